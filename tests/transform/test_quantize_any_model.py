"""qbits.quantize: every matmul of model code written any way, by rules."""

import functools
import re
import warnings
from typing import Any

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qbits
import qbits.hlo
from examples.custom_models import LM, NnxMlp, lm_batch

S8 = ("s8", "s8", "s32")
I8 = ("int8", "int8", "int32")  # the jaxpr spelling


@functools.cache
def _lm(**kw):
    """The example LM, its variables and a batch; initialised compiled (one
    program, not one per primitive) and once per ``kw`` for the module."""
    model = LM(**kw)
    tokens = lm_batch()
    return model, jax.jit(model.init)(jax.random.key(0), tokens), tokens


def _lm_loss(apply, tokens):
    def loss(params):
        logits = apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    return loss


@pytest.mark.parametrize("scan", [False, True])
def test_every_dot_of_the_training_step_is_int8(scan):
    """Custom Einsum modules, a block-diagonal linear, raw ``@`` with two
    parameters of one module, attention einsums, a tied head; unrolled, or
    scanned and rematerialised: every dot, forward and backward, is s8.

    The unrolled step is compiled (XLA keeps every dot s8); the scanned one,
    whose dots are the same, is read from its jaxpr (what qbits emitted,
    remat's recomputed forwards included)."""
    model, variables, tokens = _lm(scan=scan, remat=scan, depth=2 if scan else 1)
    apply = qbits.quantize(model.apply, "int8", jax.random.key(1))
    stage, int8 = ("jaxpr", I8) if scan else ("compiled", S8)
    step = jax.grad(_lm_loss(apply, tokens))
    dots = qbits.hlo.dot_dtypes(step, variables["params"], stage=stage)
    assert dots and set(dots) == {int8}
    # 9 matmuls per block (2 of them activation x activation) + the head,
    # three dots each (forward, both gradients; remat recomputes forwards).
    assert len(dots) >= 3 * 10


def test_layer_table_lists_every_matmul_with_its_path_and_kind():
    model, variables, tokens = _lm()
    table = qbits.layer_table(model.apply, "int8", variables, tokens)
    paths = [row.path for row in table.rows]
    assert paths[:9] == [
        "blocks_0/attn/q", "blocks_0/attn/k", "blocks_0/attn/v",
        "blocks_0/attn/btnh,bsnh->bnts", "blocks_0/attn/bnts,bsnh->btnh",
        "blocks_0/attn/o", "blocks_0/mix", "blocks_0/mlp/w_in", "blocks_0/mlp/w_out",
    ]  # fmt: skip
    assert paths[-1] == "embed"  # the tied head; the lookup is no matmul
    assert len(paths) == 19
    head = table["embed"]
    assert head.kind == "dot_general (activation x weight)"
    assert head.operands == "f32[2,8,16] x f32[16,32]"
    assert table["blocks_0/mix"].kind == "einsum (weight x activation)"
    assert "activation x activation" in table["blocks_1/attn/btnh,bsnh->bnts"].kind


def test_scanned_layers_are_listed_once_with_the_scan_length():
    model, variables, tokens = _lm(scan=True, depth=3)
    table = qbits.layer_table(model.apply, "int8", variables, tokens)
    assert [r.path for r in table.rows][:2] == ["blocks/attn/q", "blocks/attn/k"]
    assert len(table.rows) == 10
    assert table["blocks/mlp/w_in"].kind.endswith("scanned x3")


def test_rules_by_path_first_match_null_is_float():
    model, variables, tokens = _lm()
    rules = qbits.QuantConfig(
        rules=(
            qbits.Rule(".*/attn/.*->.*", None),  # attention einsums float
            qbits.Rule("embed", None),
            qbits.Rule(".*mlp.*", "int8_fwd"),
        ),
        default="int8",
    )
    table = qbits.layer_table(model.apply, rules, variables, tokens)
    described = {row.path: row.describe() for row in table.rows}
    assert described["blocks_0/attn/btnh,bsnh->bnts"] == "float"
    assert described["embed"] == "float"
    assert described["blocks_1/mlp/w_out"] == "int8_fwd"
    assert described["blocks_1/attn/q"] == "int8"
    apply = qbits.quantize(model.apply, rules, jax.random.key(0))
    dots = qbits.hlo.dot_dtypes(apply, variables, tokens, stage="jaxpr")
    # 2 x (q, k, v, o, mix, w_in, w_out) int8; 2 x 2 attention einsums + head float
    assert dots.count(I8) == 14
    assert len(dots) - dots.count(I8) == 5


def test_deterministic_config_equals_the_flax_layer_wrappers_bit_for_bit():
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(32)(x)))

    model = Mlp()
    x = jax.random.normal(jax.random.key(0), (4, 16))
    variables = model.init(jax.random.key(1), x)
    for preset in ("int8_fwd", "w4a8"):
        wrapped = qbits.flax.quantize(model, preset)
        transformed = qbits.quantize(model.apply, preset)
        np.testing.assert_array_equal(
            transformed(variables, x), wrapped.apply(variables, x)
        )
        g1 = jax.jit(jax.grad(lambda v, f=transformed: f(v, x).sum()))(variables)
        g2 = jax.jit(jax.grad(lambda v, f=wrapped.apply: f(v, x).sum()))(variables)
        jax.tree.map(np.testing.assert_array_equal, g1, g2)


