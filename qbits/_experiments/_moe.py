"""A small mixture-of-experts block: a top-k router, the experts one ragged dot.

The example of a grouped matmul (``benchmarks/moe.py`` trains it; the tests
quantize it): each token goes to the ``top_k`` experts its router scores
highest; the token copies are sorted by expert, so that each expert's rows
are consecutive, and every expert's two matmuls run as one
``lax.ragged_dot`` each, with the experts' token counts as group sizes. The
outputs are weighted by the router's softmax over the chosen experts and
added back to their tokens.

:func:`moe_expert_parallel` is the same block with the experts split over a
mesh axis (expert parallelism, inside ``jax.shard_map``): each device routes
its own tokens, sends each token copy to the device that holds its expert
(one ``all_to_all``), runs its local experts as one ragged dot each, and
sends the outputs back (a second ``all_to_all``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from qbits._errors import InvalidArgumentError
from qbits._granularity import PerTensor

__all__ = ["init_moe", "moe", "moe_expert_parallel"]


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


def _route(
    params: dict[str, jax.Array],
    x: jax.Array,
    top_k: int,
    n_experts: int,
    dot_general: Callable[..., jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The token copies sorted by expert: ``(token, gate, sizes)``.

    The copies (``top_k`` per token) sorted by expert, stably: ``token`` is
    each one's token, ``gate`` its router weight; ``sizes`` the copies of
    each expert.
    """
    logits = dot_general(x, params["router"], (((1,), (0,)), ((), ())))
    top, expert = lax.top_k(logits, top_k)
    gate = jax.nn.softmax(top, axis=-1).reshape(-1)
    chosen = expert.reshape(-1)
    order = jnp.argsort(chosen, stable=True)  # token copies grouped by expert
    sizes = jnp.bincount(chosen, length=n_experts).astype(jnp.int32)
    return order // top_k, gate[order], sizes


