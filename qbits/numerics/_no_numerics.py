"""The identity numerics."""

from __future__ import annotations

import jax

from qbits._context import Context
from qbits.numerics._base import QNumerics

__all__ = ["NoNumerics"]


class NoNumerics(QNumerics):
    """No quantization: the identity, with the identity gradient.

    A quantizer with ``NoNumerics`` returns its input bit for bit.

    Example:
      >>> import jax.numpy as jnp
      >>> qbits.numerics.NoNumerics()(jnp.array([0.1, 2.5]))
      Array([0.1, 2.5], dtype=float32)
    """

    is_identity = True

    def fwd(self, x: jax.Array, context: Context | None) -> jax.Array:
        """Returns ``x``."""
        return x

    def vjp_fwd(self, x: jax.Array, context: Context | None) -> tuple[jax.Array, None]:
        """Returns ``(x, None)``."""
        return x, None

    def vjp_bwd(self, residuals: None, g: jax.Array) -> tuple[jax.Array, None]:
        """Returns ``(g, None)``."""
        return g, None

    def get_dtype(self) -> None:
        """No storage dtype."""
        return None

    def abs_val_mapped_to(self) -> None:
        """No grid."""
        return None
