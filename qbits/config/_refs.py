"""What every entry point takes as a config, and :func:`qbits.load_config`.

``qbits.load_config``, ``qbits.quantize``, the ops (``qbits.dot_general``
and the others), the linen and nnx adapters, serving, lora, the KV cache
and the command line all accept the same forms, resolved here by one
function (:func:`resolve`): a config object, a preset name (``"int8"``),
the path of a YAML file (``"rules.yaml"``, anything ending in
``.yaml``/``.yml``, or any ``os.PathLike``), YAML text, or the plain data
of a config (a dict). Rules read from a file remember it
(``QuantConfig.source``), so that an error found later, when a matmul is
traced, names the file too.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

from qbits._errors import ConfigError, InvalidArgumentError
from qbits.config import presets
from qbits.config._matmul import DotGeneralConfig
from qbits.config._rules import QuantConfig
from qbits.config._schema import MISSING, from_dict
from qbits.config._yamlio import parse_yaml, read_yaml

__all__ = [
    "as_dot_general_config",
    "as_quant_config",
    "load_config",
    "resolve",
]

_SINGLE = ("fwd", "dlhs", "drhs")
_RULES = ("rules", "default")
# The classes a matmul preset name stands for (None: the document's own).
_MATMUL = (None, QuantConfig, DotGeneralConfig)


def _is_path(config: Any) -> bool:
    if isinstance(config, os.PathLike):
        return True
    return isinstance(config, str) and config.endswith((".yaml", ".yml"))


def _allowed(cls: type | None, none: bool) -> str:
    if cls is DotGeneralConfig:  # one matmul's config: not rules
        what = "a qbits.DotGeneralConfig"
    elif cls in _MATMUL:
        what = "a qbits.QuantConfig, a qbits.DotGeneralConfig"
    else:
        what = f"a {cls.__module__.split('._')[0]}.{cls.__name__}"
    presets_ = (
        ", a preset name: " + ", ".join(presets.names()) if cls in _MATMUL else ""
    )
    return (
        what
        + (", None (float)" if none else "")
        + ", the path of a YAML file (*.yaml), YAML text, its plain data (a dict)"
        + presets_
    )


def _from_document(data: Any) -> DotGeneralConfig | QuantConfig:
    """A matmul config document: one config, rules or a preset name."""
    if isinstance(data, str):
        return presets.get(presets.check_name(data))
    if not isinstance(data, Mapping):
        raise ConfigError(
            "",
            data,
            "a mapping (keys fwd/dlhs/drhs, or rules/default) or a preset name",
        )
    keys = set(data)
    if keys <= set(_SINGLE):  # {} is the identity config
        return from_dict(data, DotGeneralConfig)
    if keys <= set(_RULES):
        return from_dict(data, QuantConfig)
    unknown = [k for k in data if k not in _SINGLE + _RULES]
    bad = unknown[0] if unknown else next(iter(data))
    raise ConfigError(
        str(bad),
        bad,
        "the keys fwd, dlhs, drhs (one config) or rules, default (per-layer rules)",
        why="" if unknown else "both kinds of keys in one file",
    )


def _typed(data: Any, cls: type | None, source: str | None) -> Any:
    """A document (plain data) as ``cls``; ConfigError naming the place."""
    if data is None:
        raise ConfigError(
            "", MISSING, "a mapping or a preset name", why="the document is empty"
        )
    if cls not in _MATMUL:
        return from_dict(data, cls)
    config = _from_document(data)
    if cls is None:
        return config
    if cls is QuantConfig:
        if isinstance(config, DotGeneralConfig):
            config = QuantConfig(default=config)
        return dataclasses.replace(config, source=source) if source else config
    if isinstance(config, QuantConfig):  # cls is DotGeneralConfig
        if config.rules or config.default is None:
            raise ConfigError(
                "",
                "per-layer rules" if config.rules else "null",
                "one matmul config (per-layer rules go to qbits.quantize and "
                "the model adapters)",
            )
        default = config.default
        return presets.get(default) if isinstance(default, str) else default
    return config


def _check_cls(owner: str, config: Any, cls: Any) -> None:
    """Refuses a ``cls`` that is not a config class (the arguments swapped?)."""
    if cls is None or (
        isinstance(cls, type)
        and (hasattr(cls, "from_data") or dataclasses.is_dataclass(cls))
    ):
        return
    swapped = isinstance(config, type)
    raise InvalidArgumentError(
        owner,
        "cls",
        cls,
        "a config class (qbits.QuantConfig, the default; qbits.DotGeneralConfig, "
        "qbits.MatmulConfig, qbits.Quantizer...) or None: "
        + (
            f"qbits.load_config(data, {config.__name__})"
            if swapped
            else "qbits.load_config(source, cls)"
        ),
        why="the arguments are swapped: the source comes first" if swapped else "",
    )


def resolve(
    owner: str,
    config: Any,
    cls: type | None = QuantConfig,
    *,
    allow_none: bool = False,
    argument: str = "config",
) -> Any:
    """``config`` as a ``cls``: itself, a preset, a file, YAML text or data.

    The one resolution behind :func:`qbits.load_config` and every entry
    point that takes a config (they pass their own ``owner``).

    Args:
      owner: Who asks, for the error message.
      config: An instance of ``cls``; a :class:`~qbits.DotGeneralConfig` or
        preset name (a matmul ``cls``); the path of a YAML file; YAML text;
        plain data; with ``allow_none``, ``None`` (every matmul float).
      cls: The class to return: :class:`~qbits.QuantConfig` (one config
        becomes the default of rules without rules), any config class
        (:class:`~qbits.DotGeneralConfig`, :class:`~qbits.Quantizer`,
        ``qbits.kvcache.CacheConfig``...), or ``None``: the class the
        document holds (a ``DotGeneralConfig`` or a ``QuantConfig``).
      allow_none: Whether ``None`` is accepted (as rules: all float).
      argument: The argument's name, for the error message.

    Raises:
      InvalidArgumentError: Naming ``owner``, for a value of another kind,
        a missing file, or a word that is not a preset name.
      ConfigError: For a document that is not a valid ``cls``, naming the
        file (if any) and the place in it.
    """
    _check_cls(owner, config, cls)
    if isinstance(config, cls or (QuantConfig, DotGeneralConfig)):
        return config
    if cls is QuantConfig and (
        isinstance(config, DotGeneralConfig) or (config is None and allow_none)
    ):
        return QuantConfig(default=config)
    if cls in _MATMUL and isinstance(config, DotGeneralConfig):
        return config
    if cls in _MATMUL and isinstance(config, str) and config in presets.names():
        if cls is QuantConfig:
            return QuantConfig(default=config)
        return presets.get(config)
    allowed = _allowed(cls, allow_none)
    source = None
    if _is_path(config):
        source = os.fspath(config)
        if not os.path.exists(source):  # read_yaml says why it cannot read others
            why = "no such file"
            raise InvalidArgumentError(owner, argument, source, allowed, why=why)
        data = read_yaml(source)
    elif isinstance(config, str | bytes):
        data = parse_yaml(config)
        named = cls in _MATMUL and data in presets.names()
        if not isinstance(data, Mapping) and not named:  # a word, not a name
            if cls in _MATMUL:
                word = config if isinstance(config, str) else ""
                close = difflib.get_close_matches(word, presets.names(), 1)
                why = f"did you mean {close[0]!r}?" if close else ""
                raise InvalidArgumentError(owner, argument, config, allowed, why=why)
            try:
                return _typed(data, cls, None)
            except ConfigError as e:
                raise InvalidArgumentError(
                    owner, argument, config, allowed + ", or " + e.allowed
                ) from None
    elif isinstance(config, Mapping):
        data = config
    else:
        why = (
            "rules (a QuantConfig) are for qbits.quantize and the adapters; one "
            "op takes one matmul's config"
            if cls is DotGeneralConfig and isinstance(config, QuantConfig)
            else ""
        )
        raise InvalidArgumentError(owner, argument, config, allowed, why=why)
    try:
        return _typed(data, cls, source)
    except ConfigError as e:
        raise e.within(source=source) from None


def load_config(source: Any, cls: type | None = QuantConfig) -> Any:
    r"""Reads a config: the one way, whatever form it comes in.

    Args:
      source: The path of a YAML file (``*.yaml``, ``*.yml`` or any
        ``os.PathLike``), YAML text, the plain data of a config (a dict, as
        ``yaml.safe_load`` gives), a preset name (``"int8"``;
        :mod:`qbits.presets`), or a config object.
      cls: What to return. :class:`~qbits.QuantConfig` (the default): per-
        layer rules, what every entry point takes; a file, text or data
        holding one config (keys ``fwd``/``dlhs``/``drhs``) or a preset name
        becomes the ``default`` of rules without rules.
        :class:`~qbits.DotGeneralConfig`: one config (rules are refused).
        Any other config class (:class:`~qbits.MatmulConfig`,
        :class:`~qbits.Quantizer`, ``qbits.kvcache.CacheConfig``,
        ``qbits.lora.LoraConfig``...) builds that class from the data.
        ``None``: the class the document holds (a ``DotGeneralConfig`` or a
        ``QuantConfig``).

    Returns:
      An instance of ``cls``. Rules read from a file remember it
      (``QuantConfig.source``) and later errors name it.

    Raises:
      InvalidArgumentError: For a ``source`` of another kind (the message
        says what it got and lists what is accepted), a missing file, or a
        word that is not a preset name.
      ConfigError: For a document that does not parse, breaks a limit of the
        YAML reader, or holds a bad value; the message names the file and the
        path of the value (e.g. ``rules[1].config.fwd.rhs.numerics.bits``).

    Example:
      >>> qc = qbits.load_config("configs/int8_fwd.yaml")
      >>> qc.resolve("any/layer").config == qbits.presets.get("int8_fwd")
      True
      >>> qc = qbits.load_config('''
      ... rules:
      ...   - {pattern: head, config: null}
      ... default: int8_fwd
      ... ''')
      >>> qc.resolve("head").config is None, qc.resolve("mlp/fc1").name
      (True, 'int8_fwd')
      >>> data = {"fwd": {"rhs": {"numerics": {"type": "int", "bits": 4}}}}
      >>> qbits.load_config(data, qbits.DotGeneralConfig).fwd.rhs.numerics.bits
      4
      >>> qbits.load_config("int8", qbits.DotGeneralConfig) == qbits.presets.get("int8")
      True
      >>> try:
      ...     qbits.load_config("int9")
      ... except qbits.InvalidArgumentError as e:
      ...     print(str(e).split(";")[0])
      qbits.load_config: source='int9' is not allowed (did you mean 'int8'?)
    """
    return resolve("qbits.load_config", source, cls, argument="source")


def as_quant_config(
    owner: str, config: Any, *, allow_none: bool = False
) -> QuantConfig:
    """``config`` as rules (:func:`resolve` into a :class:`QuantConfig`)."""
    return resolve(owner, config, QuantConfig, allow_none=allow_none)


def as_dot_general_config(owner: str, config: Any) -> DotGeneralConfig:
    """``config`` as one config (:func:`resolve` into a DotGeneralConfig)."""
    return resolve(owner, config, DotGeneralConfig)
