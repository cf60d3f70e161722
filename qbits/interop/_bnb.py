"""bitsandbytes NF4 checkpoints (QLoRA's storage, as transformers saves them), read.

``quantization_config``: ``quant_method: bitsandbytes``, ``load_in_4bit``,
``bnb_4bit_quant_type: nf4``, ``bnb_4bit_use_double_quant``. Per
``Linear4bit`` module ``m`` (weight ``[out, in]``, flattened row by row
into blocks of ``b`` weights; QLoRA: 64):

- ``m.weight`` uint8 ``[out * in / 2, 1]``: NF4 codes, two a byte, the
  first of a pair in the high nibble;
- ``m.weight.quant_map`` float32 ``[16]``: the NF4 levels;
- ``m.weight.quant_state.bitsandbytes__nf4``: JSON bytes (``quant_type``,
  ``blocksize``, ``shape``, double quantization's ``nested_blocksize`` and
  ``nested_offset``);
- ``m.weight.absmax``: a block's absmax, float32, or with double
  quantization its uint8 code in ``m.weight.nested_quant_map`` (256
  float32 values) times the absmax of its group of ``nested_blocksize``
  (``m.weight.nested_absmax`` float32), plus ``nested_offset``.

The weight is ``quant_map[q] * absmax``. qbits reads the uint4 codes of its
NF4 (``Nf4Numerics``, ``Tiled(b)``; a block must lie within one row of
``in``) with the float32 absmax per block or, with double quantization,
holds what the file holds (``Quantizer(double_quant=True)``: the uint8
codes as the scale, ``nested_absmax`` and ``nested_offset`` beside them,
4.127 bits a weight at ``b = 64``), which it decodes as bitsandbytes does
(:func:`qbits._tensor.decode_scale`): the same float32 weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from qbits._tensor import NESTED_BLOCK
from qbits.interop._codes import Decoded
from qbits.interop._safetensors import bad, modules_with
from qbits.numerics import _SIGNED_MAP, Nf4Numerics

__all__ = ["PARTS", "read_bnb"]

# The tensors of a module's weight besides the packed codes.
PARTS = (
    ".weight.absmax",
    ".weight.quant_map",
    ".weight.nested_absmax",
    ".weight.nested_quant_map",
    ".weight.quant_state.bitsandbytes__nf4",
)


def _state(tensors: Mapping[str, np.ndarray], m: str, where: str) -> dict[str, Any]:
    name = f"{m}.weight.quant_state.bitsandbytes__nf4"
    try:
        state = json.loads(bytes(np.asarray(tensors[name], np.uint8)).decode())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"{where}: {name}", "unreadable", "JSON bytes", why=e) from None
    return state


def _need(
    tensors: Mapping[str, np.ndarray], name: str, dtype: str, shape: tuple, where: str
) -> np.ndarray:
    t = tensors.get(name)
    if t is None or t.dtype.name != dtype or tuple(t.shape) != shape:
        raise bad(
            f"{where}: {name}",
            "missing" if t is None else f"{t.dtype}{list(t.shape)}",
            f"{dtype}{list(shape)}",
        )
    return t


def read_bnb(
    tensors: Mapping[str, np.ndarray], qc: Mapping[str, Any], where: str
) -> dict[str, Decoded]:
    """Every NF4 module's weight: ``{module name: Decoded}``; checks each tensor."""
    config = f"{where}/config.json"
    if not qc.get("load_in_4bit") or qc.get("bnb_4bit_quant_type") != "nf4":
        raise bad(
            f"{config}: load_in_4bit, bnb_4bit_quant_type",
            f"{qc.get('load_in_4bit')}, {qc.get('bnb_4bit_quant_type')}",
            "true, nf4",
            why="8-bit (LLM.int8) and FP4 bitsandbytes weights not yet",
        )
    suffix = ".weight.quant_state.bitsandbytes__nf4"
    what = "the NF4 quant states of bitsandbytes' Linear4bit weights"
    modules = modules_with(tensors, suffix, where, what, "load_in_4bit nf4")
    levels = np.asarray(Nf4Numerics().levels, np.float32)
    out: dict[str, Decoded] = {}
    for m in modules:
        state = _state(tensors, m, where)
        shape, block = state.get("shape"), state.get("blocksize")
        if (
            state.get("quant_type") != "nf4"
            or not isinstance(shape, list)
            or len(shape) != 2
            or not isinstance(block, int)
            or block <= 0
        ):
            raise bad(
                f"{where}: {m}{suffix}",
                {k: state.get(k) for k in ("quant_type", "shape", "blocksize")},
                "nf4, a 2-D shape, a positive blocksize",
            )
        n_out, n_in = shape
        if n_in % block:
            raise bad(
                f"{where}: {m}.weight",
                f"[{n_out}, {n_in}] in blocks of {block}",
                f"rows of whole blocks ({n_in} inputs a multiple of {block})",
                why="qbits' NF4 blocks lie along the input axis",
            )
        n = n_out * n_in
        packed = _need(tensors, f"{m}.weight", "uint8", (n // 2, 1), where)
        qmap = _need(tensors, f"{m}.weight.quant_map", "float32", (16,), where)
        if not np.array_equal(qmap, levels):
            raise bad(
                f"{where}: {m}.weight.quant_map",
                "other levels",
                "NF4's 16 levels (qbits.numerics.Nf4Numerics().levels)",
            )
        blocks = n // block
        if "nested_blocksize" in state:  # double quantization
            nb = state["nested_blocksize"]
            codes8 = _need(tensors, f"{m}.weight.absmax", "uint8", (blocks,), where)
            nested = _need(
                tensors,
                f"{m}.weight.nested_absmax",
                "float32",
                (-(-blocks // nb),),
                where,
            )
            table = _need(
                tensors, f"{m}.weight.nested_quant_map", "float32", (256,), where
            )
            offset = state.get("nested_offset")
            if not np.array_equal(table, _SIGNED_MAP):
                raise bad(
                    f"{where}: {m}.weight.nested_quant_map",
                    "other levels",
                    "bitsandbytes' signed dynamic map (create_dynamic_map())",
                )
            if nb != NESTED_BLOCK or not isinstance(offset, int | float):
                raise bad(
                    f"{where}: {m}{suffix}",
                    f"nested_blocksize {nb}, nested_offset {offset!r}",
                    f"nested_blocksize {NESTED_BLOCK} and a float offset "
                    "(bitsandbytes' double quantization)",
                )
            # held as stored: uint8 codes [in // b, out], the nested absmax
            # and offset (qbits' order of the scales is bitsandbytes')
            absmax = codes8.reshape(n_out, n_in // block).T
            nested_parts = (nested, np.full((1, 1), offset, np.float32))
        else:
            absmax = _need(tensors, f"{m}.weight.absmax", "float32", (blocks,), where)
            absmax = absmax.reshape(n_out, n_in // block).T
            nested_parts = None
        nibbles = np.stack([packed[:, 0] >> 4, packed[:, 0] & 0xF], axis=-1)
        codes = nibbles.reshape(n_out, n_in).T.astype(np.int32)  # [in, out]
        out[m] = Decoded(codes, absmax, None, 4, "nf4", nested=nested_parts)
    return out
