"""Checks that a config fits a matmul's operands.

A granularity can only be checked against a shape (a tile size must divide
the axis it tiles), so the engine checks each matmul's config when the
matmul is traced, and a failure names the file, the config's path inside
it, the matmul and the operand: ``rules.yaml:
rules[0].config.fwd.rhs.granularity.tile_size: expected a divisor of 200
... (axis 0 has size 200, in layer 'mlp/fc1')``. The operands, their
shapes and contracting axes are the op kind's (:meth:`qbits.ops._kind.OpKind.operands`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qbits._errors import ConfigError, InvalidArgumentError
from qbits.ops import DotGeneralConfig

__all__ = ["check_fits"]


def check_fits(
    config: DotGeneralConfig,
    kind: Any,
    call: Any,
    out: Sequence[int],
    where: str = "",
    *,
    layer: str | None = None,
    source: str | None = None,
) -> None:
    """Checks that every quantizer of ``config`` fits a call's operands.

    Args:
      config: The matmul's config.
      kind: The matmul's op kind (:data:`qbits.ops.KINDS`).
      call: Its call (:meth:`~qbits.ops._kind.OpKind.call`; arrays or anything
        with ``shape`` and ``dtype``).
      out: The call's output shape.
      where: Path of ``config`` inside its file, e.g. ``"rules[1].config"``.
      layer: The matmul's path, named in the error.
      source: The file the config came from, named in the error.

    Raises:
      ConfigError: Naming e.g. ``rules[1].config.fwd.rhs.granularity.tile_size``,
        or what the op asks of a config (:meth:`~qbits.ops._kind.OpKind.check`).

    Example:
      >>> cfg, kind = qbits.presets.get("mxfp8"), qbits.ops.KINDS["dot_general"]
      >>> x, w = jax.ShapeDtypeStruct((2, 48), "float32"), jnp.ones((48, 4))
      >>> call = kind.call({"dimension_numbers": (((1,), (0,)), ((), ()))}, [x, w])
      >>> try:
      ...     qbits.transform._checks.check_fits(cfg, kind, call, (2, 4),
      ...                                        "default", layer="fc1")
      ... except qbits.ConfigError as e:
      ...     print(str(e)[:62])
      default.fwd.lhs.granularity.tile_size: expected a divisor of 4
    """
    try:
        kind.check(config)
    except InvalidArgumentError as e:
        raise ConfigError(
            f"{where}.{e.argument.removeprefix('config.')}".lstrip("."),
            e.value,
            e.allowed,
            why=e.why,
            layer=layer,
            source=source,
        ) from None
    for matmul, side, shape, contracting in kind.operands(call, tuple(out)):
        quantizer = getattr(getattr(config, matmul), side)
        try:
            quantizer.granularity.block_sizes(tuple(shape), tuple(contracting))
        except InvalidArgumentError as e:
            raise ConfigError(
                f"{where}.{matmul}.{side}.granularity.{e.argument}".lstrip("."),
                e.value,
                e.allowed,
                why=e.why or f"operand shape {tuple(shape)}",
                layer=layer,
                source=source,
            ) from None
