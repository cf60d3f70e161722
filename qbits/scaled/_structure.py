"""Scaled rules that move data without arithmetic, and nested jaxprs.

Shape operations (reshape, transpose, broadcast, slice, gather, ...) act on
the data and keep the scale. Operations that combine several tensors into
one (concatenate, pad, dynamic_update_slice, scatter) first put them on a
common scale. Nested jaxprs (``jit``, ``checkpoint``, custom derivatives)
are evaluated recursively; a ``custom_jvp`` function registered as a
*marker* (``dynamic_rescale_*``, ``cast_ml_dtype``) runs its scaled rule
instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qbits._platform import traced_for_p
from qbits.scaled._array import ScaledArray
from qbits.scaled._interpreter import (
    Const,
    UnsupportedPrimitiveError,
    eval_closed,
    plain,
    register_rule,
)
from qbits.scaled._rules import (
    accumulate_dtype,
    align,
    at_scale,
    data_dtype,
    finish,
    promote,
    scale32,
    sum_like,
)

__all__ = ["register_marker"]

_MARKERS: dict[str, Callable[..., Any]] = {}


def register_marker(name: str, rule: Callable[..., Any]) -> None:
    """Makes ``custom_jvp`` functions named ``name`` run ``rule`` on ScaledArrays."""
    _MARKERS[name] = rule


def _on_data(prim: Any):
    """The primitive applied to the data of its first operand; scale kept."""

    def rule(x: ScaledArray, *rest: Any, **params: Any) -> Any:
        out = prim.bind(x.data, *rest, **params)
        if prim.multiple_results:
            return [ScaledArray(o, x.scale) for o in out]
        return ScaledArray(out, x.scale)

    return rule


def _permute(prim: Any):
    """sort, top_k: reorder elements (a positive scale keeps their order).

    Output ``i`` takes the scale of operand ``i`` when that was scaled.
    """

    def rule(*xs: Any, **params: Any) -> list[Any]:
        xs_list = [promote(x) if isinstance(x, Const) else x for x in xs]
        datas = [x.data if isinstance(x, ScaledArray) else x for x in xs_list]
        outs = prim.bind(*datas, **params)
        return [
            ScaledArray(o, x.scale)
            if isinstance(x, ScaledArray) and jnp.issubdtype(o.dtype, jnp.floating)
            else o
            for o, x in zip(outs, xs_list + [None] * len(outs), strict=False)
        ]

    return rule


def _reduce(*xs: Any, jaxpr: Any, **params: Any) -> list[Any]:
    """A variadic ``lax.reduce`` whose computation is elementwise max / min.

    Max and min commute with a positive scale, so each scaled operand is
    reduced on its data (its init value moved to data units) and keeps its
    scale. Other computations have no scaled rule.
    """
    eqns = jaxpr.jaxpr.eqns
    if not all(e.primitive.name in ("max", "min") for e in eqns):
        raise UnsupportedPrimitiveError(
            "reduce (with a computation other than max/min)"
        )
    n = len(xs) // 2
    operands, inits = list(xs[:n]), list(xs[n:])
    datas, init_datas = [], []
    for x, init in zip(operands, inits, strict=True):
        if isinstance(x, ScaledArray):
            datas.append(x.data)
            init_datas.append(at_scale(init, scale32(x), x.dtype))
        else:
            datas.append(plain(x))
            init_datas.append(plain(init))
    outs = lax.reduce_p.bind(*datas, *init_datas, jaxpr=jaxpr, **params)
    return [
        ScaledArray(o, x.scale) if isinstance(x, ScaledArray) else o
        for o, x in zip(outs, operands, strict=True)
    ]


def _window_sum(x: ScaledArray, **params: Any) -> ScaledArray:
    acc = accumulate_dtype(x.dtype)
    summed = lax.reduce_window_sum_p.bind(jnp.asarray(x.data, acc), **params)
    return sum_like(x, math.prod(params["window_dimensions"]), summed)


def _select_and_scatter_add(source: Any, operand: Any, **params: Any) -> Any:
    """Max-pool gradient: positions chosen by ``operand``, values from ``source``."""
    chooser = operand.data if isinstance(operand, ScaledArray) else plain(operand)
    if not isinstance(source, ScaledArray):
        return lax.select_and_scatter_add_p.bind(plain(source), chooser, **params)
    out = lax.select_and_scatter_add_p.bind(source.data, chooser, **params)
    return ScaledArray(out, source.scale)


def _combine(prim: Any, operands: Callable[[int], list[int]]):
    """Operands at positions ``operands(n)`` aligned on one scale, then bound."""

    def rule(*xs: Any, **params: Any) -> ScaledArray:
        xs_list = list(xs)
        where = operands(len(xs_list))
        scaled = [xs_list[i] for i in where]
        dtype = data_dtype(scaled)
        datas, s = align(scaled)
        for i, d in zip(where, datas, strict=True):
            xs_list[i] = d.astype(dtype)
        return finish(prim.bind(*xs_list, **params), s, scaled)

    return rule


def _flat_rule(prim: Any):
    """``optimization_barrier``: data and scales pass through together."""

    def rule(*xs: Any, **params: Any) -> list[Any]:
        leaves, tree = jax.tree.flatten(list(xs))
        return jax.tree.unflatten(tree, prim.bind(*leaves, **params))

    return rule


def _call(jaxpr_param: str):
    def rule(*xs: Any, **params: Any) -> list[Any]:
        return eval_closed(params[jaxpr_param], *xs)

    return rule


def _function_name(closed: Any) -> str:
    """The name of the Python function a custom_jvp_call traced."""
    jaxpr = getattr(closed, "jaxpr", closed)
    return getattr(getattr(jaxpr, "debug_info", None), "func_name", "") or ""


def _custom_jvp_call(*xs: Any, call_jaxpr: Any, **_: Any) -> list[Any]:
    marker = _MARKERS.get(_function_name(call_jaxpr))
    if marker is not None:
        return [marker(*xs)]
    return eval_closed(call_jaxpr, *xs)


def _custom_vjp_call(*xs: Any, **params: Any) -> list[Any]:
    jaxpr = params.get("call_jaxpr", params.get("fun_jaxpr"))
    return eval_closed(jaxpr, *xs)


def _register() -> None:
    for name in (
        "transpose",
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "rev",
        "slice",
        "dynamic_slice",
        "gather",
        "reduce_max",
        "reduce_min",
        "cummax",
        "cummin",
        "copy",
        "copy_p",
        "reduce_precision",
        "stop_gradient",
        "split",
        "reduce_window_max",
        "reduce_window_min",
    ):
        prim = getattr(lax, f"{name}_p", None)
        if prim is not None:
            register_rule(prim.name, _on_data(prim))
    register_rule("concatenate", _combine(lax.concatenate_p, lambda n: list(range(n))))
    register_rule("pad", _combine(lax.pad_p, lambda n: [0, 1]))
    register_rule(
        "dynamic_update_slice", _combine(lax.dynamic_update_slice_p, lambda n: [0, 1])
    )
    for prim in (
        lax.scatter_p,
        lax.scatter_add_p,
        lax.scatter_max_p,
        lax.scatter_min_p,
    ):
        register_rule(prim.name, _combine(prim, lambda n: [0, 2]))
    register_rule("optimization_barrier", _flat_rule(lax.optimization_barrier_p))
    register_rule(traced_for_p.name, _on_data(traced_for_p))
    register_rule("reduce", _reduce)
    register_rule("sort", _permute(lax.sort_p))
    register_rule("top_k", _permute(lax.top_k_p))
    register_rule("reduce_window_sum", _window_sum)
    register_rule("select_and_scatter_add", _select_and_scatter_add)

    for name in ("jit", "pjit", "closed_call", "core_call"):
        register_rule(name, _call("jaxpr" if name in ("jit", "pjit") else "call_jaxpr"))
    for name in ("remat2", "checkpoint", "remat"):
        register_rule(name, _call("jaxpr"))
    register_rule("custom_jvp_call", _custom_jvp_call)
    # A narrow data dtype does not bound a ScaledArray's values: the cap that
    # keeps a quantized grid inside an input's dtype does not apply.
    register_marker("fit_scale_to_dtype", lambda scale: scale)
    for name in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
        register_rule(name, _custom_vjp_call)


_register()
