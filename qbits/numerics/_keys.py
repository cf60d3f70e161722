"""PRNG keys for stochastic rounding: cheap derivation, qbits' hash PRNG.

Stochastic rounding needs one uniform number per element, every step, in
every quantized gradient. JAX's threefry PRNG makes each draw a loop of
integer rounds that XLA compiles into several kernels per call, which
dominated the compile time of an int8 training step. Here the bits come from
a counter-based hash instead: the element's index, mixed with the key's bits
by the finalizer of MurmurHash3 (a bijection on 32-bit words, so for one key
the bits are a permutation of the indices: exactly uniform over any 2**32
elements). It is a few integer operations that XLA fuses into the
quantization that consumes the noise.

Compile time: XLA:CPU compiles one kernel per *distinct* fused computation,
and a constant that differs between layers (a layer index folded into each
layer's key) makes each layer's kernels distinct ones. A quantized matmul
therefore draws its noise from :func:`next_key` of its key, computed by a
small kernel of its own: whatever derived the layer's key stays there, and
the quantization kernels of equal-shaped layers are one kernel, compiled
once. Per-layer keys cost least as a chain of :func:`next_key` (one kernel
for every link); :func:`derive_key` with a layer index costs one distinct
small kernel per layer, ``jax.random.fold_in`` a threefry loop of several.

Every function here, and everything in qbits that takes a key, checks it
with :func:`check_key`: a typed key or raw ``uint32`` key data, one key
(or, where documented, a batch). The noise uses all of a key's bits:
different keys give different noise.

Keys that a framework derives per layer and per call (Flax's ``make_rng``,
nnx's ``RngStream``) go through ``jax.random.fold_in`` and ``split`` of the
key's PRNG. :func:`hash_key` gives a key of qbits' hash PRNG, whose
``fold_in``, ``split`` and random bits are the same elementwise hashing: the
Flax wrappers turn their ``quant`` keys into such keys.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError

__all__ = ["check_key", "derive_key", "hash_bits", "hash_key", "next_key"]

_GOLDEN = np.uint32(0x9E3779B9)

#: The words of raw key data: threefry2x32's two; four for ``rbg`` and
#: ``unsafe_rbg``.
_RAW_KEY_WORDS = (2, 4)


def check_key(owner: str, key: Any, *, batched: bool = False) -> jax.Array:
    """Returns ``key`` as a PRNG key array, raising unless it is one.

    A key is a typed key (``jax.random.key(seed)``, of any PRNG) or raw
    ``uint32`` key data (``jax.random.PRNGKey(seed)``: two words; four for
    the ``rbg`` PRNGs); traced keys are checked by their type. Nothing else
    is converted: an int is a seed, and an array of another dtype (floats,
    int32) would be truncated into a key nobody chose.

    Args:
      owner: What takes the key, named in the error (``"dot_general"``).
      key: The key.
      batched: Accept a batch of keys (leading axes of any shape); by
        default exactly one key.

    Returns:
      The key: a typed key as it is, raw key data as a jax ``uint32`` array.

    Raises:
      InvalidArgumentError: Naming ``owner``, the argument ``key``, the
        value (or its dtype and shape) and what is allowed.

    Example:
      >>> qbits.numerics._keys.check_key("my_layer", jax.random.key(0)).shape
      ()
      >>> try:
      ...     qbits.numerics._keys.check_key("my_layer", jnp.zeros(2))
      ... except qbits.InvalidArgumentError as e:
      ...     print(e.owner, e.argument, e.value, e.why)
      my_layer key float32[2] float32 values would be truncated to uint32 key data
    """
    allowed = (
        "a PRNG key or a batch of them: typed keys (jax.random.key(seed)), or "
        "uint32 key data of shape (..., 2) (jax.random.PRNGKey(seed); "
        "(..., 4) for the rbg PRNGs)"
        if batched
        else "a PRNG key: jax.random.key(seed), a typed key of shape (), or "
        "jax.random.PRNGKey(seed), uint32 key data of 2 words (4 for the rbg "
        "PRNGs)"
    )
    if isinstance(key, np.ndarray):
        key = jnp.asarray(key)
    if not isinstance(key, jax.Array):
        integer = isinstance(key, int | np.integer) and not isinstance(key, bool)
        why = "an int is a seed, not a key" if integer else ""
        raise InvalidArgumentError(owner, "key", key, allowed, why=why)
    shown = f"{key.dtype}{list(key.shape)}"
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        batch = key.shape
    elif key.dtype != np.dtype(np.uint32):
        raise InvalidArgumentError(
            owner,
            "key",
            shown,
            allowed,
            why=f"{key.dtype} values would be truncated to uint32 key data",
        )
    elif key.ndim == 0 or key.shape[-1] not in _RAW_KEY_WORDS:
        raise InvalidArgumentError(
            owner,
            "key",
            shown,
            allowed,
            why="raw key data has 2 or 4 uint32 words along its last axis",
        )
    else:
        batch = key.shape[:-1]
    if batch and not batched:
        raise InvalidArgumentError(
            owner,
            "key",
            shown,
            allowed,
            why=f"a batch of keys {batch}: pass one key, or jax.vmap over the batch",
        )
    return key


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection that mixes every bit.

    In lax, not jnp: jnp's operators are small jitted functions, each traced
    anew for every new shape (trace time per quantized tensor).
    """
    h = jnp.asarray(h, jnp.uint32)
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = lax.bitwise_xor(h, lax.shift_right_logical(h, np.uint32(shift)))
        h = lax.mul(h, np.uint32(factor))
    return lax.bitwise_xor(h, lax.shift_right_logical(h, np.uint32(16)))


