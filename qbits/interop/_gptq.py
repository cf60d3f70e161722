"""GPTQ checkpoints (AutoGPTQ, GPTQModel, transformers), read and written.

Per ``Linear`` module ``m`` (weight ``[out, in]``, ``b`` bits, ``p = 32 //
b`` values per int32 word, groups of ``g`` inputs, ``-1``: one group):

- ``m.qweight`` int32 ``[in / p, out]``: codes ``0 .. 2^b - 1`` packed
  along ``in``, lowest bits first;
- ``m.qzeros`` int32 ``[in / g, out / p]``: zero points packed along
  ``out``; ``checkpoint_format: gptq`` (v1) stores ``zero - 1`` (the
  weight is ``(q - (stored + 1)) * s``), ``gptq_v2`` the zero itself;
- ``m.scales`` ``[in / g, out]``: float16 (a float32 model's: float32);
- ``m.g_idx`` int32 ``[in]``: the group of each input, ``i // g``, or
  under act-order (``desc_act``) any assignment of ``g`` inputs to each
  group: qbits then stores the inputs sorted by group (stable), so that
  groups are contiguous blocks again, and keeps that order: the served
  matmul takes its activation's inputs in it (``x[..., order] @ w``).

``sym: true`` checkpoints hold the zero point ``2^(b-1)`` everywhere:
qbits reads them as signed codes ``q - 2^(b-1)`` (int4, int8) with no
zero point; others as unsigned codes with int16 zero points.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qbits.interop._codes import Decoded, pack_words, unpack_words
from qbits.interop._safetensors import bad, modules_with

__all__ = ["read_gptq", "write_gptq"]

_FORMATS = ("gptq", "gptq_v2")
_SCALES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))


def _settings(qc: Mapping[str, Any], where: str) -> tuple[int, int, bool, bool, bool]:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise bad(
            f"{where}: bits",
            bits,
            "4 or 8",
            why="qbits stores int4 and int8 codes (2- and 3-bit GPTQ not yet)",
        )
    group = qc.get("group_size", -1)
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise bad(f"{where}: group_size", group, "-1 or a positive int")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in _FORMATS:
        raise bad(f"{where}: checkpoint_format", fmt, " or ".join(_FORMATS))
    dynamic = qc.get("dynamic") or {}
    for rule, settings in dynamic.items() if isinstance(dynamic, Mapping) else []:
        other = isinstance(settings, Mapping) and any(
            settings[k] != qc.get(k) for k in settings
        )
        if not str(rule).startswith("-:") and other:
            raise bad(
                f"{where}: dynamic",
                {rule: settings},
                "no per-module settings other than the checkpoint's ('-:' "
                "rules, modules left float, are read)",
                why="GPTQModel's dynamic gives the modules a rule matches their "
                "own bits, group_size, sym or desc_act: not read yet",
            )
    return (
        bits,
        group,
        bool(qc.get("sym", True)),
        bool(qc.get("desc_act", False)),
        fmt == "gptq_v2",
    )


def read_gptq(
    tensors: Mapping[str, np.ndarray], qc: Mapping[str, Any], where: str
) -> dict[str, Decoded]:
    """Every GPTQ module's weight: ``{module name: Decoded}``; checks each tensor.

    ``where``: the checkpoint's folder (named in errors).
    """
    bits, group, sym, act_order, v2 = _settings(qc, f"{where}/config.json")
    per = 32 // bits
    out: dict[str, Decoded] = {}
    modules = modules_with(
        tensors, ".qweight", where, "GPTQ's qweight tensors", "quant_method gptq"
    )
    for m in modules:

        def need(suffix: str, dtype: Any, m: str = m) -> np.ndarray:
            name = f"{m}.{suffix}"
            if name not in tensors:
                raise bad(
                    f"{where}: {name}", "missing", f"a {np.dtype(dtype).name} tensor"
                )
            t = tensors[name]
            dtypes = _SCALES if suffix == "scales" else (np.dtype(dtype),)
            if t.dtype not in dtypes or t.ndim != (1 if suffix == "g_idx" else 2):
                raise bad(
                    f"{where}: {name}",
                    f"{t.dtype}{list(t.shape)}",
                    f"{np.dtype(dtype).name}, GPTQ's {suffix}",
                )
            return t

        qweight = need("qweight", np.int32)
        scales, qzeros = need("scales", np.float16), need("qzeros", np.int32)
        n_in, n_out = qweight.shape[0] * per, qweight.shape[1]
        size = n_in if group == -1 else group
        groups = -(-n_in // size)
        for name, t, want in (
            ("scales", scales, (groups, n_out)),
            ("qzeros", qzeros, (groups, -(-n_out // per))),
        ):
            if t.shape != want:
                raise bad(
                    f"{where}: {m}.{name}",
                    list(t.shape),
                    f"{list(want)} for a "
                    f"{bits}-bit [{n_out}, {n_in}] weight in groups of {size}",
                )
        order = None
        if f"{m}.g_idx" in tensors:
            g_idx = need("g_idx", np.int32)
            if not np.array_equal(g_idx, np.arange(n_in) // size):
                # act-order: the inputs sorted by group make contiguous groups
                order = np.argsort(g_idx, kind="stable").astype(np.int32)
                if g_idx.shape != (n_in,) or not np.array_equal(
                    g_idx[order], np.arange(n_in) // size
                ):
                    raise bad(
                        f"{where}: {m}.g_idx",
                        f"{list(g_idx.shape)}, groups {g_idx.min()}..{g_idx.max()} "
                        f"of {np.bincount(g_idx.clip(0)).max()} inputs at most",
                        f"{groups} groups of {size} inputs each",
                        why="an act-order checkpoint permutes its inputs; "
                        "each group holds group_size of them",
                    )
        elif act_order:
            raise bad(
                f"{where}: {m}.g_idx",
                "missing",
                "g_idx",
                why="desc_act (act-order) checkpoints need each input's group",
            )
        codes = unpack_words(qweight, bits, 0)
        if order is not None:
            codes = codes[order]
        zero = unpack_words(qzeros, bits, 1)[:, :n_out] + (0 if v2 else 1)
        scale = scales.astype(np.float32)
        if sym:
            if not np.all(zero == 1 << (bits - 1)):
                raise bad(
                    f"{where}: {m}.qzeros",
                    f"zero points other than {1 << (bits - 1)}",
                    "the symmetric grid's",
                    why="config.json declares sym: true",
                )
            out[m] = Decoded(codes - (1 << (bits - 1)), scale, None, bits, "int", order)
        else:
            out[m] = Decoded(codes, scale, zero.astype(np.int16), bits, "uint", order)
    return out


def write_gptq(
    weights: Mapping[str, Decoded], group: int | None, v2: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """GPTQ tensors and ``quantization_config`` of weights on one grid.

    Signed codes are written as GPTQ's symmetric grid (zero ``2^(b-1)``),
    unsigned ones with their zero points; scales as float16 where float16
    holds each exactly, else float32 (what AutoGPTQ reads into a float32
    model; float16-only kernels need float16 scales); ``group``: inputs per
    scale, ``None`` for one per channel.
    Returns ``(tensors, quantization_config)``.
    """
    tensors: dict[str, np.ndarray] = {}
    half = all(
        np.array_equal(d.scale.astype(np.float16).astype(np.float32), d.scale)
        for d in weights.values()
    )
    first = next(iter(weights.values()))
    bits, kind = first.bits, first.kind  # one grid (group: None per channel), checked
    for m, d in weights.items():
        mid = 1 << (bits - 1)
        codes = d.codes + mid if kind == "int" else d.codes
        zero = (
            np.full(d.scale.shape, mid) if d.zero is None else d.zero.astype(np.int64)
        )
        stored = zero - (0 if v2 else 1)
        g_idx = np.arange(d.codes.shape[0]) // d.group
        if d.order is not None:  # act-order: row i of codes holds input order[i]
            codes, g_idx = codes.copy(), g_idx.copy()
            codes[d.order], g_idx[d.order] = codes.copy(), g_idx.copy()
        tensors[f"{m}.qweight"] = pack_words(codes, bits, 0)
        tensors[f"{m}.qzeros"] = pack_words(stored, bits, 1)
        tensors[f"{m}.scales"] = d.scale.astype(np.float16 if half else np.float32)
        tensors[f"{m}.g_idx"] = g_idx.astype(np.int32)
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": -1 if group is None else group,
        "sym": kind == "int",
        "desc_act": any(d.order is not None for d in weights.values()),
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
    return tensors, config
