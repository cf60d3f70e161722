"""What XLA actually runs: the dtypes of every dot in an optimized module."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["dot_dtypes"]

_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[")
_DOT = re.compile(r"= (\w+)\[[^\]]*\][^ ]* dot\(%?([\w.\-]+), %?([\w.\-]+)\)")


def dot_dtypes(f: Callable[..., Any] | str, *args: Any) -> list[tuple[str, str, str]]:
    """``(lhs, rhs, out)`` element types of every dot XLA compiled.

    Use it to check that a quantized matmul stays quantized after XLA's
    optimizations (an int8 dot should read ``("s8", "s8", "s32")``; XLA may
    widen operands it cannot run natively).

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
    text = f if isinstance(f, str) else jax.jit(f).lower(*args).compile().as_text()
    dtypes = {}
    for line in text.splitlines():
        m = _DEF.match(line)
        if m:
            dtypes[m.group(1)] = m.group(2)
    found = []
    for line in text.splitlines():
        m = _DOT.search(line)
        if m:
            out, a, b = m.groups()
            found.append((dtypes.get(a, "?"), dtypes.get(b, "?"), out))
    return found
