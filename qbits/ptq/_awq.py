"""AWQ: activation-aware per-input-channel scales for weight-only quantization."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._calibration import AbsMax
from qbits._errors import InvalidArgumentError, check_int
from qbits._formats import compute_dtype
from qbits._quantizer import Quantizer
from qbits.ptq._gptq import (
    check_finite,
    check_hessian,
    check_quantizer,
    check_weight,
)
from qbits.ptq._method import Method
from qbits.ptq._smoothquant import check_channels
from qbits.ptq._stats import InputStats

__all__ = ["Awq", "AwqResult", "awq"]

# The reference implementation's floor on act_absmean ** alpha (llm-awq).
_FLOOR = 1e-4


class AwqResult(NamedTuple):
    """What :meth:`Awq.search` returns.

    Attributes:
      weight: The effective weight ``Q(s[:, None] * w) / s[:, None]``:
        ``(K, N)``, ``w``'s dtype. ``x @ weight`` is what the quantized
        layer computes.
      scales: The chosen per-input-channel scales ``s``, ``(K,)``, float32.
        To serve, store ``quantizer.quant(s[:, None] * w,
        contracting_axes=(0,))`` and divide the activation by ``s`` (or
        fold ``1 / s`` into the layer before).
      alpha: The chosen exponent, a float32 scalar.
      error: The output error of ``weight``,
        ``tr((w - weight)^T H (w - weight))``, a float32 scalar.
      clip: The clipping ratio chosen for each scale block of the scaled
        weight (the quantizer's layout, ``(K // group, N // block_n)``),
        float32; all 1 without the clipping search.

    Example:
      >>> one = jnp.ones(())
      >>> out = qbits.ptq.AwqResult(jnp.zeros((4, 2)), jnp.ones(4), one, one,
      ...                           jnp.ones((1, 2)))
      >>> out.scales.shape, out.clip.shape
      ((4,), (1, 2))
    """

    weight: jax.Array
    scales: jax.Array
    alpha: jax.Array
    error: jax.Array
    clip: jax.Array


def awq(
    w: jax.Array,
    hessian: jax.Array,
    act_absmean: jax.Array,
    quantizer: Quantizer,
    *,
    grid: int = 20,
    clip_grid: int = 11,
) -> AwqResult:
    """AWQ's search on the weight of ``x @ w``: see :class:`Awq`."""
    owner = "awq"
    w = check_weight(owner, w)
    hessian = check_hessian(owner, hessian, w.shape[0])
    act_absmean = check_channels(owner, "act_absmean", act_absmean, w.shape[0])
    for argument, x in (("w", w), ("hessian", hessian), ("act_absmean", act_absmean)):
        check_finite(owner, argument, x)
    check_quantizer(owner, quantizer)
    check_int(owner, "grid", grid, 1)
    check_int(owner, "clip_grid", clip_grid, 1)
    if not isinstance(quantizer.calibration, AbsMax):
        clip_grid = 1
    return _awq(
        w, hessian, act_absmean, quantizer=quantizer, grid=grid, clip_grid=clip_grid
    )


@dataclasses.dataclass(frozen=True)
class Awq(Method):
    r"""AWQ: activation-aware per-input-channel scales for weight-only quantization.

    AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM
    Compression and Acceleration", arXiv 2306.00978) scales input channel
    ``j`` of the weight up by ``s_j`` before quantizing it and the
    activation down by ``s_j``, so that the channels that see large
    activations lose less. For each ``alpha`` in ``linspace(0, 1, grid)``

    .. math:: s = \frac{m^\alpha}{\sqrt{\max(m^\alpha) \min(m^\alpha)}},
       \qquad \hat w(s) = \mathrm{diag}(s)^{-1} Q(\mathrm{diag}(s)\, w),

    with ``m`` the mean ``|x|`` per input channel (``stats.absmean``;
    ``m**alpha`` floored at ``1e-4``, normalised as the reference
    implementation, ``mit-han-lab/llm-awq``, does), and the ``alpha`` with
    the least output error :math:`\mathrm{tr}((w - \hat w)^T H (w - \hat w))`
    (``H = stats.hessian``) wins (the first on a tie). The error is
    computed from ``H`` exactly, with no activations.
    ``alpha = 0`` gives ``s = 1``: plain round-to-nearest, so the result is
    never worse than it on the calibration set. (The reference searches
    ``alpha`` in ``arange(grid) / grid``, without 1, and measures the error
    of a whole block's output.)

    Then AWQ's clipping search (the reference's ``auto_clip``): with ``s``
    fixed, each scale block of ``diag(s) w`` gets the clipping ratio ``r``
    in ``linspace(1, 0.5, clip_grid)`` (its bound ``r`` times the
    calibration's, :class:`~qbits.AbsMax` ``clip_factor``) whose error on
    the block's own input channels, ``d^T H_{gg} d`` (``H_{gg}`` the
    block's diagonal block of ``H``, as the reference measures each group's
    output alone), is least. Blocks are rounded independently, so the
    chosen ratios make one weight on the format's grid; it is kept if its
    full error is below the unclipped one's. The search needs an
    :class:`~qbits.AbsMax` calibration: with another, or ``clip_grid=1``,
    every ratio is 1.

    Jittable: the searches are ``lax.map`` s over their grids.

    :meth:`search` returns what it found (:class:`AwqResult`: the scales,
    to serve the weight ``Q(s w)`` with the activation divided by ``s``);
    :meth:`quantize` (what :func:`~qbits.ptq.quantize_weights` runs) the
    effective weight ``Q(s w) / s`` alone: not on the quantizer's grid, so
    the driver stores nothing for serving. Needs ``mean |x|``, so it
    refuses ``rotate=True``.

    Attributes:
      grid: The number of exponents ``alpha`` searched, >= 1.
      clip_grid: The number of clipping ratios searched, >= 1 (1: no
        search).

    Raises:
      InvalidArgumentError: For ``grid`` or ``clip_grid`` < 1; from
        :meth:`search` and :meth:`quantize`: for a ``w`` that is not a 2-D
        float array, a ``hessian`` not ``(K, K)``, an ``absmean`` not
        ``(K,)``, any of them with NaN or inf (concrete arrays), a quantizer
        with a scale provider.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> x = rng.standard_normal((64, 16), np.float32)
      >>> x[:, :2] *= 20.0  # two salient input channels
      >>> w = rng.standard_normal((16, 8), np.float32)
      >>> int3 = qbits.Quantizer(qbits.IntNumerics(bits=3),
      ...                        granularity=qbits.PerChannel())
      >>> stats = qbits.ptq.InputStats.of(x)
      >>> out = qbits.ptq.Awq(grid=5).search(w, stats, int3)
      >>> float(out.alpha), out.scales.shape, out.weight.shape, out.clip.shape
      (0.25, (16,), (16, 8), (1, 8))
      >>> qbits.ptq.Awq(grid=10)
      Awq(grid=10, clip_grid=11)
    """

    name: ClassVar[str] = "awq"
    grid: int = 20
    clip_grid: int = 11

    def __post_init__(self) -> None:
        check_int("qbits.ptq.Awq", "grid", self.grid, 1)
        check_int("qbits.ptq.Awq", "clip_grid", self.clip_grid, 1)

    def check(self, owner: str, *, smooth: float | None, rotate: bool) -> None:
        """Refuses ``rotate`` (see :meth:`Method.check`)."""
        if rotate:
            raise InvalidArgumentError(
                owner, "rotate", True,
                "method=Gptq() or Rtn() with rotate=True, or AWQ without it",
                why="AWQ's scale search needs the mean |x Q| of the rotated "
                "activation, which the statistics do not give",
            )  # fmt: skip

    def quantize(
        self, w: jax.Array, stats: InputStats, quantizer: Quantizer
    ) -> jax.Array:
        """AWQ's effective weight ``Q(s w) / s`` (see :class:`Method`)."""
        return self.search(w, stats, quantizer).weight

    def search(
        self, w: jax.Array, stats: InputStats, quantizer: Quantizer
    ) -> AwqResult:
        """AWQ's scales for ``w`` and the weight they give (see :class:`Awq`).

        Args:
          w: The weight, ``(K, N)``, floating point.
          stats: Its activation's statistics (``hessian``, ``absmean``).
          quantizer: The target grid, applied to the scaled weight with
            contracting axis 0.

        Returns:
          An :class:`AwqResult`.
        """
        return awq(w, stats.hessian, stats.absmean, quantizer, grid=self.grid,
                   clip_grid=self.clip_grid)  # fmt: skip


def awq_scales(act_absmean: jax.Array, alpha: jax.Array) -> jax.Array:
    """AWQ's scales for one ``alpha``: ``m**alpha``, normalised (float32)."""
    s = jnp.maximum(act_absmean.astype(jnp.float32) ** alpha, _FLOOR)
    return s / jnp.sqrt(jnp.max(s) * jnp.min(s))


@functools.partial(jax.jit, static_argnames=("quantizer", "grid", "clip_grid"))
def _awq(
    w: jax.Array,
    hessian: jax.Array,
    act_absmean: jax.Array,
    *,
    quantizer: Quantizer,
    grid: int,
    clip_grid: int,
) -> AwqResult:
    dtype = compute_dtype(w.dtype)
    wf, h = w.astype(dtype), hessian.astype(dtype)

    def effective(alpha: jax.Array) -> tuple[jax.Array, jax.Array]:
        s = awq_scales(act_absmean, alpha).astype(dtype)[:, None]
        q = quantizer.quant(wf * s, contracting_axes=(0,)).dequant()
        return q.astype(dtype) / s, s[:, 0]

    def full_error(w_hat: jax.Array) -> jax.Array:
        d = wf - w_hat
        hd = jnp.matmul(h, d, precision=lax.Precision.HIGHEST)
        return jnp.sum(d * hd).astype(jnp.float32)

    alphas = jnp.linspace(0.0, 1.0, grid, dtype=jnp.float32)
    errors = lax.map(lambda a: full_error(effective(a)[0]), alphas)
    best = jnp.argmin(errors)
    weight, s = effective(alphas[best])
    k, n = w.shape
    group, block_n = quantizer.granularity.block_sizes(w.shape, (0,))[:2]
    blocks = (k // group, n // block_n)
    clip = jnp.ones(blocks, jnp.float32)
    error = errors[best]
    if clip_grid > 1:
        weight, clip, error = _clip_search(
            wf, h, s, quantizer, group, block_n, clip_grid, weight, error, full_error
        )
    return AwqResult(
        weight.astype(w.dtype), s.astype(jnp.float32), alphas[best], error, clip
    )


def _clip_search(
    wf: jax.Array,
    h: jax.Array,
    s: jax.Array,
    quantizer: Quantizer,
    group: int,
    block_n: int,
    clip_grid: int,
    weight: jax.Array,
    error: jax.Array,
    full_error: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """AWQ's per-block clipping ratios for the scaled weight ``s w`` (see awq).

    Returns ``(weight, ratios, error)``: the clipped weight and its ratios if
    its error is below ``error`` (of ``weight``), else ``weight``, ones and
    ``error``.
    """
    k, n = wf.shape
    base = quantizer.calibration.clip_factor
    ws = wf * s[:, None]
    # The diagonal blocks H_gg of the groups of input channels.
    hg = h.reshape(k // group, group, k // group, group)
    hg = jnp.diagonal(hg, axis1=0, axis2=2).transpose(2, 0, 1)  # (G, group, group)

    ratios = np.linspace(1.0, 0.5, clip_grid)
    candidates = jnp.stack([
        quantizer.replace(calibration=AbsMax(clip_factor=base * float(r)))
        .quant(ws, contracting_axes=(0,)).dequant().astype(wf.dtype) / s[:, None]
        for r in ratios
    ])  # (R, K, N)  # fmt: skip
    d = (wf[None] - candidates).reshape(clip_grid, k // group, group, n)
    errs = jnp.einsum("rgin,gij,rgjn->rgn", d, hg, d,
                      precision=lax.Precision.HIGHEST)  # fmt: skip
    errs = errs.reshape(clip_grid, k // group, n // block_n, block_n).sum(-1)
    pick = jnp.argmin(errs, axis=0)  # (G, N // block_n): the first on a tie
    rows = jnp.repeat(jnp.repeat(pick, group, 0), block_n, 1)
    chosen = jnp.take_along_axis(candidates, rows[None], axis=0)[0]
    chosen_error = full_error(chosen)
    better = chosen_error < error
    return (
        jnp.where(better, chosen, weight),
        jnp.where(better, jnp.asarray(ratios, jnp.float32)[pick], 1.0),
        jnp.where(better, chosen_error, error),
    )
