"""Codebook numerics: NF4, the 16 levels of QLoRA's 4-bit NormalFloat."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct
from jax import lax

from qbits._context import Context
from qbits._errors import InvalidArgumentError, check_bool
from qbits._formats import check_float_input, compute_dtype
from qbits._sharding import take
from qbits.numerics._base import ClippedStraightThrough

__all__ = ["NF4_LEVELS", "Nf4Numerics"]

#: The 16 NF4 levels of Dettmers et al., "QLoRA: Efficient Finetuning of
#: Quantized LLMs" (arXiv 2305.14314), as bitsandbytes stores them: quantiles
#: of a standard normal, normalised to [-1, 1], with an exact zero. Code ``i``
#: (0..15) stands for ``NF4_LEVELS[i]``.
NF4_LEVELS: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
_LEVELS = np.asarray(NF4_LEVELS, np.float32)
# A value above the midpoint between two levels goes to the upper one (a value
# exactly on it to the lower one), as bitsandbytes' dQuantizeNF4 decides.
_MIDPOINTS = (_LEVELS[:-1] + _LEVELS[1:]) / np.float32(2)


class Nf4Numerics(ClippedStraightThrough):
    """NF4: the 16 NormalFloat levels of QLoRA, stored as 4-bit codes.

    The input is already divided by the scale (a block's absmax with
    :class:`~qbits.AbsMax`, so the bound maps onto the level 1.0); the
    forward pass clips to ``[-1, 1]`` and rounds to the nearest of the
    :attr:`levels` (a value exactly between two levels goes to the lower
    one, as bitsandbytes decides). NaN stays NaN. Stored (``store=True``),
    the values are the levels' indices 0..15 as ``uint4``, packed two per
    byte by serving; :class:`~qbits.QTensor` maps them back through its
    ``codebook``. The gradient is straight-through; with ``clip_gradient``
    it is zero where ``|x| > 1``.

    QLoRA quantizes weights in blocks of 64 (``Tiled(tile_size=64)``) with a
    float32 absmax each: 4.5 bits per weight, or 4.127 with its double
    quantization of the absmax (``Quantizer(double_quant=True)``, the
    ``nf4_dq`` preset).

    Attributes:
      clip_gradient: Zero the gradient where ``|x| > 1``.

    Example:
      >>> import jax.numpy as jnp
      >>> nf4 = qbits.numerics.Nf4Numerics()
      >>> nf4.abs_val_mapped_to(), nf4.get_dtype()
      (1.0, dtype(uint4))
      >>> y = nf4(jnp.array([-2.0, -0.04, 0.1, 0.9]))
      >>> [round(float(v), 4) for v in y]
      [-1.0, 0.0, 0.0796, 1.0]
      >>> nf4.codes(y).tolist()
      [0, 7, 8, 15]
    """

    clip_gradient: bool = struct.field(pytree_node=False, default=False)

    clips = True  # to [-1, 1]
    keeps_zero = True  # 0 is a level

    def __post_init__(self) -> None:
        check_bool("Nf4Numerics", "clip_gradient", self.clip_gradient)

    @property
    def levels(self) -> tuple[float, ...]:
        """The 16 NF4 levels, the codebook of the stored codes."""
        return NF4_LEVELS

    def abs_val_mapped_to(self) -> float:
        """1.0, the largest level."""
        return 1.0

    def get_dtype(self) -> np.dtype:
        """``uint4``: the codes (indices into the levels)."""
        return np.dtype(ml_dtypes.uint4)

    def codes(self, x: jax.Array) -> jax.Array:
        """The index (0..15, ``uint4``) of the level nearest each value of ``x``."""
        y = jnp.asarray(x).astype(jnp.float32)
        index = lax.full_like(y, 0, jnp.uint8)
        for m in _MIDPOINTS:  # one fused pass: count the midpoints below y
            index = index + lax.convert_element_type(lax.gt(y, m), jnp.uint8)
        return index.astype(ml_dtypes.uint4)

    def fwd(self, x: jax.Array, context: Context | None) -> jax.Array:
        """Clip to ``[-1, 1]``, round to the nearest level; NaN stays NaN."""
        x = check_float_input("Nf4Numerics", x)
        if ml_dtypes.finfo(x.dtype).nmant < 23:
            raise InvalidArgumentError(
                "Nf4Numerics",
                "x.dtype",
                x.dtype,
                "float32 or float64 (qbits.Quantizer computes in float32)",
                why=f"the NF4 levels are float32 numbers, not representable in "
                f"{x.dtype}",
            )
        y = x.astype(compute_dtype(x.dtype))
        index = self.codes(y).astype(jnp.int32)
        q = take(jnp.asarray(_LEVELS, y.dtype), index)
        return jnp.where(jnp.isnan(y), y, q).astype(x.dtype)

    def gradient_range(self) -> tuple[float, float]:
        """The levels' range (the gradient's mask with ``clip_gradient``)."""
        return (-1.0, 1.0)

    @property
    def codebook(self) -> tuple[float, ...]:
        """The levels: stored codes are indices into them (see :meth:`codes`)."""
        return NF4_LEVELS
