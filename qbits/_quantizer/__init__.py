"""Layer 3: Quantizer = numerics + calibration + granularity.

- :mod:`~qbits._quantizer._quantizer`: :class:`Quantizer`, and
  :func:`quantize_all`, which quantizes several tensors with one small scale
  kernel (:mod:`~qbits._quantizer._arithmetic`).
- :mod:`~qbits._quantizer._zero_point`: asymmetric grids, a scale and an
  integer zero point per block.
- :mod:`~qbits._quantizer._two_level`: E4M3 block scales under a float32
  tensor scale (NVFP4).
- :mod:`~qbits._quantizer._storage`: storing the values (int8, packed
  4-bit codes, fp8), and the numerics' gradient.
- :mod:`~qbits._quantizer._mx`: OCP Microscaling quantizers.
"""

from qbits._quantizer._mx import mx_quantizer
from qbits._quantizer._quantizer import Quantizer, Request, quantize_all

__all__ = [
    "Quantizer",
    "Request",
    "mx_quantizer",
    "quantize_all",
]
