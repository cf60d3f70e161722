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


def test_micro_batches_in_one_loss_combine_with_max():
    a = jax.random.normal(jax.random.key(0), (4, 16))
    b = 3 * jax.random.normal(jax.random.key(1), (4, 16))
    model = qbits.nnx.quantize(nnx.Linear(16, 4, rngs=nnx.Rngs(0)), "fp8_delayed", a)

    def two(m):  # the two uses of one state combine with max
        with qbits.nnx.max_combining(m):
            return (m(a) ** 2).sum() + (m(b) ** 2).sum()

    grads = nnx.jit(nnx.grad(two, argnums=WRT))(model)
    full = nnx.jit(
        nnx.grad(lambda m: (m(jnp.concatenate([a, b])) ** 2).sum(), argnums=WRT)
    )(model)
    got, want = grads["qbits"]["state"]["kernel"], full["qbits"]["state"]["kernel"]
    for k in ("lhs_amax_history", "grad_amax_history", "lhs_scale", "rhs_scale"):
        np.testing.assert_array_equal(got[k][...], want[k][...], err_msg=k)
    # The model's state is float32 again after the block.
    assert model.qbits.state["kernel"]["lhs_scale"][...].dtype == jnp.float32


def test_delayed_scaling_on_einsum_conv_and_attention_einsums():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.mix = nnx.Einsum("btd,de->bte", (8, 8), rngs=rngs)
            self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
            self.conv = nnx.Conv(8, 4, (3,), rngs=rngs)

        def __call__(self, x):
            return self.conv(self.attn(self.mix(x)))

    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    model = qbits.nnx.quantize(Net(nnx.Rngs(0)), "fp8_delayed", x)
    graphdef, state = nnx.split(model)

    def fn(s):
        return nnx.merge(graphdef, s)(x)

    dtypes = qbits.ops.jaxpr_dot_dtypes(fn, state) + qbits.ops.jaxpr_dot_dtypes(
        fn, state, primitive="conv_general_dilated"
    )
    assert len(dtypes) == 8  # mix, query, key, value, qk, pv, out; conv
    assert all(d[:2] == ("float8_e4m3fn", "float8_e4m3fn") for d in dtypes), dtypes
    grads = nnx.jit(nnx.grad(lambda m: (m(x) ** 2).sum(), argnums=WRT))(model)
    new = grads["qbits"]["state"]
    assert sorted(new) == sorted(
        ["mix", "attn/query", "attn/key", "attn/value", "attn/qk", "attn/pv",
         "attn/out", "conv"]
    )  # fmt: skip
    for entries in new.values():
        h = entries["lhs_amax_history"][...]
        assert h[0] > 0 and bool(jnp.isfinite(h[0]))
    np.testing.assert_allclose(new["mix"]["lhs_amax_history"][0], jnp.max(jnp.abs(x)))
