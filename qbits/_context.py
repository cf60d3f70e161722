"""The per-call context that numerics and quantizers receive."""

from __future__ import annotations

import jax
from flax import struct

__all__ = ["Context"]


class Context(struct.PyTreeNode):
    """What a quantization call needs beyond its input: the PRNG key.

    Stochastic rounding draws its noise from ``key``; the same key gives the
    same bits. A context is a pytree, so it passes through ``jit``, ``vmap``
    and ``scan`` like any other argument.

    Attributes:
      key: A PRNG key (``jax.random.key`` or a raw ``uint32[2]`` key), or
        ``None`` when nothing random is needed. Checked where a numerics
        draws from it (:func:`qbits.numerics.check_key`): a context is a
        pytree, rebuilt by JAX's transformations with placeholder leaves.

    Example:
      >>> import jax
      >>> ctx = qbits.numerics.Context(key=jax.random.key(0))
      >>> ctx.key is not None
      True
    """

    key: jax.Array | None = None
