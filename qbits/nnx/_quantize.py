"""Rule-based quantization of an unmodified Flax nnx model.

:func:`quantize` walks the nnx graph of a model (no sample input, no forward
pass), gives every quantizable matmul a path, resolves its config from a
:class:`~qbits.config.QuantConfig`, and returns a *copy* of the model in
which every matched layer computes with a quantized function:

============================  ===========================  =====================
layer                         attribute replaced           with
============================  ===========================  =====================
``nnx.Linear``                ``dot_general``              QuantizedDotGeneral
``nnx.LinearGeneral``         ``dot_general``              QuantizedDotGeneral
``nnx.Einsum``                ``einsum_op``                QuantizedEinsum
``nnx.Conv``                  ``conv_general_dilated``     QuantizedConv
``nnx.MultiHeadAttention``    ``attention_fn``             QuantizedAttention
============================  ===========================  =====================

A layer's path is its nnx graph path joined by ``/`` (``"blocks/0/attn/query"``).
The query, key, value and output projections of a ``MultiHeadAttention`` at
``P`` are its ``LinearGeneral`` children ``P/query`` ... ``P/out``; its two
attention einsums get the paths ``P/qk`` (``q . k``) and ``P/pv`` (weights
times values). A layer whose function the model set itself (anything but
Flax's default: an explicit ``dot_general=qbits.dot_general(...)``, a custom
``attention_fn``) keeps it; its row in the table says ``explicit``.

Nothing is patched globally: each quantized layer holds its own function, an
nnx Module (see :mod:`qbits.nnx._layers`), so the float model and the quantized
copy have different graph definitions and never share a ``jit`` cache entry.

The copy is made with ``nnx.clone``: it has its own ``Variable`` objects,
which start out holding the original's (immutable) parameter arrays, so no
memory is copied, and training either model leaves the other unchanged.

Layers whose config rounds stochastically (the ``int8`` preset) draw a fresh
PRNG key on every call from an ``nnx.RngStream`` forked, one per layer, from
the ``rngs`` given to :func:`quantize`. The stream's key and counter are nnx
``RngState`` Variables, not ``nnx.Param`` s: ``nnx.Optimizer(...,
wrt=nnx.Param)`` and ``nnx.grad`` leave them alone, and ``nnx.jit`` carries
the advanced counter out of each step. In a pure ``nnx.split`` /
``nnx.merge`` style, return the new state to keep the keys advancing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.nnx as nnx
import jax.numpy as jnp
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits.config import LayerRow, LayerTable, QuantConfig, as_quant_config
from qbits.nnx._attention import QuantizedAttention
from qbits.nnx._layers import (
    STREAM,
    QuantizedConv,
    QuantizedDotGeneral,
    QuantizedEinsum,
    has_stream,
)

__all__ = ["layer_table", "quantize"]

_OWNER = "qbits.nnx.quantize"


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One quantizable matmul of a model: where it is and what computes it."""

    path: str
    kind: str
    module: nnx.Module
    explicit: bool


def _sort_key(path: tuple[Any, ...]) -> tuple[tuple[int, Any], ...]:
    """Orders paths depth first, list indices numerically."""
    return tuple((0, p) if isinstance(p, int) else (1, str(p)) for p in path)


def _layers(model: nnx.Module) -> list[_Layer]:
    """The quantizable matmuls of ``model``, in graph order (shared ones once).

    Modules come depth first, their attributes by name, list items by index;
    the two einsums of an attention come after its projections.
    """
    found: list[tuple[tuple[Any, ...], _Layer]] = []
    for parts, module in nnx.iter_modules(model):
        path = "/".join(str(p) for p in parts)
        order = _sort_key(parts)
        if isinstance(module, nnx.Linear):
            explicit = module.dot_general is not lax.dot_general
            found.append((order, _Layer(path, "Linear", module, explicit)))
        elif isinstance(module, nnx.LinearGeneral):
            explicit = (
                module.dot_general is not None or module.dot_general_cls is not None
            )
            found.append((order, _Layer(path, "LinearGeneral", module, explicit)))
        elif isinstance(module, nnx.Einsum):
            explicit = module.einsum_op is not jnp.einsum
            found.append((order, _Layer(path, "Einsum", module, explicit)))
        elif isinstance(module, nnx.Conv):
            explicit = module.conv_general_dilated is not lax.conv_general_dilated
            found.append((order, _Layer(path, "Conv", module, explicit)))
        elif isinstance(module, nnx.MultiHeadAttention):
            explicit = module.attention_fn is not nnx.dot_product_attention
            prefix = f"{path}/" if path else ""
            for i, name in enumerate(("qk", "pv")):
                kind = f"MultiHeadAttention.{name}"
                layer = _Layer(prefix + name, kind, module, explicit)
                found.append(((*order, (2, i)), layer))
    return [layer for _, layer in sorted(found, key=lambda item: item[0])]


