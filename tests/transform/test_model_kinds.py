"""The engine's behaviour, once over every kind of model it takes.

A plain function of a pytree (``qbits.quantize``; here a linen model's
``apply`` over its variables), a linen module (``qbits.flax``) and an nnx
module (``qbits.nnx``) reach their matmuls through one engine: rules, unused
rules, config errors, bad arguments, delayed-scaling state, micro-batches and
serving are asserted here once, for each kind. The adapter files keep what is
the adapter's own (rngs, collections, Variables, methods, mutable).
"""

import functools

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.flax
import qbits.hlo
import qbits.nnx
import qbits.serving as serving
from qbits import ConfigError, InvalidArgumentError
from qbits.config import QuantConfig, Rule, UnusedRuleWarning

# Module-scoped models run once: these tests share one worker.
pytestmark = pytest.mark.xdist_group("model_kinds")

D, HEADS = 32, 4
S8 = ("int8", "int8", "int32")
F32 = ("float32", "float32", "float32")
E4M3 = ("float8_e4m3fn", "float8_e4m3fn")
ATTN = ("query", "key", "value", "qk", "pv", "out")
X = jax.random.normal(jax.random.key(0), (2, 5, D))
WRT = nnx.DiffState(0, (nnx.Param, qbits.nnx.ScaleState))


# One network, written for linen and for nnx: an einsum layer, attention (two
# activation x activation einsums), a layer and a raw weight, a conv, a head.
class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        w2 = self.param("w2", nn.initializers.normal(0.1), (2 * D, D))
        return nn.gelu(nn.Dense(2 * D, name="fc1")(x)) @ w2  # a raw weight


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Einsum((D, D), "btd,de->bte", name="mix")(x)
        x = x + nn.MultiHeadDotProductAttention(HEADS, name="attn")(x)
        return x + LinenMlp(name="mlp")(x)


class LinenNet(nn.Module):
    def setup(self):
        self.blocks_0 = LinenBlock()
        self.conv = nn.Conv(D, (3,))
        self.head = nn.Dense(16)

    def __call__(self, x):
        return self.head(self.conv(self.blocks_0(x)))


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(D, 2 * D, rngs=rngs)
        self.w2 = nnx.Param(0.1 * jax.random.normal(rngs.params(), (2 * D, D)))

    def __call__(self, x):
        return nnx.gelu(self.fc1(x)) @ self.w2  # a raw weight, not a layer


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.mix = nnx.Einsum("btd,de->bte", (D, D), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.mlp = NnxMlp(rngs)

    def __call__(self, x):
        x = self.mix(x)
        x = x + self.attn(x)
        return x + self.mlp(x)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NnxBlock(rngs)])
        self.conv = nnx.Conv(D, D, (3,), rngs=rngs)
        self.head = nnx.Linear(D, 16, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.conv(x))


@functools.cache
def _linen_variables():
    return jax.jit(LinenNet().init)(jax.random.key(1), X)


@functools.cache
def _dense_variables():
    return jax.jit(nn.Dense(4).init)(jax.random.key(1), X[0])


@functools.cache
def _nnx_prototype():
    return NnxNet(nnx.Rngs(1))


def _dtypes(f, *args):
    """The dots' and the convolutions' dtypes of ``f``, traced once."""
    run, leaves = (
        jax.extend.core.jaxpr_as_fun(jax.make_jaxpr(f)(*args)),
        jax.tree.leaves(args),
    )
    return qbits.hlo.dot_dtypes(run, *leaves, stage="jaxpr"), qbits.hlo.dot_dtypes(
        run, *leaves, primitive="conv_general_dilated", stage="jaxpr"
    )


def _values(tree):
    """A state as nested dicts of arrays, whatever holds them."""
    return jax.tree.map(
        lambda v: v[...] if isinstance(v, nnx.Variable) else v,
        tree,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )


