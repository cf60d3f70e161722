import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits.numerics._keys import hash_bits
from tests.helpers import FLOAT_DTYPES, bits_equal


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_no_numerics_is_the_identity(dtype):
    x = jnp.array([0.1, -0.0, jnp.nan, jnp.inf, 3e4], dtype)
    n = qbits.numerics.NoNumerics()
    y = n(x)
    assert y.dtype == dtype and bits_equal(y, x)
    assert n.get_dtype() is None and n.abs_val_mapped_to() is None
    g = jax.grad(lambda x: jnp.sum(n(x) * x))(jnp.array([1.0, 2.0]))
    np.testing.assert_array_equal(g, [2.0, 4.0])


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_uniform_noise_range_and_determinism(make_key):
    noise = qbits.numerics.UniformNoise()
    u = noise((10000,), make_key(0))
    assert u.dtype == jnp.float32
    assert float(u.min()) >= -0.5 and float(u.max()) < 0.5
    assert abs(float(u.mean())) < 0.02
    np.testing.assert_array_equal(u, noise((10000,), make_key(0)))
    assert not np.array_equal(u, noise((10000,), make_key(1)))


def test_context_is_a_pytree():
    ctx = qbits.numerics.Context(jax.random.key(0))
    assert len(jax.tree_util.tree_leaves(ctx)) == 1
    assert jax.tree_util.tree_leaves(qbits.numerics.Context()) == []


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_next_key_chains_distinct_keys_of_the_same_kind(make_key):
    key = make_key(0)
    chain = [key]
    for _ in range(64):
        chain.append(qbits.numerics.next_key(chain[-1]))

    def words(k):
        return np.asarray(jax.random.key_data(k) if k.dtype != jnp.uint32 else k)

    assert len({words(k).tobytes() for k in chain}) == len(chain)
    assert all(k.dtype == key.dtype and k.shape == key.shape for k in chain)
    again = qbits.numerics.next_key(make_key(0))
    np.testing.assert_array_equal(words(chain[1]), words(again))
    # Noise from neighbouring links is unrelated.
    noise = qbits.numerics.UniformNoise()
    a, b = noise((20000,), chain[1]), noise((20000,), chain[2])
    assert abs(float(jnp.corrcoef(a, b)[0, 1])) < 0.03


def test_hash_bits_depend_on_every_word_of_the_key():
    base = jnp.array([7, 11], jnp.uint32)
    bits = hash_bits(base, (256,))
    for other in ([8, 11], [7, 12], [11, 7]):
        changed = hash_bits(jnp.array(other, jnp.uint32), (256,))
        assert float(jnp.mean(bits == changed)) < 0.05


@pytest.mark.parametrize(
    "key",
    [
        jax.random.key(0),
        jax.random.PRNGKey(3),
        jax.random.key(0, impl="rbg"),
        jax.random.split(jax.random.key(5), 3),
    ],
    ids=["key", "legacy", "rbg", "batch"],
)
def test_hash_key_is_a_typed_key_that_jax_random_uses(key):
    k = qbits.numerics._hash_key(key)
    assert jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
    assert k.shape == (key.shape[:-1] if key.dtype == jnp.uint32 else key.shape)
    assert qbits.numerics._hash_key(k) is k
    one = k if k.ndim == 0 else k[0]
    u = jax.random.uniform(one, (100000,))
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(u.var()) - 1 / 12) < 0.002
    n = jax.random.normal(one, (100000,))
    assert abs(float(n.mean())) < 0.02 and abs(float(n.std()) - 1) < 0.02
    for dtype in (jnp.uint8, jnp.uint16, jnp.uint32):
        bits = jax.random.bits(one, (4096,), dtype)
        assert bits.dtype == dtype
        assert len(np.unique(np.asarray(bits))) > min(
            200, 2 ** (8 * bits.itemsize) // 2
        )
    # Deterministic: the same key gives the same hash key and bits.
    np.testing.assert_array_equal(
        jax.random.key_data(qbits.numerics._hash_key(key)), jax.random.key_data(k)
    )


