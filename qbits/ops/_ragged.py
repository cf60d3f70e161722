"""Quantized ``ragged_dot``: grouped matmuls, forward and both backward.

A ragged dot is ``g`` matmuls, one per group (an expert of a mixture of
experts), each on its own rows of the lhs (:mod:`qbits.ops._ragged_dims`).
:func:`ragged_dot` quantizes each as :func:`qbits.dot_general` quantizes a
matmul, through the same core (one custom VJP; the contractions are in
:mod:`qbits.ops._ragged_contract`):

- the forward and the lhs gradient are ragged dots
  (``lax.ragged_dot_general``, with JAX's dimension numbers) of quantized
  operands: ``PerChannel()`` gives the activations (and the output
  gradient) one scale per row, the weights one per group and output
  channel (per group and input channel in the lhs gradient). In real mode
  the dot runs on the stored values (int8 x int8 -> int32) and each output
  row takes its group's weight scale;
- the weight gradient sums over each group's rows, its operands quantized
  per group (``PerChannel()``: a scale per group and channel from that
  group's rows) and contracted group by group, never copied per group
  (:mod:`qbits.ops._ragged_grad`). Where a scale provider,
  ``use_fwd_quant`` or a diagnostics probe needs the core's view, the core
  quantizes their expansion per group (``[g, ...]``): the same numbers.

So with per-channel scales, the values and both gradients are those of a
loop over the groups of :func:`qbits.dot_general` on each group's rows and
weight. Other granularities apply to each tensor as a whole:
``PerTensor()`` gives all groups one scale, as it gives all batch entries
of a batched ``dot_general`` one.

Costs: the forward and the lhs gradient are ``lax.ragged_dot_general``,
which XLA:CPU computes from its lhs copied per group (codes: one byte per
element and group), a GPU or TPU as a grouped matmul. The weight gradient
keeps the float lhs and, on CPU, contracts one group at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._calibration import AbsMax, ConstantBound
from qbits._errors import InvalidArgumentError
from qbits._granularity import PerTensor
from qbits.ops import _state as state_lib
from qbits.ops._config import DotGeneralConfig, check_config
from qbits.ops._kind import Call, Operand, OpKind
from qbits.ops._op import Op
from qbits.ops._ragged_contract import RaggedContraction
from qbits.ops._ragged_dims import BASIC, RaggedDims, unsupported
from qbits.ops._ragged_grad import IDENTITY_MATMUL, own_weight_grad

__all__ = ["KIND", "RaggedDot", "ragged_dot"]

Shape = tuple[int, ...]


def _hashable(x: Any) -> Any:
    return tuple(x) if isinstance(x, list) else x


def _check_dtype(owner: str, group_sizes: Any) -> None:
    """Raises InvalidArgumentError unless ``group_sizes`` holds integers."""
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise InvalidArgumentError(
            owner, "group_sizes.dtype", jnp.dtype(group_sizes.dtype),
            "an integer dtype (int32): the number of lhs rows of each group",
        )  # fmt: skip


def _check_group_sizes(owner: str, group_sizes: Any, rhs: Any, group: int) -> None:
    """Integer sizes, one per group of ``rhs`` (its axis ``group``).

    Raises:
      InvalidArgumentError: Naming ``group_sizes`` and what it must be.
    """
    _check_dtype(owner, group_sizes)
    if len(rhs.shape) <= group:
        return  # lax names the rank
    count = rhs.shape[group]
    if tuple(group_sizes.shape) != (count,):
        raise InvalidArgumentError(
            owner, "group_sizes.shape", tuple(group_sizes.shape),
            f"({count},): one size per group, as rhs has {count} groups "
            f"(rhs.shape[{group}]; rhs is {tuple(rhs.shape)})",
        )  # fmt: skip
    _check_sizes(owner, group_sizes)


def _check_sizes(owner: str, group_sizes: Any) -> None:
    """Concrete sizes: none negative, each list's sum within their dtype.

    (Traced sizes are not checked: :func:`_valid` makes a quantized output
    NaN for them.)

    Raises:
      InvalidArgumentError: Naming the bad sizes and what they must be.
    """
    concrete = isinstance(group_sizes, jax.Array | np.ndarray)
    if not concrete or isinstance(group_sizes, jax.core.Tracer):
        return  # traced, or only a shape
    sizes = np.asarray(group_sizes).astype(object)  # Python ints: exact sums
    dtype = np.dtype(group_sizes.dtype)
    negative = [f"group_sizes[{', '.join(map(str, at))}] = {sizes[tuple(at)]}"
                for at in np.argwhere(sizes < 0)[:4]]  # fmt: skip
    if negative:
        raise InvalidArgumentError(
            owner, "group_sizes", sizes.tolist(),
            "sizes >= 0: the number of lhs rows of each group",
            why=f"negative: {', '.join(negative)}",
        )  # fmt: skip
    top = int(np.iinfo(dtype).max)
    sums = np.sum(sizes, axis=-1, keepdims=True) if sizes.size else sizes
    if np.any(sums > top):
        raise InvalidArgumentError(
            owner, "group_sizes", sizes.tolist(),
            f"sizes whose sum is at most {top}, the largest {dtype.name} (the "
            "dtype lax adds them up in; the ragged dimension is smaller still)",
            why=f"they sum to {max(np.ravel(sums))}, which wraps in {dtype.name}",
        )  # fmt: skip


def _valid(group_sizes: jax.Array) -> jax.Array:
    """Whether traced sizes are none negative and their sum does not wrap."""
    ends = jnp.cumsum(group_sizes, axis=-1, dtype=group_sizes.dtype)
    starts = jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends[..., :-1]], -1)
    return jnp.all(group_sizes >= 0) & jnp.all(ends >= starts)


def _check_shapes(owner: str, lhs: Any, rhs: Any, rd: RaggedDims) -> None:
    """Raises InvalidArgumentError, naming both shapes, for axes that differ."""
    d = rd.dims
    for kind, pairs in (
        ("contracting", zip(d.lhs_contract, d.rhs_contract, strict=True)),
        ("batch", zip(d.lhs_batch, d.rhs_batch, strict=True)),
    ):
        for a, b in pairs:
            if lhs.shape[a] != rhs.shape[b]:
                raise InvalidArgumentError(
                    owner, "rhs.shape", tuple(rhs.shape),
                    f"rhs.shape[{b}] == lhs.shape[{a}] = {lhs.shape[a]}: the "
                    f"{kind} axes of lhs and rhs have the same size",
                    why=f"lhs.shape is {tuple(lhs.shape)}; lhs axis {a} is "
                    f"{kind} with rhs axis {b}",
                )  # fmt: skip


def _check_config(config: DotGeneralConfig, owner: str) -> None:
    """What a ragged dot needs of a config beyond a dot_general's.

    Raises:
      InvalidArgumentError: For a scale provider that is not per tensor, or
        a weight-gradient operand calibrated other than by its absmax (or a
        constant bound), or on an asymmetric grid: those operands are
        calibrated per group on their expansion, where other groups' rows
        are zeros that a percentile, an MSE search or a zero point would
        count.
    """
    for matmul in ("fwd", "dlhs", "drhs"):
        for side in ("lhs", "rhs"):
            q = getattr(getattr(config, matmul), side)
            where = f"config.{matmul}.{side}"
            if q.provider is not None and not isinstance(q.granularity, PerTensor):
                raise InvalidArgumentError(
                    owner,
                    f"{where}.granularity",
                    q.granularity,
                    "PerTensor() with a scale provider (a ragged dot keeps "
                    "one scale state per tensor), or a calibration",
                )
            if matmul != "drhs" or q.numerics.is_identity:
                continue
            if q.numerics.asymmetric:
                raise InvalidArgumentError(
                    owner,
                    f"{where}.numerics",
                    q.numerics,
                    "a symmetric grid (IntNumerics, FpNumerics) for the weight "
                    "gradient's operands",
                    why="they are calibrated per group, with other groups' rows "
                    "as zeros, which an asymmetric range would count",
                )
            if q.provider is None and not isinstance(
                q.calibration, AbsMax | ConstantBound
            ):
                raise InvalidArgumentError(
                    owner,
                    f"{where}.calibration",
                    q.calibration,
                    "AbsMax() or ConstantBound() (or a scale provider) for the "
                    "weight gradient's operands",
                    why="they are calibrated per group, with other groups' rows "
                    "as zeros, which a percentile or an MSE search would count",
                )


@dataclasses.dataclass(frozen=True, eq=False)
class RaggedDot(Op):
    """A drop-in ``jax.lax.ragged_dot`` that quantizes as its config says.

    Made by :func:`ragged_dot`; call it exactly like ``lax.ragged_dot``, or
    (:meth:`general`) like ``lax.ragged_dot_general``. A config whose
    quantizers take their scales from state also needs ``state=``, from
    :meth:`init_state`. It holds its ``config`` and ``key``, as
    :class:`~qbits.ops.DotGeneral`.

    Example:
      >>> rd = qbits.ops.ragged_dot(qbits.presets.get("int8_fwd"))
      >>> rd == qbits.ops.ragged_dot(qbits.presets.get("int8_fwd"))
      True
      >>> rd.config.fwd.rhs.numerics.bits
      8
    """

    def __call__(
        self,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        group_sizes: jax.typing.ArrayLike,
        precision: Any = None,
        preferred_element_type: Any = None,
        group_offset: Any = None,
        out_sharding: Any = None,
        *,
        state: dict[str, jax.Array] | None = None,
        diagnostics: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """Computes ``lax.ragged_dot(lhs, rhs, group_sizes, ...)``, quantized.

        ``lhs`` is ``[m, k]``, ``rhs`` ``[g, k, n]``, ``group_sizes`` ``[g]``
        (integers: rows ``0..group_sizes[0]-1`` use ``rhs[0]``, and so on;
        rows past their sum give zeros). ``state``: the scale state of the
        config's providers (:meth:`init_state`); ``diagnostics`` a probe, as
        for :class:`~qbits.ops.DotGeneral`.

        Raises:
          InvalidArgumentError: For operands that are not ``[m, k]`` and
            ``[g, k, n]`` or whose ``k`` differ (naming both shapes),
            ``group_sizes`` that are not integers, not one per group of
            ``rhs``, or (concrete) negative or summing past their dtype's
            largest value, a ``group_offset`` (quantized), or operands that
            are not floating point.
        """
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        group_sizes = jnp.asarray(group_sizes)
        for name, x, rank, form in (
            ("lhs", lhs, 2, "[m, k]"),
            ("rhs", rhs, 3, "[g, k, n]"),
        ):
            if x.ndim != rank:
                raise InvalidArgumentError(
                    "ragged_dot", f"{name}.shape", tuple(x.shape),
                    f"a shape {form} (lax.ragged_dot's; RaggedDot.general takes "
                    "others, as lax.ragged_dot_general)",
                )  # fmt: skip
        _check_shapes("ragged_dot", lhs, rhs, RaggedDims.create(BASIC, 2, 3))
        _check_group_sizes("ragged_dot", group_sizes, rhs, 0)
        if self._passes(state, diagnostics):
            return lax.ragged_dot(
                lhs, rhs, group_sizes, precision, preferred_element_type,
                group_offset, out_sharding,
            )  # fmt: skip
        rest = (precision, preferred_element_type, group_offset, out_sharding)
        return self._general(
            "ragged_dot", lhs, rhs, group_sizes, BASIC, rest, state, diagnostics
        )

    def general(
        self,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        group_sizes: jax.typing.ArrayLike,
        ragged_dot_dimension_numbers: lax.RaggedDotDimensionNumbers,
        precision: Any = None,
        preferred_element_type: Any = None,
        group_offset: Any = None,
        out_sharding: Any = None,
        *,
        state: dict[str, jax.Array] | None = None,
        diagnostics: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """Computes ``lax.ragged_dot_general(...)``, quantized.

        Quantized in the mode ``lax.ragged_dot`` uses (the lhs ragged
        dimension a free one, one rhs group dimension, ``group_sizes`` of
        rank 1); an identity config passes any call to ``lax`` as it is.

        Raises:
          InvalidArgumentError: For concrete ``group_sizes`` that are
            negative or whose sum wraps around in their dtype (any config);
            quantized, for another mode, ``group_sizes`` of another rank or
            not one per group, contracting or batch axes of different sizes
            (naming both shapes), a ``group_offset``, or operands that are
            not floating point.

        Example:
          >>> rd = qbits.ops.ragged_dot(qbits.presets.get("int8_fwd"))
          >>> dn = jax.lax.RaggedDotDimensionNumbers(  # lax.ragged_dot's
          ...     (((1,), (1,)), ((), ())), lhs_ragged_dimensions=(0,),
          ...     rhs_group_dimensions=(0,))
          >>> x, w = jnp.ones((5, 8)), jnp.ones((2, 8, 3))
          >>> jax.eval_shape(lambda x, w: rd.general(x, w, jnp.array([2, 3]), dn),
          ...                x, w).shape
          (5, 3)
        """
        rdn = ragged_dot_dimension_numbers
        rest = (precision, preferred_element_type, group_offset, out_sharding)
        return self._general(
            "ragged_dot_general", lhs, rhs, group_sizes, rdn, rest, state, diagnostics
        )

    def _general(
        self,
        owner: str,
        lhs: Any,
        rhs: Any,
        group_sizes: Any,
        rdn: Any,
        rest: tuple[Any, ...],
        state: Any,
        diagnostics: Any,
    ) -> jax.Array:
        """:meth:`general`, errors naming ``owner``; ``rest`` as lax's after ``rdn``."""
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        group_sizes = jnp.asarray(group_sizes)
        if self._passes(state, diagnostics):
            _check_dtype(owner, group_sizes)
            _check_sizes(owner, group_sizes)
            return lax.ragged_dot_general(lhs, rhs, group_sizes, rdn, *rest)
        c = _contraction(owner, lhs, rhs, group_sizes, rdn, *rest)
        config = self.config
        if diagnostics is None and own_weight_grad(config.drhs):
            # The weight gradient quantizes its operands itself, group by
            # group (RaggedWeightGrad.direct); the core keeps the float lhs.
            c = dataclasses.replace(c, drhs=config.drhs)
            config = config.replace(drhs=IDENTITY_MATMUL)
        out = state_lib.run(
            config, c, lhs, rhs, self.key, state, owner,
            data=(group_sizes, self.key), probe=diagnostics,
        )  # fmt: skip
        # Traced sizes that are negative or wrap around: lax leaves them
        # undefined (on CPU a row sums the products of every group whose
        # range holds it); quantized, each row takes one group's scale.
        return jnp.where(_valid(group_sizes), out, jnp.nan)

    def init_state(
        self,
        lhs: Any,
        rhs: Any,
        group_sizes: Any,
        ragged_dot_dimension_numbers: lax.RaggedDotDimensionNumbers = BASIC,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> dict[str, jax.Array]:
        """The initial scale state for operands like these.

        Arrays or ``jax.ShapeDtypeStruct`` s (a learned scale starts from the
        operands' values).

        Example:
          >>> rd = qbits.ops.ragged_dot(qbits.presets.get("fp8_delayed"))
          >>> spec = jax.ShapeDtypeStruct
          >>> st = rd.init_state(spec((5, 8), jnp.float32),
          ...                    spec((2, 8, 3), jnp.float32), spec((2,), jnp.int32))
          >>> st["rhs_scale"], st["grad_amax_history"].shape
          (Array([1.], dtype=float32), (1024,))
        """
        lhs, rhs, gs = (
            x if isinstance(x, jax.ShapeDtypeStruct) else jnp.asarray(x)
            for x in (lhs, rhs, group_sizes)
        )
        c = _contraction(
            "ragged_dot", lhs, rhs, gs, ragged_dot_dimension_numbers, precision,
            preferred_element_type, None, None,
        )  # fmt: skip
        if isinstance(gs, jax.ShapeDtypeStruct):  # only shapes are read
            gs = jnp.zeros(gs.shape, gs.dtype)
        return state_lib.init_state(
            self.config, c.bind((gs, None)), lhs, rhs, "ragged_dot"
        )

    def unsupported(
        self,
        lhs: Any,
        rhs: Any,
        group_sizes: Any,
        ragged_dot_dimension_numbers: Any,
        group_offset: Any = None,
    ) -> str:
        """Why a ``ragged_dot_general`` call cannot be quantized, or ``""``.

        Arrays or anything with ``shape`` and ``dtype``.

        Example:
          >>> rd = qbits.ops.ragged_dot(qbits.DotGeneralConfig())
          >>> dn = jax.lax.RaggedDotDimensionNumbers(
          ...     (((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,),
          ...     rhs_group_dimensions=())
          >>> rd.unsupported(jnp.ones((5, 8)), jnp.ones((5, 3)),
          ...                jnp.array([2, 3]), dn)
          'ragged_dot_general with the ragged dimension contracted'
        """
        del rhs
        return unsupported(
            ragged_dot_dimension_numbers,
            len(lhs.shape),
            len(group_sizes.shape),
            group_offset,
        )

    def quantized_operands(
        self,
        lhs_shape: Shape,
        rhs_shape: Shape,
        ragged_dot_dimension_numbers: Any = BASIC,
    ) -> tuple[tuple[str, str, Shape, tuple[int, ...]], ...]:
        """The six quantized operands: ``(matmul, side, shape, contracting)``.

        The shapes and contracting axes each quantizer of the config sees
        (the weight gradient's operands are expanded per group: a leading
        group axis), for checking a config against a call.

        Example:
          >>> rd = qbits.ops.ragged_dot(qbits.DotGeneralConfig())
          >>> rd.quantized_operands((5, 8), (2, 8, 3))[-1]
          ('drhs', 'rhs', (2, 5, 8), (1,))
        """
        rd = RaggedDims.create(
            ragged_dot_dimension_numbers, len(lhs_shape), len(rhs_shape)
        )
        c = RaggedContraction(rd)
        cl, cr = c.gradient("lhs"), c.gradient("rhs")
        lhs, rhs = tuple(lhs_shape), tuple(rhs_shape)
        out, g = rd.out_shape(lhs, rhs), (rhs[rd.rhs_group],)
        return (
            ("fwd", "lhs", lhs, c.contracting[0]),
            ("fwd", "rhs", rhs, c.contracting[1]),
            ("dlhs", "lhs", out, cl.contracting[0]),
            ("dlhs", "rhs", rhs, cl.contracting[1]),
            ("drhs", "lhs", g + out, cr.contracting[0]),
            ("drhs", "rhs", g + lhs, cr.contracting[1]),
        )


def _contraction(
    owner: str,
    lhs: Any,
    rhs: Any,
    group_sizes: Any,
    dimension_numbers: Any,
    precision: Any,
    preferred_element_type: Any,
    group_offset: Any,
    out_sharding: Any,
) -> RaggedContraction:
    """The forward contraction of one call, its arguments checked.

    Raises:
      InvalidArgumentError: As :meth:`RaggedDot.general`.
    """
    _check_dtype(owner, group_sizes)
    rd = RaggedDims.create(
        dimension_numbers,
        len(lhs.shape),
        len(rhs.shape),
        len(group_sizes.shape),
        group_offset,
        owner,
    )
    _check_shapes(owner, lhs, rhs, rd)
    _check_group_sizes(owner, group_sizes, rhs, rd.rhs_group)
    # Let lax check the rest of the shapes and dtypes, with its own messages.
    jax.eval_shape(
        functools.partial(
            lax.ragged_dot_general,
            ragged_dot_dimension_numbers=rd.lax(),
            preferred_element_type=preferred_element_type,
        ),
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (lhs, rhs, group_sizes)),
    )
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise InvalidArgumentError(
                owner, f"{name}.dtype", jnp.dtype(x.dtype), "a floating-point dtype"
            )
    return RaggedContraction(
        rd, _hashable(precision), preferred_element_type, out_sharding
    )


