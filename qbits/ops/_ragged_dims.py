"""Dimension numbers of a ragged dot, its gradients, and its groups.

A ragged dot (``lax.ragged_dot_general`` in the mode ``lax.ragged_dot``
uses, the grouped matmul of mixture-of-experts layers) splits one lhs axis,
the *ragged* axis ``m``, into consecutive groups of ``group_sizes[j]``
indices, and multiplies group ``j`` by slice ``j`` of the rhs's *group*
axis::

    lhs [m, k] . rhs [g, k, n] -> out [m, n],   out[i] = lhs[i] @ rhs[group(i)]

(any batch and contracting axes around these). Indices past
``sum(group_sizes)`` belong to no group: their output is 0.

Its gradients, exactly as JAX transposes it (``jax/_src/lax/lax.py``,
``_ragged_dot_general_transpose_rule``): the lhs gradient is again such a
ragged dot, of the output gradient with the rhs (:meth:`RaggedDims.grad_lhs`);
the rhs gradient sums, for each group, over that group's indices of the
ragged axis (:meth:`RaggedDims.grad_rhs_ragged`). Its operands are
quantized per group; where the core quantizes them, it sees them
*expanded* per group (``[g, ...]``, each group's indices kept, the others
zeroed: :func:`expand`, :meth:`RaggedDims.dense`), so that each group's
operands get scales of their own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits.ops._dims import Axes, Dims

__all__ = [
    "BASIC",
    "RaggedDims",
    "expand",
    "group_ids",
    "ragged_bounds",
    "unsupported",
]

#: ``lax.ragged_dot``'s dimension numbers: ``[m, k] . [g, k, n] -> [m, n]``.
BASIC = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)

_MODE = (
    "the lhs ragged dimension among the lhs's non-contracting, non-batch "
    "dimensions and one rhs group dimension (lax.ragged_dot's mode, the "
    "grouped matmul of mixture-of-experts layers)"
)


def _remaining(n: int, *taken: Axes) -> Axes:
    used = {a for axes in taken for a in axes}
    return tuple(a for a in range(n) if a not in used)


def unsupported(
    dimension_numbers: Any, lhs_ndim: int, group_sizes_ndim: int, group_offset: Any
) -> str:
    """Why qbits cannot quantize this ragged dot, or ``""``.

    qbits quantizes the ragged dots whose lhs ragged dimension is a free
    (non-contracting, non-batch) dimension, with one list of group sizes
    (``[g]``) and no ``group_offset``: ``lax.ragged_dot`` and the
    ``ragged_dot_general`` calls of mixture-of-experts layers. JAX's own
    gradient exists for no other mode; the others appear in a program as
    the weight gradients JAX derives (a ragged dimension contracted).

    Example:
      >>> from qbits.ops._ragged_dims import BASIC, unsupported
      >>> unsupported(BASIC, 2, 1, None)
      ''
    """
    try:
        (lc, _), (lb, _) = dimension_numbers.dot_dimension_numbers
        (ragged,) = dimension_numbers.lhs_ragged_dimensions
        groups = tuple(dimension_numbers.rhs_group_dimensions)
    except (AttributeError, TypeError, ValueError):
        return "malformed ragged_dot_dimension_numbers"
    if ragged in lc:
        return "ragged_dot_general with the ragged dimension contracted"
    if ragged in lb:
        return "ragged_dot_general with a ragged batch dimension"
    if not 0 <= ragged < lhs_ndim or len(groups) != 1:
        return "malformed ragged_dot_dimension_numbers"
    if group_sizes_ndim != 1:
        return "group sizes per batch (group_sizes of rank > 1)"
    if group_offset is not None:
        return "a group_offset"
    return ""


@dataclasses.dataclass(frozen=True)
class RaggedDims:
    """Normalised dimension numbers of a ragged dot (the supported mode).

    Attributes:
      dims: The dot part (contracting and batch axes); the rhs's group axis
        is none of them.
      lhs_ragged: The lhs's ragged axis (one of its free axes).
      rhs_group: The rhs's group axis.
    """

    dims: Dims
    lhs_ragged: int
    rhs_group: int

    @classmethod
    def create(
        cls,
        dimension_numbers: Any,
        lhs_ndim: int,
        rhs_ndim: int,
        group_sizes_ndim: int = 1,
        group_offset: Any = None,
        owner: str = "ragged_dot_general",
    ) -> RaggedDims:
        """Checks and normalises a ``lax.RaggedDotDimensionNumbers``.

        Raises:
          InvalidArgumentError: For malformed dimension numbers or a mode
            qbits does not quantize (see :func:`unsupported`).
        """
        why = unsupported(dimension_numbers, lhs_ndim, group_sizes_ndim, group_offset)
        if why == "a group_offset":
            raise InvalidArgumentError(
                owner,
                "group_offset",
                group_offset,
                "None (qbits quantizes every group; JAX's own gradient does "
                "not support group_offset either)",
            )
        if why.startswith("group sizes"):
            raise InvalidArgumentError(
                owner,
                "group_sizes.ndim",
                group_sizes_ndim,
                "1: one size per group (qbits quantizes ragged dots with one "
                "list of group sizes)",
            )
        if why:
            raise InvalidArgumentError(
                owner, "ragged_dot_dimension_numbers", dimension_numbers, _MODE, why
            )
        dims = Dims.create(dimension_numbers.dot_dimension_numbers, lhs_ndim, rhs_ndim)
        (ragged,) = dimension_numbers.lhs_ragged_dimensions
        (group,) = dimension_numbers.rhs_group_dimensions
        if not 0 <= group < rhs_ndim or group in dims.rhs_contract + dims.rhs_batch:
            raise InvalidArgumentError(
                owner,
                "ragged_dot_dimension_numbers",
                dimension_numbers,
                _MODE,
                why=f"rhs group dimension {group} is not a free rhs axis",
            )
        return cls(dims, ragged, group)

    def lax(self) -> lax.RaggedDotDimensionNumbers:
        """The ``lax.RaggedDotDimensionNumbers``."""
        return lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=self.dims.lax(),
            lhs_ragged_dimensions=(self.lhs_ragged,),
            rhs_group_dimensions=(self.rhs_group,),
        )

    @property
    def rhs_kept(self) -> Axes:
        """The rhs's free axes but the group axis: the output's last axes."""
        d = self.dims
        return _remaining(d.rhs_ndim, d.rhs_contract, d.rhs_batch, (self.rhs_group,))

    @property
    def out_ndim(self) -> int:
        """Rank of the output: batch, lhs free, then ``rhs_kept`` axes."""
        d = self.dims
        return len(d.lhs_batch) + len(d.lhs_free) + len(self.rhs_kept)

    @property
    def out_ragged(self) -> int:
        """The output's ragged axis."""
        d = self.dims
        return len(d.lhs_batch) + d.lhs_free.index(self.lhs_ragged)

    def out_shape(self, lhs: tuple[int, ...], rhs: tuple[int, ...]) -> tuple[int, ...]:
        """The output shape for operands of these shapes."""
        d = self.dims
        return (
            tuple(lhs[a] for a in d.lhs_batch)
            + tuple(lhs[a] for a in d.lhs_free)
            + tuple(rhs[a] for a in self.rhs_kept)
        )

    def grad_lhs(self) -> tuple[RaggedDims, Axes]:
        """The lhs gradient, a ragged dot of the output gradient and the rhs.

        Returns ``(dims, perm)``: ``transpose(ragged_dot_general(g, rhs,
        dims), perm)`` is the lhs cotangent, as JAX computes it.
        """
        d = self.dims
        nb, nx, ny = len(d.lhs_batch), len(d.lhs_free), len(self.rhs_kept)
        ans_y = tuple(range(nb + nx, nb + nx + ny))
        dims = Dims(
            ans_y,
            self.rhs_kept,
            tuple(range(nb)),
            d.rhs_batch,
            nb + nx + ny,
            d.rhs_ndim,
        )
        order = np.argsort(d.rhs_contract)
        unsorted = (
            d.lhs_batch + d.lhs_free + tuple(d.lhs_contract[int(i)] for i in order)
        )
        perm = tuple(int(a) for a in np.argsort(unsorted))
        ragged = nb + d.lhs_free.index(self.lhs_ragged)
        return RaggedDims(dims, ragged, self.rhs_group), perm

    def dense(self) -> Dims:
        """The forward as a dense ``dot_general`` of the lhs expanded per group.

        ``dot_general(expand(lhs), rhs, dense())`` is ``[g, *out]``: group
        ``j``'s products at its own indices, zeros elsewhere (their sum over
        the first axis is the ragged dot). Its :meth:`Dims.grad_rhs` is the
        weight gradient of the expanded output gradient and lhs.
        """
        d = self.dims

        def up(axes: Axes) -> Axes:
            return tuple(a + 1 for a in axes)

        return Dims(
            up(d.lhs_contract),
            d.rhs_contract,
            (0, *up(d.lhs_batch)),
            (self.rhs_group, *d.rhs_batch),
            d.lhs_ndim + 1,
            d.rhs_ndim,
        )

    def grad_rhs_ragged(self) -> tuple[lax.RaggedDotDimensionNumbers, Axes]:
        """JAX's own rhs gradient: ``transpose(ragged_dot_general(lhs, g, dn), perm)``.

        The ragged dimension is contracted there (each group sums over its
        own indices): ``(dn, perm)``.
        """
        d = self.dims
        nb, nx = len(d.lhs_batch), len(d.lhs_free)
        dn = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(
                (d.lhs_free, tuple(range(nb, nb + nx))),
                (d.lhs_batch, tuple(range(nb))),
            ),
            lhs_ragged_dimensions=(self.lhs_ragged,),
            rhs_group_dimensions=(),
        )
        order = np.argsort(d.lhs_contract)
        unsorted = (
            self.rhs_group,
            *d.rhs_batch,
            *(d.rhs_contract[int(i)] for i in order),
            *self.rhs_kept,
        )
        return dn, tuple(int(a) for a in np.argsort(unsorted))


