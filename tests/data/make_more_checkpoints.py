"""Writes the round-2 checkpoints of tests/interop with the reference packers.

Run once in the reference venv (``pip install qbits[reference]``: PyTorch
CPU, autoawq 0.2.9 and accelerate installed ``--no-deps``,
compressed-tensors 0.20.0, transformers, bitsandbytes)::

    python tests/data/make_more_checkpoints.py

As in ``make_quantized_checkpoints.py`` (whose tiny two-module model,
helpers and ``reference.npz`` layout this reuses), every file is written
by the library that defines the format, never by qbits:

- AWQ (GEMM): AutoAWQ 0.2.9's ``AwqQuantizer.pseudo_quantize_tensor``
  (``awq/quantize/quantizer.py``) finds the group scales and zero points
  of a float16 weight, ``WQLinear_GEMM.from_linear``
  (``awq/modules/linear/gemm.py``) packs it; the reference dequantized
  weight is ``dequantize_gemm`` (``awq/utils/packing_utils.py``, what the
  layer's forward runs on CPU), ``y`` its forward. AutoAWQ's modules are
  imported without its package ``__init__`` (which imports its model zoo
  and ``datasets``).
- compressed-tensors ``nvfp4-pack-quantized`` (0.20.0, its ``NVFP4A16``
  scheme): ``generate_gparam`` (the global scale, from the weight's amax)
  and ``calculate_qparams`` (the E4M3 scales of 16 inputs, under it),
  ``ModelCompressor.compress_model`` and ``update_config`` write the
  checkpoint; the reference dequantized weight is the format's
  compressor's ``decompress`` of the saved tensors (bfloat16, as it
  returns it; ``weight32/<name>``: its ``dequantize`` in float32),
  ``codes/<name>`` its unpacked E2M1 values.
- FP8 with block scales (DeepSeek-V3's ``quant_method: fp8``,
  ``weight_scale_inv``): transformers 5.24's FineGrainedFP8 integration
  (``transformers/integrations/finegrained_fp8.py``): ``Fp8Quantize``
  quantizes each weight (its per-block absmax, E4M3, the inverse scale
  stored), ``Fp8Dequantize`` is the reference dequantized weight. Blocks of
  16 x 32 (``weight_block_size``; DeepSeek-V3 ships 128 x 128, whose
  smallest weight would be 64 KB): the same layout, fixtures of a few KB.
  ``fp8_block24x48``: blocks of 24 x 48 over the same 32 x 64 and 32 x 32
  weights, each ending in a partial block, as DeepSeek-V3's 576-row
  ``kv_a_proj_with_mqa`` does in blocks of 128 (``Fp8Quantize`` quantizes
  only whole blocks: it is given the weight zero-padded to whole blocks,
  which leaves every block's absmax as it is, and its codes are cropped);
  the reference dequantized weight is ``_dequantize_fp8_weight``, the
  integration's dequantization that handles a last partial block.
  ``fp8_block16x32_ue8m0``: ``FineGrainedFP8Config(scale_fmt="ue8m0")``
  (DeepSeek-V3.1's power-of-two scales, stored ``float8_e8m0fnu``).
- bitsandbytes NF4 with double quantization (0.50.2, on CPU):
  ``bitsandbytes.functional.quantize_4bit(w, blocksize=32, quant_type=
  "nf4", compress_statistics=True)``, saved as transformers saves a
  ``Linear4bit`` (the packed weight, then ``QuantState.as_dict(packed=
  True)`` under ``<name>.weight.``), the ``quantization_config`` from
  transformers' ``BitsAndBytesConfig``; the reference weight is
  ``dequantize_4bit``. Blocks of 32 (QLoRA's are 64) so that the 32-input
  ``o_proj`` holds whole blocks of its rows. ``bnb_nf4``: the same without
  double quantization (float32 absmax).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from make_quantized_checkpoints import (
    HERE,
    IN,
    OUT,
    _extras,
    _float_weights,
    _write,
    compress_and_read,
    quantizable_linears,
)
from reference_read import nvfp4_reference


def _awq_modules():
    """AutoAWQ's quantizer, GEMM layer and dequantizer, without its __init__."""
    root = pathlib.Path(importlib.util.find_spec("awq").submodule_search_locations[0])
    package = types.ModuleType("awq")
    package.__path__ = [str(root)]
    sys.modules["awq"] = package
    calib = types.ModuleType("awq.utils.calib_data")  # needs `datasets`; unused
    calib.get_calib_dataset = None
    sys.modules["awq.utils.calib_data"] = calib
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm

    return AwqQuantizer, WQLinear_GEMM, dequantize_gemm


