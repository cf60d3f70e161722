"""Traced programs, kept: an eager quantized call traces once per signature.

:func:`qbits.quantize` traces its function to a
:class:`~qbits.transform._program.Program` and plans it; both depend only
on what the function is, the rules and mode of the call, and the
*signature* of the arguments: their tree, which leaves are arrays, the
other (static) leaves and the arrays' avals (shape, dtype, weak type,
sharding). :class:`Programs` keeps them by that key (a bounded LRU), with,
for eager calls, the program compiled by ``jax.jit`` over the arrays of
the call (the arguments' and the per-call data: key, scale state, stored
weights, probes): an eager call is a compiled call, as ``jax.jit`` of it
would make it.

The function is named by an *identity*: ``(owner, *extra)``, the same
whenever the function computes the same thing (``(fn,)`` by default; the
linen adapter gives its ``Quantized`` and the method, nnx its model, graph
and method). The owner is held weakly where it allows it: its entries go
with it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from qbits.transform._plan import Plan
from qbits.transform._program import Program, _is_array, merge
from qbits.transform._runner import Frame, run_program

__all__ = ["Entry", "Programs", "Signature", "signature"]

#: How many programs are kept (the least recently used go first).
SIZE = 64


@dataclasses.dataclass(frozen=True)
class Signature:
    """What of a call's arguments decides its program.

    Attributes:
      leaves: The leaves of ``(args, kwargs)``.
      key: ``(tree, dynamic, statics, avals)``, hashable; ``None`` when a
        static leaf is not hashable (the call is then not cached).
      eager: Whether every array leaf is a concrete array (no tracer of an
        enclosing transformation, no ``ShapeDtypeStruct``).
    """

    leaves: list[Any]
    key: tuple[Any, ...] | None
    eager: bool


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    """The signature of a call (see :class:`Signature`)."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    dynamic = tuple(_is_array(x) for x in leaves)
    eager = all(
        isinstance(x, (jax.Array, np.ndarray, np.generic))
        and not isinstance(x, jax.core.Tracer)
        for x, d in zip(leaves, dynamic, strict=True)
        if d
    )
    try:
        avals = tuple(jax.typeof(x) for x, d in zip(leaves, dynamic, strict=True) if d)
        statics = tuple(
            (type(x), x) for x, d in zip(leaves, dynamic, strict=True) if not d
        )
        key = (tree, dynamic, statics, avals)
        hash(key)
    except TypeError:  # an unhashable static leaf, or a leaf without an aval
        key = None
    return Signature(leaves, key, eager)


@dataclasses.dataclass
class Entry:
    """A traced and planned program, compiled on its first eager call."""

    program: Program
    plan: Plan
    owner: Any = None  # the owner, or a weak reference to it
    _compiled: Callable[..., Any] | None = None

    def run(self, frame: Frame, leaves: Sequence[Any], eager: bool) -> list[Any]:
        """The program's flat outputs on ``leaves``, compiled when ``eager``."""
        program = self.program
        dyn = [x for x, d in zip(leaves, program.dynamic, strict=True) if d]
        if not eager:  # inside a transformation: traced inline, as its body
            return _run(program, self.plan, frame, dyn)
        if self._compiled is None:
            self._compiled = jax.jit(functools.partial(_compiled, program, self.plan))
        return self._compiled(dyn, frame.key, dict(frame.states))


def _run(program: Program, plan: Plan, frame: Frame, dyn: list[Any]) -> list[Any]:
    args, kwargs = jax.tree.unflatten(
        program.in_tree, merge(program.dynamic, dyn, program.statics)
    )
    return run_program(program, plan, frame, args, kwargs)


def _compiled(
    program: Program, plan: Plan, dyn: list[Any], key: Any, states: dict[str, Any]
) -> list[Any]:
    """The program run with the call's arrays as arguments (never constants)."""
    return _run(program, plan, Frame(key, states), dyn)


def identity(fn: Callable[..., Any], given: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """``(owner, *extra)`` naming ``fn``; a bound method is its object and function."""
    owner, *extra = given if given is not None else (fn,)
    if inspect.ismethod(owner):
        owner, extra = owner.__self__, [owner.__func__, *extra]
    return (owner, *extra)


class Programs:
    """The kept programs: an LRU of at most ``size`` :class:`Entry` s.

    An entry's key starts with its owner's ``id``; the entry holds the owner
    (weakly where it can: the entry is dropped when the owner is collected)
    and a lookup checks it is the same object.
    """

    def __init__(self, size: int = SIZE):
        self.size = size
        self._entries: collections.OrderedDict[Any, Entry] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, owner: Any, key: Any) -> Entry | None:
        """The entry of ``owner`` under ``key``, or ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            held = entry.owner
            if isinstance(held, weakref.ref):
                held = held()
            if held is not owner:  # an id reused by another object
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return entry

    def put(self, owner: Any, key: Any, entry: Entry) -> None:
        """Keeps ``entry``, dropping the least recently used beyond the size."""
        try:
            entry.owner = weakref.ref(owner, functools.partial(self._drop, key))
        except TypeError:  # not weakly referable: held until dropped
            entry.owner = owner
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def _drop(self, key: Any, ref: Any) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.owner is ref:
                del self._entries[key]

    def clear(self) -> None:
        """Forgets every program."""
        with self._lock:
            self._entries.clear()


#: The engine's programs (of :func:`qbits.quantize`).
PROGRAMS = Programs()
