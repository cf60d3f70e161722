"""Layer 1: how a real number (divided by its scale) becomes a grid point.

The grids (:class:`IntNumerics`, :class:`FpNumerics`, :class:`NoNumerics`;
:class:`UintNumerics` for asymmetric quantization with a zero point,
:class:`Nf4Numerics` for QLoRA's NF4 levels, :class:`TernaryNumerics` for
BitNet b1.58's -1, 0, +1;
:class:`QNumerics` to write one's own), stochastic rounding
(:class:`UniformNoise`, whose key comes in a :class:`Context`) and the
chain of PRNG keys it draws from (:func:`next_key`). The float formats
themselves (ml_dtypes' fp8, fp6, fp4) are described in :mod:`qbits._formats`.
"""

from qbits._context import Context
from qbits.numerics._base import QNumerics
from qbits.numerics._codebook import Nf4Numerics
from qbits.numerics._fp_numerics import Fp8Numerics
from qbits.numerics._fp_numerics import FpNumerics as FpNumerics  # qbits.FpNumerics
from qbits.numerics._int_numerics import IntNumerics as IntNumerics  # qbits.IntNumerics
from qbits.numerics._keys import next_key
from qbits.numerics._no_numerics import NoNumerics
from qbits.numerics._noise import UniformNoise
from qbits.numerics._ternary import TernaryNumerics
from qbits.numerics._uint_numerics import UintNumerics

__all__ = [
    "Context",
    "Fp8Numerics",
    "Nf4Numerics",
    "NoNumerics",
    "QNumerics",
    "TernaryNumerics",
    "UintNumerics",
    "UniformNoise",
    "next_key",
]

# Key helpers for ops, transform, lora and nnx (checking a key where it
# enters, a key per operand, the counter-based hash key): not public.
from qbits.numerics._keys import (  # isort: skip
    check_key as _check_key,  # noqa: F401
    derive_key as _derive_key,  # noqa: F401
    hash_key as _hash_key,  # noqa: F401
)

# bitsandbytes' dynamic map and nearest-level rounding, for the quantizer's
# double-quantized scales, QTensor and qbits.optim: not public.
from qbits.numerics._dynamic import (  # isort: skip
    SIGNED_MAP as _SIGNED_MAP,  # noqa: F401
    count_below as _count_below,  # noqa: F401
    dynamic_map as _dynamic_map,  # noqa: F401
    nearest_level as _nearest_level,  # noqa: F401
)
