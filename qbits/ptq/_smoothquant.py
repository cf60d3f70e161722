r"""Per-input-channel scales that move difficulty between x and w.

``x @ w == (x / s) @ (s[:, None] * w)`` for any positive ``s`` of length
``K`` (one entry per input channel). SmoothQuant (Xiao et al.,
"SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models", arXiv 2211.10438) picks ``s`` from the activations' and the
weight's ranges (:func:`smooth_scales`) so that outlier input channels of the
activations shrink and int8 activations lose less; AWQ
(:class:`~qbits.ptq.Awq`) searches ``s`` for weight-only quantization. The
division of ``x`` is usually folded into the layer before (a norm's scale, or
the previous matmul's output channels).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qbits._errors import InvalidArgumentError, check_float
from qbits.ptq._gptq import check_weight

__all__ = ["smooth_scales"]

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
      The scales ``s``, ``(K,)``, float32: ``s[:, None] * w`` is the
      weight's half, ``x / s`` the activation's
      (``quantize_weights(smooth=alpha)`` does both).

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
