"""Swapping a ``dot_general``'s operands: the weight on the rhs.

A weight matmul whose weight is the lhs operand (``w @ x``, an einsum that
JAX hands its operands in the other order) runs as ``x . w`` so that the
weight gets a config's rhs side; its output is transposed back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["permuted_sharding", "swapped", "swapped_call"]


def swapped(lhs: Any, rhs: Any, dn: Any, precision: Any) -> tuple:
    """``rhs . lhs`` for ``lhs . rhs``: swapped operands and dimension numbers.

    Returns the new operands, dimension numbers and precision, and the
    permutation that the swapped product's axes are of the original output's
    (batch axes, then rhs free axes, then lhs free axes).
    """
    (lc, rc), (lb, rb) = dn
    nb = len(lb)
    nl = jnp.ndim(lhs) - len(lc) - nb
    nr = jnp.ndim(rhs) - len(rc) - nb
    if isinstance(precision, tuple):
        precision = precision[::-1]
    # swapped output axis k holds original output axis perm[k]
    perm = [*range(nb), *range(nb + nl, nb + nl + nr), *range(nb, nb + nl)]
    return rhs, lhs, ((rc, lc), (rb, lb)), precision, perm


def permuted_sharding(sharding: Any, perm: list[int]) -> Any:
    """An output sharding for the swapped product (``None`` stays ``None``)."""
    if sharding is None:
        return None
    spec = getattr(sharding, "spec", sharding)
    entries = list(spec) + [None] * (len(perm) - len(spec))
    new = jax.sharding.PartitionSpec(*(entries[i] for i in perm))
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, new)
    return new


def swapped_call(call: Any) -> tuple[Any, list[int]]:
    """A ``dot_general`` call (an op kind's ``call``) with its operands swapped.

    Returns the call of ``rhs . lhs`` and the permutation of :func:`swapped`.
    """
    lhs, rhs, dn, precision, pet = call.args
    lhs, rhs, dn, precision, perm = swapped(lhs, rhs, dn, precision)
    kwargs = dict(call.kwargs)
    if "out_sharding" in kwargs:
        kwargs["out_sharding"] = permuted_sharding(kwargs["out_sharding"], perm)
    return type(call)((lhs, rhs, dn, precision, pet), kwargs), perm
