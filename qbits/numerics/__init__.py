"""Layer 1: how a real number (divided by its scale) becomes a grid point."""

from qbits.numerics.base import NoiseFn, QNumerics
from qbits.numerics.formats import (
    FLOAT_FORMATS,
    FloatFormat,
    float_format,
    round_to_format,
    stochastic_round_to_format,
)
from qbits.numerics.fp_numerics import Fp8Numerics, FpNumerics
from qbits.numerics.int_numerics import IntNumerics
from qbits.numerics.no_numerics import NoNumerics
from qbits.numerics.noise import UniformNoise, derive_key, hash_bits

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
    "derive_key",
    "float_format",
    "hash_bits",
    "round_to_format",
    "stochastic_round_to_format",
]
