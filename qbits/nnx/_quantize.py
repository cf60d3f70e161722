"""Rule-based quantization of an unmodified nnx model, through the engine.

:func:`quantize` returns a *copy* of the model (``nnx.clone``: new Variable
objects holding the original's arrays) whose ``__call__`` runs the model's
own ``__call__`` through :func:`qbits.quantize`, the jaxpr transformation,
on the model's state: ``graphdef, state = nnx.split(model)``, the forward
traced as a function of ``state``, every matmul it runs quantized by the
rules, and the new state (batch statistics, dropout keys) written back.
So every matmul the model runs is reached however it is written (Flax
layers, custom layers with ``x @ self.w``, raw ``jnp.einsum``, scanned and
rematerialised blocks), with the paths and errors of
:func:`qbits.layer_table`.

The copy is an instance of a subclass of the model's class (made once per
class) that only replaces ``__call__``; everything else, attribute access
and parameter paths included, is the model's. What quantization adds sits
in one child node, ``qbits``:

- ``qbits.rngs``: the key stream of stochastic rounding (nnx ``RngState``
  Variables, forked from the ``rngs`` given to :func:`quantize`; a
  counter-based hash key), one key per call;
- ``qbits.state``: the scale state of delayed and learned scales,
  ``{matmul path: {entry: Variable}}``, the layout of
  :func:`qbits.init_state`: :class:`ScaleState` Variables for replaced
  state (delayed scales, amax histories), ``nnx.Param`` for learned steps;
- ``qbits.stored``: the stored weights of a serving copy
  (:func:`qbits.serving.convert`).

None of it is an ``nnx.Param`` except learned steps: ``nnx.Optimizer(model,
tx, wrt=nnx.Param)`` trains the parameters and leaves the rest alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from qbits import transform
from qbits._errors import InvalidArgumentError
from qbits._sharding import like
from qbits._tensor import QTensor
from qbits.config import LayerTable, QuantConfig, _as_quant_config
from qbits.numerics import _hash_key as hash_key

STREAM = "quant"
_ATTR = "qbits"
_CALLER = transform._Caller(
    "qbits.nnx.quantize",
    key="rngs",
    state="the model's qbits.state",
    state_fix="qbits.nnx.quantize(model, config, *sample_batch) makes it",
)


class ScaleState(nnx.Variable):
    """A delayed scale or amax history; updated through the backward pass.

    The gradient of a loss with respect to these Variables is their new
    value: differentiate with respect to ``(nnx.Param, ScaleState)`` and
    call :func:`qbits.nnx.update_state`. Not an ``nnx.Param``: an optimizer
    with ``wrt=nnx.Param`` leaves it alone.

    Example:
      >>> import flax.nnx as nnx
      >>> model = qbits.nnx.quantize(nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
      ...                            "fp8_delayed", jnp.ones((2, 8)))
      >>> isinstance(model.qbits.state["kernel"]["lhs_scale"], qbits.nnx.ScaleState)
      True
    """


class StoredWeight(nnx.Variable):
    """The stored values or scales of a weight of a serving copy.

    Example:
      >>> import flax.nnx as nnx
      >>> x = jnp.ones((2, 8))
      >>> served = qbits.serving.convert(nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
      ...                                "int8_fwd", x)
      >>> served.qbits.stored["kernel"]["qvalue"][...].dtype
      dtype('int8')
    """


class Placeholder(nnx.Variable):
    """The empty stand-in (shape ``(0,)``) for a float weight a copy stores.

    Its dtype is the float weight's; the forward gets zeros of the weight's
    shape in its place (the stored weight is what the matmul uses).

    Example:
      >>> import flax.nnx as nnx
      >>> x = jnp.ones((2, 8))
      >>> served = qbits.serving.convert(nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
      ...                                "int8_fwd", x)
      >>> isinstance(served.kernel, qbits.nnx._Placeholder), served.kernel.shape
      (True, (0,))
    """


class _Quantization(nnx.Module):
    """The ``qbits`` node of a quantized copy (see the module docstring)."""

    def __init__(self, config: QuantConfig, rngs: nnx.RngStream | None):
        self.config = config
        self.rngs = rngs
        self.state = nnx.data({})
        self.stored = nnx.data({})
        # Static layout of the stored weights, and the float weights they
        # replace: ((path, qdtype, dtype, packed_axis, packed_pad, codebook),
        # ...) and ((key path, shape, dtype), ...).
        self.layout: tuple[tuple[Any, ...], ...] = ()
        self.fills: tuple[tuple[str, tuple[int, ...], str], ...] = ()
        # What serving records of the stored weights (static; its own type).
        self.info: tuple[Any, ...] = ()


_CLASSES: dict[type, type] = {}


def _quantized_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``__call__`` runs through the engine."""
    if cls not in _CLASSES:

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _run(self, cls.__call__, args, kwargs)

        call.__doc__ = cls.__call__.__doc__
        _CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__call__": call,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_qbits_model_class": cls,
            },
        )
    return _CLASSES[cls]


