"""qbits.lora: LoRA and QLoRA on unmodified functions, linen and nnx models."""

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

import qbits
from qbits import lora


def _nbytes(tree):
    """The bytes of a pytree's arrays."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


# The module fixtures run once: these tests share one worker.
pytestmark = pytest.mark.xdist_group("lora")

RNG = np.random.default_rng(0)  # numpy data: jax.random compiles per shape


def _normal(*shape, scale=1.0):
    return jnp.asarray((RNG.normal(size=shape) * scale).astype(np.float32))


def _same(a, b):
    """Pytrees equal bit for bit (numpy: nothing to compile)."""
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def model(p, x):
    """A raw einsum, an activation x activation one, scanned blocks, a head."""
    q = jnp.einsum("btd,dh->bth", x, p["wq"])
    s = jnp.einsum("bth,bsh->bts", q, q)  # no weight: gets no adapter
    h = x + jnp.tanh(q) * jnp.mean(s)
    block = lambda h, w: (h + jnp.tanh(h @ w), None)  # noqa: E731
    h = jax.lax.scan(block, h, p["blocks"])[0]
    return h @ p["head"]


PARAMS = {
    "wq": _normal(64, 64, scale=0.1),
    "blocks": _normal(2, 64, 64, scale=0.1),
    "head": _normal(64, 8, scale=0.1),
}
X = _normal(2, 3, 64)


def _trained(adapters, seed=1):
    """Adapters as if trained: B no longer zero (numpy: nothing to compile)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda v: jnp.asarray(
            (np.asarray(v) + rng.normal(size=v.shape) * 0.05).astype(v.dtype)
        ),
        adapters,
    )


RUN_MODEL = jax.jit(model)


@pytest.fixture(scope="module")
def qlora():
    """QLoRA (NF4 base) on the model, and the NF4 model itself, jitted."""
    cfg = lora.LoraConfig(rank=4, base="nf4")
    fn, base, adapters = lora.apply(model, cfg, PARAMS, X, key=jax.random.key(0))
    nf4_model = jax.jit(qbits.quantize(model, fn.base_rules))
    return cfg, fn, base, adapters, nf4_model


@pytest.mark.optimized
def test_qlora_base_is_packed_and_starts_as_the_quantized_model(qlora):
    _, fn, base, adapters, nf4_model = qlora
    rows = {la.path: la for la in fn.layers}
    assert [p for p, la in rows.items() if la.rank] == ["wq", "blocks", "head"]
    assert rows["bth,bsh->bts"].why_not.startswith("activation x activation")
    assert adapters["blocks"]["a"].shape == (2, 64, 4)  # one per scanned layer
    assert adapters["head"]["b"].shape == (4, 8)
    assert not np.asarray(adapters["head"]["b"]).any()
    # The base holds packed 4-bit codes and a scale per 64 weights, no floats.
    for name, w in PARAMS.items():
        assert base.params[name].shape == (0,)
        qt = base.weights[name]
        assert qt.qvalue.dtype == jnp.uint8 and qt.qvalue.size * 2 == w.size
        assert qt.scale.dtype == jnp.float32 and qt.scale.size * 64 == w.size
    assert _nbytes(base) == _nbytes(PARAMS) * 4.5 / 32
    assert _nbytes(adapters) == 4 * 4 * (64 + 64 + 2 * (64 + 64) + 64 + 8)
    # B = 0: the NF4 base model, bit for bit.
    assert _same(jax.jit(fn)(adapters, base, X), nf4_model(PARAMS, X))
    assert "| wq | einsum (activation x weight) |" in str(fn)


@pytest.fixture(scope="module")
def float_lora():
    """LoRA (float base) on the model."""
    cfg = lora.LoraConfig(rank=2, alpha=4)
    return lora.apply(model, cfg, PARAMS, X, key=jax.random.key(0))


