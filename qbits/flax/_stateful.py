"""Scale state in linen: a variable collection updated by the backward pass.

The scale state of delayed and learned scales (``fp8_delayed``, LSQ) lives
in the collection :data:`STATE` (``"_overwrite_with_gradient"``, Flax's own
name for it): through :func:`qbits.flax.quantize` as ``{matmul path:
{entry: array}}``, the layout :func:`qbits.init_state` gives; through
:class:`Stateful` (a layer's ``dot_general_cls=``) under the layer's own
path. Learned steps are trainable and live in ``params``.

The gradient of the loss with respect to that collection is the *new* state
(see :mod:`qbits.ops._state`): a training step differentiates with respect
to all variables and writes that collection back instead of giving it to
the optimizer. :class:`TrainState` does this (Flax's own
``flax.training.train_state.TrainState`` does too, as the collection has
Flax's name). A loss that uses the state more than once (micro-batches in
one gradient) converts it once with :func:`qbits.DelayedScaling.max_combining` so
that the uses combine with max.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import optax
from flax.core import FrozenDict
from flax.training import train_state

from qbits import ops
from qbits._errors import InvalidArgumentError
from qbits.config import _as_dot_general_config
from qbits.flax._quantize import STATE

__all__ = ["Stateful", "TrainState"]

# The ops by name: each op kind's (qbits.ops.KINDS), and einsum.
_OPS = {
    **{kind.name: kind.factory for kind in ops.KINDS.values()},
    "einsum": ops.einsum,
}


class Stateful(nn.Module):
    """A qbits op with its scale state as linen variables and keys from Flax.

    For explicit injection of a config that keeps scale state (delayed
    scaling, learned steps) or rounds stochastically: give a layer
    ``dot_general_cls=functools.partial(qbits.flax.Stateful, config)``
    (``nn.Dense``, ``nn.DenseGeneral``), ``conv_general_dilated_cls=`` with
    ``op="conv_general_dilated"`` (``nn.Conv``), or an attention's
    ``*_einsum_cls=`` with ``op="einsum"``. It becomes a child module of the
    layer; delayed scales and amax histories are variables of the
    :data:`STATE` collection, learned steps ``params``, all created by
    ``init`` (learned steps from the first batch); each call of a
    stochastic config draws a key from the ``'quant'`` rng stream.

    Attributes:
      config: A :class:`~qbits.DotGeneralConfig`, a preset name or the path
        of a YAML file holding one config.
      op: Which op: ``"dot_general"``, ``"einsum"``,
        ``"conv_general_dilated"`` or ``"ragged_dot"``; it is called with
        that op's arguments.

    Example:
      >>> import functools
      >>> import flax.linen as nn
      >>> cls = functools.partial(qbits.flax.Stateful, "fp8_delayed")
      >>> dense = nn.Dense(4, dot_general_cls=cls)
      >>> x = jnp.ones((2, 8))
      >>> variables = dense.init(jax.random.key(0), x)
      >>> variables[qbits.flax.STATE]["Stateful_0"]["lhs_scale"]
      Array([1.], dtype=float32)
      >>> grads = jax.jit(jax.grad(lambda v: dense.apply(v, x).sum()))(variables)
      >>> grads[qbits.flax.STATE]["Stateful_0"]["lhs_amax_history"][:2]
      Array([1., 0.], dtype=float32)
    """

    config: Any
    op: str = "dot_general"

    @nn.compact
    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        """The op, on its state; the arguments are the op's (``lax``'s)."""
        owner = "qbits.flax.Stateful"
        if self.op not in _OPS:
            raise InvalidArgumentError(
                owner, "op", self.op, "one of " + ", ".join(_OPS)
            )
        config = _as_dot_general_config(owner, self.config)
        key = self.make_rng("quant") if config.needs_key else None
        op = _OPS[self.op](config, key)
        kinds = config.state_kinds()
        if not kinds:
            return op(*args, **kwargs)
        initial: dict[str, jax.Array] = {}

        def first(name: str) -> jax.Array:
            if not initial:
                shapes = {k: v for k, v in kwargs.items() if k != "out_sharding"}
                initial.update(op.init_state(*args, **shapes))
            return initial[name]

        state = {}
        for name in sorted(kinds):
            init = functools.partial(first, name)
            if kinds[name] == "trained":
                state[name] = self.param(name, lambda _, init=init: init())
            else:
                state[name] = self.variable(STATE, name, init).value
        return op(*args, **kwargs, state=state)


class TrainState(train_state.TrainState):
    """A Flax ``TrainState`` whose :data:`STATE` collection is overwritten.

    ``params`` holds all variables (``{"params": ..., STATE: ...}``), as
    ``model.init`` returns them; the loss is differentiated with respect to
    all of them. :meth:`apply_gradients` gives the optimizer the
    ``"params"`` gradients only and writes the gradient of :data:`STATE`
    (the new scales and histories) in place of the old state. Without a
    :data:`STATE` collection it is Flax's ``TrainState``.

    Example:
      >>> import functools, optax
      >>> import flax.linen as nn
      >>> model = qbits.flax.quantize(nn.Dense(4), "fp8_delayed")
      >>> x = jnp.ones((2, 8))
      >>> state = qbits.flax.TrainState.create(
      ...     apply_fn=model.apply, params=model.init(jax.random.key(0), x),
      ...     tx=optax.sgd(0.1))
      >>> @jax.jit
      ... def step(state, x):
      ...     grads = jax.grad(lambda v: state.apply_fn(v, x).sum())(state.params)
      ...     return state.apply_gradients(grads=grads)
      >>> state = step(step(state, x), x)
      >>> dot = state.params[qbits.flax.STATE]["kernel"]  # its one matmul
      >>> dot["lhs_scale"] * 448  # the scale from step one's amax
      Array([1.], dtype=float32)
    """

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Optimizer step on ``"params"``; :data:`STATE` overwritten by its grads."""
        if STATE not in self.params:
            return super().apply_gradients(grads=grads, **kwargs)
        if STATE not in grads or "params" not in grads:
            raise InvalidArgumentError(
                "TrainState.apply_gradients",
                "grads",
                sorted(grads),
                f"gradients of all variables, with 'params' and {STATE!r} "
                "(differentiate with respect to state.params)",
            )
        updates, opt_state = self.tx.update(
            grads["params"], self.opt_state, self.params["params"]
        )
        params = dict(self.params)
        params["params"] = optax.apply_updates(self.params["params"], updates)
        params[STATE] = grads[STATE]
        if isinstance(self.params, FrozenDict):
            params = FrozenDict(params)
        return self.replace(
            step=self.step + 1, params=params, opt_state=opt_state, **kwargs
        )

    @classmethod
    def create(cls, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> Any:
        """A new state; the optimizer state covers ``"params"`` only."""
        with_opt = params["params"] if STATE in params else params
        return cls(
            step=0,
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=tx.init(with_opt),
            **kwargs,
        )
