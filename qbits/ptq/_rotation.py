r"""Rotations: ``x @ w == (x @ Q) @ (Q^T w)`` for an orthogonal ``Q``.

A random orthogonal ``Q`` spreads an outlier input channel over all of them,
so both ``x @ Q`` and ``Q^T w`` quantize with less error (QuaRot, Ashkboos
et al., arXiv 2404.00456; QuIP#, arXiv 2402.04396). A randomized Hadamard
matrix (:func:`hadamard`) is such a ``Q`` that costs ``O(K log K)`` per row
to apply with a fast transform, and ``O(K^2)`` as a plain matmul.

``Q^T w`` is applied to the weight once, offline; ``x @ Q`` to the
activation online, in the forward pass, right before the matmul (or folded
into the layer before, where that layer is linear: QuaRot folds it into the
previous weight). ``quantize_weights(rotate=True)`` does both.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import InvalidArgumentError, check_int

__all__ = ["hadamard"]

# Paley constructions are used up to this order of the non-power-of-two part.
_MAX_PALEY = 1024


def hadamard(n: int, key: jax.Array | None = None) -> jax.Array:
    r"""An orthonormal (randomized) Hadamard matrix of order ``n``, float32.

    ``H / sqrt(n)`` for a Hadamard matrix ``H`` (entries ``+-1``,
    ``H H^T = n I``); with a ``key``, its rows are multiplied by random
    signs (``diag(d) H / sqrt(n)``, ``d`` uniform in ``{-1, +1}``), QuaRot's
    randomized Hadamard transform. Either way ``Q Q^T = I``.

    ``H`` is built as a Kronecker product ``H_{2^k} \otimes H_m``:
    Sylvester's construction for the power of two, and for ``m > 2`` a
    Paley construction: type I (order ``q + 1``, ``q`` a prime with
    ``q % 4 == 3``: 12, 20, 24, 44, 48, 60, ...) or type II (order
    ``2 (q + 1)``, ``q`` a prime with ``q % 4 == 1``: 12, 28, 36, 60, 76,
    ...), ``m`` up to 1024. So ``n = 4096`` (``2^{12}``), ``5120``
    (``20 \cdot 2^8``), ``14336`` (``28 \cdot 2^9``) and ``13824``
    (``108 \cdot 2^7``) are supported; other orders (``11008 = 172 \cdot
    2^6``, any ``n`` not a multiple of 4 but 1 and 2) raise.

    Args:
      n: The order, >= 1.
      key: A PRNG key for the random signs, or ``None`` for the plain
        (deterministic) normalised Hadamard matrix.

    Returns:
      ``(n, n)``, float32, orthonormal.

    Raises:
      InvalidArgumentError: For an ``n`` with no construction here.

    Example:
      >>> qbits.ptq.hadamard(2) * 2**0.5
      Array([[ 1.,  1.],
             [ 1., -1.]], dtype=float32)
      >>> q = qbits.ptq.hadamard(12, jax.random.key(0))
      >>> bool(jnp.allclose(q @ q.T, jnp.eye(12), atol=1e-6))
      True
    """
    check_int("hadamard", "n", n, 1)
    h = (_hadamard(n) / np.sqrt(n)).astype(np.float32)
    if key is None:
        return jnp.asarray(h)
    signs = jax.random.rademacher(key, (n,), jnp.float32)
    return signs[:, None] * h


@functools.lru_cache(maxsize=32)
def _hadamard(n: int) -> np.ndarray:
    """A Hadamard matrix (int8 entries +-1) of order ``n``."""
    for m in _orders_dividing(n):
        base = _paley(m) if m > 2 else np.ones((1, 1), np.int8)
        h = base
        power = n // base.shape[0]
        sylvester = np.array([[1, 1], [1, -1]], np.int8)
        while power > 1:
            h = np.kron(sylvester, h)
            power //= 2
        return h
    raise InvalidArgumentError(
        "hadamard",
        "n",
        n,
        "2**k times 1 or an order m <= 1024 of a Paley construction (m = q + 1 "
        "for a prime q % 4 == 3, or m = 2 (q + 1) for a prime q % 4 == 1: 12, "
        "20, 28, 36, 44, ...); pad the channels to such a size, or use another "
        "orthogonal matrix",
        why="no Hadamard construction for it here",
    )


def _orders_dividing(n: int) -> list[int]:
    """The odd-free part ``m`` of ``n = 2^k m`` that has a construction."""
    found = []
    m = n
    while True:
        if m in (1, 2) or (m <= _MAX_PALEY and _paley_kind(m)):
            found.append(m)
        if m % 2:
            break
        m //= 2
    return found[-1:]  # the smallest: the fewest non-Sylvester entries


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _paley_kind(m: int) -> int:
    """1 or 2 for the Paley construction of order ``m``, 0 for none."""
    if m % 4:
        return 0
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return 1
    if _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return 2
    return 0


def _paley(m: int) -> np.ndarray:
    """Paley's Hadamard matrix of order ``m`` (type I or II)."""
    kind = _paley_kind(m)
    q = m - 1 if kind == 1 else m // 2 - 1
    residues = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if r in residues else -1 for r in range(1, q)])
    jacobsthal = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]
    ones = np.ones((q, 1), np.int64)
    if kind == 1:  # I + [[0, 1^T], [-1, Q]], skew
        core = np.block([[np.zeros((1, 1), np.int64), ones.T], [-ones, jacobsthal]])
        h = np.eye(q + 1, dtype=np.int64) + core
    else:  # the symmetric conference matrix S, S (x) [[1, 1], [1, -1]] + ...
        s = np.block([[np.zeros((1, 1), np.int64), ones.T], [ones, jacobsthal]])
        h = np.kron(s, np.array([[1, 1], [1, -1]])) + np.kron(
            np.eye(q + 1, dtype=np.int64), np.array([[1, -1], [-1, -1]])
        )
    return h.astype(np.int8)
