"""Layer 1: how a real number (divided by its scale) becomes a grid point."""

from qbits.numerics._base import NoiseFn, QNumerics, check_float_input, compute_dtype
from qbits.numerics._formats import (
    FLOAT_FORMATS,
    FloatFormat,
    float_format,
    round_to_format,
    stochastic_round_to_format,
)
from qbits.numerics._fp_numerics import Fp8Numerics, FpNumerics
from qbits.numerics._int_numerics import IntNumerics
from qbits.numerics._keys import (
    check_key,
    derive_key,
    hash_bits,
    hash_key,
    next_key,
)
from qbits.numerics._no_numerics import NoNumerics
from qbits.numerics._noise import UniformNoise

__all__ = [
    "FLOAT_FORMATS",
    "FloatFormat",
    "Fp8Numerics",
    "FpNumerics",
    "IntNumerics",
    "NoNumerics",
    "NoiseFn",
    "QNumerics",
    "UniformNoise",
    "check_float_input",
    "check_key",
    "compute_dtype",
    "derive_key",
    "float_format",
    "hash_bits",
    "hash_key",
    "next_key",
    "round_to_format",
    "stochastic_round_to_format",
]
