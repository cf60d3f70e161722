"""Checks that a config fits a matmul's operands.

A granularity can only be checked against a shape (a tile size must divide
the axis it tiles), so the engine checks each matmul's config when the
matmul is traced, and a failure names the file, the config's path inside
it, the matmul and the operand: ``rules.yaml:
rules[0].config.fwd.rhs.granularity.tile_size: expected a divisor of 200
... (axis 0 has size 200, in layer 'mlp/fc1')``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qbits import ops
from qbits._errors import ConfigError, InvalidArgumentError
from qbits.ops import Dims, DotGeneralConfig

__all__ = ["check_conv_operands", "check_operands", "check_ragged_operands"]


def _out_shape(dims: Dims, lhs: Sequence[int], rhs: Sequence[int]) -> tuple[int, ...]:
    return (
        tuple(lhs[a] for a in dims.lhs_batch)
        + tuple(lhs[a] for a in dims.lhs_free)
        + tuple(rhs[a] for a in dims.rhs_free)
    )


def check_operands(
    config: DotGeneralConfig,
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    dimension_numbers: Any,
    where: str = "",
    *,
    layer: str | None = None,
    source: str | None = None,
) -> None:
    """Checks that every quantizer of ``config`` fits a dot_general's operands.

    Args:
      config: The matmul's config.
      lhs_shape: Shape of the forward lhs.
      rhs_shape: Shape of the forward rhs.
      dimension_numbers: As for ``lax.dot_general``.
      where: Path of ``config`` inside its file, e.g. ``"rules[1].config"``.
      layer: The matmul's path, named in the error.
      source: The file the config came from, named in the error.

    Raises:
      ConfigError: Naming e.g. ``rules[1].config.fwd.rhs.granularity.tile_size``.

    Example:
      >>> cfg = qbits.presets.get("mxfp8")
      >>> try:
      ...     qbits.transform._checks.check_operands(cfg, (2, 48), (48, 4),
      ...                                 (((1,), (0,)), ((), ())), "default",
      ...                                 layer="fc1")
      ... except qbits.ConfigError as e:
      ...     print(str(e)[:62])
      default.fwd.lhs.granularity.tile_size: expected a divisor of 4
    """
    fwd = Dims.create(dimension_numbers, len(lhs_shape), len(rhs_shape))
    g = _out_shape(fwd, lhs_shape, rhs_shape)
    dlhs, drhs = fwd.grad_lhs()[0], fwd.grad_rhs()[0]
    _check_quantizers(
        config,
        (
            ("fwd", "lhs", lhs_shape, fwd.lhs_contract),
            ("fwd", "rhs", rhs_shape, fwd.rhs_contract),
            ("dlhs", "lhs", g, dlhs.lhs_contract),
            ("dlhs", "rhs", rhs_shape, dlhs.rhs_contract),
            ("drhs", "lhs", g, drhs.lhs_contract),
            ("drhs", "rhs", lhs_shape, drhs.rhs_contract),
        ),
        where,
        layer,
        source,
    )


def check_conv_operands(
    config: DotGeneralConfig,
    lhs: Any,
    rhs: Any,
    *args: Any,
    where: str = "",
    layer: str | None = None,
    source: str | None = None,
    **kwargs: Any,
) -> None:
    """:func:`check_operands` for a ``lax.conv_general_dilated`` call.

    The contracting axes are those :func:`qbits.conv_general_dilated` uses:
    window and input features forward; window and output features (dlhs);
    batch and positions (drhs).

    Args:
      config: The layer's config.
      lhs: The input (an array or anything with ``shape`` and ``dtype``).
      rhs: The kernel.
      *args: The remaining arguments of ``lax.conv_general_dilated``.
      where: Path of ``config`` inside its file.
      layer: The matmul's path, named in the error.
      source: The file the config came from, named in the error.
      **kwargs: Keyword arguments of ``lax.conv_general_dilated``.

    Raises:
      ConfigError: Naming e.g. ``default.fwd.rhs.granularity.tile_size``.
    """
    lhs = jax.ShapeDtypeStruct(jnp.shape(lhs), jnp.result_type(lhs))
    rhs = jax.ShapeDtypeStruct(jnp.shape(rhs), jnp.result_type(rhs))
    out = jax.eval_shape(
        lambda a, b: lax.conv_general_dilated(a, b, *args, **kwargs), lhs, rhs
    ).shape
    bound = inspect.signature(lax.conv_general_dilated).bind(lhs, rhs, *args, **kwargs)
    dn = lax.conv_dimension_numbers(
        lhs.shape, rhs.shape, bound.arguments.get("dimension_numbers")
    )
    ls, rs, os_ = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    _check_quantizers(
        config,
        (
            ("fwd", "lhs", lhs.shape, (*ls[2:], ls[1])),
            ("fwd", "rhs", rhs.shape, (*rs[2:], rs[1])),
            ("dlhs", "lhs", out, (*os_[2:], os_[1])),
            ("dlhs", "rhs", rhs.shape, (*rs[2:], rs[0])),
            ("drhs", "lhs", out, (os_[0], *os_[2:])),
            ("drhs", "rhs", lhs.shape, (ls[0], *ls[2:])),
        ),
        where,
        layer,
        source,
    )


def check_ragged_operands(
    config: DotGeneralConfig,
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    dimension_numbers: Any,
    where: str = "",
    *,
    layer: str | None = None,
    source: str | None = None,
) -> None:
    """:func:`check_operands` for a ``lax.ragged_dot_general`` call.

    Also what :func:`qbits.ops.ragged_dot` asks of a config (scale providers
    per tensor; the weight gradient's operands calibrated by absmax).

    Raises:
      ConfigError: Naming e.g. ``default.drhs.lhs.calibration``.

    Example:
      >>> cfg = qbits.presets.get("int4_weight_only")
      >>> try:
      ...     qbits.transform._checks.check_ragged_operands(
      ...         cfg, (6, 48), (2, 48, 4), jax.lax.RaggedDotDimensionNumbers(
      ...             (((1,), (1,)), ((), ())), (0,), (0,)), "default",
      ...         layer="experts")
      ... except qbits.ConfigError as e:
      ...     print(str(e)[:63])
      default.fwd.rhs.granularity.tile_size: expected a divisor of 48
    """
    # A key only to build the op: the config is checked, nothing is drawn.
    key = jax.random.key(0) if config.needs_key else None
    try:
        op = ops.ragged_dot(config, key)
    except InvalidArgumentError as e:
        raise ConfigError(
            f"{where}.{e.argument.removeprefix('config.')}".lstrip("."),
            e.value,
            e.allowed,
            why=e.why,
            layer=layer,
            source=source,
        ) from None
    operands = op.quantized_operands(
        tuple(lhs_shape), tuple(rhs_shape), dimension_numbers
    )
    _check_quantizers(config, operands, where, layer, source)


def _check_quantizers(
    config: DotGeneralConfig,
    operands: Iterable[tuple[str, str, Sequence[int], Sequence[int]]],
    where: str,
    layer: str | None,
    source: str | None,
) -> None:
    """Checks each ``(matmul, side, shape, contracting axes)`` operand."""
    for matmul, side, shape, contracting in operands:
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
