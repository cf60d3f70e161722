"""``nnx.dot_product_attention`` with its two einsums quantized.

``nnx.MultiHeadAttention`` computes its attention with ``attention_fn``
(``nnx.dot_product_attention`` by default), which has no hook for its two
einsums: the attention logits ``q . k`` and the weighted sum of the values
``weights . v``. :class:`QuantizedAttention` is a drop-in ``attention_fn``
that computes the same attention, step by step as Flax does, with a
:class:`~qbits.nnx.QuantizedEinsum` for each einsum, so with the ``none``
preset it gives the same numbers as Flax, bit for bit.

Like Flax it takes two routes: without dropout and without sowing the
weights, the one of ``jax.nn.dot_product_attention`` (XLA implementation:
logits scaled after the ``q . k`` einsum, softmax in float32); otherwise the
one of ``nnx.dot_product_attention_weights`` (queries scaled before it,
dropout, the weights sown into ``nnx.Intermediate``). Grouped-query attention
(fewer key/value heads than query heads) is supported on both routes.
"""

from __future__ import annotations

import math
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from flax.nnx.nn import dtypes
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits.nnx._layers import QuantizedEinsum

__all__ = ["QuantizedAttention"]

_Op = QuantizedEinsum | None


def _einsum(
    op: _Op, subscripts: str, lhs: jax.Array, rhs: jax.Array, **kwargs: Any
) -> jax.Array:
    if op is None:
        return jnp.einsum(subscripts, lhs, rhs, **kwargs)
    return op(subscripts, lhs, rhs, **kwargs)


def _as_op(name: str, op: Any, rngs: Any) -> _Op:
    if op is None or isinstance(op, QuantizedEinsum):
        return op
    try:
        return QuantizedEinsum(op, rngs=rngs, where=name)
    except InvalidArgumentError as e:
        if e.argument != "config":
            raise
        raise InvalidArgumentError(
            "QuantizedAttention",
            name,
            op,
            "a qbits.nnx.QuantizedEinsum, a qbits.DotGeneralConfig, a preset "
            "name or None (float)",
        ) from None


