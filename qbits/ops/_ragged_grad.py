"""A ragged dot's weight gradient, its operands quantized group by group.

The weight gradient of a ragged dot sums, for each group, its own rows:
``d rhs[j] = lhs_j^T g_j``. Quantized per group (``PerChannel()``: one
scale per group and channel, from that group's rows), it is what
:func:`qbits.dot_general` gives on each group's rows. Calibrated on the
operands expanded per group (``[groups, ...]``, other groups' rows zero),
its memory and work are the number of groups times the operands'.

Here, with no expansion: each group's absmax (a segment maximum over the
rows), the quantizer's own scale arithmetic on those bounds (the same
scales: a bound of zeros and a group's rows have the same maximum), each
row put on its group's scale by the quantizer (given per element: the same
codes, elementwise), and one grouped contraction
(:meth:`~qbits.ops._ragged_contract.RaggedWeightGrad.direct`). The core
keeps the float lhs for it (no codes expanded per group between the passes).

Only where nothing else needs the core's view of the operands: symmetric
grids with a zero, absmax calibration, per-channel or per-tensor scales,
no scale provider, no reuse of the forward's codes, no diagnostics probe
(:func:`own_weight_grad`). Stochastic rounding draws its noise per row
(the core draws it on the expansion): other draws, the same distribution.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qbits._calibration import AbsMax
from qbits._context import Context
from qbits._granularity import PerChannel, PerTensor
from qbits._quantizer import Quantizer, Request, quantize_all
from qbits._tensor import QTensor
from qbits.numerics import next_key
from qbits.ops._config import MatmulConfig
from qbits.ops._operands import _key, unquantized
from qbits.ops._ragged_dims import group_ids

__all__ = ["IDENTITY_MATMUL", "own_weight_grad", "quantize_rows"]

#: A matmul that quantizes nothing (the core's view of an owned weight grad).
IDENTITY_MATMUL = MatmulConfig()


def _owned(q: Quantizer) -> bool:
    return q.numerics.is_identity or (
        q.provider is None
        and isinstance(q.calibration, AbsMax)
        and isinstance(q.granularity, PerChannel | PerTensor)
        and q.numerics.has_zero
        and not q.numerics.asymmetric
        and q.scale_rounding != "e4m3"
    )


def own_weight_grad(cfg: MatmulConfig) -> bool:
    """Whether the weight gradient ``cfg`` quantizes its operands itself.

    Example:
      >>> from qbits.ops._ragged_grad import own_weight_grad
      >>> own_weight_grad(qbits.presets.get("int8").drhs)
      True
    """
    return (
        not cfg.is_identity
        and not cfg.use_fwd_quant
        and _owned(cfg.lhs)
        and _owned(cfg.rhs)
    )


def _group_amax(
    x: jax.Array, ragged: int, contracting: tuple[int, ...], group_sizes: jax.Array
) -> jax.Array:
    """``max(|x|)`` per group and block: ``[g, *x.shape]``, 1 on ``contracting``.

    ``contracting`` (axes of ``x``) holds ``ragged``; a group of no rows has
    bound 0, as on the expansion.
    """
    a = jnp.abs(x)
    others = tuple(c for c in contracting if c != ragged)
    if others:
        a = jnp.max(a, axis=others, keepdims=True)
    a = jnp.moveaxis(a, ragged, 0)
    g = group_sizes.shape[0]
    ids = group_ids(group_sizes, a.shape[0])
    bound = jax.ops.segment_max(a, ids, num_segments=g + 1)[:g]
    bound = jnp.maximum(bound, jnp.zeros((), bound.dtype))  # empty: -inf
    return jnp.expand_dims(bound, 1 + ragged)


def quantize_rows(
    q: Quantizer,
    x: jax.Array,
    ragged: int,
    contracting: tuple[int, ...],
    group_sizes: jax.Array,
    key: jax.Array | None,
    slot: int,
    store: bool,
) -> tuple[QTensor, jax.Array | None]:
    """``x`` quantized per group: ``(rows, scale)``.

    ``rows`` is ``x``'s shape, each index on its group's scale (a scale per
    element); ``scale`` the group scales, ``[g, *x.shape]`` with 1 along
    ``contracting`` (the layout of the expansion's), or ``None`` for an
    identity quantizer. ``key``: the call's (its next key is drawn, then the
    operand's ``slot``, as the core does).
    """
    if q.numerics.is_identity:
        return unquantized(x), None
    noisy = getattr(q.numerics, "noise_fn", None) is not None
    k = None if key is None or not noisy else _key(next_key(key), slot, x)
    bound = _group_amax(x, ragged, contracting, group_sizes)
    expanded = tuple(1 + c for c in contracting)
    request = Request(q, bound, Context(k), False, expanded)
    ((scales, _),) = quantize_all([request], vjp=False)
    scale = scales.scale  # the quantizer's scales of those bounds (codes unused)
    per_group = jnp.broadcast_to(scale, bound.shape)
    per_group = jnp.squeeze(per_group, 1 + ragged)
    ids = group_ids(group_sizes, x.shape[ragged])
    rows = jnp.take(per_group, ids, axis=0, mode="fill", fill_value=1)
    rows = jnp.broadcast_to(jnp.moveaxis(rows, 0, ragged), x.shape)
    store = store and q.numerics.get_dtype() is not None
    each = q.replace(granularity=PerChannel())  # one given scale per element
    ((qt, _),) = quantize_all(
        [Request(each, x, Context(k), store, (), rows)], vjp=False
    )
    return qt, scale


def straight_through(quantized: Any, plain: Any) -> Any:
    """``quantized(a, b)`` whose derivatives are ``plain``'s (straight-through)."""

    @jax.custom_jvp
    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        return quantized(a, b)

    @f.defjvp
    def _(primals: Any, tangents: Any) -> Any:
        _, t = jax.jvp(plain, primals, tangents)
        return f(*primals), t

    return f
