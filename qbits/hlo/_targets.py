"""The accelerators qbits compiles for without one, and what they sustain.

A :class:`Target` names a device XLA can compile for on any machine
(deviceless, ahead of time: :func:`qbits.hlo.program`) and the rates that
turn its compiled program into a device-time estimate
(:meth:`qbits.hlo.Program.estimate`).

The H200's rates were measured: one profiled run of the MLP training step
of ``benchmarks/train_step.py --gpu`` (jax 0.11.2, 2026-11-27), each rate
read off its kernels (GEMM FLOPs over the GEMM's time; bytes moved over a
streaming kernel's time); ``int8_not_tn`` from the second run that day
(cuBLASLt's int8 GEMM given an rhs laid out ``[K, N]``: 1.1e12 operations
in 8.55 ms). The H100 is the same chip (GH100) with slower
memory: the same GEMM rates, bandwidths scaled by the ratio of the two
memories' peak figures (3.35 / 4.8 TB/s). The TPUs' figures are the
vendor's peak numbers (*read*, never measured here).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import types
from collections.abc import Mapping

from qbits._errors import InvalidArgumentError

__all__ = ["TARGETS", "Target", "target"]


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to compile for and the rates of its kernels.

    Attributes:
      name: The short name (``"h100"``).
      platform: ``"cuda"`` or ``"tpu"``.
      device: The device's name, as ``jax.devices()`` would show it.
      topology: For a TPU, the topology to compile for (``"v5e:2x2"``: the
        program runs on its first chip); ``""`` for a GPU.
      gemm_rates: Sustained GEMM rates in TFLOP/s (TOPS for integers) by the
        operands' kind: ``"bf16"`` (and other 16/32-bit floats), ``"fp8"``
        (fast accumulation), ``"fp8_exact"`` (FP8 accumulating in full
        float32, ``precision=HIGHEST``), ``"int8"``, ``"int8_strided"``
        (a Triton GEMM with an 8-bit operand not contiguous along its
        contracting axis) and ``"int8_not_tn"`` (cuBLASLt's int8 GEMM given
        such an operand: it falls back to a kernel at a twelfth of the rate).
      bandwidth: TB/s that a streaming kernel (elementwise work,
        reductions) moves.
      cast_bandwidth: TB/s of a kernel that quantizes (writes 8-bit codes:
        rounding, clipping and scaling make it slower than a copy).
      transpose_bandwidth: TB/s of a kernel that transposes as it copies
        (XLA's tiled transpose emitter).
      loop_transpose_bandwidth: TB/s of a transpose left to XLA's
        elementwise loop emitter (uncoalesced).
      launch_us: The least time a kernel takes, in microseconds.
      measured: Where the rates come from.
    """

    name: str
    platform: str
    device: str
    topology: str
    gemm_rates: Mapping[str, float]
    bandwidth: float
    cast_bandwidth: float
    transpose_bandwidth: float
    loop_transpose_bandwidth: float
    launch_us: float
    measured: str

    def config_text(self) -> str:
        """XLA's ``GpuTargetConfigProto`` of a GPU target (text format)."""
        files = importlib.resources.files("qbits.hlo") / "targets"
        return (files / f"{self.name}.txtpb").read_text()


_H200_GEMM = types.MappingProxyType(
    {"bf16": 803.0, "fp8": 1510.0, "fp8_exact": 1370.0, "int8": 1550.0,
     "int8_strided": 325.0, "int8_not_tn": 128.0}
)  # fmt: skip
_H100_SCALE = 3.35 / 4.8
_V5E_GEMM = types.MappingProxyType(
    {"bf16": 197.0, "fp8": 197.0, "fp8_exact": 197.0, "int8": 394.0,
     "int8_strided": 394.0, "int8_not_tn": 394.0}
)  # fmt: skip

#: The targets by name.
TARGETS: Mapping[str, Target] = types.MappingProxyType(
    {
        "h100": Target(
            "h100",
            "cuda",
            "NVIDIA H100 80GB HBM3",
            "",
            _H200_GEMM,
            4.3 * _H100_SCALE,
            2.6 * _H100_SCALE,
            2.8 * _H100_SCALE,
            0.33 * _H100_SCALE,
            1.5,
            "the H200's GEMM rates; its bandwidths x 3.35/4.8 (peak memory bandwidths)",
        ),
        "h200": Target(
            "h200",
            "cuda",
            "NVIDIA H200",
            "",
            _H200_GEMM,
            4.3,
            2.6,
            2.8,
            0.33,
            1.5,
            "measured: one H200, benchmarks/train_step.py --gpu, 2026-11-27",
        ),
        "v5e": Target(
            "v5e",
            "tpu",
            "TPU v5 lite",
            "v5e:2x2",
            _V5E_GEMM,
            0.82,
            0.82,
            0.82,
            0.82,
            1.0,
            "read: Google's peak figures",
        ),
    }
)


def target(name: str, owner: str = "qbits.hlo", argument: str = "target") -> Target:
    """The :class:`Target` called ``name``.

    Raises:
      InvalidArgumentError: For an unknown name.

    Example:
      >>> from qbits.hlo._targets import target
      >>> target("h200").gemm_rates["fp8"]
      1510.0
    """
    if not isinstance(name, str) or name not in TARGETS:
        raise InvalidArgumentError(
            owner, argument, name, "one of " + ", ".join(map(repr, TARGETS))
        )
    return TARGETS[name]
