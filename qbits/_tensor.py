"""Layer 3: QTensor, quantized values with their scales."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct
from jax import lax

from qbits._errors import InvalidArgumentError, normalize_axis
from qbits._formats import FLOAT_FORMATS
from qbits._sharding import take
from qbits.numerics import _SIGNED_MAP

_FORMATS_BY_DTYPE = {f.dtype: f for f in FLOAT_FORMATS.values()}

__all__ = [
    "NESTED_BLOCK",
    "PACKABLE_DTYPES",
    "QTensor",
    "decode_scale",
    "expand_scale",
    "float_scale",
    "pack_nibbles",
    "storage_dtype",
    "unpack_nibbles",
]

# 4-bit storage dtypes that pack two values per uint8 byte.
PACKABLE_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(ml_dtypes.int4),
    np.dtype(ml_dtypes.uint4),
    np.dtype(ml_dtypes.float4_e2m1fn),
)

#: Scales per nested absmax of a double-quantized scale (bitsandbytes').
NESTED_BLOCK = 256


class QTensor(struct.PyTreeNode):
    """Quantized values and their scales: ``value ≈ qvalue * scale``.

    ``scale`` has the rank of the tensor and one entry per scale block:
    along each axis its size is 1 (shared), the axis size (per channel), or
    ``size // tile`` (tiled), so ``dequant`` broadcasts it over each block.

    ``qvalue`` holds the grid values, either in float (as :meth:`Quantizer.quant
    <qbits.Quantizer.quant>` returns them by default, differentiable) or in the
    storage dtype ``qdtype`` (``store=True``: int8, int4, fp8, ...). 4-bit
    storage can be packed two values per byte along one axis
    (:meth:`pack`); ``dequant`` unpacks.

    Three formats add to ``qvalue * scale`` (:attr:`is_plain` is then
    ``False``): a ``zero_point`` per block (asymmetric grids,
    :class:`~qbits.numerics.UintNumerics`): ``(qvalue - zero_point) *
    scale``; a ``codebook`` (NF4, stored): ``qvalue`` holds indices and
    ``codebook[qvalue] * scale`` is the value; and a per-tensor
    ``tensor_scale`` (NVFP4's two-level scaling, ``scale_rounding="e4m3"``):
    the scale of a block is ``scale * tensor_scale``, computed in float32.

    A double-quantized scale (QLoRA's storage of NF4's absmax,
    ``Quantizer(double_quant=True)``) is held as ``scale``: uint8 codes on
    bitsandbytes' signed dynamic map, with ``scale_absmax`` (float32, one
    per :data:`NESTED_BLOCK` scales) and ``scale_offset`` (float32): see
    :func:`decode_scale`.

    Attributes:
      qvalue: The grid values (or, with a ``codebook``, indices into it).
      scale: The scales: float32, ``float8_e4m3fn`` block scales stored
        under a ``tensor_scale``, or uint8 codes of a double-quantized scale.
      qdtype: The storage format (``int8``, ``float8_e4m3fn``, ...), or
        ``None`` when the numerics has none.
      dtype: The dtype :meth:`dequant` returns (the original input's dtype).
      packed_axis: The axis packed two per byte (negative), or ``None``.
      packed_pad: Whether the packed axis had odd length (its last nibble is
        padding).
      zero_point: Integer zero points, one per block (the scale's shape;
        float32 holding integers, or ``int16`` when stored), or ``None``.
      tensor_scale: A float32 second-level scale for the whole tensor (all
        axes of size 1), or ``None``.
      codebook: The values that stored codes stand for (``qvalue`` holds
        indices into it), or ``None``.
      scale_absmax: A double-quantized scale's absmax per nested block,
        float32 ``[*layers, ceil(n / 256)]`` (``n`` scales), or ``None``.
      scale_offset: A double-quantized scale's offset (the scales' mean),
        float32 of shape ``(*layers, 1, ..., 1)``, or ``None``.

    Example:
      >>> import jax.numpy as jnp
      >>> q = qbits.Quantizer(qbits.IntNumerics(bits=4))
      >>> qt = q.quant(jnp.array([0.5, -7.5, 3.0]), store=True)
      >>> qt.qvalue, qt.scale
      (Array([0, -7, 3], dtype=int4), Array([1.], dtype=float32))
      >>> qt.dequant()
      Array([ 0., -7.,  3.], dtype=float32)
      >>> packed = qt.pack()
      >>> packed.qvalue.dtype, packed.qvalue.shape, packed.shape
      (dtype('uint8'), (2,), (3,))
      >>> bool((packed.dequant() == qt.dequant()).all())
      True
    """

    qvalue: jax.Array
    scale: jax.Array
    qdtype: Any = struct.field(pytree_node=False, default=None)
    dtype: Any = struct.field(pytree_node=False, default=np.dtype(np.float32))
    packed_axis: int | None = struct.field(pytree_node=False, default=None)
    packed_pad: bool = struct.field(pytree_node=False, default=False)
    zero_point: jax.Array | None = None
    tensor_scale: jax.Array | None = None
    codebook: tuple[float, ...] | None = struct.field(pytree_node=False, default=None)
    scale_absmax: jax.Array | None = None
    scale_offset: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the tensor the QTensor stands for (packing undone)."""
        shape = list(self.qvalue.shape)
        if self.packed_axis is not None:
            shape[self.packed_axis] = 2 * shape[self.packed_axis] - self.packed_pad
        return tuple(shape)

    @property
    def ndim(self) -> int:
        """The rank."""
        return len(self.qvalue.shape)

    @property
    def is_stored(self) -> bool:
        """Whether ``qvalue`` is in the storage dtype (or packed)."""
        return self.packed_axis is not None or (
            self.qdtype is not None and self.qvalue.dtype == self.storage_dtype
        )

    @property
    def storage_dtype(self) -> np.dtype | None:
        """The dtype that holds ``qdtype`` values in memory.

        Equal to ``qdtype`` except for formats XLA cannot hold (fp6), whose
        values are kept in bfloat16, which represents every one exactly.
        """
        return storage_dtype(self.qdtype)

    @property
    def is_plain(self) -> bool:
        """Whether the value is ``qvalue * scale``: what a real dot contracts.

        ``False`` with a zero point, a codebook, a tensor scale or a
        double-quantized scale.
        """
        extras = (self.zero_point, self.tensor_scale, self.codebook, self.scale_absmax)
        return all(e is None for e in extras)

    @property
    def nbytes(self) -> int:
        """Bytes of ``qvalue``, ``scale``, zero point, tensor scale, nested scales."""
        parts = (
            self.qvalue,
            self.scale,
            self.zero_point,
            self.tensor_scale,
            self.scale_absmax,
            self.scale_offset,
        )
        return sum(
            int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
            for a in parts
            if a is not None
        )

    def unpack(self) -> QTensor:
        """The same QTensor with ``qvalue`` unpacked (no-op when not packed)."""
        if self.packed_axis is None:
            return self
        values = unpack_nibbles(
            self.qvalue, self.storage_dtype, self.packed_axis, self.packed_pad
        )
        return self.replace(qvalue=values, packed_axis=None, packed_pad=False)

    def pack(self, axis: int = -1) -> QTensor:
        """Packs 4-bit stored values two per uint8 byte along ``axis``.

        Raises:
          InvalidArgumentError: If ``qvalue`` is not stored in a 4-bit dtype
            (int4, uint4, float4_e2m1fn) or is already packed.
        """
        if self.packed_axis is not None:
            raise InvalidArgumentError(
                "QTensor.pack", "self", "a packed QTensor", "an unpacked QTensor"
            )
        axis = normalize_axis("QTensor.pack", "axis", axis, self.ndim)
        packed = pack_nibbles(self.qvalue, axis)
        return self.replace(
            qvalue=packed,
            packed_axis=axis - self.ndim,
            packed_pad=bool(self.qvalue.shape[axis] % 2),
        )

    def dequant(self) -> jax.Array:
        """``qvalue * scale`` in float32, returned as ``dtype``.

        With a codebook, ``codebook[qvalue]``; with a zero point,
        ``(qvalue - zero_point) * scale``; with a tensor scale, the scale is
        ``scale * tensor_scale`` (see the class docstring); a double-quantized
        scale is decoded first (:func:`decode_scale`).

        Raises:
          InvalidArgumentError: If ``scale`` does not have one entry per block
            of ``qvalue`` (see the class docstring).
        """
        q = self.unpack().qvalue
        if self.codebook is not None:
            table = jnp.asarray(self.codebook, jnp.float32)
            values = take(table, q.astype(jnp.int32))
        else:
            values = q.astype(jnp.float32)
        scale = float_scale(self)
        if self.zero_point is not None:
            zero = expand_scale(self.zero_point.astype(jnp.float32), q.shape)
            values = values - zero
        if self.tensor_scale is not None:
            scale = scale * self.tensor_scale.astype(jnp.float32)
        return apply_scale(values, scale).astype(self.dtype)


