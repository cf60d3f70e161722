"""bitsandbytes' dynamic 8-bit map, and rounding to the nearest of a table's levels.

The dynamic (tree) quantization map of Dettmers et al., "8-bit Optimizers
via Block-wise Quantization" (arXiv 2110.02861), as bitsandbytes builds it
(``create_dynamic_map``): blockwise 8-bit optimizer states
(:mod:`qbits.optim`) and QLoRA's double-quantized NF4 scales
(:class:`~qbits.Quantizer` ``double_quant``) are codes on it.
:func:`count_below` finds a value's place among sorted levels in two
lookups; the nearest level is the number of midpoints below the value (a
value exactly between two levels goes to the lower one).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits._sharding import take

__all__ = ["SIGNED_MAP", "count_below", "dynamic_map", "nearest_level"]


def _torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace(start, end, steps, dtype=torch.float32)`` on CPU.

    ATen steps from both ends with a float32 step and a fused multiply-add
    (``start + i * step`` for the first half, ``end - (steps - 1 - i) *
    step`` for the second), rounded once to float32: the product of two
    float32 numbers is exact in float64.
    """
    start32, end32 = np.float64(np.float32(start)), np.float64(np.float32(end))
    step = np.float64(
        np.float32((np.float32(end) - np.float32(start)) / np.float32(steps - 1))
    )
    i = np.arange(steps)
    low = start32 + step * i
    high = end32 - step * (steps - 1 - i)
    return np.where(i < steps // 2, low, high).astype(np.float32)


def dynamic_map(
    signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8
) -> np.ndarray:
    """The map of bitsandbytes' ``create_dynamic_map``, in float32, sorted.

    Each exponent ``e`` (``10**-6 .. 10**0`` for 8 bits) holds the
    midpoints of a linear grid over ``[0.1, 1]``, more of them the larger
    the exponent; plus 0 and 1.

    Example:
      >>> from qbits.numerics._dynamic import dynamic_map
      >>> m = dynamic_map(signed=True)
      >>> m.shape, float(m[0]), float(m[-1]), float(m[127])
      ((256,), -0.992968738079071, 1.0, 0.0)
    """
    data: list[np.ndarray] = []
    non_sign_bits = total_bits - 1
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)) + 1
        bounds = _torch_linspace(0.1, 1.0, items)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        power = np.float32(10.0 ** (-(max_exponent_bits - 1) + i))
        data.append(power * means)
        if signed:
            data.append(-power * means)
    if extra > 0:  # never for the maps qbits uses (kept for the transcription)
        bounds = _torch_linspace(0.1, 1.0, extra + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        power = np.float32(10.0 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1))
        data.append(power * means)
        if signed:
            data.append(-power * means)
    data.append(np.array([0.0, 1.0], np.float32))
    out = np.concatenate(data).astype(np.float32)
    return np.sort(
        np.concatenate([out, np.zeros(2**total_bits - out.size, np.float32)])
    )


#: The signed 8-bit map (bitsandbytes' default ``code`` of
#: ``quantize_blockwise``, its double quantization's ``nested_quant_map``).
SIGNED_MAP = dynamic_map(signed=True)
SIGNED_MAP.flags.writeable = False


def _keys(bits: Any) -> Any:
    """Integers ordered as the float32 numbers whose bit patterns are ``bits``.

    The bits of a negative number, but its sign, are flipped, so larger
    magnitudes come first (``-0.0`` then sorts just below ``0.0``).
    """
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@functools.cache
def _buckets(entries: bytes) -> tuple[int, np.ndarray, np.ndarray]:
    """``(shift, counts, firsts)`` of :func:`count_below` for a sorted table.

    The float32 numbers are split by their top bits (the order key shifted
    right by ``shift``: the largest shift, 24 down to 12, that puts at most
    one entry in a bucket); ``counts[b]`` entries lie before bucket ``b``
    and ``firsts[b]`` is the first entry from it on (``NaN`` past the end:
    no number is above it).
    """
    table = np.frombuffer(entries, np.float32) + np.float32(0.0)  # -0.0 -> 0.0
    keys = _keys(table.view(np.int32).astype(np.int64))
    shifts = [
        s
        for s in range(24, 11, -1)
        if np.bincount((keys >> s) - (keys.min() >> s)).max() <= 1
    ]
    if not shifts or not np.all(np.diff(table) > 0):
        raise ValueError("a table of levels must increase, its entries apart")
    shift = shifts[0]
    starts = (np.arange(2 ** (32 - shift), dtype=np.int64) - 2 ** (31 - shift)) << shift
    counts = np.searchsorted(keys, starts, "left").astype(np.int32)
    firsts = np.append(table, np.float32(np.nan))[counts]
    return shift, counts, firsts


def count_below(table: np.ndarray, x: jax.Array, inclusive: bool) -> jax.Array:
    """How many of the sorted ``table`` are ``< x`` (``<= x`` if ``inclusive``).

    ``jnp.searchsorted`` in two lookups (kept in ``x``'s layout on any
    mesh): the entries before the bucket of ``x``'s top bits, then one
    comparison with the bucket's first entry, which no other entry shares.
    ``NaN`` counts none, as a binary search's comparisons make it.
    """
    shift, counts, firsts = _buckets(np.asarray(table, np.float32).tobytes())
    x = jnp.where(x == 0, 0.0, jnp.where(jnp.isnan(x), -jnp.inf, x))
    keys = _keys(jax.lax.bitcast_convert_type(x, jnp.int32))
    bucket = (keys >> shift) + 2 ** (31 - shift)
    before = take(jnp.asarray(counts), bucket)
    first = take(jnp.asarray(firsts), bucket)
    return before + (first <= x if inclusive else first < x).astype(jnp.int32)


def nearest_level(table: np.ndarray, x: jax.Array) -> jax.Array:
    """The index (int32) of the level of sorted ``table`` nearest to ``x``.

    A value exactly between two levels goes to the lower one (the midpoints
    are rounded to float32 first); ``NaN`` gets index 0.

    Example:
      >>> from qbits.numerics._dynamic import nearest_level
      >>> table = np.array([-1.0, 0.0, 0.5, 1.0], np.float32)
      >>> nearest_level(table, jnp.array([0.25, 0.26, 0.9, -3.0])).tolist()
      [1, 2, 3, 0]
    """
    table = np.asarray(table, np.float32)
    midpoints = (table[:-1] + table[1:]) / np.float32(2)
    return count_below(midpoints, x, inclusive=False)
