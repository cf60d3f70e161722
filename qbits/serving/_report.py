"""How many bytes the stored weights take, per layer and in total."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from qbits import nnx as qnnx
from qbits._errors import InvalidArgumentError
from qbits.serving._layout import LayerInfo
from qbits.serving._nnx import served_layers
from qbits.serving._params import ServingParams

__all__ = ["LayerSize", "SizeReport", "size_report"]


def _nbytes(x: Any) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class LayerSize:
    """The weight bytes of one stored layer: a row of :class:`SizeReport`.

    Attributes:
      path: The layer's path.
      format: The stored format (``int8``, ``int4 (packed)``, ...) and config.
      shape: The float weight's shape.
      value_bytes: Bytes of the stored values.
      scale_bytes: Bytes of the scales (zero points and a tensor scale
        included, where the format has them).
      float32_bytes: Bytes of the same weight in float32.

    Example:
      >>> def f(params, x):
      ...     return x @ params["w"]
      >>> w, x = {"w": jnp.ones((4, 4))}, jnp.ones((2, 4))
      >>> sp = qbits.serving.convert(f, "int8_fwd", w, x)
      >>> row = qbits.serving.size_report(sp).layers[0]
      >>> row.value_bytes, row.scale_bytes, row.float32_bytes, row.ratio
      (16, 16, 64, 0.5)
    """

    path: str
    format: str
    shape: tuple[int, ...]
    value_bytes: int
    scale_bytes: int
    float32_bytes: int

    @property
    def bytes(self) -> int:
        """Values and scales together."""
        return self.value_bytes + self.scale_bytes

    @property
    def ratio(self) -> float:
        """``bytes / float32_bytes``."""
        return self.bytes / self.float32_bytes


@dataclasses.dataclass(frozen=True)
class SizeReport:
    """Weight bytes of a served model versus float32.

    Attributes:
      layers: One row per stored layer (``path``, ``format``, ``shape``,
        ``value_bytes``, ``scale_bytes``, ``float32_bytes``; ``bytes`` and
        ``ratio``).
      other_bytes: Bytes of every other parameter (biases, norms, float
        layers, a tied embedding's table kept for its lookup), as they are
        stored.
      other_float32_bytes: The same parameters in float32.
      shared_float32_bytes: The float32 bytes of stored weights whose float
        parameter is counted elsewhere: kept for another reader (a tied
        embedding, whose lookup reads it: it is among the other parameters)
        or stored for another matmul too. The float32 total counts each
        parameter once (:attr:`total_float32_bytes`).

    Example:
      >>> def f(params, x):
      ...     return x @ params["w"] + params["b"]
      >>> params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
      >>> sp = qbits.serving.convert(f, "int8_fwd", params, jnp.ones((2, 4)))
      >>> report = qbits.serving.size_report(sp)
      >>> report.ratio, report.total_ratio
      (0.5, 0.6)
      >>> print(str(report).splitlines()[2])
      | w | int8, int8_fwd | 4x4 | 16 | 16 | 64 | 0.5000 |
    """

    layers: tuple[LayerSize, ...]
    other_bytes: int
    other_float32_bytes: int
    shared_float32_bytes: int = 0

    @property
    def bytes(self) -> int:
        """Bytes of the stored weights (values and scales)."""
        return sum(r.bytes for r in self.layers)

    @property
    def float32_bytes(self) -> int:
        """Bytes of the stored weights in float32."""
        return sum(r.float32_bytes for r in self.layers)

    @property
    def ratio(self) -> float:
        """Stored weights' bytes over their float32 bytes (scales included)."""
        return self.bytes / self.float32_bytes if self.float32_bytes else 1.0

    @property
    def total_float32_bytes(self) -> int:
        """Bytes of all parameters in float32, each parameter once."""
        return self.float32_bytes + self.other_float32_bytes - self.shared_float32_bytes

    @property
    def total_ratio(self) -> float:
        """All parameters' bytes over their float32 bytes (each counted once)."""
        whole = self.total_float32_bytes
        return (self.bytes + self.other_bytes) / whole if whole else 1.0

    def as_dicts(self) -> list[dict[str, Any]]:
        """One plain dict per layer, then the totals."""
        rows = [
            {**dataclasses.asdict(r), "bytes": r.bytes, "ratio": r.ratio}
            for r in self.layers
        ]
        rows.append(
            {
                "path": "stored weights",
                "bytes": self.bytes,
                "float32_bytes": self.float32_bytes,
                "ratio": self.ratio,
            }
        )
        rows.append(
            {
                "path": "all parameters",
                "bytes": self.bytes + self.other_bytes,
                "float32_bytes": self.total_float32_bytes,
                "ratio": self.total_ratio,
            }
        )
        return rows

    def __str__(self) -> str:
        lines = [
            "| layer | format | shape | values | scales | float32 | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.layers:
            shape = "x".join(str(n) for n in r.shape)
            lines.append(
                f"| {r.path} | {r.format} | {shape} | {r.value_bytes:,} | "
                f"{r.scale_bytes:,} | {r.float32_bytes:,} | {r.ratio:.4f} |"
            )
        values = sum(r.value_bytes for r in self.layers)
        scales = sum(r.scale_bytes for r in self.layers)
        lines.append(
            f"| **stored weights** | | | {values:,} | {scales:,} | "
            f"{self.float32_bytes:,} | {self.ratio:.4f} |"
        )
        lines.append(
            f"| **all parameters** | | | {values:,} + {self.other_bytes:,} other | "
            f"{scales:,} | {self.total_float32_bytes:,} | "
            f"{self.total_ratio:.4f} |"
        )
        return "\n".join(lines)


def _arrays(tree: Any) -> list[Any]:
    """The arrays of ``tree`` but PRNG keys (which have no bytes per element)."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if hasattr(leaf, "dtype")]
    return [x for x in leaves if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]


def _row(info: LayerInfo, arrays: dict[str, Any]) -> LayerSize:
    """A layer's row: its values, then its scales, zero points, tensor scale."""
    fmt = info.qdtype + (" (packed)" if info.packed else "")
    return LayerSize(
        path=info.path,
        format=f"{fmt}, {info.describe()}",
        shape=info.shape,
        value_bytes=_nbytes(arrays["qvalue"]),
        scale_bytes=sum(_nbytes(a) for k, a in arrays.items() if k != "qvalue"),
        float32_bytes=int(np.prod(info.shape)) * 4,
    )


def size_report(serving: ServingParams | nnx.Module) -> SizeReport:
    """Bytes of the stored weights, per layer and in total, versus float32.

    Counts what the served object holds, leaf by leaf: each stored weight's
    values and scales, and every other parameter once (the empty
    placeholders of dropped float weights count nothing). A tied
    embedding's table, kept in float for its lookup, counts in the served
    bytes beside its stored head; the float32 total counts each float
    parameter once, however many matmuls (and lookups) read it. Works on
    shapes only (also on ``jax.eval_shape`` results).

    Args:
      serving: :class:`~qbits.serving.ServingParams` (linen models and
        functions) or a served nnx model, from :func:`qbits.serving.convert`.

    Returns:
      A :class:`SizeReport`; ``str()`` of it is a markdown table.

    Raises:
      InvalidArgumentError: For anything else.

    Example:
      >>> import flax.linen as nn
      >>> x = jnp.ones((1, 512))
      >>> params = nn.Dense(2048).init(jax.random.key(0), x)
      >>> sp = qbits.serving.convert(nn.Dense(2048), "int8_fwd", params, x)
      >>> report = qbits.serving.size_report(sp)
      >>> round(report.ratio, 4), report.layers[0].scale_bytes
      (0.2520, 8192)
    """
    if isinstance(serving, ServingParams):
        infos = [(info, serving.weights[info.path]) for info in serving.layers]
        others = _arrays(serving.params)
    elif isinstance(serving, nnx.Module) and served_layers(serving):
        infos = served_layers(serving)
        # The key streams a trained copy may keep (nnx.RngState): not weights.
        skip = nnx.Any(nnx.PathContains("qbits"), qnnx._Placeholder, nnx.RngState)
        others = _arrays(nnx.state(serving, nnx.Not(skip)))
    else:
        raise InvalidArgumentError(
            "qbits.serving.size_report",
            "serving",
            type(serving).__name__,
            "qbits.serving.ServingParams or a served nnx model (from "
            "qbits.serving.convert)",
        )
    rows = [_row(info, arrays) for info, arrays in infos]
    # A float parameter counted elsewhere: kept (param "": another reader,
    # e.g. a tied embedding's lookup, is among the others) or seen before.
    seen: set[str] = set()
    shared = 0
    for (info, _), row in zip(infos, rows, strict=True):
        if not info.param or info.param in seen:
            shared += row.float32_bytes
        seen.add(info.param)
    others = [x for x in others if jnp.issubdtype(x.dtype, jnp.inexact)]
    other_bytes = sum(_nbytes(x) for x in others)
    other_f32 = sum(int(np.prod(x.shape)) * 4 for x in others)
    return SizeReport(tuple(rows), other_bytes, other_f32, shared)
