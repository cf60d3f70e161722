"""Layer 6: the engine. Every matmul of any function, quantized by rules.

:func:`quantize` traces a function (a model's ``apply``, a loss, an nnx
model's forward over its state) to a jaxpr, names each matmul by the
parameter that feeds it, and runs it again with every matched
``dot_general``, einsum, ``@`` and convolution on qbits' quantized core.
:func:`layer_table` lists them; :func:`init_state` gives the scale state of
delayed and learned scales; :func:`collect_ranges` measures activation
ranges for :func:`qbits.freeze_ranges`; :func:`store_weights` quantizes the
weights once, for serving (``quantize(..., stored=...)``);
:func:`observe_matmuls` hands every weight matmul's activation to an
:class:`Observer` (ranges, post-training statistics). The linen and nnx
adapters, serving and post-training quantization run through these
functions (:class:`Caller` names them in errors).
"""

from qbits.transform._observe import ObservedMatmul, Observer
from qbits.transform._runner import Caller
from qbits.transform._store import StoredMatmul, store_weights
from qbits.transform._transform import (
    collect_ranges,
    init_state,
    layer_table,
    observe_matmuls,
    quantize,
)

__all__ = [
    "Caller",
    "ObservedMatmul",
    "Observer",
    "StoredMatmul",
    "collect_ranges",
    "init_state",
    "layer_table",
    "observe_matmuls",
    "quantize",
    "store_weights",
]
