"""Observing every weight matmul's activation: what a collecting run records.

A collecting run of the engine (:func:`observe_matmuls`; ranges for static
scales, calibration statistics for post-training quantization) runs the
function in float and hands each selected weight matmul's activation to an
:class:`Observer`, laid out over the weight's contraction channels: rows of
``K`` values, ``K`` the product of the contracted axes, in the order of the
weight's contracting axes (so that the rows multiply the weight reshaped to
``(K, N)``, :class:`ObservedMatmul`). The observer reduces them to a record
(a pytree of arrays); records of the same matmul merge (over the steps of a
loop, over calibration batches), or stay stacked along a scan over stacked
layers: one record per layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qbits.transform._program import Ctx, Program, Site

__all__ = ["ObservedMatmul", "Observer", "activation_rows", "describe", "record"]


@dataclasses.dataclass(frozen=True)
class ObservedMatmul:
    """One observed weight matmul, as the engine sees its operands.

    The weight's axes are those of the weight operand as the matmul sees it
    (after the model's own reshapes, transposes and casts, one layer of a
    scan over stacked layers): the parameter's own axes where the model
    multiplies by the parameter as it is (``Dense``, ``x @ w``, an einsum).

    Attributes:
      path: The matmul's path, as :func:`qbits.layer_table` names it.
      keys: The key path of the parameter feeding the weight, inside the
        parameters argument (``jax.tree_util`` keys).
      param_shape: That parameter's shape (all layers).
      side: ``"lhs"`` or ``"rhs"``: the activation's operand of the
        ``dot_general`` (the weight is the other).
      shape: The weight operand's shape (one layer).
      contracting: The weight axes the matmul contracts, in order; the
        activation's rows hold the axes they pair with, flattened in this
        order (``K``).
      batch: The weight's batch axes, in order (one matrix per group, e.g.
        per head).
      free: The weight's other axes: the output channels ``N``.
      layers: Lengths of the scans that slice the parameter (stacked
        layers), outermost first: the leading axes of a stacked record.
      grouped: Whether the activation is observed per group (leading axes
        ``shape[batch]``); a weight broadcast along its batch axes (more
        elements than its parameter) is one matrix, its groups' rows
        observed together.
      kind: The matmul's kind, as in the layer table.

    Example:
      >>> def f(params, x):
      ...     return jnp.einsum("btd,dhk->bthk", x, params["w"])
      >>> count = qbits.transform.Observer(
      ...     lambda matmul, rows: jnp.float32(rows.shape[0]), jnp.add, jnp.sum)
      >>> found, rows = qbits.transform.observe_matmuls(
      ...     f, {"w": jnp.ones((8, 2, 4))}, [jnp.ones((3, 5, 8))], count)
      >>> m = found["w"]
      >>> m.side, m.contracting, m.free, m.k, m.n, float(rows["w"])
      ('lhs', (0,), (1, 2), 8, 8, 15.0)
    """

    path: str
    keys: tuple[Any, ...]
    param_shape: tuple[int, ...]
    side: str
    shape: tuple[int, ...]
    contracting: tuple[int, ...]
    batch: tuple[int, ...]
    free: tuple[int, ...]
    layers: tuple[int, ...]
    grouped: bool
    kind: str

    @property
    def groups(self) -> tuple[int, ...]:
        """The group axes of a record (after ``layers``): ``()`` ungrouped."""
        return tuple(self.shape[a] for a in self.batch) if self.grouped else ()

    @property
    def k(self) -> int:
        """The number of contraction channels."""
        return math.prod(self.shape[a] for a in self.contracting)

    @property
    def n(self) -> int:
        """The number of output channels."""
        return math.prod(self.shape[a] for a in self.free)


@dataclasses.dataclass(frozen=True)
class Observer:
    """What a collecting run records for each observed matmul.

    Attributes:
      observe: ``(matmul, rows) -> record``: ``rows`` is the activation as
        ``(*matmul.groups, rows, K)`` (float, as the matmul gets it).
      merge: ``(record, record) -> record``: two records of one matmul
        (another batch, another use). Zeros of a record's shape and dtype
        must be its identity (the running total starts at zeros).
      merge_steps: ``record -> record``: records stacked along a leading
        axis (the steps of a loop) merged into one.
      per_layer: Keep the records of a scan over stacked layers stacked
        (one per layer) rather than merged.

    Example:
      >>> def mlp(params, x):
      ...     return jax.nn.relu(x @ params["w1"]) @ params["w2"]
      >>> params = {"w1": jnp.ones((2, 3)), "w2": jnp.ones((3, 1))}
      >>> per_channel = qbits.transform.Observer(  # max |x| of each channel
      ...     lambda matmul, rows: jnp.max(jnp.abs(rows), axis=0),
      ...     jnp.maximum, lambda steps: jnp.max(steps, axis=0))
      >>> batches = [jnp.array([[1.0, -4.0]]), jnp.array([[-2.0, 3.0]])]
      >>> _, amax = qbits.transform.observe_matmuls(mlp, params, batches, per_channel)
      >>> amax["w1"].tolist(), amax["w2"].tolist()
      ([2.0, 4.0], [1.0, 1.0, 1.0])
    """

    observe: Callable[[ObservedMatmul, jax.Array], Any]
    merge: Callable[[Any, Any], Any]
    merge_steps: Callable[[Any], Any]
    per_layer: bool = False


def record(observer: Observer, records: dict[str, Any], path: str, new: Any) -> None:
    """Adds a matmul's record to ``records``, merged with one already there."""
    old = records.get(path)
    records[path] = new if old is None else observer.merge(old, new)


