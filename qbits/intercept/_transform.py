"""``qbits.quantize``: every matmul of a function, quantized by rules.

The function is traced to a jaxpr (:mod:`qbits.intercept._program`), each
matmul site gets the config its rule resolves to, and the jaxpr is run
again equation by equation on the actual arguments, with each quantized
site's ``dot_general`` or ``conv_general_dilated`` replaced by qbits' core
(:func:`qbits.dot_general`, :func:`qbits.conv_general_dilated`): one custom
VJP whose backward matmuls are quantized as configured. Everything else
runs as JAX would run it; bodies that hold a quantized site are rebuilt
(``jit`` inlined, ``scan``/``cond``/``while`` re-entered, ``remat`` with its
policy). Nothing global is changed: a function traced before or after,
float or quantized, keeps its own numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits import ops
from qbits._errors import ConfigError, InvalidArgumentError
from qbits._jaxpr import bind, scan_counts
from qbits.config import LayerRow, LayerTable, QuantConfig, as_quant_config
from qbits.intercept._program import Ctx, Program, trace
from qbits.numerics import NoNumerics, next_key
from qbits.tensor import QTensor

__all__ = ["init_state", "layer_table", "quantize"]

_OWNER = "qbits.quantize"


class _Plan:
    """Which sites run quantized, with which config, key stream and state."""

    def __init__(
        self, program: Program, rules: QuantConfig, owner: str, store: bool = False
    ):
        self.configs: dict[Ctx, tuple[Any, int]] = {}
        # Sites with per-site data (scale state or a stored weight): its name.
        self.slots: dict[Ctx, str] = {}
        self.state_keys: dict[Ctx, str] = {}  # sites with scale state
        # ``store``: weight matmuls whose forward quantizes the weight run on
        # a stored (already quantized) weight, forward only (serving).
        self.stored: dict[Ctx, str] = {}
        # A stored weight is stacked along the scans that slice it (stacked
        # layers), and shared by the iterations of the others (a loop).
        self.sliced: dict[str, frozenset[Ctx]] = {}
        # dot_general sites whose weight is the lhs operand: run with the
        # operands swapped so that the weight gets the config's rhs side.
        self.swapped: set[Ctx] = set()
        self.holds: set[Ctx] = set()  # bodies holding a quantized site
        self.needs_key: list[str] = []
        for index, site in enumerate(program.sites):
            config = rules.resolve(site.path).config
            if config is None or site.frozen or config.is_identity:
                continue
            # A weight in a cond or while body is quantized on the fly: the
            # stored copy could not leave the body (like scale state).
            if store and _stores(config, site) and not site.control:
                if ops.needs_state(config) or config.fwd.needs_key:
                    what = ("rounds stochastically" if config.fwd.needs_key
                            else "takes its scales from state")  # fmt: skip
                    raise ConfigError(
                        f"{rules.resolve(site.path).where}.fwd",
                        f"a forward matmul that {what}",
                        "a forward matmul that computes its scales and rounds "
                        "to nearest (serving is deterministic and stateless)",
                        why=f"matmul {site.path!r}, in {owner}",
                    )
                self.stored[site.ctx] = name = self._name(site)
                self.sliced[name] = next(iter(site.weights)).sliced
            elif ops.needs_state(config):
                if site.control:
                    raise InvalidArgumentError(
                        owner,
                        "config",
                        f"the config of {site.path!r}",
                        "a config without scale state for a matmul inside a "
                        f"{site.control} body, or qbits.Rule({site.path!r}, None)",
                        why="scale state cannot be carried through "
                        f"{site.control} (an untaken branch or a repeated "
                        "iteration would overwrite it)",
                    )
                self.state_keys[site.ctx] = self._name(site)
            self.configs[site.ctx] = (config, index)
            weight_left = site.lhs and not site.rhs
            if site.primitive == "dot_general" and (weight_left or site.flipped):
                self.swapped.add(site.ctx)
            if config.needs_key:
                self.needs_key.append(site.path)
            for n in range(1, len(site.ctx)):
                self.holds.add(site.ctx[:n])

    def _name(self, site: Any) -> str:
        """A unique name for a site's data: its path, then ``path#2``..."""
        name, n = site.path, 1
        while name in self.slots.values():
            n += 1
            name = f"{site.path}#{n}"
        self.slots[site.ctx] = name
        return name

    def slots_under(self, ctx: Ctx) -> list[str]:
        """The data names of the sites inside the body at ``ctx``."""
        return [
            name
            for site, name in self.slots.items()
            if len(site) > len(ctx) and site[: len(ctx)] == ctx
        ]


