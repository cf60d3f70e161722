"""compressed-tensors checkpoints (vLLM's, llm-compressor's), read and written.

``quantization_config`` holds ``config_groups`` (each ``targets``, the
``weights``' ``num_bits``, ``type``, ``symmetric``, ``strategy``,
``group_size``), a ``format`` per group or for all, and ``ignore``. Per
quantized ``Linear`` module ``m`` (weight ``[out, in]``):

- ``pack-quantized`` (int, 4 or 8 bits): ``m.weight_packed`` int32 ``[out,
  in * b / 32]``, codes ``q + 2^(b-1)`` packed along ``in`` lowest bits
  first; ``m.weight_shape`` ``[out, in]``; ``m.weight_scale`` ``[out, in /
  g]`` (group), ``[out, 1]`` (channel) or ``[1]`` (tensor); asymmetric:
  ``m.weight_zero_point`` packed the same way along ``out``. The weight is
  ``(q - z) * s`` with signed ``q`` and ``z``.
- ``float-quantized`` (FP8 E4M3): ``m.weight`` ``float8_e4m3fn`` ``[out,
  in]`` and ``m.weight_scale`` (channel, tensor): ``q * s``.

qbits reads symmetric int codes as int4/int8, asymmetric ones shifted to
unsigned codes and zero points (``(q + 2^(b-1)) - (z + 2^(b-1))``: the
same weight), fp8 as float8_e4m3fn.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qbits.interop._codes import Decoded, pack_words, unpack_words
from qbits.interop._safetensors import bad

__all__ = ["config_group", "read_compressed", "write_compressed"]

FORMATS = (
    "pack-quantized",
    "float-quantized",
    "naive-quantized",
    "nvfp4-pack-quantized",
)
_STRATEGIES = ("group", "channel", "tensor")


def config_group(qc: Mapping[str, Any], module: str) -> Mapping[str, Any]:
    """The config group targeting ``module`` (``{}`` if none does)."""
    for group in (qc.get("config_groups") or {}).values():
        for target in group.get("targets", ()):
            hit = (
                re.fullmatch(target[3:], module)
                if target.startswith("re:")
                else target in ("Linear", module)
            )
            if hit:
                return group
    return {}


def _scheme(qc: Mapping[str, Any], module: str, where: str) -> tuple[str, dict]:
    """The format and weight arguments of the config group targeting ``module``."""
    group = config_group(qc, module)
    if not group:
        raise bad(
            f"{where}: {module}.weight_scale",
            "no config group targets it",
            "a module a config group targets",
        )
    fmt = group.get("format") or qc.get("format")
    if fmt not in FORMATS:
        name = next(k for k, g in qc["config_groups"].items() if g is group)
        raise bad(
            f"{where}/config.json: config_groups.{name}.format",
            fmt,
            "pack-quantized, float-quantized or nvfp4-pack-quantized",
        )
    return fmt, dict(group.get("weights") or {})


def read_compressed(
    tensors: Mapping[str, np.ndarray], qc: Mapping[str, Any], where: str
) -> dict[str, Decoded]:
    """Every quantized module's weight: ``{module name: Decoded}``, checked.

    Refuses what would serve another model: transforms applied as the model
    runs (``transform_config`` at ``input``, ``output``, ``k_cache`` or
    ``q_attn``: Hadamard rotations of QuIP and SpinQuant's R3/R4; those at
    ``weight_input``/``weight_output`` are already in the stored weights)
    and weights stored sparse (``sparsity_config.format`` other than
    ``dense``).
    """
    _check_dense_and_offline(qc, where)
    out: dict[str, Decoded] = {}
    modules = sorted(
        n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")
    )
    for m in modules:
        fmt, args = _scheme(qc, m, where)
        if fmt == "nvfp4-pack-quantized":
            out[m] = _nvfp4(tensors, m, args, where)
            continue
        bits, kind = args.get("num_bits"), args.get("type")
        strategy, sym = args.get("strategy"), args.get("symmetric", True)
        if strategy not in _STRATEGIES:
            raise bad(
                f"{where}: {m} weights.strategy",
                strategy,
                ", ".join(_STRATEGIES),
                why="block and tensor_group scales not yet",
            )
        scale = tensors[f"{m}.weight_scale"]
        if fmt == "pack-quantized":
            if kind != "int" or bits not in (4, 8):
                raise bad(
                    f"{where}: {m} weights", f"{kind} {bits} bits", "int, 4 or 8 bits"
                )
            shape = tensors.get(f"{m}.weight_shape")
            packed = tensors.get(f"{m}.weight_packed")
            if (
                shape is None
                or packed is None
                or packed.dtype != np.int32
                or packed.ndim != 2
            ):
                raise bad(
                    f"{where}: {m}.weight_packed",
                    "missing or not int32 [out, words]",
                    "pack-quantized's weight_packed and weight_shape",
                )
            n_out, n_in = (int(n) for n in shape)
            if packed.shape != (n_out, -(-n_in * bits // 32)):
                raise bad(
                    f"{where}: {m}.weight_packed",
                    list(packed.shape),
                    f"[{n_out}, {-(-n_in * bits // 32)}] for a {bits}-bit "
                    f"[{n_out}, {n_in}] weight",
                )
            codes = unpack_words(packed, bits, 1)[:, :n_in].T - (1 << (bits - 1))
        else:
            w = tensors.get(f"{m}.weight")
            if (
                kind != "float"
                or bits != 8
                or w is None
                or w.dtype.name != "float8_e4m3fn"
            ):
                raise bad(
                    f"{where}: {m}.weight",
                    "missing" if w is None else f"{kind} {bits} bits, {w.dtype}",
                    "float8_e4m3fn (float, 8 bits)",
                )
            n_out, n_in = w.shape
            codes = w.T.astype(np.float32)
        groups = {"group": n_in // (args.get("group_size") or n_in), "channel": 1}
        want = [n_out, groups[strategy]] if strategy in groups else [1]
        if list(scale.shape) not in (want, want[:1] * (strategy == "tensor")):
            raise bad(
                f"{where}: {m}.weight_scale",
                list(scale.shape),
                f"{want} ({strategy} scales of a [{n_out}, {n_in}] weight)",
            )
        s = scale.astype(np.float32).reshape(-1, want[-1]).T  # [groups, out] or [1, 1]
        if fmt == "float-quantized":
            out[m] = Decoded(codes, s, None, 8, "fp8")
        elif sym:
            out[m] = Decoded(codes, s, None, bits, "int")
        else:
            zp = tensors.get(f"{m}.weight_zero_point")
            words = -(-n_out * bits // 32)
            if zp is None or zp.dtype != np.int32 or zp.shape != (words, s.shape[0]):
                raise bad(
                    f"{where}: {m}.weight_zero_point",
                    "missing" if zp is None else f"{zp.dtype}{list(zp.shape)}",
                    f"int32{[words, s.shape[0]]}",
                )
            zero = unpack_words(zp, bits, 0)[
                :n_out
            ].T  # [groups, out], offset by 2^(b-1)
            out[m] = Decoded(
                codes + (1 << (bits - 1)), s, zero.astype(np.int16), bits, "uint"
            )
    if not modules:
        raise bad(
            f"{where}: *.weight_scale",
            "missing",
            "compressed-tensors' scales",
            why="config.json declares quant_method compressed-tensors",
        )
    return out


def _check_dense_and_offline(qc: Mapping[str, Any], where: str) -> None:
    """Raises for online transforms or sparse storage (see :func:`read_compressed`)."""
    groups = (qc.get("transform_config") or {}).get("config_groups") or {}
    for name, scheme in groups.items():
        for args in scheme.get("apply") or ():
            if args.get("location") not in ("weight_input", "weight_output"):
                raise bad(
                    f"{where}/config.json: transform_config.{name}",
                    f"a {scheme.get('type')} transform at {args.get('location')}",
                    "transforms at weight_input or weight_output only (in "
                    "the stored weights)",
                    why="transforms applied to activations as the model runs "
                    "are not yet served",
                )
    sparse = (qc.get("sparsity_config") or {}).get("format")
    if sparse not in (None, "dense"):
        raise bad(
            f"{where}/config.json: sparsity_config.format",
            sparse,
            "dense",
            why="sparse storage (bitmasks, 2:4) not yet",
        )


def _nvfp4(
    tensors: Mapping[str, np.ndarray], m: str, args: Mapping[str, Any], where: str
) -> Decoded:
    """An ``nvfp4-pack-quantized`` weight: E2M1 codes, E4M3 scales, global scale.

    ``weight_packed`` uint8 ``[out, in / 2]`` (element ``2i`` in the low
    nibble, each nibble E2M1's bits), ``weight_scale`` float8_e4m3fn
    ``[out, in / 16]``, ``weight_global_scale`` float32 ``[1]``; the
    weight is ``q * (scale / global_scale)``. qbits' NVFP4 holds the same
    codes and scales under the tensor scale ``1 / global_scale`` (float32).
    """
    want = {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": 16,
        "symmetric": True,
    }
    got = {k: args.get(k) for k in want}
    if got != want:
        raise bad(f"{where}: {m} weights", got, f"NVFP4's {want}")
    parts = {}
    for part, dtype in (
        ("weight_packed", "uint8"),
        ("weight_scale", "float8_e4m3fn"),
        ("weight_global_scale", "float32"),
    ):
        t = tensors.get(f"{m}.{part}")
        if t is None or t.dtype.name != dtype:
            raise bad(
                f"{where}: {m}.{part}",
                "missing" if t is None else f"{t.dtype}{list(t.shape)}",
                f"{dtype}, nvfp4-pack-quantized's {part}",
            )
        parts[part] = t
    packed, scale, gs = parts.values()
    n_out, n_in = packed.shape[0], 2 * packed.shape[-1]
    for part, shape in (
        ("weight_packed", (n_out, n_in // 2)),
        ("weight_scale", (n_out, n_in // 16)),
        ("weight_global_scale", (1,)),
    ):
        if parts[part].shape != shape or n_in % 16:
            raise bad(
                f"{where}: {m}.{part}",
                list(parts[part].shape),
                f"{list(shape)} for a [{n_out}, {n_in}] weight in groups of 16",
            )
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n_out, n_in)
    codes = nibbles.T.astype(np.uint8).view(ml_dtypes.float4_e2m1fn)
    return Decoded(
        codes.astype(np.float32),
        scale.T.astype(np.float32),
        None,
        4,
        "fp4",
        tensor_scale=float(np.float32(1) / gs[0]),
    )


def write_compressed(
    weights: Mapping[str, Decoded], group: int | None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Tensors and config: ``pack-quantized``, ``float-quantized`` or NVFP4's.

    ``group``: inputs per scale, ``None`` for one per channel or (every
    scale ``(1, 1)``) one per tensor.
    """
    first = next(iter(weights.values()))
    if first.kind == "fp4":
        return _write_nvfp4(weights)
    tensors: dict[str, np.ndarray] = {}
    bits, kind = first.bits, first.kind  # one grid, checked by the caller
    per_tensor = group is None and all(d.scale.size == 1 for d in weights.values())
    mid = 1 << (bits - 1)
    for m, d in weights.items():
        scale = d.scale.T.astype(np.float32)
        tensors[f"{m}.weight_scale"] = scale.reshape(1) if per_tensor else scale
        if kind == "fp8":
            tensors[f"{m}.weight"] = d.codes.T.astype(ml_dtypes.float8_e4m3fn)
            continue
        codes = d.codes - (mid if kind == "uint" else 0)  # signed
        tensors[f"{m}.weight_packed"] = pack_words(codes.T + mid, bits, 1)
        tensors[f"{m}.weight_shape"] = np.array(d.codes.shape[::-1], np.int64)
        if d.zero is not None:
            tensors[f"{m}.weight_zero_point"] = pack_words(
                d.zero.T.astype(np.int64), bits, 0
            )
    fmt = "float-quantized" if kind == "fp8" else "pack-quantized"
    weights_args = {
        "num_bits": bits,
        "type": "float" if kind == "fp8" else "int",
        "symmetric": kind != "uint",
        "dynamic": False,
        "strategy": "group" if group else "tensor" if per_tensor else "channel",
        "group_size": group or None,
    }
    return tensors, _config(fmt, weights_args)


def _write_nvfp4(
    weights: Mapping[str, Decoded],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """NVFP4 weights as ``nvfp4-pack-quantized`` (the layout :func:`_nvfp4` reads).

    The codes and E4M3 scales are written as they are; the global scale is
    ``1 / tensor_scale`` in float32, as compressed-tensors computes its own
    (``generate_gparam``): not every float32 is the reciprocal of one, so
    ``1 / global_scale`` may lie a float32 ulp from qbits' tensor scale.
    """
    tensors: dict[str, np.ndarray] = {}
    for m, d in weights.items():
        bits = d.codes.T.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
        tensors[f"{m}.weight_packed"] = (bits[:, 0::2] | (bits[:, 1::2] << 4)).astype(
            np.uint8
        )
        tensors[f"{m}.weight_scale"] = d.scale.T.astype(ml_dtypes.float8_e4m3fn)
        tensors[f"{m}.weight_global_scale"] = np.reshape(
            np.float32(1) / np.float32(d.tensor_scale), (1,)
        )
    weights_args = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "strategy": "tensor_group",
        "group_size": 16,
        "scale_dtype": "torch.float8_e4m3fn",
    }
    return tensors, _config("nvfp4-pack-quantized", weights_args)


def _config(fmt: str, weights_args: dict[str, Any]) -> dict[str, Any]:
    """The ``quantization_config`` of one config group targeting every Linear."""
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights_args, "format": fmt}
        },
        "ignore": [],
    }
