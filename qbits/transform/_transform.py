"""The engine's entry points: quantize, layer table, scale state, probes.

The function is traced to a jaxpr (:mod:`qbits.transform._program`), each
matmul site gets the config its rule resolves to (:mod:`._plan`), and the
jaxpr is run again on the actual arguments with each quantized site on
qbits' core (:mod:`._runner`). :func:`quantize` keeps the traced program
by the signature of its arguments (:mod:`._cache`): an eager call runs it
compiled, and traces again only for a new structure or shape. Each entry
point is written once, taking the :class:`~._plan.Caller` its errors name
first (:func:`~._plan.entry_point` makes the public function; the
adapters, serving, ptq, lora and diagnostics give their own).
Nothing global is changed: a function traced before
or after, float or quantized, keeps its own numbers. Every entry point of
qbits (this module's functions, the linen and nnx adapters, serving) runs
through these functions, so coverage, names, errors and the layout of the
scale state are the same everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from qbits._errors import InvalidArgumentError
from qbits._tensor import QTensor
from qbits.config import LayerRow, LayerTable, QuantConfig, _as_quant_config
from qbits.numerics import _check_key as check_key
from qbits.transform import _cache
from qbits.transform._plan import DIAGNOSTICS, Caller, Plan, applied, entry_point
from qbits.transform._program import Program, trace
from qbits.transform._runner import Frame, run_program

__all__ = [
    "init_probes",
    "init_state",
    "layer_table",
    "quantize",
]


def _check_key(key: Any, plan: Plan) -> None:
    if plan.needs_key and key is None:
        caller = plan.caller
        raise InvalidArgumentError(
            caller.owner,
            caller.key,
            None,
            "a PRNG key (jax.random.key(...)), or configs that round to nearest",
            why=f"the config of {plan.needs_key[0]!r} rounds stochastically",
        )


def table(program: Program, rules: QuantConfig) -> LayerTable:
    """The layer table of a traced program: one row per matmul site."""
    rows = []
    listed: set[tuple[str, str]] = set()
    for site in program.sites:
        if (site.path, site.kept) in listed and site.frozen:
            continue  # the same kept matmul again (see Program.name_sites)
        listed.add((site.path, site.kept))
        kind = site.kind + "".join(f", scanned x{n}" for n in site.loops)
        kind += ", in shard_map" * site.mapped  # operands: a shard's blocks
        res = rules.resolve(site.path)
        config, kept, note = applied(site, res.config), site.kept, ""
        if kept:
            config = None
        elif config is None and res.config is not None:
            kept = "weight-only config, no weight"
        elif config != res.config:
            note = "activations: lhs quantizer on both operands"
        rows.append(LayerRow(site.path, kind, res, kept, site.operands, config, note))
    used = {row.resolution.rule for row in rows}
    unused = tuple(i for i in range(len(rules.rules)) if i not in used)
    idle = {
        i: tuple(p for p in program.param_paths if rules.rules[i].matches(p))
        for i in unused
    }
    return LayerTable(
        tuple(rows),
        unused,
        tuple(r.pattern for r in rules.rules),
        idle={i: p for i, p in idle.items() if p},
        source=rules.source,
    )


@entry_point(Caller())
def quantize(  # noqa: D417 (caller: its public form has none)
    caller: Caller,
    fn: Callable[..., Any],
    config: Any,
    key: jax.Array | None = None,
    *,
    state: dict[str, dict[str, jax.Array]] | None = None,
    stored: Mapping[str, Any] | None = None,
    diagnostics: Mapping[str, Any] | None = None,
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
    Such a matmul has no weight: it runs its rule's config as
    :meth:`~qbits.DotGeneralConfig.for_activations` adapts it (float under
    a weight-only config, else the activation quantizer on both operands).
    :func:`layer_table` lists them all. Grouped matmuls
    (``lax.ragged_dot``, a mixture of experts' experts) are named by their
    weight like the others and run as :func:`qbits.ops.ragged_dot`: each
    group's matmul quantized as :func:`qbits.dot_general` quantizes one.
    Matmuls of two integers stay exact (as ``lax`` computes them); an
    integer operand times a float one is quantized as
    ``x.astype(w.dtype) @ w`` would be (no gradient to the integer
    operand). Ragged dots of
    another mode (a ragged dimension contracted or batched, as in the
    weight gradients JAX derives) and matmuls in a ``while_loop``'s
    condition run as they are: listed as kept, with the reason.

    Batching: ``jax.vmap(quantize(f))`` quantizes each example's tensors on
    their own (what vmap promises: each example as if ``f`` ran on it
    alone), so a per-tensor scale is per example; ``quantize(jax.vmap(f))``
    quantizes the batched program, whose tensors span the batch: one
    per-tensor scale for the batch. Choose by what the scale should cover.

    ``jax.shard_map``: a matmul inside a ``shard_map`` body (expert or
    tensor parallelism written by hand) is quantized like any other, named
    by the parameter whose block feeds it, and runs on each shard as
    ``qbits.dot_general(config)`` called in the body runs: on the shard's
    blocks, a per-tensor scale computed per shard from its own block.
    Per-tensor delayed scaling (``fp8_delayed``) crosses the body: its state
    enters replicated and each shard's amax is maxed over the shards, as
    for ``qbits.dot_general(config)`` in the body given state made outside
    (bit for bit). Other scale state there is refused (call
    ``qbits.dot_general(config)`` with the state in the body instead); a
    served weight there is quantized on the fly.

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
        quantizes the weight, already quantized: ``{matmul path: QTensor}``
        (what :func:`qbits.serving.convert` stores and
        :func:`qbits.serving.serve` passes here). Each is checked against the matmul
        and its config (shape, stored format, scale layout). Those matmuls
        run forward only on them and ignore the float parameter (whose
        value may then be anything of its shape, e.g. zeros); the output
        equals the quantized forward on the float weights bit for bit.
      diagnostics: Probes, from :func:`qbits.diagnostics.init`: every
        quantized matmul measures its quantized operands (forward and
        backward), and the gradient with respect to ``diagnostics`` holds
        the measurements (:mod:`qbits.diagnostics`). ``None`` (the
        default): nothing is measured, and the program is the one without
        diagnostics.
      params_argnum: Which positional argument holds the parameters
        (``None``: no argument names sites; weight matmuls are then named
        like activation ones).

    Returns:
      A function with ``fn``'s signature and outputs. Differentiate it
      (``jax.grad``) to run the quantized backward matmuls. As with
      ``jax.jit``, ``fn`` is traced once per signature of its arguments
      (their tree, shapes and dtypes, and the values of the leaves that
      are not arrays), and the traced program is kept (the 64 most
      recently used): a call outside any transformation runs it compiled
      (the same outputs as ``jax.jit`` of the quantized function), one
      inside ``jit``, ``grad`` or ``vmap`` runs it as part of that trace.
      ``fn`` should be pure: what it reads besides its arguments is read
      when it is traced. Each trace of it warns (``UserWarning``) when a
      config that quantizes something finds nothing to quantize (no matmul,
      or every matmul kept or float), saying why; and with
      :class:`~qbits.config.UnusedRuleWarning` for a rule that matches no
      matmul.

    Raises:
      InvalidArgumentError: For a bad ``config``, a missing ``key``, a
        missing or mismatched ``state`` or ``stored``, or scale state inside
        a ``cond``, ``while`` or ``shard_map`` body, naming the matmul's path.
      ConfigError: For a config that does not fit a matmul's operands (a
        tile size that does not divide its axis), naming the place of the
        config in its rules (and file), the matmul and the operand; for a
        rule that gives an integer matmul a config; with ``stored``, for a
        weight matmul whose forward keeps scale state or rounds
        stochastically (serving is neither).

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
    quant = _as_quant_config(caller.owner, config, allow_none=True)
    if not callable(fn):
        raise InvalidArgumentError(caller.owner, "fn", fn, "a function")
    if key is not None:
        key = _checked_key(caller, key)
    if stored is not None:
        stored = _stored_weights(caller, stored)
    owner, *extra = _cache.identity(fn, caller.identity)
    caller = dataclasses.replace(caller, identity=None)  # kept: not the owner
    mode = (quant, params_argnum, caller, stored is not None, diagnostics is not None)
    frame_leaves = jax.tree.leaves((key, state, stored, diagnostics))
    inside = any(isinstance(x, jax.core.Tracer) for x in frame_leaves)

    def program(args: Any, kwargs: Any, sig: _cache.Signature) -> _cache.Entry:
        """The call's traced and planned program: kept, or traced now."""
        cache_key = None
        if sig.key is not None:
            try:
                cache_key = (id(owner), *extra, mode, sig.key)
                hash(cache_key)
            except TypeError:  # an unhashable extra: not kept
                cache_key = None
        entry = None if cache_key is None else _cache.PROGRAMS.get(owner, cache_key)
        if entry is not None:
            return entry
        found = trace(fn, args, kwargs, params_argnum, caller.owner)
        plan = Plan(found, quant, caller, store=stored is not None,
                    diagnose=diagnostics is not None)  # fmt: skip
        if caller.whole:
            table(found, quant).warn_unused()
        entry = _cache.Entry(found, plan)
        # A constant taken from an enclosing trace belongs to that trace only.
        leaked = any(isinstance(c, jax.core.Tracer) for c in found.closed.consts)
        if cache_key is not None and not leaked:
            _cache.PROGRAMS.put(owner, cache_key, entry)
        return entry

    @functools.wraps(fn)
    def quantized(*args: Any, **kwargs: Any) -> Any:
        sig = _cache.signature(args, kwargs)
        entry = program(args, kwargs, sig)
        plan = entry.plan
        _check_key(key, plan)
        _check_state(state, plan)
        probes = {}
        if diagnostics is not None:
            names = [p[len(DIAGNOSTICS) :] for p in plan.probes.values()]
            _check_names(caller, "diagnostics", diagnostics, names,
                         "qbits.diagnostics.init(fn, config, *args) makes them",
                         "they are the quantized matmuls")  # fmt: skip
            probes = {DIAGNOSTICS + n: v for n, v in diagnostics.items()}
        if stored is not None:
            _check_names(caller, "stored", stored, plan.stored.values(),
                         "stored with this config: qbits.serving.convert "
                         "stores them, qbits.serving.serve runs them",
                         "their forward configs quantize a weight: a missing "
                         "one was stored float (converted with another "
                         "config?)")  # fmt: skip
        frame = Frame(key, {**(state or {}), **(stored or {}), **probes})
        out = entry.run(frame, sig.leaves, sig.eager and not inside)
        return jax.tree.unflatten(entry.program.out_tree, out)

    return quantized