def _stores(config: Any, site: Any) -> bool:
    """Whether serving stores this site's weight (a quantized weight operand)."""
    if site.primitive != "dot_general" or not site.weights:
        return False
    return not isinstance(config.fwd.rhs.numerics, NoNumerics)


def _table(program: Program, rules: QuantConfig) -> LayerTable:
    rows: list[LayerRow] = []
    seen: set[tuple[str, str, str]] = set()
    for site in program.sites:
        stack = "".join(f", scanned x{n}" for n in site.loops)
        kind = (
            site.kind
            + stack
            + (f", inside {site.frozen} (kept)" if site.frozen else "")
        )
        key = (site.path, kind, site.operands)
        if key in seen:
            continue
        seen.add(key)
        resolution = rules.resolve(site.path)
        explicit = bool(site.frozen)
        rows.append(LayerRow(site.path, kind, resolution, explicit, site.operands))
    used = {row.resolution.rule for row in rows if not row.explicit}
    unused = tuple(i for i in range(len(rules.rules)) if i not in used)
    idle = {
        i: tuple(p for p in program.param_paths if rules.rules[i].matches(p))
        for i in unused
    }
    return LayerTable(
        rows,
        unused,
        tuple(r.pattern for r in rules.rules),
        idle={i: p for i, p in idle.items() if p},
    )


@dataclasses.dataclass
class _Frame:
    """What a body runs with: its key, its sites' state, where to put new state.

    ``collect`` is set when the runner initialises state (:func:`init_state`):
    stateful sites then record their initial state there and run in float.

    Keys: the sites of a frame that round stochastically take the links of
    a chain started at ``key`` (:func:`~qbits.numerics.next_key`), in the
    order they run: each link is the same computation, so XLA compiles one
    kernel for all of them (a site index in the key would make a distinct
    kernel per site). A body traced on its own (a loop, a ``cond`` branch, a
    rematerialised function) starts a chain of its own from the next link
    (:meth:`body`), so nothing traced inside it leaks into this frame.
    """

    key: Any
    states: dict[str, Any]
    collect: dict[str, Any] | None = None
    last: Any = None

    def with_(self, **changes: Any) -> _Frame:
        return dataclasses.replace(self, **changes)

    def next_key(self) -> Any:
        """The next link of this frame's key chain (``None`` without a key)."""
        if self.key is None:
            return None
        self.last = next_key(self.key if self.last is None else self.last)
        return self.last

    def body(self) -> _Frame:
        """The frame of a body traced on its own: a chain from the next link.

        Copy it (:meth:`with_`) inside the traced function, so that each
        trace of the body starts from the same link.
        """
        return self.with_(key=self.next_key(), last=None)


