"""qbits.kvcache: the cache config, quantize on write, decoding, errors."""

import functools
import inspect

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits import kvcache
from qbits._experiments import Classifier, TransformerLM, spec

# The module fixtures run once: these tests share one worker.
pytestmark = pytest.mark.xdist_group("kvcache")

VOCAB = 12
B, C, H, D = 2, 8, 2, 4  # batch, capacity, heads, head_dim of the cache tests


@pytest.fixture(scope="module")
def lm():
    """The tiny LM with random weights from numpy (no compiled initialisers)."""
    model = nnx.eval_shape(
        lambda: TransformerLM(VOCAB, spec("lm", "tiny"), rngs=nnx.Rngs(3))
    )
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)

    def fill(x):  # every state of the model is a float parameter
        return jnp.asarray(0.5 * rng.standard_normal(x.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree.map(fill, state))


def test_float_cache_decode_equals_full_recompute(lm):
    """Greedy decoding with a float cache is the full forward pass, step by step."""
    prompt = np.random.default_rng(0).integers(0, VOCAB, (2, 5), np.int32)
    # 5 + 11 tokens fill the context of 16; the 13th comes from a cache
    # rebuilt from the last 8 tokens.
    tokens, logits = kvcache.generate(lm, prompt, 13, return_logits=True)
    tokens, logits = np.asarray(tokens), np.asarray(logits)
    graphdef, state = nnx.split(lm)
    forward = jax.jit(lambda state, t: nnx.merge(graphdef, state)(t))
    # The full forward over the sequence: causal, so each position's logits
    # are those of recomputing over the sequence up to it.
    sequence = np.concatenate([prompt, tokens[:, :11]], axis=1)
    window = np.concatenate([prompt, tokens[:, :12]], axis=1)[:, -8:]
    padded = np.concatenate([window, np.zeros_like(window)], axis=1)
    full = np.asarray(forward(state, sequence))[:, 4:]
    after = np.asarray(forward(state, padded))[:, 7:8]
    expected = np.concatenate([full, after], axis=1)
    np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(tokens, expected.argmax(-1))


@functools.partial(jax.jit, static_argnums=0)
def _write_twice(name, first, later):
    """A cache of ``name`` after a 3-token write and a 1-token one, and checks."""
    cache = kvcache.KVCache.create(name, B, C, H, D).append(first, -first)
    grown = cache.append(later, -later)
    q = grown.config.quantizer("keys")
    alone = [q.quant(x).dequant() for x in (first, later)]
    return cache, grown, grown.read(), alone


@pytest.mark.parametrize(
    ("name", "stored", "scales"),
    [
        ("kv_int8", "int8", (B, C, H, 1)),
        ("kv_fp8_per_head", "float8_e4m3fn", (B, 1, H, 1)),
    ],
)
def test_quantized_cache_stores_codes_once_per_token(name, stored, scales):
    first = np.random.default_rng(1).standard_normal((B, 3, H, D), np.float32)
    later = 4 * np.random.default_rng(2).standard_normal((B, 1, H, D), np.float32)
    cache, grown, read, alone = jax.device_get(_write_twice(name, first, later))
    for before, after in ((cache.keys, grown.keys), (cache.values, grown.values)):
        assert after.qvalue.dtype == np.dtype(stored)
        assert after.scale.shape == scales and after.scale.dtype == np.float32
        # Written once: the earlier positions keep their codes and scales.
        np.testing.assert_array_equal(
            after.qvalue[:, :3].astype(np.float32),
            before.qvalue[:, :3].astype(np.float32),
        )
        np.testing.assert_array_equal(after.scale[:, :3], before.scale[:, :3])
    # The stated bytes: one per value, four per scale; float32: four per value.
    assert grown.nbytes == 2 * (B * C * H * D + 4 * int(np.prod(scales)))
    assert kvcache.KVCache.create(None, B, C, H, D).nbytes == 2 * 4 * B * C * H * D
    keys, values = read
    np.testing.assert_array_equal(keys[:, :3], alone[0])  # each token's own scale
    if name.endswith("per_head"):  # the prompt's scale: the loud token saturates
        np.testing.assert_array_equal(grown.keys.scale, cache.keys.scale)
        top = grown.config.keys.abs_val_mapped_to()
        assert np.abs(keys[:, 3]).max() <= top * cache.keys.scale.max()
        assert np.abs(keys[:, 3]).max() < np.abs(later).max()
    else:  # per token: what quantizing the new token alone gives
        np.testing.assert_array_equal(keys[:, 3:4], alone[1])
    np.testing.assert_array_equal(keys[:, 4:], 0.0)  # not yet written
    assert np.abs(values[:, :3] + first).max() < 0.1 * np.abs(first).max()


def test_presets_round_trip_through_yaml(tmp_path):
    names = ("kv_float", "kv_int8", "kv_fp8", "kv_int8_per_head", "kv_fp8_per_head")
    for name in names:
        cfg = qbits.load_config(name, kvcache.CacheConfig)
        data = qbits.config._to_dict(cfg)
        assert qbits.load_config(data, kvcache.CacheConfig) == cfg
        path = tmp_path / f"{name}.yaml"
        qbits.config.dump(cfg, path)
        assert qbits.load_config(path, kvcache.CacheConfig) == cfg
    (tmp_path / "named.yaml").write_text("kv_fp8\n")
    assert qbits.load_config(
        tmp_path / "named.yaml", kvcache.CacheConfig
    ).keys.dtype.name == ("float8_e4m3fn")
    assert kvcache._as_cache_config("t", None).is_float
    assert kvcache.CacheConfig(qbits.numerics.NoNumerics()) == qbits.load_config(
        "kv_float", kvcache.CacheConfig
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keys": qbits.IntNumerics(bits=4)}, "keys=IntNumerics(bits=4"),
        ({"values": qbits.numerics.UintNumerics(bits=8)}, "values=UintNumerics"),
        (
            {"keys": qbits.IntNumerics(bits=8, noise_fn=qbits.numerics.UniformNoise())},
            "rounds stochastically",
        ),
        ({"values": qbits.FpNumerics("float8_e4m3fn", clip=False)}, "clip=False"),
        ({"granularity": "per_channel"}, "expected one of per_token, per_head"),
    ],
)
def test_bad_cache_configs(kwargs, message):
    with pytest.raises(qbits.InvalidArgumentError, match="CacheConfig: ") as e:
        kvcache.CacheConfig(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keys: {type: int, bits: 4}\n", "bad.yaml: keys: expected None (float)"),
        ("values: {type: int, bits: 32}\n", "bad.yaml: values.bits: expected an int"),
        ("keys: {type: intt}\n", "bad.yaml: keys.type: expected one of int, fp"),
        ("granularity: per_row\n", "bad.yaml: granularity: expected one of"),
        ("key: {type: int, bits: 8}\n", "bad.yaml: key: expected one of the keys"),
        ("int8\n", "bad.yaml: expected a cache preset: kv_float"),
        ("", "bad.yaml: expected a mapping"),
    ],
)
def test_bad_cache_config_files_name_the_file_and_place(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(qbits.ConfigError) as e:
        qbits.load_config(path, kvcache.CacheConfig)
    assert str(e.value).startswith(str(tmp_path)) and message in str(e.value)


def test_cache_arguments_are_checked():
    with pytest.raises(qbits.InvalidArgumentError, match=r"cache='int8'.*kv_int8"):
        kvcache.KVCache.create("int8", 1, 2, 1, 1)  # a matmul preset
    with pytest.raises(qbits.InvalidArgumentError, match=r"source='int8'.*kv_int8"):
        qbits.load_config("int8", kvcache.CacheConfig)
    with pytest.raises(qbits.InvalidArgumentError, match=r"missing\.yaml"):
        qbits.load_config("missing.yaml", kvcache.CacheConfig)
    with pytest.raises(qbits.InvalidArgumentError, match="capacity=0"):
        kvcache.KVCache.create("kv_int8", 1, 0, 1, 1)
    with pytest.raises(qbits.InvalidArgumentError, match="dtype=int32"):
        kvcache.KVCache.create(None, 1, 2, 1, 1, jnp.int32)
    cache = kvcache.KVCache.create(None, 1, 2, 1, 4)
    x = jnp.ones((1, 2, 1, 4))
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"keys='float32\[1, 2, 2, 4\]'"
    ):
        cache.append(jnp.ones((1, 2, 2, 4)), x)
    with pytest.raises(qbits.InvalidArgumentError, match=r"values='float32\[1, 1"):
        cache.append(x, x[:, :1])
    full = cache.append(x, x)
    with pytest.raises(qbits.InvalidArgumentError, match="2 of 2 positions"):
        full.append(x[:, :1], x[:, :1])
    with pytest.raises(qbits.InvalidArgumentError, match="attend: query="):
        kvcache.attend(jnp.ones((1, 3, 1, 4)), full)


