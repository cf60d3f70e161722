"""The quantized-matmul core: one custom VJP for every quantized matmul.

A quantized matmul is three contractions of two quantized operands each
(see :class:`~qbits.DotGeneralConfig`): the forward ``out = C(lhs, rhs)``,
and the two that give the gradients, ``d_lhs = C_l(g, rhs)`` and
``d_rhs = C_r(g, lhs)``. A :class:`Contraction` says what the three
contract and computes each from quantized operands (a ``dot_general`` for
:func:`qbits.dot_general` and :func:`qbits.einsum`, a convolution and its
transposes for :func:`qbits.conv_general_dilated`, ragged dots for
:func:`qbits.ops.ragged_dot`); :func:`apply` ties the three together with
the one ``jax.custom_vjp`` of qbits. A contraction may need arrays besides
its operands (``ragged_dot``'s group sizes: ``apply``'s ``data``) and work
on another form of an operand (:meth:`Contraction.prepare`).

Scales:
  Each operand's scale is computed from the operand by its quantizer's
  calibration, or given: a quantizer whose calibration is a
  :class:`~qbits.ScaleProvider` takes the scale of its tensor
  (``"lhs"``, ``"rhs"`` or ``"grad"``, the output gradient) from the
  ``scales`` argument. The cotangent of a given scale is the tensor's amax
  per scale block, this step's observation of it: new scale state leaves
  the backward pass this way and no other (:mod:`qbits.ops._state` turns it
  into the provider's next state).

Diagnostics:
  A call given a probe (``plan.diagnose``; :mod:`qbits.ops._diagnose`)
  measures each quantized operand: the forward operands and the operands
  the backward matmuls keep where they are quantized (in the forward pass,
  kept as small residuals), the output gradient where the backward matmuls
  quantize it. The measurements are the probe's cotangent, as an observed
  amax is a given scale's. Without a probe nothing of it is traced.

Residuals:
  The forward pass keeps the forward operands as the backward matmuls will
  use them: quantized already (a stored int8/fp8 array is a quarter of a
  float32 one, and quantizing next to the forward pass reads the operand
  while it is still in cache), or the forward's own quantized operand when
  a backward matmul reuses it (``use_fwd_quant``). Only for the backward
  matmuls that are needed: the custom VJP sees which arguments are
  differentiated (symbolic zeros), and the input gradient of a first layer
  or the gradient of a frozen weight is never traced.

Higher derivatives:
  A derivative of a gradient (``jax.hessian``, ``jax.jvp`` of ``jax.grad``,
  a gradient of a gradient) differentiates the rules of the custom VJP:
  both are given straight-through derivatives at every order
  (:mod:`qbits.ops._straight_through`). The matmul itself has no forward
  mode (:mod:`qbits.ops._reverse_only`).

``shard_map``:
  Inside ``jax.shard_map`` (with its default ``check_vma=True``) every
  cotangent gets the varying mesh axes of its primal: a gradient is summed
  over the axes along which it varies and its operand does not (the
  transpose of JAX's implicit ``pvary``), and an observed amax is maxed
  over them. A tensor that differs per shard draws its stochastic-rounding
  noise with the shard's index folded into its key (independent rounding
  errors on each shard, not copies).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero, zero_from_primal

from qbits._platform import per_platform
from qbits._tensor import QTensor
from qbits.numerics import next_key
from qbits.ops._backward import (
    backward_matmuls,
    backward_specs,
    gradient_operands,
)
from qbits.ops._config import IDENTITY, DotGeneralConfig, MatmulConfig
from qbits.ops._diagnose import as_cotangent, init_probe, measure, to_probe
from qbits.ops._operands import (
    SLOTS,
    TENSORS,
    Contraction,
    Grad,
    Operand,
    Reused,
    block_amax,
    fits,
    provider,
    quantize,
    unquantized,
    varying,
)
from qbits.ops._reverse_only import forward_mode_error, reverse_mode_only
from qbits.ops._straight_through import (
    instantiate,
    straight_through,
    through_codes_error,
)

__all__ = [
    "SLOTS",
    "TENSORS",
    "Contraction",
    "Operand",
    "Plan",
    "apply",
    "block_amax",
    "provider",
    "quantize",
    "varying",
]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one quantized matmul call.

    Attributes:
      config: The three matmuls.
      contraction: The forward contraction.
      dtypes: The operands' dtypes (their cotangents' dtypes).
      observe: Tensors whose amax the backward pass reports as the
        cotangent of their given scale.
      vma: The varying manual mesh axes of ``lhs``, ``rhs`` and of each
        given scale (``"<tensor>_scale"``), inside ``shard_map``; empty
        elsewhere.
      diagnose: Whether the call is given a probe (:mod:`._diagnose`):
        every quantized operand is measured, and the measurements are the
        probe's cotangent.
    """

    config: DotGeneralConfig
    contraction: Contraction
    dtypes: tuple[np.dtype, np.dtype]
    observe: tuple[str, ...] = ()
    vma: tuple[tuple[str, frozenset], ...] = ()
    diagnose: bool = False


