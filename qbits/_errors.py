"""Exceptions qbits raises for bad user input.

Every constructor and entry point validates its arguments and raises
:class:`InvalidArgumentError` (a :class:`ValueError`) naming the argument, the
bad value and what is allowed. The structured fields let higher layers (the
YAML config loader) prefix the path of the value inside a file.

One error raised because of another keeps both readable: the outer message
first, then each cause on a line of its own (``  because: ...``), never one
message inside another's parentheses. A cause is given as ``why=`` the
exception, or as its text inside ``why`` (``why=f"{path}: {e}"``): either
way it is moved to a line of its own.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["ConfigError", "InvalidArgumentError"]

#: How a cause is set off from the message it explains.
CAUSE = "\n  because: "
# The texts of the latest errors, to find one inside another's ``why``.
_RECENT: collections.deque[str] = collections.deque(maxlen=64)


def _split_why(why: Any) -> tuple[str, list[str]]:
    """``(inline reason, cause lines)`` of a ``why``: a text or an exception.

    An exception, or the text of a recent qbits error inside ``why``,
    becomes cause lines (its own causes after it, all at one level); what
    remains of the text is the inline reason.
    """
    if isinstance(why, BaseException):
        text = str(why) or type(why).__name__
        return "", text.split(CAUSE)
    why = str(why or "")
    for text in sorted(_RECENT, key=len, reverse=True):
        if len(text) > 20 and text in why:
            before, _, after = why.partition(text)
            rest = (before.rstrip(" :;,(") + " " + after.lstrip(" );,")).strip()
            return rest, text.split(CAUSE)
    return why, []


def _message(head: str, causes: list[str]) -> str:
    """``head`` with its cause lines, remembered as a qbits error's text."""
    text = CAUSE.join([head, *causes])
    _RECENT.append(text)
    return text


class InvalidArgumentError(ValueError):
    """An argument has a value qbits cannot accept.

    Attributes:
      owner: What was being built or called, e.g. ``"IntNumerics"``.
      argument: The argument's name, e.g. ``"bits"``.
      value: The rejected value.
      allowed: A human-readable description of the allowed values.

    Example:
      >>> from qbits import IntNumerics, InvalidArgumentError
      >>> try:
      ...     IntNumerics(bits=32)
      ... except InvalidArgumentError as e:
      ...     print(e)
      IntNumerics: bits=32 is not allowed; expected an int in 1..16.

      An error raised because of another shows it as its cause:

      >>> try:
      ...     IntNumerics(bits=32)
      ... except InvalidArgumentError as e:
      ...     print(InvalidArgumentError("me", "config", "int32", "8 bits", why=e))
      me: config='int32' is not allowed; expected 8 bits.
        because: IntNumerics: bits=32 is not allowed; expected an int in 1..16.
    """

    def __init__(
        self, owner: str, argument: str, value: Any, allowed: str, why: Any = ""
    ):
        self.owner = owner
        self.argument = argument
        self.value = value
        self.allowed = allowed
        self.why = why if isinstance(why, str) else str(why)
        inline, causes = _split_why(why)
        because = f" ({inline})" if inline else ""
        super().__init__(
            _message(
                f"{owner}: {argument}={_show(value)} is not allowed{because}; "
                f"expected {allowed}.",
                causes,
            )
        )


#: Longest rendering of a value before it is shortened.
_LONGEST = 160


def _show(value: Any) -> str:
    """Short, readable rendering of a rejected value.

    Arrays (and anything with a shape and a dtype) as ``dtype[shape]``,
    also inside dicts, lists and tuples; dtypes and classes by name; a
    long rendering shortened in its middle, at a boundary between words or
    items, so that neither its start nor its end (often the shape) is cut.

    Example:
      >>> import numpy as np
      >>> print(qbits._errors._show({"w": np.zeros((38, 4)), "n": 3}))
      {'w': float64[38, 4], 'n': 3}
    """
    return _shorten(_render(value, 2))


