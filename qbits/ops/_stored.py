"""Stored weights: a weight quantized once, and the matmul that reads it.

:func:`store_weight` quantizes a weight as a config's forward matmul would
(its storage dtype, 4-bit values packed); :func:`stored_matmul` runs the
forward matmul on it (serving), through the same :func:`contract` as
training.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from qbits._context import Context
from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits._tensor import PACKABLE_DTYPES, QTensor
from qbits.ops._config import MatmulConfig
from qbits.ops._dims import Axes, Dims
from qbits.ops._matmul import contract, result_dtype, stored_rhs

Grad = jax.tree_util.Partial


def quantize_operand(
    quantizer: Quantizer,
    x: jax.Array,
    contracting: Axes,
    key: jax.Array | None,
    *,
    store: bool,
    scale: jax.Array | None = None,
) -> tuple[QTensor, Grad]:
    """``quantizer.quant_vjp`` of a matmul operand, stored where it can be.

    Quantizes as the matmuls of :func:`qbits.dot_general` do (and a served
    weight is stored): scales shared along ``contracting`` by default.
    ``scale`` is the given scale of a quantizer with a scale provider.

    Returns:
      ``(qtensor, grad)`` as :meth:`qbits.Quantizer.quant_vjp`.

    Example:
      >>> q = qbits.Quantizer(qbits.IntNumerics(bits=8))
      >>> qt, _ = qbits.ops._stored.quantize_operand(q, jnp.ones((4, 8)), (1,), None,
      ...                                    store=True)
      >>> qt.qvalue.dtype
      dtype('int8')
    """
    store = store and quantizer.numerics.get_dtype() is not None
    return quantizer.quant_vjp(
        x, Context(key), store=store, contracting_axes=contracting, scale=scale
    )


def store_weight(weight: jax.Array, cfg: MatmulConfig, contracting: Any) -> QTensor:
    """The stored form of a weight, as the forward matmul quantizes it.

    Exactly what the forward matmul does to its float rhs in real mode
    (``cfg.rhs`` along the contracting axes), in the storage dtype; 4-bit
    values are packed two per byte along the last axis. What
    :func:`stored_matmul` takes as its ``rhs``.

    Args:
      weight: The float weight, in the dtype and layout the matmul sees it.
      cfg: The matmul's forward config.
      contracting: The weight axes the matmul contracts.

    Returns:
      A :class:`~qbits.QTensor` in the storage dtype.

    Example:
      >>> cfg = qbits.presets.get("w4a8").fwd
      >>> qt = qbits.ops._store_weight(jnp.ones((8, 3)), cfg, (0,))
      >>> qt.qvalue.dtype, qt.qvalue.shape, qt.shape
      (dtype('uint8'), (8, 2), (8, 3))
    """
    return _store(weight, cfg, tuple(int(a) for a in contracting))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _store(weight: jax.Array, cfg: MatmulConfig, contracting: tuple[int, ...]):
    qt, _ = quantize_operand(cfg.rhs, weight, contracting, None, store=True)
    if np.dtype(qt.qvalue.dtype) in PACKABLE_DTYPES:
        qt = qt.pack(axis=-1)
    return qt


def stored_matmul(
    lhs: jax.Array,
    rhs: QTensor,
    dims: Dims,
    cfg: MatmulConfig,
    key: jax.Array | None = None,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
    """The forward matmul against a stored rhs (a served weight).

    ``lhs`` is quantized as ``cfg.lhs`` says; ``rhs`` was quantized for this
    matmul (its scale is shared along the contracting axes, or tiled), as
    :func:`quantize_operand` stores it. Forward only (serving).

    Raises:
      InvalidArgumentError: For an ``rhs`` whose scale does not factor out.

    Example:
      >>> q = qbits.Quantizer(qbits.IntNumerics(bits=8))
      >>> cfg = qbits.MatmulConfig(lhs=q, rhs=q)
      >>> w, _ = qbits.ops._stored.quantize_operand(q, jnp.ones((8, 3)), (0,), None,
      ...                                   store=True)
      >>> dims = qbits.ops.Dims.create((((1,), (0,)), ((), ())), 2, 2)
      >>> qbits.ops._stored_matmul(jnp.ones((2, 8)), w, dims, cfg).shape
      (2, 3)
    """
    if not stored_rhs(rhs, dims):
        raise InvalidArgumentError(
            "matmul",
            "rhs.scale",
            rhs.scale.shape,
            "a scale shared along the contracting axes, or tiled along one",
        )
    lq, _ = quantize_operand(
        cfg.lhs, lhs, dims.lhs_contract, key, store=cfg.mode == "real"
    )
    return contract(
        lq,
        rhs,
        dims,
        cfg,
        result_dtype(lhs, rhs, dims, preferred_element_type),
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )
