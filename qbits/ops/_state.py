"""Scale state of a quantized matmul: providers in, observations out.

A quantizer whose ``provider`` is a :class:`~qbits.ScaleProvider`
(``DelayedScaling``, ``LearnedScale``) takes its scale from state. A
quantized matmul has three tensors that can have one: ``"lhs"`` and
``"rhs"`` (quantized in the forward matmul and, as the other operand, in one
backward matmul) and ``"grad"`` (the output gradient, quantized in both
backward matmuls). Every quantizer of one tensor that has a provider must
have the same provider and give the same scale shape; it then uses the
tensor's one scale. The state is a flat dict, ``{"<tensor>_<name>": array}``::

    {"lhs_scale": f32[1], "lhs_amax_history": f32[L], "rhs_scale": ...,
     "grad_scale": ..., "grad_amax_history": ...}          # DelayedScaling
    {"lhs_step": f32[]}                                   # LearnedScale

(:func:`init_state`). Per-tensor scales have the shapes above; other
granularities add the scale's non-1 axes (``lhs_scale: f32[N]``,
``lhs_amax_history: f32[L, N]``).

How the state is updated (Flax ``fp8_ops``' design):
  The forward pass computes this step's scale from the state, and the core
  (:mod:`qbits.ops._core`) reports each observed tensor's amax as the
  cotangent of the scale it was given; the provider turns it into the next
  state (:meth:`~qbits.ScaleProvider.update`), which becomes the
  cotangent of the ``state`` argument. So ``jax.grad`` with respect to the
  state gives the next state, which a training step writes back instead of
  giving it to the optimizer (``qbits.flax.TrainState``,
  ``qbits.nnx.update_state``). A forward pass alone (evaluation) leaves the
  state unchanged. A learned step's cotangent is its true gradient
  (trainable state, for the optimizer).

Combining with max:
  When one state is used several times in one gradient (a layer applied in
  every step of a ``lax.scan``, micro-batches in one loss), JAX adds the
  cotangents of its uses. Replaced (not trained) state is therefore
  converted to Flax's ``fp32_max_grad`` dtype (a float32 whose cotangents
  add by ``max``) before it is used: all uses of one converted value
  combine with max. Every call converts its own state; to share one
  conversion between the calls in a loop, convert once outside the loop
  with :func:`qbits.DelayedScaling.max_combining` (idempotent). Max is right:
  every use computes the same new scale (from the same old history) and the
  same rolled history except for the newest entry, whose max is the amax
  over all uses. Gradients computed separately (one ``jax.grad`` per
  micro-batch) combine with ``jax.tree.map(jnp.maximum, a, b)``. Combining
  inside one gradient needs ``jit``
  (as a training step is): JAX cannot add two values of this dtype outside
  ``jit``.

Sharding:
  The amax is ``max(|x|)`` of the whole logical array, so under ``jit`` with
  sharded operands XLA reduces it over all shards; inside ``shard_map`` it
  is maxed over the mesh axes along which the tensor varies.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.fp8_ops import fp32_max_grad
from jax import lax

from qbits import _sharding as sharding
from qbits._errors import InvalidArgumentError
from qbits._granularity import PerTensor
from qbits._providers import (
    ScaleProvider,
    delayed_scales,
    max_combining,
    stacks,
    updated_histories,
)
from qbits._quantizer import Quantizer
from qbits.ops import _core as core
from qbits.ops._config import DotGeneralConfig
from qbits.ops._diagnose import init_probe

__all__ = [
    "TensorState",
    "check_providers",
    "init_state",
    "per_tensor_state",
    "run",
    "tensor_states",
]


@dataclasses.dataclass(frozen=True)
class TensorState:
    """The scale state of one tensor of a matmul.

    Attributes:
      tensor: ``"lhs"``, ``"rhs"`` or ``"grad"``.
      provider: Its scale provider.
      quantizer: The first quantizer of the tensor with that provider.
      scale_shape: The scale's shape (one entry per block, the tensor's rank).
      contracting: The axes that quantizer's matmul contracts.
    """

    tensor: str
    provider: ScaleProvider
    quantizer: Quantizer
    scale_shape: tuple[int, ...]
    contracting: tuple[int, ...]

    @property
    def compact_shape(self) -> tuple[int, ...]:
        """The scale's shape without its size-1 axes (``()``: per tensor)."""
        return tuple(n for n in self.scale_shape if n != 1)


