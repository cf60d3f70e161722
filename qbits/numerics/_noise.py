"""Uniform noise for stochastic rounding (bits from qbits' hash, or JAX's PRNG)."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits.numerics._keys import check_key, hash_bits

__all__ = ["UniformNoise"]


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
      >>> noise = qbits.numerics.UniformNoise()
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
        """Returns float32 noise of ``shape`` drawn from ``key``.

        Raises:
          InvalidArgumentError: For a ``key`` that is not one key
            (typed, or 2 or 4 uint32 words).
        """
        key = check_key("UniformNoise", key)
        if self.prng == "jax":
            return jax.random.uniform(key, shape, jnp.float32, -0.5, 0.5)
        # 23 bits as the mantissa of a float in [1, 2), shifted to [-0.5, 0.5).
        bits = lax.shift_right_logical(hash_bits(key, shape), np.uint32(9))
        bits = lax.bitwise_or(bits, np.uint32(0x3F800000))
        return lax.sub(lax.bitcast_convert_type(bits, jnp.float32), np.float32(1.5))
