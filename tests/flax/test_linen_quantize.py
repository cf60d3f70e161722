"""qbits.flax.quantize: per-layer rules on an unmodified linen model."""

import functools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.flax
from qbits._errors import ConfigError, InvalidArgumentError
from qbits.config import QuantConfig, Rule, UnusedRuleWarning

D, HEADS, SEQ, VOCAB, BLOCKS = 32, 4, 8, 16, 1
ATTN = ("query", "key", "value", "qk", "pv", "out")


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
        self.blocks = [Block() for _ in range(BLOCKS)]  # named blocks_0, ...
        self.head = nn.Dense(VOCAB)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def first_block(self, tokens):
        return self.blocks[0](self.embed(tokens))


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


@functools.cache
def _outputs():
    """Float and quantized outputs, each from its own jitted closure."""
    model, qmodel, params = _setup()
    return {
        m: jax.jit(lambda p, x, m=m: m.apply(p, x))(params, TOKENS)
        for m in (model, qmodel)
    }


def _tree_equal(a, b):
    same = jax.tree.map(lambda u, v: bool(jnp.array_equal(u, v)), a, b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(jax.tree.leaves(same))


def test_table_assigns_the_intended_config_to_every_layer():
    model, _, _ = _setup()
    table = qbits.flax.layer_table(model, CONFIG, TOKENS)
    expected = []
    for i in range(BLOCKS):
        for part in ATTN:
            kind = (
                "MultiHeadDotProductAttention." + part if part in ("qk", "pv") else ""
            )
            expected.append((f"blocks_{i}/attn/{part}", kind or "DenseGeneral", 0))
        expected += [(f"blocks_{i}/mlp/{fc}", "Dense", 1) for fc in ("fc1", "fc2")]
    expected.append(("head", "Dense", 2))
    assert [(r.path, r.kind, r.resolution.rule) for r in table.rows] == expected
    assert table.unused_rules == ()
    configs = table.configs()
    assert configs["blocks_0/attn/qk"] == qbits.config.presets.get("int8_fwd")
    assert configs["blocks_0/mlp/fc2"] == qbits.config.presets.get("w4a8")
    assert configs["head"] is None
    assert table["head"].describe() == "float"
    assert "| blocks_0/attn/pv | MultiHeadDotProductAttention.pv |" in str(table)


def test_quantized_apply_runs_int8_dots_where_the_table_says():
    model, qmodel, params = _setup()
    table = qbits.flax.layer_table(model, CONFIG, TOKENS)
    n_quantized = sum(config is not None for config in table.configs().values())
    dots = qbits.ops.jaxpr_dot_dtypes(lambda p: qmodel.apply(p, TOKENS), params)
    assert len(dots) == len(table.rows) == 8 * BLOCKS + 1
    assert dots.count(("int8", "int8", "int32")) == n_quantized == 8 * BLOCKS
    assert dots[-1] == ("float32", "float32", "float32")  # the head
    float_dots = qbits.ops.jaxpr_dot_dtypes(lambda p: model.apply(p, TOKENS), params)
    assert set(float_dots) == {("float32", "float32", "float32")}


def test_same_variables_close_outputs_and_gradients():
    model, qmodel, params = _setup()
    qparams = jax.eval_shape(qmodel.init, jax.random.key(1), TOKENS)
    assert jax.tree.map(jnp.shape, qparams) == jax.tree.map(jnp.shape, params)
    y, yq = _outputs()[model], _outputs()[qmodel]
    assert not np.array_equal(y, yq)
    np.testing.assert_allclose(yq, y, atol=0.15 * float(jnp.abs(y).max()))

    def loss(p):
        logits = qmodel.apply(p, TOKENS)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads = jax.jit(jax.grad(loss))(params)["params"]
    assert jax.tree.structure(grads) == jax.tree.structure(params["params"])
    for g in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(g)))
    for path in ("head", "blocks_0/mlp/fc1", "blocks_0/attn/query", "embed"):
        leaf = functools.reduce(lambda t, k: t[k], path.split("/"), grads)
        assert any(float(jnp.abs(v).max()) > 0 for v in jax.tree.leaves(leaf)), path
    assert qmodel.model == model  # the user's model is untouched


@pytest.mark.parametrize("quantized_first", [False, True])
def test_jit_caches_stay_separate(quantized_first):
    model, qmodel, params = _setup()
    want = _outputs()
    assert not np.allclose(want[model], want[qmodel], rtol=1e-3, atol=1e-3)

    @functools.partial(jax.jit, static_argnums=0)
    def shared(module, p, x):
        return module.apply(p, x)

    close = functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-6)
    for m in (qmodel, model) if quantized_first else (model, qmodel):
        close(jax.jit(m.apply)(params, TOKENS), want[m])
        close(shared(m, params, TOKENS), want[m])


