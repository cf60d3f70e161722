"""Checks that a config fits a layer's operands, and ops that check first.

A granularity can only be checked against a shape (a tile size must divide
the axis it tiles), so configs are checked when a layer is first traced,
and a failure names the config's path inside its file, the layer and the
operand: ``rules[0].config.fwd.rhs.granularity.tile_size: expected a divisor
of 200 ... (axis 0 has size 200, in layer 'mlp/fc1')``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qbits._errors import ConfigError, InvalidArgumentError
from qbits.ops import ConvGeneralDilated, Dims, DotGeneral, DotGeneralConfig

__all__ = [
    "CheckedConv",
    "CheckedDotGeneral",
    "check_conv_operands",
    "check_operands",
    "show_layer",
    "with_layer",
]


def show_layer(path: str) -> str:
    """A layer path for messages (the root module's path is empty)."""
    return repr(path) if path else "'' (the top-level module)"


@contextlib.contextmanager
def _in_layer(layer: str | None) -> Iterator[None]:
    """Adds the layer's path to a ConfigError raised inside."""
    try:
        yield
    except ConfigError as e:
        if layer is None or e.layer is not None:
            raise
        raise with_layer(e, layer) from None


def with_layer(error: ConfigError, layer: str) -> ConfigError:
    """``error`` naming the layer it was found in (its ``layer`` attribute).

    Args:
      error: An error found when a config was checked against a layer.
      layer: The layer's path (``""`` for the top-level module).

    Returns:
      The same error with ``layer`` set; its message ends ``in layer '...'``.

    Example:
      >>> e = qbits.ConfigError("fwd.rhs.numerics.bits", 48, "an int in 1..16")
      >>> print(qbits.config._checks.with_layer(e, "mlp/fc1"))
      fwd.rhs.numerics.bits: expected an int in 1..16, got 48 (in layer 'mlp/fc1').
    """
    return ConfigError(
        error.path,
        error.value,
        error.allowed,
        why=error.why,
        source=error.source,
        layer=layer,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class CheckedDotGeneral:
    """A quantized ``dot_general`` that checks its config against the operands.

    Attributes:
      op: The quantized function.
      where: The config's path inside its file (``"rules[0].config"``).
      layer: The layer's path, named in errors, or ``None``.
    """

    op: DotGeneral
    where: str
    layer: str | None = None

    def __call__(
        self,
        lhs: Any,
        rhs: Any,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        *,
        out_sharding: Any = None,
        state: Any = None,
    ) -> jax.Array:
        """Checks, then computes ``lax.dot_general(lhs, rhs, ...)`` quantized."""
        with _in_layer(self.layer):
            check_operands(
                self.op.config,
                jnp.shape(lhs),
                jnp.shape(rhs),
                dimension_numbers,
                self.where,
            )
        return self.op(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding=out_sharding,
            **({} if state is None else {"state": state}),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class CheckedConv:
    """A quantized ``conv_general_dilated`` that checks its config first.

    Attributes: as :class:`CheckedDotGeneral`.
    """

    op: ConvGeneralDilated
    where: str
    layer: str | None = None

    def __call__(self, lhs: Any, rhs: Any, *args: Any, **kwargs: Any) -> jax.Array:
        """Checks, then computes ``lax.conv_general_dilated(...)`` quantized."""
        with _in_layer(self.layer):
            check_conv_operands(
                self.op.config,
                lhs,
                rhs,
                *args,
                where=self.where,
                **{k: v for k, v in kwargs.items() if k != "state"},
            )
        return self.op(lhs, rhs, *args, **kwargs)


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
) -> None:
    """Checks that every quantizer of ``config`` fits a dot_general's operands.

    Used by the injection layers when a layer is first traced, so that a tile
    size that does not divide an axis is reported with its place in the file.

    Args:
      config: The layer's config.
      lhs_shape: Shape of the forward lhs.
      rhs_shape: Shape of the forward rhs.
      dimension_numbers: As for ``lax.dot_general``.
      where: Path of ``config`` inside its file, e.g. ``"rules[1].config"``.

    Raises:
      ConfigError: Naming e.g. ``rules[1].config.fwd.rhs.granularity.tile_size``.
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
    )


def check_conv_operands(
    config: DotGeneralConfig,
    lhs: Any,
    rhs: Any,
    *args: Any,
    where: str = "",
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
    )


def _check_quantizers(
    config: DotGeneralConfig,
    operands: Iterable[tuple[str, str, Sequence[int], Sequence[int]]],
    where: str,
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
            ) from None
