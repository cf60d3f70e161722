"""Scaled rules for arithmetic: elementwise, reductions, matmul, conv.

Unit-scaling rules (Blake et al., "Unit Scaling", 2023): assuming the data of
each input has unit scale, choose the output scale so that the output data
has unit scale too. ``a + b``: ``sqrt(sa**2 + sb**2)``; a sum of ``N``
terms or a matmul contracting ``K`` elements: ``sqrt(N)`` / ``sqrt(K)``
times the input scales; ``mul``/``div``: the product/quotient of the scales
(exact). New scales are rounded (power of two by default) so that moving a
factor between data and scale is exact. Functions without a useful scale
rule (``exp``, ``tanh``, ...) are evaluated on the value in float32 and
returned with scale 1 (bounded functions) or ``min(scale, 1)`` (functions
that behave like ``x`` near zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._calibration import round_scale
from qbits.scaled._array import E8M0, ScaledArray, pow2_split
from qbits.scaled._interpreter import Const, current_rounding, register_rule

F32 = jnp.float32


def scale32(x: ScaledArray) -> jax.Array:
    """The scale of ``x`` as a float32 scalar."""
    return jnp.asarray(x.scale).astype(F32)


def compute_dtype(dtype: Any) -> np.dtype:
    """Arithmetic on 8-bit (or smaller) data runs in float32, else in place."""
    dtype = np.dtype(dtype)
    return np.dtype(F32) if dtype.itemsize < 2 else dtype


def accumulate_dtype(dtype: Any) -> np.dtype:
    """Sums and matmuls of sub-32-bit data accumulate in float32."""
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype(F32)


def scaled_operands(xs: list[Any]) -> list[ScaledArray]:
    """The ScaledArrays among the operands."""
    return [x for x in xs if isinstance(x, ScaledArray)]


def data_dtype(xs: list[Any]) -> np.dtype:
    """The dtype of the result's data: the data dtype of the ScaledArrays."""
    return scaled_operands(xs)[0].dtype


def _e8m0_out(xs: list[Any]) -> bool:
    scaled = scaled_operands(xs)
    return all(np.dtype(jnp.asarray(x.scale).dtype) == E8M0 for x in scaled)


def choose_scale(exact: Any, xs: list[Any]) -> jax.Array:
    """Rounds a new (positive) scale; non-positive or NaN becomes 1."""
    mode = current_rounding()
    if mode == "none" and _e8m0_out(xs):
        mode = "pow2"
    exact = jnp.asarray(exact, F32)
    rounded = round_scale(exact, mode)
    return jnp.where(exact > 0, rounded, jnp.ones_like(rounded))


def finish(data: jax.Array, scale: jax.Array, xs: list[Any]) -> ScaledArray:
    """A ScaledArray whose scale dtype is E8M0 when every input's is."""
    scale_dtype = E8M0 if _e8m0_out(xs) else np.dtype(F32)
    return ScaledArray(data, jnp.asarray(scale, F32).astype(scale_dtype))


def make(data: jax.Array, exact: Any, xs: list[Any], dtype: Any) -> ScaledArray:
    """Data (in a compute dtype) at scale ``exact``, after rounding the scale."""
    s = choose_scale(exact, xs)
    data = data * (jnp.asarray(exact, F32) / s).astype(data.dtype)
    return finish(data.astype(dtype), s, xs)


def magnitude(x: Any) -> Any:
    """The scale an operand contributes to ``add``: its scale, |c|, or 1."""
    if isinstance(x, ScaledArray):
        return scale32(x)
    if isinstance(x, Const):
        return np.abs(x.value)
    return np.float32(1)


def at_scale(x: Any, s: jax.Array, dtype: Any) -> jax.Array:
    """The data representing operand ``x`` at scale ``s``, in ``dtype``."""
    if isinstance(x, ScaledArray):
        return jnp.asarray(x.data, dtype) * (scale32(x) / s).astype(dtype)
    if isinstance(x, Const):
        return jnp.broadcast_to((x.value / s).astype(dtype), x.shape)
    wide = accumulate_dtype(dtype)  # divide before narrowing: no overflow
    return (jnp.asarray(x, wide) * (1 / s).astype(wide)).astype(dtype)