def _checked_key(caller: Caller, key: Any) -> Any:
    """The key, checked (``check_key``) as the caller names it."""
    try:
        return check_key(caller.owner, key)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(
            caller.owner, caller.key, e.value, e.allowed, why=e.why
        ) from None


def _check_mapping(caller: Caller, arg: str, given: Any, allowed: str) -> None:
    """Raises unless ``given`` is a mapping (``{matmul path: ...}``)."""
    if not isinstance(given, Mapping):
        raise InvalidArgumentError(caller.owner, arg, type(given).__name__, allowed)


def _stored_weights(caller: Caller, stored: Any) -> dict[str, QTensor]:
    """``{name: QTensor}`` from a mapping of QTensors or of ``store_weights``."""
    _check_mapping(caller, "stored", stored, "a mapping {matmul path: QTensor}")
    return {name: getattr(w, "weight", w) for name, w in stored.items()}


def _check_state(state: Any, plan: Plan) -> None:
    if not plan.state_keys and state is None:
        return
    caller = plan.caller
    _check_names(caller, caller.state, state, plan.state_keys.values(),
                 caller.state_fix,
                 "their configs take their scales from state")  # fmt: skip


def _check_names(
    caller: Caller, arg: str, given: Any, names: Any, fix: str, why: str
) -> None:
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
        caller.owner,
        arg,
        given,
        f"the {arg} of exactly the matmuls {listed} ({fix})",
        why=why if want else f"no matmul needs it ({why})",
    )


