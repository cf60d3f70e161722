"""Adapters: what a weight matmul does to its input and adds to its output.

An adapted weight matmul ``x . w`` runs as it would without the adapter
(float, quantized, or on its stored weight) and adds what an
:class:`Adapter` computes from the activation ``x`` and the adapter's own
data (low-rank adapters: ``(x A) B``). An adapter may also transform the
activation before the matmul quantizes it (SmoothQuant's ``x / s``, a
rotation's ``x Q``: :mod:`qbits.ptq`). The adapter sees the activation as
the engine's observers do (:func:`~._observe.activation_rows`): rows of
``K`` values over the weight's contraction channels, per group for a
weight with batch axes of its own, and returns rows of ``N`` values over
the weight's output channels; the engine puts them back in the matmul's
output layout. Its data come in by the matmul's path, sliced per layer
along a scan over stacked layers, like scale state and stored weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits.transform._observe import ObservedMatmul, activation_rows

__all__ = ["DATA", "Adapter", "adapted"]

# The prefix of an adapter's data name among a run's per-site data: a
# matmul's path never starts with "/", so it never meets a stored weight's
# or a scale state's name.
DATA = "/adapter/"


@dataclasses.dataclass(frozen=True)
class Adapter:
    """What an adapted weight matmul does to its input and adds to its output.

    Attributes:
      apply: ``(matmul, rows, data, key) -> rows``, or ``None`` (nothing
        added): ``rows`` is the
        activation as ``(*matmul.groups, M, K)`` (as the observers of
        :func:`~qbits.transform.observe_matmuls` get it); ``data`` is the
        adapter's data for this matmul (one layer's, for a scan over stacked
        layers); ``key`` a PRNG key (``None`` unless ``needs_key``). Returns
        ``(*matmul.groups, M, N)``: what is added to the matmul's output,
        over its ``N`` output channels (the weight's free axes flattened in
        order). It sees the activation as the model computed it (before
        ``before``).
      needs_key: Whether ``apply`` draws random numbers (dropout): each
        adapted matmul, each scan iteration, gets a key of its own.
      before: ``(matmul, rows, data) -> rows``, or ``None``: replaces the
        activation the matmul itself multiplies (and quantizes) by what it
        returns from the activation's rows (the same shape, ``K`` values
        per row): a function of the input channels (SmoothQuant's division
        by per-channel scales, a rotation). Gradients flow through it to
        the activation and the data.

    Example:
      >>> double = qbits.transform.Adapter(lambda m, rows, w, key: rows @ w)
      >>> def f(params, x):
      ...     return x @ params["w"]
      >>> params, x = {"w": jnp.ones((4, 2))}, jnp.ones((3, 4))
      >>> adapted = qbits.transform.adapt(f, None, double, {"w": params["w"]})
      >>> adapted(params, x)[0].tolist()  # x @ w + x @ w
      [8.0, 8.0]
      >>> halve = qbits.transform.Adapter(before=lambda m, rows, s: rows / s)
      >>> halved = qbits.transform.adapt(f, None, halve, {"w": jnp.full(4, 2.0)})
      >>> halved(params, x)[0].tolist()  # (x / 2) @ w
      [2.0, 2.0]
    """

    apply: Callable[[ObservedMatmul, jax.Array, Any, Any], jax.Array] | None = None
    needs_key: bool = False
    before: Callable[[ObservedMatmul, jax.Array, Any], jax.Array] | None = None


def adapted(
    adapter: Adapter,
    matmul: ObservedMatmul,
    operands: tuple[Any, Any],
    dimension_numbers: Any,
    data: Any,
    next_key: Callable[[], Any],
    run: Callable[[Any, Any], Any],
) -> Any:
    """``run(lhs, rhs)`` (the matmul), adapted by ``adapter``.

    The activation (the operand that is not the weight) goes to the adapter
    as rows of ``K`` values (:func:`~._observe.activation_rows`): what
    ``adapter.before`` returns replaces it (back in its own layout) before
    the matmul runs; what ``adapter.apply`` returns, rows of ``N`` values
    from the activation as the model computed it, is added to the output
    in the equation's own layout (its batch axes, then the lhs's free axes,
    then the rhs's), whichever operand the weight is. ``next_key`` draws
    the adapter's key (after the matmul's own).
    """
    lhs, rhs = operands
    weight_left = matmul.side == "rhs"
    x, dn = (
        (rhs, _flipped(dimension_numbers)) if weight_left else (lhs, dimension_numbers)
    )
    (xc, wc), (xb, wb) = dn
    rows = activation_rows(x, dn, matmul.grouped)
    # activation_rows: transposed to (batch, free, contracting) in the
    # weight's order, then flattened.
    xc = [a for _, a in sorted(zip(wc, xc, strict=True))]
    xb = [a for _, a in sorted(zip(wb, xb, strict=True))]
    free = [a for a in range(jnp.ndim(x)) if a not in xc and a not in xb]
    if adapter.before is not None:
        new = adapter.before(matmul, rows, data)
        if jnp.shape(new) != jnp.shape(rows):
            raise ValueError(
                f"an Adapter's before() returned shape {jnp.shape(new)} for the "
                f"activation rows of {matmul.path!r} of shape {jnp.shape(rows)}; "
                "it must keep the rows' shape"
            )
        order = (*xb, *free, *xc)
        moved = jnp.reshape(new, tuple(jnp.shape(x)[a] for a in order))
        new = jnp.transpose(moved, np.argsort(order)).astype(x.dtype)
        lhs, rhs = (lhs, new) if weight_left else (new, rhs)
    out = run(lhs, rhs)
    if adapter.apply is None:
        return out
    added = adapter.apply(matmul, rows, data, next_key() if adapter.needs_key else None)
    # Back to the activation's batch axes in the equation's order, its free
    # axes, the weight's free axes; then the equation's own output layout.
    by_weight = sorted(range(len(xb)), key=lambda i: wb[i])
    shape = (
        *(jnp.shape(x)[xb[i]] for i in by_weight),
        *(jnp.shape(x)[a] for a in free),
        *(matmul.shape[a] for a in matmul.free),
    )
    added = jnp.reshape(added, shape)
    nb, nx = len(xb), len(free)
    perm = [*np.argsort(by_weight), *range(nb, len(shape))]
    if weight_left:  # the weight's free axes come first in the output
        perm = [*perm[:nb], *perm[nb + nx :], *perm[nb : nb + nx]]
    return out + jnp.transpose(added, perm).astype(out.dtype)


def _flipped(dn: Any) -> Any:
    """Dimension numbers with the operands' roles exchanged."""
    (lc, rc), (lb, rb) = dn
    return (rc, lc), (rb, lb)
