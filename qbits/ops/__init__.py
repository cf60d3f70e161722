"""Layer 5: quantized dot_general, einsum, conv and ragged_dot.

One core (one custom VJP) computes the three quantized matmuls of each;
scales come from calibration or from scale state (see
:func:`dot_general`'s ``state=``). :data:`KINDS` holds each primitive's
op kind (:class:`~qbits.ops._kind.OpKind`): what the engine reads, checks
and runs of it.
"""

from qbits.ops import _conv, _dot_general, _ragged
from qbits.ops._config import DotGeneralConfig, MatmulConfig
from qbits.ops._conv import ConvGeneralDilated, conv_general_dilated
from qbits.ops._diagnose import init_probe, read_probe
from qbits.ops._dims import Dims
from qbits.ops._dot_general import DotGeneral, dot_general
from qbits.ops._einsum import Einsum, einsum
from qbits.ops._hlo import dot_dtypes, jaxpr_dot_dtypes
from qbits.ops._kind import registry
from qbits.ops._ragged import ragged_dot
from qbits.ops._state import combine_state, max_combining, per_tensor_state
from qbits.ops._stored import store_weight, stored_matmul

#: ``{primitive name: OpKind}``: every primitive qbits quantizes (a new op
#: kind is its module's ``KIND`` added here).
KINDS = registry(_dot_general.KIND, _conv.KIND, _ragged.KIND)

__all__ = [
    "KINDS",
    "ConvGeneralDilated",
    "Dims",
    "DotGeneral",
    "DotGeneralConfig",
    "Einsum",
    "MatmulConfig",
    "combine_state",
    "conv_general_dilated",
    "dot_dtypes",
    "dot_general",
    "einsum",
    "init_probe",
    "jaxpr_dot_dtypes",
    "max_combining",
    "per_tensor_state",
    "ragged_dot",
    "read_probe",
    "store_weight",
    "stored_matmul",
]
