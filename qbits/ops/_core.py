"""The quantized-matmul core: one custom VJP for dot_general, einsum and conv.

A quantized matmul is three contractions of two quantized operands each
(see :class:`~qbits.DotGeneralConfig`): the forward ``out = C(lhs, rhs)``,
and the two that give the gradients, ``d_lhs = C_l(g, rhs)`` and
``d_rhs = C_r(g, lhs)``. A :class:`Contraction` says what the three
contract and computes each from quantized operands (a ``dot_general`` for
:func:`qbits.dot_general` and :func:`qbits.einsum`, a convolution and its
transposes for :func:`qbits.conv_general_dilated`); :func:`apply` ties the
three together with the one ``jax.custom_vjp`` of qbits.

Scales:
  Each operand's scale is computed from the operand by its quantizer's
  calibration, or given: a quantizer whose calibration is a
  :class:`~qbits.providers.ScaleProvider` takes the scale of its tensor
  (``"lhs"``, ``"rhs"`` or ``"grad"``, the output gradient) from the
  ``scales`` argument. The cotangent of a given scale is the tensor's amax
  per scale block, this step's observation of it: new scale state leaves
  the backward pass this way and no other (:mod:`qbits.ops._state` turns it
  into the provider's next state).

Residuals:
  The forward pass keeps the forward operands as the backward matmuls will
  use them: quantized already (a stored int8/fp8 array is a quarter of a
  float32 one, and quantizing next to the forward pass reads the operand
  while it is still in cache), or the forward's own quantized operand when
  a backward matmul reuses it (``use_fwd_quant``). Only for the backward
  matmuls that are needed: the custom VJP sees which arguments are
  differentiated (symbolic zeros), and the input gradient of a first layer
  or the gradient of a frozen weight is never traced.

Passes:
  The tensors a pass quantizes (four in the forward, the output gradient
  for each backward matmul) are quantized together
  (:func:`qbits._quantizer.quantize_all`): their scale arithmetic compiles
  to one small kernel per pass. XLA:CPU's compile time grows with every
  kernel instance and every instruction; a deep model pays it per layer.

``shard_map``:
  Inside ``jax.shard_map`` (with its default ``check_vma=True``) every
  cotangent gets the varying mesh axes of its primal: a gradient is summed
  over the axes along which it varies and its operand does not (the
  transpose of JAX's implicit ``pvary``), and an observed amax is maxed
  over them.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from qbits._context import Context
from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer, Request, quantize_all
from qbits.calibration import AbsMax
from qbits.granularity import BlockLayout
from qbits.numerics import derive_key, next_key
from qbits.ops._config import IDENTITY, DotGeneralConfig, MatmulConfig
from qbits.providers import ScaleProvider
from qbits.tensor import QTensor

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

Axes = tuple[int, ...]
Grad = jax.tree_util.Partial

#: The tensors a quantized matmul quantizes: its operands and the output
#: gradient.
TENSORS: tuple[str, ...] = ("lhs", "rhs", "grad")

#: The six quantized operands: ``(matmul, side, tensor, key stream)``. A
#: stochastic-rounding key for operand ``i`` is
#: :func:`qbits.numerics.derive_key` ``(next_key(key), i)``.
SLOTS: tuple[tuple[str, str, str, int], ...] = (
    ("fwd", "lhs", "lhs", 0),
    ("fwd", "rhs", "rhs", 1),
    ("dlhs", "lhs", "grad", 2),
    ("dlhs", "rhs", "rhs", 3),
    ("drhs", "lhs", "grad", 4),
    ("drhs", "rhs", "lhs", 5),
)


def provider(quantizer: Quantizer) -> ScaleProvider | None:
    """The quantizer's scale provider, or ``None`` when it calibrates."""
    cal = quantizer.calibration
    return cal if isinstance(cal, ScaleProvider) else None


