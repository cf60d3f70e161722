"""The low-precision dot of two operands' codes and its rescaling.

:func:`real_dot` contracts stored values (int8, fp8, widened int4/fp4) in
their own dtype, with the accumulator :func:`common_dtypes` picks, and
multiplies the output by the operands' scales in an order that keeps every
result float32 can hold; a tiled contracting axis is split into tiles whose
partial products are scaled and summed. :mod:`qbits.ops._matmul` decides
the operands' layouts per backend and calls it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._sharding import alike
from qbits._tensor import QTensor
from qbits.ops._config import MatmulConfig
from qbits.ops._dims import Axes, Dims
from qbits.ops._headroom import shifted

__all__ = [
    "common_dtypes",
    "dot_operand",
    "is_byte_float",
    "permute",
    "real_dot",
    "tiled_pair",
    "unless_lost",
]


def is_byte_float(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 1


def dot_operand(qt: QTensor) -> jax.Array:
    """The stored values in a dtype XLA can contract."""
    q = qt.unpack().qvalue
    if q.dtype in (jnp.int4, jnp.int2):
        return q.astype(jnp.int8)
    if q.dtype == jnp.uint4:
        return q.astype(jnp.uint8)
    if q.dtype == np.dtype(ml_dtypes.float4_e2m1fn):
        return q.astype(jnp.bfloat16)
    return q


def common_dtypes(
    a: jax.Array, b: jax.Array, accumulator: Any
) -> tuple[jax.Array, jax.Array, np.dtype]:
    """Operand and accumulator dtypes for the real dot."""
    a_int = jnp.issubdtype(a.dtype, jnp.integer)
    b_int = jnp.issubdtype(b.dtype, jnp.integer)
    if a_int and b_int and accumulator in (None, np.dtype(np.int32)):
        return a, b, np.dtype(np.int32)
    if accumulator == np.dtype(np.int32):
        raise InvalidArgumentError(
            "MatmulConfig",
            "accumulator",
            "int32",
            "None or float32 for these operands",
            why=f"operands are {a.dtype} and {b.dtype}, not both integers",
        )

    # Integers meet a float operand (or a float accumulator): widen them to a
    # float dtype that holds them exactly, the other operand's where it can.
    def widened(x: jax.Array, other: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jnp.integer):
            return x
        if ml_dtypes.iinfo(x.dtype).bits > 8:
            return x.astype(jnp.float32)
        float_other = jnp.issubdtype(other.dtype, jnp.floating)
        if float_other and jnp.dtype(other.dtype).itemsize >= 2:
            return x.astype(other.dtype)
        return x.astype(jnp.bfloat16)

    return widened(a, b), widened(b, a), np.dtype(np.float32)


def tiled_pair(
    a: jax.Array, sl: jax.Array, sr: jax.Array, dims: Dims
) -> tuple[int, int] | None:
    """The contracting pair whose scales are tiled, and the tile size.

    Raises:
      InvalidArgumentError: If a scale varies along a contracting axis in a
        way that cannot be factored out of the dot.
    """
    tiled = []
    for i, (la, ra) in enumerate(
        zip(dims.lhs_contract, dims.rhs_contract, strict=True)
    ):
        k = a.shape[la]
        counts = {sl.shape[la], sr.shape[ra]} - {1}
        if not counts:
            continue
        if len(counts) > 1:
            raise _not_factorable(
                f"lhs axis {la} and rhs axis {ra} are contracted, but their scales "
                f"have {sl.shape[la]} and {sr.shape[ra]} entries along them"
            )
        tile = k // next(iter(counts))
        if tile == 1:
            raise _not_factorable(
                f"the scales vary with every element of contracted axis {la}"
            )
        tiled.append((i, tile))
    if len(tiled) > 1:
        raise _not_factorable("real mode tiles at most one contracting axis")
    return tiled[0] if tiled else None


def _not_factorable(why: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        "MatmulConfig",
        "mode",
        "real",
        "'fake' for these scales (real mode needs scales shared along the "
        "contracting axes, or tiled alike along one of them)",
        why=why,
    )


def _split(x: jax.Array, axis: int, tile: int) -> jax.Array:
    shape = list(x.shape)
    shape[axis : axis + 1] = [shape[axis] // tile, tile]
    return x.reshape(shape)


def real_dot(
    a: jax.Array,
    sl: jax.Array,
    b: jax.Array,
    sr: jax.Array,
    dims: Dims,
    cfg: MatmulConfig,
    precision: Any,
    out_sharding: Any,
    *,
    one_scalar: bool = False,
    out_dtype: Any = None,
    headroom: tuple[str, float] | None = None,
) -> jax.Array:
    """The low-precision dot and the rescaling, in float32.

    A tiled contracting axis is split into (tiles, tile); the tile index
    becomes a batch axis of the dot, and the per-tile products are scaled and
    summed.

    ``headroom`` (a float operand against quantized codes, see
    :func:`_headroom`): the float operand's rows (its values for one output
    element) whose sums with the codes could overflow float32 are divided
    by a power of two first, and the output multiplied back (exact); other
    rows are multiplied by 1, so their results are unchanged, bit for bit.

    The output is multiplied by the two scales in an order that keeps every
    result float32 can hold (per tensor: the product of the scales unless it
    leaves float32's normal range; per channel: :func:`unless_lost`), so a
    huge or tiny pair of scales never turns a representable result into inf
    or 0.
    ``one_scalar`` (GPU, per-tensor scales): one multiply by the
    product, the form XLA's GPU compiler folds into an FP8 GEMM (cuBLASLt's
    scale) instead of a pass over the output; there the product of the two
    scales must be a normal float32 (it is unless the two operands' amaxes
    multiply to less than about 2e-33 for E4M3, or overflow). With a
    bfloat16 ``out_dtype`` too, the fp8 dot is XLA's FP8 form: the codes
    widened to bfloat16, the lhs times the product rounded to it, the dot
    writing it (see :mod:`qbits.ops._matmul`'s GPU layout; float16's range
    does not hold the product of two small scales).
    """
    tiled = tiled_pair(a, sl, sr, dims)
    if (
        one_scalar
        and tiled is None
        and headroom is None
        and sl.size == 1
        and sr.size == 1
        and is_byte_float(a)
        and is_byte_float(b)
        and out_dtype is not None
        and np.dtype(out_dtype) == np.dtype(jnp.bfloat16)
    ):
        both = _scale_product(sl, sr)
        # XLA's FP8 form: the codes widened, the lhs times the scale
        # product; cuBLASLt applies it as the lhs scale, and the GEMM output
        # takes no pass of its own.
        scaled = lax.mul(a.astype(out_dtype), both.astype(out_dtype))
        return lax.dot_general(
            scaled, b.astype(out_dtype), dims.lax(), precision,
            preferred_element_type=out_dtype, out_sharding=out_sharding,
        )  # fmt: skip
    a, b, acc = common_dtypes(a, b, cfg.accumulator)
    unshift, out_dims = None, dims
    if headroom is not None:
        side, bound = headroom
        k = 1
        for la in dims.lhs_contract:
            k *= a.shape[la]
        if tiled is not None:  # each dot sums one tile
            k = k // a.shape[dims.lhs_contract[tiled[0]]] * tiled[1]
        if side == "lhs":
            a, unshift = shifted(a, dims.lhs_contract, k * bound)
        else:
            b, unshift = shifted(b, dims.rhs_contract, k * bound)
    if tiled is not None:
        i, tile = tiled
        la, ra = dims.lhs_contract[i], dims.rhs_contract[i]
        a, b = _split(a, la, tile), _split(b, ra, tile)
        sl, sr = jnp.expand_dims(sl, la + 1), jnp.expand_dims(sr, ra + 1)

        def shift(axes: Axes, at: int) -> Axes:
            return tuple(x + (x > at) for x in axes)

        dims = Dims(
            tuple(la + 1 if x == la else x for x in shift(dims.lhs_contract, la)),
            tuple(ra + 1 if x == ra else x for x in shift(dims.rhs_contract, ra)),
            (*shift(dims.lhs_batch, la), la),
            (*shift(dims.rhs_batch, ra), ra),
            a.ndim,
            b.ndim,
        )
        out_sharding = None
    out = lax.dot_general(
        a,
        b,
        dims.lax(),
        precision,
        preferred_element_type=acc,
        out_sharding=out_sharding,
    ).astype(jnp.float32)
    # lax, not jnp, for the elementwise rescaling: jnp's functions are small
    # jitted functions, each traced anew for every new shape.
    if sl.size == 1 and sr.size == 1:
        a, b = sl.reshape(()).astype(jnp.float32), sr.reshape(()).astype(jnp.float32)
        both = lax.mul(a, b)
        if one_scalar:
            out = lax.mul(out, both)
        else:  # the product, unless it left float32's normal range
            normal = lax.bitwise_and(lax.is_finite(both), lax.ge(lax.abs(both), _TINY))
            first = lax.select(normal, both, a)
            second = lax.select(normal, np.float32(1), b)
            out = lax.mul(lax.mul(out, first), second)
    else:
        dims_out = tuple(range(out.ndim))
        left, right = (
            lax.broadcast_in_dim(_scale_to_output(s, dims, side), out.shape, dims_out)
            for s, side in ((sl, "lhs"), (sr, "rhs"))
        )
        # Tied to the output: each device scales its own part (int8,
        # sharded LM: -12 all-gathers, -3 all-to-alls, +4 all-reduces per
        # block; benchmarks/sharded_collectives.py).
        out, left = alike(out, left)
        out, right = alike(out, right)
        out = unless_lost(
            lax.mul(lax.mul(out, left), right),
            out,
            lambda o: lax.mul(o, lax.mul(left, right)),
        )
    if tiled is not None:
        out = jnp.sum(out, axis=len(dims.lhs_batch) - 1)
    if unshift is not None:
        factor = _scale_to_output(unshift, out_dims, headroom[0])
        out = lax.mul(
            out, lax.broadcast_in_dim(factor, out.shape, tuple(range(out.ndim)))
        )
    return out


_TINY = np.float32(np.finfo(np.float32).tiny)


def _scale_product(sl: jax.Array, sr: jax.Array) -> jax.Array:
    """``sl * sr`` for XLA's FP8 form, from the inverses the casts use.

    Each operand's cast multiplies by ``1 / s`` (:mod:`qbits._quantizer`);
    written as ``1 / ((1 / sl) (1 / sr))`` the product reads those same
    inverses, and XLA's GPU compiler computes both inverses and the product
    in one small kernel, where ``sl * sr`` (recomputed from the two amaxes)
    took a kernel of its own beside each inverse's: one launch less per
    quantized tensor (the MLP block's fp8 step: 36 -> 31 kernels). Within
    three float32 ulps of ``sl * sr``, which the form then rounds to
    bfloat16 (2**-9) anyway.
    """
    one = np.float32(1)
    il, ir = (
        lax.div(lax.full_like(s, one), s).reshape(()).astype(jnp.float32)
        for s in (sl, sr)
    )
    return lax.div(one, lax.mul(il, ir))


def unless_lost(scaled: jax.Array, out: jax.Array, other: Any) -> jax.Array:
    """``scaled``, or ``other(out)`` where ``scaled`` overflowed or flushed to 0.

    Two orders of the same two multiplies: where the first loses a result
    (an intermediate beyond float32's range), the other keeps it.
    """
    zero = lax.full_like(out, 0)
    lost = lax.bitwise_or(
        lax.bitwise_not(lax.is_finite(scaled)),
        lax.bitwise_and(lax.eq(scaled, zero), lax.ne(out, zero)),
    )
    return lax.select(lax.bitwise_and(lost, lax.is_finite(out)), other(out), scaled)


def _scale_to_output(scale: jax.Array, dims: Dims, side: str) -> jax.Array:
    """Lays out an operand's scale like the dot's output.

    The scale has size 1 along contracted axes; the output has the batch axes,
    then the lhs free axes, then the rhs free axes.
    """
    if side == "lhs":
        batch, free, contract = dims.lhs_batch, dims.lhs_free, dims.lhs_contract
        before, after = 0, len(dims.rhs_free)
    else:
        batch, free, contract = dims.rhs_batch, dims.rhs_free, dims.rhs_contract
        before, after = len(dims.lhs_free), 0
    s = jnp.transpose(scale, batch + free + contract)
    s = s.reshape(s.shape[: len(batch) + len(free)])
    shape = s.shape[: len(batch)] + (1,) * before + s.shape[len(batch) :] + (1,) * after
    return s.reshape(shape).astype(jnp.float32)


def permute(x: jax.Array, perm: Axes | None) -> jax.Array:
    if perm is None or tuple(perm) == tuple(range(x.ndim)):
        return x
    return jnp.transpose(x, perm)
