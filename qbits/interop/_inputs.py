"""What a checkpoint declares about its layers' inputs (W8A8 and kin).

A weight format says how the weights are stored; some checkpoints also
declare that each layer's *input* is quantized when the model runs, and
serving engines (vLLM, SGLang) then quantize it. Serving such a
checkpoint with float inputs gives another model's outputs, so qbits
quantizes the inputs it can reproduce and says which it cannot:

- compressed-tensors ``input_activations`` with ``type: float``,
  ``num_bits: 8``, ``dynamic: true`` (llm-compressor's ``FP8_DYNAMIC``):
  E4M3 codes with an absmax scale per token (``strategy: token``), per
  tensor (``tensor``) or per ``group_size`` inputs (``group``), computed
  from each input as it comes: a ``Quantizer`` of ``Fp8Numerics`` with
  ``PerChannel()``, ``PerTensor()`` or ``Tiled(group_size)``.
- DeepSeek-V3's FP8 (``quant_method: fp8``, ``activation_scheme:
  dynamic``): E4M3 with an absmax scale per token and ``weight_block_size[1]``
  inputs (``Tiled``), as its ``act_quant`` and transformers' ``FP8Linear``
  quantize them; with ``scale_fmt: ue8m0`` (DeepSeek-V3.1 on) each scale
  rounded up to a power of two (``scale_rounding="e8m0"``).
- compressed-tensors ``input_activations`` with ``type: float``,
  ``num_bits: 8``, ``dynamic: false``, ``strategy: tensor``
  (llm-compressor's static ``FP8``): E4M3 on the calibrated
  ``m.input_scale``: ``ConstantBound(b)`` with ``b / 448`` that scale
  (the float32 ``b`` nearest ``448 s`` that gives it back exactly; for
  about 1 scale in 9 none does, and qbits' is a float32 ulp from it).
- compressed-tensors ``input_activations`` with ``type: int``,
  ``num_bits: 8``, ``dynamic: true``, ``strategy: token``, symmetric
  (llm-compressor's ``W8A8``), as vLLM quantizes them
  (``dynamic_scaled_int8_quant``: a scale ``amax / 127`` per token, codes
  -127..127): ``IntNumerics(bits=8, preserve_max_val=True)`` with
  ``PerChannel()``. compressed-tensors' own fake quantization maps
  ``amax`` onto 127.5 instead (codes -128..127), a grid no serving engine
  runs.

- compressed-tensors' NVFP4 inputs (``nvfp4-pack-quantized`` W4A4:
  ``num_bits: 4``, ``strategy: tensor_group``, ``group_size: 16``,
  ``dynamic: local``): E2M1 in groups of 16 with E4M3 scales computed as
  they come, under the calibrated ``m.input_global_scale`` ``G``:
  two-level scaling (``scale_rounding="e4m3"``) with the tensor amax fixed
  at ``448 * 6 / G`` (``Quantizer(tensor_amax=...)``).

Not reproduced, named in one warning (the layers then read float inputs):
other static input scales (vLLM clips static int8 inputs at -128, qbits'
``IntNumerics`` at -127), asymmetric int8 inputs, other FP4 inputs,
``output_activations`` and a ``kv_cache_scheme`` (qbits' own
:mod:`qbits.kvcache` quantizes a cache).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qbits._calibration import AbsMax, ConstantBound
from qbits._errors import InvalidArgumentError
from qbits._granularity import PerChannel, PerTensor, Tiled
from qbits._quantizer import Quantizer
from qbits.interop._compressed import config_group
from qbits.interop._safetensors import bad
from qbits.numerics import Fp8Numerics, FpNumerics, IntNumerics

__all__ = ["INPUT_PARTS", "input_args", "input_quantizers", "written_inputs"]

#: Tensors of a module's declared input (and output, cache) quantization:
#: not model tensors, whether qbits reproduces the scheme or not.
INPUT_PARTS = (
    ".input_scale",
    ".activation_scale",  # transformers' FP8Linear, activation_scheme static
    ".input_zero_point",
    ".input_global_scale",
    ".output_scale",
    ".output_zero_point",
    ".k_scale",
    ".v_scale",
)
_GRANULARITY = {"token": PerChannel, "tensor": PerTensor}


def input_quantizers(
    method: str,
    qc: Mapping[str, Any],
    modules: Iterable[str],
    tensors: Mapping[str, np.ndarray],
    where: str,
) -> tuple[dict[str, Quantizer], list[str], set[str]]:
    """The quantizer of each module's input, the schemes not reproduced.

    Args:
      method: ``quantization_config.quant_method``.
      qc: The ``quantization_config``.
      modules: The quantized modules' names.
      tensors: The checkpoint's tensors (static input scales).
      where: The checkpoint folder, for errors.

    Returns:
      ``({module: Quantizer}, [what is not reproduced, one line each],
      {the tensors read: static input scales})``.

    Raises:
      InvalidArgumentError: For a static FP8 input whose ``input_scale``
        is missing or not one positive finite float.
    """
    fp8 = Fp8Numerics("float8_e4m3fn")
    # vLLM's dynamic_scaled_int8_quant: scale amax / 127, codes -127..127
    int8_as_vllm = IntNumerics(bits=8, preserve_max_val=True)
    found: dict[str, Quantizer] = {}
    unread: set[str] = set()
    read: set[str] = set()
    if method == "fp8":
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme == "dynamic":
            _, bn = qc["weight_block_size"]
            # ue8m0: DeepSeek-V3.1's act_quant rounds each scale up to 2^k
            pow2 = "e8m0" if qc.get("scale_fmt") == "ue8m0" else "none"
            q = Quantizer(fp8, AbsMax(), Tiled(tile_size=bn), scale_rounding=pow2)
            found = dict.fromkeys(modules, q)
        else:
            unread.add(f"activation_scheme {scheme!r} (activation_scale tensors)")
    if method != "compressed-tensors":
        return found, sorted(unread), read
    for m in modules:
        group = config_group(qc, m)
        args = dict(group.get("input_activations") or {})
        if group.get("output_activations"):
            unread.add("output_activations")
        if not args:
            continue
        strategy = args.get("strategy")
        kind = (args.get("type"), args.get("num_bits"), args.get("dynamic"))
        if kind == ("float", 8, True) and strategy in ("token", "tensor", "group"):
            granularity = (
                Tiled(tile_size=int(args["group_size"]))
                if strategy == "group"
                else _GRANULARITY[strategy]()
            )
            found[m] = Quantizer(fp8, AbsMax(), granularity)
            continue
        if kind == ("float", 8, False) and strategy == "tensor":
            bound = ConstantBound(_bound(tensors.get(f"{m}.input_scale"), m, where))
            found[m] = Quantizer(fp8, bound, PerTensor())
            read.add(f"{m}.input_scale")
            continue
        if kind == ("float", 4, "local") and (strategy, args.get("group_size")) == (
            "tensor_group",
            16,
        ):  # NVFP4 W4A4: E4M3 scales per 16 under the calibrated global scale
            gs = _positive(tensors.get(f"{m}.input_global_scale"), m, where)
            amax = float(np.float32(448 * 6) / np.float32(gs))
            found[m] = Quantizer(
                FpNumerics("float4_e2m1fn"), AbsMax(), Tiled(tile_size=16),
                scale_rounding="e4m3", tensor_amax=amax,
            )  # fmt: skip
            read.add(f"{m}.input_global_scale")
            continue
        if kind == ("int", 8, True) and strategy == "token" and args.get("symmetric"):
            found[m] = Quantizer(int8_as_vllm, AbsMax(), PerChannel())
            continue
        unread.add(
            "input_activations "
            + ", ".join(f"{k} {args.get(k)}" for k in ("type", "num_bits", "strategy"))
            + (", static" if args.get("dynamic") is False else "")
        )
    if qc.get("kv_cache_scheme"):
        unread.add("kv_cache_scheme")
    return found, sorted(unread), read


def _positive(
    value: Any, m: str, where: str, part: str = "input_global_scale"
) -> float:
    """The one positive finite float a static input tensor must hold."""
    s = None if value is None else np.asarray(value)
    if (
        s is None
        or s.size != 1
        or s.dtype.kind != "f"
        or not np.isfinite(s).all()
        or not (s > 0).all()
    ):
        raise bad(
            f"{where}: {m}.{part}",
            "missing" if s is None else f"{s.dtype}{list(s.shape)} {s.ravel()[:2]}",
            "one positive float: the static input scale input_activations declare",
        )
    return float(s.ravel()[0])


def _bound(scale: Any, m: str, where: str) -> float:
    """The float32 bound whose scale (``bound / 448``) is ``scale``."""
    s = np.float32(_positive(scale, m, where, "input_scale"))
    mapped = np.float32(448)
    near = up = down = np.float32(s * mapped)
    nearest_first = [near]
    for _ in range(8):
        up = np.nextafter(up, np.float32(np.inf))
        down = np.nextafter(down, np.float32(0))
        nearest_first += [down, up]
    for b in nearest_first:  # b / 448 is monotone in b: the nearest that gives s
        if np.float32(b / mapped) == s:
            return float(b)
    return float(near)  # none does: the scale is a float32 ulp from s


def input_args(q: Quantizer) -> dict[str, Any] | None:
    """compressed-tensors' ``input_activations`` for an input quantizer.

    ``None`` unless the engines compute it as qbits does: dynamic E4M3 with
    an absmax scale (``AbsMax()``, no scale rounding, provider or noise)
    per tensor, per token (``PerChannel()``) or per group of inputs
    (``Tiled(tile_size=g)`` along them).
    """
    n, grid = q.numerics, q.granularity
    if not (
        isinstance(n, Fp8Numerics)
        and n.dtype == ml_dtypes.float8_e4m3fn
        and n.clip
        and n.noise_fn is None
        and q.calibration == AbsMax()
        and q.scale_rounding == "none"
        and q.provider is None
    ):
        return None
    if isinstance(grid, PerTensor):
        strategy, group = "tensor", None
    elif grid == PerChannel():
        strategy, group = "token", None
    elif grid == Tiled(tile_size=getattr(grid, "tile_size", 0)):
        strategy, group = "group", grid.tile_size
    else:
        return None
    return {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
        "strategy": strategy, "group_size": group,
    }  # fmt: skip


def written_inputs(
    owner: str, format: str, modules: Iterable[str], activations: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The one ``input_activations`` entry ``activations`` write, checked.

    Raises:
      InvalidArgumentError: Unless every module has one input quantizer,
        the same for all, that :func:`input_args` expresses, and the format
        is compressed-tensors.
    """
    if not activations:
        return None
    args = {m: input_args(q) for m, q in activations.items()}
    kinds = {json.dumps(a, sort_keys=True) for a in args.values()}
    if (
        format != "compressed-tensors"
        or set(activations) != set(modules)
        or None in args.values()
        or len(kinds) != 1
    ):
        raise InvalidArgumentError(
            owner, "activations", f"input quantizers of {sorted(activations)}",
            "one dynamic E4M3 input quantizer (AbsMax(), PerTensor(), "
            "PerChannel() or Tiled(tile_size=g)) for every quantized layer, "
            "in compressed-tensors; or none (the inputs served in float)",
        )  # fmt: skip
    return next(iter(args.values()))
