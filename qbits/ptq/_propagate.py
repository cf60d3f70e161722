r"""Statistics of the activations the partly quantized model computes.

A :attr:`~qbits.ptq.Method.propagated` method (QEP) quantizes a weight for
the input the quantized model gives it, ``X_hat`` (the weights before it
already quantized), rather than the float model's ``X``: it needs
``X_hat^T X_hat`` and ``X_hat^T X`` over the same calibration rows. One
run gives both: ``fn`` is mapped (``jax.vmap``) over a pair of parameter
trees, the float ones and the current ones, and two copies of each batch,
so that every weight matmul multiplies a pair of activations by a pair of
weights; the engine's observing run (:func:`qbits.transform.observe_matmuls`)
hands each matmul's rows with the pair axis first (it is the first batch
axis of the weight operand), and :class:`PairStats` reduces them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from qbits import transform
from qbits._errors import InvalidArgumentError
from qbits.transform import ObservedMatmul, Observer
from qbits.transform import _Caller as Caller

__all__ = ["PairStats", "propagated_stats"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PairStats:
    """``X_hat^T X_hat`` and ``X_hat^T X`` of one matmul (leading axes as InputStats).

    Attributes:
      quantized_hessian: ``(..., K, K)``: ``sum x_hat x_hat^T`` over the rows.
      cross: ``(..., K, K)``: ``sum x_hat x^T`` (row ``k``: channel ``k`` of
        ``x_hat``).
    """

    quantized_hessian: jax.Array
    cross: jax.Array

    def merge(self, other: PairStats) -> PairStats:
        """The statistics of the rows of both."""
        return PairStats(
            self.quantized_hessian + other.quantized_hessian, self.cross + other.cross
        )

    def merge_leading(self) -> PairStats:
        """The statistics stacked along the leading axis, merged."""
        return PairStats(
            jnp.sum(self.quantized_hessian, axis=0), jnp.sum(self.cross, axis=0)
        )


def _pair(matmul: ObservedMatmul, rows: jax.Array) -> PairStats:
    """``rows``: ``(2, *groups, rows, K)``, the float activation first."""
    x, x_hat = rows[0].astype(jnp.float32), rows[1].astype(jnp.float32)

    def gram(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.einsum("...rk,...rl->...kl", a, b, precision=lax.Precision.HIGHEST)

    return PairStats(gram(x_hat, x_hat), gram(x_hat, x))


_OBSERVER = Observer(_pair, PairStats.merge, PairStats.merge_leading, per_layer=True)


def propagated_stats(
    owner: str,
    fn: Any,
    float_params: Any,
    params: Any,
    batches: Iterable[Any],
    wanted: Sequence[tuple[str, tuple[int, ...]]],
) -> PairStats:
    """The :class:`PairStats` of some matmuls of ``fn``, merged over them.

    Args:
      owner: Named in errors.
      fn: ``fn(params, batch)``.
      float_params: Its float parameters (``X``).
      params: The same tree with some weights quantized (``X_hat``).
      batches: The calibration batches (iterated once).
      wanted: ``(matmul path, leading shape of its statistics)`` of the
        matmuls to merge (the uses of one weight).

    Returns:
      Their statistics, summed over the uses.

    Raises:
      InvalidArgumentError: For a matmul the paired run does not observe
        as the float run does (its weight rearranged by ``vmap``).
    """
    pair = jax.tree.map(
        lambda f, q: jnp.stack([f, jnp.asarray(q, jnp.result_type(f))]),
        float_params,
        params,
    )
    twice = (jax.tree.map(lambda b: jnp.stack([b, b]), batch) for batch in batches)
    caller = Caller(owner)
    _, records = transform._observe_matmuls(
        caller, jax.vmap(fn), pair, twice, _OBSERVER
    )
    total = None
    for path, lead in wanted:
        got = records.get(path)
        shape = None if got is None else got.cross.shape[:-2]
        if shape != lead:
            raise InvalidArgumentError(
                owner, "method", "a method that needs propagated statistics",
                "a method without them (Gptq(), Rtn()) for this model",
                why=f"the run of fn mapped over the float and the quantized "
                f"parameters observes {path!r} "
                + ("not at all" if got is None else f"with leading axes {shape}")
                + f", the float run with {lead}",
            )  # fmt: skip
        total = got if total is None else total.merge(got)
    return total
