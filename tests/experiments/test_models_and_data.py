"""The example models, their data and the example files."""

import dataclasses
import math
import pathlib

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits._experiments import TransformerLM, load_sweep, spec, train
from qbits._experiments import _corpus as corpus
from qbits._experiments._data import (
    char_batch,
    char_data,
    char_eval_batches,
    class_data,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENS = jax.ShapeDtypeStruct((2, 16), jnp.int32)


def test_shipped_corpus_is_the_generated_text():
    text = corpus.read()
    assert text == corpus.generate()
    assert 250_000 < len(text) < 400_000 and text.isascii()


def test_char_data_split_and_vocabulary():
    data = char_data()
    assert data.vocab == len(set(corpus.read())) < 64
    assert data.train.dtype == jnp.int32
    assert data.train.shape[0] + data.eval.shape[0] == len(corpus.read())
    decoded = "".join(data.chars[i] for i in np.asarray(data.eval[:40]))
    assert decoded == corpus.read()[data.train.shape[0] :][:40]


def test_batches_are_shifted_windows():
    tokens = jnp.arange(100, dtype=jnp.int32)
    x, y = char_batch(tokens, jax.random.key(0), 4, 8)
    assert x.shape == y.shape == (4, 8)
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    ex, ey = char_eval_batches(tokens, 2, 3, 8)
    assert ex.shape == (2, 3, 8)
    np.testing.assert_array_equal(ey[..., :-1], ex[..., 1:])


def test_class_data_is_deterministic():
    a, b = class_data(n=16, n_eval=4), class_data(n=16, n_eval=4)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y_eval, b.y_eval)


def test_lm_layer_paths():
    model = nnx.eval_shape(lambda: TransformerLM(40, spec("lm"), rngs=nnx.Rngs(0)))
    paths = [row.path for row in qbits.nnx.layer_table(model, "int8", TOKENS).rows]
    assert len(paths) == 2 * 8 + 1
    assert {"blocks/0/attn/qk", "blocks/1/mlp/fc2", "head"} <= set(paths)


def test_unknown_model_and_size():
    with pytest.raises(ValueError, match="unknown model 'cnn'"):
        spec("cnn")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        spec("lm", "huge")


def test_example_files_load():
    rules = qbits.load_config(ROOT / "examples" / "transformer_rules.yaml")
    model = nnx.eval_shape(lambda: TransformerLM(40, spec("lm"), rngs=nnx.Rngs(0)))
    table = qbits.nnx.layer_table(model, rules, TOKENS)
    assert not table.unused_rules
    assert table["head"].describe() == "w4a8"
    assert table["blocks/0/attn/qk"].describe() == "float"
    lm = load_sweep(ROOT / "examples" / "sweep_lm.yaml")
    names = [e.name for e in lm.entries]
    assert names == ["none", "int8_fwd", "int8", "fp8", "w4a8", "w4a8_attn8"]
    w4 = qbits.nnx.layer_table(model, lm.entries[-1].config, TOKENS)
    assert w4["blocks/0/attn/pv"].describe() == "int8_fwd"
    assert w4["blocks/0/mlp/fc1"].describe() == "w4a8" and not w4.unused_rules
    bits = load_sweep(ROOT / "examples" / "sweep_bits.yaml")
    assert len(bits.entries) == 2 + 3 * 2 * 2 and bits.seeds == (0, 1)
    # The diagnostics study: its rules files match the layers they name.
    diag = {e.name: e.config for e in load_sweep(
        ROOT / "examples" / "sweep_diagnostics.yaml").entries}  # fmt: skip
    sensitive = qbits.nnx.layer_table(model, diag["w4a8_sensitive8"], TOKENS)
    assert not sensitive.unused_rules
    assert sensitive["blocks/1/mlp/fc2"].describe() == "int8_fwd"
    assert sensitive["blocks/1/attn/qk"].describe() == "int8_fwd"
    assert sensitive["blocks/1/mlp/fc1"].describe() == "w4a8"
    fp8 = qbits.nnx.layer_table(model, diag["fp8_attn_float"], TOKENS)
    assert fp8["blocks/0/attn/pv"].describe() == "float"
    assert fp8["head"].describe() == "fp8"


def test_deep_lm_scans_stacked_blocks_and_trains_quantized():
    """The ``deep`` size: blocks stacked by nnx.vmap, run by nnx.scan;
    fp8_delayed (one amax history per layer) trains (int8's per-layer keys
    under nnx.scan: tests/nnx/test_nnx_scan.py); the layer table lists each
    block layer once."""
    deep = spec("lm", "deep")
    assert deep.scan and deep.depth == 12
    small = dataclasses.replace(spec("lm", "tiny"), depth=2, scan=True)
    lm = nnx.eval_shape(lambda: TransformerLM(10, small, rngs=nnx.Rngs(0)))
    rows = qbits.nnx.layer_table(lm, "int8", TOKENS).rows
    assert [r.path for r in rows][:2] == ["blocks/attn/query", "blocks/attn/key"]
    assert len(rows) == 9
    assert rows[0].kind == "dot_general (activation x weight), scanned x2"
    assert rows[-1].kind == "dot_general (activation x weight)"  # the head
    result = train(small, "fp8_delayed", steps=2)
    assert math.isfinite(result.train_loss)


def test_gpu_step_trains_every_preset_kind():
    from qbits._experiments import gpu_step

    with pytest.raises(qbits.InvalidArgumentError, match="model"):
        gpu_step("mlp", None)
    for preset in (None, "fp8_delayed"):
        make, args = gpu_step("block", preset, tokens=32, d_model=16, d_ff=32)
        params, state = make()(*args)
        assert params["w1"].dtype == jnp.bfloat16
        assert not jnp.array_equal(params["w1"], args[0]["w1"])  # it moved
        assert jax.tree.structure(state) == jax.tree.structure(args[1])