def test_methods_of_the_model_run_quantized():
    model, qmodel, params = _setup()

    def dots(module, method):
        return qbits.ops.jaxpr_dot_dtypes(
            lambda p: module.apply(p, TOKENS, method=method), params
        )

    assert dots(model, "first_block") == [("float32", "float32", "float32")] * 8
    for method in ("first_block", Transformer.first_block, model.first_block):
        assert dots(qmodel, method) == [("int8", "int8", "int32")] * 8
    assert dots(qmodel, None) == dots(qmodel, "__call__")


class ConvEinsum(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3), name="conv")(x)
        x = nn.Einsum((4, 6), "bhwc,cd->bhwd", name="einsum")(x)
        x = nn.remat(nn.Dense)(5, name="remat")(x)
        return nn.ConvTranspose(3, (2, 2), name="convT")(x)


def _conv_dtypes(f, *args):
    found = qbits.ops.jaxpr_dot_dtypes(f, *args, primitive="conv_general_dilated")
    return [(lhs, rhs) for lhs, rhs, _ in found]


def test_conv_einsum_and_remat_layers():
    model = ConvEinsum()
    x = jax.random.normal(jax.random.key(0), (2, 4, 4, 3))
    params = jax.jit(model.init)(jax.random.key(1), x)
    qmodel = qbits.flax.quantize(model, "int8_fwd")
    table = qbits.flax.layer_table(model, "int8_fwd", x)
    # ConvTranspose has no injection point: float, not listed.
    assert [(r.path, r.kind) for r in table.rows] == [
        ("conv", "Conv"),
        ("einsum", "Einsum"),
        ("remat", "Dense"),
    ]
    qparams = jax.eval_shape(qmodel.init, jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, qparams) == jax.tree.map(jnp.shape, params)
    dots = qbits.ops.jaxpr_dot_dtypes(lambda p: qmodel.apply(p, x), params)
    assert dots == [("int8", "int8", "int32")] * 2
    convs = _conv_dtypes(lambda p: qmodel.apply(p, x), params)
    assert convs == [("int8", "int8"), ("float32", "float32")]  # conv, convT

    @functools.partial(jax.jit, static_argnums=0)
    def run(m, p):
        return m.apply(p, x)

    y, yq = run(model, params), run(qmodel, params)
    assert not np.array_equal(y, yq)
    np.testing.assert_allclose(yq, y, atol=0.1 * float(jnp.abs(y).max()))


class SelfAttention(nn.MultiHeadDotProductAttention):
    @nn.compact
    def __call__(self, x):
        return super().__call__(x) * 2.0


def test_attention_with_precision_and_subclasses():
    x = jnp.ones((2, 4, 8))
    for attn in (
        nn.MultiHeadDotProductAttention(2, precision=jax.lax.Precision.HIGHEST),
        SelfAttention(2),  # calls MultiHeadDotProductAttention.__call__
    ):
        params = jax.eval_shape(attn.init, jax.random.key(0), x)
        qattn = qbits.flax.quantize(attn, "int8_fwd")
        dots = qbits.ops.jaxpr_dot_dtypes(lambda p, a=qattn: a.apply(p, x), params)
        assert dots == [("int8", "int8", "int32")] * 6
        table = qbits.flax.layer_table(attn, "int8_fwd", x)
        assert [r.path for r in table.rows] == list(ATTN)


def test_quantized_einsum_is_the_qbits_einsum_on_the_same_parameters():
    layer = nn.Einsum((8, 3, 5), "btd,dhk->bthk")
    x = jax.random.normal(jax.random.key(0), (2, 4, 8))
    params = jax.jit(layer.init)(jax.random.key(1), x)
    qlayer = qbits.flax.quantize(layer, "int8_fwd")
    p = params["params"]
    op = qbits.einsum(qbits.config.presets.get("int8_fwd"))
    want = jax.jit(lambda x, k: op("btd,dhk->bthk", x, k))(x, p["kernel"]) + p["bias"]
    np.testing.assert_allclose(jax.jit(qlayer.apply)(params, x), want, 1e-6, 1e-6)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(qlayer.apply(p, x) ** 2)))(params)
    for g in jax.tree.leaves(grads):
        assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0


class Explicit(nn.Module):
    @nn.compact
    def __call__(self, x):
        mine = qbits.dot_general(qbits.config.presets.get("int4_fwd"))
        x = nn.Dense(8, dot_general=mine, name="a")(x)
        x = nn.Dense(8, name="b")(x)
        attn = nn.MultiHeadDotProductAttention(2, qkv_dot_general=mine, name="attn")
        return attn(x[:, None, :].repeat(2, axis=1))