class Function:
    """``qbits.quantize`` over a function: the linen model's ``apply``."""

    name, prefix = "function", "blocks_0/"
    not_a_model = "not a function"

    def model(self):
        return LinenNet().apply

    def table(self, config):
        return qbits.layer_table(self.model(), config, _linen_variables(), X)

    def run(self, config, stateful=False):
        """The quantized forward, traced (it warns and raises as it runs)."""
        fn, v = self.model(), _linen_variables()
        state = qbits.init_state(fn, config, v, X) if stateful else None
        return jax.eval_shape(qbits.quantize(fn, config, state=state), v, X)

    def dots(self, config, stateful=False):
        """The quantized forward's dots and convolutions, and the float one's."""
        fn, v = self.model(), _linen_variables()
        state = qbits.init_state(fn, config, v, X) if stateful else None
        return _dtypes(qbits.quantize(fn, config, state=state), v, X), _dtypes(fn, v, X)

    def quantize(self, model, config):
        return qbits.quantize(model, config)

    def quantized(self):
        return qbits.quantize(self.model(), "int8_fwd")

    def state(self, config):
        return qbits.init_state(self.model(), config, _linen_variables(), X)

    def new_state(self, config, *xs, combine=False):
        """The initial state and the new one from one gradient over ``xs``,
        of the network, or of a lone dense layer for a batch of vectors."""
        fn, v = self.model(), _linen_variables()
        if xs[0].ndim == 2:
            fn, v = nn.Dense(4).apply, _dense_variables()
        state = qbits.init_state(fn, config, v, xs[0])

        def loss(state):
            if combine:
                state = qbits.DelayedScaling.max_combining(state)
            apply = qbits.quantize(fn, config, state=state)
            return sum(jnp.sum(apply(v, x) ** 2) for x in xs)

        return state, jax.jit(jax.grad(loss))(state)


class Linen(Function):
    """``qbits.flax.quantize`` over a linen module."""

    name = "linen"
    not_a_model = "not a module"

    def table(self, config):
        return qbits.flax.layer_table(LinenNet(), config, X)

    def run(self, config, stateful=False):
        qmodel, v = qbits.flax.quantize(LinenNet(), config), _linen_variables()
        if stateful:
            v = jax.eval_shape(qmodel.init, jax.random.key(1), X)
        return jax.eval_shape(qmodel.apply, v, X)

    def dots(self, config, stateful=False):
        model, v = LinenNet(), _linen_variables()
        qmodel = qbits.flax.quantize(model, config)
        assert qmodel.model == model  # the user's model is untouched
        quantized = v
        if stateful:
            quantized = jax.eval_shape(qmodel.init, jax.random.key(1), X)
        return _dtypes(lambda v: qmodel.apply(v, X), quantized), _dtypes(
            lambda v: model.apply(v, X), v
        )

    def quantize(self, model, config):
        return qbits.flax.quantize(model, config)

    def quantized(self):
        return qbits.flax.quantize(LinenNet(), "int8_fwd")

    def state(self, config):
        qmodel = qbits.flax.quantize(LinenNet(), config)
        return jax.eval_shape(qmodel.init, jax.random.key(1), X)[qbits.flax.STATE]

    def new_state(self, config, *xs, combine=False):
        qmodel = qbits.flax.quantize(
            LinenNet() if xs[0].ndim == 3 else nn.Dense(4), config
        )
        v = jax.jit(qmodel.init)(jax.random.key(1), xs[0])

        def loss(v):
            if combine:
                v = {
                    **v,
                    qbits.flax.STATE: qbits.DelayedScaling.max_combining(
                        v[qbits.flax.STATE]
                    ),
                }
            return sum(jnp.sum(qmodel.apply(v, x) ** 2) for x in xs)

        return v[qbits.flax.STATE], jax.jit(jax.grad(loss))(v)[qbits.flax.STATE]


def _nnx_dtypes(model):
    graphdef, state = nnx.split(model)
    return _dtypes(lambda s: nnx.merge(graphdef, s)(X), state)


