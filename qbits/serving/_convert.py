"""``convert``: float weights to stored low-precision weights, linen or nnx."""

from __future__ import annotations

import warnings
from typing import Any

import flax.linen as nn
import flax.nnx as nnx

from qbits._errors import InvalidArgumentError
from qbits.config import as_quant_config, presets
from qbits.serving._linen import ServingParams
from qbits.serving._linen_convert import convert_linen
from qbits.serving._nnx import convert_nnx, served_layers

__all__ = ["convert"]


def convert(
    model: nn.Module | nnx.Module,
    config: Any,
    variables: Any = None,
    *args: Any,
    method: Any = None,
    **kwargs: Any,
) -> ServingParams | nnx.Module:
    """Stored low-precision weights for serving, from trained float weights.

    Every ``Dense`` / ``DenseGeneral`` (linen) or ``Linear`` /
    ``LinearGeneral`` (nnx) whose forward config (from the same per-layer
    rules as :func:`qbits.flax.quantize` / :func:`qbits.nnx.quantize`)
    quantizes the weight gets it stored once, exactly as the training
    forward pass quantizes it at every step: the same quantizer
    (``fwd.rhs``), contracting axes and dtype. Values are int8, int4 packed
    two per byte (uint8, along the kernel's last axis), fp8, ...; scales are
    float32; no float kernel is kept. Everything else is unchanged: biases,
    norms, embeddings, float layers, and Conv/Einsum/attention layers, which
    are served as in training (quantized on the fly).

    Args:
      model: A linen module (unbound; a :func:`qbits.flax.quantize` wrapper
        is unwrapped) or an nnx module.
      config: A :class:`~qbits.QuantConfig`, a
        :class:`~qbits.DotGeneralConfig` or a preset name: the config the
        model was trained with. Only forward matmuls matter.
      variables: linen only: the float variables (``model.init(...)``).
      *args: linen only: sample inputs for the model (arrays or
        ``jax.ShapeDtypeStruct`` s; traced abstractly to find the layers).
      method: linen only: the method to trace, as in ``apply``.
      **kwargs: linen only: keyword arguments of the traced method.

    Returns:
      linen: :class:`~qbits.serving.ServingParams` for
      ``qbits.serving.serve(model, config).apply``. nnx: a serving copy of
      the model (the original is unchanged).

    Raises:
      InvalidArgumentError: For a model that is neither, missing or
        converted variables, a linen model given no sample inputs (when the
        traced method takes some), or linen-only arguments given with an nnx
        model.
      ConfigError: For a layer whose forward matmul rounds stochastically
        (serving is deterministic), or a config that does not fit a layer.

    Warns:
      UserWarning: When no layer gets stored weights (no ``Dense``-family
        layer's config quantizes its weight): the result serves float
        weights. ``qbits.layer_table`` lists the model's matmuls.

    Example:
      >>> import flax.linen as nn
      >>> x = jnp.ones((2, 256))
      >>> params = nn.Dense(8).init(jax.random.key(0), x)
      >>> sp = qbits.serving.convert(nn.Dense(8), "int4_weight_only", params, x)
      >>> sp.variables["qbits_serving"]["qvalue"].dtype, sp.layers[0].packed
      (dtype('uint8'), True)
      >>> sp.variables["qbits_serving"]["qvalue"].shape  # [256, 8] int4
      (256, 4)
    """
    if isinstance(model, nnx.Module):
        if variables is not None or args or kwargs or method is not None:
            raise InvalidArgumentError(
                "qbits.serving.convert",
                "variables",
                "variables or sample inputs with an nnx model",
                "convert(nnx_model, config) (the model holds its parameters)",
            )
        served = convert_nnx(model, config)
        _warn_if_empty(len(served_layers(served)), config)
        return served
    if isinstance(model, nn.Module):
        if variables is None:
            raise InvalidArgumentError(
                "qbits.serving.convert",
                "variables",
                None,
                "the float variables of the linen model (model.init(...)), "
                "then sample inputs: convert(model, config, variables, x)",
            )
        params = convert_linen(model, config, variables, *args, method=method, **kwargs)
        _warn_if_empty(len(params.layers), config)
        return params
    raise InvalidArgumentError(
        "qbits.serving.convert",
        "model",
        model,
        "a flax.linen.Module or a flax.nnx.Module",
    )


def _warn_if_empty(stored: int, config: Any) -> None:
    """Warns when a config that quantizes something stored no weight."""
    rules = as_quant_config("qbits.serving.convert", config)
    refs = [rules.default, *(rule.config for rule in rules.rules)]
    configs = [presets.get(ref) if isinstance(ref, str) else ref for ref in refs]
    if stored == 0 and any(c is not None and not c.fwd.is_identity for c in configs):
        warnings.warn(
            "qbits.serving.convert stored no low-precision weights: no "
            "Dense/DenseGeneral (linen) or Linear/LinearGeneral (nnx) layer's "
            "config quantizes its weight, so every weight stays float. Check "
            "the rules (qbits.flax.layer_table / qbits.nnx.layer_table); "
            "matmuls of custom layers and einsums (qbits.layer_table) are not "
            "stored by convert yet",
            UserWarning,
            stacklevel=3,
        )
