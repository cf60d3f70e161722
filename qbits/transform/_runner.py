"""Running a traced program with its matmul sites quantized.

A :class:`Plan` decides, from the rules, which sites of a
:class:`~qbits.transform._program.Program` run quantized, with which
config, key stream, scale state or stored weight. The :class:`Runner` then
runs the program's jaxpr again equation by equation on the actual
arguments, with each planned site's ``dot_general``,
``conv_general_dilated`` or ``ragged_dot_general`` replaced by qbits' core
(:func:`qbits.dot_general`, :func:`qbits.conv_general_dilated`,
:func:`qbits.ops.ragged_dot`): one custom VJP whose backward matmuls are
quantized as configured. Everything else runs as JAX would run it;
bodies that hold a planned site are rebuilt (``jit`` inlined,
``scan``/``cond``/``while`` re-entered, ``remat`` with its policy).

The same runner serves every mode of the engine: quantized (training and
evaluation), initialising scale state, storing weights (serving) and
observing activations (ranges, calibration statistics); :class:`Frame` says
which.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits import ops
from qbits._errors import ConfigError, InvalidArgumentError
from qbits._jaxpr import bind, scan_counts
from qbits.config import QuantConfig, Resolution
from qbits.numerics import NoNumerics, next_key
from qbits.ops import DotGeneralConfig
from qbits.tensor import QTensor
from qbits.transform._adapter import DATA, Adapter, adapter_input, adapter_output
from qbits.transform._checks import (
    check_conv_operands,
    check_operands,
    check_ragged_operands,
)
from qbits.transform._observe import (
    ObservedMatmul,
    Observer,
    activation_rows,
    describe,
    record,
)
from qbits.transform._program import RAGGED_DOT, Ctx, Program, Site, float_operands
from qbits.transform._swap import permuted_sharding, swapped

__all__ = [
    "DIAGNOSTICS",
    "Caller",
    "Frame",
    "Plan",
    "Runner",
    "applied",
    "run_program",
]

# The prefix of a probe's name among a run's per-site data (as the adapter
# data's, :data:`~._adapter.DATA`).
DIAGNOSTICS = "/diagnostics/"


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who runs the engine, as errors name it.

    Every entry point (``qbits.quantize``, the linen and nnx adapters,
    serving) runs the same engine; its errors name the entry point and the
    argument as the user wrote it (``rngs['quant']`` rather than ``key``).

    Attributes:
      owner: The entry point, e.g. ``"qbits.quantize"``.
      key: How the PRNG key for stochastic rounding is passed.
      state: How the scale state is passed.
      state_fix: How to make the state, for the error that misses it.
      whole: Whether the function runs the whole model, so that a rule that
        matches no matmul, or a config that quantizes nothing, is worth a
        warning (a method that runs part of a model is not; nor is an entry
        point's second trace of the same call: it warns once).
    """

    owner: str = "qbits.quantize"
    key: str = "key"
    state: str = "state"
    state_fix: str = "qbits.init_state(fn, config, *args) makes it"
    whole: bool = True

    def check_inputs(
        self, method: Callable[..., Any], args: Any, kwargs: Any, call: str
    ) -> None:
        """Raises unless ``method`` takes ``(*args, **kwargs)``, naming the fix.

        For the entry points that trace a model on sample inputs: a model
        called without them (or with others) fails deep inside the engine
        with the model's own ``TypeError``; this names the inputs instead.

        Args:
          method: The model's method, bound (its signature is checked).
          args: The sample inputs given.
          kwargs: The keyword inputs given.
          call: The call to make, with ``{inputs}`` where the inputs go.

        Raises:
          InvalidArgumentError: Naming the missing (or extra) inputs and
            the call to make.
        """
        try:
            signature = inspect.signature(method)
            signature.bind(*args, **kwargs)
            return
        except ValueError:  # no signature to check (a builtin)
            return
        except TypeError as e:
            problem = str(e)
        required = [
            p.name
            for p in signature.parameters.values()
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        given = f"{len(args)} positional input{'s' * (len(args) != 1)}"
        name = getattr(method, "__qualname__", "the model's call")
        raise InvalidArgumentError(
            self.owner,
            "*args",
            f"{given} and keywords {sorted(kwargs)}" if kwargs else given,
            f"the sample inputs of {name}{signature} (arrays or "
            f"jax.ShapeDtypeStruct s): {call.format(inputs=', '.join(required))}",
            why=problem,
        )


@dataclasses.dataclass(frozen=True)
class Planned:
    """One site that runs through the core: its config and where it came from."""

    site: Site
    config: Any
    resolution: Resolution


class Plan:
    """Which sites run quantized, with which config, key stream and state.

    Args:
      program: The traced function.
      rules: The per-layer rules.
      caller: Named in errors.
      store: Serving: weight matmuls whose forward quantizes the weight run
        on a stored (already quantized) weight, forward only.
      observe: Observing activations: the weight ``dot_general`` s that
        the rules give a quantizing config (all of them with ``every``),
        outside ``cond`` and ``while`` bodies (what they record could not
        leave the body), run in float and hand their activation to it.
      every: With ``observe``: observe every weight matmul.
      adapter: Adapting weight matmuls: what the ones in ``adapted`` add
        to their output (their data: ``frame.states[DATA + path]``).
      adapted: The paths of the weight ``dot_general`` s to adapt (the
        caller checks that they are such matmuls, outside ``cond`` and
        ``while`` bodies).
      diagnose: Every quantized site measures its quantized operands: its
        probe (:func:`qbits.ops.init_probe`) is ``frame.states[DIAGNOSTICS
        + path]``, sliced per layer along a scan over stacked layers.

    Raises:
      ConfigError: For a rule that gives an integer matmul a config, or (with
        ``store``) a stored weight matmul that rounds stochastically or keeps
        scale state.
      InvalidArgumentError: For scale state inside a ``cond`` or ``while``
        body.
    """

    def __init__(
        self,
        program: Program,
        rules: QuantConfig,
        caller: Caller,
        *,
        store: bool = False,
        observe: Observer | None = None,
        every: bool = False,
        adapter: Adapter | None = None,
        adapted: Collection[str] = (),
        diagnose: bool = False,
    ):
        self.rules = rules
        self.caller = caller
        self.planned: dict[Ctx, Planned] = {}
        # Sites with per-site data (scale state or a stored weight): its name.
        self.state_keys: dict[Ctx, str] = {}
        self.stored: dict[Ctx, str] = {}
        # The data of a weight matmul is stacked along the scans that slice
        # its weight (stacked layers), and shared by the iterations of the
        # others (a loop over micro-batches, one weight); that of an
        # activation matmul is stacked along every scan around it.
        self.sliced: dict[str, frozenset[Ctx]] = {}
        # The state entries that are replaced (not trained), per site: shared
        # along a loop, their uses combine with max.
        self.replaced: dict[str, tuple[str, ...]] = {}
        # dot_general sites whose weight is the lhs operand: run with the
        # operands swapped so that the weight gets the config's rhs side.
        self.swapped: set[Ctx] = set()
        self.observe = observe
        self.observed: dict[Ctx, ObservedMatmul] = {}
        self.holds: set[Ctx] = set()  # bodies holding a planned site
        self.needs_key: list[str] = []
        # Adapted weight matmuls: how the adapter sees each, its data's name.
        self.adapter = adapter
        self.adapted: dict[Ctx, ObservedMatmul] = {}
        self.adapter_data: dict[Ctx, str] = {}
        # Diagnosed sites: their probe's name.
        self.probes: dict[Ctx, str] = {}
        for site in program.sites:
            if site.path in adapted:
                self._adapt(site, program)
            res = rules.resolve(site.path)
            if site.integer and not site.frozen:
                self._check_integer(site, res)
            if site.kept:
                continue
            config = applied(site, res.config)
            if observe is not None:
                chosen = every or not (config is None or config.is_identity)
                weight = site.weights and site.primitive == "dot_general"
                if chosen and weight and not site.control:
                    self._add(site, None, res)
                    flip = site.ctx in self.swapped
                    self.observed[site.ctx] = describe(site, program, flip)
                    self.sliced[site.path] = next(iter(site.weights)).sliced
                continue
            if config is None or config.is_identity:
                continue
            # A weight in a cond or while body is quantized on the fly: the
            # stored copy could not leave the body (like scale state).
            if store and _stores(config, site) and not site.control:
                if config.needs_state or config.fwd.needs_key:
                    what = ("rounds stochastically" if config.fwd.needs_key
                            else "takes its scales from state")  # fmt: skip
                    raise ConfigError(
                        f"{res.where}.fwd",
                        f"a forward matmul that {what}",
                        "a forward matmul that computes its scales and rounds "
                        "to nearest (serving is deterministic and stateless)",
                        why=f"matmul {site.path!r}, in {caller.owner}",
                        source=rules.source,
                    )
                self.stored[site.ctx] = site.path
                self.sliced[site.path] = next(iter(site.weights)).sliced
            elif config.needs_state:
                if site.control:
                    raise InvalidArgumentError(
                        caller.owner,
                        "config",
                        f"the config of {site.path!r}",
                        "a config without scale state for a matmul inside a "
                        f"{site.control} body, or qbits.Rule({site.base!r}, None)",
                        why="scale state cannot be carried through "
                        f"{site.control} (an untaken branch or a repeated "
                        "iteration would overwrite it)",
                    )
                self.state_keys[site.ctx] = site.path
                if site.weights:
                    self.sliced[site.path] = next(iter(site.weights)).sliced
                kinds = config.state_kinds()
                self.replaced[site.path] = tuple(
                    k for k, v in kinds.items() if v == "replaced"
                )
            self._add(site, config, res)
            if config.needs_key:
                self.needs_key.append(site.path)
            if diagnose and site.ctx not in self.stored:
                self._diagnose(site)
        if observe is None and adapter is None and caller.whole and not self.planned:
            _warn_if_nothing(program, rules, caller)

    def _add(self, site: Site, config: Any, res: Resolution) -> None:
        self.planned[site.ctx] = Planned(site, config, res)
        weight_left = site.lhs and not site.rhs
        if site.primitive == "dot_general" and (weight_left or site.flipped):
            self.swapped.add(site.ctx)
        for n in range(1, len(site.ctx)):
            self.holds.add(site.ctx[:n])
        if config is not None:
            self._check_fits(site, config, res)

    def _diagnose(self, site: Site) -> None:
        name = self.probes[site.ctx] = DIAGNOSTICS + site.path
        if site.weights:
            self.sliced[name] = next(iter(site.weights)).sliced
        # Shared along a loop, the maxima of its uses combine with max.
        self.replaced[name] = ("maxima",)

    def _adapt(self, site: Site, program: Program) -> None:
        weight_left = bool(site.lhs and not site.rhs)
        self.adapted[site.ctx] = describe(site, program, weight_left)
        name = self.adapter_data[site.ctx] = DATA + site.path
        self.sliced[name] = next(iter(site.weights)).sliced
        for n in range(1, len(site.ctx)):
            self.holds.add(site.ctx[:n])

    def _check_fits(self, site: Site, config: Any, res: Resolution) -> None:
        """Raises a ConfigError naming the rule and the matmul for a misfit."""
        eqn, p = site.eqn, site.eqn.params
        lhs, rhs = (
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars[:2]
        )
        where, source = res.where, self.rules.source
        if site.primitive == "dot_general":
            dn = p["dimension_numbers"]
            if site.ctx in self.swapped:
                lhs, rhs, dn, _, _ = swapped(lhs, rhs, dn, None)
            check_operands(
                config, lhs.shape, rhs.shape, dn, where, layer=site.path, source=source
            )
        elif site.primitive == "ragged_dot":
            dn = p.get("ragged_dot_dimension_numbers", RAGGED_DOT)
            check_ragged_operands(
                config, lhs.shape, rhs.shape, dn, where, layer=site.path, source=source
            )
        else:
            check_conv_operands(
                config, lhs, rhs, p["window_strides"], p["padding"],
                p["lhs_dilation"], p["rhs_dilation"], p["dimension_numbers"],
                p["feature_group_count"], p["batch_group_count"],
                where=where, layer=site.path, source=source,
            )  # fmt: skip

    def _check_integer(self, site: Site, res: Resolution) -> None:
        """An integer matmul stays exact; only a rule's ``null`` may name it."""
        if res.rule is None or res.config is None or res.config.is_identity:
            return
        raise ConfigError(
            res.where,
            res.name or "a quantizing config",
            f"null for matmul {site.path!r} (its operands are "
            f"{site.operands}: integer matmuls are exact and stay as lax "
            "computes them)",
            why=f"rules[{res.rule}] (pattern {self.rules.rules[res.rule].pattern!r}) "
            "matches it",
            source=self.rules.source,
            layer=site.path,
        )

    def names_under(self, ctx: Ctx) -> list[str]:
        """The data names (state, stored weights, adapters) of sites in ``ctx``."""
        named = [*self.state_keys.items(), *self.stored.items(),
                 *self.adapter_data.items(), *self.probes.items()]  # fmt: skip
        return [
            name
            for site, name in named
            if len(site) > len(ctx) and site[: len(ctx)] == ctx
        ]


def _warn_if_nothing(program: Program, rules: QuantConfig, caller: Caller) -> None:
    """Warns that ``rules`` quantize nothing in ``program``, saying why.

    Silent when the rules quantize nothing anywhere (every config float or
    the identity: float on purpose).
    """
    if all(c.is_identity for c in rules.all_configs()):
        return
    if not program.sites:
        why = (
            "the function runs no matmul (no dot_general, einsum, @, "
            "convolution or ragged dot in its jaxpr)"
        )
    else:
        reasons = {}
        for site in program.sites:
            res = rules.resolve(site.path)
            if site.kept:
                reasons[site.path] = f"kept: {site.kept}"
            elif res.config is None:
                reasons[site.path] = f"{res.where}: null"
            elif applied(site, res.config) is None:
                reasons[site.path] = "weight-only config, no weight"
            else:
                reasons[site.path] = f"{res.where}: {res.name or 'an identity config'}"
        shown = [f"{path!r} ({why})" for path, why in list(reasons.items())[:4]]
        more = f" and {len(reasons) - 4} more" if len(reasons) > 4 else ""
        why = f"every matmul runs float: {', '.join(shown)}{more}"
    warnings.warn(
        f"{caller.owner}: the config {_name(rules)} quantizes nothing: {why}. "
        "qbits.layer_table lists the matmuls and the config each one gets",
        UserWarning,
        stacklevel=_outside(),
    )


_INSIDE = tuple(
    os.path.dirname(path) + os.sep
    for path in (os.path.dirname(__file__), jax.__file__, flax.__file__)
)


def _outside() -> int:
    """The ``stacklevel`` of the first caller outside qbits, jax and flax."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level


def _name(rules: QuantConfig) -> str:
    """How a warning names the rules: their file, preset name or shape."""
    if rules.source:
        return repr(rules.source)
    if not rules.rules:
        return repr(rules.default) if isinstance(rules.default, str) else "(inline)"
    default = rules.default
    shown = repr(default) if isinstance(default, str | None) else "inline"
    return f"(rules {[r.pattern for r in rules.rules]}, default {shown})"


def applied(site: Site, config: DotGeneralConfig | None) -> DotGeneralConfig | None:
    """The config ``site`` runs with, its rule's config being ``config``.

    A matmul without a weight operand (two activations) runs
    :meth:`~qbits.DotGeneralConfig.for_activations` of it (float for a
    weight-only config); the others run it as it is. Every entry point
    (quantize, layer table, state, serving, statistics) plans with this.
    """
    if config is None or site.weights:
        return config
    return config.for_activations()


def _stores(config: Any, site: Site) -> bool:
    """Whether serving stores this site's weight (a quantized weight operand)."""
    if site.primitive != "dot_general" or not site.weights:
        return False
    return not isinstance(config.fwd.rhs.numerics, NoNumerics)


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
            invals = given = [read(v) for v in eqn.invars]
            if here in self.plan.planned or here in self.plan.adapted:
                invals = given = float_operands(eqn, invals)
            adapter = self.plan.adapter if here in self.plan.adapted else None
            if adapter is not None and adapter.before is not None:
                invals = self._before(eqn, invals, here, frame)
            if here in self.plan.planned:
                outs = [self._matmul(eqn, invals, here, frame)]
            elif here in self.plan.holds:
                outs = self._body(eqn, invals, here, frame)
            else:
                out = bind(eqn, invals)
                outs = out if eqn.primitive.multiple_results else [out]
            if adapter is not None and adapter.apply is not None:
                outs = [self._adapted(eqn, given, here, frame, outs[0])]
            for v, val in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jax.extend.core.DropVar):
                    env[v] = val
        return [read(v) for v in jaxpr.outvars]

    def _matmul(self, eqn: Any, invals: list[Any], here: Ctx, frame: Frame) -> Any:
        planned = self.plan.planned[here]
        config, site = planned.config, planned.site
        p = dict(eqn.params)
        kwargs: dict[str, Any] = {}
        swap = here in self.plan.swapped
        if eqn.primitive.name == "dot_general":
            make = ops.dot_general
            lhs, rhs = invals[0], invals[1]
            dn, precision = p["dimension_numbers"], p.get("precision")
            out_sharding = p.get("out_sharding")
            if swap:
                lhs, rhs, dn, precision, perm = swapped(lhs, rhs, dn, precision)
                out_sharding = permuted_sharding(out_sharding, perm)
            args = (lhs, rhs, dn, precision, p.get("preferred_element_type"))
            if out_sharding is not None:
                kwargs["out_sharding"] = out_sharding
        elif site.primitive == "ragged_dot":

            def make(config: Any, key: Any = None) -> Any:
                return ops.ragged_dot(config, key).general

            dn = p.get("ragged_dot_dimension_numbers", RAGGED_DOT)
            pet = p.get("preferred_element_type")
            args = (*invals[:3], dn, p.get("precision"), pet)
            if p.get("out_sharding") is not None:
                kwargs["out_sharding"] = p["out_sharding"]
        else:
            make = ops.conv_general_dilated
            args = (
                invals[0], invals[1], p["window_strides"], p["padding"],
                p["lhs_dilation"], p["rhs_dilation"], p["dimension_numbers"],
                p["feature_group_count"], p["batch_group_count"], p.get("precision"),
                p.get("preferred_element_type"),
            )  # fmt: skip
        if frame.observed is not None:  # observing: the activation's rows
            info, observer = self.plan.observed[here], self.plan.observe
            rows = activation_rows(args[0], args[2], info.grouped)
            new = observer.observe(info, rows)  # type: ignore[union-attr]
            record(observer, frame.observed, site.path, new)  # type: ignore[arg-type]
            return bind(eqn, invals)
        stored_name = self.plan.stored.get(here)
        state_name = self.plan.state_keys.get(here)
        probe_name = self.plan.probes.get(here)
        if probe_name is not None:
            if frame.collect is not None:  # initialising: the probe's zeros
                frame.collect[probe_name] = ops.init_probe()
            else:
                kwargs["diagnostics"] = frame.states[probe_name]
        if stored_name is not None:
            dims = ops.Dims.create(args[2], jnp.ndim(args[0]), jnp.ndim(args[1]))
            if frame.collect is not None:  # storing: the forward's rhs, once
                frame.collect[stored_name] = ops.store_weight(
                    args[1], config.fwd, dims.rhs_contract
                )
                return bind(eqn, invals)
            qt = frame.states[stored_name]
            self._check_stored(stored_name, qt, args[1], config, dims)
            qt = qt.replace(dtype=np.dtype(args[1].dtype))
            out = ops.stored_matmul(
                args[0], qt, dims, config.fwd, precision=args[3],
                preferred_element_type=args[4], **kwargs,
            )  # fmt: skip
        elif state_name is not None and frame.collect is not None:
            # initialising: the state from the actual operands, float forward
            if site.primitive == "ragged_dot":
                init = ops.ragged_dot(config).init_state
            else:
                init = make(config).init_state
            n = 5 if make is ops.dot_general else len(args)  # without out_sharding
            frame.collect[state_name] = init(*args[:n])
            return bind(eqn, invals)
        else:
            site_key = frame.next_key() if config.needs_key else None
            if state_name is not None:
                kwargs["state"] = frame.states[state_name]
            out = make(config, site_key)(*args, **kwargs)
        if swap:  # back to the equation's own output layout
            out = jnp.transpose(out, np.argsort(perm))
        return out

    def _before(
        self, eqn: Any, invals: list[Any], here: Ctx, frame: Frame
    ) -> list[Any]:
        """The operands with the activation as the plan's adapter transforms it."""
        lhs, rhs = adapter_input(
            self.plan.adapter, self.plan.adapted[here], invals[0], invals[1],  # type: ignore[arg-type]
            eqn.params["dimension_numbers"], frame.states[self.plan.adapter_data[here]],
        )  # fmt: skip
        return [lhs, rhs, *invals[2:]]

    def _adapted(
        self, eqn: Any, invals: list[Any], here: Ctx, frame: Frame, out: Any
    ) -> Any:
        """``out`` plus what the plan's adapter adds to this weight matmul."""
        adapter = self.plan.adapter
        key = frame.next_key() if adapter.needs_key else None  # type: ignore[union-attr]
        data = frame.states[self.plan.adapter_data[here]]
        added = adapter_output(
            adapter, self.plan.adapted[here], invals[0], invals[1],  # type: ignore[arg-type]
            eqn.params["dimension_numbers"], data, key,
        )  # fmt: skip
        return out + added.astype(out.dtype)

    def _check_stored(
        self, name: str, qt: Any, weight: Any, config: Any, dims: Any
    ) -> None:
        """Raises unless ``qt`` is what storing ``weight`` with this config gives."""
        want = jax.eval_shape(
            functools.partial(
                ops.store_weight, cfg=config.fwd, contracting=dims.rhs_contract
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
        elif layout(qt) == layout(want) and jnp.issubdtype(qt.scale.dtype, np.floating):
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
        raise NotImplementedError(name)  # pragma: no cover - _program lists no others

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

        Converted once, outside the loop (:func:`qbits.ops.max_combining`):
        every iteration computes the same new scale and history but for the
        newest amax, whose max over the iterations is the loop's.
        """
        replaced = self.plan.replaced[name]
        return {
            k: ops.max_combining(v) if k in replaced else v for k, v in state.items()
        }

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
