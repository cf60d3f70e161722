"""Quantized two-operand einsum, built on :func:`qbits.dot_general`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from qbits._errors import InvalidArgumentError
from qbits.ops import _state as state_lib
from qbits.ops._config import DotGeneralConfig, check_config
from qbits.ops._dot_general import DotGeneral
from qbits.ops._op import Op

__all__ = ["Einsum", "einsum"]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a two-operand einsum maps onto one dot_general."""

    lhs_sum: tuple[int, ...]  # axes summed out of the lhs first
    rhs_sum: tuple[int, ...]
    lhs_broadcast: tuple[int, ...] | None  # shape to broadcast to, or None
    rhs_broadcast: tuple[int, ...] | None
    dimension_numbers: Any
    perm: tuple[int, ...]  # dot_general output -> einsum output


def _labels(term: str, ndim: int, n_ellipsis: int, subscripts: str) -> list[str]:
    """Operand labels with ``...`` expanded into placeholder labels."""
    if term.count("...") > 1 or "." in term.replace("...", ""):
        raise _bad(subscripts, f"malformed term {term!r}")
    explicit = term.replace("...", "")
    for ch in explicit:
        if not ch.isalpha():
            raise _bad(subscripts, f"{ch!r} is not a letter")
    if "..." not in term:
        if len(explicit) != ndim:
            raise _bad(
                subscripts,
                f"{term!r} has {len(explicit)} labels for an operand of rank {ndim}",
            )
        return list(explicit)
    k = ndim - len(explicit)
    if k < 0:
        raise _bad(
            subscripts, f"{term!r} has more labels than the operand's rank {ndim}"
        )
    # Ellipsis axes are aligned from the right, like numpy broadcasting.
    dots = [chr(0x100 + n_ellipsis - k + i) for i in range(k)]
    head, tail = term.split("...")
    return list(head) + dots + list(tail)


def _bad(subscripts: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        "einsum",
        "subscripts",
        subscripts,
        "a two-operand einsum such as 'bsd,dh->bsh' (letters, one optional "
        "'...' per term, no repeated label within a term)",
        why=why,
    )


