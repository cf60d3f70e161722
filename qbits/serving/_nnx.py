"""Serving Flax nnx models from stored low-precision weights.

An nnx model is served as its ``__call__`` over its state is
(:func:`qbits.nnx.as_function`): :func:`~qbits.serving._params.store` stores
the weight of every matmul whose forward config quantizes it (``Linear``,
``Einsum``, attention, custom layers alike), and the serving copy
holds them as :class:`~qbits.nnx.StoredWeight` Variables (values and
scales; zero points and NVFP4's tensor scale where the format has them),
with an empty placeholder Variable (shape ``(0,)``) in place of each float
weight they replace.
Its output equals the quantized copy's (``qbits.nnx.quantize(model,
config)``) bit for bit.
"""

from __future__ import annotations

from typing import Any

import flax.nnx as nnx

from qbits import nnx as qnnx
from qbits.config import QuantConfig
from qbits.serving._layout import LayerInfo, forward_only
from qbits.serving._params import store

__all__ = ["convert_nnx", "served_layers"]


def convert_nnx(
    owner: str,
    model: nnx.Module,
    config: QuantConfig,
    args: Any,
    kwargs: Any,
    given: Any = None,
) -> nnx.Module:
    """The serving copy of an nnx model: see :func:`qbits.serving.convert`.

    ``given``: stored weights to keep (see :func:`~qbits.serving._params.store`).
    """
    fn, state = qnnx.as_function(model)
    stored, fills, layers = store(owner, fn, config, state, args, kwargs, given)
    served = qnnx._serving_copy(model, forward_only(config), stored, fills)
    served.qbits.info = tuple(layers)
    return served


def served_layers(model: nnx.Module) -> list[tuple[LayerInfo, dict[str, Any]]]:
    """``(info, arrays)`` of every stored weight of a serving copy.

    ``arrays``: ``{"qvalue": ..., "scale": ...}``, with ``"zero_point"``,
    ``"tensor_scale"``, ``"scale_absmax"`` and ``"scale_offset"`` where the
    format has them.
    """
    node = getattr(model, "qbits", None)
    infos = getattr(node, "info", ()) if node is not None else ()
    return [
        (info, {k: v.get_raw_value() for k, v in node.stored[info.path].items()})
        for info in infos
    ]