def test_identity_config_is_lax_bit_for_bit():
    model, variables, tokens = _lm()
    out = qbits.quantize(model.apply, "none")(variables, tokens)  # compiled
    np.testing.assert_array_equal(out, jax.jit(model.apply)(variables, tokens))


def test_nnx_module_with_raw_matmul_and_linear():
    model = NnxMlp(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    x = jax.random.normal(jax.random.key(2), (8, 16))
    table = qbits.layer_table(forward, "int8", state, x)
    assert [r.path for r in table.rows] == ["w1", "proj"]
    qforward = qbits.quantize(forward, "int8", jax.random.key(3))
    dots = qbits.hlo.dot_dtypes(jax.grad(lambda s: qforward(s, x).sum()), state)
    assert dots and set(dots) == {S8}
    out = qbits.quantize(forward, "int8_fwd")(state, x)
    np.testing.assert_allclose(out, forward(state, x), atol=0.05, rtol=0.05)


def test_nnx_scanned_vmapped_blocks():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.lin(x))

    class Scanned(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=4)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def step(block, x):
                return block(x)

            return step(self.blocks, x)

    graphdef, state = nnx.split(Scanned(nnx.Rngs(0)))

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    x = jax.random.normal(jax.random.key(1), (8, 16))
    table = qbits.layer_table(forward, "int8", state, x)
    assert [(r.path, r.kind) for r in table.rows] == [
        ("blocks/lin", "dot_general (activation x weight), scanned x4")
    ]
    qforward = qbits.quantize(forward, "int8", jax.random.key(2))
    dots = qbits.hlo.dot_dtypes(jax.grad(lambda s: qforward(s, x).sum()), state)
    assert dots and set(dots) == {S8}


def test_scanned_equals_unrolled_for_a_deterministic_config():
    model, variables, tokens = _lm(scan=True, remat=True)
    unrolled = LM(scan=False)
    stacked = variables["params"]["blocks"]
    params = {k: v for k, v in variables["params"].items() if k != "blocks"}
    for i in range(2):
        params[f"blocks_{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
    a = qbits.quantize(model.apply, "int8_fwd")(variables, tokens)
    b = qbits.quantize(unrolled.apply, "int8_fwd")({"params": params}, tokens)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_stochastic_rounding_draws_per_scan_iteration():
    def fn(w, x):
        def step(h, _):
            return h @ w, h

        return jax.lax.scan(step, x, None, length=3)[1]

    w = jnp.eye(16) * 0.7
    x = jnp.tile(jnp.linspace(-1, 1, 16), (4, 1))
    rounding = qbits.Quantizer(
        qbits.IntNumerics(bits=4, noise_fn=qbits.numerics.UniformNoise()),
        granularity=qbits.PerChannel(),
    )
    mm = qbits.MatmulConfig(lhs=rounding, rhs=rounding)
    config = qbits.DotGeneralConfig(mm, mm, mm)
    key = jax.random.key(0)
    ys = qbits.quantize(fn, config, key)(w, x)
    again = qbits.quantize(fn, config, key)(w, x)
    np.testing.assert_array_equal(ys, again)  # the same key, the same numbers
    # the same input h in iterations 0 and 1 would round alike with one stream
    g = jax.jit(jax.grad(lambda w: (qbits.quantize(fn, config, key)(w, x) ** 2).sum()))(
        w
    )
    assert bool(jnp.all(jnp.isfinite(g)))
    draws = qbits.quantize(lambda w, x: fn(w, x)[:1], config, key)
    assert draws(w, x).shape == (1, 4, 16)


def test_cond_while_and_nested_jit_are_reached():
    @jax.jit
    def inner(x, w):
        return x @ w

    def fn(params, x):
        y = jax.lax.cond(x.sum() > 0, lambda a: a @ params["a"], lambda a: a, x)
        y = inner(y, params["b"])
        _, y = jax.lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ params["c"]), (0, y)
        )
        return y

    params = {k: jnp.eye(8) * 0.5 for k in "abc"}
    x = jnp.ones((2, 8))
    table = qbits.layer_table(fn, "int8_fwd", params, x)
    assert [r.path for r in table.rows] == ["a", "b", "c"]
    dots = qbits.hlo.dot_dtypes(
        qbits.quantize(fn, "int8_fwd"), params, x, stage="jaxpr"
    )
    assert dots == [I8] * 3
    np.testing.assert_allclose(
        qbits.quantize(fn, "int8_fwd")(params, x), fn(params, x), rtol=0.05
    )


def test_the_jit_cache_keeps_float_and_quantized_apart():
    model, variables, tokens = _lm()
    float_fn = jax.jit(model.apply)
    quant_fn = jax.jit(qbits.quantize(model.apply, "int8_fwd"))
    first_float = float_fn(variables, tokens)
    first_quant = quant_fn(variables, tokens)
    assert not np.array_equal(first_float, first_quant)
    # the other order, fresh functions
    quant_again = jax.jit(qbits.quantize(model.apply, "int8_fwd"))(variables, tokens)
    float_again = jax.jit(model.apply)(variables, tokens)
    np.testing.assert_array_equal(first_float, float_again)
    np.testing.assert_array_equal(first_quant, quant_again)


