r"""Activation transforms of the driver: SmoothQuant scales and rotations.

:func:`~qbits.ptq.quantize_weights` may transform each weight matmul
``x @ w`` before quantizing it, without changing the float model:

- SmoothQuant (``smooth=alpha``): ``x @ w == (x / s) @ (s w)`` with the
  per-input-channel scales of :func:`~qbits.ptq.smooth_scales`, from the
  calibration set's ``max |x|``;
- a rotation (``rotate=True``): ``x @ w == (x Q) @ (Q^T w)`` with a
  (randomized) Hadamard matrix ``Q`` (:func:`~qbits.ptq.hadamard`);
- both: ``x @ w == ((x / s) Q) @ (Q^T s w)``.

The weight's half is applied once, offline, and the weight quantized after
it (by RTN, GPTQ or AWQ, on the statistics of the transformed activation:
``H' = T^T H T`` for ``x' = x T``). The activation's half runs online, in
the forward pass, right before the matmul quantizes its input:
:data:`ACTIVATION` is the engine adapter that applies it
(:func:`qbits.transform.adapt`), with each matmul's data
``{"scale": s, "rotation": Q}`` (either or both). It is not folded into
the layer before: a division per input channel, or a ``K x K`` matmul per
row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from qbits.ptq._rotation import hadamard
from qbits.ptq._smoothquant import smooth_scales
from qbits.ptq._stats import InputStats
from qbits.transform import Adapter

__all__ = ["ACTIVATION", "Transform"]


def _before(matmul: Any, rows: jax.Array, data: dict[str, jax.Array]) -> jax.Array:
    """The activation's half: ``rows / s``, then ``@ Q`` (``rows``: ``(*g, M, K)``)."""
    x = rows.astype(jnp.float32)
    if "scale" in data:
        x = x / data["scale"][..., None, :]
    if "rotation" in data:
        x = jnp.matmul(x, data["rotation"], precision=jax.lax.Precision.HIGHEST)
    return x


# The adapter that runs the activations' half of every transform.
ACTIVATION = Adapter(before=_before)


class Transform:
    """One matmul's transform: its scales and rotation, per ``(K, N)`` matrix.

    Args:
      alpha: SmoothQuant's migration strength, or ``None`` for no scales.
      rotation: The ``(K, K)`` orthogonal matrix, or ``None``.
    """

    def __init__(self, alpha: float | None, rotation: jax.Array | None):
        self.alpha = alpha
        self.rotation = rotation

    @classmethod
    def create(
        cls, alpha: float | None, rotate: bool, key: jax.Array | None, k: int
    ) -> Transform:
        """The transform of a matmul with ``k`` input channels."""
        return cls(alpha, hadamard(k, key) if rotate else None)

    @property
    def identity(self) -> bool:
        """Whether it changes nothing."""
        return self.alpha is None and self.rotation is None

    def apply(
        self, w: jax.Array, stats: InputStats
    ) -> tuple[jax.Array, InputStats, dict[str, jax.Array]]:
        """``(w', stats', data)`` of one ``(K, N)`` weight.

        ``w' = T^{-1} w`` and the statistics of ``x' = x T`` for
        ``T = diag(1/s) Q``; ``data`` is what the activation's half needs.
        """
        h, absmax, abssum = stats.hessian, stats.absmax, stats.abssum
        data = {}
        if self.alpha is not None:
            s = smooth_scales(stats.absmax, w, alpha=self.alpha)
            w = (w * s[:, None]).astype(w.dtype)
            h = h / s[:, None] / s[None, :]
            absmax, abssum = absmax / s, abssum / s
            data["scale"] = s
        if self.rotation is not None:
            q = self.rotation
            w = _highest(q.T, w).astype(w.dtype)
            h = _highest(_highest(q.T, h), q)
            # |x Q| is not a function of the statistics: AWQ refuses it.
            absmax = abssum = jnp.full_like(abssum, jnp.nan)
            data["rotation"] = q
        stats = dataclasses.replace(stats, hessian=h, absmax=absmax, abssum=abssum)
        return w, stats, data

    def gram(self, g: jax.Array, data: dict[str, jax.Array]) -> jax.Array:
        """``A^T B`` of two activations (``(K, K)``), transformed: ``T^T g T``."""
        if "scale" in data:
            g = g / data["scale"][:, None] / data["scale"][None, :]
        if "rotation" in data:
            q = data["rotation"]
            g = _highest(_highest(q.T, g), q)
        return g

    def effective(self, w_new: jax.Array, data: dict[str, jax.Array]) -> jax.Array:
        """The weight that ``x`` meets: ``T w_new`` (for output errors)."""
        w = w_new.astype(jnp.float32)
        if "rotation" in data:
            w = _highest(data["rotation"], w)
        if "scale" in data:
            w = w / data["scale"][:, None]
        return w


def _highest(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(
        a.astype(jnp.float32),
        b.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
