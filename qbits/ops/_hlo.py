"""What XLA actually runs: the GEMMs of an optimized module and their dtypes."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.extend

__all__ = ["dot_dtypes", "jaxpr_dot_dtypes"]

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
    library calls or fused kernels: :class:`qbits.hlo.Program` lists those.

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
