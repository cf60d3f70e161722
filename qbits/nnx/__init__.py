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
"""

from qbits.nnx.attention import QuantizedAttention
from qbits.nnx.layers import QuantizedConv, QuantizedDotGeneral, QuantizedEinsum
from qbits.nnx.quantize import layer_table, quantize

__all__ = [
    "QuantizedAttention",
    "QuantizedConv",
    "QuantizedDotGeneral",
    "QuantizedEinsum",
    "layer_table",
    "quantize",
]