def check_providers(config: DotGeneralConfig, owner: str) -> None:
    """Checks what can be checked of the providers without operand shapes.

    Raises:
      InvalidArgumentError: As :func:`tensor_states`.
    """
    for matmul, side, tensor, _ in core.SLOTS:
        q = getattr(getattr(config, matmul), side)
        p = core.provider(q)
        if p is None:
            continue
        where = f"config.{matmul}.{side}"
        if q.scale_rounding != "none":
            raise InvalidArgumentError(
                owner,
                f"{where}.scale_rounding",
                q.scale_rounding,
                f"'none' with {type(p).__name__} (the provider gives the scale)",
            )
        if q.numerics.abs_val_mapped_to() is None:
            raise InvalidArgumentError(
                owner,
                f"{where}.numerics",
                q.numerics,
                f"numerics with a largest value (int, fp) with {type(p).__name__}",
            )
        if p.trainable and tensor == "grad":
            raise InvalidArgumentError(
                owner,
                f"{where}.provider",
                p,
                f"a calibration or a replaced scale state ({type(p).__name__} "
                "learns from gradients, which the output gradient has none of)",
            )
        if p.trainable and getattr(q.numerics, "noise_fn", None) is not None:
            raise InvalidArgumentError(
                owner,
                f"{where}.numerics",
                q.numerics,
                f"numerics that round to nearest with {type(p).__name__}",
            )