def test_models_without_a_cache_are_refused(lm):
    classifier = nnx.eval_shape(
        lambda: Classifier(8, 3, spec("mlp", "tiny"), rngs=nnx.Rngs(0))
    )
    with pytest.raises(qbits.InvalidArgumentError, match="it has no KV cache"):
        kvcache.generate(classifier, jnp.ones((1, 2), jnp.int32), 1, cache="kv_int8")
    deep = nnx.eval_shape(
        lambda: TransformerLM(VOCAB, spec("lm", "deep"), rngs=nnx.Rngs(0))
    )
    with pytest.raises(qbits.InvalidArgumentError, match="scanned blocks"):
        deep.init_cache(1, "kv_int8")
    with pytest.raises(qbits.InvalidArgumentError, match="scanned blocks"):
        kvcache.generate(deep, jnp.ones((3,), jnp.int32), 1)
    quantized = qbits.nnx.quantize(lm, "int8_fwd")
    with pytest.raises(qbits.InvalidArgumentError, match="a quantized copy"):
        quantized.init_cache(1, "kv_int8")
    with pytest.raises(qbits.InvalidArgumentError, match="cache='kv_int4'"):
        lm.init_cache(1, "kv_int4")
    with pytest.raises(qbits.InvalidArgumentError, match="the tuple of 1 KVCache"):
        lm.decode(
            jnp.ones((1, 2), jnp.int32), kvcache.KVCache.create(None, 1, 16, 2, 8)
        )
    with pytest.raises(qbits.InvalidArgumentError, match=r"tokens='float32\[1, 2\]'"):
        lm.decode(jnp.ones((1, 2)), lm.init_cache(1))
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"(?s)tokens\[1, 0\] = -3.*vocabulary"
    ):
        lm.decode(jnp.array([[2, 1], [-3, 4]], jnp.int16), lm.init_cache(2))


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        (jnp.ones((1, 2)), {}, "prompt='float32[1, 2]'"),
        (jnp.ones((1, 0), jnp.int32), {}, "length >= 1"),
        ([1, 2], {}, "prompt=[1, 2]"),
        (jnp.ones((2,), jnp.int32), {"steps": -1}, "steps=-1"),
        (jnp.ones((2,), jnp.int32), {"temperature": -0.5}, "temperature=-0.5"),
        (jnp.ones((2,), jnp.int32), {"seed": 2**32}, "seed=4294967296"),
        (jnp.ones((2,), jnp.int32), {"cache": "fp8"}, "cache='fp8'"),
        (jnp.ones((2,), bool), {}, "bool[2]"),
        # Ids outside the vocabulary (12): too large, negative, a wrapped uint.
        (
            np.array([[3, VOCAB, 5], [0, 1, -2]]),
            {},
            f"prompt[0, 1] = {VOCAB}, prompt[1, 2] = -2",
        ),
        (np.array([7, 255], np.uint8), {}, "prompt[1] = 255"),
    ],
)
def test_generate_arguments_are_checked(lm, prompt, kwargs, message):
    kwargs = {"steps": 1, **kwargs}
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"qbits\.kvcache\.generate: "
    ) as e:
        kvcache.generate(lm, prompt, **kwargs)
    assert message in str(e.value)


def test_public_names_are_documented_with_examples():
    for name in kvcache.__all__:
        obj = getattr(kvcache, name)
        if callable(obj):
            doc = inspect.getdoc(obj) or ""
            assert "Example" in doc, name
