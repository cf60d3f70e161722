"""PyTorch checkpoints mapped onto the Hugging Face Flax Llama and GPT-2.

tests/data/make_flax_checkpoints.py (transformers 4.57.1, the last with
Flax; compressed-tensors, AutoGPTQ) wrote a compressed-tensors Llama and a
GPTQ GPT-2, the parameter trees of ``FlaxLlamaForCausalLM`` and
``FlaxGPT2LMHeadModel`` and their logits on the reference's dequantized
weights (loaded ``from_pt``: transformers' own name and layout mapping).
Here each checkpoint is served onto that tree (shapes only, from the
JSON) through a JAX transcription of the Flax model's forward: the
logits are the Flax model's within float tolerance. Flax GPT-2 stores its
``Conv1D`` kernels ``[out, in]`` and reads them transposed: the stored
weights are laid out as the matmul reads them. And AWQ of the Flax Llama,
its scales folded as AutoAWQ folds a Llama's, written as compressed-tensors
and served back (read by compressed-tensors too, with
``QBITS_REFERENCE_PYTHON``).
"""

import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits.interop
from qbits import InvalidArgumentError

DATA = pathlib.Path(__file__).parents[1] / "data" / "flax"


def _tree(name):
    flat = json.loads((DATA / f"{name}_params.json").read_text())
    tree = {}
    for path, (shape, dtype) in flat.items():
        *parents, last = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
    return tree


def _attend(q, k, v):
    """Causal softmax attention, ``[b, t, heads, d]`` each (Flax's, in float32)."""
    t = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _llama(p, tokens, heads=4, kv_heads=2, eps=1e-6, theta=10000.0):
    """``FlaxLlamaForCausalLM``'s forward (transformers 4.57.1), transcribed."""

    def norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w

    def rotary(x):  # [b, t, h, d]: rotate_half, as Flax Llama
        d, t = x.shape[-1], x.shape[1]
        inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
        freqs = np.einsum("i,j->ij", np.arange(t), inv)
        emb = np.concatenate([freqs, freqs], -1)[None, :, None, :]
        half = jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * np.cos(emb).astype(np.float32) + half * np.sin(emb).astype(
            np.float32
        )

    m = p["model"]
    x = m["embed_tokens"]["embedding"][tokens]
    b, t = tokens.shape
    for layer in m["layers"].values():
        a = layer["self_attn"]
        h = norm(x, layer["input_layernorm"]["weight"])
        q = (h @ a["q_proj"]["kernel"]).reshape(b, t, heads, -1)
        k = (h @ a["k_proj"]["kernel"]).reshape(b, t, kv_heads, -1)
        v = (h @ a["v_proj"]["kernel"]).reshape(b, t, kv_heads, -1)
        k, v = (jnp.repeat(z, heads // kv_heads, axis=2) for z in (k, v))
        o = _attend(rotary(q), rotary(k), v).reshape(b, t, -1)
        x = x + o @ a["o_proj"]["kernel"]
        h = norm(x, layer["post_attention_layernorm"]["weight"])
        f = layer["mlp"]
        gate = jax.nn.silu(h @ f["gate_proj"]["kernel"]) * (h @ f["up_proj"]["kernel"])
        x = x + gate @ f["down_proj"]["kernel"]
    return norm(x, m["norm"]["weight"]) @ p["lm_head"]["kernel"]


def _gpt2(p, tokens, heads=4, eps=1e-5):
    """``FlaxGPT2LMHeadModel``'s forward (transformers 4.57.1), transcribed:
    ``FlaxConv1D`` kernels are ``[out, in]``, multiplied transposed."""

    def norm(x, n):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + eps) * n["scale"] + n["bias"]

    def conv1d(x, c):
        return x @ c["kernel"].T + c["bias"]

    m = p["transformer"]
    b, t = tokens.shape
    x = m["wte"]["embedding"][tokens] + m["wpe"]["embedding"][jnp.arange(t)]
    for layer in m["h"].values():
        qkv = conv1d(norm(x, layer["ln_1"]), layer["attn"]["c_attn"])
        q, k, v = (z.reshape(b, t, heads, -1) for z in jnp.split(qkv, 3, axis=-1))
        x = x + conv1d(_attend(q, k, v).reshape(b, t, -1), layer["attn"]["c_proj"])
        h = conv1d(norm(x, layer["ln_2"]), layer["mlp"]["c_fc"])
        x = x + conv1d(jax.nn.gelu(h, approximate=True), layer["mlp"]["c_proj"])
    return norm(x, m["ln_f"]) @ m["wte"]["embedding"].T  # the tied head


@pytest.mark.parametrize(
    "name, folder, fn, names, tol",
    [
        ("llama", "llama_ct", _llama, "llama", 1e-6),
        # the reference's weights are AutoGPTQ's float16 products, qbits' exact
        ("gpt2", "gpt2_gptq", _gpt2, "gpt2", 1e-4),
    ],
)
def test_served_onto_the_flax_parameter_tree_gives_the_flax_logits(
    name, folder, fn, names, tol
):
    ref = np.load(DATA / f"{name}.npz")
    ckpt = qbits.interop.read_checkpoint(DATA / folder)
    half = ckpt.format.startswith("gptq")  # AutoGPTQ dequantizes in float16
    for m, qt in ckpt.weights.items():  # codes and scales: the reference's weight
        w = np.asarray(qt.dequant()).T
        w = w.astype(np.float16).astype(np.float32) if half else w
        np.testing.assert_array_equal(w, ref[f"weight/{m}"], err_msg=m)
    tokens = jnp.asarray(ref["tokens"])
    sp, config = qbits.interop.serving_params(
        ckpt, fn, _tree(name), tokens, names=names
    )
    assert len(sp.layers) == len(ckpt.weights)  # every weight from its codes
    logits = qbits.serving.serve(fn, config)(sp, tokens)
    top = float(np.abs(ref["logits"]).max())
    np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=tol * top)


