"""One stored weight, as the formats and qbits both see it.

Every format's reader decodes a PyTorch ``Linear`` weight (``[out, in]``)
into a :class:`Decoded`: integer (or fp8) codes laid out as a JAX kernel,
``[in, out]`` (the contracting axis first, as qbits stores a dense layer's
weight), a float32 scale per block, an integer zero point per block or
none, and the qbits quantizer whose grid they are on. :func:`to_qtensor`
makes the stored :class:`~qbits.QTensor` serving reads (int4 and uint4
packed two per byte along the last axis); :func:`from_qtensor` reads one
back for the writers. Nothing here holds a float copy of a weight.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qbits._calibration import AbsMax
from qbits._granularity import PerChannel, PerTensor, Tiled
from qbits._quantizer import Quantizer
from qbits._tensor import QTensor
from qbits.numerics import (
    Fp8Numerics,
    FpNumerics,
    IntNumerics,
    Nf4Numerics,
    UintNumerics,
)

__all__ = ["Decoded", "from_qtensor", "pack_words", "to_qtensor", "unpack_words"]


@dataclasses.dataclass(frozen=True)
class Decoded:
    """A weight's codes ``[in, out]``, scales and zero points per block.

    ``scale`` (float32) and ``zero`` (int16, or ``None``) have shape
    ``(in // group, out)`` (groups), ``(1, out)`` (per channel), ``(1,
    1)`` (per tensor) or ``(in // group, out // free)`` (2-D blocks);
    ``kind``: ``int``: signed codes centred on zero (no zero point),
    ``uint``: unsigned codes with zero points, ``fp8``: E4M3 codes,
    ``nf4``: indices 0..15 of NF4's levels (a codebook).
    ``order``: ``None``, or the PyTorch input each row of ``codes`` holds
    (GPTQ act-order: the inputs sorted by group); the matmul then takes its
    activation as ``x[..., order]``. ``fp4``: NVFP4, E2M1 codes with E4M3
    block scales (held as float32, each exactly an E4M3 value) under the
    float32 ``tensor_scale``. ``nested``: a double-quantized ``scale``
    (bitsandbytes NF4, QLoRA's): ``scale`` holds its uint8 codes, ``nested``
    the float32 absmax per 256 scales and the offset ``(1, 1)``
    (:func:`qbits._tensor.decode_scale`).
    """

    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    bits: int
    kind: str  # "int", "uint", "fp8", "fp4" or "nf4"
    order: np.ndarray | None = None
    tensor_scale: float | None = None
    nested: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def group(self) -> int:
        """Inputs per scale (the whole input axis for one scale per channel)."""
        return self.codes.shape[0] // self.scale.shape[0]

    def quantizer(self) -> Quantizer:
        """The qbits quantizer whose grid these codes are on."""
        if self.kind == "nf4":  # QLoRA's codes in blocks along the input axis
            tiled, double = Tiled(tile_size=self.group), self.nested is not None
            return Quantizer(Nf4Numerics(), AbsMax(), tiled, double_quant=double)
        if self.kind == "fp4":  # NVFP4: qbits.config.presets.nvfp4's weights
            return Quantizer(
                FpNumerics("float4_e2m1fn"), AbsMax(), Tiled(tile_size=16), "e4m3"
            )
        if self.kind == "fp8":
            numerics: Any = Fp8Numerics("float8_e4m3fn")
        elif self.kind == "uint":
            numerics = UintNumerics(bits=self.bits)
        else:
            numerics = IntNumerics(bits=self.bits)
        free = self.codes.shape[1] // self.scale.shape[1]  # outputs per scale
        if self.scale.shape == (1, 1) and self.codes.shape[1] != 1:
            granularity: Any = PerTensor()
        elif free > 1:  # blocks of group x free (DeepSeek-V3's 128 x 128)
            granularity = Tiled(tile_size=self.group, free_tile_size=free)
        elif self.scale.shape[0] == 1:
            granularity = PerChannel()
        else:
            granularity = Tiled(tile_size=self.group)
        return Quantizer(numerics, AbsMax(), granularity)


_STORAGE = {
    ("int", 4): ml_dtypes.int4,
    ("int", 8): np.int8,
    ("uint", 4): ml_dtypes.uint4,
    ("uint", 8): np.uint8,
    ("fp8", 8): ml_dtypes.float8_e4m3fn,
}


def to_qtensor(d: Decoded) -> QTensor:
    """The stored QTensor serving reads (4-bit codes packed along ``out``)."""
    fp4 = d.kind == "fp4"
    own = {"fp4": ml_dtypes.float4_e2m1fn, "nf4": ml_dtypes.uint4}
    dtype = np.dtype(own.get(d.kind) or _STORAGE[d.kind, d.bits])
    scale_dtype = jnp.float8_e4m3fn if fp4 else jnp.float32
    nested = (None, None) if d.nested is None else d.nested
    qt = QTensor(
        jnp.asarray(d.codes.astype(dtype)),
        jnp.asarray(d.scale, jnp.uint8 if d.nested is not None else scale_dtype),
        qdtype=dtype,
        dtype=np.dtype(np.float32),
        zero_point=None if d.zero is None else jnp.asarray(d.zero, jnp.int16),
        tensor_scale=None
        if d.tensor_scale is None
        else jnp.full((1, 1), d.tensor_scale, jnp.float32),
        codebook=Nf4Numerics().levels if d.kind == "nf4" else None,
        scale_absmax=None if nested[0] is None else jnp.asarray(nested[0]),
        scale_offset=None if nested[1] is None else jnp.asarray(nested[1]),
    )
    return qt.pack(axis=-1) if d.bits == 4 else qt


def from_qtensor(qt: QTensor, owner: str, where: str) -> Decoded:
    """A stored 2-D weight ``[in, out]`` as codes.

    int4/uint4/int8/uint8/fp8, or NVFP4 (float4_e2m1fn codes,
    float8_e4m3fn scales per 16 inputs, a float32 tensor scale:
    ``qbits.config.presets.nvfp4``'s weight).

    Raises:
      InvalidArgumentError: For any other layout (a codebook, a tensor
        scale but not NVFP4's, double-quantized scales, another format or
        rank).
    """
    from qbits._errors import InvalidArgumentError

    kinds = {np.dtype(v): k for k, v in _STORAGE.items()}
    kinds[np.dtype(ml_dtypes.float4_e2m1fn)] = ("fp4", 4)
    qdtype = None if qt.qdtype is None else np.dtype(qt.qdtype)
    fp4 = qdtype == np.dtype(ml_dtypes.float4_e2m1fn)
    nvfp4 = (
        fp4
        and qt.tensor_scale is not None
        and np.dtype(qt.scale.dtype) == np.dtype(ml_dtypes.float8_e4m3fn)
        and len(qt.shape) == 2
        and qt.scale.shape == (qt.shape[0] // 16, qt.shape[1])
        and qt.shape[0] % 16 == 0
    )
    if (
        qdtype not in kinds
        or qt.codebook is not None
        or qt.scale_absmax is not None  # double-quantized scales: not written
        or (qt.tensor_scale is not None) != fp4
        or (fp4 and not nvfp4)
        or len(qt.shape) != 2
    ):
        raise InvalidArgumentError(
            owner,
            where,
            f"a {qdtype} weight of shape {list(qt.shape)}"
            + (" with a codebook (NF4)" if qt.codebook is not None else "")
            + (" with double-quantized scales" if qt.scale_absmax is not None else ""),
            "a 2-D int4, uint4, int8, uint8 or float8_e4m3fn weight without "
            "codebook, tensor scale or double-quantized scales, or NVFP4's "
            "(float4_e2m1fn codes, float8_e4m3fn scales per 16 inputs, a "
            "tensor scale)",
        )
    kind, bits = kinds[qdtype]
    codes = np.asarray(qt.unpack().qvalue)
    if fp4:
        return Decoded(
            codes.astype(np.float32),
            np.asarray(qt.scale).astype(np.float32),
            None,
            4,
            "fp4",
            tensor_scale=float(np.asarray(qt.tensor_scale, np.float32).reshape(())),
        )
    codes = codes.astype(np.float32 if kind == "fp8" else np.int32)
    zero = None if qt.zero_point is None else np.asarray(qt.zero_point, np.int32)
    return Decoded(codes, np.asarray(qt.scale, np.float32), zero, bits, kind)


def unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned ``bits``-wide fields of int32 words along ``axis``, low bits first."""
    u = np.moveaxis(np.asarray(words).astype(np.int64) & 0xFFFFFFFF, axis, -1)
    shifts = np.arange(0, 32, bits, dtype=np.int64)
    fields = (u[..., None] >> shifts) & ((1 << bits) - 1)
    fields = fields.reshape(*u.shape[:-1], -1)
    return np.moveaxis(fields, -1, axis).astype(np.int32)


def pack_words(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Inverse of :func:`unpack_words`: unsigned fields into int32 words."""
    v = np.moveaxis(np.asarray(values).astype(np.int64), axis, -1)
    per = 32 // bits
    pad = -v.shape[-1] % per
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
    v = v.reshape(*v.shape[:-1], -1, per) & ((1 << bits) - 1)
    words = (v << np.arange(0, 32, bits, dtype=np.int64)).sum(-1)
    return np.moveaxis(words.astype(np.uint32).view(np.int32), -1, axis)
