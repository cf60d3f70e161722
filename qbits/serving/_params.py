"""Serving params: a function's stored low-precision weights, any pytree.

:func:`convert_params` traces the function as :func:`qbits.quantize` does
(the engine's ``store_weights``) and stores every weight matmul
whose forward config quantizes the weight: custom layers, einsum weights,
``x @ w``, tied heads and scanned layers as much as Flax's own ``Dense``.
Each stored weight is the QTensor the training (QAT) forward pass computes
at every step. The float parameter it replaces becomes an empty
placeholder (shape ``(0,)``, its dtype) wherever it sits in the parameter
tree (a dict, linen variables, an nnx ``State``, an equinox module, a
dataclass node), unless something else reads it (an embedding lookup reads
a tied head's table). The layout of every stored weight, and its forward
config, ride along as static metadata (a ``LayerInfo`` row per stored weight),
also under ``jax.jit``.

:func:`serve_params` runs the function with ``qbits.quantize(fn, config,
stored=...)`` on the params with zeros in the placeholders: the stored
matmuls on their stored weights, every other quantized matmul quantizing on
the fly, as in training. Its output equals ``qbits.quantize(fn, config)`` on
the float parameters bit for bit.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.core import FrozenDict, unfreeze

from qbits import transform
from qbits._errors import InvalidArgumentError
from qbits._sharding import like
from qbits._tensor import QTensor
from qbits.config import QuantConfig
from qbits.serving._layout import (
    LayerInfo,
    check_layers,
    check_stored,
    fingerprint,
    forward_only,
    stored_parts,
    stored_qtensor,
)

__all__ = [
    "ORDER",
    "ServingParams",
    "convert_params",
    "replaced",
    "serve_params",
    "store",
]


# A stored weight's optional array: the order of its contracting inputs.
ORDER = "input_order"


class ServingParams(struct.PyTreeNode):
    """The parameters of a served model or function, with their stored weights.

    A pytree: ``params`` and ``weights`` are its leaves (pass it through
    ``jax.jit``); ``layers`` is static metadata, available while tracing.

    Attributes:
      params: The float parameters as given to :func:`qbits.serving.convert`
        (any pytree), each parameter that a stored weight replaces an empty
        placeholder (shape ``(0,)``, its dtype).
      weights: ``{matmul path: {"qvalue": array, "scale": array}}``: the
        stored weights (with ``"zero_point"`` for asymmetric grids,
        ``"tensor_scale"`` for NVFP4's two-level scales,
        ``"scale_absmax"`` and ``"scale_offset"`` beside a double-quantized
        scale's uint8 codes (``nf4_dq``), and
        ``"input_order"`` for a weight whose rows hold its inputs in
        another order, an act-order GPTQ checkpoint's: the matmul then
        multiplies ``x[..., input_order]``).
      layers: One ``LayerInfo`` per stored weight: its path, kind, shape
        and dtype as the matmul sees it, contracting axes, stored format,
        packing, the key path of the float parameter it replaces and its
        forward config.

    Example:
      >>> import flax.linen as nn
      >>> x = jnp.ones((2, 8))
      >>> params = nn.Dense(4).init(jax.random.key(0), x)
      >>> sp = qbits.serving.convert(nn.Dense(4), "int8_fwd", params, x)
      >>> jax.tree.map(lambda a: f"{a.dtype.name}{list(a.shape)}", sp.params)
      {'params': {'bias': 'float32[4]', 'kernel': 'float32[0]'}}
      >>> sp.weights["kernel"]["qvalue"].dtype  # a Dense alone: its kernel's path
      dtype('int8')
    """

    params: Any
    weights: dict[str, dict[str, jax.Array]]
    layers: tuple[LayerInfo, ...] = struct.field(pytree_node=False, default=())

    def layer(self, path: str) -> LayerInfo:
        """The stored weight of the matmul at ``path``.

        Raises:
          KeyError: If no stored weight has that path.
        """
        for info in self.layers:
            if info.path == path:
                return info
        raise KeyError(path)


def _params(owner: str, params: Any) -> Any:
    """The float parameters, checked (linen's FrozenDict as a plain dict)."""
    if isinstance(params, ServingParams):
        raise InvalidArgumentError(
            owner,
            "params",
            "serving params",
            "float parameters",
            why="they are converted already",
        )
    if isinstance(params, FrozenDict):
        params = unfreeze(params)
    if not jax.tree.leaves(params):
        raise InvalidArgumentError(
            owner,
            "params",
            type(params).__name__,
            "the float parameters: a pytree of arrays (a linen model's "
            "model.init(...), a dict, an nnx State, an equinox module)",
        )
    return params


def store(
    owner: str,
    fn: Callable[..., Any],
    config: QuantConfig,
    params: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    given: Mapping[str, QTensor] | None = None,
) -> tuple[dict[str, QTensor], dict[str, tuple[tuple[int, ...], Any]], list]:
    """The stored weights of ``fn(params, *args)``, what they replace, and infos.

    ``given``: stored weights to keep instead of quantizing the float
    weights (post-training quantization's own codes and scales), each
    checked against the layout the config stores.

    Returns:
      ``(stored, fills, layers)``: ``{matmul path: QTensor}``; ``{key path
      (jax.tree_util.keystr) of a dropped parameter: (shape, dtype)}``; one
      :class:`LayerInfo` per stored weight.
    """
    fwd = forward_only(config)
    caller = transform._Caller(owner)
    on_the_fly: dict[str, str] = {}
    found = transform._store_weights(
        caller, fn, fwd, params, *args, on_the_fly=on_the_fly, **kwargs
    )
    if not found:
        _warn_none_stored(owner, config, on_the_fly)
    for name, qt in (given or {}).items():
        if name not in found:
            raise InvalidArgumentError(
                owner,
                "stored",
                f"a stored weight for {name!r}",
                "stored weights of the matmuls whose config stores a weight ("
                + (", ".join(repr(n) for n in found) or "none")
                + "): quantize_weights with the config given to convert",
            )
        found[name] = replace(found[name], weight=_given(owner, name, qt, found[name]))
    stored: dict[str, QTensor] = {}
    fills: dict[str, tuple[tuple[int, ...], Any]] = {}
    layers = []
    for name, s in found.items():
        dropped: dict[str, Any] = {}
        if s.exclusive:
            param = jax.tree_util.keystr(s.keys)
            fills[param] = (s.shape, np.dtype(s.dtype))
            dropped = dict(
                param=param, param_shape=s.shape, param_dtype=np.dtype(s.dtype).name
            )
        stored[name] = s.weight
        cfg = fwd.resolve(name).config.fwd
        layers.append(
            LayerInfo(
                path=name,
                kind=s.kind,
                shape=tuple(int(n) for n in s.weight.shape),
                dtype=np.dtype(s.weight.dtype).name,
                contracting=s.contracting,
                qdtype=np.dtype(cfg.rhs.numerics.get_dtype()).name,
                packed=s.weight.packed_axis is not None,
                config=fingerprint(cfg),
                name=config.resolve(name).name or "",
                **dropped,
            )
        )
    return stored, fills, layers


def _warn_none_stored(owner: str, rules: QuantConfig, on_the_fly: dict) -> None:
    """Warns that a config that quantizes something stored no weight: why."""
    if all(c.fwd.is_identity for c in rules.all_configs()):
        return  # float on purpose
    if on_the_fly:
        shown = [f"{path!r} ({where})" for path, where in list(on_the_fly.items())[:4]]
        more = f" and {len(on_the_fly) - 4} more" if len(on_the_fly) > 4 else ""
        why = (
            "every weight matmul the config quantizes has its weight quantized "
            "on the fly, at each call, from the float weight the served params "
            f"keep: {', '.join(shown)}{more}. A stored weight cannot enter a "
            "cond, while or shard_map body, and convolutions and ragged dots "
            "are served as in training"
        )
    else:
        why = (
            "no weight matmul's config quantizes its weight, so every weight "
            "stays float. Check the rules (qbits.layer_table)"
        )
    warnings.warn(
        f"{owner} stored no low-precision weights: {why}",
        UserWarning,
        stacklevel=transform._outside(),
    )


def _layout(qt: QTensor) -> str:
    """How a stored weight is laid out: formats, shapes and packing."""

    def part(label: str, x: Any) -> str:
        if x is None:
            return ""
        return f", {label} {np.dtype(x.dtype).name}{list(np.shape(x))}"

    packed = ", packed" if qt.packed_axis is not None else ""
    return (
        f"{np.dtype(qt.qdtype).name}{list(qt.shape)}{packed} as "
        f"{np.dtype(qt.qvalue.dtype).name}{list(qt.qvalue.shape)}"
        + part("scale", qt.scale)
        + part("zero point", qt.zero_point)
        + part("tensor scale", qt.tensor_scale)
        + part("scale absmax", qt.scale_absmax)
        + part("scale offset", qt.scale_offset)
        + (", codebook" if qt.codebook is not None else "")
    )


def _given(owner: str, name: str, qt: Any, found: Any) -> QTensor:
    """A given stored weight, checked against the one the config stores."""
    want = _layout(found.weight)
    got = _layout(qt) if isinstance(qt, QTensor) else f"a {type(qt).__name__}"
    if got != want or qt.codebook != found.weight.codebook:
        raise InvalidArgumentError(
            owner,
            f"stored[{name!r}]",
            got,
            f"{want}, the weight this config stores",
            why="quantized with another config? Run quantize_weights with the "
            "config given to convert",
        )
    return qt.replace(dtype=found.weight.dtype)


def replaced(tree: Any, fills: Mapping[str, Any], fill: Callable[..., Any]) -> Any:
    """``tree`` with each leaf at a key path of ``fills`` replaced by ``fill``."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, leaf in leaves:
        found = fills.get(jax.tree_util.keystr(path))
        out.append(leaf if found is None else fill(leaf, *found))
    return jax.tree.unflatten(treedef, out)


def convert_params(
    owner: str,
    fn: Callable[..., Any],
    config: QuantConfig,
    params: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    given: Mapping[str, QTensor] | None = None,
) -> ServingParams:
    """Serving params of ``fn(params, *args, **kwargs)``; see ``convert``."""
    params = _params(owner, params)
    stored, fills, layers = store(owner, fn, config, params, args, kwargs, given)
    served = replaced(params, fills, lambda leaf, _, dtype: jnp.zeros((0,), dtype))
    weights = {name: _arrays(qt) for name, qt in stored.items()}
    return ServingParams(served, weights, tuple(layers))


def _arrays(qt: QTensor) -> dict[str, jax.Array]:
    """A stored weight's arrays: values, scales and what the format adds."""
    arrays = {"qvalue": qt.qvalue, "scale": qt.scale}
    for name in ("zero_point", "tensor_scale", "scale_absmax", "scale_offset"):
        if getattr(qt, name) is not None:
            arrays[name] = getattr(qt, name)
    return arrays


def _unpack(owner: str, config: QuantConfig, serving: Any) -> tuple[Any, dict, dict]:
    """The parameters to trace with (zeros filled in), the stored QTensors, orders."""
    if not isinstance(serving, ServingParams):
        why = "these are not serving params"
        if isinstance(serving, Mapping):
            why = "these look like float parameters: run convert first"
        raise InvalidArgumentError(
            owner,
            "serving",
            type(serving).__name__,
            "qbits.serving.ServingParams from qbits.serving.convert(model, "
            "config, params, *sample_inputs) or qbits.serving.restore",
            why=why,
        )
    fwd = forward_only(config)
    check_layers(owner, fwd, config, serving.layers)
    stored, fills, orders = {}, {}, {}
    for info in serving.layers:
        arrays = serving.weights.get(info.path)
        quantizer = fwd.resolve(info.path).config.fwd.rhs
        parts = stored_parts(quantizer)
        if isinstance(arrays, Mapping) and ORDER in arrays:
            arrays = dict(arrays)
            orders[info.path] = arrays.pop(ORDER)
            _check_order(owner, info, orders[info.path])
        if not isinstance(arrays, Mapping) or set(arrays) != set(parts):
            raise InvalidArgumentError(
                owner,
                f"serving.weights[{info.path!r}]",
                type(arrays).__name__,
                "{" + ", ".join(f"'{p}': array" for p in parts) + "}, as "
                "convert stores them",
            )
        check_stored(owner, info, **arrays)
        stored[info.path] = stored_qtensor(info, arrays, quantizer)
        if info.param:
            fills[info.param] = (info.param_shape, info.param_dtype, arrays["qvalue"])

    def fill(leaf: Any, shape: tuple[int, ...], dtype: str, codes: Any) -> jax.Array:
        if tuple(jnp.shape(leaf)) != (0,):
            raise InvalidArgumentError(
                owner,
                "serving",
                f"serving params holding a float parameter at {info_of(leaf)}",
                "the serving params from qbits.serving.convert",
                why="a stored weight serves in its place",
            )
        return zeros_like_codes(shape, dtype, codes)

    def info_of(leaf: Any) -> str:
        return f"a {np.dtype(leaf.dtype).name}{list(jnp.shape(leaf))} leaf"

    return replaced(serving.params, fills, fill), stored, orders


def _check_order(owner: str, info: LayerInfo, order: Any) -> None:
    """An input order is an int permutation of the weight's contracting inputs."""
    k = math.prod(info.shape[a] for a in info.contracting)
    bad = jnp.shape(order) != (k,) or not jnp.issubdtype(
        jnp.result_type(order), jnp.integer
    )
    if not bad and not isinstance(order, jax.core.Tracer):  # its values: a permutation
        bad = not np.array_equal(np.sort(np.asarray(order)), np.arange(k))
    if bad:
        raise InvalidArgumentError(
            owner,
            f"serving.weights[{info.path!r}][{ORDER!r}]",
            f"{jnp.result_type(order).name}{list(jnp.shape(order))}",
            f"an integer permutation of the {k} contracting inputs",
        )


def _in_order(matmul: Any, rows: jax.Array, order: jax.Array) -> jax.Array:
    """The activation's rows ``(..., K)`` with their inputs in ``order``."""
    return jnp.take(rows, order, axis=-1)


# Runs the matmuls whose stored weight holds its inputs in another order
# (an act-order GPTQ checkpoint: qbits.interop) on x[..., order].
_ORDERED = transform.Adapter(before=_in_order)


def serve_params(
    owner: str, fn: Callable[..., Any], config: QuantConfig
) -> Callable[..., Any]:
    """``served(serving_params, *args, **kwargs)`` running ``fn`` on them."""
    caller = transform._Caller(owner)

    def served(serving: Any, *args: Any, **kwargs: Any) -> Any:
        params, stored, orders = _unpack(owner, config, serving)
        fwd = forward_only(config)
        if orders:
            run = transform._adapt(caller, fn, fwd, _ORDERED, orders, stored=stored)
        else:
            run = transform._quantize(caller, fn, fwd, stored=stored)
        return run(params, *args, **kwargs)

    return served


def zeros_like_codes(shape: tuple[int, ...], dtype: Any, codes: Any) -> jax.Array:
    """Zeros for a dropped float weight, laid out as its stored codes.

    The program is traced with them: under explicit mesh axes their
    sharding is in its types (what follows the matmul keeps the float
    model's layout). Packed codes (half the last axis) lay out the axes
    they share with the weight; codes of another rank nothing.
    """
    zeros = jnp.zeros(shape, dtype)
    if codes is None or jnp.ndim(codes) != len(shape):
        return zeros
    return like(zeros, codes, range(len(shape)))