def float_scale(qt: QTensor) -> jax.Array:
    """The scale of ``qt`` in float32 (a double-quantized one decoded)."""
    if qt.scale_absmax is None:
        return qt.scale.astype(jnp.float32)
    if qt.scale_offset is None:
        raise InvalidArgumentError(
            "QTensor", "scale_offset", None, "the offset of the double-quantized scale"
        )
    return decode_scale(qt.scale, qt.scale_absmax, qt.scale_offset)


def decode_scale(codes: jax.Array, absmax: jax.Array, offset: jax.Array) -> jax.Array:
    r"""A double-quantized scale, decoded as bitsandbytes dequantizes it.

    The scales (all but the leading ``absmax.ndim - 1`` axes, stacked
    layers) are taken in the order of their axes reversed (for a kernel
    ``[in, out]``: PyTorch's weight ``[out, in]``, its blocks row by row);
    the ``i``-th of them is, in float32,

    .. math:: s_i = \mathrm{map}[c_i] \cdot a_{\lfloor i / 256 \rfloor} + o

    (``map``: bitsandbytes' signed dynamic 8-bit map, ``a``: ``absmax``,
    ``o``: ``offset``), the product rounded before the sum, as
    ``dequantize_blockwise(codes) + offset`` computes it.

    Raises:
      InvalidArgumentError: If ``codes`` is not uint8 or ``absmax`` and
        ``offset`` do not fit its shape.
    """
    lead = absmax.ndim - 1
    shape = tuple(codes.shape)
    n = int(np.prod(shape[lead:], dtype=np.int64))
    blocks = -(-n // NESTED_BLOCK)
    if (
        codes.dtype != jnp.uint8
        or lead < 0
        or tuple(absmax.shape) != (*shape[:lead], blocks)
        or tuple(offset.shape) != (*shape[:lead], *(1,) * (len(shape) - lead))
    ):
        raise InvalidArgumentError(
            "QTensor",
            "scale, scale_absmax, scale_offset",
            f"{codes.dtype}{list(shape)}, {list(absmax.shape)}, {list(offset.shape)}",
            f"uint8 codes, [*layers, {blocks}] and [*layers, 1, ...] "
            "(one absmax per 256 scales, one offset)",
        )
    perm = (*range(lead), *reversed(range(lead, len(shape))))
    flat = jnp.transpose(codes, perm).reshape(*shape[:lead], n)
    values = take(jnp.asarray(_SIGNED_MAP), flat.astype(jnp.int32))
    nested = jnp.repeat(
        absmax.astype(jnp.float32), NESTED_BLOCK, axis=-1,
        total_repeat_length=blocks * NESTED_BLOCK,
    )[..., :n]  # fmt: skip
    # The product rounded, then the sum. XLA fuses a multiply and an add
    # into one fused multiply-add (rounded once: another float32 number);
    # a max with a floor below every product (the map's lowest level is
    # -0.993) stands between them and changes no value.
    product = jnp.maximum(values * nested, -jnp.abs(nested))
    values = product + offset.astype(jnp.float32).reshape(*shape[:lead], 1)
    moved = values.reshape(*shape[:lead], *(shape[a] for a in perm[lead:]))
    return jnp.transpose(moved, np.argsort(perm))


def storage_dtype(qdtype: Any) -> np.dtype | None:
    """The in-memory dtype for values of format ``qdtype`` (bf16 for fp6)."""
    if qdtype is None:
        return None
    qdtype = np.dtype(qdtype)
    if qdtype in _FORMATS_BY_DTYPE:
        return _FORMATS_BY_DTYPE[qdtype].storage
    return qdtype


def apply_scale(q: jax.Array, scale: jax.Array) -> jax.Array:
    """Multiplies ``q`` by per-block ``scale`` (one entry per block per axis).

    Raises:
      InvalidArgumentError: If ``scale`` has another rank or an axis of
        ``q`` is not a multiple of the scale's size along it.
    """
    return q * expand_scale(scale.astype(q.dtype), q.shape)


def expand_scale(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``scale`` (one entry per block) broadcast to ``shape``, tiles repeated.

    Raises:
      InvalidArgumentError: If ``scale`` has another rank than ``shape`` or
        an axis of ``shape`` is not a multiple of the scale's size along it.
    """
    # An axis of size 0 takes a scale of size 0 (per index) or 1 (shared).
    if scale.ndim != len(shape) or any(
        (n % k if k else n) for n, k in zip(shape, scale.shape, strict=True)
    ):
        raise InvalidArgumentError(
            "QTensor",
            "scale.shape",
            scale.shape,
            f"a shape of rank {len(shape)} whose sizes divide qvalue's {shape}",
        )
    if all(k in (1, n) for n, k in zip(shape, scale.shape, strict=True)):
        return scale
    split: list[int] = []
    for n, k in zip(shape, scale.shape, strict=True):
        split.extend((k, 1) if k not in (1, n) else (k,))
    full: list[int] = []
    for n, k in zip(shape, scale.shape, strict=True):
        full.extend((k, n // k) if k not in (1, n) else (n,))
    return jnp.broadcast_to(scale.reshape(split), full).reshape(shape)


def _nibble_codes(values: jax.Array) -> jax.Array:
    """The 4-bit codes of int4/uint4/fp4 values, as uint8 in 0..15."""
    if np.dtype(values.dtype) not in PACKABLE_DTYPES:
        raise InvalidArgumentError(
            "pack_nibbles",
            "values.dtype",
            values.dtype,
            "int4, uint4 or float4_e2m1fn (store=True values)",
        )
    return lax.bitcast_convert_type(values, jnp.uint4).astype(jnp.uint8)


def pack_nibbles(values: jax.Array, axis: int = -1) -> jax.Array:
    """Packs 4-bit values two per uint8 byte along ``axis``.

    Element ``2i`` goes to the low nibble of byte ``i``, element ``2i + 1`` to
    the high nibble. An odd-length axis is padded with a zero nibble.

    Example:
      >>> import jax.numpy as jnp
      >>> v = jnp.array([1, -2, 7], jnp.int4)
      >>> qbits._tensor.pack_nibbles(v)
      Array([225,   7], dtype=uint8)
    """
    axis = normalize_axis("pack_nibbles", "axis", axis, values.ndim)
    codes = jnp.moveaxis(_nibble_codes(values), axis, -1)
    if codes.shape[-1] % 2:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
    # Pairs by a reshape, not strided slices: it keeps a sharded axis sharded
    # under explicit mesh axes.
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return jnp.moveaxis(packed, -1, axis)


def unpack_nibbles(
    packed: jax.Array, dtype: Any, axis: int = -1, pad: bool = False
) -> jax.Array:
    """Inverse of :func:`pack_nibbles`; drops the padding nibble if ``pad``.

    Example:
      >>> import jax.numpy as jnp
      >>> packed = jnp.array([225, 7], jnp.uint8)
      >>> qbits._tensor.unpack_nibbles(packed, jnp.int4, pad=True)
      Array([1, -2, 7], dtype=int4)
    """
    if packed.dtype != jnp.uint8:
        raise InvalidArgumentError(
            "unpack_nibbles", "packed.dtype", packed.dtype, "uint8"
        )
    dtype = np.dtype(dtype)
    if dtype not in PACKABLE_DTYPES:
        raise InvalidArgumentError(
            "unpack_nibbles", "dtype", dtype, "int4, uint4 or float4_e2m1fn"
        )
    axis = normalize_axis("unpack_nibbles", "axis", axis, packed.ndim)
    b = jnp.moveaxis(packed, axis, -1)
    codes = jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    if pad:
        codes = codes[..., :-1]
    values = lax.bitcast_convert_type(codes.astype(jnp.uint4), dtype)
    return jnp.moveaxis(values, -1, axis)
