"""The engine's entry points: quantize, layer table, scale state, observing.

The function is traced to a jaxpr (:mod:`qbits.transform._program`), each
matmul site gets the config its rule resolves to (:mod:`._runner`'s plan),
and the jaxpr is run again on the actual arguments with each quantized
site on qbits' core. Nothing global is changed: a function traced before
or after, float or quantized, keeps its own numbers. Every entry point of
qbits (this module's functions, the linen and nnx adapters, serving) runs
through these functions, so coverage, names, errors and the layout of the
scale state are the same everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from qbits._errors import InvalidArgumentError
from qbits.config import LayerRow, LayerTable, QuantConfig, as_quant_config
from qbits.numerics import check_key
from qbits.tensor import QTensor
from qbits.transform._observe import ObservedMatmul, Observer
from qbits.transform._plan import DIAGNOSTICS, Caller, Plan, applied
from qbits.transform._program import Program, trace
from qbits.transform._runner import Frame, run_program

__all__ = [
    "collect_ranges",
    "init_probes",
    "init_state",
    "layer_table",
    "observe_matmuls",
    "quantize",
]

_QUANTIZE = Caller()
_INIT_STATE = Caller("qbits.init_state")
_LAYER_TABLE = Caller("qbits.layer_table")
_COLLECT_RANGES = Caller("qbits.collect_ranges")
_OBSERVE = Caller("qbits.transform.observe_matmuls")
_INIT_PROBES = Caller("qbits.diagnostics.init")


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


def quantize(
    fn: Callable[..., Any],
    config: Any,
    key: jax.Array | None = None,
    *,
    state: dict[str, dict[str, jax.Array]] | None = None,
    stored: Mapping[str, Any] | None = None,
    diagnostics: Mapping[str, Any] | None = None,
    params_argnum: int | None = 0,
    caller: Caller = _QUANTIZE,
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
      caller: The entry point errors name (the linen and nnx adapters and
        serving pass theirs).

    Returns:
      A function with ``fn``'s signature and outputs. Differentiate it
      (``jax.grad``) to run the quantized backward matmuls. Each trace of
      it warns (``UserWarning``) when a config that quantizes something
      finds nothing to quantize (no matmul, or every matmul kept or float),
      saying why; and with :class:`~qbits.config.UnusedRuleWarning` for a
      rule that matches no matmul.

    Raises:
      InvalidArgumentError: For a bad ``config``, a missing ``key``, a
        missing or mismatched ``state`` or ``stored``, or scale state inside
        a ``cond`` or ``while`` body, naming the matmul's path.
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
    quant = as_quant_config(caller.owner, config, allow_none=True)
    if not callable(fn):
        raise InvalidArgumentError(caller.owner, "fn", fn, "a function")
    if key is not None:
        key = _checked_key(caller, key)
    if stored is not None:
        stored = _stored_weights(caller, stored)

    @functools.wraps(fn)
    def quantized(*args: Any, **kwargs: Any) -> Any:
        program = trace(fn, args, kwargs, params_argnum, caller.owner)
        plan = Plan(program, quant, caller, store=stored is not None,
                    diagnose=diagnostics is not None)  # fmt: skip
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
                         "stored with this config: qbits.serving.convert or "
                         "qbits.transform.store_weights",
                         "their forward configs quantize a weight: a missing "
                         "one was stored float (converted with another "
                         "config?)")  # fmt: skip
        if caller.whole:
            table(program, quant).warn_unused()
        frame = Frame(key, {**(state or {}), **(stored or {}), **probes})
        out = run_program(program, plan, frame, args, kwargs)
        return jax.tree.unflatten(program.out_tree, out)

    return quantized


def _checked_key(caller: Caller, key: Any) -> Any:
    """The key, checked (:func:`qbits.numerics.check_key`) as the caller names it."""
    try:
        return check_key(caller.owner, key)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(
            caller.owner, caller.key, e.value, e.allowed, why=e.why
        ) from None


def _stored_weights(caller: Caller, stored: Any) -> dict[str, QTensor]:
    """``{name: QTensor}`` from a mapping of QTensors or of ``store_weights``."""
    if not isinstance(stored, Mapping):
        raise InvalidArgumentError(
            caller.owner,
            "stored",
            type(stored).__name__,
            "a mapping {matmul path: QTensor}, e.g. qbits.serving.convert's weights",
        )
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


def init_state(
    fn: Callable[..., Any],
    config: Any,
    *args: Any,
    params_argnum: int | None = 0,
    caller: Caller = _INIT_STATE,
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
      caller: As for :func:`quantize`.
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
    quant = as_quant_config(caller.owner, config, allow_none=True)
    program = trace(fn, args, kwargs, params_argnum, caller.owner)
    plan = Plan(program, quant, caller)
    collect: dict[str, Any] = {}
    if plan.state_keys:  # else the run would collect nothing
        frame = Frame(jax.random.key(0), {}, collect)
        run_program(program, plan, frame, args, kwargs)
    return collect


def init_probes(
    fn: Callable[..., Any],
    config: Any,
    *args: Any,
    params_argnum: int | None = 0,
    caller: Caller = _INIT_PROBES,
    **kwargs: Any,
) -> dict[str, dict[str, jax.Array]]:
    """A diagnostics probe for every quantized matmul of ``fn``.

    What :func:`quantize` takes as ``diagnostics=``: ``{matmul path: probe}``
    (:func:`qbits.ops.init_probe`'s zeros), stacked along the scans over
    stacked layers (one probe per layer). Traced only (nothing is computed).

    Args:
      fn: The function, as for :func:`quantize`.
      config: The rules, as for :func:`quantize`.
      *args: Arguments for ``fn`` (arrays or ``jax.ShapeDtypeStruct``).
      params_argnum: As for :func:`quantize`.
      caller: As for :func:`quantize`.
      **kwargs: Keyword arguments for ``fn``.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> probes = qbits.transform.init_probes(mlp, "int8", params, jnp.ones((3, 4)))
      >>> sorted(probes), probes["w1"]["sums"].shape
      (['w1', 'w2'], (6, 9))
    """
    quant = as_quant_config(caller.owner, config, allow_none=True)

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


def layer_table(
    fn: Callable[..., Any],
    config: Any,
    *args: Any,
    params_argnum: int | None = 0,
    caller: Caller = _LAYER_TABLE,
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
      caller: As for :func:`quantize`.
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
    quant = as_quant_config(caller.owner, config, allow_none=True)
    program = trace(fn, args, kwargs, params_argnum, caller.owner)
    Plan(program, quant, caller)  # the checks a run makes before it starts
    return table(program, quant)


def observe_matmuls(
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
    observer: Observer,
    *,
    config: Any = None,
    caller: Caller = _OBSERVE,
) -> tuple[dict[str, ObservedMatmul], dict[str, Any]]:
    """What an observer records of every weight matmul's activation, over batches.

    The one mechanism behind :func:`collect_ranges` and post-training
    statistics (:func:`qbits.ptq.collect_stats`). Runs ``fn(params, batch)``
    in float, jitted once, on each batch; each observed weight matmul hands
    its activation, as ``(*groups, rows, K)`` rows over the weight's
    contraction channels (:class:`ObservedMatmul`), to ``observer.observe``,
    whose records merge over batches (a running total that starts at zeros,
    updated in place), over the steps of a loop and over the uses of a
    path, or stay stacked along a scan over stacked layers
    (``observer.per_layer``).

    Observed are the weight ``dot_general`` s (dense layers, einsums, ``@``;
    not convolutions) that run in float: integer matmuls and those inside a
    custom-gradient function are kept as they are; those inside a ``cond``
    or ``while`` body are left out (a record could not leave the body).

    Args:
      fn: ``fn(params, batch)``, e.g. a linen model's ``apply``.
      params: Its parameters (they name the matmuls).
      batches: An iterable of inputs (each passed as the second argument).
      observer: What to record.
      config: Per-layer rules, as for :func:`quantize`: observe the weight
        matmuls they give a quantizing config; ``None``: every one.
      caller: The entry point errors name.

    Returns:
      ``({path: ObservedMatmul}, {path: merged record})``, paths as
      :func:`layer_table` names them.

    Raises:
      InvalidArgumentError: For no batches, a bad ``config`` or ``fn``.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> rows = qbits.transform.Observer(
      ...     lambda matmul, x: jnp.float32(x.shape[0]), jnp.add, jnp.sum)
      >>> found, counts = qbits.transform.observe_matmuls(
      ...     mlp, params, [jnp.ones((3, 4)), jnp.ones((5, 4))], rows)
      >>> found["w2"].k, found["w2"].contracting, found["w2"].side, float(counts["w2"])
      (8, (0,), 'lhs', 8.0)
    """
    if not callable(fn):
        raise InvalidArgumentError(caller.owner, "fn", fn, "a function")
    every = config is None
    rules = as_quant_config(caller.owner, config, allow_none=True)
    found: dict[str, ObservedMatmul] = {}

    def observe(params: Any, batch: Any) -> dict[str, Any]:
        program = trace(fn, (params, batch), {}, 0, caller.owner)
        plan = Plan(program, rules, caller, observe=observer, every=every)
        found.clear()
        found.update({m.path: m for m in plan.observed.values()})
        frame = Frame(None, {}, observed={})
        run_program(program, plan, frame, (params, batch), {})
        return frame.observed  # type: ignore[return-value]

    @functools.partial(jax.jit, donate_argnums=2)
    def step(params: Any, batch: Any, total: dict[str, Any]) -> dict[str, Any]:
        new = observe(params, batch)
        return {n: observer.merge(total[n], v) for n, v in new.items()}

    total = None
    for batch in batches:
        if total is None:
            shapes = jax.eval_shape(observe, params, batch)
            total = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total = step(params, batch, total)
    if total is None:
        raise InvalidArgumentError(
            caller.owner, "batches", batches, "at least one batch"
        )
    return dict(found), total


def _amax(matmul: ObservedMatmul, rows: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(rows)).astype(jnp.float32)


_RANGES = Observer(_amax, jnp.maximum, functools.partial(jnp.max, axis=0))


def collect_ranges(
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
    *,
    caller: Caller = _COLLECT_RANGES,
) -> dict[str, float]:
    """The largest activation magnitude of every weight matmul, over batches.

    Runs ``fn(params, batch)`` (in float, jitted) on each batch and takes,
    per weight matmul, the max over batches of ``max(|activation|)``: the
    operand a config's ``fwd.lhs`` quantizes. Give the result to
    :func:`qbits.freeze_ranges` (static post-training ranges). Matmuls in a
    ``cond`` or ``while`` body are left out (their ranges cannot leave it).

    Args:
      fn: ``fn(params, batch)``, e.g. a linen model's ``apply``.
      params: Its parameters.
      batches: An iterable of inputs (each passed as the second argument).
      caller: As for :func:`quantize`.

    Returns:
      ``{matmul path: absmax}``, paths as :func:`layer_table` names them.

    Raises:
      InvalidArgumentError: For no batches.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> qbits.collect_ranges(mlp, params, [jnp.ones((3, 4)), -2 * jnp.ones((3, 4))])
      {'w1': 2.0, 'w2': 4.0}
    """
    _, ranges = observe_matmuls(fn, params, batches, _RANGES, caller=caller)
    return {path: float(value) for path, value in ranges.items()}
