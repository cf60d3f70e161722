"""Scale state in nnx models: :class:`DelayedState` Variables.

A quantized nnx layer (:class:`~qbits.nnx.QuantizedDotGeneral`,
:class:`~qbits.nnx.QuantizedEinsum`, :class:`~qbits.nnx.QuantizedConv`)
whose config uses :class:`~qbits.DelayedScaling` (e.g. the ``fp8_delayed``
preset) holds its scales and amax histories as
:class:`DelayedState` Variables: ``lhs_scale``, ``lhs_amax_history``,
``rhs_...``, ``grad_...``. They are not ``nnx.Param`` s, so
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` leaves them alone.

The gradient of the loss with respect to them is the *new* state (see
:mod:`qbits.ops._state`): differentiate with respect to
``(nnx.Param, DelayedState)`` and call :func:`update_state`, which writes the
new state into the model and returns the parameter gradients for the
optimizer. When a layer is used more than once in one loss (micro-batches,
a shared layer in a loop), run the loss inside :func:`max_combining` so the
uses combine with max.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import flax.nnx as nnx

from qbits._errors import InvalidArgumentError
from qbits.ops import max_combining as _max_combining

__all__ = ["DelayedState", "init_state", "max_combining", "update_state"]


class DelayedState(nnx.Variable):
    """A delayed scale or amax history; updated through the backward pass.

    Example:
      >>> import flax.nnx as nnx
      >>> dg = qbits.nnx.QuantizedDotGeneral("fp8_delayed")
      >>> isinstance(dg.lhs_scale, qbits.nnx.DelayedState)
      True
    """


def update_state(model: nnx.Module, grads: Any) -> Any:
    """Writes the new delayed-scaling state in ``grads`` into ``model``.

    Args:
      model: The model the gradients were taken of.
      grads: The ``nnx.State`` from ``nnx.grad`` with respect to
        ``(nnx.Param, qbits.nnx.DelayedState)``.

    Returns:
      The gradients without the state: what ``nnx.Optimizer.update`` takes.

    Example:
      >>> import flax.nnx as nnx, optax
      >>> model = qbits.nnx.quantize(nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
      ...                            "fp8_delayed")
      >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> wrt = nnx.DiffState(0, (nnx.Param, qbits.nnx.DelayedState))
      >>> @nnx.jit
      ... def step(model, opt, x):
      ...     grads = nnx.grad(lambda m: m(x).sum(), argnums=wrt)(model)
      ...     opt.update(model, qbits.nnx.update_state(model, grads))
      >>> step(model, opt, jnp.full((2, 8), 2.0))
      >>> model.dot_general.lhs_amax_history[:2]
      Array([2., 0.], dtype=float32)
    """
    state, params = nnx.split_state(grads, DelayedState, ...)
    nnx.update(model, state)
    return params


@contextlib.contextmanager
def max_combining(model: nnx.Module) -> Iterator[nnx.Module]:
    """Makes every use of the model's delayed state combine with max.

    Inside the ``with`` block each :class:`DelayedState` holds its value
    converted once to the max-combining dtype
    (:func:`qbits.ops.max_combining`), so all calls of a layer within one
    gradient share it; the float32 values are put back on exit. Use it
    inside the differentiated function, under ``nnx.jit``.

    Example:
      >>> import flax.nnx as nnx
      >>> model = qbits.nnx.quantize(nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
      ...                            "fp8_delayed")
      >>> wrt = nnx.DiffState(0, (nnx.Param, qbits.nnx.DelayedState))
      >>> def loss(m, a, b):  # two micro-batches, one layer
      ...     with qbits.nnx.max_combining(m):
      ...         return m(a).sum() + m(b).sum()
      >>> a, b = jnp.full((2, 8), 3.0), jnp.full((2, 8), 5.0)
      >>> grads = nnx.jit(nnx.grad(loss, argnums=wrt))(model, a, b)
      >>> grads["dot_general"]["lhs_amax_history"][...][:2]
      Array([5., 0.], dtype=float32)
    """
    found = [
        node for _, node in nnx.iter_graph(model) if isinstance(node, DelayedState)
    ]
    originals = [v[...] for v in found]
    for v, value in zip(found, originals, strict=True):
        v.set_value(_max_combining(value))
    try:
        yield model
    finally:
        for v, value in zip(found, originals, strict=True):
            v.set_value(value)


def init_state(
    model: nnx.Module, batch: Any, call: Callable[[nnx.Module, Any], Any] | None = None
) -> None:
    """Sets the scale state of every quantized layer of ``model`` from one batch.

    Runs the model once, eagerly; each layer whose config has scale
    providers sets its state from the operands it sees: learned steps
    (:class:`~qbits.LearnedScale`, :func:`qbits.lsq.init_step`) and state
    whose shape follows the operands (per-channel delayed scales). Per-tensor
    delayed state needs no batch (it starts as scale 1, empty history); this
    resets it. Call it once, before training.

    Args:
      model: A quantized model.
      batch: An input batch.
      call: ``call(model, batch)`` runs the model; default ``model(batch)``.

    Raises:
      InvalidArgumentError: When a layer with scale state was not called by
        the run.

    Example:
      >>> import flax.nnx as nnx
      >>> lsq = qbits.Quantizer(qbits.IntNumerics(bits=4),
      ...                       qbits.LearnedScale("absmax"))
      >>> cfg = qbits.DotGeneralConfig(qbits.MatmulConfig(lhs=lsq))
      >>> model = qbits.nnx.quantize(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), cfg)
      >>> qbits.nnx.init_state(model, jnp.full((2, 8), 15.0))
      >>> model.dot_general.lhs_step[...]
      Array(2., dtype=float32)
    """
    found = [
        node for _, node in nnx.iter_graph(model) if getattr(node, "_state_names", ())
    ]
    for node in found:
        node._init_state_next_call = True
    try:
        if call is None:
            model(batch)
        else:
            call(model, batch)
    finally:
        missed = [node for node in found if node._init_state_next_call]
        for node in found:
            node._init_state_next_call = False
    if missed:
        raise InvalidArgumentError(
            "init_state",
            "batch",
            "a batch that leaves a layer with scale state uncalled",
            "a call of the model that runs every layer with scale state",
        )
