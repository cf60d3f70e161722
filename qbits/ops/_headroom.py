"""Overflow headroom of a float operand against quantized codes.

A weight-only matmul (a float lhs, int4 codes) contracts the float values
with the codes, not with the dequantized weight: its sums are ``1 / scale``
times larger than the result. :func:`headroom` says how large the codes
get (:func:`code_bound`); :func:`shifted` divides the float operand's rows
whose sums could overflow float32 by a power of two first (exact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits._tensor import QTensor
from qbits.ops._config import MatmulConfig
from qbits.ops._dims import Axes

__all__ = ["INT32_MAX", "code_bound", "headroom", "int32_holds", "shifted"]


def headroom(lqt: QTensor, rqt: QTensor, cfg: MatmulConfig) -> tuple[str, float] | None:
    """A float operand against quantized codes: ``(its side, the codes' bound)``.

    A weight-only matmul (a float lhs, int4 codes) contracts the float
    values with the codes, not with the dequantized weight: the sums are
    ``1 / scale`` times larger than the result, and overflow float32 where
    the result does not (``1e37 * 7 * 256``). ``None`` when both operands
    are quantized (their codes are small) or neither is.
    """
    plain = [q.numerics.is_identity for q in (cfg.lhs, cfg.rhs)]
    if plain[0] == plain[1]:
        return None
    side, qt, q = ("lhs", rqt, cfg.rhs) if plain[0] else ("rhs", lqt, cfg.lhs)
    qdtype = None if qt.qdtype is None else np.dtype(qt.qdtype)
    if qdtype is not None and jnp.issubdtype(qdtype, jnp.integer):
        bound = float(code_bound(qt, q))
    elif qdtype is not None:
        bound = float(ml_dtypes.finfo(qdtype).max)
    else:  # a grid without a storage dtype, clipped at its bound
        bound = float(q.numerics.abs_val_mapped_to() or 1.0)
    return side, bound


INT32_MAX = 2**31 - 1


def code_bound(qt: QTensor, quantizer: Quantizer | None = None) -> int:
    """The largest magnitude of a stored integer operand's codes.

    ``2**(bits-1) - 1`` for a clipping :class:`~qbits.IntNumerics` that
    stored ``qt``; otherwise the storage dtype's largest value.
    """
    top = int(ml_dtypes.iinfo(np.dtype(qt.qdtype)).max)
    numerics = getattr(quantizer, "numerics", None)
    if numerics is None or numerics.get_dtype() != np.dtype(qt.qdtype):
        return top
    bound = numerics.code_bound()
    return top if bound is None else min(top, bound)


def int32_holds(k: int, lqt: QTensor, rqt: QTensor, cfg: MatmulConfig) -> bool:
    """Whether an int32 accumulator holds every sum of ``k`` code products.

    The rule: ``K * max|a| * max|b| <= 2**31 - 1``, with the code bounds of
    :func:`code_bound`. int8 x int8 sums up to K = 133,144 exactly; 16-bit
    codes only K = 2 (wider sums accumulate in float32).

    Raises:
      InvalidArgumentError: For ``accumulator=int32`` where it could
        overflow.
    """
    worst = k * code_bound(lqt, cfg.lhs) * code_bound(rqt, cfg.rhs)
    if worst <= INT32_MAX:
        return True
    if cfg.accumulator == np.dtype(np.int32):
        raise InvalidArgumentError(
            "MatmulConfig",
            "accumulator",
            "int32",
            "None or float32 for these operands",
            why=f"{k} products of {np.dtype(lqt.qdtype)} x {np.dtype(rqt.qdtype)} "
            f"codes can sum to {worst}, beyond int32",
        )
    return False


def shifted(
    x: jax.Array, contracting: Axes, limit: float
) -> tuple[jax.Array, jax.Array]:
    """``x`` with each row divided by ``2**p``, and the ``2**p`` (float32).

    A row is the elements that one output sums (the contracting axes). ``p``
    is the least power that keeps ``limit * max|row| / 2**p`` below
    ``2**127``: the sum of the row's products with values of magnitude at
    most ``limit / n`` cannot overflow; ``p = 0`` (a factor of 1) for every
    row float32 holds anyway, and NaN and inf stay.
    """
    magnitude = lax.abs(x.astype(jnp.float32))
    amax = lax.expand_dims(lax.reduce_max(magnitude, contracting), contracting)
    # amax < 2**(e - 126) for its biased exponent e (normal numbers)
    biased = lax.shift_right_logical(
        lax.bitcast_convert_type(amax, jnp.uint32), np.uint32(23)
    ).astype(jnp.int32)
    need = int(np.ceil(np.log2(max(limit, 1.0))))
    p = lax.clamp(np.int32(0), biased + np.int32(need - 253), np.int32(64))

    def power(e: jax.Array) -> jax.Array:  # 2**e for e in [-126, 127]
        bits = lax.shift_left(
            lax.convert_element_type(e + 127, jnp.uint32), np.uint32(23)
        )
        return lax.bitcast_convert_type(bits, jnp.float32)

    down = lax.broadcast_in_dim(
        power(-p).astype(x.dtype), x.shape, tuple(range(x.ndim))
    )
    return lax.mul(x, down), power(p)