def test_awq_of_the_flax_llama_scales_folded_written_and_served(tmp_path):
    # AutoAWQ's Llama layout on the Flax Llama's tree: up_proj's channels
    # before down_proj, input_layernorm before q/k/v, post_attention_
    # layernorm before gate/up (v_proj keeps its channels: with grouped
    # key/value heads its 16 are not o_proj's 32 inputs).
    from qbits.numerics import IntNumerics

    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: jnp.asarray(
            1 + 0.1 * rng.standard_normal(s.shape)
            if len(s.shape) == 1
            else 0.2 * rng.standard_normal(s.shape),
            s.dtype,
        ),
        _tree("llama"),
    )
    tokens = jnp.asarray(np.load(DATA / "llama.npz")["tokens"])
    at = "model/layers/0"
    fold = {
        f"{at}/mlp/up_proj": (f"{at}/mlp/down_proj",),
        f"{at}/input_layernorm": tuple(f"{at}/self_attn/{m}_proj" for m in "qkv"),
        f"{at}/post_attention_layernorm": (f"{at}/mlp/gate_proj", f"{at}/mlp/up_proj"),
    }
    want = _llama(params, tokens)

    def awq(bits, granularity):
        q = qbits.Quantizer(IntNumerics(bits=bits), qbits.AbsMax(), granularity)
        config = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=q))
        awq = qbits.ptq.Awq(grid=4, clip_grid=2)
        return qbits.ptq.quantize_weights(
            _llama, params, [tokens], config, method=awq, fold=fold
        )

    top = float(jnp.abs(want).max())
    fine = awq(16, qbits.PerChannel())  # Q(s w) is s w: the float model
    np.testing.assert_allclose(_llama(fine.params, tokens), want, atol=1e-4 * top)
    result = awq(4, qbits.Tiled(tile_size=16))
    assert len(result.stored) == 8  # every weight on its grid, lm_head too
    weights = {p.replace("/", "."): qt for p, qt in result.stored.items()}
    tensors = {}  # the float ones (norms, embedding) under PyTorch's names
    for path, x in jax.tree_util.tree_flatten_with_path(result.params)[0]:
        keys = [k.key for k in path]
        if keys[-1] != "kernel":
            tensors[".".join([*keys[:-1], "weight"])] = np.asarray(x)
    qbits.interop.write_checkpoint(
        tmp_path, weights, "compressed-tensors", tensors=tensors
    )
    ckpt = qbits.interop.read_checkpoint(tmp_path)
    sp, config = qbits.interop.serving_params(ckpt, _llama, _tree("llama"), tokens)
    got = qbits.serving.serve(_llama, config)(sp, tokens)
    mine = _llama(result.params, tokens)  # the AWQ result in float: on the grid
    np.testing.assert_allclose(got, mine, atol=1e-5 * float(jnp.abs(mine).max()))
    python = os.environ.get("QBITS_REFERENCE_PYTHON")  # compressed-tensors reads it
    if python:
        script = DATA.parent / "reference_read.py"
        out = tmp_path.parent / "llama_awq.npz"
        run = subprocess.run([python, str(script), str(tmp_path), str(out)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        got = np.load(out)
        for m, qt in weights.items():
            np.testing.assert_array_equal(
                got[f"weight/{m}"], np.asarray(qt.dequant()).T
            )


def test_a_tied_head_the_checkpoint_holds_must_equal_its_embedding():
    # AutoGPTQ saves the whole state dict: GPT-2's lm_head.weight beside wte.
    import dataclasses

    ckpt = qbits.interop.read_checkpoint(DATA / "gpt2_gptq")
    tokens = jnp.asarray(np.load(DATA / "gpt2.npz")["tokens"])
    wte = np.asarray(ckpt.tensors["transformer.wte.weight"])

    def served(head):
        tensors = {**ckpt.tensors, "lm_head.weight": head}
        tied = dataclasses.replace(ckpt, tensors=tensors)
        return qbits.interop.serving_params(
            tied, _gpt2, _tree("gpt2"), tokens, names="gpt2"
        )

    sp, _ = served(wte.copy())
    np.testing.assert_array_equal(sp.params["transformer"]["wte"]["embedding"], wte)
    with pytest.raises(InvalidArgumentError, match=r"lm_head\.weight.*as 'transf"):
        served(wte + 1)
