"""qbits.flax.quantize: linen's init/apply over the engine, on unmodified models."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.flax
import qbits.hlo
from qbits import InvalidArgumentError
from qbits.config import QuantConfig, Rule

D, HEADS, SEQ, VOCAB = 32, 4, 8, 16
S8 = ("int8", "int8", "int32")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(2 * D, name="fc1")(x))
        return nn.Dense(D, name="fc2")(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(HEADS, name="attn")(h, mask=mask)
        return x + MLP(name="mlp")(nn.LayerNorm(name="ln2")(x))


class Transformer(nn.Module):
    def setup(self):
        self.embed = nn.Embed(VOCAB, D)
        self.blocks_0 = Block()
        self.head = nn.Dense(VOCAB)

    def __call__(self, tokens):
        return self.head(self.blocks_0(self.embed(tokens)))

    def first_block(self, tokens):
        return self.blocks_0(self.embed(tokens))


CONFIG = QuantConfig(
    rules=(
        Rule(r".*/attn/.*", "int8_fwd"),
        Rule(r".*/mlp/.*", "w4a8"),
        Rule("head", None),
    ),
    default="int8_fwd",  # would quantize the head but for rules[2]
)
TOKENS = jax.random.randint(jax.random.key(0), (2, SEQ), 0, VOCAB)


@functools.cache
def _setup():
    model = Transformer()
    params = jax.jit(model.init)(jax.random.key(1), TOKENS)
    return model, qbits.flax.quantize(model, CONFIG), params


def test_init_gives_the_float_models_variables_and_gradients_reach_them():
    model, qmodel, params = _setup()
    shapes = jax.eval_shape(qmodel.init, jax.random.key(1), TOKENS)
    assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, params)
    y = jax.jit(model.apply)(params, TOKENS)
    yq = jax.jit(qmodel.apply)(params, TOKENS)
    assert not np.array_equal(y, yq)
    np.testing.assert_allclose(yq, y, atol=0.15 * float(jnp.abs(y).max()))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(qmodel.apply(p, TOKENS) ** 2)))(params)
    for path in ("head", "blocks_0/mlp/fc1", "blocks_0/attn/query", "embed"):
        leaf = functools.reduce(lambda t, k: t[k], path.split("/"), grads["params"])
        assert any(float(jnp.abs(v).max()) > 0 for v in jax.tree.leaves(leaf)), path


@pytest.mark.parametrize("quantized_first", [False, True])
def test_jit_caches_stay_separate(quantized_first):
    model, qmodel, params = _setup()
    want = {m: jax.jit(m.apply)(params, TOKENS) for m in (model, qmodel)}  # apart

    @functools.partial(jax.jit, static_argnums=0)
    def shared(module, p, x):
        return module.apply(p, x)

    for m in (qmodel, model) if quantized_first else (model, qmodel):
        np.testing.assert_allclose(shared(m, params, TOKENS), want[m], 1e-6, 1e-6)


def test_methods_mutable_collections_and_rngs_pass_through():
    model, qmodel, params = _setup()

    def dots(module, method):
        return qbits.hlo.dot_dtypes(
            lambda p: module.apply(p, TOKENS, method=method), params, stage="jaxpr"
        )

    for method in ("first_block", Transformer.first_block, model.first_block):
        assert dots(qmodel, method) == [S8] * 8

    class Stats(nn.Module):  # batch statistics and dropout keep working
        @nn.compact
        def __call__(self, x, train):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
            return nn.Dropout(0.5, deterministic=not train)(x)

    x = jnp.ones((4, 6))
    qstats = qbits.flax.quantize(Stats(), "int8")
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = qstats.init(keys, x, False)
    rngs = {"dropout": jax.random.key(2), "quant": jax.random.key(3)}
    y, updates = qstats.apply(variables, x, True, rngs=rngs, mutable=["batch_stats"])
    assert y.shape == (4, 8) and "batch_stats" in updates
    assert float(jnp.mean(y == 0)) > 0.2  # dropout ran


class ConvEinsum(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), name="conv")(x)
        x = nn.Einsum((4, 6), "bhwc,cd->bhwd", name="einsum")(x)
        x = nn.remat(nn.Dense)(5, name="remat")(x)
        return nn.ConvTranspose(3, (2, 2), name="convT")(x)


def test_conv_einsum_remat_and_conv_transpose_layers():
    model = ConvEinsum()
    x = jax.random.normal(jax.random.key(0), (2, 4, 4, 3))
    params = jax.jit(model.init)(jax.random.key(1), x)
    qmodel = qbits.flax.quantize(model, "int8_fwd")
    table = qbits.flax.layer_table(model, "int8_fwd", x)
    # ConvTranspose runs lax.conv_general_dilated too: the engine reaches it.
    assert [r.path for r in table.rows] == ["conv", "einsum", "remat", "convT"]
    dots = qbits.hlo.dot_dtypes(lambda p: qmodel.apply(p, x), params, stage="jaxpr")
    assert dots == [S8] * 2
    convs = qbits.hlo.dot_dtypes(
        lambda p: qmodel.apply(p, x),
        params,
        primitive="conv_general_dilated",
        stage="jaxpr",
    )
    assert [c[:2] for c in convs] == [("int8", "int8")] * 2
    y, yq = jax.jit(model.apply)(params, x), jax.jit(qmodel.apply)(params, x)
    np.testing.assert_allclose(yq, y, atol=0.1 * float(jnp.abs(y).max()))


class Explicit(nn.Module):
    @nn.compact
    def __call__(self, x):
        mine = qbits.dot_general("int4_fwd")
        x = nn.Dense(8, dot_general=mine, name="a")(x)
        return nn.Dense(8, name="b")(x)


def test_a_models_own_quantized_dot_general_is_kept():
    model = Explicit()
    x = jax.random.normal(jax.random.key(0), (3, 8))
    params = jax.jit(model.init)(jax.random.key(1), x)
    table = qbits.flax.layer_table(model, "int8_fwd", x)
    assert table.rows[0].kept == "inside custom_vjp"
    assert table.rows[0].as_dict()["source"] == "kept: inside custom_vjp"
    assert table["b"].describe() == "int8_fwd"
    qmodel = qbits.flax.quantize(model, "int8_fwd")
    dots = qbits.hlo.dot_dtypes(lambda p: qmodel.apply(p, x), params, stage="jaxpr")
    assert dots == [S8, S8]  # a: its own int4 (widened to int8); b: the rules'


def test_stochastic_rounding_draws_from_the_quant_stream():
    x = jax.random.normal(jax.random.key(0), (4, D))
    qmodel = qbits.flax.quantize(MLP(), QuantConfig(rules=(Rule("fc.", "int8"),)))
    params = jax.jit(qmodel.init)({"params": jax.random.key(1)}, x)
    # The same parameters, values included, as the float model's init.
    want = jax.jit(MLP().init)(jax.random.key(1), x)
    assert jax.tree.all(jax.tree.map(jnp.array_equal, params, want))
    with pytest.raises(InvalidArgumentError, match=r"rngs\['quant'\]=None") as e:
        jax.eval_shape(qmodel.apply, params, x)
    assert "'fc1' rounds stochastically" in str(e.value)

    def step(params, key):
        def loss(p):
            return jnp.sum(qmodel.apply(p, x, rngs={"quant": key}) ** 2)

        return jax.grad(loss)(params)["params"]

    hlo = jax.jit(step).trace(params, jax.random.key(2)).lower().compile().as_text()
    assert " while(" not in hlo  # the layers' keys are a chain, no threefry loop
    g = [jax.jit(step)(params, jax.random.key(k)) for k in (2, 2, 3)]
    np.testing.assert_array_equal(g[0]["fc1"]["kernel"], g[1]["fc1"]["kernel"])
    for name in ("fc1", "fc2"):
        assert not np.array_equal(g[0][name]["kernel"], g[2][name]["kernel"])


def test_scanned_blocks_draw_their_own_keys_without_split_rngs():
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.tanh(nn.Dense(16, name="fc")(x)), None

    scanned = nn.scan(
        Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )()
    x = jax.random.normal(jax.random.key(0), (2, 16))
    model = qbits.flax.quantize(scanned, "int8")
    variables = model.init(jax.random.key(1), x, None)
    assert variables["params"]["fc"]["kernel"].shape == (3, 16, 16)
    table = qbits.flax.layer_table(scanned, "int8", x, None)
    assert table["fc"].kind.endswith("scanned x3")
    grads = jax.jit(
        jax.grad(
            lambda v, k: jnp.sum(model.apply(v, x, None, rngs={"quant": k})[0] ** 2)
        )
    )(variables, jax.random.key(2))
    assert bool(jnp.all(jnp.isfinite(grads["params"]["fc"]["kernel"])))


def test_layer_table_given_the_variables_or_no_inputs_says_what_it_takes():
    """By analogy with qbits.layer_table(fn, config, params, x), variables
    passed where the inputs go ended in the model's own AttributeError."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic: bool = True):
            return nn.Dense(3, name="fc")(x.astype(jnp.float32))

    x = jnp.ones((2, 6))
    variables = Net().init(jax.random.key(0), x)
    with pytest.raises(InvalidArgumentError, match=r"args\[0\]=.*variables") as e:
        qbits.flax.layer_table(Net(), "int8_fwd", variables, x)
    assert "qbits.layer_table(model.apply, config, variables, x)" in str(e.value)
    with pytest.raises(
        InvalidArgumentError, match=r"missing .*'x'.*\(model, config, x\)"
    ):
        qbits.flax.layer_table(Net(), "int8_fwd")
    assert qbits.flax.layer_table(Net(), "int8_fwd", x, False).rows[0].path == "fc"
