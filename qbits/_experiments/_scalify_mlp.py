"""An MNIST-sized MLP trained end to end under ``qbits.scaled.scalify``.

784 inputs, two hidden layers, 10 classes, on a generated problem shaped
like MNIST (nothing is downloaded): a 32-dimensional latent labelled by
:func:`qbits._experiments.class_data`'s fixed teacher network, projected to
784 "pixels" by a fixed random map, plus pixel noise. Like MNIST, the inputs
are high-dimensional but lie near a low-dimensional set, so the MLP learns
the task rather than memorizing its training set. The same training step
(forward, ``jax.grad``, SGD update) runs in three precisions from the same
initialization and batches:

- ``float32``: plain JAX, no scalify;
- ``float16``: parameters, inputs, activations and gradients are float16
  ScaledArrays; scalify propagates the scales;
- ``fp8``: float16 storage with every matmul operand rounded to E4M3 in the
  forward pass and every matmul's incoming gradient rounded to E5M2 in the
  backward pass (``cast_ml_dtype``, ``grad=True`` for the gradient), as simulated
  FP8 training does.

The only scaling hints in the model are the ones Scalify's own MNIST example
uses: the logits' gradient is rescaled dynamically (its scale is not
predictable by static rules), and the parameters are re-centred on their
scale after each update (``dynamic_rescale_l2``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits import scaled
from qbits._experiments._data import class_data

__all__ = ["PRECISIONS", "ScalifyResult", "train_scalify_mlp"]

PRECISIONS = ("float32", "float16", "fp8")
_E4M3 = jnp.float8_e4m3fn
_E5M2 = jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class ScalifyResult:
    """Outcome of one run.

    Attributes:
      precision: ``float32``, ``float16`` or ``fp8``.
      losses: Training loss at every step (float32 numpy array).
      eval_loss: Cross-entropy on the held-out set after training.
      eval_accuracy: Accuracy on the held-out set.
      seconds: Wall time of the training loop, compile included.
    """

    precision: str
    losses: np.ndarray
    eval_loss: float
    eval_accuracy: float
    seconds: float

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last 10% of the steps."""
        tail = max(1, len(self.losses) // 10)
        return float(np.mean(self.losses[-tail:]))


def _mnist_like(n_train: int, n_eval: int) -> Any:
    latent = class_data(n=n_train, n_eval=n_eval, features=32, classes=10)
    k_proj, k_noise = jax.random.split(jax.random.key(7))
    proj = jax.random.normal(k_proj, (32, 784)) / np.float32(np.sqrt(32))

    def pixels(z: jax.Array, key: jax.Array) -> jax.Array:
        return z @ proj + 0.1 * jax.random.normal(key, (z.shape[0], 784))

    k_train, k_eval = jax.random.split(k_noise)
    return dataclasses.replace(
        latent, x=pixels(latent.x, k_train), x_eval=pixels(latent.x_eval, k_eval)
    )


def _init(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (n_in, n_out)) * np.float32(np.sqrt(2.0 / n_in)),
            "b": jnp.zeros((n_out,)),
        }
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def _dense(x: jax.Array, layer: dict[str, jax.Array], fp8: bool) -> jax.Array:
    w = layer["w"]
    if fp8:
        x, w = scaled.cast_ml_dtype(x, _E4M3), scaled.cast_ml_dtype(w, _E4M3)
    y = x @ w
    if fp8:
        y = scaled.cast_ml_dtype(y, _E5M2, grad=True)
    return y + layer["b"]


def _logits(params: list[dict[str, jax.Array]], x: jax.Array, fp8: bool) -> jax.Array:
    for layer in params[:-1]:
        x = jnp.maximum(_dense(x, layer, fp8), 0)
    return _dense(x, params[-1], fp8)


def _loss(params: Any, x: jax.Array, onehot: jax.Array, fp8: bool) -> jax.Array:
    logits = scaled.dynamic_rescale_l2(_logits(params, x, fp8), grad=True)
    logp = logits - jax.nn.logsumexp(logits, axis=1, keepdims=True)
    return -jnp.mean(jnp.sum(logp * onehot.astype(logp.dtype), axis=1))


def _step_fn(fp8: bool, lr: float):
    def step(params: Any, x: jax.Array, onehot: jax.Array) -> tuple[jax.Array, Any]:
        loss, grads = jax.value_and_grad(_loss)(params, x, onehot, fp8)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return loss, scaled.dynamic_rescale_l2(params)

    return step


def train_scalify_mlp(
    precision: str,
    *,
    steps: int = 1000,
    batch: int = 128,
    hidden: int = 512,
    lr: float = 0.05,
    seed: int = 0,
    n_train: int = 60000,
    n_eval: int = 10000,
) -> ScalifyResult:
    """Trains the MLP in one precision; same data and init for every precision.

    Args:
      precision: ``"float32"``, ``"float16"`` or ``"fp8"``.
      steps: SGD steps.
      batch: Batch size.
      hidden: Width of both hidden layers.
      lr: Learning rate.
      seed: Initialization and batch-order seed.
      n_train: Size of the generated training set.
      n_eval: Size of the generated held-out set.

    Returns:
      A :class:`ScalifyResult`.

    Raises:
      ValueError: For an unknown precision.

    Example:
      >>> from qbits._experiments import train_scalify_mlp
      >>> # "float32" is the baseline; "float16" and "fp8" run under scalify
      >>> # (a few seconds more to trace: tests/scaled/test_ops.py runs them).
      >>> result = train_scalify_mlp("float32", steps=2, hidden=16, n_train=64,
      ...                            n_eval=32)
      >>> result.precision, len(result.losses)
      ('float32', 2)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    data = _mnist_like(n_train, n_eval)
    params = _init(jax.random.key(seed), (784, hidden, hidden, 10))
    step = _step_fn(precision == "fp8", lr)
    if precision == "float32":
        run = jax.jit(step)

        def prepare(x: jax.Array) -> Any:
            return x
    else:
        run = jax.jit(scaled.scalify(step))
        params = scaled.dynamic_rescale_l2(
            scaled.as_scaled_array(
                jax.tree.map(lambda p: p.astype(jnp.float16), params)
            )
        )

        def prepare(x: jax.Array) -> Any:
            return scaled.as_scaled_array(x.astype(jnp.float16))

    order = np.random.default_rng(seed)
    losses = np.zeros(steps, np.float32)
    start = time.perf_counter()
    for i in range(steps):
        idx = order.integers(0, n_train, batch)
        onehot = jax.nn.one_hot(data.y[idx], 10)
        loss, params = run(params, prepare(data.x[idx]), onehot)
        losses[i] = float(np.asarray(scaled.asarray(loss), np.float32))
    seconds = time.perf_counter() - start
    eval_params = jax.tree.map(
        lambda p: jnp.asarray(p, jnp.float32),
        scaled.asarray(params, jnp.float32),
    )
    logits = _logits(eval_params, data.x_eval, fp8=False)
    logp = jax.nn.log_softmax(logits)
    eval_loss = float(-jnp.mean(jnp.take_along_axis(logp, data.y_eval[:, None], 1)))
    accuracy = float(jnp.mean(jnp.argmax(logits, 1) == data.y_eval))
    return ScalifyResult(precision, losses, eval_loss, accuracy, seconds)
