"""Layer 6: quantizing Flax linen models.

Explicit injection needs nothing from here: give a layer
``dot_general=qbits.dot_general(config)`` (or ``conv_general_dilated=``).
:func:`quantize` applies per-layer rules to an *unmodified* linen model
without patching JAX globally; :func:`layer_table` shows which config each
layer gets.
"""

from qbits.flax.quantize import Quantized, layer_table, quantize

__all__ = ["Quantized", "layer_table", "quantize"]
