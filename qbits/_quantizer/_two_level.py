r"""Two-level scaling: E4M3 block scales under a float32 tensor scale (NVFP4).

``scale_rounding="e4m3"``, NVIDIA's NVFP4 recipe for any grid (NVFP4 is
E2M1 elements in blocks of 16, :func:`qbits.presets.get` ``("nvfp4")``).
With ``m = numerics.abs_val_mapped_to()`` (6 for E2M1) and ``amax`` the
largest finite magnitude of the whole tensor, in float32:

.. math:: g = \frac{amax}{448\, m}, \qquad
          b = \mathrm{e4m3}\Big(\frac{bound}{m\, g}\Big), \qquad
          q = \mathrm{numerics}\Big(\frac{x}{b\, g}\Big), \qquad
          \hat{x} = q\, (b\, g),

(``amax`` fixed by ``Quantizer(tensor_amax=...)``: a calibrated global
scale, as NVFP4 W4A4 checkpoints ship their inputs'; values beyond it may
clip at the top block scale), with ``bound`` each block's calibration (its absmax with
:class:`~qbits.AbsMax`), ``e4m3`` rounding to nearest even onto
``float8_e4m3fn`` (saturating at 448) and ``b g`` one float32 product. The
tensor scale ``g`` makes the block with the largest bound use the top of
E4M3's range, so that the 8-bit block scales keep their precision. Stored,
``b`` is ``float8_e4m3fn`` (one byte per block) and ``g`` one float32.

The tensor scale is floored at ``2**-126`` (float32's smallest normal: a
subnormal ``g`` would read as zero on XLA:CPU). Below ``amax = 448 m
2**-126`` (about ``3.2e-35`` for NVFP4) ``g`` stays ``2**-126`` and the
block scales no longer reach E4M3's top (448), which costs no precision
while they stay E4M3 normals: measured, the same error down to ``amax =
1e-36``; smaller tensors are float32 subnormals, which XLA:CPU reads as
zero (:mod:`qbits._calibration`).

A block whose ``b`` is 0 (a block of zeros, or one below ``2**-10 m g``,
about ``2e-6 amax`` for NVFP4) dequantizes to exact zeros (codes 0); there
the gradient of ``quant(x).dequant()`` is 0 (the matmuls' gradient,
:meth:`~qbits.Quantizer.quant_vjp`, stays straight-through). A tensor of
zeros has ``g = 1``. A block holding a NaN or inf gets a NaN scale and is
left out of ``amax``, so it changes no other block.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError, check_float
from qbits._formats import float_format, round_to_format
from qbits._quantizer._storage import Blocked, encode, to_storage
from qbits._tensor import QTensor
from qbits.numerics import QNumerics

__all__ = [
    "BLOCK_SCALE_DTYPE",
    "check_tensor_amax",
    "quantize_two_level",
    "two_level_scale",
]

#: How stored block scales are kept.
BLOCK_SCALE_DTYPE = np.dtype(float_format("float8_e4m3fn").dtype)
_E4M3 = float_format("float8_e4m3fn")
_TINY = float(np.finfo(np.float32).tiny)


def check_tensor_amax(q: Any) -> None:
    """Raises unless ``q.tensor_amax`` is ``None`` or fits a two-level scale."""
    if q.tensor_amax is None:
        return
    check_float("Quantizer", "tensor_amax", q.tensor_amax, lo=0.0, lo_open=True)
    if q.scale_rounding != "e4m3":
        raise InvalidArgumentError(
            "Quantizer", "tensor_amax", q.tensor_amax,
            "None unless scale_rounding='e4m3' (a two-level scale's tensor level)",
        )  # fmt: skip


def two_level_scale(
    bound: jax.Array, amax: jax.Array, mapped: float
) -> tuple[jax.Array, jax.Array]:
    """``(b, g)``: E4M3 block scales (as float32) and the tensor scale.

    Args:
      bound: Each block's bound, float32.
      amax: The tensor's largest finite magnitude (a scalar).
      mapped: The grid magnitude the bound maps onto (6 for E2M1).

    Example:
      >>> from qbits._quantizer._two_level import two_level_scale
      >>> b, g = two_level_scale(jnp.array([6.0, 3.0, 0.0]), jnp.array(6.0), 6.0)
      >>> b, g * 448
      (Array([448., 224.,   0.], dtype=float32), Array(1., dtype=float32))
    """
    dtype = bound.dtype
    g = lax.div(amax, np.asarray(448.0 * mapped, dtype))
    # Floored at float32's smallest normal: XLA:CPU reads a subnormal as 0.
    g = lax.max(g, np.asarray(_TINY, dtype))
    g = lax.select(lax.gt(amax, lax.full_like(amax, 0)), g, lax.full_like(g, 1))
    raw = lax.div(bound, lax.mul(np.asarray(mapped, dtype), g))
    raw = lax.clamp(np.asarray(0, dtype), raw, np.asarray(_E4M3.max, dtype))
    return round_to_format(raw, _E4M3), g


def _encode(x: jax.Array, b: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x / (b g)`` (``x`` itself where ``b`` is 0), and where ``b`` is 0."""
    zero = lax.eq(b, lax.full_like(b, 0))
    scale = lax.select(zero, lax.full_like(b, 1), lax.mul(b, g))
    return x / scale, zero


