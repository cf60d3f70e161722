"""Layer 2: scale providers, scales that come from explicit state.

A :class:`~qbits.Calibration` is a pure function of the tensor
being quantized. Some scales depend on more: on the amax of earlier steps
(:class:`DelayedScaling`) or on a trained parameter (:class:`LearnedScale`).
Such a scale comes from a *scale provider*: an object that owns state the
way an optax transform does, with

- :meth:`ScaleProvider.init_state`, the state of one tensor (float32 arrays);
- :meth:`ScaleProvider.scale`, this step's scale from the state;
- :meth:`ScaleProvider.update`, the next state from this step's
  observation (the tensor's amax, per scale block).

A quantizer takes a provider in its ``provider`` field, in place of its
calibration (``Quantizer(numerics, provider=DelayedScaling())``). The
quantized matmul core (:mod:`qbits.ops`) is given the scale as an input
instead of computing it, and reports the observation of the tensor through
its backward pass: the cotangent of a given scale is the tensor's amax. The
state of a model lives where its entry point keeps it (``qbits.init_state``'s
dict, a linen variable collection, nnx Variables); the functional form is
``qbits.dot_general(config)(..., state=state)`` with the state from
``init_state``.

The state of one tensor has a compact shape: the scale's shape with its
size-1 axes dropped, ``()`` for a per-tensor scale.

When one state is used several times in one gradient (a layer in every step
of a ``lax.scan``, micro-batches in one loss), JAX adds the new states of
its uses; :func:`max_combining`, applied once where the state is read,
makes them combine with max. New states of separate gradients combine with
``jax.tree.map(jnp.maximum, a, b)``.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from flax.linen.fp8_ops import fp32_max_grad

from qbits._errors import InvalidArgumentError, check_choice, check_float, check_int
from qbits._lsq import LSQ_INITS, grid_max, init_step, lsq_quantize
from qbits._platform import per_platform
from qbits.numerics import QNumerics

__all__ = [
    "DelayedScaling",
    "LearnedScale",
    "ScaleProvider",
    "max_combining",
    "scale_from_history",
    "update_history",
]

AMAX_COMPUTES: tuple[str, ...] = ("max", "most_recent")
#: The longest amax history a :class:`DelayedScaling` may keep (per tensor).
MAX_HISTORY_LENGTH = 65536

State = dict[str, jax.Array]


def max_combining(state: Any) -> Any:
    """Scale state whose uses in one gradient combine with max, not add.

    Converts every float32 leaf to Flax's ``fp32_max_grad`` (a float32 whose
    cotangents add by ``max``). Convert once, where the state is read, and
    pass the result to every use (every step of a ``lax.scan``, every
    micro-batch of one loss, under ``jit``): their new states then combine
    with max, which is right because every use computes the same new scale
    and history but for the newest amax, the max over all uses. Leaves
    already converted are left alone; other dtypes are refused.

    Args:
      state: A pytree of float32 scale state (``qbits.init_state``'s dict,
        the linen ``qbits.flax.STATE`` collection, an nnx ``ScaleState``
        state).

    Returns:
      The same pytree in ``fp32_max_grad``.

    Raises:
      InvalidArgumentError: For a leaf that is not float32 (parameters).

    Example:
      >>> dg = qbits.dot_general(qbits.presets.get("fp8_delayed"))
      >>> st = dg.init_state(jnp.ones((2, 4)), jnp.ones((4, 3)),
      ...                    (((1,), (0,)), ((), ())))
      >>> str(qbits.DelayedScaling.max_combining(st)["lhs_scale"].dtype)
      'fp8_meta32'
    """

    def convert(x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype == fp32_max_grad:
            return x
        if dtype != jnp.float32:
            raise InvalidArgumentError(
                "qbits.DelayedScaling.max_combining",
                "state",
                x,
                "float32 arrays (scales, histories)",
            )
        return jax.lax.convert_element_type(x, fp32_max_grad)

    return jax.tree.map(convert, state)


class ScaleProvider(struct.PyTreeNode, metaclass=abc.ABCMeta):
    """Gives a quantizer its scale from explicit state; see the module docstring.

    Subclasses implement :meth:`init_state` and :meth:`scale`, and :meth:`update`
    when they observe the tensor (``observes = True``).

    Example:
      A fixed, per-block scale kept as state (never updated):

      >>> class FixedScale(qbits.ScaleProvider):
      ...     def init_state(self, shape, x, numerics, amax=None):
      ...         return {"scale": jnp.full(shape, 0.5, jnp.float32)}
      ...     def scale(self, state, numerics):
      ...         return state["scale"]
      >>> p = FixedScale()
      >>> p.scale(p.init_state((), None, None), None)
      Array(0.5, dtype=float32)
    """

    #: Whether the core reports the tensor's amax for :meth:`update`.
    observes: ClassVar[bool] = False
    #: Whether the state holds trainable parameters (an optimizer updates
    #: them from their gradients) rather than state that :meth:`update`
    #: replaces.
    trainable: ClassVar[bool] = False

    @abc.abstractmethod
    def init_state(
        self,
        shape: tuple[int, ...],
        x: jax.Array | None,
        numerics: QNumerics,
        amax: jax.Array | None = None,
    ) -> State:
        """The initial state of one tensor.

        Args:
          shape: The compact shape of the tensor's scale.
          x: The tensor (a first batch), or ``None`` when it is not known;
            only providers that start from data read it.
          numerics: The quantizer's numerics.
          amax: ``max(|x|)`` per scale block (``shape``), or ``None`` with
            ``x``.
        """

    @abc.abstractmethod
    def scale(self, state: State, numerics: QNumerics) -> jax.Array:
        """This step's scale (the compact shape, float32)."""

    def update(self, state: State, amax: jax.Array, numerics: QNumerics) -> State:
        """The next state, given this step's amax per block (compact shape)."""
        return state

    def prepare(self, x: jax.Array, state: State, numerics: QNumerics) -> jax.Array:
        """The tensor as the quantizer sees it (``x`` itself by default)."""
        return x