def _render(value: Any, depth: int) -> str:
    if isinstance(value, np.dtype):
        return value.name
    name = getattr(value, "__name__", None)
    if isinstance(value, type) and name is not None:
        return name
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None and not isinstance(value, str):
        try:
            return f"{np.dtype(dtype).name}{list(shape)}"
        except TypeError:  # a dtype numpy does not know (a PRNG key's)
            return f"{dtype}{list(shape)}"
    if depth > 0 and isinstance(value, Mapping) and len(value) <= 32:
        items = (f"{k!r}: {_render(v, depth - 1)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if depth > 0 and isinstance(value, list | tuple) and len(value) <= 32:
        inner = ", ".join(_render(v, depth - 1) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def _shorten(text: str) -> str:
    """``text``, or its start and end around `` ... `` cut at boundaries."""
    if len(text) <= _LONGEST:
        return text
    keep = (_LONGEST - 5) // 2
    head, tail = text[:keep], text[-keep:]
    cut = max(head.rfind(c) for c in " ,")
    head = head[: cut + 1].rstrip() if cut > keep // 2 else head
    starts = [i for i in (tail.find(" "), tail.find(",")) if i >= 0]
    cut = min(starts) if starts else -1
    tail = tail[cut + 1 :].lstrip() if 0 <= cut < keep // 2 else tail
    return f"{head} ... {tail}"


def check_bool(owner: str, argument: str, value: Any) -> None:
    """Raises InvalidArgumentError unless ``value`` is a Python bool."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(owner, argument, value, "True or False")


def check_choice(owner: str, argument: str, value: Any, choices: Any) -> None:
    """Raises InvalidArgumentError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise InvalidArgumentError(
            owner, argument, value, "one of " + ", ".join(map(str, choices))
        )


def check_mapping(owner: str, argument: str, value: Any, allowed: str) -> None:
    """Raises InvalidArgumentError, naming ``value``'s type, unless it is a Mapping."""
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(owner, argument, type(value).__name__, allowed)


def check_int(
    owner: str, argument: str, value: Any, lo: int | None = None, hi: int | None = None
) -> None:
    """Raises InvalidArgumentError unless ``value`` is an int in ``lo..hi``."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (lo is None or value >= lo) and (hi is None or value <= hi)
    if not ok:
        span = {
            (True, True): f" in {lo}..{hi}",
            (True, False): f" >= {lo}",
            (False, True): f" <= {hi}",
            (False, False): "",
        }[(lo is not None, hi is not None)]
        raise InvalidArgumentError(owner, argument, value, f"an int{span}")


def check_float(
    owner: str,
    argument: str,
    value: Any,
    *,
    lo: float,
    hi: float | None = None,
    lo_open: bool = False,
) -> None:
    """Raises InvalidArgumentError unless ``value`` is a finite real in range."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        try:
            v = float(value)
        except OverflowError:  # an int beyond float's range
            v = float("inf")
        ok = v == v and v not in (float("inf"), float("-inf"))
        ok = ok and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
    if not ok:
        left = "(" if lo_open else "["
        right = f"{hi}]" if hi is not None else "inf)"
        raise InvalidArgumentError(
            owner, argument, value, f"a finite number in {left}{lo}, {right}"
        )


def normalize_axis(owner: str, argument: str, axis: Any, ndim: int) -> int:
    """Returns ``axis`` as a non-negative index into an array of rank ``ndim``."""
    if not (isinstance(axis, int) and not isinstance(axis, bool)) or not (
        -ndim <= axis < ndim
    ):
        raise InvalidArgumentError(
            owner,
            argument,
            axis,
            f"an int in {-ndim}..{ndim - 1} for an array of rank {ndim}",
        )
    return axis % ndim


class ConfigError(ValueError):
    """A quantization config (a YAML file, a dict or a rule) is invalid.

    The message names where the bad value sits inside the config, the value
    and what is allowed, for example
    ``rules[1].config.fwd.rhs.numerics.bits: expected an int in 1..16, got 32``.

    Attributes:
      path: Where the value sits, e.g. ``"rules[1].config.fwd.rhs.numerics.bits"``
        (empty for the whole document).
      value: The rejected value.
      allowed: A human-readable description of the allowed values.
      source: Where the config came from: its file, or a file and the place
        in it (``"sweep.yaml: grid (fwd4_bwd8)"``); ``None`` if unknown.
      layer: The path of the model layer the config was checked against
        (errors found when a layer is traced), or ``None``.

    Example:
      >>> data = {"fwd": {"lhs": {"numerics": {"type": "int", "bits": 32}}}}
      >>> try:
      ...     qbits.load_config(data, qbits.DotGeneralConfig)
      ... except qbits.ConfigError as e:
      ...     print(e)
      fwd.lhs.numerics.bits: expected an int in 1..16, got 32.
    """

    def __init__(
        self,
        path: str,
        value: Any,
        allowed: str,
        *,
        why: Any = "",
        source: str | None = None,
        layer: str | None = None,
    ):
        self.path = path
        self.value = value
        self.allowed = allowed
        self.why = why if isinstance(why, str) else str(why)
        self.source = source
        self.layer = layer
        where = ": ".join(p for p in (source, path) if p)
        inline, causes = _split_why(why)
        reasons = [inline] if inline else []
        if layer is not None:
            shown = repr(layer) if layer else "'' (the top-level module)"
            reasons.append(f"in layer {shown}")
        because = f" ({', '.join(reasons)})" if reasons else ""
        super().__init__(
            _message(
                f"{where + ': ' if where else ''}expected {allowed}, "
                f"got {_show(value)}{because}.",
                causes,
            )
        )

    def within(self, prefix: str = "", source: str | None = None) -> ConfigError:
        """The same error with ``prefix`` put before its path."""
        path = ".".join(p for p in (prefix, self.path) if p).replace(".[", "[")
        return ConfigError(
            path,
            self.value,
            self.allowed,
            why=self.why,
            source=source or self.source,
            layer=self.layer,
        )


# Shown as qbits.InvalidArgumentError / qbits.ConfigError (their public home).
InvalidArgumentError.__module__ = "qbits"
ConfigError.__module__ = "qbits"