class QuantizedAttention(nnx.Module):
    """An ``attention_fn`` for ``nnx.MultiHeadAttention`` with quantized einsums.

    It takes the arguments of ``nnx.dot_product_attention`` and computes the
    same attention, with ``qk`` for the logits ``q . k`` and ``pv`` for the
    weighted sum of the values. :func:`qbits.nnx.quantize` puts one into every
    ``nnx.MultiHeadAttention`` whose ``attention_fn`` is Flax's default and
    whose ``<path>/qk`` or ``<path>/pv`` matches a rule.

    In ``qk`` the lhs is the (scaled) query and the rhs the key, contracted
    over the head depth; in ``pv`` the lhs is the attention weights and the
    rhs the value, contracted over the key positions.

    Args:
      qk: The ``q . k`` einsum: a :class:`~qbits.nnx.QuantizedEinsum`, a
        :class:`~qbits.DotGeneralConfig` or a preset name, or ``None`` for
        float (``jnp.einsum``).
      pv: The ``weights . v`` einsum, likewise.
      rngs: Where stochastic rounding draws its keys when ``qk`` or ``pv`` is
        a config that needs them (see :class:`~qbits.nnx.QuantizedEinsum`).

    Raises:
      InvalidArgumentError: For a ``qk`` or ``pv`` of another type, or a
        config that rounds stochastically without ``rngs``.

    Example:
      >>> import flax.nnx as nnx
      >>> attn = nnx.MultiHeadAttention(
      ...     4, 16, decode=False, rngs=nnx.Rngs(0),
      ...     attention_fn=qbits.nnx.QuantizedAttention("int8_fwd", "int8_fwd"))
      >>> nnx.jit(lambda m, x: m(x))(attn, jnp.ones((2, 5, 16))).shape
      (2, 5, 16)
    """

    def __init__(
        self,
        qk: QuantizedEinsum | Any = None,
        pv: QuantizedEinsum | Any = None,
        *,
        rngs: nnx.Rngs | nnx.RngStream | None = None,
    ):
        self.qk = _as_op("qk", qk, rngs)
        self.pv = _as_op("pv", pv, rngs)

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: jax.Array | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: Any = None,
        precision: Any = None,
        module: nnx.Module | None = None,
        promote_dtype: Any = dtypes.promote_dtype,
        is_causal: bool = False,
    ) -> jax.Array:
        """Computes ``nnx.dot_product_attention`` with the quantized einsums.

        Args:
          query: ``[batch..., q_length, num_heads, depth]``.
          key: ``[batch..., kv_length, num_kv_heads, depth]``.
          value: ``[batch..., kv_length, num_kv_heads, v_depth]``.
          bias: Added to the logits, broadcastable to
            ``[batch..., num_heads, q_length, kv_length]``.
          mask: Where ``False``, the weights are masked out; broadcastable as
            ``bias``.
          broadcast_dropout: Dropout shared along the batch and head axes.
          dropout_rng: Key of the dropout.
          dropout_rate: Probability of dropping a weight.
          deterministic: No dropout when ``True``.
          dtype: Dtype of the computation (default: from the inputs).
          precision: Precision of the einsums on the second route.
          module: The Module that sows the weights into ``nnx.Intermediate``.
          promote_dtype: As in ``nnx.dot_product_attention``.
          is_causal: Apply a causal mask.

        Returns:
          ``[batch..., q_length, num_heads, v_depth]``.
        """
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
        if key.shape[-3] != value.shape[-3]:
            raise ValueError(
                f"k, v lengths must match, but got {key.shape[-3]} and "
                f"{value.shape[-3]}."
            )
        if dropout_rate == 0.0 and module is None:
            return self._fused_route(query, key, value, bias, mask, is_causal)
        weights = self._weights(
            query,
            key,
            bias,
            mask,
            broadcast_dropout,
            dropout_rng,
            dropout_rate,
            deterministic,
            precision,
            module,
            is_causal,
        )
        q_heads, v_heads = weights.shape[-3], value.shape[-2]
        if q_heads == v_heads:
            return _einsum(
                self.pv, "...hqk,...khd->...qhd", weights, value, precision=precision
            )
        if q_heads % v_heads:
            raise ValueError(
                f"Query heads ({q_heads}) must be multiple of Value heads ({v_heads})"
            )
        groups = q_heads // v_heads
        weights = weights.reshape(
            (*weights.shape[:-3], v_heads, groups, *weights.shape[-2:])
        )
        out = _einsum(
            self.pv, "...hgqk,...khd->...qhgd", weights, value, precision=precision
        )
        return out.reshape((*out.shape[:-3], q_heads, out.shape[-1]))

    def _weights(
        self,
        query: jax.Array,
        key: jax.Array,
        bias: jax.Array | None,
        mask: jax.Array | None,
        broadcast_dropout: bool,
        dropout_rng: jax.Array | None,
        dropout_rate: float,
        deterministic: bool,
        precision: Any,
        module: nnx.Module | None,
        is_causal: bool,
    ) -> jax.Array:
        """``nnx.dot_product_attention_weights`` with the ``qk`` einsum."""
        dtype = query.dtype
        if query.shape[-1] != key.shape[-1]:
            raise ValueError(
                f"q, k depths must match, but got {query.shape[-1]} and "
                f"{key.shape[-1]}."
            )
        q_heads, k_heads = query.shape[-2], key.shape[-2]
        grouped = q_heads != k_heads
        if grouped:
            if q_heads % k_heads:
                raise ValueError(
                    f"Query heads ({q_heads}) must be multiple of Key heads "
                    f"({k_heads}) for Grouped Query Attention."
                )
            query = query.reshape(
                (*query.shape[:-2], k_heads, q_heads // k_heads, query.shape[-1])
            )
            subscripts = "...qhgd,...khd->...hgqk"
        else:
            subscripts = "...qhd,...khd->...hqk"
        query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
        weights = _einsum(self.qk, subscripts, query, key, precision=precision)
        if grouped:
            weights = weights.reshape(
                (*weights.shape[:-4], q_heads, *weights.shape[-2:])
            )
        if bias is not None:
            weights = weights + bias
        if mask is not None or is_causal:
            masks = [m for m in [mask] if m is not None]
            if is_causal:
                t, s = weights.shape[-2:]
                causal = jnp.tril(jnp.ones((t, s), dtype=dtype))
                target = mask.shape if mask is not None else weights.shape
                masks.append(jnp.broadcast_to(causal, target))
            combined = nnx.combine_masks(*masks, dtype=dtype)
            weights = jnp.where(combined, weights, jnp.finfo(dtype).min)
        weights = jax.nn.softmax(weights).astype(dtype)
        if module:
            module.sow(nnx.Intermediate, "attention_weights", weights)
        if not deterministic and dropout_rate > 0.0:
            keep_prob = 1.0 - dropout_rate
            ndim = key.ndim
            if broadcast_dropout:
                shape = (1,) * (ndim - 2) + weights.shape[-2:]
            else:
                shape = weights.shape
            keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
            multiplier = keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype)
            weights = weights * multiplier
        return weights

    def _fused_route(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None,
        mask: jax.Array | None,
        is_causal: bool,
    ) -> jax.Array:
        """``jax.nn.dot_product_attention`` (XLA) with the two einsums."""
        query_shape = query.shape
        if len(query_shape) > 4:  # nnx folds the batch axes into one

            def fold(x: jax.Array | None) -> jax.Array | None:
                if x is None:
                    return None
                return jnp.reshape(x, (math.prod(x.shape[:-3]), *x.shape[-3:]))

            query, key, value, bias, mask = map(fold, (query, key, value, bias, mask))
        if mask is not None:
            mask = mask.astype(jnp.bool)

        def four_d(x: jax.Array | None) -> jax.Array | None:
            if x is None or x.ndim >= 4:
                return x
            return jnp.expand_dims(x, tuple(range(4 - x.ndim)))

        query, key, value, bias, mask = map(four_d, (query, key, value, bias, mask))
        b, t, n, h = query.shape
        _, _s, k, _ = key.shape
        if n % k:
            raise ValueError(
                "The number of query heads must be a multiple of key/value "
                f"heads, but got {n} vs {k}"
            )
        g = n // k

        def grouped(x: jax.Array | None) -> jax.Array | None:
            if x is None:
                return None
            xb, xn, xt, xs = x.shape
            if xn == 1:
                return jnp.broadcast_to(x[:, :, None], (xb, xn, g, xt, xs))
            return jnp.reshape(x, (xb, k, g, xt, xs))

        bias, mask = grouped(bias), grouped(mask)
        query = jnp.reshape(query, (b, t, k, g, h))
        logits_dtype = jnp.promote_types(query.dtype, np.float32)
        logits = self._logits(query, key, logits_dtype)
        logits *= jnp.array(1.0 / np.sqrt(h), dtype=logits.dtype)
        if bias is not None:
            logits = (logits + bias).astype(logits.dtype)
        if mask is not None or is_causal:
            keep = jnp.ones_like(logits, dtype=bool)
            if mask is not None:
                keep = jnp.logical_and(keep, mask)
            if is_causal:
                tt, ss = logits.shape[-2:]
                keep = jnp.logical_and(keep, jnp.tril(jnp.ones((tt, ss), dtype=bool)))
            big = min(jnp.finfo(logits.dtype).max, jnp.finfo(np.float32).max)
            logits = jnp.where(keep, logits, jnp.asarray(-0.7 * big, logits.dtype))
        probs = jax.nn.softmax(logits.astype(np.float32), axis=-1).astype(key.dtype)
        out = _einsum(self.pv, "BKGTS,BSKH->BTKGH", probs, value)
        return jnp.reshape(out, query_shape)

    def _logits(self, query: jax.Array, key: jax.Array, logits_dtype: Any) -> jax.Array:
        """The grouped ``q . k`` einsum, with the precision JAX picks."""
        subscripts = "BTKGH,BSKH->BKGTS"
        quantized = self.qk is not None and not self.qk.config.fwd.is_identity
        precision = None
        if not quantized and query.dtype == jnp.bfloat16:
            precision = lax.DotAlgorithmPreset.BF16_BF16_F32
        elif not quantized and query.dtype == np.float16:
            precision = lax.DotAlgorithmPreset.F16_F16_F32
        if precision is not None:
            try:  # as JAX: the preset fails on platforms that lack it
                return _einsum(
                    self.qk,
                    subscripts,
                    query,
                    key,
                    precision=precision,
                    preferred_element_type=logits_dtype,
                )
            except Exception:
                pass
        return _einsum(
            self.qk, subscripts, query, key, preferred_element_type=logits_dtype
        )