def _plan(
    subscripts: str, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]
) -> _Plan:
    spec = subscripts.replace(" ", "")
    inputs, arrow, output = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        raise _bad(subscripts, f"{len(terms)} operands")
    n_ell = max(
        (
            len(s) - len(t.replace("...", ""))
            for t, s in zip(terms, (lhs_shape, rhs_shape), strict=True)
            if "..." in t
        ),
        default=0,
    )
    lhs = _labels(terms[0], len(lhs_shape), n_ell, subscripts)
    rhs = _labels(terms[1], len(rhs_shape), n_ell, subscripts)
    for labels, term in ((lhs, terms[0]), (rhs, terms[1])):
        if len(set(labels)) != len(labels):
            raise _bad(subscripts, f"a label repeats within {term!r} (a diagonal)")
    ellipsis = [chr(0x100 + i) for i in range(n_ell)]
    if arrow:
        if "..." not in output and any(d in lhs + rhs for d in ellipsis):
            raise _bad(subscripts, "the output drops the '...' axes")
        if output.count("...") > 1:
            raise _bad(subscripts, f"malformed output {output!r}")
        head, _, tail = output.partition("...")
        out = list(head) + (ellipsis if "..." in output else []) + list(tail)
        for ch in head + tail:
            if ch not in lhs + rhs:
                raise _bad(subscripts, f"output label {ch!r} is in no operand")
        if len(set(out)) != len(out):
            raise _bad(subscripts, "a label repeats in the output")
    else:  # numpy's implicit output: ellipsis, then labels seen once, sorted
        counts = {ch: (lhs + rhs).count(ch) for ch in lhs + rhs}
        out = ellipsis + sorted(
            ch for ch, n in counts.items() if n == 1 and ch not in ellipsis
        )

    sizes: dict[str, int] = {}
    for labels, shape in ((lhs, lhs_shape), (rhs, rhs_shape)):
        for ch, n in zip(labels, shape, strict=True):
            if ch in sizes and sizes[ch] != n and 1 not in (sizes[ch], n):
                raise InvalidArgumentError(
                    "einsum",
                    "operands",
                    f"shapes {lhs_shape} and {rhs_shape}",
                    f"equal sizes for label {ch!r} in both operands",
                    why=f"sizes {sizes[ch]} and {n}",
                )
            if ch not in sizes or sizes[ch] == 1:
                sizes[ch] = n

    def broadcast(labels: list[str], shape: tuple[int, ...]) -> tuple[int, ...] | None:
        target = tuple(sizes[ch] for ch in labels)
        return target if target != tuple(shape) else None

    # Labels only one operand has and the output lacks are summed out first.
    lhs_sum = tuple(i for i, ch in enumerate(lhs) if ch not in rhs and ch not in out)
    rhs_sum = tuple(i for i, ch in enumerate(rhs) if ch not in lhs and ch not in out)
    lhs_kept = [ch for i, ch in enumerate(lhs) if i not in lhs_sum]
    rhs_kept = [ch for i, ch in enumerate(rhs) if i not in rhs_sum]
    lhs_b = broadcast(lhs, lhs_shape)
    rhs_b = broadcast(rhs, rhs_shape)
    shared = [ch for ch in lhs_kept if ch in rhs_kept]
    batch = [ch for ch in shared if ch in out]
    contract = [ch for ch in shared if ch not in out]
    dims = (
        (
            tuple(lhs_kept.index(c) for c in contract),
            tuple(rhs_kept.index(c) for c in contract),
        ),
        (
            tuple(lhs_kept.index(c) for c in batch),
            tuple(rhs_kept.index(c) for c in batch),
        ),
    )
    dot_out = (
        batch
        + [ch for ch in lhs_kept if ch not in shared]
        + [ch for ch in rhs_kept if ch not in shared]
    )
    perm = tuple(dot_out.index(ch) for ch in out)
    return _Plan(lhs_sum, rhs_sum, lhs_b, rhs_b, dims, perm)


def _permute_sharding(sharding: Any, perm: tuple[int, ...]) -> Any:
    """The sharding of the dot's output, given the einsum output's."""
    inverse = np.argsort(perm)
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, _permute_sharding(sharding.spec, perm))
    if isinstance(sharding, PartitionSpec):
        spec = tuple(sharding) + (None,) * (len(perm) - len(sharding))
        return PartitionSpec(*(spec[i] for i in inverse))
    return sharding


