"""Layer 6: quantizing Flax linen models.

Explicit injection needs nothing from here: give a layer
``dot_general=qbits.dot_general(config)`` (or ``conv_general_dilated=``).
:func:`quantize` applies per-layer rules to an *unmodified* linen model
without patching JAX globally; :func:`layer_table` shows which config each
layer gets. Delayed scaling (the ``fp8_delayed`` preset) keeps its state in
the :data:`STATE` collection (:mod:`qbits.flax._stateful`); :class:`TrainState`
writes it back each step. :func:`collect_ranges` measures activation ranges
for :func:`qbits.freeze_ranges` (static post-training ranges).
"""

from qbits.flax._layers import Session
from qbits.flax._quantize import Quantized, layer_table, quantize
from qbits.flax._ranges import RANGES, collect_ranges
from qbits.flax._stateful import (
    STATE,
    StatefulConv,
    StatefulDotGeneral,
    StatefulEinsum,
    TrainState,
    max_combining,
)

__all__ = [
    "RANGES",
    "STATE",
    "Quantized",
    "Session",
    "StatefulConv",
    "StatefulDotGeneral",
    "StatefulEinsum",
    "TrainState",
    "collect_ranges",
    "layer_table",
    "max_combining",
    "quantize",
]