def apply(
    plan: Plan,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    scales: dict[str, jax.Array],
    data: Any = None,
    probe: Any = None,
) -> jax.Array:
    """The quantized matmul of ``plan``: ``C(lhs, rhs)`` with its custom VJP.

    Args:
      plan: What to compute and how to quantize.
      lhs: The left operand, floating point.
      rhs: The right operand.
      key: PRNG key for stochastic rounding, or ``None``; ignored by a
        config that rounds to nearest everywhere. Operand ``SLOTS[i]`` draws
        from ``derive_key(next_key(key), i)``: :func:`~qbits.numerics.next_key`
        computes the key in a small kernel of its own, so the kernels that
        draw noise are the same for every layer whatever constants derived
        the layer's key.
      scales: The given scale of each tensor with a scale provider, shaped
        like the scale its quantizers compute (one entry per block).
      data: Arrays the contraction needs besides the operands (a pytree,
        not differentiated; ``ragged_dot``'s group sizes), bound to it where
        it is traced (:meth:`Contraction.bind`); ``None`` for most.
      probe: With ``plan.diagnose``, a probe (:func:`~._diagnose.init_probe`)
        whose cotangent is the measurements of every quantized operand
        (:mod:`qbits.ops._diagnose`); ``None`` otherwise.

    Returns:
      The output, in the dtype the unquantized operation gives.

    Raises:
      InvalidArgumentError: Under forward-mode differentiation of the matmul
        itself (``jax.jvp``, ``jax.jacfwd``, applying ``jax.linearize``'s
        function), which a custom VJP does not have (derivatives of its
        gradient, forward mode included, are straight-through); for a mixed
        second derivative through the quantized codes a backward matmul
        keeps (:mod:`qbits.ops._straight_through`).
    """
    key = next_key(key) if key is not None and plan.config.needs_key else None
    lhs, rhs, scales = reverse_mode_only((lhs, rhs, scales))
    try:
        return _jit_core(plan, lhs, rhs, key, scales, data, probe)
    except TypeError as e:  # JAX's own, where it meets the forward mode first
        if "forward-mode" not in str(e):
            raise
        raise forward_mode_error() from None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(
    plan: Plan,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    scales: dict[str, jax.Array],
    data: Any,
    probe: Any,
) -> jax.Array:
    # Without differentiation only the forward matmul is traced: nothing of
    # the backward matmuls (their operands, their configs' checks).
    return _forward(plan, lhs, rhs, key, scales, data)[0]


