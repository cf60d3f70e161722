"""Reads a checkpoint with the reference libraries: their dequantized weights.

The other half of qbits' write test: ``qbits.interop.write_checkpoint``
writes, the library that defines the format reads (never qbits)::

    python tests/data/reference_read.py CHECKPOINT_DIR OUT.npz [DIR OUT.npz ...]

(in a venv with ``qbits[reference]``: PyTorch, auto-gptq 0.7.1 installed
``--no-deps``, compressed-tensors) writes ``weight/<module>`` (PyTorch's
``[out, in]``, float32) for every quantized module:

- GPTQ: AutoGPTQ's ``QuantLinear`` (``nn_modules/qlinear/qlinear_cuda.py``)
  given the tensors as buffers, its PyTorch forward on the identity in
  the scales' dtype (float16; float32 for a float32 model's); a
  ``gptq_v2`` checkpoint is first converted to v1 as GPTQModel 7.7.0's
  ``convert_gptq_v2_to_v1_format_module`` does (every stored zero point
  minus one, in int32 words);
- compressed-tensors: the config is validated by ``QuantizationConfig``,
  each module decompressed by its format's compressor (``pack-quantized``,
  ``float-quantized``, ``nvfp4-pack-quantized``: its bfloat16 weights, and
  the codes, scales and float32 weights of its own unpacking and
  ``dequantize``); a module's ``input_activations`` as compressed-tensors
  parses them (``inputs/<module>``: type, bits, strategy, group, dynamic).

tests/interop runs it in a subprocess of the interpreter named by
``QBITS_REFERENCE_PYTHON`` (docs/guides/development.md).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import numpy as np
import torch
from safetensors.torch import load_file


def _qlinear():
    root = pathlib.Path(
        importlib.util.find_spec("auto_gptq").submodule_search_locations[0]
    )
    spec = importlib.util.spec_from_file_location(
        "_ref_qlinear_cuda", root / "nn_modules/qlinear/qlinear_cuda.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read(folder: str | pathlib.Path) -> dict[str, np.ndarray]:
    """``{"weight/<module>": dequantized weight [out, in]}``, as the reference
    reads it; NVFP4 modules also ``codes/``, ``scale/``, ``global_scale/`` and
    ``weight32/`` (compressed-tensors' own unpacking, float32 dequantize)."""
    folder = pathlib.Path(folder)
    tensors = load_file(folder / "model.safetensors")
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    out = {}
    if qc["quant_method"] == "gptq":
        qlinear = _qlinear()
        bits, group = qc["bits"], qc["group_size"]
        for m in sorted(
            n[: -len(".qweight")] for n in tensors if n.endswith(".qweight")
        ):
            qweight = tensors[f"{m}.qweight"]
            fin, fout = qweight.shape[0] * 32 // bits, qweight.shape[1]
            scales = tensors[f"{m}.scales"]  # float16, or a float32 model's
            layer = qlinear.QuantLinear(
                bits, group, fin, fout, bias=False, weight_dtype=scales.dtype
            )
            qzeros = tensors[f"{m}.qzeros"]
            if qc.get("checkpoint_format") == "gptq_v2":
                qzeros = qzeros - (0x11111111 if bits == 4 else 0x01010101)
            layer.qweight, layer.qzeros = qweight, qzeros
            layer.scales, layer.g_idx = scales, tensors[f"{m}.g_idx"]
            with torch.no_grad():
                out[f"weight/{m}"] = (
                    layer(torch.eye(fin, dtype=scales.dtype)).t().float().numpy()
                )
    else:
        from compressed_tensors.compressors.base import BaseCompressor
        from compressed_tensors.quantization import (
            QuantizationConfig,
            QuantizationScheme,
        )

        QuantizationConfig.model_validate(qc)  # the loader accepts the config
        ((_, group),) = qc["config_groups"].items()
        scheme = QuantizationScheme.model_validate(group)
        codec = BaseCompressor.get_value_from_registry(
            group.get("format") or qc["format"]
        )
        for m in sorted(
            n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")
        ):
            part = {
                k[len(m) + 1 :]: v for k, v in tensors.items() if k.startswith(m + ".")
            }
            decompressed = codec.decompress(part, scheme)
            out[f"weight/{m}"] = decompressed["weight"].float().numpy()
            inputs = scheme.input_activations  # W8A8: the inputs, as it parsed them
            if inputs is not None:
                out[f"inputs/{m}"] = np.array(
                    f"{inputs.type} {inputs.num_bits} {inputs.strategy} "
                    f"{inputs.group_size} dynamic={inputs.dynamic}"
                )
            if "weight_global_scale" in part:  # NVFP4: its codes and scales too
                out.update(nvfp4_reference(m, part, scheme))
    # The loader's choice of the layers it quantizes: those the checkpoint
    # quantizes; every other Linear (2-D float weight) stays float.
    shapes = {
        k[len("weight/") :]: w.shape for k, w in out.items() if k[:7] == "weight/"
    }
    floats = {
        n[: -len(".weight")]: tuple(t.shape)
        for n, t in tensors.items()
        if n.endswith(".weight") and t.ndim == 2 and n[: -len(".weight")] not in shapes
    }  # fp8's weight is its codes
    model = _linears({**floats, **shapes})
    converted = (_gptq_converted if qc["quant_method"] == "gptq" else _ct_converted)(
        model, qc
    )
    if converted != set(shapes):
        sys.exit(
            f"{folder}: the loader quantizes {sorted(converted)}, the checkpoint "
            f"{sorted(shapes)}"
        )
    out.update({f"float/{f}": tensors[f"{f}.weight"].float().numpy() for f in floats})
    return out


def _linears(shapes: dict[str, tuple]) -> torch.nn.Module:
    """A model of ``Linear`` layers ``[out, in]`` under the given dotted names."""
    model = torch.nn.Module()
    for name, (n_out, n_in) in shapes.items():
        *path, last = name.split(".")
        parent = model
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        with torch.device("meta"):
            parent.add_module(last, torch.nn.Linear(n_in, n_out, bias=False))
    return model


def _gptq_converted(model: torch.nn.Module, qc: dict) -> set[str]:
    """The layers transformers' GPTQ loader converts: optimum 2.3.0's
    ``GPTQQuantizer.convert_model`` given ``GPTQConfig(**qc)``, its kernel
    choice and the layer swap (gptqmodel's) stubbed out."""
    import optimum.gptq.quantizer as optimum_gptq
    from transformers.utils.quantization_config import GPTQConfig

    optimum_gptq.QuantizeConfig = lambda **kwargs: None  # gptqmodel's
    optimum_gptq.FORMAT = optimum_gptq.METHOD = str
    config = GPTQConfig.from_dict(qc).to_dict_optimum()
    quantizer = optimum_gptq.GPTQQuantizer.from_dict(config)
    converted: list[str] = []
    quantizer.select_quant_linear = lambda **kwargs: None
    quantizer._replace_by_quant_layers = lambda model, names: converted.extend(names)
    quantizer.convert_model(model)
    return set(converted)


def _ct_converted(model: torch.nn.Module, qc: dict) -> set[str]:
    """The layers compressed-tensors gives a quantization scheme to."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
    )

    apply_quantization_config(model, QuantizationConfig.model_validate(qc))
    return {
        n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None)
    }


def nvfp4_reference(m: str, part: dict, scheme) -> dict[str, np.ndarray]:
    """An NVFP4 module's codes, scales and float32 weights, as compressed-tensors
    unpacks and dequantizes them (``decompress`` returns bfloat16)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = part["weight_packed"]
    shape = (packed.shape[0], 2 * packed.shape[1])
    codes = unpack_fp4_from_uint8(packed, *shape, dtype=torch.float32)
    w32 = dequantize(
        x_q=codes,
        scale=part["weight_scale"].float(),
        args=scheme.weights,
        global_scale=part["weight_global_scale"],
        dtype=torch.float32,
    )
    return {
        f"codes/{m}": codes.numpy(),
        f"scale/{m}": part["weight_scale"].float().numpy(),
        f"global_scale/{m}": part["weight_global_scale"].float().numpy(),
        f"weight32/{m}": w32.numpy(),
    }


if __name__ == "__main__":
    pairs = sys.argv[1:]
    for folder, out in zip(pairs[::2], pairs[1::2], strict=True):
        np.savez(out, **read(folder))
