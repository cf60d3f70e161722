"""Autoregressive decoding with a KV cache: :func:`generate`.

The model is any nnx module with two methods (what
the ``qbits`` command's example transformer has):

- ``init_cache(batch, config)``: an empty cache, a pytree of
  :class:`~qbits.kvcache.KVCache` (one per attention layer) of the model's
  context length, stored as the :class:`~qbits.kvcache.CacheConfig` says;
- ``decode(tokens, cache)``: the logits ``[batch, n, vocab]`` of ``n`` new
  tokens at the positions after the cache's, and the cache with their keys
  and values appended.

The prompt is decoded in one call (prefill), then each new token in one
compiled step that samples it (greedy, or at a temperature) and decodes it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import InvalidArgumentError, check_bool, check_float, check_int
from qbits.kvcache._cache import KVCache
from qbits.kvcache._config import CacheConfig, as_cache_config

__all__ = ["generate"]

_OWNER = "qbits.kvcache.generate"


def _pick(logits: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
    """The next token of each sequence: argmax, or a sample at ``temperature``."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / np.float32(temperature)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prefill(
    graphdef: Any, state: Any, tokens: jax.Array, config: CacheConfig
) -> tuple[jax.Array, Any]:
    model = nnx.merge(graphdef, state)
    logits, cache = model.decode(tokens, model.init_cache(tokens.shape[0], config))
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnums=(0, 6))
def _advance(
    graphdef: Any,
    state: Any,
    logits: jax.Array,
    cache: Any,
    key: jax.Array,
    i: jax.Array,
    temperature: float,
) -> tuple[jax.Array, jax.Array, Any]:
    token = _pick(logits, jax.random.fold_in(key, i), temperature)
    logits, cache = nnx.merge(graphdef, state).decode(token[:, None], cache)
    return token, logits[:, -1], cache


@functools.partial(jax.jit, static_argnums=(3,))
def _sample(logits: jax.Array, key: jax.Array, i: jax.Array, temperature: float):
    return _pick(logits, jax.random.fold_in(key, i), temperature)


def _caches(tree: Any) -> list[KVCache]:
    return [
        leaf
        for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, KVCache))
        if isinstance(leaf, KVCache)
    ]


