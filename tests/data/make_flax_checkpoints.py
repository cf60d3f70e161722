"""Writes tests/data/flax: quantized checkpoints of tiny Hugging Face Llama and
GPT-2 models, and what the Hugging Face Flax models make of them.

Run once in a venv of its own, with the last transformers that has Flax
(transformers 5 dropped it) and the jax/flax it needs::

    python3.11 -m venv flaxvenv
    flaxvenv/bin/pip install jax==0.4.13 jaxlib==0.4.13 flax==0.7.0 \\
        transformers==4.57.1 "numpy<2" safetensors torch==2.13.0 \\
        compressed-tensors==0.20.0
    flaxvenv/bin/pip install --no-deps auto-gptq==0.7.1
    flaxvenv/bin/python tests/data/make_flax_checkpoints.py

Every file is written by the reference libraries, never by qbits:

- ``llama_ct/``: a random ``LlamaForCausalLM`` (1 layer, width 32, 4 query
  and 2 key/value heads, vocabulary 64), its attention and MLP ``Linear`` s
  quantized by compressed-tensors 0.20.0 (``pack-quantized``, int4
  symmetric, groups of 16: ``calculate_qparams`` and
  ``ModelCompressor``, as ``make_quantized_checkpoints.py`` does), the
  embeddings, norms and ``lm_head`` float.
- ``gpt2_gptq/``: a random ``GPT2LMHeadModel`` (1 layer, width 32, 4 heads),
  its ``Conv1D`` s (``c_attn`` fused q/k/v, ``c_proj``, ``c_fc``) quantized by
  AutoGPTQ 0.7.1 (``Quantizer.find_params`` on groups of 16, int4
  symmetric, ``QuantLinear.pack`` given the weight as a ``Linear``
  ``[out, in]``: AutoGPTQ transposes a ``Conv1D`` so), float16 scales.
- ``<model>.npz``: the reference's dequantized weights (``weight/<module>``,
  ``[out, in]``: compressed-tensors' ``decompress``, AutoGPTQ's
  ``QuantLinear`` forward on the identity in float16), ``tokens`` and
  ``logits``: the Hugging Face Flax model (``FlaxLlamaForCausalLM``,
  ``FlaxGPT2LMHeadModel``, transformers 4.57.1) loaded ``from_pt`` from the
  PyTorch model holding those weights (transformers' own PyTorch-to-Flax
  conversion of names and layouts), run on ``tokens``.
- ``<model>_params.json``: that Flax model's parameter tree: ``/``-joined
  path -> ``[shape, dtype]``.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from make_quantized_checkpoints import (
    _load,
    calibrate_groups,
    decompressed,
    gptq_packed,
)

HERE = pathlib.Path(__file__).parent / "flax"
TOKENS = (np.arange(16).reshape(2, 8) * 7 % 64).astype(np.int32)


def _flax(folder: pathlib.Path, cls, name: str, ref: dict) -> None:
    """The Flax model ``from_pt`` of ``folder``: its tree and logits into HERE."""
    import jax

    model = cls.from_pretrained(folder, from_pt=True, dtype=jax.numpy.float32)
    flat = jax.tree_util.tree_flatten_with_path(model.params)[0]
    tree = {
        "/".join(str(k.key) for k in path): [list(a.shape), str(a.dtype)]
        for path, a in flat
    }
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(tree.items())]
    (HERE / f"{name}_params.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
    logits = model(TOKENS).logits
    np.savez_compressed(
        HERE / f"{name}.npz", tokens=TOKENS, logits=np.asarray(logits), **ref
    )


def llama() -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import FlaxLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # norms off their init of ones
                p.add_(0.1 * torch.randn_like(p))
    float_state = {k: v.clone() for k, v in model.state_dict().items()}
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=16
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    quantized = calibrate_groups(model, args, 16)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    path = HERE / "llama_ct"
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config.to_json_file(path / "config.json")
    compressor.update_config(str(path))
    ref = {}
    for n, w in decompressed(path, quantized, scheme).items():
        ref[f"weight/{n}"] = w.numpy()
        float_state[f"{n}.weight"] = w
    _from_torch(
        LlamaForCausalLM(config), float_state, FlaxLlamaForCausalLM, "llama", ref
    )


def _from_torch(model, state: dict, flax_cls, name: str, ref: dict) -> None:
    model.load_state_dict(state)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        _flax(pathlib.Path(tmp), flax_cls, name, ref)


def gpt2() -> None:
    from transformers import FlaxGPT2LMHeadModel, GPT2Config, GPT2LMHeadModel

    qlinear = _load("_ref_qlinear_cuda", "nn_modules/qlinear/qlinear_cuda.py")
    quantizer = _load("_ref_quantizer", "quantization/quantizer.py")
    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32,
        torch_dtype="float32",
    )  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "ln_" in n or "bias" in n:  # norms and biases off their init
                p.add_(0.1 * torch.randn_like(p))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    bits, group = 4, 16
    tensors = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied
    ref = {}
    modules = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    for mod in modules:
        w = state[f"{mod}.weight"].t().contiguous()  # Conv1D [in, out] -> [out, in]
        fin = w.shape[1]
        g_idx = torch.arange(fin, dtype=torch.int32) // group
        layer, *_ = gptq_packed(qlinear, quantizer, w, g_idx, bits, group, True)
        with torch.no_grad():
            deq = layer(torch.eye(fin, dtype=torch.float16)).t().float()  # [out, in]
        ref[f"weight/{mod}"] = deq.numpy()
        state[f"{mod}.weight"] = deq.t().contiguous()  # the Conv1D's [in, out]
        del tensors[f"{mod}.weight"]
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            tensors[f"{mod}.{part}"] = getattr(layer, part)
    path = HERE / "gpt2_gptq"
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              path / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    meta = config.to_dict()
    meta["quantization_config"] = {
        "bits": bits, "group_size": group, "desc_act": False, "sym": True,
        "quant_method": "gptq", "checkpoint_format": "gptq", "damp_percent": 0.01,
        "true_sequential": True, "static_groups": False,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    _from_torch(GPT2LMHeadModel(config), state, FlaxGPT2LMHeadModel, "gpt2", ref)


if __name__ == "__main__":
    HERE.mkdir(exist_ok=True)
    llama()
    gpt2()
