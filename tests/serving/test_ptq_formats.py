"""Serving the PTQ formats: zero points, NF4 codes, NVFP4's two-level scales.

Each model mixes two formats (one rule per layer), so that two models
cover the four presets.
"""

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.serving as serving


def asym4(k, n):  # packed codes, a float32 scale and an int16 zero per 128
    return k * n // 2 + k * n // 128 * 6


def nf4(k, n):  # packed codes, a float32 absmax per 64
    return k * n // 2 + k * n // 64 * 4


def nvfp4(k, n):  # packed codes, an e4m3 scale per 16, one float32
    return k * n // 2 + k * n // 16 + 4


# preset: (the arrays beside values and scales, bytes of a [K, N] weight)
FORMATS = {
    "w4g128_asym": ({"zero_point": "int16"}, asym4),
    "nf4": ({}, nf4),
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
    presets = ("w4g128_asym", "nf4")
    config = _rules(presets)
    sp = serving.convert(mlp, config, params, x)
    served = _check(sp, presets, mlp, params, x, serving.serve(mlp, config))
    serving.save(tmp_path / "ckpt", sp)  # zero points survive a checkpoint
    back = serving.restore(tmp_path / "ckpt", jax.eval_shape(lambda: sp))
    assert set(back.weights["w1"]) == {"qvalue", "scale", "zero_point"}
    np.testing.assert_array_equal(served(back, x), served(sp, x))


def test_a_linen_model_serves_bit_for_bit(setup):
    _, x = setup
    model, presets = Mlp(), ("nvfp4", "nvfp4_weight_only")
    params = model.init(jax.random.key(1), x)
    config = _rules(presets)
    sp = serving.convert(model, config, params, x)
    _check(sp, presets, model.apply, params, x, serving.serve(model, config).apply)


def test_missing_arrays_and_nnx_are_refused(setup):
    params, x = setup
    sp = serving.convert(mlp, "nvfp4_weight_only", params, x)
    weights = {**sp.weights, "w1": dict(sp.weights["w1"])}
    del weights["w1"]["tensor_scale"]
    with pytest.raises(qbits.InvalidArgumentError, match=r"'tensor_scale': array"):
        serving.serve(mlp, "nvfp4_weight_only")(sp.replace(weights=weights), x)
    model = nnx.Linear(64, 8, rngs=nnx.Rngs(0))
    with pytest.raises(qbits.InvalidArgumentError, match="as_function"):
        serving.convert(model, "nf4", jnp.ones((2, 64)))