class Nnx:
    """``qbits.nnx.quantize`` over an nnx module: a quantized copy."""

    name, prefix = "nnx", "blocks/0/"
    not_a_model = "not a module"

    def model(self):
        return nnx.clone(_nnx_prototype())  # a fresh copy: building one runs ops

    def table(self, config):
        return qbits.nnx.layer_table(self.model(), config, X)

    def run(self, config, stateful=False):
        model = qbits.nnx.quantize(self.model(), config, X)
        graphdef, state = nnx.split(model)
        return jax.eval_shape(lambda s: nnx.merge(graphdef, s)(X), state)

    def dots(self, config, stateful=False):
        model = self.model()
        quantized = _nnx_dtypes(qbits.nnx.quantize(model, config, X))
        return quantized, _nnx_dtypes(model)  # the original stays float

    def quantize(self, model, config):
        return qbits.nnx.quantize(model, config)

    def quantized(self):
        return qbits.nnx.quantize(self.model(), "int8_fwd")

    def state(self, config):
        state = dict(qbits.nnx.quantize(self.model(), config, X).qbits.state)
        leaves = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        assert all(isinstance(v, qbits.nnx.ScaleState) for v in leaves)
        return state

    def new_state(self, config, *xs, combine=False):
        model = self.model() if xs[0].ndim == 3 else nnx.Linear(D, 4, rngs=nnx.Rngs(0))
        model = qbits.nnx.quantize(model, config, xs[0])

        def loss(m):
            if not combine:
                return sum(jnp.sum(m(x) ** 2) for x in xs)
            graphdef, state, rest = nnx.split(m, qbits.nnx.ScaleState, ...)
            m = nnx.merge(graphdef, qbits.DelayedScaling.max_combining(state), rest)
            return sum(jnp.sum(m(x) ** 2) for x in xs)

        grads = nnx.jit(nnx.grad(loss, argnums=WRT))(model)
        state = _values(dict(model.qbits.state))
        # The model itself keeps its float32 state (the loss merged a copy).
        assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(state))
        return state, _values(grads["qbits"]["state"])


KINDS = [Function(), Linen(), Nnx()]
BY_NAME = pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
SITES = ["mix", *(f"attn/{p}" for p in ATTN), "mlp/fc1", "mlp"]


def _sites(kind):
    return [kind.prefix + s for s in SITES] + ["conv", "head"]


@BY_NAME
def test_rules_drive_the_table_and_the_dots(kind):
    config = QuantConfig(
        rules=(
            Rule(".*attn.*", "int8_fwd"),
            Rule(".*mlp.*", "w4a8"),
            Rule("head", None),
        ),
        default="int8_fwd",  # would quantize the head but for rules[2]
    )
    table = kind.table(config)
    rules = [None] + [0] * 6 + [1, 1, None, 2]
    assert [(r.path, r.resolution.rule) for r in table.rows] == list(
        zip(_sites(kind), rules, strict=True)
    )
    assert table.unused_rules == ()
    assert table["head"].describe() == "float"
    assert table[kind.prefix + "mlp"].describe() == "w4a8"
    assert "einsum (activation x activation)" in table[kind.prefix + "attn/qk"].kind
    (quantized, convs), (original, float_convs) = kind.dots(config)
    assert quantized == [S8] * 9 + [F32]  # all but the head
    assert [c[:2] for c in convs] == [("int8", "int8")]
    assert set(original) == {F32} and [c[:2] for c in float_convs] == [F32[:2]]


@BY_NAME
def test_an_unused_rule_warns_and_names_the_rule(kind):
    config = QuantConfig(rules=(Rule(".*", "int8_fwd"), Rule("decoder/.*", "int8_fwd")))
    with pytest.warns(UnusedRuleWarning, match=r"rules\[1\] \(pattern 'decoder/\.\*'"):
        kind.run(config)
    assert kind.table(config).unused_rules == (1,)


@BY_NAME
def test_config_errors_name_the_file_the_rule_and_the_matmul(kind, tmp_path):
    path = tmp_path / "rules.yaml"  # int4 tiles of 128 on a contraction of 32
    path.write_text("rules:\n  - pattern: head\n    config: int4_weight_only\n")
    where = r"rules\[0\]\.config\.fwd\.rhs\.granularity\.tile_size"
    for call in (kind.table, kind.run):
        with pytest.raises(ConfigError, match=where) as e:
            call(str(path))
        assert str(e.value).startswith(f"{path}: ") and "in layer 'head'" in str(
            e.value
        )


