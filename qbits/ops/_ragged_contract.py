"""A ragged dot's three matmuls as contractions of the quantized-matmul core.

:class:`RaggedContraction` is the forward and the lhs gradient (ragged dots,
``lax.ragged_dot_general``); :class:`RaggedWeightGrad` the rhs gradient,
per group on operands expanded per group (see :mod:`qbits.ops._ragged`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._tensor import QTensor
from qbits.ops import _core as core
from qbits.ops._config import MatmulConfig
from qbits.ops._dims import Axes
from qbits.ops._dot_general import DotContraction
from qbits.ops._headroom import int32_holds
from qbits.ops._matmul import _per_index_free, codes_precision
from qbits.ops._operands import unquantized
from qbits.ops._ragged_dims import RaggedDims, expand, group_ids, group_mask
from qbits.ops._rescale import common_dtypes, dot_operand, permute, unless_lost

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
      group_sizes: The call's group sizes, once bound (:meth:`bind`).
    """

    ragged: RaggedDims
    precision: Any = None
    preferred_element_type: Any = None
    out_sharding: Any = None
    out_perm: Axes | None = None
    group_sizes: Any = dataclasses.field(default=None, compare=False)

    def bind(self, data: Any) -> RaggedContraction:
        """This contraction with the call's group sizes."""
        return dataclasses.replace(self, group_sizes=data)

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
    """The rhs gradient of a ragged dot: per group, on expanded operands.

    Its operands are the output gradient and the forward lhs, each expanded
    per group (:meth:`prepare`); it contracts them with ``dense``, a
    ``dot_general`` batched over the groups.

    Attributes:
      dense: The dot of the expanded operands.
      ragged: The forward's dimension numbers.
      precision: As for ``lax.ragged_dot_general``.
      preferred_element_type: As for ``lax.ragged_dot_general``.
      group_sizes: The call's group sizes, once bound.
    """

    dense: DotContraction
    ragged: RaggedDims
    precision: Any = None
    preferred_element_type: Any = None
    group_sizes: Any = dataclasses.field(default=None, compare=False)

    def bind(self, data: Any) -> RaggedWeightGrad:
        """This contraction with the call's group sizes."""
        return dataclasses.replace(self, group_sizes=data)

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
        """The weight gradient from expanded, quantized operands."""
        return self.dense(self._masked(lhs, "lhs"), self._masked(rhs, "rhs"), cfg)

    def direct(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
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

    def gradient(self, side: str) -> core.Contraction:  # pragma: no cover
        """A gradient contraction has no gradients of its own here."""
        raise NotImplementedError("the gradient of a ragged dot's weight gradient")

    def reuse(self, rhs: QTensor) -> QTensor | None:
        """The forward lhs (expanded) when its scale factors out."""
        return self.dense.reuse(rhs)

    def fold(self, lhs: jax.Array, rhs: QTensor) -> jax.Array:
        """The expanded output gradient times the forward lhs's scale."""
        return self.dense.fold(lhs, rhs)