def generate(
    model: nnx.Module,
    prompt: Any,
    steps: int,
    *,
    cache: Any = None,
    temperature: float = 0.0,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    return_logits: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decodes ``steps`` tokens after ``prompt`` with a KV cache.

    The prompt's keys and values are written to the cache in one call, then
    each new token's, once, as it is decoded; attention reads them back
    from the cache (:func:`~qbits.kvcache.attend`). When the cache is full
    (the model's context length), it is rebuilt from the last half of the
    window (one prefill call) and decoding goes on.

    Args:
      model: An nnx model with ``init_cache`` and ``decode`` methods (see
        the module docstring), e.g. the ``qbits`` command's example transformer.
      prompt: int tokens, ``[batch, length]`` or ``[length]``, at least
        one, each in ``0 .. vocab - 1`` (the last axis of the model's
        logits). Checked here, where the prompt is concrete; a prompt
        traced under an outer ``jit`` is not checked, and an id outside the
        vocabulary then decodes as the model embeds it (``nnx.Embed``:
        NaN for ``id >= vocab``, a negative id counted from the end).
      steps: How many tokens to decode (0 or more).
      cache: How the cache stores keys and values: a
        :class:`~qbits.kvcache.CacheConfig`, ``None`` (float), a cache
        preset name (``"kv_int8"``) or a YAML file.
      temperature: 0 (default) takes the most likely token (greedy); a
        positive temperature samples from ``softmax(logits / temperature)``.
      seed: Seed of the sampling keys (``0 .. 2**32 - 1``; the same seed
        samples the same tokens).
      progress: Called as ``progress(i)`` once the ``i``-th token is
        computed (without it, decoding runs ahead of Python).
      return_logits: Also return the logits each new token was drawn from.

    Returns:
      The new tokens, int32 ``[batch, steps]`` (``[steps]`` for a 1-D
      prompt); with ``return_logits``, ``(tokens, logits)``, the logits
      ``[batch, steps, vocab]`` (``[steps, vocab]``).

    Raises:
      InvalidArgumentError: For a model without a KV cache (no
        ``init_cache``/``decode``, or one whose ``init_cache`` refuses), a bad
        cache config, prompt (not integer, or an id outside the vocabulary,
        naming the ids and their positions), ``steps``, ``temperature`` or
        ``seed``.
      ConfigError: For a cache config file that does not hold one.

    Example:
      Any nnx model with the two methods decodes with it: here a toy whose
      logits favour the token after the last one (``(t + 1) % 4``) and
      mix in attention over the cached tokens.

      >>> import flax.nnx as nnx
      >>> from qbits import kvcache
      >>> class Cyclic(nnx.Module):
      ...     def __init__(self):
      ...         self.table = nnx.Param(jnp.roll(jnp.eye(4), 1, axis=1))
      ...     def init_cache(self, batch, config):
      ...         return kvcache.KVCache.create(config, batch, 8, heads=1, head_dim=4)
      ...     def decode(self, tokens, cache):
      ...         x = self.table[...][tokens][:, :, None]  # [batch, n, 1 head, 4]
      ...         cache = cache.append(x, x)
      ...         return (x + 0.1 * kvcache.attend(x, cache))[:, :, 0], cache
      >>> kvcache.generate(Cyclic(), jnp.array([0, 1]), 5, cache="kv_int8")
      Array([2, 3, 0, 1, 2], dtype=int32)
    """
    init = getattr(model, "init_cache", None)
    if not (
        isinstance(model, nnx.Module)
        and callable(init)
        and callable(getattr(model, "decode", None))
    ):
        raise InvalidArgumentError(
            _OWNER,
            "model",
            type(model).__name__,
            "an nnx model that decodes with a KV cache: methods "
            "init_cache(batch, config) and decode(tokens, cache), as "
            "the qbits command's example transformer has",
            why="it has no KV cache",
        )
    config = as_cache_config(_OWNER, cache)
    tokens = _check_prompt(prompt)
    check_int(_OWNER, "steps", steps, 0, 2**31 - 1)
    check_float(_OWNER, "temperature", temperature, lo=0.0)
    check_int(_OWNER, "seed", seed, 0, 2**32 - 1)
    check_bool(_OWNER, "return_logits", return_logits)
    if progress is not None and not callable(progress):
        raise InvalidArgumentError(
            _OWNER, "progress", progress, "None or a callable(i)"
        )
    batch = tokens.shape[0]
    empty = _caches(jax.eval_shape(lambda: init(batch, config)))
    if not empty:
        raise InvalidArgumentError(
            _OWNER,
            "model",
            type(model).__name__,
            "a model whose init_cache(batch, config) returns KVCaches",
        )
    capacity = min(c.capacity for c in empty)
    graphdef, state = nnx.split(model)
    temperature = float(temperature)
    key = jax.random.key(seed)

    def prefill(window: jax.Array) -> tuple[jax.Array, Any]:
        return _prefill(graphdef, state, window, config)

    window = tokens[:, -capacity:]
    vocab = _prefill.eval_shape(graphdef, state, window, config)[0].shape[-1]
    _check_ids(prompt, vocab)
    logits, caches = prefill(window)
    filled = window.shape[1]
    out: list[jax.Array] = []
    seen_logits: list[jax.Array] = []
    for i in range(steps):
        index = jnp.asarray(i, jnp.int32)
        if return_logits:
            seen_logits.append(logits)
        if i == steps - 1 or filled == capacity:
            out.append(_sample(logits, key, index, temperature))
            if i < steps - 1:  # full: go on from the last half of the window
                seen = jnp.concatenate([tokens, jnp.stack(out, axis=1)], axis=1)
                window = seen[:, -max(1, capacity // 2) :]
                logits, caches = prefill(window)
                filled = window.shape[1]
        else:
            token, logits, caches = _advance(
                graphdef, state, logits, caches, key, index, temperature
            )
            out.append(token)
            filled += 1
        if progress is not None:  # once the token is computed
            jax.block_until_ready(out[-1])
            progress(i + 1)
    result = jnp.stack(out, axis=1) if out else jnp.zeros((batch, 0), jnp.int32)
    one = jnp.ndim(prompt) == 1
    if not return_logits:
        return result[0] if one else result
    vocab = logits.shape[-1]
    stacked = (
        jnp.stack(seen_logits, axis=1)
        if seen_logits
        else jnp.zeros((batch, 0, vocab), logits.dtype)
    )
    return (result[0], stacked[0]) if one else (result, stacked)


def _check_prompt(prompt: Any) -> jax.Array:
    """The prompt as int32 ``[batch, length]``."""
    shape = getattr(prompt, "shape", None)
    dtype = getattr(prompt, "dtype", None)
    ok = shape is not None and dtype is not None and len(shape) in (1, 2)
    ok = ok and jnp.issubdtype(dtype, jnp.integer) and shape[-1] >= 1
    ok = ok and (len(shape) == 1 or shape[0] >= 1)
    if not ok:
        shown = prompt
        if shape is not None and dtype is not None:
            shown = f"{np.dtype(dtype).name}{list(shape)}"
        raise InvalidArgumentError(
            _OWNER,
            "prompt",
            shown,
            "int tokens of shape [batch, length] or [length], length >= 1",
        )
    tokens = jnp.asarray(prompt, jnp.int32)
    return tokens[None] if tokens.ndim == 1 else tokens


def _check_ids(prompt: Any, vocab: int) -> None:
    """Raises unless every id of a concrete ``prompt`` is in ``0..vocab - 1``."""
    if isinstance(prompt, jax.core.Tracer):
        return  # traced: checked by nobody (see generate)
    ids = np.asarray(prompt)
    bad = np.argwhere((ids < 0) | (ids >= vocab))
    if bad.size:
        shown = [f"prompt{list(map(int, at))} = {ids[tuple(at)]}" for at in bad[:4]]
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise InvalidArgumentError(
            _OWNER,
            "prompt",
            f"{ids.dtype.name}{list(ids.shape)}",
            f"token ids in 0..{vocab - 1} (a vocabulary of {vocab}: the last "
            "axis of the model's logits)",
            why=f"ids outside the vocabulary: {', '.join(shown)}{more}",
        )
