"""Layer 7: post-training quantization (PTQ).

Calibration statistics come through the engine: :func:`collect_stats` runs a
function on calibration batches and gives every weight matmul's
:class:`MatmulStats`: where its weight is (``matrix(w)`` reshapes it to
``(K, N)``) and the :class:`InputStats` of its activation (Hessian
``X^T X``, per-channel max and mean magnitude), streamed over the batches.

The algorithms are pure functions over one weight matmul ``x @ w``, the
weight a 2-D array of shape ``(K, N)`` (``K`` input channels, the
contracting axis; ``N`` output channels), and those statistics as plain
arrays. The target grid is a :class:`~qbits.Quantizer` applied to ``w`` with
contracting axis 0 (``qbits.PerChannel()``: a scale per output channel;
``qbits.Tiled(tile_size=128)``: groups of 128 input channels).

- :class:`Gptq`: GPTQ (arXiv 2210.17323), quantize input channel by input
  channel and spread each one's error onto the rest, guided by ``H``
  (:class:`GptqResult`: the weight on its grid and its scales).
- :class:`Awq`: AWQ (arXiv 2306.00978), search per-input-channel scales
  ``mean|x|**alpha`` that protect the salient inputs (:meth:`Awq.search`:
  :class:`AwqResult`).
- :func:`smooth_scales`: SmoothQuant (arXiv 2211.10438), move activation
  outliers into the weight before int8 activations
  (``x @ w == (x / s) @ (s w)``).
- :func:`hadamard`: QuaRot-style rotations (``x @ w == (x Q) @ (Q^T w)``).

:func:`quantize_weights` is the driver: statistics of every weight matmul
of any function or model, then a method on each weight with the grid its
rule gives, in the layout its matmul reads it in, once for the matmuls that
share it (:class:`PtqResult`, one report a weight in its ``layers``). Methods are values
holding their settings, each a :class:`Method` (:class:`InputStats` in, a
quantized weight out): :class:`Rtn` (round to nearest), :class:`Gptq`,
:class:`Awq`, :class:`Qep` (quantization error propagation: each weight
corrected for the error of the weights before it, arXiv 2504.09629);
``method="gptq"`` stands for ``Gptq()``.

The package sits on layer 7 (with :mod:`qbits.flax` and :mod:`qbits.nnx`):
it may import the quantizer, calibrations, numerics, granularities, ops,
config and the engine.
"""

from qbits.ptq._awq import Awq, AwqResult
from qbits.ptq._collect import MatmulStats, collect_stats
from qbits.ptq._gptq import Gptq, GptqResult
from qbits.ptq._method import Method
from qbits.ptq._qep import Qep
from qbits.ptq._rotation import hadamard
from qbits.ptq._rtn import Rtn
from qbits.ptq._smoothquant import smooth_scales
from qbits.ptq._stats import InputStats
from qbits.ptq._weights import PtqResult, quantize_weights

__all__ = [
    "Awq",
    "AwqResult",
    "Gptq",
    "GptqResult",
    "InputStats",
    "MatmulStats",
    "Method",
    "PtqResult",
    "Qep",
    "Rtn",
    "collect_stats",
    "hadamard",
    "quantize_weights",
    "smooth_scales",
]

# For qbits.lora (where a matmul reads its weight in its parameter), not users.
from qbits.ptq._layout import operand_indices as _operand_indices  # noqa: F401  # isort: skip
