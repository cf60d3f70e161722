r"""AWQ with its scales folded into the layer before: weights on their grids.

:class:`~qbits.ptq.Awq` alone gives each weight the effective weight
``Q(s w) / s``, on no grid a checkpoint format stores. AutoAWQ (its
``apply_scale``) keeps ``Q(s w)`` instead and divides the activation by
``s`` in the layer that makes it: a norm's scale (and bias), or the output
channels of the projection before (Llama's ``v_proj`` before ``o_proj``).
:func:`~qbits.ptq.quantize_weights` does the same with ``fold=``: a
mapping ``{layer before: matmuls}`` whose matmuls all read that layer's
output. For each entry, in order:

- one ``s`` for all its matmuls, searched as :class:`~qbits.ptq.Awq`
  searches one weight's (``alpha`` in ``linspace(0, 1, grid)``, then each
  scale block's clipping ratio) with their output errors summed, as
  AutoAWQ searches ``q/k/v`` together (they read one input: their
  statistics must be equal);
- each matmul's weight becomes ``Q(s w)``, on its quantizer's grid, with
  its codes and scales stored as serving stores them (``PtqResult.stored``);
- every parameter under the layer before is divided by ``s`` along its
  last axes, as many as make ``K`` (a norm's ``(K,)`` scale and bias; a
  projection's ``(in, heads, head_dim)`` kernel and ``(heads, head_dim)``
  bias before a matmul that contracts ``(heads, head_dim)``).

Weights in no entry get ``s = 1`` (the clipping search alone: an MLP's
down projection after a GELU has no linear layer before it). A layer
before may itself be a weight quantized here (``v_proj``): its entry, which
divides its output channels, must come before the one that quantizes it;
a weight whose output channels are not its parameter's last axes (Flax
GPT-2's ``[out, in]`` kernels) cannot be a layer before.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._calibration import AbsMax
from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits.ptq._awq import Awq, awq_scales
from qbits.ptq._gptq import GptqResult, output_error
from qbits.ptq._plan import Weight
from qbits.ptq._rtn import rtn

__all__ = ["check_fold", "check_folded", "fold_awq"]


def check_fold(
    owner: str, fold: Any, method: Any, smooth: Any, rotate: bool, stats: Any
) -> dict[str, tuple[str, ...]]:
    """``fold`` as ``{layer before: (matmul paths)}``; raises for what it cannot do."""
    allowed = (
        "a mapping {layer before: matmul paths reading its output}, e.g. "
        "{'blocks/0/norm1': ('blocks/0/attn/query', 'blocks/0/attn/key')}"
    )
    if not isinstance(fold, Mapping) or not all(
        isinstance(k, str)
        and not isinstance(v, str)
        and len(v) > 0
        and all(isinstance(m, str) for m in v)
        for k, v in fold.items()
    ):
        raise InvalidArgumentError(owner, "fold", fold, allowed)
    why = None
    if not isinstance(method, Awq):
        why = f"method={method!r}: only AWQ has scales to fold"
    elif smooth is not None or rotate:
        why = "smooth and rotate transform the activation online, not folded"
    elif stats is not None:
        why = "stats: fold needs the batches (give batches, not stats)"
    if why:
        raise InvalidArgumentError(
            owner, "fold", "given", "fold with method=qbits.ptq.Awq() and batches "
            "alone (no smooth, rotate or stats)", why=why,
        )  # fmt: skip
    return {k: tuple(v) for k, v in fold.items()}


def fold_awq(
    owner: str,
    weights: list[Weight],
    values: list[Any],
    names: list[tuple[str, ...]],
    fold: dict[str, tuple[str, ...]],
    method: Awq,
) -> list[tuple[Weight, jax.Array, tuple[float, float], GptqResult, jax.Array]]:
    """Quantizes every weight by AWQ with ``fold``; updates ``values`` in place.

    Args:
      owner: Named in errors.
      weights: The driver's plan.
      values: The flattened parameters (the layers before are divided here).
      names: Each parameter's key path as strings (``("blocks", "0",
        "norm1", "scale")``).
      fold: What :func:`check_fold` returned.
      method: Its settings (``grid``, ``clip_grid``).

    Returns:
      Per weight, in the order quantized: the weight, its new ``(K, N)``
      matrix ``Q(s w)`` (on the grid), ``(error_rtn, error)`` (of the
      effective ``Q(s w) / s`` against the float weight, per calibration
      row), its grid (scales, zero points) for storing, and ``s w`` in
      float (for :func:`check_folded`).
    """
    by_path = {p: w for w in weights for p in w.paths}
    seen: dict[str, str] = {}
    groups: list[tuple[str | None, list[Weight]]] = []
    for before, matmuls in fold.items():
        members = []
        for m in matmuls:
            if m not in by_path:
                raise InvalidArgumentError(
                    owner, "fold", f"{before!r}: {m!r}",
                    "paths of weight matmuls the config quantizes: "
                    + ", ".join(sorted(by_path)),
                )  # fmt: skip
            if m in seen:
                raise InvalidArgumentError(
                    owner, "fold", f"{before!r}: {m!r}",
                    "each matmul under one layer before",
                    why=f"{m!r} is under {seen[m]!r} too",
                )  # fmt: skip
            seen[m] = before
            if by_path[m] not in members:
                members.append(by_path[m])
        groups.append((before, members))
    for w in weights:
        if not any(p in seen for p in w.paths):
            groups.append((None, [w]))
    done: dict[int, str] = {}  # leaves quantized so far
    by_leaf = {w.leaf: w for w in weights}
    out = []
    for before, members in groups:
        for w in members:
            if w.ms.layers or w.ms.batch:
                raise InvalidArgumentError(
                    owner, "fold", "given", "fold for weights that are one (K, N) "
                    "matrix each", why=f"{w.ms.path!r} has stacked layers or "
                    "groups (a scan, a per-group weight)",
                )  # fmt: skip
        mats = tuple(  # float32, as the driver quantizes every weight
            w.ms.matrix(w.ms.operand(values[w.leaf])).astype(jnp.float32)
            for w in members
        )
        first = members[0]
        for w in members[1:]:
            if w.quantizer != first.quantizer:
                raise InvalidArgumentError(
                    owner, "fold", f"{before!r}",
                    "matmuls with one weight quantizer under one layer before",
                    why=f"{first.ms.path!r} and {w.ms.path!r} have other grids",
                )  # fmt: skip
            if not np.array_equal(w.stats.hessian, first.stats.hessian):
                raise InvalidArgumentError(
                    owner, "fold", f"{before!r}",
                    "matmuls that read the same input under one layer before",
                    why=f"{first.ms.path!r} and {w.ms.path!r} read other inputs",
                )  # fmt: skip
        leaves = [] if before is None else _leaves(owner, before, names)
        for leaf in leaves:
            reader = by_leaf.get(leaf)  # a weight: its outputs must be last
            n = len(np.shape(values[leaf]))
            if reader is not None and (
                reader.ms.index is not None
                or tuple(reader.ms.free) != tuple(range(n - len(reader.ms.free), n))
            ):
                raise InvalidArgumentError(
                    owner, "fold", f"{before!r}",
                    "a layer whose parameters end in their output channels",
                    why=f"{reader.ms.path!r} reads {'/'.join(names[leaf])!r} "
                    "with its output channels elsewhere (a kernel stored "
                    "[out, in])",
                )  # fmt: skip
            if leaf in done:
                raise InvalidArgumentError(
                    owner, "fold", f"{before!r}",
                    f"{before!r} listed before {done[leaf]!r}",
                    why=f"{before!r} divides {'/'.join(names[leaf])!r}, which "
                    f"{done[leaf]!r} quantized before it",
                )  # fmt: skip
        grid = method.grid if before is not None else 1
        clip_grid = (
            method.clip_grid if isinstance(first.quantizer.calibration, AbsMax) else 1
        )
        s, grids = _search(
            mats, first.stats.hessian, first.stats.absmean,
            quantizer=first.quantizer, grid=grid, clip_grid=clip_grid,
        )  # fmt: skip
        rows = float(jnp.maximum(first.stats.rows, 1.0))
        for w, m, g in zip(members, mats, grids, strict=True):
            err_rtn = float(
                output_error(m, rtn(m, w.quantizer).weight, w.stats.hessian)
            )
            err = float(output_error(m, g.weight / s[:, None], w.stats.hessian))
            errors = (err_rtn / rows, err / rows)
            out.append((w, g.weight.astype(m.dtype), errors, g, m * s[:, None]))
            done[w.leaf] = before or w.ms.path
        k = s.shape[0]
        for leaf in leaves:
            values[leaf] = _divide(owner, before, names[leaf], values[leaf], s, k)
    return out


def check_folded(
    owner: str, fn: Any, params: Any, folded: Any, batch: Any, fold: Any
) -> None:
    """Raises unless the model with the scales folded, in float, is the model.

    ``folded``: the parameters with each layer before divided by ``s`` and
    each weight ``s w`` (not quantized). They compute what ``params`` do
    only if every reader of a layer before's output is one of its matmuls:
    a layer whose output also reaches another matmul, a residual or the
    output would silently change the model.
    """
    # float32 parameters: 1e-3 of the largest output; narrower ones round
    # the divided layers and s w (bfloat16: about 1e-2 on their own).
    kinds = {
        np.dtype(x.dtype)
        for x in jax.tree.leaves(folded)
        if jnp.issubdtype(x.dtype, jnp.floating)
    }
    tol = max([1e-3] + [8 * float(jnp.finfo(k).eps) for k in kinds])
    want = jax.tree.leaves(jax.jit(fn)(params, batch))
    got = jax.tree.leaves(jax.jit(fn)(folded, batch))
    for a, b in zip(want, got, strict=True):
        if not jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating):
            continue
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        top = float(np.max(np.abs(a), initial=0.0))
        off = float(np.max(np.abs(a - b), initial=0.0))
        if not off <= tol * top:  # NaN too
            raise InvalidArgumentError(
                owner, "fold", fold,
                "layers before whose output only their listed matmuls read "
                "(a norm before all of q, k and v; not a layer whose output "
                "also reaches another matmul, a residual or the output)",
                why=f"in float, the model with AWQ's scales folded differs "
                f"from the model by {off / max(top, 1e-30):.2g} of its "
                "largest output on the first batch",
            )  # fmt: skip


def _leaves(owner: str, before: str, names: list[tuple[str, ...]]) -> list[int]:
    """The parameters under ``before`` (a ``/`` path of their keys)."""
    parts = tuple(before.split("/"))
    found = [i for i, n in enumerate(names) if n[: len(parts)] == parts]
    if not found:
        raise InvalidArgumentError(
            owner, "fold", f"{before!r}", "a layer whose parameters are in params",
            why=f"no parameter is under {before!r}",
        )  # fmt: skip
    return found


def _divide(
    owner: str, before: str, name: tuple[str, ...], v: Any, s: jax.Array, k: int
) -> jax.Array:
    """``v`` divided by ``s`` along its last axes whose sizes multiply to ``k``."""
    shape = tuple(np.shape(v))
    for t in range(1, len(shape) + 1):
        if math.prod(shape[-t:]) == k:
            v = jnp.asarray(v)  # divided in float32, kept in its dtype
            return (v.astype(jnp.float32) / s.reshape(shape[-t:])).astype(v.dtype)
    raise InvalidArgumentError(
        owner, "fold", f"{before!r}",
        f"a layer whose parameters end in {k} output channels",
        why=f"{'/'.join(name)!r} has shape {list(shape)}",
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("quantizer", "grid", "clip_grid"))
def _search(
    mats: tuple[jax.Array, ...],
    hessian: jax.Array,
    absmean: jax.Array,
    *,
    quantizer: Quantizer,
    grid: int,
    clip_grid: int,
) -> tuple[jax.Array, tuple[GptqResult, ...]]:
    """One ``s`` for ``mats`` (their errors summed) and each ``Q(s w)``'s grid."""
    mats = tuple(m.astype(jnp.float32) for m in mats)
    h = hessian.astype(jnp.float32)

    def error(alpha: jax.Array) -> jax.Array:
        s = awq_scales(absmean, alpha)[:, None]
        return sum(output_error(m, rtn(m * s, quantizer).weight / s, h) for m in mats)

    alphas = jnp.linspace(0.0, 1.0, grid, dtype=jnp.float32)
    s = awq_scales(absmean, alphas[jnp.argmin(lax.map(error, alphas))])
    grids = tuple(_clipped(m, h, s, quantizer, clip_grid) for m in mats)
    return s, grids