def activation_rows(x: jax.Array, dimension_numbers: Any, grouped: bool) -> Any:
    """The lhs (activation) of ``lhs . rhs`` as ``(*groups, rows, K)``.

    The contracted axes are flattened in the order of the rhs (weight) axes
    they pair with, and so are the batch axes, which lead when ``grouped``
    (else they are rows too).
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lc = [a for _, a in sorted(zip(rc, lc, strict=True))]
    lb = [a for _, a in sorted(zip(rb, lb, strict=True))]
    free = [a for a in range(jnp.ndim(x)) if a not in lc and a not in lb]
    x = jnp.transpose(x, (*lb, *free, *lc))
    k = math.prod(x.shape[jnp.ndim(x) - len(lc) :])
    if grouped:
        return x.reshape(*x.shape[: len(lb)], -1, k)
    return x.reshape(-1, k)


def describe(site: Site, program: Program, swapped: bool) -> ObservedMatmul:
    """The :class:`ObservedMatmul` of a weight ``dot_general`` site."""
    (lc, rc), (lb, rb) = site.eqn.params["dimension_numbers"]
    w = 0 if swapped else 1
    contracting, batch = (
        (tuple(sorted(lc)), tuple(sorted(lb)))
        if swapped
        else (tuple(sorted(rc)), tuple(sorted(rb)))
    )
    shape = tuple(int(d) for d in site.eqn.invars[w].aval.shape)
    weight = next(iter(site.weights))
    param_shape = _param_shapes(program)[weight.keys]
    layers = tuple(
        n for c, n in _scans(program.closed.jaxpr, site.ctx) if c in weight.sliced
    )
    per_layer = math.prod(param_shape) // max(math.prod(layers), 1)
    return ObservedMatmul(
        path=site.path,
        keys=weight.keys,
        param_shape=param_shape,
        side="rhs" if swapped else "lhs",
        shape=shape,
        contracting=tuple(int(a) for a in contracting),
        batch=tuple(int(a) for a in batch),
        free=tuple(a for a in range(len(shape)) if a not in contracting + batch),
        layers=layers,
        grouped=bool(batch) and math.prod(shape) <= per_layer,
        kind=site.kind,
    )


def _param_shapes(program: Program) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """``{key path inside the parameters: shape}`` (parameters: ``args[0]``)."""
    leaves = jax.tree.unflatten(program.in_tree, range(len(program.dynamic)))
    invars = iter(program.closed.jaxpr.invars)
    shapes = {}
    for (path, _), dynamic in zip(
        jax.tree_util.tree_flatten_with_path(leaves)[0], program.dynamic, strict=True
    ):
        if not dynamic:
            continue
        shape = tuple(int(d) for d in next(invars).aval.shape)
        if path[:2] == (jax.tree_util.SequenceKey(0),) * 2:
            shapes[tuple(path[2:])] = shape
    return shapes


def _scans(jaxpr: Any, ctx: Ctx) -> list[tuple[Ctx, int]]:
    """The scans around the equation at ``ctx`` (outside cond/while bodies)."""
    found = []
    for n in range(len(ctx) - 1):
        eqn = jaxpr.eqns[ctx[n]]
        body = eqn.params["jaxpr"]
        if eqn.primitive.name == "scan":
            found.append((ctx[: n + 1], int(eqn.params["length"])))
        jaxpr = getattr(body, "jaxpr", body)  # a ClosedJaxpr's, or an open one
    return found
