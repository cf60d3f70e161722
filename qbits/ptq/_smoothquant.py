r"""Per-input-channel scales that move difficulty between x and w.

``x @ w == (x / s) @ (s[:, None] * w)`` for any positive ``s`` of length
``K`` (one entry per input channel): :func:`scale_activation` and
:func:`scale_weight` apply the two halves. SmoothQuant (Xiao et al.,
"SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models", arXiv 2211.10438) picks ``s`` from the activations' and the
weight's ranges (:func:`smooth_scales`) so that outlier input channels of the
activations shrink and int8 activations lose less; AWQ
(:func:`~qbits.ptq.awq`) searches ``s`` for weight-only quantization. The
division of ``x`` is usually folded into the layer before (a norm's scale, or
the previous matmul's output channels).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qbits._errors import InvalidArgumentError, check_float
from qbits._formats import compute_dtype
from qbits.ptq._gptq import check_activation, check_weight

__all__ = ["scale_activation", "scale_weight", "smooth_scales"]

# The reference implementation's floors (mit-han-lab/smoothquant, smooth.py).
_FLOOR = 1e-5


def smooth_scales(
    act_absmax: jax.Array, w: jax.Array, *, alpha: float = 0.5
) -> jax.Array:
    r"""SmoothQuant's per-input-channel smoothing scales.

    .. math:: s_j = \frac{\max |x_j|^{\alpha}}{\max_n |w_{jn}|^{1 - \alpha}}

    for each input channel ``j`` (a row of ``w``), as the reference
    implementation computes them: the weight's row maxima are floored at
    ``1e-5`` before the power, and the scales after it (an input channel
    that never fires, ``max |x_j| = 0``, gets ``s_j = 1e-5``: its weight row
    is scaled down, and its activation, 0, stays 0). ``alpha = 0.5`` splits
    the range evenly; larger ``alpha`` moves more of it into the weight.

    Args:
      act_absmax: ``max |x|`` per input channel over the calibration set,
        ``(K,)``.
      w: The weight of ``x @ w``, ``(K, N)``.
      alpha: The migration strength, in [0, 1].

    Returns:
      The scales ``s``, ``(K,)``, float32: use ``scale_weight(w, s)`` and
      ``scale_activation(x, s)``.

    Raises:
      InvalidArgumentError: For a ``w`` that is not a 2-D float array,
        ``act_absmax`` not of shape ``(K,)``, or ``alpha`` outside [0, 1].

    Example:
      >>> import jax.numpy as jnp
      >>> w = jnp.array([[1.0, -4.0], [0.5, 0.25]])
      >>> qbits.ptq.smooth_scales(jnp.array([16.0, 1.0]), w)
      Array([2.       , 1.4142135], dtype=float32)
    """
    owner = "smooth_scales"
    w = check_weight(owner, w)
    act_absmax = check_channels(owner, "act_absmax", act_absmax, w.shape[0])
    act_absmax = act_absmax.astype(jnp.float32)
    check_float(owner, "alpha", alpha, lo=0.0, hi=1.0)
    w_absmax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=1, initial=0.0)
    s = act_absmax**alpha / jnp.maximum(w_absmax, _FLOOR) ** (1.0 - alpha)
    return jnp.maximum(s, _FLOOR)


def scale_weight(w: jax.Array, s: jax.Array) -> jax.Array:
    """The weight's half of a smoothing: ``s[:, None] * w``.

    Row ``j`` of ``w`` (input channel ``j``) is multiplied by ``s[j]``; with
    :func:`scale_activation` the matmul is unchanged:
    ``scale_activation(x, s) @ scale_weight(w, s) == x @ w`` up to
    rounding.

    Args:
      w: The weight of ``x @ w``, ``(K, N)``.
      s: Positive scales, ``(K,)``.

    Returns:
      ``(K, N)``, ``w``'s dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> qbits.ptq.scale_weight(jnp.ones((2, 3)), jnp.array([2.0, 0.5]))
      Array([[2. , 2. , 2. ],
             [0.5, 0.5, 0.5]], dtype=float32)
    """
    w = check_weight("scale_weight", w)
    s = check_channels("scale_weight", "s", s, w.shape[0])
    dtype = compute_dtype(w.dtype)
    return (w.astype(dtype) * s.astype(dtype)[:, None]).astype(w.dtype)


def scale_activation(x: jax.Array, s: jax.Array) -> jax.Array:
    """The activation's half of a smoothing: ``x / s`` along the last axis.

    Args:
      x: The matmul's input, ``(..., K)``, floating point.
      s: The scales given to :func:`scale_weight`, ``(K,)``.

    Returns:
      ``x / s``, ``x``'s shape and dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> x, w = jnp.array([[4.0, 1.0]]), jnp.array([[1.0], [2.0]])
      >>> s = jnp.array([2.0, 0.5])
      >>> qbits.ptq.scale_activation(x, s)
      Array([[2., 2.]], dtype=float32)
      >>> qbits.ptq.scale_activation(x, s) @ qbits.ptq.scale_weight(w, s)
      Array([[6.]], dtype=float32)
    """
    x = check_activation("scale_activation", x)
    s = check_channels("scale_activation", "s", s, x.shape[-1])
    dtype = compute_dtype(x.dtype)
    return (x.astype(dtype) / s.astype(dtype)).astype(x.dtype)


def check_channels(owner: str, argument: str, v: Any, k: int) -> jax.Array:
    """``v`` as a float ``(k,)`` array (one entry per input channel)."""
    v = jnp.asarray(v)
    if v.shape != (k,) or not (
        jnp.issubdtype(v.dtype, jnp.floating) or jnp.issubdtype(v.dtype, jnp.integer)
    ):
        raise InvalidArgumentError(
            owner,
            argument,
            f"{v.dtype}{list(v.shape)}",
            f"a real array of shape ({k},): one entry per input channel (a row of w)",
        )
    return v if jnp.issubdtype(v.dtype, jnp.floating) else v.astype(jnp.float32)
