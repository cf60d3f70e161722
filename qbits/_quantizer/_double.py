r"""Double quantization of a tensor's scales: QLoRA's storage of NF4's absmax.

``Quantizer(double_quant=True)``, as bitsandbytes' ``quantize_4bit(...,
compress_statistics=True)`` (``bnb_4bit_use_double_quant``) stores the
absmax of its blocks (Dettmers et al., "QLoRA: Efficient Finetuning of
Quantized LLMs", arXiv 2305.14314, section 3): the elements are quantized
with the float32 scales ``s``; then, with ``o`` the scales' mean (float32),
the ``s - o`` are quantized in blocks of 256 (in the order of
:func:`qbits._tensor.decode_scale`) to uint8 codes on bitsandbytes' signed
dynamic map, each block divided by its absmax ``a`` (float32):

.. math:: c_i = \mathrm{nearest}\Big(\frac{s_i - o}{a_{\lfloor i/256 \rfloor}}\Big),
          \qquad \hat{s}_i = \mathrm{map}[c_i]\, a + o.

As bitsandbytes' reference implementation (its ``default`` backend)
rounds: a full block is multiplied by ``1 / max(a, t)``, a last partial
one divided by ``max(a, t)`` (which is then its stored absmax), clipped
to ``[-1, 1]``, the nearest level taken (a tie to the lower one). ``t`` is
float32's smallest normal (bitsandbytes' is ``1e-38``, a subnormal, which
XLA:CPU reads as 0); it only matters for a block of scales all equal to
their mean, which decodes to the mean either way. Measured on
the 65,536 scales of a 1024 x 4096 weight (bitsandbytes 0.50.2): with its
offset, the codes of its reference backend bit for bit; its CPU kernel's
search differs on 125 (a level away at near-ties, and values below about
1.5e-5 go to 2.1e-5). The mean is XLA's float32 sum divided by ``n``;
PyTorch sums in another order, so ``o`` can differ from bitsandbytes' by a
rounding of the sum (it did there, by one ulp).

Stored, a scale costs 8 bits plus 32 per 256: NF4 in blocks of 64 is 4.127
bits a weight, not 4.5. A block holding a NaN makes the mean, and so every
scale, NaN.

The error of a decoded scale is at most half the widest gap between
neighbouring levels of the map (``0.0140625 / 2`` of ``a``, between 0.1 and
1) plus float32 roundings; the elements' codes are those of the float32
scales, so the dequantized tensor differs from the single-quantized one by
``|level| |s - \hat{s}| <= |s - \hat{s}|`` per element.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import InvalidArgumentError, check_bool
from qbits._tensor import NESTED_BLOCK
from qbits.numerics import _SIGNED_MAP, _nearest_level

__all__ = ["check_double_quant", "double_quantize"]


def double_quantize(scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(codes, absmax, offset)`` of float32 ``scale`` (see the module docstring).

    ``codes``: uint8, ``scale``'s shape; ``absmax``: float32, one per 256
    scales; ``offset``: float32 of shape ``(1,) * scale.ndim``.

    Example:
      >>> from qbits._quantizer._double import double_quantize
      >>> from qbits._tensor import decode_scale
      >>> s = jnp.array([[1.0, 2.0], [3.0, 4.0]])
      >>> codes, absmax, offset = double_quantize(s)
      >>> codes.dtype, absmax.tolist(), offset.tolist()
      (dtype('uint8'), [1.5], [[2.5]])
      >>> np.round(decode_scale(codes, absmax, offset), 4).tolist()
      [[1.0105, 2.002], [2.998, 4.0]]
    """
    shape = tuple(scale.shape)
    n = int(np.prod(shape, dtype=np.int64))
    s = scale.astype(jnp.float32)
    offset = jnp.mean(s) if n else jnp.zeros((), jnp.float32)
    flat = jnp.transpose(s).reshape(n) - offset  # the axes reversed
    blocks, rem = -(-n // NESTED_BLOCK), n % NESTED_BLOCK
    x = jnp.pad(flat, (0, blocks * NESTED_BLOCK - n)).reshape(blocks, NESTED_BLOCK)
    absmax = jnp.max(jnp.abs(x), axis=1)
    floor = jnp.maximum(absmax, np.finfo(np.float32).tiny)
    scaled = x * (np.float32(1) / floor)[:, None]
    if rem:  # bitsandbytes divides a last partial block, and keeps its floor
        scaled = scaled.at[-1].set(x[-1] / floor[-1])
        absmax = absmax.at[-1].set(floor[-1])
    codes = _nearest_level(_SIGNED_MAP, jnp.clip(scaled, -1.0, 1.0))
    codes = codes.astype(jnp.uint8).reshape(-1)[:n].reshape(shape[::-1])
    return jnp.transpose(codes), absmax, jnp.reshape(offset, (1,) * len(shape))


def check_double_quant(quantizer: Any) -> None:
    """Raises unless a Quantizer's ``double_quant`` is a bool it can have."""
    check_bool("Quantizer", "double_quant", quantizer.double_quant)
    if quantizer.double_quant and (
        quantizer.numerics.asymmetric
        or quantizer.scale_rounding != "none"
        or quantizer.provider is not None
    ):
        raise InvalidArgumentError(
            "Quantizer",
            "double_quant",
            True,
            "False with an asymmetric grid, a scale_rounding other than "
            "'none' or a scale provider (bitsandbytes double-quantizes the "
            "float32 absmax of a symmetric grid)",
        )
