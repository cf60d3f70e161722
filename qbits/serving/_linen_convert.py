"""Converting a linen model's float variables into serving params.

The model is traced abstractly (``jax.eval_shape``) on sample inputs under
an interceptor that records every ``nn.Dense`` / ``nn.DenseGeneral`` whose
forward config quantizes the weight: its path, kernel shape and contracting
axes (as flax computes them for that input) and its dtype. Each recorded
kernel is then quantized once, outside the trace, by
:func:`~qbits.serving._layout.store_weight`.
"""

from __future__ import annotations

import inspect
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta, unfreeze

from qbits._errors import InvalidArgumentError
from qbits.config import QuantConfig, as_quant_config
from qbits.flax import Quantized
from qbits.ops import Dims
from qbits.serving._layout import (
    COLLECTION,
    LayerInfo,
    check_servable,
    fingerprint,
    forward_only,
    store_weight,
    stores_weight,
)
from qbits.serving._linen import (
    _DENSE,
    Served,
    ServingParams,
    _as_method,
    _dense_layout,
    _fn,
    _path,
    _show,
)

__all__ = ["convert_linen"]


class _Collector:
    """Interceptor of the conversion trace: records every Dense to store."""

    def __init__(self, config: QuantConfig, original: QuantConfig):
        self.config = config
        self.original = original
        self.found: dict[str, tuple[tuple[str, ...], nn.Module, LayerInfo]] = {}

    def intercept(self, next_fun, args, kwargs, context):
        kind = _DENSE.get(getattr(context.orig_method, "func", None))
        module = context.module
        if kind is None or module.dot_general is not None:
            return next_fun(*args, **kwargs)
        if module.dot_general_cls is not None:
            return next_fun(*args, **kwargs)
        path = _path(module)
        res = self.config.resolve(path)
        if not stores_weight(res.config) or path in self.found:
            return next_fun(*args, **kwargs)
        check_servable("qbits.serving.convert", path, res.config.fwd, res.where)
        inputs = jnp.asarray(args[0])
        dn, shape, _, _ = _dense_layout(module, inputs)
        kernel = module.get_variable("params", "kernel")
        if kernel is None:
            raise InvalidArgumentError(
                "qbits.serving.convert",
                "params",
                f"params without {path}/kernel",
                "the float model's variables (model.init(...))",
                why=f"layer {_show(path)} has no 'kernel'",
            )
        kernel = meta.unbox(kernel)
        dims = Dims.create(dn, inputs.ndim, len(shape))
        info = LayerInfo(
            path=path,
            kind=kind,
            shape=tuple(int(n) for n in shape),
            dtype=np.dtype(kernel.dtype).name,
            contracting=dims.rhs_contract,
            qdtype=np.dtype(res.config.fwd.rhs.numerics.get_dtype()).name,
            packed=False,
            config=fingerprint(res.config.fwd),
            name=self.original.resolve(path).name or "",
        )
        self.found[path] = (tuple(str(p) for p in module.path), module.dtype, info)
        return next_fun(*args, **kwargs)


class _Run(nn.Module):
    """Runs ``model`` under an interceptor, sharing its scope."""

    model: nn.Module
    interceptor: Any
    method: Any = "__call__"

    def setup(self) -> None:
        nn.share_scope(self, self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with nn.intercept_methods(self.interceptor.intercept):
            return _fn(self.method, self.model)(*args, **kwargs)


def _variables(owner: str, variables: Any) -> dict[str, Any]:
    if not isinstance(variables, dict) and not hasattr(variables, "keys"):
        raise InvalidArgumentError(
            owner,
            "variables",
            variables,
            "the float model's variables: a dict with a 'params' collection "
            "(model.init(...))",
        )
    variables = unfreeze(variables)
    if COLLECTION in variables:
        raise InvalidArgumentError(
            owner,
            "variables",
            f"variables with a {COLLECTION!r} collection",
            "float variables",
            why="they are converted already",
        )
    if "params" not in variables:
        raise InvalidArgumentError(
            owner,
            "variables",
            f"a dict with keys {sorted(variables)}",
            "the float model's variables: a dict with a 'params' collection "
            "(model.init(...))",
        )
    return variables


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for p in path:
        tree = tree.setdefault(p, {})
    tree.update(value)


def _required_inputs(model: nn.Module, method: Any) -> tuple[str, list[str]]:
    """``(name, required parameters)`` of the method ``convert`` traces."""
    fn = getattr(type(model), method, None) if isinstance(method, str) else method
    name = method if isinstance(method, str) else getattr(fn, "__name__", "method")
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]  # the module
    except (TypeError, ValueError):  # no signature to read: let the trace tell
        return name, []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [
        p.name for p in params if p.default is p.empty and p.kind not in variadic
    ]
    return name, required


def _check_inputs(owner: str, model: nn.Module, method: Any, given: bool) -> None:
    """Raises when no sample inputs were given and the traced method needs some."""
    if given:
        return
    name, required = _required_inputs(model, method)
    if not required:
        return
    call = f"{type(model).__name__}.{name}({', '.join(required)})"
    raise InvalidArgumentError(
        owner,
        "*args",
        "no sample inputs",
        "sample inputs after the variables, as model.apply takes them: "
        "convert(model, config, variables, x), with arrays or "
        "jax.ShapeDtypeStruct s (keyword arguments and method= as in apply)",
        why=f"convert traces the model on sample inputs to find its Dense "
        f"layers, and {call} takes inputs",
    )


def convert_linen(
    model: nn.Module,
    config: Any,
    variables: Any,
    *args: Any,
    method: Any = None,
    **kwargs: Any,
) -> ServingParams:
    """Serving params of a linen model: see :func:`qbits.serving.convert`."""
    owner = "qbits.serving.convert"
    if isinstance(model, Quantized | Served):
        model = model.model
    original = as_quant_config(owner, config)
    fwd = forward_only(original)
    variables = _variables(owner, variables)
    collector = _Collector(fwd, original)
    method = _as_method(method, owner)
    _check_inputs(owner, model, method, bool(args or kwargs))
    run = _Run(model, collector, method)
    # Trace abstractly: arrays become shapes, other arguments stay as they are.
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, jax.Array | np.ndarray | jax.ShapeDtypeStruct)
    ]

    def trace(v: Any, *values: Any) -> Any:
        filled = list(leaves)
        for i, value in zip(arrays, values, strict=True):
            filled[i] = value
        a, k = jax.tree.unflatten(treedef, filled)
        return run.apply(v, *a, **k)

    jax.eval_shape(trace, variables, *(leaves[i] for i in arrays))
    params = jax.tree.map(lambda x: x, variables)  # a copy of the structure
    stored: dict[str, Any] = {}
    infos = []
    for path, dtype, info in collector.found.values():
        layer = _get(params["params"], path)
        kernel = meta.unbox(layer.pop("kernel"))
        if dtype is not None:
            kernel = jnp.asarray(kernel, dtype)
        cfg = fwd.resolve(info.path).config.fwd
        qt = store_weight(kernel, cfg, info.contracting)
        _set(stored, path, {"qvalue": qt.qvalue, "scale": qt.scale})
        infos.append(
            LayerInfo(**{**info.__dict__, "packed": qt.packed_axis is not None})
        )
    params[COLLECTION] = stored
    return ServingParams(params, tuple(infos))
