"""Serving Flax linen models from stored low-precision weights.

:func:`~qbits.serving._linen_convert.convert_linen` turns a model's float variables into
:class:`ServingParams`: every ``nn.Dense`` / ``nn.DenseGeneral`` whose
forward config quantizes the weight loses its float ``kernel`` (from the
``params`` collection) and gets, in the ``qbits_serving`` collection at the
same module path, ``qvalue`` (int8, packed int4 in uint8, fp8) and
``scale``. Everything else (biases, norms, embeddings, float layers) is
unchanged. The layout of every stored layer, and its forward config, ride
along as static metadata (:class:`~qbits.serving.LayerInfo`), also under
``jax.jit``.

:func:`serve` wraps the model like :func:`qbits.flax.quantize` does: while it
runs, an interceptor computes each stored layer as flax's own ``__call__``
does (parameters, dtype promotion, bias), with the float weight replaced by
the stored QTensor in the very matmul the training forward pass uses
(:func:`qbits.ops._matmul.matmul` with an already-quantized rhs). Every other
quantizable layer (Conv, Einsum, attention einsums, layers whose weight
stays float) runs exactly as in :func:`qbits.flax.quantize`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import struct

from qbits._errors import ConfigError, InvalidArgumentError
from qbits.config import QuantConfig, as_quant_config
from qbits.flax import Quantized, Session
from qbits.ops import Dims, stored_matmul
from qbits.serving._layout import (
    COLLECTION,
    LayerInfo,
    check_layers,
    check_stored,
    describe_matmul,
    fingerprint_dict,
    forward_only,
    stored_qtensor,
    stores_weight,
)

__all__ = ["Served", "ServingParams", "serve"]

_DENSE = {
    getattr(nn.Dense.__call__, "__wrapped__", nn.Dense.__call__): "Dense",
    getattr(
        nn.DenseGeneral.__call__, "__wrapped__", nn.DenseGeneral.__call__
    ): "DenseGeneral",
}


class ServingParams(struct.PyTreeNode):
    """The variables of a served linen model, with their stored layout.

    A pytree: ``variables`` are its leaves (pass it through ``jax.jit``);
    ``layers`` is static metadata, available while tracing.

    Attributes:
      variables: ``{"params": ..., "qbits_serving": ...}``: the float
        variables without the stored layers' kernels, and per stored layer
        ``{"qvalue", "scale"}`` at the layer's module path.
      layers: One :class:`~qbits.serving.LayerInfo` per stored layer.

    Example:
      >>> import flax.linen as nn
      >>> x = jnp.ones((2, 8))
      >>> params = nn.Dense(4).init(jax.random.key(0), x)
      >>> sp = qbits.serving.convert(nn.Dense(4), "int8_fwd", params, x)
      >>> jax.tree.map(lambda a: a.dtype.name, sp.variables)
      {'params': {'bias': 'float32'},
       'qbits_serving': {'qvalue': 'int8', 'scale': 'float32'}}
    """

    variables: Any
    layers: tuple[LayerInfo, ...] = struct.field(pytree_node=False, default=())

    def layer(self, path: str) -> LayerInfo:
        """The stored layer at ``path``.

        Raises:
          KeyError: If no stored layer has that path.
        """
        for info in self.layers:
            if info.path == path:
                return info
        raise KeyError(path)


def _show(path: str) -> str:
    return repr(path) if path else "'' (the top-level module)"


def _path(module: nn.Module) -> str:
    return "/".join(str(p) for p in module.path)


def _fn(method: str | Callable[..., Any], model: nn.Module) -> Callable[..., Any]:
    if isinstance(method, str):
        return getattr(model, method)
    return functools.partial(method, model)


def _as_method(method: Any, owner: str) -> str | Callable[..., Any]:
    if method is None:
        return "__call__"
    if isinstance(method, str):
        return method
    if inspect.ismethod(method) and isinstance(method.__self__, nn.Module):
        method = method.__func__
    if not callable(method):
        raise InvalidArgumentError(
            owner, "method", method, "None, a method name or a method of the model"
        )
    return method


def _dense_layout(
    module: nn.Module, inputs: Any
) -> tuple[Any, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(dimension_numbers, kernel_shape, bias_shape, bias_broadcast)``.

    As flax 0.12's ``Dense.__call__`` / ``DenseGeneral.__call__`` compute them.
    """
    ndim = inputs.ndim
    if not isinstance(module, nn.DenseGeneral):
        dn = (((ndim - 1,), (0,)), ((), ()))
        bias_shape = (module.features,)
        return dn, (inputs.shape[-1], module.features), bias_shape, bias_shape
    features = tuple(np.atleast_1d(module.features).tolist())
    axis = tuple(a % ndim for a in np.atleast_1d(module.axis).tolist())
    batch_dims = tuple(a % ndim for a in np.atleast_1d(module.batch_dims).tolist())
    n_batch, n_axis = len(batch_dims), len(axis)
    batch_shape = tuple(inputs.shape[a] for a in batch_dims)
    kernel_shape = batch_shape + tuple(inputs.shape[a] for a in axis) + features
    batch_ind = tuple(range(n_batch))
    contract_ind = tuple(range(n_batch, n_batch + n_axis))
    expanded = tuple(
        inputs.shape[a] if a in batch_dims else 1 for a in range(ndim) if a not in axis
    )
    dn = ((axis, contract_ind), (batch_dims, batch_ind))
    return dn, kernel_shape, batch_shape + features, expanded + features