def ragged_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each group's first index and one past its last (int32)."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    return ends - sizes, ends


def group_ids(group_sizes: jax.Array, n: int) -> jax.Array:
    """The group of each index ``0..n-1`` of the ragged axis (``g``: none)."""
    _, ends = ragged_bounds(group_sizes)
    i = lax.broadcasted_iota(jnp.int32, (n, ends.shape[0]), 0)
    return jnp.sum((ends[None, :] <= i).astype(jnp.int32), axis=1)


def group_mask(group_sizes: jax.Array, shape: tuple[int, ...], axis: int) -> jax.Array:
    """``[g, *shape]`` booleans: index ``i`` of ``axis`` is in group ``j``."""
    starts, ends = ragged_bounds(group_sizes)
    g = starts.shape[0]
    i = lax.broadcasted_iota(jnp.int32, (g, shape[axis]), 1)
    inside = (starts[:, None] <= i) & (i < ends[:, None])
    return lax.broadcast_in_dim(inside, (g, *shape), (0, axis + 1))


def expand(x: jax.Array, group_sizes: jax.Array, axis: int) -> jax.Array:
    """``x`` expanded per group along its ragged ``axis``: ``[g, *x.shape]``.

    Slice ``j`` keeps group ``j``'s indices along ``axis`` and is zero
    elsewhere: ``expand([1, 2, 3], [1, 2], 0)`` is ``[[1, 0, 0], [0, 2, 3]]``.
    """
    mask = group_mask(group_sizes, x.shape, axis)
    wide = lax.broadcast_in_dim(x, mask.shape, tuple(range(1, x.ndim + 1)))
    return lax.select(mask, wide, lax.full_like(wide, 0))