class _Runner:
    """Runs a program's jaxpr with the planned sites quantized."""

    def __init__(self, plan: _Plan):
        self.plan = plan

    def run(self, jaxpr: Any, consts: list[Any], args: list[Any], ctx: Ctx,
            frame: _Frame) -> list[Any]:  # fmt: skip
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
            if here in self.plan.configs:
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

    def _matmul(self, eqn: Any, invals: list[Any], here: Ctx, frame: _Frame) -> Any:
        config, _ = self.plan.configs[here]
        site_key = frame.next_key() if config.needs_key else None
        p = dict(eqn.params)
        kwargs: dict[str, Any] = {}
        swap = here in self.plan.swapped
        if eqn.primitive.name == "dot_general":
            make = ops.dot_general
            lhs, rhs = invals[0], invals[1]
            dn, precision = p["dimension_numbers"], p.get("precision")
            out_sharding = p.get("out_sharding")
            if swap:
                lhs, rhs, dn, precision, perm = _swapped(lhs, rhs, dn, precision)
                out_sharding = _permuted_sharding(out_sharding, perm)
            args = (lhs, rhs, dn, precision, p.get("preferred_element_type"))
            if out_sharding is not None:
                kwargs["out_sharding"] = out_sharding
        else:
            make = ops.conv_general_dilated
            args = (
                invals[0], invals[1], p["window_strides"], p["padding"],
                p["lhs_dilation"], p["rhs_dilation"], p["dimension_numbers"],
                p["feature_group_count"], p["batch_group_count"], p.get("precision"),
                p.get("preferred_element_type"),
            )  # fmt: skip
        stored_name = self.plan.stored.get(here)
        state_name = self.plan.state_keys.get(here)
        if stored_name is not None:
            dims = ops.Dims.create(args[2], jnp.ndim(args[0]), jnp.ndim(args[1]))
            if frame.collect is not None:  # storing: the forward's rhs, once
                frame.collect[stored_name] = ops.store_weight(
                    args[1], config.fwd, dims.rhs_contract
                )
                return bind(eqn, invals)
            qt = frame.states[stored_name].replace(dtype=np.dtype(args[1].dtype))
            out = ops.stored_matmul(
                args[0], qt, dims, config.fwd, precision=args[3],
                preferred_element_type=args[4], **kwargs,
            )  # fmt: skip
        elif state_name is not None and frame.collect is not None:
            # initialising: the state from the actual operands, float forward
            frame.collect[state_name] = make(config).init_state(*args[:5])
            return bind(eqn, invals)
        else:
            if state_name is not None:
                kwargs["state"] = frame.states[state_name]
            out = make(config, site_key)(*args, **kwargs)
        if swap:  # back to the equation's own output layout
            out = jnp.transpose(out, np.argsort(perm))
        return out

    def _body(self, eqn: Any, invals: list[Any], here: Ctx, frame: _Frame) -> list:
        name, p = eqn.primitive.name, eqn.params
        run = self.run
        if name in ("jit", "pjit", "closed_call", "core_call"):
            closed = p["jaxpr"]
            return run(closed.jaxpr, closed.consts, invals, here, frame)
        if name in ("remat2", "checkpoint"):
            if frame.collect is not None:  # initialising: nothing to save
                return run(p["jaxpr"], [], invals, here, frame)
            base = frame.body()
            fn = jax.checkpoint(
                lambda *a: run(p["jaxpr"], [], list(a), here, base.with_()),
                prevent_cse=p["prevent_cse"],
                policy=p["policy"],
            )
            return fn(*invals)
        if name == "cond":
            base = frame.body()
            branches = [
                functools.partial(
                    lambda j, b, *a: run(b.jaxpr, b.consts, list(a), (*here, j),
                                         base.with_()), j, b,
                )
                for j, b in enumerate(p["branches"])
            ]  # fmt: skip
            return list(lax.switch(invals[0], branches, *invals[1:]))
        if name == "scan":
            return self._scan(eqn, invals, here, frame)
        if name == "while":
            return self._while(eqn, invals, here, frame)
        raise AssertionError(name)  # pragma: no cover - _program lists no others

    def _scan(self, eqn: Any, invals: list[Any], here: Ctx, frame: _Frame) -> list:
        p = eqn.params
        n_consts, n_carry = scan_counts(p)
        consts = invals[:n_consts]
        init = invals[n_consts : n_consts + n_carry]
        xs = invals[n_consts + n_carry :]
        body = p["jaxpr"]
        length = int(p["length"])
        # The state of the sites inside is stacked along the scan: one slice
        # per iteration (per layer, for a scan over stacked layers).
        names = self.plan.slots_under(here)
        sliced = self.plan.sliced
        shared = {n for n in names if n in sliced and here not in sliced[n]}
        initialising = frame.collect is not None
        stacked = (
            {}
            if initialising
            else {n: frame.states[n] for n in names if n not in shared}
        )

        base = frame.body()

        def step(carry: list[Any], x: tuple[Any, list[Any], dict]) -> Any:
            it, x_slice, state_slice = x
            key = _iteration_key(base.key, it)
            inner = base.with_(key=key, states={**frame.states, **state_slice},
                               collect={} if initialising else None)  # fmt: skip
            out = self.run(body.jaxpr, body.consts, [*consts, *carry, *x_slice],
                           here, inner)  # fmt: skip
            return out[:n_carry], (out[n_carry:], inner.collect or {})

        iters = lax.iota("int32", length)
        carry, (ys, new) = lax.scan(
            step, list(init), (iters, list(xs), stacked), length=length,
            reverse=p["reverse"], unroll=p["unroll"],
        )  # fmt: skip
        if initialising:  # a shared weight: every iteration stored the same
            frame.collect.update(  # type: ignore[union-attr]
                {n: jax.tree.map(lambda a: a[0], v) if n in shared else v
                 for n, v in new.items()}
            )  # fmt: skip
        return list(carry) + list(ys)

    def _while(self, eqn: Any, invals: list[Any], here: Ctx, frame: _Frame) -> list:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = invals[:nc], invals[nc : nc + nb]
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]

        def cond_fn(c: tuple[Any, list[Any]]) -> Any:
            return bind_closed(cond, [*cond_consts, *c[1]])[0]

        base = frame.body()

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