def _in_node(path: tuple[Any, ...], value: Any) -> bool:
    del value
    return bool(path) and path[0] == _ATTR


def _model_state(path: tuple[Any, ...], value: Any) -> bool:
    """The state a forward may change: not parameters, placeholders or ours."""
    return not (_in_node(path, value) or isinstance(value, nnx.Param | Placeholder))


def _function(module: nnx.Module, method: Callable[..., Any]) -> tuple[Any, Any]:
    """``(fn, state)``: the module's ``method`` as a function of its state."""
    graphdef, node, state = nnx.split(module, _in_node, ...)

    def fn(state: Any, *args: Any, **kwargs: Any) -> Any:
        model = nnx.merge(graphdef, node, state)
        out = method(model, *args, **kwargs)
        return out, nnx.state(model, _model_state)

    fn.graphdef = graphdef  # type: ignore[attr-defined]
    return fn, state


def as_function(model: nnx.Module) -> tuple[Callable[..., Any], Any]:
    """The model's ``__call__`` as a pure function of its state.

    What the engine quantizes, and what :func:`qbits.layer_table`,
    :func:`qbits.collect_ranges` and :func:`qbits.serving.convert` trace
    for an nnx model. For a quantized or served copy, it is the original
    model's ``__call__`` over the copy's state (without its ``qbits`` node).

    Args:
      model: A ``flax.nnx.Module``.

    Returns:
      ``(fn, state)``: ``fn(state, *args, **kwargs)`` returns ``(output,
      new state)`` (the Variables a forward may change: batch statistics,
      dropout keys), and ``state`` is the model's.

    Example:
      >>> import flax.nnx as nnx
      >>> fn, state = qbits.nnx.as_function(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
      >>> table = qbits.layer_table(fn, "int8", state, jnp.ones((2, 8)))
      >>> [row.path for row in table.rows]  # a layer alone: its kernel's path
      ['kernel']
    """
    if not isinstance(model, nnx.Module):
        raise InvalidArgumentError(
            "qbits.nnx.as_function", "model", model, "a flax.nnx.Module"
        )
    cls = getattr(type(model), "_qbits_model_class", type(model))
    return _function(model, cls.__call__)