def test_a_models_own_quantized_function_is_kept_and_listed():
    config = qbits.presets.get("int8_fwd")

    class Own(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(8, dot_general=qbits.dot_general(config), name="own")(x)
            return nn.Dense(4, name="plain")(x)

    model = Own()
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    table = qbits.layer_table(model.apply, "w4a8", variables, x)
    own = [r for r in table.rows if r.path == "own"]
    assert own and all(r.kept and r.describe() == "kept" for r in own)
    assert own[0].kept == "inside custom_vjp"
    assert table["plain"].describe() == "w4a8"
    out = qbits.quantize(model.apply, "w4a8")(variables, x)
    assert out.shape == (2, 4)


def test_convolutions_are_reached():
    class Cnn(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(4, (3, 3))(x))
            return nn.Dense(2)(x.reshape(x.shape[0], -1))

    model = Cnn()
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    variables = model.init(jax.random.key(1), x)
    table = qbits.layer_table(model.apply, "int8", variables, x)
    assert [(r.path, r.kind.split(" ")[0]) for r in table.rows] == [
        ("Conv_0", "conv"), ("Dense_0", "dot_general")
    ]  # fmt: skip
    apply = qbits.quantize(model.apply, "int8", jax.random.key(0))

    def convs(argnums):
        loss = jax.grad(lambda v, x: apply(v, x).sum(), argnums)
        jaxpr = jax.make_jaxpr(loss)(variables, x)
        return [
            tuple(str(v.aval.dtype) for v in e.invars)
            for e in _equations(jaxpr.jaxpr)
            if e.primitive.name == "conv_general_dilated"
        ]

    # The forward on the stored int8 values; the two gradient convolutions
    # run in float on quantized values (as qbits.conv_general_dilated does).
    both = convs((0, 1))
    assert len(both) == 3 and both[0] == ("int8", "int8")
    # Without the input's gradient its convolution is not even traced.
    assert len(convs(0)) == 2


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_errors_name_the_matmul_and_the_fix():
    model, variables, tokens = _lm()
    with pytest.raises(qbits.InvalidArgumentError, match=r"key.*blocks_0/attn/q"):
        qbits.quantize(model.apply, "int8")(variables, tokens)
    with pytest.raises(qbits.InvalidArgumentError, match=r"state=None.*init_state"):
        qbits.quantize(model.apply, "fp8_delayed")(variables, tokens)
    with pytest.raises(qbits.InvalidArgumentError, match="config='no_such_preset'"):
        qbits.quantize(model.apply, "no_such_preset")
    with pytest.raises(qbits.InvalidArgumentError, match="fn"):
        qbits.quantize("not a function", "int8")
    with pytest.raises(qbits.InvalidArgumentError, match="params_argnum=2"):
        qbits.quantize(model.apply, "int8_fwd", params_argnum=2)(variables, tokens)


def test_unused_rules_say_whether_the_module_exists():
    class Lookup(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(32, 8, name="embed")(tokens)
            return nn.Dense(4, name="head")(x)

    model = Lookup()
    tokens = lm_batch()
    variables = model.init(jax.random.key(0), tokens)
    rules = qbits.QuantConfig(
        rules=(qbits.Rule("embed", None), qbits.Rule("nowhere", None)),
        default="int8_fwd",
    )
    table = qbits.layer_table(model.apply, rules, variables, tokens)
    message = table.unused_message()
    assert "rules[0] (pattern 'embed') matches embed, which run no matmul" in message
    assert "rules[1] (pattern 'nowhere') matched no matmul" in message
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qbits.quantize(model.apply, rules)(variables, tokens)
    assert any(issubclass(w.category, qbits.config.UnusedRuleWarning) for w in caught)


def test_delayed_scaling_state_through_the_transformation_equals_explicit_ops():
    """fp8_delayed: init_state, then the new state is the gradient of the
    state, step after step, exactly as explicit stateful layers keep it."""

    class Mlp(nn.Module):
        dot: Any = None

        @nn.compact
        def __call__(self, x):
            dense = functools.partial(nn.Dense, dot_general_cls=self.dot)
            return dense(4, name="head")(nn.relu(dense(32, name="fc1")(x)))

    model = Mlp()
    wrapped = Mlp(functools.partial(qbits.flax.Stateful, "fp8_delayed"))
    x = jax.random.normal(jax.random.key(0), (8, 16))
    variables = wrapped.init(jax.random.key(1), x)
    params = {"params": variables["params"]}
    state = qbits.init_state(model.apply, "fp8_delayed", params, x)
    assert sorted(state) == ["fc1", "head"]

    def loss(params, state):
        apply = qbits.quantize(model.apply, "fp8_delayed", state=state)
        return jnp.sum(apply(params, x) ** 2)

    def wrapped_loss(variables):
        return jnp.sum(wrapped.apply(variables, x) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    wrapped_step = jax.jit(jax.grad(wrapped_loss))
    for _ in range(3):
        grads, state = step(params, state)
        wrapped_grads = wrapped_step(variables)
        variables = {**variables, qbits.flax.STATE: wrapped_grads[qbits.flax.STATE]}
        theirs = variables[qbits.flax.STATE]
        for layer in ("fc1", "head"):
            for name, value in theirs[layer]["Stateful_0"].items():
                np.testing.assert_array_equal(state[layer][name], value)
        jax.tree.map(
            np.testing.assert_array_equal, grads["params"], wrapped_grads["params"]
        )
    assert float(state["fc1"]["lhs_amax_history"][0]) == float(jnp.max(jnp.abs(x)))


def test_delayed_scaling_state_is_stacked_along_scanned_layers():
    model, variables, tokens = _lm(scan=True, remat=True, depth=3)
    rules = qbits.QuantConfig(rules=(qbits.Rule(".*->.*", None),),
                              default="fp8_delayed")  # fmt: skip
    state = qbits.init_state(model.apply, rules, variables, tokens)
    assert state["blocks/mlp/w_in"]["lhs_amax_history"].shape == (3, 1024)

    def loss(params, state):
        apply = qbits.quantize(model.apply, rules, state=state)
        logits = apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    grads, new = jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], state)
    history = new["blocks/mlp/w_in"]["grad_amax_history"]
    assert history.shape == (3, 1024) and bool(jnp.all(history[:, 0] > 0))
    first = new["blocks/mlp/w_in"]["rhs_amax_history"][:, 0]
    weights = variables["params"]["blocks"]["mlp"]["w_in"]
    np.testing.assert_array_equal(first, jnp.max(jnp.abs(weights), axis=(1, 2)))
    assert bool(jnp.all(jnp.isfinite(grads["blocks"]["mlp"]["w_in"])))


def test_scale_state_inside_cond_is_refused():
    def fn(w, x):
        return jax.lax.cond(x.sum() > 0, lambda a: a @ w, lambda a: a, x)

    w, x = jnp.eye(4), jnp.ones((2, 4))
    with pytest.raises(qbits.InvalidArgumentError, match="inside a cond body"):
        qbits.init_state(fn, "fp8_delayed", w, x)


def test_shard_map_bodies_are_quantized_and_carry_per_tensor_state():
    # (8 devices, tensor parallel, every preset kind: tests/ops/shard_map_check.py)
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec

    def f(p, x, dot=jnp.matmul):
        layer = jax.shard_map(
            dot, mesh=mesh, in_specs=(spec("d"), spec(None, "d")), out_specs=spec("d")
        )
        return layer(x, p["fc"]["kernel"])

    p = {"fc": {"kernel": jax.random.normal(jax.random.key(0), (16, 8))}}
    x = jax.random.normal(jax.random.key(1), (4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it quantizes something: no warning
        (row,) = qbits.layer_table(f, "fp8", p, x).rows
    assert (row.path, row.kept, row.describe()) == ("fc", "", "fp8")
    assert row.kind == "dot_general (activation x weight), in shard_map"
    dot = qbits.dot_general("fp8")
    hand = functools.partial(f, dot=lambda x, w: dot(x, w, (((1,), (0,)), ((), ()))))
    np.testing.assert_array_equal(qbits.quantize(f, "fp8")(p, x), jax.jit(hand)(p, x))
    # Per-tensor delayed scaling crosses the body replicated (8 devices,
    # equal to the hand-written body: tests/ops/shard_map_check.py); state
    # per channel would differ per shard: refused, naming the fix.
    state = qbits.init_state(f, "fp8_delayed", p, x)
    assert state["fc"]["rhs_amax_history"].shape == (1024,)
    channel = qbits.Quantizer(
        qbits.IntNumerics(bits=8), granularity=qbits.PerChannel(),
        provider=qbits.DelayedScaling(),
    )  # fmt: skip
    per_channel = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=channel))
    fix = r"'fc'.*shard_map body.*qbits.dot_general\(config\) inside the body"
    with pytest.raises(qbits.InvalidArgumentError, match=fix):
        qbits.init_state(f, per_channel, p, x)

    def g(p, x):  # served: fc quantized on the fly, out stored
        return f(p, x) @ p["out"]

    p["out"] = jnp.ones((8, 2))
    served = qbits.serving.convert(g, "int8_fwd", p, x)
    assert list(served.weights) == ["out"]
    want = qbits.quantize(g, "int8_fwd")(p, x)
    np.testing.assert_array_equal(qbits.serving.serve(g, "int8_fwd")(served, x), want)


def test_vmap_jit_and_host_callbacks_pass_through():
    def fn(params, x):
        jax.debug.callback(lambda v: None, x.sum())
        return jnp.tanh(x @ params["w"])

    params = {"w": jax.random.normal(jax.random.key(0), (8, 4))}
    xs = jax.random.normal(jax.random.key(1), (5, 3, 8))
    qfn = qbits.quantize(fn, "int8_fwd")
    batched = jax.jit(jax.vmap(qfn, in_axes=(None, 0)))(params, xs)
    one_by_one = jnp.stack([qfn(params, x) for x in xs])
    np.testing.assert_allclose(batched, one_by_one, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(batched, jax.vmap(fn, (None, 0))(params, xs), atol=0.05)


def test_a_weight_on_the_left_gets_the_weight_side_of_the_config():
    """``w4a8`` on ``lax.dot_general(w, x)``: the weight is int4 (the
    config's rhs side), the activation int8, as if written ``x @ w.T``."""

    def weight_first(w, x):
        return jax.lax.dot_general(w, x, (((1,), (1,)), ((), ()))).T

    w = jax.random.normal(jax.random.key(0), (24, 32))
    x = jax.random.normal(jax.random.key(1), (8, 32))
    table = qbits.layer_table(weight_first, "w4a8", w, x)
    assert table.rows[0].kind == "dot_general (weight x activation)"
    config = qbits.presets.get("w4a8")

    def reference(w, x):
        return qbits.dot_general(config)(x, w, (((1,), (1,)), ((), ())))

    transformed = qbits.quantize(weight_first, "w4a8")
    np.testing.assert_array_equal(transformed(w, x), reference(w, x))
    for a, b in zip(
        jax.grad(lambda w, x: transformed(w, x).sum(), argnums=(0, 1))(w, x),
        jax.grad(lambda w, x: reference(w, x).sum(), argnums=(0, 1))(w, x),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_flax_conv_densegeneral_and_attention_equal_explicit_ops():
    """The engine on Flax's own layers computes what the layers compute when
    given qbits' ops explicitly (dot_general=, einsum classes, conv); the
    attention's two einsums, of two activations each, run the config's
    :meth:`for_activations` (given by hand, a config runs as it is)."""

    class Mixed(nn.Module):
        preset: str | None = None

        @nn.compact
        def __call__(self, x):
            ops = {}
            if self.preset is not None:
                dg = qbits.dot_general(self.preset)
                acts = qbits.presets.get(self.preset).for_activations()
                einsum = functools.partial(qbits.einsum, acts)
                ops = {
                    "attn": dict(
                        qkv_dot_general=dg,
                        out_dot_general=dg,
                        qk_attn_weights_einsum_cls=einsum,
                        attn_weights_value_einsum_cls=einsum,
                    ),
                    "conv": dict(
                        conv_general_dilated=qbits.conv_general_dilated(self.preset)
                    ),
                    "dg": dict(dot_general=dg),
                }
            h = nn.Conv(8, (3,), name="conv", **ops.get("conv", {}))(x)
            h = nn.MultiHeadDotProductAttention(2, name="attn", **ops.get("attn", {}))(
                h
            )
            return nn.DenseGeneral(3, name="dg", **ops.get("dg", {}))(h)

    x = jax.random.normal(jax.random.key(0), (2, 6, 4))
    variables = Mixed().init(jax.random.key(1), x)
    for preset in ("w4a8",):  # int8 activations, int4 weights: the sides differ
        f = jax.jit(qbits.quantize(Mixed().apply, preset))
        g = jax.jit(Mixed(preset).apply)
        np.testing.assert_array_equal(f(variables, x), g(variables, x))
        grads = [
            jax.jit(jax.grad(lambda v, h=h: h(v, x).sum()))(variables) for h in (f, g)
        ]
        jax.tree.map(np.testing.assert_array_equal, *grads)


@pytest.mark.parametrize(
    "spec", ["bnts,bsnh->btnh", "btnh,bsnh->bnts", "...hqk,...khd->...qhd"]
)
def test_an_activation_einsum_gives_lhs_to_its_written_first_operand(spec):
    """JAX may hand dot_general the einsum's operands the other way round
    (values before weights); the config's sides follow the written einsum,
    as qbits.einsum gives them (the backward matmuls differ per side; the
    forward of two activations runs the lhs quantizer on both)."""
    shapes = {
        "bnts,bsnh->btnh": ((2, 3, 5, 6), (2, 6, 3, 4)),
        "btnh,bsnh->bnts": ((2, 5, 3, 4), (2, 6, 3, 4)),
        "...hqk,...khd->...qhd": ((2, 3, 5, 6), (2, 6, 3, 4)),
    }[spec]
    a = jax.random.normal(jax.random.key(0), shapes[0])
    b = jax.random.normal(jax.random.key(1), shapes[1])
    int8, int4 = (qbits.Quantizer(qbits.IntNumerics(bits=b)) for b in (8, 4))
    config = qbits.DotGeneralConfig(
        fwd=qbits.MatmulConfig(lhs=int8, rhs=int4),
        dlhs=qbits.MatmulConfig(lhs=int4, rhs=int8),  # the sides differ
        drhs=qbits.MatmulConfig(lhs=int8, rhs=int4),
    )
    ours = qbits.quantize(
        lambda a, b: jnp.einsum(spec, a, b), config, params_argnum=None
    )
    theirs = jax.jit(functools.partial(qbits.einsum(config.for_activations()), spec))
    np.testing.assert_array_equal(ours(a, b), theirs(a, b))
    grads = jax.jit(jax.grad(lambda a, b: ours(a, b).sum(), argnums=(0, 1)))(a, b)
    want = jax.jit(jax.grad(lambda a, b: theirs(a, b).sum(), argnums=(0, 1)))(a, b)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("flag", [True, False])
def test_cond_branches_with_different_equations_each_run_their_own(flag):
    """Equation i of one branch is not mistaken for equation i of another
    (before: an IndexError from the runner)."""
    dn = (((1,), (0,)), ((), ()))
    dot = qbits.dot_general(qbits.presets.get("int8_fwd"))

    def fn(params, x, flag):
        return jax.lax.cond(
            flag,
            lambda x: x @ params["w"],
            lambda x: (jnp.tanh(x) * 2.0) @ params["v"],
            x,
        )

    params = {"w": jnp.full((8, 4), 0.5), "v": jnp.linspace(-1, 1, 32).reshape(8, 4)}
    x = jax.random.normal(jax.random.key(0), (3, 8))
    got = qbits.quantize(fn, "int8_fwd")(params, x, jnp.bool_(flag))
    lhs, rhs = (x, params["w"]) if flag else (jnp.tanh(x) * 2.0, params["v"])
    want = dot(lhs, rhs, dn)
    np.testing.assert_array_equal(got, want)


def test_each_site_draws_its_own_noise():
    # Sites take the links of a key chain: two matmuls with equal operands
    # round their gradients differently (the same key for both would round
    # them alike), and the same key gives the same numbers again.
    def fn(ws, x):
        return sum(jnp.sum(jnp.tanh(x @ w) ** 2) for w in ws)

    w = jax.random.normal(jax.random.key(0), (32, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (8, 32))
    key = jax.random.key(2)
    grads = jax.grad(qbits.quantize(fn, "int8", key))([w, w], x)
    assert not np.array_equal(grads[0], grads[1])
    scale = float(jnp.abs(grads[0]).max())
    np.testing.assert_allclose(grads[0], grads[1], atol=0.05 * scale)
    again = jax.grad(qbits.quantize(fn, "int8", key))([w, w], x)
    np.testing.assert_array_equal(grads[0], again[0])


def _attention(p, x):
    q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
    scores = jnp.einsum("td,sd->ts", q, k)
    return jnp.einsum("ts,sd->td", jax.nn.softmax(scores), v)


_ACTS = {  # what each preset runs on a matmul of two activations
    "w4a8": "w4a8 (activations: lhs quantizer on both operands)",
    "w1_58a8": "w1_58a8 (activations: lhs quantizer on both operands)",
    "fp8_blockwise": "fp8_blockwise (activations: lhs quantizer on both operands)",
    **dict.fromkeys(
        ("int4_weight_only", "w4g128_asym", "nf4", "nf4_dq", "nvfp4_weight_only"),
        "kept",
    ),
}


@pytest.mark.parametrize("name", qbits.presets.names())
def test_each_preset_on_a_matmul_of_two_activations(name):
    """A matmul with no weight runs the rule's config adapted to it, in one
    place (DotGeneralConfig.for_activations): weight-only presets leave it
    float, the others put the activation quantizer on both operands (w4a8:
    int8 x int8, never int4; fp8_blockwise: 1 x 128 tiles, not blocks);
    the layer table says what runs."""
    p = {n: jnp.ones((128, 128)) for n in "qkv"}
    x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    table = qbits.layer_table(_attention, name, p, x)
    config = qbits.presets.get(name)
    for path in ("td,sd->ts", "ts,sd->td"):
        row = table[path]
        assert row.describe() == _ACTS.get(name, name)
        assert row.applied == (None if row.kept else config.for_activations())
        if row.kept:
            assert row.kept == "weight-only config, no weight"
    assert table["q"].describe() == name and table["q"].applied == config


def test_w4a8_runs_int8_on_attention_and_weight_only_leaves_it_float():
    """Head dimension 24 divides no weight-only tile: those presets used to
    refuse the attention einsums; w4a8 used to put them on 4 bits."""
    p = {n: jax.random.normal(jax.random.key(i), (64, 24)) for i, n in enumerate("qkv")}
    x = jax.random.normal(jax.random.key(3), (5, 64))
    dtypes = qbits.hlo.dot_dtypes(
        lambda p: qbits.quantize(_attention, "w4a8")(p, x), p, stage="jaxpr"
    )
    assert dtypes[3:] == [("int8", "int8", "int32")] * 2  # qk and pv
    nf4 = qbits.quantize(_attention, "nf4")(p, x)
    rules = qbits.QuantConfig((qbits.Rule("td,sd->ts|ts,sd->td", None),), "nf4")
    np.testing.assert_array_equal(nf4, qbits.quantize(_attention, rules)(p, x))


def test_weight_only_presets_on_the_example_transformer():
    """``qbits ptq``'s weight-only presets on the model ``qbits train``
    writes: its result ran with the preset as the default, and a head
    dimension of 32 failed the attention einsums ("expected a divisor of 32
    ... in layer 'blocks/0/attn/qk'"). Traced only: nothing is computed."""
    from qbits._experiments import ModelSpec, TransformerLM

    spec = ModelSpec("lm", 128, 1, 4, 8, 2, 1, 1e-3)
    model = nnx.eval_shape(lambda: TransformerLM(7, spec, rngs=nnx.Rngs(0)))
    fn, state = qbits.nnx.as_function(model)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def logits(params, tokens):
        return fn(params, tokens)[0]

    # attn/out contracts 4 heads x 32: no tile of 128 along one axis.
    rules = qbits.QuantConfig((qbits.Rule(".*/attn/out", None),), "w4g128_asym")
    table = qbits.layer_table(logits, rules, state, tokens)
    assert table["blocks/0/attn/qk"].kept == "weight-only config, no weight"
    assert table["blocks/0/mlp/fc1"].describe() == "w4g128_asym"
    out = jax.eval_shape(qbits.quantize(logits, rules), state, tokens)
    assert out.shape == (2, 8, 7)


def test_kept_matmuls_are_listed_with_the_reason():
    """Integer matmuls stay exact (a rule that quantizes one is an error
    naming it); a ragged dot contracting its ragged dimension (a weight
    gradient JAX derives) and a while_loop's condition are listed and run
    as they are."""
    weight_grad = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())

    def f(p, x, ids, groups):
        counts = ids @ p["table"]  # integer: exact
        moe = jax.lax.ragged_dot_general(x, p["experts"], groups, weight_grad)
        i = jax.lax.while_loop(
            lambda c: jnp.sum(c[1] @ p["probe"]) < 10.0,
            lambda c: (c[0] + 1, c[1] + 1.0),
            (0, x),
        )[0]
        return moe.sum() + counts.sum().astype(jnp.float32) + i

    p = {
        "table": jnp.ones((4, 3), jnp.int32),
        "experts": jnp.ones((6, 5)),
        "probe": jnp.ones((4, 1)),
    }
    args = (p, jnp.ones((6, 4)), jnp.ones((6, 4), jnp.int32), jnp.array([3, 3]))
    with pytest.warns(UserWarning, match="quantizes nothing: every matmul runs"):
        table = qbits.layer_table(f, "int8_fwd", *args)
    assert [(r.path, r.kept) for r in table.rows] == [
        ("table", "integer operands"),
        ("experts", "ragged_dot_general with the ragged dimension contracted"),
        ("probe", "inside a while_loop condition"),
    ]
    with pytest.warns(UserWarning, match="'probe' \\(kept: inside a while_loop"):
        out = qbits.quantize(f, "int8_fwd")(*args)
    np.testing.assert_array_equal(out, f(*args))
    rules = qbits.QuantConfig(rules=(qbits.Rule("table", "int8_fwd"),))
    with pytest.raises(qbits.ConfigError, match=r"rules\[0\].*'table'.*integer"):
        qbits.layer_table(f, rules, *args)


@pytest.mark.parametrize(
    "x_dtype, w_dtype, weight_left",
    [(jnp.int8, jnp.bfloat16, False), (jnp.uint16, jnp.float32, True)],
)
def test_an_integer_activation_times_a_float_weight_is_quantized(
    x_dtype, w_dtype, weight_left
):
    """Only a matmul of two integers is exact: an integer operand times a
    float one (what JAX hands dot_general for ``x_int @ w``) is a site like
    any other, quantized as ``x.astype(float) @ w`` is, forward and backward
    (no gradient to the integer operand), stored for serving and seen by
    post-training statistics."""
    dn = (((1,), (1,)), ((), ())) if weight_left else (((1,), (0,)), ((), ()))
    f32 = jnp.float32

    def mixed(p, x):
        a, b = (p["w"], x) if weight_left else (x, p["w"])
        return jax.lax.dot_general(a, b, dn, preferred_element_type=f32)

    def cast(p, x):
        a, b = (p["w"], x.astype(f32)) if weight_left else (x.astype(f32), p["w"])
        return jax.lax.dot_general(a, b, dn, preferred_element_type=f32)

    shape = (6, 32) if weight_left else (32, 6)
    w = (jax.random.normal(jax.random.key(0), shape) / 4).astype(w_dtype)
    x = jax.random.randint(jax.random.key(1), (5, 32), 0, 100).astype(x_dtype)
    p = {"w": w}
    table = qbits.layer_table(mixed, "int8", p, x)
    assert [(r.path, r.kept, r.describe()) for r in table.rows] == [("w", "", "int8")]
    key = jax.random.key(2)
    got = qbits.quantize(mixed, "int8", key)(p, x)
    np.testing.assert_array_equal(got, qbits.quantize(cast, "int8", key)(p, x))
    assert not np.array_equal(got, mixed(p, x))  # quantized, not float
    grads = [
        jax.jit(jax.grad(lambda p, h=h: qbits.quantize(h, "int8", key)(p, x).sum()))(p)
        for h in (mixed, cast)
    ]
    np.testing.assert_array_equal(grads[0]["w"], grads[1]["w"])
    caller = qbits.transform._Caller()
    stored = qbits.transform._store_weights(caller, mixed, "w4a8", p, x)
    assert list(stored) == ["w"]
    served = qbits.quantize(mixed, "w4a8", stored=stored)(p, x)
    np.testing.assert_array_equal(served, qbits.quantize(cast, "w4a8")(p, x))
    ranges = qbits.collect_ranges(mixed, p, [x])
    assert ranges == {"w": float(jnp.abs(x.astype(f32)).max())}


def _norm(p, x):  # no matmul: an elementwise scale and a sum
    return jnp.sum(x * p["scale"], axis=-1)


def _counts(p, x, ids):  # an integer matmul (kept) and a weight matmul
    return (ids @ p["ids"]).astype(jnp.float32) + x @ p["w"]


_P = {"scale": jnp.ones(5), "ids": jnp.ones((5, 3), jnp.int32), "w": jnp.ones((5, 3))}
_X, _IDS = jnp.ones((2, 5)), jnp.ones((2, 5), jnp.int32)
_W_NULL = qbits.QuantConfig((qbits.Rule("w", None),), "int8_fwd")


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda: qbits.quantize(_norm, "fp8")(_P, _X),
         "qbits.quantize: the config 'fp8' quantizes nothing: the function "
         "runs no matmul"),
        (lambda: qbits.layer_table(_counts, _W_NULL, _P, _X, _IDS),
         re.escape("qbits.layer_table: the config (rules ['w'], default "
                   "'int8_fwd') quantizes nothing: every matmul runs float: "
                   "'ids' (kept: integer operands), 'w' (rules[0].config: null)")),
        (lambda: qbits.init_state(_counts, _W_NULL, _P, _X, _IDS),
         "qbits.init_state: .* 'w' \\(rules\\[0\\].config: null\\)"),
        (lambda: qbits.quantize(lambda p, x: jnp.einsum("td,sd->ts", x, x),
                                "w4g128_asym")({}, jnp.ones((3, 128))),
         "'w4g128_asym' quantizes nothing: every matmul runs float: "
         "'td,sd->ts' \\(weight-only config, no weight\\)"),
    ],
)  # fmt: skip
def test_a_config_that_quantizes_nothing_says_why(call, says):
    """Every entry point warns when a config that quantizes something finds
    nothing to quantize, naming itself, the config and why."""
    with pytest.warns(UserWarning, match=says):
        call()


