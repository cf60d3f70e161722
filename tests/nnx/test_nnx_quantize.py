"""qbits.nnx.quantize: rule-based quantization of unmodified nnx models."""

import functools

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qbits
import qbits.flax
import qbits.nnx
from qbits._errors import ConfigError
from qbits.config import QuantConfig, Rule, UnusedRuleWarning, presets
from qbits.ops import jaxpr_dot_dtypes

D, HEADS, SEQ, VOCAB = 32, 4, 8, 16
F32 = ("float32", "float32", "float32")
INT8 = ("int8", "int8", "int32")


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(D, 2 * D, rngs=rngs)
        self.fc2 = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.gelu(self.fc1(x)))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = Mlp(rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x), is_causal=True)
        return x + self.mlp(self.ln2(x))


class Transformer(nnx.Module):
    def __init__(self, blocks=2, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@functools.cache
def _prototype():
    return Transformer(blocks=1)


def make_transformer():
    """A fresh copy of a (cached) transformer: building one runs many ops."""
    return nnx.clone(_prototype())


def abstract_transformer():
    """Two blocks, parameters as shapes only: enough to trace a jaxpr."""
    return nnx.eval_shape(lambda: Transformer(blocks=2))


@nnx.jit
def call(model, *args):
    return model(*args)


def reference(model, *args):
    """The model's output from a jit of its own (no cache shared with ``call``)."""
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s: nnx.merge(graphdef, s)(*args))(state)


TOKENS = jax.random.randint(jax.random.key(0), (2, SEQ), 0, VOCAB)
TARGETS = jnp.roll(TOKENS, -1, axis=1)

CONFIG = QuantConfig(
    rules=(
        Rule(".*attn.*", "int8_fwd"),
        Rule(".*mlp.*", "w4a8"),
        Rule("head", None),
    )
)


def forward_dtypes(model, *args):
    """Dot dtypes of the model's forward pass, traced as a pure function."""
    graphdef, state = nnx.split(model)
    return jaxpr_dot_dtypes(lambda s, *a: nnx.merge(graphdef, s)(*a), state, *args)


def loss_fn(model):
    logits = model(TOKENS)
    return optax.softmax_cross_entropy_with_integer_labels(logits, TARGETS).mean()


def test_layer_table_assigns_each_layer_its_rule():
    model = abstract_transformer()
    table = qbits.nnx.layer_table(model, CONFIG)
    expected = {}
    for b in range(2):
        for name in ("query", "key", "value", "out"):
            expected[f"blocks/{b}/attn/{name}"] = ("LinearGeneral", "int8_fwd", 0)
        for name in ("qk", "pv"):
            kind = f"MultiHeadAttention.{name}"
            expected[f"blocks/{b}/attn/{name}"] = (kind, "int8_fwd", 0)
        for name in ("fc1", "fc2"):
            expected[f"blocks/{b}/mlp/{name}"] = ("Linear", "w4a8", 1)
    expected["head"] = ("Linear", "float", 2)
    got = {r.path: (r.kind, r.describe(), r.resolution.rule) for r in table.rows}
    assert got == expected
    assert table.unused_rules == ()
    assert table["head"].resolution.config is None
    assert table["blocks/0/mlp/fc1"].resolution.config == presets.get("w4a8")
    # Blocks in order, the attention einsums after its projections.
    paths = [r.path for r in table.rows]
    assert paths.index("blocks/1/attn/key") > paths.index("blocks/0/mlp/fc2")
    assert paths.index("blocks/0/attn/qk") > paths.index("blocks/0/attn/value")


