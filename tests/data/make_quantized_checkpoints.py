"""Writes the pre-quantized checkpoints of tests/interop with the reference packers.

Run once in a venv with the reference packages (``pip install
qbits[reference]``; PyTorch CPU, auto-gptq 0.7.1 installed ``--no-deps``,
compressed-tensors, transformers)::

    python tests/data/make_quantized_checkpoints.py

Every file under ``tests/data/quantized/`` is written here by the library
that defines the format, never by qbits:

- GPTQ: ``auto_gptq.nn_modules.qlinear.qlinear_cuda.QuantLinear.pack``
  (AutoGPTQ 0.7.1, the packer transformers and optimum loaded GPTQ
  checkpoints with), its scales and zero points from AutoGPTQ's own
  ``auto_gptq.quantization.quantizer.Quantizer.find_params`` on each group;
  the reference dequantized weight is ``QuantLinear.forward`` (its PyTorch
  path) on the identity. ``gptq_v2`` is GPTQModel's conversion of a v1
  checkpoint, transcribed from ``convert_gptq_v1_to_v2_format_module``
  (``gptqmodel/utils/model.py``, GPTQModel 7.7.0): every stored zero point
  plus one. AutoGPTQ's modules are loaded from their files (its package
  ``__init__`` imports its whole model zoo).
- compressed-tensors (0.20.0): ``apply_quantization_config``, scales from
  ``compute_dynamic_scales_and_zp``, ``ModelCompressor.compress_model`` and
  ``update_config`` write the checkpoint; the reference dequantized weight
  is the format's compressor's ``decompress`` of the saved tensors.

Each checkpoint directory holds ``config.json`` (with its
``quantization_config``), ``model.safetensors`` and ``reference.npz``: per
quantized module the reference's dequantized weight (``weight/<name>``,
PyTorch's ``[out, in]``), its integer codes (``codes/<name>``, ``[out,
in]``, as the packer was given them), and a tiny matmul (``x``,
``y/<name>`` = the reference forward of ``x``).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file

HERE = pathlib.Path(__file__).parent / "quantized"
# AutoGPTQ packs zero points of 32 // bits output channels per int32 word.
IN, OUT = 64, 32
MODULES = {  # (in, out)
    "model.layers.0.self_attn.q_proj": (IN, OUT),
    "model.layers.0.self_attn.o_proj": (OUT, OUT),
}


def _load(name: str, relpath: str):
    """An AutoGPTQ module, from its file (without the package's __init__)."""
    root = pathlib.Path(
        importlib.util.find_spec("auto_gptq").submodule_search_locations[0]
    )
    spec = importlib.util.spec_from_file_location(name, root / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _float_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (fin, fout) in MODULES.items():
        w = torch.randn(fout, fin, generator=g) * 0.05
        w[:, ::7] += 0.02  # groups shifted off zero: zero points matter
        out[name] = w
    return out


def _write(path: pathlib.Path, tensors: dict, config: dict, ref: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors"
    )
    full = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config}
    (path / "config.json").write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
    np.savez_compressed(path / "reference.npz", **ref)


def _extras(seed: int) -> dict[str, torch.Tensor]:
    """Unquantized tensors riding along (a norm and the head stay float)."""
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "model.norm.weight": torch.ones(OUT) + 0.1 * torch.randn(OUT, generator=g),
        "lm_head.weight": 0.05 * torch.randn(16, OUT, generator=g),
    }