class DelayedScaling(ScaleProvider):
    r"""Delayed scaling: the scale comes from an amax history of earlier steps.

    This is production FP8 training's scaling (Transformer Engine, Flax's
    ``fp8_ops``). The state of a tensor holds a ``scale`` and an
    ``amax_history`` ring buffer; at every step

    .. math::

       s_t = \frac{a \cdot 2^{\mathrm{margin}}}{\mathrm{fmt\_max}},
       \quad a = \max(\mathrm{history}_{t-1})
       \ (\text{or its most recent entry}),

    the tensor is quantized with :math:`s_t`, and its own amax is pushed into
    the history for the next step (:func:`update_history`). Where :math:`a`
    is zero or not finite the old scale is kept. Per-tensor scales are the
    usual recipe; other granularities keep one history per scale block.

    Attributes:
      history_length: Length of the amax ring buffer, an int in
        1..:data:`MAX_HISTORY_LENGTH` (1024 as in Flax and Transformer
        Engine's defaults).
      amax_compute: ``"max"`` (the largest amax in the history) or
        ``"most_recent"`` (the last step's amax).
      margin: The scale is multiplied by ``2**margin`` (headroom against
        growth between steps): a number in ``[0, 32]`` (the widest grid,
        E5M2, spans ``2**31.8`` from its largest to its smallest value),
        below the number of powers of two between the numerics' largest
        and smallest nonzero values, so that the amax still lands on a
        nonzero grid value (below 8 for int8, 18.8 for E4M3).

    Example:
      >>> cal = qbits.DelayedScaling(history_length=4)
      >>> state = cal.init_state((), None, qbits.numerics.Fp8Numerics())
      >>> state = cal.update(state, jnp.float32(896.0), qbits.numerics.Fp8Numerics())
      >>> state["amax_history"]
      Array([896.,   0.,   0.,   0.], dtype=float32)
      >>> cal.scale(state, qbits.numerics.Fp8Numerics())
      Array([2.], dtype=float32)
    """

    history_length: int = struct.field(pytree_node=False, default=1024)
    amax_compute: str = struct.field(pytree_node=False, default="max")
    margin: float = struct.field(pytree_node=False, default=0.0)

    observes: ClassVar[bool] = True
    #: :func:`max_combining`: scale state whose uses in one gradient combine
    #: with max (micro-batches, scanned steps).
    max_combining = staticmethod(max_combining)

    def __post_init__(self) -> None:
        check_int(
            "DelayedScaling",
            "history_length",
            self.history_length,
            1,
            MAX_HISTORY_LENGTH,
        )
        check_choice("DelayedScaling", "amax_compute", self.amax_compute, AMAX_COMPUTES)
        check_float("DelayedScaling", "margin", self.margin, lo=0.0, hi=_MAX_MARGIN)

    def init_state(
        self,
        shape: tuple[int, ...],
        x: jax.Array | None,
        numerics: QNumerics,
        amax: jax.Array | None = None,
    ) -> State:
        """Scale 1 and a history of zeros, as Flax's FP8 layers start.

        A per-tensor scale is stored as ``[1]`` and its history as ``[L]``,
        the layout of Flax's ``fp8_ops`` state.

        Raises:
          InvalidArgumentError: For a ``margin`` that maps the amax below the
            numerics' smallest nonzero value (every output would be 0).
        """
        _check_margin(self.margin, numerics)
        return {
            "scale": jnp.ones(shape or (1,), jnp.float32),
            "amax_history": jnp.zeros((self.history_length, *shape), jnp.float32),
        }

    def scale(self, state: State, numerics: QNumerics) -> jax.Array:
        """:func:`scale_from_history` of the state's history and scale.

        Raises:
          InvalidArgumentError: As :meth:`init_state`, for the margin.
        """
        _check_margin(self.margin, numerics)
        return scale_from_history(
            state["amax_history"],
            state["scale"],
            _fmt_max(numerics),
            self.margin,
            self.amax_compute,
        )

    def update(self, state: State, amax: jax.Array, numerics: QNumerics) -> State:
        """This step's scale, and the history with ``amax`` pushed in."""
        return {
            "scale": self.scale(state, numerics),
            "amax_history": update_history(state["amax_history"], amax),
        }


