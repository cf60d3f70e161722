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
  a backward matmul reuses it (``use_fwd_quant``).

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits.calibration import AbsMax
from qbits.granularity import BlockLayout
from qbits.numerics import derive_key
from qbits.ops import _matmul as matmul
from qbits.ops._config import IDENTITY, DotGeneralConfig, MatmulConfig
from qbits.providers import ScaleProvider
from qbits.tensor import QTensor

__all__ = [
    "SLOTS",
    "TENSORS",
    "Contraction",
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
#: :func:`qbits.numerics.derive_key` ``(key, i)``.
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


def _key(key: jax.Array | None, stream: int) -> jax.Array | None:
    return None if key is None else derive_key(key, stream)


def _settled(key: jax.Array) -> jax.Array:
    """``key`` itself, computed by a kernel of its own (a reduction).

    XLA:CPU compiles one kernel per distinct fused computation. A key derived
    per layer carries a per-layer constant, which XLA would copy into each of
    the key streams this matmul derives from it (a distinct kernel per layer
    and stream). Summed with zeros along a new axis, the key comes out of a
    reduction that XLA keeps apart: one small kernel per layer, and the
    streams' kernels are the same for every layer.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        words = _settled(jax.random.key_data(key))
        return jax.random.wrap_key_data(words, impl=jax.random.key_impl(key))
    padded = jnp.stack([key, jnp.zeros_like(key)], axis=-1)
    return jnp.sum(padded, axis=-1, dtype=key.dtype)


def quantize(
    quantizer: Quantizer,
    x: jax.Array,
    contracting: Axes,
    key: jax.Array | None,
    *,
    store: bool,
    scale: jax.Array | None = None,
) -> tuple[QTensor, Grad]:
    """:func:`qbits.ops.quantize_operand` of one of the six operands.

    ``scale`` is used where the quantizer has a scale provider; a
    calibrating quantizer computes its own.
    """
    given = scale if provider(quantizer) is not None else None
    return matmul.quantize_operand(
        quantizer, x, contracting, key, store=store, scale=given
    )


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
      key: PRNG key for stochastic rounding (``derive_key(key, i)`` for the
        operand ``SLOTS[i]``), or ``None``.
      scales: The given scale of each tensor with a scale provider, shaped
        like the scale its quantizers compute (one entry per block).

    Returns:
      The output, in the dtype the unquantized operation gives.

    Raises:
      InvalidArgumentError: Under forward-mode differentiation
        (``jax.jvp``, ``jax.jacfwd``), which a custom VJP does not have.
    """
    if key is not None and plan.config.needs_key:
        key = _settled(key)
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
) -> tuple[jax.Array, QTensor, QTensor, Grad, Grad]:
    """The forward matmul and its quantized operands."""
    fwd, c = plan.config.fwd, plan.contraction
    if fwd.is_identity:
        lq, lgrad = _unquantized(lhs), Grad(_identity)
        rq, rgrad = _unquantized(rhs), Grad(_identity)
        return c.plain(lhs, rhs), lq, rq, lgrad, rgrad
    real = fwd.mode == "real"
    lc, rc = c.contracting
    lq, lgrad = quantize(
        fwd.lhs, lhs, lc, _key(key, 0), store=real, scale=scales.get("lhs")
    )
    rq, rgrad = quantize(
        fwd.rhs, rhs, rc, _key(key, 1), store=real, scale=scales.get("rhs")
    )
    return c(lq, rq, fwd), lq, rq, lgrad, rgrad


def _fwd(
    plan: Plan,
    lhs: jax.Array,
    rhs: jax.Array,
    key: jax.Array | None,
    scales: dict[str, jax.Array],
) -> tuple[jax.Array, tuple[Any, ...]]:
    config, c = plan.config, plan.contraction
    fwd = config.fwd
    out, lq, rq, lgrad, rgrad = _forward(plan, lhs, rhs, key, scales)
    lc, rc = c.contracting
    amax = {
        t: block_amax(q, x, axes)
        for t, q, x, axes in (("lhs", fwd.lhs, lhs, lc), ("rhs", fwd.rhs, rhs, rc))
        if t in plan.observe
    }
    residuals = (
        _for_backward(
            config.dlhs, c.gradient("lhs"), rhs, rq, key, 3, scales.get("rhs")
        ),
        _for_backward(
            config.drhs, c.gradient("rhs"), lhs, lq, key, 5, scales.get("lhs")
        ),
        lgrad,
        rgrad,
        key,
        scales.get("grad"),
        amax,
        {t: jnp.zeros_like(s) for t, s in scales.items()},
    )
    return out, residuals


def _for_backward(
    cfg: MatmulConfig,
    c: Contraction,
    x: jax.Array,
    forward: QTensor,
    key: jax.Array | None,
    stream: int,
    scale: jax.Array | None,
) -> jax.Array | QTensor | _Reused:
    """A forward operand as the backward matmul ``cfg`` (its rhs) will use it."""
    if cfg.use_fwd_quant:
        return _Reused(forward)
    if cfg.rhs == IDENTITY:
        return x
    qt, _ = quantize(
        cfg.rhs,
        x,
        c.contracting[1],
        _key(key, stream),
        store=cfg.mode == "real",
        scale=scale,
    )
    return qt


def _bwd(
    plan: Plan, residuals: tuple[Any, ...], g: jax.Array
) -> tuple[jax.Array, jax.Array, None, dict[str, jax.Array]]:
    rhs_b, lhs_b, lgrad, rgrad, key, gscale, amax, zeros = residuals
    config, c = plan.config, plan.contraction
    shared: dict[Any, tuple[QTensor, Any]] = {}
    dl = _gradient(config.dlhs, c.gradient("lhs"), g, rhs_b, key, 2, gscale, shared)
    dr = _gradient(config.drhs, c.gradient("rhs"), g, lhs_b, key, 4, gscale, shared)
    dl = lgrad(dl.astype(plan.dtypes[0]))
    dr = rgrad(dr.astype(plan.dtypes[1]))
    vma = dict(plan.vma)
    dl = _match_vma(dl, vma.get("lhs", frozenset()), lax.psum)
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


def _gradient(
    cfg: MatmulConfig,
    c: Contraction,
    g: jax.Array,
    other: jax.Array | QTensor | _Reused,
    key: jax.Array | None,
    stream: int,
    gscale: jax.Array | None,
    shared: dict[Any, tuple[QTensor, Any]],
) -> jax.Array:
    """One gradient matmul: ``g`` against a forward operand, as ``cfg`` says."""
    if cfg.is_identity and not isinstance(other, QTensor | _Reused):
        return c.plain(g, other)
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
    # The output gradient quantized once for both backward matmuls when they
    # quantize it alike (same quantizer, same blocks, no noise).
    blocks = cfg.lhs.granularity.block_sizes(g.shape, lc) if cfg.lhs != IDENTITY else ()
    same = (cfg.lhs, blocks, real)
    if not folded and not cfg.needs_key and same in shared:
        gq = shared[same][0]
    else:
        gq, _ = quantize(cfg.lhs, g, lc, _key(key, stream), store=real, scale=gscale)
        if not folded:
            shared[same] = (gq, None)
    return c(gq, oq, cfg)


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


_core.defvjp(_fwd, _bwd)


_jit_core = jax.jit(_core, static_argnums=0)