def align(xs: list[Any], dtype: Any = None) -> tuple[list[jax.Array], jax.Array]:
    """Represents operands on one scale: the largest scale among them.

    Constants and plain arrays take the ScaledArrays' scale; the data of a
    ScaledArray with a smaller scale is divided down (never up, so nothing
    overflows). With one ScaledArray, its data is returned untouched.
    """
    scaled = scaled_operands(xs)
    dtype = compute_dtype(scaled[0].dtype) if dtype is None else np.dtype(dtype)
    if len(scaled) == 1:
        s = scale32(scaled[0])
        return [
            jnp.asarray(x.data, dtype) if x is scaled[0] else at_scale(x, s, dtype)
            for x in xs
        ], s
    s = scale32(scaled[0])
    for x in scaled[1:]:
        s = jnp.maximum(s, scale32(x))
    return [at_scale(x, s, dtype) for x in xs], s


def value(x: Any) -> jax.Array:
    """The represented value in float32 (at least)."""
    if isinstance(x, ScaledArray):
        return jnp.asarray(x.data, accumulate_dtype(x.dtype)) * scale32(x)
    if isinstance(x, Const):
        return x.materialize().astype(accumulate_dtype(x.dtype))
    return x


def promote(x: Any) -> ScaledArray:
    """Any float operand as a ScaledArray (constants: pow2-split, exact)."""
    if isinstance(x, ScaledArray):
        return x
    if isinstance(x, Const):
        mantissa, power = pow2_split(x.value)
        return ScaledArray(
            jnp.full(x.shape, mantissa, x.dtype), jnp.asarray(power, F32)
        )
    return ScaledArray(x, jnp.ones((), F32))


# -- elementwise binary -------------------------------------------------------


def _add_rule(sign: float):
    def rule(a: Any, b: Any, **_: Any) -> ScaledArray:
        xs = [a, b]
        dtype = data_dtype(xs)
        cdt = compute_dtype(dtype)
        s = choose_scale(jnp.hypot(magnitude(a), magnitude(b)), xs)
        data = at_scale(a, s, cdt) + sign * at_scale(b, s, cdt)
        return finish(data.astype(dtype), s, xs)

    return rule


def _factor(x: Any) -> tuple[Any, Any]:
    """(data factor, scale factor) of an operand of ``mul``/``div``."""
    if isinstance(x, ScaledArray):
        return x.data, scale32(x)
    if isinstance(x, Const):
        mantissa, power = pow2_split(x.value)
        return jnp.broadcast_to(mantissa, x.shape), power
    return x, np.float32(1)


def _mul(a: Any, b: Any, **_: Any) -> ScaledArray:
    xs = [a, b]
    dtype = data_dtype(xs)
    cdt = compute_dtype(dtype)
    (da, sa), (db, sb) = _factor(a), _factor(b)
    return make(jnp.asarray(da, cdt) * jnp.asarray(db, cdt), sa * sb, xs, dtype)


def _div(a: Any, b: Any, **_: Any) -> ScaledArray:
    xs = [a, b]
    dtype = data_dtype(xs)
    cdt = compute_dtype(dtype)
    (da, sa), (db, sb) = _factor(a), _factor(b)
    return make(jnp.asarray(da, cdt) / jnp.asarray(db, cdt), sa / sb, xs, dtype)


def _aligned(fn: Any):
    """max, min, rem, clamp: elementwise on data at a common scale."""

    def rule(*xs: Any, **params: Any) -> ScaledArray:
        dtype = data_dtype(list(xs))
        datas, s = align(list(xs))
        return finish(fn(*datas, **params).astype(dtype), s, list(xs))

    return rule


def _compare(prim: Any):
    def rule(a: Any, b: Any, **params: Any) -> jax.Array:
        datas, _ = align([a, b], F32)
        return prim.bind(*datas, **params)

    return rule


def _select_n(pred: Any, *cases: Any, **_: Any) -> ScaledArray:
    dtype = data_dtype(list(cases))
    datas, s = align(list(cases))
    return finish(lax.select_n(pred, *datas).astype(dtype), s, list(cases))


def _atan2(a: Any, b: Any, **_: Any) -> ScaledArray:
    # Scale-invariant: atan2(y * s, x * s) == atan2(y, x).
    dtype = data_dtype([a, b])
    (da, db), _ = align([a, b], F32)
    return finish(jnp.arctan2(da, db).astype(dtype), jnp.ones((), F32), [a, b])


# -- elementwise unary ----------------------------------------------------------


def _unary_on_data(fn: Any):
    def rule(x: ScaledArray, **params: Any) -> ScaledArray:
        return ScaledArray(fn(x.data, **params), x.scale)

    return rule


