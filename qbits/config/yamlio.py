"""YAML files: safe loading only, exact round trips.

Files are read with a :class:`yaml.SafeLoader` (so a file can never build a
Python object) that also refuses duplicate keys, which plain YAML would
silently resolve to the last one. A file holds either one config (keys
``fwd``/``dlhs``/``drhs``), a per-layer :class:`~qbits.QuantConfig` (keys
``rules``/``default``) or just a preset name.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from qbits.config import presets
from qbits.config.rules import QuantConfig
from qbits.config.schema import MISSING, from_dict, to_dict
from qbits.errors import ConfigError
from qbits.ops import DotGeneralConfig

__all__ = [
    "dump",
    "dumps",
    "load",
    "load_config",
    "loads",
    "preset_yaml",
    "write_presets",
]

_SINGLE = ("fwd", "dlhs", "drhs")
_RULES = ("rules", "default")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            line = key_node.start_mark.line + 1
            raise ConfigError(
                "",
                key,
                "each key once per mapping",
                why=f"duplicate key at line {line}",
            )
        seen[key] = True
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)


def dumps(config: Any, comment: str = "") -> str:
    """A config as YAML text.

    Args:
      config: A :class:`~qbits.DotGeneralConfig`, :class:`~qbits.QuantConfig`
        or a piece of one.
      comment: Text put first, each line as a ``#`` comment.

    Returns:
      YAML that :func:`loads` turns back into an equal config.

    Example:
      >>> print(qbits.config.dumps(qbits.presets.get("int4_weight_only")))
      fwd:
        rhs:
          numerics:
            type: int
            bits: 4
            dtype: int4
          granularity:
            type: tiled
            tile_size: 128
      <BLANKLINE>
    """
    header = "".join(f"# {line}".rstrip() + "\n" for line in comment.splitlines())
    body = yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)
    return header + (body if body.strip() != "{}" else "{}\n")


def loads(text: str, source: str | None = None) -> DotGeneralConfig | QuantConfig:
    """Parses a YAML config.

    Args:
      text: YAML holding a config (``fwd``/``dlhs``/``drhs``), a per-layer
        config (``rules``/``default``) or a preset name.
      source: The file name, for error messages.

    Returns:
      A :class:`~qbits.DotGeneralConfig` for a single config or preset name, a
      :class:`~qbits.QuantConfig` for rules.

    Raises:
      ConfigError: For YAML that does not parse, uses tags that would build
        Python objects, is empty or not a mapping, or holds a bad value (the
        message names its path, e.g. ``rules[1].config.fwd.rhs.numerics.bits``).

    Example:
      >>> qc = qbits.config.loads('''
      ... rules:
      ...   - {pattern: head, config: null}
      ... default: int8_fwd
      ... ''')
      >>> qc.resolve("head").config is None, qc.resolve("mlp/fc1").name
      (True, 'int8_fwd')
    """
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except ConfigError as e:
        raise e.within(source=source) from None
    except yaml.constructor.ConstructorError as e:
        tag = re.search(r"tag '([^']*)'", e.problem or "")
        line = getattr(e.problem_mark, "line", -1) + 1
        raise ConfigError(
            "",
            tag.group(1) if tag else e.problem,
            "plain YAML: mappings, lists, strings, numbers, booleans and null",
            why=f"line {line}: a tag that would build a Python object",
            source=source,
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(
            "",
            text if len(text) < 40 else text[:37] + "...",
            "valid YAML",
            why=where + str(getattr(e, "problem", e)),
            source=source,
        ) from None
    try:
        return _from_document(data)
    except ConfigError as e:
        raise e.within(source=source) from None


def _from_document(data: Any) -> DotGeneralConfig | QuantConfig:
    if data is None:
        raise ConfigError(
            "", MISSING, "a mapping or a preset name", why="the document is empty"
        )
    if isinstance(data, str):
        return presets.get(presets.check_name(data))
    if not isinstance(data, dict):
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
    mixed = not unknown
    raise ConfigError(
        str(bad),
        bad,
        "the keys fwd, dlhs, drhs (one config) or rules, default (per-layer rules)",
        why="both kinds of keys in one file" if mixed else "",
    )


def dump(config: Any, path: str | os.PathLike, comment: str = "") -> None:
    """Writes :func:`dumps` of ``config`` to the file ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(dumps(config, comment))


def load(path: str | os.PathLike) -> DotGeneralConfig | QuantConfig:
    """Reads a config file (see :func:`loads`).

    Raises:
      ConfigError: For a file that cannot be read or holds a bad config; the
        message starts with the file name.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(
            "", os.fspath(path), "a readable file", why=e.strerror or str(e)
        ) from None
    return loads(text, source=os.fspath(path))


def load_config(path: str | os.PathLike) -> QuantConfig:
    """Reads a per-layer config file.

    A file with a single config or a preset name becomes the ``default`` of a
    :class:`~qbits.QuantConfig` without rules: every layer gets it.

    Args:
      path: A YAML file.

    Returns:
      A :class:`~qbits.QuantConfig`.

    Raises:
      ConfigError: As :func:`loads`.

    Example:
      >>> qc = qbits.load_config("configs/int8_fwd.yaml")
      >>> qc.resolve("any/layer").config == qbits.presets.get("int8_fwd")
      True
    """
    config = load(path)
    if isinstance(config, QuantConfig):
        return config
    return QuantConfig(default=config)


def preset_yaml(name: str) -> str:
    """The text of ``configs/<name>.yaml``: the preset, its description on top.

    Example:
      >>> print(qbits.config.preset_yaml("none"))
      # none: No quantization: exactly ``lax.dot_general``.
      #
      # The float baseline of every ablation, and the config to give layers that
      # must stay float (or use ``null`` in a rule).
      {}
      <BLANKLINE>
    """
    return dumps(presets.get(name), f"{name}: {presets.describe(name)}")


def write_presets(directory: str | os.PathLike) -> list[str]:
    """Writes every preset to ``directory/<name>.yaml``; returns the paths.

    The files in the repository's ``configs/`` are written by this function
    (a test checks they are current).
    """
    paths = []
    for name in presets.names():
        path = os.path.join(directory, f"{name}.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(preset_yaml(name))
        paths.append(path)
    return paths
