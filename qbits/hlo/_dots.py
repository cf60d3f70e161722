"""The dtypes of every dot: of the module XLA compiled, or of the jaxpr."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.extend

from qbits._errors import InvalidArgumentError

__all__ = ["dot_dtypes"]

_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[")
_DOT = re.compile(r"= (\w+)\[[^\]]*\][^ ]* dot\(%?([\w.\-]+), %?([\w.\-]+)\)")


def _element_types(text: str) -> dict[str, str]:
    """Instruction name -> element type (the first of a tuple)."""
    dtypes = {}
    for line in text.splitlines():
        m = _DEF.match(line)
        if m:
            dtypes[m.group(1)] = m.group(2)
    return dtypes


def dot_dtypes(
    f: Callable[..., Any] | str,
    *args: Any,
    stage: str = "compiled",
    primitive: str = "dot_general",
) -> list[tuple[str, str, str]]:
    """``(lhs, rhs, out)`` element types of every dot of ``f(*args)``.

    ``stage="compiled"`` reads the module XLA optimized (``jax.jit(f)``
    compiled on ``args``): use it to check that a quantized matmul stays
    quantized after XLA's rewrites (an int8 dot should read ``("s8", "s8",
    "s32")``; XLA may widen operands it cannot run natively). On a GPU
    most dots become library calls or fused kernels: :class:`Program`
    lists those. ``stage="jaxpr"`` reads ``f``'s jaxpr instead, walking
    into nested jaxprs (``jit``, ``custom_vjp``, ``scan``, ...): what
    qbits emitted, before XLA rewrites it; only the forward computation
    is traced unless ``f`` itself differentiates.

    Args:
      f: A function of ``args``; for ``stage="compiled"`` also the text of
        an optimized HLO module (``compiled.as_text()``).
      *args: Arguments for ``f``.
      stage: ``"compiled"`` (HLO type names: ``"s8"``, ``"f32"``) or
        ``"jaxpr"`` (NumPy dtype names: ``"int8"``, ``"float32"``).
      primitive: With ``stage="jaxpr"``, the primitive to list:
        ``"dot_general"`` or ``"conv_general_dilated"``.

    Returns:
      One ``(lhs, rhs, out)`` tuple of type names per dot (per equation of
      ``primitive``).

    Raises:
      InvalidArgumentError: For another ``stage``, HLO text with
        ``stage="jaxpr"``, or another ``primitive`` than ``"dot_general"``
        with ``stage="compiled"``.

    Example:
      XLA:CPU runs an int8 dot natively only when the lhs is contracted along
      its last axis; otherwise it widens both operands to int32:

      >>> a, b = jnp.ones((4, 8), jnp.int8), jnp.ones((8, 4), jnp.int8)
      >>> def dot(a, b, dims):
      ...     return jax.lax.dot_general(a, b, (dims, ((), ())),
      ...                                preferred_element_type=jnp.int32)
      >>> qbits.hlo.dot_dtypes(lambda a, b: dot(a, b, ((1,), (0,))), a, b)
      [('s8', 's8', 's32')]
      >>> qbits.hlo.dot_dtypes(lambda a, b: dot(b, a, ((0,), (1,))), a, b)
      [('s32', 's32', 's32')]

      What qbits emitted, before XLA:

      >>> x = jnp.ones((4, 8))
      >>> int8 = qbits.presets.get("int8_fwd")
      >>> qbits.hlo.dot_dtypes(lambda a, b: qbits.dot_general(int8)(
      ...     a, b, (((1,), (0,)), ((), ()))), x, x.T, stage="jaxpr")
      [('int8', 'int8', 'int32')]
    """
    owner = "qbits.hlo.dot_dtypes"
    if stage not in ("compiled", "jaxpr"):
        raise InvalidArgumentError(owner, "stage", stage, '"compiled" or "jaxpr"')
    if stage == "jaxpr":
        if isinstance(f, str):
            raise InvalidArgumentError(
                owner, "f", "HLO text", "a function", why='stage="jaxpr" traces f'
            )
        return _jaxpr_dots(f, args, primitive)
    if primitive != "dot_general":
        raise InvalidArgumentError(
            owner,
            "primitive",
            primitive,
            '"dot_general"',
            why='stage="compiled" lists the dots of the HLO module',
        )
    text = f if isinstance(f, str) else jax.jit(f).lower(*args).compile().as_text()
    dtypes = _element_types(text)
    found = []
    for line in text.splitlines():
        m = _DOT.search(line)
        if m:
            out, a, b = m.groups()
            found.append((dtypes.get(a, "?"), dtypes.get(b, "?"), out))
    return found


def _jaxpr_dots(
    f: Callable[..., Any], args: tuple[Any, ...], primitive: str
) -> list[tuple[str, str, str]]:
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