def _sign(x: ScaledArray, **_: Any) -> ScaledArray:
    return finish(jnp.sign(x.data), jnp.ones((), F32), [x])


def _is_finite(x: ScaledArray, **_: Any) -> jax.Array:
    return jnp.isfinite(x.data) & jnp.isfinite(scale32(x))


def _power_rule(prim: Any, scale_fn: Any):
    """sqrt, rsqrt, cbrt, integer_pow, square: data and scale both mapped.

    The data goes through the primitive, the scale through
    ``scale_fn(scale, y)`` (``y``: integer_pow's exponent).
    """

    def rule(x: ScaledArray, **params: Any) -> ScaledArray:
        cdt = compute_dtype(x.dtype)
        data = prim.bind(jnp.asarray(x.data, cdt), **params)
        return make(data, scale_fn(scale32(x), params.get("y")), [x], x.dtype)

    return rule


def _on_value(prim: Any, out_scale: str):
    """Evaluates ``prim`` (or a function) on the value in float32.

    The output scale is chosen by ``out_scale``:

    ``"unit"``: 1 (bounded or slowly growing outputs, e.g. exp of a logit);
    ``"small"``: ``min(scale, 1)`` (``f(x) ~ x`` near 0, e.g. tanh);
    ``"same"``: the input's scale (round, floor, ceil).
    """

    def rule(*xs: Any, **params: Any) -> ScaledArray:
        xs_list = list(xs)
        dtype = data_dtype(xs_list)
        fn = prim.bind if hasattr(prim, "bind") else prim
        out = fn(*[jnp.asarray(value(x), F32) for x in xs_list], **params)
        s_in = scale32(scaled_operands(xs_list)[0])
        if out_scale == "unit":
            return finish(out.astype(dtype), jnp.ones((), F32), xs_list)
        s = choose_scale(
            s_in if out_scale == "same" else jnp.minimum(s_in, 1.0), xs_list
        )
        return finish((out / s).astype(dtype), s, xs_list)

    return rule


def _convert_element_type(x: ScaledArray, *, new_dtype: Any, **params: Any) -> Any:
    if jnp.issubdtype(new_dtype, jnp.floating):
        return ScaledArray(
            lax.convert_element_type_p.bind(x.data, new_dtype=new_dtype, **params),
            x.scale,
        )
    return lax.convert_element_type_p.bind(value(x), new_dtype=new_dtype, **params)


# -- reductions ---------------------------------------------------------------------


def sum_like(x: ScaledArray, n: int, summed: jax.Array) -> ScaledArray:
    """A sum of ``n`` terms of ``x``'s data (``summed``): scale grows by sqrt(n)."""
    s_in = scale32(x)
    s = choose_scale(s_in * np.float32(math.sqrt(max(n, 1))), [x])
    data = summed * (s_in / s).astype(summed.dtype)
    return finish(data.astype(x.dtype), s, [x])


def _reduce_sum(x: ScaledArray, *, axes: tuple[int, ...], **_: Any) -> ScaledArray:
    n = math.prod(x.shape[a] for a in axes)
    acc = accumulate_dtype(x.dtype)
    return sum_like(x, n, jnp.sum(jnp.asarray(x.data, acc), axis=tuple(axes)))


def _cumsum(x: ScaledArray, *, axis: int, reverse: bool, **_: Any) -> ScaledArray:
    acc = accumulate_dtype(x.dtype)
    summed = lax.cumsum(jnp.asarray(x.data, acc), axis=axis, reverse=reverse)
    return sum_like(x, x.shape[axis], summed)


def _arg_reduce(prim: Any):
    def rule(x: ScaledArray, **params: Any) -> jax.Array:
        return prim.bind(x.data, **params)

    return rule


# -- matmul and conv -------------------------------------------------------------


def _binder(primitive: Any, **params: Any) -> Callable[..., jax.Array]:
    """``run(a, b, accumulator dtype)``: the primitive bound with its params."""

    def run(da: jax.Array, db: jax.Array, acc: Any) -> jax.Array:
        return primitive.bind(da, db, preferred_element_type=acc, **params)

    return run


