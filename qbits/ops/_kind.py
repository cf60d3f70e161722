"""Op kinds: what the engine knows of each primitive qbits quantizes.

An op kind is one value (an :class:`OpKind`) that says, for one ``lax``
primitive: which jaxpr equations it reads (``primitives``), how to read
the call of its quantized op from an equation (:meth:`OpKind.call`), the
six operands its config quantizes with their layouts (:meth:`OpKind.operands`:
shape and contracting axes of the forward's and both gradients' operands),
and how to build and run its op (:meth:`OpKind.apply`,
:meth:`OpKind.init_state`). Each op module defines its kind next to its op
(``KIND`` in :mod:`~qbits.ops._dot_general`, :mod:`~qbits.ops._conv`,
:mod:`~qbits.ops._ragged`); :data:`qbits.ops.KINDS` maps every primitive
name to its kind. The engine (:mod:`qbits.transform`) finds, checks and
runs matmul sites through this registry only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from qbits.ops._config import DotGeneralConfig

__all__ = ["Call", "OpKind", "Operand", "registry"]

#: One quantized operand: ``(matmul, side, shape, contracting axes)``, e.g.
#: ``("dlhs", "rhs", (16, 8), (1,))``.
Operand = tuple[str, str, tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of an op, as an equation of its primitive makes it.

    Attributes:
      args: The positional arguments of the op (``lax``'s function's:
        the operands first, then the equation's parameters).
      kwargs: The keyword arguments (``out_sharding`` where one is set).
    """

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class OpKind:
    """A primitive qbits quantizes: how the engine reads, checks and runs it.

    A kind defines the attributes below and :meth:`call`, :meth:`operands`
    and ``factory``; the rest has defaults that fit an op called like its
    ``lax`` function.

    Attributes:
      name: Its sites' ``primitive`` (the ``lax`` function it replaces).
      primitives: The jaxpr primitive names it reads.
      short: Its name in the layer table (``"conv"``).
      limited: Why the engine's weight modes (the weight run as the rhs,
        stored weights, observed activations, adapters: all of which need a
        plain ``dot_general``) do not apply to it, or ``""``.
      factory: The public constructor of its op, ``factory(config, key)``.
    """

    name: str
    primitives: tuple[str, ...]
    short: str
    limited: str
    factory: Callable[..., Any]

    def __repr__(self) -> str:
        return f"OpKind({self.name!r})"

    def call(self, params: Mapping[str, Any], operands: list[Any]) -> Call:
        """The op's call for an equation with these parameters and operands."""
        raise NotImplementedError

    def operands(self, call: Call, out: tuple[int, ...]) -> tuple[Operand, ...]:
        """The six quantized operands of ``call`` (its output shape ``out``).

        In the order of :meth:`~qbits.DotGeneralConfig.quantizers`: the
        forward's lhs and rhs, the lhs gradient's (the output gradient and
        the rhs) and the rhs gradient's (the output gradient and the lhs),
        each with the shape and the contracting axes its quantizer sees.
        """
        raise NotImplementedError

    def is_matmul(self, params: Mapping[str, Any]) -> bool:
        """Whether an equation is a matmul (``False``: it contracts nothing)."""
        del params
        return True

    def unsupported(self, params: Mapping[str, Any], operands: list[Any]) -> str:
        """Why the op cannot quantize an equation, or ``""`` (avals or arrays)."""
        del params, operands
        return ""

    def contracting(self, params: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
        """The contracting axes of each operand, where the engine needs them."""
        del params
        return ((), ())

    def check(self, config: DotGeneralConfig) -> None:
        """Raises what the op raises for ``config`` before it sees operands."""
        del config

    def apply(
        self, config: DotGeneralConfig, key: jax.Array | None, call: Call, **extra: Any
    ) -> jax.Array:
        """Runs ``call`` quantized (``extra``: ``state=``, ``diagnostics=``)."""
        return self.factory(config, key)(*call.args, **call.kwargs, **extra)

    def init_state(self, config: DotGeneralConfig, call: Call) -> dict[str, Any]:
        """The op's initial scale state for ``call``'s operands."""
        return self.factory(config).init_state(*call.args)


def registry(*kinds: OpKind) -> dict[str, OpKind]:
    """``{primitive: kind}`` for every primitive each kind reads, and its name.

    Example:
      >>> sorted(qbits.ops.KINDS)
      ['conv_general_dilated', 'dot_general', 'ragged_dot', 'ragged_dot_general']
    """
    found: dict[str, OpKind] = {}
    for kind in kinds:
        for name in _names(kind):
            found[name] = kind
    return found


def _names(kind: OpKind) -> Iterable[str]:
    return dict.fromkeys((*kind.primitives, kind.name))
