"""The operands of one quantized matmul call, quantized together.

A call of a quantized matmul (:mod:`qbits.ops._core`) quantizes up to six
operands (:data:`SLOTS`): both operands of the forward matmul, and for each
backward matmul the output gradient and the forward operand it keeps. Each
is an :class:`Operand`; :func:`quantize` quantizes those of one pass.

Passes:
  The tensors a pass quantizes (four in the forward, the output gradient
  for each backward matmul) are quantized together
  (:func:`qbits._quantizer.quantize_all`): their scale arithmetic compiles
  to one small kernel per pass. XLA:CPU's compile time grows with every
  kernel instance and every instruction; a deep model pays it per layer.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qbits._calibration import AbsMax
from qbits._context import Context
from qbits._errors import InvalidArgumentError
from qbits._granularity import BlockLayout
from qbits._jaxpr import varying
from qbits._providers import ScaleProvider
from qbits._quantizer import Quantizer, Request, quantize_all
from qbits._tensor import QTensor
from qbits.numerics import _derive_key as derive_key
from qbits.ops._config import MatmulConfig

__all__ = [
    "SLOTS",
    "TENSORS",
    "Contraction",
    "Grad",
    "Operand",
    "Reused",
    "block_amax",
    "fits",
    "provider",
    "quantize",
    "unquantized",
    "varying",
]

Axes = tuple[int, ...]
Grad = jax.tree_util.Partial

#: The tensors a quantized matmul quantizes: its operands and the output
#: gradient.
TENSORS: tuple[str, ...] = ("lhs", "rhs", "grad")

#: The six quantized operands: ``(matmul, side, tensor, key stream)``. A
#: stochastic-rounding key for operand ``i`` is
#: ``derive_key(next_key(key), i)`` (inside
#: ``shard_map``, with the shard's index folded in: see ``_key``).
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
    return quantizer.provider


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

    def bind(self, data: Any) -> Contraction:
        """This contraction with the call's ``data`` (see :func:`~._core.apply`).

        Arrays a contraction needs besides its operands and cannot hold as a
        static argument (``ragged_dot``'s group sizes); the core binds them
        where it traces the contraction. Without data: ``self``.
        """
        return self

    def prepare(self, x: Any, side: str) -> Any:
        """The tensor this contraction quantizes and contracts as ``side``.

        From the call's own tensor (an array, or a QTensor that a backward
        matmul reuses): itself, unless the contraction works on another form
        of it (``ragged_dot``'s weight gradient: per group). :meth:`plain`
        and :meth:`__call__` take prepared operands.
        """
        return x

    def direct(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """The unquantized operation on the call's own operands.

        :meth:`plain` of the prepared operands, unless the contraction has a
        way of its own (what JAX itself computes for them).
        """
        return self.plain(self.prepare(lhs, "lhs"), self.prepare(rhs, "rhs"))

    def reuse(self, rhs: QTensor) -> QTensor | None:
        """A forward operand reused as this contraction's rhs.

        Returns it when its scale factors out of this contraction, else
        ``None`` (the scale is then folded into the lhs: :meth:`fold`).
        """
        return rhs

    def fold(self, lhs: jax.Array, rhs: QTensor) -> jax.Array:
        """``lhs`` times ``rhs``'s scale, laid out along ``lhs``'s axes."""
        raise NotImplementedError


def _key(key: jax.Array | None, slot: int, x: Any) -> jax.Array | None:
    """The key of operand ``SLOTS[slot]``, the tensor ``x``.

    Inside ``shard_map``, where ``x`` differs per shard and the key does
    not, the shard's index along those mesh axes is folded in: each shard
    draws its own noise, so the rounding errors that a ``psum`` adds up
    are independent rather than copies of one another. A tensor that is
    the same on every shard (a replicated weight) is rounded alike on all.
    """
    if key is None:
        return None
    k = derive_key(key, slot)
    if isinstance(x, jax.ShapeDtypeStruct):  # a placeholder draws nothing
        return k
    for axis in sorted(varying(x) - varying(k), key=str):
        k = derive_key(k, lax.axis_index(axis))
    return k


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
            Context(_key(key, o.slot, o.x)),
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
    # In the tensor's own dtype (exact for a max of magnitudes), widened after:
    # no float32 copy of the tensor.
    xb = x.reshape(layout.blocked_shape)
    bound = AbsMax().bound(xb, layout.reduce_axes).astype(jnp.float32)
    return bound.reshape(layout.scale_shape)


def unquantized(x: jax.Array) -> QTensor:
    return QTensor(x, jnp.ones((1,) * x.ndim, jnp.float32), dtype=x.dtype)


@dataclasses.dataclass(frozen=True)
class Reused:
    """A forward operand that a backward matmul reuses (``use_fwd_quant``)."""

    qtensor: QTensor


jax.tree_util.register_dataclass(Reused, data_fields=["qtensor"], meta_fields=[])


def fits(quantizer: Quantizer, x: jax.Array, axes: Axes) -> bool:
    """Whether ``quantizer``'s blocks fit ``x`` (a matmul nobody needs may not)."""
    try:
        quantizer.granularity.block_sizes(x.shape, axes)
    except InvalidArgumentError:
        return False
    return True