def gptq_packed(qlinear, quantizer, w, g_idx, bits: int, group: int, sym: bool):
    """AutoGPTQ's ``QuantLinear`` of ``w`` ``[out, in]`` in ``g_idx``'s groups.

    Returns ``(layer, w on the grid, scales, zeros)``: the scales as GPTQ
    keeps them (float16 values, in float32), the zeros as found.
    """
    fout, fin = w.shape
    scales = torch.zeros(fout, fin // group)
    zeros = torch.zeros(fout, fin // group)
    for gi in range(fin // group):
        q = quantizer.Quantizer()
        q.configure(bits, perchannel=True, sym=sym, mse=False)
        q.find_params(w[:, g_idx == gi], weight=True)
        scales[:, gi] = q.scale.flatten()
        zeros[:, gi] = q.zero.flatten()
    # GPTQ keeps fp16 scales: the packer rounds with them
    scales = scales.half().float()
    g = g_idx.long()
    # GPTQ hands the packer its weight on the grid (quantizer.quantize, clamped)
    w = quantizer.quantize(w, scales[:, g], zeros[:, g], 2**bits - 1)
    # in float32 (8-bit grid values need more than float16's 11 bits), the
    # scales then stored as the float16 values they are (a fp16 model's)
    linear = torch.nn.Linear(fin, fout, bias=False)
    linear.weight.data = w
    layer = qlinear.QuantLinear(bits, group, fin, fout, bias=False)
    layer.pack(linear, scales.clone(), zeros.clone(), g_idx)  # may edit zeros
    layer.scales = layer.scales.half()
    return layer, w, scales, zeros


def gptq(
    name: str, bits: int, group: int, sym: bool, act_order: bool, v2: bool
) -> None:
    qlinear = _load("_ref_qlinear_cuda", "nn_modules/qlinear/qlinear_cuda.py")
    quantizer = _load("_ref_quantizer", "quantization/quantizer.py")
    weights = _float_weights(bits * 10 + group + sym + 2 * act_order)
    tensors, ref = _extras(bits), {}
    x = torch.randn(3, max(IN, OUT), generator=torch.Generator().manual_seed(7))
    ref["x"] = x.numpy()
    for mod, w in weights.items():
        fin = w.shape[1]
        if act_order:  # GPTQ's act-order: groups over a permuted column order
            perm = torch.randperm(fin, generator=torch.Generator().manual_seed(fin))
            g_idx = torch.empty(fin, dtype=torch.int32)
            g_idx[perm] = torch.arange(fin, dtype=torch.int32) // group
        else:
            g_idx = torch.arange(fin, dtype=torch.int32) // group
        layer, w, scales, zeros = gptq_packed(
            qlinear, quantizer, w, g_idx, bits, group, sym
        )
        g = g_idx.long()
        # The codes QuantLinear.pack computes (float32: fp16 weight and scales, zeros)
        codes = torch.round((w + (zeros * scales)[:, g]) / scales[:, g])
        assert codes.min() >= 0 and codes.max() <= 2**bits - 1
        ref[f"codes/{mod}"] = codes.to(torch.int16).numpy()
        ref[f"zeros/{mod}"] = zeros.to(torch.int16).numpy()
        ref[f"scales/{mod}"] = scales.half().numpy()
        with torch.no_grad():
            eye = torch.eye(fin, dtype=torch.float16)
            ref[f"weight/{mod}"] = layer(eye).t().float().numpy()  # [out, in]
            ref[f"y/{mod}"] = layer(x[:, :fin].half()).float().numpy()
        qzeros = layer.qzeros
        if v2:  # GPTQModel 7.7.0's convert_gptq_v1_to_v2_format_module (int32 words)
            qzeros = qzeros + (0x11111111 if bits == 4 else 0x01010101)
        tensors[f"{mod}.qweight"] = layer.qweight
        tensors[f"{mod}.qzeros"] = qzeros
        tensors[f"{mod}.scales"] = layer.scales
        tensors[f"{mod}.g_idx"] = layer.g_idx
    config = {
        "bits": bits,
        "group_size": group,
        "desc_act": act_order,
        "sym": sym,
        "quant_method": "gptq",
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
        "damp_percent": 0.01,
        "true_sequential": True,
        "static_groups": False,
    }
    _write(HERE / name, tensors, {"quantization_config": config}, ref)


def compressed(name: str, fmt: str, args: dict, inputs: dict | None = None) -> None:
    """A compressed-tensors checkpoint; with ``inputs``, its layers' inputs
    quantized as well (``input_activations``): ``yq/<name>`` is then the
    reference forward with compressed-tensors' own quantization of ``x``."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    weights = _float_weights(len(name))
    acts = None if inputs is None else QuantizationArgs(**inputs)
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**args), input_activations=acts
    )
    model = quantizable_linears(weights, scheme)
    for mod in weights:
        m = getattr(model, mod.replace(".", "__"))
        qargs = m.quantization_scheme.weights
        w = m.weight.data
        if qargs.strategy == "group":  # [out, groups, group]
            w = w.reshape(w.shape[0], -1, qargs.group_size)
            s, z = calculate_qparams(w.amin(-1), w.amax(-1), qargs)
        elif qargs.strategy == "channel":
            s, z = calculate_qparams(
                w.amin(1, keepdim=True), w.amax(1, keepdim=True), qargs
            )
        else:
            s, z = calculate_qparams(w.amin().reshape(1), w.amax().reshape(1), qargs)
        m.weight_scale.data.copy_(s)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(z)
        if acts is not None and not acts.dynamic:  # static: calibrated on a
            # sample of its own, narrower than x (so that x clips)
            g = torch.Generator().manual_seed(11)
            calib = 0.8 * torch.randn(16, w.shape[-1], generator=g)
            s, _ = calculate_qparams(
                calib.amin().reshape(1), calib.amax().reshape(1), acts
            )
            m.input_scale.data.copy_(s)
    path, _, _, ref = compress_and_read(model, fmt, name, weights, len(name))
    for mod in weights if acts is not None else ():
        m = getattr(model, mod.replace(".", "__"))
        w = torch.from_numpy(ref[f"weight/{mod}"])
        x = torch.from_numpy(ref["x"][:, : w.shape[1]])
        # [batch, seq, hidden], as a model runs (compressed-tensors' "token"
        # keeps the first two axes: a 2-D input would get one scale)
        xq = forward_quantize(m, x[None], "input", acts)[0]
        ref[f"yq/{mod}"] = (xq @ w.t()).numpy()
    np.savez_compressed(path / "reference.npz", **ref)


def quantizable_linears(weights, scheme):
    """A module of bias-free Linears holding ``weights`` (flat names: ``.``
    as ``__``, renamed when written), with compressed-tensors' ``scheme``
    applied to them (their scale parameters still to fill)."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
    )

    model = torch.nn.Module()
    for mod, w in weights.items():
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w.clone()
        model.add_module(mod.replace(".", "__"), linear)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme})
    )
    return model