def _check_model(model: Any) -> None:
    if not isinstance(model, nnx.Module):
        raise InvalidArgumentError(_OWNER, "model", model, "a flax.nnx.Module")


def _table(model: nnx.Module, config: QuantConfig) -> tuple[LayerTable, list[_Layer]]:
    layers = _layers(model)
    table = config.table(
        [
            (layer.path, layer.kind + "".join(f", stacked x{n}" for n in _stack(layer)))
            for layer in layers
        ],
        explicit=[layer.path for layer in layers if layer.explicit],
    )
    return table, layers


def layer_table(model: nnx.Module, config: Any) -> LayerTable:
    """Which config each quantizable matmul of ``model`` gets from ``config``.

    Needs no inputs: the layers are found in the model's nnx graph. A
    layer's path is its graph path joined by ``/`` (``"blocks/0/mlp/fc1"``);
    its kind is the Flax class (``"Linear"``, ``"LinearGeneral"``,
    ``"Einsum"``, ``"Conv"``). The two attention einsums of an
    ``nnx.MultiHeadAttention`` at ``P`` are ``P/qk`` and ``P/pv``, of kinds
    ``"MultiHeadAttention.qk"`` and ``"MultiHeadAttention.pv"``; its
    projections are its ``LinearGeneral`` children ``P/query`` ... ``P/out``.
    Layers stacked by ``nnx.vmap`` (blocks run by ``nnx.scan``) are listed
    once, their kind saying how many: ``"Linear, stacked x12"``.

    Args:
      model: A ``flax.nnx.Module``.
      config: A :class:`~qbits.config.QuantConfig`, or one
        :class:`~qbits.DotGeneralConfig` or preset name for every layer.

    Returns:
      A :class:`~qbits.config.LayerTable`: one row per matmul, in graph
      order, and the rules that matched no layer.

    Raises:
      InvalidArgumentError: For a model that is not an nnx Module or a config
        of another type.

    Example:
      >>> import flax.nnx as nnx
      >>> import qbits.nnx
      >>> from qbits.config import QuantConfig, Rule
      >>> model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)),
      ...                        nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
      >>> config = QuantConfig(rules=(Rule("layers/1", None),), default="int8_fwd")
      >>> for row in qbits.nnx.layer_table(model, config).rows:
      ...     print(row.path, row.kind, row.describe())
      layers/0 Linear int8_fwd
      layers/1 Linear float
    """
    _check_model(model)
    return _table(model, as_quant_config(_OWNER, config))[0]


def quantize(
    model: nnx.Module,
    config: Any,
    *,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
) -> nnx.Module:
    """A copy of ``model`` whose matched matmuls run quantized.

    Every ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``
    and the two attention einsums of every ``nnx.MultiHeadAttention`` whose
    path resolves to a config (see :func:`layer_table`) computes with that
    config; the others, and layers with a function of their own, are left as
    they are. ``model`` itself is not changed. No input and no forward pass
    is needed, and nothing is patched globally.

    Args:
      model: A ``flax.nnx.Module``.
      config: A :class:`~qbits.config.QuantConfig`, or one
        :class:`~qbits.DotGeneralConfig` or preset name for every layer.
      rngs: Keys for stochastic rounding, needed when some layer's config
        rounds stochastically (the ``int8`` preset): an ``nnx.Rngs`` with a
        ``quant`` (or ``default``) stream, or an ``nnx.RngStream``. Each such
        layer forks its own stream from it (advancing it), with a
        :func:`qbits.numerics.hash_key` (no threefry loop per layer in the
        compiled step), and draws a new key on every call. The same seed
        gives the same keys.

    Returns:
      The quantized copy: new ``Variable`` objects holding the original's
      parameter arrays (shared until either model is updated).

    Raises:
      InvalidArgumentError: For a model or config of another type, or when
        some layer needs keys and ``rngs`` is missing or has no stream for
        them (the message names the layers).
      ConfigError: At a layer's first call, when its config does not fit its
        operands (e.g. ``rules[0].config.fwd.rhs.granularity.tile_size``).

    Warns:
      UnusedRuleWarning: When a rule matches no layer.

    Example:
      >>> import flax.nnx as nnx
      >>> import qbits.nnx
      >>> from qbits.config import QuantConfig, Rule
      >>> model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.relu,
      ...                        nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
      >>> config = QuantConfig(rules=(Rule("layers/2", None),), default="int8")
      >>> qmodel = qbits.nnx.quantize(model, config, rngs=nnx.Rngs(quant=0))
      >>> x = jnp.ones((2, 8))
      >>> graphdef, state = nnx.split(qmodel)
      >>> qbits.ops.jaxpr_dot_dtypes(lambda s: nnx.merge(graphdef, s)(x), state)
      [('int8', 'int8', 'int32'), ('float32', 'float32', 'float32')]
      >>> model.layers[0].dot_general is jax.lax.dot_general  # unchanged
      True
    """
    _check_model(model)
    config = as_quant_config(_OWNER, config)
    if rngs is not None and not isinstance(rngs, nnx.Rngs | nnx.RngStream):
        raise InvalidArgumentError(
            _OWNER,
            "rngs",
            rngs,
            f"None, an nnx.Rngs (e.g. nnx.Rngs({STREAM}=0)) or an nnx.RngStream",
        )
    new = nnx.clone(model)
    table, layers = _table(new, config)
    active = [
        (layer, row)
        for layer, row in zip(layers, table.rows, strict=True)
        if not row.explicit and row.resolution.config is not None
    ]
    keyed = [row for _, row in active if row.resolution.config.needs_key]
    if keyed and not has_stream(rngs):
        _missing_rngs(rngs, keyed)
    _inject(active, rngs)
    table.warn_unused()
    return new


