"""Delayed-scaling state in linen: a variable collection updated by the backward.

:class:`StatefulDotGeneral` is a linen module for ``dot_general_cls=``
(``nn.Dense``, ``nn.DenseGeneral``); :func:`qbits.flax.quantize` puts one into
every ``Dense``/``DenseGeneral`` whose config uses
:class:`~qbits.calibration.DelayedScaling` (e.g. the ``fp8_delayed``
preset). Its scales and amax histories live in the collection
:data:`STATE` (``"_overwrite_with_gradient"``, Flax's own name for it), at
``<layer path>/StatefulDotGeneral_0/{lhs,rhs,grad}_{scale,amax_history}``.

The gradient of the loss with respect to that collection is the *new* state
(see :mod:`qbits.ops.stateful`): a training step differentiates with respect
to all variables and writes that collection back instead of giving it to the
optimizer. :class:`TrainState` does this (Flax's own
``flax.training.train_state.TrainState`` does too, as the collection has
Flax's name). :func:`max_combining` converts the collection once, at the top
of a loss that uses a layer more than once (``nn.scan`` sharing the state,
micro-batches in one loss), so the uses combine with max under ``jit``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import optax
from flax.core import FrozenDict
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training import train_state

from qbits.config.rules import as_dot_general_config
from qbits.errors import InvalidArgumentError
from qbits.ops import (
    init_state,
    init_steps,
    learned_tensors,
    stateful_dot_general,
)
from qbits.ops import max_combining as _max_combining

__all__ = ["STATE", "StatefulDotGeneral", "TrainState", "max_combining"]

STATE = OVERWRITE_WITH_GRADIENT


class StatefulDotGeneral(nn.Module):
    """A quantized ``dot_general`` keeping delayed scales in a collection.

    Learned step sizes (:class:`~qbits.calibration.LearnedScale`) are
    trainable parameters ``lhs_step`` / ``rhs_step`` (``params``
    collection), initialised from the first batch given to ``init``.

    Give it to a layer as ``dot_general_cls=functools.partial(
    qbits.flax.StatefulDotGeneral, "fp8_delayed")``; it becomes a child module
    of the layer. Its variables (collection :data:`STATE`) are created by
    ``init``: scales 1, histories zero.

    Attributes:
      config: A :class:`~qbits.DotGeneralConfig` or a preset name.
      key: A PRNG key for stochastic rounding; ``None`` draws one from the
        ``'quant'`` rng stream when the config needs it.

    Example:
      >>> import functools
      >>> import flax.linen as nn
      >>> cls = functools.partial(qbits.flax.StatefulDotGeneral, "fp8_delayed")
      >>> dense = nn.Dense(4, dot_general_cls=cls)
      >>> x = jnp.ones((2, 8))
      >>> variables = dense.init(jax.random.key(0), x)
      >>> variables[qbits.flax.STATE]["StatefulDotGeneral_0"]["lhs_scale"]
      Array([1.], dtype=float32)
      >>> grads = jax.jit(jax.grad(lambda v: dense.apply(v, x).sum()))(variables)
      >>> grads[qbits.flax.STATE]["StatefulDotGeneral_0"]["lhs_amax_history"][:2]
      Array([1., 0.], dtype=float32)
    """

    config: Any
    key: jax.Array | None = None

    @nn.compact
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
        """``lax.dot_general`` quantized with this module's delayed scales."""
        config = as_dot_general_config("StatefulDotGeneral", self.config)
        key = self.key
        if key is None and config.needs_key:
            key = self.make_rng("quant")
        state = {
            name: self.variable(STATE, name, lambda v=value: v).value
            for name, value in init_state(config).items()
        }
        steps = None
        if learned_tensors(config):
            names = sorted(f"{t}_step" for t in learned_tensors(config))
            steps = {
                name: self.param(
                    name, lambda _, n=name: init_steps(config, lhs, rhs)[n]
                )
                for name in names
            }
        op = stateful_dot_general(config, key)
        return op(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            state=state,
            steps=steps,
            out_sharding=out_sharding,
        )


def max_combining(variables: Any) -> Any:
    """The variables with the :data:`STATE` collection made to combine with max.

    Call it at the top of a loss, on the variables being differentiated, when
    a layer's state is used more than once in one gradient (a layer shared
    across ``nn.scan`` steps, several micro-batches in one loss). Needs
    ``jit`` around the gradient.

    Example:
      >>> v = {"params": {}, qbits.flax.STATE: {"s": jnp.ones(1)}}
      >>> str(qbits.flax.max_combining(v)[qbits.flax.STATE]["s"].dtype)
      'fp8_meta32'
    """
    if STATE not in variables:
        return variables
    out = dict(variables)
    out[STATE] = _max_combining(variables[STATE])
    return type(variables)(out) if isinstance(variables, FrozenDict) else out


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
      >>> dot = state.params[qbits.flax.STATE]["StatefulDotGeneral_0"]
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
