"""qbits.interop: the inputs a checkpoint quantizes (W8A8), served as declared.

``ct_fp8_dynamic`` was written by compressed-tensors with
llm-compressor's FP8_DYNAMIC scheme (channel weights, each token's input
quantized as the model runs); its ``yq/`` outputs are compressed-tensors'
own forward with that input quantization (tests/data/make_quantized_checkpoints.py).
"""

import json
import os
import re
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qbits.interop
from qbits.interop._safetensors import read_tensors, write_tensors
from tests.interop.test_checkpoints import DATA, OUT_PROJ, Q_PROJ, _llama, _shapes


def _read_quietly(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return qbits.interop.read_checkpoint(path)


def _served_q(ckpt, x):
    sp, config = qbits.interop.serving_params(ckpt, _llama, _shapes(), x)
    return np.asarray(qbits.serving.serve(_llama, config)(sp, x)[0])


def test_dynamic_fp8_inputs_are_quantized_as_compressed_tensors_does():
    ckpt = _read_quietly(DATA / "ct_fp8_dynamic")
    assert sorted(ckpt.activations) == [OUT_PROJ, Q_PROJ]
    inputs = ckpt.activations[Q_PROJ]
    assert inputs.numerics.dtype == jnp.float8_e4m3fn
    assert isinstance(inputs.granularity, qbits.PerChannel)  # a scale per token
    ref = np.load(DATA / "ct_fp8_dynamic" / "reference.npz")
    q = _served_q(ckpt, jnp.asarray(ref["x"][:, :64]))
    np.testing.assert_allclose(q, ref[f"yq/{Q_PROJ}"], rtol=1e-5, atol=1e-6)
    # served with float inputs, it would be another model's output
    assert np.abs(q - ref[f"y/{Q_PROJ}"]).max() > 1e-2


def test_static_fp8_inputs_are_quantized_on_the_calibrated_scale():
    ckpt = _read_quietly(DATA / "ct_fp8_static")
    inputs = ckpt.activations[Q_PROJ]
    scale = read_tensors(DATA / "ct_fp8_static")[f"{Q_PROJ}.input_scale"]
    assert isinstance(inputs.granularity, qbits.PerTensor)
    assert np.float32(inputs.calibration.value) / np.float32(448) == scale[0]
    ref = np.load(DATA / "ct_fp8_static" / "reference.npz")
    assert np.abs(ref["x"]).max() > 448 * scale[0]  # x clips at the scale
    q = _served_q(ckpt, jnp.asarray(ref["x"][:, :64]))
    np.testing.assert_allclose(q, ref[f"yq/{Q_PROJ}"], rtol=1e-5, atol=1e-6)
    assert np.abs(q - ref[f"y/{Q_PROJ}"]).max() > 1e-2
    for bad in (np.array([0.0], np.float32), np.array([0.1, 0.2], np.float32)):
        tensors = {**read_tensors(DATA / "ct_fp8_static"), f"{Q_PROJ}.input_scale": bad}
        with pytest.raises(qbits.InvalidArgumentError, match=r"q_proj\.input_scale"):
            qbits.interop._inputs.input_quantizers(
                "compressed-tensors", ckpt.quantization_config, [Q_PROJ], tensors, "w"
            )


def test_int8_inputs_are_quantized_as_vllm_does():
    # llm-compressor's W8A8; vLLM's dynamic_scaled_int8_quant (its CUDA
    # kernel, int8_quant_kernels.cu): scale amax / 127 per token, codes
    # rint(x * (127 / amax)) saturated
    ckpt = _read_quietly(DATA / "ct_w8a8_int8")
    inputs = ckpt.activations[Q_PROJ]
    assert inputs.numerics == qbits.IntNumerics(bits=8, preserve_max_val=True)
    ref = np.load(DATA / "ct_w8a8_int8" / "reference.npz")
    x = ref["x"][:, :64]
    amax = np.abs(x).max(-1, keepdims=True)
    codes = np.clip(np.rint(x * (np.float32(127) / amax)), -128, 127)
    want = (codes * (amax / np.float32(127))) @ ref[f"weight/{Q_PROJ}"].T
    q = _served_q(ckpt, jnp.asarray(x))
    np.testing.assert_allclose(q, want, rtol=1e-5, atol=1e-6)
    # compressed-tensors' own fake quantization maps amax onto 127.5: a
    # grid as fine, another model; both a quantization step from float
    for other in (ref[f"yq/{Q_PROJ}"], ref[f"y/{Q_PROJ}"]):
        assert 1e-4 < np.abs(q - other).max() < 1e-2


@pytest.mark.parametrize("name", ["fp8_block16x32", "fp8_block16x32_ue8m0"])
def test_deepseek_fp8_inputs_are_quantized_per_token_and_weight_block(name):
    # act_quant of DeepSeek-V3 (and transformers' FP8Linear): E4M3, a scale
    # amax / 448 per token and weight_block_size[1] inputs; ue8m0 (V3.1 on):
    # that scale rounded up to a power of two
    ckpt = _read_quietly(DATA / name)
    inputs = ckpt.activations[Q_PROJ]
    assert inputs.granularity == qbits.Tiled(tile_size=32)
    ref = np.load(DATA / name / "reference.npz")
    x = ref["x"][:, :64].reshape(3, 2, 32)
    s = np.abs(x).max(-1, keepdims=True) / np.float32(448)
    if name.endswith("ue8m0"):
        assert inputs.scale_rounding == "e8m0"
        s = np.exp2(np.ceil(np.log2(s))).astype(np.float32)
    xq = ((x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s).reshape(3, 64)
    want = xq @ ref[f"weight/{Q_PROJ}"].T
    q = _served_q(ckpt, jnp.asarray(ref["x"][:, :64]))
    np.testing.assert_allclose(q, want, rtol=1e-5, atol=1e-6)


def _edited(tmp_path, name, edit_config, edit_tensors=None):
    out = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(DATA / name, out)
    full = json.loads((out / "config.json").read_text())
    edit_config(full["quantization_config"])
    (out / "config.json").write_text(json.dumps(full))
    if edit_tensors is not None:
        tensors = read_tensors(out)
        edit_tensors(tensors)
        write_tensors(out / "model.safetensors", tensors)
    return out


def _inputs(**args):
    def edit(qc):
        qc["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
            "group_size": None, **args,
        }  # fmt: skip

    return edit


def test_input_granularities_and_what_is_not_reproduced_warns(tmp_path):
    ckpt = _read_quietly(
        _edited(tmp_path, "ct_fp8_dynamic", _inputs(strategy="tensor"))
    )
    assert isinstance(ckpt.activations[Q_PROJ].granularity, qbits.PerTensor)
    path = _edited(tmp_path, "ct_fp8_dynamic", _inputs(strategy="group", group_size=16))
    assert _read_quietly(path).activations[Q_PROJ].granularity == qbits.Tiled(
        tile_size=16
    )

    def static(t):  # calibrated input scales, as llm-compressor's FP8 writes them
        for m in (Q_PROJ, OUT_PROJ):
            t[f"{m}.input_scale"] = np.array([0.01], np.float32)

    cases = [
        (_inputs(type="int", dynamic=False), static, "type int, num_bits 8"),
        (_inputs(strategy="tensor", type="int"), None, "type int, num_bits 8"),
        (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8}), None, "kv_cache"),
        (lambda qc: None, static, f"{OUT_PROJ}.input_scale"),  # undeclared
    ]
    for edit_config, edit_tensors, named in cases:
        path = _edited(tmp_path, "ct_fp8_channel", edit_config, edit_tensors)
        with pytest.warns(UserWarning, match="serves those values in float") as record:
            ckpt = qbits.interop.read_checkpoint(path)
        assert named in str(record[0].message)
        assert ckpt.activations == {}  # those layers read float inputs
        assert sorted(ckpt.tensors) == ["lm_head.weight", "model.norm.weight"]

    def as_bytes(t):  # ue8m0 scales as transformers' MXFP8 checkpoints hold them
        for m in (Q_PROJ, OUT_PROJ):
            t[f"{m}.weight_scale_inv"] = t[f"{m}.weight_scale_inv"].view(np.uint8)

    path = _edited(tmp_path, "fp8_block16x32_ue8m0", lambda qc: None, as_bytes)
    got = _read_quietly(path).weights[Q_PROJ].scale
    want = _read_quietly(DATA / "fp8_block16x32_ue8m0").weights[Q_PROJ].scale
    np.testing.assert_array_equal(got, want)
    # ue8m0 declared, float scales stored: the tensors are checked
    path = _edited(tmp_path, "fp8_block16x32", lambda qc: qc.update(scale_fmt="ue8m0"))
    with pytest.raises(qbits.InvalidArgumentError, match="not powers of two"):
        qbits.interop.read_checkpoint(path)
    path = _edited(
        tmp_path, "fp8_block16x32", lambda qc: qc.update(activation_scheme="static")
    )
    with pytest.warns(UserWarning, match="activation_scheme 'static'"):
        assert qbits.interop.read_checkpoint(path).activations == {}