class Contraction(abc.ABC):
    """A bilinear map ``out = C(lhs, rhs)`` that runs on quantized operands.

    Implementations are frozen dataclasses (static arguments of the custom
    VJP: hashable, compared by value).
    """

    @property
    @abc.abstractmethod
    def contracting(self) -> tuple[Axes, Axes]:
        """The axes of each operand that the map sums over (calibration)."""

    @abc.abstractmethod
    def __call__(self, lhs: QTensor, rhs: QTensor, cfg: MatmulConfig) -> jax.Array:
        """The output from quantized operands, real or fake as ``cfg`` says.

        ``lhs`` and ``rhs`` hold float values with a unit scale where an
        operand is not quantized. Returns the output in the dtype the
        unquantized operation would give.
        """

    @abc.abstractmethod
    def plain(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """The unquantized operation (what JAX itself computes)."""

    @abc.abstractmethod
    def gradient(self, side: str) -> Contraction:
        """The contraction ``(g, other) -> d side``, laid out like ``side``."""

    def reuse(self, rhs: QTensor) -> QTensor | None:
        """A forward operand reused as this contraction's rhs.

        Returns it when its scale factors out of this contraction, else
        ``None`` (the scale is then folded into the lhs: :meth:`fold`).
        """
        return rhs

    def fold(self, lhs: jax.Array, rhs: QTensor) -> jax.Array:
        """``lhs`` times ``rhs``'s scale, laid out along ``lhs``'s axes."""
        raise NotImplementedError


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
    """

    config: DotGeneralConfig
    contraction: Contraction
    dtypes: tuple[np.dtype, np.dtype]
    observe: tuple[str, ...] = ()
    vma: tuple[tuple[str, frozenset], ...] = ()


def varying(x: Any) -> frozenset:
    """The manual mesh axes along which ``x`` varies (inside ``shard_map``)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def _key(key: jax.Array | None, slot: int) -> jax.Array | None:
    """The key of operand ``SLOTS[slot]``."""
    return None if key is None else derive_key(key, slot)


class Operand(NamedTuple):
    """One of the six quantized operands of a call, to quantize.

    Attributes:
      quantizer: Its quantizer.
      x: The tensor.
      contracting: The axes its matmul contracts.
      slot: Its index in :data:`SLOTS` (its key stream).
      store: Store the values in the low-precision dtype (real mode).
      scale: Its tensor's given scale, used where the quantizer has a scale
        provider (a calibrating quantizer computes its own).
    """

    quantizer: Quantizer
    x: jax.Array
    contracting: Axes
    slot: int
    store: bool
    scale: jax.Array | None


def quantize(
    operands: dict[str, Operand], key: jax.Array | None
) -> dict[str, tuple[QTensor, Grad]]:
    """Quantizes the operands of one pass together (:func:`quantize_all`).

    The forward pass quantizes up to four tensors (both forward operands,
    and the two that the backward matmuls keep), the backward pass the
    output gradient for each of its matmuls: their scale arithmetic then
    compiles to one small kernel per pass.
    """
    requests = [
        Request(
            o.quantizer,
            o.x,
            Context(_key(key, o.slot)),
            o.store and o.quantizer.numerics.get_dtype() is not None,
            o.contracting,
            o.scale if provider(o.quantizer) is not None else None,
        )
        for o in operands.values()
    ]
    return dict(zip(operands, quantize_all(requests, vjp=True), strict=True))


def block_amax(quantizer: Quantizer, x: jax.Array, contracting: Axes) -> jax.Array:
    """``max(|x|)`` per scale block of ``quantizer`` (inf where a NaN is)."""
    blocks = quantizer.granularity.block_sizes(x.shape, contracting)
    layout = BlockLayout.create(x.shape, blocks)
    xb = x.astype(jnp.float32).reshape(layout.blocked_shape)
    return AbsMax().bound(xb, layout.reduce_axes).reshape(layout.scale_shape)


def _unquantized(x: jax.Array) -> QTensor:
    return QTensor(x, jnp.ones((1,) * x.ndim, jnp.float32), dtype=x.dtype)


@dataclasses.dataclass(frozen=True)
class _Reused:
    """A forward operand that a backward matmul reuses (``use_fwd_quant``)."""

    qtensor: QTensor


jax.tree_util.register_dataclass(_Reused, data_fields=["qtensor"], meta_fields=[])


def apply(
    plan: Plan,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    scales: dict[str, jax.Array],
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

    Returns:
      The output, in the dtype the unquantized operation gives.

    Raises:
      InvalidArgumentError: Under forward-mode differentiation
        (``jax.jvp``, ``jax.jacfwd``), which a custom VJP does not have.
    """
    key = next_key(key) if key is not None and plan.config.needs_key else None
    try:
        return _jit_core(plan, lhs, rhs, key, scales)
    except TypeError as e:
        if "forward-mode" not in str(e):
            raise
        raise InvalidArgumentError(
            "qbits quantized matmul",
            "differentiation",
            "forward-mode (jax.jvp, jax.jacfwd, jax.linearize of a jvp)",
            "reverse mode: jax.grad, jax.vjp, jax.jacrev (the quantized "
            "backward matmuls are a custom VJP, which has no forward mode); "
            "for a JVP of the forward quantization use fake mode outside "
            "qbits.dot_general, e.g. Quantizer.quant(x).dequant()",
        ) from None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(
    plan: Plan,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    scales: dict[str, jax.Array],
) -> jax.Array:
    # Without differentiation only the forward matmul is traced: nothing of
    # the backward matmuls (their operands, their configs' checks).
    return _forward(plan, lhs, rhs, key, scales)[0]


def _forward(
    plan: Plan,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    scales: dict[str, jax.Array],
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
    config, c = plan.config, plan.contraction
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
        axes = c.gradient(side).contracting[1]
        if cfg.use_fwd_quant or cfg.rhs == IDENTITY:
            continue
        if name not in kept:
            if not _fits(cfg.rhs, x, axes):  # no place to keep
                continue
            x = jax.ShapeDtypeStruct(x.shape, x.dtype)
        operands[name] = Operand(
            cfg.rhs, x, axes, slot, cfg.mode == "real", scales.get(tensor)
        )
    done = {n: v for n, v in quantize(operands, key).items() if v is not None}
    if fwd.is_identity:
        done["lhs"] = (_unquantized(lhs), Grad(_identity))
        done["rhs"] = (_unquantized(rhs), Grad(_identity))
        out = c.plain(lhs, rhs)
    else:
        out = c(done["lhs"][0], done["rhs"][0], fwd)
    for name in kept or ():
        cfg, _, x, tensor, _ = backward[name]
        done[name] = _for_backward(cfg, x, done[tensor][0], done.get(name))
    return out, done


def _fwd(
    plan: Plan,
    lhs: Any,
    rhs: Any,
    key: Any,
    scales: dict[str, Any],
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
    scales = {t: s.value for t, s in scales.items()}
    fwd, c = plan.config.fwd, plan.contraction
    out, done = _forward(plan, lhs, rhs, key, scales, kept=needed)
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
    )
    return out, residuals


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


def _fits(quantizer: Quantizer, x: jax.Array, axes: Axes) -> bool:
    """Whether ``quantizer``'s blocks fit ``x`` (a matmul nobody needs may not)."""
    try:
        quantizer.granularity.block_sizes(x.shape, axes)
    except InvalidArgumentError:
        return False
    return True


def _for_backward(
    cfg: MatmulConfig,
    x: jax.Array,
    forward: QTensor,
    quantized: tuple[QTensor, Grad] | None,
) -> jax.Array | QTensor | _Reused:
    """A forward operand as the backward matmul ``cfg`` (its rhs) will use it.

    The forward's own quantized operand (``use_fwd_quant``), the operand
    quantized for this matmul, or the float operand (``cfg.rhs`` is the
    identity).
    """
    if cfg.use_fwd_quant:
        return _Reused(forward)
    if quantized is None:
        return x
    return quantized[0]


def _bwd(
    plan: Plan, residuals: tuple[Any, ...], g: Any
) -> tuple[jax.Array | None, jax.Array | None, None, dict[str, Any]]:
    rhs_b, lhs_b, needs, lgrad, rgrad, key, gscale, amax, zeros = residuals
    config, c = plan.config, plan.contraction
    if isinstance(g, SymbolicZero):  # nothing flows back
        return None, None, None, {t: None for t in zeros}
    needed = {n for n, k in zip(("dlhs", "drhs"), needs.shape, strict=True) if k}
    specs = {
        "dlhs": (config.dlhs, c.gradient("lhs"), rhs_b, 2),
        "drhs": (config.drhs, c.gradient("rhs"), lhs_b, 4),
    }
    matmuls = {
        name: _Gradient.create(cfg, cg, g, other, slot, gscale)
        for name, (cfg, cg, other, slot) in specs.items()
        if name in needed
    }
    # The output gradient quantized once for both backward matmuls when they
    # quantize it alike (same quantizer, same blocks, no noise). A matmul
    # nobody needs keeps its place in the scale kernel (a placeholder) unless
    # the other one's quantization stands for it, so that the kernels are
    # those of a call that needs both.
    operands: dict[str, Operand] = {}
    same: dict[Any, str] = {}
    for name, (cfg, cg, _, slot) in specs.items():
        if name not in needed:
            lc = cg.contracting[0]
            if cfg.lhs == IDENTITY or not _fits(cfg.lhs, g, lc):
                continue
            shareable = _Gradient.shareable_of(cfg, g.shape, lc)
            if shareable is None or all(
                m.shareable != shareable for m in matmuls.values()
            ):
                spec = jax.ShapeDtypeStruct(g.shape, g.dtype)
                operands[name] = Operand(cfg.lhs, spec, lc, slot, False, gscale)
            continue
        m = matmuls[name]
        if m.operand is None:
            continue
        if m.shareable in same:
            m.uses = same[m.shareable]
            continue
        operands[name] = m.operand
        if m.shareable is not None:
            same[m.shareable] = name
    done = quantize(operands, key)
    grads = {
        name: m.contract(done[m.uses or name][0] if m.operand is not None else None)
        for name, m in matmuls.items()
    }
    vma = dict(plan.vma)
    dl = dr = None
    if "dlhs" in grads:
        dl = lgrad(grads["dlhs"].astype(plan.dtypes[0]))
        dl = _match_vma(dl, vma.get("lhs", frozenset()), lax.psum)
    if "drhs" in grads:
        dr = rgrad(grads["drhs"].astype(plan.dtypes[1]))
        dr = _match_vma(dr, vma.get("rhs", frozenset()), lax.psum)
    observed = dict(zeros)
    observed.update(amax)
    if "grad" in plan.observe:
        side = "lhs" if provider(config.dlhs.lhs) else "rhs"
        q = config.dlhs.lhs if side == "lhs" else config.drhs.lhs
        observed["grad"] = block_amax(q, g, c.gradient(side).contracting[0])
    for t in observed:
        observed[t] = _match_vma(
            observed[t].reshape(zeros[t].shape),
            vma.get(f"{t}_scale", frozenset()),
            lax.pmax,
        )
    return dl, dr, None, observed


@dataclasses.dataclass
class _Gradient:
    """One gradient matmul: ``g`` against a forward operand, as ``cfg`` says.

    Attributes:
      cfg: The matmul's config.
      contraction: The gradient contraction.
      g: The output gradient (times the reused operand's scale where it was
        folded in).
      other: The forward operand, quantized for this matmul already.
      operand: ``g`` to quantize, or ``None`` (a float matmul).
      shareable: What makes ``g``'s quantization the same as another
        matmul's (``None``: never shared).
      uses: The matmul whose quantized ``g`` this one takes.
    """

    cfg: MatmulConfig
    contraction: Contraction
    g: jax.Array
    other: Any
    operand: Operand | None
    shareable: Any
    uses: str | None = None

    @classmethod
    def create(
        cls,
        cfg: MatmulConfig,
        c: Contraction,
        g: jax.Array,
        other: jax.Array | QTensor | _Reused,
        slot: int,
        gscale: jax.Array | None,
    ) -> _Gradient:
        if cfg.is_identity and not isinstance(other, QTensor | _Reused):
            return cls(cfg, c, g, other, None, None)
        real = cfg.mode == "real"
        folded = False
        if isinstance(other, _Reused):
            oq = c.reuse(other.qtensor)
            if oq is None:  # its scale varies along axes this matmul contracts
                g = c.fold(g, other.qtensor)
                ones = jnp.ones((1,) * other.qtensor.ndim, jnp.float32)
                oq = other.qtensor.replace(scale=ones)
                folded = True
        elif isinstance(other, QTensor):
            oq = other
        else:
            oq = _unquantized(other)
        lc = c.contracting[0]
        operand = Operand(cfg.lhs, g, lc, slot, real, gscale)
        shareable = None if folded else cls.shareable_of(cfg, g.shape, lc)
        return cls(cfg, c, g, oq, operand, shareable)

    @staticmethod
    def shareable_of(cfg: MatmulConfig, shape: tuple[int, ...], lc: Axes) -> Any:
        """What makes ``g``'s quantization for ``cfg`` shareable (or ``None``)."""
        if cfg.needs_key:
            return None
        q = cfg.lhs
        blocks = q.granularity.block_sizes(shape, lc) if q != IDENTITY else ()
        return (q, blocks, cfg.mode == "real")

    def contract(self, gq: QTensor | None) -> jax.Array:
        """The gradient, from ``g`` quantized (``None`` for a float matmul)."""
        if self.operand is None:
            return self.contraction.plain(self.g, self.other)
        return self.contraction(gq, self.other, self.cfg)


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
