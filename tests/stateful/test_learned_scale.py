"""Learned step sizes (LSQ): the gradient, initialisation, ops and linen."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.hlo
from qbits import LearnedScale
from qbits._lsq import grid_max, init_step, lsq_quantize

DN = (((1,), (0,)), ((), ()))
INT4 = qbits.IntNumerics(bits=4)


def _lsq_config(init="lsq"):
    q = qbits.Quantizer(INT4, provider=LearnedScale(init))
    return qbits.DotGeneralConfig(qbits.MatmulConfig(lhs=q, rhs=q))


@pytest.mark.parametrize("numerics", [INT4, qbits.IntNumerics(bits=8)])
def test_gradients_follow_the_lsq_formula(numerics):
    x = jax.random.normal(jax.random.key(0), (64,)) * 2.0
    g = jax.random.normal(jax.random.key(1), (64,))
    step = jnp.float32(0.11)
    qp = grid_max(numerics)
    assert qp == {4: 7.0, 8: 127.0}[numerics.bits]
    dx, ds = jax.grad(
        lambda x, s: jnp.sum(lsq_quantize(numerics, x, s) * g), argnums=(0, 1)
    )(x, step)
    v = np.asarray(x / step, np.float64)
    q = np.clip(np.round(v), -qp, qp)
    inside = (v > -qp) & (v < qp)
    # Esser et al., eq. 3: round(v) - v inside, -Qn / Qp outside; g = 1/sqrt(N Qp)
    dxhat_ds = np.where(inside, q - v, np.where(v <= -qp, -qp, qp))
    expected = np.sum(np.asarray(g) * dxhat_ds) / math.sqrt(x.size * qp)
    np.testing.assert_allclose(ds, expected, rtol=1e-4)
    np.testing.assert_array_equal(dx, np.where(inside, g, 0.0))
    # The forward is the grid value times the step.
    np.testing.assert_allclose(lsq_quantize(numerics, x, step), q * 0.11, rtol=1e-6)


def test_initialisation_and_bad_settings():
    x = jnp.array([1.0, -3.0, 0.5, 0.0])
    np.testing.assert_allclose(init_step(x, INT4), 2 * 1.125 / math.sqrt(7.0))
    np.testing.assert_allclose(
        init_step(x, INT4, "absmax"), 3.0 / INT4.abs_val_mapped_to()
    )
    assert init_step(jnp.zeros(3), INT4) == 1.0
    with pytest.raises(qbits.InvalidArgumentError, match="LearnedScale: init="):
        LearnedScale("mean")
    noisy = qbits.IntNumerics(bits=4, noise_fn=qbits.numerics.UniformNoise())
    with pytest.raises(qbits.InvalidArgumentError, match="LearnedScale: numerics="):
        grid_max(noisy)
    q = qbits.Quantizer(INT4, provider=LearnedScale())
    with pytest.raises(qbits.InvalidArgumentError, match=r"dlhs\.lhs"):
        qbits.dot_general(qbits.DotGeneralConfig(dlhs=qbits.MatmulConfig(lhs=q)))
    dg = qbits.dot_general(_lsq_config())
    with pytest.raises(qbits.InvalidArgumentError, match="state=None"):
        dg(jnp.ones((2, 3)), jnp.ones((3, 4)), DN)
    cfg = _lsq_config("absmax")
    assert qbits.load_config(qbits.config.dump(cfg), None) == cfg


def test_learned_steps_run_real_int_dots_and_train():
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (32, 16))
    w_true = jax.random.normal(k[1], (16, 4))
    y = x @ w_true
    dg = qbits.dot_general(_lsq_config())
    w = jax.random.normal(k[2], (16, 4)) * 0.1
    steps = dg.init_state(x, w, DN)
    assert sorted(steps) == ["lhs_step", "rhs_step"]
    out = dg(x, w, DN, state=steps)
    expected = lsq_quantize(INT4, x, steps["lhs_step"]) @ lsq_quantize(
        INT4, w, steps["rhs_step"]
    )
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    # Real mode: the forward dot runs on the stored integers.
    dtypes = qbits.hlo.dot_dtypes(
        lambda x, w: dg(x, w, DN, state=steps), x, w, stage="jaxpr"
    )
    assert dtypes[0] == ("int8", "int8", "int32")

    def loss(params):
        return jnp.mean((dg(x, params["w"], DN, state=params["steps"]) - y) ** 2)

    params = {"w": w, "steps": steps}
    first = loss(params)

    @jax.jit
    def update(params):
        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)

    for _ in range(40):
        params = update(params)
    assert loss(params) < 0.5 * first
    assert params["steps"]["rhs_step"] != steps["rhs_step"]


def test_linen_rule_puts_steps_in_params():
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="fc")(x)

    model = qbits.flax.quantize(Mlp(), _lsq_config())
    x = jax.random.normal(jax.random.key(0), (8, 16))
    v = model.init(jax.random.key(1), x)
    steps = v["params"][qbits.flax.LEARNED]["fc"]  # trained: parameters
    np.testing.assert_allclose(steps["lhs_step"], init_step(x, INT4), rtol=1e-6)
    assert qbits.flax.STATE not in v  # no delayed state
    grads = jax.jit(jax.grad(lambda v: (model.apply(v, x) ** 2).sum()))(v)
    assert grads["params"][qbits.flax.LEARNED]["fc"]["rhs_step"] != 0


def test_nnx_steps_are_params_initialised_from_a_batch_and_trained():
    import flax.nnx as nnx

    x = jax.random.normal(jax.random.key(0), (8, 16))
    linear = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    model = qbits.nnx.quantize(linear, _lsq_config(), x)  # steps from the batch
    steps = model.qbits.state["kernel"]
    assert isinstance(steps["lhs_step"], nnx.Param)  # trained by the optimizer
    np.testing.assert_allclose(steps["lhs_step"][...], init_step(x, INT4), rtol=1e-6)
    grads = nnx.jit(nnx.grad(lambda m: (m(x) ** 2).sum()))(model)
    assert grads["qbits"]["state"]["kernel"]["rhs_step"][...] != 0
    with pytest.raises(qbits.InvalidArgumentError, match="sample batch"):
        qbits.nnx.quantize(linear, _lsq_config())
