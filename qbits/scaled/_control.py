"""Scaled rules for control flow: ``cond``, ``scan`` and ``while``.

A loop carry must have the same type on every iteration, so a carry slot is
a ScaledArray in all iterations or in none: the rules find the fixed point
(promote a plain initial value whose update comes out scaled) and give
carried ScaledArrays float32 scales. ``cond`` branches are made to agree the
same way. A ScaledArray scanned over (``xs``) shares its scale across the
iterations; stacked outputs (``ys``) are aligned on the largest
per-iteration scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qbits._jaxpr import scan_counts
from qbits.scaled._array import ScaledArray
from qbits.scaled._interpreter import eval_closed, plain, register_rule
from qbits.scaled._rules import F32, promote, scale32

__all__: list[str] = []


def _normalize(values: list[Any], kinds: list[bool]) -> list[Any]:
    """ScaledArrays (float32 scales) where ``kinds`` says so, arrays elsewhere."""
    out = []
    for v, scaled in zip(values, kinds, strict=True):
        if not scaled:
            out.append(plain(v))
            continue
        s = promote(v)
        out.append(ScaledArray(s.data, scale32(s)))
    return out


def _kinds(values: list[Any]) -> list[bool]:
    return [isinstance(v, ScaledArray) for v in values]


def _fixed_point(
    step: Callable[[list[Any], list[Any]], list[Any]], init: list[Any], extra: list[Any]
) -> tuple[list[bool], list[Any]]:
    """Kinds of the carry that ``step(carry, extra)`` maps to themselves.

    Returns the kinds and the initial carry normalized to them.
    """
    kinds = _kinds(init)
    for _ in range(len(init) + 1):
        carry = _normalize(init, kinds)
        out = jax.eval_shape(lambda c, e: [plain(v) for v in step(c, e)], carry, extra)
        new = [k or isinstance(o, ScaledArray) for k, o in zip(kinds, out, strict=True)]
        if new == kinds:
            return kinds, carry
        kinds = new
    raise RuntimeError("scalify: loop carry types did not settle")  # unreachable


def _cond(index: Any, *ops: Any, branches: Any, **_: Any) -> list[Any]:
    ops_list = [plain(o) for o in ops]
    kinds = [False] * len(branches[0].out_avals)
    for branch in branches:
        out = jax.eval_shape(
            lambda *a, b=branch: [plain(v) for v in eval_closed(b, *a)], *ops_list
        )
        kinds = [
            k or isinstance(o, ScaledArray) for k, o in zip(kinds, out, strict=True)
        ]

    def run(branch: Any) -> Callable[..., list[Any]]:
        return lambda *a: _normalize(eval_closed(branch, *a), kinds)

    return lax.switch(index, [run(b) for b in branches], *ops_list)


def _split_scanned(xs: list[Any]) -> tuple[list[Any], list[Any]]:
    """Scanned-over operands as arrays, plus the scales to re-attach."""
    datas, scales = [], []
    for x in xs:
        x = plain(x)
        datas.append(x.data if isinstance(x, ScaledArray) else x)
        scales.append(x.scale if isinstance(x, ScaledArray) else None)
    return datas, scales


def _scan(
    *args: Any, jaxpr: Any, length: int, reverse: bool, unroll: Any, **params: Any
) -> list[Any]:
    num_consts, num_carry = scan_counts(params)
    consts = [plain(c) for c in args[:num_consts]]
    init = list(args[num_consts : num_consts + num_carry])
    xs_data, xs_scales = _split_scanned(list(args[num_consts + num_carry :]))

    def attach(x_slice: list[Any]) -> list[Any]:
        return [
            d if s is None else ScaledArray(d, s)
            for d, s in zip(x_slice, xs_scales, strict=True)
        ]

    x0 = [jax.ShapeDtypeStruct(d.shape[1:], d.dtype) for d in xs_data]

    def carry_step(carry: list[Any], x_slice: list[Any]) -> list[Any]:
        return eval_closed(jaxpr, *consts, *carry, *x_slice)[:num_carry]

    kinds, carry = _fixed_point(carry_step, init, attach(x0))

    def body(c: list[Any], x_slice: list[Any]) -> tuple[list[Any], list[Any]]:
        out = eval_closed(jaxpr, *consts, *c, *attach(x_slice))
        ys = []
        for y in out[num_carry:]:
            y = plain(y)
            ys.append((y.data, scale32(y)) if isinstance(y, ScaledArray) else y)
        return _normalize(out[:num_carry], kinds), ys

    carry, ys = lax.scan(body, carry, xs_data, length=length, reverse=reverse,
                         unroll=unroll)  # fmt: skip
    return list(carry) + [_stack(y) for y in ys]


def _stack(y: Any) -> Any:
    """Stacked per-iteration ``(data, scale)`` as one ScaledArray."""
    if not isinstance(y, tuple):
        return y
    data, scales = y
    s = jnp.max(scales)
    ratio = (scales / s).reshape((-1,) + (1,) * (data.ndim - 1))
    compute = F32 if data.dtype.itemsize < 4 else data.dtype
    return ScaledArray((data.astype(compute) * ratio).astype(data.dtype), s)


def _while(
    *args: Any, cond_jaxpr: Any, body_jaxpr: Any, cond_nconsts: int,
    body_nconsts: int, **_: Any,
) -> list[Any]:  # fmt: skip
    cond_consts = [plain(c) for c in args[:cond_nconsts]]
    body_consts = [plain(c) for c in args[cond_nconsts : cond_nconsts + body_nconsts]]
    init = list(args[cond_nconsts + body_nconsts :])

    def step(carry: list[Any], _: list[Any]) -> list[Any]:
        return eval_closed(body_jaxpr, *body_consts, *carry)

    kinds, carry = _fixed_point(step, init, [])
    return lax.while_loop(
        lambda c: plain(eval_closed(cond_jaxpr, *cond_consts, *c)[0]),
        lambda c: _normalize(step(c, []), kinds),
        carry,
    )


register_rule("cond", _cond)
register_rule("scan", _scan)
register_rule("while", _while)
