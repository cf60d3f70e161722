"""Rule patterns that match in bounded time.

A rule's pattern is matched with Python's ``re``, which backtracks: a
pattern such as ``(a+)+b`` tries every way of splitting a run of ``a`` s
between its two quantifiers, 2**n ways for n of them, and matching a path of
40 characters never finishes. :func:`backtracking` reads the parsed pattern
(the same parse ``re`` compiles) and names what would make the ways
multiply, so that :class:`~qbits.Rule` can refuse such a pattern when it is
made, never hang when it is matched.
"""

from __future__ import annotations

from re import _constants as sre  # the parser's opcodes (Python >= 3.11)
from re import _parser as sre_parser
from typing import Any

__all__ = ["backtracking"]

#: Most unbounded quantifiers (``*``, ``+``, ``{m,}``) in a rule's pattern.
_MAX_UNBOUNDED = 4
#: Most bounded variable quantifiers (``?``, ``{m,n}``) in a rule's pattern.
_MAX_BOUNDED = 16
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


def _children(op: Any, av: Any) -> list[Any]:
    """The subpatterns directly inside one parsed item."""
    if op in _REPEATS:
        return [av[2]]
    if op is sre.SUBPATTERN:
        return [av[3]]
    if op is sre.BRANCH:
        return list(av[1])
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return [av[1]]
    if op is sre.ATOMIC_GROUP:
        return [av]
    if op is sre.GROUPREF_EXISTS:
        return [p for p in av[1:] if p is not None]
    return []


def _quantifier(lo: int, hi: int) -> str:
    """How a quantifier is written: ``*``, ``+``, ``{2}``, ``{1,3}``, ``{2,}``."""
    if hi == sre.MAXREPEAT:
        return {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def _varies(items: Any) -> bool:
    """Whether a subpattern holds a variable quantifier, ``|`` or a backreference."""
    for op, av in items:
        if op in _REPEATS and av[0] != av[1]:
            return True
        if op in (sre.BRANCH, sre.GROUPREF, sre.GROUPREF_EXISTS):
            return True
        if any(_varies(child) for child in _children(op, av)):
            return True
    return False


def backtracking(pattern: str) -> str:
    """Why matching ``pattern`` could take exponential (or high polynomial) time.

    The ways multiply where a quantifier repeats a group holding a variable
    quantifier, ``|`` or a backreference (``(a+)+``, ``(a|ab)*``,
    ``(.*/){3}``), and with every unbounded quantifier (each multiplies them
    by the path's length): more than :data:`_MAX_UNBOUNDED` of those, or more
    than :data:`_MAX_BOUNDED` bounded variable ones (``?``, ``{m,n}``), are
    refused too.

    Args:
      pattern: A valid regular expression.

    Returns:
      The reason, or ``""`` for a pattern that matches in bounded time.

    Example:
      >>> backtracking(".*attn/(query|key)")
      ''
      >>> backtracking("(a+)+b")[:40]
      "the quantifier '+' repeats a group that "
    """
    unbounded = bounded = 0
    stack = [sre_parser.parse(pattern).data]
    while stack:
        for op, av in stack.pop():
            if op in _REPEATS:
                lo, hi, body = av
                if hi > 1 and _varies(body):
                    return (
                        f"the quantifier {_quantifier(lo, hi)!r} repeats a group "
                        "that holds a quantifier, '|' or a backreference"
                    )
                if lo != hi:
                    if hi == sre.MAXREPEAT:
                        unbounded += 1
                    else:
                        bounded += 1
            stack.extend(_children(op, av))
    if unbounded > _MAX_UNBOUNDED:
        return f"it has {unbounded} unbounded quantifiers (*, +, {{m,}})"
    if bounded > _MAX_BOUNDED:
        return f"it has {bounded} bounded variable quantifiers (?, {{m,n}})"
    return ""
