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
:class:`Observer` (ranges, post-training statistics); :func:`adapt` runs
a function whose weight matmuls add an :class:`Adapter`'s output
(low-rank adapters), :func:`weight_matmuls` lists which can be adapted
(:class:`WeightMatmul`). The linen and nnx adapters, serving,
post-training quantization and LoRA run through these functions
(:class:`Caller` names them in errors).
"""

from qbits.transform._adapt import WeightMatmul, adapt, weight_matmuls
from qbits.transform._adapter import Adapter
from qbits.transform._observe import ObservedMatmul, Observer
from qbits.transform._observing import collect_ranges, observe_matmuls
from qbits.transform._plan import Caller
from qbits.transform._store import StoredMatmul, store_weights
from qbits.transform._transform import (
    init_probes,
    init_state,
    layer_table,
    quantize,
)

__all__ = [
    "Adapter",
    "Caller",
    "ObservedMatmul",
    "Observer",
    "StoredMatmul",
    "WeightMatmul",
    "adapt",
    "collect_ranges",
    "init_probes",
    "init_state",
    "layer_table",
    "observe_matmuls",
    "quantize",
    "store_weights",
    "weight_matmuls",
]

# The entry points with the caller their errors name (a Caller), for the
# adapters, serving, ptq, lora and diagnostics: not public.
from qbits.transform._adapt import _adapt as _adapt  # isort: skip
from qbits.transform._adapt import _weight_matmuls as _weight_matmuls  # isort: skip
from qbits.transform._observing import _observe_matmuls as _observe_matmuls  # isort: skip
from qbits.transform._store import _store_weights as _store_weights  # isort: skip
from qbits.transform._transform import _init_probes as _init_probes  # isort: skip
from qbits.transform._transform import _init_state as _init_state  # isort: skip
from qbits.transform._transform import _layer_table as _layer_table  # isort: skip
from qbits.transform._transform import _quantize as _quantize  # isort: skip
