"""The engine's stored weights and qbits.quantize(..., stored=): serving."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qbits
from qbits import transform


def _store(*args, **kwargs):
    """The engine's stored weights (what qbits.serving.convert stores)."""
    return transform._store_weights(transform._Caller(), *args, **kwargs)


def _params():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "w_in": jax.random.normal(k[0], (16, 32)),
        "w_left": jax.random.normal(k[1], (8, 32)),  # multiplied from the left
        "w_t": jax.random.normal(k[2], (4, 8)),  # transposed before use
        "shift": jax.random.normal(k[3], (16, 32)),  # also added: kept float
    }


def _fn(params, x):
    h = jax.nn.relu(x @ params["w_in"])  # [b, 32]
    h = lax.dot_general(params["w_left"], h, (((1,), (1,)), ((), ())))  # [8, b]
    h = h.T @ params["w_t"].T  # [b, 4]
    return h.sum() + (x @ params["shift"]).sum() + params["shift"].sum()


@pytest.mark.parametrize("preset", ["int8_fwd", "w4a8", "fp8"])
def test_stored_weights_serve_the_quantized_forward_bit_for_bit(preset):
    params, x = _params(), jax.random.normal(jax.random.key(1), (3, 16))
    stored = _store(_fn, preset, params, x)
    assert sorted(stored) == ["shift", "w_in", "w_left", "w_t"]
    # The weight on the left is stored as the rhs it becomes; the transposed
    # one in the layout its matmul sees.
    assert stored["w_left"].contracting == (1,)
    assert stored["w_t"].weight.shape == (8, 4)
    assert stored["w_t"].shape == (4, 8) and stored["w_t"].contracting == (0,)
    assert [s.exclusive for s in stored.values()].count(False) == 1
    assert not stored["shift"].exclusive  # the sum reads it too
    weights = {n: s.weight for n, s in stored.items()}
    served = jax.jit(qbits.quantize(_fn, preset, stored=weights))
    # The float parameters a stored matmul replaces are not read.
    zeros = {
        n: jnp.zeros_like(p) if stored[n].exclusive else p for n, p in params.items()
    }
    qat = jax.jit(qbits.quantize(_fn, preset))(params, x)
    np.testing.assert_array_equal(served(zeros, x), qat)


def test_sample_inputs_may_be_shapes():
    params = _params()
    spec = jax.ShapeDtypeStruct((3, 16), jnp.float32)
    by_spec = _store(_fn, "int8_fwd", params, spec)
    by_value = _store(_fn, "int8_fwd", params, jnp.ones((3, 16)))
    for name, s in by_spec.items():
        np.testing.assert_array_equal(s.weight.qvalue, by_value[name].weight.qvalue)


def test_stateful_and_stochastic_forward_configs_are_refused():
    params, x = _params(), jnp.ones((3, 16))
    with pytest.raises(qbits.ConfigError, match="takes its scales from state"):
        _store(_fn, "fp8_delayed", params, x)
    noisy = qbits.Quantizer(
        qbits.IntNumerics(bits=8, noise_fn=qbits.numerics.UniformNoise())
    )
    config = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(lhs=noisy, rhs=noisy))
    with pytest.raises(qbits.ConfigError, match="rounds stochastically"):
        _store(_fn, config, params, x)


def test_missing_or_extra_stored_weights_are_named():
    params, x = _params(), jnp.ones((3, 16))
    stored = _store(_fn, "int8_fwd", params, x)
    weights = {n: s.weight for n, s in stored.items()}
    fewer = {n: w for n, w in weights.items() if n != "w_t"}
    with pytest.raises(qbits.InvalidArgumentError, match=r"missing \['w_t'\]"):
        qbits.quantize(_fn, "int8_fwd", stored=fewer)(params, x)
    rules = qbits.QuantConfig(rules=(qbits.Rule("w_t", None),), default="int8_fwd")
    with pytest.raises(qbits.InvalidArgumentError, match=r"with \['w_t'\] extra"):
        qbits.quantize(_fn, rules, stored=weights)(params, x)


def test_weights_inside_cond_and_while_are_quantized_on_the_fly():
    params, x = _params(), jax.random.normal(jax.random.key(1), (3, 16))

    def fn(params, x):
        h = jax.lax.cond(
            x.sum() > 0, lambda: x @ params["w_in"], lambda: x @ params["shift"]
        )
        return jax.lax.fori_loop(
            0, 2, lambda i, h: jnp.tanh(h @ params["w_left"].T @ params["w_left"]), h
        )

    stored = _store(fn, "int8_fwd", params, x)
    # fori_loop with a static trip count is a scan: its weight is stored
    # once (the same every iteration); the cond's are quantized on the fly.
    assert sorted(stored) == ["w_left", "w_left#2"]
    weights = {n: s.weight for n, s in stored.items()}
    # Used twice per iteration (transposed, then not): two stored weights,
    # neither stacked along the loop.
    assert sorted(w.shape for w in weights.values()) == [(8, 32), (32, 8)]
    served = qbits.quantize(fn, "int8_fwd", stored=weights)
    np.testing.assert_array_equal(
        jax.jit(served)(params, x), jax.jit(qbits.quantize(fn, "int8_fwd"))(params, x)
    )


def test_stored_weights_are_checked_against_their_matmul_and_config():
    params, x = _params(), jnp.ones((3, 16))
    stored = _store(_fn, "int8_fwd", params, x)
    # What the engine stores goes in as it is.
    jax.eval_shape(qbits.quantize(_fn, "int8_fwd", stored=stored), params, x)
    # int8 weights served under w4a8 (int4 packed): refused, not misread.
    with pytest.raises(qbits.InvalidArgumentError, match=r"stored\['w_in'\]=.*int8"):
        qbits.quantize(_fn, "w4a8", stored=stored)(params, x)
    # A weight of another shape (another model): refused, naming its shape.
    other = _store(_fn, "int8_fwd", {**params, "w_t": jnp.ones((2, 8))}, x)
    with pytest.raises(qbits.InvalidArgumentError, match=r"stored\['w_t'\]=.*\[8, 2\]"):
        qbits.quantize(_fn, "int8_fwd", stored={**stored, "w_t": other["w_t"]})(
            params, x
        )
    with pytest.raises(qbits.InvalidArgumentError, match="stored="):
        qbits.quantize(_fn, "int8_fwd", stored=[1, 2])


@pytest.mark.optimized  # float4 casts: XLA's default CPU emitters
def test_a_stored_weight_missing_its_zero_point_or_tensor_scale_is_refused():
    params, x = (
        {"w": jax.random.normal(jax.random.key(0), (128, 8))},
        jnp.ones((2, 128)),
    )

    def fn(params, x):
        return x @ params["w"]

    for preset, part in (
        ("w4g128_asym", "zero_point"),
        ("nvfp4_weight_only", "tensor_scale"),
    ):
        stored = _store(fn, preset, params, x)
        qt = stored["w"].weight
        assert getattr(qt, part) is not None
        bare = {"w": qt.replace(**{part: None})}
        with pytest.raises(qbits.InvalidArgumentError, match=part.replace("_", " ")):
            qbits.quantize(fn, preset, stored=bare)(params, x)