def ragged_dot(config: DotGeneralConfig, key: jax.Array | None = None) -> RaggedDot:
    """A quantized drop-in for ``jax.lax.ragged_dot`` (grouped matmuls).

    The returned function has exactly the signature of ``lax.ragged_dot``
    (``lhs [m, k]``, ``rhs [g, k, n]``, ``group_sizes [g]``, ``precision``,
    ``preferred_element_type``, ``group_offset``, ``out_sharding``) and the
    same groups: rows ``0..group_sizes[0]-1`` of ``lhs`` multiply ``rhs[0]``,
    and so on; rows past their sum give zeros. ``config.fwd`` quantizes the
    forward ragged dot, ``config.dlhs`` and ``config.drhs`` the two gradient
    matmuls (``d lhs = ragged_dot(g, rhs^T)``, ``d rhs[j] = lhs_j^T g_j``),
    through the core of :func:`qbits.dot_general`. With ``PerChannel()``
    scales (the int8 presets) the numbers are those of
    :func:`qbits.dot_general` applied to each group's rows and weight, in
    the forward and both gradients: scales per row of the activations and
    of the output gradient, per group and channel of the weights, and, in
    the weight gradient, per group and channel of both operands. A config
    that quantizes nothing is ``lax.ragged_dot`` itself, bit for bit.
    :meth:`RaggedDot.general` is ``lax.ragged_dot_general``.

    Group sizes are counts. ``lax`` does not define negative ones, nor ones
    whose sum wraps around in their dtype (on CPU a row then sums the
    products of every group whose range holds it, which per-group scales
    cannot reproduce): concrete, they are refused, whatever the config;
    traced, a quantized output is NaN. A sum past the ragged dimension
    cuts the last groups off at it, as in ``lax``.

    Args:
      config: The forward matmul and the two gradient matmuls (a
        :class:`~qbits.DotGeneralConfig`, a preset name or a YAML file, as
        for :func:`qbits.dot_general`).
      key: A PRNG key, required when any operand rounds stochastically.

    Returns:
      A :class:`~qbits.ops._ragged.RaggedDot`.

    Raises:
      InvalidArgumentError: As :func:`qbits.dot_general`; for a scale
        provider that is not per tensor; for weight-gradient operands
        (``config.drhs``) calibrated other than by absmax or a constant
        bound, or on an asymmetric grid (they are calibrated per group, on
        rows where other groups' are zeros).

    Example:
      >>> rd = qbits.ops.ragged_dot(qbits.presets.get("int8"), jax.random.key(0))
      >>> x = jnp.cos(jnp.arange(96.0)).reshape(6, 16)   # 6 tokens
      >>> w = jnp.sin(jnp.arange(384.0)).reshape(3, 16, 8)  # 3 experts
      >>> sizes = jnp.array([2, 0, 4])          # expert 1 gets no token
      >>> loss = lambda x, w: jnp.sum(rd(x, w, sizes) ** 2)
      >>> value, (gx, gw) = jax.value_and_grad(loss, (0, 1))(x, w)
      >>> want = jnp.sum(jax.lax.ragged_dot(x, w, sizes) ** 2)
      >>> round(float(value / want), 2)
      1.0
      >>> float(jnp.abs(gw[1]).max())            # no rows, no gradient
      0.0
    """
    config, key = check_config("ragged_dot", config, key)
    state_lib.check_providers(config, "ragged_dot")
    _check_config(config, "ragged_dot")
    return RaggedDot(config, key)