class Reference(nn.Module):
    """Explicit, with every layer given what quantize(.., "int8_fwd") gives."""

    @nn.compact
    def __call__(self, x):
        int4 = qbits.dot_general(qbits.config.presets.get("int4_fwd"))
        int8 = qbits.dot_general(qbits.config.presets.get("int8_fwd"))
        x = nn.Dense(8, dot_general=int4, name="a")(x)
        x = nn.Dense(8, dot_general=int8, name="b")(x)
        attn = nn.MultiHeadDotProductAttention(
            2,
            qkv_dot_general=int4,
            out_dot_general=int8,
            qk_attn_weights_einsum_cls=lambda: qbits.einsum(int8.config),
            attn_weights_value_einsum_cls=lambda: qbits.einsum(int8.config),
            name="attn",
        )
        return attn(x[:, None, :].repeat(2, axis=1))


def test_explicit_dot_generals_are_kept():
    model = Explicit()
    x = jax.random.normal(jax.random.key(0), (3, 8))
    params = jax.jit(model.init)(jax.random.key(1), x)
    table = qbits.flax.layer_table(model, "int8_fwd", x)
    explicit = {r.path for r in table.rows if r.explicit}
    assert explicit == {"a", "attn/query", "attn/key", "attn/value"}
    assert table["b"].describe() == "int8_fwd"
    assert table["a"].as_dict()["source"] == "model"
    assert "a" not in table.configs()
    qmodel = qbits.flax.quantize(model, "int8_fwd")

    @functools.partial(jax.jit, static_argnums=0)
    def run(m, p):
        return m.apply(p, x)

    np.testing.assert_allclose(run(qmodel, params), run(Reference(), params), 1e-6)


def test_unused_rule_warns_and_names_the_rule():
    dense = nn.Dense(4)
    x = jnp.ones((2, 8))
    params = dense.init(jax.random.key(0), x)
    config = QuantConfig(rules=(Rule(".*", "int8_fwd"), Rule("decoder/.*", "int8")))
    qmodel = qbits.flax.quantize(dense, config)
    with pytest.warns(
        UnusedRuleWarning, match=r"rules\[1\] \(pattern 'decoder/\.\*'\)"
    ):
        jax.eval_shape(qmodel.apply, params, x)
    assert qbits.flax.layer_table(dense, config, x).unused_rules == (1,)


def test_stochastic_rounding_needs_a_quant_key():
    x = jax.random.normal(jax.random.key(0), (4, D))
    qmodel = qbits.flax.quantize(MLP(), QuantConfig(rules=(Rule("fc.", "int8"),)))
    rngs = {"params": jax.random.key(1), "quant": jax.random.key(2)}
    params = jax.jit(qmodel.init)(rngs, x)
    # The same parameters, values included, as the float model's init.
    assert _tree_equal(params, jax.jit(MLP().init)(jax.random.key(1), x))
    with pytest.raises(InvalidArgumentError, match=r"rngs=\{'quant'") as e:
        jax.eval_shape(qmodel.apply, params, x)
    assert "layer 'fc1' gets rules[0].config ('int8')" in str(e.value)

    @jax.jit
    def grads(key):
        def loss(p):
            return jnp.sum(qmodel.apply(p, x, rngs={"quant": key}) ** 2)

        return jax.grad(loss)(params)["params"]["fc1"]["kernel"]

    g0, g1 = grads(jax.random.key(0)), grads(jax.random.key(1))
    np.testing.assert_array_equal(g0, grads(jax.random.key(0)))
    assert not np.array_equal(g0, g1)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="fc")(x)


def test_tile_size_that_does_not_divide_names_the_config_path():
    config = QuantConfig(rules=(Rule("fc", "int4_weight_only"),))
    where = r"rules\[0\]\.config\.fwd\.rhs\.granularity"
    with pytest.raises(ConfigError, match=where + r"\.tile_size") as e:
        qbits.flax.layer_table(Net(), config, jnp.ones((2, 32)))
    assert "in layer 'fc'" in str(e.value)
    with pytest.raises(ConfigError, match=where + r"\.tile_size"):
        jax.eval_shape(
            qbits.flax.quantize(Net(), config).init,
            jax.random.key(0),
            jnp.ones((2, 32)),
        )
    # A convolution's kernel is tiled along its input features.
    conv = qbits.flax.quantize(nn.Conv(4, (3, 3)), "int4_weight_only")
    jax.eval_shape(conv.init, jax.random.key(0), jnp.ones((1, 4, 4, 128)))
    with pytest.raises(ConfigError, match=r"default\.fwd\.rhs\.granularity"):
        jax.eval_shape(conv.init, jax.random.key(0), jnp.ones((1, 4, 4, 100)))
    x = jnp.ones((2, 128))  # a multiple of 128 fits
    qmodel = qbits.flax.quantize(Net(), config)
    params = jax.eval_shape(qmodel.init, jax.random.key(0), x)
    assert params["params"]["fc"]["kernel"].shape == (128, 4)


