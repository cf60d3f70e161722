"""Serving the PTQ formats: zero points, NF4 codes, NVFP4's two-level scales.

Each model mixes two formats (one rule per layer), so that two models
cover four presets (nf4_dq: NF4's double-quantized scales); an nnx
serving copy holds the extra arrays too.
"""

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.serving as serving

# The module fixtures run once: these tests share one worker.
pytestmark = pytest.mark.xdist_group("serving_ptq")


def asym4(k, n):  # packed codes, a float32 scale and an int16 zero per 128
    return k * n // 2 + k * n // 128 * 6


def nf4(k, n):  # packed codes, a float32 absmax per 64
    return k * n // 2 + k * n // 64 * 4


def nf4_dq(k, n):  # packed codes, a byte per 64, a float32 per 256 of those, one
    return k * n // 2 + k * n // 64 + -(-k * n // 64 // 256) * 4 + 4


def nvfp4(k, n):  # packed codes, an e4m3 scale per 16, one float32
    return k * n // 2 + k * n // 16 + 4


# preset: (the arrays beside values and scales, bytes of a [K, N] weight)
FORMATS = {
    "w4g128_asym": ({"zero_point": "int16"}, asym4),
    "nf4": ({}, nf4),
    "nf4_dq": ({"scale_absmax": "float32", "scale_offset": "float32"}, nf4_dq),
    "nvfp4": ({"tensor_scale": "float32"}, nvfp4),
    "nvfp4_weight_only": ({"tensor_scale": "float32"}, nvfp4),
}
SHAPES = [(256, 128), (128, 32)]


def mlp(params, x):
    return jax.nn.relu(x @ params["w1"]) @ params["w2"]


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="w2")(nn.relu(nn.Dense(128, name="w1")(x)))


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    params = {  # w1 shifted away from zero
        "w1": (rng.standard_normal((256, 128)) * 0.05 + 0.02).astype(np.float32),
        "w2": (rng.standard_normal((128, 32)) * 0.05).astype(np.float32),
    }
    return params, rng.standard_normal((4, 256)).astype(np.float32)


def _check(sp, presets, fn, params, x, served_fn):
    assert [info.path for info in sp.layers] == ["w1", "w2"]
    for path, name, shape in zip(["w1", "w2"], presets, SHAPES, strict=True):
        extra, nbytes = FORMATS[name]
        arrays = sp.weights[path]
        assert set(arrays) == {"qvalue", "scale", *extra}
        assert arrays["qvalue"].dtype == np.uint8  # packed 4-bit codes
        assert all(arrays[k].dtype == np.dtype(d) for k, d in extra.items())
        assert sp.layer(path).describe() == name
        assert serving.size_report(sp).layers[int(path[1]) - 1].bytes == nbytes(*shape)
    assert serving.size_report(sp).ratio <= 0.1407  # 4.5 or 4.375 bits a weight
    served = jax.jit(served_fn)
    out = served(sp, x)
    np.testing.assert_array_equal(
        out, jax.jit(qbits.quantize(fn, _rules(presets)))(params, x)
    )
    assert not np.array_equal(out, fn(params, x))  # really quantized
    return served


def _rules(presets):
    return qbits.QuantConfig(rules=(qbits.Rule("w1", presets[0]),), default=presets[1])


def test_a_function_serves_bit_for_bit_and_checkpoints(tmp_path, setup):
    params, x = setup
    presets = ("w4g128_asym", "nf4_dq")
    config = _rules(presets)
    sp = serving.convert(mlp, config, params, x)
    served = _check(sp, presets, mlp, params, x, serving.serve(mlp, config))
    assert sp.weights["w2"]["scale"].dtype == np.uint8  # double-quantized
    serving.save(tmp_path / "ckpt", sp)  # zero points survive a checkpoint
    back = serving.restore(tmp_path / "ckpt", jax.eval_shape(lambda: sp))
    assert set(back.weights["w1"]) == {"qvalue", "scale", "zero_point"}
    assert set(back.weights["w2"]) == {"qvalue", "scale", *FORMATS["nf4_dq"][0]}
    np.testing.assert_array_equal(served(back, x), served(sp, x))
    w2 = {**sp.weights["w2"], "scale_absmax": jnp.ones((3,))}  # 64 scales: 1 block
    with pytest.raises(qbits.InvalidArgumentError, match="w2/scale_absmax"):
        served(sp.replace(weights={**sp.weights, "w2": w2}), x)


