"""Layer 4: quantized dot_general, einsum and conv."""

from qbits.ops.config import DotGeneralConfig, MatmulConfig
from qbits.ops.dot_general import DotGeneral, dot_general
from qbits.ops.hlo import dot_dtypes

__all__ = [
    "DotGeneral",
    "DotGeneralConfig",
    "MatmulConfig",
    "dot_dtypes",
    "dot_general",
]
