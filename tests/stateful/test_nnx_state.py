"""Scale state in nnx models: ScaleState Variables, update_state."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import qbits
from qbits.nnx import ScaleState

WRT = nnx.DiffState(0, (nnx.Param, ScaleState))


def _model():
    return nnx.Sequential(
        nnx.Linear(16, 32, rngs=nnx.Rngs(0)),
        nnx.relu,
        nnx.Linear(32, 4, rngs=nnx.Rngs(1)),
    )


def test_training_writes_new_state_and_optimizer_skips_it():
    rules = qbits.QuantConfig(
        rules=[qbits.Rule("layers/2", None)], default="fp8_delayed"
    )
    x = jax.random.normal(jax.random.key(0), (8, 16))
    y = jax.random.normal(jax.random.key(1), (8, 4))
    model = qbits.nnx.quantize(_model(), rules, x)
    assert list(model.qbits.state) == ["layers/0"]  # the float layer holds none
    dot = model.qbits.state["layers/0"]
    assert dot["lhs_amax_history"][...].shape == (1024,)
    opt = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        def loss(m):
            return jnp.mean((m(x) - y) ** 2)

        grads = nnx.grad(loss, argnums=WRT)(model)
        opt.update(model, qbits.nnx.update_state(model, grads))

    kernel = model.layers[0].kernel[...]
    step(model, opt, x, y)
    assert dot["lhs_amax_history"][0] == jnp.max(jnp.abs(x))
    assert dot["lhs_scale"][0] == 1.0 and dot["grad_amax_history"][0] > 0
    assert not np.array_equal(model.layers[0].kernel[...], kernel)
    step(model, opt, x, y)
    np.testing.assert_allclose(
        dot["lhs_scale"][...], jnp.max(jnp.abs(x)) / 448, rtol=1e-6
    )
    assert not nnx.state(_model(), ScaleState)  # the float model holds none


def test_same_numbers_as_linen_and_the_functional_op():
    x = jax.random.normal(jax.random.key(0), (8, 16))
    model = qbits.nnx.quantize(nnx.Linear(16, 4, rngs=nnx.Rngs(0)), "fp8_delayed", x)
    grads = nnx.jit(nnx.grad(lambda m: (m(x) ** 2).sum(), argnums=WRT))(model)
    op = qbits.dot_general("fp8_delayed")
    kernel = model.kernel[...]
    dn = (((1,), (0,)), ((), ()))
    ref = jax.jit(jax.grad(lambda s: (op(x, kernel, dn, state=s) ** 2).sum()))(
        op.init_state(x, kernel, dn)
    )
    got = grads["qbits"]["state"]["kernel"]
    for k, v in ref.items():
        np.testing.assert_array_equal(got[k][...], v, err_msg=k)