#: The largest margin of any numerics: E5M2's largest value is 2**31.8 times
#: its smallest.
_MAX_MARGIN = 32.0


def _check_margin(margin: float, numerics: QNumerics) -> None:
    """Raises unless the amax, scaled by ``2**margin``, lands on a nonzero value.

    With the margin the amax maps onto ``fmt_max / 2**margin``; below half
    the grid's smallest nonzero value it and everything below it round to
    0: every output of the matmul would be zero.
    """
    fmt_max = _fmt_max(numerics)
    smallest = numerics.smallest_nonzero()
    if smallest is None:  # no zero on the grid, or no smallest value known
        return
    limit = math.log2(2 * fmt_max / smallest)
    if not margin < limit:
        raise InvalidArgumentError(
            "DelayedScaling",
            "margin",
            margin,
            f"a number below {limit:.4g} for {numerics!r}",
            why=f"the amax would map onto {fmt_max} / 2**{margin}, which rounds "
            "to 0 with everything below it: every output would be zero",
        )


def _fmt_max(numerics: QNumerics) -> float:
    mapped = numerics.abs_val_mapped_to()
    if mapped is None:
        raise InvalidArgumentError(
            "DelayedScaling",
            "numerics",
            numerics,
            "numerics with a largest value (int, fp)",
        )
    return float(mapped)


def scale_from_history(
    history: jax.Array,
    old_scale: jax.Array,
    fmt_max: float,
    margin: float = 0.0,
    amax_compute: str = "max",
) -> jax.Array:
    r"""The delayed scale: ``amax * 2**margin / fmt_max`` from an amax history.

    Computed exactly as Flax's ``fp8_ops.compute_scale`` (and Transformer
    Engine) do, as the reciprocal of :math:`(\mathrm{fmt\_max} / a) /
    2^{\mathrm{margin}}`, so the two give the same bits.

    Args:
      history: The amax history, ``[history_length, *scale_shape]``
        (float32); entry 0 is the most recent (see :func:`update_history`).
      old_scale: The current scale (``scale_shape``), kept where the amax
        is 0 or not finite.
      fmt_max: The largest magnitude of the format (448 for E4M3, 57344 for
        E5M2): ``numerics.abs_val_mapped_to()``.
      margin: Headroom: the scale is multiplied by ``2**margin``.
      amax_compute: ``"max"`` over the history or ``"most_recent"``.

    Returns:
      The new scale, ``old_scale``'s shape and dtype.

    Raises:
      InvalidArgumentError: For an unknown ``amax_compute``, an empty
        history, or a ``margin`` outside ``[0, 32]``.

    Example:
      >>> h = jnp.array([2.0, 8.0, 0.0])
      >>> qbits._providers.scale_from_history(h, jnp.ones(()), 4.0)
      Array(2., dtype=float32)
      >>> qbits._providers.scale_from_history(
      ...     h, jnp.ones(()), 4.0, amax_compute="most_recent")
      Array(0.5, dtype=float32)
      >>> qbits._providers.scale_from_history(jnp.zeros(3), jnp.full((), 3.0), 4.0)
      Array(3., dtype=float32)
    """
    check_choice("scale_from_history", "amax_compute", amax_compute, AMAX_COMPUTES)
    check_float("scale_from_history", "margin", margin, lo=0.0, hi=_MAX_MARGIN)
    if history.ndim < 1 or history.shape[0] < 1:
        raise InvalidArgumentError(
            "scale_from_history",
            "history.shape",
            history.shape,
            "(history_length, *scale_shape) with history_length >= 1",
        )
    amax = jnp.max(history, axis=0) if amax_compute == "max" else history[0]
    return _scale_from_amax(amax, old_scale, fmt_max, margin)


