"""Static ranges for nnx: collect activation absmax per layer over batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp

import qbits._ranges  # noqa: F401  (freeze_ranges, the next step)
from qbits._errors import InvalidArgumentError
from qbits.nnx._quantize import _layers

__all__ = ["collect_ranges"]


class _Recorder:
    """A dot_general that records ``max(|lhs|)`` and calls the original."""

    def __init__(self, path: str, inner: Callable[..., Any], seen: dict[str, Any]):
        self.path, self.inner, self.seen = path, inner, seen

    def __call__(self, lhs: Any, rhs: Any, *args: Any, **kwargs: Any) -> jax.Array:
        amax = jnp.max(jnp.abs(jnp.asarray(lhs))).astype(jnp.float32)
        old = self.seen.get(self.path)
        self.seen[self.path] = amax if old is None else jnp.maximum(old, amax)
        return self.inner(lhs, rhs, *args, **kwargs)


def collect_ranges(
    model: nnx.Module,
    batches: Iterable[Any],
    call: Callable[[nnx.Module, Any], Any] | None = None,
) -> dict[str, float]:
    """The largest input magnitude of every ``Linear``/``LinearGeneral``, over batches.

    Runs the (float) model on each batch, eagerly, with each layer's
    ``dot_general`` wrapped by a recorder; the model is restored afterwards.
    Give the result to :func:`qbits.freeze_ranges`.

    Args:
      model: The nnx model (float; it is not changed).
      batches: An iterable of inputs.
      call: ``call(model, batch)`` runs the model; default ``model(batch)``.

    Returns:
      ``{layer path: absmax}``, paths as ``qbits.nnx.quantize`` names them.

    Raises:
      InvalidArgumentError: For no batches.

    Example:
      >>> import flax.nnx as nnx
      >>> model = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
      >>> qbits.nnx.collect_ranges(model, [jnp.ones((2, 8)), -2 * jnp.ones((2, 8))])
      {'layers/0': 2.0}
    """
    seen: dict[str, Any] = {}
    layers = [
        layer
        for layer in _layers(model)
        if layer.kind in ("Linear", "LinearGeneral") and not layer.explicit
    ]
    saved = [(layer.module, layer.module.dot_general) for layer in layers]
    count = 0
    try:
        for layer, (module, inner) in zip(layers, saved, strict=True):
            fn = inner if inner is not None else jax.lax.dot_general
            module.dot_general = _Recorder(layer.path, fn, seen)
        for batch in batches:
            count += 1
            if call is None:
                model(batch)
            else:
                call(model, batch)
    finally:
        for module, inner in saved:
            module.dot_general = inner
    if not count:
        raise InvalidArgumentError(
            "collect_ranges", "batches", batches, "at least one batch"
        )
    return {path: float(v) for path, v in seen.items()}