def test_quantized_forward_runs_the_intended_dtypes():
    model = abstract_transformer()
    qmodel = qbits.nnx.quantize(model, CONFIG)
    # Per block: 4 projections and 2 attention einsums int8 x int8; 2 MLP dots
    # with int8 activations and int4 weights (widened to int8 for the dot);
    # then the float head.
    assert forward_dtypes(qmodel, TOKENS) == [INT8] * 16 + [F32]
    fc1 = qmodel.blocks[0].mlp.fc1.dot_general
    assert fc1.config.fwd.rhs.numerics.bits == 4
    # The original model still computes float numbers.
    assert forward_dtypes(model, TOKENS) == [F32] * 17
    assert model.blocks[0].mlp.fc1.dot_general is jax.lax.dot_general
    assert model.blocks[0].attn.attention_fn is nnx.dot_product_attention


def test_copy_shares_arrays_not_variables():
    model = make_transformer()
    qmodel = qbits.nnx.quantize(model, "int8_fwd")
    assert qmodel.head.kernel is not model.head.kernel
    assert qmodel.head.kernel[...] is model.head.kernel[...]
    qmodel.head.kernel[...] = qmodel.head.kernel[...] + 1.0
    assert not np.array_equal(qmodel.head.kernel[...], model.head.kernel[...])


def train(model, steps, lr=0.1):
    optimizer = nnx.Optimizer(model, optax.sgd(lr, momentum=0.5), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(steps)], optimizer


SR_CONFIG = QuantConfig(
    rules=(Rule(".*mlp.*", "int8"), Rule("head", None)), default="int8_fwd"
)


def test_trains_with_stochastic_rounding_and_optimizer():
    model = make_transformer()
    qmodel = qbits.nnx.quantize(model, SR_CONFIG, rngs=nnx.Rngs(quant=0))
    losses, optimizer = train(qmodel, 6)
    assert np.all(np.isfinite(losses))
    assert np.all(np.diff(losses) < 0) and losses[-1] < 0.6 * losses[0]
    # One key per call, advanced across jitted steps, different per layer.
    fc1 = qmodel.blocks[0].mlp.fc1.dot_general
    fc2 = qmodel.blocks[0].mlp.fc2.dot_general
    assert int(fc1.rngs.count[...]) == int(fc2.rngs.count[...]) == 6
    assert not np.array_equal(
        jax.random.key_data(fc1.rngs.key[...]), jax.random.key_data(fc2.rngs.key[...])
    )
    # The RNG state is not a parameter: the optimizer holds Params only.
    params = nnx.state(qmodel, nnx.Param)
    assert not any("rngs" in map(str, path) for path, _ in nnx.to_flat_state(params))
    momentum = jax.tree.leaves(nnx.state(optimizer.opt_state))
    assert len(momentum) == len(jax.tree.leaves(params))
    rng_state = nnx.state(qmodel, nnx.RngState)
    assert len(nnx.to_flat_state(rng_state)) == 4  # fc1, fc2: key and count
    # Layers without stochastic rounding hold no state.
    assert qmodel.blocks[0].attn.query.dot_general.rngs is None
    # The original model is untouched by the training.
    assert np.array_equal(
        nnx.state(model, nnx.Param)["head"]["kernel"][...],
        _prototype().head.kernel[...],
    )


def test_stochastic_rounding_keys_advance_and_reproduce():
    model = make_transformer()
    config = QuantConfig(rules=(Rule(".*/fc1", "int8"),))
    grad = nnx.jit(nnx.value_and_grad(loss_fn))

    def kernel_grads(qmodel):
        loss, grads = grad(qmodel)
        fc1 = grads["blocks"][0]["mlp"]["fc1"]["kernel"][...]
        return float(loss), np.asarray(fc1), np.asarray(grads["head"]["kernel"][...])

    qmodel = qbits.nnx.quantize(model, config, rngs=nnx.Rngs(quant=0))
    loss1, g1, head1 = kernel_grads(qmodel)
    loss2, g2, head2 = kernel_grads(qmodel)
    assert loss1 == loss2  # the forward pass is deterministic
    assert not np.array_equal(g1, g2)  # the rounding of the gradients is not
    np.testing.assert_allclose(g1, g2, atol=0.05 * np.abs(g1).max())
    # The float head's gradient reads only the forward pass and the loss: the
    # calls differ in nothing else.
    assert np.array_equal(head1, head2)
    same_seed = qbits.nnx.quantize(model, config, rngs=nnx.Rngs(quant=0))
    assert np.array_equal(kernel_grads(same_seed)[1], g1)
    other_seed = qbits.nnx.quantize(model, config, rngs=nnx.Rngs(quant=1))
    assert not np.array_equal(kernel_grads(other_seed)[1], g1)


