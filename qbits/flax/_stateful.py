"""Scale state in linen: a variable collection updated by the backward pass.

:class:`StatefulDotGeneral` (for ``dot_general_cls=`` of ``nn.Dense``,
``nn.DenseGeneral``), :class:`StatefulConv` (``conv_general_dilated_cls=``
of ``nn.Conv``) and :class:`StatefulEinsum` (``nn.Einsum`` and attention
einsums) are linen modules that keep the scale state of a config whose
quantizers have scale providers; :func:`qbits.flax.quantize` puts them where
such a config applies (e.g. the ``fp8_delayed`` preset). Delayed scales and
amax histories live in the collection :data:`STATE`
(``"_overwrite_with_gradient"``, Flax's own name for it), at ``<layer
path>/StatefulDotGeneral_0/{lhs,rhs,grad}_{scale,amax_history}``; learned
steps in ``params``.

The gradient of the loss with respect to that collection is the *new* state
(see :mod:`qbits.ops._state`): a training step differentiates with respect
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

from qbits._errors import InvalidArgumentError
from qbits.config import CheckedConv, CheckedDotGeneral, as_dot_general_config
from qbits.ops import (
    ConvGeneralDilated,
    Einsum,
    conv_general_dilated,
    dot_general,
    einsum,
    state_kinds,
)
from qbits.ops import max_combining as _max_combining

__all__ = [
    "STATE",
    "StatefulConv",
    "StatefulDotGeneral",
    "StatefulEinsum",
    "TrainState",
    "max_combining",
]

STATE = OVERWRITE_WITH_GRADIENT


class _Stateful(nn.Module):
    """Keeps the scale state of one quantized op as linen variables."""

    config: Any
    key: jax.Array | None = None
    where: str = "config"
    layer: str | None = None

    def _make_op(self, make: Any) -> tuple[Any, Any]:
        config = as_dot_general_config(type(self).__name__, self.config)
        key = self.key
        if key is None and config.needs_key:
            key = self.make_rng("quant")
        return config, make(config, key)

    def _checked(self, op: Any) -> Any:
        """``op`` checking its config against the operands first."""
        if isinstance(op, ConvGeneralDilated):
            return CheckedConv(op, self.where, self.layer)
        return CheckedDotGeneral(op, self.where, self.layer)

    def _scale_state(self, config: Any, init: Any) -> dict[str, jax.Array] | None:
        """The state variables (created from ``init()`` on first use)."""
        kinds = state_kinds(config)
        if not kinds:
            return None
        initial: dict[str, jax.Array] = {}

        def first(name: str) -> jax.Array:
            if not initial:
                initial.update(init())
            return initial[name]

        state = {}
        for name in sorted(kinds):
            if kinds[name] == "trained":
                state[name] = self.param(name, lambda _, n=name: first(n))
            else:
                state[name] = self.variable(STATE, name, lambda n=name: first(n)).value
        return state


class StatefulDotGeneral(_Stateful):
    """A quantized ``dot_general`` keeping its scale state as linen variables.

    Delayed scales and amax histories (:class:`~qbits.DelayedScaling`) live
    in the collection :data:`STATE`; learned step sizes
    (:class:`~qbits.LearnedScale`) are trainable parameters ``lhs_step`` /
    ``rhs_step`` (``params`` collection), initialised from the first batch
    given to ``init``.

    Give it to a layer as ``dot_general_cls=functools.partial(
    qbits.flax.StatefulDotGeneral, "fp8_delayed")``; it becomes a child module
    of the layer. Its variables are created by ``init``: scales 1, histories
    zero.

    Attributes:
      config: A :class:`~qbits.DotGeneralConfig` or a preset name.
      key: A PRNG key for stochastic rounding; ``None`` draws one from the
        ``'quant'`` rng stream when the config needs it.
      where: The config's place in its file, named in errors.
      layer: The layer's path, named in errors, or ``None``.

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
        """``lax.dot_general`` quantized with this module's scale state."""
        config, op = self._make_op(dot_general)
        state = self._scale_state(
            config,
            lambda: op.init_state(
                lhs, rhs, dimension_numbers, precision, preferred_element_type
            ),
        )
        return self._checked(op)(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding=out_sharding,
            state=state,
        )


class StatefulEinsum(_Stateful):
    """A quantized two-operand einsum keeping its scale state.

    As :class:`StatefulDotGeneral`; :func:`qbits.flax.quantize` uses it for
    ``nn.Einsum`` layers and attention einsums whose config keeps state.

    Attributes:
      config: A :class:`~qbits.DotGeneralConfig` or a preset name.
      key: As for :class:`StatefulDotGeneral`.

    Example:
      >>> import flax.linen as nn
      >>> op = qbits.flax.StatefulEinsum("fp8_delayed")
      >>> x, w = jnp.ones((2, 3, 8)), jnp.ones((8, 4))
      >>> variables = op.init(jax.random.key(0), "btd,dh->bth", x, w)
      >>> sorted(variables[qbits.flax.STATE])[:2]
      ['grad_amax_history', 'grad_scale']
    """

    @nn.compact
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
        """``jnp.einsum(subscripts, lhs, rhs)`` quantized with this module's state."""
        config, op = self._make_op(einsum)
        state = self._scale_state(config, lambda: op.init_state(subscripts, lhs, rhs))
        op = Einsum(self._checked(op.dot_general))
        return op(
            subscripts,
            lhs,
            rhs,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
            state=state,
        )


class StatefulConv(_Stateful):
    """A quantized ``conv_general_dilated`` keeping its scale state.

    As :class:`StatefulDotGeneral`, for ``conv_general_dilated_cls=`` of
    ``nn.Conv``.

    Attributes:
      config: A :class:`~qbits.DotGeneralConfig` or a preset name.
      key: As for :class:`StatefulDotGeneral`.

    Example:
      >>> import functools
      >>> import flax.linen as nn
      >>> cls = functools.partial(qbits.flax.StatefulConv, "fp8_delayed")
      >>> conv = nn.Conv(4, (3, 3), conv_general_dilated_cls=cls)
      >>> variables = conv.init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
      >>> variables[qbits.flax.STATE]["StatefulConv_0"]["rhs_scale"]
      Array([1.], dtype=float32)
    """

    @nn.compact
    def __call__(self, lhs: Any, rhs: Any, *args: Any, **kwargs: Any) -> jax.Array:
        """``lax.conv_general_dilated`` quantized with this module's state."""
        config, op = self._make_op(conv_general_dilated)
        state = self._scale_state(
            config, lambda: op.init_state(lhs, rhs, *args, **kwargs)
        )
        return self._checked(op)(lhs, rhs, *args, **kwargs, state=state)


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
