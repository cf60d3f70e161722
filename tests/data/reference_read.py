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
  ``float-quantized``).

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
    """``{module: dequantized weight [out, in]}``, as the reference reads it."""
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
                out[m] = layer(torch.eye(fin, dtype=scales.dtype)).t().float().numpy()
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
            out[m] = codec.decompress(part, scheme)["weight"].float().numpy()
    return out


if __name__ == "__main__":
    pairs = sys.argv[1:]
    for folder, out in zip(pairs[::2], pairs[1::2], strict=True):
        weights = read(folder)
        np.savez(out, **{f"weight/{m}": w for m, w in weights.items()})