def compress_and_read(model, fmt: str, name: str, weights, seed: int):
    """``model`` compressed in ``fmt`` into ``HERE / name``, and read back.

    The reference read is the format's compressor on the saved tensors.
    Returns ``(path, {module: its saved tensors}, the scheme, reference)``,
    the reference holding ``x``, and each module's ``weight/`` and ``y/``.
    """
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    tensors = {k.replace("__", "."): v for k, v in model.state_dict().items()}
    tensors.update(_extras(seed))
    path = HERE / name
    _write(path, tensors, {}, {})
    compressor.update_config(str(path))
    saved = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    group = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    codec = BaseCompressor.get_value_from_registry(config["format"])
    x = torch.randn(3, max(IN, OUT), generator=torch.Generator().manual_seed(7))
    ref, parts = {"x": x.numpy()}, {}
    for mod in weights:
        part = {
            k[len(mod) + 1 :]: v for k, v in saved.items() if k.startswith(mod + ".")
        }
        w = codec.decompress(part, group)["weight"]
        ref[f"weight/{mod}"] = w.float().numpy()
        ref[f"y/{mod}"] = (x[:, : w.shape[1]] @ w.float().t()).numpy()
        parts[mod] = part
    return path, parts, group, ref


def calibrate_groups(model, args, group: int) -> list[str]:
    """Sets each quantized Linear's group scales (and zero points) from its
    weight's min and max, by compressed-tensors' ``calculate_qparams``; the
    names of those Linears."""
    from compressed_tensors.quantization.utils import calculate_qparams

    quantized = [n for n, m in model.named_modules() if hasattr(m, "weight_scale")]
    for n in quantized:
        m = model.get_submodule(n)
        w = m.weight.data.reshape(m.weight.shape[0], -1, group)
        s, z = calculate_qparams(w.amin(-1), w.amax(-1), args)
        m.weight_scale.data.copy_(s)
        if not args.symmetric:
            m.weight_zero_point.data.copy_(z)
    return quantized


