"""Layer 8: a quantized KV cache for autoregressive decoding.

Imported on its own: ``from qbits import kvcache``.

- :class:`CacheConfig`: how keys and values are stored: float, int8 or fp8
  (any numerics stored in one byte, written by a :class:`~qbits.Quantizer`),
  one scale per token and head or one per head; YAML like every qbits
  config (:func:`qbits.config.dump`, :func:`qbits.load_config`;
  :func:`as_cache_config` reads a file). Presets: :func:`preset`,
  :func:`preset_names` (``kv_float``, ``kv_int8``, ``kv_fp8``,
  ``kv_int8_per_head``, ``kv_fp8_per_head``).
- :class:`KVCache`: one attention layer's cache; :meth:`KVCache.append`
  quantizes each token's keys and values once, when it is written;
  :meth:`KVCache.read` dequantizes them. :func:`attend`: causal attention
  of the newest tokens over a cache.
- :func:`generate`: greedy or temperature sampling with a cache, for any
  nnx model with ``init_cache`` and ``decode`` methods
  (:class:`qbits.experiments.TransformerLM` has them).

The package sits on layer 8 (with :mod:`qbits.serving`): it uses the
quantizer, numerics, granularities, :class:`~qbits.QTensor` and the config
layer's YAML.
"""

from qbits.kvcache._cache import KVCache, attend
from qbits.kvcache._config import (
    GRANULARITIES,
    CacheConfig,
    as_cache_config,
    preset,
    preset_names,
)
from qbits.kvcache._generate import generate

__all__ = [
    "GRANULARITIES",
    "CacheConfig",
    "KVCache",
    "as_cache_config",
    "attend",
    "generate",
    "preset",
    "preset_names",
]
