r"""GPTQ: quantize a weight input channel by input channel, spreading the error.

One weight matmul ``x @ w``, ``w`` of shape ``(K, N)`` (``K`` input channels,
the contracting axis; ``N`` output channels), and the calibration statistic
``H = X^T X`` (``(K, K)``, summed over the calibration rows of ``x``). The
output error of a quantized weight ``w_hat`` over the calibration set is

.. math:: \lVert X w - X \hat w \rVert_F^2 = \mathrm{tr}\big((w - \hat w)^T H
   (w - \hat w)\big),

which :func:`output_error` computes; GPTQ (:class:`Gptq`; Frantar et al.,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", arXiv 2210.17323) minimises it greedily, one input channel (a
row of ``w``) at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError, check_bool, check_float, check_int
from qbits._formats import compute_dtype
from qbits._granularity import Tiled
from qbits._quantizer import Quantizer
from qbits.ptq._method import Method
from qbits.ptq._stats import InputStats

__all__ = ["Gptq", "GptqResult", "gptq", "output_error"]


class GptqResult(NamedTuple):
    """A weight on its quantizer's grid with its scales (:meth:`Method.quantize`).

    Attributes:
      weight: The quantized weight, dequantized: ``(K, N)``, ``w``'s dtype.
        Every entry is a grid value times its block's scale (minus its zero
        point, times the tensor scale, where the format has them).
      scale: The scales it used, in the quantizer's layout for ``w`` (one
        entry per scale block: ``(K // group, N // block_n)``), float32
        (NVFP4: the E4M3 block scales, as float32). For a symmetric grid,
        ``quantizer.quant_vjp(weight, scale=scale, contracting_axes=(0,),
        store=True)`` gives the stored codes.
      zero_point: The zero points (:class:`~qbits.numerics.UintNumerics`),
        same layout, integer-valued float32; else ``None``.
      tensor_scale: The float32 tensor scale (``scale_rounding="e4m3"``),
        shape ``()``; else ``None``.

    Example:
      >>> out = qbits.ptq.GptqResult(jnp.zeros((4, 2)), jnp.ones((1, 2)))
      >>> out.zero_point is None and out.tensor_scale is None
      True
    """

    weight: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None = None
    tensor_scale: jax.Array | None = None


def gptq(
    w: jax.Array,
    hessian: jax.Array,
    quantizer: Quantizer,
    *,
    damping: float = 0.01,
    act_order: bool = False,
    block_size: int = 128,
    name: str | None = None,
) -> GptqResult:
    """GPTQ of ``w`` on ``hessian``: see :class:`Gptq` (``name``: for errors)."""
    owner = "gptq"
    w = check_weight(owner, w)
    k, n = w.shape
    hessian = check_hessian(owner, hessian, k)
    check_quantizer(owner, quantizer)
    check_float(owner, "damping", damping, lo=0.0)
    check_bool(owner, "act_order", act_order)
    check_int(owner, "block_size", block_size, 1)
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(owner, "name", name, "a str or None")
    check_finite(owner, "w", w, name)
    check_finite(owner, "hessian", hessian, name)
    group, block_n = quantizer.granularity.block_sizes(w.shape, (0,))[:2]
    scale_shape = (k // group if k else 0, n // block_n if n else 0)
    if quantizer.numerics.is_identity or w.size == 0:
        return GptqResult(w, jnp.ones(scale_shape, jnp.float32))
    block = _block_rows(k, group, block_size)
    weight, params, ok = _gptq(
        w,
        hessian,
        damping,
        quantizer=quantizer,
        act_order=act_order,
        group=group,
        block_n=block_n,
        block=block,
    )
    if not isinstance(ok, jax.core.Tracer) and not bool(ok):
        # Finite (checked above): rounding in an ill-conditioned X^T X, which
        # damping cures, or a matrix that is no X^T X, which it does not.
        layer = f"layer {name!r}" if name is not None else "this layer"
        larger = f"a larger damping (e.g. {10 * damping:g}); " if damping < 1 else ""
        raise InvalidArgumentError(
            owner,
            "damping",
            damping,
            f"{larger}hessian must be X^T X of the layer's calibration inputs "
            "(positive semidefinite)",
            why=f"the Hessian of {layer} is not positive definite after damping",
        )
    scale, zero_point, tensor_scale = params
    if quantizer.numerics.asymmetric:
        return GptqResult(weight, scale, zero_point=zero_point)
    if quantizer.scale_rounding == "e4m3":
        return GptqResult(weight, scale, tensor_scale=tensor_scale)
    return GptqResult(weight, scale)


def output_error(w: jax.Array, w_hat: jax.Array, hessian: jax.Array) -> jax.Array:
    r"""The output error of replacing ``w`` by ``w_hat`` in ``x @ w``.

    .. math:: \mathrm{tr}\big((w - \hat w)^T H (w - \hat w)\big)
       = \lVert X w - X \hat w \rVert_F^2 \quad (H = X^T X),

    the summed squared error of the matmul's output over the calibration
    rows ``X`` (their mean, if ``H`` is the mean), computed in float32
    without the activations.

    Args:
      w: The weight, ``(K, N)``.
      w_hat: Its replacement, ``(K, N)``.
      hessian: ``X^T X``, ``(K, K)``.

    Returns:
      A float32 scalar.
    """
    w = jnp.asarray(w)
    d = (w - jnp.asarray(w_hat, w.dtype)).astype(compute_dtype(w.dtype))
    return _trace_form(d, jnp.asarray(hessian, d.dtype)).astype(jnp.float32)


def _trace_form(d: jax.Array, h: jax.Array) -> jax.Array:
    """``tr(d^T h d)`` at full precision."""
    return jnp.sum(d * jnp.matmul(h, d, precision=lax.Precision.HIGHEST))


def check_weight(owner: str, w: Any) -> jax.Array:
    """``w`` as a 2-D floating-point array, or InvalidArgumentError."""
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise InvalidArgumentError(
            owner, "w.dtype", w.dtype, "a floating-point dtype (float32, bfloat16)"
        )
    if w.ndim != 2:
        raise InvalidArgumentError(
            owner,
            "w.shape",
            w.shape,
            "a 2-D weight (K, N) used as x @ w; reshape a weight with "
            "several input or output axes to (K, N) first",
        )
    return w


def check_hessian(owner: str, hessian: Any, k: int) -> jax.Array:
    """``hessian`` as a float ``(k, k)`` array, or InvalidArgumentError."""
    hessian = jnp.asarray(hessian)
    if hessian.shape != (k, k) or not jnp.issubdtype(hessian.dtype, jnp.floating):
        raise InvalidArgumentError(
            owner,
            "hessian",
            f"{hessian.dtype}{list(hessian.shape)}",
            f"a float array of shape ({k}, {k}): X^T X over the calibration "
            "rows X of the input, K = w.shape[0]",
        )
    return hessian


def check_finite(owner: str, argument: str, x: Any, name: str | None = None) -> None:
    """Raises unless ``x`` (concrete: a traced array passes) is all finite."""
    if isinstance(x, jax.core.Tracer):
        return
    bad = int(np.sum(~np.isfinite(np.asarray(x))))
    if bad:
        layer = f" of layer {name!r}" if name is not None else ""
        raise InvalidArgumentError(
            owner, argument, f"an array with {bad} NaN or inf entries",
            f"finite values: {argument}{layer} as the float model computes it "
            "on calibration data",
        )  # fmt: skip


def check_quantizer(owner: str, quantizer: Any) -> None:
    """Raises unless ``quantizer`` computes its scales and rounds to nearest."""
    if not isinstance(quantizer, Quantizer):
        raise InvalidArgumentError(owner, "quantizer", quantizer, "a qbits.Quantizer")
    if quantizer.provider is not None:
        raise InvalidArgumentError(
            owner,
            "quantizer.provider",
            quantizer.provider,
            "None: post-training quantization computes the weight's scales "
            "from the weight (a calibration such as qbits.AbsMax())",
        )
    if getattr(quantizer.numerics, "noise_fn", None) is not None:
        raise InvalidArgumentError(
            owner,
            "quantizer.numerics.noise_fn",
            quantizer.numerics.noise_fn,
            "None: post-training quantization rounds the weight to nearest",
        )


def blocks_quantizer(quantizer: Quantizer, rows: int, cols: int) -> Quantizer:
    """``quantizer`` with scale blocks of ``rows x cols`` for a 2-D tensor."""
    granularity = Tiled(axis=0, tile_size=rows, shared_axes=(), free_tile_size=cols)
    return quantizer.replace(granularity=granularity)


def _inverse_cholesky(h: jax.Array, eye: jax.Array) -> jax.Array:
    """The upper Cholesky factor ``u`` of ``h^{-1}`` (``h^{-1} = u^T u``).

    With ``j`` the reversal, ``j h j = m m^T`` (``m`` lower) gives
    ``h = r r^T`` for the upper ``r = j m j``, so ``h^{-1} = r^{-T} r^{-1}``
    and ``u = r^{-1} = j m^{-1} j``: one factorisation and one triangular
    solve, no explicit inverse (and a third of the compile time).
    """
    m = jnp.linalg.cholesky(h[::-1, ::-1])
    m_inv = jax.scipy.linalg.solve_triangular(m, eye, lower=True)
    return m_inv[::-1, ::-1]


def _block_rows(k: int, group: int, block_size: int) -> int:
    """The largest block <= block_size dividing k, dividing or a multiple of group.

    Then a group that starts inside a block lies inside it, and a block
    that meets a group start begins at it.
    """
    for b in range(min(block_size, k), 0, -1):
        if k % b == 0 and (b % group == 0 or group % b == 0):
            return b
    return 1


@functools.partial(
    jax.jit,
    static_argnames=("quantizer", "act_order", "group", "block_n", "block"),
)
def _gptq(
    w: jax.Array,
    hessian: jax.Array,
    damping: float,
    *,
    quantizer: Quantizer,
    act_order: bool,
    group: int,
    block_n: int,
    block: int,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
    """GPTQ's numbers: ``(weight, (scale, zero point, tensor scale), ok)``."""
    k, n = w.shape
    dtype = compute_dtype(w.dtype)
    h = hessian.astype(dtype)
    diag = jnp.diagonal(h)
    dead = diag == 0
    h = h + jnp.diag(dead.astype(dtype))
    wf = jnp.where(dead[:, None], jnp.zeros((), dtype), w.astype(dtype))
    groups = blocks_quantizer(quantizer, group, block_n)
    rows = blocks_quantizer(quantizer, 1, block_n)
    n_groups = k // group
    asymmetric = quantizer.numerics.asymmetric
    two_level = quantizer.scale_rounding == "e4m3"
    # Two-level scales: one tensor scale for the whole weight, so static.
    static = act_order or two_level

    def calibrate(now: jax.Array) -> jax.Array:
        """``(3, groups, N // block_n)``: scale, zero point, tensor scale."""
        qt = groups.quant(now)
        zero = jnp.zeros(qt.scale.shape, jnp.float32)
        z = qt.zero_point.astype(jnp.float32) if asymmetric else zero
        g = zero + qt.tensor_scale.reshape(()) if two_level else zero
        return jnp.stack([qt.scale.astype(jnp.float32), z, g])

    if static:  # from w itself (act_order: the reference's static groups)
        params = calibrate(wf)
    else:
        params = jnp.zeros((3, n_groups, n // block_n), jnp.float32)
    if act_order:
        perm = jnp.argsort(-jnp.diagonal(h), stable=True)
        wf, h = wf[perm], h[perm][:, perm]
        group_of = perm // group
    else:
        perm = None
        group_of = jnp.arange(k) // group

    def round_row(row: jax.Array, p: jax.Array) -> jax.Array:
        """One row (float32) on the grid of its group's parameters ``p``."""
        if not (asymmetric or two_level):
            # float32: qbits' given scales are float32 (quant_vjp(scale=)
            # refuses float64 input under x64).
            qt, _ = rows.quant_vjp(row[None], scale=p[0][None])
            return qt.dequant()[0]
        # The formats' own arithmetic (see qbits' zero-point and two-level
        # quantizers), with the group's parameters kept.
        s = jnp.repeat(p[0] * p[2] if two_level else p[0], block_n)
        z = jnp.repeat(p[1], block_n)
        empty = s == 0  # a two-level block of zeros
        y = row / jnp.where(empty, 1.0, s) + z
        q = (quantizer.numerics.fwd(y, None) - z) * s
        return jnp.where(empty, 0.0, q)

    eye = jnp.eye(k, dtype=dtype)
    h = h + (damping * jnp.mean(jnp.diagonal(h))).astype(dtype) * eye
    upper = _inverse_cholesky(h, eye)
    ok = jnp.all(jnp.isfinite(upper)) & jnp.all(jnp.diagonal(upper) > 0)

    def one_block(b: jax.Array, carry: Any) -> Any:
        wf, params, out = carry
        start = b * block
        w1 = lax.dynamic_slice_in_dim(wf, start, block, 0)
        u = lax.dynamic_slice(upper, (start, 0), (block, k))
        u1 = lax.dynamic_slice_in_dim(u, start, block, 1)

        def one_row(j: jax.Array, inner: Any) -> Any:
            w1, params, q1, e1 = inner
            i = start + j
            if not static:  # a group starts: its parameters, from rows now
                if group <= block:
                    now = lax.dynamic_slice_in_dim(w1, j, group, 0)
                else:  # the group starts at this block: wf is up to date
                    now = lax.dynamic_slice_in_dim(wf, i, group, 0)
                params = lax.cond(
                    i % group == 0,
                    lambda: params.at[:, i // group].set(calibrate(now)[:, 0]),
                    lambda: params,
                )
            row = w1[j]
            p = params[:, group_of[i]]
            q = round_row(row.astype(jnp.float32), p).astype(dtype)
            err = (row - q) / u1[j, j]
            w1 = w1 - u1[j][:, None] * err[None, :]  # u1[j, :j] is 0
            return w1, params, q1.at[j].set(q), e1.at[j].set(err)

        zeros = jnp.zeros((block, n), dtype)
        _, params, q1, e1 = lax.fori_loop(0, block, one_row, (w1, params, zeros, zeros))
        # The lazy batch update of every later row (earlier rows get 0 from
        # the triangular factor; this block's own rows are done).
        wf = wf - jnp.matmul(u.T, e1, precision=lax.Precision.HIGHEST)
        out = lax.dynamic_update_slice_in_dim(out, q1, start, 0)
        return wf, params, out

    out = jnp.zeros((k, n), dtype)
    _, params, out = lax.fori_loop(0, k // block, one_block, (wf, params, out))
    if act_order:
        out = out[jnp.argsort(perm)]
    out = jnp.where(ok, out, jnp.full_like(out, jnp.nan))  # NaN, not garbage
    scale, zero_point, tensor_scale = params
    return out.astype(w.dtype), (scale, zero_point, tensor_scale[0, 0]), ok


@dataclasses.dataclass(frozen=True)
class Gptq(Method):
    r"""GPTQ: quantize the weight of ``x @ w`` input channel by input channel.

    The algorithm of Frantar et al. (arXiv 2210.17323) and its reference
    implementation (``IST-DASLab/gptq``, ``fasterquant``), in the layout
    ``x @ w``: the input channels are the rows of ``w``.

    1. Dead inputs (``H[i, i] == 0``: the input never fires) get
       ``H[i, i] = 1`` and a zero weight row.
    2. ``H`` is damped: ``damping * mean(diag H)`` is added to its diagonal.
    3. ``U``, the upper Cholesky factor of ``H^{-1}``, gives the update: row
       ``i`` is quantized to ``q_i`` and the rows after it move by
       ``-U[i, j] (w_i - q_i) / U[i, i]`` (in blocks of ``block_size`` rows,
       the reference's lazy batch updates; the result is the same).

    The scale groups are the quantizer's scale blocks along ``K``: its
    granularity for ``w`` with contracting axis 0 (``qbits.PerChannel()``:
    one group of all ``K`` rows, one scale per output channel;
    ``qbits.Tiled(tile_size=128)``: groups of 128 input channels, the
    reference's ``groupsize=128``). A group's scales (and zero points, for a
    :class:`~qbits.numerics.UintNumerics` grid) are computed when the group
    starts, from its rows with every earlier row's error applied (the
    reference computes them from rows that miss the updates made inside the
    current block of ``block_size`` rows when a group starts inside one; the
    two agree when ``block_size`` is a multiple of the group, e.g. both
    128), and every row of the group is rounded with them, clipped where it
    has moved outside their range. With one group the scales come from ``w``
    itself. Two-level scales (``scale_rounding="e4m3"``, NVFP4) share one
    tensor scale, which needs the whole weight: their scales all come from
    ``w`` itself, as with ``act_order``.

    The grid is the quantizer's own, the one the engine serves. For 4-bit
    symmetric :class:`~qbits.IntNumerics` that is ``-7..7`` (15 levels: an
    exact zero, the bound on the edge 7.5), where the reference
    implementation and Qwix round symmetric int4 onto ``-8..7`` with the
    same scale: values the error feedback pushes below ``-7.5`` clip at
    ``-7`` here. On correlated calibration data (``K = 128``, per output
    channel and in groups of 32) that costs GPTQ 1-2% more output error, on
    average, than the reference's grid (round to nearest: 0.2%). For 16
    levels use the
    asymmetric grid, :class:`~qbits.numerics.UintNumerics` with zero points
    (the ``w4g128_asym`` preset), or ``IntNumerics(bits=4,
    preserve_zero=False)`` (``+-0.5 .. +-7.5``, no exact zero).

    With ``act_order`` the rows are processed in order of descending
    ``diag(H)`` (the most active inputs first) and the result is put back in
    the original order. The groups stay contiguous in the original order,
    their scales computed from ``w`` before any update (the reference's
    ``static_groups=True``), so that the result has the quantizer's own
    layout and serves without a permutation.

    The computation runs in float32 (float64 for float64 input under
    ``jax_enable_x64``), jitted once per shape and configuration: a
    ``lax.fori_loop`` over blocks of rows and one inside each block. ``H``
    may be the sum or the mean over rows (GPTQ is invariant to its scale).
    Called with concrete arrays, a Hessian that is not positive definite
    after damping raises; under an outer ``jit`` (traced arrays) it cannot,
    and the weight comes back NaN.

    :meth:`quantize` returns a :class:`GptqResult` of ``w`` on
    ``stats.hessian`` (``H = X^T X`` over the calibration rows ``X`` of
    ``x``, ``(K, K)``): the quantized weight (dequantized, ``w``'s shape and
    dtype) and the scales it used. The quantizer is the target grid (with a
    calibration, not a scale provider), its granularity applied to ``w``
    with contracting axis 0; stochastic rounding is not supported.

    Attributes:
      damping: The fraction of ``mean(diag H)`` added to the diagonal.
      act_order: Process input channels by descending ``diag(H)``.
      block_size: Rows per lazy-batch block: a speed knob, not a numerics
        one. The block used is the largest size up to this that divides
        ``K`` and divides or is a multiple of the group.

    Raises:
      InvalidArgumentError: For a negative ``damping``, a non-bool
        ``act_order`` or a ``block_size`` < 1; from :meth:`quantize`: if
        ``w`` is not a 2-D float array, ``hessian`` is
        not ``(K, K)``, either holds NaN or inf (concrete arrays), the
        quantizer's groups do not divide ``K`` (its own error) or it has a
        scale provider, or the damped Hessian, finite, is not positive
        definite (raise ``damping``).

    Example:
      >>> rng = np.random.default_rng(0)
      >>> x = rng.standard_normal((64, 16), np.float32)
      >>> w = rng.standard_normal((16, 8), np.float32)
      >>> int4 = qbits.Quantizer(qbits.IntNumerics(bits=4),
      ...                        granularity=qbits.Tiled(tile_size=8))
      >>> stats = qbits.ptq.InputStats.of(x)
      >>> out = qbits.ptq.Gptq().quantize(w, stats, int4)  # groups of 8 rows
      >>> out.weight.shape, out.weight.dtype, out.scale.shape
      ((16, 8), dtype('float32'), (2, 8))
      >>> qbits.ptq.Gptq(damping=0.02)
      Gptq(damping=0.02, act_order=False, block_size=128)
    """

    name: ClassVar[str] = "gptq"
    damping: float = 0.01
    act_order: bool = False
    block_size: int = 128

    def __post_init__(self) -> None:
        owner = "qbits.ptq.Gptq"
        check_float(owner, "damping", self.damping, lo=0.0)
        check_bool(owner, "act_order", self.act_order)
        check_int(owner, "block_size", self.block_size, 1)

    def quantize(
        self, w: jax.Array, stats: InputStats, quantizer: Quantizer
    ) -> GptqResult:
        """GPTQ of ``w`` on ``stats.hessian`` (see :class:`Gptq`)."""
        return gptq(w, stats.hessian, quantizer, damping=self.damping,
                    act_order=self.act_order, block_size=self.block_size)  # fmt: skip
