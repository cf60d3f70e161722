"""The KV cache of one attention layer: quantize on write, dequantize on read.

A :class:`KVCache` holds the keys and values of the tokens decoded so far in
the layout ``[batch, position, heads, head_dim]``, up to a fixed capacity,
and how many positions are written (``length``). As its
:class:`~qbits.kvcache.CacheConfig` says, each is stored in float (the
model's dtype) or as a :class:`~qbits.QTensor`: int8 or fp8 values and
float32 scales, one per token and head or one per head. A token's keys and
values are quantized once, when it is appended, by the config's
:class:`~qbits.Quantizer`; positions already written never change.
:func:`attend` computes attention from the stored values, dequantized.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from qbits._errors import InvalidArgumentError, check_int
from qbits._tensor import QTensor
from qbits.kvcache._config import CacheConfig, as_cache_config

__all__ = ["KVCache", "attend"]


def _concrete_int(x: Any) -> int | None:
    """``x`` as an int outside ``jit``; ``None`` when it is traced."""
    if isinstance(x, jax.core.Tracer):
        return None
    return int(x)


class KVCache(struct.PyTreeNode):
    """The keys and values of the decoded tokens of one attention layer.

    A pytree (it passes through ``jax.jit``); :meth:`append` returns a new
    cache. Make one with :meth:`create`.

    Attributes:
      keys: ``[batch, capacity, heads, head_dim]``: a float array, or a
        :class:`~qbits.QTensor` of stored values (int8, fp8) with float32
        scales (``[batch, capacity, heads, 1]`` per token, ``[batch, 1,
        heads, 1]`` per head).
      values: The values, as ``keys``.
      length: The number of positions written (an int32 scalar).
      config: The :class:`~qbits.kvcache.CacheConfig` (static).

    Example:
      >>> from qbits import kvcache
      >>> cache = kvcache.KVCache.create("kv_int8", batch=1, capacity=8,
      ...                                heads=2, head_dim=4)
      >>> append = jax.jit(kvcache.KVCache.append)  # compiled, as decoding runs it
      >>> k = jnp.linspace(-1.0, 1.0, 24).reshape(1, 3, 2, 4)
      >>> cache = append(cache, k, -k)
      >>> cache.keys.qvalue.dtype, cache.keys.scale.shape, int(cache.length)
      (dtype('int8'), (1, 8, 2, 1), 3)
      >>> cache.nbytes, kvcache.KVCache.create(None, 1, 8, 2, 4).nbytes  # vs float32
      (256, 512)
    """

    keys: Any
    values: Any
    length: jax.Array
    config: CacheConfig = struct.field(pytree_node=False)

    @classmethod
    def create(
        cls,
        config: Any,
        batch: int,
        capacity: int,
        heads: int,
        head_dim: int,
        dtype: Any = jnp.float32,
    ) -> KVCache:
        """An empty cache of ``capacity`` positions.

        Args:
          config: A :class:`~qbits.kvcache.CacheConfig`, ``None`` (float), a
            cache preset name, a YAML file, text or data (as
            :func:`qbits.load_config` reads a
            :class:`~qbits.kvcache.CacheConfig`).
          batch: Sequences decoded together.
          capacity: The most positions the cache holds.
          heads: Key/value heads.
          head_dim: Features per head.
          dtype: The float dtype of the keys and values (what :meth:`read`
            gives back, and what a float cache stores).

        Raises:
          InvalidArgumentError: For a bad config, size or dtype.

        Example:
          >>> from qbits import kvcache
          >>> cache = kvcache.KVCache.create(None, 2, 16, 4, 8)
          >>> cache.keys.shape, cache.nbytes
          ((2, 16, 4, 8), 8192)
        """
        owner = "KVCache.create"
        config = as_cache_config(owner, config)
        for name, value in (
            ("batch", batch),
            ("capacity", capacity),
            ("heads", heads),
            ("head_dim", head_dim),
        ):
            check_int(owner, name, value, 1)
        if not isinstance(dtype, str | type | np.dtype) or not jnp.issubdtype(
            dtype, jnp.floating
        ):
            raise InvalidArgumentError(
                owner, "dtype", dtype, "a float dtype (float32, bfloat16, ...)"
            )
        dtype = np.dtype(dtype)
        shape = (batch, capacity, heads, head_dim)
        scale_shape = (
            (batch, capacity, heads, 1)
            if config.granularity == "per_token"
            else (batch, 1, heads, 1)
        )

        def empty(which: str) -> Any:
            numerics = getattr(config, which)
            if numerics is None:
                return jnp.zeros(shape, dtype)
            qdtype = np.dtype(numerics.get_dtype())
            return QTensor(
                jnp.zeros(shape, qdtype),
                jnp.ones(scale_shape, jnp.float32),
                qdtype=qdtype,
                dtype=dtype,
            )

        return cls(empty("keys"), empty("values"), jnp.zeros((), jnp.int32), config)

    @property
    def capacity(self) -> int:
        """The most positions the cache holds."""
        return int(_stored(self.keys).shape[1])

    @property
    def dtype(self) -> np.dtype:
        """The float dtype of the keys and values."""
        return np.dtype(self.keys.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored keys and values, their scales included."""
        return sum(
            x.nbytes if isinstance(x, QTensor) else int(np.prod(x.shape)) * x.itemsize
            for x in (self.keys, self.values)
        )

    def append(self, keys: jax.Array, values: jax.Array) -> KVCache:
        """The cache with ``keys`` and ``values`` of new tokens written after the rest.

        Each is quantized once, here (per-token scales from the new tokens
        themselves; a per-head scale from the first write, kept for every
        later one), and written at positions ``length .. length + n - 1``;
        the positions written before do not change.

        Args:
          keys: ``[batch, n, heads, head_dim]``, the keys of ``n`` new tokens.
          values: The values, of the same shape.

        Returns:
          The new cache (``length`` grown by ``n``).

        Raises:
          InvalidArgumentError: For arrays of another shape or a non-float
            dtype, or (outside ``jit``, where ``length`` is known) more
            tokens than the cache has room for. Under ``jit`` the caller
            keeps ``length + n <= capacity`` (a write past the end would
            land on the last positions).

        Example:
          >>> from qbits import kvcache
          >>> cache = kvcache.KVCache.create(None, 1, 4, 1, 2)  # float
          >>> cache = cache.append(jnp.ones((1, 3, 1, 2)), jnp.ones((1, 3, 1, 2)))
          >>> int(cache.length), cache.capacity
          (3, 4)
        """
        owner = "KVCache.append"
        want = _stored(self.keys).shape
        shape = getattr(keys, "shape", None)
        ok = shape is not None and len(shape) == 4 and 1 <= shape[1] <= want[1]
        ok = ok and (shape[0], *shape[2:]) == (want[0], *want[2:])
        if not ok or not jnp.issubdtype(keys.dtype, jnp.floating):
            raise InvalidArgumentError(
                owner,
                "keys",
                _describe(keys),
                f"a float array of shape ({want[0]}, n, {want[2]}, {want[3]}) "
                f"with 1 <= n <= {want[1]} (the capacity)",
            )
        if getattr(values, "shape", None) != shape or not jnp.issubdtype(
            values.dtype, jnp.floating
        ):
            raise InvalidArgumentError(
                owner, "values", _describe(values), f"a float array of shape {shape}"
            )
        n = shape[1]
        written = _concrete_int(self.length)
        if written is not None and written + n > want[1]:
            raise InvalidArgumentError(
                owner,
                "keys",
                _describe(keys),
                f"at most {want[1] - written} new tokens",
                why=f"{written} of {want[1]} positions are written",
            )
        start = self.length.astype(jnp.int32)
        return self.replace(
            keys=self._write("keys", self.keys, keys, start),
            values=self._write("values", self.values, values, start),
            length=self.length + n,
        )

    def _write(self, which: str, stored: Any, x: jax.Array, start: jax.Array) -> Any:
        """``x`` quantized (once) and written into ``stored`` at ``start``."""
        zero = jnp.zeros((), jnp.int32)
        at = (zero, start, zero, zero)
        if not isinstance(stored, QTensor):
            return lax.dynamic_update_slice(stored, x.astype(stored.dtype), at)
        quantizer = self.config.quantizer(which)
        fresh = quantizer.quant(x, store=True)  # its own scales
        if self.config.granularity == "per_token":
            scale = lax.dynamic_update_slice(stored.scale, fresh.scale, at)
            qvalue = fresh.qvalue
        else:  # per head: the first write sets the scale, later ones reuse it
            first = start == 0
            scale = jnp.where(first, fresh.scale, stored.scale)
            kept, _ = quantizer.quant_vjp(x, store=True, scale=stored.scale)
            qvalue = jnp.where(first, fresh.qvalue, kept.qvalue)
        qvalue = lax.dynamic_update_slice(stored.qvalue, qvalue, at)
        return stored.replace(qvalue=qvalue, scale=scale)

    def read(self) -> tuple[jax.Array, jax.Array]:
        """The keys and values, ``[batch, capacity, heads, head_dim]`` each.

        Stored values are dequantized (``qvalue * scale``) into the cache's
        float dtype; positions not yet written are zeros.

        Example:
          >>> from qbits import kvcache
          >>> cache = kvcache.KVCache.create(None, 1, 2, 1, 2)
          >>> k = jnp.array([[[[0.5, -1.0]]]])
          >>> cache.append(k, k).read()[1][0, :, 0]
          Array([[ 0.5, -1. ],
                 [ 0. ,  0. ]], dtype=float32)
        """
        return _dequant(self.keys), _dequant(self.values)


