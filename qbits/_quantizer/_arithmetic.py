"""The per-block scale arithmetic of tensors quantized together.

:func:`scales_and_inverses` turns the bounds of several tensors into their
scales and inverses in one small kernel (see its docstring);
:func:`negatives_stay_negative` keeps the sign of values that underflow
when scaled, for grids without a zero.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._platform import per_platform

__all__ = [
    "flat_vector",
    "given_scale",
    "negatives_stay_negative",
    "pre_factor",
    "scales_and_inverses",
]


def flat_vector(v: jax.Array) -> jax.Array:
    """``v`` as a flat vector, on one device.

    On several devices the scales keep their shape: merging a sharded axis
    with others has no sharding JAX can infer under explicit mesh axes
    (``AxisType.Explicit``), and under auto axes XLA's partitioner reshards
    the flat vector with all-gathers and collective-permutes (a scale keeps
    the sharding of the tensor it scales only in the tensor's shape).
    """
    spec = getattr(getattr(jax.typeof(v), "sharding", None), "spec", None)
    if jax.device_count() > 1 or (
        spec is not None and any(entry is not None for entry in spec)
    ):
        return v
    return v.reshape(-1)


def pre_factor(scale: jax.Array) -> jax.Array:
    """``2**-64`` for scales above ``2**64``, else 1 (exact, per block)."""
    big = lax.gt(scale, lax.full_like(scale, 2.0**64))
    return lax.select(big, lax.full_like(scale, 2.0**-64), lax.full_like(scale, 1))


def scales_and_inverses(
    flats: list[jax.Array], make: Any, split: bool
) -> list[tuple[jax.Array, jax.Array, jax.Array | None]]:
    """``(scale, 1 / (scale * pre), pre)`` of each flat bound (or given scale).

    ``make`` turns bounds into scales (``None`` for given scales); ``pre``
    is the exact power-of-two first step of a division by a huge scale
    (``None`` unless ``split``).

    On CPU, left to itself, XLA copies the small per-block arithmetic that
    makes a scale into every element of each large consumer (the
    quantization, the rescaled matmul output), and compiles one more kernel
    for the reciprocal it uses to divide by the scale. Stacked and divided by
    a 1 that XLA cannot see (exact), both come from one small kernel that runs
    once per block; the bounds of all the tensors are laid end to end first,
    so that the tensors quantized together share that kernel (XLA:CPU's
    compile time grows with every kernel and every operation in one). On
    several devices, and on other backends, the plain form is kept: stacked
    and sliced, a sharded scale is resharded by collectives (an all-gather
    and collective-permutes per slice), and the barrier would split the
    fusions that GPU and TPU compilers make of it. The numbers are the same
    in every form.
    """

    def arithmetic(flat: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
        scale = flat if make is None else make(flat)
        pre = pre_factor(scale) if split else None
        inverse = lax.div(
            lax.full_like(scale, 1), scale if pre is None else lax.mul(scale, pre)
        )
        return scale, inverse, pre

    def default(*flats: jax.Array) -> list[Any]:
        return [arithmetic(f) for f in flats]

    def cpu_one(flat: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
        scale, inverse, pre = arithmetic(flat)
        n = scale.shape[0]
        both = lax.concatenate([scale, inverse], 0)
        both = lax.div(both, lax.optimization_barrier(lax.full_like(both, 1)))
        return lax.slice_in_dim(both, 0, n), lax.slice_in_dim(both, n, 2 * n), pre

    def cpu(*flats: jax.Array) -> list[Any]:
        if jax.device_count() > 1:
            return default(*flats)
        if len(flats) == 1:
            return [cpu_one(flats[0])]
        scale, inverse, pre = cpu_one(lax.concatenate(flats, 0))
        out, start = [], 0
        for f in flats:
            stop = start + f.shape[0]
            scale_f, inverse_f = (
                lax.slice_in_dim(v, start, stop) for v in (scale, inverse)
            )
            pre_f = None if pre is None else lax.slice_in_dim(pre, start, stop)
            out.append((scale_f, inverse_f, pre_f))
            start = stop
        return out

    return per_platform(*flats, cpu=cpu, default=default)


@jax.custom_jvp
def negatives_stay_negative(y: jax.Array, x: jax.Array) -> jax.Array:
    """``y`` (``x`` scaled), where a negative ``x`` became a zero: -tiny.

    The smallest negative normal rounds to the grid's negative value
    nearest 0 (``floor(y) + 0.5``), as ``x`` itself would.
    """
    tiny = np.asarray(-np.finfo(y.dtype).tiny, y.dtype)
    # x < 0 by its bits: XLA:CPU compares a negative subnormal as a zero.
    signed = np.dtype(f"int{np.dtype(x.dtype).itemsize * 8}")
    bits = lax.bitcast_convert_type(x, signed)
    negative = lax.bitwise_and(
        lax.lt(bits, np.asarray(0, signed)),
        lax.ne(bits, np.asarray(np.iinfo(signed).min, signed)),  # not -0.0
    )
    lost = lax.bitwise_and(lax.eq(y, lax.full_like(y, 0)), negative)
    return lax.select(lost, lax.full_like(y, tiny), y)


@negatives_stay_negative.defjvp
def negatives_stay_negative_jvp(primals: Any, tangents: Any) -> Any:
    # y's own derivative: what the flushed zero was replaced by is a constant
    # only in value, not in the straight-through gradient.
    return negatives_stay_negative(*primals), tangents[0]


def given_scale(scale: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A given scale as an array of the scale ``shape``, in the compute ``dtype``.

    (float32, or float64 for a float64 tensor under ``jax_enable_x64``: the
    dtype the scale arithmetic of a computed scale runs in.)
    """
    scale = jnp.asarray(scale)
    if scale.size != int(np.prod(shape)):
        raise InvalidArgumentError(
            "Quantizer.quant",
            "scale.shape",
            scale.shape,
            f"a scale of shape {shape} (one entry per block)",
        )
    return scale.reshape(shape).astype(dtype)
