"""Layer 4: quantized dot_general, einsum and conv.

One core (:mod:`qbits.ops.core`, one custom VJP) computes the three
quantized matmuls of each; scales come from calibration or from scale state
(:mod:`qbits.ops.state`).
"""

from qbits.ops.config import DotGeneralConfig, MatmulConfig
from qbits.ops.conv import ConvGeneralDilated, conv_general_dilated
from qbits.ops.dot_general import DotGeneral, dot_general
from qbits.ops.einsum import Einsum, einsum
from qbits.ops.hlo import Gemm, dot_dtypes, gemms, jaxpr_dot_dtypes
from qbits.ops.state import combine_state, max_combining, needs_state, state_kinds

__all__ = [
    "ConvGeneralDilated",
    "DotGeneral",
    "DotGeneralConfig",
    "Einsum",
    "Gemm",
    "MatmulConfig",
    "combine_state",
    "conv_general_dilated",
    "dot_dtypes",
    "dot_general",
    "einsum",
    "gemms",
    "jaxpr_dot_dtypes",
    "max_combining",
    "needs_state",
    "state_kinds",
]
