"""Layer 2: which real value maps onto the edge of the grid (the bound).

A calibration is a frozen pytree whose call ``calibration(x, axes, quantize)``
returns the *bound* of each scale block: ``x`` is reduced over ``axes`` (kept
with size 1). The quantizer turns bounds into scales with :func:`make_scale`:
``scale = bound / numerics.abs_val_mapped_to()``, optionally rounded to a
power of two.

Non-finite input:
  A scale block that holds a NaN or an infinity gets a NaN bound, whatever
  the calibration, so every element of that block dequantizes to NaN. A NaN
  or inf is never turned into a finite number, and it never changes the
  scale of any other block. (Calibrating only the finite values and clipping
  the inf would hide an overflow as a plausible number.) The check is that
  the block's sum is finite, so a block of finite values whose sum overflows
  float32 (magnitudes near 3e38) is treated as non-finite too: loudly, as
  NaN.

All-zero blocks:
  A bound of 0 gives a scale of 1, so an all-zero block quantizes to exact
  zeros with a finite scale.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from qbits.errors import InvalidArgumentError, check_float

__all__ = [
    "SCALE_ROUNDINGS",
    "AbsMax",
    "Calibration",
    "ConstantBound",
    "MseSearch",
    "Percentile",
    "ScaleRounding",
    "make_scale",
    "round_scale",
]

ScaleRounding = Literal["none", "pow2", "e8m0"]
SCALE_ROUNDINGS: tuple[str, ...] = ("none", "pow2", "e8m0")

# (x, bound) -> x quantized and dequantized with that bound.
QuantizeFn = Callable[[jax.Array, jax.Array], jax.Array]
Axes = tuple[int, ...]


class Calibration(struct.PyTreeNode, metaclass=abc.ABCMeta):
    """Computes the bound of each scale block; see the module docstring.

    Subclasses implement :meth:`bound`; calling the calibration applies the
    non-finite rule on top.

    Example:
      A bound of three standard deviations (RMS) per block:

      >>> import jax, jax.numpy as jnp
      >>> class ThreeSigma(qbits.Calibration):
      ...     def bound(self, x, axes, quantize=None):
      ...         return 3 * jnp.sqrt(jnp.mean(x * x, axis=axes, keepdims=True))
      >>> q = qbits.Quantizer(qbits.IntNumerics(bits=8), ThreeSigma())
      >>> q.quant(jnp.array([1.0, -1.0, 1.0, -1.0])).scale
      Array([0.02352941], dtype=float32)
    """

    @abc.abstractmethod
    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """The bound of each block of ``x``, reduced over ``axes`` (keepdims).

        Args:
          x: The tensor, in float32 (or float64).
          axes: The axes each scale is shared over.
          quantize: ``(x, bound) -> dequant(quant(x))``; only searching
            calibrations use it.
        """

    def __call__(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """The bound of each block; NaN for blocks holding a NaN or inf."""
        bound = self.bound(x, axes, quantize).astype(x.dtype)
        return lax.select(_all_finite(x, axes), bound, jnp.full_like(bound, jnp.nan))


def _all_finite(x: jax.Array, axes: Axes) -> jax.Array:
    """Whether each block holds only finite values: whether its sum is finite.

    XLA:CPU's vectorized max reductions drop NaN (a NaN in a 512x2048 array
    gives its largest finite magnitude), but sums keep NaN and inf, and a
    plain sum reads the block without writing a transformed copy first.
    """
    return jnp.isfinite(jnp.sum(x, axis=axes, keepdims=True))


def _absmax(x: jax.Array, axes: Axes) -> jax.Array:
    # max(max x, -min x): reductions straight over x, which XLA:CPU does
    # without first writing |x| out as a separate array.
    return jnp.maximum(
        jnp.max(x, axis=axes, keepdims=True), -jnp.min(x, axis=axes, keepdims=True)
    )


class AbsMax(Calibration):
    """The largest magnitude in the block, times ``clip_factor``.

    Attributes:
      clip_factor: Multiplies the absmax; below 1 clips the largest values
        in exchange for finer steps.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([[1.0, -4.0], [0.5, 2.0]])
      >>> qbits.AbsMax()(x, axes=(1,))
      Array([[4.],
             [2.]], dtype=float32)
      >>> qbits.AbsMax(clip_factor=0.5)(x, axes=(0, 1))
      Array([[2.]], dtype=float32)
    """

    clip_factor: float = struct.field(pytree_node=False, default=1.0)

    def __post_init__(self) -> None:
        check_float("AbsMax", "clip_factor", self.clip_factor, lo=0.0, lo_open=True)

    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """``clip_factor * max(|x|)`` over ``axes``."""
        return _absmax(x, axes) * self.clip_factor


class Percentile(Calibration):
    """A percentile of the magnitudes in the block (linear interpolation).

    Attributes:
      percentile: In ``(0, 100]``; 100 is the absmax.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.arange(101.0)
      >>> qbits.Percentile(99.0)(x, axes=(0,))
      Array([99.], dtype=float32)
    """

    percentile: float = struct.field(pytree_node=False, default=99.99)

    def __post_init__(self) -> None:
        check_float(
            "Percentile", "percentile", self.percentile, lo=0.0, hi=100.0, lo_open=True
        )

    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """The ``percentile``-th percentile of ``|x|`` over ``axes``."""
        return jnp.percentile(jnp.abs(x), self.percentile, axis=axes, keepdims=True)


class MseSearch(Calibration):
    """Searches clip factors of the absmax for the least squared error.

    Every candidate bound ``factor * absmax`` is tried by quantizing and
    dequantizing the block; each block keeps the factor with the smallest sum
    of squared errors (ties go to the earlier factor). The signal power of a
    block does not depend on the factor, so this is also the factor of best
    signal-to-quantization-noise ratio (SNR).

    Attributes:
      clip_factors: The candidate factors, positive; below 1 clips.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = qbits.Quantizer(qbits.IntNumerics(bits=4), qbits.MseSearch())
      >>> x = jax.random.normal(jax.random.key(0), (4096,))
      >>> mse = jnp.mean((q.quant(x).dequant() - x) ** 2)
      >>> absmax = qbits.Quantizer(qbits.IntNumerics(bits=4))
      >>> bool(mse < jnp.mean((absmax.quant(x).dequant() - x) ** 2))
      True
    """

    clip_factors: tuple[float, ...] = struct.field(
        pytree_node=False,
        default=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5),
    )

    def __post_init__(self) -> None:
        factors = self.clip_factors
        if isinstance(factors, Sequence) and not isinstance(factors, str):
            factors = tuple(factors)
        if not isinstance(factors, tuple) or not factors:
            raise InvalidArgumentError(
                "MseSearch", "clip_factors", factors, "a non-empty sequence of numbers"
            )
        for i, f in enumerate(factors):
            check_float("MseSearch", f"clip_factors[{i}]", f, lo=0.0, lo_open=True)
        object.__setattr__(self, "clip_factors", tuple(float(f) for f in factors))

    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """The candidate bound with the least squared quantization error."""
        if quantize is None:
            raise InvalidArgumentError(
                "MseSearch",
                "quantize",
                None,
                "a function (x, bound) -> dequant(quant(x)); use MseSearch "
                "through a qbits.Quantizer, which supplies it",
            )
        absmax = _absmax(x, axes)
        best_bound = best_err = None
        for factor in self.clip_factors:
            candidate = absmax * factor
            err = jnp.sum(jnp.square(quantize(x, candidate) - x), axes, keepdims=True)
            if best_err is None:
                best_bound, best_err = candidate, err
            else:
                better = err < best_err
                best_bound = jnp.where(better, candidate, best_bound)
                best_err = jnp.where(better, err, best_err)
        return best_bound


class ConstantBound(Calibration):
    """A fixed bound, the same for every block (a static range).

    Attributes:
      value: The bound, a finite positive number.

    Example:
      >>> import jax.numpy as jnp
      >>> qbits.ConstantBound(6.0)(jnp.ones((2, 3)), axes=(1,))
      Array([[6.],
             [6.]], dtype=float32)
    """

    value: float = struct.field(pytree_node=False, default=1.0)

    def __post_init__(self) -> None:
        check_float("ConstantBound", "value", self.value, lo=0.0, lo_open=True)

    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """``value``, broadcast to the block shape."""
        shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        return jnp.full(shape, self.value, x.dtype)


def round_scale(scale: jax.Array, rounding: ScaleRounding) -> jax.Array:
    """Rounds positive scales to powers of two (NaN stays NaN).

    Args:
      scale: Positive scales.
      rounding: ``"none"``; ``"pow2"``, the nearest power of two in log scale
        (values may then clip by up to a factor of sqrt(2)); or ``"e8m0"``,
        the next power of two *up*, so nothing clips. Powers of two are
        clamped to ``[2**-126, 2**127]``: the range of ``float8_e8m0fnu``
        that float32 holds as normal numbers.

    Returns:
      The rounded scales, same shape and dtype.

    Raises:
      InvalidArgumentError: For an unknown ``rounding``.

    Example:
      >>> import jax.numpy as jnp
      >>> s = jnp.array([0.3, 0.75, 4.0])
      >>> qbits.calibration.round_scale(s, "pow2")
      Array([0.25, 1.  , 4.  ], dtype=float32)
      >>> qbits.calibration.round_scale(s, "e8m0")
      Array([0.5, 1. , 4. ], dtype=float32)
    """
    if rounding not in SCALE_ROUNDINGS:
        raise InvalidArgumentError(
            "round_scale", "rounding", rounding, "one of " + ", ".join(SCALE_ROUNDINGS)
        )
    if rounding == "none":
        return scale
    mantissa, exponent = jnp.frexp(scale)  # scale = m * 2**e, m in [0.5, 1)
    up = mantissa >= np.sqrt(0.5) if rounding == "pow2" else mantissa != 0.5
    # The result is 0.5 * 2**e' = 2**(e' - 1); keep it a normal float32.
    exponent = jnp.clip(exponent + up.astype(exponent.dtype) - 1, -126, 127) + 1
    rounded = jnp.ldexp(jnp.full_like(scale, 0.5), exponent)
    return lax.select(jnp.isnan(scale), scale, rounded)


def make_scale(
    bound: jax.Array, abs_val_mapped_to: float, rounding: ScaleRounding = "none"
) -> jax.Array:
    """Turns bounds into scales: ``bound / abs_val_mapped_to``, rounded.

    A zero bound gives scale 1 (the block is all zeros and stays exact); a
    scale too small for a normal float is raised to the smallest normal; NaN
    stays NaN.

    Example:
      >>> import jax.numpy as jnp
      >>> qbits.calibration.make_scale(jnp.array([255.0, 0.0]), 127.5)
      Array([2., 1.], dtype=float32)
    """
    scale = bound / abs_val_mapped_to
    tiny = jnp.finfo(scale.dtype).tiny
    scale = lax.select(scale == 0, jnp.ones_like(scale), jnp.maximum(scale, tiny))
    return round_scale(scale, rounding)
