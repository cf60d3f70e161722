"""``collect_stats``: every weight matmul's input statistics, over batches.

The engine's observing run (:func:`qbits.transform.observe_matmuls`, the
mechanism behind :func:`qbits.collect_ranges`) runs the function in float
on each calibration batch and hands each weight matmul's activation, as
rows over the weight's contraction channels, to an :class:`InputStats`
update; the statistics stream over the batches (one ``K x K`` Hessian per
matmul and layer in memory, never the activations).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits import transform
from qbits._errors import InvalidArgumentError
from qbits.ptq._layout import indices
from qbits.ptq._stats import InputStats
from qbits.transform import ObservedMatmul, Observer
from qbits.transform import _Caller as Caller

__all__ = ["MatmulStats", "collect_stats"]

_COLLECT = Caller("qbits.ptq.collect_stats")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MatmulStats:
    """One weight matmul: where its weight is, and its input statistics.

    The weight's axes are those of the weight operand as the matmul sees it
    (one layer of a scan over stacked layers; after the model's own
    reshapes, transposes and casts): the parameter's own axes where the
    model multiplies by the parameter as it is (``Dense``, ``x @ w``, an
    einsum). :meth:`operand` reads the operand from the parameter (a
    Conv1D kernel stored ``(out, in)`` and transposed before multiplying,
    as Hugging Face's GPT-2 stores them), :meth:`matrix` reshapes it to the
    ``(K, N)`` the statistics are over, :meth:`write` puts an operand back
    into the parameter.

    Attributes:
      path: The matmul's path, as :func:`qbits.layer_table` names it.
      keys: The key path of the weight's parameter inside ``params``
        (``jax.tree_util`` keys).
      side: The activation's operand of the ``dot_general``: ``"lhs"``
        (``x @ w``) or ``"rhs"`` (``w @ x``, or an einsum JAX runs so).
      shape: The weight operand's shape (one layer).
      contracting: Its contracted axes, in order: ``K`` is them flattened
        (a weight of shape ``(*K axes, *N axes)`` reshapes to ``(K, N)``).
      batch: Its batch axes, in order (one matrix per group, e.g. per head).
      free: Its other axes: the output channels ``N``.
      layers: Lengths of the scans that slice the parameter (stacked
        layers), outermost first: the leading axes of ``stats``.
      grouped: Whether ``stats`` has one entry per group (axes
        ``shape[batch]`` after ``layers``); ``False`` for a weight broadcast
        along its batch axes (one matrix: the groups' rows are its rows).
      stats: The :class:`InputStats` of its activation, over ``K``.
      index: Which entry of the parameter each entry of the operand is
        (int64, shape ``(*layers, *shape)``: :func:`operand_indices`), or
        ``None`` where the operand is the parameter as it is.
      exclusive: Whether this matmul is all that reads the parameter (no
        other matmul, no lookup: a tied embedding's head is not).

    Example:
      >>> def head(params, x):
      ...     return x @ params["w"]
      >>> params, x = {"w": jnp.ones((4, 3))}, jnp.ones((2, 4))
      >>> ms = qbits.ptq.collect_stats(head, params, [x])["w"]
      >>> ms.side, ms.shape, ms.stats.hessian.shape, ms.matrix(params["w"]).shape
      ('lhs', (4, 3), (4, 4), (4, 3))
    """

    path: str = dataclasses.field(metadata={"static": True})
    keys: tuple[Any, ...] = dataclasses.field(metadata={"static": True})
    side: str = dataclasses.field(metadata={"static": True})
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    contracting: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    batch: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    free: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    layers: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    grouped: bool = dataclasses.field(metadata={"static": True})
    stats: InputStats
    index: np.ndarray | None = None
    exclusive: bool = dataclasses.field(default=True, metadata={"static": True})

    def operand(self, param: jax.Array) -> jax.Array:
        """The weight operand, all layers stacked, read from its parameter.

        Args:
          param: The parameter (of shape ``param_shape``).

        Returns:
          The operand of every layer, ``(*layers, *shape)``, in the
          parameter's dtype.

        Raises:
          InvalidArgumentError: For a parameter the operand cannot be read
            from (statistics of another model, or made by hand without
            ``index`` for a model that rearranges its parameter).

        Example:
          >>> def f(params, x):  # a kernel stored (out, in)
          ...     return x @ params["w"].T
          >>> params = {"w": jnp.arange(6.0).reshape(3, 2)}
          >>> ms = qbits.ptq.collect_stats(f, params, [jnp.ones((1, 2))])["w"]
          >>> ms.operand(params["w"]).tolist(), ms.shape
          ([[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]], (2, 3))
        """
        want = (*self.layers, *self.shape)
        if self.index is None and tuple(jnp.shape(param)) == want:
            return jnp.asarray(param)
        if self.index is not None and np.size(param) > int(self.index.max(initial=-1)):
            # On the host: a gather per weight shape would compile.
            return jnp.asarray(np.asarray(param).reshape(-1)[self.index])
        raise InvalidArgumentError(
            "qbits.ptq.MatmulStats.operand",
            "param",
            f"{jax.tree_util.keystr(self.keys)} of shape {list(jnp.shape(param))}",
            f"the parameter {self.path!r} reads its weight of shape "
            f"{list(want)} from (statistics of this model, from "
            "qbits.ptq.collect_stats)",
        )

    def write(self, param: jax.Array, operand: jax.Array) -> jax.Array:
        """``param`` with the entries the operand reads replaced by ``operand``.

        The inverse of :meth:`operand` (entries the matmul does not read,
        e.g. past a slice, keep their values).

        Args:
          param: The parameter.
          operand: A new operand, ``(*layers, *shape)``.

        Returns:
          The parameter with those entries, in its dtype and shape.

        Example:
          >>> def f(params, x):
          ...     return x @ params["w"].T
          >>> params = {"w": jnp.zeros((3, 2))}
          >>> ms = qbits.ptq.collect_stats(f, params, [jnp.ones((1, 2))])["w"]
          >>> ms.write(params["w"], jnp.arange(6.0).reshape(2, 3)).tolist()
          [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
        """
        self.operand(param)  # the same checks
        dtype = jnp.result_type(param)
        if self.index is None:
            return jnp.asarray(operand, dtype).reshape(jnp.shape(param))
        flat = np.array(param, dtype).reshape(-1)  # a copy, on the host
        flat[self.index.reshape(-1)] = np.asarray(operand, dtype).reshape(-1)
        return jnp.asarray(flat.reshape(jnp.shape(param)))

    def matrix(self, weight: jax.Array) -> jax.Array:
        """One layer's weight operand as ``(*groups, K, N)``.

        Rows of the activation (over ``K``) times this matrix are the
        matmul's outputs (over ``N``): the layout the statistics are in.

        Args:
          weight: The weight operand of one layer, of shape ``shape``.

        Returns:
          ``weight`` transposed and reshaped to ``(K, N)``, after the
          group axes where ``grouped``.

        Raises:
          InvalidArgumentError: For a weight of another shape.

        Example:
          >>> def f(params, x):
          ...     return jnp.einsum("btk,nk->btn", x, params["w"])
          >>> params = {"w": jnp.arange(6.0).reshape(3, 2)}
          >>> stats = qbits.ptq.collect_stats(f, params, [jnp.ones((1, 4, 2))])
          >>> stats["w"].matrix(params["w"]).shape, stats["w"].side
          ((2, 3), 'lhs')
        """
        if tuple(jnp.shape(weight)) != self.shape:
            raise InvalidArgumentError(
                "qbits.ptq.MatmulStats.matrix",
                "weight",
                f"shape {list(jnp.shape(weight))}",
                f"the weight operand of one layer of {self.path!r}, shape "
                f"{list(self.shape)}",
            )
        k = math.prod(self.shape[a] for a in self.contracting)
        w = jnp.transpose(weight, (*self.batch, *self.contracting, *self.free))
        groups = tuple(self.shape[a] for a in self.batch) if self.grouped else ()
        return w.reshape(*groups, k, -1) if self.grouped else w.reshape(k, -1)


def _stats_of(matmul: ObservedMatmul, rows: jax.Array) -> InputStats:
    return InputStats.of(rows)


_OBSERVER = Observer(
    _stats_of, InputStats.merge, InputStats.merge_leading, per_layer=True
)


def collect_stats(
    fn: Callable[[Any, Any], Any],
    params: Any,
    batches: Iterable[Any],
    *,
    config: Any = None,
) -> dict[str, MatmulStats]:
    """The input statistics of every weight matmul of ``fn``, over batches.

    Runs ``fn(params, batch)`` in float, jitted once, on each calibration
    batch, and accumulates for each weight matmul (dense layers, einsums,
    ``@``, written anywhere in ``fn``) the :class:`InputStats` of the
    activation that multiplies the weight, over the weight's contraction
    channels: its Hessian ``X^T X``, per-channel max and mean magnitude. A
    streaming computation: one ``K x K`` matrix per matmul (and layer) in
    memory, never the activations. Every non-contracted axis of the
    activation is rows (batch, sequence, and the batch axes of a weight
    broadcast along them); a weight with batch axes of its own (one matrix
    per group) gets statistics per group.

    A matmul inside a scan over stacked layers (``nn.scan``, ``lax.scan``
    over stacked weights) gets statistics per layer (stacked: leading axis
    the scan's length); a loop that uses the same weight every step
    (micro-batches) sums its steps. Left out: convolutions, integer
    matmuls, matmuls inside a custom-gradient function (kept as they are by
    the engine) and matmuls inside a ``cond``, ``while`` or ``shard_map``
    body (their statistics could not leave it).

    Args:
      fn: ``fn(params, batch)``, e.g. a linen model's ``apply``.
      params: Its parameters: the matmuls are named after them.
      batches: An iterable of calibration inputs (each passed as the second
        argument), all of one structure, shape and dtype.
      config: Which matmuls: the per-layer rules that will quantize them
        (anything :func:`qbits.quantize` accepts: a preset name, a
        :class:`~qbits.QuantConfig` with rules); those their rule gives a
        quantizing config. ``None``: every weight matmul.

    Returns:
      ``{matmul path: MatmulStats}``, paths as :func:`qbits.layer_table`
      names them, in program order.

    Raises:
      InvalidArgumentError: For no batches, a batch unlike the first (its
        index and what differs), a bad ``config`` or ``fn``.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((8, 2))}
      >>> batches = [jnp.ones((3, 4)), 2 * jnp.ones((3, 4))]
      >>> stats = qbits.ptq.collect_stats(mlp, params, batches)
      >>> s = stats["w1"].stats
      >>> s.hessian.shape, s.rows.tolist(), s.absmax.tolist()
      ((4, 4), 6.0, [2.0, 2.0, 2.0, 2.0])
    """
    first: list[Any] = []
    found, records = transform._observe_matmuls(
        _COLLECT, fn, params, _alike(batches, first), _OBSERVER, config=config
    )
    index = indices(fn, params, tuple(first), {}, found)
    readers = transform._weight_matmuls(_COLLECT, fn, params, *first)
    return {
        path: MatmulStats(
            path=path,
            keys=m.keys,
            side=m.side,
            shape=m.shape,
            contracting=m.contracting,
            batch=m.batch,
            free=m.free,
            layers=m.layers,
            grouped=m.grouped,
            stats=records[path],
            index=index.get(path),
            exclusive=readers[path].exclusive,
        )
        for path, m in found.items()
    }


def _alike(batches: Iterable[Any], first_batch: list[Any]) -> Iterator[Any]:
    """The batches, each checked against the first (structure, shapes, dtypes).

    The first batch is appended to ``first_batch``.
    """
    if not isinstance(batches, Iterable):
        raise InvalidArgumentError(
            _COLLECT.owner, "batches", batches, "an iterable of batches"
        )
    first = None
    for i, batch in enumerate(batches):
        leaves, tree = jax.tree_util.tree_flatten_with_path(batch)
        spec = tree, [(path, _spec(leaf)) for path, leaf in leaves]
        if first is None:
            first = spec
            first_batch.append(batch)
        elif spec != first:
            raise InvalidArgumentError(
                _COLLECT.owner,
                f"batches[{i}]",
                _differs(spec, first),
                "a batch of the structure, shapes and dtypes of batches[0] "
                "(one compiled run serves every batch: pad, or group the "
                "batches by shape and merge the statistics)",
            )
        yield batch


def _spec(leaf: Any) -> str:
    dtype = np.dtype(jnp.result_type(leaf)).name
    return f"{dtype}{list(np.shape(leaf))}"


def _differs(spec: Any, first: Any) -> str:
    """What differs between a batch's and the first batch's structure."""
    (tree, leaves), (tree0, leaves0) = spec, first
    if tree != tree0:
        return f"a batch of structure {tree} (batches[0]: {tree0})"
    for (path, got), (_, want) in zip(leaves, leaves0, strict=True):
        if got != want:
            where = jax.tree_util.keystr(path) or "the batch"
            return f"{where} {got} (batches[0]: {want})"
    return "a batch unlike batches[0]"  # pragma: no cover - specs differ above
