"""``convert``: float weights to stored low-precision weights, linen or nnx."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.nnx as nnx

from qbits._errors import InvalidArgumentError
from qbits.config import _as_quant_config
from qbits.flax import Quantized
from qbits.ptq import PtqResult
from qbits.serving._linen import convert_linen
from qbits.serving._nnx import convert_nnx
from qbits.serving._params import ServingParams, convert_params

__all__ = ["convert"]


def convert(
    model: nn.Module | nnx.Module | Callable[..., Any],
    config: Any,
    *args: Any,
    method: Any = None,
    **kwargs: Any,
) -> ServingParams | nnx.Module:
    """Stored low-precision weights for serving, from trained float weights.

    The model is traced as :func:`qbits.quantize` traces it, on sample
    inputs, and every matmul with a weight operand whose forward config
    quantizes the weight (``fwd.rhs``) gets the weight stored once, exactly
    as the training forward pass quantizes it at every step: Flax layers,
    custom layers, einsum weights, ``x @ w``, tied heads and scanned layers
    (stacked). Values are int8, int4 packed two per byte (uint8, along the
    weight's last axis), fp8, ...; scales are float32. The float parameter
    a stored weight replaces is dropped, wherever it sits in the parameters
    (kept where something else reads it, e.g. a tied embedding's lookup).
    Everything else is unchanged: biases, norms, embeddings, float matmuls,
    and convolutions and activation x activation matmuls, which are served
    as in training (quantized on the fly).

    Args:
      model: A linen module (unbound; a :func:`qbits.flax.quantize` wrapper
        is unwrapped), an nnx module (or its quantized copy), or a function
        ``fn(params, *args, **kwargs)`` of any pytree of parameters (dicts,
        haiku's flat keys, equinox modules, dataclass nodes).
      config: The config the model was trained with: a
        :class:`~qbits.QuantConfig`, a :class:`~qbits.DotGeneralConfig`, a
        preset name or the path of a YAML file. Only forward matmuls
        matter.
      *args: linen models and functions: the float parameters
        (``model.init(...)``; the function's ``params``), or the
        :class:`~qbits.ptq.PtqResult` of post-training quantization
        (:func:`qbits.ptq.quantize_weights` with this config), then sample
        inputs. nnx models: sample inputs, after the ``PtqResult`` of
        ``quantize_weights`` on the model's ``qbits.nnx.as_function`` (the
        model gets its params). Sample inputs may be
        ``jax.ShapeDtypeStruct`` s: only their shapes matter. From a
        ``PtqResult`` the weights it stored keep their codes and scales
        (GPTQ's own; the float weights on their grids would be quantized
        again, with scales of their own); the rest of its params are
        converted as float parameters are.
      method: linen only: the method to trace, as in ``apply``.
      **kwargs: Keyword arguments of the traced method or function.

    Returns:
      linen models and functions: :class:`~qbits.serving.ServingParams` for
      ``qbits.serving.serve(model, config)``. nnx: a serving copy of the
      model (the original is unchanged).

    Raises:
      InvalidArgumentError: For a model that is none of these, missing or
        converted parameters, or a model given no sample inputs (when the
        traced method takes some).
      ConfigError: For a weight matmul whose forward config rounds
        stochastically or keeps scale state (serving is deterministic and
        stateless), or a config that does not fit a matmul.

    Warns:
      UserWarning: When no weight gets stored: no weight matmul's config
        quantizes its weight (the result serves float weights;
        ``qbits.layer_table`` lists the model's matmuls), or every one that
        does is quantized on the fly at each call, its float weight kept (in a
        ``cond``, ``while`` or ``shard_map`` body, or a convolution or ragged
        dot; the message names them). From a
        ``PtqResult``: when a weight it wrote has no stored weight (AWQ's),
        so that it is quantized again.

    Example:
      >>> import flax.linen as nn
      >>> x = jnp.ones((2, 256))
      >>> params = nn.Dense(8).init(jax.random.key(0), x)
      >>> sp = qbits.serving.convert(nn.Dense(8), "int4_weight_only", params, x)
      >>> stored = sp.weights["kernel"]
      >>> stored["qvalue"].dtype, sp.layers[0].packed
      (dtype('uint8'), True)
      >>> stored["qvalue"].shape  # [256, 8] int4
      (256, 4)
    """
    owner = "qbits.serving.convert"
    rules = _as_quant_config(owner, config)
    if isinstance(model, Quantized):
        model = model.model
    if isinstance(model, nnx.Module):
        if method is not None:
            raise InvalidArgumentError(
                owner, "method", method, "None for an nnx model (linen models only)"
            )
        given = None
        if args and isinstance(args[0], PtqResult):  # the model, on its params
            result, args = args[0], args[1:]
            given = _stored_of(owner, result)
            model = nnx.clone(model)
            nnx.update(model, result.params)
        if not (args or kwargs):
            raise InvalidArgumentError(
                owner,
                "*args",
                "no sample inputs",
                "sample inputs for the model's __call__: convert(model, config, x)",
                why="convert traces the model to find its matmuls",
            )
        served = convert_nnx(owner, model, rules, args, kwargs, given)
        return served
    if isinstance(model, nn.Module) or callable(model):
        if not args:
            raise InvalidArgumentError(
                owner,
                "params",
                None,
                "the float parameters of the model (model.init(...)), then "
                "sample inputs: convert(model, config, params, x)",
            )
        params, args = args[0], args[1:]
        given = None
        if isinstance(params, PtqResult):
            params, given = params.params, _stored_of(owner, params)
        if isinstance(model, nn.Module):
            served = convert_linen(
                model, rules, params, *args, method=method, given=given, **kwargs
            )
        elif method is not None:
            raise InvalidArgumentError(
                owner, "method", method, "None for a function (linen models only)"
            )
        else:
            served = convert_params(owner, model, rules, params, args, kwargs, given)
        return served
    raise InvalidArgumentError(
        owner,
        "model",
        model,
        "a flax.linen.Module, a flax.nnx.Module or a function of (params, ...)",
    )


def _stored_of(owner: str, result: PtqResult) -> dict[str, Any]:
    """The stored weights of a PTQ result, checked; warns for weights without."""
    if result.transforms:
        raise InvalidArgumentError(
            owner,
            "params",
            "a PtqResult with transforms (quantize_weights(smooth=, rotate=))",
            "a PtqResult of quantize_weights without smooth and rotate",
            why="serving does not yet divide or rotate the activations "
            "online (PtqResult.function does)",
        )
    again = [r.path for r in result.layers if r.path not in result.stored]
    if again:
        warnings.warn(
            f"qbits.serving.convert quantizes {', '.join(map(repr, again))} "
            "again, with scales of its own: the PtqResult has no stored weight "
            "for them (AWQ's weights Q(s w) / s need their activation scales: "
            "quantize_weights(fold=) folds them into the layer before; "
            "NVFP4's tensor scale per group of a grouped weight has no "
            "stored form; scale blocks that do not fit the operand's own axes)",
            UserWarning,
            stacklevel=3,
        )
    return dict(result.stored)
