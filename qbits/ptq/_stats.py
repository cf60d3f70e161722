"""Streaming statistics of a weight matmul's input over calibration rows.

Post-training quantization (GPTQ, AWQ, SmoothQuant) needs, per weight
matmul, second-order and per-channel statistics of the activation that
multiplies the weight, over calibration data: the Hessian of the layer's
squared output error ``sum x x^T``, the largest and the mean magnitude of
each input channel. :class:`InputStats` holds them over the weight's
contraction channels ``K``, updated one batch of rows at a time: its memory
is one ``K x K`` matrix per layer, whatever the number of rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from qbits._errors import InvalidArgumentError
from qbits._sharding import spec_entries

__all__ = ["InputStats"]

_OWNER = "qbits.ptq.InputStats"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InputStats:
    r"""Statistics of one weight matmul's activation, over its rows.

    The activation is seen as rows ``x`` of ``K`` values, ``K`` the weight's
    contraction channels (a dense layer's inputs; every token of every
    sequence is a row). All fields are float32 and share leading axes (none
    for one matmul; one per layer for a scan over stacked layers, one per
    group for a weight with batch axes): ``stats.rows.shape``.

    .. math::

       H = \sum_{\text{rows}} x x^\top, \quad
       \text{absmax}_k = \max |x_k|, \quad
       \text{abssum}_k = \sum |x_k|

    A :class:`~qbits.ptq.Method` gets them for one ``(K, N)`` matrix (no
    leading axes), after the driver's transforms (``smooth``, ``rotate``:
    the statistics of the transformed activation; ``absmax`` and ``abssum``
    NaN after a rotation, which does not keep them).

    Attributes:
      hessian: ``(..., K, K)``: ``sum x x^T`` (``X^T X`` for rows ``X``).
      absmax: ``(..., K)``: the largest ``|x_k|``.
      abssum: ``(..., K)``: the sum of ``|x_k|``.
      rows: ``(...)``: the number of rows (float32: exact below ``2**24``).
      quantized_hessian: For a :attr:`~qbits.ptq.Method.propagated`
        method: ``X_hat^T X_hat``, ``X_hat`` the activation as the model
        computes it with the weights quantized so far (same rows); else
        ``None``.
      cross: For a propagated method: ``X_hat^T X``; else ``None``.

    Example:
      >>> x = jnp.array([[1.0, -2.0], [3.0, 0.0]])
      >>> stats = qbits.ptq.InputStats.zeros(2).update(x)
      >>> stats.hessian.tolist(), stats.absmax.tolist(), stats.absmean.tolist()
      ([[10.0, -2.0], [-2.0, 4.0]], [3.0, 2.0], [2.0, 1.0])
    """

    hessian: jax.Array
    absmax: jax.Array
    abssum: jax.Array
    rows: jax.Array
    quantized_hessian: jax.Array | None = None
    cross: jax.Array | None = None

    @classmethod
    def zeros(cls, k: int) -> InputStats:
        """The statistics of no rows over ``k`` channels (merging's identity).

        Args:
          k: The number of contraction channels.

        Returns:
          Zeros: ``hessian`` ``(k, k)``, ``absmax`` and ``abssum`` ``(k,)``,
          ``rows`` ``()``.

        Raises:
          InvalidArgumentError: Unless ``k`` is a positive int.

        Example:
          >>> qbits.ptq.InputStats.zeros(3).hessian.shape
          (3, 3)
        """
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidArgumentError(_OWNER + ".zeros", "k", k, "a positive int")
        z = jnp.zeros((k,), jnp.float32)
        return cls(jnp.zeros((k, k), jnp.float32), z, z, jnp.zeros((), jnp.float32))

    @classmethod
    def of(cls, x: jax.Array) -> InputStats:
        """The statistics of the rows ``x``: ``(..., rows, K)``.

        Args:
          x: Rows of ``K`` floats; leading axes give stats of the same axes.

        Returns:
          Their statistics, computed in float32 (the Hessian at full
          precision, also on GPU and TPU).

        Raises:
          InvalidArgumentError: For fewer than two axes or a non-float ``x``.

        Example:
          >>> qbits.ptq.InputStats.of(jnp.ones((2, 5, 3))).rows.tolist()
          [5.0, 5.0]
        """
        shape = jnp.shape(x)
        if len(shape) < 2 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise InvalidArgumentError(
                _OWNER, "x", f"{jnp.result_type(x)}{list(shape)}",
                "float rows of shape (..., rows, K)",
            )  # fmt: skip
        x = jnp.asarray(x, jnp.float32)
        hessian = jnp.einsum(
            "...rk,...rl->...kl", x, x, precision=lax.Precision.HIGHEST,
            out_sharding=_summed_over_rows(x),
        )  # fmt: skip
        a = jnp.abs(x)
        rows = jnp.full(shape[:-2], shape[-2], jnp.float32)
        absmax = jnp.max(a, axis=-2, initial=0.0)
        return cls(hessian, absmax, jnp.sum(a, axis=-2), rows)

    def update(self, x: jax.Array) -> InputStats:
        """These statistics with the rows ``x`` (``(..., rows, K)``) added.

        Args:
          x: More rows, with the same ``K`` (and leading axes).

        Returns:
          The statistics of all rows.

        Raises:
          InvalidArgumentError: For rows of another shape.

        Example:
          >>> x = jnp.arange(6.0).reshape(3, 2)
          >>> s = qbits.ptq.InputStats.zeros(2).update(x[:1]).update(x[1:])
          >>> bool((s.hessian == x.T @ x).all()), s.rows.tolist()
          (True, 3.0)
        """
        return self.merge(InputStats.of(x))

    def merge(self, other: InputStats) -> InputStats:
        """The statistics of the rows of both (as if seen in one batch).

        Args:
          other: Statistics of the same matmul (same shapes).

        Returns:
          The combined statistics.

        Raises:
          InvalidArgumentError: For statistics of another shape.

        Example:
          >>> a = qbits.ptq.InputStats.of(jnp.ones((2, 3)))
          >>> a.merge(a).rows.tolist()
          4.0
        """
        if not isinstance(other, InputStats) or _shapes(other) != _shapes(self):
            raise InvalidArgumentError(
                _OWNER + ".merge",
                "other",
                _describe(other),
                f"InputStats of the same shapes as these ({_describe(self)})",
            )
        return InputStats(
            self.hessian + other.hessian,
            jnp.maximum(self.absmax, other.absmax),
            self.abssum + other.abssum,
            self.rows + other.rows,
        )

    def merge_leading(self) -> InputStats:
        """The statistics stacked along the leading axis, merged into one.

        Returns:
          Statistics with one leading axis less (e.g. the loop steps or the
          groups of rows they were collected over, combined).

        Raises:
          InvalidArgumentError: For statistics without leading axes.

        Example:
          >>> s = qbits.ptq.InputStats.of(jnp.ones((4, 2, 3)))
          >>> s.merge_leading().rows.tolist()
          8.0
        """
        if not jnp.ndim(self.rows):
            raise InvalidArgumentError(
                _OWNER + ".merge_leading",
                "self",
                _describe(self),
                "statistics with a leading axis to merge",
            )
        return InputStats(
            jnp.sum(self.hessian, axis=0),
            jnp.max(self.absmax, axis=0),
            jnp.sum(self.abssum, axis=0),
            jnp.sum(self.rows, axis=0),
        )

    @property
    def absmean(self) -> jax.Array:
        """``(..., K)``: the mean ``|x_k|`` (zero for no rows)."""
        return self.abssum / jnp.maximum(self.rows, 1.0)[..., None]

    @property
    def mean_hessian(self) -> jax.Array:
        """``(..., K, K)``: ``sum x x^T / rows`` (zero for no rows)."""
        return self.hessian / jnp.maximum(self.rows, 1.0)[..., None, None]


def _shapes(stats: InputStats) -> tuple[tuple[int, ...], ...]:
    return tuple(jnp.shape(a) for a in (stats.hessian, stats.absmax,
                                        stats.abssum, stats.rows))  # fmt: skip


def _describe(stats: Any) -> str:
    if not isinstance(stats, InputStats):
        return type(stats).__name__
    return f"hessian {list(jnp.shape(stats.hessian))}"


def _summed_over_rows(x: jax.Array) -> Any:
    """The Hessian's sharding where explicit mesh axes shard the rows or ``K``.

    (JAX then asks for one: the rows are summed over, and ``K`` would be
    sharded twice over one mesh axis. Leading axes keep theirs, ``K x K``
    replicated.) ``None`` otherwise.
    """
    entries = spec_entries(x)
    if entries is None or entries[-2:] == (None, None):
        return None
    return P(*entries[:-2], None, None)
