"""Observing every weight matmul's activation, over batches; activation ranges.

:func:`observe_matmuls` runs a function in float, jitted once, on each
batch, and hands each observed weight matmul's activation to an
:class:`~qbits.transform.Observer` (the engine in its observing mode:
:class:`~._runner.Frame`'s ``observed``); :func:`collect_ranges` is the
observer of the largest magnitudes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from qbits._errors import InvalidArgumentError
from qbits.config import _as_quant_config
from qbits.transform._observe import ObservedMatmul, Observer
from qbits.transform._plan import Caller, Plan, entry_point
from qbits.transform._program import trace
from qbits.transform._runner import Frame, run_program

__all__ = ["collect_ranges", "observe_matmuls"]

_COLLECT_RANGES = Caller("qbits.collect_ranges")


@entry_point(Caller("qbits.transform.observe_matmuls"))
def observe_matmuls(  # noqa: D417 (caller: its public form has none)
    caller: Caller,
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
    observer: Observer,
    *,
    config: Any = None,
) -> tuple[dict[str, ObservedMatmul], dict[str, Any]]:
    """What an observer records of every weight matmul's activation, over batches.

    The one mechanism behind :func:`collect_ranges` and post-training
    statistics (:func:`qbits.ptq.collect_stats`). Runs ``fn(params, batch)``
    in float, jitted once, on each batch; each observed weight matmul hands
    its activation, as ``(*groups, rows, K)`` rows over the weight's
    contraction channels (:class:`ObservedMatmul`), to ``observer.observe``,
    whose records merge over batches (a running total that starts at zeros,
    updated in place), over the steps of a loop and over the uses of a
    path, or stay stacked along a scan over stacked layers
    (``observer.per_layer``).

    Observed are the weight ``dot_general`` s (dense layers, einsums, ``@``;
    not convolutions) that run in float: integer matmuls and those inside a
    custom-gradient function are kept as they are; those inside a ``cond``,
    ``while`` or ``shard_map`` body are left out (a record could not leave
    the body).

    Args:
      fn: ``fn(params, batch)``, e.g. a linen model's ``apply``.
      params: Its parameters (they name the matmuls).
      batches: An iterable of inputs (each passed as the second argument).
      observer: What to record.
      config: Per-layer rules, as for :func:`quantize`: observe the weight
        matmuls they give a quantizing config; ``None``: every one.

    Returns:
      ``({path: ObservedMatmul}, {path: merged record})``, paths as
      :func:`layer_table` names them.

    Raises:
      InvalidArgumentError: For no batches, a bad ``config`` or ``fn``.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> rows = qbits.transform.Observer(
      ...     lambda matmul, x: jnp.float32(x.shape[0]), jnp.add, jnp.sum)
      >>> found, counts = qbits.transform.observe_matmuls(
      ...     mlp, params, [jnp.ones((3, 4)), jnp.ones((5, 4))], rows)
      >>> found["w2"].k, found["w2"].contracting, found["w2"].side, float(counts["w2"])
      (8, (0,), 'lhs', 8.0)
    """
    if not callable(fn):
        raise InvalidArgumentError(caller.owner, "fn", fn, "a function")
    every = config is None
    rules = _as_quant_config(caller.owner, config, allow_none=True)
    found: dict[str, ObservedMatmul] = {}

    def observe(params: Any, batch: Any) -> dict[str, Any]:
        program = trace(fn, (params, batch), {}, 0, caller.owner)
        plan = Plan(program, rules, caller, observe=observer, every=every)
        found.clear()
        found.update({m.path: m for m in plan.observed.values()})
        frame = Frame(None, {}, observed={})
        run_program(program, plan, frame, (params, batch), {})
        return frame.observed  # type: ignore[return-value]

    @functools.partial(jax.jit, donate_argnums=2)
    def step(params: Any, batch: Any, total: dict[str, Any]) -> dict[str, Any]:
        new = observe(params, batch)
        return {n: observer.merge(total[n], v) for n, v in new.items()}

    total = None
    for batch in batches:
        if total is None:
            shapes = jax.eval_shape(observe, params, batch)
            total = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        total = step(params, batch, total)
    if total is None:
        raise InvalidArgumentError(
            caller.owner, "batches", batches, "at least one batch"
        )
    return dict(found), total


def _amax(matmul: ObservedMatmul, rows: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(rows)).astype(jnp.float32)


_RANGES = Observer(_amax, jnp.maximum, functools.partial(jnp.max, axis=0))


def collect_ranges(
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
) -> dict[str, float]:
    """The largest activation magnitude of every weight matmul, over batches.

    Runs ``fn(params, batch)`` (in float, jitted) on each batch and takes,
    per weight matmul, the max over batches of ``max(|activation|)``: the
    operand a config's ``fwd.lhs`` quantizes. Give the result to
    :func:`qbits.freeze_ranges` (static post-training ranges). Matmuls in a
    ``cond``, ``while`` or ``shard_map`` body are left out (their ranges
    cannot leave it).

    Args:
      fn: ``fn(params, batch)``, e.g. a linen model's ``apply``.
      params: Its parameters.
      batches: An iterable of inputs (each passed as the second argument).

    Returns:
      ``{matmul path: absmax}``, paths as :func:`layer_table` names them.

    Raises:
      InvalidArgumentError: For no batches.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> qbits.collect_ranges(mlp, params, [jnp.ones((3, 4)), -2 * jnp.ones((3, 4))])
      {'w1': 2.0, 'w2': 4.0}
    """
    observe = observe_matmuls.__wrapped__  # type: ignore[attr-defined]
    _, ranges = observe(_COLLECT_RANGES, fn, params, batches, _RANGES)
    return {path: float(value) for path, value in ranges.items()}
