"""Float numerics: fp8 (OCP and FNUZ), fp6 and fp4."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import struct
from jax import lax

from qbits._context import Context
from qbits._errors import InvalidArgumentError, check_bool
from qbits._formats import (
    FloatFormat,
    check_float_input,
    compute_dtype,
    float_format,
    round_to_format,
    stochastic_round_to_format,
)
from qbits.numerics._base import (
    ClippedStraightThrough,
    NoiseFn,
    require_key,
)

__all__ = ["Fp8Numerics", "FpNumerics"]


class FpNumerics(ClippedStraightThrough):
    """The grid of a low-bit float format (fp8, fp6, fp4).

    The input is already divided by the scale, so the calibration bound maps
    onto the format's largest value (448 for ``float8_e4m3fn``). The forward
    pass clips (saturates) to ``[-max, max]`` first, because a plain cast of an
    out-of-range value gives NaN (``e4m3fn``, FNUZ) or inf (``e5m2``); then it
    rounds to nearest even onto the format, subnormals included, or, with
    ``noise_fn``, stochastically: up or down to a neighbouring grid point with
    noise of one unit in the last place of the value's own binade, which is
    unbiased. Formats XLA:CPU cannot cast (fp6) are emulated exactly in
    float32. NaN stays NaN. The output has the input's dtype and holds values
    that are exactly representable in the format.

    Attributes:
      dtype: The format, as an ml_dtypes name (``"float8_e4m3fn"``) or dtype
        (``jnp.float8_e4m3fn``). Every float format of 8 bits or fewer that
        ml_dtypes has, except the scale format ``float8_e8m0fnu``.
      clip: Saturate to ``[-max, max]`` before rounding. Without it,
        out-of-range values follow the format's own overflow (NaN, inf, or
        saturation for fp6/fp4).
      clip_gradient: Zero the gradient where ``|x| > max``.
      noise_fn: Noise for stochastic rounding (e.g. ``UniformNoise()``);
        needs a ``Context`` with a key.

    Raises:
      InvalidArgumentError: For an unknown format.

    Example:
      >>> import jax.numpy as jnp
      >>> e4m3 = qbits.FpNumerics("float8_e4m3fn")
      >>> e4m3.abs_val_mapped_to()
      448.0
      >>> e4m3(jnp.array([500.0, 0.3, -1.06, 1e-4]))
      Array([ 4.48e+02,  3.125e-01, -1.0e+00,  0.0e+00], dtype=float32)
    """

    dtype: Any = struct.field(pytree_node=False)
    clip: bool = struct.field(pytree_node=False, default=True)
    clip_gradient: bool = struct.field(pytree_node=False, default=False)
    noise_fn: NoiseFn | None = struct.field(pytree_node=False, default=None)

    keeps_zero = True  # 0 is on every float grid, and its noise keeps it 0

    def __post_init__(self) -> None:
        owner = type(self).__name__
        fmt = float_format(self.dtype, owner=owner, bits=self._format_bits())
        object.__setattr__(self, "dtype", fmt.dtype)
        check_bool(owner, "clip", self.clip)
        check_bool(owner, "clip_gradient", self.clip_gradient)
        if self.noise_fn is not None and not callable(self.noise_fn):
            raise InvalidArgumentError(
                owner, "noise_fn", self.noise_fn, "None or a callable(shape, key)"
            )

    @staticmethod
    def _format_bits() -> int | None:
        return None

    @property
    def format(self) -> FloatFormat:
        """The :class:`~qbits.numerics.FloatFormat` of ``dtype``."""
        return float_format(self.dtype)

    def abs_val_mapped_to(self) -> float:
        """The format's largest finite value."""
        return self.format.max

    def get_dtype(self) -> np.dtype:
        """The format's dtype."""
        return self.dtype

    def fwd(self, x: jax.Array, context: Context | None) -> jax.Array:
        """Saturate (optional), then round (to nearest even, or stochastically)."""
        owner = type(self).__name__
        x = check_float_input(owner, x)
        fmt = self.format
        y = x.astype(compute_dtype(x.dtype))
        if self.clip:
            top = np.asarray(fmt.max, y.dtype)  # not float64 under x64
            y = lax.clamp(-top, y, top)
        if self.noise_fn is not None:
            noise = self.noise_fn(y.shape, require_key(owner, context))
            y = stochastic_round_to_format(y, fmt, noise)
        if fmt.native and context is not None and context.cast_next:
            # The storage cast that follows rounds exactly as round_to_format
            # (to nearest even, the format's overflow): rounding twice would
            # only hide the cast from XLA behind round_to_format's barrier.
            return y.astype(x.dtype)
        return round_to_format(y, fmt).astype(x.dtype)

    def gradient_range(self) -> tuple[float, float]:
        """The format's finite range (the gradient's mask with ``clip_gradient``)."""
        return (-self.format.max, self.format.max)

    @property
    def clips(self) -> bool:
        """``clip``."""
        return self.clip

    def saturation_edge(self) -> float:
        """The largest value plus half its step (464 for E4M3): it rounds down."""
        fmt = self.format
        top = float(fmt.max)
        return top + 2.0 ** (np.floor(np.log2(top)) - fmt.nmant - 1)

    def smallest_nonzero(self) -> float:
        """The smallest subnormal."""
        return 2.0 ** (self.format.min_exp - self.format.nmant)


class Fp8Numerics(FpNumerics):
    """:class:`FpNumerics` restricted to the 8-bit formats; E4M3 by default.

    Use ``float8_e4m3fn`` for weights and activations and ``float8_e5m2`` for
    gradients, as FP8 training recipes do.

    Example:
      >>> qbits.numerics.Fp8Numerics().get_dtype()
      dtype(float8_e4m3fn)
      >>> qbits.numerics.Fp8Numerics("float8_e5m2").abs_val_mapped_to()
      57344.0
    """

    dtype: Any = struct.field(pytree_node=False, default="float8_e4m3fn")

    @staticmethod
    def _format_bits() -> int | None:
        return 8