def _stored(x: Any) -> jax.Array:
    return x.qvalue if isinstance(x, QTensor) else x


def _dequant(x: Any) -> jax.Array:
    return x.dequant() if isinstance(x, QTensor) else x


def _describe(x: Any) -> str:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return repr(x)
    return f"{np.dtype(dtype).name}{list(shape)}"


def attend(query: jax.Array, cache: KVCache) -> jax.Array:
    """Causal attention of the newest tokens' queries over a cache.

    ``query`` holds the queries of the last ``n`` tokens appended to
    ``cache`` (append their keys and values first): the query at position
    ``p`` attends to positions ``0 .. p``. The keys and values are read from
    the cache (dequantized), and attention is
    ``softmax(q k^T / sqrt(head_dim)) v``, as
    ``jax.nn.dot_product_attention`` computes it (what Flax's attention
    layers call).

    Args:
      query: ``[batch, n, heads, head_dim]``.
      cache: The cache holding the keys and values of every position up to
        the newest token.

    Returns:
      ``[batch, n, heads, head_dim]``, in the query's dtype.

    Raises:
      InvalidArgumentError: For a query whose batch, heads or head_dim differ
        from the cache's, or with more tokens than the cache holds.

    Example:
      >>> from qbits import kvcache
      >>> q, v = jnp.ones((1, 1, 2, 4)), jnp.arange(8.0).reshape(1, 1, 2, 4)
      >>> cache = kvcache.KVCache.create(None, 1, 4, 2, 4).append(q, v)
      >>> out = jax.jit(kvcache.attend)(q, cache)
      >>> bool((out == v).all())  # one token: its own value
      True
    """
    want = _stored(cache.keys).shape
    shape = getattr(query, "shape", None)
    if (
        shape is None
        or len(shape) != 4
        or (shape[0], *shape[2:]) != (want[0], *want[2:])
        or not 1 <= shape[1] <= want[1]
    ):
        raise InvalidArgumentError(
            "attend",
            "query",
            _describe(query),
            f"an array of shape ({want[0]}, n, {want[2]}, {want[3]}) with "
            f"1 <= n <= {want[1]} (the cache's batch, heads, head_dim and capacity)",
        )
    keys, values = cache.read()
    n = shape[1]
    positions = cache.length - n + jnp.arange(n, dtype=jnp.int32)
    mask = jnp.arange(want[1], dtype=jnp.int32)[None, :] <= positions[:, None]
    return jax.nn.dot_product_attention(
        query,
        keys.astype(query.dtype),
        values.astype(query.dtype),
        mask=mask[None, None],
    )