def _swapped(lhs: Any, rhs: Any, dn: Any, precision: Any) -> tuple:
    """``rhs . lhs`` for ``lhs . rhs``: swapped operands and dimension numbers.

    Returns the new operands, dimension numbers and precision, and the
    permutation that the swapped product's axes are of the original output's
    (batch axes, then rhs free axes, then lhs free axes).
    """
    (lc, rc), (lb, rb) = dn
    nb = len(lb)
    nl = jnp.ndim(lhs) - len(lc) - nb
    nr = jnp.ndim(rhs) - len(rc) - nb
    if isinstance(precision, tuple):
        precision = precision[::-1]
    # swapped output axis k holds original output axis perm[k]
    perm = [*range(nb), *range(nb + nl, nb + nl + nr), *range(nb, nb + nl)]
    return rhs, lhs, ((rc, lc), (rb, lb)), precision, perm


def _permuted_sharding(sharding: Any, perm: list[int]) -> Any:
    """An output sharding for the swapped product (``None`` stays ``None``)."""
    if sharding is None:
        return None
    spec = getattr(sharding, "spec", sharding)
    entries = list(spec) + [None] * (len(perm) - len(spec))
    new = jax.sharding.PartitionSpec(*(entries[i] for i in perm))
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, new)
    return new


def _iteration_key(key: Any, iteration: Any) -> Any:
    """The key stream of one loop iteration (``None`` stays ``None``)."""
    return None if key is None else jax.random.fold_in(key, iteration)


def bind_closed(closed: Any, args: list[Any]) -> list[Any]:
    """Evaluates a ClosedJaxpr as JAX would."""
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def _check_key(key: Any, plan: _Plan, owner: str) -> None:
    if plan.needs_key and key is None:
        raise InvalidArgumentError(
            owner,
            "key",
            None,
            "a PRNG key (jax.random.key(...)), or configs that round to nearest",
            why=f"the config of {plan.needs_key[0]!r} rounds stochastically",
        )


