"""Noise for stochastic rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["UniformNoise"]


class UniformNoise(struct.PyTreeNode):
    """Uniform noise in ``[-0.5, 0.5)``, one unit wide, for stochastic rounding.

    Added before rounding to nearest, it makes rounding unbiased:
    ``E[round(x + u)] = x``. Float numerics scale it by the unit in the last
    place of each value's own binade. The same key gives the same bits.

    Example:
      >>> import jax
      >>> noise = qbits.UniformNoise()
      >>> u = noise((4,), jax.random.key(0))
      >>> bool(((u >= -0.5) & (u < 0.5)).all())
      True
    """

    def __call__(self, shape: tuple[int, ...], key: jax.Array) -> jax.Array:
        """Returns float32 noise of ``shape`` drawn from ``key``."""
        return jax.random.uniform(key, shape, jnp.float32, -0.5, 0.5)
