"""qbits.dot_general inside Flax layers: linen and nnx."""

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import qbits
from qbits import DotGeneralConfig, IntNumerics, MatmulConfig, Quantizer

INT8 = Quantizer(IntNumerics(bits=8), granularity=qbits.PerChannel())
MM = MatmulConfig(lhs=INT8, rhs=INT8)
CONFIG = DotGeneralConfig(MM, MM, MM)
DN = (((1,), (0,)), ((), ()))


def test_linen_dense_dot_general():
    dg = qbits.dot_general(CONFIG)
    x = jax.random.normal(jax.random.key(0), (4, 8))
    layer = nn.Dense(6, dot_general=dg)
    params = layer.init(jax.random.key(1), x)
    y = jax.jit(layer.apply)(params, x)
    p = params["params"]
    np.testing.assert_array_equal(
        y, jax.jit(dg, static_argnums=2)(x, p["kernel"], DN) + p["bias"]
    )
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply(p, x) ** 2)))(params)
    assert grads["params"]["kernel"].shape == (8, 6)


def test_linen_dense_dot_general_cls():
    x = jax.random.normal(jax.random.key(0), (4, 8))
    with_fn = nn.Dense(6, dot_general=qbits.dot_general(CONFIG))
    with_cls = nn.Dense(6, dot_general_cls=lambda: qbits.dot_general(CONFIG))
    params = with_fn.init(jax.random.key(1), x)
    np.testing.assert_array_equal(with_cls.apply(params, x), with_fn.apply(params, x))


def test_linen_dense_general():
    dg = qbits.dot_general(CONFIG)
    x = jax.random.normal(jax.random.key(0), (2, 3, 4, 5))
    layer = nn.DenseGeneral(features=(6, 7), axis=(-2, -1), dot_general=dg)
    params = layer.init(jax.random.key(1), x)
    y = jax.jit(layer.apply)(params, x)
    ref = nn.DenseGeneral(features=(6, 7), axis=(-2, -1)).apply(params, x)
    assert y.shape == (2, 3, 6, 7)
    np.testing.assert_allclose(y, ref, rtol=0.05, atol=0.1)
    jax.jit(jax.grad(lambda p: jnp.sum(layer.apply(p, x) ** 2)))(params)


def test_nnx_linear_passes_out_sharding_and_trains():
    dg = qbits.dot_general(CONFIG)
    model = nnx.Linear(8, 6, dot_general=dg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (16, 8))
    y_true = x @ jax.random.normal(jax.random.key(1), (8, 6))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y_true) ** 2))(
            model
        )
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(30)]
    assert losses[-1] < 0.2 * losses[0]


def test_nnx_linear_general():
    dg = qbits.dot_general(CONFIG)
    layer = nnx.LinearGeneral(
        (4, 5), (6,), axis=(-2, -1), dot_general=dg, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(0), (2, 4, 5))
    assert layer(x).shape == (2, 6)