def test_qbits_import_names_the_inputs_it_quantizes(capsys):
    from qbits.cli import main

    assert main(["import", str(DATA / "ct_fp8_dynamic")]) == 0
    out = capsys.readouterr().out
    assert "inputs quantized as they come: float8_e4m3fn per token (2 layers)" in out


def test_inputs_written_as_compressed_tensors_declares_them(tmp_path):
    ckpt = _read_quietly(DATA / "ct_fp8_dynamic")
    write = qbits.interop.write_checkpoint
    write(
        tmp_path / "ct",
        ckpt.weights,
        "compressed-tensors",
        activations=ckpt.activations,
    )
    assert _read_quietly(tmp_path / "ct").activations == ckpt.activations
    int8 = qbits.presets.get("int8").fwd.lhs  # no engine quantizes inputs so
    for fmt, acts in (
        ("gptq", ckpt.activations),  # GPTQ declares weights only
        ("compressed-tensors", {Q_PROJ: ckpt.activations[Q_PROJ]}),  # not o_proj's
        ("compressed-tensors", {Q_PROJ: int8, OUT_PROJ: int8}),
    ):
        with pytest.raises(qbits.InvalidArgumentError, match="activations="):
            write(tmp_path / "bad", ckpt.weights, fmt, activations=acts)
    assert not (tmp_path / "bad").exists()  # checked before anything is written
    # compressed-tensors itself parses them (QBITS_REFERENCE_PYTHON's venv)
    python = os.environ.get("QBITS_REFERENCE_PYTHON")
    if not python:
        pytest.skip("QBITS_REFERENCE_PYTHON is not set (docs/guides/development.md)")
    script = DATA.parent / "reference_read.py"
    run = subprocess.run(
        [python, str(script), str(tmp_path / "ct"), str(tmp_path / "ct.npz")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = np.load(tmp_path / "ct.npz")
    for m, qt in ckpt.weights.items():
        np.testing.assert_array_equal(got[f"weight/{m}"], np.asarray(qt.dequant()).T)
        assert str(got[f"inputs/{m}"]) == "float 8 token None dynamic=True"


def test_online_transforms_and_sparse_storage_are_refused(tmp_path):
    hadamard = {
        "type": "hadamard",
        "apply": [
            {"targets": ["re:.*o_proj$"], "location": "weight_input"},
            {"targets": ["re:.*o_proj$"], "location": "input", "inverse": True},
        ],
    }
    for edit, named in (
        (lambda qc: qc.update(transform_config={"config_groups": {"R4": hadamard}}),
         "transform_config.R4='a hadamard transform at input'"),
        (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask"}),
         "sparsity_config.format='sparse-24-bitmask'"),
    ):  # fmt: skip
        with pytest.raises(qbits.InvalidArgumentError, match=re.escape(named)):
            qbits.interop.read_checkpoint(_edited(tmp_path, "ct_fp8_channel", edit))
    # transforms in the stored weights alone: read
    hadamard["apply"] = hadamard["apply"][:1]
    edit = lambda qc: qc.update(transform_config={"config_groups": {"R1": hadamard}})  # noqa: E731
    assert _read_quietly(_edited(tmp_path, "ct_fp8_channel", edit)).weights


def test_input_groups_over_several_contracting_axes_are_refused(tmp_path):
    # the checkpoint's groups are of the flattened input; a matmul contracting
    # (heads, head_dim) would group along head_dim alone: refused
    def heads(p, x):
        attn = p["model"]["layers"]["0"]["self_attn"]
        dims = (((1, 2), (0, 1)), ((), ()))
        q = jax.lax.dot_general(x.reshape(3, 2, 32), attn["q_proj"]["kernel"], dims)
        return q @ attn["o_proj"]["kernel"]

    shapes = {"model": {"layers": _shapes()["model"]["layers"]}}
    attn = shapes["model"]["layers"]["0"]["self_attn"]
    attn["q_proj"]["kernel"] = jax.ShapeDtypeStruct((2, 32, 32), jnp.float32)
    path = _edited(tmp_path, "ct_fp8_dynamic", _inputs(strategy="group", group_size=16))
    ckpt = _read_quietly(path)
    ckpt = qbits.interop.Checkpoint(
        ckpt.format, ckpt.weights, ckpt.quantizers, {}, ckpt.quantization_config,
        activations=ckpt.activations,
    )  # fmt: skip
    with pytest.raises(qbits.InvalidArgumentError, match="contracting 2 axes"):
        qbits.interop.serving_params(
            ckpt, heads, shapes, jnp.ones((3, 64)), names=[
                (r"model\.layers\.0\.self_attn\.(q|o)_proj\.weight",
                 r"model/layers/0/self_attn/\1_proj/kernel"),
            ],
        )  # fmt: skip
