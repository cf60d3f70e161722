"""qbits.nnx.quantize: a copy of an unmodified nnx model, run through the engine."""

import functools

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qbits
import qbits.nnx
from qbits import InvalidArgumentError
from qbits.config import QuantConfig, Rule

D, HEADS, SEQ, VOCAB = 32, 4, 8, 16


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(D, 2 * D, rngs=rngs)
        self.w2 = nnx.Param(0.1 * jax.random.normal(rngs.params(), (2 * D, D)))

    def __call__(self, x):
        return nnx.gelu(self.fc1(x)) @ self.w2  # a raw weight, not a layer


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = Mlp(rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x), is_causal=True)
        return x + self.drop(self.mlp(self.ln2(x)))


class Transformer(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@functools.cache
def _prototype():
    return Transformer()


def make_transformer():
    """A fresh copy of a (cached) transformer: building one runs many ops."""
    return nnx.clone(_prototype())


TOKENS = jax.random.randint(jax.random.key(0), (2, SEQ), 0, VOCAB)
TARGETS = jnp.roll(TOKENS, -1, axis=1)


def loss_fn(model):
    logits = model(TOKENS)
    return optax.softmax_cross_entropy_with_integer_labels(logits, TARGETS).mean()


def test_the_copy_is_the_models_class_and_shares_arrays_not_variables():
    model = make_transformer()
    qmodel = qbits.nnx.quantize(model, "int8_fwd")
    assert isinstance(qmodel, Transformer) and type(qmodel).__name__ == "Transformer"
    assert qmodel.head.kernel is not model.head.kernel
    assert qmodel.head.kernel[...] is model.head.kernel[...]
    # Parameter paths are the model's: an optimizer sees the same tree.
    params = nnx.state(qmodel, nnx.Param)
    assert jax.tree.structure(params) == jax.tree.structure(nnx.state(model, nnx.Param))
    with pytest.raises(InvalidArgumentError, match="not quantized or served yet"):
        qbits.nnx.quantize(qmodel, "int8_fwd")


def test_trains_with_stochastic_rounding_an_optimizer_and_dropout():
    model = qbits.nnx.quantize(make_transformer(), "int8", rngs=nnx.Rngs(quant=0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        losses = [float(step(model, optimizer)) for _ in range(8)]
    assert losses[-1] < losses[0]
    assert int(model.qbits.rngs.count[...]) == 8  # one key per call
    # The model's own key streams (dropout) advance too.
    assert int(model.blocks[0].drop.rngs.count[...]) == 8
    # Keys: the same seed gives the same gradients, another seed others.
    grad = nnx.jit(nnx.grad(loss_fn))  # traced once for the three
    grads = [
        grad(qbits.nnx.quantize(make_transformer(), "int8", rngs=nnx.Rngs(quant=s)))
        for s in (3, 3, 4)
    ]
    k = [g["blocks"][0]["mlp"]["fc1"]["kernel"][...] for g in grads]
    np.testing.assert_array_equal(k[0], k[1])
    assert not np.array_equal(k[0], k[2])


def test_functional_split_merge_style_with_delayed_scaling():
    x = jax.random.normal(jax.random.key(1), (4, D))
    model = qbits.nnx.quantize(Mlp(nnx.Rngs(0)), "fp8_delayed", x)
    assert sorted(model.qbits.state) == ["fc1", "w2"]
    optimizer = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)
    wrt = nnx.DiffState(0, (nnx.Param, qbits.nnx.ScaleState))
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=wrt)(model)
        optimizer.update(model, qbits.nnx.update_state(model, grads))
        return nnx.state((model, optimizer))

    state = step(step(state, x), 3 * x)
    model, _ = nnx.merge(graphdef, state)
    history = model.qbits.state["fc1"]["lhs_amax_history"][...]  # a ring buffer
    want = [3 * jnp.abs(x).max(), jnp.abs(x).max()]
    np.testing.assert_allclose([history[0], history[-1]], want)
    with pytest.raises(InvalidArgumentError, match="sample batch"):
        qbits.nnx.quantize(Mlp(nnx.Rngs(0)), "fp8_delayed")


def test_jit_cache_keeps_float_and_quantized_apart():
    model = make_transformer()
    qmodel = qbits.nnx.quantize(model, "int8_fwd")
    call = nnx.jit(lambda m, x: m(x))
    for first, second in ((model, qmodel), (qmodel, model)):
        a, b = call(first, TOKENS), call(second, TOKENS)
        assert not np.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize(
    "rngs", [None, "key", nnx.Rngs(params=0)], ids=["none", "key", "no_quant"]
)
def test_keys_for_a_stochastic_config_need_an_rngs_with_a_quant_stream(rngs):
    """The rest of the bad arguments: tests/transform/test_model_kinds.py."""
    linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    match = r"rngs=None .*rngs=nnx.Rngs" if rngs is None else "rngs="
    with pytest.raises(InvalidArgumentError, match=match):
        qbits.nnx.quantize(linear, QuantConfig(rules=(Rule(".*", "int8"),)), rngs=rngs)


def test_layer_table_without_sample_inputs_names_them():
    """Not the model's own TypeError from deep in the engine."""
    model = nnx.Conv(3, 4, (2,), rngs=nnx.Rngs(0))
    with pytest.raises(
        InvalidArgumentError,
        match=r"qbits.nnx.layer_table: \*args=.*'inputs'.*\(model, config, inputs\)",
    ):
        qbits.nnx.layer_table(model, "int8_fwd")
    with pytest.raises(InvalidArgumentError, match="too many positional"):
        qbits.nnx.layer_table(model, "int8_fwd", TOKENS, None, TOKENS)


def test_explicit_stateful_ops_keep_keys_and_state():
    x = jnp.ones((2, 16))
    dg = qbits.nnx.Stateful("int8", rngs=nnx.Rngs(quant=0))
    layer = nnx.Linear(16, 4, dot_general=dg, rngs=nnx.Rngs(0))
    nnx.jit(nnx.grad(lambda m: m(x).sum()))(layer)
    assert int(layer.dot_general.rngs.count[...]) == 1
    einsum = qbits.nnx.Stateful("fp8_delayed", op="einsum")
    layer = nnx.Einsum("bd,dh->bh", (16, 4), einsum_op=einsum, rngs=nnx.Rngs(0))
    wrt = nnx.DiffState(0, (nnx.Param, qbits.nnx.ScaleState))
    grads = nnx.jit(nnx.grad(lambda m: m(2 * x).sum(), argnums=wrt))(layer)
    qbits.nnx.update_state(layer, grads)
    assert float(layer.einsum_op.lhs_amax_history[0]) == 2.0
    with pytest.raises(InvalidArgumentError, match="rngs=None"):
        qbits.nnx.Stateful("int8")
    with pytest.raises(InvalidArgumentError, match="op='matmul'"):
        qbits.nnx.Stateful("int8_fwd", op="matmul")


def test_stateful_takes_every_op_kind_by_name():
    """``op="ragged_dot"``: a grouped matmul with delayed scales as nnx state."""
    layer = qbits.nnx.Stateful("fp8_delayed", op="ragged_dot")
    x = jnp.cos(jnp.arange(48.0)).reshape(6, 8)
    w = jnp.sin(jnp.arange(64.0)).reshape(2, 8, 4)
    sizes = jnp.array([2, 4])
    out = layer(x, w, sizes)
    op = qbits.ops.ragged_dot(qbits.presets.get("fp8_delayed"))
    want = op(x, w, sizes, state=op.init_state(x, w, sizes))
    np.testing.assert_array_equal(out, want)
    assert layer.rhs_amax_history[...].shape == (1024,)
