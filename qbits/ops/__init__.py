"""Layer 5: quantized dot_general, einsum, conv and ragged_dot.

One core (one custom VJP) computes the three quantized matmuls of each;
scales come from calibration or from scale state (see
:func:`dot_general`'s ``state=``). :data:`KINDS` holds each primitive's
op kind (:class:`~qbits.ops._kind.OpKind`): what the engine reads, checks
and runs of it. The underscored names are what the engine, the adapters,
serving and diagnostics need of the ops besides the ops: not public.
The drop-ins for ``jax.lax`` (``dot_general``, ``einsum``,
``conv_general_dilated``) and their configs are pinned where users reach
them, as :func:`qbits.dot_general` etc.; ``qbits.ops.X`` is the same object
(marked ``# qbits.X`` below).
"""

from qbits.ops import _conv, _dot_general, _ragged
from qbits.ops._config import DotGeneralConfig as DotGeneralConfig  # qbits.X
from qbits.ops._config import MatmulConfig as MatmulConfig  # qbits.X
from qbits.ops._conv import ConvGeneralDilated
from qbits.ops._conv import conv_general_dilated as conv_general_dilated  # qbits.X
from qbits.ops._diagnose import init_probe as _init_probe  # noqa: F401 (not public)
from qbits.ops._diagnose import read_probe as _read_probe  # noqa: F401
from qbits.ops._dims import Dims
from qbits.ops._dot_general import DotGeneral
from qbits.ops._dot_general import dot_general as dot_general  # qbits.X
from qbits.ops._einsum import Einsum
from qbits.ops._einsum import einsum as einsum  # qbits.X
from qbits.ops._kind import registry
from qbits.ops._ragged import ragged_dot
from qbits.ops._state import per_tensor_state as _per_tensor_state  # noqa: F401
from qbits.ops._stored import store_weight as _store_weight  # noqa: F401
from qbits.ops._stored import stored_matmul as _stored_matmul  # noqa: F401

#: ``{primitive name: OpKind}``: every primitive qbits quantizes (a new op
#: kind is its module's ``KIND`` added here).
KINDS = registry(_dot_general.KIND, _conv.KIND, _ragged.KIND)

__all__ = [
    "KINDS",
    "ConvGeneralDilated",
    "Dims",
    "DotGeneral",
    "Einsum",
    "ragged_dot",
]
