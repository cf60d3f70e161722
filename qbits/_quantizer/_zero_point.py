r"""Asymmetric quantization: a scale and an integer zero point per block.

With :class:`~qbits.numerics.UintNumerics` (codes ``0 .. top``, ``top =
2**bits - 1``) a block's range ``[lo, hi]`` maps onto ``[0, top]``:

.. math:: s = \frac{hi - lo}{top}, \qquad z = \mathrm{round}(-lo / s),
          \qquad q = \mathrm{clip}(\mathrm{round}(x / s + z), 0, top),
          \qquad \hat{x} = (q - z)\, s.

The range comes from the quantizer's calibration, applied to the block's
values around the midpoint ``m = (min + max) / 2`` of their range: a bound
``b`` gives ``[m - b, m + b]``. :class:`~qbits.AbsMax` gives the min-max
range (the smallest value maps onto code 0 and the largest onto ``top``,
up to the rounding of the zero point), :class:`~qbits.MseSearch` shrinks it
around the midpoint to the least squared error, ``AbsMax(clip_factor)``
shrinks it by a fixed factor.

Zero points are stored as ``int16`` (:data:`ZERO_POINT_DTYPE`), in
``[top - 32767, 32767]``: a block whose range lies so far from zero that
its zero point would leave that interval (a narrow range far from zero, a
constant block) has its range widened towards zero just enough that it
fits, so no value clips; only its resolution is coarser. A block of zeros
has scale 1 and zero point 0 (exact zeros, with the straight-through
gradient), a block holding a NaN or an inf a NaN scale, as everywhere in
qbits (its codes and zero point are then unspecified).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._quantizer._storage import Blocked, encode, to_storage
from qbits._tensor import QTensor
from qbits.numerics import UintNumerics

__all__ = ["ZERO_POINT_DTYPE", "quantize_asymmetric", "scale_and_zero_point"]

#: How stored zero points are kept.
ZERO_POINT_DTYPE = np.dtype(np.int16)
_Z_MAX = int(np.iinfo(ZERO_POINT_DTYPE).max)
_TINY = float(np.finfo(np.float32).tiny)


def scale_and_zero_point(
    lo: jax.Array, hi: jax.Array, top: int
) -> tuple[jax.Array, jax.Array]:
    """The scale and the (integer-valued, float) zero point of ranges ``[lo, hi]``.

    See the module docstring: the range is widened towards zero where the
    zero point would leave ``[top - 32767, 32767]``; a zero range gives
    scale 1, zero point 0; scales are at least float32's smallest normal.

    Example:
      >>> from qbits._quantizer._zero_point import scale_and_zero_point
      >>> lo, hi = jnp.array([-1.5, 3.0, 7.0]), jnp.array([6.0, 10.5, 7.0])
      >>> s, z = scale_and_zero_point(lo, hi, 15)
      >>> s.tolist(), z.tolist()  # a constant block: widened to [0, 7]
      ([0.5, 0.5, 0.0002136], [3.0, -6.0, -32752.0])
    """
    dtype = lo.dtype
    reach = _Z_MAX - top  # the zero point lies in [-reach, top + reach]
    k = np.asarray(reach / (top + reach), dtype)
    span = np.asarray(top + reach, dtype)
    zero = lax.full_like(lo, 0)
    # Widened towards zero: the range [-reach s, top s] or [-(top + reach) s,
    # -reach s] whose far end is the block's (exactly, so that a constant
    # block maps onto the top or bottom code and back).
    up = lax.bitwise_and(lax.gt(hi, zero), lax.gt(lo, lax.mul(hi, k)))
    down = lax.bitwise_and(lax.lt(lo, zero), lax.lt(hi, lax.mul(lo, k)))
    # (hi - lo) / top without overflow for huge ranges, and one rounding
    # whether or not the compiler contracts it into an FMA (halving is exact:
    # hi/top - lo/top, which XLA turns into two multiplies by 1/top, rounds
    # differently where LLVM fuses them, so two programs disagreed).
    half = np.asarray(0.5, dtype)
    t = np.asarray(top * 0.5, dtype)
    scale = lax.div(lax.sub(lax.mul(hi, half), lax.mul(lo, half)), t)
    scale = lax.select(up, lax.div(hi, span), scale)
    scale = lax.select(down, lax.div(lax.neg(lo), span), scale)
    empty = lax.eq(scale, zero)
    scale = lax.max(scale, lax.full_like(scale, _TINY))  # NaN stays NaN
    scale = lax.select(empty, lax.full_like(scale, 1), scale)
    z = lax.round(lax.neg(lax.div(lo, scale)), lax.RoundingMethod.TO_NEAREST_EVEN)
    z = lax.clamp(np.asarray(-reach, dtype), z, span)
    z = lax.select(up, lax.full_like(z, -reach), z)
    z = lax.select(down, lax.full_like(z, top + reach), z)
    return scale, lax.select(empty, zero, z)


def _fake(
    numerics: UintNumerics,
    x: jax.Array,
    scale: jax.Array,
    zero: jax.Array,
    context: Any,
) -> jax.Array:
    """``(numerics(x / s + z) - z) * s``, the value on the grid."""
    return (numerics.fwd(x / scale + zero, context) - zero) * scale


def quantize_asymmetric(
    request: Any, found: Blocked, vjp: bool
) -> tuple[QTensor, jax.tree_util.Partial | None]:
    """Quantizes a request with a :class:`UintNumerics` grid, in its blocks.

    A scale and a zero point per block; the result as
    :func:`qbits._quantizer.quantize_all` gives it, with its gradient.
    """
    layout, xb, xs, no_grad = found
    numerics: UintNumerics = request.quantizer.numerics
    x, context, axes = request.x, request.context, layout.reduce_axes
    if x.size:
        lo = jnp.min(xs, axis=axes, keepdims=True)
        hi = jnp.max(xs, axis=axes, keepdims=True)
    else:
        lo = hi = jnp.zeros(layout.reduced_shape, xs.dtype)
    half = np.asarray(0.5, xs.dtype)
    mid = lo * half + hi * half  # no overflow, unlike (lo + hi) / 2

    def quantize(v: jax.Array, bound: jax.Array) -> jax.Array:
        s, z = scale_and_zero_point(mid - bound, mid + bound, numerics.top)
        return _fake(numerics, v + mid, s, z, context) - mid

    calibration = request.quantizer.calibration
    bound = calibration(xs - mid, axes, quantize) if x.size else lo
    scale, zero = scale_and_zero_point(mid - bound, mid + bound, numerics.top)
    scale, zero = no_grad(scale), no_grad(zero)
    codes, grad = encode(numerics, xb / scale + zero, context, layout, vjp)
    codes = codes.reshape(x.shape)
    zero = zero.reshape(layout.scale_shape)
    if request.store:
        codes = to_storage(codes, numerics.get_dtype(), saturate=False, guard=not vjp)
        zero = zero.astype(ZERO_POINT_DTYPE)
    qt = QTensor(
        codes,
        scale.reshape(layout.scale_shape).astype(jnp.float32),
        qdtype=numerics.get_dtype(),
        dtype=x.dtype,
        zero_point=zero,
    )
    return qt, grad