def test_hash_key_fold_in_and_split_give_distinct_unrelated_keys():
    k = qbits.numerics._hash_key(jax.random.key(0))
    folded = jax.vmap(lambda i: jax.random.fold_in(k, i))(jnp.arange(4096))
    split = jax.random.split(k, 4096)
    for keys in (folded, split):
        words = np.asarray(jax.random.key_data(keys))
        assert len({w.tobytes() for w in words}) == len(words)
        u = jax.vmap(lambda kk: jax.random.uniform(kk))(keys)
        assert abs(float(u.mean()) - 0.5) < 0.02
        assert abs(float(jnp.corrcoef(u[:-1], u[1:])[0, 1])) < 0.05
    # split and fold_in are different derivations
    assert not np.array_equal(
        jax.random.key_data(folded[1]), jax.random.key_data(split[1])
    )
    # Different source keys give different hash keys, for every PRNG.
    sources = [jax.random.key(i) for i in range(64)]
    sources += [jax.random.key(i, impl="rbg") for i in range(64)]
    words = {
        np.asarray(jax.random.key_data(qbits.numerics._hash_key(s))).tobytes()
        for s in sources
    }
    assert len(words) == len(sources)


_INT8 = qbits.presets.get("int8")
_NOISY = qbits.Quantizer(qbits.IntNumerics(noise_fn=qbits.numerics.UniformNoise()))


@pytest.mark.parametrize(
    ("call", "owner", "why"),
    [
        (lambda: qbits.numerics._hash_key(7), "hash_key", "a seed, not a key"),
        (
            lambda: qbits.numerics._hash_key(jnp.ones(1, jnp.uint32)),
            "hash_key",
            "words",
        ),
        (lambda: qbits.numerics._hash_key(jnp.zeros(2)), "hash_key", "truncated"),
        (lambda: qbits.dot_general(_INT8, 3), "dot_general", "a seed, not a key"),
        (
            lambda: qbits.dot_general(_INT8, jnp.full(2, 1.5)),
            "dot_general",
            "truncated",
        ),
        (
            lambda: qbits.dot_general(_INT8, jax.random.split(jax.random.key(0), 4)),
            "dot_general",
            "a batch of keys",
        ),
        (
            lambda: qbits.einsum(_INT8, jnp.zeros((2, 2), jnp.uint32)),
            "einsum",
            "a batch of keys",
        ),
        (
            lambda: qbits.conv_general_dilated(_INT8, jnp.arange(2)),
            "conv_general_dilated",
            "int32 values would be truncated",
        ),
        (
            lambda: qbits.numerics._derive_key(jnp.full(2, 1.5), 0),
            "derive_key",
            "truncated",
        ),
        (
            lambda: qbits.numerics.UniformNoise()(
                (4,), jax.random.split(jax.random.key(0))
            ),
            "UniformNoise",
            "a batch of keys",
        ),
        (
            lambda: _NOISY.quant(jnp.ones(4), qbits.numerics.Context(jnp.ones(2))),
            "IntNumerics",
            "truncated",
        ),
    ],
)
def test_keys_are_checked_where_they_enter(call, owner, why):
    # One check (qbits.numerics._check_key) everywhere a key enters: a float
    # or int32 array was truncated into key bits, a batch of keys mixed into
    # one, an int or an empty key raised AttributeError / IndexError.
    with pytest.raises(
        qbits.InvalidArgumentError, match=rf"^{owner}: key=.*{why}.*random\.key"
    ):
        call()


def test_noise_uses_every_bit_of_a_key():
    # Two words folded into one 32-bit seed: w0 ^ 3 phi w1 is the same for
    # (6 phi, 0) and (0, 2), and so was their noise.
    six_phi = (6 * 0x9E3779B9) % 2**32
    noise = qbits.numerics.UniformNoise()
    a = noise((256,), jnp.array([six_phi, 0], jnp.uint32))
    b = noise((256,), jnp.array([0, 2], jnp.uint32))
    assert not np.any(a == b)
    # Four-word (rbg) keys become hash keys of two words: 3 phi w1 ^ 5 phi w2
    # cancelled for (0, 2, 6/5, 0) against zeros.
    w2 = 6 * pow(5, -1, 2**32) % 2**32
    zero = qbits.numerics._hash_key(jnp.zeros(4, jnp.uint32))
    other = qbits.numerics._hash_key(jnp.array([0, 2, w2, 0], jnp.uint32))
    assert np.any(jax.random.key_data(zero) != jax.random.key_data(other))
