"""Layer 6: the engine. Every matmul of any function, quantized by rules.

:func:`qbits.quantize` traces a function (a model's ``apply``, a loss, an
nnx model's forward over its state) to a jaxpr, names each matmul by the
parameter that feeds it, and runs it again with every matched
``dot_general``, einsum, ``@`` and convolution on qbits' quantized core;
:func:`qbits.layer_table`, :func:`qbits.init_state` and
:func:`qbits.collect_ranges` are the engine's too. The linen and nnx
adapters, serving, post-training quantization, LoRA and diagnostics run
through it.

This module is the engine's face for extending it:

- :func:`observe_matmuls` runs a function in float over batches and hands
  every weight matmul's activation to an :class:`Observer` (what
  :func:`qbits.collect_ranges` and :func:`qbits.ptq.collect_stats`
  record);
- :func:`adapt` runs a function whose weight matmuls add what an
  :class:`Adapter` computes (what :mod:`qbits.lora` adds, or transforms
  the activation first, as :mod:`qbits.ptq`'s smoothing does).

Both see each weight matmul as an :class:`ObservedMatmul`: the weight's
contraction, batch and free axes, and the scans over stacked layers.
"""

from qbits.transform._adapt import adapt
from qbits.transform._adapter import Adapter
from qbits.transform._observe import ObservedMatmul, Observer
from qbits.transform._observing import observe_matmuls

__all__ = [
    "Adapter",
    "ObservedMatmul",
    "Observer",
    "adapt",
    "observe_matmuls",
]

# For the adapters, serving, ptq, lora and diagnostics: not public. Each
# entry point takes the Caller its errors name first; the public ones
# (qbits.quantize...) wrap it with their own (_plan.entry_point).
from qbits.transform import _plan, _store, _transform  # isort: skip
from qbits.transform import _adapt as _adapting  # isort: skip

_Caller = _plan.Caller
_WeightMatmul = _adapting.WeightMatmul
_adapt = adapt.__wrapped__  # type: ignore[attr-defined]
_init_probes = _transform.init_probes
_init_state = _transform.init_state.__wrapped__
_layer_table = _transform.layer_table.__wrapped__
_observe_matmuls = observe_matmuls.__wrapped__  # type: ignore[attr-defined]
_quantize = _transform.quantize.__wrapped__
_store_weights = _store.store_weights
_outside = _plan._outside
_weight_matmuls = _adapting.weight_matmuls
