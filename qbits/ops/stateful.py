"""Stateful quantized ``dot_general``: delayed scaling through the backward pass.

A quantizer whose calibration is :class:`~qbits.calibration.DelayedScaling`
takes its scale from state: a ``scale`` and an ``amax_history`` per tensor.
A dot_general has three such tensors: ``lhs`` and ``rhs`` (the forward
operands, quantized in ``fwd``) and ``grad`` (the incoming gradient, quantized
once for both backward matmuls). The state is a flat dict::

    {"lhs_scale": f32[1], "lhs_amax_history": f32[L], "rhs_scale": ...,
     "grad_scale": ..., "grad_amax_history": ...}

holding the entries of the delayed tensors only (:func:`init_state`).

How the state is updated (Flax ``fp8_ops``' design):
  The forward pass computes this step's scale from the history
  (:func:`~qbits.calibration.scale_from_history`), quantizes with it, and
  pushes the operand's absmax into the history; the gradient's scale and
  history are updated in the backward pass, where ``g`` exists. The *new*
  state is returned as the cotangent of the ``state`` argument, so
  ``jax.grad`` with respect to the state gives the next step's state, which a
  training step writes back instead of giving it to the optimizer
  (``qbits.flax.TrainState``, ``qbits.nnx.update_state``). A forward pass
  alone (evaluation) leaves the state unchanged.

Combining with max:
  When one state is used several times in one gradient (a layer applied in
  every step of a ``lax.scan``, or micro-batches in one loss), JAX adds the
  cotangents of its uses. The state is therefore converted to Flax's
  ``fp32_max_grad`` dtype (a float32 whose cotangents add by ``max``) before
  it enters the custom VJP: all uses of one converted value combine with max.
  Every call converts its own state; to share one conversion between the
  calls in a loop, convert once outside the loop with :func:`max_combining`
  (idempotent). Max is right: every use computes the same new scale (from
  the same old history) and the same rolled history except for the newest
  entry, whose max is the amax over all uses. Gradients computed separately
  (one ``jax.grad`` per micro-batch) combine with :func:`combine_state`.
  Combining inside one gradient needs ``jit`` (as a training step is): JAX
  cannot add two values of this dtype outside ``jit``.

Sharding:
  The amax is ``max(|x|)`` of the whole logical array, so under ``jit`` with
  sharded operands XLA reduces it over all shards (tested on 8 devices:
  the same scales as unsharded).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax.linen.fp8_ops import fp32_max_grad
from jax import lax

from qbits.calibration import DelayedScaling, LearnedScale, update_history
from qbits.context import Context
from qbits.errors import InvalidArgumentError
from qbits.granularity import PerTensor
from qbits.lsq import grid_max, init_step, lsq_quantize
from qbits.numerics.base import compute_dtype
from qbits.ops.config import IDENTITY, DotGeneralConfig, MatmulConfig, check_config
from qbits.ops.dims import Dims
from qbits.ops.dot_general import (
    _DLHS_LHS,
    _DLHS_RHS,
    _DRHS_LHS,
    _DRHS_RHS,
    _FWD_LHS,
    _FWD_RHS,
    DotGeneral,
    _grad_sharding,
    _gradient_matmul,
    _hashable,
    _keys,
)
from qbits.ops.dot_general import _for_backward as _stateless_for_backward
from qbits.ops.matmul import (
    QuantizedOperand,
    contract,
    quantize,
    result_dtype,
)
from qbits.quantizer import Quantizer
from qbits.tensor import QTensor, storage_dtype

__all__ = [
    "STATE_TENSORS",
    "StatefulDotGeneral",
    "combine_state",
    "delayed_tensors",
    "init_state",
    "init_steps",
    "learned_tensors",
    "max_combining",
    "needs_state",
    "stateful_dot_general",
]

STATE_TENSORS: tuple[str, ...] = ("lhs", "rhs", "grad")

Grad = jax.tree_util.Partial


def _delayed(q: Quantizer) -> DelayedScaling | None:
    cal = q.calibration
    return cal if isinstance(cal, DelayedScaling) else None


def needs_state(config: DotGeneralConfig) -> bool:
    """Whether a quantizer of ``config`` needs state: delayed or learned scales.

    Example:
      >>> qbits.ops.needs_state(qbits.presets.get("fp8_delayed"))
      True
      >>> qbits.ops.needs_state(qbits.presets.get("fp8"))
      False
    """
    return any(
        isinstance(q.calibration, DelayedScaling | LearnedScale)
        for m in (config.fwd, config.dlhs, config.drhs)
        for q in (m.lhs, m.rhs)
    )


def learned_tensors(config: DotGeneralConfig) -> dict[str, LearnedScale]:
    """The forward operands (``"lhs"``, ``"rhs"``) with a learned step (LSQ).

    Raises:
      InvalidArgumentError: For :class:`~qbits.calibration.LearnedScale` in a
        backward matmul, with a granularity other than per-tensor, with scale
        rounding, or with stochastic numerics.

    Example:
      >>> lsq = qbits.Quantizer(qbits.IntNumerics(bits=4),
      ...                       qbits.calibration.LearnedScale())
      >>> cfg = qbits.DotGeneralConfig(qbits.MatmulConfig(lhs=lsq, rhs=lsq))
      >>> sorted(qbits.ops.learned_tensors(cfg))
      ['lhs', 'rhs']
    """
    owner = "stateful_dot_general"
    out: dict[str, LearnedScale] = {}
    for m_name in ("fwd", "dlhs", "drhs"):
        for side in ("lhs", "rhs"):
            q = getattr(getattr(config, m_name), side)
            if not isinstance(q.calibration, LearnedScale):
                continue
            where = f"config.{m_name}.{side}"
            if m_name != "fwd":
                raise InvalidArgumentError(
                    owner,
                    f"{where}.calibration",
                    q.calibration,
                    "LearnedScale in the forward matmul only (the backward "
                    "matmuls see the forward's learned quantization)",
                )
            if not isinstance(q.granularity, PerTensor) or q.scale_rounding != "none":
                raise InvalidArgumentError(
                    owner,
                    f"{where}.granularity",
                    q.granularity,
                    "PerTensor() and scale_rounding='none' with LearnedScale",
                )
            grid_max(q.numerics)  # validates the numerics
            out[side] = q.calibration
    return out


def init_steps(
    config: DotGeneralConfig, lhs: jax.Array, rhs: jax.Array
) -> dict[str, jax.Array]:
    """Initial learned steps from a first batch: ``{"lhs_step": ..., ...}``.

    Example:
      >>> lsq = qbits.Quantizer(qbits.IntNumerics(bits=4),
      ...                       qbits.calibration.LearnedScale("absmax"))
      >>> cfg = qbits.DotGeneralConfig(qbits.MatmulConfig(lhs=lsq))
      >>> qbits.ops.init_steps(cfg, jnp.array([[15.0]]), jnp.ones((1, 1)))
      {'lhs_step': Array(2., dtype=float32)}
    """
    operands = {"lhs": lhs, "rhs": rhs}
    quantizers = {"lhs": config.fwd.lhs, "rhs": config.fwd.rhs}
    return {
        f"{name}_step": init_step(operands[name], quantizers[name].numerics, cal.init)
        for name, cal in learned_tensors(config).items()
    }


def delayed_tensors(config: DotGeneralConfig) -> dict[str, DelayedScaling]:
    """The tensors of ``config`` with delayed scaling, and their settings.

    ``"lhs"`` and ``"rhs"`` when ``fwd.lhs`` / ``fwd.rhs`` use it; ``"grad"``
    when the backward matmuls' gradient quantizer (``dlhs.lhs``, which must
    then equal ``drhs.lhs``) does. A backward matmul's other operand
    (``dlhs.rhs``, ``drhs.rhs``) with delayed scaling uses the forward
    operand's scale of the same step.

    Raises:
      InvalidArgumentError: For a delayed quantizer that is not per-tensor,
        whose numerics has no largest value, or that rounds its scale; for
        ``dlhs.lhs != drhs.lhs`` when either is delayed; for a delayed
        backward operand whose forward operand is not delayed.

    Example:
      >>> sorted(qbits.ops.delayed_tensors(qbits.presets.get("fp8_delayed")))
      ['grad', 'lhs', 'rhs']
    """
    owner = "stateful_dot_general"
    for m_name in ("fwd", "dlhs", "drhs"):
        for side in ("lhs", "rhs"):
            q = getattr(getattr(config, m_name), side)
            if _delayed(q) is None:
                continue
            where = f"config.{m_name}.{side}"
            if not isinstance(q.granularity, PerTensor):
                raise InvalidArgumentError(
                    owner,
                    f"{where}.granularity",
                    q.granularity,
                    "PerTensor() with DelayedScaling (one scale per tensor)",
                )
            if q.scale_rounding != "none":
                raise InvalidArgumentError(
                    owner,
                    f"{where}.scale_rounding",
                    q.scale_rounding,
                    "'none' with DelayedScaling",
                )
            if q.numerics.abs_val_mapped_to() is None:
                raise InvalidArgumentError(
                    owner,
                    f"{where}.numerics",
                    q.numerics,
                    "numerics with a largest value (int, fp) with DelayedScaling",
                )
    out: dict[str, DelayedScaling] = {}
    for name, q in (("lhs", config.fwd.lhs), ("rhs", config.fwd.rhs)):
        cal = _delayed(q)
        if cal is not None:
            out[name] = cal
    gl, gr = config.dlhs.lhs, config.drhs.lhs
    if _delayed(gl) is not None or _delayed(gr) is not None:
        if gl != gr:
            raise InvalidArgumentError(
                owner,
                "config.drhs.lhs",
                gr,
                "the same quantizer as config.dlhs.lhs when the gradient uses "
                "DelayedScaling (the gradient is quantized once, with one state)",
            )
        out["grad"] = _delayed(gl)  # type: ignore[assignment]
    for m_name, fwd_side in (("dlhs", "rhs"), ("drhs", "lhs")):
        m = getattr(config, m_name)
        if _delayed(m.rhs) is not None and fwd_side not in out:
            raise InvalidArgumentError(
                owner,
                f"config.{m_name}.rhs.calibration",
                m.rhs.calibration,
                f"not DelayedScaling unless config.fwd.{fwd_side} uses it too "
                "(a backward operand reuses the forward operand's delayed scale)",
            )
    return out


def init_state(config: DotGeneralConfig) -> dict[str, jax.Array]:
    """The initial state: scales 1, histories of zeros (as Flax's FP8 layers).

    Returns:
      ``{f"{t}_scale": ones((1,)), f"{t}_amax_history": zeros((L,))}`` for
      every delayed tensor ``t`` (float32); empty when nothing is delayed.

    Example:
      >>> state = qbits.ops.init_state(qbits.presets.get("fp8_delayed"))
      >>> sorted(state), state["lhs_amax_history"].shape
      (['grad_amax_history', 'grad_scale', 'lhs_amax_history', 'lhs_scale', \
'rhs_amax_history', 'rhs_scale'], (1024,))
    """
    state = {}
    for name, cal in delayed_tensors(config).items():
        state[f"{name}_scale"] = jnp.ones((1,), jnp.float32)
        state[f"{name}_amax_history"] = jnp.zeros((cal.history_length,), jnp.float32)
    return state


def _check_state(config: DotGeneralConfig, state: Any) -> dict[str, jax.Array]:
    expected = jax.eval_shape(lambda: init_state(config))
    if not isinstance(state, dict) or set(state) != set(expected):
        got = sorted(state) if isinstance(state, dict) else state
        raise InvalidArgumentError(
            "StatefulDotGeneral",
            "state",
            got,
            "a dict with keys " + ", ".join(sorted(expected)) + " (init_state(config))",
        )
    out = {}
    for k, spec in expected.items():
        v = state[k]
        shape = jnp.shape(v)
        dtype = getattr(v, "dtype", None)
        if shape != spec.shape or dtype not in (np.dtype(np.float32), fp32_max_grad):
            raise InvalidArgumentError(
                "StatefulDotGeneral",
                f"state[{k!r}]",
                f"{dtype}{list(shape)}",
                f"float32{list(spec.shape)}",
                why="the history length is the config's history_length",
            )
        out[k] = v
    return out


def max_combining(state: Any) -> Any:
    """Converts float32 state to Flax's ``fp32_max_grad``: cotangents add by max.

    Convert once, where the state is read, and pass the result to every use
    (every step of a ``lax.scan``, every micro-batch): their new states then
    combine with max. Leaves already converted are left alone; other dtypes
    are refused.

    Example:
      >>> st = qbits.ops.init_state(qbits.presets.get("fp8_delayed"))
      >>> str(qbits.ops.max_combining(st)["lhs_scale"].dtype)
      'fp8_meta32'
    """

    def convert(x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype == fp32_max_grad:
            return x
        if dtype != np.dtype(np.float32):
            raise InvalidArgumentError(
                "max_combining", "state", x, "float32 arrays (scales, histories)"
            )
        return lax.convert_element_type(x, fp32_max_grad)

    return jax.tree.map(convert, state)


def combine_state(a: Any, b: Any) -> Any:
    """Combines two new states (e.g. of two micro-batches) with max.

    Example:
      >>> qbits.ops.combine_state({"s": jnp.array([1.0, 5.0])},
      ...                         {"s": jnp.array([3.0, 2.0])})
      {'s': Array([3., 5.], dtype=float32)}
    """
    return jax.tree.map(jnp.maximum, a, b)


def _f32(x: jax.Array) -> jax.Array:
    if x.dtype == fp32_max_grad:
        return lax.convert_element_type(x, jnp.float32)
    return x


def _as_ct(x: jax.Array) -> jax.Array:
    return lax.convert_element_type(x, fp32_max_grad)


@dataclasses.dataclass(frozen=True, eq=False)
class StatefulDotGeneral:
    """A quantized ``lax.dot_general`` with delayed-scaling state.

    Made by :func:`stateful_dot_general`. Call it like ``lax.dot_general``
    with the state as the keyword ``state=``; it returns the output only. The
    new state is the gradient of the loss with respect to ``state`` (see the
    module docstring).

    Attributes:
      config: The three matmuls.
      key: PRNG key for stochastic rounding, or ``None``.

    Example:
      >>> dg = qbits.stateful_dot_general(qbits.presets.get("fp8_delayed"))
      >>> sorted(dg.init_state())[:2]
      ['grad_amax_history', 'grad_scale']
    """

    config: DotGeneralConfig
    key: jax.Array | None = None

    def init_state(self) -> dict[str, jax.Array]:
        """:func:`init_state` of the config."""
        return init_state(self.config)

    def init_steps(self, lhs: jax.Array, rhs: jax.Array) -> dict[str, jax.Array]:
        """:func:`init_steps` of the config."""
        return init_steps(self.config, lhs, rhs)

    def __call__(
        self,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        *,
        state: dict[str, jax.Array] | None = None,
        steps: dict[str, jax.Array] | None = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        """``lax.dot_general(lhs, rhs, ...)`` with stateful quantization.

        ``state`` holds the delayed scales (:func:`init_state`), ``steps``
        the learned step sizes (:func:`init_steps`; trainable parameters).
        """
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        config = self.config
        learned = learned_tensors(config)
        expected = {f"{name}_step" for name in learned}
        got = set(steps) if isinstance(steps, dict) else steps
        if (steps is None and expected) or (steps is not None and got != expected):
            raise InvalidArgumentError(
                "StatefulDotGeneral",
                "steps",
                sorted(got) if isinstance(got, set) else got,
                "a dict with keys " + ", ".join(sorted(expected))
                if expected
                else "None (the config learns no step)",
            )
        if learned:  # LSQ fake quantization; the dot sees the grid values
            fwd = config.fwd
            if "lhs" in learned:
                lhs = lsq_quantize(fwd.lhs.numerics, lhs, steps["lhs_step"])
                fwd = dataclasses.replace(fwd, lhs=IDENTITY)
            if "rhs" in learned:
                rhs = lsq_quantize(fwd.rhs.numerics, rhs, steps["rhs_step"])
                fwd = dataclasses.replace(fwd, rhs=IDENTITY)
            config = dataclasses.replace(config, fwd=fwd)
        if not delayed_tensors(config):
            if state:
                raise InvalidArgumentError(
                    "StatefulDotGeneral", "state", sorted(state), "None or {}"
                )
            return DotGeneral(config, self.key)(
                lhs,
                rhs,
                dimension_numbers,
                precision,
                preferred_element_type,
                out_sharding=out_sharding,
            )
        state = max_combining(_check_state(config, state))
        dims = Dims.create(dimension_numbers, lhs.ndim, rhs.ndim)
        jax.eval_shape(
            functools.partial(lax.dot_general, dimension_numbers=dims.lax()),
            jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
            jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
        )
        for name, x in (("lhs", lhs), ("rhs", rhs)):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise InvalidArgumentError(
                    "StatefulDotGeneral",
                    f"{name}.dtype",
                    x.dtype,
                    "a floating-point dtype",
                )
        return _stateful_dot(
            config,
            dims,
            _hashable(precision),
            preferred_element_type,
            out_sharding,
            lhs,
            rhs,
            self.key,
            state,
        )


def stateful_dot_general(
    config: DotGeneralConfig, key: jax.Array | None = None
) -> StatefulDotGeneral:
    """A quantized ``dot_general`` whose delayed scales are state.

    Args:
      config: A config in which some quantizers use
        :class:`~qbits.calibration.DelayedScaling` (e.g. the ``fp8_delayed``
        preset); the others quantize as in :func:`qbits.dot_general`.
      key: A PRNG key, required when an operand rounds stochastically.

    Returns:
      A :class:`StatefulDotGeneral`: ``f(lhs, rhs, dimension_numbers,
      precision=None, preferred_element_type=None, *, state,
      out_sharding=None)``.

    Raises:
      InvalidArgumentError: As :func:`delayed_tensors`, or for a missing key.

    Example:
      >>> cfg = qbits.presets.get("fp8_delayed")
      >>> dg = qbits.ops.stateful_dot_general(cfg)
      >>> state = dg.init_state()
      >>> x, w = jnp.full((2, 4), 3.0), jnp.full((4, 3), 0.5)
      >>> dn = (((1,), (0,)), ((), ()))
      >>> loss = lambda x, w, st: dg(x, w, dn, state=st).sum()
      >>> new = jax.grad(loss, argnums=2)(x, w, state)  # the next state
      >>> new["lhs_amax_history"][:2], new["grad_amax_history"][:2]
      (Array([3., 0.], dtype=float32), Array([1., 0.], dtype=float32))
      >>> new = jax.grad(loss, argnums=2)(x, w, new)  # scales from step 1
      >>> new["lhs_scale"] * 448
      Array([3.], dtype=float32)
    """
    check_config("stateful_dot_general", config, key)
    delayed_tensors(config)
    learned_tensors(config)
    return StatefulDotGeneral(config, key)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


def _quantize_scaled(
    quantizer: Quantizer,
    x: jax.Array,
    scale: jax.Array,
    key: jax.Array | None,
    *,
    store: bool,
) -> QuantizedOperand:
    """Quantizes ``x`` with a given per-tensor ``scale`` (``x / scale``, as Flax)."""
    numerics = quantizer.numerics
    xc = x.astype(compute_dtype(x.dtype))
    s = scale.reshape((1,) * x.ndim).astype(xc.dtype)
    q, residuals = numerics.vjp_fwd(xc / s, Context(key))
    grad = Grad(functools.partial(_numerics_grad, numerics), residuals)
    qdtype = numerics.get_dtype()
    if store and qdtype is not None:
        target = storage_dtype(qdtype)
        if jnp.issubdtype(target, jnp.integer):
            info = ml_dtypes.iinfo(target)
            q = lax.clamp(float(info.min), q, float(info.max))
        q = q.astype(target)
    qt = QTensor(q, s.astype(jnp.float32), qdtype=qdtype, dtype=x.dtype)
    return QuantizedOperand(qt, grad)


def _numerics_grad(numerics: Any, residuals: Any, g: jax.Array) -> jax.Array:
    dx, _ = numerics.vjp_bwd(residuals, g)
    return dx


def _delayed_operand(
    name: str,
    cal: DelayedScaling,
    quantizer: Quantizer,
    x: jax.Array,
    state: dict[str, jax.Array],
    key: jax.Array | None,
    store: bool,
) -> tuple[QuantizedOperand, tuple[jax.Array, jax.Array]]:
    """Quantizes with this step's delayed scale; also the new scale, history."""
    scale = _f32(state[f"{name}_scale"])
    history = _f32(state[f"{name}_amax_history"])
    new_scale = cal.scale(history, scale, quantizer.numerics.abs_val_mapped_to())
    new_history = update_history(history, _amax(x))
    return _quantize_scaled(quantizer, x, new_scale, key, store=store), (
        new_scale,
        new_history,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _stateful_dot(
    config: DotGeneralConfig,
    dims: Dims,
    precision: Any,
    preferred_element_type: Any,
    out_sharding: Any,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    state: dict[str, jax.Array],
) -> jax.Array:
    out, _ = _fwd(
        config,
        dims,
        precision,
        preferred_element_type,
        out_sharding,
        lhs,
        rhs,
        key,
        state,
    )
    return out


def _fwd(
    config: DotGeneralConfig,
    dims: Dims,
    precision: Any,
    preferred_element_type: Any,
    out_sharding: Any,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    state: dict[str, jax.Array],
) -> tuple[jax.Array, tuple[Any, ...]]:
    delayed = delayed_tensors(config)
    real = config.fwd.mode == "real"
    keys = _keys(key, _FWD_LHS, _FWD_RHS)
    new: dict[str, jax.Array] = {}
    operands = {}
    for name, x, q, k, contracting in (
        ("lhs", lhs, config.fwd.lhs, keys[0], dims.lhs_contract),
        ("rhs", rhs, config.fwd.rhs, keys[1], dims.rhs_contract),
    ):
        if name in delayed:
            op, (s, h) = _delayed_operand(
                name, delayed[name], q, x, state, k, store=real
            )
            new[f"{name}_scale"], new[f"{name}_amax_history"] = s, h
        else:
            op = quantize(q, x, contracting, k, store=real)
        operands[name] = op
    out = contract(
        operands["lhs"].qtensor,
        operands["rhs"].qtensor,
        dims,
        config.fwd,
        result_dtype(lhs, rhs, dims, preferred_element_type),
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )
    residuals = (
        _for_backward(
            config.drhs,
            lhs,
            operands["lhs"].qtensor,
            dims.grad_rhs()[0],
            key,
            _DRHS_RHS,
            new.get("lhs_scale"),
        ),
        _for_backward(
            config.dlhs,
            rhs,
            operands["rhs"].qtensor,
            dims.grad_lhs()[0],
            key,
            _DLHS_RHS,
            new.get("rhs_scale"),
        ),
        operands["lhs"].grad,
        operands["rhs"].grad,
        key,
        {k: v for k, v in state.items() if k.startswith("grad_")},
        new,
    )
    return out, residuals


def _for_backward(
    cfg: MatmulConfig,
    x: jax.Array,
    forward: QTensor,
    dims: Dims,
    key: jax.Array | None,
    stream: int,
    forward_scale: jax.Array | None,
) -> jax.Array | QTensor:
    """A forward operand as the backward matmul ``cfg`` (its rhs) will use it.

    As in :mod:`qbits.ops.dot_general`, except that a delayed-scaled operand
    is quantized with the forward's delayed scale.
    """
    if cfg.use_fwd_quant or cfg.rhs == IDENTITY or _delayed(cfg.rhs) is None:
        return _stateless_for_backward(cfg, x, forward, dims, key, stream)
    (k,) = _keys(key, stream)
    store = cfg.mode == "real"
    return _quantize_scaled(cfg.rhs, x, forward_scale, k, store=store).qtensor


def _bwd(
    config: DotGeneralConfig,
    dims: Dims,
    precision: Any,
    preferred_element_type: Any,
    out_sharding: Any,
    residuals: tuple[Any, ...],
    g: jax.Array,
) -> tuple[jax.Array, jax.Array, None, dict[str, jax.Array]]:
    lhs, rhs, lhs_grad, rhs_grad, key, grad_state, new = residuals
    new = dict(new)
    delayed = delayed_tensors(config)
    g_q = None
    if "grad" in delayed:
        store = "real" in (config.dlhs.mode, config.drhs.mode)
        (g_key,) = _keys(key, _DLHS_LHS)
        g_q, (s, h) = _delayed_operand(
            "grad", delayed["grad"], config.dlhs.lhs, g, grad_state, g_key, store
        )
        new["grad_scale"], new["grad_amax_history"] = s, h
        g_q = g_q.qtensor

    def gradient(of, other, grad_dims, cfg, streams):
        if g_q is None:
            return _gradient_matmul(
                g, of, other, grad_dims, cfg, _keys(key, *streams), precision,
                preferred_element_type,
            )  # fmt: skip
        # The gradient is already quantized with its delayed scale.
        dims_, perm = grad_dims
        if not isinstance(other, QTensor):
            other = QTensor(
                other, jnp.ones((1,) * other.ndim, jnp.float32), dtype=other.dtype
            )
        out = contract(
            g_q,
            other,
            dims_,
            cfg,
            result_dtype(g, other, dims_, preferred_element_type),
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=_grad_sharding(of, perm),
            out_perm=perm,
        )
        return out.astype(of.dtype)

    dl = gradient(lhs, rhs, dims.grad_lhs(), config.dlhs, (_DLHS_LHS, _DLHS_RHS))
    dr = gradient(rhs, lhs, dims.grad_rhs(), config.drhs, (_DRHS_LHS, _DRHS_RHS))
    return lhs_grad(dl), rhs_grad(dr), None, {k: _as_ct(v) for k, v in new.items()}


_stateful_dot.defvjp(_fwd, _bwd)
