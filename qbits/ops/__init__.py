"""Layer 4: quantized dot_general, einsum and conv."""

from qbits.ops.config import DotGeneralConfig, MatmulConfig
from qbits.ops.conv import ConvGeneralDilated, conv_general_dilated
from qbits.ops.dot_general import DotGeneral, dot_general
from qbits.ops.einsum import Einsum, einsum
from qbits.ops.hlo import dot_dtypes, jaxpr_dot_dtypes

__all__ = [
    "ConvGeneralDilated",
    "DotGeneral",
    "DotGeneralConfig",
    "Einsum",
    "MatmulConfig",
    "conv_general_dilated",
    "dot_dtypes",
    "dot_general",
    "einsum",
    "jaxpr_dot_dtypes",
]