@entry_point(Caller("qbits.init_state"))
def init_state(  # noqa: D417 (caller: its public form has none)
    caller: Caller,
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
      later ones, as in :func:`layer_table`.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> state = qbits.init_state(mlp, "fp8_delayed", params, jnp.ones((3, 4)))
      >>> sorted(state), state["w1"]["lhs_amax_history"].shape
      (['w1', 'w2'], (1024,))
    """
    quant = _as_quant_config(caller.owner, config, allow_none=True)
    program = trace(fn, args, kwargs, params_argnum, caller.owner)
    plan = Plan(program, quant, caller)
    if not plan.state_keys:  # the run would collect nothing
        return {}

    leaves, treedef = jax.tree.flatten((args, kwargs))

    def collected(dyn: list[Any]) -> dict[str, Any]:
        given = iter(dyn)  # the traced leaves; the others as traced
        pairs = zip(leaves, program.dynamic, strict=True)
        full = [next(given) if d else x for x, d in pairs]
        collect: dict[str, Any] = {}
        frame = Frame(jax.random.key(0), {}, collect)
        run_program(program, plan, frame, *jax.tree.unflatten(treedef, full))
        return collect

    # Compiled, not run op by op: XLA frees each value after its last use
    # (eagerly, every intermediate of the model stays alive until the end).
    dyn = [x for x, d in zip(leaves, program.dynamic, strict=True) if d]
    return jax.jit(collected)(dyn)


def init_probes(
    caller: Caller,
    fn: Callable[..., Any],
    config: Any,
    *args: Any,
    params_argnum: int | None = 0,
    **kwargs: Any,
) -> dict[str, dict[str, jax.Array]]:
    """A diagnostics probe for every quantized matmul of ``fn``.

    What :func:`quantize` takes as ``diagnostics=``: ``{matmul path: probe}``
    (:func:`qbits.diagnostics.init`'s zeros), stacked along the scans over
    stacked layers (one probe per layer). Traced only (nothing is computed).
    """
    quant = _as_quant_config(caller.owner, config, allow_none=True)

    def collect(*args: Any, **kwargs: Any) -> dict[str, Any]:
        program = trace(fn, args, kwargs, params_argnum, caller.owner)
        plan = Plan(program, quant, caller, diagnose=True)
        found: dict[str, Any] = {}
        frame = Frame(jax.random.key(0), {}, found)
        run_program(program, plan, frame, args, kwargs)
        return {n[len(DIAGNOSTICS) :]: v for n, v in found.items()
                if n.startswith(DIAGNOSTICS)}  # fmt: skip

    shapes = jax.eval_shape(collect, *args, **kwargs)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@entry_point(Caller("qbits.layer_table"))
def layer_table(  # noqa: D417 (caller: its public form has none)
    caller: Caller,
    fn: Callable[..., Any],
    config: Any,
    *args: Any,
    params_argnum: int | None = 0,
    **kwargs: Any,
) -> LayerTable:
    """Every matmul ``fn(*args, **kwargs)`` runs, and the config it gets.

    Traces ``fn`` (no computation) and lists each matmul: its unique path,
    its kind (which operands are weights, einsum or conv, stacked layers),
    the operand types, the config and the rule that gave it. Matmuls that
    run as they are whatever the rules say are listed as kept, with the
    reason: inside a model's own custom-gradient function (a model that
    passes its own quantized ``dot_general``), matmuls of two integers
    (exact), matmuls of two activations under a weight-only config (no
    weight to quantize),
    ragged dots that :func:`qbits.ops.ragged_dot` does not quantize (a
    ragged dimension contracted or batched) and matmuls in a
    ``while_loop``'s condition. Rules that match no matmul are reported as
    unused, saying when they match a module that holds parameters but
    multiplies with none of them.

    Args:
      fn: The function, as for :func:`quantize`.
      config: The rules, as for :func:`quantize`.
      *args: Example positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      params_argnum: As for :func:`quantize`.
      **kwargs: Example keyword arguments.

    Returns:
      A :class:`~qbits.config.LayerTable`. Warns (``UserWarning``) when a
      config that quantizes something finds nothing to quantize, as
      :func:`quantize` does.

    Raises:
      ConfigError: For a rule that gives an integer matmul a config.

    Example:
      >>> def f(params, x):
      ...     counts = x.astype(jnp.int32) @ params["ids"]  # exact, kept
      ...     return x @ params["w"] + counts.astype(jnp.float32)
      >>> params = {"w": jnp.ones((4, 2)), "ids": jnp.ones((4, 2), jnp.int32)}
      >>> table = qbits.layer_table(f, "int8", params, jnp.ones((3, 4)))
      >>> [(row.path, row.describe()) for row in table.rows]
      [('ids', 'kept'), ('w', 'int8')]
    """
    quant = _as_quant_config(caller.owner, config, allow_none=True)
    program = trace(fn, args, kwargs, params_argnum, caller.owner)
    Plan(program, quant, caller)  # the checks a run makes before it starts
    return table(program, quant)
