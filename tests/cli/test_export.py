"""qbits export and qbits generate --checkpoint: a PTQ result of the example LM
written as a compressed-tensors checkpoint, and decoded from it as from the
PTQ result (the GPTQ export, read by AutoGPTQ: benchmarks/checkpoint_formats.py)."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits._experiments
import qbits.interop
from qbits._experiments import build_model, ptq_trained, spec
from qbits._experiments._sweep import save_model_params, write_json_atomic
from qbits.cli import main
from qbits.cli._interop import decoder, served_lm

DATA = "tests/data/quantized"


def _saved_run(folder):
    """The tiny LM with random weights, saved as qbits train saves it."""
    model = nnx.eval_shape(lambda: build_model(spec("lm", "tiny"), 0)[0])
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)

    def init(path, x):  # biases 0 and norms 1: tokens that vary
        name = jax.tree_util.keystr(path)
        if "bias" in name or "scale" in name:
            return jnp.full(x.shape, "scale" in name, x.dtype)
        return jnp.asarray(rng.standard_normal(x.shape), x.dtype)

    state = jax.tree_util.tree_map_with_path(init, state)
    runs = folder / "runs"
    runs.mkdir(parents=True)
    save_model_params(runs / "float32__seed0.params", nnx.merge(graphdef, state))
    run = {"name": "float32", "seed": 0, "model": "lm", "size": "tiny"}
    write_json_atomic(runs / "float32__seed0.json", run | {"result": {}})
    return folder


def _one_error_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("method", ["rtn", "awq"])  # awq: scales folded
def test_export_then_generate_from_the_checkpoint_equals_the_ptq_result(
    tmp_path, capsys, monkeypatch, method
):
    run = _saved_run(tmp_path / "run")
    out = tmp_path / "ckpt"
    kept = []  # the PTQ result the command exports

    def keep(*args, **kwargs):
        kept.append(ptq_trained(*args, **kwargs))
        return kept[-1]

    monkeypatch.setattr(qbits._experiments, "ptq_trained", keep)
    argv = ["export", "int8_fwd", str(out), "--run", str(run), "--method", method]
    assert main([*argv, "--format", "compressed-tensors", "--calibration", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out}: compressed-tensors/pack-quantized, lm")
    assert "7 quantized weights" in printed and "blocks.0.attn.out" in printed
    assert "int8_fwd quantizes activations too; the checkpoint holds" in printed
    model, data, _, result = kept[0]
    ckpt = qbits.interop.read_checkpoint(out)
    query = ckpt.weights["blocks.0.attn.query"]  # [in, heads * head_dim]
    stored = result.stored["blocks/0/attn/query"]  # [in, heads, head_dim]
    np.testing.assert_array_equal(query.qvalue, stored.qvalue.reshape(16, 16))
    np.testing.assert_array_equal(query.scale, stored.scale.reshape(1, 16))
    if method == "awq":  # the norm before query, key and value holds 1 / s
        norm = result.params["blocks"][0]["norm1"]["scale"][...]
        np.testing.assert_array_equal(ckpt.tensors["blocks.0.norm1.weight"], norm)
        assert not np.array_equal(norm, model.blocks[0].norm1.scale[...])

    # Decoded from the checkpoint (names "qbits-lm" onto the LM's decode)...
    text = ["generate", "--checkpoint", str(out), "--tokens", "6", "--prompt", "The "]
    assert main([*text, "-q"]) == 0
    got = capsys.readouterr().out
    # ...and served the native way from the PTQ result: the same tokens.
    prompt = jnp.asarray([data.chars.index(c) for c in "The "], jnp.int32)
    caches = jax.eval_shape(lambda: model.init_cache(1, "kv_int8"))
    fn = decoder(model)
    sp = qbits.serving.convert(fn, "int8_fwd", result, prompt[None, :1], caches)
    native = served_lm(model, sp, "int8_fwd")
    tokens = qbits.kvcache.generate(native, prompt, 6, cache="kv_int8")
    assert got == "The " + "".join(data.chars[i] for i in np.asarray(tokens)) + "\n"
    assert len(set(got[4:])) > 2, got  # not one token repeated


def test_export_and_generate_errors_are_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["export", "int8_fwd", str(tmp_path / "out"), "--run", str(run)]
    assert main(argv) == 2
    assert "holds no saved params" in _one_error_line(capsys)
    assert main(["generate", "--checkpoint", f"{DATA}/gptq_w4g16_sym"]) == 2
    assert "config.json has no qbits entry" in _one_error_line(capsys)
    assert main(["generate", "--checkpoint", "c", "--run", "r"]) == 2
    assert "--run, --steps and --size do not apply" in _one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_the_lms_awq_is_folded_for_ptq_reports_and_exports():
    # post_train (qbits ptq) and ptq_trained (qbits export) take their
    # methods' arguments from one place: the LM's AWQ the report shows is
    # the folded one export writes.
    from qbits._experiments._ptq import _method_kwargs, lm_fold

    lm, mlp = spec("lm", "tiny"), spec("mlp", "tiny")
    run = {"model": "lm", "seed": 0}
    assert _method_kwargs("awq", run, lm)["fold"] == lm_fold(lm.depth)
    assert "fold" not in _method_kwargs("gptq", run, lm)
    assert "fold" not in _method_kwargs("awq", run | {"model": "mlp"}, mlp)


def test_export_declares_the_inputs_fp8_quantizes(tmp_path, capsys):
    # fp8 quantizes every stored layer's input per tensor, dynamic E4M3:
    # written as compressed-tensors' input_activations, read back as such
    run = _saved_run(tmp_path / "run")
    out = tmp_path / "ckpt"
    argv = ["export", "fp8", str(out), "--run", str(run), "--method", "rtn"]
    assert main([*argv, "--format", "compressed-tensors", "--calibration", "1"]) == 0
    assert "inputs: fp8 quantizes them as" in capsys.readouterr().out
    ckpt = qbits.interop.read_checkpoint(out)
    assert len(ckpt.activations) == len(ckpt.weights) == 7
    assert {type(q.granularity) for q in ckpt.activations.values()} == {qbits.PerTensor}
