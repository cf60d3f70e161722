"""Layer 7: quantizing Flax linen models, through the engine.

:func:`quantize` gives an unmodified linen model's ``init`` and ``apply``
with every matmul it runs quantized by per-layer rules
(:func:`qbits.quantize` underneath); :func:`layer_table` lists them. Scale
state lives in the :data:`STATE` collection; :class:`TrainState` writes it
back each step. Explicit injection needs nothing from here
(``nn.Dense(dot_general=qbits.dot_general(config))``), except for configs
that keep scale state or round stochastically: :class:`Stateful` keeps
their variables and draws their keys.
"""

from qbits.flax._quantize import LEARNED, STATE, Quantized, layer_table, quantize
from qbits.flax._stateful import Stateful, TrainState

__all__ = [
    "LEARNED",
    "STATE",
    "Quantized",
    "Stateful",
    "TrainState",
    "layer_table",
    "quantize",
]
