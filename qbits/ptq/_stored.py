"""The stored weight of a PTQ'd matmul: the method's own codes and scales.

:func:`~qbits.ptq.quantize_weights` works on each weight as ``(K, N)``
matrices (:meth:`~qbits.ptq.MatmulStats.matrix`: one per layer of a scan,
one per group of a grouped weight) with scales in the layout of the
quantizer on that matrix, ``(K // group, N // block_n)``. Serving stores
the weight operand as the matmul sees it (the quantizer along the
operand's contracting axes, 4-bit values packed along the last axis,
scanned layers stacked first). :func:`stored_weight`
maps the one onto the other: each per-block parameter (scale, zero point,
tensor scale) is spread over its block's entries, moved to the operand's
layout by the inverse of ``matrix``, and read back once per block of the
operand's own quantization (on the host: these are small); the codes are
the weight's values on that grid. Dequantized, the stored weight is the
method's float weight, bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits._sharding import like
from qbits._tensor import QTensor
from qbits.ops import MatmulConfig, _store_weight
from qbits.ptq._collect import MatmulStats
from qbits.ptq._gptq import GptqResult

__all__ = ["stored_weight"]


def stored_weight(
    ms: MatmulStats,
    weight: jax.Array,
    quantizer: Quantizer,
    grids: Sequence[GptqResult],
) -> QTensor | None:
    """The weight of ``ms`` as serving stores it, on the grids given.

    Args:
      ms: The matmul.
      weight: Its new parameter (all layers), on the grids.
      quantizer: The weight's quantizer.
      grids: Per layer, then per group (row-major), the scales, zero points
        and tensor scale of the weight's ``(K, N)`` matrix.

    Returns:
      The stored :class:`~qbits.QTensor` (what
      the engine's ``store_weights`` gives for this matmul, with the
      given grids' scales in place of freshly calibrated ones), or ``None``
      where the grids' blocks are not the operand's own (a tensor scale per
      group of a grouped weight, where the operand has one), or where the
      quantizer fits the ``(K, N)`` matrix but not the operand's own axes
      (``Tiled(128)`` over a per-head weight's 32-wide head axis; serving
      refuses that config for this weight).
    """
    weight = jnp.asarray(weight)
    one = jax.ShapeDtypeStruct(ms.shape, weight.dtype)
    try:
        ref = jax.eval_shape(
            functools.partial(
                _store_weight,
                cfg=MatmulConfig(rhs=quantizer),
                contracting=ms.contracting,
            ),
            one,
        )
    except InvalidArgumentError:  # the blocks fit (K, N), not the operand's axes
        return None
    # Which entry of the operand each entry of the (K, N) matrices is.
    where = np.asarray(ms.matrix(jnp.arange(math.prod(ms.shape)).reshape(ms.shape)))
    shapes = {"scale": ref.scale.shape}  # each per-block parameter's blocks
    if ref.zero_point is not None:
        shapes["zero_point"] = ref.scale.shape
    if ref.tensor_scale is not None:
        shapes["tensor_scale"] = ref.tensor_scale.shape
    layers = max(1, math.prod(ms.layers))
    per_layer = len(grids) // layers
    found: dict[str, list[np.ndarray]] = {name: [] for name in shapes}
    for i in range(layers):
        mine = grids[i * per_layer : (i + 1) * per_layer]
        for name, shape in shapes.items():
            full = _spread(ms, where, [getattr(g, name) for g in mine])
            block = _per_block(full, shape)
            if block is None:
                return None
            found[name].append(block)
    # Layers flattened; each block's axis sharded as the weight's (the
    # scales of a sharded weight live with its shards).
    lead = (0,) if len(ms.layers) == 1 else (None,)
    same = tuple(weight.shape) == (*ms.layers, *ms.shape)
    own = tuple(len(ms.layers) + a if same else None for a in range(len(ms.shape)))
    axes = (*lead, *own)
    arrays = {name: like(np.stack(v), weight, axes) for name, v in found.items()}
    layout = (
        np.dtype(ref.storage_dtype).name,
        np.dtype(ref.scale.dtype).name,
        np.dtype(ref.qdtype).name,
        None if ref.zero_point is None else np.dtype(ref.zero_point.dtype).name,
        ref.codebook,
        ref.packed_axis,
    )
    return _encode_layers(
        weight, arrays, quantizer, ms.contracting, layout, tuple(ms.layers)
    )


def _spread(ms: MatmulStats, where: np.ndarray, parts: Sequence[Any]) -> np.ndarray:
    """Per-block parameters of each ``(K, N)`` matrix, per entry of the operand.

    ``parts``: one array of blocks per matrix (per group, for a grouped
    weight), or a scalar (a tensor scale).
    """
    k, n = where.shape[-2:]
    full = []
    for p in parts:
        p = np.asarray(p, np.float32)
        p = p.reshape((1, 1) if p.ndim == 0 else p.shape)
        full.append(np.repeat(np.repeat(p, k // p.shape[0], 0), n // p.shape[1], 1))
    mats = np.stack(full) if ms.grouped else full[0]
    out = np.zeros(math.prod(ms.shape), np.float32)
    out[where.reshape(-1)] = mats.reshape(-1)
    return out.reshape(ms.shape)


def _per_block(full: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``full`` once per block of a scale of ``shape``; ``None`` if it varies inside."""
    steps = tuple(n // s for n, s in zip(full.shape, shape, strict=True))
    block = full[tuple(slice(None, None, s) for s in steps)]
    spread = block
    for axis, s in enumerate(steps):
        spread = np.repeat(spread, s, axis)
    return block if np.array_equal(spread, full) else None


@functools.partial(
    jax.jit, static_argnames=("quantizer", "contracting", "layout", "layers")
)
def _encode_layers(
    w: jax.Array,
    arrays: dict[str, jax.Array],
    quantizer: Quantizer,
    contracting: tuple[int, ...],
    layout: tuple[Any, ...],
    layers: tuple[int, ...],
) -> QTensor:
    """The codes of ``w`` (on the grid) with these parameters, layer by layer.

    ``arrays``: its scale (and zero point, tensor scale) per block, per
    layer (flattened); ``layout``: the stored dtypes of the values, scales,
    format and zero points, the codebook and the packed axis.
    """

    def encode(w: jax.Array, arrays: dict[str, jax.Array]) -> QTensor:
        storage, scale_dtype, qdtype, zero_dtype, codebook, packed_axis = layout
        numerics = quantizer.numerics
        scale = arrays["scale"]
        zero, tensor = arrays.get("zero_point"), arrays.get("tensor_scale")
        if zero is None and tensor is None:  # values and scales: the quantizer's path
            qt, _ = quantizer.quant_vjp(
                w, store=True, contracting_axes=contracting, scale=scale
            )
        else:
            x = w.astype(jnp.float32)

            def full(p: jax.Array) -> jax.Array:
                for axis, n in enumerate(x.shape):
                    p = jnp.repeat(p, n // p.shape[axis], axis)
                return p

            if tensor is not None:  # two-level (NVFP4): blocks of scale 0 hold zeros
                total = full(scale * tensor)
                y = jnp.where(total == 0, x, x / jnp.where(total == 0, 1.0, total))
            else:
                y = x / full(scale) + full(zero)
            q = numerics.fwd(y, None)
            if hasattr(numerics, "codes"):  # a codebook's indices (NF4)
                q = numerics.codes(q)
            qt = QTensor(
                q.astype(storage),
                scale.astype(scale_dtype),
                qdtype=np.dtype(qdtype),
                dtype=w.dtype,
                zero_point=None if zero is None else zero.astype(zero_dtype),
                tensor_scale=None if tensor is None else tensor.astype(jnp.float32),
                codebook=codebook,
            )
        if packed_axis is not None:
            qt = qt.pack(axis=packed_axis)
        return qt

    if not layers:
        return encode(w, jax.tree.map(lambda a: a[0], arrays))
    n = math.prod(layers)
    qt = jax.vmap(encode)(w.reshape(n, *w.shape[len(layers) :]), arrays)
    return jax.tree.map(lambda a: a.reshape(*layers, *a.shape[1:]), qt)
