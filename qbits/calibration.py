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
  NaN. (:class:`AbsMax` finds non-finite values in its own single pass
  and has no such limit.)

All-zero blocks:
  A bound of 0 gives a scale of 1, so an all-zero block quantizes to exact
  zeros with a finite scale.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from qbits.errors import InvalidArgumentError, check_float, check_int

__all__ = [
    "AMAX_COMPUTES",
    "SCALE_ROUNDINGS",
    "AbsMax",
    "Calibration",
    "ConstantBound",
    "DelayedScaling",
    "LearnedScale",
    "MseSearch",
    "Percentile",
    "ScaleRounding",
    "make_scale",
    "round_scale",
    "scale_from_history",
    "update_history",
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

    #: Whether :meth:`bound` is itself non-finite for every block holding a
    #: NaN or an inf, so that no separate pass over ``x`` has to find them.
    bound_flags_non_finite: ClassVar[bool] = False

    def __call__(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """The bound of each block; NaN for blocks holding a NaN or inf."""
        bound = self.bound(x, axes, quantize).astype(x.dtype)
        finite = jnp.isfinite(bound) if self.bound_flags_non_finite else None
        if finite is None:
            finite = _all_finite(x, axes)
        return lax.select(finite, bound, jnp.full_like(bound, jnp.nan))


def _all_finite(x: jax.Array, axes: Axes) -> jax.Array:
    """Whether each block holds only finite values: whether its sum is finite.

    XLA:CPU's vectorized max reductions drop NaN (a NaN in a 512x2048 array
    gives its largest finite magnitude), but sums keep NaN and inf, and a
    plain sum reads the block without writing a transformed copy first.
    """
    return jnp.isfinite(jnp.sum(x, axis=axes, keepdims=True))


def _max_pair(
    a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    return lax.max(a[0], b[0]), lax.max(a[1], b[1])


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _absmax_nan_as_inf(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``max(|x|)`` over ``axes`` (kept), inf where a NaN is among the values.

    One variadic reduction (the largest magnitude and whether a NaN was
    seen) straight over ``x``: XLA:CPU fuses ``|x|`` into it instead of first
    writing ``|x|`` out for a library reduction kernel, which is faster and
    compiles one kernel fewer. The NaN flag is needed because XLA:CPU's
    vectorized max reductions drop NaN.
    """
    low = np.array(-np.inf, x.dtype)
    magnitude, nan = lax.reduce(
        (jnp.abs(x), jnp.isnan(x).astype(x.dtype)),
        (low, np.zeros((), x.dtype)),
        _max_pair,
        axes,
    )
    out = lax.select(nan > 0, jnp.full_like(magnitude, jnp.inf), magnitude)
    return jnp.expand_dims(out, axes)


@_absmax_nan_as_inf.defjvp
def _absmax_nan_as_inf_jvp(
    axes: tuple[int, ...], primals: tuple[jax.Array], tangents: tuple[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    (x,), (t,) = primals, tangents
    _, dt = jax.jvp(lambda v: jnp.max(jnp.abs(v), axes, keepdims=True), (x,), (t,))
    return _absmax_nan_as_inf(x, axes), dt


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

    bound_flags_non_finite: ClassVar[bool] = True

    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """``clip_factor * max(|x|)`` over ``axes``; inf where ``x`` holds NaN.

        NaN is mapped to inf before the reduction, because XLA:CPU's
        vectorized max reductions drop NaN. On CPU, over trailing axes, one
        variadic reduction of ``(|x|, isnan(x))`` does the same in a single
        pass that XLA:CPU fuses with the producer of ``x`` (faster there);
        elsewhere the mapped ``max`` is the form GPU and TPU compilers fuse
        best. Both are right on every backend.
        """
        axes = tuple(a % x.ndim for a in axes)

        def mapped(x: jax.Array) -> jax.Array:
            magnitude = jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x))
            return jnp.max(magnitude, axis=axes, keepdims=True)

        if axes == tuple(range(x.ndim - len(axes), x.ndim)):
            bound = lax.platform_dependent(
                x, cpu=functools.partial(_absmax_nan_as_inf, axes=axes), default=mapped
            )
        else:  # across rows XLA:CPU runs a variadic reduction slowly
            bound = mapped(x)
        return bound * self.clip_factor


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
    # Subnormal scales round to the smallest normal power of two anyway; frexp
    # is not exact on them everywhere (jax 0.12 flushes them to zero).
    tiny = jnp.finfo(scale.dtype).tiny
    mantissa, exponent = jnp.frexp(jnp.maximum(scale, tiny))  # m in [0.5, 1)
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


AMAX_COMPUTES: tuple[str, ...] = ("max", "most_recent")
LSQ_INITS: tuple[str, ...] = ("lsq", "absmax")


class DelayedScaling(Calibration):
    r"""Delayed scaling: the scale comes from an amax history of earlier steps.

    This is production FP8 training's per-tensor scaling (Transformer
    Engine, Flax's ``fp8_ops``). The quantizer's state holds a ``scale`` and
    an ``amax_history`` ring buffer; at every step

    .. math::

       s_t = \frac{a \cdot 2^{\mathrm{margin}}}{\mathrm{fmt\_max}},
       \quad a = \max(\mathrm{history}_{t-1})
       \ (\text{or its most recent entry}),

    the tensor is quantized with :math:`s_t`, and its own absmax is pushed
    into the history for the next step (:func:`update_history`). When
    :math:`a` is zero or not finite the old scale is kept. The math is in
    :func:`scale_from_history` and :func:`update_history`; the state lives in
    layer 6 (a linen variable collection, nnx Variables) and is updated
    through the backward pass (see :mod:`qbits.ops.stateful`).

    A delayed-scaling quantizer has no bound of its own: used by a stateless
    ``qbits.dot_general`` it raises, naming the stateful alternatives.

    Attributes:
      history_length: Length of the amax ring buffer, an int >= 1 (1024 as
        in Flax and Transformer Engine's defaults).
      amax_compute: ``"max"`` (the largest amax in the history) or
        ``"most_recent"`` (the last step's amax).
      margin: The scale is multiplied by ``2**margin`` (headroom against
        growth between steps); a finite number >= 0.

    Example:
      >>> cal = qbits.calibration.DelayedScaling(history_length=4)
      >>> history = jnp.zeros((4,))
      >>> history = qbits.calibration.update_history(history, jnp.float32(896.0))
      >>> history
      Array([896.,   0.,   0.,   0.], dtype=float32)
      >>> cal.scale(history, jnp.ones((1,)), fmt_max=448.0)
      Array([2.], dtype=float32)
    """

    history_length: int = struct.field(pytree_node=False, default=1024)
    amax_compute: str = struct.field(pytree_node=False, default="max")
    margin: float = struct.field(pytree_node=False, default=0.0)

    def __post_init__(self) -> None:
        check_int("DelayedScaling", "history_length", self.history_length, lo=1)
        if self.amax_compute not in AMAX_COMPUTES:
            raise InvalidArgumentError(
                "DelayedScaling",
                "amax_compute",
                self.amax_compute,
                "one of " + ", ".join(AMAX_COMPUTES),
            )
        check_float("DelayedScaling", "margin", self.margin, lo=0.0)

    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """Raises: a delayed scale is state, which a plain quantizer lacks."""
        raise InvalidArgumentError(
            "DelayedScaling",
            "state",
            None,
            "a stateful matmul: qbits.flax.quantize / qbits.flax.StatefulDotGeneral "
            "(linen), qbits.nnx.quantize / qbits.nnx.QuantizedDotGeneral (nnx) or "
            "qbits.ops.stateful_dot_general",
            why="a delayed scale comes from an amax history of earlier steps, "
            "which only a stateful layer keeps",
        )

    def scale(
        self, history: jax.Array, old_scale: jax.Array, fmt_max: float
    ) -> jax.Array:
        """This step's scale; :func:`scale_from_history` with these settings."""
        return scale_from_history(
            history, old_scale, fmt_max, self.margin, self.amax_compute
        )


def scale_from_history(
    history: jax.Array,
    old_scale: jax.Array,
    fmt_max: float,
    margin: float = 0.0,
    amax_compute: str = "max",
) -> jax.Array:
    r"""The delayed scale: ``amax * 2**margin / fmt_max`` from an amax history.

    Computed exactly as Flax's ``fp8_ops.compute_scale`` (and Transformer
    Engine) do, as the reciprocal of :math:`(\mathrm{fmt\_max} / a) /
    2^{\mathrm{margin}}`, so the two give the same bits.

    Args:
      history: The amax history, ``[history_length]`` (float32); entry 0 is
        the most recent (see :func:`update_history`).
      old_scale: The current scale, kept where the amax is 0 or not finite.
      fmt_max: The largest magnitude of the format (448 for E4M3, 57344 for
        E5M2): ``numerics.abs_val_mapped_to()``.
      margin: Headroom: the scale is multiplied by ``2**margin``.
      amax_compute: ``"max"`` over the history or ``"most_recent"``.

    Returns:
      The new scale, ``old_scale``'s shape and dtype.

    Raises:
      InvalidArgumentError: For an unknown ``amax_compute`` or an empty
        history.

    Example:
      >>> h = jnp.array([2.0, 8.0, 0.0])
      >>> qbits.calibration.scale_from_history(h, jnp.ones((1,)), 4.0)
      Array([2.], dtype=float32)
      >>> qbits.calibration.scale_from_history(
      ...     h, jnp.ones((1,)), 4.0, amax_compute="most_recent")
      Array([0.5], dtype=float32)
      >>> qbits.calibration.scale_from_history(jnp.zeros(3), jnp.full((1,), 3.0), 4.0)
      Array([3.], dtype=float32)
    """
    if amax_compute not in AMAX_COMPUTES:
        raise InvalidArgumentError(
            "scale_from_history",
            "amax_compute",
            amax_compute,
            "one of " + ", ".join(AMAX_COMPUTES),
        )
    if history.ndim != 1 or history.shape[0] < 1:
        raise InvalidArgumentError(
            "scale_from_history",
            "history.shape",
            history.shape,
            "(history_length,) with history_length >= 1",
        )
    amax = jnp.max(history, axis=0) if amax_compute == "max" else history[0]
    amax = amax.astype(old_scale.dtype)
    inverse = 1.0 / old_scale
    factor = (fmt_max / amax) / (2.0**margin)
    factor = jnp.where(amax > 0.0, factor, inverse)
    factor = jnp.where(jnp.isfinite(amax), factor, inverse)
    return 1.0 / factor


def update_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """Pushes this step's amax into the ring buffer (as Flax's ``fp8_ops``).

    The history is rolled one place towards the front and ``amax`` written
    at index 0 (Flax's ``compute_amax_history``): index 0 holds the most
    recent amax, indices 1.. the earlier ones, oldest first; after ``L``
    steps it holds the last ``L`` amaxes.

    Args:
      history: ``[history_length]``.
      amax: A scalar, the tensor's ``max(|x|)`` this step.

    Returns:
      The new history, same shape and dtype.

    Example:
      >>> h = jnp.array([1.0, 2.0, 3.0])
      >>> qbits.calibration.update_history(h, jnp.float32(9.0))
      Array([9., 3., 1.], dtype=float32)
    """
    amax = jnp.asarray(amax).astype(history.dtype)
    return jnp.roll(history, shift=-1, axis=0).at[0].set(amax)


class LearnedScale(Calibration):
    r"""A learned step size (LSQ, Esser et al., arXiv 1902.08153).

    The scale (the step between grid points) is a trainable parameter, one
    per tensor, trained with the LSQ gradient (:func:`qbits.lsq.lsq_quantize`):

    .. math::

       \frac{\partial \hat{x}}{\partial s} = \begin{cases}
       Q(v) - v & -Q_n < v < Q_p \\ Q(v) & \text{otherwise}\end{cases},
       \quad v = x / s,

    scaled by :math:`g = 1 / \sqrt{N Q_p}` (N elements per scale); ``x``
    gets the straight-through gradient inside the range and zero outside.
    The parameter lives with the model's parameters (linen ``params``
    collection, ``<layer>/StatefulDotGeneral_0/lhs_step``).

    Attributes:
      init: How the step is initialised from the first batch: ``"lsq"``
        (:math:`2\,\mathrm{mean}|x| / \sqrt{Q_p}`, the paper's) or
        ``"absmax"`` (:math:`\max|x|` mapped onto the grid's edge).

    Example:
      >>> qbits.calibration.LearnedScale().init
      'lsq'
    """

    init: str = struct.field(pytree_node=False, default="lsq")

    def __post_init__(self) -> None:
        if self.init not in LSQ_INITS:
            raise InvalidArgumentError(
                "LearnedScale", "init", self.init, "one of " + ", ".join(LSQ_INITS)
            )

    def bound(
        self, x: jax.Array, axes: Axes, quantize: QuantizeFn | None = None
    ) -> jax.Array:
        """Raises: a learned step is a parameter, which a plain quantizer lacks."""
        raise InvalidArgumentError(
            "LearnedScale",
            "step",
            None,
            "a layer that holds the step as a parameter: qbits.flax.quantize / "
            "qbits.flax.StatefulDotGeneral or qbits.ops.stateful_dot_general "
            "with steps=",
        )
