"""FP8 with 2-D block scales, as DeepSeek-V3 ships it (``quant_method: fp8``).

``quantization_config``: ``quant_method: fp8``, ``fmt: e4m3``,
``activation_scheme: dynamic``, ``weight_block_size: [bm, bn]``
(DeepSeek-V3 and transformers' ``FineGrainedFP8Config``: ``[128, 128]``),
``scale_fmt: float`` or ``ue8m0`` (DeepSeek-V3.1 on: every scale a power
of two, stored as float32, ``float8_e8m0fnu`` or its bytes; the inputs'
scales rounded up to powers of two as well).
Per ``Linear`` module ``m`` (weight ``[out, in]``):

- ``m.weight`` float8_e4m3fn ``[out, in]``;
- ``m.weight_scale_inv`` float32 ``[out / bm, in / bn]``: each block's
  scale (the name says inverse: the weight was divided by it, the
  dequantized weight is ``weight * weight_scale_inv``).

qbits reads float8_e4m3fn codes with a float32 scale per ``bn x bm`` block
of its ``[in, out]`` kernel: ``Tiled(tile_size=bn, free_tile_size=bm)``,
the weight grid of qbits' ``fp8_blockwise`` preset for ``[128, 128]``. A
weight that ends in a partial block (``out`` not a multiple of ``bm``, or
``in`` of ``bn``) gets each block's scale repeated onto tiles of
``gcd(bm, out)`` by ``gcd(bn, in)``, which divide both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qbits.interop._codes import Decoded
from qbits.interop._safetensors import bad, modules_with

__all__ = ["read_fp8_blocks"]

_SCALES = ("float32", "bfloat16")
# ue8m0 (DeepSeek-V3.1 on): float32 powers of two, float8_e8m0fnu, or its bytes
_POW2_SCALES = ("float32", "float8_e8m0fnu", "uint8")


def _powers_of_two(s: np.ndarray) -> bool:
    mantissa, _ = np.frexp(s)
    return bool(np.all(np.isfinite(s) & (s > 0) & (mantissa == 0.5)))


def read_fp8_blocks(
    tensors: Mapping[str, np.ndarray], qc: Mapping[str, Any], where: str
) -> dict[str, Decoded]:
    """Every FP8 module's weight: ``{module name: Decoded}``; checks each tensor."""
    config = f"{where}/config.json"
    block = qc.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise bad(
            f"{config}: weight_block_size",
            block,
            "[rows, columns] of each scale's block (DeepSeek-V3: [128, 128])",
            why="per-tensor FP8 checkpoints without blocks not yet",
        )
    scale_fmt = qc.get("scale_fmt", "float")
    if qc.get("fmt", "e4m3") != "e4m3" or scale_fmt not in ("float", "ue8m0"):
        raise bad(
            f"{config}: fmt, scale_fmt",
            f"{qc.get('fmt')}, {scale_fmt}",
            "e4m3 weights, float or ue8m0 scales",
        )
    bm, bn = block
    modules = modules_with(
        tensors, ".weight_scale_inv", where, "the block scales of FP8 weights",
        "quant_method fp8",
    )  # fmt: skip
    out: dict[str, Decoded] = {}
    for m in modules:
        w, s = tensors.get(f"{m}.weight"), tensors[f"{m}.weight_scale_inv"]
        if w is None or w.dtype.name != "float8_e4m3fn" or w.ndim != 2:
            raise bad(
                f"{where}: {m}.weight",
                "missing" if w is None else f"{w.dtype}{list(w.shape)}",
                "a float8_e4m3fn [out, in] weight",
            )
        n_out, n_in = w.shape
        want = [-(-n_out // bm), -(-n_in // bn)]
        dtypes = _SCALES if scale_fmt == "float" else _POW2_SCALES
        if s.dtype.name not in dtypes or list(s.shape) != want:
            raise bad(
                f"{where}: {m}.weight_scale_inv",
                f"{s.dtype}{list(s.shape)}",
                f"{' or '.join(dtypes)}{want}: a scale per {bm} x {bn} block "
                f"of a [{n_out}, {n_in}] weight",
            )
        if s.dtype == np.uint8:  # ue8m0's bytes (transformers' MXFP8 checkpoints)
            s = s.view(ml_dtypes.float8_e8m0fnu)
        s = s.astype(np.float32)
        if scale_fmt == "ue8m0" and not _powers_of_two(s):
            raise bad(
                f"{where}: {m}.weight_scale_inv",
                "scales that are not powers of two",
                "ue8m0 scales (scale_fmt: ue8m0), powers of two",
            )
        # A last partial block (DeepSeek-V3's 576-row kv_a_proj_with_mqa in
        # blocks of 128): qbits' tiles divide the weight, so its scales are
        # repeated onto the largest tiles that do (gcd(128, 576) = 64 rows).
        fm, fn = math.gcd(bm, n_out), math.gcd(bn, n_in)
        s = np.repeat(np.repeat(s, bm // fm, axis=0), bn // fn, axis=1)
        s = s[: n_out // fm, : n_in // fn]
        out[m] = Decoded(w.T.astype(np.float32), s.T.astype(np.float32), None, 8, "fp8")
    return out
