"""Exceptions qbits raises for bad user input.

Every constructor and entry point validates its arguments and raises
:class:`InvalidArgumentError` (a :class:`ValueError`) naming the argument, the
bad value and what is allowed. The structured fields let higher layers (the
YAML config loader) prefix the path of the value inside a file.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ConfigError", "InvalidArgumentError"]


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
    """

    def __init__(
        self, owner: str, argument: str, value: Any, allowed: str, why: str = ""
    ):
        self.owner = owner
        self.argument = argument
        self.value = value
        self.allowed = allowed
        self.why = why
        because = f" ({why})" if why else ""
        super().__init__(
            f"{owner}: {argument}={_show(value)} is not allowed{because}; "
            f"expected {allowed}."
        )


def _show(value: Any) -> str:
    """Short, readable rendering of a rejected value."""
    if isinstance(value, np.dtype):
        return value.name
    name = getattr(value, "__name__", None)
    if isinstance(value, type) and name is not None:
        return name
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_bool(owner: str, argument: str, value: Any) -> None:
    """Raises InvalidArgumentError unless ``value`` is a Python bool."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(owner, argument, value, "True or False")


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
      ...     qbits.config.from_dict(data)
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
        why: str = "",
        source: str | None = None,
        layer: str | None = None,
    ):
        self.path = path
        self.value = value
        self.allowed = allowed
        self.why = why
        self.source = source
        self.layer = layer
        where = ": ".join(p for p in (source, path) if p)
        reasons = [why] if why else []
        if layer is not None:
            shown = repr(layer) if layer else "'' (the top-level module)"
            reasons.append(f"in layer {shown}")
        because = f" ({', '.join(reasons)})" if reasons else ""
        super().__init__(
            f"{where + ': ' if where else ''}expected {allowed}, "
            f"got {_show(value)}{because}."
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
