"""OCP Microscaling (MX) quantizers."""

from __future__ import annotations

from qbits._calibration import AbsMax
from qbits._errors import check_choice
from qbits._granularity import Tiled
from qbits._quantizer._quantizer import Quantizer
from qbits.numerics import FpNumerics, IntNumerics

__all__ = ["mx_quantizer"]

_MX_ELEMENTS = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
    "int8",
)


def mx_quantizer(element: str = "float8_e4m3fn", axis: int | None = None) -> Quantizer:
    """An OCP Microscaling (MX) quantizer: tiles of 32, E8M0 scales.

    The shared power-of-two scale of each tile is rounded *up* so that no
    element of the tile clips (as production FP8 training does; the MX v1.0
    spec rounds down and saturates).

    Args:
      element: ``"float8_e4m3fn"`` / ``"float8_e5m2"`` (MXFP8),
        ``"float6_e2m3fn"`` / ``"float6_e3m2fn"`` (MXFP6), ``"float4_e2m1fn"``
        (MXFP4) or ``"int8"`` (MXINT8).
      axis: The axis tiled in blocks of 32; ``None`` for a matmul operand's
        contracting axis.

    Returns:
      A :class:`Quantizer`: an absmax scale per tile of 32, a power of two
      (E8M0).

    Raises:
      InvalidArgumentError: For another element format.

    Example:
      >>> import jax.numpy as jnp
      >>> q = qbits.presets.mx_quantizer("float4_e2m1fn", axis=-1)
      >>> qt = q.quant(jnp.linspace(-1.0, 1.0, 64).reshape(1, 64))
      >>> qt.scale.shape, qt.scale[0, 0]
      ((1, 2), Array(0.25, dtype=float32))
    """
    check_choice("mx_quantizer", "element", element, _MX_ELEMENTS)
    numerics = IntNumerics(bits=8) if element == "int8" else FpNumerics(element)
    return Quantizer(numerics, AbsMax(), Tiled(axis=axis, tile_size=32), "e8m0")