def quantize(
    fn: Callable[..., Any],
    config: Any,
    key: jax.Array | None = None,
    *,
    state: dict[str, dict[str, jax.Array]] | None = None,
    stored: Mapping[str, QTensor] | None = None,
    params_argnum: int | None = 0,
) -> Callable[..., Any]:
    """Quantizes every matmul ``fn`` computes, by per-layer rules.

    Every ``lax.dot_general``, ``jnp.einsum``, ``jnp.matmul``/``@``,
    ``jnp.dot`` and convolution that ``fn`` runs, wherever it is written
    (custom layers, tied embeddings, scanned and rematerialised blocks,
    nested ``jit``), runs through qbits' quantized core with the config of
    the first rule that matches its path; ``None`` keeps it float. A
    function transformation, not a patch: nothing global changes, and the
    same model can run float and quantized side by side.

    A matmul's path is the module path of the parameter that feeds it (the
    leaves of ``args[params_argnum]``: linen variables, an nnx ``State``,
    any pytree of arrays), e.g. ``blocks_0/mlp/fc1``; where one module
    multiplies with several parameters, the parameter's name is added
    (``mlp/w_in``). Matmuls of two activations (attention) are named after
    the modules that produced their operands plus the einsum subscripts
    (``attn/btnh,bsnh->bnts``; Flax's attention einsums are ``attn/qk`` and
    ``attn/pv``); a config's ``lhs`` is the einsum's written first operand.
    :func:`layer_table` lists them all.

    Args:
      fn: The function, e.g. ``model.apply`` or a loss of ``(params, batch)``.
      config: Per-layer rules (a :class:`~qbits.QuantConfig`), or one
        :class:`~qbits.DotGeneralConfig` or preset name for every matmul.
      key: PRNG key for stochastic rounding (required when a config rounds
        stochastically): every matmul, every scan iteration and every loop
        step draws its own stream.
      state: The scale state of matmuls whose configs take their scales
        from state (delayed scaling, static ranges, learned scales), from
        :func:`init_state`: ``{matmul path: its state}``, stacked along the
        scan for matmuls inside one. As with the layer wrappers, the new
        state is the gradient of ``state`` (``jax.grad`` with respect to
        it): call ``quantize`` inside the differentiated function.
      stored: Serving: the weights of the weight matmuls whose forward
        quantizes the weight, already quantized (from
        :func:`store_weights`, ``{matmul path: QTensor}``). Those matmuls
        run forward only on them and ignore the float parameter (whose
        value may then be anything of its shape, e.g. zeros); the output
        equals the quantized forward on the float weights bit for bit.
      params_argnum: Which positional argument holds the parameters
        (``None``: no argument names sites; weight matmuls are then named
        like activation ones).

    Returns:
      A function with ``fn``'s signature and outputs. Differentiate it
      (``jax.grad``) to run the quantized backward matmuls.

    Raises:
      InvalidArgumentError: For a bad ``config``, a missing ``key``, a
        missing or mismatched ``state`` or ``stored``, or scale state inside
        a ``cond`` or ``while`` body, naming the matmul's path.
      ConfigError: With ``stored``, for a weight matmul whose forward keeps
        scale state or rounds stochastically (serving is neither).

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> qmlp = qbits.quantize(mlp, "int8_fwd")
      >>> qmlp(params, jnp.ones((3, 4))).shape
      (3, 2)
      >>> table = qbits.layer_table(mlp, "int8_fwd", params, jnp.ones((3, 4)))
      >>> [(row.path, row.operands) for row in table.rows]
      [('w1', 'f32[3,4] x f32[4,8]'), ('w2', 'f32[3,8] x f32[8,2]')]
    """
    quant = as_quant_config(_OWNER, config, allow_none=True)
    if not callable(fn):
        raise InvalidArgumentError(_OWNER, "fn", fn, "a function")

    @functools.wraps(fn)
    def quantized(*args: Any, **kwargs: Any) -> Any:
        program = trace(fn, args, kwargs, params_argnum)
        plan = _Plan(program, quant, _OWNER, store=stored is not None)
        _check_key(key, plan, _OWNER)
        _check_state(state, plan)
        if stored is not None:
            _check_names("stored", stored, plan.stored.values(),
                         "stored with this config: qbits.serving.convert or "
                         "qbits.intercept.store_weights",
                         "their forward configs quantize a weight: a missing "
                         "one was stored float (converted with another "
                         "config?)")  # fmt: skip
        _table(program, quant).warn_unused()
        frame = _Frame(key, {**(state or {}), **(stored or {})})
        out = _run(program, plan, frame, args, kwargs)
        return jax.tree.unflatten(program.out_tree, out)

    return quantized


