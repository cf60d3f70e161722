"""Serving the PTQ formats: zero points, NF4 codes, NVFP4's two-level scales."""

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.serving as serving

# preset: (stored values, the arrays beside them, bytes of a [K, N] weight)
FORMATS = {
    "w4g128_asym": ("uint8", {"zero_point": "int16"}, lambda k, n: k * n // 2 + k * n // 128 * 6),
    "w4g128_asym_mse": ("uint8", {"zero_point": "int16"}, lambda k, n: k * n // 2 + k * n // 128 * 6),
    "w8_asym": ("uint8", {"zero_point": "int16"}, lambda k, n: k * n + n * 6),
    "nf4": ("uint8", {}, lambda k, n: k * n // 2 + k * n // 64 * 4),
    "nvfp4": ("uint8", {"tensor_scale": "float32"}, lambda k, n: k * n // 2 + k * n // 16 + 4),
    "nvfp4_weight_only": ("uint8", {"tensor_scale": "float32"}, lambda k, n: k * n // 2 + k * n // 16 + 4),
}  # fmt: skip


def mlp(params, x):
    return jax.nn.relu(x @ params["w1"]) @ params["w2"]


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(32, name="fc2")(nn.relu(nn.Dense(128, name="fc1")(x)))


@pytest.fixture(scope="module")
def setup():
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k[0], (256, 128)) * 0.05 + 0.02,  # shifted
        "w2": jax.random.normal(k[1], (128, 32)) * 0.05,
    }
    return params, jax.random.normal(k[2], (4, 256))


@pytest.mark.parametrize("name", FORMATS)
def test_serving_equals_qat_forward_bit_for_bit_and_counts_bytes(setup, name):
    params, x = setup
    values, extra, nbytes = FORMATS[name]
    linen = name in ("w8_asym", "nvfp4_weight_only")  # a linen model for some
    if linen:
        model = Mlp()
        params = model.init(jax.random.key(1), x)
        fn, paths = model.apply, ["fc1", "fc2"]
    else:
        fn, paths = mlp, ["w1", "w2"]
    sp = serving.convert(model if linen else fn, name, params, x)
    assert [info.path for info in sp.layers] == paths
    for path in paths:
        arrays = sp.weights[path]
        assert set(arrays) == {"qvalue", "scale", *extra}
        assert arrays["qvalue"].dtype == np.dtype(values)
        assert all(arrays[k].dtype == np.dtype(d) for k, d in extra.items())
    served_fn = serving.serve(model, name).apply if linen else serving.serve(fn, name)
    served = jax.jit(served_fn)(sp, x)
    qat = jax.jit(qbits.quantize(fn, name))(params, x)
    np.testing.assert_array_equal(served, qat)
    assert not np.array_equal(served, fn(params, x))  # really quantized
    report = serving.size_report(sp)
    shapes = [(256, 128), (128, 32)]
    assert [r.bytes for r in report.layers] == [nbytes(*s) for s in shapes]
    if name != "w8_asym":  # 4.5 (NF4, NVFP4) or 4.375 bits a weight (asym)
        assert report.ratio <= 0.1407


def test_checkpoint_keeps_zero_points_and_tensor_scales(tmp_path, setup):
    params, x = setup
    config = qbits.QuantConfig(
        rules=(qbits.Rule("w1", "w4g128_asym"),), default="nvfp4_weight_only"
    )
    sp = serving.convert(mlp, config, params, x)
    serving.save(tmp_path / "ckpt", sp)
    back = serving.restore(tmp_path / "ckpt", jax.eval_shape(lambda: sp))
    assert set(back.weights["w1"]) == {"qvalue", "scale", "zero_point"}
    assert set(back.weights["w2"]) == {"qvalue", "scale", "tensor_scale"}
    run = jax.jit(serving.serve(mlp, config))
    np.testing.assert_array_equal(run(back, x), run(sp, x))


def test_missing_or_other_arrays_and_nnx_are_refused(setup):
    params, x = setup
    sp = serving.convert(mlp, "nf4", params, x)
    dropped = sp.replace(weights={**sp.weights, "w1": {**sp.weights["w1"]}})
    dropped.weights["w1"]["zero_point"] = jnp.zeros((2, 128), jnp.int16)
    with pytest.raises(qbits.InvalidArgumentError, match=r"'qvalue': array, 'scale'"):
        serving.serve(mlp, "nf4")(dropped, x)
    model = nnx.Linear(64, 8, rngs=nnx.Rngs(0))
    with pytest.raises(qbits.InvalidArgumentError, match="as_function"):
        serving.convert(model, "nf4", jnp.ones((2, 64)))
