"""A ragged dot's three matmuls as contractions of the quantized-matmul core.

:class:`RaggedContraction` is the forward and the lhs gradient (ragged dots,
``lax.ragged_dot_general``); :class:`RaggedWeightGrad` the rhs gradient,
each group's sum over its own rows (see :mod:`qbits.ops._ragged`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._platform import per_platform
from qbits._tensor import QTensor
from qbits.ops import _core as core
from qbits.ops._config import MatmulConfig
from qbits.ops._dims import Axes
from qbits.ops._dot_general import DotContraction
from qbits.ops._headroom import int32_holds
from qbits.ops._matmul import _per_index_free, codes_precision, result_dtype
from qbits.ops._operands import unquantized
from qbits.ops._ragged_dims import (
    RaggedDims,
    expand,
    group_ids,
    group_mask,
    ragged_bounds,
)
from qbits.ops._ragged_grad import quantize_rows, straight_through
from qbits.ops._rescale import (
    _TINY,
    _scale_to_output,
    common_dtypes,
    dot_operand,
    is_byte_float,
    permute,
    unless_lost,
)

__all__ = ["RaggedContraction", "RaggedWeightGrad"]


def _unbound() -> InvalidArgumentError:  # pragma: no cover - the core binds
    return InvalidArgumentError(
        "ragged_dot", "group_sizes", None, "the call's group sizes (bind them)"
    )


@dataclasses.dataclass(frozen=True)
class RaggedContraction(core.Contraction):
    """A ragged dot as a contraction of the core: the forward and lhs gradient.

    Attributes:
      ragged: The dimension numbers.
      precision, preferred_element_type, out_sharding: The call's, as
        ``lax.ragged_dot_general`` takes them (``precision`` hashable).
      out_perm: The output is transposed by it (the lhs gradient, laid out
        like the lhs), or ``None``.
      drhs: The weight gradient's config where it quantizes its operands
        itself (:mod:`qbits.ops._ragged_grad`), else ``None``.
      group_sizes: The call's group sizes, once bound (:meth:`bind`).
      key: The call's PRNG key, once bound.
    """

    ragged: RaggedDims
    precision: Any = None
    preferred_element_type: Any = None
    out_sharding: Any = None
    out_perm: Axes | None = None
    group_sizes: Any = dataclasses.field(default=None, compare=False)
    drhs: MatmulConfig | None = None
    key: Any = dataclasses.field(default=None, compare=False)

    def bind(self, data: Any) -> RaggedContraction:
        """This contraction with the call's ``(group sizes, key)``."""
        group_sizes, key = data
        return dataclasses.replace(self, group_sizes=group_sizes, key=key)

    @property
    def contracting(self) -> tuple[Axes, Axes]:
        """The contracting axes of the lhs and the rhs."""
        d = self.ragged.dims
        return d.lhs_contract, d.rhs_contract

    def _dot(self, lhs: jax.Array, rhs: jax.Array, preferred: Any) -> jax.Array:
        if self.group_sizes is None:
            raise _unbound()
        return lax.ragged_dot_general(
            lhs,
            rhs,
            self.group_sizes,
            self.ragged.lax(),
            codes_precision(self.precision, lhs, rhs),
            preferred_element_type=preferred,
            out_sharding=self.out_sharding,
        )

    def plain(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """``lax.ragged_dot_general`` itself (then the output permutation)."""
        return permute(self._dot(lhs, rhs, self.preferred_element_type), self.out_perm)

    def __call__(self, lhs: QTensor, rhs: QTensor, cfg: MatmulConfig) -> jax.Array:
        """The ragged dot of two quantized operands, real or fake as ``cfg`` says.

        Real mode contracts the stored values where both operands are
        quantized plainly (no zero point, codebook or tensor scale) with
        scales shared along the contracting axes; otherwise the dequantized
        values (the same numbers within float32 rounding).
        """
        out_dtype = jax.eval_shape(
            lambda a, b: self._dot(a, b, self.preferred_element_type),
            jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
            jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
        ).dtype
        if cfg.mode == "real" and self._factors(lhs, rhs):
            out = self._real(lhs, rhs, cfg)
        else:
            out = self._dot(lhs.dequant(), rhs.dequant(), self.preferred_element_type)
        return permute(out.astype(out_dtype), self.out_perm)

    def _factors(self, lhs: QTensor, rhs: QTensor) -> bool:
        lc, rc = self.contracting
        return (
            0 not in lhs.shape + rhs.shape
            and lhs.qdtype is not None
            and rhs.qdtype is not None
            and lhs.is_plain
            and rhs.is_plain
            and all(lhs.scale.shape[a] == 1 for a in lc)
            and all(rhs.scale.shape[a] == 1 for a in rc)
        )

    def _real(self, lqt: QTensor, rqt: QTensor, cfg: MatmulConfig) -> jax.Array:
        r, d = self.ragged, self.ragged.dims
        lqt = _per_index_free(lqt, d.lhs_batch + d.lhs_free)
        rqt = _per_index_free(rqt, (*d.rhs_batch, *r.rhs_kept, r.rhs_group))
        a, b, acc = common_dtypes(dot_operand(lqt), dot_operand(rqt), cfg.accumulator)
        k = int(np.prod([lqt.shape[x] for x in d.lhs_contract]))
        if acc == np.dtype(np.int32) and not int32_holds(k, lqt, rqt, cfg):
            a, b, acc = common_dtypes(a, b, np.dtype(np.float32))
        out = self._dot(a, b, acc).astype(jnp.float32)
        nb, nf = len(d.lhs_batch), len(d.lhs_free)
        ls = jnp.transpose(lqt.scale, d.lhs_batch + d.lhs_free + d.lhs_contract)
        ls = ls.reshape(ls.shape[: nb + nf]).astype(jnp.float32)
        left = lax.broadcast_in_dim(ls, out.shape, tuple(range(nb + nf)))
        mapping = {a: i for i, a in enumerate(d.rhs_batch)}
        mapping.update({a: nb + nf + i for i, a in enumerate(r.rhs_kept)})
        right = self._per_group(rqt.scale, mapping, r.out_ragged, out.shape)
        return unless_lost(
            lax.mul(lax.mul(out, left), right),
            out,
            lambda o: lax.mul(o, lax.mul(left, right)),
        )

    def _per_group(
        self,
        scale: jax.Array,
        mapping: dict[int, int],
        ragged: int,
        shape: tuple[int, ...],
    ) -> jax.Array:
        """An rhs scale laid out on an array of ``shape``.

        Rhs axis ``a`` goes to axis ``mapping[a]`` (the others have size 1);
        along ``ragged``, each index takes its group's entry of the scale's
        group axis (0 for an index of no group).
        """
        group = self.ragged.rhs_group
        rest = sorted(mapping, key=mapping.get)
        others = [a for a in range(scale.ndim) if a != group and a not in mapping]
        s = jnp.transpose(scale.astype(jnp.float32), [group, *rest, *others])
        s = s.reshape(s.shape[: 1 + len(rest)])
        targets = [mapping[a] for a in rest]
        if s.shape[0] == 1:  # one scale for every group
            return lax.broadcast_in_dim(s[0], shape, tuple(targets))
        ids = group_ids(self.group_sizes, shape[ragged])
        s = jnp.take(s, ids, axis=0, mode="fill", fill_value=0)
        targets = [ragged, *targets]
        order = [int(i) for i in np.argsort(targets)]
        return lax.broadcast_in_dim(
            jnp.transpose(s, order), shape, tuple(sorted(targets))
        )

    def gradient(self, side: str) -> core.Contraction:
        """The gradient contraction of ``side``, as JAX transposes a ragged dot."""
        if side == "lhs":
            dims, perm = self.ragged.grad_lhs()
            return RaggedContraction(
                dims,
                self.precision,
                self.preferred_element_type,
                None,
                perm,
                self.group_sizes,
            )
        dims, perm = self.ragged.dense().grad_rhs()
        dense = DotContraction(
            dims, self.precision, self.preferred_element_type, None, perm
        )
        return RaggedWeightGrad(
            dense,
            self.ragged,
            self.precision,
            self.preferred_element_type,
            self.group_sizes,
            self.drhs,
            self.key,
        )

    def reuse(self, rhs: QTensor) -> QTensor | None:
        """The forward rhs, when its scale is shared along this dot's contraction."""
        shared = all(rhs.scale.shape[a] == 1 for a in self.contracting[1])
        return rhs if shared else None

    def fold(self, lhs: jax.Array, rhs: QTensor) -> jax.Array:
        """``lhs`` times the rhs scale, each row taking its group's.

        Raises:
          InvalidArgumentError: If the scale varies along the rhs's free axes.
        """
        d = self.ragged.dims
        mapping = dict(zip(d.rhs_batch, d.lhs_batch, strict=True))
        mapping.update(zip(d.rhs_contract, d.lhs_contract, strict=True))
        if any(rhs.scale.shape[a] != 1 for a in self.ragged.rhs_kept):
            raise InvalidArgumentError(
                "ragged_dot",
                "use_fwd_quant",
                True,
                "False for this forward quantization",
                why=f"the forward operand's scale {rhs.scale.shape} varies along "
                "axes that the backward matmul does not contract",
            )
        scale = self._per_group(rhs.scale, mapping, self.ragged.lhs_ragged, lhs.shape)
        return lhs.astype(jnp.float32) * scale


@dataclasses.dataclass(frozen=True)
class RaggedWeightGrad(core.Contraction):
    """The rhs gradient of a ragged dot: each group's sum over its rows.

    Its operands are the output gradient and the forward lhs. Where it
    quantizes them itself (``drhs``; :mod:`qbits.ops._ragged_grad`), the
    core hands them over in float (:meth:`direct`). Otherwise the core
    quantizes them expanded per group (:meth:`prepare`); :meth:`__call__`
    gathers each back into one array and contracts group by group
    (``dense``, a ``dot_general`` batched over the groups, gives the
    layouts and scale order).

    Attributes:
      dense: The dot of the expanded operands.
      ragged: The forward's dimension numbers.
      precision: As for ``lax.ragged_dot_general``.
      preferred_element_type: As for ``lax.ragged_dot_general``.
      group_sizes: The call's group sizes, once bound.
      drhs: Its config where it quantizes its operands itself (in
        :meth:`direct`; the core then sees an identity matmul), or ``None``.
      key: The call's PRNG key, once bound.
    """

    dense: DotContraction
    ragged: RaggedDims
    precision: Any = None
    preferred_element_type: Any = None
    group_sizes: Any = dataclasses.field(default=None, compare=False)
    drhs: MatmulConfig | None = None
    key: Any = dataclasses.field(default=None, compare=False)

    def bind(self, data: Any) -> RaggedWeightGrad:
        """This contraction with the call's ``(group sizes, key)``."""
        group_sizes, key = data
        return dataclasses.replace(self, group_sizes=group_sizes, key=key)

    @property
    def contracting(self) -> tuple[Axes, Axes]:
        """The contracting axes of the expanded operands."""
        return self.dense.contracting

    def _axis(self, side: str) -> int:
        r = self.ragged
        return r.out_ragged if side == "lhs" else r.lhs_ragged

    def prepare(self, x: Any, side: str) -> Any:
        """``x`` expanded per group (a plain QTensor keeps its codes)."""
        if self.group_sizes is None:
            raise _unbound()
        axis, gs = self._axis(side), self.group_sizes
        if not isinstance(x, QTensor):
            return expand(x, gs, axis)
        if not x.is_plain:  # a zero point or codebook: its zero is no code 0
            return unquantized(expand(x.dequant(), gs, axis))
        x = x.unpack()
        return x.replace(
            qvalue=expand(x.qvalue, gs, axis), scale=jnp.expand_dims(x.scale, 0)
        )

    def _masked(self, x: Any, side: str) -> Any:
        """``x`` with other groups' entries zeroed again.

        On a grid without a zero they were quantized to half a step.
        """
        axis = self._axis(side) + 1
        if isinstance(x, QTensor):
            if not x.is_plain:
                return unquantized(self._masked(x.dequant(), side))
            x = x.unpack()
            return x.replace(qvalue=self._masked(x.qvalue, side))
        mask = group_mask(self.group_sizes, x.shape[1:], axis - 1)
        return lax.select(mask, x, lax.full_like(x, 0))

    def plain(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """The batched ``dot_general`` of the expanded operands."""
        return self.dense.plain(self._masked(lhs, "lhs"), self._masked(rhs, "rhs"))

    def __call__(self, lhs: QTensor, rhs: QTensor, cfg: MatmulConfig) -> jax.Array:
        """The weight gradient from quantized operands, group by group.

        Each operand was quantized on its expansion (scales per group); its
        values are gathered back into one array (each index holds its own
        group's value) and contracted group by group (:meth:`_grouped`):
        nothing of size ``groups x operand`` is kept. Integer codes with
        scales that factor out (per group and channel) contract exactly, in
        int32, rescaled in the order of :func:`qbits.dot_general`'s; other
        operands are dequantized first.
        """
        lhs, rhs = self._masked(lhs, "lhs"), self._masked(rhs, "rhs")
        if 0 in lhs.shape + rhs.shape:
            return self.dense(lhs, rhs, cfg)
        out_dtype = result_dtype(lhs, rhs, self.dense.dims, self.preferred_element_type)
        if (
            cfg.mode == "real"
            and self._factors(lhs, 0)
            and self._factors(rhs, 1)
            and is_byte_float(dot_operand(lhs)) == is_byte_float(dot_operand(rhs))
        ):
            lhs, rhs = lhs.unpack(), rhs.unpack()
            rows = [t.replace(qvalue=_collapse(t.qvalue)) for t in (lhs, rhs)]
            out = self._rescaled(rows[0], lhs.scale, rows[1], rhs.scale, cfg)
            return out.astype(out_dtype)
        g, x = (_collapse(t.dequant()) for t in (lhs, rhs))
        dtype = jnp.promote_types(g.dtype, x.dtype)
        pet = self.preferred_element_type
        out = self._grouped(g.astype(dtype), x.astype(dtype), pet)
        return out.astype(out_dtype)

    def _factors(self, qt: QTensor, side: int) -> bool:
        """Integer codes whose scale is per group and per index of a free axis."""
        contracting = self.contracting[side]
        return (
            qt.is_plain
            and qt.qdtype is not None
            and self._codes(qt)
            and all(
                s == 1 or (a not in contracting and s == n)
                for a, (s, n) in enumerate(zip(qt.scale.shape, qt.shape, strict=True))
            )
        )

    def _rescaled(
        self,
        lqt: QTensor,
        lscale: jax.Array,
        rqt: QTensor,
        rscale: jax.Array,
        cfg: MatmulConfig,
    ) -> jax.Array:
        """Each group's sum of code products, times its two scales (float32).

        ``lqt``, ``rqt``: the operands' codes, one array each (not
        expanded); ``lscale``, ``rscale``: their scales per group, laid out
        as on the expansion.
        """
        dims, perm = self.dense.dims, self.dense.out_perm
        a, b, acc = common_dtypes(dot_operand(lqt), dot_operand(rqt), cfg.accumulator)
        rows = lqt.shape[self.ragged.out_ragged]
        if acc == np.dtype(np.int32) and not int32_holds(rows, lqt, rqt, cfg):
            a, b, acc = common_dtypes(a, b, np.dtype(np.float32))
        out = self._grouped(a, b, acc).astype(jnp.float32)
        left, right = (
            permute(
                lax.broadcast_in_dim(
                    _scale_to_output(scale, dims, side),
                    _unpermuted(out.shape, perm),
                    tuple(range(out.ndim)),
                ),
                perm,
            )
            for scale, side in ((lscale, "lhs"), (rscale, "rhs"))
        )
        integer = jnp.issubdtype(a.dtype, jnp.integer)
        if integer and perm is not None and tuple(perm) == dims.swap_perm():
            left, right = right, left  # qbits.dot_general exchanges the operands
        if lscale.size == 1 and rscale.size == 1:  # as real_dot: the product
            a, b = lscale.reshape(()), rscale.reshape(())
            if integer and perm is not None and tuple(perm) == dims.swap_perm():
                a, b = b, a
            both = lax.mul(a, b)
            normal = lax.bitwise_and(lax.is_finite(both), lax.ge(lax.abs(both), _TINY))
            first = lax.select(normal, both, a)
            second = lax.select(normal, np.float32(1), b)
            return lax.mul(lax.mul(out, first), second)
        return unless_lost(
            lax.mul(lax.mul(out, left), right),
            out,
            lambda o: lax.mul(o, lax.mul(left, right)),
        )

    def _grouped(self, lhs: jax.Array, rhs: jax.Array, preferred: Any) -> jax.Array:
        """Each group's sum over its own indices of the ragged axis.

        ``lax.ragged_dot_general`` contracting the ragged axis: a grouped
        matmul on GPU and TPU. JAX computes it on CPU from operands expanded
        per group; there, a loop over the groups contracts each group's
        indices (the others masked), one group's operand at a time.
        """
        dn, perm = self.ragged.grad_rhs_ragged()
        gs = self.group_sizes

        def ragged(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
            return lax.ragged_dot_general(
                rhs, lhs, gs, dn, self.precision, preferred_element_type=preferred
            )

        def loop(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
            axis = self.ragged.lhs_ragged
            starts, ends = ragged_bounds(gs)

            def one(j: jax.Array) -> jax.Array:
                i = lax.broadcasted_iota(jnp.int32, rhs.shape, axis)
                inside = (starts[j] <= i) & (i < ends[j])
                masked = lax.select(inside, rhs, lax.full_like(rhs, 0))
                return lax.dot_general(
                    masked, lhs, dn.dot_dimension_numbers, self.precision,
                    preferred_element_type=preferred,
                )  # fmt: skip

            return lax.map(one, jnp.arange(gs.shape[0]))

        out = per_platform(lhs, rhs, cpu=loop, default=ragged)
        return permute(out, perm)

    def direct(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """The weight gradient of the call's own operands.

        JAX's own (a ragged dot contracting the ragged axis), or, where
        this contraction quantizes its operands itself (``drhs``), that
        quantized (:meth:`_owned`), straight-through when differentiated.
        """
        if self.drhs is None:
            return self._lax(lhs, rhs)
        return straight_through(self._owned, self._lax)(lhs, rhs)

    def _lax(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """JAX's own weight gradient: a ragged dot contracting the ragged axis."""
        dn, perm = self.ragged.grad_rhs_ragged()
        out = lax.ragged_dot_general(
            rhs,
            lhs,
            self.group_sizes,
            dn,
            self.precision,
            preferred_element_type=self.preferred_element_type,
        )
        return permute(out, perm)

    def _owned(self, g: jax.Array, x: jax.Array) -> jax.Array:
        """The weight gradient of ``g`` and ``x``, quantized group by group."""
        cfg, gs, r = self.drhs, self.group_sizes, self.ragged
        lc, rc = (tuple(a - 1 for a in axes) for axes in self.contracting)
        real = cfg.mode == "real"
        gq, gscale = quantize_rows(
            cfg.lhs, g, r.out_ragged, lc, gs, self.key, 4, real
        )  # fmt: skip
        xq, xscale = quantize_rows(
            cfg.rhs, x, r.lhs_ragged, rc, gs, self.key, 5, real
        )  # fmt: skip
        shapes = [
            jax.ShapeDtypeStruct((gs.shape[0], *t.shape), t.dtype) for t in (g, x)
        ]
        out_dtype = result_dtype(*shapes, self.dense.dims, self.preferred_element_type)
        if (
            real
            and gscale is not None
            and xscale is not None
            and all(self._codes(t) for t in (gq, xq))
            and is_byte_float(dot_operand(gq)) == is_byte_float(dot_operand(xq))
        ):
            out = self._rescaled(gq, gscale, xq, xscale, cfg)
            return out.astype(out_dtype)
        a, b = gq.dequant(), xq.dequant()
        dtype = jnp.promote_types(a.dtype, b.dtype)
        pet = self.preferred_element_type
        out = self._grouped(a.astype(dtype), b.astype(dtype), pet)
        return out.astype(out_dtype)

    @staticmethod
    def _codes(qt: QTensor) -> bool:
        """Stored integer or one-byte float codes with a plain scale."""
        if not qt.is_plain or qt.qdtype is None:
            return False
        codes = dot_operand(qt)
        return jnp.issubdtype(codes.dtype, jnp.integer) or is_byte_float(codes)

    def gradient(self, side: str) -> core.Contraction:  # pragma: no cover
        """A gradient contraction has no gradients of its own here."""
        raise NotImplementedError("the gradient of a ragged dot's weight gradient")

    def reuse(self, rhs: QTensor) -> QTensor | None:
        """The forward lhs (expanded) when its scale factors out."""
        return self.dense.reuse(rhs)

    def fold(self, lhs: jax.Array, rhs: QTensor) -> jax.Array:
        """The expanded output gradient times the forward lhs's scale."""
        return self.dense.fold(lhs, rhs)


def _collapse(x: jax.Array) -> jax.Array:
    """An expanded operand (``[g, ...]``, other groups' entries zero) as one.

    Each index is in at most one group: the sum over the groups is exact.
    """
    return jnp.sum(x, axis=0, dtype=x.dtype)


def _unpermuted(shape: tuple[int, ...], perm: Axes | None) -> tuple[int, ...]:
    """The shape that ``permute(., perm)`` turns into ``shape``."""
    if perm is None:
        return shape
    out = [0] * len(shape)
    for i, p in enumerate(perm):
        out[p] = shape[i]
    return tuple(out)
