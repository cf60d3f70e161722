"""Layer 6: quantization of Flax nnx models.

Explicit injection: give a layer a quantized function, e.g.
``nnx.Linear(..., dot_general=qbits.dot_general(config))``, or one of the
Module versions here, which keep PRNG state for stochastic rounding:
:class:`QuantizedDotGeneral`, :class:`QuantizedEinsum`, :class:`QuantizedConv`
and :class:`QuantizedAttention` (an ``attention_fn`` for
``nnx.MultiHeadAttention``).

Rule-based injection into an unmodified model: :func:`quantize` returns a
copy of the model whose layers matching a :class:`~qbits.config.QuantConfig`
run quantized; :func:`layer_table` shows which layer gets which config.
Delayed scaling keeps its state in :class:`DelayedState` Variables of the
:class:`QuantizedDotGeneral`; :func:`update_state` writes it back each
step. :func:`collect_ranges` measures activation ranges for
:func:`qbits.freeze_ranges`.
"""

from qbits.nnx._attention import QuantizedAttention
from qbits.nnx._layers import QuantizedConv, QuantizedDotGeneral, QuantizedEinsum
from qbits.nnx._quantize import layer_table, quantize
from qbits.nnx._ranges import collect_ranges
from qbits.nnx._stateful import DelayedState, init_state, max_combining, update_state

__all__ = [
    "DelayedState",
    "QuantizedAttention",
    "QuantizedConv",
    "QuantizedDotGeneral",
    "QuantizedEinsum",
    "collect_ranges",
    "init_state",
    "layer_table",
    "max_combining",
    "quantize",
    "update_state",
]
