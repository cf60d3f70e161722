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
        draws from it (a typed key, or 2 or 4 uint32 words): a context is a
        pytree, rebuilt by JAX's transformations with placeholder leaves.
      cast_next: Whether the values a numerics returns are cast to its
        storage dtype (:meth:`~qbits.numerics.QNumerics.get_dtype`) right
        after, as a quantizer does for a real-mode matmul: a numerics whose
        rounding is exactly that cast may leave the rounding to it (FP8's
        does, so that XLA fuses the cast with whatever lays the codes out
        for their GEMM). Set by the quantizer.

    Example:
      >>> import jax
      >>> ctx = qbits.numerics.Context(key=jax.random.key(0))
      >>> ctx.key is not None
      True
    """

    key: jax.Array | None = None
    cast_next: bool = struct.field(pytree_node=False, default=False)
