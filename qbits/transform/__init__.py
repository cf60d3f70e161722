"""Layer 6: the engine. Every matmul of any function, quantized by rules.

:func:`quantize` traces a function (a model's ``apply``, a loss, an nnx
model's forward over its state) to a jaxpr, names each matmul by the
parameter that feeds it, and runs it again with every matched
``dot_general``, einsum, ``@`` and convolution on qbits' quantized core.
:func:`layer_table` lists them; :func:`init_state` gives the scale state of
delayed and learned scales; :func:`collect_ranges` measures activation
ranges for :func:`qbits.freeze_ranges`; :func:`store_weights` quantizes the
weights once, for serving (``quantize(..., stored=...)``). The linen and
nnx adapters and serving run through these functions (:class:`Caller`
names them in errors).
"""

from qbits.transform._runner import Caller
from qbits.transform._store import StoredMatmul, store_weights
from qbits.transform._transform import (
    collect_ranges,
    init_state,
    layer_table,
    quantize,
)

__all__ = [
    "Caller",
    "StoredMatmul",
    "collect_ranges",
    "init_state",
    "layer_table",
    "quantize",
    "store_weights",
]
