"""What every entry point takes as a config: an object, a preset name or a file.

``qbits.quantize``, ``qbits.dot_general``, the linen and nnx adapters,
serving and the command line all accept the same three forms, resolved
here: a config object (:class:`~qbits.QuantConfig` or
:class:`~qbits.DotGeneralConfig`), a preset name (``"int8"``), or the path
of a YAML file (``"rules.yaml"``, anything ending in ``.yaml``/``.yml``).
Rules read from a file remember it (``QuantConfig.source``), so that an
error found later, when a matmul is traced, names the file too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from qbits import ops
from qbits._errors import ConfigError, InvalidArgumentError
from qbits.config import presets
from qbits.config._rules import QuantConfig
from qbits.config._yamlio import load_config
from qbits.ops import DotGeneralConfig

__all__ = [
    "as_dot_general_config",
    "as_quant_config",
    "conv_general_dilated",
    "dot_general",
    "einsum",
]


def _is_path(config: Any) -> bool:
    if isinstance(config, os.PathLike):
        return True
    return isinstance(config, str) and config.endswith((".yaml", ".yml"))


def _allowed(none: bool) -> str:
    return (
        "a qbits.QuantConfig, a qbits.DotGeneralConfig"
        + (", None (float)" if none else "")
        + ", the path of a YAML file (*.yaml) or a preset name: "
        + ", ".join(presets.names())
    )


def as_quant_config(
    owner: str, config: Any, *, allow_none: bool = False
) -> QuantConfig:
    """``config`` as rules; one config, preset or file becomes what it says.

    Args:
      owner: Who asks, for the error message.
      config: A :class:`QuantConfig`, a :class:`~qbits.DotGeneralConfig`, a
        preset name, the path of a YAML file (rules or one config), or (with
        ``allow_none``) ``None``: every matmul float.
      allow_none: Whether ``None`` is accepted.

    Returns:
      A :class:`QuantConfig` (with ``source`` set when read from a file).

    Raises:
      InvalidArgumentError: Naming ``owner``, for anything else.
      ConfigError: For a file that is not a valid config, naming the file.

    Example:
      >>> qc = qbits.config.as_quant_config("me", "configs/int8_fwd.yaml")
      >>> qc.source, qc.resolve("fc").name is None
      ('configs/int8_fwd.yaml', True)
    """
    if isinstance(config, QuantConfig):
        return config
    if _is_path(config):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise InvalidArgumentError(
                owner,
                "config",
                path,
                _allowed(allow_none),
                why="no such file" if not os.path.exists(path) else "not a file",
            )
        return dataclasses.replace(load_config(path), source=path)
    if (
        isinstance(config, DotGeneralConfig)
        or (config is None and allow_none)
        or (isinstance(config, str) and config in presets.names())
    ):
        return QuantConfig(default=config)
    raise InvalidArgumentError(owner, "config", config, _allowed(allow_none))


def as_dot_general_config(owner: str, config: Any) -> DotGeneralConfig:
    """``config`` as one DotGeneralConfig: itself, its preset or its file.

    Args:
      owner: Who asks, for the error message.
      config: A :class:`~qbits.DotGeneralConfig`, a preset name, or the path
        of a YAML file holding one config (not rules).

    Raises:
      InvalidArgumentError: Naming ``owner``, for anything else.
      ConfigError: For a file that is not one config, naming the file.

    Example:
      >>> qbits.config.as_dot_general_config("me", "int8") == qbits.presets.get("int8")
      True
    """
    if isinstance(config, DotGeneralConfig):
        return config
    if isinstance(config, str) and config in presets.names():
        return presets.get(config)
    if _is_path(config):
        rules = as_quant_config(owner, config)
        if rules.rules or rules.default is None:
            raise ConfigError(
                "",
                "per-layer rules" if rules.rules else "null",
                "one matmul config (per-layer rules go to qbits.quantize and "
                "the model adapters)",
                source=rules.source,
            )
        return (
            presets.get(rules.default)
            if isinstance(rules.default, str)
            else rules.default
        )
    raise InvalidArgumentError(
        owner,
        "config",
        config,
        "a qbits.DotGeneralConfig, the path of a YAML file (*.yaml) or a "
        "preset name: " + ", ".join(presets.names()),
    )


def dot_general(config: Any, key: Any = None) -> ops.DotGeneral:
    """A quantized drop-in for ``jax.lax.dot_general``.

    :func:`qbits.ops.dot_general` with ``config`` given as every entry point
    takes it: a :class:`~qbits.DotGeneralConfig`, a preset name or the path
    of a YAML file holding one config. The returned function has exactly
    the signature of ``lax.dot_general``; its gradient runs the config's
    ``dlhs`` and ``drhs`` matmuls, quantized as configured.

    Args:
      config: The forward matmul and the two gradient matmuls.
      key: A PRNG key, required when any operand rounds stochastically (see
        :func:`qbits.ops.dot_general` for how to give each layer its own).

    Returns:
      A :class:`~qbits.ops.DotGeneral`, usable as ``dot_general=`` in
      ``flax.linen.Dense`` and ``flax.nnx.Linear``.

    Raises:
      InvalidArgumentError: For a config of another kind, or one that rounds
        stochastically without a key.
      ConfigError: For a file that does not hold one config.

    Example:
      >>> dg = qbits.dot_general("int8_fwd")
      >>> x, w = jnp.ones((4, 16)), jnp.ones((16, 8))
      >>> dg(x, w, (((1,), (0,)), ((), ()))).shape
      (4, 8)
    """
    return ops.dot_general(as_dot_general_config("qbits.dot_general", config), key)


def einsum(config: Any, key: Any = None) -> ops.Einsum:
    """A quantized drop-in for two-operand ``jnp.einsum``.

    :func:`qbits.ops.einsum` with ``config`` given as for
    :func:`qbits.dot_general` (a config, a preset name or a YAML file).
    Usable as ``nnx.Einsum(einsum_op=...)``.

    Args:
      config: The forward matmul and the two gradient matmuls.
      key: A PRNG key, required when the config rounds stochastically.

    Returns:
      An :class:`~qbits.ops.Einsum`.

    Raises:
      InvalidArgumentError: As :func:`qbits.dot_general`.

    Example:
      >>> op = qbits.einsum("int8_fwd")
      >>> op("btd,dh->bth", jnp.ones((2, 3, 8)), jnp.ones((8, 4))).shape
      (2, 3, 4)
    """
    return ops.einsum(as_dot_general_config("qbits.einsum", config), key)


def conv_general_dilated(config: Any, key: Any = None) -> ops.ConvGeneralDilated:
    """A quantized drop-in for ``jax.lax.conv_general_dilated``.

    :func:`qbits.ops.conv_general_dilated` with ``config`` given as for
    :func:`qbits.dot_general` (a config, a preset name or a YAML file).
    Usable as ``conv_general_dilated=`` in ``flax.linen.Conv`` and
    ``flax.nnx.Conv``.

    Args:
      config: The forward convolution and the two gradient convolutions.
      key: A PRNG key, required when the config rounds stochastically.

    Returns:
      A :class:`~qbits.ops.ConvGeneralDilated`.

    Raises:
      InvalidArgumentError: As :func:`qbits.dot_general`.

    Example:
      >>> conv = qbits.conv_general_dilated("int8_fwd")
      >>> conv(jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3)), (1, 1), "SAME").shape
      (1, 4, 8, 8)
    """
    return ops.conv_general_dilated(
        as_dot_general_config("qbits.conv_general_dilated", config), key
    )
