"""The program a GPU or TPU would run, compiled on any machine.

XLA's GPU and TPU compilers run without a device ("deviceless", ahead of
time): given a description of the target they run every pass (fusion,
layout assignment, the cuBLASLt FP8 and int8 rewrites, the TPU's MXU
lowering) and return the optimized module that device would execute.
:func:`program` does that for a function and its arguments, and
:class:`Program` reads the result: its kernels, its GEMMs, what sits
between each quantization and its GEMM, and an estimate of its device time.

It needs the compiler of the target's platform: the CUDA plugin
(``pip install 'qbits[gpu]'``: ``jax[cuda13]``, about 3 GB) for a GPU, and
``libtpu`` (``pip install 'qbits[tpu]'``) for a TPU. Autotuning needs a
device and does not run: XLA then leaves every dot it would autotune as a
Triton GEMM fusion, so GPU programs are compiled with Triton GEMMs off
(:data:`GPU_COMPILER_OPTIONS`), which is also how qbits recommends running
8-bit programs on a GPU (``docs/guides/performance.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from qbits._errors import InvalidArgumentError
from qbits._platform import lowering_platforms
from qbits.hlo._estimate import Estimate, estimate
from qbits.hlo._module import Gemm, Kernel, kernels
from qbits.hlo._targets import TARGETS, Target, target

__all__ = ["GPU_COMPILER_OPTIONS", "Program", "program"]

#: XLA options for a GPU program whose matmuls are 8-bit: dots go straight
#: to cuBLAS(Lt) instead of Triton GEMM fusions that are autotuned against
#: it (on an H200 that autotuning was 75 of an FP8 step's 77 s of compile,
#: and the fusions it rejected left their converts and transposes behind as
#: lone kernels). Pass them per program:
#: ``jax.jit(step, compiler_options=dict(qbits.hlo.GPU_COMPILER_OPTIONS))``.
GPU_COMPILER_OPTIONS: Mapping[str, Any] = types.MappingProxyType(
    {"xla_gpu_enable_triton_gemm": False}
)

_INSTALL = {
    "cuda": "pip install 'qbits[gpu]' (jax[cuda13], about 3 GB; Python 3.12+)",
    "tpu": "pip install 'qbits[tpu]' (libtpu)",
}


@dataclasses.dataclass(frozen=True)
class Operand:
    """How one operand reaches a GEMM.

    Attributes:
      side: ``"lhs"`` or ``"rhs"``.
      source: The kernel (or parameter) that made the values the GEMM reads.
      path: The kernels between the quantization (a ``cast`` kernel, or the
        parameter) and the GEMM, nearest the GEMM first: transposes and
        copies of codes, converts.
      amax: The kernels that compute the scale the quantization uses
        (reductions, and a float32 copy of a weight where one is made).
    """

    side: str
    source: str
    path: tuple[Kernel, ...]
    amax: tuple[Kernel, ...]


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One GEMM of a :class:`Program` and what surrounds it.

    Attributes:
      kernel: The GEMM's kernel.
      operands: How each operand reaches it.
      output: The kernels that only convert its output (a GEMM could have
        written that dtype itself).
    """

    kernel: Kernel
    operands: tuple[Operand, ...]
    output: tuple[Kernel, ...]

    @property
    def gemm(self) -> Gemm:
        """The GEMM."""
        return self.kernel.gemm  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Program:
    """An optimized HLO module and what it runs.

    Attributes:
      text: The module's text.
      target: The target it was compiled for (for its estimate): a
        :class:`~qbits.hlo._targets.Target`, given as its name
        (``"h100"``, ``"h200"``, ``"v5e"``) or itself; or ``None`` (this
        machine's backend).
      temp_bytes: The device memory XLA allocates for the program's
        temporaries (its buffer assignment: activations, gradients, codes),
        besides its arguments and outputs; ``None`` where unknown.

    Example:
      >>> text = jax.jit(lambda a, b: a @ b).lower(
      ...     jnp.ones((8, 16)), jnp.ones((16, 4))).compile().as_text()
      >>> p = qbits.hlo.Program(text)
      >>> len(p.gemms), p.gemms[0].lhs
      (1, 'f32')
    """

    text: str
    target: Target | str | None = None
    temp_bytes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.target, str):
            named = target(self.target, "qbits.hlo.Program", "target")
            object.__setattr__(self, "target", named)

    @functools.cached_property
    def kernels(self) -> tuple[Kernel, ...]:
        """Every kernel, in program order (:func:`qbits.hlo.kernels`)."""
        return tuple(kernels(self.text))

    @property
    def gemms(self) -> tuple[Gemm, ...]:
        """The GEMMs, in program order."""
        return tuple(k.gemm for k in self.kernels if k.gemm is not None)

    def count(self, category: str) -> int:
        """The number of kernels of a category (``"code_layout"``...)."""
        return sum(k.category == category for k in self.kernels)

    def estimate(self, target_name: str | None = None) -> Estimate:
        """The estimated device time on ``target_name`` (default: the target).

        Raises:
          InvalidArgumentError: Without a target.
        """
        t = (
            self.target
            if target_name is None
            else target(target_name, "qbits.hlo.Program.estimate", "target_name")
        )
        if t is None:
            raise InvalidArgumentError(
                "qbits.hlo.Program.estimate", "target_name", None,
                "a target name (" + ", ".join(map(repr, TARGETS)) + ") for a "
                "program compiled for this machine",
            )  # fmt: skip
        return estimate(self.kernels, t)

    @functools.cached_property
    def matmuls(self) -> tuple[Matmul, ...]:
        """Every GEMM with the kernels between it and its quantized operands."""
        by_name = {k.name: k for k in self.kernels}
        users: dict[str, list[Kernel]] = {}
        for k in self.kernels:
            for i in k.inputs:
                users.setdefault(i, []).append(k)

        def amax_of(cast: Kernel) -> tuple[Kernel, ...]:
            found: list[Kernel] = []
            todo = [i for i in cast.inputs if i in by_name]
            seen: set[str] = set()
            while todo:
                k = by_name[todo.pop()]
                if k.name in seen or k.category in ("gemm", "cast"):
                    continue
                seen.add(k.name)
                if k.category in ("reduce", "wide_copy") or k.transposes:
                    found.append(k)
                if k.category in ("reduce", "wide_copy", "other") and (
                    k.category != "other" or k.written < 1 << 16
                ):
                    todo.extend(i for i in k.inputs if i in by_name)
            return tuple(f for f in found if f.category in ("reduce", "wide_copy"))

        out = []
        for k in self.kernels:
            if k.gemm is None:
                continue
            operands = []
            for side, name in zip(("lhs", "rhs"), k.inputs[:2], strict=False):
                path: list[Kernel] = []
                while name in by_name and by_name[name].category in (
                    "code_layout", "output_convert"
                ):  # fmt: skip
                    path.append(by_name[name])
                    name = by_name[name].inputs[0]
                source = by_name.get(name)
                amax = amax_of(source) if source and source.category == "cast" else ()
                operands.append(Operand(side, name, tuple(path), amax))
            converts = tuple(
                u for u in users.get(k.name, []) if u.category == "output_convert"
            )
            out.append(Matmul(k, tuple(operands), converts))
        return tuple(out)

    def summary(self) -> str:
        """A table of the GEMMs, what surrounds them, and the estimate."""
        lines = []
        head = f"{len(self.gemms)} GEMMs, {len(self.kernels)} kernels"
        if self.target is not None:
            e = self.estimate()
            head = (
                f"{self.target.name} ({self.target.device}): {head}; estimated "
                f"{e.total_ms:.2f} ms of device time (GEMMs {e.gemm_ms:.2f}, "
                f"the rest {e.outside_gemms_ms:.2f})"
            )
            if self.temp_bytes is not None:
                head += f"; temporaries {self.temp_bytes / 2**20:.0f} MiB"
        lines.append(head)
        for m in self.matmuls:
            g = m.gemm
            notes = []
            for o in m.operands:
                for k in o.path:
                    what = {"code_layout": "codes re-laid out",
                            "output_convert": "converted"}[k.category]  # fmt: skip
                    notes.append(f"{o.side}: {what} ({_of(k)})")
                copies = [k for k in o.amax if k.category == "wide_copy"]
                for k in copies:
                    notes.append(f"{o.side}: amax of a float32 copy ({_of(k)})")
            for k in m.output:
                notes.append(f"out: a separate convert to {k.output} ({_of(k)})")
            if g.low_precision and not all(g.contraction_minor):
                minor = zip(("lhs", "rhs"), g.contraction_minor, strict=True)
                side = " and ".join(name for name, ok in minor if not ok)
                path = "Triton" if g.kind == "triton" else "cuBLASLt"
                notes.append(
                    f"{side}: 8-bit, not contiguous along K (not TN): "
                    f"{path}'s slow path"
                )
            where = _short(m.kernel.where)
            lines.append(
                f"  {m.kernel.name:18s} {g!s:44s} {where}"
                + "".join(f"\n      {n}" for n in notes)
            )
        if self.target is not None:
            e = self.estimate()
            parts = ", ".join(
                f"{c} {ms:.2f}" for c, ms in sorted(e.by_category.items(),
                                                   key=lambda kv: -kv[1])
            )  # fmt: skip
            lines.append(f"  time by kind (ms): {parts}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _of(k: Kernel) -> str:
    return f"{k.name}, {k.nbytes / 1e6:.0f} MB"


def _short(where: str) -> str:
    parts = [p for p in where.split("/") if p and not p.startswith(("jit(", "cond",
             "branch_", "pjit"))]  # fmt: skip
    return "/".join(parts[-3:])


def _spec(x: Any, sharding: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
    return x


@functools.cache
def _device(name: str) -> Any:
    """One device of the target's topology (deviceless)."""
    from jax.experimental import topologies

    t = target(name)
    try:
        if t.platform == "cuda":
            topology = topologies.get_topology_desc(
                platform="cuda", target_config=t.config_text(), topology="1x1x1"
            )
        else:
            topology = topologies.get_topology_desc(
                platform="tpu", topology_name=t.topology
            )
    except Exception as e:  # jax's own, for a missing plugin or backend
        raise RuntimeError(
            f"qbits.hlo.program: cannot compile for {t.name} ({t.platform}) on "
            f"this machine: {type(e).__name__}: {e}. Install the compiler: "
            f"{_INSTALL[t.platform]}; on a machine without a GPU, call "
            "qbits.hlo.prepare_environment() before jax runs anything "
            "(qbits inspect --target does)."
        ) from None
    return topology.devices[0]


def _cuda_plugin() -> bool:
    """Whether jax's CUDA plugin is installed."""
    for version in (12, 13):
        try:
            if importlib.util.find_spec(f"jax_plugins.xla_cuda{version}"):
                return True
        except ModuleNotFoundError:  # no jax_plugins package at all
            return False
    return False


def prepare_environment() -> None:
    """Lets jax start XLA's GPU compiler on a machine without a GPU.

    Call it before jax runs anything (its backends start then), on a
    machine without a GPU (it hides the GPUs of one that has some): sets
    ``CUDA_VISIBLE_DEVICES=-1`` and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``
    where they are unset, and, where the CUDA plugin is installed and
    ``JAX_PLATFORMS`` is unset, jax's platforms to ``cpu,cuda`` (no other
    plugin starts). ``qbits inspect --target`` calls it.

    Example:
      >>> qbits.hlo.prepare_environment()  # doctest: +SKIP
    """
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if _cuda_plugin() and "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu,cuda"
        jax.config.update("jax_platforms", "cpu,cuda")


def program(
    fn: Callable[..., Any],
    *args: Any,
    target: str,
    compiler_options: Mapping[str, Any] | None = None,
) -> Program:
    """Compiles ``fn(*args)`` for ``target`` on this machine; no device needed.

    Args:
      fn: The function, as it would be given to ``jax.jit`` (a training
        step, a forward pass).
      *args: Its arguments: arrays or ``jax.ShapeDtypeStruct`` s (nothing is
        computed; only shapes and dtypes are used).
      target: ``"h100"``, ``"h200"`` or ``"v5e"`` (their rates:
        :data:`~qbits.hlo._targets.TARGETS`).
      compiler_options: XLA options for the compile; for a GPU the default
        is :data:`GPU_COMPILER_OPTIONS`.

    Returns:
      The compiled :class:`Program`: ``print(p)`` lists its GEMMs and what
      surrounds them, ``p.estimate()`` its device time.

    Raises:
      InvalidArgumentError: For an unknown target.
      RuntimeError: Where the target's compiler is not installed (the
        message says how to install it).

    Example:
      With the CUDA plugin installed (``pip install 'qbits[gpu]'``)::

        p = qbits.hlo.program(step, params, x, y, target="h100")
        print(p)              # each GEMM: cuBLASLt FP8? s8? what feeds it
        p.estimate().total_ms
    """
    t = _target_arg(target)
    if compiler_options is None:
        compiler_options = GPU_COMPILER_OPTIONS if t.platform == "cuda" else {}
    device = _device(t.name)
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = jax.tree.map(lambda x: _spec(x, sharding), args)
    with lowering_platforms(t.platform):
        traced = jax.jit(fn).trace(*specs)
    lowered = traced.lower(lowering_platforms=(t.platform,))
    compiled = lowered.compile(compiler_options=dict(compiler_options))
    memory = compiled.memory_analysis()
    temp = None if memory is None else int(memory.temp_size_in_bytes)
    return Program(compiled.as_text(), t, temp)


def _target_arg(name: Any) -> Target:
    return target(name, "qbits.hlo.program")
