"""Noise for stochastic rounding, and cheap key derivation.

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
layer's key) makes each layer's kernels distinct ones. The key therefore
enters the quantization only as one ``uint32`` seed, reduced from the key's
words in a small kernel of its own: whatever derived the key stays in that
kernel, and the quantization kernels of equal-shaped layers are one kernel,
compiled once. Derive per-layer keys with :func:`derive_key` (one small
kernel per key) rather than ``jax.random.fold_in`` (a threefry loop of
several kernels per key on CPU).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qbits._errors import InvalidArgumentError

__all__ = ["UniformNoise", "derive_key", "hash_bits"]

_GOLDEN = np.uint32(0x9E3779B9)


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection that mixes every bit."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _key_words(key: jax.Array) -> jax.Array:
    """The key's bits as uint32 words (typed keys and legacy uint32 keys)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return jnp.asarray(key).astype(jnp.uint32)


def derive_key(key: jax.Array, stream: int) -> jax.Array:
    """A key for stream ``stream`` of ``key``: its words hashed with the stream.

    Stands in for ``jax.random.fold_in`` where many keys are derived (six per
    quantized matmul, one per layer): elementwise integer operations instead
    of a threefry hash, the same kind of key (typed or legacy) as ``key``.

    Example:
      >>> k = jax.random.key(0)
      >>> bool((jax.random.key_data(qbits.numerics.derive_key(k, 1))
      ...       != jax.random.key_data(qbits.numerics.derive_key(k, 2))).any())
      True
    """
    salt = np.uint32((int(stream) * 0x9E3779B9 + 0x7F4A7C15) % 2**32)
    words = _fmix32(_key_words(key) ^ salt)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(words, impl=jax.random.key_impl(key))
    return words.astype(key.dtype)


def _mixed_sum(words: jax.Array) -> jax.Array:
    """One ``uint32`` from a vector of words, each hashed with its position.

    A reduction, so that XLA computes it in a kernel of its own and hands its
    consumers a scalar: an elementwise scalar would be copied, with the
    constants that produced it, into every kernel that uses it.
    """
    words = words.reshape(-1)
    position = jax.lax.iota(jnp.uint32, words.shape[0]) + np.uint32(1)
    return jnp.sum(_fmix32(words + position * _GOLDEN), dtype=jnp.uint32)


def hash_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """32 random bits per element of ``shape`` from ``key`` (counter-based hash).

    Element ``i`` (in row-major order) gets ``fmix32(i * φ ^ seed)``, with the
    seed mixed from all of the key's words: the same key gives the same bits;
    shapes beyond 2**32 elements repeat.
    """
    seed = _fmix32(_mixed_sum(_key_words(key)))
    index = jax.lax.iota(jnp.uint32, int(np.prod(shape, dtype=np.int64)))
    return _fmix32(index * _GOLDEN ^ seed).reshape(shape)


class UniformNoise(struct.PyTreeNode):
    """Uniform noise in ``[-0.5, 0.5)``, one unit wide, for stochastic rounding.

    Added before rounding to nearest, it makes rounding unbiased:
    ``E[round(x + u)] = x``. Float numerics scale it by the unit in the last
    place of each value's own binade. The same key gives the same bits.

    Attributes:
      prng: ``"hash"`` (default): 23 random bits per element from
        :func:`hash_bits`, a few integer operations that fuse into the
        quantization (cheap to compile and to run); ``"jax"``:
        ``jax.random.uniform`` with the key's own PRNG (threefry).

    Example:
      >>> import jax
      >>> noise = qbits.UniformNoise()
      >>> u = noise((4,), jax.random.key(0))
      >>> bool(((u >= -0.5) & (u < 0.5)).all())
      True
    """

    prng: Literal["hash", "jax"] = struct.field(pytree_node=False, default="hash")

    def __post_init__(self) -> None:
        if self.prng not in ("hash", "jax"):
            raise InvalidArgumentError(
                "UniformNoise", "prng", self.prng, "'hash' or 'jax'"
            )

    def __call__(self, shape: tuple[int, ...], key: jax.Array) -> jax.Array:
        """Returns float32 noise of ``shape`` drawn from ``key``."""
        if self.prng == "jax":
            return jax.random.uniform(key, shape, jnp.float32, -0.5, 0.5)
        # 23 bits as the mantissa of a float in [1, 2), shifted to [-0.5, 0.5).
        bits = (hash_bits(key, shape) >> 9) | np.uint32(0x3F800000)
        return jax.lax.bitcast_convert_type(bits, jnp.float32) - np.float32(1.5)
