"""Running a traced program with its matmul sites quantized.

A :class:`~qbits.transform._plan.Plan` decides which sites of a
:class:`~qbits.transform._program.Program` run quantized and how; the
:class:`Runner` runs the program's jaxpr again equation by equation on the actual
arguments, with each planned site's ``dot_general``,
``conv_general_dilated`` or ``ragged_dot_general`` replaced by qbits' core
(:func:`qbits.dot_general`, :func:`qbits.conv_general_dilated`,
:func:`qbits.ops.ragged_dot`): one custom VJP whose backward matmuls are
quantized as configured. Everything else runs as JAX would run it;
bodies that hold a planned site are rebuilt (``jit`` inlined,
``scan``/``cond``/``while``/``shard_map`` re-entered, ``remat`` with its
policy).

The same runner serves every mode of the engine: quantized (training and
evaluation), initialising scale state, storing weights (serving) and
observing activations (ranges, calibration statistics); :class:`Frame` says
which.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from qbits import ops
from qbits._errors import InvalidArgumentError
from qbits._jaxpr import bind, rebind_shard_map, scan_counts, shard_map_body
from qbits._providers import max_combining
from qbits._tensor import QTensor
from qbits.numerics import next_key
from qbits.transform._adapter import adapted
from qbits.transform._observe import (
    activation_rows,
    record,
)
from qbits.transform._plan import Plan
from qbits.transform._program import Ctx, Program, float_operands
from qbits.transform._swap import swapped_call

__all__ = [
    "Frame",
    "Runner",
    "run_program",
]


@dataclasses.dataclass
class Frame:
    """What a body runs with: its key, its sites' data, what to collect.

    Modes: ``collect`` is set when the runner initialises state or stores
    weights (stateful or stored sites then record their initial state or
    stored weight there and run in float; the others run quantized, so that
    each site sees the operands training gives it); ``observed`` when it
    observes activations (each observed matmul records what the plan's
    :class:`~._observe.Observer` makes of its activation, by path, and runs
    in float).

    Keys: the sites of a frame that round stochastically take the links of
    a chain started at ``key`` (:func:`~qbits.numerics.next_key`), in the
    order they run: each link is the same computation, so XLA compiles one
    kernel for all of them (a site index in the key would make a distinct
    kernel per site). A body traced on its own (a loop, a ``cond`` branch, a
    rematerialised function) starts a chain of its own from the next link
    (:meth:`body`), so nothing traced inside it leaks into this frame.
    """

    key: Any
    states: Mapping[str, Any]
    collect: dict[str, Any] | None = None
    observed: dict[str, Any] | None = None
    last: Any = None

    def with_(self, **changes: Any) -> Frame:
        return dataclasses.replace(self, **changes)

    def next_key(self) -> Any:
        """The next link of this frame's key chain (``None`` without a key)."""
        if self.key is None:
            return None
        self.last = next_key(self.key if self.last is None else self.last)
        return self.last

    def body(self) -> Frame:
        """The frame of a body traced on its own: a chain from the next link.

        Copy it (:meth:`with_`) inside the traced function, so that each
        trace of the body starts from the same link.
        """
        return self.with_(key=self.next_key(), last=None)


