"""Datasets of the example models; nothing is downloaded.

- ``lm``: the shipped character corpus (:mod:`qbits._experiments.corpus`),
  its first 90% for training and the last 10% held out.
- ``mlp``: a generated 10-class problem (inputs from a normal distribution,
  labels from a fixed random teacher network, as in ``examples/qat_mlp.py``);
  the held-out inputs are new draws from the same teacher.

Batches are a pure function of ``(seed, step)``: every config of a
comparison sees the same data in the same order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from qbits._experiments import _corpus as corpus

__all__ = ["CharData", "ClassData", "char_data", "class_data"]


@dataclasses.dataclass(frozen=True)
class CharData:
    """A character corpus as integer tokens.

    Attributes:
      chars: The vocabulary, sorted; token ``i`` is ``chars[i]``.
      train: int32 tokens of the training split.
      eval: int32 tokens of the held-out split.
    """

    chars: str
    train: jax.Array
    eval: jax.Array

    @property
    def vocab(self) -> int:
        """Number of distinct characters."""
        return len(self.chars)


def char_data(text: str | None = None, eval_fraction: float = 0.1) -> CharData:
    """Tokenizes ``text`` (default: the shipped corpus) by character.

    Example:
      >>> from qbits._experiments._data import char_data
      >>> data = char_data("abcabcabca")
      >>> data.chars, data.train.shape, data.eval.shape
      ('abc', (9,), (1,))
    """
    text = corpus.read() if text is None else text
    chars = "".join(sorted(set(text)))
    lookup = np.zeros(128 if not chars else max(128, ord(chars[-1]) + 1), np.int32)
    lookup[[ord(c) for c in chars]] = np.arange(len(chars), dtype=np.int32)
    tokens = lookup[np.frombuffer(text.encode("latin-1", "replace"), np.uint8)]
    split = len(tokens) - max(1, int(len(tokens) * eval_fraction))
    return CharData(chars, jnp.asarray(tokens[:split]), jnp.asarray(tokens[split:]))


def char_batch(
    tokens: jax.Array, key: jax.Array, batch: int, context: int
) -> tuple[jax.Array, jax.Array]:
    """Random windows: inputs ``[batch, context]`` and next-character targets."""
    start = jax.random.randint(key, (batch,), 0, tokens.shape[0] - context - 1)
    idx = start[:, None] + jnp.arange(context + 1)[None, :]
    windows = tokens[idx]
    return windows[:, :-1], windows[:, 1:]


def char_eval_batches(
    tokens: jax.Array, batches: int, batch: int, context: int
) -> tuple[jax.Array, jax.Array]:
    """Evenly spaced held-out windows ``[batches, batch, context]`` (fixed)."""
    n = batches * batch
    start = jnp.linspace(0, tokens.shape[0] - context - 2, n).astype(jnp.int32)
    idx = start[:, None] + jnp.arange(context + 1)[None, :]
    windows = tokens[idx].reshape(batches, batch, context + 1)
    return windows[..., :-1], windows[..., 1:]


@dataclasses.dataclass(frozen=True)
class ClassData:
    """A generated classification problem.

    Attributes:
      x, y: Training inputs ``[n, features]`` and int32 labels ``[n]``.
      x_eval, y_eval: Held-out inputs and labels.
      classes: Number of classes.
    """

    x: jax.Array
    y: jax.Array
    x_eval: jax.Array
    y_eval: jax.Array
    classes: int


def class_data(
    n: int = 8192, n_eval: int = 2048, features: int = 64, classes: int = 10
) -> ClassData:
    """A nonlinear ``classes``-way problem from a fixed random teacher network.

    Example:
      >>> from qbits._experiments._data import class_data
      >>> data = class_data(n=32, n_eval=8, features=4, classes=3)
      >>> data.x.shape, data.y_eval.shape, data.classes
      ((32, 4), (8,), 3)
    """
    x, y = _teacher(n + n_eval, features, classes)
    return ClassData(x[:n], y[:n], x[n:], y[n:], classes)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _teacher(n: int, features: int, classes: int) -> tuple[jax.Array, jax.Array]:
    """Inputs and teacher labels, in one compiled function (quick to start)."""
    k_teacher, k_x = jax.random.split(jax.random.key(42))
    w1 = jax.random.normal(k_teacher, (features, 128)) / np.sqrt(features)
    w2 = jax.random.normal(jax.random.fold_in(k_teacher, 1), (128, classes))
    x = jax.random.normal(k_x, (n, features))
    return x, jnp.argmax(jnp.tanh(x @ w1) @ w2, axis=-1).astype(jnp.int32)