@dataclasses.dataclass(frozen=True, eq=False)
class Einsum(Op):
    """A quantized two-operand ``jnp.einsum``; made by :func:`einsum`.

    It holds its ``config`` and ``key``, as :class:`DotGeneral`, whose
    quantized ``dot_general`` does the contraction.

    Example:
      >>> import flax.nnx as nnx
      >>> op = qbits.einsum(qbits.DotGeneralConfig())
      >>> layer = nnx.Einsum("bd,dh->bh", (8, 4), einsum_op=op, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 8))).shape
      (2, 4)
    """

    @property
    def dot_general(self) -> DotGeneral:
        """The quantized dot_general that does the contraction."""
        return DotGeneral(self.config, self.key)

    def __call__(
        self,
        subscripts: str,
        lhs: jax.typing.ArrayLike,
        rhs: jax.typing.ArrayLike,
        *,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
        state: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        """Computes ``jnp.einsum(subscripts, lhs, rhs)`` with quantized matmuls.

        ScaledArray operands give a ScaledArray result (:mod:`qbits.scaled`).
        ``state`` holds the scale state of the config's providers
        (:meth:`init_state`).
        """
        if not isinstance(subscripts, str):
            raise InvalidArgumentError(
                "einsum", "subscripts", subscripts, "a string such as 'bd,dh->bh'"
            )
        options = {
            "precision": precision,
            "preferred_element_type": preferred_element_type,
        }

        def plain(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
            _plan(subscripts, lhs.shape, rhs.shape)  # qbits' errors
            # jnp.einsum's own numbers
            return jnp.einsum(
                subscripts, lhs, rhs, **options, out_sharding=out_sharding
            )

        def quantized(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
            plan = _plan(subscripts, lhs.shape, rhs.shape)
            lhs, rhs = _prepared(plan, lhs, rhs)
            identity = plan.perm == tuple(range(len(plan.perm)))
            extra = {} if state is None else {"state": state}
            out = self.dot_general(
                lhs,
                rhs,
                plan.dimension_numbers,
                out_sharding=out_sharding
                if identity
                else _permute_sharding(out_sharding, plan.perm),
                **options,
                **extra,
            )
            return out if identity else jnp.transpose(out, plan.perm)

        return self._apply(lhs, rhs, plain, quantized, state, None)

    def init_state(self, subscripts: str, lhs: Any, rhs: Any) -> dict[str, jax.Array]:
        """The initial scale state for these operands (see :mod:`qbits.ops._state`).

        Example:
          >>> op = qbits.einsum(qbits.presets.get("fp8_delayed"))
          >>> state = op.init_state("btd,dh->bth", jnp.ones((2, 3, 4)),
          ...                       jnp.ones((4, 5)))
          >>> state["lhs_scale"]
          Array([1.], dtype=float32)
        """
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        plan = _plan(subscripts, lhs.shape, rhs.shape)
        lhs, rhs = _prepared(plan, lhs, rhs)
        return self.dot_general.init_state(lhs, rhs, plan.dimension_numbers)


def _prepared(plan: _Plan, lhs: jax.Array, rhs: jax.Array) -> tuple[Any, Any]:
    """The operands of the plan's one dot_general: broadcast and summed."""
    if plan.lhs_broadcast is not None:
        lhs = jnp.broadcast_to(lhs, plan.lhs_broadcast)
    if plan.rhs_broadcast is not None:
        rhs = jnp.broadcast_to(rhs, plan.rhs_broadcast)
    if plan.lhs_sum:
        lhs = jnp.sum(lhs, axis=plan.lhs_sum)
    if plan.rhs_sum:
        rhs = jnp.sum(rhs, axis=plan.rhs_sum)
    return lhs, rhs


def einsum(config: DotGeneralConfig, key: jax.Array | None = None) -> Einsum:
    """A quantized drop-in for two-operand ``jnp.einsum``.

    Usable as ``nnx.Einsum(einsum_op=...)`` and wherever ``jnp.einsum(
    subscripts, lhs, rhs)`` is called; ``...``, implicit outputs and labels
    summed out of one operand are supported. The contraction runs as one
    :func:`qbits.dot_general`, whose config's ``lhs`` and ``rhs`` always mean
    the operands in the order given here (``jnp.einsum`` may exchange them
    when it calls a ``_dot_general``).

    Args:
      config: The forward matmul and the two gradient matmuls: a
        :class:`~qbits.DotGeneralConfig`, a preset name (``"int8"``) or the
        path of a YAML file holding one config (as
        :func:`qbits.load_config` reads it).
      key: A PRNG key, required when the config rounds stochastically.

    Returns:
      An :class:`Einsum`.

    Raises:
      InvalidArgumentError: For a config that needs a key and has none, or
        a ``key`` that is not one PRNG key (typed, or 2 or 4 uint32 words);
        the call raises for subscripts that are not a two-operand einsum.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> int8 = qbits.Quantizer(qbits.IntNumerics(bits=8),
      ...                        granularity=qbits.PerChannel())
      >>> mm = qbits.MatmulConfig(lhs=int8, rhs=int8)
      >>> op = qbits.einsum(qbits.DotGeneralConfig(fwd=mm, dlhs=mm, drhs=mm))
      >>> q = jax.random.normal(jax.random.key(0), (2, 5, 4, 8))  # b t h d
      >>> k = jax.random.normal(jax.random.key(1), (2, 7, 4, 8))  # b s h d
      >>> op("bthd,bshd->bhts", q, k).shape
      (2, 4, 5, 7)
    """
    config, key = check_config("einsum", config, key)
    state_lib.check_providers(config, "einsum")
    return Einsum(config, key)
