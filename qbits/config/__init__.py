"""Layer 5: typed configs, YAML files, presets and per-layer rules.

- :mod:`~qbits.config._schema`: configs as plain data (``to_dict``,
  ``from_dict``); the dataclasses of layers 1-4 are the schema.
- :mod:`~qbits.config._yamlio`: YAML files (safe loading only).
- :mod:`~qbits.config.presets`: named recipes, also ``configs/<name>.yaml``.
- :mod:`~qbits.config._rules`: :class:`QuantConfig`, per-layer rules and the
  per-layer table; :mod:`~qbits.config._patterns`: rule patterns that match
  in bounded time.
- :mod:`~qbits.config._refs`: what every entry point takes as a config (an
  object, a preset name or a YAML file).
"""

from qbits.config import presets
from qbits.config._refs import as_dot_general_config, as_quant_config
from qbits.config._rules import (
    LayerRow,
    LayerTable,
    QuantConfig,
    Resolution,
    Rule,
    UnusedRuleWarning,
)
from qbits.config._schema import from_dict, register, to_dict
from qbits.config._yamlio import (
    dump,
    dumps,
    load,
    load_config,
    loads,
    read_yaml,
)

__all__ = [
    "LayerRow",
    "LayerTable",
    "QuantConfig",
    "Resolution",
    "Rule",
    "UnusedRuleWarning",
    "as_dot_general_config",
    "as_quant_config",
    "dump",
    "dumps",
    "from_dict",
    "load",
    "load_config",
    "loads",
    "presets",
    "read_yaml",
    "register",
    "to_dict",
]
