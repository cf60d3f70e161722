"""A small mixture-of-experts block: a top-k router, the experts one ragged dot.

The example of a grouped matmul (``benchmarks/moe.py`` trains it; the tests
quantize it): each token goes to the ``top_k`` experts its router scores
highest; the token copies are sorted by expert, so that each expert's rows
are consecutive, and every expert's two matmuls run as one
``lax.ragged_dot`` each, with the experts' token counts as group sizes. The
outputs are weighted by the router's softmax over the chosen experts and
added back to their tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["init_moe", "moe"]


def init_moe(
    key: jax.Array, d_model: int, d_hidden: int, n_experts: int
) -> dict[str, jax.Array]:
    """Parameters of :func:`moe`: ``router``, ``w_in`` and ``w_out``.

    Example:
      >>> from qbits._experiments._moe import init_moe
      >>> p = jax.eval_shape(lambda k: init_moe(k, 8, 16, 4), jax.random.key(0))
      >>> {k: v.shape for k, v in p.items()}
      {'router': (8, 4), 'w_in': (4, 8, 16), 'w_out': (4, 16, 8)}
    """
    k_router, k_in, k_out = jax.random.split(key, 3)
    shapes = {
        "router": (k_router, (d_model, n_experts), d_model),
        "w_in": (k_in, (n_experts, d_model, d_hidden), d_model),
        "w_out": (k_out, (n_experts, d_hidden, d_model), d_hidden),
    }
    return {
        name: jax.random.normal(k, shape) / math.sqrt(fan_in)
        for name, (k, shape, fan_in) in shapes.items()
    }


def moe(
    params: dict[str, jax.Array],
    x: jax.Array,
    top_k: int = 2,
    *,
    ragged_dot: Callable[..., jax.Array] = lax.ragged_dot,
    dot_general: Callable[..., jax.Array] = lax.dot_general,
) -> jax.Array:
    """The mixture of experts of ``x`` ``[tokens, d_model]``, same shape.

    Args:
      params: From :func:`init_moe`.
      x: The tokens.
      top_k: Experts per token.
      ragged_dot: The grouped matmul (``lax.ragged_dot`` or a quantized one,
        :func:`qbits.ops.ragged_dot`).
      dot_general: The router's matmul.

    Example:
      >>> from qbits._experiments._moe import moe
      >>> p = {"router": jnp.ones((8, 4)), "w_in": jnp.ones((4, 8, 16)),
      ...      "w_out": jnp.ones((4, 16, 8))}
      >>> jax.eval_shape(moe, p, jnp.ones((5, 8))).shape
      (5, 8)
    """
    n_experts = params["w_in"].shape[0]
    logits = dot_general(x, params["router"], (((1,), (0,)), ((), ())))
    top, expert = lax.top_k(logits, top_k)
    gate = jax.nn.softmax(top, axis=-1).reshape(-1)
    chosen = expert.reshape(-1)
    order = jnp.argsort(chosen, stable=True)  # token copies grouped by expert
    token = order // top_k
    sizes = jnp.bincount(chosen, length=n_experts).astype(jnp.int32)
    h = jax.nn.gelu(ragged_dot(x[token], params["w_in"], sizes))
    y = ragged_dot(h, params["w_out"], sizes) * gate[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)
