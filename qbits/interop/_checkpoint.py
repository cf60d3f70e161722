"""``read_checkpoint`` and ``write_checkpoint``: quantized safetensors folders."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits._tensor import QTensor
from qbits.interop._awq import read_awq
from qbits.interop._bnb import PARTS as _BNB_PARTS
from qbits.interop._bnb import read_bnb
from qbits.interop._codes import Decoded, from_qtensor, to_qtensor
from qbits.interop._compressed import read_compressed, write_compressed
from qbits.interop._fp8block import read_fp8_blocks
from qbits.interop._gptq import read_gptq, write_gptq
from qbits.interop._inputs import INPUT_PARTS, input_quantizers, written_inputs
from qbits.interop._safetensors import bad, read_tensors, write_tensors

__all__ = ["Checkpoint", "read_checkpoint", "write_checkpoint"]

_READERS = {
    "gptq": read_gptq,
    "awq": read_awq,
    "compressed-tensors": read_compressed,
    "fp8": read_fp8_blocks,
    "bitsandbytes": read_bnb,
}
_WRITE_FORMATS = ("gptq", "gptq_v2", "compressed-tensors")
# Parts of a quantized module that are not other tensors of the model.
_PARTS = (
    ".qweight",
    ".qzeros",
    ".scales",
    ".g_idx",
    ".weight_packed",
    ".weight_shape",
    ".weight_scale",
    ".weight_zero_point",
    ".weight_global_scale",
    ".weight_scale_inv",
    *_BNB_PARTS,
)
# Constants of a tensor, not bytes per weight (not in Checkpoint.stored_bytes).
_TABLES = (
    ".weight_shape",
    ".weight.quant_map",
    ".weight.nested_quant_map",
    ".weight.quant_state.bitsandbytes__nf4",
)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A pre-quantized checkpoint, read into qbits' stored weights.

    Attributes:
      format: ``"gptq"``, ``"gptq_v2"``, ``"awq"``, ``"fp8"`` or
        ``"compressed-tensors/<format>"``.
      weights: ``{PyTorch module name: QTensor}``: each quantized ``Linear``
        weight stored as qbits serves a dense kernel, ``[in, out]`` (the
        transpose of PyTorch's ``[out, in]``): int4/uint4 codes packed two
        per byte along ``out``, int8/uint8 or float8_e4m3fn codes, float32
        scales per block, int16 zero points for asymmetric grids; NVFP4's
        float4_e2m1fn codes with E4M3 scales under a tensor scale;
        bitsandbytes NF4 with double quantization as stored (uint8 scale
        codes, their absmax per 256 and offset). No float copy of a weight
        is held.
      quantizers: ``{module name: Quantizer}``: the qbits grid each weight
        is on (``IntNumerics``/``UintNumerics``/``Fp8Numerics`` with
        ``Tiled(group)``, ``PerChannel()`` or ``PerTensor()``), for the
        config that serves it.
      tensors: Every other tensor (norms, embeddings, unquantized layers),
        by name, as stored (PyTorch layout).
      quantization_config: The ``quantization_config`` of ``config.json``.
      input_orders: ``{module name: int32 [in]}`` for act-order GPTQ
        weights (``desc_act``, ``g_idx`` not ``i // group_size``): the
        weight's rows hold the inputs sorted by group, row ``r`` PyTorch's
        input ``order[r]``, so that each group is contiguous; serving
        multiplies ``x[..., order]`` by it (:func:`serving_params` carries
        the order along). Empty for every other checkpoint.
      stored_bytes: ``{module name: int}``: the bytes each quantized
        weight takes in the checkpoint's files: its codes, scales, zero
        points and ``g_idx`` as stored there (GPTQ's float16 scales;
        bitsandbytes' double quantization: a uint8 absmax per block and a
        float32 one per 256 blocks, QLoRA's 4.127 bits a weight at blocks
        of 64), not a format's per-tensor constants (quant maps,
        ``weight_shape``, the JSON quant state). ``weights[m].nbytes`` is
        what qbits holds: the same arrays (float32 scales where the file
        has float16 ones), plus 4 bytes for double quantization's offset.
      activations: ``{module name: Quantizer}`` for the layers whose inputs
        the checkpoint quantizes as it runs (compressed-tensors' FP8
        ``input_activations``, dynamic or on a static ``input_scale``, and
        int8 per token, NVFP4 under a static global scale; DeepSeek FP8's
        per-token blocks):
        :func:`serving_params` quantizes those inputs so. What qbits does
        not reproduce (asymmetric int8 inputs, other static scales) is
        named in a warning when the checkpoint is read.

    Example:
      >>> import os, qbits.interop
      >>> ckpt = qbits.interop.read_checkpoint(os.path.join(
      ...     "tests", "data", "quantized", "gptq_w4g16_asym"))
      >>> ckpt.format, sorted(ckpt.weights)[0]
      ('gptq', 'model.layers.0.self_attn.o_proj')
      >>> w = ckpt.weights["model.layers.0.self_attn.q_proj"]
      >>> w.shape, w.qdtype, w.scale.shape, w.zero_point.dtype  # [in, out]
      ((64, 32), dtype(uint4), (4, 32), dtype('int16'))
    """

    format: str
    weights: Mapping[str, QTensor]
    quantizers: Mapping[str, Quantizer]
    tensors: Mapping[str, np.ndarray]
    quantization_config: Mapping[str, Any]
    input_orders: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    stored_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    activations: Mapping[str, Quantizer] = dataclasses.field(default_factory=dict)


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Reads a pre-quantized safetensors checkpoint into stored weights.

    Formats (``quantization_config.quant_method`` of ``config.json``):
    ``gptq`` (AutoGPTQ, GPTQModel and transformers' layout: 4 and 8 bits,
    symmetric or not, groups or one per channel, act-order, ``checkpoint_format``
    ``gptq`` or ``gptq_v2``), ``awq`` (AutoAWQ's GEMM layout),
    ``compressed-tensors`` (``pack-quantized`` int4/int8 with group,
    channel or tensor scales and zero points; ``float-quantized`` FP8 E4M3
    with channel or tensor scales; ``nvfp4-pack-quantized``) and ``fp8``
    (DeepSeek-V3's E4M3 weights with 2-D block scales). Every tensor is
    checked against the declared format before anything is returned.

    Args:
      path: The checkpoint folder: ``config.json`` and one
        ``*.safetensors`` file or the shards of
        ``model.safetensors.index.json``.

    Returns:
      A :class:`Checkpoint`.

    Warns:
      UserWarning: Naming what the checkpoint declares about its layers'
        inputs (or outputs, or KV cache) that qbits does not reproduce
        (asymmetric int8 inputs, other static scales): those are then served
        in float. FP8 inputs (dynamic, or static per tensor), int8 ones
        (dynamic per token) and NVFP4 ones are reproduced
        (:attr:`Checkpoint.activations`).

    Raises:
      InvalidArgumentError: One line naming the file and tensor: an unknown
        format or bit width, a missing tensor, shapes or dtypes that do not
        fit the declared format, a truncated shard, ``desc_act`` without
        ``g_idx``, or a ``g_idx`` whose groups do not hold ``group_size``
        inputs each.

    Example:
      >>> import os, qbits.interop
      >>> ckpt = qbits.interop.read_checkpoint(os.path.join(
      ...     "tests", "data", "quantized", "ct_fp8_channel"))
      >>> ckpt.format, ckpt.weights["model.layers.0.self_attn.q_proj"].qdtype
      ('compressed-tensors/float-quantized', dtype(float8_e4m3fn))
      >>> sorted(ckpt.tensors)
      ['lm_head.weight', 'model.norm.weight']
    """
    folder = pathlib.Path(path)
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise bad(
            str(config_file), "unreadable", "the model's config.json", why=e
        ) from None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        raise bad(
            f"{config_file}: quantization_config",
            "missing",
            "a pre-quantized model's quantization_config",
        )
    method = qc.get("quant_method")
    if method not in _READERS:
        raise bad(
            f"{config_file}: quant_method",
            method,
            " or ".join(_READERS),
            why="hqq, eetq, torchao and other methods not yet",
        )
    tensors = read_tensors(folder)
    decoded = _READERS[method](tensors, qc, str(folder))
    fmt = {
        "gptq": qc.get("checkpoint_format", "gptq"),
        "compressed-tensors": f"compressed-tensors/{qc.get('format')}",
    }.get(method, method)
    used = {m + p for m in decoded for p in _PARTS}
    used |= {f"{m}.weight" for m, d in decoded.items() if d.kind in ("fp8", "nf4")}
    # The inputs' (outputs', cache's) scales are no model tensors either.
    aside = sorted(k for k in tensors if k.endswith(INPUT_PARTS))
    activations, unread, read = input_quantizers(
        method, qc, sorted(decoded), tensors, str(folder)
    )
    aside_unread = [k for k in aside if k not in read]
    if aside_unread and not unread:
        unread = [f"the scales {aside_unread[0]!r} and others of that kind"]
    if unread:
        warnings.warn(
            f"{folder}: the weights are read, but not {'; '.join(unread)}: "
            "qbits serves those values in float, where a serving engine "
            "would quantize them",
            stacklevel=2,
        )
    used |= set(aside)
    stored = {
        m: sum(
            int(tensors[n].nbytes)
            for n in {*(m + p for p in _PARTS), f"{m}.weight"} & used
            if n in tensors and not n.endswith(_TABLES)
        )
        for m in decoded
    }
    return Checkpoint(
        format=fmt,
        weights={m: to_qtensor(d) for m, d in decoded.items()},
        quantizers={m: d.quantizer() for m, d in decoded.items()},
        tensors={k: v for k, v in tensors.items() if k not in used},
        quantization_config=qc,
        input_orders={m: d.order for m, d in decoded.items() if d.order is not None},
        stored_bytes=stored,
        activations=activations,
    )


def write_checkpoint(
    path: str | os.PathLike,
    weights: Mapping[str, QTensor],
    format: str = "gptq",
    tensors: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    input_orders: Mapping[str, Any] | None = None,
    activations: Mapping[str, Quantizer] | None = None,
) -> None:
    """Writes stored weights as a GPTQ or compressed-tensors checkpoint.

    Args:
      path: The folder (created): ``config.json`` and ``model.safetensors``.
      weights: ``{PyTorch module name: QTensor}``: 2-D stored weights ``[in,
        out]`` (a dense kernel's layout, as :class:`Checkpoint` holds them
        and :func:`qbits.ptq.quantize_weights` stores them), all on one
        grid: int4/int8 (symmetric) or uint4/uint8 with zero points, in
        groups along ``in``, one scale per output channel or one per
        tensor; or float8_e4m3fn per channel or per tensor; or NVFP4
        (float4_e2m1fn codes, float8_e4m3fn scales per 16 inputs, a tensor
        scale: the ``nvfp4`` presets' weights).
      format: ``"gptq"`` (v1 zero points, ``zero - 1``), ``"gptq_v2"`` or
        ``"compressed-tensors"`` (``pack-quantized``; fp8:
        ``float-quantized``; NVFP4: ``nvfp4-pack-quantized``, its global
        scale ``1 / tensor_scale`` in float32; 2-D float ``*.weight``
        tensors beside them are its ``ignore`` list). GPTQ scales are
        float16 where float16 holds them all exactly (a checkpoint read
        from GPTQ), else float32 (qbits' PTQ scales: a float32 model's
        GPTQ checkpoint, which AutoGPTQ reads; float16-only kernels need
        float16 scales).
      tensors: Other tensors to write as they are (norms, embeddings),
        PyTorch layout. Its 2-D ``*.weight`` tensors are Linear layers kept
        float, which the loaders must leave float: compressed-tensors'
        ``ignore`` list; GPTQ's ``block_name_to_quantize`` (the quantized
        modules' common prefix) and ``modules_in_block_to_quantize`` (their
        names), as transformers (optimum) selects the layers it converts.
      config: Other ``config.json`` entries (``model_type``, sizes).
      input_orders: ``{module name: int [in]}``: for a weight whose rows
        hold its inputs in another order, the input each row holds (an
        act-order GPTQ checkpoint's :attr:`Checkpoint.input_orders`: pass
        them with its weights, else the rows are written as the inputs in
        order). Written as GPTQ's ``g_idx`` (``desc_act``); not in
        compressed-tensors.
      activations: ``{module name: Quantizer}``: the quantizer of each
        layer's input where the model quantizes it too (W8A8, a
        :attr:`Checkpoint.activations`): written as compressed-tensors'
        ``input_activations``, so that serving engines quantize the inputs
        as qbits does. Dynamic E4M3 per tensor, per token or per group of
        inputs, one for all quantized layers.

    Raises:
      InvalidArgumentError: For an unknown format, weights on different
        grids or not int4/uint4/int8/uint8/float8_e4m3fn, fp8 weights in
        GPTQ, GPTQ weights whose sizes are not whole int32 words of codes
        (multiples of 8 at 4 bits, of 4 at 8), or zero points the format
        cannot store (``0 .. 2^b - 1``; GPTQ v1 stores ``zero - 1``: no
        zero of 0), or an input order that is not a permutation of its
        weight's inputs (or is given for compressed-tensors), or (GPTQ) a
        float Linear whose name ends in a quantized module's.

    Example:
      >>> import os, tempfile, qbits.interop
      >>> ckpt = qbits.interop.read_checkpoint(os.path.join(
      ...     "tests", "data", "quantized", "gptq_w4g16_sym"))
      >>> out = os.path.join(tempfile.mkdtemp(), "ct")
      >>> qbits.interop.write_checkpoint(out, ckpt.weights, "compressed-tensors")
      >>> again = qbits.interop.read_checkpoint(out)
      >>> w = "model.layers.0.self_attn.q_proj"
      >>> bool((again.weights[w].dequant() == ckpt.weights[w].dequant()).all())
      True
    """
    owner = "qbits.interop.write_checkpoint"
    if format not in _WRITE_FORMATS:
        raise InvalidArgumentError(owner, "format", format, " or ".join(_WRITE_FORMATS))
    decoded = {
        m: from_qtensor(qt, owner, f"weights[{m!r}]") for m, qt in weights.items()
    }
    for m, order in (input_orders or {}).items():
        order = np.asarray(order)
        d = decoded.get(m)
        n_in = None if d is None else d.codes.shape[0]
        if (
            d is None
            or format == "compressed-tensors"
            or order.shape != (n_in,)
            or not np.array_equal(np.sort(order), np.arange(n_in))
        ):
            raise InvalidArgumentError(
                owner,
                f"input_orders[{m!r}]",
                f"{order.dtype}{list(order.shape)}",
                "a permutation of the inputs of a weight in weights, for GPTQ "
                "(compressed-tensors is written without an input order)",
            )
        decoded[m] = dataclasses.replace(d, order=order.astype(np.int64))
    inputs = written_inputs(owner, format, decoded, activations or {})
    # One grid: bits, zero points or not, one group size (a weight of one
    # group is on every grid whose group is its input size).
    groups = {d.group for d in decoded.values() if d.scale.shape[0] > 1}
    group = next(iter(groups)) if len(groups) == 1 else None
    grids = {(d.bits, d.kind, _blocks(d, group)) for d in decoded.values()}
    floats = any(d.kind in ("fp8", "fp4") for d in decoded.values())
    if len(grids) != 1 or (floats and format != "compressed-tensors"):
        raise InvalidArgumentError(
            owner,
            "weights",
            f"grids {sorted(map(str, grids))}",
            "weights all on one grid (bits, zero points, group); fp8 "
            "(float-quantized) and NVFP4 in compressed-tensors only",
        )
    # float Linear weights beside them (a layer the method left float)
    floats = sorted(
        n[: -len(".weight")]
        for n, t in (tensors or {}).items()
        if n.endswith(".weight") and np.ndim(t) == 2
    )
    if format.startswith("gptq"):
        _check_gptq(owner, decoded, v2=format == "gptq_v2")
        out, qc = write_gptq(_per_channel(decoded), group, v2=format == "gptq_v2")
        qc.update(_gptq_selection(owner, sorted(decoded), floats))
    else:
        _check_zeros(owner, decoded, 0, "compressed-tensors")
        out, qc = write_compressed(decoded, group)
        qc["ignore"] = floats
        if inputs is not None:
            qc["config_groups"]["group_0"]["input_activations"] = inputs
    for name, t in (tensors or {}).items():
        out[name] = np.asarray(t)
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    write_tensors(folder / "model.safetensors", out)
    full = {**(config or {}), "quantization_config": qc}
    (folder / "config.json").write_text(
        json.dumps(full, indent=2, sort_keys=True) + "\n"
    )


def _gptq_selection(
    owner: str, quantized: list[str], floats: list[str]
) -> dict[str, Any]:
    """The GPTQ config entries that keep ``floats`` float in transformers.

    transformers loads GPTQ through optimum's ``GPTQQuantizer.convert_model``:
    it converts the ``Linear`` modules whose names start with
    ``block_name_to_quantize`` and, given ``modules_in_block_to_quantize``,
    only those ending in one of its names. Written: the quantized modules'
    common dotted prefix and their full names.

    Raises:
      InvalidArgumentError: If a float module's name ends in a quantized
        one's (``encoder.q`` beside ``q``): that rule would convert it too.
    """
    parts = [m.split(".") for m in quantized]
    common = []
    for names in zip(*parts, strict=False):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    clash = [f for f in floats if f not in quantized and f.endswith(tuple(quantized))]
    if clash:
        raise InvalidArgumentError(
            owner,
            "tensors",
            f"float {clash[0]!r}",
            "float Linear weights whose names do not end in a quantized module's name",
            why="GPTQ's modules_in_block_to_quantize matches name endings",
        )
    return {
        "block_name_to_quantize": ".".join(common),
        "modules_in_block_to_quantize": [quantized],
    }


def _blocks(d: Decoded, group: int | None) -> Any:
    """A weight's scale blocks: its group, ``"channel"`` or ``"tensor"``."""
    if d.scale.shape == (1, 1) and d.codes.shape[1] != 1:
        return "tensor"
    if d.scale.shape[0] == 1:
        return group if d.codes.shape[0] == group else "channel"
    return d.group


def _per_channel(decoded: Mapping[str, Decoded]) -> dict[str, Decoded]:
    """One scale (and zero point) per tensor repeated per channel (GPTQ's)."""
    out = {}
    for m, d in decoded.items():
        width = (d.scale.shape[0], d.codes.shape[1])
        zero = None if d.zero is None else np.broadcast_to(d.zero, width)
        out[m] = dataclasses.replace(
            d, scale=np.broadcast_to(d.scale, width), zero=zero
        )
    return out


def _check_gptq(owner: str, decoded: Mapping[str, Decoded], v2: bool) -> None:
    """GPTQ holds zero points ``0 .. 2^b - 1`` (v1: ``1 .. 2^b``) in whole words."""
    for m, d in decoded.items():
        per = 32 // d.bits
        if d.codes.shape[0] % per or d.codes.shape[1] % per:
            raise InvalidArgumentError(
                owner,
                f"weights[{m!r}]",
                f"a [{d.codes.shape[1]}, {d.codes.shape[0]}] weight",
                f"inputs and outputs in multiples of {per} for {d.bits}-bit GPTQ",
                why="qweight and qzeros pack whole int32 words; AutoGPTQ reads no "
                "padding",
            )
    _check_zeros(owner, decoded, 0 if v2 else 1, format_name(v2))


def _check_zeros(owner: str, decoded: Mapping[str, Decoded], lo: int, fmt: str) -> None:
    """Zero points ``lo .. lo + 2^b - 1``: what ``b`` bits hold (no silent wrap).

    qbits' asymmetric grid spans a group's own [min, max], so a group of
    one sign has its zero point outside the codes; the formats' cannot.
    """
    for m, d in decoded.items():
        if d.zero is not None and (
            d.zero.min() < lo or d.zero.max() > (1 << d.bits) - 1 + lo
        ):
            raise InvalidArgumentError(
                owner,
                f"weights[{m!r}]",
                f"zero points {d.zero.min()}..{d.zero.max()}",
                f"{lo}..{(1 << d.bits) - 1 + lo} for {fmt}",
            )


def format_name(v2: bool) -> str:
    """The GPTQ format's name."""
    return "gptq_v2" if v2 else "gptq (v1 stores zero - 1)"