def test_layer_streams_compile_without_threefry_loops():
    # Each layer draws fold_in(stream key, count) per call; on a threefry
    # key that is a rolled loop per layer in the compiled step.
    qmodel = qbits.nnx.quantize(make_transformer(), "int8", rngs=nnx.Rngs(quant=0))
    graph, state = nnx.split(qmodel)

    def step(state):
        return nnx.grad(loss_fn)(nnx.merge(graph, state))

    hlo = jax.jit(step).trace(state).lower().compile().as_text()
    assert " while(" not in hlo
    keys = [v[...] for _, v in nnx.to_flat_state(nnx.state(qmodel, nnx.RngKey))]
    assert keys and all(str(k.dtype) == "key<qh>" for k in keys)


def test_jit_cache_keeps_float_and_quantized_apart():
    model = make_transformer()
    qmodel = qbits.nnx.quantize(model, "int8_fwd")
    models = {"float": model, "quant": qmodel}
    got = {"float": [], "quant": []}
    for order in (("float", "quant"), ("quant", "float")):
        apply = nnx.jit(lambda m, x: m(x))  # one jitted function for both

        @functools.partial(jax.jit, static_argnums=0)
        def pure(graphdef, state, x):
            return nnx.merge(graphdef, state)(x)

        for name in order:
            got[name].append(apply(models[name], TOKENS))
        for name in order:
            got[name].append(pure(*nnx.split(models[name]), TOKENS))
    # Had one model run the other's computation, its four results would not
    # agree; the float and the quantized ones are far apart.
    for name in ("float", "quant"):
        for y in got[name][1:]:
            np.testing.assert_allclose(y, got[name][0], atol=1e-5)
    f, q = got["float"][0], got["quant"][0]
    assert 1e-2 < np.abs(q - f).max() < 0.1 * np.abs(f).max()


@nnx.jit
def attention_variants(model, x, mask):
    """Both routes of Flax's attention, with a mask and causal."""
    outputs = [model(x, mask=mask), model(x, is_causal=True)]
    for kwargs in ({"mask": mask}, {"is_causal": True}):  # weights sown
        y, sown = nnx.capture(model, nnx.Intermediate)(x, sow_weights=True, **kwargs)
        outputs += [y, sown["attention_weights"][0]]
    return outputs


@nnx.jit
def dropout_and_batch_axes(model, x, x5):
    return model(x, deterministic=False), model(x5, deterministic=True)


