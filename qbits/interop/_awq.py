"""AWQ checkpoints (AutoAWQ's GEMM layout, as transformers and vLLM load it), read.

``quantization_config``: ``quant_method: awq``, ``bits: 4``,
``group_size``, ``zero_point: true``, ``version: gemm``. Per ``Linear``
module ``m`` (weight ``[out, in]``, groups of ``g`` inputs):

- ``m.qweight`` int32 ``[in, out / 8]``: codes ``0 .. 15`` packed along
  ``out``, eight a word, in AWQ's order: the word's nibble ``i`` (lowest
  first) holds output ``8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]``;
- ``m.qzeros`` int32 ``[in / g, out / 8]``: the zero points, packed the
  same way (the zero itself, no offset);
- ``m.scales`` float16 ``[in / g, out]``.

The weight is ``(q - z) * s``: qbits reads uint4 codes and int16 zero
points in ``Tiled(g)`` groups along ``in`` (AWQ's input scales are already
folded into the weight).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from qbits.interop._codes import Decoded, unpack_words
from qbits.interop._safetensors import bad, modules_with

__all__ = ["read_awq"]

# Output 8 c + j of a word sits in its nibble _UNDO[j] (AWQ_REVERSE_ORDER).
_UNDO = np.argsort([0, 2, 4, 6, 1, 3, 5, 7])
_SCALES = (np.dtype(np.float16), np.dtype(np.float32))


def _settings(qc: Mapping[str, Any], where: str) -> int:
    """The group size; refuses what the GEMM layout is not."""
    if qc.get("bits", 4) != 4:
        raise bad(
            f"{where}: bits", qc.get("bits"), "4", why="AWQ's GEMM layout is 4-bit"
        )
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise bad(
            f"{where}: version",
            version,
            "gemm",
            why="GEMV, Marlin and ExLlama layouts pack differently (not yet)",
        )
    if not qc.get("zero_point", True):
        raise bad(f"{where}: zero_point", False, "true (AWQ's GEMM layout)")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise bad(f"{where}: group_size", group, "-1 or a positive int")
    return group


def read_awq(
    tensors: Mapping[str, np.ndarray], qc: Mapping[str, Any], where: str
) -> dict[str, Decoded]:
    """Every AWQ module's weight: ``{module name: Decoded}``; checks each tensor."""
    group = _settings(qc, f"{where}/config.json")
    modules = modules_with(
        tensors, ".qweight", where, "AWQ's qweight tensors", "quant_method awq"
    )
    out: dict[str, Decoded] = {}
    for m in modules:
        got = {}
        for part in ("qweight", "qzeros", "scales"):
            t = tensors.get(f"{m}.{part}")
            ok = _SCALES if part == "scales" else (np.dtype(np.int32),)
            if t is None or t.dtype not in ok or t.ndim != 2:
                raise bad(
                    f"{where}: {m}.{part}",
                    "missing" if t is None else f"{t.dtype}{list(t.shape)}",
                    f"AWQ's 2-D {'float16' if part == 'scales' else 'int32'} {part}",
                )
            got[part] = t
        n_in, n_out = got["qweight"].shape[0], got["qweight"].shape[1] * 8
        size = n_in if group == -1 else group
        groups = -(-n_in // size)
        for part, want in (
            ("qzeros", (groups, n_out // 8)),
            ("scales", (groups, n_out)),
        ):
            if got[part].shape != want:
                raise bad(
                    f"{where}: {m}.{part}",
                    list(got[part].shape),
                    f"{list(want)} for a [{n_out}, {n_in}] weight in groups of {size}",
                )
        if n_in % size:
            raise bad(
                f"{where}: {m}.qweight",
                f"{n_in} inputs",
                f"a multiple of group_size {size}",
            )

        def unpacked(words: np.ndarray) -> np.ndarray:
            fields = unpack_words(words, 4, 1)  # [rows, out], nibbles in word order
            rows = fields.reshape(fields.shape[0], -1, 8)[:, :, _UNDO]
            return rows.reshape(fields.shape[0], -1)

        out[m] = Decoded(
            unpacked(got["qweight"]),
            got["scales"].astype(np.float32),
            unpacked(got["qzeros"]).astype(np.int16),
            4,
            "uint",
        )
    return out
