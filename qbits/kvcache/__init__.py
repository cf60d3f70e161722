"""Layer 8: a quantized KV cache for autoregressive decoding.

Imported on its own: ``from qbits import kvcache``.

- :class:`CacheConfig`: how keys and values are stored: float, int8 or fp8
  (any numerics stored in one byte, written by a :class:`~qbits.Quantizer`),
  one scale per token and head or one per head; YAML like every qbits
  config (:func:`qbits.config.dump`; ``qbits.load_config(source,
  CacheConfig)`` reads a file, text, data or a preset name). Presets, by
  name wherever a cache config is taken: ``kv_float``, ``kv_int8``,
  ``kv_fp8``, ``kv_int8_per_head``, ``kv_fp8_per_head``.
- :class:`KVCache`: one attention layer's cache; :meth:`KVCache.append`
  quantizes each token's keys and values once, when it is written;
  :meth:`KVCache.read` dequantizes them. :func:`attend`: causal attention
  of the newest tokens over a cache.
- :func:`generate`: greedy or temperature sampling with a cache, for any
  nnx model with ``init_cache`` and ``decode`` methods
  (the ``qbits`` command's example transformer has them).

The package sits on layer 8 (with :mod:`qbits.serving`): it uses the
quantizer, numerics, granularities, :class:`~qbits.QTensor` and the config
layer's YAML.
"""

from qbits.kvcache._cache import KVCache, attend
from qbits.kvcache._config import CacheConfig
from qbits.kvcache._generate import generate

__all__ = [
    "CacheConfig",
    "KVCache",
    "attend",
    "generate",
]

# For the command line and the example models (not public): a cache config
# argument resolved with the caller's name in errors.
from qbits.kvcache._config import as_cache_config as _as_cache_config  # isort: skip  # noqa: F401
