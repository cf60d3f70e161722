"""What XLA actually runs: the GEMMs of an optimized module and their dtypes."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend

__all__ = ["Gemm", "dot_dtypes", "gemms", "jaxpr_dot_dtypes"]

_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[")
_DOT = re.compile(r"= (\w+)\[[^\]]*\][^ ]* dot\(%?([\w.\-]+), %?([\w.\-]+)\)")


def _optimized_text(f: Callable[..., Any] | str, args: tuple[Any, ...]) -> str:
    return f if isinstance(f, str) else jax.jit(f).lower(*args).compile().as_text()


def _element_types(text: str) -> dict[str, str]:
    """Instruction name -> element type (the first of a tuple)."""
    dtypes = {}
    for line in text.splitlines():
        m = _DEF.match(line)
        if m:
            dtypes[m.group(1)] = m.group(2)
    return dtypes


def dot_dtypes(f: Callable[..., Any] | str, *args: Any) -> list[tuple[str, str, str]]:
    """``(lhs, rhs, out)`` element types of every dot XLA compiled.

    Use it to check that a quantized matmul stays quantized after XLA's
    optimizations (an int8 dot should read ``("s8", "s8", "s32")``; XLA may
    widen operands it cannot run natively). On a GPU most dots become
    library calls or fused kernels: :func:`gemms` lists those.

    Args:
      f: A function (compiled with ``jax.jit`` on ``args``), or the text of
        an optimized HLO module (``compiled.as_text()``).
      *args: Arguments for ``f``.

    Returns:
      One ``(lhs, rhs, out)`` tuple of HLO type names per dot.

    Example:
      XLA:CPU runs an int8 dot natively only when the lhs is contracted along
      its last axis; otherwise it widens both operands to int32:

      >>> import jax.numpy as jnp
      >>> a, b = jnp.ones((4, 8), jnp.int8), jnp.ones((8, 4), jnp.int8)
      >>> def dot(a, b, dims):
      ...     return jax.lax.dot_general(a, b, (dims, ((), ())),
      ...                                preferred_element_type=jnp.int32)
      >>> qbits.ops.dot_dtypes(lambda a, b: dot(a, b, ((1,), (0,))), a, b)
      [('s8', 's8', 's32')]
      >>> qbits.ops.dot_dtypes(lambda a, b: dot(b, a, ((0,), (1,))), a, b)
      [('s32', 's32', 's32')]
    """
    text = _optimized_text(f, args)
    dtypes = _element_types(text)
    found = []
    for line in text.splitlines():
        m = _DOT.search(line)
        if m:
            out, a, b = m.groups()
            found.append((dtypes.get(a, "?"), dtypes.get(b, "?"), out))
    return found


class Gemm(NamedTuple):
    """One GEMM of an optimized module (see :func:`gemms`).

    Attributes:
      kind: ``"cublaslt_fp8"`` (``__cublas$lt$matmul$f8``), ``"cublaslt"``,
        ``"cublas"`` (``__cublas$gemm``), ``"cudnn"``, ``"triton"`` (a
        Triton GEMM fusion), another fusion kind, or ``"dot"`` (a dot XLA
        runs itself, as XLA:CPU's own dots; ``"ynn_fusion"`` for its
        YNNPACK ones).
      lhs: The element type of the left operand as the GEMM reads it.
      rhs: The same for the right operand.
      out: The element type of the result.
      name: The instruction's name in the module.
    """

    kind: str
    lhs: str
    rhs: str
    out: str
    name: str


_CALL_KINDS = {
    "__cublas$lt$matmul$f8": "cublaslt_fp8",
    "__cublas$lt$matmul": "cublaslt",
    "__cublas$gemm": "cublas",
}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \(?(\w+)\[")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_FUSION_KIND = re.compile(r'"kind":"([^"]+)"')
_OPERANDS = re.compile(r"(?:custom-call|dot)\(([^)]*)\)")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")


def _operand_names(line: str) -> list[str]:
    m = _OPERANDS.search(line)
    if not m:
        return []
    return [a.strip().split(" ")[-1].lstrip("%") for a in m.group(1).split(",")]


def gemms(f: Callable[..., Any] | str, *args: Any) -> list[Gemm]:
    """Every GEMM XLA compiled: library calls, GEMM fusions and plain dots.

    On a GPU, XLA turns dots into cuBLAS/cuBLASLt calls (an FP8 dot with
    per-tensor scales into ``__cublas$lt$matmul$f8``) or into Triton GEMM
    fusions; this lists each with the element types it reads, so that a test
    or a benchmark can check that every quantized matmul runs on its
    low-precision GEMM. On CPU it lists the dots (as :func:`dot_dtypes`).

    Args:
      f: A function (compiled with ``jax.jit`` on ``args``), or the text of
        an optimized HLO module (``compiled.as_text()``).
      *args: Arguments for ``f``.

    Returns:
      A list of :class:`Gemm`, in module order.

    Example:
      >>> import jax.numpy as jnp
      >>> a = jnp.ones((4, 8), jnp.int8)
      >>> (g,) = qbits.ops._hlo.gemms(lambda a, b: jax.lax.dot_general(
      ...     a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32),
      ...     a, a)
      >>> g.lhs, g.rhs, g.out
      ('s8', 's8', 's32')
    """
    text = _optimized_text(f, args)
    dtypes = _element_types(text)
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        header = _HEADER.match(line) if line and not line[0].isspace() else None
        if header and line.rstrip().endswith("{"):
            current = bodies.setdefault(header.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)

    def inner_dot(comp: str, seen: set[str]) -> str | None:
        seen.add(comp)
        for line in bodies.get(comp, []):
            if " dot(" in line:
                return line
            for called in _CALLS.findall(line):
                if called not in seen:
                    found = inner_dot(called, seen)
                    if found:
                        return found
        return None

    fused: set[str] = set()
    found: list[Gemm] = []
    for lines in bodies.values():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, out = m.groups()
            target = _TARGET.search(line)
            if target and ("cublas" in target.group(1) or "cudnn" in target.group(1)):
                ops = _operand_names(line)
                kind = _CALL_KINDS.get(target.group(1), target.group(1))
                lhs, rhs = (dtypes.get(o, "?") for o in [*ops, "?", "?"][:2])
                found.append(Gemm(kind, lhs, rhs, out, name))
                continue
            calls = _CALLS.search(line)
            if " fusion(" in line and "kind=kCustom" in line and calls:
                seen: set[str] = set()
                dot = inner_dot(calls.group(1), seen)
                if dot is None:
                    continue
                fused |= seen
                kind = _FUSION_KIND.search(line)
                kind_name = kind.group(1).lstrip("_") if kind else "fusion"
                kind_name = "triton" if "triton" in kind_name else kind_name
                kind_name = "cudnn" if "cudnn" in kind_name else kind_name
                ops = _operand_names(dot)
                lhs, rhs = (dtypes.get(o, "?") for o in [*ops, "?", "?"][:2])
                found.append(Gemm(kind_name, lhs, rhs, out, name))
    for comp, lines in bodies.items():
        if comp in fused:
            continue
        for line in lines:
            m = _DOT.search(line)
            im = _INSTR.match(line)
            if m and im:
                out, a, b = m.groups()
                found.append(Gemm("dot", dtypes.get(a, "?"), dtypes.get(b, "?"),
                                  out, im.group(1)))  # fmt: skip
    return found


def jaxpr_dot_dtypes(
    f: Callable[..., Any], *args: Any, primitive: str = "dot_general"
) -> list[tuple[str, str, str]]:
    """``(lhs, rhs, out)`` dtype names of every ``dot_general`` in ``f``'s jaxpr.

    Walks into nested jaxprs (``jit``, ``custom_vjp``, ``scan``, ...). Unlike
    :func:`dot_dtypes` it shows what qbits emitted, before XLA rewrites it;
    only the forward computation is traced unless ``f`` itself differentiates.

    Args:
      f: A function of ``args``.
      *args: Arguments for ``f``.
      primitive: The primitive to list: ``"dot_general"`` or
        ``"conv_general_dilated"``.

    Returns:
      One ``(lhs, rhs, out)`` tuple of numpy dtype names per matching equation.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((4, 8))
      >>> int8 = qbits.presets.get("int8_fwd")
      >>> qbits.ops.jaxpr_dot_dtypes(lambda a, b: qbits.dot_general(int8)(
      ...     a, b, (((1,), (0,)), ((), ()))), x, x.T)
      [('int8', 'int8', 'int32')]
    """
    found: list[tuple[str, str, str]] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == primitive:
                a, b = (v.aval.dtype.name for v in eqn.invars)
                found.append((a, b, eqn.outvars[0].aval.dtype.name))
            branch = _platform_branch(eqn)
            subs = [branch] if branch else jax.extend.core.jaxprs_in_params(eqn.params)
            for sub in subs:
                walk(sub)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


_PLATFORM_ALIASES = {"gpu": ("cuda", "rocm", "gpu")}


def _platform_branch(eqn: Any) -> Any:
    """The branch of a ``lax.platform_dependent`` cond this backend lowers."""
    platforms = (
        eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
    )
    if not platforms:
        return None
    backend = jax.default_backend()
    names = _PLATFORM_ALIASES.get(backend, (backend,))
    for branch, where in zip(eqn.params["branches"], platforms, strict=True):
        if where is None or any(p in names for p in where):
            return branch.jaxpr
    return None