def test_nothing_to_quantize_warns_once_per_trace_and_not_for_float():
    import flax.linen as nn

    class Scale(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x * self.param("s", nn.initializers.ones, (x.shape[-1],))

    qmodel = qbits.flax.quantize(Scale(), "mxfp8")
    x = jnp.ones((2, 4))
    variables = qmodel.init(jax.random.key(0), x)
    apply = jax.jit(qmodel.apply)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply(variables, x)
        apply(variables, 2 * x)  # the same trace: no second warning
        qbits.quantize(_norm, None)(_P, _X)  # float on purpose: silent
        qbits.quantize(_norm, "none")(_P, _X)
    assert [str(w.message)[:45] for w in caught] == [
        "qbits.flax.quantize: the config 'mxfp8' quant"
    ]
    with pytest.warns(UserWarning, match="qbits.flax.layer_table: .* no matmul"):
        qbits.flax.layer_table(Scale(), "mxfp8", x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qbits.nnx.quantize(nnx.LayerNorm(4, rngs=nnx.Rngs(0)), "int8_fwd", x)
    assert len(caught) == 1 and "qbits.nnx.quantize" in str(caught[0].message)


def test_config_errors_from_quantize_and_convert_name_the_rule_and_the_matmul():
    def f(p, x):
        return x @ p["fc"]

    p, x = {"fc": jnp.ones((48, 4))}, jnp.ones((2, 48))
    rules = qbits.QuantConfig(rules=(qbits.Rule("fc", "int4_weight_only"),))
    where = r"rules\[0\]\.config\.fwd\.rhs\.granularity\.tile_size"
    with pytest.raises(qbits.ConfigError, match=where + r".*in layer 'fc'"):
        qbits.quantize(f, rules)(p, x)
    with pytest.raises(qbits.ConfigError, match=where + r".*in layer 'fc'"):
        qbits.serving.convert(f, rules, p, x)


def test_vmap_of_a_quantized_function_scales_each_example_on_its_own():
    """Per-tensor scales: ``vmap(quantize(f))`` quantizes each example's
    tensors alone (vmap's contract: each example as if called alone);
    ``quantize(vmap(f))`` quantizes the batched function, whose tensors span
    the batch, with one scale."""

    def f(w, x):
        return x @ w

    w = jnp.ones((4, 2))
    xs = jnp.stack([jnp.full((3, 4), 0.01), jnp.linspace(-8.0, 8.0, 12).reshape(3, 4)])
    xs = xs.at[0, 0, 0].set(0.013)  # a value the shared scale cannot resolve
    per_example = jax.vmap(qbits.quantize(f, "fp8"), in_axes=(None, 0))(w, xs)
    alone = jnp.stack([qbits.quantize(f, "fp8")(w, x) for x in xs])
    np.testing.assert_array_equal(per_example, alone)
    shared = qbits.quantize(jax.vmap(f, in_axes=(None, 0)), "fp8")(w, xs)
    assert not np.array_equal(shared[0], alone[0])
    np.testing.assert_array_equal(shared[1], alone[1])


def test_keys_are_checked_where_they_enter():
    def f(p, x):
        return x @ p["w"]

    x = jnp.ones((3, 4))
    for bad in (5, jnp.zeros(2), jnp.stack([jax.random.PRNGKey(0)] * 2)):
        with pytest.raises(qbits.InvalidArgumentError, match=r"qbits\.quantize: key="):
            qbits.quantize(f, "int8", bad)
    model = qbits.flax.quantize(nn.Dense(2), "int8")
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(qbits.InvalidArgumentError, match=r"rngs\['quant'\]=5"):
        model.apply(variables, x, rngs={"quant": 5})