def _missing_rngs(rngs: Any, keyed: list[LayerRow]) -> None:
    """Raises: ``rngs`` cannot give keys to the layers that need them."""
    listed = ", ".join(f"{row.path} ({row.resolution.where})" for row in keyed[:5])
    if len(keyed) > 5:
        listed += f" and {len(keyed) - 5} more"
    shown = rngs if rngs is None else f"an {type(rngs).__name__} without that stream"
    raise InvalidArgumentError(
        _OWNER,
        "rngs",
        shown,
        f"an nnx.Rngs with a {STREAM!r} (or 'default') stream, e.g. "
        f"rngs=nnx.Rngs({STREAM}=0)",
        why=f"these layers round stochastically and need PRNG keys: {listed}",
    )


def _stack(layer: _Layer) -> tuple[int, ...]:
    """The leading axes a layer's kernel has beyond its own (``nnx.vmap``).

    Layers created under ``nnx.vmap`` (blocks stacked for ``nnx.scan``) hold
    their parameters with a leading axis per stacked layer; the quantized
    function they get holds its key stream and scale state stacked alike.
    """
    module = layer.module
    if layer.kind == "Linear":
        own, kernel = 2, module.kernel
    elif layer.kind == "LinearGeneral":
        own = len(module.in_features) + len(module.out_features)
        own += len(module.batch_axis)
        kernel = module.kernel
    elif layer.kind == "Einsum":
        own, kernel = len(module.kernel_shape), module.kernel
    elif layer.kind == "Conv":
        own, kernel = len(module.kernel_size) + 2, module.kernel
    else:  # an attention einsum: stacked as the attention's query projection
        query = module.query
        own = len(query.in_features) + len(query.out_features)
        kernel = query.kernel
    shape = tuple(kernel.get_value().shape)
    return shape[: max(len(shape) - own, 0)]


def _inject(active: list[tuple[_Layer, LayerRow]], rngs: Any) -> None:
    """Gives each matched layer its quantized function."""
    attention: dict[int, dict[str, QuantizedEinsum]] = {}
    modules: dict[int, nnx.Module] = {}
    for layer, row in active:
        res = row.resolution
        kwargs = {
            "rngs": rngs,
            "where": res.where,
            "layer": row.path,
            "stack": _stack(layer),
        }
        module = layer.module
        if layer.kind in ("Linear", "LinearGeneral"):
            module.dot_general = nnx.data(QuantizedDotGeneral(res.config, **kwargs))
        elif layer.kind == "Einsum":
            module.einsum_op = nnx.data(QuantizedEinsum(res.config, **kwargs))
        elif layer.kind == "Conv":
            op = QuantizedConv(res.config, **kwargs)
            module.conv_general_dilated = nnx.data(op)
        else:
            name = layer.kind.rsplit(".", 1)[1]
            attention.setdefault(id(module), {})[name] = QuantizedEinsum(
                res.config, **kwargs
            )
            modules[id(module)] = module
    for key, ops in attention.items():
        modules[key].attention_fn = nnx.data(QuantizedAttention(**ops))
