"""Serving Flax nnx models from stored low-precision weights.

:func:`convert_nnx` makes a serving copy of an nnx model: it first quantizes
it as :func:`qbits.nnx.quantize` does (forward matmuls only), then every
``nnx.Linear`` / ``nnx.LinearGeneral`` whose forward config quantizes the
weight gets a :class:`ServedDotGeneral` holding the stored ``qvalue`` and
``scale`` (:class:`StoredWeight` variables), and its ``kernel`` becomes an
empty :class:`KernelPlaceholder` (zero bytes; its dtype keeps flax's dtype
promotion of the layer unchanged). Flax's own ``__call__`` of the layer
runs; its matmul is the training forward's, on the stored QTensor.
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import InvalidArgumentError
from qbits.config import as_quant_config
from qbits.nnx import QuantizedDotGeneral, layer_table
from qbits.nnx import quantize as qat_quantize
from qbits.ops import Dims, MatmulConfig, store_weight, stored_matmul
from qbits.serving._layout import (
    LayerInfo,
    check_servable,
    check_stored,
    fingerprint,
    forward_only,
    stored_qtensor,
    stores_weight,
)

__all__ = ["KernelPlaceholder", "ServedDotGeneral", "StoredWeight", "convert_nnx"]


class StoredWeight(nnx.Variable):
    """An nnx Variable holding a stored weight (``qvalue``) or its ``scale``.

    Not an ``nnx.Param``: optimizers and ``nnx.grad`` leave it alone.

    Example:
      >>> import flax.nnx as nnx
      >>> served = qbits.serving.convert(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), "fp8")
      >>> state = nnx.state(served, qbits.serving.StoredWeight)
      >>> sorted(str(a.dtype) for a in jax.tree.leaves(state))
      ['float32', 'float8_e4m3fn']
    """


class KernelPlaceholder(nnx.Variable):
    """The empty stand-in for a served layer's float kernel (shape ``(0,)``).

    Its dtype is the float kernel's, so that the layer promotes its inputs
    as in training; it holds no values and is not saved in checkpoints.

    Example:
      >>> import flax.nnx as nnx
      >>> served = qbits.serving.convert(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), "fp8")
      >>> isinstance(served.kernel, qbits.serving.KernelPlaceholder)
      True
    """


class ServedDotGeneral(nnx.Module):
    """A layer's matmul on its stored weight; ignores the (empty) kernel.

    Made by :func:`qbits.serving.convert`; it sits in the layer's
    ``dot_general`` attribute and is called as ``lax.dot_general`` is.

    Attributes:
      qvalue: The stored values (int8, int4 packed in uint8, fp8, ...).
      scale: Their scales (float32).
      info: The layout (:class:`~qbits.serving.LayerInfo`).
      config: The layer's forward matmul config.

    Example:
      >>> import flax.nnx as nnx
      >>> layer = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
      >>> served = qbits.serving.convert(layer, "int8_fwd")
      >>> served.dot_general.qvalue[...].dtype, served.kernel[...].shape
      (dtype('int8'), (0,))
    """

    def __init__(self, info: LayerInfo, qvalue: jax.Array, scale: jax.Array, cfg):
        self.info = info
        self.config = cfg
        self.qvalue = StoredWeight(qvalue)
        self.scale = StoredWeight(scale)

    def __call__(
        self,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        *,
        out_sharding: Any = None,
    ) -> jax.Array:
        """``lax.dot_general(lhs, stored weight, ...)`` as the QAT forward does."""
        owner = "qbits.serving.ServedDotGeneral"
        info = self.info
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        if rhs.shape != (0,):
            raise InvalidArgumentError(
                owner,
                "kernel",
                f"a float kernel {rhs.dtype.name}{list(rhs.shape)}",
                "the empty placeholder of a converted layer (shape (0,))",
                why=f"layer {info.path!r} serves a stored {info.qdtype} weight: "
                "the serving model was given float params; run "
                "qbits.serving.convert(model, config) instead",
            )
        qvalue, scale = self.qvalue[...], self.scale[...]
        check_stored(owner, info, qvalue, scale)
        qt = stored_qtensor(info, qvalue, scale).replace(dtype=np.dtype(rhs.dtype))
        dims = Dims.create(dimension_numbers, lhs.ndim, len(info.shape))
        if isinstance(precision, list):
            precision = tuple(precision)
        out = stored_matmul(
            lhs,
            qt,
            dims,
            self.config,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )
        return out


def _contracting(module: nnx.Module) -> tuple[int, ...]:
    """The kernel axes a Linear / LinearGeneral contracts."""
    if isinstance(module, nnx.Linear):
        return (0,)
    n_batch, n_axis = len(module.batch_axis), len(module.axis)
    return tuple(range(n_batch, n_batch + n_axis))


def convert_nnx(model: nnx.Module, config: Any) -> nnx.Module:
    """The serving copy of an nnx model: see :func:`qbits.serving.convert`."""
    owner = "qbits.serving.convert"
    original = as_quant_config(owner, config)
    fwd = forward_only(original)
    table = layer_table(model, fwd)
    for row in table.rows:
        res = row.resolution
        linear = row.kind in ("Linear", "LinearGeneral") and not row.explicit
        if linear and stores_weight(res.config):
            check_servable(owner, row.path, res.config.fwd, res.where)
    served = qat_quantize(model, fwd)
    for parts, module in nnx.iter_modules(served):
        if not isinstance(module, nnx.Linear | nnx.LinearGeneral):
            continue
        op = module.dot_general
        if not isinstance(op, QuantizedDotGeneral) or not stores_weight(op.config):
            continue
        path = "/".join(str(p) for p in parts)
        cfg: MatmulConfig = op.config.fwd
        kernel = module.kernel[...]
        dtype = np.dtype(kernel.dtype)
        quantized = (
            kernel if module.dtype is None else jnp.asarray(kernel, module.dtype)
        )
        contracting = _contracting(module)
        qt = store_weight(quantized, cfg, contracting)
        info = LayerInfo(
            path=path,
            kind=type(module).__name__,
            shape=tuple(int(n) for n in kernel.shape),
            dtype=dtype.name,
            contracting=contracting,
            qdtype=np.dtype(cfg.rhs.numerics.get_dtype()).name,
            packed=qt.packed_axis is not None,
            config=fingerprint(cfg),
            name=original.resolve(path).name or "",
        )
        module.dot_general = nnx.data(ServedDotGeneral(info, qt.qvalue, qt.scale, cfg))
        module.kernel = KernelPlaceholder(jnp.zeros((0,), dtype))
    return served


def served_layers(model: nnx.Module) -> list[tuple[LayerInfo, Any, Any]]:
    """``(info, qvalue, scale)`` of every served layer of an nnx model."""
    found = []
    for _, module in nnx.iter_modules(model):
        if isinstance(module, ServedDotGeneral):
            qvalue, scale = module.qvalue.get_raw_value(), module.scale.get_raw_value()
            found.append((module.info, qvalue, scale))
    return found
