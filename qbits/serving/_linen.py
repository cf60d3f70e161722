"""Serving Flax linen models (and plain functions) from stored weights.

A linen model is served as its ``apply`` function is:
:func:`~qbits.serving._params.convert_params` stores the weights of every
matmul of ``model.apply`` whose forward config quantizes its weight, and
:class:`Served` runs ``model.apply`` on them. The rules, paths and numbers
are :func:`qbits.quantize`'s: a served model equals ``qbits.quantize(
model.apply, config)`` on the float variables bit for bit.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.nnx as nnx

from qbits._errors import InvalidArgumentError
from qbits.config import QuantConfig, _as_quant_config
from qbits.flax import Quantized
from qbits.serving._params import ServingParams, convert_params, serve_params

__all__ = ["Served", "convert_linen", "serve"]


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


def _apply(model: nn.Module, method: str | Callable[..., Any]) -> Callable[..., Any]:
    """``model.apply`` of one method, as a function of ``(variables, ...)``."""

    def apply(variables: Any, *args: Any, **kwargs: Any) -> Any:
        return model.apply(variables, *args, method=method, **kwargs)

    return apply


@dataclasses.dataclass(frozen=True)
class Served:
    """A linen model served from :class:`~qbits.serving.ServingParams`.

    Made by :func:`serve`; called as a served function is
    (``served(serving_params, *inputs)``), or as ``served.apply(...)``.
    ``apply`` takes the serving params (from
    :func:`qbits.serving.convert` or :func:`qbits.serving.restore`) in place
    of variables; everything else is as in ``flax.linen.Module.apply``
    (``method=`` names or gives a method of the model; ``rngs=``,
    ``mutable=``). Its output equals, bit for bit, that of
    ``qbits.flax.quantize(model, config).apply`` (``qbits.quantize(
    model.apply, config)``) on the float variables.

    Attributes:
      model: The float linen model (unmodified).
      config: The per-layer rules it was converted with.

    Example:
      >>> import flax.linen as nn
      >>> x = jax.random.normal(jax.random.key(0), (2, 8))
      >>> params = nn.Dense(4).init(jax.random.key(1), x)
      >>> sp = qbits.serving.convert(nn.Dense(4), "w4a8", params, x)
      >>> served = qbits.serving.serve(nn.Dense(4), "w4a8")
      >>> qat = qbits.quantize(nn.Dense(4).apply, "w4a8")
      >>> bool((jax.jit(served)(sp, x) == jax.jit(qat)(params, x)).all())
      True
    """

    model: nn.Module
    config: QuantConfig

    def apply(self, serving: Any, *args: Any, method: Any = None, **kwargs: Any):
        """Runs the model on its stored weights.

        Args:
          serving: :class:`ServingParams` from :func:`qbits.serving.convert`.
          *args: The model's inputs.
          method: A method name or method of the model.
          **kwargs: As for ``flax.linen.Module.apply``.

        Returns:
          What the model's method returns.

        Raises:
          InvalidArgumentError: For float variables or anything other than
            serving params.
          ConfigError: For serving params converted with another config.
        """
        owner = "qbits.serving.Served.apply"
        fn = _apply(self.model, _as_method(method, owner))
        return serve_params(owner, fn, self.config)(serving, *args, **kwargs)

    __call__ = apply


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
        "sample inputs after the params, as model.apply takes them: "
        "convert(model, config, params, x), with arrays or "
        "jax.ShapeDtypeStruct s (keyword arguments and method= as in apply)",
        why=f"convert traces the model on sample inputs to find its matmuls, "
        f"and {call} takes inputs",
    )


def convert_linen(
    model: nn.Module,
    config: Any,
    variables: Any,
    *args: Any,
    method: Any = None,
    given: Any = None,
    **kwargs: Any,
) -> ServingParams:
    """Serving params of a linen model: see :func:`qbits.serving.convert`.

    ``given``: stored weights to keep (see :func:`~qbits.serving._params.store`).
    """
    owner = "qbits.serving.convert"
    if isinstance(model, Quantized):
        model = model.model
    method = _as_method(method, owner)
    _check_inputs(owner, model, method, bool(args or kwargs))
    rules = _as_quant_config(owner, config)
    fn = _apply(model, method)
    return convert_params(owner, fn, rules, variables, args, kwargs, given)


def serve(model: nn.Module | Callable[..., Any], config: Any) -> Any:
    """The serving version of a linen model or a function.

    Args:
      model: The float linen model (unbound), as given to
        :func:`qbits.serving.convert`; or the function that was converted
        (``fn(variables, *args)``).
      config: The config it was converted with (a
        :class:`~qbits.QuantConfig`, a :class:`~qbits.DotGeneralConfig` or a
        preset name).

    Returns:
      The served model, called the same way for both:
      ``served(serving_params, *args, **kwargs)`` (a linen model's also
      takes ``method=`` and has ``served.apply``, as ``Module.apply``).

    Raises:
      InvalidArgumentError: For a model that is neither a linen module nor
        a function, or a config of another type.

    Example:
      >>> import flax.linen as nn
      >>> dense, x = nn.Dense(2), jnp.ones((3, 4))
      >>> variables = dense.init(jax.random.key(0), x)
      >>> def fn(variables, x):
      ...     return jax.nn.relu(dense.apply(variables, x))
      >>> for model in (dense, fn):  # a linen model, a function: one form
      ...     sp = qbits.serving.convert(model, "int8_fwd", variables, x)
      ...     print(qbits.serving.serve(model, "int8_fwd")(sp, x).shape)
      (3, 2)
      (3, 2)
    """
    owner = "qbits.serving.serve"
    if isinstance(model, Quantized | Served):
        model = model.model
    quant = _as_quant_config(owner, config)
    if isinstance(model, nnx.Module):
        raise InvalidArgumentError(
            owner,
            "model",
            type(model).__name__,
            "a linen model or a function; an nnx model is served by the copy "
            "qbits.serving.convert(model, config, *sample_inputs) returns",
        )
    if isinstance(model, nn.Module):
        return Served(model, quant)
    if callable(model):
        return serve_params(owner, model, quant)
    raise InvalidArgumentError(
        owner, "model", model, "a flax.linen.Module or a function of (variables, ...)"
    )
