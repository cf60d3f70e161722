"""Ternary numerics: the weights of BitNet b1.58, -1, 0 or +1."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
from flax import struct
from jax import lax

from qbits._context import Context
from qbits._errors import check_bool
from qbits._formats import check_float_input, compute_dtype
from qbits.numerics._base import ClippedStraightThrough

__all__ = ["TernaryNumerics"]


class TernaryNumerics(ClippedStraightThrough):
    r"""The ternary grid :math:`\{-1, 0, +1\}` of BitNet b1.58.

    Ma et al., "The Era of 1-bit LLMs: All Large Language Models are in
    1.58 Bits" (arXiv 2402.17764), train their weights as

    .. math:: \tilde W = \mathrm{RoundClip}(W / \gamma, -1, 1), \qquad
              \gamma = \mathrm{mean}(|W|),

    one absmean :math:`\gamma` per tensor. A :class:`~qbits.Quantizer` with
    this grid, ``calibration=qbits.AbsMean()`` and
    ``PerTensor()`` does exactly that: the bound (the absmean) maps onto the
    code 1, so the scale is :math:`\gamma`. The forward pass clips to
    ``[-1, 1]`` and rounds to nearest even; NaN stays NaN. The gradient is
    straight-through, as in BitNet's training; with ``clip_gradient`` it is
    zero where ``|x| > 1``. Stored (``store=True``), the codes are ``int4``,
    packed two per byte by serving (1.58 bits of information in 4 of
    storage); with int8 activations a stored matmul sums them in int32.

    Attributes:
      clip_gradient: Zero the gradient where ``|x| > 1`` (the straight-through
        gradient of BitNet passes everywhere).

    Example:
      >>> import jax.numpy as jnp
      >>> t = qbits.numerics.TernaryNumerics()
      >>> t.abs_val_mapped_to(), t.get_dtype()
      (1.0, dtype(int4))
      >>> t(jnp.array([-3.0, -0.6, 0.5, 0.7, 9.0]))
      Array([-1., -1.,  0.,  1.,  1.], dtype=float32)
    """

    clip_gradient: bool = struct.field(pytree_node=False, default=False)

    clips = True
    keeps_zero = True

    def __post_init__(self) -> None:
        check_bool("TernaryNumerics", "clip_gradient", self.clip_gradient)

    def abs_val_mapped_to(self) -> float:
        """1.0: the bound (the absmean) maps onto the code 1."""
        return 1.0

    def get_dtype(self) -> np.dtype:
        """``int4``."""
        return np.dtype(ml_dtypes.int4)

    def fwd(self, x: jax.Array, context: Context | None) -> jax.Array:
        """Clip to ``[-1, 1]``, round to nearest even."""
        x = check_float_input("TernaryNumerics", x)
        y = x.astype(compute_dtype(x.dtype))
        one = np.asarray(1, y.dtype)  # not float64 under x64
        y = lax.round(lax.clamp(-one, y, one), lax.RoundingMethod.TO_NEAREST_EVEN)
        return y.astype(x.dtype)

    def gradient_range(self) -> tuple[float, float]:
        """``[-1, 1]``, the clip range (the gradient's mask with ``clip_gradient``)."""
        return (-1.0, 1.0)

    def code_bound(self) -> int:
        """1: the codes' largest magnitude (a stored matmul sums in int32)."""
        return 1

    def saturation_edge(self) -> float:
        """1.5: inputs beyond it would round past the top code."""
        return 1.5

    def smallest_nonzero(self) -> float:
        """1."""
        return 1.0