def _scale_from_amax(
    amax: jax.Array, old_scale: jax.Array, fmt_max: float, margin: float
) -> jax.Array:
    """:func:`scale_from_history` given the amax taken from the history."""
    amax = amax.astype(old_scale.dtype)
    inverse = 1.0 / old_scale
    factor = (fmt_max / amax) / (2.0**margin)
    factor = jnp.where(amax > 0.0, factor, inverse)
    factor = jnp.where(jnp.isfinite(amax), factor, inverse)
    return 1.0 / factor


def update_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """Pushes this step's amax into the ring buffer (as Flax's ``fp8_ops``).

    The history is rolled one place towards the front and ``amax`` written
    at index 0 (Flax's ``compute_amax_history``): index 0 holds the most
    recent amax, indices 1.. the earlier ones, oldest first; after ``L``
    steps it holds the last ``L`` amaxes.

    Args:
      history: ``[history_length, *scale_shape]``.
      amax: This step's ``max(|x|)`` per block, ``scale_shape`` (or a
        scalar for a per-tensor history).

    Returns:
      The new history, same shape and dtype.

    Example:
      >>> h = jnp.array([1.0, 2.0, 3.0])
      >>> qbits._providers.update_history(h, jnp.float32(9.0))
      Array([9., 3., 1.], dtype=float32)
    """
    amax = jnp.asarray(amax).astype(history.dtype).reshape(history.shape[1:])
    return per_platform(history, amax, cpu=_rolled, cuda=_joined, default=_rolled)


def _rolled(history: jax.Array, amax: jax.Array) -> jax.Array:
    return jnp.roll(history, shift=-1, axis=0).at[0].set(amax)


def _joined(history: jax.Array, amax: jax.Array) -> jax.Array:
    """:func:`_rolled`'s values in one concatenation: one kernel on a GPU.

    The roll and the write of ``amax`` are two kernels per history there
    (the roll runs as soon as the step starts, the write after the amax).
    """
    return jnp.concatenate([amax[None], history[2:], history[:1]])[: len(history)]


def stacks(provider: ScaleProvider, state: State) -> bool:
    """Whether :func:`delayed_scales` takes this tensor's state with others'.

    A per-tensor :class:`DelayedScaling` history (``[L]``) whose scale is
    its max.
    """
    return (
        type(provider) is DelayedScaling
        and provider.amax_compute == "max"
        and jnp.ndim(state["amax_history"]) == 1
    )


def delayed_scales(
    providers: Sequence[DelayedScaling],
    states: Sequence[State],
    numerics: Sequence[QNumerics],
) -> list[jax.Array]:
    """:meth:`DelayedScaling.scale` of several tensors' states (:func:`stacks`).

    On a GPU the histories of one length are reduced together, one
    reduction over their stack instead of one tiny kernel each (a matmul
    has three tensors, a transformer block 18); elsewhere each alone. The
    same numbers either way: a max is exact.
    """
    for p, n in zip(providers, numerics, strict=True):
        _check_margin(p.margin, n)
    histories = [s["amax_history"] for s in states]
    maxima = per_platform(
        *histories, cpu=_maxima, cuda=_stacked_maxima, default=_maxima
    )
    return [
        _scale_from_amax(a, s["scale"], _fmt_max(n), p.margin)
        for a, s, n, p in zip(maxima, states, numerics, providers, strict=True)
    ]