def test_attention_with_none_preset_equals_flax_bit_for_bit():
    x = jax.random.normal(jax.random.key(1), (2, SEQ, D))
    mask = jax.random.bernoulli(jax.random.key(2), 0.7, (2, 1, SEQ, SEQ))
    for kv_heads in (None, 2):  # multi-head and grouped-query attention
        model = nnx.MultiHeadAttention(
            HEADS, D, num_kv_heads=kv_heads, decode=False, rngs=nnx.Rngs(0)
        )
        qmodel = qbits.nnx.quantize(model, "none")
        assert isinstance(qmodel.attention_fn, qbits.nnx.QuantizedAttention)
        want = attention_variants(model, x, mask)
        got = attention_variants(qmodel, x, mask)
        for a, b in zip(want, got, strict=True):
            # Bit for bit on jax 0.10; from jax 0.12 on, XLA fuses Flax's
            # vmapped grouped-query attention differently: within 1 ulp.
            ulp = np.spacing(np.abs(np.asarray(a, np.float32))).max()
            np.testing.assert_allclose(a, b, rtol=0, atol=ulp)
    # Dropout (the clone starts with the same dropout stream), and batch axes
    # folded as nnx does.
    model = nnx.MultiHeadAttention(
        HEADS, D, num_kv_heads=2, dropout_rate=0.3, decode=False, rngs=nnx.Rngs(0)
    )
    qmodel = qbits.nnx.quantize(model, "none")
    x5 = jax.random.normal(jax.random.key(3), (3, 2, SEQ, D))
    want = dropout_and_batch_axes(model, x, x5)
    got = dropout_and_batch_axes(qmodel, x, x5)
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(a, b)
    # bfloat16, where the q . k einsum asks for a float32 accumulation.
    with jax.numpy_dtype_promotion("standard"):  # as Flax's attention needs
        model = nnx.MultiHeadAttention(
            HEADS, D, dtype=jnp.bfloat16, decode=False, rngs=nnx.Rngs(0)
        )
        qmodel = qbits.nnx.quantize(model, "none")
        want, got = call(model, x), call(qmodel, x)
    assert got.dtype == jnp.bfloat16
    assert np.array_equal(want, got)


def test_attention_einsums_run_int8():
    model = nnx.MultiHeadAttention(
        HEADS, D, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0)
    )
    config = QuantConfig(rules=(Rule("qk|pv", "int8_fwd"),))
    qmodel = qbits.nnx.quantize(model, config)
    x = jax.random.normal(jax.random.key(1), (2, SEQ, D))
    assert forward_dtypes(qmodel, x) == [F32] * 3 + [INT8] * 2 + [F32]
    np.testing.assert_allclose(reference(qmodel, x), reference(model, x), atol=0.05)
    # Only one of the two einsums: the other stays float.
    qk_only = qbits.nnx.quantize(model, QuantConfig(rules=(Rule("qk", "int8_fwd"),)))
    assert qk_only.attention_fn.pv is None
    assert forward_dtypes(qk_only, x).count(INT8) == 1


class Mixed(nnx.Module):
    def __init__(self, rngs):
        self.einsum = nnx.Einsum("bd,dh->bh", (D, 8), (8,), rngs=rngs)
        self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
        self.explicit = nnx.Linear(
            D, 8, dot_general=qbits.dot_general(presets.get("fp8")), rngs=rngs
        )
        self.general = nnx.LinearGeneral(D, (2, 4), rngs=rngs)

    def __call__(self, x, image):
        y = self.einsum(x) + self.explicit(x) + self.general(x).reshape(-1, 8)
        return y, self.conv(image)


def conv_dtypes(f, *args):
    found = qbits.ops.jaxpr_dot_dtypes(f, *args, primitive="conv_general_dilated")
    return [(lhs, rhs) for lhs, rhs, _ in found]


def test_einsum_conv_linear_general_and_explicit_layers():
    model = Mixed(nnx.Rngs(0))
    explicit_fn = model.explicit.dot_general
    table = qbits.nnx.layer_table(model, "int8_fwd")
    assert {r.path: (r.kind, r.describe()) for r in table.rows} == {
        "conv": ("Conv", "int8_fwd"),
        "einsum": ("Einsum", "int8_fwd"),
        "explicit": ("Linear", "explicit"),
        "general": ("LinearGeneral", "int8_fwd"),
    }
    qmodel = qbits.nnx.quantize(model, "int8_fwd")
    assert qmodel.explicit.dot_general is explicit_fn  # kept as the model set it
    assert isinstance(qmodel.einsum.einsum_op, qbits.nnx.QuantizedEinsum)
    assert isinstance(qmodel.conv.conv_general_dilated, qbits.nnx.QuantizedConv)
    x = jax.random.normal(jax.random.key(0), (4, D))
    image = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
    fp8 = ("float8_e4m3fn", "float8_e4m3fn", "float32")
    assert forward_dtypes(qmodel, x, image) == [INT8, fp8, INT8]
    graphdef, state = nnx.split(qmodel)
    convs = conv_dtypes(lambda s: nnx.merge(graphdef, s)(x, image), state)
    assert convs == [("int8", "int8")]
    graphdef, state = nnx.split(model)
    assert conv_dtypes(lambda s: nnx.merge(graphdef, s)(x, image), state) == [
        ("float32", "float32")
    ]
    for got, want in zip(call(qmodel, x, image), call(model, x, image), strict=True):
        np.testing.assert_allclose(got, want, atol=0.5)