def awq(name: str, group: int) -> None:
    awq_quantizer, gemm_linear, dequantize_gemm = _awq_modules()
    quantizer = awq_quantizer.__new__(awq_quantizer)  # only its rounding is used
    quantizer.w_bit, quantizer.group_size, quantizer.zero_point = 4, group, True
    tensors, ref = _extras(40 + group), {}
    x = torch.randn(3, max(IN, OUT), generator=torch.Generator().manual_seed(7))
    ref["x"] = x.numpy()
    for mod, w in _float_weights(40 + group).items():
        w = w.half()  # AutoAWQ quantizes a float16 model
        w_q, scales, zeros = quantizer.pseudo_quantize_tensor(w)
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).half()
        linear.weight.data = w_q
        layer = gemm_linear.from_linear(
            linear,
            4,
            group,
            scales=scales.t().contiguous(),
            zeros=zeros.t().contiguous(),
        )
        with torch.no_grad():
            weight = dequantize_gemm(
                layer.qweight, layer.qzeros, layer.scales, 4, group
            )
            ref[f"weight/{mod}"] = weight.t().float().numpy()  # [out, in]
            ref[f"y/{mod}"] = layer(x[:, : w.shape[1]]).float().numpy().reshape(3, -1)
        ref[f"scales/{mod}"] = layer.scales.t().numpy()  # [out, groups]
        ref[f"zeros/{mod}"] = zeros.to(torch.int16).numpy()  # [out, groups]
        for part in ("qweight", "qzeros", "scales"):
            tensors[f"{mod}.{part}"] = getattr(layer, part)
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    _write(HERE / name, tensors, {"quantization_config": config}, ref)


