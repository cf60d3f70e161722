"""Unsigned integer numerics: the grid of asymmetric (zero-point) quantization."""

from __future__ import annotations

from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import struct
from jax import lax

from qbits._context import Context
from qbits._errors import InvalidArgumentError, check_bool
from qbits._formats import check_float_input, compute_dtype
from qbits.numerics._base import (
    ClippedStraightThrough,
    NoiseFn,
    integer_dtype,
    require_key,
)

__all__ = ["UintNumerics"]

_STORAGE_BY_BITS = ((4, ml_dtypes.uint4), (8, np.uint8))


class UintNumerics(ClippedStraightThrough):
    r"""An unsigned integer grid, :math:`0 .. 2^b - 1`: asymmetric quantization.

    With this grid a :class:`~qbits.Quantizer` quantizes asymmetrically: each
    block's range ``[lo, hi]`` (its smallest and largest value with
    :class:`~qbits.AbsMax`) maps onto ``[0, 2**bits - 1]`` through a scale and
    an integer zero point,

    .. math:: q = \mathrm{clip}(\mathrm{round}(x / s) + z,\ 0,\ 2^b - 1),
              \qquad \hat{x} = (q - z)\, s,

    so a block whose values are all positive (or shifted away from zero)
    uses every level, where a symmetric grid wastes half of them. The input
    of this numerics is ``x / s + z``, already shifted; it clips to the grid
    and rounds to nearest even. The gradient is straight-through; with
    ``clip_gradient`` it is zero where the input lay outside ``[0, 2**bits - 1]``.

    Attributes:
      bits: Number of bits, 1..8 (uint4 storage for 1..4, uint8 for 5..8).
      clip_gradient: Zero the gradient outside the grid's range.
      noise_fn: Noise added before rounding (e.g. ``UniformNoise()``) for
        stochastic rounding; needs a ``Context`` with a key.
      dtype: Unsigned storage dtype; ``None`` picks uint4 or uint8.

    Raises:
      InvalidArgumentError: For bits outside 1..8 or a storage dtype that is
        not unsigned or too small for the bits.

    Example:
      >>> import jax.numpy as jnp
      >>> u4 = qbits.numerics.UintNumerics(bits=4)
      >>> u4.abs_val_mapped_to(), u4.get_dtype()
      (15.0, dtype(uint4))
      >>> u4(jnp.array([-3.0, 0.4, 7.5, 8.5, 20.0]))
      Array([ 0.,  0.,  8.,  8., 15.], dtype=float32)
    """

    bits: int = struct.field(pytree_node=False, default=8)
    clip_gradient: bool = struct.field(pytree_node=False, default=False)
    noise_fn: NoiseFn | None = struct.field(pytree_node=False, default=None)
    dtype: Any = struct.field(pytree_node=False, default=None)

    asymmetric = True  # a scale and a zero point per block
    clips = True  # codes are clipped to [0, 2**bits - 1]

    def __post_init__(self) -> None:
        owner = "UintNumerics"
        bits = self.bits
        if isinstance(bits, bool) or not (isinstance(bits, int) and 1 <= bits <= 8):
            raise InvalidArgumentError(
                owner,
                "bits",
                self.bits,
                "an int in 1..8 (codes are stored as uint4 for 1..4 bits, "
                "uint8 for 5..8); for wider grids use the symmetric "
                "IntNumerics(bits=...)",
            )
        check_bool(owner, "clip_gradient", self.clip_gradient)
        if self.noise_fn is not None and not callable(self.noise_fn):
            raise InvalidArgumentError(
                owner, "noise_fn", self.noise_fn, "None or a callable(shape, key)"
            )
        object.__setattr__(self, "dtype", self._storage_dtype(self.dtype))

    def _storage_dtype(self, dtype: Any) -> np.dtype:
        owner = "UintNumerics"
        if dtype is None:
            return next(np.dtype(d) for b, d in _STORAGE_BY_BITS if self.bits <= b)
        dt, info = integer_dtype(
            owner, dtype, "None or an unsigned integer dtype (uint8, ..)"
        )
        if info.min < 0 or info.max < self.top:
            raise InvalidArgumentError(
                owner,
                "dtype",
                dt,
                f"an unsigned integer dtype holding 0..{self.top} for bits={self.bits}",
            )
        return dt

    @property
    def top(self) -> int:
        """The largest code, ``2**bits - 1``."""
        return 2**self.bits - 1

    def abs_val_mapped_to(self) -> float:
        """``2**bits - 1``: the span of codes that a block's range maps onto."""
        return float(self.top)

    def get_dtype(self) -> np.dtype:
        """The unsigned storage dtype."""
        return self.dtype

    def fwd(self, x: jax.Array, context: Context | None) -> jax.Array:
        """Noise (optional), clip to ``[0, 2**bits - 1]``, round to nearest even."""
        x = check_float_input("UintNumerics", x)
        have = ml_dtypes.finfo(x.dtype).nmant + 1
        if self.bits > have:
            raise InvalidArgumentError(
                "UintNumerics",
                "x.dtype",
                x.dtype,
                f"a float dtype with at least {self.bits} significand bits (float32)",
                why=f"the {self.bits}-bit grid is not representable in {x.dtype}",
            )
        y = x.astype(compute_dtype(x.dtype))
        if self.noise_fn is not None:
            y = y + self.noise_fn(y.shape, require_key("UintNumerics", context)).astype(
                y.dtype
            )
        zero, top = np.asarray(0, y.dtype), np.asarray(self.top, y.dtype)
        y = lax.round(lax.clamp(zero, y, top), lax.RoundingMethod.TO_NEAREST_EVEN)
        return y.astype(x.dtype)

    def gradient_range(self) -> tuple[float, float]:
        """The codes' range (the gradient's mask with ``clip_gradient``)."""
        return (0.0, float(self.top))
