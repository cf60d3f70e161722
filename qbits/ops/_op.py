"""What every quantized op holds and does on each call.

An op (:class:`~qbits.ops.DotGeneral`, :class:`~qbits.ops.Einsum`,
:class:`~qbits.ops.ConvGeneralDilated`, the ragged dot) is a config and a
PRNG key, equal by value; a call takes ScaledArray operands through
:func:`~qbits.scaled.scalify`, is the ``lax`` op itself for a config that
quantizes nothing, and otherwise runs the core on the op's contraction
with the config's scale state (:mod:`qbits.ops._state`) and a diagnostics
probe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qbits.ops import _core as core
from qbits.ops import _state as state_lib
from qbits.ops._config import DotGeneralConfig
from qbits.scaled import is_scaled, scalify

__all__ = ["Op"]

Operands = Callable[[jax.Array, jax.Array], Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """A quantized op: its config and PRNG key, and what every call does.

    Two are equal when their configs are and they hold the same key object,
    so that ``jit`` caches on them as static arguments and Flax compares
    layers that hold them.
    """

    config: DotGeneralConfig
    key: jax.Array | None = None

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and other.config == self.config
            and other.key is self.key
        )

    def __hash__(self) -> int:
        return hash((self.config, id(self.key)))

    def _passes(self, state: Any, probe: Any) -> bool:
        """Whether a call is the ``lax`` op itself (no quantizer, state, probe)."""
        return self.config.is_identity and not state and probe is None

    def _apply(
        self, lhs: Any, rhs: Any, plain: Operands, quantized: Operands,
        state: Any, probe: Any,
    ) -> Any:  # fmt: skip
        """A call: ``plain(lhs, rhs)`` where it :meth:`_passes`, else ``quantized``.

        ScaledArray operands go through ``scalify`` (the call runs on their
        data); others are made arrays.
        """
        if is_scaled(lhs) or is_scaled(rhs):
            return scalify(
                lambda a, b: self._apply(a, b, plain, quantized, state, probe)
            )(lhs, rhs)
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        return plain(lhs, rhs) if self._passes(state, probe) else quantized(lhs, rhs)

    def _run(
        self, owner: str, c: core.Contraction, lhs: jax.Array, rhs: jax.Array,
        state: Any, probe: Any, data: Any = None,
    ) -> jax.Array:  # fmt: skip
        """The core on contraction ``c``, its scales from ``state``."""
        return state_lib.run(
            self.config, c, lhs, rhs, self.key, state, owner, data=data, probe=probe
        )

    def _init_state(
        self,
        owner: str,
        contraction: Callable[[Any, Any], core.Contraction],
        lhs: Any,
        rhs: Any,
    ) -> dict[str, jax.Array]:
        """The initial state for operands like these (arrays or shapes)."""
        lhs, rhs = (
            x if isinstance(x, jax.ShapeDtypeStruct) else jnp.asarray(x)
            for x in (lhs, rhs)
        )
        return state_lib.init_state(self.config, contraction(lhs, rhs), lhs, rhs, owner)