def decompressed(path: pathlib.Path, quantized: list[str], scheme) -> dict:
    """``{Linear name: float32 weight}``: compressed-tensors' own decompression
    of the pack-quantized weights saved in ``path``."""
    from compressed_tensors.compressors.base import BaseCompressor

    saved = load_file(path / "model.safetensors")
    codec = BaseCompressor.get_value_from_registry("pack-quantized")
    out = {}
    for n in quantized:
        part = {k[len(n) + 1 :]: v for k, v in saved.items() if k.startswith(n + ".")}
        out[n] = codec.decompress(part, scheme)["weight"].float()
    return out


def qbits_lm(name: str) -> None:
    """qbits' tiny example LM (width 16, 1 block, 10 tokens) as a PyTorch twin.

    Named as qbits names it (``blocks.0.attn.query``, ...), its attention
    and MLP ``Linear`` s quantized by compressed-tensors (uint4 with zero
    points, groups of 16), the head, norms and embeddings float.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    torch.manual_seed(3)
    width, vocab = 16, 10
    block = torch.nn.Module()
    block.attn = torch.nn.Module()
    for n in ("query", "key", "value", "out"):
        setattr(block.attn, n, torch.nn.Linear(width, width))
    block.mlp = torch.nn.Module()
    block.mlp.fc1, block.mlp.fc2 = (
        torch.nn.Linear(width, 4 * width),
        torch.nn.Linear(4 * width, width),
    )
    block.norm1, block.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([block])
    model.embed = torch.nn.Embedding(vocab, width)
    model.pos = torch.nn.Parameter(0.02 * torch.randn(16, width))
    model.norm, model.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms and biases off their init
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=16
    )
    scheme = QuantizationScheme(targets=["re:blocks.*"], weights=args)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme})
    )
    quantized = calibrate_groups(model, args, 16)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    path = HERE / name
    _write(path, dict(model.state_dict()), {}, {})
    compressor.update_config(str(path))
    ref = {
        f"weight/{n}": w.numpy()
        for n, w in decompressed(path, quantized, scheme).items()
    }
    np.savez_compressed(path / "reference.npz", **ref)


def main() -> None:
    qbits_lm("ct_qbits_lm")
    gptq("gptq_w4g16_asym", 4, 16, sym=False, act_order=False, v2=False)
    gptq("gptq_w4g16_sym", 4, 16, sym=True, act_order=False, v2=False)
    gptq("gptq_w8g32_sym", 8, 32, sym=True, act_order=False, v2=False)
    gptq("gptq_v2_w4g16_asym", 4, 16, sym=False, act_order=False, v2=True)
    gptq("gptq_w4g16_actorder", 4, 16, sym=True, act_order=True, v2=False)
    compressed(
        "ct_w4g16_asym",
        "pack-quantized",
        dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
    )
    compressed(
        "ct_w4g32_sym",
        "pack-quantized",
        dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    )
    compressed(
        "ct_w8_channel",
        "pack-quantized",
        dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
    )
    compressed(
        "ct_fp8_tensor",
        "float-quantized",
        dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
    )
    compressed(
        "ct_fp8_channel",
        "float-quantized",
        dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
    )
    # llm-compressor's FP8_DYNAMIC: channel weights, inputs per token at run time
    compressed(
        "ct_fp8_dynamic",
        "float-quantized",
        dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
        dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
    )
    # llm-compressor's W8A8 (int8): channel weights, inputs per token at run time
    compressed(
        "ct_w8a8_int8",
        "pack-quantized",
        dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
    )
    # llm-compressor's FP8 (static): a calibrated input_scale per layer
    compressed(
        "ct_fp8_static",
        "float-quantized",
        dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
        dict(
            num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False
        ),
    )


if __name__ == "__main__":
    main()