class _ServingSession:
    """Interceptor of a served model: stored Dense layers, the rest as QAT."""

    def __init__(
        self, config: QuantConfig, original: QuantConfig, layers: dict[str, LayerInfo]
    ):
        self.config = config
        self.original = original
        self.layers = layers
        self.qat = Session(config)

    def intercept(self, next_fun, args, kwargs, context):
        kind = _DENSE.get(getattr(context.orig_method, "func", None))
        module = context.module
        if kind is None or module.dot_general is not None:
            return self.qat.intercept(next_fun, args, kwargs, context)
        if module.dot_general_cls is not None:
            return self.qat.intercept(next_fun, args, kwargs, context)
        path = _path(module)
        res = self.config.resolve(path)
        if not stores_weight(res.config):
            return self.qat.intercept(next_fun, args, kwargs, context)
        return self._served(module, path, res, *args, **kwargs)

    def _describe(self, path: str, res: Any) -> str:
        name = self.original.resolve(path).name
        return name or describe_matmul(fingerprint_dict(res))

    def _served(self, module: nn.Module, path: str, res: Any, inputs: Any) -> Any:
        owner = "qbits.serving.Served"
        info = self.layers.get(path)
        if module.has_variable("params", "kernel"):
            raise InvalidArgumentError(
                owner,
                "variables",
                f"float params (layer {path!r} has a float 'kernel')",
                "serving params from qbits.serving._convert(model, config, "
                "variables, *sample_inputs)",
                why=f"layer {_show(path)} serves a stored "
                f"{np.dtype(res.config.fwd.rhs.numerics.get_dtype()).name} weight "
                "and holds no float weight",
            )
        if info is None or not module.has_variable(COLLECTION, "qvalue"):
            raise ConfigError(
                res.where,
                "serving params without a stored weight for this layer",
                "serving params converted with the serving model's config",
                why=f"layer {_show(path)} gets {self._describe(path, res)} in the "
                "serving model: run qbits.serving.convert with that config",
            )
        qvalue = module.get_variable(COLLECTION, "qvalue")
        scale = module.get_variable(COLLECTION, "scale")
        inputs = jnp.asarray(inputs)
        dn, shape, bias_shape, bias_broadcast = _dense_layout(module, inputs)
        if tuple(shape) != info.shape:
            raise InvalidArgumentError(
                owner,
                "inputs",
                f"an input of shape {inputs.shape}",
                f"an input for which layer {path!r} has a kernel of the stored "
                f"shape {info.shape}",
                why=f"it would need a kernel of shape {tuple(shape)}",
            )
        check_stored(owner, info, qvalue, scale)
        bias = None
        if module.use_bias:
            bias = module.param(
                "bias", module.bias_init, bias_shape, module.param_dtype
            )
        placeholder = jnp.zeros((0,), info.dtype)  # the kernel, for promotion
        inputs, placeholder, bias = module.promote_dtype(
            inputs, placeholder, bias, dtype=module.dtype
        )
        qt = stored_qtensor(info, qvalue, scale).replace(
            dtype=np.dtype(placeholder.dtype)
        )
        dims = Dims.create(dn, inputs.ndim, len(shape))
        precision = module.precision
        if isinstance(precision, list):
            precision = tuple(precision)
        out = stored_matmul(inputs, qt, dims, res.config.fwd, precision=precision)
        if bias is not None:
            out += jnp.reshape(bias, bias_broadcast)
        return out