def nvfp4(name: str, scheme: str = "NVFP4A16") -> None:
    """NVFP4 weights; ``scheme="NVFP4"`` (W4A4): the inputs too, in groups
    of 16 under a calibrated ``input_global_scale``; ``yq/<name>`` is then
    compressed-tensors' forward with its own quantization of ``x``."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from compressed_tensors.quantization.utils import (
        calculate_qparams,
        generate_gparam,
    )

    weights = _float_weights(50)
    model = quantizable_linears(weights, preset_name_to_scheme(scheme, ["Linear"]))
    for mod in weights:
        m = getattr(model, mod.replace(".", "__"))
        args = m.quantization_scheme.weights
        w = m.weight.data
        gs = generate_gparam(w.amin(), w.amax())
        g = w.reshape(w.shape[0], -1, args.group_size)
        s, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
        m.weight_global_scale.data.copy_(gs)
        m.weight_scale.data.copy_(s)
        if m.quantization_scheme.input_activations is not None:  # calibrated
            # on a sample of its own, narrower than x (x's top blocks clip)
            gen = torch.Generator().manual_seed(11)
            calib = 0.8 * torch.randn(16, w.shape[1], generator=gen)
            m.input_global_scale.data.copy_(generate_gparam(calib.amin(), calib.amax()))
    path, parts, group, ref = compress_and_read(
        model, "nvfp4-pack-quantized", name, weights, 50
    )
    for mod, part in parts.items():
        # codes and float32 weights as compressed-tensors unpacks and
        # dequantizes them (decompress returns bfloat16)
        read = nvfp4_reference(mod, part, group)
        ref.update({k: read[k] for k in (f"codes/{mod}", f"weight32/{mod}")})
        m = getattr(model, mod.replace(".", "__"))
        acts = m.quantization_scheme.input_activations
        if acts is not None:
            w = torch.from_numpy(ref[f"weight32/{mod}"])
            x = torch.from_numpy(ref["x"][:, : w.shape[1]])
            xq = forward_quantize(m, x[None], "input", acts)[0]  # [batch, seq, in]
            ref[f"yq/{mod}"] = (xq @ w.t()).numpy()
    np.savez_compressed(path / "reference.npz", **ref)


def fp8_blocks(name: str, block: tuple[int, int], scale_fmt: str = "float") -> None:
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import (
        Fp8Dequantize,
        Fp8Quantize,
        _dequantize_fp8_weight,
    )

    quantizer = types.SimpleNamespace(  # what the conversion ops read of it
        quantization_config=FineGrainedFP8Config(
            weight_block_size=block, scale_fmt=scale_fmt
        )
    )
    tensors, ref = _extras(60), {}
    x = torch.randn(3, max(IN, OUT), generator=torch.Generator().manual_seed(7))
    ref["x"] = x.numpy()
    for mod, w in _float_weights(60).items():
        rows, cols = w.shape
        pad = (0, -cols % block[1], 0, -rows % block[0])
        out = Fp8Quantize(quantizer).convert(
            {f"{mod}.weight": torch.nn.functional.pad(w, pad)}
        )
        q, s = out[f"{mod}.weight"][:rows, :cols], out[f"{mod}.weight_scale_inv"]
        if pad == (0, 0, 0, 0):
            weight = Fp8Dequantize(quantizer)._dequantize_one(q, s)  # float32
        else:
            weight = _dequantize_fp8_weight(q, s, list(block), torch.float32)
        tensors[f"{mod}.weight"], tensors[f"{mod}.weight_scale_inv"] = q, s
        weight = weight.float()  # ue8m0's bfloat16: exact (E4M3 times 2^k)
        ref[f"weight/{mod}"] = weight.numpy()
        ref[f"y/{mod}"] = (x[:, : w.shape[1]] @ weight.t()).numpy()
    config = {  # DeepSeek-V3's, its block size apart
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
    }
    if scale_fmt != "float":  # DeepSeek-V3.1's: power-of-two scales
        config["scale_fmt"] = scale_fmt
    _write(HERE / name, tensors, {"quantization_config": config}, ref)


def bnb_nf4(name: str, block: int, double: bool = True) -> None:
    import bitsandbytes.functional as bnb
    from transformers import BitsAndBytesConfig

    tensors, ref = _extras(70), {}
    x = torch.randn(3, max(IN, OUT), generator=torch.Generator().manual_seed(7))
    ref["x"] = x.numpy()
    for mod, w in _float_weights(70).items():
        packed, state = bnb.quantize_4bit(
            w, blocksize=block, quant_type="nf4", compress_statistics=double
        )
        tensors[f"{mod}.weight"] = packed
        for k, v in state.as_dict(packed=True).items():
            tensors[f"{mod}.weight.{k}"] = v
        weight = bnb.dequantize_4bit(packed, state)  # float32
        ref[f"weight/{mod}"] = weight.numpy()
        ref[f"y/{mod}"] = (x[:, : w.shape[1]] @ weight.t()).numpy()
        absmax = state.absmax  # double-dequantized as dequantize_4bit does
        if double:
            absmax = bnb.dequantize_blockwise(absmax, state.state2) + state.offset
        ref[f"absmax/{mod}"] = absmax.numpy()
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=torch.float32,
    ).to_dict()
    _write(HERE / name, tensors, {"quantization_config": config}, ref)


def main() -> None:
    awq("awq_w4g16", 16)
    nvfp4("ct_nvfp4")
    nvfp4("ct_nvfp4_w4a4", "NVFP4")
    fp8_blocks("fp8_block16x32", (16, 32))
    fp8_blocks("fp8_block24x48", (24, 48))
    fp8_blocks("fp8_block16x32_ue8m0", (16, 32), "ue8m0")
    bnb_nf4("bnb_nf4_dq", 32)
    bnb_nf4("bnb_nf4", 32, double=False)


if __name__ == "__main__":
    main()