def test_delayed_scaling_on_a_conv_trains_as_linen_does():
    # Issue 16 reported an error for "fp8_delayed" on an nnx Conv (naming
    # neither layer nor rule); the core now runs delayed scaling on convs.
    layer = nnx.Conv(3, 8, (3, 3), rngs=nnx.Rngs(0))
    qmodel = qbits.nnx.quantize(layer, "fp8_delayed")
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    graphdef, state = nnx.split(qmodel)
    assert conv_dtypes(lambda s: nnx.merge(graphdef, s)(x), state) == [
        ("float8_e4m3fn", "float8_e4m3fn")
    ]
    wrt = nnx.DiffState(0, (nnx.Param, qbits.nnx.DelayedState))
    grads = nnx.jit(nnx.grad(lambda m: (m(x) ** 2).sum(), argnums=wrt))(qmodel)
    new = grads["conv_general_dilated"]
    assert float(new["lhs_amax_history"][...][0]) == float(jnp.max(jnp.abs(x)))
    kernel = jnp.max(jnp.abs(layer.kernel[...]))
    assert float(new["rhs_amax_history"][...][0]) == float(kernel)
    assert float(new["grad_amax_history"][...][0]) > 0
    # Bit for bit what linen's quantized Conv computes from the same weights.
    linen = qbits.flax.quantize(nn.Conv(8, (3, 3)), "fp8_delayed")
    variables = linen.init(jax.random.key(1), x)
    variables["params"] = {"kernel": layer.kernel[...], "bias": layer.bias[...]}
    np.testing.assert_array_equal(call(qmodel, x), jax.jit(linen.apply)(variables, x))
    linen_grads = jax.jit(jax.grad(lambda v: (linen.apply(v, x) ** 2).sum()))(variables)
    for name, value in linen_grads[qbits.flax.STATE]["StatefulConv_0"].items():
        np.testing.assert_array_equal(new[name][...], value, err_msg=name)
    np.testing.assert_array_equal(grads["kernel"][...], linen_grads["params"]["kernel"])


def test_mxfp8_on_a_linear_with_3d_inputs_forward_and_backward():
    # Issue 16: mxfp8 on a (batch, seq, features) input failed even in the
    # forward ("expected an explicit axis"). The gradient matmul now tiles
    # the last axis it contracts (seq: a multiple of the tile size, 32).
    layer = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    qmodel = qbits.nnx.quantize(layer, "mxfp8")
    x = jax.random.normal(jax.random.key(0), (2, 32, 64))

    def loss(model, x):
        return (model(x) ** 2).sum()

    graphdef, state = nnx.split(qmodel)
    dtypes = jaxpr_dot_dtypes(
        jax.grad(lambda s, x: loss(nnx.merge(graphdef, s), x), argnums=(0, 1)),
        state,
        x,
    )
    e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
    assert dtypes == [
        (e4m3, e4m3, "float32"),  # forward
        (e5m2, e4m3, "float32"),  # gradient of the input
        (e5m2, e4m3, "float32"),  # gradient of the kernel (over batch and seq)
    ]
    np.testing.assert_allclose(call(qmodel, x), call(layer, x), atol=0.3)
    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)))
    (q_model, q_x), (f_model, f_x) = grad(qmodel, x), grad(layer, x)
    for got, want in ((q_model["kernel"][...], f_model["kernel"][...]), (q_x, f_x)):
        assert bool(jnp.isfinite(got).all())
        assert float(jnp.abs(got - want).max()) < 0.1 * float(jnp.abs(want).max())