def _experts(
    params: dict[str, jax.Array],
    rows: jax.Array,
    sizes: jax.Array,
    ragged_dot: Callable[..., jax.Array],
    activation: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Each expert's two matmuls on its rows (sorted by expert)."""
    h = activation(ragged_dot(rows, params["w_in"], sizes))
    return ragged_dot(h, params["w_out"], sizes)


def moe(
    params: dict[str, jax.Array],
    x: jax.Array,
    top_k: int = 2,
    *,
    ragged_dot: Callable[..., jax.Array] = lax.ragged_dot,
    dot_general: Callable[..., jax.Array] = lax.dot_general,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
) -> jax.Array:
    """The mixture of experts of ``x`` ``[tokens, d_model]``, same shape.

    Args:
      params: From :func:`init_moe`.
      x: The tokens.
      top_k: Experts per token.
      ragged_dot: The grouped matmul (``lax.ragged_dot`` or a quantized one,
        :func:`qbits.ops.ragged_dot`).
      dot_general: The router's matmul.
      activation: Between each expert's two matmuls.

    Example:
      >>> from qbits._experiments._moe import moe
      >>> p = {"router": jnp.ones((8, 4)), "w_in": jnp.ones((4, 8, 16)),
      ...      "w_out": jnp.ones((4, 16, 8))}
      >>> jax.eval_shape(moe, p, jnp.ones((5, 8))).shape
      (5, 8)
    """
    n_experts = params["w_in"].shape[0]
    token, gate, sizes = _route(params, x, top_k, n_experts, dot_general)
    y = _experts(params, x[token], sizes, ragged_dot, activation) * gate[:, None]
    return jnp.zeros_like(x).at[token].add(y)


def _check_shard_local(ragged_dot: Callable[..., jax.Array]) -> None:
    """Refuses a quantized ragged dot with a scale across experts.

    Raises:
      InvalidArgumentError: For a per-tensor scale computed from the
        tensor (not given by a scale provider): on one shard it would be
        the amax of that shard's experts and rows only.
    """
    config = getattr(ragged_dot, "config", None)
    for matmul in ("fwd", "dlhs", "drhs") if config is not None else ():
        for side in ("lhs", "rhs"):
            q = getattr(getattr(config, matmul), side)
            if q.numerics.is_identity or q.provider is not None:
                continue
            if isinstance(q.granularity, PerTensor):
                raise InvalidArgumentError(
                    "moe_expert_parallel",
                    f"ragged_dot.config.{matmul}.{side}.granularity",
                    q.granularity,
                    "PerChannel() (scales per row and per expert, as the int8 "
                    "presets have them)",
                    why="a per-tensor scale spans all experts; each shard "
                    "would compute it from its own experts' rows only",
                )


def moe_expert_parallel(
    params: dict[str, jax.Array],
    x: jax.Array,
    top_k: int = 2,
    *,
    axis_name: str,
    ragged_dot: Callable[..., jax.Array] = lax.ragged_dot,
    dot_general: Callable[..., jax.Array] = lax.dot_general,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
) -> jax.Array:
    """:func:`moe` with its experts split over the mesh axis ``axis_name``.

    Call it inside ``jax.shard_map`` with the tokens ``x`` and the experts
    (``w_in``, ``w_out``) split along ``axis_name`` and the router
    replicated: device ``i`` holds experts ``i * e .. (i + 1) * e - 1`` of
    ``n = d * e`` (``d`` devices). Each device routes its own tokens, sends
    every token copy to its expert's device (one ``lax.all_to_all``, with
    the copies' expert counts), runs its ``e`` experts as :func:`moe` does
    (one ragged dot per matmul, rows sorted by expert), and sends the
    outputs back (a second ``all_to_all``). Every expert sees its rows in
    the order :func:`moe` gives them on the whole batch (the tokens split
    in contiguous blocks), so with scales per row and per expert the
    quantized outputs and gradients are :func:`moe`'s, bit for bit.

    The buffers hold every copy a device could receive (``d x tokens x
    top_k`` rows: nothing is dropped, whatever the routing).

    Args:
      params: From :func:`init_moe`, the experts split along ``axis_name``.
      x: This device's tokens.
      top_k: Experts per token.
      axis_name: The mesh axis the experts (and tokens) are split along.
      ragged_dot: As for :func:`moe`.
      dot_general: As for :func:`moe`.
      activation: As for :func:`moe`.

    Raises:
      InvalidArgumentError: For a quantized ``ragged_dot`` with a per-tensor
        scale computed from its tensor (it would span experts: one shard's
        amax is not the whole tensor's).

    Example:
      >>> from qbits._experiments._moe import init_moe, moe_expert_parallel
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("expert",),
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> p = jax.eval_shape(lambda k: init_moe(k, 8, 16, 4), jax.random.key(0))
      >>> specs = {"router": P(), "w_in": P("expert"), "w_out": P("expert")}
      >>> f = jax.shard_map(
      ...     lambda p, x: moe_expert_parallel(p, x, axis_name="expert"),
      ...     mesh=mesh, in_specs=(specs, P("expert")), out_specs=P("expert"))
      >>> jax.eval_shape(f, p, jnp.ones((6, 8))).shape
      (6, 8)
    """
    _check_shard_local(ragged_dot)
    local = params["w_in"].shape[0]
    devices = lax.axis_size(axis_name)
    token, gate, sizes = _route(params, x, top_k, local * devices, dot_general)
    copies = token.shape[0]
    # Sorted by expert, the copies are sorted by device: device j's block
    # of the send buffer (``copies`` rows) starts with its copies.
    counts = sizes.reshape(devices, local)
    per_device = counts.sum(axis=1)
    dest = jnp.repeat(jnp.arange(devices), per_device, total_repeat_length=copies)
    first = jnp.cumsum(per_device) - per_device
    slot = dest * copies + jnp.arange(copies) - first[dest]
    send = jnp.zeros((devices * copies, x.shape[1]), x.dtype).at[slot].set(x[token])
    rows = lax.all_to_all(send, axis_name, 0, 0, tiled=True)
    got = lax.all_to_all(counts, axis_name, 0, 0, tiled=True)  # [source, expert]
    # The received rows, block by source, each sorted by local expert; the
    # unused ones (expert ``local``) go last, past every group.
    ends = jnp.cumsum(got, axis=1)
    at = jnp.arange(copies)
    expert = jnp.sum(at[None, None, :] >= ends[:, :, None], axis=1).reshape(-1)
    by_expert = jnp.argsort(expert, stable=True)
    y = _experts(params, rows[by_expert], got.sum(axis=0), ragged_dot, activation)
    y = jnp.zeros_like(y).at[by_expert].set(y)
    back = lax.all_to_all(y, axis_name, 0, 0, tiled=True)
    return jnp.zeros_like(x).at[token].add(back[slot] * gate[:, None])
