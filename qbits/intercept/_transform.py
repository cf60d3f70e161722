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

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from qbits import ops
from qbits._errors import InvalidArgumentError
from qbits._jaxpr import bind, scan_counts
from qbits.config import LayerRow, LayerTable, QuantConfig, as_quant_config
from qbits.intercept._program import Ctx, Program, trace
from qbits.numerics import derive_key

__all__ = ["layer_table", "quantize"]

_OWNER = "qbits.quantize"


class _Plan:
    """Which sites run quantized, with which config and key stream."""

    def __init__(self, program: Program, rules: QuantConfig, owner: str):
        self.configs: dict[Ctx, tuple[Any, int]] = {}
        self.holds: set[Ctx] = set()  # bodies holding a quantized site
        self.needs_key: list[str] = []
        for index, site in enumerate(program.sites):
            config = rules.resolve(site.path).config
            if config is None or site.frozen or config.is_identity:
                continue
            if ops.needs_state(config):
                raise InvalidArgumentError(
                    owner,
                    "config",
                    f"the config of {site.path!r}",
                    "a config without scale state here (current scaling); keep "
                    "delayed, static or learned scales on layers quantized by "
                    "qbits.flax.quantize / qbits.nnx.quantize, or add "
                    f"qbits.Rule({site.path!r}, None)",
                    why="its scales come from state, which qbits.quantize does "
                    "not carry",
                )
            self.configs[site.ctx] = (config, index)
            if config.needs_key:
                self.needs_key.append(site.path)
            for n in range(1, len(site.ctx)):
                self.holds.add(site.ctx[:n])


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
    base = rules.table([])
    used = {row.resolution.rule for row in rows if not row.explicit}
    unused = tuple(i for i in range(len(rules.rules)) if i not in used)
    idle = {
        i: tuple(p for p in program.param_paths if rules.rules[i].matches(p))
        for i in unused
    }
    return LayerTable(
        rows, unused, base.patterns, idle={i: p for i, p in idle.items() if p}
    )


