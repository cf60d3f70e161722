"""Layer 7: where low precision hurts, per layer and per operand.

Diagnostics measure every quantized operand of every quantized matmul of a
function (through the engine, :func:`qbits.quantize`) or of one matmul
(:func:`qbits.dot_general` and the other ops, ``diagnostics=``): the
forward lhs and rhs, and the output gradient and the kept operand of both
backward matmuls. For each: the SQNR in dB, the fraction
of values clipped (saturated) and flushed to zero, the bits the scale
leaves unused, and the range of its scales (:class:`Metrics`).

How: each quantized matmul gets a *probe*, a few zeros (:func:`init`);
the core measures its operands in the forward and backward passes and the
measurements are the probe's gradient. So they come out of ``jax.grad``
(or ``jax.vjp``) under ``jit`` as a pytree, with no host callback, stacked
per layer along a scan over stacked layers; without probes nothing is
measured and the compiled program is the one without diagnostics.

- :func:`diagnose`: a function's output and its :class:`Metrics`, in one
  call (its gradient too, for a scalar loss).
- :func:`init`, then ``qbits.quantize(fn, config, diagnostics=probes)``,
  differentiated with respect to the probes, then :func:`read`: the same
  inside a training step of your own.
- :meth:`Metrics.table`: the per-layer table; :meth:`Metrics.rows`: flat
  records (CSV, JSON).
- :func:`search_budget`: what to do about it under a bit budget: each
  weight matmul's loss change under each candidate format, then the
  per-layer choice (an exact knapsack) as a :class:`~qbits.QuantConfig`
  (:class:`BudgetSearch`).
"""

from qbits.diagnostics._metrics import Metrics, diagnose, init, read
from qbits.diagnostics._search import BudgetSearch, search_budget

__all__ = [
    "BudgetSearch",
    "Metrics",
    "diagnose",
    "init",
    "read",
    "search_budget",
]