class Served(nn.Module):
    """A linen model served from :class:`ServingParams`.

    Made by :func:`serve`. ``apply`` takes the serving params (from
    :func:`qbits.serving.convert` or :func:`qbits.serving.restore`) in place
    of variables; everything else is as in ``flax.linen.Module.apply``
    (``method=`` names or gives a method of the wrapped model). Its output
    equals, bit for bit, that of ``qbits.flax.quantize(model, config)``
    applied to the float variables.

    Attributes:
      model: The float linen model (unmodified).
      config: The per-layer rules it was converted with.

    Example:
      >>> import flax.linen as nn
      >>> x = jax.random.normal(jax.random.key(0), (2, 8))
      >>> params = nn.Dense(4).init(jax.random.key(1), x)
      >>> sp = qbits.serving.convert(nn.Dense(4), "w4a8", params, x)
      >>> served = qbits.serving.serve(nn.Dense(4), "w4a8")
      >>> qat = qbits.flax.quantize(nn.Dense(4), "w4a8")
      >>> bool((jax.jit(served.apply)(sp, x) == jax.jit(qat.apply)(params, x)).all())
      True
    """

    model: nn.Module
    config: QuantConfig

    def setup(self) -> None:
        """Shares the wrapper's scope with the model (identical variables)."""
        nn.share_scope(self, self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the model (only inside :meth:`apply`)."""
        return self._run("__call__", {}, *args, **kwargs)

    def _run(
        self,
        method: str | Callable[..., Any],
        layers: dict[str, LayerInfo],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        session = _ServingSession(forward_only(self.config), self.config, layers)
        with nn.intercept_methods(session.intercept):
            return _fn(method, self.model)(*args, **kwargs)

    @nn.nowrap
    def apply(self, serving: Any, *args: Any, method: Any = None, **kwargs: Any):
        """Runs the model on its stored weights.

        Args:
          serving: :class:`ServingParams` from :func:`qbits.serving.convert`.
          *args: The model's inputs.
          method: A method name or method of the wrapped model.
          **kwargs: As for ``flax.linen.Module.apply``.

        Returns:
          What the model's method returns.

        Raises:
          InvalidArgumentError: For float variables or anything other than
            serving params, naming the first float layer.
          ConfigError: For serving params converted with another config.
        """
        owner = "qbits.serving.Served.apply"
        if not isinstance(serving, ServingParams):
            why = "these are not serving params"
            if isinstance(serving, dict) or hasattr(serving, "keys"):
                why = "these look like float variables: run convert first"
            raise InvalidArgumentError(
                owner,
                "serving",
                type(serving).__name__,
                "qbits.serving.ServingParams from qbits.serving._convert(model, "
                "config, variables, *sample_inputs) or qbits.serving.restore",
                why=why,
            )
        check_layers(owner, forward_only(self.config), self.config, serving.layers)
        layers = {info.path: info for info in serving.layers}
        fn = _as_method(method, owner)

        def run(wrapper: Served, *a: Any, **k: Any) -> Any:
            return wrapper._run(fn, layers, *a, **k)

        return super().apply(serving.variables, *args, method=run, **kwargs)


def serve(model: nn.Module, config: Any) -> Served:
    """The serving version of a linen model (see :class:`Served`).

    Args:
      model: The float linen model (unbound), as given to
        :func:`qbits.flax.quantize`.
      config: The config it was converted with (a
        :class:`~qbits.QuantConfig`, a :class:`~qbits.DotGeneralConfig` or a
        preset name).

    Returns:
      A :class:`Served` module; call ``served.apply(serving_params, *inputs)``.

    Raises:
      InvalidArgumentError: For a model that is not a linen module or a
        config of another type.

    Example:
      >>> import flax.linen as nn
      >>> served = qbits.serving.serve(nn.Dense(4), "int8_fwd")
      >>> served.config.default
      'int8_fwd'
    """
    owner = "qbits.serving.serve"
    if isinstance(model, Quantized | Served):
        model = model.model
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(owner, "model", model, "a flax.linen.Module")
    return Served(model, as_quant_config(owner, config))
