"""Quantization diagnostics of one quantized matmul, as a probe's cotangent.

A *probe* is a small pytree of zeros (:func:`init_probe`) given to the core
(:func:`qbits.ops._core.apply`) beside the operands. The core measures each
quantized operand of its three matmuls (:data:`PROBE_SLOTS`): the forward
operands and the operands the backward matmuls keep in the forward pass,
the output gradient in the backward pass. What it measured is the
cotangent of the probe, as an observed amax is the cotangent of a given
scale (:mod:`qbits.ops._state`): ``jax.grad`` with respect to the probe
gives the measurements, under ``jit``, with no host callback. Without a
probe nothing is measured: the program is the one without diagnostics.

The measurements are sums (:data:`SUMS`) and maxima (:data:`MAXIMA`): the
cotangents of a probe used several times (every step of a loop over
micro-batches) add, and those of the maxima combine by max (they are
converted with :func:`qbits.DelayedScaling.max_combining`), so the metrics of
several uses are those of all their values together. :func:`read_probe`
turns them into the metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._tensor import QTensor, expand_scale, float_scale
from qbits.ops._operands import SLOTS, block_amax

__all__ = [
    "MAXIMA",
    "METRICS",
    "PROBE_SLOTS",
    "SQNR_CAP_DB",
    "SUMS",
    "as_cotangent",
    "init_probe",
    "measure",
    "read_probe",
    "to_probe",
]

#: The measured operands, in :data:`~qbits.ops._operands.SLOTS` order:
#: ``"<matmul>.<tensor>"`` (``"dlhs.grad"`` is the output gradient as the
#: input-gradient matmul quantizes it).
PROBE_SLOTS: tuple[str, ...] = tuple(f"{m}.{t}" for m, _, t, _ in SLOTS)

#: What is summed over an operand's values (and blocks).
SUMS: tuple[str, ...] = (
    "values",  # elements
    "nonzero",  # elements that are not 0
    "signal",  # sum x**2
    "noise",  # sum (x - Q(x))**2
    "clipped",  # elements beyond the grid's top edge (saturated)
    "flushed",  # nonzero elements quantized to 0
    "blocks",  # scale blocks with a nonzero amax
    "wasted",  # sum over those blocks of log2(grid max / (amax / scale))
    "nonfinite",  # elements that are NaN or +-inf
)

#: What is maxed: the largest ``log2(scale)``, and minus the smallest.
MAXIMA: tuple[str, ...] = ("log2_scale_max", "neg_log2_scale_min")

#: The metrics :func:`read_probe` gives for each operand.
METRICS: tuple[str, ...] = (
    "sqnr_db",
    "clipped",
    "flushed",
    "wasted_bits",
    "log2_scale_min",
    "log2_scale_max",
    "nonfinite",
)

#: The SQNR of an operand quantized without error (every value on the grid).
SQNR_CAP_DB = 150.0


def init_probe() -> dict[str, jax.Array]:
    """The zeros that make a quantized matmul report its diagnostics.

    Pass it as ``diagnostics=`` to a quantized matmul (e.g.
    :class:`~qbits.ops.DotGeneral`) and differentiate with respect to it:
    the gradient holds the measurements of every quantized operand, which
    :func:`read_probe` turns into metrics.

    Example:
      >>> probe = qbits.ops._init_probe()
      >>> {k: v.shape for k, v in probe.items()}
      {'sums': (6, 9), 'maxima': (6, 2)}
    """
    return {
        "sums": jnp.zeros((len(PROBE_SLOTS), len(SUMS)), jnp.float32),
        "maxima": jnp.zeros((len(PROBE_SLOTS), len(MAXIMA)), jnp.float32),
    }


def measure(
    quantizer: Any, x: jax.Array, qt: QTensor, contracting: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
    """The sums and maxima of one operand ``x`` quantized as ``qt``.

    Returns ``(f32[len(SUMS)], f32[len(MAXIMA)])``.
    """
    x = x.astype(jnp.float32)
    xq = qt.dequant().astype(jnp.float32)
    scale = float_scale(qt)  # a double-quantized scale decoded
    if qt.tensor_scale is not None:
        scale = scale * qt.tensor_scale.astype(jnp.float32)
    f32 = jnp.float32
    nonzero = x != 0
    sums = [
        f32(x.size),
        jnp.sum(nonzero, dtype=f32),
        jnp.sum(x * x),
        jnp.sum(jnp.square(x - xq)),
    ]
    edge = quantizer.numerics.saturation_edge()
    if edge is None:
        sums.append(f32(0))
    else:
        beyond = jnp.abs(x) > edge * expand_scale(scale, x.shape)
        sums.append(jnp.sum(beyond, dtype=f32))
    sums.append(jnp.sum(nonzero & (xq == 0), dtype=f32))
    mapped = quantizer.numerics.abs_val_mapped_to()
    amax = block_amax(quantizer, x, contracting).reshape(scale.shape)
    used = (amax > 0) & (scale > 0)
    if mapped is None:
        sums += [f32(0), f32(0)]
    else:
        ratio = jnp.where(used, mapped * scale / jnp.where(used, amax, 1), 1)
        sums += [jnp.sum(used, dtype=f32), jnp.sum(jnp.log2(ratio))]
    sums.append(jnp.sum(~jnp.isfinite(x), dtype=f32))
    positive = scale > 0
    log2 = jnp.log2(jnp.where(positive, scale, 1))
    maxima = [
        jnp.max(jnp.where(positive, log2, -jnp.inf)),
        jnp.max(jnp.where(positive, -log2, -jnp.inf)),
    ]
    return jnp.stack(sums), jnp.stack(maxima)


def to_probe(
    base: dict[str, jax.Array], measured: dict[str, tuple[jax.Array, jax.Array]]
) -> dict[str, jax.Array]:
    """``base`` (float32, a probe's layout) with the ``measured`` slots set."""
    sums, maxima = base["sums"], base["maxima"]
    for name, (s, m) in measured.items():
        i = PROBE_SLOTS.index(name)
        sums = sums.at[i].set(s)
        maxima = maxima.at[i].set(m)
    return {"sums": sums, "maxima": maxima}


def as_cotangent(measured: dict[str, jax.Array], probe: Any) -> dict[str, jax.Array]:
    """``measured`` in the dtypes of ``probe`` (float32, or max-combining)."""
    return {k: lax.convert_element_type(v, probe[k].dtype) for k, v in measured.items()}


def _check_raw(raw: Any) -> None:
    """Raises InvalidArgumentError unless ``raw`` is laid out like a probe."""
    want = {k: v.shape for k, v in init_probe().items()}
    ok = isinstance(raw, Mapping) and set(raw) == set(want)
    lead = set()
    for k, shape in want.items() if ok else ():
        x = raw[k]
        dtype = getattr(x, "dtype", None)
        ok = ok and dtype is not None and jnp.issubdtype(dtype, jnp.floating)
        ok = ok and tuple(np.shape(x)[-2:]) == shape
        lead.add(tuple(np.shape(x)[:-2]))
    if not ok or len(lead) > 1:
        raise InvalidArgumentError(
            "qbits.diagnostics.read",
            "raw",
            _shapes(raw),
            "the gradient of a probe of qbits.diagnostics.init: float arrays "
            + ", ".join(f"{k!r} shaped (..., {a}, {b})" for k, (a, b) in want.items())
            + " with the same leading (layer) axes",
        )


def _shapes(tree: Any) -> Any:
    """``tree`` with each array shown as its dtype and shape (for errors)."""

    def show(x: Any) -> Any:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return f"{np.dtype(x.dtype).name}{list(np.shape(x))}"
        return x

    return jax.tree.map(show, tree)


def read_probe(raw: dict[str, Any]) -> dict[str, dict[str, jax.Array]]:
    """The metrics of each quantized operand, from a probe's gradient.

    Args:
      raw: The gradient of a probe (:func:`init_probe`), with any leading
        axes (one per layer of a scan over stacked layers).

    Returns:
      ``{slot: {metric: array}}`` for each of :data:`PROBE_SLOTS`, each
      metric shaped like the probe's leading axes; NaN for an operand not
      measured (not quantized, or its matmul not run) or all zeros, and
      every metric but ``nonfinite`` NaN for an operand with a value that
      is not finite:

      - ``sqnr_db``: ``10 log10(sum x^2 / sum (x - Q(x))^2)``, capped at
        :data:`SQNR_CAP_DB` where ``Q(x) == x``.
      - ``clipped``: the fraction of values beyond the grid's top edge
        times the scale (saturated: integer grids, the edge of the top
        bucket, 127.5 for int8; float formats, their largest value plus
        half their top step).
      - ``flushed``: the fraction of nonzero values quantized to 0.
      - ``wasted_bits``: the mean over scale blocks (those with a nonzero
        amax) of ``log2(grid max / (amax / scale))``: how much of the
        grid's range the block leaves unused (0 for an absmax scale,
        negative where the scale clips).
      - ``log2_scale_min``, ``log2_scale_max``: the range of the scales.
      - ``nonfinite``: the number of values that are NaN or +-inf (0 for a
        finite operand, summed over the uses of a shared probe).

    Example:
      >>> dg = qbits.dot_general(qbits.presets.get("int8_fwd"))
      >>> x = jax.random.normal(jax.random.key(0), (8, 16))
      >>> w = jax.random.normal(jax.random.key(1), (16, 4))
      >>> loss = lambda w, probe: dg(x, w, (((1,), (0,)), ((), ())),
      ...                             diagnostics=probe).sum()
      >>> raw = jax.jit(jax.grad(loss, argnums=1))(w, qbits.ops._init_probe())
      >>> m = qbits.ops._read_probe(raw)
      >>> bool(m["fwd.rhs"]["sqnr_db"] > 30), float(m["fwd.rhs"]["clipped"])
      (True, 0.0)

    Raises:
      InvalidArgumentError: Unless ``raw`` has a probe's layout: ``"sums"``
        and ``"maxima"`` float arrays shaped ``(..., 6, 9)`` and
        ``(..., 6, 2)`` with the same leading axes.
    """
    _check_raw(raw)
    sums = jnp.asarray(raw["sums"], jnp.float32)
    maxima = jnp.asarray(raw["maxima"], jnp.float32)
    out: dict[str, dict[str, jax.Array]] = {}
    for i, slot in enumerate(PROBE_SLOTS):
        s = {k: sums[..., i, j] for j, k in enumerate(SUMS)}
        # Measured, not all zeros, and every value finite (a NaN or an inf
        # makes the sums, the scales and the quantized values meaningless).
        nonfinite = jnp.where(s["values"] > 0, s["nonfinite"], jnp.nan)
        seen = (s["nonzero"] > 0) & (s["nonfinite"] == 0)
        nan = jnp.full(seen.shape, jnp.nan, jnp.float32)

        def ratio(a: jax.Array, b: jax.Array, seen: jax.Array = seen) -> jax.Array:
            return jnp.where(seen & (b > 0), a / jnp.where(b > 0, b, 1), jnp.nan)

        sqnr = 10 * jnp.log10(s["signal"] / jnp.where(s["noise"] > 0, s["noise"], 1))
        sqnr = jnp.where(s["noise"] > 0, jnp.minimum(sqnr, SQNR_CAP_DB), SQNR_CAP_DB)
        out[slot] = {
            "sqnr_db": jnp.where(seen, sqnr, nan),
            "clipped": ratio(s["clipped"], s["values"]),
            "flushed": jnp.where(seen, ratio(s["flushed"], s["nonzero"]), nan),
            "wasted_bits": ratio(s["wasted"], s["blocks"]),
            "log2_scale_min": jnp.where(seen, -maxima[..., i, 1], nan),
            "log2_scale_max": jnp.where(seen, maxima[..., i, 0], nan),
            "nonfinite": nonfinite,
        }
    return out
