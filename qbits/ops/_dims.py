"""Dimension numbers of ``dot_general``: normalising and transposing them."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from qbits._errors import InvalidArgumentError

__all__ = ["Dims"]

Axes = tuple[int, ...]


def _remaining(n: int, *taken: Sequence[int]) -> Axes:
    used = {a for axes in taken for a in axes}
    return tuple(a for a in range(n) if a not in used)


@dataclasses.dataclass(frozen=True)
class Dims:
    """Normalised ``dot_general`` dimension numbers plus operand ranks.

    The output of ``dot_general`` has the batch axes first (in ``lhs_batch``
    order), then the lhs free axes, then the rhs free axes (each in
    ascending order).

    Attributes:
      lhs_contract: Contracting axes of the lhs.
      rhs_contract: Contracting axes of the rhs (paired with ``lhs_contract``).
      lhs_batch: Batch axes of the lhs.
      rhs_batch: Batch axes of the rhs.
      lhs_ndim: Rank of the lhs.
      rhs_ndim: Rank of the rhs.

    Example:
      >>> dims = qbits.ops.Dims.create((((2,), (1,)), ((0,), (0,))), 3, 3)
      >>> dims.lhs_contract, dims.lhs_batch, dims.lhs_free, dims.rhs_free
      ((2,), (0,), (1,), (2,))
    """

    lhs_contract: Axes
    rhs_contract: Axes
    lhs_batch: Axes
    rhs_batch: Axes
    lhs_ndim: int
    rhs_ndim: int

    @classmethod
    def create(cls, dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int) -> Dims:
        """Normalises ``((lc, rc), (lb, rb))``; negative axes are allowed.

        Raises:
          InvalidArgumentError: If the dimension numbers are malformed.
        """
        try:
            (lc, rc), (lb, rb) = dimension_numbers
            # operator.index: 1.7 or "1" is an error, as in lax, never truncated.
            lc, rc, lb, rb = (
                tuple(operator.index(a) for a in axes) for axes in (lc, rc, lb, rb)
            )
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                "dot_general",
                "dimension_numbers",
                dimension_numbers,
                "((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), "
                "each a sequence of ints",
            ) from None

        def norm(axes: Axes, ndim: int) -> Axes:
            if any(not -ndim <= a < ndim for a in axes):
                raise InvalidArgumentError(
                    "dot_general",
                    "dimension_numbers",
                    dimension_numbers,
                    f"axes within the operand ranks ({lhs_ndim}, {rhs_ndim})",
                )
            return tuple(a % ndim for a in axes)

        return cls(
            norm(lc, lhs_ndim),
            norm(rc, rhs_ndim),
            norm(lb, lhs_ndim),
            norm(rb, rhs_ndim),
            lhs_ndim,
            rhs_ndim,
        )

    @property
    def lhs_free(self) -> Axes:
        """Lhs axes that are neither contracted nor batch, ascending."""
        return _remaining(self.lhs_ndim, self.lhs_contract, self.lhs_batch)

    @property
    def rhs_free(self) -> Axes:
        """Rhs axes that are neither contracted nor batch, ascending."""
        return _remaining(self.rhs_ndim, self.rhs_contract, self.rhs_batch)

    @property
    def out_ndim(self) -> int:
        """Rank of the output."""
        return len(self.lhs_batch) + len(self.lhs_free) + len(self.rhs_free)

    def lax(self) -> tuple[tuple[Axes, Axes], tuple[Axes, Axes]]:
        """The ``dimension_numbers`` tuple for ``lax.dot_general``."""
        return (
            (self.lhs_contract, self.rhs_contract),
            (self.lhs_batch, self.rhs_batch),
        )

    def swap_perm(self) -> Axes:
        """The output permutation that exchanging the operands performs.

        ``dot_general(rhs, lhs, swapped())`` equals
        ``transpose(dot_general(lhs, rhs), swap_perm())``.
        """
        nb, nl, nr = len(self.lhs_batch), len(self.lhs_free), len(self.rhs_free)
        return (
            tuple(range(nb))
            + tuple(range(nb + nl, nb + nl + nr))
            + tuple(range(nb, nb + nl))
        )

    def moved(
        self, lhs_order: Axes | None = None, rhs_order: Axes | None = None
    ) -> Dims:
        """The dimension numbers after transposing the operands by these orders."""

        def renumber(axes: Axes, order: Axes | None) -> Axes:
            if order is None:
                return axes
            position = {axis: i for i, axis in enumerate(order)}
            return tuple(position[a] for a in axes)

        return Dims(
            renumber(self.lhs_contract, lhs_order),
            renumber(self.rhs_contract, rhs_order),
            renumber(self.lhs_batch, lhs_order),
            renumber(self.rhs_batch, rhs_order),
            self.lhs_ndim,
            self.rhs_ndim,
        )

    def swapped(self) -> Dims:
        """The same contraction with the operands exchanged."""
        return Dims(
            self.rhs_contract,
            self.lhs_contract,
            self.rhs_batch,
            self.lhs_batch,
            self.rhs_ndim,
            self.lhs_ndim,
        )

    def grad_lhs(self) -> tuple[Dims, Axes]:
        """The gradient matmul for the lhs, exactly as JAX transposes it.

        Returns ``(dims, perm)``: ``transpose(dot_general(g, rhs, dims), perm)``
        is the cotangent of the lhs (JAX's ``_dot_general_transpose_lhs``).
        """
        return self._transpose(swap_ans=False)

    def grad_rhs(self) -> tuple[Dims, Axes]:
        """The gradient matmul for the rhs, exactly as JAX transposes it.

        Returns ``(dims, perm)``: ``transpose(dot_general(g, lhs, dims), perm)``
        is the cotangent of the rhs (JAX's ``_dot_general_transpose_rhs``).
        """
        return self.swapped()._transpose(swap_ans=True)

    def _transpose(self, *, swap_ans: bool) -> tuple[Dims, Axes]:
        # x is the operand whose cotangent we want, y the other one.
        x_contract, y_contract = self.lhs_contract, self.rhs_contract
        x_batch, y_batch = self.lhs_batch, self.rhs_batch
        x_kept, y_kept = self.lhs_free, self.rhs_free
        nb = len(x_batch)
        ans_batch = tuple(range(nb))
        if swap_ans:
            ans_y = tuple(range(nb, nb + len(y_kept)))
        else:
            ans_y = tuple(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
        g_ndim = nb + len(x_kept) + len(y_kept)
        dims = Dims(ans_y, y_kept, ans_batch, y_batch, g_ndim, self.rhs_ndim)
        order = np.argsort(y_contract)
        x_contract_sorted_by_y = tuple(x_contract[int(i)] for i in order)
        unsorted = x_batch + x_kept + x_contract_sorted_by_y
        perm = tuple(int(a) for a in np.argsort(unsorted))
        return dims, perm