class _RaggedDotKind(OpKind):
    """``ragged_dot_general``: the op kind of :meth:`RaggedDot.general`."""

    name = "ragged_dot"
    primitives = ("ragged_dot_general", "ragged_dot")  # the latter: older JAX
    short = "ragged_dot"
    limited = "a ragged dot"
    factory = staticmethod(ragged_dot)

    def call(self, params: Any, operands: list[Any]) -> Call:
        """``(lhs, rhs, group_sizes, dimension_numbers, precision, pet)``."""
        p = params
        dn = p.get("ragged_dot_dimension_numbers", BASIC)
        args = (*operands[:3], dn, p.get("precision"), p.get("preferred_element_type"))
        sharding = p.get("out_sharding")
        return Call(args, {} if sharding is None else {"out_sharding": sharding})

    def operands(self, call: Call, out: tuple[int, ...]) -> tuple[Operand, ...]:
        """:meth:`RaggedDot.quantized_operands` (``out`` unused)."""
        lhs, rhs, _, dn = call.args[:4]
        op = RaggedDot(DotGeneralConfig())
        return op.quantized_operands(tuple(lhs.shape), tuple(rhs.shape), dn)

    def unsupported(self, params: Any, operands: list[Any]) -> str:
        """:meth:`RaggedDot.unsupported`: a mode other than ``lax.ragged_dot``'s."""
        lhs, rhs, sizes = operands[:3]
        dn = params.get("ragged_dot_dimension_numbers", BASIC)
        op = RaggedDot(DotGeneralConfig())
        return op.unsupported(lhs, rhs, sizes, dn, params.get("group_offset"))

    def check(self, config: DotGeneralConfig) -> None:
        """What :func:`ragged_dot` asks of a config (per-tensor providers...)."""
        # A key only to build the op: the config is checked, nothing is drawn.
        ragged_dot(config, jax.random.key(0) if config.needs_key else None)

    def apply(
        self, config: DotGeneralConfig, key: jax.Array | None, call: Call, **extra: Any
    ) -> jax.Array:
        """:meth:`RaggedDot.general` on the call."""
        return ragged_dot(config, key).general(*call.args, **call.kwargs, **extra)


#: The ``ragged_dot_general`` op kind.
KIND = _RaggedDotKind()
