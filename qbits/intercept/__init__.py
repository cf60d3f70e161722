"""Layer 6: quantize every matmul of any function, by rules, without patching.

:func:`quantize` traces a function (a model's ``apply``, a loss, a training
step's forward) to a jaxpr, names each matmul by the parameter that feeds
it, and runs it again with every matched ``dot_general``, einsum, ``@`` and
convolution on qbits' quantized core. :func:`layer_table` lists them;
:func:`init_state` gives the scale state of delayed, static and learned
scales; :func:`store_weights` quantizes the weights once, for serving
(``quantize(..., stored=...)``).
"""

from qbits.intercept._store import StoredMatmul, store_weights
from qbits.intercept._transform import init_state, layer_table, quantize

__all__ = [
    "StoredMatmul",
    "init_state",
    "layer_table",
    "quantize",
    "store_weights",
]