class _Runner:
    """Runs a program's jaxpr with the planned sites quantized."""

    def __init__(self, plan: _Plan, key: jax.Array | None):
        self.plan = plan
        self.key = key

    def run(self, jaxpr: Any, consts: list[Any], args: list[Any], ctx: Ctx,
            key: Any) -> list[Any]:  # fmt: skip
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
                outs = [self._matmul(eqn, invals, here, key)]
            elif here in self.plan.holds:
                outs = self._body(eqn, invals, here, key)
            else:
                out = bind(eqn, invals)
                outs = out if eqn.primitive.multiple_results else [out]
            for v, val in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jax.extend.core.DropVar):
                    env[v] = val
        return [read(v) for v in jaxpr.outvars]

    def _matmul(self, eqn: Any, invals: list[Any], here: Ctx, key: Any) -> Any:
        config, index = self.plan.configs[here]
        site_key = derive_key(key, index) if config.needs_key else None
        p = dict(eqn.params)
        if eqn.primitive.name == "dot_general":
            kwargs = {}
            if p.get("out_sharding") is not None:
                kwargs["out_sharding"] = p["out_sharding"]
            return ops.dot_general(config, site_key)(
                invals[0], invals[1], p["dimension_numbers"], p.get("precision"),
                p.get("preferred_element_type"), **kwargs,
            )  # fmt: skip
        return ops.conv_general_dilated(config, site_key)(
            invals[0], invals[1], p["window_strides"], p["padding"],
            p["lhs_dilation"], p["rhs_dilation"], p["dimension_numbers"],
            p["feature_group_count"], p["batch_group_count"], p.get("precision"),
            p.get("preferred_element_type"),
        )  # fmt: skip

    def _body(self, eqn: Any, invals: list[Any], here: Ctx, key: Any) -> list[Any]:
        name, p = eqn.primitive.name, eqn.params
        run = self.run
        if name in ("jit", "pjit", "closed_call", "core_call"):
            closed = p["jaxpr"]
            return run(closed.jaxpr, closed.consts, invals, here, key)
        if name in ("remat2", "checkpoint"):
            fn = jax.checkpoint(
                lambda *a: run(p["jaxpr"], [], list(a), here, key),
                prevent_cse=p["prevent_cse"],
                policy=p["policy"],
            )
            return fn(*invals)
        if name == "cond":
            branches = [
                functools.partial(
                    lambda b, *a: run(b.jaxpr, b.consts, list(a), here, key), b
                )
                for b in p["branches"]
            ]
            return list(lax.switch(invals[0], branches, *invals[1:]))
        if name == "scan":
            return self._scan(eqn, invals, here, key)
        if name == "while":
            return self._while(eqn, invals, here, key)
        raise AssertionError(name)  # pragma: no cover - _program lists no others

    def _scan(self, eqn: Any, invals: list[Any], here: Ctx, key: Any) -> list[Any]:
        p = eqn.params
        n_consts, n_carry = scan_counts(p)
        consts = invals[:n_consts]
        init = invals[n_consts : n_consts + n_carry]
        xs = invals[n_consts + n_carry :]
        body = p["jaxpr"]
        length = int(p["length"])

        def step(carry: list[Any], x: tuple[Any, list[Any]]) -> Any:
            it, x_slice = x
            k = None if key is None else jax.random.fold_in(key, it)
            out = self.run(body.jaxpr, body.consts, [*consts, *carry, *x_slice],
                           here, k)  # fmt: skip
            return out[:n_carry], out[n_carry:]

        iters = lax.iota("int32", length)
        carry, ys = lax.scan(step, list(init), (iters, list(xs)), length=length,
                             reverse=p["reverse"], unroll=p["unroll"])  # fmt: skip
        return list(carry) + list(ys)

    def _while(self, eqn: Any, invals: list[Any], here: Ctx, key: Any) -> list[Any]:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = invals[:nc], invals[nc : nc + nb]
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]

        def cond_fn(c: tuple[Any, list[Any]]) -> Any:
            return bind_closed(cond, [*cond_consts, *c[1]])[0]

        def body_fn(c: tuple[Any, list[Any]]) -> Any:
            it, carry = c
            k = None if key is None else jax.random.fold_in(key, it)
            out = self.run(body.jaxpr, body.consts, [*body_consts, *carry], here, k)
            return it + 1, out

        _, out = lax.while_loop(
            cond_fn, body_fn, (jax.numpy.int32(0), invals[nc + nb :])
        )
        return list(out)


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
    (``attn/...qhd,...khd->...hqk``). :func:`layer_table` lists them all.

    Args:
      fn: The function, e.g. ``model.apply`` or a loss of ``(params, batch)``.
      config: Per-layer rules (a :class:`~qbits.QuantConfig`), or one
        :class:`~qbits.DotGeneralConfig` or preset name for every matmul.
      key: PRNG key for stochastic rounding (required when a config rounds
        stochastically): every matmul, every scan iteration and every loop
        step draws its own stream.
      params_argnum: Which positional argument holds the parameters
        (``None``: no argument names sites; weight matmuls are then named
        like activation ones).

    Returns:
      A function with ``fn``'s signature and outputs. Differentiate it
      (``jax.grad``) to run the quantized backward matmuls.

    Raises:
      InvalidArgumentError: For a bad ``config``, a missing ``key``, or a
        config whose scales come from state (delayed, static, learned: use
        :func:`qbits.flax.quantize` / :func:`qbits.nnx.quantize` for those
        layers), naming the matmul's path.

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
        plan = _Plan(program, quant, _OWNER)
        _check_key(key, plan, _OWNER)
        _table(program, quant).warn_unused()
        leaves = jax.tree.leaves((args, kwargs))
        dyn = [x for x, d in zip(leaves, program.dynamic, strict=True) if d]
        closed = program.closed
        out = _Runner(plan, key).run(closed.jaxpr, closed.consts, dyn, (), key)
        return jax.tree.unflatten(program.out_tree, out)

    return quantized


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
