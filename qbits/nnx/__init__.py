"""Layer 7: quantizing Flax nnx models, through the engine.

:func:`quantize` returns a copy of an unmodified nnx model whose every
matmul runs quantized by per-layer rules (:func:`qbits.quantize`
underneath); :func:`layer_table` lists them. Scale state lives in
:class:`ScaleState` Variables (not parameters); :func:`update_state` writes
the new state from a gradient. Explicit injection needs nothing from here
(``nnx.Linear(dot_general=qbits.dot_general(config))``), except for configs
that round stochastically or keep scale state: :class:`Stateful` holds
their key stream and state.
"""

from qbits.nnx._quantize import (
    ScaleState,
    StoredWeight,
    as_function,
    layer_table,
    quantize,
    update_state,
)
from qbits.nnx._stateful import Stateful

__all__ = [
    "ScaleState",
    "Stateful",
    "StoredWeight",
    "as_function",
    "layer_table",
    "quantize",
    "update_state",
]

# For qbits.serving (its nnx serving copy), not users.
from qbits.nnx._quantize import Placeholder as _Placeholder  # noqa: F401  # isort: skip
from qbits.nnx._quantize import serving_copy as _serving_copy  # noqa: F401  # isort: skip
