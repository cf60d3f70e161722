"""Explicit injection in nnx of configs that keep state or draw keys.

``nnx.Linear(dot_general=qbits.dot_general(config))`` needs nothing more
for a config that rounds to nearest and computes its scales. A config that
rounds stochastically needs a new key on every call, and one with scale
providers (delayed scaling, learned steps) needs its state between calls:
:class:`Stateful` is the op with both, as an nnx Module the layer holds.
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from qbits import ops
from qbits._errors import InvalidArgumentError
from qbits.config import _as_dot_general_config
from qbits.nnx._quantize import ScaleState, _stream

__all__ = ["Stateful"]

# The ops by name: each op kind's (qbits.ops.KINDS), and einsum.
_OPS = {
    **{kind.name: kind.factory for kind in ops.KINDS.values()},
    "einsum": ops.einsum,
}


class Stateful(nnx.Module):
    """A qbits op with its key stream and scale state, as an nnx Module.

    Give it to a layer where Flax takes the op: ``nnx.Linear(...,
    dot_general=qbits.nnx.Stateful(config, rngs=...))``, ``nnx.Einsum(...,
    einsum_op=qbits.nnx.Stateful(config, op="einsum"))``, ``nnx.Conv(...,
    conv_general_dilated=qbits.nnx.Stateful(config,
    op="conv_general_dilated"))``. Call it with the op's (``lax``'s)
    arguments.

    A stochastic config draws a new key from its stream on every call (the
    stream's ``RngState`` Variables advance under ``nnx.jit``). Scale state
    is held as Variables named like its entries (``lhs_scale``,
    ``lhs_amax_history``...): :class:`~qbits.nnx.ScaleState` for delayed
    scales, ``nnx.Param`` for learned steps. State whose shape does not
    depend on the operands (per-tensor delayed scaling) exists from the
    start; other state is set from the operands of the first call (run the
    layer once, e.g. on a sample batch, before taking gradients).

    Args:
      config: A :class:`~qbits.DotGeneralConfig`, a preset name or the path
        of a YAML file holding one config.
      op: ``"dot_general"``, ``"einsum"``, ``"conv_general_dilated"`` or
        ``"ragged_dot"``.
      rngs: Where stochastic rounding draws its keys: an ``nnx.Rngs`` (its
        ``quant`` stream, else its ``default`` one) or an ``nnx.RngStream``;
        needed only when the config rounds stochastically.

    Raises:
      InvalidArgumentError: For a config or op of another kind, or a
        stochastic config without ``rngs``.

    Example:
      >>> import flax.nnx as nnx
      >>> dg = qbits.nnx.Stateful("int8", rngs=nnx.Rngs(quant=0))
      >>> layer = nnx.Linear(16, 4, dot_general=dg, rngs=nnx.Rngs(0))
      >>> grads = nnx.jit(nnx.grad(lambda m: m(jnp.ones((2, 16))).sum()))(layer)
      >>> int(layer.dot_general.rngs.count[...])  # one key drawn per call
      1
    """

    def __init__(
        self,
        config: Any,
        op: str = "dot_general",
        *,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
    ):
        owner = "qbits.nnx.Stateful"
        self.config = _as_dot_general_config(owner, config)
        if op not in _OPS:
            raise InvalidArgumentError(owner, "op", op, "one of " + ", ".join(_OPS))
        self.op = op
        if self.config.needs_key and rngs is None:
            raise InvalidArgumentError(
                owner,
                "rngs",
                None,
                "an nnx.Rngs with a 'quant' (or 'default') stream, e.g. "
                "rngs=nnx.Rngs(quant=0)",
                why="the config rounds stochastically",
            )
        self.rngs = _stream(rngs) if self.config.needs_key else None
        self._kinds = self.config.state_kinds()
        for name, value in ops._per_tensor_state(self.config).items():
            setattr(self, name, self._variable(name, value))

    def _variable(self, name: str, value: jax.Array) -> nnx.Variable:
        cls = nnx.Param if self._kinds[name] == "trained" else ScaleState
        return cls(value)

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        """The op, with this call's key and the state."""
        key = None if self.rngs is None else self.rngs()
        op = _OPS[self.op](self.config, key)
        if not self._kinds:
            return op(*args, **kwargs)
        missing = [n for n in sorted(self._kinds) if not hasattr(self, n)]
        if missing:  # state whose shape follows the operands: from this call
            shapes = {k: v for k, v in kwargs.items() if k != "out_sharding"}
            initial = op.init_state(*args, **shapes)
            for name in missing:
                setattr(self, name, self._variable(name, jnp.asarray(initial[name])))
        state = {name: getattr(self, name)[...] for name in sorted(self._kinds)}
        return op(*args, **kwargs, state=state)
