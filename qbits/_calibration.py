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
  the inf would hide an overflow as a plausible number.) Every finite input,
  up to float32's largest value, is finite to every calibration (a block
  whose sum overflows float32 included) and quantizes to finite values of
  the right sign.

All-zero blocks:
  A bound of 0 (with :class:`AbsMax`, :class:`MseSearch`: a block of zeros)
  gives a scale of 1, and the block dequantizes to exact zeros on every
  grid: a grid without a zero (``IntNumerics(preserve_zero=False)``) gets
  the code 0 there, off its grid. The scale stays 1, not 0, so that the fake
  quantization ``quant(x).dequant()`` keeps its straight-through gradient in
  such a block (a zero-initialised weight still trains) and nothing divides
  by zero. A bound of 0 is the only all-zero case: any positive bound, however
  small, gets a positive scale (see below).

Tiny and huge blocks:
  Scales are float32 numbers within float32's normal range: a positive bound
  whose ``bound / abs_val_mapped_to`` is below the smallest normal float32
  (``2**-126``; the quotient may even underflow to 0) gets that smallest
  normal, so tiny blocks quantize as finely as float32 allows (the
  dequantized values then resolve steps of ``2**-126``). Scales are capped
  so that the grid's largest magnitude times the scale is finite in the
  input's dtype (and in float32), after rounding to a power of two too, so a
  block near the dtype's largest value dequantizes to finite values of the
  right sign; ``"e8m0"`` then rounds down instead of up where rounding up
  would overflow, and the values beyond the grid clip.

Subnormal input:
  XLA:CPU reads float32 subnormals (magnitudes below ``2**-126``, about
  ``1.18e-38``) as zero (flush-to-zero), in the calibration's reductions
  and in the division by the scale. On CPU a block whose largest magnitude
  is subnormal therefore gets the bound 0 and quantizes to exact zeros,
  and a subnormal element of any block quantizes as 0 (which differs from
  rounding it only in blocks whose step is itself near ``2**-126``). Other
  backends may keep subnormals.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct
from jax import lax
from jax.typing import DTypeLike

from qbits._errors import InvalidArgumentError, check_choice, check_float
from qbits._platform import per_platform
from qbits._sharding import max_on_shards