def _key_words(key: jax.Array) -> jax.Array:
    """The key's bits as uint32 words (typed keys and legacy uint32 keys)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return jnp.asarray(key).astype(jnp.uint32)


def derive_key(key: jax.Array, stream: int | jax.Array) -> jax.Array:
    """A key for stream ``stream`` of ``key``: its words hashed with the stream.

    Stands in for ``jax.random.fold_in`` where many keys are derived (six per
    quantized matmul, one per layer): elementwise integer operations instead
    of a threefry hash, the same kind of key (typed or legacy) as ``key``.

    Args:
      key: A key or a batch of keys (:func:`check_key`).
      stream: An int, or an integer scalar array (a traced index, e.g.
        ``jax.lax.axis_index``).

    Raises:
      InvalidArgumentError: For a ``key`` that is not one, or a ``stream``
        that is not an integer scalar.

    Example:
      >>> k = jax.random.key(0)
      >>> bool((jax.random.key_data(qbits.numerics._keys.derive_key(k, 1))
      ...       != jax.random.key_data(qbits.numerics._keys.derive_key(k, 2))).any())
      True
    """
    key = check_key("derive_key", key, batched=True)
    if isinstance(stream, int | np.integer) and not isinstance(stream, bool):
        salt = np.uint32((int(stream) * 0x9E3779B9 + 0x7F4A7C15) % 2**32)
    elif (
        isinstance(stream, jax.Array)
        and jnp.issubdtype(stream.dtype, jnp.integer)
        and stream.ndim == 0
    ):  # the same salt, computed: uint32 arithmetic wraps as the int's does
        salt = lax.convert_element_type(stream, jnp.uint32)
        salt = lax.add(lax.mul(salt, _GOLDEN), np.uint32(0x7F4A7C15))
    else:
        raise InvalidArgumentError(
            "derive_key", "stream", stream, "an int or an integer scalar array"
        )
    words = _fmix32(lax.bitwise_xor(_key_words(key), salt))
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(words, impl=jax.random.key_impl(key))
    return words.astype(key.dtype)


def next_key(key: jax.Array) -> jax.Array:
    """The key after ``key`` in a chain (the stream -1 hashed in, settled).

    For one key per layer, chain them (``k = next_key(k)`` before each
    layer) rather than deriving them with a layer index
    (``jax.random.fold_in(key, i)`` or the like): every link of the chain is the same
    computation, so XLA compiles one kernel for all of them, while a layer
    index is a constant that makes each layer's key kernel a distinct one
    (about as much XLA:CPU compile time as the rest of a quantized layer's
    stochastic rounding).

    The key comes out of a reduction (the key's words summed with zeros
    along a new axis), which XLA keeps as a kernel of its own: whatever
    computed ``key`` stays in that kernel instead of being copied into each
    kernel that draws noise from the result. The quantized matmuls take
    ``next_key`` of the key they are given.

    Example:
      >>> k1 = qbits.numerics.next_key(jax.random.key(0))
      >>> k2 = qbits.numerics.next_key(k1)
      >>> bool((jax.random.key_data(k1) != jax.random.key_data(k2)).any())
      True
    """
    derived = derive_key(check_key("next_key", key, batched=True), -1)
    if jnp.issubdtype(derived.dtype, jax.dtypes.prng_key):
        words = jax.random.key_data(derived)
        settled = _settle(words)
        return jax.random.wrap_key_data(settled, impl=jax.random.key_impl(derived))
    return _settle(derived)


def _settle(words: jax.Array) -> jax.Array:
    padded = jnp.stack([words, jnp.zeros_like(words)], axis=-1)
    return jnp.sum(padded, axis=-1, dtype=words.dtype)


def hash_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """32 random bits per element of ``shape`` from ``key`` (counter-based hash).

    Element ``i`` (in row-major order) gets ``fmix32(fmix32(i * φ ^ k0) ^
    k1)``, with ``(k0, k1)`` the key's 64 bits (a key of more words absorbed
    into two, see :func:`hash_key`): for one key the bits are a permutation
    of the indices, the same key gives the same bits, and keys that differ
    in any bit give different bits. Shapes beyond 2**32 elements repeat.

    Compile time: everything here is elementwise and fuses into the kernel
    that uses the bits. A key computed per call with constants of its own
    (a layer index) would make that kernel distinct per call; the quantized
    matmuls therefore draw from :func:`next_key` of their key, which is
    computed by a small kernel of its own.

    Raises:
      InvalidArgumentError: For a ``key`` that is not one key
        (:func:`check_key`).
    """
    words = _two_words(_key_words(check_key("hash_bits", key)))
    index = lax.iota(jnp.uint32, int(np.prod(shape, dtype=np.int64)))
    h = _fmix32(lax.bitwise_xor(lax.mul(index, _GOLDEN), words[0]))
    return _fmix32(lax.bitwise_xor(h, words[1])).reshape(shape)


# qbits' hash PRNG (see hash_key): keys of two uint32 words, like threefry's.
_FOLD_SALT = np.uint32(0x7F4A7C15)
_SPLIT_SALT = np.uint32(0x2545F491)
_SECOND_WORD = np.uint32(0x165667B1)
_CONVERT_SALT = np.uint32(0x3C6EF372)
_ABSORB_SALT = np.uint32(0x6A09E667)


def _hash_derive(words: jax.Array, data: jax.Array, salt: np.uint32) -> jax.Array:
    """Key words (``(..., 2)``) moved on by ``data`` (uint32, broadcast).

    ``data`` is spread by a bijection and mixed into the first word with
    the second; the new first word is mixed into the second. For one
    ``data`` the map is a bijection of the key's words (the second word
    can be recovered from the new words, then the first): different keys
    stay different, and different data give different first words.
    """
    spread = _fmix32(jnp.asarray(data, jnp.uint32) * _GOLDEN + salt)
    first = _fmix32(words[..., 0] ^ spread ^ _fmix32(words[..., 1]))
    second = _fmix32(words[..., 1] ^ first ^ _SECOND_WORD)
    return jnp.stack([first, second], axis=-1)


def _two_words(words: jax.Array) -> jax.Array:
    """Key words ``(..., n)`` as two, ``(..., 2)``: themselves for ``n = 2``.

    Otherwise the first word starts the pair and each further word is
    absorbed by :func:`_hash_derive` (for one word a bijection of the pair,
    and different words give different pairs): keys that differ in any
    word give different pairs, except for true 64-bit hash collisions.
    """
    if words.shape[-1] == 2:
        return words
    first = words[..., 0]
    pair = jnp.stack([first, _fmix32(first ^ _SECOND_WORD)], axis=-1)
    for i in range(1, words.shape[-1]):
        pair = _hash_derive(pair, words[..., i], _ABSORB_SALT)
    return pair


def _hash_seed(seed: jax.Array) -> jax.Array:
    seed = jnp.asarray(seed)
    low = lax.convert_element_type(seed, jnp.uint32)
    high = (
        lax.convert_element_type(seed >> 32, jnp.uint32)
        if seed.dtype.itemsize == 8
        else jnp.zeros_like(low)
    )
    return _hash_derive(jnp.stack([low, high]), np.uint32(0), _FOLD_SALT)


def _hash_fold_in(key: jax.Array, data: jax.Array) -> jax.Array:
    return _hash_derive(key, data, _FOLD_SALT)


def _hash_split(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    index = lax.iota(jnp.uint32, int(np.prod(shape, dtype=np.int64)))
    return _hash_derive(key, index, _SPLIT_SALT).reshape(*shape, 2)


def _hash_random_bits(
    key: jax.Array, bit_width: int, shape: tuple[int, ...]
) -> jax.Array:
    bits = hash_bits(key, shape)
    if bit_width == 64:
        high = hash_bits(_hash_fold_in(key, np.uint32(1)), shape)
        wide = jnp.uint64
        return (high.astype(wide) << np.uint64(32)) | bits.astype(wide)
    return bits.astype(jnp.dtype(f"uint{bit_width}"))


_HASH_PRNG = jax.extend.random.define_prng_impl(
    key_shape=(2,),
    seed=_hash_seed,
    split=_hash_split,
    random_bits=_hash_random_bits,
    fold_in=_hash_fold_in,
    name="qbits_hash",
    tag="qh",
)


def hash_key(key: jax.Array) -> jax.Array:
    """``key`` as a key of qbits' hash PRNG (the same words, mixed if need be).

    ``jax.random.fold_in``, ``split`` and the random functions work on the
    result as on any typed key, but each is a few elementwise integer
    operations (:func:`hash_bits`' hash) instead of threefry, which JAX
    lowers on CPU to a loop that XLA compiles into kernels of their own at
    every call. Meant for keys that are folded and split many times in one
    step: a Flax model's ``quant`` keys (``make_rng`` per layer, an nnx
    ``RngStream`` per layer), which :func:`qbits.flax.quantize` and
    :func:`qbits.nnx.quantize` turn into hash keys themselves. The bits are
    good for stochastic rounding, not for cryptography.

    Args:
      key: A typed key (``jax.random.key``) of any PRNG, or legacy
        ``uint32`` key data (``jax.random.PRNGKey``), or a batch of either
        (:func:`check_key`).

    Returns:
      Typed hash keys of ``key``'s batch shape (``key`` itself if it is
      one); its words mixed, so different keys give different hash keys
      (keys of four words are absorbed into two first).

    Raises:
      InvalidArgumentError: For a ``key`` that is not a key or a batch of
        keys.

    Example:
      >>> k = qbits.numerics._keys.hash_key(jax.random.key(0))
      >>> jax.random.uniform(jax.random.fold_in(k, 3), (2,)).shape
      (2,)
    """
    key = check_key("hash_key", key, batched=True)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if jax.random.key_impl(key) == _HASH_PRNG:
            return key
        words = jax.random.key_data(key)
    else:
        words = key
    words = _two_words(words)
    # Mixed, so that simple key data (key(0) is two zero words) gives
    # well-spread bits from the first draw.
    words = _hash_derive(words, np.uint32(0), _CONVERT_SALT)
    return jax.random.wrap_key_data(words, impl=_HASH_PRNG)
