"""qbits.interop: checkpoints written by the reference packers, read by qbits.

The fixtures under tests/data/quantized were written by AutoGPTQ and
compressed-tensors (tests/data/make_quantized_checkpoints.py), with each
reference's own dequantized weights and forward output: qbits' codes,
scales and dequantized weights must equal them bit for bit, its served
output the reference float matmul within float tolerance.
"""

import json
import os
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qbits.interop
from qbits._tensor import float_scale
from qbits.interop._safetensors import read_tensors, write_tensors

DATA = pathlib.Path(__file__).parents[1] / "data" / "quantized"
# Each holds q_proj and o_proj (the LM apart).
READABLE = sorted(p.name for p in DATA.iterdir() if p.name != "ct_qbits_lm")
# Served as well (one compile each): a checkpoint of each kind of weight
# (DeepSeek's FP8 quantizes its inputs too: served in test_inputs).
SERVED = (
    "gptq_w4g16_asym",
    "gptq_w8g32_sym",
    "gptq_w4g16_actorder",
    "ct_w4g32_sym",
    "ct_fp8_channel",
    "bnb_nf4_dq",
)
Q_PROJ, OUT_PROJ = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"


def _llama(p, x):
    """A Llama-named stand-in: q_proj, o_proj, the final norm and the head."""
    layer = p["model"]["layers"]["0"]["self_attn"]
    h = x @ layer["q_proj"]["kernel"]
    q = h
    h = h @ layer["o_proj"]["kernel"]
    return q, h, (h * p["model"]["norm"]["weight"]) @ p["lm_head"]["kernel"]


def _shapes():
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    attn = {"q_proj": {"kernel": f32(64, 32)}, "o_proj": {"kernel": f32(32, 32)}}
    return {
        "model": {"layers": {"0": {"self_attn": attn}}, "norm": {"weight": f32(32)}},
        "lm_head": {"kernel": f32(32, 16)},
    }


