"""Serving params: a function's (or linen model's) stored low-precision weights.

:func:`convert_params` traces the function as :func:`qbits.quantize` does
(:func:`qbits.intercept.store_weights`) and stores every weight matmul
whose forward config quantizes the weight: custom layers, einsum weights,
``x @ w``, tied heads and scanned layers as much as Flax's own ``Dense``.
Each stored weight is the QTensor the training (QAT) forward pass computes
at every step, in the ``qbits_serving`` collection at the matmul's path;
the float parameter it replaces leaves the variables (unless something
else reads it, as an embedding lookup reads a tied head's table).
Everything else (biases, norms, embeddings, float matmuls) is unchanged.
The layout of every stored weight, and its forward config, ride along as
static metadata (:class:`~qbits.serving.LayerInfo`), also under ``jax.jit``.

:func:`serve_params` runs the function with ``qbits.quantize(fn, config,
stored=...)``: the stored matmuls on their stored weights, every other
quantized matmul quantizing on the fly, as in training. Its output equals
``qbits.quantize(fn, config)`` on the float parameters bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.core import unfreeze

from qbits import intercept
from qbits._errors import InvalidArgumentError
from qbits.config import QuantConfig, as_quant_config
from qbits.serving._layout import (
    COLLECTION,
    LayerInfo,
    check_layers,
    check_stored,
    fingerprint,
    forward_only,
    rule_path,
    stored_qtensor,
)

__all__ = ["ServingParams", "convert_params", "get_path", "serve_params"]


class ServingParams(struct.PyTreeNode):
    """The variables of a served model or function, with their stored layout.

    A pytree: ``variables`` are its leaves (pass it through ``jax.jit``);
    ``layers`` is static metadata, available while tracing.

    Attributes:
      variables: The float variables (a linen model's ``{"params": ...}``,
        or a function's parameter dict) without the parameters that stored
        weights replace, plus a ``"qbits_serving"`` entry: per stored weight
        ``{"qvalue", "scale"}`` at its matmul's path.
      layers: One :class:`~qbits.serving.LayerInfo` per stored weight.

    Example:
      >>> import flax.linen as nn
      >>> x = jnp.ones((2, 8))
      >>> params = nn.Dense(4).init(jax.random.key(0), x)
      >>> sp = qbits.serving.convert(nn.Dense(4), "int8_fwd", params, x)
      >>> jax.tree.map(lambda a: a.dtype.name, sp.variables)
      {'params': {'bias': 'float32'},
       'qbits_serving': {'kernel': {'qvalue': 'int8', 'scale': 'float32'}}}
    """

    variables: Any
    layers: tuple[LayerInfo, ...] = struct.field(pytree_node=False, default=())

    def layer(self, path: str) -> LayerInfo:
        """The stored weight of the matmul at ``path``.

        Raises:
          KeyError: If no stored weight has that path.
        """
        for info in self.layers:
            if info.path == path:
                return info
        raise KeyError(path)


def _variables(owner: str, variables: Any) -> dict[str, Any]:
    """The float variables as a plain nested dict, checked."""
    if not isinstance(variables, Mapping):
        raise InvalidArgumentError(
            owner,
            "variables",
            type(variables).__name__,
            "the float variables as a dict: a linen model's model.init(...), "
            "or a function's parameters (for nnx: nnx.to_pure_dict(state) from "
            "graphdef, state = nnx.split(model), with fn = lambda p, x: "
            "nnx.merge(graphdef, p)(x))",
        )
    variables = unfreeze(variables)
    if COLLECTION in variables:
        raise InvalidArgumentError(
            owner,
            "variables",
            f"variables with a {COLLECTION!r} entry",
            "float variables",
            why="they are converted already",
        )
    return variables


def _key(node: Mapping[Any, Any], part: str) -> Any:
    """The key of ``node`` a path segment names (``"0"`` names ``0``)."""
    if part not in node and part.isdigit() and int(part) in node:
        return int(part)
    return part


def get_path(tree: Mapping[Any, Any], path: str) -> Any:
    """The node at ``path`` (``"a/b"``; ``""`` is ``tree`` itself)."""
    for p in path.split("/") if path else ():
        tree = tree[_key(tree, p)]
    return tree


def _dict_keys(keys: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The dict keys of a key path, or ``None`` if it passes anything else."""
    if not all(isinstance(k, jax.tree_util.DictKey) for k in keys):
        return None
    return tuple(k.key for k in keys)


def convert_params(
    owner: str,
    fn: Callable[..., Any],
    config: Any,
    variables: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> ServingParams:
    """Serving params of ``fn(variables, *args, **kwargs)``; see ``convert``."""
    original = as_quant_config(owner, config)
    fwd = forward_only(original)
    variables = _variables(owner, variables)
    stored = intercept.store_weights(fn, fwd, variables, *args, **kwargs)
    served = jax.tree.map(lambda x: x, variables)  # new dicts, the same arrays
    weights: dict[str, Any] = {}
    infos = []
    for name, s in stored.items():
        keys = _dict_keys(s.keys) if s.exclusive else None
        if keys is not None:
            parent = served
            for k in keys[:-1]:
                parent = parent[k]
            parent.pop(keys[-1], None)  # another stored matmul may share it
        node = weights
        for part in name.split("/"):
            node = node.setdefault(part, {})
        node.update(qvalue=s.weight.qvalue, scale=s.weight.scale)
        cfg = fwd.resolve(rule_path(name)).config.fwd
        dropped = {}
        if keys is not None:
            dropped = dict(
                param="/".join(map(str, keys)),
                param_shape=s.shape,
                param_dtype=np.dtype(s.dtype).name,
            )
        infos.append(
            LayerInfo(
                path=name,
                kind=s.kind,
                shape=tuple(int(n) for n in s.weight.shape),
                dtype=np.dtype(s.weight.dtype).name,
                contracting=s.contracting,
                qdtype=np.dtype(cfg.rhs.numerics.get_dtype()).name,
                packed=s.weight.packed_axis is not None,
                config=fingerprint(cfg),
                name=original.resolve(rule_path(name)).name or "",
                **dropped,
            )
        )
    served[COLLECTION] = weights
    return ServingParams(served, tuple(infos))


def _unpack(owner: str, config: QuantConfig, serving: Any) -> tuple[Any, dict]:
    """The float variables to trace with, and the stored QTensors by path."""
    if not isinstance(serving, ServingParams):
        why = "these are not serving params"
        if isinstance(serving, Mapping):
            why = "these look like float variables: run convert first"
        raise InvalidArgumentError(
            owner,
            "serving",
            type(serving).__name__,
            "qbits.serving.ServingParams from qbits.serving.convert(model, "
            "config, variables, *sample_inputs) or qbits.serving.restore",
            why=why,
        )
    check_layers(owner, forward_only(config), config, serving.layers)
    weights = serving.variables.get(COLLECTION, {})
    variables = jax.tree.map(  # new dicts to fill
        lambda x: x, {k: v for k, v in serving.variables.items() if k != COLLECTION}
    )
    stored = {}
    filled = set()  # parameters replaced by zeros (several matmuls may share one)
    for info in serving.layers:
        arrays = get_path(weights, info.path)
        check_stored(owner, info, arrays["qvalue"], arrays["scale"])
        stored[info.path] = stored_qtensor(info, arrays["qvalue"], arrays["scale"])
        if info.param and info.param not in filled:  # any value of its shape
            parents, _, leaf = info.param.rpartition("/")
            node = get_path(variables, parents)
            leaf = _key(node, leaf)
            if leaf in node:
                raise InvalidArgumentError(
                    owner,
                    "serving",
                    f"serving params holding a float {info.param!r}",
                    "the serving params from qbits.serving.convert",
                    why=f"the matmul {info.path!r} serves a stored "
                    f"{info.qdtype} weight in its place",
                )
            node[leaf] = jnp.zeros(info.param_shape, info.param_dtype)
            filled.add(info.param)
    return variables, stored


def serve_params(
    owner: str, fn: Callable[..., Any], config: QuantConfig
) -> Callable[..., Any]:
    """``served(serving_params, *args, **kwargs)`` running ``fn`` on them."""

    def served(serving: Any, *args: Any, **kwargs: Any) -> Any:
        variables, stored = _unpack(owner, config, serving)
        run = intercept.quantize(fn, forward_only(config), stored=stored)
        return run(variables, *args, **kwargs)

    return served
