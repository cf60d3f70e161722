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
from qbits.numerics import (
    UniformNoise,
    _count_below,
    _dynamic_map,
    _nearest_level,
)

__all__ = ["QuantizedMoment", "dequantize", "levels", "quantize"]

_FP8 = float_format("float8_e4m3fn", owner="qbits.optim")
_FP8_MAX = np.float32(448.0)


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
        return _dynamic_map(signed, 7 if bits == 8 else 3, bits)
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
            codes = _nearest_level(table, scaled)
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
