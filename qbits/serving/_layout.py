"""What a served layer stores, and how its weights are quantized once.

A served layer keeps its weight as the QTensor the training (QAT) forward
pass would compute from the float weight at every step: the same quantizer
(the layer's ``fwd.rhs``), the same contracting axes, the same float dtype
(after the layer's own dtype promotion). 4-bit values are packed two per
byte along the weight's last axis (an output-feature axis: unpacking it
needs no transpose). :class:`LayerInfo` records all of that, and the
layer's forward config, as static metadata next to the arrays.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import ConfigError, InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits._tensor import QTensor, decode_scale, storage_dtype
from qbits.config import QuantConfig, Rule, _to_dict, presets
from qbits.ops import DotGeneralConfig, MatmulConfig

__all__ = [
    "LayerInfo",
    "check_layers",
    "check_stored",
    "fingerprint",
    "forward_only",
]


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One served layer: where it is and how its weight is stored.

    Attributes:
      path: The matmul's path (``"block_0/mlp/fc1"``, as in
        :func:`qbits.layer_table`).
      kind: The matmul's kind (``"dot_general (activation x weight)"``,
        ``"einsum (...)"``), as in :func:`qbits.layer_table`.
      shape: Shape of the weight as the matmul sees it (after the model's
        own reshapes and transposes), scanned layers stacked first.
      dtype: Its float dtype as the matmul sees it.
      contracting: The weight axes the matmul contracts (of one layer).
      qdtype: The stored format (``int8``, ``int4``, ``float8_e4m3fn``).
      packed: Whether 4-bit values are packed two per byte (last axis).
      config: The layer's forward matmul config, as canonical JSON.
      name: The preset the config came from, or ``""``.
      param: The float parameter the stored weight replaces, as its key
        path in the parameters (``jax.tree_util.keystr``:
        ``"['params']['block_0']['mlp']['fc1']['kernel']"``), or ``""``
        where the float parameter is kept (something else reads it too,
        e.g. the lookup of a tied embedding).
      param_shape: That parameter's shape.
      param_dtype: That parameter's dtype.

    Example:
      >>> import flax.linen as nn
      >>> x = jnp.ones((2, 8))
      >>> params = nn.Dense(4).init(jax.random.key(0), x)
      >>> info = qbits.serving.convert(nn.Dense(4), "w4a8", params, x).layers[0]
      >>> info.kind, info.shape, info.qdtype, info.packed, info.describe()
      ('dot_general (activation x weight)', (8, 4), 'int4', True, 'w4a8')
    """

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    contracting: tuple[int, ...]
    qdtype: str
    packed: bool
    config: str
    name: str = ""
    param: str = ""
    param_shape: tuple[int, ...] = ()
    param_dtype: str = ""

    def describe(self) -> str:
        """The config, short: the preset name or the forward quantizers."""
        if self.name:
            return self.name
        return describe_matmul(json.loads(self.config))

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for the checkpoint's metadata)."""
        d = dataclasses.asdict(self)
        for key in ("shape", "contracting", "param_shape"):
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerInfo:
        """Inverse of :meth:`as_dict`."""
        data = dict(data)
        for key in ("shape", "contracting", "param_shape"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


def describe_matmul(data: dict[str, Any]) -> str:
    """``lhs <numerics> x rhs <numerics>`` from a MatmulConfig's dict."""

    def side(name: str) -> str:
        q = data.get(name)
        if not q:
            return "float"
        numerics = q.get("numerics", "none")
        if isinstance(numerics, dict):
            numerics = numerics.get("dtype") or numerics.get("type")
        gran = q.get("granularity", "per_tensor")
        if isinstance(gran, dict):
            gran = gran.get("type", "")
        return f"{numerics} {gran}"

    return f"{side('lhs')} x {side('rhs')}"


def fingerprint(cfg: MatmulConfig) -> str:
    """The forward matmul config as canonical JSON: equal iff configs are."""
    return json.dumps(_to_dict(cfg), sort_keys=True, separators=(",", ":"))


def _fwd_only(ref: Any) -> DotGeneralConfig | None:
    config = presets.get(ref) if isinstance(ref, str) else ref
    if config is None or config.fwd.is_identity:
        return None
    return DotGeneralConfig(fwd=config.fwd)


def forward_only(config: QuantConfig) -> QuantConfig:
    """The same rules with only their forward matmuls (serving has no backward).

    A rule whose forward matmul quantizes nothing becomes ``None`` (float).
    """
    return QuantConfig(
        rules=tuple(Rule(r.pattern, _fwd_only(r.config)) for r in config.rules),
        default=_fwd_only(config.default),
    )


def stores_weight(config: DotGeneralConfig | None) -> bool:
    """Whether a layer with this config keeps a stored (quantized) weight."""
    return config is not None and not config.fwd.rhs.numerics.is_identity


def stored_parts(quantizer: Quantizer) -> tuple[str, ...]:
    """The arrays a weight stored by ``quantizer`` has, ``qvalue`` and ``scale`` first.

    Asymmetric grids add ``zero_point``, two-level scales (NVFP4)
    ``tensor_scale``, double-quantized scales (``nf4_dq``: ``scale`` holds
    their uint8 codes) ``scale_absmax`` and ``scale_offset``.
    """
    parts = ("qvalue", "scale")
    if quantizer.numerics.asymmetric:
        parts += ("zero_point",)
    if quantizer.scale_rounding == "e4m3":
        parts += ("tensor_scale",)
    if quantizer.double_quant:
        parts += ("scale_absmax", "scale_offset")
    return parts


def stored_qtensor(
    info: LayerInfo, arrays: Mapping[str, jax.Array], quantizer: Quantizer
) -> QTensor:
    """The QTensor of a served layer from its stored arrays (:func:`stored_parts`)."""
    return QTensor(
        arrays["qvalue"],
        arrays["scale"],
        qdtype=np.dtype(info.qdtype),
        dtype=np.dtype(info.dtype),
        packed_axis=-1 if info.packed else None,
        packed_pad=bool(info.packed and info.shape[-1] % 2),
        zero_point=arrays.get("zero_point"),
        tensor_scale=arrays.get("tensor_scale"),
        codebook=quantizer.numerics.codebook,
        scale_absmax=arrays.get("scale_absmax"),
        scale_offset=arrays.get("scale_offset"),
    )


def expected_arrays(info: LayerInfo) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of the stored ``qvalue`` of a layer."""
    shape = list(info.shape)
    if info.packed:
        shape[-1] = (shape[-1] + 1) // 2
        return tuple(shape), np.dtype(np.uint8)
    return tuple(shape), np.dtype(storage_dtype(info.qdtype))


def fingerprint_dict(res: Any) -> dict[str, Any]:
    """The forward config of a resolution as plain data."""
    return json.loads(fingerprint(res.config.fwd))


def check_stored(
    owner: str, info: LayerInfo, qvalue: Any, scale: Any, **extra: Any
) -> None:
    """Raises unless the stored arrays of a layer have the stored layout.

    ``extra``: the zero points, tensor scale or a double-quantized scale's
    absmax and offset, where the format has them.
    """
    shape, dtype = expected_arrays(info)
    if np.dtype(qvalue.dtype) != dtype or tuple(qvalue.shape) != shape:
        float_given = jnp.issubdtype(qvalue.dtype, jnp.floating) and dtype.kind != "f"
        hint = " (float values: run qbits.serving.convert)" if float_given else ""
        raise InvalidArgumentError(
            owner,
            f"{info.path}/qvalue",
            f"an array {np.dtype(qvalue.dtype).name}{list(qvalue.shape)}",
            f"{dtype.name}{list(shape)}, as stored for {info.describe()}",
            why=f"layer {_show(info.path)}{hint}",
        )
    nested = extra.get("scale_absmax")
    kind = jnp.uint8 if nested is not None else jnp.floating
    if not jnp.issubdtype(scale.dtype, kind) or scale.ndim != len(info.shape):
        raise InvalidArgumentError(
            owner,
            f"{info.path}/scale",
            f"an array {np.dtype(scale.dtype).name}{list(scale.shape)}",
            f"{'uint8 codes' if nested is not None else 'a float array'} of "
            f"rank {len(info.shape)}",
            why=f"layer {_show(info.path)}",
        )
    if nested is not None:
        offset = extra.get("scale_offset")
        try:
            jax.eval_shape(decode_scale, scale, nested, offset)
        except (InvalidArgumentError, AttributeError):
            raise InvalidArgumentError(
                owner,
                f"{info.path}/scale_absmax, scale_offset",
                f"{np.shape(nested)}, {np.shape(offset)}",
                f"float32 [*layers, ceil(n / 256)] and [*layers, 1, ...] for "
                f"the {list(scale.shape)} scale codes",
                why=f"layer {_show(info.path)}",
            ) from None
    tensor = extra.get("tensor_scale")
    for name, kind, shape in (
        ("zero_point", jnp.integer, tuple(scale.shape)),
        ("tensor_scale", jnp.floating, _tensor_scale_shape(tensor, scale, info)),
    ):
        x = extra.get(name)
        if x is not None and not (
            jnp.issubdtype(x.dtype, kind) and tuple(x.shape) == shape
        ):
            raise InvalidArgumentError(
                owner,
                f"{info.path}/{name}",
                f"an array {np.dtype(x.dtype).name}{list(x.shape)}",
                f"{'an integer' if kind is jnp.integer else 'a float'} array of "
                f"shape {list(shape)}",
                why=f"layer {_show(info.path)}",
            )


def _tensor_scale_shape(tensor: Any, scale: Any, info: LayerInfo) -> tuple[int, ...]:
    """The shape a stored tensor scale may have: one per scanned layer, or one.

    ``(*layers, 1, ..., 1)``: the scale's leading (scanned layers') sizes,
    then ones (``tensor`` tells how many leading axes it keeps); ``(1,) *
    rank`` without scanned layers.
    """
    rank = len(info.shape)
    if tensor is None or jnp.ndim(tensor) != rank:
        return (1,) * rank
    lead = 0
    while lead < rank - 1 and tensor.shape[lead] == scale.shape[lead] != 1:
        lead += 1
    return (*scale.shape[:lead], *(1,) * (rank - lead))


def check_layers(
    owner: str,
    config: QuantConfig,
    original: QuantConfig,
    layers: tuple[LayerInfo, ...],
    source: str | None = None,
) -> None:
    """Raises ConfigError unless every stored layer has the config's forward.

    Args:
      owner: Who checks (for messages).
      config: The forward-only rules of the serving model.
      original: The rules as given (for preset names in messages).
      layers: The stored layers of the params or checkpoint.
      source: The checkpoint directory, if any.
    """
    for info in layers:
        res = config.resolve(info.path)
        if stores_weight(res.config) and fingerprint(res.config.fwd) == info.config:
            continue
        if stores_weight(res.config):
            expected = original.resolve(info.path).name or describe_matmul(
                fingerprint_dict(res)
            )
        else:
            expected = "a float weight (no stored weight)"
        raise ConfigError(
            res.where,
            info.describe(),
            f"{expected}, the serving model's config for layer {info.path!r}",
            why=f"{owner}: the serving params were converted with another "
            "config; convert with the serving model's config, or serve them "
            "with the config they were converted with",
            source=source,
        )


def _show(path: str) -> str:
    return repr(path) if path else "'' (the top-level module)"
