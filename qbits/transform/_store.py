"""``store_weights``: the quantized weights of a function, stored once.

Serving computes a trained model's forward pass on weights quantized once
instead of at every call. The function is traced as :func:`qbits.quantize`
traces it; every weight matmul whose forward config quantizes the weight
(``fwd.rhs``) gets the weight as that forward pass quantizes it: the same
quantizer, on the operand as the matmul sees it (after the model's own
reshapes, transposes and dtype casts), along its contracting axes, stacked
along the scans it runs in. ``qbits.quantize(fn, config, stored=...)``
then runs those matmuls on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qbits._tensor import QTensor
from qbits.config import _as_quant_config
from qbits.transform._plan import Caller, Plan
from qbits.transform._program import merge, trace
from qbits.transform._runner import Frame, run_program

__all__ = ["StoredMatmul", "store_weights"]


@dataclasses.dataclass(frozen=True)
class StoredMatmul:
    """One weight matmul's stored weight.

    Attributes:
      path: The matmul's path (as in :func:`qbits.layer_table`).
      weight: The quantized weight, in the storage dtype (int4 packed two
        per byte along the last axis), stacked along the scans that slice
        the parameter (one slice per scanned layer); a loop that uses the
        same weight every iteration stores it once.
      keys: The key path of the parameter feeding it, inside the
        parameters argument (``jax.tree_util`` keys).
      shape: The parameter's shape.
      dtype: The parameter's dtype.
      contracting: The weight axes the matmul contracts (per layer).
      kind: The matmul's kind, as in the layer table.
      exclusive: Whether stored matmuls are all that read the parameter:
        a server can then drop its float copy (a tied embedding, also read
        by its lookup, is not exclusive).
    """

    path: str
    weight: QTensor
    keys: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: Any
    contracting: tuple[int, ...]
    kind: str
    exclusive: bool


def store_weights(
    caller: Caller,
    fn: Callable[..., Any],
    config: Any,
    *args: Any,
    params_argnum: int = 0,
    on_the_fly: dict[str, str] | None = None,
    **kwargs: Any,
) -> dict[str, StoredMatmul]:
    """Every weight matmul's weight, quantized once as its forward does.

    The one path from float weights to stored ones
    (:func:`qbits.serving.convert`, :mod:`qbits.ptq`, :mod:`qbits.lora`),
    its errors naming ``caller``.

    Args:
      caller: Who calls (named in errors).
      fn: The function, as for :func:`qbits.quantize`.
      config: The rules it runs with (only forward matmuls matter).
      *args: Arguments for ``fn``; ``args[params_argnum]`` holds the float
        parameters (concrete arrays); other arrays may be
        ``jax.ShapeDtypeStruct`` s (only their shapes matter).
      params_argnum: Which positional argument holds the parameters.
      on_the_fly: If given, filled with ``{matmul path: where}`` for each
        weight matmul whose config quantizes its weight but whose weight is
        not stored, being quantized at every call: in a ``cond``, ``while``
        or ``shard_map`` body (``"in a shard_map body"``), or a convolution
        or ragged dot (``"a convolution"``).
      **kwargs: Keyword arguments for ``fn``.

    Returns:
      ``{matmul path: StoredMatmul}`` for each weight matmul whose forward
      config quantizes the weight; convolutions and matmuls inside a
      ``cond``, ``while`` or ``shard_map`` body are left out (served quantizing on the
      fly). ``qbits.quantize(fn, config, stored=...)`` takes it as it is.

    Raises:
      ConfigError: For a weight matmul whose forward config keeps scale
        state or rounds stochastically.
    """
    quant = _as_quant_config(caller.owner, config, allow_none=True)
    program = trace(fn, args, kwargs, params_argnum, caller.owner)
    plan = Plan(program, quant, caller, store=True)
    if on_the_fly is not None:
        on_the_fly.update(plan.on_the_fly)
    leaves = [
        jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
        for x in jax.tree.leaves((args, kwargs))
    ]
    dyn = [x for x, d in zip(leaves, program.dynamic, strict=True) if d]

    @jax.jit
    def collect_weights(dyn: list[Any]) -> dict[str, QTensor]:
        # Only the weights are returned: XLA drops the activations' work.
        full = merge(program.dynamic, dyn, program.statics)
        a, k = jax.tree.unflatten(program.in_tree, full)
        collect: dict[str, Any] = {}
        run_program(program, plan, Frame(None, {}, collect), a, k)
        return collect

    collect = collect_weights(dyn)
    sites = {site.ctx: site for site in program.sites}
    # A parameter can be dropped when every matmul reading it is stored.
    others = {w for ctx, site in sites.items() if ctx not in plan.stored
              for w in site.lhs | site.rhs}  # fmt: skip
    params = dict(jax.tree_util.tree_flatten_with_path(args[params_argnum])[0])
    out = {}
    for ctx, name in plan.stored.items():
        site = sites[ctx]
        weight = next(iter(site.weights))
        leaf = params[weight.keys]
        qt = collect[name]
        ndim = len(qt.shape) - len(weight.sliced)  # the weight of one layer
        lhs_axes, rhs_axes = site.contracting
        axes = lhs_axes if ctx in plan.swapped else rhs_axes
        out[name] = StoredMatmul(
            path=name,
            weight=qt,
            keys=weight.keys,
            shape=tuple(int(n) for n in leaf.shape),
            dtype=leaf.dtype,
            contracting=tuple(int(a) % ndim for a in axes),
            kind=site.kind,
            exclusive=weight not in program.escaped and weight not in others,
        )
    return out
