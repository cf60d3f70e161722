"""The program XLA compiles, read: kernels, GEMMs, a device-time estimate.

:func:`program` compiles a function for a GPU or TPU on any machine (no
device needed: XLA's compilers run ahead of time against a description of
the target) and returns a :class:`Program`, which lists each GEMM XLA emits
(cuBLASLt FP8, s8, Triton, a bf16 fallback), what sits between each
quantization and its GEMM (transposes of codes, converts, amax passes on a
float32 copy) and estimates its device time from rates measured on an H200.
``qbits inspect CONFIG --target h100`` prints it for a training step.
Import it on its own (``import qbits.hlo``). What a :class:`Program`
returns (its kernels, GEMMs, estimate, the targets' rates) are plain
dataclasses documented with it.
:class:`Program` also reads a module compiled on this machine
(``Program(jax.jit(f).lower(...).compile().as_text())``).
:func:`dot_dtypes` lists the operand and result types of every dot of a
function, as XLA compiled it for this machine or as its jaxpr has it.
:func:`lowering_platforms` names the platforms a function is traced for,
where they are not the default backend's (a deviceless compile by hand,
``jax.export`` for several platforms); :func:`program` names its own.
"""

from qbits._platform import lowering_platforms
from qbits.hlo._dots import dot_dtypes
from qbits.hlo._program import (
    GPU_COMPILER_OPTIONS,
    Program,
    prepare_environment,
    program,
)

__all__ = [
    "GPU_COMPILER_OPTIONS",
    "Program",
    "dot_dtypes",
    "lowering_platforms",
    "prepare_environment",
    "program",
]

# Where the function defined in a private module is documented.
lowering_platforms.__module__ = "qbits.hlo"