def updated_histories(histories: Sequence[jax.Array], amaxes: Sequence[jax.Array]):
    """:func:`update_history` of several per-tensor histories (:func:`stacks`).

    On a GPU those of one length in one kernel (their stack, rolled and
    written); elsewhere each alone. The same values.
    """
    amaxes = [
        jnp.asarray(a).astype(h.dtype).reshape(()) for h, a in zip(histories, amaxes,
                                                                   strict=True)
    ]  # fmt: skip
    n = len(histories)

    def each(*a: jax.Array) -> list[jax.Array]:
        return [_rolled(h, m) for h, m in zip(a[:n], a[n:], strict=True)]

    def stacked(*a: jax.Array) -> list[jax.Array]:
        return _stacked(_joined, a[:n], a[n:])

    return list(per_platform(*histories, *amaxes, cpu=each, cuda=stacked, default=each))


def _maxima(*histories: jax.Array) -> list[jax.Array]:
    return [jnp.max(h, axis=0) for h in histories]


def _stacked_maxima(*histories: jax.Array) -> list[jax.Array]:
    return _stacked(lambda h: jnp.max(h, axis=0), histories)


def _stacked(fn: Any, histories: Sequence[jax.Array], *others: Sequence[Any]) -> list:
    """``fn`` of each history (and its ``others``), mapped over stacks.

    The histories of one length and dtype are stacked: one kernel for them.
    """
    groups: dict[tuple[int, Any], list[int]] = {}
    for i, h in enumerate(histories):
        groups.setdefault((h.shape[0], h.dtype), []).append(i)
    out: list[Any] = [None] * len(histories)
    for members in groups.values():
        args = [jnp.stack([xs[i] for i in members]) for xs in (histories, *others)]
        result = jax.vmap(fn)(*args)
        for j, i in enumerate(members):
            out[i] = result[j]
    return out


class LearnedScale(ScaleProvider):
    r"""A learned step size (LSQ, Esser et al., arXiv 1902.08153).

    The scale (the step between grid points) is a trainable parameter, one
    per tensor, trained with the LSQ gradient:

    .. math::

       \frac{\partial \hat{x}}{\partial s} = \begin{cases}
       Q(v) - v & -Q_n < v < Q_p \\ Q(v) & \text{otherwise}\end{cases},
       \quad v = x / s,

    scaled by :math:`g = 1 / \sqrt{N Q_p}` (N elements per scale); ``x``
    gets the straight-through gradient inside the range and zero outside.
    The matmul runs on the quantized operand as the quantizer's mode says
    (real mode: int8 x int8 with the learned step as the scale). The
    parameter is named ``<tensor>_step`` (``lhs_step``, ``rhs_step``) and
    lives with the model's parameters.

    Attributes:
      init: How the step is initialised from the first batch: ``"lsq"``
        (:math:`2\,\mathrm{mean}|x| / \sqrt{Q_p}`, the paper's) or
        ``"absmax"`` (:math:`\max|x|` mapped onto the grid's edge).

    Example:
      >>> lsq = qbits.LearnedScale("absmax")
      >>> lsq.init_state((), jnp.array([15.0, -3.0]), qbits.IntNumerics(bits=4))
      {'step': Array(2., dtype=float32)}
    """

    init: str = struct.field(pytree_node=False, default="lsq")

    trainable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_choice("LearnedScale", "init", self.init, LSQ_INITS)

    def init_state(
        self,
        shape: tuple[int, ...],
        x: jax.Array | None,
        numerics: QNumerics,
        amax: jax.Array | None = None,
    ) -> State:
        """The step from a first batch (NaN when no batch is given)."""
        grid_max(numerics)  # validates the numerics
        if x is None:
            return {"step": jnp.full(shape, jnp.nan, jnp.float32)}
        step = init_step(x, numerics, self.init)
        return {"step": jnp.broadcast_to(step, shape).astype(jnp.float32)}

    def scale(self, state: State, numerics: QNumerics) -> jax.Array:
        """The step, without gradient (the gradient flows through :meth:`prepare`)."""
        return jax.lax.stop_gradient(state["step"])

    def prepare(self, x: jax.Array, state: State, numerics: QNumerics) -> jax.Array:
        """``x`` fake-quantized with the learned step, with LSQ gradients.

        Quantizing the result again with the same step is exact, so the
        matmul (real or fake) sees the same grid values.
        """
        step = state["step"]
        return lsq_quantize(numerics, x, step.reshape(()) if step.size == 1 else step)