def _forward(
    plan: Plan,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    scales: dict[str, jax.Array],
    data: Any,
    *,
    kept: tuple[str, ...] | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
    """The forward matmul, and its operands quantized.

    Returns the output and ``{"lhs", "rhs"}`` (the forward operands as
    ``(QTensor, grad)``). Differentiated (``kept`` not ``None``), also for
    each backward matmul named in ``kept`` (``"dlhs"``, ``"drhs"``) the
    forward operand it keeps (see :func:`_for_backward`); one not kept still
    takes its place in the scale kernel (a placeholder, see
    :class:`~qbits._quantizer.Request`), so that the kernels are those of a
    call that keeps both.
    """
    config, c = plan.config, plan.contraction.bind(data)
    fwd = config.fwd
    lc, rc = c.contracting
    operands: dict[str, Operand] = {}
    if not fwd.is_identity:
        real = fwd.mode == "real"
        operands["lhs"] = Operand(fwd.lhs, lhs, lc, 0, real, scales.get("lhs"))
        operands["rhs"] = Operand(fwd.rhs, rhs, rc, 1, real, scales.get("rhs"))
    backward = {
        "dlhs": (config.dlhs, "lhs", rhs, "rhs", 3),
        "drhs": (config.drhs, "rhs", lhs, "lhs", 5),
    }
    for name in () if kept is None else ("dlhs", "drhs"):
        cfg, side, x, tensor, slot = backward[name]
        cg = c.gradient(side)
        axes = cg.contracting[1]
        if cfg.use_fwd_quant or cfg.rhs == IDENTITY:
            continue
        x = cg.prepare(x, "rhs")
        if name not in kept:
            if not fits(cfg.rhs, x, axes):  # no place to keep
                continue
            x = jax.ShapeDtypeStruct(x.shape, x.dtype)
        operands[name] = Operand(
            cfg.rhs, x, axes, slot, cfg.mode == "real", scales.get(tensor)
        )
    done = {n: v for n, v in quantize(operands, key).items() if v is not None}
    if fwd.is_identity:
        done["lhs"] = (unquantized(lhs), Grad(_identity))
        done["rhs"] = (unquantized(rhs), Grad(_identity))
        out = c.plain(lhs, rhs)
    else:
        out = c(done["lhs"][0], done["rhs"][0], fwd)
    if plan.diagnose and kept is not None:
        done["measured"] = _measure_forward(plan, operands, done, kept)
    for name in kept or ():
        cfg, _, x, tensor, _ = backward[name]
        done[name] = _for_backward(cfg, x, done[tensor][0], done.get(name))
    return out, done


def _measure_forward(
    plan: Plan,
    operands: dict[str, Operand],
    done: dict[str, Any],
    kept: tuple[str, ...],
) -> dict[str, Any]:
    """The measurements of the operands the forward pass quantizes."""
    measured = {}
    for name, slot in (("lhs", "fwd.lhs"), ("rhs", "fwd.rhs")):
        if name in operands:
            o = operands[name]
            measured[slot] = measure(o.quantizer, o.x, done[name][0], o.contracting)
    for name, tensor, slot in (
        ("dlhs", "rhs", "dlhs.rhs"),
        ("drhs", "lhs", "drhs.lhs"),
    ):
        if name not in kept:
            continue
        if getattr(plan.config, name).use_fwd_quant:
            if f"fwd.{tensor}" in measured:
                measured[slot] = measured[f"fwd.{tensor}"]
        elif name in operands and name in done:
            o = operands[name]
            measured[slot] = measure(o.quantizer, o.x, done[name][0], o.contracting)
    return measured


def _fwd(
    plan: Plan,
    lhs: Any,
    rhs: Any,
    key: Any,
    scales: dict[str, Any],
    data: Any,
    probe: Any,
) -> tuple[jax.Array, tuple[Any, ...]]:
    # Symbolic zeros: each argument comes with whether it is differentiated
    # (``perturbed``). A backward matmul whose gradient nobody needs (the
    # first layer's input gradient, a frozen weight's) is never traced: its
    # operand is not quantized here, nor the output gradient for it in the
    # backward pass (which XLA could not drop once its scale arithmetic
    # shares a kernel with the needed ones').
    needed = tuple(
        name for name, arg in (("dlhs", lhs), ("drhs", rhs)) if arg.perturbed
    )
    lhs, rhs = lhs.value, rhs.value
    key = jax.tree.map(lambda k: k.value, key)
    data = jax.tree.map(lambda d: d.value, data)
    probe = jax.tree.map(lambda p: p.value, probe)
    scales = {t: s.value for t, s in scales.items()}
    fwd, c = plan.config.fwd, plan.contraction
    out, done = _kept_forward(plan, needed, lhs, rhs, key, scales, data)
    # The forward measurements, in the probe's layout (a fixed structure).
    measured = None
    if probe is not None:
        measured = (to_probe(init_probe(), done.pop("measured")), probe)
    lc, rc = c.contracting
    amax = {
        t: block_amax(q, x, axes)
        for t, q, x, axes in (("lhs", fwd.lhs, lhs, lc), ("rhs", fwd.rhs, rhs, rc))
        if t in plan.observe
    }
    # JAX keeps the residuals' structure from the first linearization of this
    # (cached) core for every later one, whatever is perturbed there: an
    # unneeded matmul's slot holds a stand-in of the same structure, and
    # which matmuls are needed is in the shape of ``needs`` (static in _bwd).
    sources = {"dlhs": (rhs, "rhs"), "drhs": (lhs, "lhs")}
    slots = [
        done[name]
        if name in done
        else _stand_in(getattr(plan.config, name), x, done[tensor][0])
        for name, (x, tensor) in sources.items()
    ]
    needs = jnp.zeros(tuple(int(n in needed) for n in sources), jnp.bool_)
    residuals = (
        *slots,
        needs,
        done["lhs"][1],
        done["rhs"][1],
        key,
        scales.get("grad"),
        amax,
        {t: jnp.zeros_like(s) for t, s in scales.items()},
        data,
        measured,
    )
    return out, residuals


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _kept_forward(
    plan: Plan,
    needed: tuple[str, ...],
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    scales: dict[str, jax.Array],
    data: Any,
) -> tuple[jax.Array, dict[str, Any]]:
    """:func:`_forward`, keeping the operands of the backward matmuls ``needed``.

    Differentiated (a derivative of a gradient), the output is
    straight-through: ``C(dlhs, Q(rhs)) + C(Q(lhs), drhs)``
    (:mod:`qbits.ops._straight_through`).
    """
    return _forward(plan, lhs, rhs, key, scales, data, kept=needed)


def _kept_forward_jvp(
    plan: Plan, needed: tuple[str, ...], primals: tuple[Any, ...], tangents: Any
) -> tuple[Any, Any]:
    lhs, rhs, key, scales, data = primals
    dl, dr = tangents[0], tangents[1]
    out, done = _kept_forward(plan, needed, lhs, rhs, key, scales, data)
    # What the backward matmuls keep: a float operand carries its derivative,
    # quantized codes carry none (scales and masks have derivative zero).
    t_done = zero_from_primal(done, True)
    for name, tensor, t in (("dlhs", "rhs", dr), ("drhs", "lhs", dl)):
        if name not in needed or isinstance(t, SymbolicZero):
            continue
        if isinstance(done[name], QTensor | Reused):
            raise through_codes_error(name, tensor)
        t_done[name] = t
    (lq, lgrad), (rq, rgrad) = done["lhs"], done["rhs"]

    def emulated(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        a = straight_through(lhs, lq.dequant(), lgrad)
        b = straight_through(rhs, rq.dequant(), rgrad)
        return plan.contraction.bind(data).plain(a, b).astype(out.dtype)

    args = (lhs, rhs)
    _, t_out = jax.jvp(emulated, args, instantiate((dl, dr), args))
    return (out, done), (t_out, t_done)


_kept_forward.defjvp(_kept_forward_jvp, symbolic_zeros=True)


def _stand_in(cfg: MatmulConfig, x: jax.Array, forward: QTensor) -> Any:
    """What a backward matmul nobody needs keeps: its residual's structure.

    The structure :func:`_for_backward` gives (a forward operand, or the
    float operand, cost nothing; a quantized one is a QTensor of the same
    static fields with empty values).
    """
    if cfg.use_fwd_quant or cfg.rhs == IDENTITY:
        return _for_backward(cfg, x, forward, None)
    empty = jnp.zeros((0,), jnp.float32)
    qdtype = cfg.rhs.numerics.get_dtype()
    return QTensor(empty, empty, qdtype=qdtype, dtype=np.dtype(x.dtype))


def _for_backward(
    cfg: MatmulConfig,
    x: jax.Array,
    forward: QTensor,
    quantized: tuple[QTensor, Grad] | None,
) -> jax.Array | QTensor | Reused:
    """A forward operand as the backward matmul ``cfg`` (its rhs) will use it.

    The forward's own quantized operand (``use_fwd_quant``), the operand
    quantized for this matmul, or the float operand (``cfg.rhs`` is the
    identity).
    """
    if cfg.use_fwd_quant:
        return Reused(forward)
    if quantized is None:
        return x
    return quantized[0]


def _as_is(g: jax.Array, amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    return g, amax


def _measured_first(g: jax.Array, amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The gradient as it was when its amax (delayed scaling's) was taken.

    On a GPU the amax then comes from the kernel that makes the gradient
    (one pass writing it and reducing it, as under current scaling);
    otherwise XLA fuses the gradient's producer into the cast that writes
    its codes, writes the gradient a second time beside them and reads it
    again for the amax (a 268 MB pass per step on the GPU benchmark's MLP).
    """
    return lax.optimization_barrier((g, amax))


def _bwd(plan: Plan, residuals: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
    (rhs_b, lhs_b, needs, lgrad, rgrad, key, gscale, amax, zeros, data,
     measured) = residuals  # fmt: skip
    config, c = plan.config, plan.contraction
    if isinstance(g, SymbolicZero):  # nothing flows back
        probe = None if measured is None else as_cotangent(*measured)
        return None, None, None, {t: None for t in zeros}, None, probe
    needed = tuple(n for n, k in zip(("dlhs", "drhs"), needs.shape, strict=True) if k)
    observed = dict(zeros)
    observed.update(amax)
    if "grad" in plan.observe:
        side = "lhs" if provider(config.dlhs.lhs) else "rhs"
        q = config.dlhs.lhs if side == "lhs" else config.drhs.lhs
        cg = c.bind(data).gradient(side)
        gamax = block_amax(q, cg.prepare(g, "lhs"), cg.contracting[0])
        g, observed["grad"] = per_platform(
            g, gamax, cpu=_as_is, cuda=_measured_first, default=_as_is
        )
    grads, gq = backward_matmuls(config, c, needed, g, rhs_b, lhs_b, key, gscale, data)
    if measured is not None:
        found, probe = measured
        found = _measure_backward(plan, found, needed, g, rhs_b, lhs_b, gscale,
                                  data, gq)  # fmt: skip
        measured = as_cotangent(found, probe)
    vma = dict(plan.vma)
    dl = dr = None
    if "dlhs" in grads:
        dl = lgrad(grads["dlhs"].astype(plan.dtypes[0]))
        dl = _match_vma(dl, vma.get("lhs", frozenset()), lax.psum)
    if "drhs" in grads:
        dr = rgrad(grads["drhs"].astype(plan.dtypes[1]))
        dr = _match_vma(dr, vma.get("rhs", frozenset()), lax.psum)
    for t in observed:
        observed[t] = _match_vma(
            observed[t].reshape(zeros[t].shape),
            vma.get(f"{t}_scale", frozenset()),
            lax.pmax,
        )
    return dl, dr, None, observed, None, measured


def _measure_backward(
    plan: Plan,
    measured: dict[str, jax.Array],
    needed: tuple[str, ...],
    g: jax.Array,
    rhs_b: Any,
    lhs_b: Any,
    gscale: Any,
    data: Any,
    quantized: dict[str, Any],
) -> dict[str, jax.Array]:
    """``measured`` with the output gradient's measurements added."""
    specs = backward_specs(plan.config, plan.contraction.bind(data), rhs_b, lhs_b)
    operands = gradient_operands(specs, needed, g, gscale)
    found = {
        f"{name}.grad": measure(o.quantizer, o.x, quantized[name][0], o.contracting)
        for name, o in operands.items()
        if name in quantized
    }
    return to_probe(measured, found)


def _identity(g: jax.Array) -> jax.Array:
    return g


def _match_vma(ct: jax.Array, want: frozenset, combine: Any) -> jax.Array:
    """``ct`` with exactly the varying mesh axes ``want`` (see the docstring)."""
    have = varying(ct)
    extra = tuple(sorted(have - want, key=str))
    if extra:
        ct = combine(ct, extra)
    missing = tuple(sorted(want - varying(ct), key=str))
    if missing:
        ct = lax.pcast(ct, missing, to="varying")
    return ct


_core.defvjp(_fwd, _bwd, symbolic_zeros=True)


_jit_core = jax.jit(_core, static_argnums=0)