def quantize_two_level(
    request: Any, found: Blocked, vjp: bool
) -> tuple[QTensor, jax.tree_util.Partial | None]:
    """Quantizes a request whose ``scale_rounding`` is ``"e4m3"``, in its blocks.

    Returns ``(qtensor, grad)`` as :func:`qbits._quantizer.quantize_all` does.
    """
    layout, xb, xs, no_grad = found
    numerics: QNumerics = request.quantizer.numerics
    x, context, axes = request.x, request.context, layout.reduce_axes
    mapped = float(numerics.abs_val_mapped_to())
    finite = jnp.where(jnp.isfinite(xs), jnp.abs(xs), 0)
    amax = jnp.max(finite) if x.size else jnp.zeros((), xs.dtype)
    if request.quantizer.tensor_amax is not None:  # a calibrated global scale
        amax = jnp.asarray(request.quantizer.tensor_amax, xs.dtype)

    def on_grid(v: jax.Array, b: jax.Array, g: jax.Array) -> jax.Array:
        y, zero = _encode(v, b, g)
        out = numerics.fwd(y, context) * lax.mul(b, g)
        return lax.select(jnp.broadcast_to(zero, out.shape), jnp.zeros_like(out), out)

    def quantize(v: jax.Array, bound: jax.Array) -> jax.Array:
        return on_grid(v, *two_level_scale(bound, amax, mapped))

    if x.size:
        bound = request.quantizer.calibration(xs, axes, quantize)
    else:
        bound = jnp.zeros(layout.reduced_shape, xs.dtype)
    b, g = two_level_scale(no_grad(bound), no_grad(amax), mapped)
    y, zero = _encode(xb, b, g)
    codes, grad = encode(numerics, y, context, layout, vjp)
    # Blocks whose scale is 0 hold exact zeros; the subtracted copy carries
    # no gradient.
    codes = codes - lax.stop_gradient(codes) * zero.astype(codes.dtype)
    codes = codes.reshape(x.shape)
    scale = b.reshape(layout.scale_shape)
    codebook = None
    if request.store:
        index = getattr(numerics, "codes", None)  # a codebook's indices (NF4)
        codes = to_storage(
            codes, numerics.get_dtype(), saturate=True, guard=not vjp, codes=index
        )
        scale = scale.astype(BLOCK_SCALE_DTYPE)
        codebook = numerics.codebook
    qt = QTensor(
        codes,
        scale,
        qdtype=numerics.get_dtype(),
        dtype=x.dtype,
        tensor_scale=jnp.reshape(g, (1,) * x.ndim).astype(jnp.float32),
        codebook=codebook,
    )
    return qt, grad
