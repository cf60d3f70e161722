"""Blocked tensors, the numerics' gradient on them, and storing quantized values."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._formats import compute_dtype
from qbits._granularity import BlockLayout
from qbits._tensor import storage_dtype
from qbits.numerics import QNumerics

__all__ = ["Blocked", "NumericsGrad", "blocked", "encode", "to_storage"]


class Blocked(NamedTuple):
    """A request's tensor in its scale blocks (see :func:`blocked`)."""

    layout: BlockLayout
    #: The tensor reshaped to its blocked shape, in its compute dtype.
    xb: jax.Array
    #: ``xb`` without gradient: what calibrations read.
    xs: jax.Array
    #: What to apply to values computed from ``xb`` that must carry no
    #: gradient (``lax.stop_gradient``, or the identity when the caller
    #: differentiates through its own VJP).
    no_grad: Callable[[jax.Array], jax.Array]


def blocked(request: Any, vjp: bool) -> Blocked | None:
    """A request's tensor in its scale blocks; ``None`` for a placeholder."""
    x = request.x
    if isinstance(x, jax.ShapeDtypeStruct):
        return None
    blocks = request.quantizer.granularity.block_sizes(
        x.shape, request.contracting_axes
    )
    layout = BlockLayout.create(x.shape, blocks)
    xb = x.astype(compute_dtype(x.dtype)).reshape(layout.blocked_shape)
    no_grad = (lambda v: v) if vjp else lax.stop_gradient
    return Blocked(layout, xb, no_grad(xb), no_grad)


def encode(
    numerics: QNumerics, y: jax.Array, context: Any, layout: BlockLayout, vjp: bool
) -> tuple[jax.Array, jax.tree_util.Partial | None]:
    """The codes of the scaled blocks ``y``, and their gradient with ``vjp``."""
    if not vjp:
        return numerics(y, context), None
    codes, residuals = numerics.vjp_fwd(y, context)
    return codes, jax.tree_util.Partial(
        NumericsGrad(numerics, layout.blocked_shape), residuals
    )


@dataclasses.dataclass(frozen=True)
class NumericsGrad:
    """The numerics' gradient on a blocked tensor (a value, not an identity).

    Equal for equal numerics and shapes, so that the pytree structure of a
    quantization's gradient is the same each time it is computed.
    """

    numerics: QNumerics
    blocked_shape: tuple[int, ...]

    def __call__(self, residuals: Any, g: jax.Array) -> jax.Array:
        dx, _ = self.numerics.vjp_bwd(residuals, g.reshape(self.blocked_shape))
        return dx.reshape(g.shape)


def to_storage(
    q: jax.Array,
    qdtype: np.dtype,
    *,
    saturate: bool,
    guard: bool,
    codes: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """Casts grid values to their storage dtype.

    Integers saturate at the dtype's range unless the numerics already clip.
    A NaN element always lies in a block whose scale is NaN (see
    :mod:`qbits._calibration`), so its integer code does not matter.
    ``codes`` turns grid values into the codes stored (a codebook's indices).
    With ``guard``, differentiating through the stored values raises.
    """
    target = storage_dtype(qdtype)
    if guard:
        q = _no_grad(q, target)
    if codes is not None:
        q = codes(q)
    if saturate and jnp.issubdtype(target, jnp.integer):
        info = ml_dtypes.iinfo(target)
        lo, hi = (np.asarray(v, q.dtype) for v in (info.min, info.max))
        q = lax.clamp(lo, q, hi)
    return q.astype(target)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _no_grad(q: jax.Array, target: np.dtype) -> jax.Array:
    """``q``, refusing to be differentiated: it is about to be stored."""
    return q


@_no_grad.defjvp
def _no_grad_jvp(target: np.dtype, primals: Any, tangents: Any) -> Any:
    raise InvalidArgumentError(
        "Quantizer.quant",
        "store",
        True,
        "False when differentiating",
        why=f"values stored as {np.dtype(target)} carry no gradient; "
        "quant(x).dequant() with the default store=False has the numerics' "
        "gradient",
    )