def test_unused_rule_warns():
    config = QuantConfig(rules=(Rule(".*mlp.*", "int8_fwd"), Rule("decoder/.*", None)))
    with pytest.warns(
        UnusedRuleWarning, match=r"rules\[1\] \(pattern 'decoder/\.\*'\)"
    ):
        qbits.nnx.quantize(make_transformer(), config)
    assert qbits.nnx.layer_table(make_transformer(), config).unused_rules == (1,)


def test_missing_rngs_is_an_error_at_quantize_time():
    model = make_transformer()
    with pytest.raises(qbits.InvalidArgumentError, match="rngs") as info:
        qbits.nnx.quantize(model, SR_CONFIG)
    message = str(info.value)
    assert "blocks/0/mlp/fc1 (rules[0].config)" in message
    assert "nnx.Rngs(quant=0)" in message
    assert "attn" not in message
    with pytest.raises(qbits.InvalidArgumentError, match="rngs"):
        qbits.nnx.quantize(model, SR_CONFIG, rngs=nnx.Rngs(params=0))
    # A default stream will do, and so will a stream.
    qbits.nnx.quantize(model, SR_CONFIG, rngs=nnx.Rngs(0))
    qbits.nnx.quantize(model, SR_CONFIG, rngs=nnx.Rngs(quant=0).quant)


def test_tile_size_that_does_not_divide_names_the_rule():
    model = nnx.Sequential(
        nnx.Linear(128, 32, rngs=nnx.Rngs(0)), nnx.Linear(32, 8, rngs=nnx.Rngs(1))
    )
    config = QuantConfig(
        rules=(Rule("layers/0", "int8_fwd"), Rule("layers/1", "int4_weight_only"))
    )
    qmodel = qbits.nnx.quantize(model, config)
    with pytest.raises(ConfigError) as info:
        call(qmodel, jnp.ones((2, 128)))
    assert info.value.path == "rules[1].config.fwd.rhs.granularity.tile_size"
    ok = QuantConfig(rules=(Rule("layers/0", "int4_weight_only"),), default=None)
    assert call(qbits.nnx.quantize(model, ok), jnp.ones((2, 128))).shape == (2, 8)


def test_bad_arguments():
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    for config in (3, None, "int9", presets.get):
        with pytest.raises(qbits.InvalidArgumentError, match="config"):
            qbits.nnx.quantize(model, config)
    with pytest.raises(qbits.InvalidArgumentError, match="model"):
        qbits.nnx.quantize({"w": 1}, "int8")
    with pytest.raises(qbits.InvalidArgumentError, match="rngs"):
        qbits.nnx.quantize(model, "int8", rngs=0)
    with pytest.raises(qbits.InvalidArgumentError, match="config"):
        qbits.nnx.QuantizedDotGeneral(1)
    with pytest.raises(qbits.InvalidArgumentError, match="rngs"):
        qbits.nnx.QuantizedEinsum("int8")
    with pytest.raises(qbits.InvalidArgumentError, match="qk"):
        qbits.nnx.QuantizedAttention(qk=3)


def test_single_config_applies_to_every_layer():
    model = make_transformer()
    table = qbits.nnx.layer_table(model, presets.get("int8_fwd"))
    assert {r.describe() for r in table.rows} == {"inline"}
    assert len(table.rows) == 9
    qmodel = qbits.nnx.quantize(model, "int8_fwd")
    assert forward_dtypes(qmodel, TOKENS) == [INT8] * 9
