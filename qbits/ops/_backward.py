"""The backward matmuls of a quantized matmul, from the output gradient.

Each backward matmul contracts the output gradient ``g``, quantized as its
config's ``lhs`` says, with the forward operand that the forward pass kept
for it (quantized as its ``rhs`` says, the forward's own quantized operand,
or the float operand): a :class:`Gradient`. :func:`backward_matmuls`
computes those that are needed, quantizing ``g`` once for both where they
quantize it alike.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import zero_from_primal

from qbits._tensor import QTensor
from qbits.ops._config import IDENTITY, DotGeneralConfig, MatmulConfig
from qbits.ops._operands import (
    Axes,
    Contraction,
    Grad,
    Operand,
    Reused,
    fits,
    quantize,
    unquantized,
)
from qbits.ops._straight_through import instantiate, straight_through

__all__ = ["Gradient", "backward_matmuls", "backward_specs", "gradient_operands"]

#: ``{"dlhs" | "drhs": (config, contraction, kept operand, key slot)}``.
Specs = dict[str, tuple[MatmulConfig, Contraction, Any, int]]


@dataclasses.dataclass
class Gradient:
    """One gradient matmul: ``g`` against a forward operand, as ``cfg`` says.

    Attributes:
      cfg: The matmul's config.
      contraction: The gradient contraction.
      g: The output gradient, prepared for the contraction
        (:meth:`~qbits.ops._operands.Contraction.prepare`; times the reused
        operand's scale where it was folded in); as it came for a float
        matmul.
      other: The forward operand, quantized for this matmul already (as it
        came for a float matmul).
      operand: ``g`` to quantize, or ``None`` (a float matmul: the
        contraction's :meth:`~qbits.ops._operands.Contraction.direct`).
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
        other: jax.Array | QTensor | Reused,
        slot: int,
        gscale: jax.Array | None,
    ) -> Gradient:
        if cfg.is_identity and not isinstance(other, QTensor | Reused):
            return cls(cfg, c, g, other, None, None)  # call operands: direct
        g = c.prepare(g, "lhs")
        real = cfg.mode == "real"
        folded = False
        if isinstance(other, Reused):
            # One that is not plain (a zero point, NVFP4) is dequantized.
            qt = c.prepare(other.qtensor, "rhs")
            oq = c.reuse(qt) if qt.is_plain else qt
            if oq is None:  # its scale varies along axes this matmul contracts
                g = c.fold(g, qt)
                ones = jnp.ones((1,) * qt.ndim, jnp.float32)
                oq = qt.replace(scale=ones)
                folded = True
        elif isinstance(other, QTensor):
            oq = other  # quantized for this matmul (prepared) already
        else:
            oq = unquantized(c.prepare(other, "rhs"))
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

    def straight_through(self, gq: QTensor | None, grad: Grad | None) -> jax.Array:
        """:meth:`contract` in float, ``g``'s quantization straight-through.

        The same values up to rounding; its derivative is the matmul's
        straight-through derivative (:mod:`qbits.ops._straight_through`).
        """
        if self.operand is None:
            return self.contraction.direct(self.g, self.other)
        a = straight_through(self.g, gq.dequant(), grad)
        b = self.other.dequant()
        dtype = jnp.promote_types(a.dtype, b.dtype)
        return self.contraction.plain(a.astype(dtype), b.astype(dtype))

    def contract(self, gq: QTensor | None) -> jax.Array:
        """The gradient, from ``g`` quantized (``None`` for a float matmul)."""
        if self.operand is None:
            return self.contraction.direct(self.g, self.other)
        return self.contraction(gq, self.other, self.cfg)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def backward_matmuls(
    config: DotGeneralConfig,
    c: Contraction,
    needed: tuple[str, ...],
    g: jax.Array,
    rhs_b: Any,
    lhs_b: Any,
    key: jax.Array | None,
    gscale: jax.Array | None,
    data: Any = None,
) -> tuple[dict[str, jax.Array], dict[str, tuple[QTensor, Grad]]]:
    """The backward matmuls ``needed`` (``"dlhs"``, ``"drhs"``) of ``g``.

    Differentiated (a derivative of a gradient), each is straight-through in
    ``g``: the derivative of :meth:`Gradient.straight_through`.

    Args:
      config: The three matmuls.
      c: The forward contraction.
      needed: The backward matmuls to compute.
      g: The output gradient.
      rhs_b: What the forward pass kept for ``dlhs`` (from the rhs).
      lhs_b: What the forward pass kept for ``drhs`` (from the lhs).
      key: The call's key (stochastic rounding), or ``None``.
      gscale: The output gradient's given scale, or ``None``.
      data: The call's data, bound to ``c`` (:meth:`Contraction.bind`).

    Returns:
      Each needed matmul's output, laid out like its forward operand; and
      for each that quantizes ``g``, ``g`` quantized (``(QTensor, grad)``).
    """
    c = c.bind(data)
    each = backward_specs(config, c, rhs_b, lhs_b)
    matmuls = _gradients(each, needed, g, gscale)
    # The output gradient quantized once for both backward matmuls when they
    # quantize it alike (same quantizer, same blocks, no noise). A matmul
    # nobody needs keeps its place in the scale kernel (a placeholder) unless
    # the other one's quantization stands for it, so that the kernels are
    # those of a call that needs both.
    operands: dict[str, Operand] = {}
    same: dict[Any, str] = {}
    for name, (cfg, cg, _, slot) in each.items():
        if name not in needed:
            lc = cg.contracting[0]
            if cfg.lhs == IDENTITY:
                continue
            gp = jax.eval_shape(lambda g, cg=cg: cg.prepare(g, "lhs"), g)
            if not fits(cfg.lhs, gp, lc):
                continue
            shareable = Gradient.shareable_of(cfg, gp.shape, lc)
            if shareable is None or all(
                m.shareable != shareable for m in matmuls.values()
            ):
                spec = jax.ShapeDtypeStruct(gp.shape, gp.dtype)
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
    quantized = {
        name: done[m.uses or name]
        for name, m in matmuls.items()
        if m.operand is not None
    }
    return grads, quantized


def gradient_operands(
    specs: Specs, needed: tuple[str, ...], g: jax.Array, gscale: jax.Array | None
) -> dict[str, Operand]:
    """The output gradient as each needed backward matmul quantizes it.

    What :func:`backward_matmuls` quantizes (prepared, with a reused
    operand's scale folded in), for the matmuls that quantize ``g``: the
    diagnostics measure it (:mod:`qbits.ops._diagnose`). ``specs``: the
    call's :func:`backward_specs`.
    """
    return {
        name: m.operand
        for name, m in _gradients(specs, needed, g, gscale).items()
        if m.operand is not None and specs[name][0].lhs != IDENTITY
    }


def backward_specs(
    config: DotGeneralConfig, c: Contraction, rhs_b: Any, lhs_b: Any
) -> Specs:
    """Each backward matmul's config, contraction, kept operand and key slot.

    ``c``: the forward contraction, bound to the call's data.
    """
    return {
        "dlhs": (config.dlhs, c.gradient("lhs"), rhs_b, 2),
        "drhs": (config.drhs, c.gradient("rhs"), lhs_b, 4),
    }


def _gradients(
    specs: Specs,
    needed: tuple[str, ...],
    g: jax.Array,
    gscale: jax.Array | None,
) -> dict[str, Gradient]:
    """The ``needed`` backward matmuls of ``g`` (in ``specs``' order)."""
    return {
        name: Gradient.create(cfg, cg, g, other, slot, gscale)
        for name, (cfg, cg, other, slot) in specs.items()
        if name in needed
    }


def _backward_matmuls_jvp(
    config: DotGeneralConfig,
    c: Contraction,
    needed: tuple[str, ...],
    primals: tuple[Any, ...],
    tangents: tuple[Any, ...],
) -> tuple[Any, Any]:
    g, rhs_b, lhs_b, _, gscale, data = primals
    grads, quantized = backward_matmuls(config, c, needed, *primals)

    def emulated(g: jax.Array, rhs_b: Any, lhs_b: Any) -> dict[str, jax.Array]:
        each = backward_specs(config, c.bind(data), rhs_b, lhs_b)
        return {
            name: m.straight_through(*quantized.get(name, (None, None))).astype(
                grads[name].dtype
            )
            for name, m in _gradients(each, needed, g, gscale).items()
        }

    args = (g, rhs_b, lhs_b)
    _, t_grads = jax.jvp(emulated, args, instantiate(tangents[:3], args))
    return (grads, quantized), (t_grads, zero_from_primal(quantized, True))


backward_matmuls.defjvp(_backward_matmuls_jvp, symbolic_zeros=True)