@pytest.mark.parametrize(
    ("kind", "case"),
    [
        *((k, c) for k in KINDS for c in ("model", "3", "int9", "missing.yaml")),
        *((k, "twice") for k in KINDS[1:]),  # a quantized function is a function
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_bad_arguments(kind, case):
    model, config = kind.model(), {"3": 3}.get(case, case)
    if case == "model":
        model, config = kind.not_a_model, "int8"
    elif case == "twice":
        model, config = kind.quantized(), "int8"
    with pytest.raises(InvalidArgumentError):
        kind.quantize(model, config)


@BY_NAME
def test_delayed_scaling_reaches_einsum_conv_and_attention(kind):
    config = QuantConfig(  # the MLP and the head float: less to compile
        rules=(Rule(".*mlp.*|head", None),), default="fp8_delayed"
    )
    (quantized, convs), _ = kind.dots(config, stateful=True)
    # mix, query, key, value, qk, pv, out and the conv run on E4M3 operands.
    assert [d[:2] for d in quantized + convs] == [E4M3] * 7 + [F32[:2]] * 3 + [E4M3]
    state, new = kind.new_state(config, X)
    sites = sorted([*_sites(kind)[:7], "conv"])
    assert sorted(state) == sorted(new) == sites
    for path, entries in new.items():
        h = entries["lhs_amax_history"]
        assert h[0] > 0 and bool(jnp.isfinite(h[0])), path
    np.testing.assert_allclose(
        new[kind.prefix + "mix"]["lhs_amax_history"][0], jnp.max(jnp.abs(X))
    )


@BY_NAME
def test_attention_gets_the_state_of_the_config_it_runs(kind):
    """A matmul of two activations runs the activation quantizer on both
    operands: its state has the rhs entries that the config gives only the
    weight side of a layer."""
    from qbits import DelayedScaling
    from qbits.numerics import Fp8Numerics

    fp8 = Fp8Numerics("float8_e4m3fn")
    config = qbits.DotGeneralConfig(
        fwd=qbits.MatmulConfig(
            lhs=qbits.Quantizer(fp8, provider=DelayedScaling(history_length=4)),
            rhs=qbits.Quantizer(fp8),
        )
    )
    state = kind.state(config)
    attn = kind.prefix + "attn/"
    for site in ("query", "value"):
        assert sorted(state[attn + site]) == ["lhs_amax_history", "lhs_scale"]
    for site in ("qk", "pv"):
        assert sorted(state[attn + site]) == [
            "lhs_amax_history", "lhs_scale", "rhs_amax_history", "rhs_scale"
        ]  # fmt: skip
    assert kind.run(config, stateful=True).shape == (*X.shape[:2], 16)


@BY_NAME
def test_micro_batches_in_one_loss_combine_with_max(kind):
    """Two uses of one state in one gradient, converted by max_combining:
    the new state is that of one batch holding both, not a sum."""
    a, b = X[0, :2], 3 * X[1, :3]
    _, two = kind.new_state("fp8_delayed", a, b, combine=True)
    _, full = kind.new_state("fp8_delayed", jnp.concatenate([a, b]))
    assert sorted(two) == ["kernel"]  # a dense layer alone
    for k in ("lhs_amax_history", "grad_amax_history", "lhs_scale", "rhs_scale"):
        np.testing.assert_array_equal(two["kernel"][k], full["kernel"][k], err_msg=k)
    amax = two["kernel"]["lhs_amax_history"][0]
    assert float(amax) == float(jnp.max(jnp.abs(b)))  # the larger, not a sum


# Serving: a network of two stored layers (each under its own format) and a
# float head, as linen (with a dropout behind a non-array argument) and nnx.
class LinenServeBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Dense(128, name="fc1")(x))
        return nn.Dropout(0.5, deterministic=not train)(x)


class LinenServeNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = LinenServeBlock(name="block")(x, train)
        x = nn.DenseGeneral((2, 16), name="proj")(x)
        x = nn.LayerNorm(name="norm")(x.reshape(x.shape[0], -1))
        return nn.Dense(10, name="head")(x)


class NnxServeBlock(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(256, 128, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.fc1(x))


class NnxServeNet(nnx.Module):
    def __init__(self, rngs):
        self.block = NnxServeBlock(rngs)
        self.proj = nnx.LinearGeneral(128, (2, 16), rngs=rngs)
        self.head = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(self.proj(self.block(x)).reshape(x.shape[0], -1))


SERVE_X = jax.random.normal(jax.random.key(3), (4, 256))


@functools.cache
def _serve_variables():
    return jax.jit(LinenServeNet().init)(jax.random.key(1), SERVE_X)


@functools.cache
def _serve_nnx():
    return NnxServeNet(nnx.Rngs(2))


def _linen_serve(fn, config):
    """Served and QAT outputs and what was stored, for a function or linen."""
    params = _serve_variables()
    if fn is None:  # the linen adapter
        model = LinenServeNet()
        sp = serving.convert(model, config, params, SERVE_X, False)  # non-arrays
        served = jax.jit(serving.serve(model, config).apply)(sp, SERVE_X)
        qat = jax.jit(qbits.flax.quantize(model, config).apply)(params, SERVE_X)
        ref = jax.jit(model.apply)(params, SERVE_X)
    else:
        sp = serving.convert(fn, config, params, SERVE_X)
        served = jax.jit(serving.serve(fn, config))(sp, SERVE_X)
        qat = jax.jit(qbits.quantize(fn, config))(params, SERVE_X)
        ref = jax.jit(fn)(params, SERVE_X)
    kernels = sp.params["params"]
    dropped = [kernels["block"]["fc1"]["kernel"], kernels["proj"]["kernel"]]
    return sp.weights, dropped, kernels["head"]["kernel"], served, qat, ref


def _serve_function(config):
    return _linen_serve(lambda p, x: LinenServeNet().apply(p, x), config)


def _serve_linen(config):
    return _linen_serve(None, config)


def _serve_nnx_copy(config):
    model = nnx.clone(_serve_nnx())
    served = serving.convert(model, config, SERVE_X)
    run = nnx.jit(lambda m, x: m(x))
    qat = qbits.nnx.quantize(model, config, SERVE_X)
    assert model.block.fc1.kernel[...].shape == (256, 128)  # the original stays
    stored = _values(dict(served.qbits.stored))
    dropped = [served.block.fc1.kernel[...], served.proj.kernel[...]]
    out = run(served, SERVE_X)
    return (
        stored,
        dropped,
        served.head.kernel[...],
        out,
        run(qat, SERVE_X),
        run(model, SERVE_X),
    )


SERVE = {"function": _serve_function, "linen": _serve_linen, "nnx": _serve_nnx_copy}
INT8_WEIGHT_ONLY = qbits.DotGeneralConfig(
    fwd=qbits.MatmulConfig(
        rhs=qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=qbits.PerChannel())
    )
)
# name: (config, stored codes' dtype, the arrays beside qvalue and scale)
FORMATS = {
    "int8_fwd": ("int8_fwd", "int8", {}),
    "w4a8": ("w4a8", "uint8", {}),
    "int4_weight_only": ("int4_weight_only", "uint8", {}),
    "int8_weight_only": (INT8_WEIGHT_ONLY, "int8", {}),
    "fp8": ("fp8", "float8_e4m3fn", {}),
    "w4g128_asym": ("w4g128_asym", "uint8", {"zero_point": "int16"}),
}
# Two formats a model, one a stored layer: three models cover the six, on
# every kind of model. The PTQ formats with more arrays or float4 casts (nf4,
# nvfp4, nvfp4_weight_only, unsigned with zero points) are served bit for bit
# in tests/serving/test_ptq_formats.py, each on a kind of model: what they
# add is the format's rounding, which the kind of model does not change.
PAIRS = [("int8_fwd", "w4a8"), ("int4_weight_only", "int8_weight_only"),
         ("fp8", "w4g128_asym")]  # fmt: skip
SERVED_CASES = [(kind, pair) for pair in PAIRS for kind in SERVE]


@pytest.mark.parametrize(
    ("kind", "pair"),
    SERVED_CASES,
    ids=lambda v: "+".join(v) if isinstance(v, tuple) else v,
)
def test_served_equals_the_quantized_forward_bit_for_bit(kind, pair):
    config = QuantConfig(
        rules=(
            Rule("block/fc1", FORMATS[pair[0]][0]),
            Rule("proj", FORMATS[pair[1]][0]),
            Rule("head", None),  # a served model mixes stored and float layers
        )
    )
    stored, dropped, head, served, qat, ref = SERVE[kind](config)
    assert sorted(stored) == ["block/fc1", "proj"]
    for path, name in zip(("block/fc1", "proj"), pair, strict=True):
        _, dtype, extra = FORMATS[name]
        arrays = stored[path]
        assert set(arrays) == {"qvalue", "scale", *extra}, (path, name)
        assert arrays["qvalue"].dtype == np.dtype(dtype), (path, name)
        assert all(arrays[k].dtype == np.dtype(d) for k, d in extra.items())
    # No float kernel of a stored layer is left: an empty placeholder each.
    assert [k.shape for k in dropped] == [(0,), (0,)]
    assert head.shape == (32, 10)  # a float layer
    np.testing.assert_array_equal(served, qat)
    assert served.dtype == qat.dtype
    assert not np.array_equal(served, ref)  # the weights really are quantized
