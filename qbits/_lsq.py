"""Learned step sizes (LSQ): fake quantization whose scale is trained.

Layer 2 (beside calibration; it uses numerics only): the math of
:class:`~qbits.LearnedScale`. Esser et al., "Learned Step Size
Quantization" (arXiv 1902.08153).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from qbits._errors import InvalidArgumentError, check_choice
from qbits._formats import compute_dtype
from qbits.numerics import QNumerics

__all__ = ["LSQ_INITS", "grid_max", "init_step", "lsq_quantize"]

#: How a learned step starts: LSQ's ``2 mean|x| / sqrt(Q_p)`` or the absmax.
LSQ_INITS: tuple[str, ...] = ("lsq", "absmax")


def grid_max(numerics: QNumerics) -> float:
    """:math:`Q_p`: the largest value ``numerics`` puts on its grid.

    Example:
      >>> qbits._lsq.grid_max(qbits.IntNumerics(bits=8))
      127.0
      >>> qbits._lsq.grid_max(qbits.IntNumerics(bits=4))
      7.0
    """
    mapped = numerics.abs_val_mapped_to()
    if mapped is None or getattr(numerics, "noise_fn", None) is not None:
        raise InvalidArgumentError(
            "LearnedScale",
            "numerics",
            numerics,
            "numerics with a grid edge and rounding to nearest (int, fp)",
        )
    return _grid_max(numerics, float(mapped))


@functools.lru_cache(maxsize=64)
def _grid_max(numerics: QNumerics, mapped: float) -> float:
    with jax.ensure_compile_time_eval():  # concrete even inside a trace
        return float(numerics.fwd(jnp.asarray(4.0 * mapped, jnp.float32), None))


def init_step(x: jax.Array, numerics: QNumerics, init: str = "lsq") -> jax.Array:
    r"""The initial step size from a first batch, float32 scalar.

    ``"lsq"``: :math:`2\,\mathrm{mean}|x| / \sqrt{Q_p}`; ``"absmax"``:
    :math:`\\max|x|` divided by the value the grid maps its bound onto. A
    zero tensor gives step 1.

    Example:
      >>> qbits._lsq.init_step(jnp.array([1.0, -3.0]), qbits.IntNumerics(bits=4))
      Array(1.5118579, dtype=float32)
    """
    check_choice("init_step", "init", init, LSQ_INITS)
    x = jnp.abs(jnp.asarray(x).astype(jnp.float32))
    if init == "lsq":
        step = 2.0 * jnp.mean(x) / math.sqrt(grid_max(numerics))
    else:
        step = jnp.max(x) / numerics.abs_val_mapped_to()
    return jnp.where(step > 0, step, jnp.ones_like(step))


def lsq_quantize(numerics: QNumerics, x: jax.Array, step: jax.Array) -> jax.Array:
    r"""Fake-quantizes ``x`` with step ``step``, with LSQ gradients.

    Forward: :math:`\hat{x} = Q(x / s) \cdot s` with ``Q = numerics``.
    Backward: ``x`` gets ``g`` where :math:`-Q_p < v < Q_p` and 0 outside;
    ``step`` gets :math:`\sum g \cdot (Q(v) - v \cdot \mathbb{1}_{in})
    / \sqrt{N Q_p}` over the elements sharing it (N of them).

    Args:
      numerics: The grid (rounding to nearest).
      x: The tensor.
      step: The step size, broadcastable to ``x`` (a scalar per tensor).

    Returns:
      ``x`` quantized and dequantized, ``x``'s dtype.

    Example:
      >>> q = qbits.IntNumerics(bits=4)
      >>> x = jnp.array([0.26, 3.0])
      >>> qbits._lsq.lsq_quantize(q, x, jnp.float32(0.1))
      Array([0.3, 0.7], dtype=float32)
      >>> jax.grad(lambda s: qbits._lsq.lsq_quantize(q, x, s).sum())(jnp.float32(0.1))
      Array(1.9777331, dtype=float32)
    """
    x = jnp.asarray(x)
    step = jnp.asarray(step, jnp.float32)
    n = x.size // max(step.size, 1)
    grad_scale = 1.0 / math.sqrt(n * grid_max(numerics))
    return _lsq(numerics, grad_scale, x, step)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _lsq(numerics: QNumerics, grad_scale: float, x: jax.Array, step: jax.Array):
    out, _ = _lsq_fwd(numerics, grad_scale, x, step)
    return out


def _lsq_fwd(numerics: QNumerics, grad_scale: float, x: jax.Array, step: jax.Array):
    xc = x.astype(compute_dtype(x.dtype))
    s = step.astype(xc.dtype)
    v = xc / s
    q = numerics.fwd(v, None)
    return (q * s).astype(x.dtype), (v, q, step)


def _lsq_bwd(numerics: QNumerics, grad_scale: float, res: Any, g: jax.Array):
    v, q, step = res
    qp = grid_max(numerics)
    inside = (v > -qp) & (v < qp)
    gc = g.astype(v.dtype)
    dx = jnp.where(inside, gc, jnp.zeros_like(gc)).astype(g.dtype)
    dstep = gc * (q - jnp.where(inside, v, jnp.zeros_like(v))) * grad_scale
    # Sum over the axes the step was broadcast along.
    shape = (1,) * (v.ndim - step.ndim) + step.shape
    axes = tuple(
        i
        for i, (a, b) in enumerate(zip(shape, v.shape, strict=True))
        if a == 1 and b != 1
    )
    axes += tuple(range(v.ndim - step.ndim))
    dstep = jnp.sum(dstep, axis=tuple(sorted(set(axes))), keepdims=True)
    return dx, dstep.reshape(step.shape).astype(step.dtype)


_lsq.defvjp(_lsq_fwd, _lsq_bwd)
