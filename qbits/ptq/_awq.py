"""AWQ: activation-aware per-input-channel scales for weight-only quantization."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qbits._errors import check_int
from qbits._formats import compute_dtype
from qbits._quantizer import Quantizer
from qbits.ptq._gptq import check_hessian, check_quantizer, check_weight
from qbits.ptq._smoothquant import check_channels

__all__ = ["AwqResult", "awq"]

# The reference implementation's floor on act_absmean ** alpha (llm-awq).
_FLOOR = 1e-4


class AwqResult(NamedTuple):
    """What :func:`awq` returns.

    Attributes:
      weight: The effective weight ``Q(s[:, None] * w) / s[:, None]``:
        ``(K, N)``, ``w``'s dtype. ``x @ weight`` is what the quantized
        layer computes.
      scales: The chosen per-input-channel scales ``s``, ``(K,)``, float32.
        To serve, store ``quantizer.quant(qbits.ptq.scale_weight(w, s),
        contracting_axes=(0,))`` and divide the activation by ``s``
        (:func:`~qbits.ptq.scale_activation`, or fold ``1 / s`` into the
        layer before).
      alpha: The chosen exponent, a float32 scalar.
      error: The output error of ``weight`` (:func:`~qbits.ptq.output_error`),
        a float32 scalar.
    """

    weight: jax.Array
    scales: jax.Array
    alpha: jax.Array
    error: jax.Array


def awq(
    w: jax.Array,
    hessian: jax.Array,
    act_absmean: jax.Array,
    quantizer: Quantizer,
    *,
    grid: int = 20,
) -> AwqResult:
    r"""Searches AWQ's per-input-channel scales for the weight of ``x @ w``.

    AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM
    Compression and Acceleration", arXiv 2306.00978) scales input channel
    ``j`` of the weight up by ``s_j`` before quantizing it and the
    activation down by ``s_j``, so that the channels that see large
    activations lose less. For each ``alpha`` in ``linspace(0, 1, grid)``

    .. math:: s = \frac{m^\alpha}{\sqrt{\max(m^\alpha) \min(m^\alpha)}},
       \qquad \hat w(s) = \mathrm{diag}(s)^{-1} Q(\mathrm{diag}(s)\, w),

    with ``m = act_absmean`` (``m**alpha`` floored at ``1e-4``, normalised
    as the reference implementation, ``mit-han-lab/llm-awq``, does), and the
    ``alpha`` with the least output error
    :math:`\mathrm{tr}((w - \hat w)^T H (w - \hat w))` wins (the first on a
    tie). The error is computed from ``H`` exactly, with no activations.
    ``alpha = 0`` gives ``s = 1``: plain round-to-nearest, so the result is
    never worse than it on the calibration set. (The reference searches
    ``alpha`` in ``arange(grid) / grid``, without 1, and measures the error
    of a whole block's output; AWQ's clipping search is not part of this.)

    Jittable: the search is a ``lax.map`` over the grid.

    Args:
      w: The weight, ``(K, N)``, floating point.
      hessian: ``X^T X`` over the calibration rows ``X`` of ``x``, ``(K, K)``.
      act_absmean: The mean of ``|x|`` per input channel, ``(K,)``.
      quantizer: The target grid (a :class:`~qbits.Quantizer` with a
        calibration), applied to the scaled weight with contracting axis 0.
      grid: The number of ``alpha`` values tried, >= 1.

    Returns:
      An :class:`AwqResult`: the effective weight, the scales, ``alpha`` and
      the error.

    Raises:
      InvalidArgumentError: For a ``w`` that is not a 2-D float array, a
        ``hessian`` not ``(K, K)``, an ``act_absmean`` not ``(K,)``, a
        quantizer with a scale provider or ``grid`` < 1.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> x = rng.standard_normal((64, 16), np.float32)
      >>> x[:, :2] *= 20.0  # two salient input channels
      >>> w = rng.standard_normal((16, 8), np.float32)
      >>> int3 = qbits.Quantizer(qbits.IntNumerics(bits=3),
      ...                        granularity=qbits.PerChannel())
      >>> out = qbits.ptq.awq(w, x.T @ x, np.abs(x).mean(0), int3, grid=5)
      >>> float(out.alpha), out.scales.shape, out.weight.shape
      (0.25, (16,), (16, 8))
    """
    owner = "awq"
    w = check_weight(owner, w)
    hessian = check_hessian(owner, hessian, w.shape[0])
    act_absmean = check_channels(owner, "act_absmean", act_absmean, w.shape[0])
    check_quantizer(owner, quantizer)
    check_int(owner, "grid", grid, 1)
    return _awq(w, hessian, act_absmean, quantizer=quantizer, grid=grid)


def awq_scales(act_absmean: jax.Array, alpha: jax.Array) -> jax.Array:
    """AWQ's scales for one ``alpha``: ``m**alpha``, normalised (float32)."""
    s = jnp.maximum(act_absmean.astype(jnp.float32) ** alpha, _FLOOR)
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


@functools.partial(jax.jit, static_argnames=("quantizer", "grid"))
def _awq(
    w: jax.Array,
    hessian: jax.Array,
    act_absmean: jax.Array,
    *,
    quantizer: Quantizer,
    grid: int,
) -> AwqResult:
    dtype = compute_dtype(w.dtype)
    wf, h = w.astype(dtype), hessian.astype(dtype)

    def effective(alpha: jax.Array) -> tuple[jax.Array, jax.Array]:
        s = awq_scales(act_absmean, alpha).astype(dtype)[:, None]
        q = quantizer.quant(wf * s, contracting_axes=(0,)).dequant()
        return q.astype(dtype) / s, s[:, 0]

    def error(alpha: jax.Array) -> jax.Array:
        d = wf - effective(alpha)[0]
        hd = jnp.matmul(h, d, precision=lax.Precision.HIGHEST)
        return jnp.sum(d * hd).astype(jnp.float32)

    alphas = jnp.linspace(0.0, 1.0, grid, dtype=jnp.float32)
    errors = lax.map(error, alphas)
    best = jnp.argmin(errors)
    weight, s = effective(alphas[best])
    return AwqResult(
        weight.astype(w.dtype), s.astype(jnp.float32), alphas[best], errors[best]
    )
