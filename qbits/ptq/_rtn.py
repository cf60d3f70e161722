"""Round to nearest: the baseline every method is reported against."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from qbits._quantizer import Quantizer
from qbits.ptq._gptq import GptqResult, blocks_quantizer
from qbits.ptq._method import Method
from qbits.ptq._stats import InputStats

__all__ = ["Rtn", "rtn"]


@dataclasses.dataclass(frozen=True)
class Rtn(Method):
    """Round to nearest: each weight on its quantizer's grid, alone.

    What the engine computes with the same config (``qbits.quantize``), as
    a :func:`~qbits.ptq.quantize_weights` method: the baseline of every
    report in :attr:`~qbits.ptq.PtqResult.layers` (``error_rtn``). No
    statistics used.

    Example:
      >>> w = jnp.array([[0.3, -1.0], [0.9, 0.2]])
      >>> int4 = qbits.Quantizer(qbits.IntNumerics(bits=4))
      >>> out = qbits.ptq.Rtn().quantize(w, None, int4)
      >>> [round(v, 3) for v in out.weight[0].tolist()]
      [0.267, -0.933]
    """

    name: ClassVar[str] = "rtn"

    def quantize(
        self, w: jax.Array, stats: InputStats | None, quantizer: Quantizer
    ) -> GptqResult:
        """``w`` rounded to nearest on the quantizer's grid (see :class:`Method`)."""
        return rtn(w, quantizer)


@functools.partial(jax.jit, static_argnames=("quantizer",))
def rtn(w: jax.Array, quantizer: Quantizer) -> GptqResult:
    """Round to nearest with the quantizer's blocks along ``K`` of ``(K, N)``."""
    group, block_n = quantizer.granularity.block_sizes(w.shape, (0,))[:2]
    qt = blocks_quantizer(quantizer, group, block_n).quant(w)
    zero = None if qt.zero_point is None else qt.zero_point.astype(jnp.float32)
    tensor = None if qt.tensor_scale is None else qt.tensor_scale.reshape(())
    return GptqResult(qt.dequant().astype(w.dtype), qt.scale, zero, tensor)
