"""Delayed-scaling state in linen models: collection, TrainState, scan."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state as flax_train_state

import qbits
from qbits.flax import STATE


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="fc1")(x))
        return nn.Dense(4, name="head")(x)


def _data():
    k = jax.random.split(jax.random.key(0), 2)
    return jax.random.normal(k[0], (8, 16)), jax.random.normal(k[1], (8, 4))


def test_quantize_puts_state_in_the_collection_and_trainstate_overwrites_it():
    x, y = _data()
    rules = qbits.QuantConfig(rules=[qbits.Rule("head", None)], default="fp8_delayed")
    model = qbits.flax.quantize(Mlp(), rules)
    variables = jax.jit(model.init)(jax.random.key(1), x)
    assert list(variables[STATE]) == ["fc1"]  # head stays float, holds no state
    assert variables[STATE]["fc1"]["lhs_amax_history"].shape == (1024,)
    # The float model's params work, and the other way round.
    assert jax.tree.structure(variables["params"]) == jax.tree.structure(
        Mlp().init(jax.random.key(1), x)["params"]
    )
    state = qbits.flax.TrainState.create(
        apply_fn=model.apply, params=variables, tx=optax.sgd(0.01)
    )

    @jax.jit
    def step(state, x, y):
        def loss(v):
            return jnp.mean((state.apply_fn(v, x) - y) ** 2)

        grads = jax.grad(loss)(state.params)
        return state.apply_gradients(grads=grads), grads

    first, grads = step(state, x, y)
    dot = first.params[STATE]["fc1"]
    np.testing.assert_array_equal(dot["lhs_amax_history"][0], jnp.max(jnp.abs(x)))
    assert dot["lhs_scale"] == 1.0  # step one used the initial scale
    assert dot["grad_amax_history"][0] > 0
    # Params moved by the optimizer; the state was overwritten, not optimized.
    assert not np.array_equal(
        first.params["params"]["fc1"]["kernel"], variables["params"]["fc1"]["kernel"]
    )
    second, _ = step(first, x, y)
    dot2 = second.params[STATE]["fc1"]
    np.testing.assert_allclose(dot2["lhs_scale"], jnp.max(jnp.abs(x)) / 448, rtol=1e-6)
    # Flax's own TrainState handles the collection the same way.
    flax_state = flax_train_state.TrainState.create(
        apply_fn=model.apply, params=variables, tx=optax.sgd(0.01)
    )
    flax_first = jax.jit(flax_state.apply_gradients)(grads=grads)
    jax.tree.map(
        np.testing.assert_array_equal, flax_first.params[STATE], first.params[STATE]
    )
    jax.tree.map(
        functools.partial(np.testing.assert_allclose, rtol=1e-6),
        flax_first.params["params"],
        first.params["params"],
    )


def test_trainstate_refuses_grads_without_the_collection():
    x, _ = _data()
    model = qbits.flax.quantize(Mlp(), "fp8_delayed")
    v = jax.jit(model.init)(jax.random.key(1), x)
    state = qbits.flax.TrainState.create(
        apply_fn=model.apply, params=v, tx=optax.sgd(1)
    )
    with pytest.raises(qbits.InvalidArgumentError, match="grads="):
        state.apply_gradients(grads={"params": v["params"]})


def test_explicit_stateful_ops_and_bad_config():
    cls = functools.partial(qbits.flax.Stateful, "fp8_delayed")
    dense = nn.Dense(4, dot_general_cls=cls)
    x = jnp.ones((2, 8))
    v = jax.jit(dense.init)(jax.random.key(0), x)
    assert set(v[STATE]["Stateful_0"]) == {
        f"{t}_{k}" for t in ("lhs", "rhs", "grad") for k in ("scale", "amax_history")
    }
    grads = jax.jit(jax.grad(lambda v: dense.apply(v, 3 * x).sum()))(v)
    assert grads[STATE]["Stateful_0"]["lhs_amax_history"][0] == 3.0
    conv = nn.Conv(
        4,
        (3,),
        conv_general_dilated_cls=functools.partial(
            qbits.flax.Stateful, "fp8_delayed", op="conv_general_dilated"
        ),
    )
    v = jax.jit(conv.init)(jax.random.key(0), jnp.ones((1, 5, 8)))
    assert v[STATE]["Stateful_0"]["rhs_scale"].shape == (1,)
    keyed = nn.Dense(4, dot_general_cls=functools.partial(qbits.flax.Stateful, "int8"))
    v = jax.jit(keyed.init)(jax.random.key(0), x)
    with pytest.raises(Exception, match="quant"):  # its keys come from 'quant'
        keyed.apply(v, x)
    jax.jit(keyed.apply)(v, x, rngs={"quant": jax.random.key(1)})
    bad = nn.Dense(4, dot_general_cls=functools.partial(qbits.flax.Stateful, "nope"))
    with pytest.raises(qbits.InvalidArgumentError, match="config='nope'"):
        bad.init(jax.random.key(0), x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.tanh(nn.Dense(16, name="fc")(x)), None


def test_scan_over_layers_keeps_one_state_per_layer():
    scanned = nn.scan(
        Block,
        variable_axes={"params": 0, STATE: 0},
        split_rngs={"params": True},
        length=3,
    )
    model = qbits.flax.quantize(scanned(), "fp8_delayed")
    x, _ = _data()
    variables = jax.jit(model.init)(jax.random.key(0), x, None)
    hist = variables[STATE]["fc"]["lhs_amax_history"]
    assert hist.shape == (3, 1024)
    grads = jax.jit(jax.grad(lambda v: model.apply(v, x, None)[0].sum()))(variables)
    new = grads[STATE]["fc"]["lhs_amax_history"][:, 0]
    # Each layer recorded its own input's amax: layer 0 sees x, the others tanh.
    assert new[0] == jnp.max(jnp.abs(x))
    assert bool(jnp.all(new[1:] <= 1.0)) and new[1] != new[2]


class Shared(nn.Module):
    """One Dense (one state) applied to every micro-batch inside a scan."""

    @nn.compact
    def __call__(self, xs):
        body = nn.scan(
            lambda mdl, carry, x: (carry + jnp.sum(mdl(x) ** 2), None),
            variable_broadcast=["params", STATE],
            split_rngs={"params": False},
        )
        total, _ = body(nn.Dense(8, name="fc"), jnp.float32(0.0), xs)
        return total


def test_state_shared_across_scan_steps_combines_with_max():
    model = qbits.flax.quantize(Shared(), "fp8_delayed")
    xs = (
        jax.random.normal(jax.random.key(2), (3, 4, 16))
        * jnp.array([1.0, 6.0, 2.0])[:, None, None]
    )
    variables = jax.jit(model.init)(jax.random.key(0), xs)
    # One weight in every step of the loop: one state, not one per step.
    assert variables[STATE]["fc"]["lhs_amax_history"].shape == (1024,)
    new = jax.jit(jax.grad(lambda v: model.apply(v, xs)))(variables)[STATE]["fc"]
    flat = xs.reshape(1, 12, 16)
    ref = jax.jit(jax.grad(lambda v: model.apply(v, flat)))(variables)[STATE]["fc"]
    for k in ref:
        np.testing.assert_array_equal(new[k], ref[k], err_msg=k)
    assert new["lhs_amax_history"][0] == jnp.max(jnp.abs(xs))


def test_gradient_accumulation_keeps_the_largest_microbatch_amax():
    """optax.MultiSteps: every micro-batch's amax reaches the state."""
    model = qbits.flax.quantize(nn.Dense(4, name="fc"), "fp8_delayed")
    x = jax.random.normal(jax.random.key(0), (4, 8))
    variables = jax.jit(model.init)(jax.random.key(1), x)
    state = qbits.flax.TrainState.create(
        apply_fn=model.apply,
        params=variables,
        tx=optax.MultiSteps(optax.sgd(0.01), every_k_schedule=3),
    )

    @jax.jit
    def micro_step(state, x):
        grads = jax.grad(lambda v: (state.apply_fn(v, x) ** 2).sum())(state.params)
        with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps
            return state.apply_gradients(grads=grads)

    scales = (50.0, 1.0, 1.0)  # the largest micro-batch comes first
    for s in scales:
        state = micro_step(state, s * x)
    hist = state.params[STATE]["kernel"]["lhs_amax_history"]
    # Each micro-batch's amax is in the history (index 0 the newest, the
    # older ones behind it, as Flax's ring buffer); the largest sets the scale.
    amax = float(jnp.max(jnp.abs(x)))
    np.testing.assert_allclose(hist[0], amax, rtol=1e-6)
    np.testing.assert_allclose(
        sorted(np.asarray(hist))[-3:], [amax, amax, 50 * amax], rtol=1e-6
    )
    state = micro_step(state, x)
    np.testing.assert_allclose(
        state.params[STATE]["kernel"]["lhs_scale"],
        [50 * float(jnp.max(jnp.abs(x))) / 448],
        rtol=1e-6,
    )