def _run(program: Program, plan: _Plan, frame: _Frame, args: Any, kwargs: Any):
    leaves = jax.tree.leaves((args, kwargs))
    dyn = [x for x, d in zip(leaves, program.dynamic, strict=True) if d]
    closed = program.closed
    return _Runner(plan).run(closed.jaxpr, closed.consts, dyn, (), frame)


def _check_state(state: Any, plan: _Plan) -> None:
    if not plan.state_keys and state is None:
        return
    _check_names("state", state, plan.state_keys.values(),
                 "qbits.init_state(fn, config, *args) makes it",
                 "their configs take their scales from state")  # fmt: skip


def _check_names(arg: str, given: Any, names: Any, fix: str, why: str) -> None:
    """Raises unless ``given`` is a mapping with exactly these matmul names."""
    want = sorted(names)
    have = sorted(given) if isinstance(given, Mapping) else None
    if have == want:
        return
    listed = ", ".join(want[:4]) + (
        f" and {len(want) - 4} more" if len(want) > 4 else ""
    )
    if have is not None:
        missing = [n for n in want if n not in have][:3]
        extra = [n for n in have if n not in want][:3]
        given = f"a mapping missing {missing}, with {extra} extra"
    raise InvalidArgumentError(
        _OWNER,
        arg,
        given,
        f"the {arg} of exactly the matmuls {listed} ({fix})",
        why=why if want else f"no matmul needs it ({why})",
    )


def init_state(
    fn: Callable[..., Any],
    config: Any,
    *args: Any,
    params_argnum: int | None = 0,
    **kwargs: Any,
) -> dict[str, dict[str, jax.Array]]:
    """The initial scale state of every matmul of ``fn`` whose config keeps one.

    Runs ``fn(*args, **kwargs)`` once (in float) and gives each matmul whose
    config takes its scales from state (delayed scaling, static ranges,
    learned scales) its initial state, from its actual operands: what
    :func:`quantize` takes as ``state=``. Matmuls inside a scan get their
    states stacked along it (one per layer of a scan over layers).

    Args:
      fn: The function, as for :func:`quantize`.
      config: The rules, as for :func:`quantize`.
      *args: Arguments for ``fn``.
      params_argnum: As for :func:`quantize`.
      **kwargs: Keyword arguments for ``fn``.

    Returns:
      ``{matmul path: {state entry: array}}`` (empty when no config keeps
      state). A path used by several matmuls gets ``#2``, ``#3``... for the
      later ones.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> state = qbits.init_state(mlp, "fp8_delayed", params, jnp.ones((3, 4)))
      >>> sorted(state), state["w1"]["lhs_amax_history"].shape
      (['w1', 'w2'], (1024,))
    """
    quant = as_quant_config("qbits.init_state", config, allow_none=True)
    program = trace(fn, args, kwargs, params_argnum)
    plan = _Plan(program, quant, "qbits.init_state")
    collect: dict[str, Any] = {}
    _run(program, plan, _Frame(jax.random.key(0), {}, collect), args, kwargs)
    return collect


def layer_table(
    fn: Callable[..., Any],
    config: Any,
    *args: Any,
    params_argnum: int | None = 0,
    **kwargs: Any,
) -> LayerTable:
    """Every matmul ``fn(*args, **kwargs)`` runs, and the config it gets.

    Traces ``fn`` (no computation) and lists each matmul once: its path, its
    kind (which operands are weights, einsum or conv, stacked layers), the
    operand types, the config and the rule that gave it. Matmuls inside a
    model's own custom-gradient function (for instance a model that passes
    its own quantized ``dot_general``) are listed as kept. Rules that
    match no matmul are reported as unused, saying when they match a
    module that holds parameters but multiplies with none of them.

    Args:
      fn: The function, as for :func:`quantize`.
      config: The rules, as for :func:`quantize`.
      *args: Example positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      params_argnum: As for :func:`quantize`.
      **kwargs: Example keyword arguments.

    Returns:
      A :class:`~qbits.LayerTable`.
    """
    quant = as_quant_config("qbits.layer_table", config, allow_none=True)
    program = trace(fn, args, kwargs, params_argnum)
    return _table(program, quant)