def _contracting_matmul(
    a: Any, b: Any, k: int, run: Any, out_dtype: Any
) -> ScaledArray:
    """``run(lhs_data, rhs_data, acc_dtype)`` contracting ``k`` elements."""
    like = scaled_operands([a, b])[0]
    a, b = promote(a), promote(b)
    da, db = jnp.asarray(a.data), jnp.asarray(b.data)
    if da.dtype != db.dtype and not (da.dtype.itemsize == db.dtype.itemsize == 1):
        # fp8 x fp8 of two formats (E4M3 x E5M2) stays as it is: the pattern
        # XLA's GPU compiler turns into an FP8 GEMM. Other mixes widen.
        common = F32 if min(da.dtype.itemsize, db.dtype.itemsize) == 1 else None
        common = common or jnp.promote_types(da.dtype, db.dtype)
        da, db = da.astype(common), db.astype(common)
    acc = accumulate_dtype(da.dtype)
    product = scale32(a) * scale32(b)
    s = choose_scale(product * np.float32(math.sqrt(max(k, 1))), [a, b])
    out = run(da, db, acc) * (product / s).astype(acc)
    dtype = out_dtype if out_dtype is not None else like.dtype
    return finish(out.astype(dtype), s, [a, b])


def _dot_general(
    a: Any,
    b: Any,
    *,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    **params: Any,
) -> ScaledArray:
    (lhs_contract, _), _ = dimension_numbers
    k = math.prod(a.shape[i] for i in lhs_contract)
    run = _binder(lax.dot_general_p, dimension_numbers=dimension_numbers,
                  precision=precision, **params)  # fmt: skip
    return _contracting_matmul(a, b, k, run, preferred_element_type)


def _conv(
    a: Any,
    b: Any,
    *,
    dimension_numbers: Any,
    preferred_element_type: Any = None,
    **params: Any,
) -> ScaledArray:
    rhs_spec = dimension_numbers.rhs_spec  # (out, in, spatial...)
    k = math.prod(b.shape[d] for d in rhs_spec[1:])
    run = _binder(lax.conv_general_dilated_p, dimension_numbers=dimension_numbers,
                  **params)  # fmt: skip
    return _contracting_matmul(a, b, k, run, preferred_element_type)


def _register() -> None:
    for name, sign in (("add", 1.0), ("add_any", 1.0), ("sub", -1.0)):
        register_rule(name, _add_rule(sign))
    register_rule("mul", _mul)
    register_rule("div", _div)
    register_rule("max", _aligned(lax.max))
    register_rule("min", _aligned(lax.min))
    register_rule("rem", _aligned(lax.rem))
    register_rule("clamp", _aligned(lax.clamp))
    register_rule("select_n", _select_n)
    register_rule("atan2", _atan2)
    for prim in (lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p):
        register_rule(prim.name, _compare(prim))
    register_rule("neg", _unary_on_data(lax.neg))
    register_rule("abs", _unary_on_data(lax.abs))
    register_rule("sign", _sign)
    register_rule("is_finite", _is_finite)
    register_rule("sqrt", _power_rule(lax.sqrt_p, lambda s, _: jnp.sqrt(s)))
    register_rule("rsqrt", _power_rule(lax.rsqrt_p, lambda s, _: lax.rsqrt(s)))
    register_rule("cbrt", _power_rule(lax.cbrt_p, lambda s, _: jnp.cbrt(s)))
    register_rule("square", _power_rule(lax.square_p, lambda s, _: s * s))
    register_rule("integer_pow", _power_rule(lax.integer_pow_p, lax.integer_pow))
    unit = (
        "exp",
        "exp2",
        "log",
        "logistic",
        "cos",
        "cosh",
        "acos",
        "acosh",
        "atanh",
        "erfc",
        "erf_inv",
        "lgamma",
        "digamma",
        "pow",
    )
    small = (
        "tanh",
        "sin",
        "tan",
        "asin",
        "atan",
        "sinh",
        "asinh",
        "erf",
        "expm1",
        "log1p",
    )
    same = ("round", "floor", "ceil")
    for kind, names in (("unit", unit), ("small", small), ("same", same)):
        for name in names:
            register_rule(name, _on_value(getattr(lax, f"{name}_p"), kind))
    register_rule("convert_element_type", _convert_element_type)
    register_rule("reduce_sum", _reduce_sum)
    register_rule("cumsum", _cumsum)
    register_rule("cumlogsumexp", _on_value(lax.cumlogsumexp_p, "unit"))
    # tanh's derivative, a primitive of its own from jax 0.12 on.
    register_rule(
        "one_minus_square", _on_value(lambda t: (1.0 + t) * (1.0 - t), "unit")
    )
    register_rule("argmax", _arg_reduce(lax.argmax_p))
    register_rule("argmin", _arg_reduce(lax.argmin_p))
    register_rule("dot_general", _dot_general)
    register_rule("conv_general_dilated", _conv)


_register()