def _filled(
    state: Any,
    fills: tuple[tuple[str, tuple[int, ...], str], ...],
    codes: dict[str, Any],
) -> Any:
    """``state`` with each placeholder given zeros of its weight's shape.

    Laid out as the weight's stored codes (``codes``: by key path), where
    they have its rank: under explicit mesh axes the program traced with
    them keeps the float model's layout after the matmul.
    """
    if not fills:
        return state
    shapes = {path: (shape, dtype) for path, shape, dtype in fills}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    out = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        found = shapes.get(name)
        if found is not None:
            leaf = jnp.zeros(found[0], found[1])
            got = codes.get(name)
            if got is not None and got.ndim == leaf.ndim:  # packed: as the codes
                leaf = like(leaf, got, range(leaf.ndim))
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def _run(module: Any, method: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    node: _Quantization = getattr(module, _ATTR)
    key = node.rngs() if node.rngs is not None else None
    fn, state = _function(module, method)
    scale = {path: {k: v[...] for k, v in entries.items()}
             for path, entries in node.state.items()}  # fmt: skip
    stored = None
    if node.layout:
        stored = {}
        for path, qdtype, dtype, packed_axis, packed_pad, codebook in node.layout:
            arrays = {k: v[...] for k, v in node.stored[path].items()}
            stored[path] = QTensor(
                arrays["qvalue"],
                arrays["scale"],
                qdtype=np.dtype(qdtype),
                dtype=np.dtype(dtype),
                packed_axis=packed_axis,
                packed_pad=packed_pad,
                zero_point=arrays.get("zero_point"),
                tensor_scale=arrays.get("tensor_scale"),
                codebook=codebook,
                scale_absmax=arrays.get("scale_absmax"),
                scale_offset=arrays.get("scale_offset"),
            )
    caller = dataclasses.replace(_CALLER, identity=(module, fn.graphdef, method))
    run = transform._quantize(  # identity: what fn is made of
        caller, fn, node.config, key, state=scale or None, stored=stored
    )
    codes = {info.param: stored[info.path].qvalue  # type: ignore[index]
             for info in node.info if info.param and stored}  # fmt: skip
    out, new = run(_filled(state, node.fills, codes), *args, **kwargs)
    nnx.update(module, new)
    return out


def _stream(rngs: Any) -> nnx.RngStream | None:
    """A stream forked from ``rngs``' ``quant`` (or default) stream, or ``None``.

    Its key is a counter-based hash key: each call's ``fold_in`` is
    a few integer operations, not a threefry loop.
    """
    if rngs is None:
        return None
    stream = None
    if isinstance(rngs, nnx.RngStream):
        stream = rngs.fork()
    elif isinstance(rngs, nnx.Rngs):
        try:
            stream = rngs[STREAM].fork()
        except (AttributeError, KeyError):
            stream = None
    if stream is None:
        raise InvalidArgumentError(
            _CALLER.owner,
            "rngs",
            rngs,
            f"None, an nnx.Rngs with a {STREAM!r} (or 'default') stream, e.g. "
            f"rngs=nnx.Rngs({STREAM}=0), or an nnx.RngStream",
        )
    return type(stream)(hash_key(stream.key[...]), tag=stream.tag)


def _check_model(model: Any) -> None:
    if hasattr(type(model), "_qbits_model_class"):
        raise InvalidArgumentError(
            _CALLER.owner,
            "model",
            type(model).__name__,
            "a model that is not quantized or served yet (quantize the original)",
        )


def _copy(model: nnx.Module, config: QuantConfig, rngs: Any) -> nnx.Module:
    """The quantized copy of ``model``, without state or stored weights yet.

    A quantized copy gives a copy of its model (its own ``qbits`` node
    replaced).
    """
    if not isinstance(model, nnx.Module):
        raise InvalidArgumentError(_CALLER.owner, "model", model, "a flax.nnx.Module")
    new = nnx.clone(model)
    cls = getattr(type(model), "_qbits_model_class", type(model))
    new.__class__ = _quantized_class(cls)
    setattr(new, _ATTR, _Quantization(config, _stream(rngs)))
    return new


def quantize(
    model: nnx.Module,
    config: Any,
    *args: Any,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
    **kwargs: Any,
) -> nnx.Module:
    """A copy of ``model`` whose every matmul runs quantized, as rules say.

    Every matmul the model's ``__call__`` runs (see :func:`qbits.quantize`:
    ``nnx.Linear``, ``nnx.Einsum``, attention, custom layers computing
    ``x @ self.w``, scanned blocks) gets the config of the first rule whose
    pattern fully matches its path (``"blocks/0/mlp/fc1"``;
    :func:`qbits.nnx.layer_table` lists them), else the default. ``model``
    itself is not changed, and nothing is patched globally.

    Args:
      model: A ``flax.nnx.Module``.
      config: A :class:`~qbits.QuantConfig`, a
        :class:`~qbits.DotGeneralConfig`, a preset name or the path of a
        YAML file.
      *args: A sample batch for ``model(*args, **kwargs)``: required when a
        config keeps scale state (its initial state is set from it: learned
        steps from these operands), optional otherwise (the configs are then
        checked against the operands at once, and unused rules reported, as
        is a config that finds nothing to quantize; without it, the first
        call reports them).
      rngs: Keys for stochastic rounding, needed when a config rounds
        stochastically (the ``int8`` preset): an ``nnx.Rngs`` with a
        ``quant`` (or ``default``) stream, or an ``nnx.RngStream``. A stream
        is forked from it; every call draws a new key. The same seed gives
        the same keys.
      **kwargs: Keyword arguments of the sample call.

    Returns:
      The quantized copy (see the module docstring): new ``Variable``
      objects holding the original's arrays, plus a ``qbits`` node.

    Raises:
      InvalidArgumentError: For a model or config of another kind, missing
        ``rngs`` for a stochastic config, or no sample batch for a config
        with scale state.
      ConfigError: For a config that does not fit a matmul (at the sample
        call, or at the first call), naming the rule and the matmul.

    Example:
      >>> import flax.nnx as nnx
      >>> class Net(nnx.Module):
      ...     def __init__(self, rngs):
      ...         self.fc1 = nnx.Linear(8, 16, rngs=rngs)
      ...         self.w = nnx.Param(jnp.ones((16, 4)))  # a raw weight
      ...     def __call__(self, x):
      ...         return nnx.relu(self.fc1(x)) @ self.w
      >>> config = qbits.QuantConfig(rules=(qbits.Rule("w", None),), default="int8")
      >>> qnet = qbits.nnx.quantize(Net(nnx.Rngs(0)), config, rngs=nnx.Rngs(quant=0))
      >>> x = jnp.ones((2, 8))
      >>> graphdef, state = nnx.split(qnet)
      >>> import qbits.hlo
      >>> qbits.hlo.dot_dtypes(lambda s: nnx.merge(graphdef, s)(x), state,
      ...                      stage="jaxpr")
      [('int8', 'int8', 'int32'), ('float32', 'float32', 'float32')]
    """
    rules = _as_quant_config(_CALLER.owner, config, allow_none=True)
    stochastic = [c for c in rules.all_configs() if c.needs_key]
    if stochastic and rngs is None:
        raise InvalidArgumentError(
            _CALLER.owner,
            "rngs",
            None,
            f"an nnx.Rngs with a {STREAM!r} (or 'default') stream, e.g. "
            f"rngs=nnx.Rngs({STREAM}=0)",
            why="a config of the rules rounds stochastically and needs keys",
        )
    _check_model(model)
    new = _copy(model, rules, rngs if stochastic else None)
    if not (args or kwargs):
        if any(c.needs_state for c in rules.all_configs()):
            raise InvalidArgumentError(
                _CALLER.owner,
                "*args",
                "no sample batch",
                "a sample batch after the config: quantize(model, config, x)",
                why="a config of the rules keeps scale state, whose initial "
                "value is set from the operands",
            )
        return new
    fn, state = as_function(new)
    table = transform._layer_table(_CALLER, fn, rules, state, *args, **kwargs)
    table.warn_unused()
    again = dataclasses.replace(_CALLER, whole=False)  # warned by the table
    initial = transform._init_state(again, fn, rules, state, *args, **kwargs)
    node: _Quantization = getattr(new, _ATTR)
    configs = table.configs()  # as the matmuls run them: which state is trained
    for path, entries in initial.items():
        kinds = configs[path].state_kinds()
        node.state[path] = {
            name: (nnx.Param if kinds[name] == "trained" else ScaleState)(value)
            for name, value in entries.items()
        }
    return new


def serving_copy(
    model: nnx.Module,
    config: QuantConfig,
    stored: dict[str, QTensor],
    fills: dict[str, tuple[tuple[int, ...], Any]],
) -> nnx.Module:
    """A copy of ``model`` that runs on stored weights (for serving).

    Args:
      model: The float model.
      config: The forward-only rules it serves with.
      stored: ``{matmul path: QTensor}`` of the stored weights (values and
        scales; zero points, tensor scales and codebooks where they have
        them: kept as :class:`StoredWeight` s ``"zero_point"`` and
        ``"tensor_scale"`` (``"scale_absmax"``, ``"scale_offset"`` for a
        double-quantized scale), the codebook as static data).
      fills: ``{key path (jax.tree_util.keystr of the model's state): (shape,
        dtype)}`` of the float weights the copy drops (a
        :class:`Placeholder` each).

    Returns:
      The serving copy: no key stream, no scale state.

    Example:
      >>> import flax.nnx as nnx
      >>> linear = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
      >>> cfg = qbits.presets.get("int8_fwd")
      >>> qt = qbits.ops._store_weight(linear.kernel[...], cfg.fwd, (0,))
      >>> served = qbits.nnx._serving_copy(
      ...     linear, qbits.QuantConfig(default=cfg), {"kernel": qt},
      ...     {"['kernel'].value": ((8, 4), jnp.float32)})
      >>> served.kernel.shape, served(jnp.ones((2, 8))).shape
      ((0,), (2, 4))
    """
    new = _copy(model, config, None)
    node: _Quantization = getattr(new, _ATTR)
    for path, qt in stored.items():
        parts = {"qvalue": qt.qvalue, "scale": qt.scale, "zero_point": qt.zero_point,
                 "tensor_scale": qt.tensor_scale, "scale_absmax": qt.scale_absmax,
                 "scale_offset": qt.scale_offset}  # fmt: skip
        node.stored[path] = {
            k: StoredWeight(v) for k, v in parts.items() if v is not None
        }
    node.layout = tuple(
        (path, np.dtype(qt.qdtype).name, np.dtype(qt.dtype).name, qt.packed_axis,
         qt.packed_pad, qt.codebook)
        for path, qt in stored.items()
    )  # fmt: skip
    node.fills = tuple(
        (path, tuple(shape), np.dtype(dtype).name)
        for path, (shape, dtype) in fills.items()
    )
    _, _, state = nnx.split(new, _in_node, ...)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    dropped = {jax.tree_util.keystr(p) for p, _ in leaves} & set(fills)
    for path, _ in leaves:
        name = jax.tree_util.keystr(path)
        if name in dropped:
            _replace(new, path, fills[name][1])
    return new


def _replace(module: nnx.Module, path: tuple[Any, ...], dtype: Any) -> None:
    """Puts an empty :class:`Placeholder` in the Variable at a state key path."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    keys = keys[:-1] if keys and keys[-1] == "value" else keys
    parent: Any = module
    for k in keys[:-1]:
        parent = parent[k] if isinstance(k, int) else getattr(parent, k)
    empty = Placeholder(jnp.zeros((0,), dtype))
    if isinstance(keys[-1], int):
        parent[keys[-1]] = empty
    else:
        setattr(parent, keys[-1], empty)


def layer_table(
    model: nnx.Module, config: Any, *args: Any, **kwargs: Any
) -> LayerTable:
    """Every matmul the nnx model runs on these inputs, and its config.

    Traces ``model(*args, **kwargs)`` (nothing is computed) as
    :func:`qbits.layer_table` traces a function; rows, paths and unused
    rules are the same as there. Works on ``nnx.eval_shape`` models.

    Args:
      model: A ``flax.nnx.Module`` (a quantized copy lists its own rules'
        configs only if ``config`` is them).
      config: As for :func:`quantize`.
      *args: Sample inputs: arrays or ``jax.ShapeDtypeStruct`` s.
      **kwargs: Keyword arguments of the call.

    Returns:
      A :class:`~qbits.config.LayerTable`.

    Raises:
      InvalidArgumentError: For sample inputs the model's ``__call__`` does
        not take (none given: they name its inputs and the call to make).

    Example:
      >>> import flax.nnx as nnx
      >>> model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)),
      ...                        nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
      >>> config = qbits.QuantConfig(rules=(qbits.Rule("layers/1", None),),
      ...                            default="int8_fwd")
      >>> for row in qbits.nnx.layer_table(model, config, jnp.ones((2, 8))).rows:
      ...     print(row.path, row.describe())
      layers/0 int8_fwd
      layers/1 float
    """
    caller = dataclasses.replace(_CALLER, owner="qbits.nnx.layer_table")
    rules = _as_quant_config(caller.owner, config, allow_none=True)
    fn, state = as_function(model)
    cls = getattr(type(model), "_qbits_model_class", type(model))
    call = "qbits.nnx.layer_table(model, config, {inputs})"
    caller.check_inputs(cls.__call__.__get__(model), args, kwargs, call)
    return transform._layer_table(caller, fn, rules, state, *args, **kwargs)


def update_state(model: nnx.Module, grads: Any) -> Any:
    """Writes the new scale state in ``grads`` into ``model``.

    A loss that runs the model several times (micro-batches) converts its
    state once with :func:`qbits.DelayedScaling.max_combining` first, so that
    the new states of the uses combine with max.

    Args:
      model: The model the gradients were taken of.
      grads: The ``nnx.State`` from ``nnx.grad`` with respect to
        ``(nnx.Param, qbits.nnx.ScaleState)``.

    Returns:
      The gradients without the state: what ``nnx.Optimizer.update`` takes.

    Example:
      >>> import flax.nnx as nnx, optax
      >>> x = jnp.full((2, 8), 2.0)
      >>> model = qbits.nnx.quantize(nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
      ...                            "fp8_delayed", x)
      >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> wrt = nnx.DiffState(0, (nnx.Param, qbits.nnx.ScaleState))
      >>> @nnx.jit
      ... def step(model, opt, x):
      ...     grads = nnx.grad(lambda m: m(x).sum(), argnums=wrt)(model)
      ...     opt.update(model, qbits.nnx.update_state(model, grads))
      >>> step(model, opt, x)
      >>> model.qbits.state["kernel"]["lhs_amax_history"][:2]
      Array([2., 0.], dtype=float32)
    """
    state, params = nnx.split_state(grads, ScaleState, ...)
    nnx.update(model, state)
    return params
