"""``convert``: float weights to stored low-precision weights, linen or nnx."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.nnx as nnx

from qbits._errors import InvalidArgumentError
from qbits.config import as_quant_config, presets
from qbits.serving._linen import convert_linen
from qbits.serving._nnx import convert_nnx, served_layers
from qbits.serving._params import ServingParams, convert_params

__all__ = ["convert"]


def convert(
    model: nn.Module | nnx.Module | Callable[..., Any],
    config: Any,
    variables: Any = None,
    *args: Any,
    method: Any = None,
    **kwargs: Any,
) -> ServingParams | nnx.Module:
    """Stored low-precision weights for serving, from trained float weights.

    linen models and functions: the model's ``apply`` (or the function) is
    traced as :func:`qbits.quantize` traces it, and every matmul with a
    weight operand whose forward config quantizes the weight (``fwd.rhs``)
    gets the weight stored once, exactly as the training forward pass
    quantizes it at every step: custom layers, einsum weights, ``x @ w``,
    tied heads and scanned layers (stacked) as much as ``Dense``. Values
    are int8, int4 packed two per byte (uint8, along the weight's last
    axis), fp8, ...; scales are float32. The float parameter a stored
    weight replaces is dropped (kept where something else reads it, e.g. a
    tied embedding's lookup). Everything else is unchanged: biases, norms,
    embeddings, float matmuls, and convolutions and activation x activation
    matmuls, which are served as in training (quantized on the fly).

    nnx models: every ``Linear`` / ``LinearGeneral`` whose forward config
    (from the rules of :func:`qbits.nnx.quantize`) quantizes the weight gets
    it stored in a serving copy of the model. For an nnx model with its own
    layers, convert its function instead: ``graphdef, state =
    nnx.split(model)``, ``fn = lambda p, x: nnx.merge(graphdef, p)(x)`` and
    ``convert(fn, config, nnx.to_pure_dict(state), x)``.

    Args:
      model: A linen module (unbound; a :func:`qbits.flax.quantize` wrapper
        is unwrapped), an nnx module, or a function ``fn(variables, *args,
        **kwargs)``.
      config: A :class:`~qbits.QuantConfig`, a
        :class:`~qbits.DotGeneralConfig` or a preset name: the config the
        model was trained with. Only forward matmuls matter.
      variables: linen and functions: the float variables
        (``model.init(...)``; a function's parameter dict).
      *args: linen and functions: sample inputs (arrays or
        ``jax.ShapeDtypeStruct`` s: only their shapes matter).
      method: linen only: the method to trace, as in ``apply``.
      **kwargs: Keyword arguments of the traced method or function.

    Returns:
      linen and functions: :class:`~qbits.serving.ServingParams` for
      ``qbits.serving.serve(model, config)``. nnx: a serving copy of the
      model (the original is unchanged).

    Raises:
      InvalidArgumentError: For a model that is none of these, missing or
        converted variables, a linen model given no sample inputs (when the
        traced method takes some), or variables or inputs given with an nnx
        model.
      ConfigError: For a weight matmul whose forward config rounds
        stochastically or keeps scale state (serving is deterministic and
        stateless), or a config that does not fit a layer.

    Warns:
      UserWarning: When no weight gets stored (no weight matmul's config
        quantizes its weight): the result serves float weights.
        ``qbits.layer_table`` lists the model's matmuls.

    Example:
      >>> import flax.linen as nn
      >>> x = jnp.ones((2, 256))
      >>> params = nn.Dense(8).init(jax.random.key(0), x)
      >>> sp = qbits.serving.convert(nn.Dense(8), "int4_weight_only", params, x)
      >>> stored = sp.variables["qbits_serving"]["kernel"]
      >>> stored["qvalue"].dtype, sp.layers[0].packed
      (dtype('uint8'), True)
      >>> stored["qvalue"].shape  # [256, 8] int4
      (256, 4)
    """
    owner = "qbits.serving.convert"
    if isinstance(model, nnx.Module):
        if variables is not None or args or kwargs or method is not None:
            raise InvalidArgumentError(
                owner,
                "variables",
                "variables or sample inputs with an nnx model",
                "convert(nnx_model, config) (the model holds its parameters)",
            )
        served = convert_nnx(model, config)
        _warn_if_empty(len(served_layers(served)), config)
        return served
    if isinstance(model, nn.Module) or callable(model):
        if variables is None:
            raise InvalidArgumentError(
                owner,
                "variables",
                None,
                "the float variables of the model (model.init(...)), then "
                "sample inputs: convert(model, config, variables, x)",
            )
        if isinstance(model, nn.Module):
            params = convert_linen(
                model, config, variables, *args, method=method, **kwargs
            )
        elif method is not None:
            raise InvalidArgumentError(
                owner, "method", method, "None for a function (linen models only)"
            )
        else:
            params = convert_params(owner, model, config, variables, args, kwargs)
        _warn_if_empty(len(params.layers), config)
        return params
    raise InvalidArgumentError(
        owner,
        "model",
        model,
        "a flax.linen.Module, a flax.nnx.Module or a function of (variables, ...)",
    )


def _warn_if_empty(stored: int, config: Any) -> None:
    """Warns when a config that quantizes something stored no weight."""
    rules = as_quant_config("qbits.serving.convert", config)
    refs = [rules.default, *(rule.config for rule in rules.rules)]
    configs = [presets.get(ref) if isinstance(ref, str) else ref for ref in refs]
    if stored == 0 and any(c is not None and not c.fwd.is_identity for c in configs):
        warnings.warn(
            "qbits.serving.convert stored no low-precision weights: no weight "
            "matmul's config quantizes its weight (for nnx models: no "
            "Linear/LinearGeneral layer's), so every weight stays float. Check "
            "the rules (qbits.layer_table; qbits.nnx.layer_table)",
            UserWarning,
            stacklevel=3,
        )