def test_only_the_adapters_train_through_the_quantized_base(qlora):
    _, fn, base, adapters, _ = qlora
    y = jnp.asarray(RNG.normal(size=(2, 3, 8)).astype(np.float32))

    def loss(ad, base):
        return jnp.mean((fn(ad, base, X) - y) ** 2)

    grad = jax.jit(jax.value_and_grad(loss))
    opt = optax.adam(1e-2)  # sees the adapters only

    @jax.jit
    def update(ad, g, state):
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
            updates, state = opt.update(g, state)
        return optax.apply_updates(ad, updates), state

    state, frozen = opt.init(adapters), jax.tree.map(np.array, base)
    ad, losses, grads = adapters, [], []
    for _ in range(4):
        value, g = grad(ad, base)
        losses.append(float(value))
        grads.append(g)
        ad, state = update(ad, g, state)
    first = grads[0]
    assert losses[-1] < losses[0]
    assert _same(base, frozen)
    assert jax.tree.structure(first) == jax.tree.structure(adapters)
    # B = 0: A gets no gradient, and B's is scale * A^T dW, with dW the
    # weight's gradient in the model run on the base's dequantized weights:
    # the gradient reaches every adapter through the NF4 matmuls as through
    # their dequantized weights in float.
    dequantized = lora.merge(fn, adapters, base)
    dw = jax.jit(jax.grad(lambda p: jnp.mean((model(p, X) - y) ** 2)))(dequantized)
    for la in fn.layers:
        if la.rank is None:
            continue
        a = np.asarray(adapters[la.path]["a"])
        want = la.scale * np.einsum("...kr,...kn->...rn", a, np.asarray(dw[la.path]))
        assert not np.asarray(first[la.path]["a"]).any()
        atol = 1e-5 * np.abs(want).max()  # float rounding, summed differently
        np.testing.assert_allclose(first[la.path]["b"], want, rtol=1e-4, atol=atol)


def test_dropout_only_with_a_key():
    cfg = lora.LoraConfig(rank=2, dropout=0.5)
    fn, base, ad = lora.apply(
        lambda p, x: x @ p["w"],
        cfg,
        {"w": _normal(8, 4)},
        X[0, :, :8],
        key=jax.random.key(0),
    )
    ad = _trained(ad)

    @jax.jit
    def outs(ad, base, x):
        keys = jax.random.key(0), jax.random.key(1), None
        return [fn(ad, base, x, dropout_key=k) for k in keys]

    x = np.asarray(X[0, :, :8])
    a, b, c = (np.asarray(y) for y in outs(ad, base, x))
    assert not np.allclose(a, b) and not np.allclose(a, c)
    no_dropout = x @ np.asarray(base.params["w"]) + (
        x @ np.asarray(ad["w"]["a"]) @ np.asarray(ad["w"]["b"]) * fn.layers[0].scale
    )
    np.testing.assert_allclose(c, no_dropout, rtol=1e-5, atol=1e-5)


