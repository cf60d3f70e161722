"""Layer 7: post-training quantization, through the engine.

:func:`collect_stats` runs a function on calibration batches and gives
every weight matmul's :class:`MatmulStats`: where its weight is and the
:class:`InputStats` of its activation (Hessian ``X^T X``, per-channel max
and mean magnitude), streamed over the batches.
"""

from qbits.ptq._collect import MatmulStats, collect_stats
from qbits.ptq._stats import InputStats

__all__ = [
    "InputStats",
    "MatmulStats",
    "collect_stats",
]
