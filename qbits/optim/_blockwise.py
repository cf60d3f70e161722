"""Blockwise quantized moments: codes + one absmax per block.

An optimizer moment (a float32 array shaped like its parameter) is stored
as codes of the parameter's shape and one float32 scale per block of
``block_size`` consecutive elements of the flattened array, the scale
being the block's absolute maximum (Dettmers et al. 2022, "8-bit
Optimizers via Block-wise Quantization", arXiv 2110.02861). A value is
divided by its block's absmax and rounded to the nearest level of a map
(``dynamic``, ``linear``) or cast to FP8 E4M3 after dividing by
``absmax / 448`` (``fp8``).

The maps, 8-bit:

- ``dynamic``: bitsandbytes' dynamic (tree) quantization map,
  ``create_dynamic_map`` transcribed in float32: signed for the first
  moment, unsigned (all 8 bits for magnitudes, levels down to 1e-7) for
  the second.
- ``linear``: signed ``k / 127`` (k = -127..127); unsigned ``k / 256``
  (k = 1..256), no zero level, so a small second moment never becomes 0
  (which would blow the update up through ``1 / (sqrt(v) + eps)``).

4-bit (torchao's 4-bit optimizer, after Li et al. 2023, "Memory
Efficient Optimizers with 4-bit States"): signed ``create_dynamic_map(
signed=True, max_exponent_bits=3, total_bits=4)`` for the first moment,
``k / 16`` (k = 1..16, no zero) for the second; ``linear`` 4-bit is
signed ``k / 7``. Codes are packed two per byte along the last axis.

Rounding is to the nearest level; a value exactly between two levels goes
to the lower one, as bitsandbytes' ``quantize_blockwise`` decides
(``torch.bucketize`` on the midpoints). Stochastic rounding picks one of
the two levels around a value with probabilities that make it unbiased.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qbits._errors import InvalidArgumentError
from qbits._formats import float_format, round_to_format, stochastic_round_to_format
from qbits._sharding import like, take
from qbits._tensor import expand_scale, pack_nibbles
from qbits.numerics import UniformNoise

__all__ = ["QuantizedMoment", "dequantize", "dynamic_map", "levels", "quantize"]

_FP8 = float_format("float8_e4m3fn", owner="qbits.optim")
_FP8_MAX = np.float32(448.0)


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
      >>> from qbits.optim._blockwise import dynamic_map
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


def levels(state_format: str, bits: int, signed: bool) -> np.ndarray | None:
    """The sorted float32 levels of a map (``None`` for ``fp8``).

    Example:
      >>> from qbits.optim._blockwise import levels
      >>> levels("dynamic", 4, signed=False)[:2].tolist()
      [0.0625, 0.125]
    """
    if state_format == "fp8":
        return None
    if state_format == "dynamic" and (bits == 8 or signed):
        return dynamic_map(signed, 7 if bits == 8 else 3, bits)
    if signed:
        top = 2 ** (bits - 1) - 1
        return (np.arange(-top, top + 1, dtype=np.float32) / np.float32(top)).astype(
            np.float32
        )
    return np.arange(1, 2**bits + 1, dtype=np.float32) / np.float32(2**bits)


class QuantizedMoment(struct.PyTreeNode):
    """One optimizer moment stored as codes and blockwise absmax scales.

    The leaves are ``codes`` (``uint8``; shaped like the parameter, the
    last axis halved for 4-bit codes packed two per byte; ``float8_e4m3fn``
    for ``fp8``) and ``absmax`` (float32, one per block of ``block_size``
    elements of the flattened parameter; for ``fp8`` the block's absmax
    divided by 448). Both are laid out like the parameter: the codes as
    its axes, the scales along its first axis. Orbax saves and restores
    them like any array.

    Attributes:
      codes: The codes.
      absmax: The blocks' scales.
      shape: The parameter's shape.
      state_format: ``"dynamic"``, ``"linear"`` or ``"fp8"``.
      bits: 8 or 4.
      signed: The map of a signed moment (Adam's first) or of a
        non-negative one (its second).
      block_size: Elements per scale.

    Example:
      >>> import jax.numpy as jnp
      >>> from qbits.optim import QuantizedMoment
      >>> from qbits.optim._blockwise import quantize
      >>> q = quantize(jnp.linspace(-1.0, 1.0, 4096), "dynamic", 8, True, 2048)
      >>> isinstance(q, QuantizedMoment), q.codes.dtype, q.absmax.shape
      (True, dtype('uint8'), (2,))
    """

    codes: jax.Array
    absmax: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    state_format: str = struct.field(pytree_node=False)
    bits: int = struct.field(pytree_node=False)
    signed: bool = struct.field(pytree_node=False)
    block_size: int = struct.field(pytree_node=False)


def _tiling(shape: tuple[int, ...], block_size: int) -> tuple[int, int] | None:
    """``(axis, m)``: blocks are ``m`` slices of ``axis`` times the axes after it.

    ``None`` when no such split exists (the moment is then flattened and
    its last block may be partial, as bitsandbytes does). Either way the
    blocks, in row-major order, are those of the flattened moment.
    """
    inner = 1
    for axis in range(len(shape) - 1, -1, -1):
        if block_size % inner:
            return None
        m = block_size // inner
        if shape[axis] % m == 0:
            return axis, m
        inner *= shape[axis]
    return None


def scale_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """The shape of a moment's scales: the parameter's rank, or one axis."""
    tiling = _tiling(shape, block_size)
    if tiling is None:
        return (-(math.prod(shape) // -block_size),)
    axis, m = tiling
    return (*shape[:axis], shape[axis] // m, *(1,) * (len(shape) - axis - 1))


def _absmax(x: jax.Array, block_size: int) -> jax.Array:
    shape = tuple(x.shape)
    tiling = _tiling(shape, block_size)
    a = jnp.abs(x)
    if tiling is None:
        flat = jnp.pad(a.reshape(-1), (0, -a.size % block_size))
        return jnp.max(flat.reshape(-1, block_size), axis=1)
    axis, m = tiling
    tiles = a.reshape(*shape[:axis], shape[axis] // m, m, *shape[axis + 1 :])
    out = jnp.max(tiles, axis=tuple(range(axis + 1, len(shape) + 1)))
    return out.reshape(scale_shape(shape, block_size))


def _expand(scale: jax.Array, shape: tuple[int, ...], block_size: int) -> jax.Array:
    """Per-block ``scale`` broadcast to the moment's ``shape``."""
    if _tiling(shape, block_size) is not None:
        return expand_scale(scale, shape)
    n = math.prod(shape)
    return jnp.repeat(scale, block_size, total_repeat_length=scale.size * block_size)[
        :n
    ].reshape(shape)


def _keys(bits: Any) -> Any:
    """Integers ordered as the float32 numbers whose bit patterns are ``bits``.

    The bits of a negative number, but its sign, are flipped, so larger
    magnitudes come first (``-0.0`` then sorts just below ``0.0``).
    """
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@functools.cache
def _buckets(entries: bytes) -> tuple[int, np.ndarray, np.ndarray]:
    """``(shift, counts, firsts)`` of :func:`_count_below` for a sorted table.

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


def _count_below(table: np.ndarray, x: jax.Array, inclusive: bool) -> jax.Array:
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


def quantize(
    x: jax.Array,
    state_format: str,
    bits: int,
    signed: bool,
    block_size: int,
    key: jax.Array | None = None,
) -> QuantizedMoment:
    """Quantizes a float32 moment blockwise; stochastic rounding with ``key``."""
    shape = tuple(x.shape)
    x = x.astype(jnp.float32)
    absmax = _absmax(x, block_size)
    noise = None if key is None else UniformNoise()(shape, key)
    if state_format == "fp8":
        absmax = absmax / _FP8_MAX  # the scale of E4M3's largest value
        inverse = 1.0 / jnp.where(absmax > 0, absmax, 1.0)
        scaled = jnp.clip(x * _expand(inverse, shape, block_size), -_FP8_MAX, _FP8_MAX)
        if noise is not None:
            scaled = stochastic_round_to_format(scaled, _FP8, noise)
        codes = round_to_format(scaled, _FP8).astype(_FP8.dtype)
    else:
        table = levels(state_format, bits, signed)
        # bitsandbytes multiplies by the reciprocal, with absmax >= 1e-38.
        inverse = 1.0 / jnp.maximum(absmax, np.float32(1e-38))
        scaled = jnp.clip(x * _expand(inverse, shape, block_size), -1.0, 1.0)
        if noise is None:  # the nearest level, a tie to the lower one
            midpoints = (table[:-1] + table[1:]) / np.float32(2)
            codes = _count_below(midpoints, scaled, inclusive=False)
        else:  # the level below or above, as likely as makes it unbiased
            low = jnp.clip(
                _count_below(table, scaled, inclusive=True) - 1, 0, table.size - 2
            )
            below = take(jnp.asarray(table), low)
            above = take(jnp.asarray(table), low + 1)
            up = (scaled - below) / (above - below) > noise + 0.5
            codes = low + up.astype(low.dtype)
        # 4-bit: two codes a byte, element 2i in the low nibble.
        codes = pack_nibbles(codes.astype(jnp.uint4)) if bits == 4 else codes
        codes = codes.astype(jnp.uint8)
    return QuantizedMoment(
        codes=codes,
        absmax=absmax,
        shape=shape,
        state_format=state_format,
        bits=bits,
        signed=signed,
        block_size=block_size,
    )


def dequantize(q: QuantizedMoment) -> jax.Array:
    """The float32 moment that ``q`` stores."""
    codes = q.codes
    if q.state_format == "fp8":
        values = codes.astype(jnp.float32)
    elif q.bits == 4:  # looked up by the byte: its low, then its high nibble
        table = levels(q.state_format, q.bits, q.signed)
        table, byte = np.pad(table, (0, 16 - table.size), "edge"), np.arange(256)
        index = codes.astype(jnp.int32)
        pair = [
            take(jnp.asarray(table[nibble]), index) for nibble in (byte & 15, byte >> 4)
        ]
        values = jnp.stack(pair, -1).reshape(*codes.shape[:-1], -1)[..., : q.shape[-1]]
    else:
        table = jnp.asarray(levels(q.state_format, q.bits, q.signed))
        values = take(table, codes.astype(jnp.int32))
    return values * _expand(q.absmax, q.shape, q.block_size)


def laid_out(q: QuantizedMoment, param: Any) -> QuantizedMoment:
    """``q`` with its codes laid out like ``param``, its scales along axis 0."""
    codes = like(q.codes, param, tuple(range(q.codes.ndim)))
    if _tiling(q.shape, q.block_size) is not None:
        axes: tuple[int | None, ...] = tuple(range(q.absmax.ndim))
    else:  # flattened blocks: along the first axis of a vector only
        axes = (0 if len(q.shape) == 1 else None,)
    return q.replace(codes=codes, absmax=like(q.absmax, param, axes))


def check_format(owner: str, state_format: Any, bits: Any) -> None:
    """Raises for a format/bits pair that has no map."""
    allowed = {8: ("dynamic", "linear", "fp8"), 4: ("dynamic", "linear")}
    if bits not in allowed:
        raise InvalidArgumentError(owner, "bits", bits, "8 or 4")
    if state_format not in allowed[bits]:
        raise InvalidArgumentError(
            owner,
            "state_format",
            state_format,
            " or ".join(repr(f) for f in allowed[bits]),
            why=f"the formats of {bits}-bit states",
        )