def test_merge_float_and_quantized_base(float_lora, qlora):
    # Float base: the merged model equals the adapted one within float rounding.
    fn, base, ad = float_lora
    ad = _trained(ad)
    merged = lora.merge(fn, ad, base)
    assert jax.tree.map(jnp.shape, merged) == jax.tree.map(jnp.shape, PARAMS)
    run_model = RUN_MODEL
    np.testing.assert_allclose(
        run_model(merged, X), jax.jit(fn)(ad, base, X), rtol=1e-5, atol=1e-5
    )
    # NF4 base: merged = dequantized base + update, equal to the adapted model
    # within float rounding. Quantized again, each weight moves to its NF4
    # grid once more: by at most half the widest gap between two NF4 levels
    # (0.139) times its block's absmax (blocks of 64 along K), tested per
    # weight; the model's output then moves by as much as quantizing a model
    # to NF4 moves it: here under twice the NF4 base's distance from float.
    _, fn, base, ad, nf4_model = qlora
    ad = _trained(ad)
    merged = lora.merge(fn, ad, base)
    unmerged = jax.jit(fn)(ad, base, X)
    np.testing.assert_allclose(run_model(merged, X), unmerged, rtol=1e-5, atol=1e-5)
    levels = np.asarray(qbits.numerics.Nf4Numerics().levels)
    w = np.asarray(merged["head"])
    bound = np.max(np.diff(levels)) / 2 * np.abs(w).max(axis=0, keepdims=True)
    fwd = fn.base_rules.resolve("head").config.fwd
    requantized = jax.jit(lambda w: qbits.ops._store_weight(w, fwd, (0,)).dequant())
    assert (np.abs(np.asarray(requantized(w)) - w) <= bound * (1 + 1e-6)).all()
    gap = np.abs(np.asarray(nf4_model(merged, X)) - np.asarray(unmerged)).max()
    base_gap = np.asarray(nf4_model(PARAMS, X)) - np.asarray(run_model(PARAMS, X))
    assert 0 < gap < 2 * np.abs(base_gap).max()  # measured: 1.6x


def _conv1d(p, x):
    """Kernels as Hugging Face's GPT-2 stores them: (out, in), transposed."""
    h = jax.nn.gelu(x @ p["c_fc"].T)  # square: the shape cannot tell
    heads = p["o_proj"].reshape(4, 16, 64)  # (heads * dim, D) as (heads, dim, D)
    h = jnp.einsum("bhd,hde->be", h.reshape(-1, 4, 16), heads)
    return h @ p["c_proj"].T


def test_merge_writes_rearranged_kernels_back_and_names_another_base(float_lora):
    params = {"c_fc": _normal(64, 64, scale=0.1), "o_proj": _normal(64, 64),
              "c_proj": _normal(8, 64, scale=0.1)}  # fmt: skip
    x = _normal(4, 64)
    # The heads' kernel float (NF4's blocks of 64 do not fit its 16-wide axis).
    nf4 = qbits.QuantConfig(rules=(qbits.Rule("o_proj", None),), default="nf4")
    for cfg in (lora.LoraConfig(rank=2), lora.LoraConfig(rank=2, base=nf4)):
        fn, base, ad = lora.apply(_conv1d, cfg, params, x, key=jax.random.key(2))
        assert all(not la.merge for la in fn.layers)
        ad = _trained(ad)
        merged = lora.merge(fn, ad, base)
        np.testing.assert_allclose(
            jax.jit(_conv1d)(merged, x), jax.jit(fn)(ad, base, x), rtol=1e-5, atol=1e-5
        )
    # Another model's base: named, with the parameters that differ.
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"base=.*no parameter \['c_fc'\]"
    ):
        lora.merge(fn, ad, float_lora[1])


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="head")(nn.relu(nn.Dense(64, name="fc")(x)))


def test_linen_and_nnx_models():
    x = _normal(4, 64)
    mlp = _Mlp()  # its variables, as mlp.init would make them
    variables = {"params": {
        "fc": {"kernel": _normal(64, 64, scale=0.1), "bias": _normal(64)},
        "head": {"kernel": _normal(64, 8, scale=0.1), "bias": _normal(8)},
    }}  # fmt: skip
    cfg = lora.LoraConfig(
        rank=2, rules=(lora.LoraRule("head", rank=4), lora.LoraRule("fc"))
    )
    fn, base, ad = lora.apply(mlp, cfg, variables, x, key=jax.random.key(1))
    assert {p: ab["a"].shape for p, ab in ad.items()} == {
        "fc": (64, 2),
        "head": (64, 4),
    }
    ad = _trained(ad)
    merged = lora.merge(fn, ad, base)
    np.testing.assert_allclose(
        jax.jit(mlp.apply)(merged, x), jax.jit(fn)(ad, base, x), rtol=1e-5, atol=1e-5
    )

    init = lambda key, shape, dtype: _normal(*shape, scale=0.1)  # noqa: E731
    net = nnx.Sequential(
        nnx.Linear(64, 64, kernel_init=init, rngs=nnx.Rngs(0)),
        nnx.relu,
        nnx.Linear(64, 8, kernel_init=init, rngs=nnx.Rngs(1)),
    )
    cfg = lora.LoraConfig(rank=2, base="nf4")
    fn, base, ad = lora.apply(net, cfg, x, key=jax.random.key(1))
    assert sorted(ad) == ["layers/0", "layers/2"]
    assert base.weights["layers/0"].qvalue.dtype == jnp.uint8
    ad = _trained(ad)
    out, _ = jax.jit(fn)(ad, base, x)  # as qbits.nnx.as_function: (output, state)
    nnx.update(net, lora.merge(fn, ad, base))
    merged_out = nnx.jit(lambda m, x: m(x))(net, x)
    np.testing.assert_allclose(merged_out, out, rtol=1e-5, atol=1e-5)


