"""Static ranges for linen: collect activation absmax per layer over batches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import qbits._ranges  # noqa: F401  (freeze_ranges, the next step)
from qbits._errors import InvalidArgumentError
from qbits.flax._layers import _path
from qbits.flax._quantize import quantize

__all__ = ["RANGES", "collect_ranges"]

RANGES = "qbits_ranges"
_PREFIX = "lhs_absmax:"
_DENSE = (nn.Dense.__call__, nn.DenseGeneral.__call__)
_RAW = tuple(getattr(m, "__wrapped__", m) for m in _DENSE)


def _observer() -> Any:
    """An interceptor sowing the absmax of each Dense layer's input."""

    def observe(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        if getattr(context.orig_method, "func", None) in _RAW and args:
            x = jnp.asarray(args[0])
            if jnp.issubdtype(x.dtype, jnp.floating):
                module = context.module
                _sow(module, _path(module), x)
        return next_fun(*args, **kwargs)

    return observe


def _sow(module: nn.Module, path: str, x: jax.Array) -> None:
    # Named by the layer's path as quantize sees it (which can differ from
    # where the variable is stored).
    module.sow(
        RANGES,
        _PREFIX + path,
        jnp.max(jnp.abs(x)).astype(jnp.float32),
        init_fn=lambda: jnp.zeros((), jnp.float32),
        reduce_fn=jnp.maximum,
    )


def collect_ranges(
    model: nn.Module, variables: Any, batches: Iterable[Any], **apply_kwargs: Any
) -> dict[str, float]:
    """The largest input magnitude of every ``Dense``/``DenseGeneral``, over batches.

    Runs ``model.apply(variables, batch, **apply_kwargs)`` (jitted, the float
    model) on each batch and takes, per layer, the max over batches of
    ``max(|input|)``. Give the result to :func:`qbits.freeze_ranges`.

    Args:
      model: An unbound linen module (the float model).
      variables: Its variables.
      batches: An iterable of inputs (each passed as the first argument).
      **apply_kwargs: More arguments for ``apply`` (e.g. ``rngs``), static.

    Returns:
      ``{layer path: absmax}``, paths as ``qbits.flax.quantize`` names them.

    Raises:
      InvalidArgumentError: For no batches.

    Example:
      >>> import flax.linen as nn
      >>> model = nn.Dense(4)
      >>> v = model.init(jax.random.key(0), jnp.ones((1, 8)))
      >>> qbits.flax.collect_ranges(model, v, [jnp.ones((2, 8)), -3 * jnp.ones((2, 8))])
      {'': 3.0}
    """
    wrapped = quantize(model, None)  # float, with quantize's layer paths

    @jax.jit
    def run(variables: Any, batch: Any) -> Any:
        with nn.intercept_methods(_observer()):
            _, state = wrapped.apply(variables, batch, mutable=[RANGES], **apply_kwargs)
        return state.get(RANGES, {})

    ranges: dict[str, float] = {}
    count = 0
    for batch in batches:
        count += 1
        found = jax.tree_util.tree_flatten_with_path(run(variables, batch))[0]
        for key_path, value in found:
            path = str(getattr(key_path[-1], "key", key_path[-1]))[len(_PREFIX) :]
            ranges[path] = max(ranges.get(path, 0.0), float(jnp.max(value)))
    if not count:
        raise InvalidArgumentError(
            "collect_ranges", "batches", batches, "at least one batch"
        )
    return ranges