@pytest.mark.optimized  # float4 casts: XLA's default CPU emitters
def test_a_linen_model_serves_bit_for_bit(setup):
    _, x = setup
    model, presets = Mlp(), ("nvfp4", "nvfp4_weight_only")
    params = model.init(jax.random.key(1), x)
    config = _rules(presets)
    sp = serving.convert(model, config, params, x)
    _check(sp, presets, model.apply, params, x, serving.serve(model, config).apply)


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        rng = np.random.default_rng(2)  # NumPy draws: nothing to compile

        def init(key, shape, dtype):
            return jnp.asarray(rng.standard_normal(shape) * 0.05, dtype)

        self.w1 = nnx.Linear(256, 128, kernel_init=init, rngs=rngs)
        self.w2 = nnx.Linear(128, 128, kernel_init=init, rngs=rngs)
        self.w3 = nnx.Linear(128, 32, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return self.w3(nnx.relu(self.w2(nnx.relu(self.w1(x)))))


UINT8 = qbits.DotGeneralConfig(  # zero points, one per output channel, unpacked
    fwd=qbits.MatmulConfig(
        rhs=qbits.Quantizer(
            qbits.numerics.UintNumerics(bits=8), granularity=qbits.PerChannel()
        )
    )
)


@pytest.mark.optimized  # float4 casts: XLA's default CPU emitters
def test_an_nnx_copy_serves_bit_for_bit_and_checkpoints(tmp_path, setup):
    _, x = setup
    config = qbits.QuantConfig(
        rules=(qbits.Rule("w1", UINT8), qbits.Rule("w2", "nf4")),
        default="nvfp4_weight_only",
    )
    model = NnxMlp(nnx.Rngs(0))
    served = serving.convert(model, config, x)
    stored = served.qbits.stored
    assert {k: sorted(v) for k, v in stored.items()} == {
        "w1": ["qvalue", "scale", "zero_point"],
        "w2": ["qvalue", "scale"],
        "w3": ["qvalue", "scale", "tensor_scale"],
    }
    assert stored["w1"]["qvalue"][...].dtype == np.uint8  # uint8 codes, unpacked
    assert stored["w1"]["zero_point"][...].dtype == np.int16
    assert stored["w2"]["qvalue"][...].shape == (128, 64)  # packed NF4 codes
    assert stored["w3"]["scale"][...].dtype == jnp.float8_e4m3fn
    sizes = [(r.path, r.bytes) for r in serving.size_report(served).layers]
    assert sizes == [("w1", 256 * 128 + 128 * 6), ("w2", nf4(128, 128)),
                     ("w3", nvfp4(128, 32))]  # fmt: skip
    run = nnx.jit(lambda m, x: m(x))
    out = run(served, x)
    np.testing.assert_array_equal(out, run(qbits.nnx.quantize(model, config, x), x))
    assert not np.array_equal(out, run(model, x))
    serving.save(tmp_path / "ckpt", served)  # the extra arrays round-trip
    target = nnx.clone(served)
    zeros = jax.tree.map(jnp.zeros_like, nnx.state(target, qbits.nnx.StoredWeight))
    nnx.update(target, zeros)
    back = serving.restore(tmp_path / "ckpt", target).qbits.stored
    for path, arrays in stored.items():
        for name, v in arrays.items():
            np.testing.assert_array_equal(back[path][name][...], v[...])


@pytest.mark.optimized  # float4 casts: XLA's default CPU emitters
def test_missing_arrays_are_refused(setup):
    params, x = setup
    sp = serving.convert(mlp, "nvfp4_weight_only", params, x)
    weights = {**sp.weights, "w1": dict(sp.weights["w1"])}
    del weights["w1"]["tensor_scale"]
    with pytest.raises(qbits.InvalidArgumentError, match=r"'tensor_scale': array"):
        serving.serve(mlp, "nvfp4_weight_only")(sp.replace(weights=weights), x)


@pytest.mark.optimized  # float4 casts (run in this module's optimized process)
def test_a_compressed_tensors_nvfp4_checkpoint_serves_on_its_codes_and_scales():
    # qbits.interop's NVFP4 read (tests/interop): compressed-tensors' codes,
    # E4M3 scales and 1 / global scale served, against its float32 weights.
    import pathlib

    import ml_dtypes

    import qbits.interop

    data = pathlib.Path(__file__).parents[1] / "data" / "quantized" / "ct_nvfp4"
    ckpt = qbits.interop.read_checkpoint(data)
    ref = np.load(data / "reference.npz")
    q, o = (f"model.layers.0.self_attn.{n}_proj" for n in ("q", "o"))

    def fn(p, x):
        return (x @ p["q"]) @ p["o"]

    only = qbits.interop.Checkpoint(
        ckpt.format, ckpt.weights, ckpt.quantizers, {}, ckpt.quantization_config
    )
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in
              (("q", (64, 32)), ("o", (32, 32)))}  # fmt: skip
    names = [(r".*\.(q|o)_proj\.weight", r"\1")]
    x = jnp.asarray(ref["x"][:, :64])
    sp, config = qbits.interop.serving_params(only, fn, params, x, names=names)
    assert sp.weights["q"]["qvalue"].dtype == np.uint8  # E2M1 codes, two a byte
    assert sp.weights["q"]["scale"].dtype == ml_dtypes.float8_e4m3fn
    assert sp.weights["q"]["tensor_scale"].shape == (1, 1)
    got = serving.serve(fn, config)(sp, x)
    want = ref["x"][:, :64] @ ref[f"weight32/{q}"].T @ ref[f"weight32/{o}"].T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.optimized  # float4 casts (run in this module's optimized process)
def test_nvfp4_checkpoint_inputs_are_quantized_under_its_global_scale():
    # compressed-tensors' NVFP4 (W4A4, tests/interop/test_inputs.py): E2M1 in
    # groups of 16, E4M3 scales as the inputs come, under the static
    # input_global_scale G; against compressed-tensors' own forward
    from qbits.interop._safetensors import read_tensors
    from tests.interop.test_inputs import DATA, Q_PROJ, _read_quietly, _served_q

    ckpt = _read_quietly(DATA / "ct_nvfp4_w4a4")
    inputs = ckpt.activations[Q_PROJ]
    gs = read_tensors(DATA / "ct_nvfp4_w4a4")[f"{Q_PROJ}.input_global_scale"][0]
    assert inputs.scale_rounding == "e4m3" and inputs.granularity.tile_size == 16
    assert inputs.tensor_amax == np.float32(448 * 6) / gs
    ref = np.load(DATA / "ct_nvfp4_w4a4" / "reference.npz")
    q = _served_q(ckpt, jnp.asarray(ref["x"][:, :64]))
    np.testing.assert_allclose(q, ref[f"yq/{Q_PROJ}"], rtol=1e-5, atol=1e-6)
    assert np.abs(q - ref[f"y/{Q_PROJ}"]).max() > 5e-2  # float inputs: 10% off