def test_adapters_checkpoint_round_trip(tmp_path, qlora):
    cfg, _, _, ad, _ = qlora
    ad = _trained(ad)
    path = tmp_path / "adapters"
    lora.save_adapters(path, ad, cfg)
    like = jax.eval_shape(lambda: ad)
    back = lora.restore_adapters(path, like, cfg)
    assert _same(ad, back)
    with pytest.raises(qbits.ConfigError, match="saved with another config"):
        lora.restore_adapters(path, like, lora.LoraConfig(rank=4))  # float base
    other = {"head": {"a": jnp.ones((64, 3)), "b": jnp.ones((3, 8))}}
    with pytest.raises(qbits.InvalidArgumentError, match="another model"):
        lora.restore_adapters(path, other)
    with pytest.raises(qbits.InvalidArgumentError, match="force=True"):
        lora.save_adapters(path, ad, cfg)
    zeros = jax.tree.map(lambda v: np.zeros(v.shape, v.dtype), ad)
    lora.save_adapters(path, zeros, cfg, force=True)
    assert not np.asarray(lora.restore_adapters(path, like)["head"]["a"]).any()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(qbits.InvalidArgumentError, match="meta item"):
        lora.save_adapters(tmp_path / "mine", ad, cfg, force=True)
    assert (tmp_path / "mine" / "notes.txt").exists()


def test_config_is_plain_data_and_yaml(tmp_path):
    base = qbits.QuantConfig(rules=(qbits.Rule("head", None),), default="nf4")
    for cfg in (
        lora.LoraConfig(),
        lora.LoraConfig(
            rank=4,
            alpha=8.0,
            dropout=0.1,
            init="gaussian",
            base=base,
            rules=(
                lora.LoraRule("head", adapt=False),
                lora.LoraRule(".*attn.*", rank=2, alpha=2.0),
                lora.LoraRule(".*"),
            ),
        ),
        lora.LoraConfig(base=qbits.presets.get("w4g128_asym")),
    ):
        text = qbits.config.dump(cfg)
        assert qbits.load_config(yaml.safe_load(text), lora.LoraConfig) == cfg
    path, cfg = tmp_path / "lora.yaml", lora.LoraConfig(rank=2, alpha=4.0)
    qbits.config.dump(cfg, path)
    w, x = np.ones((64, 4), np.float32), np.ones((1, 64), np.float32)
    fn, _, _ = lora.apply(lambda p, x: x @ p["w"], str(path), {"w": w}, x,
                          key=jax.random.key(0))  # fmt: skip
    assert fn.config == cfg
    path.write_text("rank: 0\n")
    with pytest.raises(qbits.ConfigError, match=r"lora\.yaml: rank: expected an int"):
        lora.apply(
            lambda p, x: x @ p["w"], str(path), {"w": w}, x, key=jax.random.key(0)
        )
    bad = {"rules": [{"pattern": ".*", "rank": 0}]}
    with pytest.raises(
        qbits.ConfigError, match=r"^rules\[0\]\.rank: expected an int >= 1"
    ):
        qbits.load_config(bad, lora.LoraConfig)
    with pytest.raises(qbits.ConfigError, match=r"^base: expected a preset name"):
        qbits.load_config({"base": "nf5"}, lora.LoraConfig)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 0}, r"^rank: expected an int >= 1"),
        ({"rank": True}, r"^rank: expected an int >= 1"),
        ({"alpha": 0.0}, r"^alpha: expected a finite number > 0"),
        ({"alpha": float("nan")}, r"^alpha: expected a finite number > 0"),
        ({"dropout": 1.0}, r"^dropout: expected a number in \[0, 1\)"),
        ({"dropout": -0.1}, r"^dropout: expected a number in \[0, 1\)"),
        ({"init": "xavier"}, r"^init: expected one of kaiming, gaussian"),
    ],
)
def test_bad_configs(kwargs, match):
    with pytest.raises(qbits.ConfigError, match=match):
        lora.LoraConfig(**kwargs)