def tensor_states(
    config: DotGeneralConfig,
    contraction: core.Contraction,
    shapes: dict[str, tuple[int, ...]],
    owner: str = "dot_general",
) -> dict[str, TensorState]:
    """The tensors of a matmul that take their scale from state.

    Args:
      config: The three matmuls.
      contraction: The forward contraction.
      shapes: The shapes of ``"lhs"``, ``"rhs"`` and ``"grad"`` (the output).
      owner: Named in errors.

    Raises:
      InvalidArgumentError: When quantizers of one tensor have different
        providers or scale shapes, or a provider cannot serve its quantizer
        (scale rounding, numerics without a largest value, a learned scale
        for the output gradient or with stochastic rounding).
    """
    check_providers(config, owner)
    grads = {
        "fwd": contraction,
        "dlhs": contraction.gradient("lhs"),
        "drhs": contraction.gradient("rhs"),
    }
    out: dict[str, TensorState] = {}
    for matmul, side, tensor, _ in core.SLOTS:
        q = getattr(getattr(config, matmul), side)
        p = core.provider(q)
        if p is None:
            continue
        axes = grads[matmul].contracting[0 if side == "lhs" else 1]
        blocks = q.granularity.block_sizes(shapes[tensor], axes)
        shape = tuple(n // b for n, b in zip(shapes[tensor], blocks, strict=True))
        where = f"config.{matmul}.{side}"
        first = out.get(tensor)
        if first is None:
            out[tensor] = TensorState(tensor, p, q, shape, tuple(axes))
            continue
        if p != first.provider or (
            q.numerics.abs_val_mapped_to()
            != first.quantizer.numerics.abs_val_mapped_to()
        ):
            raise InvalidArgumentError(
                owner,
                f"{where}.provider",
                p,
                f"the same provider and grid range as the other quantizers of "
                f"the {tensor!r} tensor (one state per tensor)",
            )
        if shape != first.scale_shape:
            raise InvalidArgumentError(
                owner,
                f"{where}.granularity",
                q.granularity,
                f"a granularity giving the {tensor!r} tensor's scale shape "
                f"{first.scale_shape} here too (one state per tensor), e.g. "
                "PerTensor(), or a calibration (no provider) for this operand",
                why=f"it gives {shape}",
            )
    return out


def per_tensor_state(config: DotGeneralConfig) -> dict[str, jax.Array]:
    """The state entries whose shape does not depend on the operands.

    Those of quantizers with per-tensor scale providers (compact shape
    ``()``): a layer can hold them before it has seen an operand. Others
    (per-channel scales) are set from a first batch; a learned step is NaN
    until then.

    Example:
      >>> st = qbits.ops._per_tensor_state(qbits.presets.get("fp8_delayed"))
      >>> st["grad_scale"], st["grad_amax_history"].shape
      (Array([1.], dtype=float32), (1024,))
    """
    out: dict[str, jax.Array] = {}
    for matmul, side, tensor, _ in core.SLOTS:
        q = getattr(getattr(config, matmul), side)
        p = core.provider(q)
        if p is None or not isinstance(q.granularity, PerTensor):
            continue
        for name, value in p.init_state((), None, q.numerics).items():
            out.setdefault(f"{tensor}_{name}", value)
    return out


def _shapes(
    contraction: core.Contraction, lhs: Any, rhs: Any
) -> dict[str, tuple[int, ...]]:
    out = jax.eval_shape(
        contraction.plain,
        jax.ShapeDtypeStruct(jnp.shape(lhs), jnp.result_type(lhs)),
        jax.ShapeDtypeStruct(jnp.shape(rhs), jnp.result_type(rhs)),
    )
    return {"lhs": jnp.shape(lhs), "rhs": jnp.shape(rhs), "grad": out.shape}


def init_state(
    config: DotGeneralConfig,
    contraction: core.Contraction,
    lhs: jax.Array,
    rhs: jax.Array,
    owner: str = "dot_general",
) -> dict[str, jax.Array]:
    """The initial state of a matmul's providers, from sample operands.

    Providers that start from data (:class:`~qbits.LearnedScale`) read the
    operands; others use only their shapes (abstract
    ``jax.ShapeDtypeStruct`` s are fine for them).
    """
    states = tensor_states(config, contraction, _shapes(contraction, lhs, rhs), owner)
    operands = {"lhs": lhs, "rhs": rhs}
    if "grad" in states:  # the output's type: its sharding under explicit axes
        operands["grad"] = jax.eval_shape(contraction.plain, lhs, rhs)
    out: dict[str, jax.Array] = {}
    for t, ts in states.items():
        x = operands[t]
        amax = None
        data = x if isinstance(x, jax.Array | np.ndarray) else None
        if data is not None:
            data = jnp.asarray(data)
            amax = core.block_amax(ts.quantizer, data, ts.contracting)
            amax = amax.reshape(ts.compact_shape)
        for name, value in ts.provider.init_state(
            ts.compact_shape, data, ts.quantizer.numerics, amax
        ).items():
            out[f"{t}_{name}"] = _laid_out(value, x, ts)
    return out


def _laid_out(value: jax.Array, x: Any, ts: TensorState) -> jax.Array:
    """A state entry sharded as its tensor.

    The scale's kept axes as the tensor's; the rest (a history's steps, a
    per-tensor scale) replicated.
    """
    kept = [a for a, n in enumerate(ts.scale_shape) if n != 1]
    lead = value.ndim - len(kept)
    if lead < 0 or tuple(value.shape[lead:]) != ts.compact_shape:
        kept = []
        lead = value.ndim
    return sharding.like(value, x, (None,) * lead + tuple(kept))


def _check_state(
    owner: str, expected: dict[str, Any], state: Any
) -> dict[str, jax.Array]:
    if not isinstance(state, dict) or set(state) != set(expected):
        got = sorted(state) if isinstance(state, dict) else state
        raise InvalidArgumentError(
            owner,
            "state",
            got,
            "a dict with keys " + ", ".join(sorted(expected)) + " (from init_state)"
            if expected
            else "None or {} (the config keeps no scale state)",
        )
    for k, spec in expected.items():
        v = state[k]
        shape, dtype = jnp.shape(v), getattr(v, "dtype", None)
        if shape != spec.shape or dtype not in (np.dtype(np.float32), fp32_max_grad):
            raise InvalidArgumentError(
                owner,
                f"state[{k!r}]",
                f"{dtype}{list(shape)}",
                f"float32{list(spec.shape)}",
                why="the state's shapes follow the config (history_length, "
                "granularity) and the operand shapes",
            )
    return dict(state)


def _f32(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {
        k: lax.convert_element_type(v, jnp.float32) if v.dtype == fp32_max_grad else v
        for k, v in state.items()
    }


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _provide(provider: ScaleProvider, numerics: Any, state: dict[str, jax.Array]):
    """The scale from state; its cotangent (the amax) gives the next state."""
    return provider.scale(_f32(state), numerics)


def _provide_fwd(provider: ScaleProvider, numerics: Any, state: dict[str, jax.Array]):
    return _provide(provider, numerics, state), state


def _provide_bwd(provider: ScaleProvider, numerics: Any, state: Any, amax: Any):
    new = provider.update(_f32(state), amax, numerics)
    return ({k: lax.convert_element_type(new[k], state[k].dtype) for k in state},)


_provide.defvjp(_provide_fwd, _provide_bwd)


def _provide_scale(provider: ScaleProvider, numerics: Any, state: Any) -> jax.Array:
    """:func:`_provide` of the max-combining state."""
    return _provide(provider, numerics, max_combining(state))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _provide_delayed(
    providers: tuple[ScaleProvider, ...],
    numerics: tuple[Any, ...],
    states: tuple[dict[str, jax.Array], ...],
) -> list[jax.Array]:
    """:func:`_provide` of a matmul's per-tensor delayed-scaling states at once.

    The same scales and next states as one :func:`_provide` per tensor; on
    a GPU their histories are reduced, and the next ones written, together
    (:func:`~qbits._providers.delayed_scales`): two kernels per matmul where
    each tensor took two of its own. The next state's ``scale`` is this
    step's (what :meth:`~qbits.DelayedScaling.update` recomputes).
    """
    return delayed_scales(providers, [_f32(s) for s in states], numerics)


def _provide_delayed_fwd(providers: Any, numerics: Any, states: Any):
    scales = _provide_delayed(providers, numerics, states)
    return scales, (states, scales)


def _provide_delayed_bwd(providers: Any, numerics: Any, residuals: Any, amaxes: Any):
    states, scales = residuals
    histories = updated_histories(
        [_f32(s)["amax_history"] for s in states], list(amaxes)
    )
    new = []
    for state, scale, history in zip(states, scales, histories, strict=True):
        next_state = {"scale": scale, "amax_history": history}
        new.append({k: lax.convert_element_type(next_state[k], state[k].dtype)
                    for k in state})  # fmt: skip
    return (tuple(new),)


_provide_delayed.defvjp(_provide_delayed_fwd, _provide_delayed_bwd)


# Called on concrete state (outside ``jit``), in one program: there the
# max-combining arrays are intermediates, and JAX cannot hold a sharded one
# on its own (an op-by-op call would).
_replaced_scale = jax.jit(_provide_scale, static_argnums=(0, 1))


def run(
    config: DotGeneralConfig,
    contraction: core.Contraction,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    state: dict[str, jax.Array] | None,
    owner: str,
    data: Any = None,
    probe: Any = None,
) -> jax.Array:
    """The quantized matmul, its providers' scales taken from ``state``.

    ``data``: the contraction's arrays besides the operands (see
    :func:`qbits.ops._core.apply`). ``probe``: a diagnostics probe
    (:func:`~qbits.ops._diagnose.init_probe`), or ``None``.

    Raises:
      InvalidArgumentError: For state that does not match the config and
        the operands (missing, extra or misshapen entries).
    """
    dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    vma = [("lhs", core.varying(lhs)), ("rhs", core.varying(rhs))]
    diagnose = probe is not None
    if diagnose:
        probe = _check_probe(owner, probe)
    if not config.needs_state:
        if state:
            _check_state(owner, {}, state)
        plan = core.Plan(config, contraction, dtypes, (), tuple(vma), diagnose)
        return core.apply(plan, lhs, rhs, key, {}, data, probe)
    bound = contraction.bind(data)
    states = tensor_states(config, bound, _shapes(bound, lhs, rhs), owner)
    if state is None:
        raise InvalidArgumentError(
            owner,
            "state",
            None,
            "the scale state of the config's providers ("
            + ", ".join(type(s.provider).__name__ for s in states.values())
            + "): pass state=op.init_state(...), or use qbits.flax.quantize / "
            "qbits.nnx.quantize, which keep it",
        )
    expected = jax.eval_shape(
        lambda: init_state(
            config,
            bound,
            jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
            jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
            owner,
        )
    )
    state = _check_state(owner, expected, state)
    operands = {"lhs": lhs, "rhs": rhs}
    scales: dict[str, jax.Array] = {}
    subs = {
        t: {k[len(t) + 1 :]: v for k, v in state.items() if k.startswith(f"{t}_")}
        for t in states
    }
    traced = {
        t: any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(sub))
        for t, sub in subs.items()
    }
    # Per-tensor delayed scaling: the tensors' states together (one
    # reduction and one history write per matmul on a GPU).
    together = [
        t for t, ts in states.items() if traced[t] and stacks(ts.provider, subs[t])
    ]
    if len(together) > 1:
        found = _provide_delayed(
            tuple(states[t].provider for t in together),
            tuple(states[t].quantizer.numerics for t in together),
            tuple(max_combining(subs[t]) for t in together),
        )
        scales.update(zip(together, found, strict=True))
    for t, ts in states.items():
        sub = subs[t]
        numerics = ts.quantizer.numerics
        if t in operands:
            operands[t] = ts.provider.prepare(operands[t], _f32(sub), numerics)
        if t in scales:
            scale = scales[t]
        elif ts.provider.trainable:
            scale = ts.provider.scale(_f32(sub), numerics)
        else:
            provide = _provide_scale if traced[t] else _replaced_scale
            scale = provide(ts.provider, numerics, sub)
        scales[t] = jnp.reshape(scale, ts.scale_shape).astype(jnp.float32)
        vma.append((f"{t}_scale", core.varying(scales[t])))
    observe = tuple(t for t, ts in states.items() if ts.provider.observes)
    plan = core.Plan(config, contraction, dtypes, observe, tuple(vma), diagnose)
    return core.apply(plan, operands["lhs"], operands["rhs"], key, scales, data, probe)


def _check_probe(owner: str, probe: Any) -> dict[str, jax.Array]:
    """The probe, its maxima max-combining (`DelayedScaling.max_combining`)."""
    want = jax.eval_shape(init_probe)
    if (
        not isinstance(probe, dict)
        or set(probe) != set(want)
        or any(jnp.shape(probe[k]) != want[k].shape for k in want)
    ):
        raise InvalidArgumentError(
            owner,
            "diagnostics",
            jax.tree.map(jnp.shape, probe),
            "a probe: one matmul's of qbits.diagnostics.init(fn, config, "
            "*args), which gives every matmul of fn its own",
        )
    return {"sums": probe["sums"], "maxima": max_combining(probe["maxima"])}