def _clipped(
    m: jax.Array, h: jax.Array, s: jax.Array, quantizer: Quantizer, clip_grid: int
) -> GptqResult:
    """``Q(s m)`` with each scale block's best clipping ratio (AWQ's ``auto_clip``).

    As :class:`~qbits.ptq.Awq`'s search: the ratio in ``linspace(1, 0.5,
    clip_grid)`` whose error on the block's own inputs is least, kept if
    the whole weight's error is below the unclipped one's. A grid with a
    tensor scale (NVFP4's, from the clipped bound) is not clipped: blocks
    of other ratios would lie on other tensor scales.
    """
    sm = m * s[:, None]
    plain = rtn(sm, quantizer)
    if clip_grid == 1 or plain.tensor_scale is not None:
        return plain
    k, n = m.shape
    group, block_n = quantizer.granularity.block_sizes(m.shape, (0,))[:2]
    base = quantizer.calibration.clip_factor
    ratios = np.linspace(1.0, 0.5, clip_grid)
    cands = [
        rtn(sm, quantizer.replace(calibration=AbsMax(clip_factor=base * float(r))))
        for r in ratios
    ]
    weights = jnp.stack([c.weight for c in cands])  # (R, K, N), on the grid
    hg = h.reshape(k // group, group, k // group, group)
    hg = jnp.diagonal(hg, axis1=0, axis2=2).transpose(2, 0, 1)  # (G, group, group)
    d = (m[None] - weights / s[:, None]).reshape(clip_grid, k // group, group, n)
    errs = jnp.einsum("rgin,gij,rgjn->rgn", d, hg, d, precision=lax.Precision.HIGHEST)
    errs = errs.reshape(clip_grid, k // group, n // block_n, block_n).sum(-1)
    pick = jnp.argmin(errs, axis=0)  # (G, N // block_n): the first on a tie
    spread = jnp.repeat(jnp.repeat(pick, group, 0), block_n, 1)

    def per_block(parts: list[jax.Array]) -> jax.Array:
        stacked = jnp.stack([p.reshape(pick.shape) for p in parts])
        return jnp.take_along_axis(stacked, pick[None], axis=0)[0]

    chosen = GptqResult(
        jnp.take_along_axis(weights, spread[None], axis=0)[0],
        per_block([c.scale for c in cands]).reshape(plain.scale.shape),
        None
        if plain.zero_point is None
        else per_block([c.zero_point for c in cands]).reshape(plain.zero_point.shape),
    )
    better = output_error(m, chosen.weight / s[:, None], h) < output_error(
        m, plain.weight / s[:, None], h
    )
    return jax.tree.map(lambda a, b: jnp.where(better, a, b), chosen, plain)