def test_bad_rules():
    with pytest.raises(qbits.ConfigError, match="exponential time"):
        lora.LoraRule("(a+)+")
    with pytest.raises(qbits.ConfigError, match=r"^rank: expected an int >= 1"):
        lora.LoraRule("head", rank=-2)
    with pytest.raises(qbits.ConfigError, match=r"^rules\[0\]: expected a qbits.lora"):
        lora.LoraConfig(rules=(qbits.Rule("head"),))


def test_rules_that_do_not_fit_the_model(qlora):
    def apply(cfg, **kw):
        return lora.apply(model, cfg, PARAMS, X, key=jax.random.key(0), **kw)

    with pytest.raises(
        qbits.ConfigError, match=r"rules\[1\]\.pattern.*matches no matmul"
    ):
        apply(lora.LoraConfig(rules=(lora.LoraRule("head"), lora.LoraRule("mlp/.*"))))
    with pytest.raises(
        qbits.ConfigError, match=r"matches only bth,bsh->bts: activation"
    ):
        apply(lora.LoraConfig(rules=(lora.LoraRule("bth.*"),)))
    with pytest.raises(qbits.ConfigError, match=r"rules\[0\]\.rank.*1\.\.8.*'head'"):
        apply(lora.LoraConfig(rules=(lora.LoraRule("head", rank=9),)))
    with pytest.raises(qbits.ConfigError, match=r"weight-only config.*'wq'"):
        apply(lora.LoraConfig(base="int8_fwd"))
    with pytest.raises(
        qbits.ConfigError, match=r"^base\.default\.fwd\.rhs\.granularity"
    ):
        lora.apply(  # NF4's blocks of 64 along K = 32: named in the base config
            lambda p, x: x @ p["w"], lora.LoraConfig(rank=2, base="nf4"),
            {"w": jnp.ones((32, 4))}, jnp.ones((1, 32)), key=jax.random.key(0),
        )  # fmt: skip
    with pytest.raises(qbits.ConfigError, match="no matmul gets an adapter"):
        apply(lora.LoraConfig(rules=(lora.LoraRule(".*", adapt=False),)))
    with pytest.raises(qbits.InvalidArgumentError, match="key=None"):
        lora.apply(model, lora.LoraConfig(), PARAMS, X, key=None)
    _, fn, base, ad, _ = qlora
    with pytest.raises(qbits.InvalidArgumentError, match="adapters of exactly"):
        fn({"head": ad["head"]}, base, X)
    with pytest.raises(qbits.InvalidArgumentError, match=r"adapters\['head'\]"):
        fn({**ad, "head": {"a": jnp.ones((64, 3)), "b": jnp.ones((3, 8))}}, base, X)
    with pytest.raises(qbits.InvalidArgumentError, match="LoraBase"):
        fn(ad, PARAMS, X)
