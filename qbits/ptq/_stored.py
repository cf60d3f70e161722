"""The stored weight of a PTQ'd matmul: the method's own codes and scales.

:func:`~qbits.ptq.quantize_weights` works on each weight as ``(K, N)``
matrices (:meth:`~qbits.ptq.MatmulStats.matrix`: one per layer of a scan,
one per group of a grouped weight) with scales in the layout of the
quantizer on that matrix, ``(K // group, N // block_n)``. Serving stores
the weight operand as the matmul sees it (:func:`qbits.ops.store_weight`:
the quantizer along the operand's contracting axes, 4-bit values packed
along the last axis, scanned layers stacked first). :func:`stored_weight`
maps the one onto the other: each per-block parameter (scale, zero point,
tensor scale) is spread over its block's entries, moved to the operand's
layout by the inverse of ``matrix``, and read back per block of the
operand's own quantization; the codes are the weight's values on that
grid. Dequantized, the stored weight is the method's float weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qbits._quantizer import Quantizer
from qbits.ops import MatmulConfig, store_weight
from qbits.ptq._collect import MatmulStats
from qbits.ptq._gptq import GptqResult
from qbits.tensor import QTensor

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
      :func:`qbits.transform.store_weights` gives for this matmul, with the
      given grids' scales in place of freshly calibrated ones), or ``None``
      where the grids' blocks are not the operand's own (a weight with
      several contracting axes tiled along their flattening, a tensor scale
      per group of a grouped weight): serving then quantizes that weight
      again.
    """
    weight = jnp.asarray(weight)
    per_layer = len(grids) // max(1, math.prod(ms.layers))
    out = []
    for i, layer in enumerate(np.ndindex(*ms.layers)):
        mine = grids[i * per_layer : (i + 1) * per_layer]
        qt = _one_layer(ms, weight[layer], quantizer, mine)
        if qt is None:
            return None
        out.append(qt)
    if not ms.layers:
        return out[0]
    return jax.tree.map(lambda *a: jnp.stack(a).reshape(*ms.layers, *a[0].shape), *out)


def _spread(ms: MatmulStats, parts: Sequence[jax.Array]) -> jax.Array:
    """Per-block parameters of each ``(K, N)`` matrix, per entry of the operand.

    ``parts``: one array of blocks per matrix (per group, for a grouped
    weight), or a scalar (a tensor scale).
    """
    # The inverse of ms.matrix: which entry of the operand each matrix
    # entry is.
    where = ms.matrix(jnp.arange(math.prod(ms.shape)).reshape(ms.shape))
    k, n = where.shape[-2:]
    full = []
    for p in parts:
        p = jnp.asarray(p, jnp.float32).reshape((1, 1) if jnp.ndim(p) == 0 else p.shape)
        full.append(jnp.repeat(jnp.repeat(p, k // p.shape[0], 0), n // p.shape[1], 1))
    mats = jnp.stack(full) if ms.grouped else full[0]
    flat = jnp.zeros(math.prod(ms.shape), jnp.float32)
    return flat.at[where.reshape(-1)].set(mats.reshape(-1)).reshape(ms.shape)


def _per_block(full: jax.Array, shape: tuple[int, ...]) -> jax.Array | None:
    """``full`` once per block of a scale of ``shape``; ``None`` if it varies inside."""
    steps = tuple(n // s for n, s in zip(full.shape, shape, strict=True))
    block = full[tuple(slice(None, None, s) for s in steps)]
    spread = block
    for axis, s in enumerate(steps):
        spread = jnp.repeat(spread, s, axis)
    return block if bool(jnp.array_equal(spread, full)) else None


def _one_layer(
    ms: MatmulStats, w: jax.Array, quantizer: Quantizer, grids: Sequence[GptqResult]
) -> QTensor | None:
    """One layer's stored weight (``w`` in the operand's layout)."""
    ref = store_weight(w, MatmulConfig(rhs=quantizer), ms.contracting)
    scale = _per_block(_spread(ms, [g.scale for g in grids]), ref.scale.shape)
    if scale is None:
        return None
    zero = tensor = None
    if ref.zero_point is not None:
        zero = _per_block(_spread(ms, [g.zero_point for g in grids]), scale.shape)
        if zero is None:
            return None
    if ref.tensor_scale is not None:
        tensor = _per_block(_spread(ms, [g.tensor_scale for g in grids]), (1,) * w.ndim)
        if tensor is None:
            return None
    return _encode(w, quantizer, ref, scale, zero, tensor, ms.contracting)


def _encode(
    w: jax.Array,
    quantizer: Quantizer,
    ref: QTensor,
    scale: jax.Array,
    zero: jax.Array | None,
    tensor: jax.Array | None,
    contracting: tuple[int, ...],
) -> QTensor:
    """The codes of ``w`` (on the grid) with these parameters, stored as ``ref``."""
    numerics = quantizer.numerics
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
            q.astype(ref.storage_dtype),
            scale.astype(ref.scale.dtype),
            qdtype=ref.qdtype,
            dtype=w.dtype,
            zero_point=None if zero is None else zero.astype(ref.zero_point.dtype),
            tensor_scale=None if tensor is None else tensor.astype(jnp.float32),
            codebook=ref.codebook,
        )
    if ref.packed_axis is not None:
        qt = qt.pack(axis=ref.packed_axis)
    return qt
