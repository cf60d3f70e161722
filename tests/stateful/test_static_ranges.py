"""Static ranges: collect activation ranges over batches, freeze, use."""

import dataclasses

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits import freeze_ranges

DN = (((1,), (0,)), ((), ()))


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="fc1")(x))
        return nn.Dense(4, name="head")(x)


def _batches():
    keys = jax.random.split(jax.random.key(0), 3)
    return [
        jax.random.normal(k, (8, 16)) * s
        for k, s in zip(keys, (1.0, 4.0, 2.0), strict=True)
    ]


def _frozen_dense(cfg, bound, x, kernel, bias):
    lhs = dataclasses.replace(cfg.fwd.lhs, calibration=qbits.ConstantBound(bound))
    frozen = dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, lhs=lhs))
    return qbits.dot_general(frozen)(x, kernel, DN) + bias


def test_linen_ranges_are_the_max_over_batches_and_freeze_into_the_forward():
    batches = _batches()
    model = Mlp()
    v = model.init(jax.random.key(1), batches[0])
    ranges = qbits.collect_ranges(model.apply, v, batches)
    assert ranges["fc1"] == max(float(jnp.max(jnp.abs(b))) for b in batches)
    hidden = [
        nn.relu(nn.Dense(32).apply({"params": v["params"]["fc1"]}, b)) for b in batches
    ]
    np.testing.assert_allclose(
        ranges["head"], max(float(jnp.max(h)) for h in hidden), rtol=1e-6
    )
    rules = qbits.QuantConfig(rules=[qbits.Rule("head", None)], default="int8_fwd")
    frozen = freeze_ranges(rules, ranges)
    assert frozen.resolve("fc1").config.fwd.lhs.calibration == qbits.ConstantBound(
        ranges["fc1"]
    )
    assert frozen.resolve("head").config is None
    # Serialisable: the ranges are in the YAML.
    assert qbits.load_config(qbits.config.dump(frozen), None) == frozen
    # The forward uses the frozen bound, not the batch's own absmax.
    x = batches[0] * 10.0  # beyond the calibrated range: clips
    y = qbits.flax.quantize(model, frozen).apply(v, x)
    p = v["params"]["fc1"]
    h = nn.relu(
        _frozen_dense(
            qbits.presets.get("int8_fwd"), ranges["fc1"], x, p["kernel"], p["bias"]
        )
    )
    expected = nn.Dense(4).apply({"params": v["params"]["head"]}, h)
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
    dynamic = qbits.flax.quantize(model, rules).apply(v, x)
    assert not np.allclose(dynamic, y, atol=1e-3)


def test_nnx_ranges_and_frozen_forward():
    batches = _batches()
    model = nnx.Sequential(nnx.Linear(16, 8, rngs=nnx.Rngs(0)))
    ranges = qbits.collect_ranges(*qbits.nnx.as_function(model), batches)
    assert ranges == {"layers/0": max(float(jnp.max(jnp.abs(b))) for b in batches)}
    frozen = freeze_ranges("int8_fwd", ranges)
    qmodel = qbits.nnx.quantize(model, frozen)
    x = batches[1] * 3.0
    lin = model.layers[0]
    expected = _frozen_dense(
        qbits.presets.get("int8_fwd"),
        ranges["layers/0"],
        x,
        lin.kernel[...],
        lin.bias[...],
    )
    np.testing.assert_allclose(qmodel(x), expected, rtol=1e-6, atol=1e-6)


def test_bad_ranges_and_no_batches_raise():
    with pytest.raises(qbits.InvalidArgumentError, match=r"ranges\['fc1'\]"):
        freeze_ranges("int8_fwd", {"fc1": 0.0})
    with pytest.raises(qbits.InvalidArgumentError, match=r"ranges\['fc1'\]"):
        freeze_ranges("int8_fwd", {"fc1": float("nan")})
    model = nn.Dense(2)
    v = model.init(jax.random.key(0), jnp.ones((1, 2)))
    with pytest.raises(qbits.InvalidArgumentError, match="batches"):
        qbits.collect_ranges(model.apply, v, [])
