"""One engine under every entry point: linen, nnx and functions of any pytree."""

import dataclasses
import inspect

import equinox as eqx
import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qbits
import qbits.hlo
import qbits.serving as serving

VOCAB, WIDTH, HIDDEN = 8, 256, 256
S8 = ("s8", "s8", "s32")
INIT = nn.initializers.normal(0.05)


class Proj(nn.Module):
    """A custom layer: its own parameter, a raw einsum."""

    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("w", INIT, (x.shape[-1], self.features))
        return jnp.einsum("btd,df->btf", x, w)


class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(Proj(HIDDEN, name="up")(x))
        return h @ self.param("down", INIT, (HIDDEN, WIDTH))  # a raw @


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, WIDTH, name="embed")
        x = embed(tokens)
        x = x + Inner(name="model")(x)  # a submodule named "model"
        table = embed.variables["params"]["embedding"]
        # A tied head through a nested apply, as Hugging Face's GPT-2 has it.
        head = nn.Embed(VOCAB, WIDTH)
        return head.apply({"params": {"embedding": table}}, x, method=head.attend)


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Param(0.05 * jax.random.normal(rngs.params(), (WIDTH, HIDDEN)))
        self.down = nnx.Einsum("btd,df->btf", (HIDDEN, WIDTH), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(jnp.einsum("btd,df->btf", x, self.up[...])))


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.model = Mlp(rngs)  # a submodule named "model"

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.model(x)
        return x @ self.embed.embedding[...].T  # the tied head, a raw @


TOKENS = jax.random.randint(jax.random.key(0), (4, 8), 0, VOCAB)


def _loss(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS).mean()


def _bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_linen_model_through_the_adapter_every_dot_s8_served_bit_for_bit():
    model = LinenLM()
    qmodel = qbits.flax.quantize(model, "int8")
    variables = qmodel.init(jax.random.key(1), TOKENS)
    table = qbits.flax.layer_table(model, "int8", TOKENS)
    assert [r.path for r in table.rows] == ["model/up", "model", "embed"]

    def step(v, key):
        return jax.grad(lambda v: _loss(qmodel.apply(v, TOKENS, rngs={"quant": key})))(
            v
        )

    dots = qbits.hlo.dot_dtypes(step, variables, jax.random.key(2))
    assert len(dots) == 9 and set(dots) == {S8}  # 3 forward, 6 backward
    sp = serving.convert(qmodel, "int8", variables, TOKENS)
    served = jax.jit(serving.serve(model, "int8").apply)(sp, TOKENS)
    key = {"quant": jax.random.key(3)}  # the forward rounds to nearest: any key
    qat = jax.jit(lambda v: qmodel.apply(v, TOKENS, rngs=key))(variables)
    np.testing.assert_array_equal(served, qat)
    assert sp.params["params"]["model"]["down"].shape == (0,)
    assert sp.params["params"]["embed"]["embedding"].shape == (VOCAB, WIDTH)  # read
    assert _bytes(sp) <= 0.27 * _bytes(variables)
    report = serving.size_report(sp)
    assert report.bytes + report.other_bytes == _bytes(sp)


def test_nnx_model_through_the_adapter_every_dot_s8_served_bit_for_bit():
    model = NnxLM(nnx.Rngs(1))
    qmodel = qbits.nnx.quantize(model, "int8", rngs=nnx.Rngs(quant=2))
    table = qbits.nnx.layer_table(model, "int8", TOKENS)
    assert [r.path for r in table.rows] == ["model", "model/down", "embed"]
    graphdef, state = nnx.split(qmodel)

    def step(state):
        return nnx.grad(lambda m: _loss(m(TOKENS)))(nnx.merge(graphdef, state))

    dots = qbits.hlo.dot_dtypes(step, state)
    assert len(dots) == 9 and set(dots) == {S8}
    served = serving.convert(model, "int8", TOKENS)
    run = nnx.jit(lambda m, t: m(t))
    np.testing.assert_array_equal(run(served, TOKENS), run(qmodel, TOKENS))
    assert served.model.up.shape == (0,) and served.model.down.kernel.shape == (0,)
    stored = nnx.state(served, nnx.Not(nnx.RngState))
    assert _bytes(stored) <= 0.27 * _bytes(nnx.state(model))
    report = serving.size_report(served)
    assert report.bytes + report.other_bytes == _bytes(stored)


class EqxMlp(eqx.Module):
    w_in: jax.Array
    w_out: jax.Array

    def __call__(self, x):
        return jax.nn.relu(x @ self.w_in) @ self.w_out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    w_in: jax.Array
    w_out: jax.Array
    scale: jax.Array


def _haiku(p, x):
    x = jax.nn.relu(x @ p["mlp/~/linear_0"]["w"])
    return x @ p["mlp/~/linear_1"]["w"]