@pytest.mark.parametrize("name", READABLE)
def test_reads_codes_and_scales_bit_for_bit_and_serves_the_reference(name):
    ckpt = qbits.interop.read_checkpoint(DATA / name)
    ref = np.load(DATA / name / "reference.npz")
    gptq = name.startswith("gptq")
    half = name.startswith(("gptq", "awq"))  # references in float16
    assert sorted(ckpt.weights) == [OUT_PROJ, Q_PROJ]
    assert sorted(ckpt.tensors) == ["lm_head.weight", "model.norm.weight"]
    assert sorted(ckpt.input_orders) == (
        [OUT_PROJ, Q_PROJ] if "actorder" in name else []
    )
    for m, qt in ckpt.weights.items():
        w = np.asarray(qt.dequant()).T  # [out, in], as PyTorch
        # act-order: the stored rows are the inputs sorted by group
        order = ckpt.input_orders.get(m, np.arange(w.shape[1]))
        w = w[:, np.argsort(order)]
        # GPTQ's and AWQ's references dequantize in float16: qbits' exact
        # product, rounded once
        got = w.astype(np.float16).astype(np.float32) if half else w
        if "nvfp4" in name:  # compressed-tensors decompresses NVFP4 to bfloat16
            got = w.astype(ml_dtypes.bfloat16).astype(np.float32)
            codes = np.asarray(qt.unpack().qvalue).astype(np.float32).T
            np.testing.assert_array_equal(codes, ref[f"codes/{m}"])
            # its float32 dequantize: scale / global_scale, qbits' scale *
            # (1 / global_scale): float32 roundings apart
            np.testing.assert_allclose(w, ref[f"weight32/{m}"], rtol=2**-22, atol=0)
        np.testing.assert_array_equal(got, ref[f"weight/{m}"])
        if name.startswith("bnb"):  # the absmax bitsandbytes double-dequantizes
            dq = "dq" in name
            scale = np.asarray(float_scale(qt))
            np.testing.assert_array_equal(scale.T.ravel(), ref[f"absmax/{m}"])
            # the file's bytes: codes, an absmax per block (double quantization:
            # uint8, and a float32 per 256 blocks)
            n, blocks = w.size, qt.scale.size
            absmax = blocks + 4 * -(-blocks // 256) if dq else 4 * blocks
            assert ckpt.stored_bytes[m] == n // 2 + absmax
            # qbits holds the same (and the offset of the file's JSON state)
            assert qt.nbytes == n // 2 + absmax + 4 * dq
            assert (
                (qt.scale_absmax is not None) == dq == ckpt.quantizers[m].double_quant
            )
            if dq:  # the file's uint8 codes (bitsandbytes' order), not float32
                held = {k: v for k, v in vars(qt).items() if hasattr(v, "dtype")}
                assert {k: (v.dtype.name, v.shape) for k, v in held.items()} == {
                    "qvalue": ("uint8", (w.shape[1], w.shape[0] // 2)),
                    "scale": ("uint8", (w.shape[1] // 32, w.shape[0])),
                    "scale_absmax": ("float32", (-(-blocks // 256),)),
                    "scale_offset": ("float32", (1, 1)),
                }
                file = read_tensors(DATA / name)
                codes = file[f"{m}.weight.absmax"]
                np.testing.assert_array_equal(np.asarray(qt.scale).T.ravel(), codes)
                # compiled too (XLA would fuse the decode's product and sum)
                got = jax.jit(lambda q: (float_scale(q), q.dequant()))(qt)
                np.testing.assert_array_equal(got[0], scale)
                np.testing.assert_array_equal(np.asarray(got[1]).T, ref[f"weight/{m}"])
        if name.startswith("awq"):  # AutoAWQ's zero points and fp16 scales
            np.testing.assert_array_equal(qt.zero_point.T, ref[f"zeros/{m}"])
            np.testing.assert_array_equal(
                np.asarray(qt.scale).T.astype(np.float16), ref[f"scales/{m}"]
            )
        if gptq:  # the codes the packer was given, its fp16 scales
            codes = np.asarray(qt.unpack().qvalue).astype(np.int32)
            if qt.zero_point is None:  # signed codes: GPTQ's are offset by 2^(bits-1)
                codes += 8 if qt.qdtype.name == "int4" else 128
            np.testing.assert_array_equal(
                codes.T[:, np.argsort(order)], ref[f"codes/{m}"]
            )
            np.testing.assert_array_equal(
                np.asarray(qt.scale).T.astype(np.float16), ref[f"scales/{m}"]
            )
    if name not in SERVED:
        return
    x = jnp.asarray(ref["x"])
    sp, config = qbits.interop.serving_params(ckpt, _llama, _shapes(), x[:, :64])
    assert {k for k in sp.weights} == {
        "model/layers/0/self_attn/q_proj",
        "model/layers/0/self_attn/o_proj",
    }
    q, _, _ = qbits.serving.serve(_llama, config)(sp, x[:, :64])
    if "actorder" in name:  # the input order rides with the stored weight
        path = "model/layers/0/self_attn/q_proj"
        for order in (jnp.arange(63), jnp.zeros(64, jnp.int32)):  # not a permutation
            arrays = {**sp.weights[path], "input_order": order}
            bad = sp.replace(weights={**sp.weights, path: arrays})
            with pytest.raises(qbits.InvalidArgumentError, match="input_order"):
                qbits.serving.serve(_llama, config)(bad, x[:, :64])
    # the reference weights, in float
    want = ref["x"][:, :64] @ ref.get(f"weight32/{Q_PROJ}", ref[f"weight/{Q_PROJ}"]).T
    np.testing.assert_allclose(np.asarray(q), want, rtol=2e-3, atol=2e-4)
    # and the reference's own forward (float16 for GPTQ)
    np.testing.assert_allclose(np.asarray(q), ref[f"y/{Q_PROJ}"], rtol=2e-2, atol=2e-3)


def _copy(tmp_path, name, edit=None, config=None):
    """A fixture copied, its tensors and config.json edited."""
    out = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(DATA / name, out)
    if edit is not None:
        tensors = read_tensors(out)
        edit(tensors)
        write_tensors(out / "model.safetensors", tensors)
    if config is not None:
        full = json.loads((out / "config.json").read_text())
        full["quantization_config"].update(config)
        (out / "config.json").write_text(json.dumps(full))
    return out


def _error(path):
    with pytest.raises(qbits.InvalidArgumentError) as e:
        qbits.interop.read_checkpoint(path)
    text = str(e.value)
    assert "\n" not in text.split("because")[0], text
    return text


def test_bad_checkpoints_are_one_line_errors_naming_file_and_tensor(tmp_path):
    def uneven(t):  # act-order groups, one of them holding 17 inputs
        g_idx = t[f"{OUT_PROJ}.g_idx"].copy()
        g_idx[np.flatnonzero(g_idx == 0)[0]] = 1
        t[f"{OUT_PROJ}.g_idx"] = g_idx

    text = _error(_copy(tmp_path, "gptq_w4g16_actorder", edit=uneven))
    assert "o_proj.g_idx" in text and "of 17 inputs at most" in text
    path = _copy(
        tmp_path,
        "gptq_w4g16_asym",
        edit=lambda t: t.pop(f"{Q_PROJ}.g_idx"),
        config={"desc_act": True},
    )
    assert f"{Q_PROJ}.g_idx='missing'" in _error(path)
    path = _copy(tmp_path, "gptq_w4g16_sym", edit=lambda t: t.pop(f"{OUT_PROJ}.scales"))
    assert f"{OUT_PROJ}.scales='missing'" in _error(path)
    assert "bits=3" in _error(_copy(tmp_path, "gptq_w8g32_sym", config={"bits": 3}))
    # GPTQModel's dynamic: modules with their own settings are refused by
    # name; a '-:' rule (modules left float) and restated settings are read
    dynamic = {"+:.*o_proj": {"bits": 8}}
    path = _copy(tmp_path, "gptq_w4g16_sym", config={"dynamic": dynamic})
    assert "dynamic={'+:.*o_proj': {'bits': 8}}" in _error(path)
    dynamic = {"-:lm_head": {}, r"+:.*q_proj": {"bits": 4}}
    path = _copy(tmp_path, "gptq_w4g16_sym", config={"dynamic": dynamic})
    assert Q_PROJ in qbits.interop.read_checkpoint(path).weights
    # a 4-bit checkpoint declared 8-bit: qweight holds twice the inputs
    text = _error(
        _copy(tmp_path, "gptq_v2_w4g16_asym", config={"bits": 8, "group_size": 8})
    )
    assert f"{OUT_PROJ}.qzeros=[2, 4]" in text and "8-bit" in text
    assert "quant_method='hqq'" in _error(
        _copy(tmp_path, "ct_fp8_tensor", config={"quant_method": "hqq"})
    )
    # a checkpoint declared AWQ that is not: its tensors are checked
    assert "*.qweight='missing'" in _error(
        _copy(
            tmp_path, "ct_fp8_tensor", config={"quant_method": "awq", "version": "gemm"}
        )
    )
    assert "version='gemv'" in _error(
        _copy(tmp_path, "awq_w4g16", config={"version": "gemv"})
    )
    text = _error(_copy(tmp_path, "awq_w4g16", config={"group_size": 32}))
    assert f"{OUT_PROJ}.qzeros=[2, 4]" in text and "groups of 32" in text
    path = _copy(tmp_path, "fp8_block16x32", config={"weight_block_size": [8, 32]})
    assert f"{OUT_PROJ}.weight_scale_inv='float32[2, 1]'" in _error(path)
    text = _error(_copy(tmp_path, "fp8_block16x32", config={"weight_block_size": None}))
    assert "weight_block_size=None" in text
    path = _copy(tmp_path, "bnb_nf4_dq", config={"bnb_4bit_quant_type": "fp4"})
    assert "'True, fp4'" in _error(path)
    path = _copy(
        tmp_path, "bnb_nf4_dq", edit=lambda t: t.pop(f"{Q_PROJ}.weight.nested_absmax")
    )
    assert f"{Q_PROJ}.weight.nested_absmax='missing'" in _error(path)
    path = _copy(
        tmp_path,
        "bnb_nf4_dq",
        edit=lambda t: t.update(
            {f"{Q_PROJ}.weight.nested_quant_map": np.ones(256, np.float32)}
        ),
    )
    assert f"{Q_PROJ}.weight.nested_quant_map='other levels'" in _error(path)
    text = _error(
        _copy(
            tmp_path,
            "ct_w4g16_asym",
            edit=lambda t: t.update(
                {f"{Q_PROJ}.weight_scale": t[f"{Q_PROJ}.weight_scale"][:, :2]}
            ),
        )
    )
    assert f"{Q_PROJ}.weight_scale=[32, 2]" in text
    assert "sym" in _error(_copy(tmp_path, "gptq_w4g16_asym", config={"sym": True}))
    path = _copy(tmp_path, "ct_w8_channel")
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    text = _error(path)
    assert "model.safetensors: " in text and "truncated shard" in text


def test_writes_what_it_reads_gptq_and_compressed_tensors(tmp_path):
    for name, fmt in (
        ("gptq_w4g16_asym", "compressed-tensors"),
        ("gptq_w4g16_sym", "gptq"),
        ("gptq_w8g32_sym", "gptq_v2"),
        ("ct_w8_channel", "compressed-tensors"),
        ("ct_fp8_tensor", "compressed-tensors"),  # float-quantized
        ("ct_fp8_channel", "compressed-tensors"),
        ("ct_nvfp4", "compressed-tensors"),  # nvfp4-pack-quantized
    ):
        ckpt = qbits.interop.read_checkpoint(DATA / name)
        out = tmp_path / f"{name}-{fmt}"
        qbits.interop.write_checkpoint(out, ckpt.weights, fmt, tensors=ckpt.tensors)
        again = qbits.interop.read_checkpoint(out)
        assert again.format.startswith(fmt)
        for m, qt in ckpt.weights.items():
            np.testing.assert_array_equal(again.weights[m].dequant(), qt.dequant())
            assert again.quantizers[m] == ckpt.quantizers[m]
    ckpt = qbits.interop.read_checkpoint(DATA / "ct_w4g32_sym")  # float32 scales
    qbits.interop.write_checkpoint(tmp_path / "gptq32", ckpt.weights, "gptq")
    assert read_tensors(tmp_path / "gptq32")[f"{Q_PROJ}.scales"].dtype == np.float32
    again = qbits.interop.read_checkpoint(tmp_path / "gptq32")
    for m, qt in ckpt.weights.items():
        np.testing.assert_array_equal(again.weights[m].dequant(), qt.dequant())
    # qbits' zero points may lie outside the codes (a group of one sign): refused
    ckpt = qbits.interop.read_checkpoint(DATA / "ct_w4g16_asym")
    qt = ckpt.weights[Q_PROJ]
    off = {Q_PROJ: qt.replace(zero_point=qt.zero_point.at[0, 0].set(16))}
    wrapped = r"zero points 3\.\.16.*expected 0\.\.15"
    with pytest.raises(qbits.InvalidArgumentError, match=wrapped):
        qbits.interop.write_checkpoint(tmp_path / "z", off, "compressed-tensors")
    ckpt = qbits.interop.read_checkpoint(DATA / "ct_fp8_tensor")
    with pytest.raises(qbits.InvalidArgumentError, match="compressed-tensors only"):
        qbits.interop.write_checkpoint(tmp_path / "fp8", ckpt.weights)  # GPTQ
    # NF4 and double-quantized scales have no GPTQ or compressed-tensors form
    nf4 = qbits.interop.read_checkpoint(DATA / "bnb_nf4_dq").weights
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"codebook \(NF4\) with double"
    ):
        qbits.interop.write_checkpoint(tmp_path / "nf4", nf4, "compressed-tensors")
    int4 = qbits.Quantizer(
        qbits.IntNumerics(bits=4),
        granularity=qbits.Tiled(tile_size=16),
        double_quant=True,
    )
    dq = {Q_PROJ: int4.quant(jnp.ones((64, 32)), store=True, contracting_axes=(0,))}
    with pytest.raises(
        qbits.InvalidArgumentError, match="with double-quantized scales"
    ):
        qbits.interop.write_checkpoint(tmp_path / "dq", dq, "gptq")
    # float Linears beside GPTQ weights: transformers' selection names the rest
    ckpt = qbits.interop.read_checkpoint(DATA / "gptq_w4g16_sym")
    q_only, floats = (
        {Q_PROJ: ckpt.weights[Q_PROJ]},
        {f"{OUT_PROJ}.weight": np.ones((32, 32))},
    )
    qbits.interop.write_checkpoint(tmp_path / "f", q_only, tensors=floats)
    qc = json.loads((tmp_path / "f" / "config.json").read_text())["quantization_config"]
    assert qc["block_name_to_quantize"] == Q_PROJ
    assert qc["modules_in_block_to_quantize"] == [[Q_PROJ]]
    with pytest.raises(qbits.InvalidArgumentError, match="end in a quantized"):
        clash = {f"x.{Q_PROJ}.weight": np.ones((32, 64))}
        qbits.interop.write_checkpoint(tmp_path / "c", q_only, tensors=clash)
    # act-order: the rows go back to their inputs, g_idx says their groups
    ckpt = qbits.interop.read_checkpoint(DATA / "gptq_w4g16_actorder")
    orders = ckpt.input_orders
    qbits.interop.write_checkpoint(tmp_path / "act", ckpt.weights, input_orders=orders)
    for name in ("qweight", "qzeros", "scales", "g_idx"):  # AutoGPTQ's own, again
        want = read_tensors(DATA / "gptq_w4g16_actorder")
        got = read_tensors(tmp_path / "act")
        for m in orders:
            np.testing.assert_array_equal(got[f"{m}.{name}"], want[f"{m}.{name}"])
    for bad, fmt in ((np.zeros_like(orders[Q_PROJ]), "gptq"),
                     (orders[Q_PROJ], "compressed-tensors")):  # fmt: skip
        with pytest.raises(qbits.InvalidArgumentError, match="input_orders"):
            qbits.interop.write_checkpoint(
                tmp_path / "bad", ckpt.weights, fmt, input_orders={Q_PROJ: bad}
            )


def test_the_reference_libraries_read_what_qbits_writes(tmp_path):
    # In a subprocess of an interpreter with qbits[reference] (PyTorch,
    # AutoGPTQ, compressed-tensors), named by QBITS_REFERENCE_PYTHON: the
    # libraries that define the formats read back what qbits wrote.
    python = os.environ.get("QBITS_REFERENCE_PYTHON")
    if not python:
        pytest.skip("QBITS_REFERENCE_PYTHON is not set (docs/guides/development.md)")
    cases = [("gptq_w4g16_asym", f) for f in ("gptq", "gptq_v2", "compressed-tensors")]
    cases += [("gptq_w8g32_sym", "gptq"), ("ct_w4g32_sym", "gptq")]  # float32 scales
    cases += [
        (n, "compressed-tensors")
        for n in ("ct_fp8_tensor", "ct_fp8_channel", "ct_nvfp4")
    ]
    # o_proj kept float beside q_proj: the loaders must leave it (and lm_head)
    # float (reference_read.py fails if their choice is not the checkpoint's)
    cases += [
        ("gptq_w8g32_sym", f"{f} o_proj float") for f in ("gptq", "compressed-tensors")
    ]
    argv, written = [python, str(DATA.parent / "reference_read.py")], []
    for i, (name, fmt) in enumerate(cases):
        ckpt = qbits.interop.read_checkpoint(DATA / name)
        fmt, *kept = fmt.split(" ", 1)
        weights, tensors = ckpt.weights, {}
        if kept:
            weights = {Q_PROJ: ckpt.weights[Q_PROJ]}
            tensors = {**ckpt.tensors, f"{OUT_PROJ}.weight": np.ones((32, 32))}
        qbits.interop.write_checkpoint(tmp_path / str(i), weights, fmt, tensors=tensors)
        argv += [str(tmp_path / str(i)), str(tmp_path / f"{i}.npz")]
        written.append((ckpt, weights, fmt, tmp_path / f"{i}.npz"))
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for ckpt, weights, fmt, npz in written:
        got = np.load(npz)
        floats = sorted(k for k in got if k.startswith("float/"))
        kept = ["float/lm_head", f"float/{OUT_PROJ}"]
        assert floats == (kept if len(weights) == 1 else []), npz
        half = fmt.startswith("gptq") and ckpt.format.startswith("gptq")
        for m, qt in weights.items():
            w = np.asarray(qt.dequant()).T
            if half:  # float16 scales: the reference dequantizes in float16
                w = w.astype(np.float16).astype(np.float32)
            if qt.tensor_scale is not None:  # NVFP4: codes and scales bit for bit
                qt = qt.unpack()
                for part, mine in (("codes", qt.qvalue), ("scale", qt.scale)):
                    mine = np.asarray(mine).astype(np.float32).T
                    np.testing.assert_array_equal(got[f"{part}/{m}"], mine)
                # its float32 scale / global_scale, qbits' scale * tensor_scale:
                # a rounding apart, and one more for the fixture's global scale
                # read (1 / g) and written back (1 / (1 / g))
                np.testing.assert_array_max_ulp(got[f"weight32/{m}"], w, maxulp=2)
                w = w.astype(ml_dtypes.bfloat16).astype(np.float32)  # decompress'
            np.testing.assert_array_equal(got[f"weight/{m}"], w, err_msg=f"{npz} {m}")


def test_the_references_read_qbits_awq_of_the_example_lm_scales_folded(tmp_path):
    # AWQ's s folded into the layers before (norms, value's channels): the
    # checkpoint holds Q(s w) and the folded float norms. The reference reads
    # codes and scales bit for bit; the float LM on its weights is qbits'
    # served AWQ model within float tolerance.
    python = os.environ.get("QBITS_REFERENCE_PYTHON")
    if not python:
        pytest.skip("QBITS_REFERENCE_PYTHON is not set (docs/guides/development.md)")
    from qbits._experiments import build_model, spec
    from qbits._experiments._ptq import lm_fold
    from qbits.cli._interop import _torch_layout
    from qbits.numerics import IntNumerics

    model, data = build_model(spec("lm", "tiny"), 0)
    fn, params = qbits.nnx.as_function(model)
    tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, data.vocab)
    q = qbits.Quantizer(IntNumerics(bits=8), qbits.AbsMax(), qbits.PerChannel())
    config = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=q))
    awq = qbits.ptq.Awq(grid=5, clip_grid=3)
    result = qbits.ptq.quantize_weights(
        fn, params, [tokens], config, method=awq, fold=lm_fold(1)
    )
    assert len(result.stored) == 7  # every weight on its grid
    served = qbits.serving.serve(fn, config)
    mine, _ = served(qbits.serving.convert(fn, config, result, tokens), tokens)
    argv, written = [python, str(DATA.parent / "reference_read.py")], []
    for fmt in ("compressed-tensors", "gptq"):
        weights, tensors = _torch_layout(model, result, fmt)
        qbits.interop.write_checkpoint(tmp_path / fmt, weights, fmt, tensors=tensors)
        argv += [str(tmp_path / fmt), str(tmp_path / f"{fmt}.npz")]
        written.append((fmt, weights))
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for fmt, weights in written:
        got = np.load(tmp_path / f"{fmt}.npz")
        for m, qt in weights.items():  # float32 scales: no float16 rounding
            np.testing.assert_array_equal(
                got[f"weight/{m}"], np.asarray(qt.dequant()).T
            )
        ckpt = qbits.interop.read_checkpoint(tmp_path / fmt)
        sp, _ = qbits.interop.serving_params(ckpt, fn, params, tokens, names="qbits-lm")
        want, _ = fn(_reference_params(sp, got), tokens)
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-4, err_msg=fmt)


def _reference_params(sp, ref):
    """``sp.params`` with the reference's dequantized weights (``weight/NAME``,
    PyTorch's ``[out, in]``) where stored weights serve: the float model the
    reference library would run."""
    floats = {}
    for info in sp.layers:
        w = ref[f"weight/{info.path.replace('/', '.')}"].T
        floats[info.param] = jnp.asarray(w.reshape(info.param_shape))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(sp.params)
    return jax.tree.unflatten(
        treedef, [floats.get(jax.tree_util.keystr(p), x) for p, x in leaves]
    )


def test_qbits_example_lm_served_from_a_compressed_tensors_checkpoint():
    # qbits' tiny LM (nnx, LinearGeneral attention) as compressed-tensors
    # quantized its PyTorch twin; logits against the same LM in float on the
    # reference's dequantized weights.
    import flax.nnx as nnx

    from qbits._experiments import TransformerLM, spec

    ckpt = qbits.interop.read_checkpoint(DATA / "ct_qbits_lm")
    ref = np.load(DATA / "ct_qbits_lm" / "reference.npz")
    lm = nnx.eval_shape(lambda: TransformerLM(10, spec("lm", "tiny"), rngs=nnx.Rngs(0)))
    fn, state = qbits.nnx.as_function(lm)
    tokens = jnp.arange(32).reshape(2, 16) % 10
    sp, config = qbits.interop.serving_params(ckpt, fn, state, tokens, names="qbits-lm")
    assert len(sp.layers) == 6 and all(i.param_shape for i in sp.layers)
    logits, _ = qbits.serving.serve(fn, config)(sp, tokens)
    want, _ = fn(_reference_params(sp, ref), tokens)
    np.testing.assert_allclose(
        np.asarray(logits), np.asarray(want), rtol=1e-4, atol=1e-5
    )


def test_reads_indexed_shards_and_names_a_tensor_missing_from_its_shard(tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(DATA / "gptq_w4g16_asym", path)
    tensors = read_tensors(path)
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "a.safetensors": names[: len(names) // 2],
        "b.safetensors": names[len(names) // 2 :],
    }
    for file, part in shards.items():
        write_tensors(path / file, {n: tensors[n] for n in part})
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    whole = qbits.interop.read_checkpoint(DATA / "gptq_w4g16_asym")
    got = qbits.interop.read_checkpoint(path)
    for m, qt in whole.weights.items():
        np.testing.assert_array_equal(got.weights[m].qvalue, qt.qvalue)
        np.testing.assert_array_equal(got.weights[m].scale, qt.scale)
    index["weight_map"]["extra.bias"] = "b.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "b.safetensors: extra.bias='missing'" in _error(path)


def test_qbits_import_lists_the_weights_or_prints_the_one_line_error(capsys):
    from qbits.cli import main

    assert main(["import", str(DATA / "gptq_w4g16_asym")]) == 0
    out = capsys.readouterr().out
    assert f"{Q_PROJ} uint4 Tiled(16) + zero points" in out and "7.000" in out
    for name, stored, bits in (
        ("bnb_nf4_dq", "NF4 (uint4 codes) Tiled(32) + 8-bit scales", "4.281   4.266"),
        ("fp8_block24x48", "float8_e4m3fn Tiled(16 x 8)", "8.250   8.062"),
        ("gptq_w4g16_actorder", "int4 Tiled(16) + input order", "7.000   6.250"),
        ("ct_nvfp4", "float4_e2m1fn Tiled(16) + E4M3 scales, tensor scale", "4.516"),
    ):
        assert main(["import", str(DATA / name)]) == 0
        line = next(s for s in capsys.readouterr().out.splitlines() if Q_PROJ in s)
        assert stored in line and line.endswith(bits), line
    assert main(["import", str(DATA / "gptq_w4g16_asym" / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err