class Runner:
    """Runs a program's jaxpr with the planned sites on the core."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def run(self, jaxpr: Any, consts: list[Any], args: list[Any], ctx: Ctx,
            frame: Frame) -> list[Any]:  # fmt: skip
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = c
        for v, a in zip(jaxpr.invars, args, strict=True):
            env[v] = a
        for i, eqn in enumerate(jaxpr.eqns):
            here = (*ctx, i)
            invals = [read(v) for v in eqn.invars]
            if here in self.plan.planned or here in self.plan.adapted:
                invals = float_operands(eqn, invals)
            if here in self.plan.adapted:
                outs = [self._adapted(eqn, invals, here, frame)]
            elif here in self.plan.planned:
                outs = [self._matmul(eqn, invals, here, frame)]
            elif here in self.plan.holds:
                outs = self._body(eqn, invals, here, frame)
            else:
                out = bind(eqn, invals)
                outs = out if eqn.primitive.multiple_results else [out]
            for v, val in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jax.extend.core.DropVar):
                    env[v] = val
        return [read(v) for v in jaxpr.outvars]

    def _matmul(self, eqn: Any, invals: list[Any], here: Ctx, frame: Frame) -> Any:
        planned = self.plan.planned[here]
        config, site, kind = planned.config, planned.site, planned.site.op
        call = kind.call(eqn.params, invals)
        perm = None
        if here in self.plan.swapped:  # a dot_general: the weight as its rhs
            call, perm = swapped_call(call)
        if frame.observed is not None:  # observing: the activation's rows
            info, observer = self.plan.observed[here], self.plan.observe
            rows = activation_rows(call.args[0], call.args[2], info.grouped)
            new = observer.observe(info, rows)  # type: ignore[union-attr]
            record(observer, frame.observed, site.path, new)  # type: ignore[arg-type]
            return bind(eqn, invals)
        extra: dict[str, Any] = {}
        probe_name = self.plan.probes.get(here)
        if probe_name is not None:
            if frame.collect is not None:  # initialising: the probe's zeros
                frame.collect[probe_name] = ops._init_probe()
            else:
                extra["diagnostics"] = frame.states[probe_name]
        stored_name = self.plan.stored.get(here)
        state_name = self.plan.state_keys.get(here)
        if stored_name is not None:
            out = self._stored(stored_name, config, call, frame, extra)
            if out is None:  # storing: the forward's rhs, once
                return bind(eqn, invals)
        elif state_name is not None and frame.collect is not None:
            # initialising: the state from the actual operands, float forward
            frame.collect[state_name] = kind.init_state(config, call)
            return bind(eqn, invals)
        else:
            site_key = frame.next_key() if config.needs_key else None
            if state_name is not None:
                extra["state"] = frame.states[state_name]
            out = kind.apply(config, site_key, call, **extra)
        if perm is not None:  # back to the equation's own output layout
            out = jnp.transpose(out, np.argsort(perm))
        return out

    def _stored(
        self, name: str, config: Any, call: Any, frame: Frame, extra: dict[str, Any]
    ) -> Any:
        """A weight dot_general on its stored weight (``None``: storing it)."""
        lhs, rhs, dn, precision, pet = call.args
        dims = ops.Dims.create(dn, jnp.ndim(lhs), jnp.ndim(rhs))
        if frame.collect is not None:
            frame.collect[name] = ops._store_weight(rhs, config.fwd, dims.rhs_contract)
            return None
        qt = frame.states[name]
        self._check_stored(name, qt, rhs, config, dims)
        qt = qt.replace(dtype=np.dtype(rhs.dtype))
        return ops._stored_matmul(
            lhs, qt, dims, config.fwd, precision=precision,
            preferred_element_type=pet, **call.kwargs, **extra,
        )  # fmt: skip

    def _adapted(self, eqn: Any, invals: list[Any], here: Ctx, frame: Frame) -> Any:
        """The weight matmul (float or quantized), adapted by the plan's adapter."""

        def run(lhs: Any, rhs: Any) -> Any:
            operands = [lhs, rhs, *invals[2:]]
            if here in self.plan.planned:
                return self._matmul(eqn, operands, here, frame)
            return bind(eqn, operands)

        return adapted(
            self.plan.adapter, self.plan.adapted[here], (invals[0], invals[1]),  # type: ignore[arg-type]
            eqn.params["dimension_numbers"], frame.states[self.plan.adapter_data[here]],
            frame.next_key, run,
        )  # fmt: skip

    def _check_stored(
        self, name: str, qt: Any, weight: Any, config: Any, dims: Any
    ) -> None:
        """Raises unless ``qt`` is what storing ``weight`` with this config gives."""
        want = jax.eval_shape(
            functools.partial(
                ops._store_weight, cfg=config.fwd, contracting=dims.rhs_contract
            ),
            jax.ShapeDtypeStruct(jnp.shape(weight), jnp.result_type(weight)),
        )

        def layout(q: Any) -> str:
            packed = ", packed" if q.packed_axis is not None else ""
            extra = "".join(
                f", {label} {list(np.shape(part))}"
                for label, part in (
                    ("zero point", q.zero_point),
                    ("tensor scale", q.tensor_scale),
                    ("scale absmax", q.scale_absmax),
                    ("codebook", q.codebook),
                )
                if part is not None
            )
            return (
                f"{np.dtype(q.qdtype).name}{list(q.shape)}{packed} as "
                f"{q.qvalue.dtype.name}{list(q.qvalue.shape)} with scale "
                f"{list(q.scale.shape)}{extra}"
            )

        if not isinstance(qt, QTensor):
            got = f"a {type(qt).__name__}"
        elif layout(qt) == layout(want) and qt.scale.dtype == want.scale.dtype:
            return
        else:
            got = layout(qt)
        raise InvalidArgumentError(
            self.plan.caller.owner,
            f"stored[{name!r}]",
            got,
            f"{layout(want)}, the weight stored for its config "
            f"({self.plan.rules.resolve(name).name or 'inline'})",
            why="stored with another config or for another model? Store them "
            "again with qbits.serving.convert and this config",
        )

    def _body(self, eqn: Any, invals: list[Any], here: Ctx, frame: Frame) -> list:
        name, p = eqn.primitive.name, eqn.params
        run = self.run
        if name in ("jit", "pjit", "closed_call", "core_call"):
            closed = p["jaxpr"]
            return run(closed.jaxpr, closed.consts, invals, here, frame)
        if name in ("remat2", "checkpoint"):
            if frame.collect is not None or frame.observed is not None:
                return run(p["jaxpr"], [], invals, here, frame)  # nothing to save
            base = frame.body()
            fn = jax.checkpoint(
                lambda *a: run(p["jaxpr"], [], list(a), here, base.with_()),
                prevent_cse=p["prevent_cse"],
                policy=p["policy"],
            )
            return fn(*invals)
        if name == "cond":
            base = frame.body()
            # Records cannot leave a branch: a cond's matmuls record none.
            inner = base.with_(observed=None)
            branches = [
                functools.partial(
                    lambda j, b, *a: run(b.jaxpr, b.consts, list(a), (*here, j),
                                         inner.with_()), j, b,
                )
                for j, b in enumerate(p["branches"])
            ]  # fmt: skip
            return list(lax.switch(invals[0], branches, *invals[1:]))
        if name == "scan":
            return self._scan(eqn, invals, here, frame)
        if name == "while":
            return self._while(eqn, invals, here, frame)
        if name == "shard_map":
            return self._shard_map(eqn, invals, here, frame)
        raise NotImplementedError(name)  # pragma: no cover - _program lists no others

    def _shard_map(self, eqn: Any, invals: list[Any], here: Ctx, frame: Frame) -> list:
        """A ``shard_map`` body re-run, its sites' scale state crossing it.

        Nothing else per site crosses the body (the plan keeps stored
        weights, adapters, probes and records out of it); its keys are a
        chain of their own, the shard's index folded in by the core. Scale
        state (per-tensor delayed scaling, the same on every shard: see the
        plan) enters replicated and its new value leaves as its gradient,
        each shard's amax maxed over the shards by the core; initialising,
        the states made in the body leave replicated.
        """
        p = eqn.params
        body, consts = shard_map_body(p)
        run = self.run
        names = [n for n in self.plan.names_under(here)
                 if n in self.plan.state_keys.values()]  # fmt: skip
        base = frame.body()
        if not names:
            inner = base.with_(collect=None, observed=None)
            return rebind_shard_map(
                p, lambda *a: run(body, consts, list(a), here, inner.with_()), invals
            )
        collecting = frame.collect is not None
        given = {} if collecting else {n: frame.states[n] for n in names}

        def fn(args: tuple[Any, ...], given: dict[str, Any]) -> Any:
            inner = base.with_(
                states={**frame.states, **given},
                collect={} if collecting else None,
                observed=None,
            )
            outs = tuple(run(body, consts, list(args), here, inner))
            made = {n: inner.collect[n] for n in names} if collecting else {}
            return outs, made

        mapped = jax.shard_map(
            fn,
            mesh=p["mesh"],
            in_specs=(tuple(p["in_specs"]), P()),
            out_specs=(tuple(p["out_specs"]), P()),
            axis_names=p["newly_manual_axes"],
            check_vma=p["check_vma"],
        )
        outs, made = mapped(tuple(invals), given)
        if collecting:
            frame.collect.update(made)  # type: ignore[union-attr]
        return list(outs)

    def _scan(self, eqn: Any, invals: list[Any], here: Ctx, frame: Frame) -> list:
        p = eqn.params
        n_consts, n_carry = scan_counts(p)
        consts = invals[:n_consts]
        init = invals[n_consts : n_consts + n_carry]
        xs = invals[n_consts + n_carry :]
        body = p["jaxpr"]
        length = int(p["length"])
        # The data of the sites inside is stacked along the scan: one slice
        # per iteration (per layer, for a scan over stacked layers).
        names = self.plan.names_under(here)
        sliced = self.plan.sliced
        shared = {n for n in names if n in sliced and here not in sliced[n]}
        collecting = frame.collect is not None
        observing = frame.observed is not None
        stacked = (
            {}
            if collecting or observing
            else {n: frame.states[n] for n in names if n not in shared}
        )
        states = dict(frame.states)
        if not (collecting or observing):
            for n in shared & set(self.plan.replaced):  # one state, every step
                states[n] = self._combining(n, states[n])

        base = frame.body()

        def step(carry: list[Any], x: tuple[Any, list[Any], dict]) -> Any:
            it, x_slice, state_slice = x
            key = _iteration_key(base.key, it)
            inner = base.with_(
                key=key,
                states={**states, **state_slice},
                collect={} if collecting else None,
                observed={} if observing else None,
            )
            out = self.run(body.jaxpr, body.consts, [*consts, *carry, *x_slice],
                           here, inner)  # fmt: skip
            found = (inner.collect or {}, inner.observed or {})
            return out[:n_carry], (out[n_carry:], found)

        iters = lax.iota("int32", length)
        carry, (ys, (new, records)) = lax.scan(
            step, list(init), (iters, list(xs), stacked), length=length,
            reverse=p["reverse"], unroll=p["unroll"],
        )  # fmt: skip
        if collecting:  # a shared weight: every iteration stored the same
            frame.collect.update(  # type: ignore[union-attr]
                {n: jax.tree.map(lambda a: a[0], v) if n in shared else v
                 for n, v in new.items()}
            )  # fmt: skip
        if observing:  # one record per layer, or the iterations' merged
            observer = self.plan.observe
            for n, v in records.items():
                if not (observer.per_layer and here in sliced[n]):  # type: ignore[union-attr]
                    v = observer.merge_steps(v)  # type: ignore[union-attr]
                record(observer, frame.observed, n, v)  # type: ignore[arg-type]
        return list(carry) + list(ys)

    def _combining(self, name: str, state: dict[str, Any]) -> dict[str, Any]:
        """A state used by every iteration of a loop, its uses combining by max.

        Converted once, outside the loop (:func:`qbits.DelayedScaling.max_combining`):
        every iteration computes the same new scale and history but for the
        newest amax, whose max over the iterations is the loop's.
        """
        replaced = self.plan.replaced[name]
        return {k: max_combining(v) if k in replaced else v for k, v in state.items()}

    def _while(self, eqn: Any, invals: list[Any], here: Ctx, frame: Frame) -> list:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = invals[:nc], invals[nc : nc + nb]
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]

        def cond_fn(c: tuple[Any, list[Any]]) -> Any:
            return bind_closed(cond, [*cond_consts, *c[1]])[0]

        base = frame.body().with_(observed=None)  # records cannot leave the loop

        def body_fn(c: tuple[Any, list[Any]]) -> Any:
            it, carry = c
            inner = base.with_(key=_iteration_key(base.key, it))
            out = self.run(body.jaxpr, body.consts, [*body_consts, *carry], here,
                           inner)  # fmt: skip
            return it + 1, out

        _, out = lax.while_loop(
            cond_fn, body_fn, (jax.numpy.int32(0), invals[nc + nb :])
        )
        return list(out)


def _iteration_key(key: Any, iteration: Any) -> Any:
    """The key stream of one loop iteration (``None`` stays ``None``)."""
    return None if key is None else jax.random.fold_in(key, iteration)


def bind_closed(closed: Any, args: list[Any]) -> list[Any]:
    """Evaluates a ClosedJaxpr as JAX would."""
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def run_program(
    program: Program, plan: Plan, frame: Frame, args: Any, kwargs: Any
) -> list[Any]:
    """Runs ``program`` on the leaves of ``(args, kwargs)`` as ``plan`` says."""
    leaves = jax.tree.leaves((args, kwargs))
    dyn = [x for x, d in zip(leaves, program.dynamic, strict=True) if d]
    closed = program.closed
    return Runner(plan).run(closed.jaxpr, closed.consts, dyn, (), frame)