def _dataclass(p, x):
    return (jax.nn.relu(x @ p.w_in) @ p.w_out) * p.scale


@pytest.mark.parametrize("kind", ["equinox", "haiku", "dataclass"])
def test_any_pytree_of_parameters_serves_bit_for_bit_without_its_floats(kind):
    k = jax.random.split(jax.random.key(0), 3)
    w_in = jax.random.normal(k[0], (64, 128))
    w_out = jax.random.normal(k[1], (128, 8))
    x = jax.random.normal(k[2], (4, 64))
    if kind == "equinox":
        params, fn = EqxMlp(w_in, w_out), lambda m, x: m(x)
        names, dropped = ["w_in", "w_out"], lambda sp: (sp.w_in, sp.w_out)
    elif kind == "haiku":
        params = {"mlp/~/linear_0": {"w": w_in}, "mlp/~/linear_1": {"w": w_out}}
        fn = _haiku
        names = ["mlp/~/linear_0", "mlp/~/linear_1"]

        def dropped(sp):
            return sp["mlp/~/linear_0"]["w"], sp["mlp/~/linear_1"]["w"]
    else:
        params, fn = Weights(w_in, w_out, jnp.ones(())), _dataclass
        names, dropped = ["w_in", "w_out"], lambda sp: (sp.w_in, sp.w_out)
    sp = serving.convert(fn, "w4a8", params, x)
    assert [info.path for info in sp.layers] == names
    assert all(a.shape == (0,) for a in dropped(sp.params))  # no float copies
    served = jax.jit(serving.serve(fn, "w4a8"))(sp, x)
    np.testing.assert_array_equal(
        served, jax.jit(qbits.quantize(fn, "w4a8"))(params, x)
    )
    assert _bytes(sp) < 0.16 * _bytes(params)


def test_flat_keys_name_every_block_uniquely_and_rules_reach_each():
    """Haiku/penzai flat keys: each block's attention einsum has its own name,
    a rule for one block reaches it, the table and the state agree, and an
    elementwise dot_general (a norm's scale) is no matmul."""

    def block(p, name, x):
        q = x @ p[f"{name}/attn/q"]["w"]
        k = x @ p[f"{name}/attn/k"]["w"]
        v = x @ p[f"{name}/attn/v"]["w"]
        scores = jnp.einsum("bqd,bkd->bqk", q, k)
        x = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), v)
        scale = p[f"{name}/norm"]["scale"]  # elementwise, no contraction
        out = jax.lax.dot_general(x, scale, (((), ()), ((2,), (0,))))
        return jnp.moveaxis(out, 0, -1)

    def model(p, x):
        return block(p, "block_1", block(p, "block_0", x))

    w = jnp.eye(8)
    params = {f"block_{i}/attn/{part}": {"w": w} for i in range(2) for part in "qkv"}
    params |= {f"block_{i}/norm": {"scale": jnp.ones(8)} for i in range(2)}
    x = jnp.ones((2, 3, 8))
    rules = qbits.QuantConfig(rules=(qbits.Rule("block_0/.*", None),),
                              default="fp8_delayed")  # fmt: skip
    table = qbits.layer_table(model, rules, params, x)
    paths = [r.path for r in table.rows]
    assert paths == [
        "block_0/attn/q", "block_0/attn/k", "block_0/attn/v",
        "block_0/attn/bqd,bkd->bqk", "block_0/attn/bqk,bkd->bqd",
        "block_1/attn/q", "block_1/attn/k", "block_1/attn/v",
        "block_1/attn/bqd,bkd->bqk", "block_1/attn/bqk,bkd->bqd",
    ]  # fmt: skip
    assert [r.describe() for r in table.rows] == ["float"] * 5 + ["fp8_delayed"] * 5
    state = qbits.init_state(model, rules, params, x)
    assert sorted(state) == sorted(paths[5:])


def test_entry_points_are_written_once_and_name_their_caller():
    """Each entry point's public form has no caller; the private one names it."""
    public = (qbits.quantize, qbits.init_state, qbits.layer_table,
              qbits.transform.adapt, qbits.transform.observe_matmuls)  # fmt: skip
    for fn in public:
        assert "caller" not in inspect.signature(fn).parameters, fn.__name__
        assert fn.__doc__ == fn.__wrapped__.__doc__ and "Example" in fn.__doc__
    with pytest.raises(qbits.InvalidArgumentError, match=r"^qbits\.quantize: "):
        qbits.quantize(42, None)
    with pytest.raises(qbits.InvalidArgumentError, match=r"^qbits\.transform\.adapt"):
        qbits.transform.adapt(42, None, qbits.transform.Adapter(), {})
    serve = qbits.transform._Caller("qbits.serving.serve")
    with pytest.raises(qbits.InvalidArgumentError, match=r"^qbits\.serving\.serve: "):
        qbits.transform._quantize(serve, 42, None)
