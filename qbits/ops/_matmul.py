"""One quantized dot: quantized operands in, the rescaled output out.

:func:`contract` is what :func:`qbits.dot_general` computes in each of its
three matmuls (the forward and both gradients) once the operands are
quantized, in real mode (low-precision dot, scales on the output) or fake
mode (a float dot of the dequantized operands). It is not differentiable
itself; the custom VJP in :mod:`qbits.ops._core` ties three of them together.

Integer operands and XLA:CPU
  XLA:CPU runs an s8 x s8 -> s32 dot on its fast kernel only when the lhs has
  its contracting axes last; with any other lhs layout, and for an s8 array
  that was transposed after quantization, it converts both operands to s32
  (3-5x slower than float32); the rhs may be ``[K, N]`` or ``[N, K]``. So an
  lhs whose contracting axes are not last is transposed (see ``_laid_out``),
  and when the caller will permute the output the way exchanging the
  operands does (the weight gradient ``x^T g``), the operands are exchanged,
  so that the dot writes the final layout and the transposed operand is the
  smaller activation rather than the output.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._platform import per_platform
from qbits._tensor import QTensor, expand_scale
from qbits.ops._config import MatmulConfig
from qbits.ops._dims import Axes, Dims
from qbits.ops._headroom import headroom, int32_holds
from qbits.ops._rescale import (
    dot_operand,
    is_byte_float,
    permute,
    real_dot,
    tiled_pair,
)


def result_dtype(
    lhs: jax.Array | QTensor,
    rhs: jax.Array | QTensor,
    dims: Dims,
    preferred_element_type: Any,
) -> np.dtype:
    """The dtype ``lax.dot_general`` would return for these operands."""
    return dot_shape(
        tuple(lhs.shape), jnp.dtype(lhs.dtype), tuple(rhs.shape),
        jnp.dtype(rhs.dtype), dims.lax(), preferred_element_type,
    ).dtype  # fmt: skip


def dot_shape(
    lhs_shape: tuple[int, ...],
    lhs_dtype: np.dtype,
    rhs_shape: tuple[int, ...],
    rhs_dtype: np.dtype,
    dimension_numbers: Any,
    preferred_element_type: Any = None,
) -> jax.ShapeDtypeStruct:
    """``lax.dot_general``'s output for operands like these, with its checks.

    Raises what ``lax.dot_general`` raises for them (shapes, dtypes); each
    combination is traced once (a model's sites share a few shapes).
    """
    return _dot_shape(
        lhs_shape, lhs_dtype, rhs_shape, rhs_dtype, dimension_numbers,
        preferred_element_type, bool(jax.config.jax_enable_x64),
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _dot_shape(
    lhs_shape: tuple[int, ...],
    lhs_dtype: np.dtype,
    rhs_shape: tuple[int, ...],
    rhs_dtype: np.dtype,
    dimension_numbers: Any,
    preferred_element_type: Any,
    x64: bool,
) -> jax.ShapeDtypeStruct:
    del x64  # in the key: it decides the dtypes
    out = jax.eval_shape(
        functools.partial(
            lax.dot_general,
            dimension_numbers=dimension_numbers,
            preferred_element_type=preferred_element_type,
        ),
        jax.ShapeDtypeStruct(lhs_shape, lhs_dtype),
        jax.ShapeDtypeStruct(rhs_shape, rhs_dtype),
    )
    return jax.ShapeDtypeStruct(out.shape, np.dtype(out.dtype))


def contract(
    lqt: QTensor,
    rqt: QTensor,
    dims: Dims,
    cfg: MatmulConfig,
    out_dtype: Any,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    out_perm: Axes | None = None,
) -> jax.Array:
    """Contracts two operands quantized already, as ``cfg.mode`` says.

    Scales must factor out of the dot in real mode (shared along the
    contracting axes, or tiled); operands that are not plain
    (:attr:`QTensor.is_plain`: zero points, NF4 codes, NVFP4's two-level
    scales) are dequantized first. Integer x integer dots accumulate in int32
    where it holds every sum (see :func:`code_bound`), else in float32.

    Returns:
      The output in ``out_dtype``, transposed by ``out_perm``.
    """
    empty = 0 in lqt.shape or 0 in rqt.shape  # nothing to multiply: lax's zeros
    # Zero points, codebooks and tensor scales have no dot of their own: such
    # an operand is dequantized (the same numbers as fake mode).
    plain = lqt.is_plain and rqt.is_plain
    if cfg.mode != "real" or empty or not plain:
        out = lax.dot_general(
            lqt.dequant(),
            rqt.dequant(),
            dims.lax(),
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )
        return permute(out.astype(out_dtype), out_perm)
    lqt = _per_index_free(lqt, dims.lhs_batch + dims.lhs_free)
    rqt = _per_index_free(rqt, dims.rhs_batch + dims.rhs_free)
    a, b = dot_operand(lqt), dot_operand(rqt)
    precision = codes_precision(precision, a, b)
    if jnp.issubdtype(a.dtype, jnp.integer) and jnp.issubdtype(b.dtype, jnp.integer):
        if _int32_holds(lqt, rqt, dims, cfg):
            out = _integer_dot(lqt, rqt, dims, cfg, precision, out_perm, out_sharding)
            return out.astype(out_dtype)
        # The int32 sum could overflow: accumulate the (exact) codes in float32.
        cfg = dataclasses.replace(cfg, accumulator=np.dtype(np.float32))
    if is_byte_float(a) and is_byte_float(b):  # fp8

        def cpu(lqt: QTensor, rqt: QTensor) -> jax.Array:
            a, b = dot_operand(lqt), dot_operand(rqt)
            out = real_dot(
                a, lqt.scale, b, rqt.scale, dims, cfg, precision, out_sharding
            )
            return permute(out, out_perm).astype(out_dtype)

        def gpu(lqt: QTensor, rqt: QTensor) -> jax.Array:
            out = _gemm_layout_dot(
                lqt, rqt, dims, cfg, precision, out_perm, out_sharding,
                out_dtype=out_dtype,
            )  # fmt: skip
            return out.astype(out_dtype)

        return per_platform(lqt, rqt, cpu=cpu, default=gpu)
    out = real_dot(
        a, lqt.scale, b, rqt.scale, dims, cfg, precision, out_sharding,
        headroom=headroom(lqt, rqt, cfg),
    )  # fmt: skip
    return permute(out.astype(out_dtype), out_perm)


def _int32_holds(lqt: QTensor, rqt: QTensor, dims: Dims, cfg: MatmulConfig) -> bool:
    """Whether an int32 accumulator holds every sum of this integer dot.

    :func:`~qbits.ops._headroom.int32_holds`, with K the number of products
    summed into one output (the tile size for tiled scales).
    """
    k = 1
    for la in dims.lhs_contract:
        k *= lqt.shape[la]
    tiled = tiled_pair(lqt, lqt.scale, rqt.scale, dims)
    if tiled is not None:
        k = k // lqt.shape[dims.lhs_contract[tiled[0]]] * tiled[1]
    return int32_holds(k, lqt, rqt, cfg)


def _per_index_free(qt: QTensor, axes: Axes) -> QTensor:
    """``qt`` with block scales along ``axes`` (not contracted) made per index.

    A scale shared by a block of rows or columns (DeepSeek-V3's 128 x 128
    weight blocks) factors out of each output element like a per-channel
    one; repeating it (a small array) lets the dot treat it as one.
    """
    scale = qt.scale
    for a in axes:
        n, k = qt.shape[a], scale.shape[a]
        if k not in (1, n):
            scale = jnp.repeat(scale, n // k, axis=a)
    return qt if scale is qt.scale else qt.replace(scale=scale)


def codes_precision(precision: Any, a: jax.Array, b: jax.Array) -> Any:
    """``precision`` for a dot of two operands' codes (int8, fp8).

    A dot algorithm (``lax.DotAlgorithmPreset.BF16_BF16_F32``, which
    ``jax.nn.dot_product_attention`` and Flax's attention pass for bfloat16
    inputs) names the float types the operands are cast to: applied to
    codes it would cast int8 and fp8 to bfloat16 and run a bfloat16 GEMM
    instead of an s8 or FP8 one (and accumulate int8 products in float32).
    It describes the float matmul the codes replace, so it is dropped;
    ``lax.Precision`` values, which cast nothing, are kept.
    """
    low = all(jnp.issubdtype(x.dtype, jnp.integer) or is_byte_float(x) for x in (a, b))
    if low and isinstance(precision, lax.DotAlgorithm | lax.DotAlgorithmPreset):
        return None
    return precision


def stored_rhs(rhs: QTensor, dims: Dims) -> bool:
    """Whether a stored rhs's scale factors out of this dot as it is.

    That is the case when it was quantized for this matmul (its scale is
    shared along the contracted axes, or tiled); a forward operand reused by
    a backward matmul (``use_fwd_quant``) has its scale along axes this
    matmul contracts, and it is folded into the lhs instead
    (:func:`fold_scale_into_lhs`).
    """
    shape = rhs.scale.shape
    return all(shape[a] == 1 for a in dims.rhs_contract) or _single_tiled(
        shape, rhs, dims
    )


def _single_tiled(shape: tuple[int, ...], rhs: QTensor, dims: Dims) -> bool:
    varying = [a for a in dims.rhs_contract if shape[a] != 1]
    return len(varying) == 1 and 1 < shape[varying[0]] < rhs.shape[varying[0]]


def _integer_dot(
    lhs: QTensor,
    rhs: QTensor,
    dims: Dims,
    cfg: MatmulConfig,
    precision: Any,
    out_perm: Axes | None,
    out_sharding: Any,
) -> jax.Array:
    """An integer dot laid out for the backend: see the module docstring."""

    def cpu(lhs: QTensor, rhs: QTensor) -> jax.Array:
        swap = out_perm is not None and tuple(out_perm) == dims.swap_perm()
        a, b, d = (rhs, lhs, dims.swapped()) if swap else (lhs, rhs, dims)
        a_order = d.lhs_batch + d.lhs_free + d.lhs_contract
        b_order = _rhs_order(d)
        a_vals, a_scale = _laid_out(a, a_order, barriers=True)
        b_vals, b_scale = _laid_out(b, b_order, barriers=True)
        moved = d.moved(a_order, b_order)
        # Moving operand axes keeps the output layout; exchanging the operands
        # writes the permuted output directly.
        sharding = _permuted_sharding(out_sharding, out_perm) if swap else out_sharding
        out = real_dot(
            a_vals, a_scale, b_vals, b_scale, moved, cfg, precision, sharding
        )
        return out if swap else permute(out, out_perm)

    def gpu(lhs: QTensor, rhs: QTensor) -> jax.Array:
        return _gemm_layout_dot(lhs, rhs, dims, cfg, precision, out_perm, out_sharding)

    return per_platform(lhs, rhs, cpu=cpu, default=gpu)


def _gemm_layout_dot(
    lhs: QTensor,
    rhs: QTensor,
    dims: Dims,
    cfg: MatmulConfig,
    precision: Any,
    out_perm: Axes | None,
    out_sharding: Any,
    *,
    out_dtype: Any = None,
) -> jax.Array:
    """A byte-operand dot with both operands ``[batch, free, contracting]``.

    cuBLASLt runs int8 and fp8 GEMMs only with both operands contiguous along
    the contracting axes ("TN"). Left to itself, XLA's GPU compiler makes the
    transposes that need after fusion, as separate kernels, slow on one-byte
    elements; written here, they fuse into the quantization that produces
    the operand, and XLA sees the layout its GEMM takes.

    An FP8 dot with per-tensor scales whose output is bfloat16
    (``out_dtype``) is written in the form XLA turns into one cuBLASLt FP8
    GEMM that writes that dtype itself, the product of the two scales its
    lhs scale: ``dot(bf16(a) * s, bf16(b)) -> bf16``, ``s`` the product
    rounded to ``bf16`` (no float32 output written and converted by another
    kernel, no pass over the output for the scale). Its outputs differ from
    the float32 form's by that rounding of the scale product (a relative
    2**-9) and the output's one rounding to bf16. Not for float16: its
    range does not hold a product of two small scales (weights of amax 0.05
    and activations of amax 1 give 2.5e-7, a float16 subnormal with two
    significant bits), so a float16 output is written as float32 first.
    """
    if precision is None and cfg.accumulator == np.dtype(np.float32):
        # fp8: no fast accumulation (cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM).
        precision = lax.Precision.HIGHEST
    swap = out_perm is not None and tuple(out_perm) == dims.swap_perm()
    a, b, d = (rhs, lhs, dims.swapped()) if swap else (lhs, rhs, dims)
    a_order = d.lhs_batch + d.lhs_free + d.lhs_contract
    b_order = d.rhs_batch + d.rhs_free + d.rhs_contract
    a_vals, a_scale = _laid_out(a, a_order, barriers=False)
    b_vals, b_scale = _laid_out(b, b_order, barriers=False)
    moved = d.moved(a_order, b_order)
    sharding = _permuted_sharding(out_sharding, out_perm) if swap else out_sharding
    out = real_dot(
        a_vals, a_scale, b_vals, b_scale, moved, cfg, precision, sharding,
        one_scalar=True, out_dtype=out_dtype,
    )  # fmt: skip
    return out if swap else permute(out, out_perm)


def _rhs_order(d: Dims) -> Axes:
    """The rhs layout for an integer dot.

    The rhs stays as it is when it is ``[batch, K, N]`` or ``[batch, N, K]``
    (both run on the fast kernel, and a transpose costs a strided pass);
    otherwise it becomes ``[batch, K, N]``.
    """
    for order in (
        d.rhs_batch + d.rhs_contract + d.rhs_free,
        d.rhs_batch + d.rhs_free + d.rhs_contract,
    ):
        if order == tuple(range(d.rhs_ndim)):
            return order
    return d.rhs_batch + d.rhs_contract + d.rhs_free


def _laid_out(
    qt: QTensor, order: Axes, *, barriers: bool
) -> tuple[jax.Array, jax.Array]:
    """The dot operand and scale of ``qt``, transposed to ``order``.

    With ``barriers`` (XLA:CPU): XLA:CPU turns a bare transpose of an s8
    array into a copy and then runs the dot in s32; inside an elementwise
    computation the transposed array stays s8. Zeroing the values of blocks
    whose scale is NaN is such a computation, and a harmless one (those
    outputs are NaN through the scale). The barriers keep XLA from folding
    the transpose into the dot.
    """
    values = dot_operand(qt)
    if order == tuple(range(values.ndim)):
        return values, qt.scale
    scale = jnp.transpose(qt.scale, order)
    if not barriers:
        return jnp.transpose(values, order), scale
    values = jnp.transpose(lax.optimization_barrier(values), order)
    poisoned = jnp.isnan(expand_scale(scale, values.shape))
    values = jnp.where(poisoned, jnp.zeros_like(values), values)
    return lax.optimization_barrier(values), scale


def fold_scale_into_lhs(lhs: jax.Array, rhs_fwd: QTensor, dims: Dims) -> jax.Array:
    """``lhs * s`` where ``s`` is the rhs scale laid out along the lhs axes.

    Reusing the forward pass's rhs in a backward matmul: its scale varies
    along axes that this matmul contracts, so it cannot be applied to the
    output; it is applied to the other operand instead (exact in real
    arithmetic: ``sum_k g_k (s_k q_k) = sum_k (g_k s_k) q_k``).
    """
    scale = rhs_fwd.scale
    if any(scale.shape[a] != 1 for a in dims.rhs_free):
        raise InvalidArgumentError(
            "dot_general",
            "use_fwd_quant",
            True,
            "False for this forward quantization",
            why=f"the forward operand's scale {scale.shape} varies along axes "
            f"{dims.rhs_free} that the backward matmul does not contract "
            "(tiled scales cannot be reused)",
        )
    pairs = dict(
        zip(
            dims.lhs_contract + dims.lhs_batch,
            dims.rhs_contract + dims.rhs_batch,
            strict=True,
        )
    )
    paired = sorted(pairs)
    # Put the paired rhs axes in lhs order (free rhs axes have size 1), then
    # insert size-1 axes where the lhs has free axes.
    scale = jnp.transpose(scale, [pairs[a] for a in paired] + list(dims.rhs_free))
    shape = [
        scale.shape[paired.index(a)] if a in pairs else 1 for a in range(dims.lhs_ndim)
    ]
    return lhs.astype(jnp.float32) * scale.reshape(shape)


def _permuted_sharding(sharding: Any, perm: Axes | None) -> Any:
    """The sharding of ``transpose(out, perm)`` given ``out``'s."""
    if sharding is None or perm is None:
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
    return sharding.update(spec=type(sharding.spec)(*(spec[p] for p in perm)))
