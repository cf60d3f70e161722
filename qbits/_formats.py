"""Low-bit float formats, and the float dtypes qbits computes in.

Layer 0: what the numerics (layer 1) and every layer above share about
dtypes.

Every float format of 8 bits or fewer that ml_dtypes defines is described by
:class:`FloatFormat`, read off ml_dtypes itself. :func:`round_to_format` puts
float32 values onto a format's grid with the format's own semantics (round to
nearest even, its subnormals, its overflow: inf, NaN or saturation). Formats
that XLA casts natively use ``astype``; the others (fp6, which XLA:CPU cannot
cast) are emulated exactly in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._platform import per_platform

__all__ = [
    "FLOAT_FORMATS",
    "FloatFormat",
    "check_float_input",
    "compute_dtype",
    "float_format",
    "round_to_format",
    "stochastic_round_to_format",
]

# The element formats, by ml_dtypes name. float8_e8m0fnu is a scale format
# (no sign, no zero); scales round to it through scale_rounding="e8m0".
_NAMES = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3",
    "float8_e3m4",
    "float8_e4m3b11fnuz",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
)
# Formats XLA converts to and from natively on every backend qbits targets.
_NATIVE = {n for n in _NAMES if not n.startswith("float6")}


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """The parameters of a low-bit float format.

    Attributes:
      name: The ml_dtypes name, e.g. ``"float8_e4m3fn"``.
      dtype: The numpy dtype.
      bits: Total bits.
      nmant: Explicit mantissa bits.
      max: Largest finite value.
      min_exp: Exponent of the smallest normal value (``2**min_exp``).
      overflow: What a value beyond ``max`` becomes: ``"inf"``, ``"nan"`` or
        ``"saturate"``.
      signed_zero: Whether ``-0.0`` exists.
      native: Whether XLA casts to it directly (else it is emulated).
      storage: The dtype that holds its values on the real path: the format
        itself where XLA can hold it, else bfloat16 (which holds every value
        of the format exactly).
    """

    name: str
    dtype: np.dtype
    bits: int
    nmant: int
    max: float
    min_exp: int
    overflow: str
    signed_zero: bool
    native: bool
    storage: np.dtype


def _describe(name: str) -> FloatFormat:
    dtype = np.dtype(getattr(ml_dtypes, name))
    info = ml_dtypes.finfo(dtype)
    big = np.array([1e30], np.float32).astype(dtype).astype(np.float32)[0]
    overflow = "inf" if np.isinf(big) else ("nan" if np.isnan(big) else "saturate")
    neg_zero = np.array([-0.0], np.float32).astype(dtype).astype(np.float32)[0]
    native = name in _NATIVE
    return FloatFormat(
        name=name,
        dtype=dtype,
        bits=int(info.bits),
        nmant=int(info.nmant),
        max=float(info.max),
        min_exp=int(np.log2(float(info.smallest_normal))),
        overflow=overflow,
        signed_zero=bool(np.signbit(neg_zero)),
        native=native,
        storage=dtype if native else np.dtype(jnp.bfloat16),
    )


FLOAT_FORMATS: dict[str, FloatFormat] = {n: _describe(n) for n in _NAMES}


def float_format(
    fmt: Any, *, owner: str = "float_format", bits: int | None = None
) -> FloatFormat:
    """Looks up a format by ml_dtypes name or dtype.

    Args:
      fmt: A name such as ``"float8_e4m3fn"`` or a dtype such as
        ``jnp.float8_e4m3fn``.
      owner: Who is asking, for the error message.
      bits: If given, only formats of exactly this many bits are accepted.

    Returns:
      The format's :class:`FloatFormat`.

    Raises:
      InvalidArgumentError: If ``fmt`` is not one of the accepted formats.

    Example:
      >>> from qbits._formats import float_format
      >>> f = float_format("float8_e4m3fn")
      >>> f.max, f.min_exp, f.overflow
      (448.0, -6, 'nan')
    """
    allowed = {n: f for n, f in FLOAT_FORMATS.items() if bits in (None, f.bits)}
    if isinstance(fmt, str):
        found = allowed.get(fmt)
    else:
        try:
            dtype = np.dtype(fmt)
        except TypeError:
            dtype = None
        found = next((f for f in allowed.values() if f.dtype == dtype), None)
    if found is None:
        raise InvalidArgumentError(owner, "dtype", fmt, "one of " + ", ".join(allowed))
    return found


def _binade_ulp(a: jax.Array, fmt: FloatFormat) -> jax.Array:
    """The format's spacing at ``a >= 0``, in ``a``'s own binade."""
    _, e = jnp.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    e = jnp.maximum(e - 1, fmt.min_exp)  # subnormals share the lowest spacing
    return jnp.ldexp(jnp.ones_like(a), e - fmt.nmant)


def _finish(q: jax.Array, x: jax.Array, fmt: FloatFormat) -> jax.Array:
    """Applies overflow, sign and signed-zero semantics to magnitudes ``q``."""
    if fmt.overflow == "saturate":
        q = jnp.minimum(q, fmt.max)
    else:
        special = jnp.inf if fmt.overflow == "inf" else jnp.nan
        q = jnp.where(q > fmt.max, special, q)
    q = jnp.copysign(q, x)
    # XLA folds `q + 0.0` away, so drop the sign of zero with a select.
    return q if fmt.signed_zero else jnp.where(q == 0, jnp.zeros_like(q), q)


def emulated_round_to_format(x: jax.Array, fmt: FloatFormat) -> jax.Array:
    """Rounds ``x`` (float32 or float64) to nearest even on ``fmt``'s grid.

    Exact: dividing by the (power-of-two) spacing is exact, so there is a
    single rounding, as in a native cast.
    """
    a = jnp.abs(x)
    ulp = _binade_ulp(a, fmt)
    return _finish(jnp.round(a / ulp) * ulp, x, fmt)


def round_to_format(x: jax.Array, fmt: FloatFormat) -> jax.Array:
    """Rounds ``x`` (float32 or float64) onto ``fmt``, keeping ``x``'s dtype.

    Round to nearest even, the format's subnormals and its overflow behaviour;
    NaN stays NaN even for formats that have no NaN (the float result can hold
    it).
    """
    if not fmt.native:
        return jnp.where(jnp.isnan(x), x, emulated_round_to_format(x, fmt))
    has_nan = bool(np.isnan(np.float32(np.nan).astype(fmt.dtype).astype(np.float32)))

    def cpu(x: jax.Array) -> jax.Array:
        return jnp.where(jnp.isnan(x), x, x.astype(fmt.dtype).astype(x.dtype))

    def other(x: jax.Array) -> jax.Array:
        # XLA's GPU compiler removes a narrowing-widening cast pair as "excess
        # precision" (--xla_allow_excess_precision, on by default), which
        # would leave x unrounded; the barrier keeps the narrow value. The
        # cast keeps NaN where the format has one.
        y = lax.optimization_barrier(x.astype(fmt.dtype)).astype(x.dtype)
        return y if has_nan else jnp.where(jnp.isnan(x), x, y)

    return per_platform(x, cpu=cpu, default=other)


def stochastic_round_to_format(
    x: jax.Array, fmt: FloatFormat, noise: jax.Array
) -> jax.Array:
    """Rounds ``x`` up or down to a neighbour on ``fmt``'s grid, unbiased.

    ``noise`` is uniform in ``[-0.5, 0.5)``; one unit of it is one unit in the
    last place of the value's own binade, so the result is always one of the
    two grid points around ``x`` and ``E[result] = x``. Overflow follows the
    format (apply :func:`round_to_format` afterwards for its semantics).
    """
    a = jnp.abs(x)
    ulp = _binade_ulp(a, fmt)
    q = jnp.floor(a / ulp + (noise.astype(x.dtype) + 0.5)) * ulp
    return jnp.copysign(q, x)


def check_float_input(owner: str, x: Any) -> jax.Array:
    """Returns ``x`` as a jax array, raising unless it is floating point."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise InvalidArgumentError(
            owner, "x.dtype", x.dtype, "a floating-point dtype (float32, bfloat16, ...)"
        )
    return x


def compute_dtype(dtype: Any) -> np.dtype:
    """The dtype numerics compute in: float64 stays, everything else is f32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype("f4")
