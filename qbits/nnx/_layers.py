"""Quantized matmul functions that are nnx Modules.

Flax nnx layers take their matmul as an attribute: ``nnx.Linear.dot_general``,
``nnx.LinearGeneral.dot_general``, ``nnx.Einsum.einsum_op`` and
``nnx.Conv.conv_general_dilated``. The classes here are drop-ins for those
functions that are also :class:`flax.nnx.Module` s, so that a layer holding
one sees it as a child node. That is what stochastic rounding needs: the
module owns an :class:`flax.nnx.RngStream` (its key and counter are nnx
Variables, not parameters) and draws a fresh key on every call, so the noise
advances from step to step under ``nnx.jit`` and differs between layers. A
config that needs no key holds no state at all.

Each call also checks, when it is traced, that the config fits the operands
(e.g. a tile size divides the contracting axis) and names the place of a
misfit inside the rules file: ``rules[1].config.fwd.rhs.granularity.tile_size``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from qbits._errors import InvalidArgumentError
from qbits.config import CheckedConv, CheckedDotGeneral, as_dot_general_config
from qbits.nnx._stateful import DelayedState
from qbits.numerics import hash_key
from qbits.ops import (
    DotGeneralConfig,
    Einsum,
    check_providers,
    conv_general_dilated,
    dot_general,
    per_tensor_state,
    state_kinds,
)

__all__ = ["QuantizedConv", "QuantizedDotGeneral", "QuantizedEinsum"]

STREAM = "quant"


def has_stream(rngs: Any) -> bool:
    """Whether ``rngs`` is an RngStream or Rngs with a ``quant``/default stream."""
    if isinstance(rngs, nnx.RngStream):
        return True
    if isinstance(rngs, nnx.Rngs):
        try:
            rngs[STREAM]
        except (AttributeError, KeyError):
            return False
        return True
    return False


def fork_stream(
    owner: str, rngs: Any, why: str, stack: tuple[int, ...] = ()
) -> nnx.RngStream:
    """A new RngStream forked from ``rngs``' ``quant`` (or default) stream.

    Its key is a :func:`qbits.numerics.hash_key`: each call's ``fold_in``
    (and ``split`` for ``stack``) is a few integer operations, not a
    threefry loop per layer. With ``stack``, one stream per stacked layer
    (split along those axes).
    """
    stream = None
    if isinstance(rngs, nnx.RngStream):
        stream = rngs.fork()
    elif has_stream(rngs):
        stream = rngs[STREAM].fork()
    if stream is not None:
        stream = type(stream)(hash_key(stream.key[...]), tag=stream.tag)
        return stream.split(stack) if stack else stream
    raise InvalidArgumentError(
        owner,
        "rngs",
        rngs,
        f"an nnx.Rngs with a {STREAM!r} (or 'default') stream, e.g. "
        f"rngs=nnx.Rngs({STREAM}=0), or an nnx.RngStream",
        why=why,
    )


class _Quantized(nnx.Module):
    """Shared state of the quantized functions: config, key stream, scale state.

    Scale state (:mod:`qbits.ops._state`) is held as Variables named like its
    entries: :class:`~qbits.nnx.DelayedState` for replaced state (delayed
    scales, amax histories), ``nnx.Param`` for trained state (learned steps).
    Per-tensor state has its final shape from the start; other
    granularities' state, and learned steps (NaN until then), are set from
    a first batch by :func:`qbits.nnx.init_state`.
    """

    def __init__(
        self,
        config: DotGeneralConfig | str,
        *,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
        where: str = "config",
        layer: str | None = None,
        stack: tuple[int, ...] = (),
    ):
        owner = type(self).__name__
        self.config = as_dot_general_config(owner, config)
        if not isinstance(where, str):
            raise InvalidArgumentError(owner, "where", where, "a string")
        if layer is not None and not isinstance(layer, str):
            raise InvalidArgumentError(owner, "layer", layer, "None or a string")
        self.where = where
        self.layer = layer
        stack = tuple(stack)
        self.rngs = (
            fork_stream(owner, rngs, "the config rounds stochastically", stack)
            if self.config.needs_key
            else None
        )
        check_providers(self.config, owner)
        kinds = state_kinds(self.config)
        self._state_names = tuple(sorted(kinds))
        initial = per_tensor_state(self.config)
        for name in self._state_names:
            value = initial.get(name, jnp.zeros((0,), jnp.float32))
            if name in initial:  # one per stacked layer
                value = jnp.broadcast_to(value, stack + value.shape)
            var = nnx.Param if kinds[name] == "trained" else DelayedState
            setattr(self, name, var(value))
        self._init_state_next_call = False

    def _key(self) -> jax.Array | None:
        """A new key for this call (advancing the stream), or ``None``."""
        return None if self.rngs is None else self.rngs()

    def _state(self, init: Callable[[], dict[str, jax.Array]]) -> Any:
        """The scale state for this call (set from ``init()`` when asked to)."""
        if not self._state_names:
            return None
        if self._init_state_next_call:
            for name, value in init().items():
                getattr(self, name)[...] = value
            self._init_state_next_call = False
        state = {name: getattr(self, name)[...] for name in self._state_names}
        if any(v.shape == (0,) for v in state.values()):
            raise InvalidArgumentError(
                type(self).__name__,
                "state",
                "not initialised",
                "state set from a first batch: call qbits.nnx.init_state(model, "
                "batch) once before training",
                why="the scale state's shape depends on the operand shapes "
                "(its granularity is not per tensor)",
            )
        return state


class QuantizedDotGeneral(_Quantized):
    """A quantized ``lax.dot_general`` that is an nnx Module.

    Give it as ``dot_general=`` to ``nnx.Linear`` or ``nnx.LinearGeneral``;
    :func:`qbits.nnx.quantize` puts one into every matching layer. Call it
    exactly like ``jax.lax.dot_general``.

    A config with delayed scaling (``"fp8_delayed"``) gives the module
    :class:`~qbits.nnx.DelayedState` Variables, updated through the
    backward pass (see :func:`qbits.nnx.update_state`). A config with
    learned steps (:class:`~qbits.LearnedScale`) gives it ``nnx.Param`` s
    ``lhs_step`` / ``rhs_step``, NaN until :func:`qbits.nnx.init_state`
    initialises them from a batch.

    Args:
      config: A :class:`~qbits.DotGeneralConfig` or a preset name.
      rngs: Where stochastic rounding draws its keys: an ``nnx.Rngs`` (its
        ``quant`` stream, else its ``default`` one) or an ``nnx.RngStream``.
        A stream is forked from it, and every call draws a new key. Needed
        only when the config rounds stochastically (e.g. the ``int8``
        preset); otherwise ignored.
      where: The config's place in its file, used in error messages
        (``"rules[0].config"``).
      layer: The layer's path, named in error messages, or ``None``.
      stack: Leading axes of a layer stacked by ``nnx.vmap``: the key stream
        and scale state get them too (one per stacked layer).

    Raises:
      InvalidArgumentError: For a config that is neither, or one that rounds
        stochastically without ``rngs``.
      ConfigError: At the first call, when the config does not fit the
        operands (a tile size that does not divide an axis).

    Example:
      >>> import flax.nnx as nnx
      >>> dg = qbits.nnx.QuantizedDotGeneral("int8", rngs=nnx.Rngs(quant=0))
      >>> layer = nnx.Linear(16, 4, dot_general=dg, rngs=nnx.Rngs(0))
      >>> grads = nnx.jit(nnx.grad(lambda m: m(jnp.ones((2, 16))).sum()))(layer)
      >>> int(layer.dot_general.rngs.count[...])  # one key drawn per call
      1
    """

    def __call__(
        self,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        *,
        out_sharding: Any = None,
    ) -> jax.Array:
        """Computes ``lax.dot_general(lhs, rhs, ...)`` with quantized matmuls."""
        op = dot_general(self.config, self._key())
        state = self._state(
            lambda: op.init_state(
                lhs, rhs, dimension_numbers, precision, preferred_element_type
            )
        )
        checked = CheckedDotGeneral(op, self.where, self.layer)
        return checked(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding=out_sharding,
            state=state,
        )


class QuantizedEinsum(_Quantized):
    """A quantized two-operand ``jnp.einsum`` that is an nnx Module.

    Give it as ``einsum_op=`` to ``nnx.Einsum``; :func:`qbits.nnx.quantize`
    uses it there and for the two einsums of ``nnx.MultiHeadAttention``.
    See :func:`qbits.einsum` for the subscripts it takes.

    Args:
      config: A :class:`~qbits.DotGeneralConfig` or a preset name.
      rngs: As for :class:`QuantizedDotGeneral`.
      where: As for :class:`QuantizedDotGeneral`.

    Raises:
      InvalidArgumentError: As for :class:`QuantizedDotGeneral`.
      ConfigError: At the first call, when the config does not fit the
        operands.

    Example:
      >>> import flax.nnx as nnx
      >>> op = qbits.nnx.QuantizedEinsum("int8_fwd")
      >>> layer = nnx.Einsum("bd,dh->bh", (8, 4), einsum_op=op, rngs=nnx.Rngs(0))
      >>> nnx.jit(lambda m, x: m(x))(layer, jnp.ones((2, 8))).shape
      (2, 4)
    """

    def __call__(
        self,
        subscripts: str,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        *,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """Computes ``jnp.einsum(subscripts, lhs, rhs)`` with quantized matmuls."""
        op = Einsum(
            CheckedDotGeneral(
                dot_general(self.config, self._key()), self.where, self.layer
            )
        )
        state = self._state(lambda: op.init_state(subscripts, lhs, rhs))
        return op(
            subscripts,
            lhs,
            rhs,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
            state=state,
        )


class QuantizedConv(_Quantized):
    """A quantized ``lax.conv_general_dilated`` that is an nnx Module.

    Give it as ``conv_general_dilated=`` to ``nnx.Conv``;
    :func:`qbits.nnx.quantize` puts one into every matching ``nnx.Conv``.

    Args:
      config: A :class:`~qbits.DotGeneralConfig` or a preset name.
      rngs: As for :class:`QuantizedDotGeneral`.
      where: As for :class:`QuantizedDotGeneral`.

    Raises:
      InvalidArgumentError: As for :class:`QuantizedDotGeneral`.
      ConfigError: At the first call, when the config does not fit the
        operands.

    Example:
      >>> import flax.nnx as nnx
      >>> conv = qbits.nnx.QuantizedConv("int8_fwd")
      >>> layer = nnx.Conv(3, 4, (3, 3), conv_general_dilated=conv,
      ...                  rngs=nnx.Rngs(0))
      >>> nnx.jit(lambda m, x: m(x))(layer, jnp.ones((1, 8, 8, 3))).shape
      (1, 8, 8, 4)
    """

    def __call__(
        self,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        window_strides: Any,
        padding: Any,
        lhs_dilation: Any = None,
        rhs_dilation: Any = None,
        dimension_numbers: Any = None,
        feature_group_count: int = 1,
        batch_group_count: int = 1,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """Computes ``lax.conv_general_dilated`` with quantized convolutions."""
        args = (
            lhs,
            rhs,
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            dimension_numbers,
            feature_group_count,
            batch_group_count,
            precision,
            preferred_element_type,
        )
        conv = conv_general_dilated(self.config, self._key())
        state = self._state(lambda: conv.init_state(*args, out_sharding=out_sharding))
        op = CheckedConv(conv, self.where, self.layer)
        return op(*args, out_sharding=out_sharding, state=state)