__all__ = [
    "SCALE_ROUNDINGS",
    "AbsMax",
    "AbsMean",
    "Calibration",
    "ConstantBound",
    "MseSearch",
    "Percentile",
    "ScaleRounding",
    "make_scale",
    "round_scale",
    "scale_limits",
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

    #: Whether :meth:`bound` is already NaN for every block holding a NaN or
    #: an inf (and finite elsewhere), so that no separate check is needed.
    bound_flags_non_finite: ClassVar[bool] = False

    def __call__(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """The bound of each block; NaN for blocks holding a NaN or inf."""
        bound = self.bound(x, axes, quantize).astype(x.dtype)
        if self.bound_flags_non_finite:
            return bound
        finite = _all_finite(x, axes)
        return lax.select(finite, bound, jnp.full_like(bound, jnp.nan))


def _all_finite(x: jax.Array, axes: Axes) -> jax.Array:
    """Whether each block holds only finite values (kept axes).

    An ``and`` of ``is_finite`` over the block, fused into one reduction.
    (Not whether the block's sum is finite: the sum of finite values near
    float32's largest overflows. Not a max: XLA:CPU's vectorized max
    reductions drop NaN.)
    """
    axes = tuple(a % x.ndim for a in axes)
    return lax.expand_dims(lax.reduce_and(lax.is_finite(x), axes), axes)


def _max_pair(
    a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    return lax.max(a[0], b[0]), lax.max(a[1], b[1])


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _absmax_nan_if_non_finite(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``max(|x|)`` over ``axes`` (kept), NaN where a NaN or inf is among them.

    One variadic reduction (the largest magnitude and whether a non-finite
    value was seen) straight over ``x``: XLA:CPU fuses ``|x|`` into it
    instead of first writing ``|x|`` out for a library reduction kernel,
    which is faster and compiles one kernel fewer. The flag is needed
    because XLA:CPU's vectorized max reductions drop NaN.
    """
    # lax, not jnp, here and in AbsMax.bound: jnp's functions are small jitted
    # functions, each traced anew for every new shape (trace time per layer).
    low = np.array(-np.inf, x.dtype)
    non_finite = lax.convert_element_type(lax.bitwise_not(lax.is_finite(x)), x.dtype)
    magnitude, non_finite = lax.reduce(
        (lax.abs(x), non_finite), (low, np.zeros((), x.dtype)), _max_pair, axes
    )
    nan = lax.full_like(magnitude, np.nan)
    out = lax.select(lax.gt(non_finite, lax.full_like(non_finite, 0)), nan, magnitude)
    return lax.expand_dims(out, axes)


@_absmax_nan_if_non_finite.defjvp
def _absmax_nan_if_non_finite_jvp(
    axes: tuple[int, ...], primals: tuple[jax.Array], tangents: tuple[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    (x,), (t,) = primals, tangents
    _, dt = jax.jvp(lambda v: jnp.max(jnp.abs(v), axes, keepdims=True), (x,), (t,))
    return _absmax_nan_if_non_finite(x, axes), dt


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
        in exchange for finer steps (a bound that would underflow float32
        is its smallest normal, never 0: the block is not taken for zeros).
        Above 1 the bound saturates at the dtype's largest finite value
        instead of overflowing. At least float32's smallest normal,
        ``2**-126`` (a smaller factor is 0 in float32).

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
        check_float("AbsMax", "clip_factor", self.clip_factor, lo=_F32_TINY)

    bound_flags_non_finite: ClassVar[bool] = True

    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """``clip_factor * max(|x|)`` over ``axes``; NaN where a block is not finite.

        On one CPU device, over trailing axes, one variadic reduction of
        ``(|x|, not isfinite(x))`` finds both in a single pass that XLA:CPU
        fuses with the producer of ``x`` (faster there; on several devices
        XLA's partitioner would all-gather both partial results of a sharded
        ``x`` where a ``max`` takes one all-reduce); elsewhere non-finite
        values are mapped to inf before a plain ``max`` (XLA:CPU's
        vectorized max reductions drop NaN), the form GPU and TPU compilers
        fuse best, and an inf bound becomes NaN; where explicit mesh axes
        shard ``axes``, that max per shard and one all-reduce over all of
        them (not one per mesh axis). All are right on every backend.
        """
        axes = tuple(a % x.ndim for a in axes)

        def largest(x: jax.Array) -> jax.Array:  # inf where not finite
            inf = lax.full_like(x, np.inf)
            magnitude = lax.select(lax.is_finite(x), lax.abs(x), inf)
            return lax.expand_dims(lax.reduce_max(magnitude, axes), axes)

        def nan_if_inf(bound: jax.Array) -> jax.Array:
            nan = lax.full_like(bound, np.nan)
            return lax.select(lax.lt(bound, lax.full_like(bound, np.inf)), bound, nan)

        if axes == tuple(range(x.ndim - len(axes), x.ndim)) and jax.device_count() == 1:
            bound = per_platform(
                x,
                cpu=functools.partial(_absmax_nan_if_non_finite, axes=axes),
                default=lambda x: nan_if_inf(largest(x)),
            )
        else:  # across rows XLA:CPU runs a variadic reduction slowly
            sharded = max_on_shards(largest, largest, x, axes)  # None: auto axes
            bound = nan_if_inf(largest(x) if sharded is None else sharded)
        if self.clip_factor <= 1.0:
            clipped = lax.mul(bound, np.asarray(self.clip_factor, bound.dtype))
            if self.clip_factor == 1.0:
                return clipped
            # A positive bound times a small factor may underflow to 0, which
            # means a block of zeros (scale 1): keep at least the smallest
            # normal (a subnormal bound stays as it is; NaN stays NaN).
            tiny = np.asarray(np.finfo(bound.dtype).tiny, bound.dtype)
            return lax.max(clipped, lax.min(bound, lax.full_like(bound, tiny)))
        # A factor above 1 must not turn a finite absmax into inf (which
        # would read as non-finite input): saturate at the largest finite
        # (NaN stays NaN).
        largest = np.asarray(jnp.finfo(bound.dtype).max, bound.dtype)
        return jnp.minimum(bound * self.clip_factor, largest)


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


class AbsMean(Calibration):
    r"""The mean magnitude in the block: BitNet b1.58's weight scale.

    With :class:`~qbits.numerics.TernaryNumerics` (which maps the bound onto
    the code 1) and ``PerTensor()``, the scale is BitNet b1.58's
    :math:`\gamma = \mathrm{mean}(|W|)` (arXiv 2402.17764). Most values
    lie beyond the bound and clip. A block whose sum of magnitudes
    overflows float32 is averaged from magnitudes scaled down first, so
    that its mean stays finite.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([[1.0, -3.0], [0.5, -0.5]])
      >>> qbits.AbsMean()(x, axes=(1,))
      Array([[2. ],
             [0.5]], dtype=float32)
    """

    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """``mean(|x|)`` over ``axes``."""
        magnitude = jnp.abs(x)
        mean = jnp.mean(magnitude, axis=axes, keepdims=True)
        n = math.prod(x.shape[a] for a in axes)
        # Each magnitude times 2**-k, 2**k >= n: the sum is at most the
        # largest magnitude (a power of two scales exactly).
        down = np.asarray(2.0 ** -max(n - 1, 1).bit_length(), x.dtype)
        up = np.asarray(2.0 ** max(n - 1, 1).bit_length(), x.dtype)
        scaled = jnp.mean(magnitude * down, axis=axes, keepdims=True) * up
        return lax.select(jnp.isinf(mean), scaled, mean)


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
        # Errors in units of a power of two at the block's absmax: the same
        # comparisons (a power of two scales exactly), without overflowing
        # float32 for a huge block or underflowing for a tiny one.
        unit = _power_of_two_at(absmax)
        best_bound = best_err = None
        for factor in self.clip_factors:
            candidate = absmax * factor
            diff = (quantize(x, candidate) - x) / unit
            err = jnp.sum(jnp.square(diff), axes, keepdims=True)
            if best_err is None:
                best_bound, best_err = candidate, err
            else:
                better = err < best_err
                best_bound = jnp.where(better, candidate, best_bound)
                best_err = jnp.where(better, err, best_err)
        return best_bound


def _power_of_two_at(v: jax.Array) -> jax.Array:
    """A power of two in ``(v / 4, v]``: ``2**(e - 1)`` for ``v = m * 2**e``.

    At least the smallest normal; 1 where ``v`` is 0 or not finite.
    """
    _, e = jnp.frexp(v)
    tiny_exp = jnp.finfo(v.dtype).minexp
    unit = jnp.ldexp(jnp.ones_like(v), jnp.maximum(e - 1, tiny_exp))
    usable = jnp.isfinite(v) & (v > 0)
    return jnp.where(usable, unit, jnp.ones_like(v))


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
      >>> qbits._calibration.round_scale(s, "pow2")
      Array([0.25, 1.  , 4.  ], dtype=float32)
      >>> qbits._calibration.round_scale(s, "e8m0")
      Array([0.5, 1. , 4. ], dtype=float32)
    """
    check_choice("round_scale", "rounding", rounding, SCALE_ROUNDINGS)
    if rounding == "none":
        return scale
    # Subnormal scales round to the smallest normal power of two anyway; frexp
    # is not exact on them everywhere (jax 0.12 flushes them to zero).
    mantissa, exponent = jnp.frexp(jnp.maximum(scale, _F32_TINY))  # m in [0.5, 1)
    half = np.asarray(0.5, scale.dtype)
    up = mantissa >= np.sqrt(half) if rounding == "pow2" else mantissa != half
    # The result is 0.5 * 2**e' = 2**(e' - 1); keep it a normal float32.
    exponent = jnp.clip(exponent + up.astype(exponent.dtype) - 1, -126, 127) + 1
    rounded = jnp.ldexp(jnp.full_like(scale, 0.5), exponent)
    return lax.select(jnp.isnan(scale), scale, rounded)


# Scales are float32 (QTensor stores them so), whatever the compute dtype.
_F32_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = np.float32(np.finfo(np.float32).max)


def scale_limits(
    abs_val_mapped_to: float,
    rounding: ScaleRounding = "none",
    dtype: DTypeLike = np.float32,
) -> tuple[float, float]:
    """The smallest and largest scale :func:`make_scale` gives (float32).

    The smallest is float32's smallest normal, ``2**-126``. The largest is the
    largest float32 ``s`` (a power of two unless ``rounding`` is ``"none"``)
    whose product with ``abs_val_mapped_to`` is at most the largest finite
    value of ``dtype`` (and of float32), so that no grid value times its
    scale overflows there.

    Args:
      abs_val_mapped_to: The grid magnitude the bound maps onto.
      rounding: See :func:`round_scale`.
      dtype: The dtype the dequantized values take.

    Returns:
      ``(smallest, largest)``, Python floats.

    Example:
      >>> qbits._calibration.scale_limits(448.0, "e8m0")
      (1.1754943508222875e-38, 6.646139978924579e+35)
      >>> qbits._calibration.scale_limits(127.5, "e8m0", jnp.float16)
      (1.1754943508222875e-38, 512.0)
    """
    return _scale_limits(float(abs_val_mapped_to), rounding, np.dtype(dtype))


@functools.cache
def _scale_limits(mapped: float, rounding: str, dtype: np.dtype) -> tuple[float, float]:
    top = min(float(_F32_MAX), float(ml_dtypes.finfo(dtype).max))
    m = np.float32(mapped)
    hi = np.float32(min(float(_F32_MAX), top / float(m)))
    with np.errstate(over="ignore"):
        while not float(m * hi) <= top:
            hi = np.nextafter(hi, np.float32(0))
    if rounding != "none":  # the largest power of two <= hi, exactly
        _, exponent = np.frexp(hi)  # hi = f * 2**exponent, f in [0.5, 1)
        hi = np.ldexp(np.float32(1.0), min(int(exponent) - 1, 127))
    return _F32_TINY, float(hi)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def fit_scale_to_dtype(scale: jax.Array, cap: float) -> jax.Array:
    """``min(scale, cap)``: the scaled grid fits the input's narrow dtype.

    A marker for :func:`qbits.scaled.scalify`, where a narrow data dtype
    (float16 data with a float32 scale) does not bound the values, so the
    cap does not apply there (:mod:`qbits.scaled` registers the identity
    for it by this function's name).
    """
    return jnp.minimum(scale, np.asarray(cap, scale.dtype))


@fit_scale_to_dtype.defjvp
def _fit_scale_to_dtype_jvp(cap: float, primals: Any, tangents: Any) -> Any:
    (scale,), (t,) = primals, tangents
    return fit_scale_to_dtype(scale, cap), t


def make_scale(
    bound: jax.Array,
    abs_val_mapped_to: float,
    rounding: ScaleRounding = "none",
    dtype: DTypeLike = np.float32,
) -> jax.Array:
    """Turns bounds into scales: ``bound / abs_val_mapped_to``, rounded.

    A zero bound gives scale 1 (the block is all zeros; see the module
    docstring). Any positive bound gives a positive float32 scale: one too
    small for a normal float32 (also one whose quotient underflows to 0) is
    raised to the smallest normal, ``2**-126``, and one so large that the
    grid's largest value times it would overflow ``dtype`` (or float32) is
    lowered to the largest that does not (:func:`scale_limits`; with
    ``"e8m0"`` that rounds down where rounding up would overflow, and the
    values beyond the grid clip). NaN stays NaN.

    Args:
      bound: Bounds, float32 or float64, non-negative (or NaN).
      abs_val_mapped_to: The grid magnitude the bound maps onto.
      rounding: See :func:`round_scale`.
      dtype: The dtype the dequantized values take (the quantizer's input
        dtype): the scaled grid must fit it.

    Returns:
      The scales, ``bound``'s shape and dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> qbits._calibration.make_scale(jnp.array([255.0, 0.0]), 127.5)
      Array([2., 1.], dtype=float32)
      >>> qbits._calibration.make_scale(jnp.array([1e-37, 3e38]), 448.0, "e8m0")
      Array([1.1754944e-38, 6.6461400e+35], dtype=float32)
    """
    lo, hi = scale_limits(abs_val_mapped_to, "none", np.float32)
    bound = jnp.asarray(bound)
    if not jnp.issubdtype(bound.dtype, jnp.floating):
        bound = bound.astype(jnp.float32)
    scale = lax.div(bound, np.asarray(abs_val_mapped_to, bound.dtype))
    # NaN-preserving clamp (XLA's clamp propagates NaN), with scalar limits.
    scale = lax.clamp(np.asarray(lo, scale.dtype), scale, np.asarray(hi, scale.dtype))
    if rounding != "none":
        _, hi = scale_limits(abs_val_mapped_to, rounding, np.float32)
        scale = jnp.minimum(round_scale(scale, rounding), hi)
    _, fit = scale_limits(abs_val_mapped_to, rounding, dtype)
    if fit < hi:  # a dtype narrower than float32 (bfloat16, float16)
        scale = fit_scale_to_dtype(scale, fit)
    # Compare the bound, not the scale: bound / mapped underflows for tiny
    # positive bounds.
    zero = lax.eq(bound, lax.full_like(bound, 0))
    return lax.select(zero, lax.full_like(scale, 1), scale)
