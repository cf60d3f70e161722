"""A device-time estimate of a compiled program, kernel by kernel.

The model is the simplest that the H200's profile supports: a GEMM takes
its FLOPs at the rate its operands run at (:attr:`Target.gemm_rates`); any
other kernel moves its bytes (every operand read whole, every output
written) at the bandwidth its kind sustains (streaming, a tiled transpose,
or a transpose left to the loop emitter; one that keeps the minor axis, a
permutation of whole rows such as attention's heads, at the tiled rate: on
the H200 XLA's fusion autotuner made such casts tiled Triton kernels, which
a deviceless compile cannot choose), and no kernel takes less than
:attr:`Target.launch_us`. Kernels run one after the other; what runs
between them (launches under CUDA graphs, the host) is not counted: the
estimate is device time, as a profiler sums it.

Checked against the H200 run it is calibrated on (the optimized HLO of each
variant and its profile): the device times of the bf16, fp8, fp8_delayed,
int8 and int8_fwd MLP steps within 10% (``tests/hlo/test_estimate.py``
pins it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from qbits.hlo._module import Gemm, Kernel
from qbits.hlo._targets import Target

__all__ = ["Estimate", "estimate", "kernel_us"]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The estimated device time of a program.

    Attributes:
      target: The target's name.
      total_ms: The whole program, in milliseconds.
      by_category: Milliseconds per kernel category (``gemm``, ``cast``,
        ``code_layout``, ``output_convert``, ``wide_copy``, ``reduce``,
        ``other``).
      kernels: ``(kernel name, microseconds)`` for every kernel, in program
        order.
    """

    target: str
    total_ms: float
    by_category: Mapping[str, float]
    kernels: tuple[tuple[str, float], ...]

    @property
    def gemm_ms(self) -> float:
        """The GEMMs' time."""
        return self.by_category.get("gemm", 0.0)

    @property
    def outside_gemms_ms(self) -> float:
        """Everything but the GEMMs."""
        return self.total_ms - self.gemm_ms


def _rate(gemm: Gemm, target: Target) -> float:
    rates = target.gemm_rates
    if not gemm.low_precision:
        return rates["bf16"]
    if gemm.lhs.startswith("f8") or gemm.rhs.startswith("f8"):
        return rates["fp8"] if gemm.fast_accumulation else rates["fp8_exact"]
    if not all(gemm.contraction_minor):
        return rates["int8_strided" if gemm.kind == "triton" else "int8_not_tn"]
    return rates["int8"]


def kernel_us(kernel: Kernel, target: Target) -> float:
    """The estimated time of one kernel, in microseconds."""
    if kernel.gemm is not None:
        rate = _rate(kernel.gemm, target)
        return max(target.launch_us, kernel.gemm.flops / rate / 1e6)
    if kernel.transposes and kernel.fusion_kind == "kLoop" and not kernel.keeps_rows:
        bandwidth = target.loop_transpose_bandwidth
    elif kernel.transposes:
        bandwidth = target.transpose_bandwidth
    elif kernel.category == "cast":
        bandwidth = target.cast_bandwidth
    else:
        bandwidth = target.bandwidth
    return max(target.launch_us, kernel.nbytes / bandwidth / 1e6)


def estimate(kernels: Sequence[Kernel], target: Target) -> Estimate:
    """The device time of ``kernels`` on ``target`` (see the module docstring)."""
    times = tuple((k.name, kernel_us(k, target)) for k in kernels)
    by: dict[str, float] = {}
    for k, (_, us) in zip(kernels, times, strict=True):
        by[k.category] = by.get(k.category, 0.0) + us / 1e3
    return Estimate(target.name, sum(us for _, us in times) / 1e3, by, times)