def test_mxfp8_on_a_dense_with_3d_inputs_forward_and_backward():
    # Issue 16: mxfp8 on a (batch, seq, features) input failed even in the
    # forward ("expected an explicit axis"). The gradient matmul now tiles
    # the last axis it contracts (seq: a multiple of the tile size, 32).
    model = nn.Dense(64)
    qmodel = qbits.flax.quantize(model, "mxfp8")
    x = jax.random.normal(jax.random.key(0), (2, 32, 64))
    params = model.init(jax.random.key(1), x)

    def loss(m, p, x):
        return (m.apply(p, x) ** 2).sum()

    grad = jax.grad(functools.partial(loss, qmodel), argnums=(0, 1))
    e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
    assert qbits.ops.jaxpr_dot_dtypes(grad, params, x) == [
        (e4m3, e4m3, "float32"),  # forward
        (e5m2, e4m3, "float32"),  # gradient of the input
        (e5m2, e4m3, "float32"),  # gradient of the kernel (over batch and seq)
    ]
    y, yq = model.apply(params, x), jax.jit(qmodel.apply)(params, x)
    np.testing.assert_allclose(yq, y, atol=0.3)
    float_grad = jax.grad(functools.partial(loss, model), argnums=(0, 1))
    (g_params, g_x), (f_params, f_x) = jax.jit(grad)(params, x), float_grad(params, x)
    got_kernel, want_kernel = g_params["params"]["kernel"], f_params["params"]["kernel"]
    for got, want in ((got_kernel, want_kernel), (g_x, f_x)):
        assert bool(jnp.isfinite(got).all())
        assert float(jnp.abs(got - want).max()) < 0.1 * float(jnp.abs(want).max())


@pytest.mark.parametrize(
    ("model", "config"),
    [
        ("not a module", "int8"),
        (nn.Dense(4), 3),
        (nn.Dense(4), "int9"),
        (qbits.flax.quantize(nn.Dense(4), "int8"), "int8"),
    ],
)
def test_bad_arguments(model, config):
    with pytest.raises(InvalidArgumentError):
        qbits.flax.quantize(model, config)


def test_layer_keys_compile_without_threefry_loops():
    # make_rng folds each layer's path into the 'quant' key; on a threefry
    # key that is a rolled loop per layer in the compiled step.
    x = jax.random.normal(jax.random.key(0), (4, D))
    qmodel = qbits.flax.quantize(MLP(), "int8")
    params = MLP().init(jax.random.key(1), x)

    def step(params, key):
        def loss(p):
            return jnp.sum(qmodel.apply(p, x, rngs={"quant": key}) ** 2)

        return jax.grad(loss)(params)

    for key in (jax.random.key(2), jax.random.PRNGKey(2)):
        hlo = jax.jit(step).trace(params, key).lower().compile().as_text()
        assert " while(" not in hlo
    # Each layer still rounds with its own noise: the two layers' noise
    # streams differ (fc1's gradient changes with the key, as fc2's does).
    g = [jax.jit(step)(params, jax.random.key(k))["params"] for k in (2, 3)]
    for name in ("fc1", "fc2"):
        assert not np.array_equal(g[0][name]["kernel"], g[1][name]["kernel"])


def test_missing_quant_key_inside_scan_says_to_split_it():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.tanh(nn.Dense(16, name="fc")(x)), None

    def scanned(split):
        return nn.scan(Block, variable_axes={"params": 0}, split_rngs=split, length=3)()

    x, keys = (
        jnp.ones((2, 16)),
        {"params": jax.random.key(0), "quant": jax.random.key(1)},
    )
    model = qbits.flax.quantize(scanned({"params": True}), "int8")
    with pytest.raises(qbits.InvalidArgumentError, match="split_rngs"):
        model.init(keys, x, None)
    model = qbits.flax.quantize(scanned({"params": True, "quant": True}), "int8")
    variables = model.init(keys, x, None)
    assert variables["params"]["fc"]["kernel"].shape == (3, 16, 16)
    # Without any key, the message says to pass one.
    with pytest.raises(qbits.InvalidArgumentError, match="pass rngs="):
        model.init({"params": jax.random.key(0)}, x, None)
