"""Layer 4: quantized dot_general, einsum and conv."""

from qbits.ops.config import DotGeneralConfig, MatmulConfig
from qbits.ops.conv import ConvGeneralDilated, conv_general_dilated
from qbits.ops.dot_general import DotGeneral, dot_general
from qbits.ops.einsum import Einsum, einsum
from qbits.ops.hlo import Gemm, dot_dtypes, gemms, jaxpr_dot_dtypes
from qbits.ops.stateful import (
    StatefulDotGeneral,
    combine_state,
    delayed_tensors,
    init_state,
    init_steps,
    learned_tensors,
    max_combining,
    needs_state,
    stateful_dot_general,
)

__all__ = [
    "ConvGeneralDilated",
    "DotGeneral",
    "DotGeneralConfig",
    "Einsum",
    "Gemm",
    "MatmulConfig",
    "StatefulDotGeneral",
    "combine_state",
    "conv_general_dilated",
    "delayed_tensors",
    "dot_dtypes",
    "dot_general",
    "einsum",
    "gemms",
    "init_state",
    "init_steps",
    "jaxpr_dot_dtypes",
    "learned_tensors",
    "max_combining",
    "needs_state",
    "stateful_dot_general",
]
