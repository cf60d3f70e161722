"""Layer 5: typed configs, YAML files, presets and per-layer rules.

- :mod:`~qbits.config.schema`: configs as plain data (``to_dict``,
  ``from_dict``); the dataclasses of layers 1-4 are the schema.
- :mod:`~qbits.config.yamlio`: YAML files (safe loading only).
- :mod:`~qbits.config.presets`: named recipes, also ``configs/<name>.yaml``.
- :mod:`~qbits.config.rules`: :class:`QuantConfig`, per-layer rules and the
  per-layer table.
"""

from qbits.config import presets
from qbits.config.rules import (
    LayerRow,
    LayerTable,
    QuantConfig,
    Resolution,
    Rule,
    UnusedRuleWarning,
    check_conv_operands,
    check_operands,
)
from qbits.config.schema import from_dict, register, to_dict
from qbits.config.yamlio import (
    dump,
    dumps,
    load,
    load_config,
    loads,
    preset_yaml,
    write_presets,
)

__all__ = [
    "LayerRow",
    "LayerTable",
    "QuantConfig",
    "Resolution",
    "Rule",
    "UnusedRuleWarning",
    "check_conv_operands",
    "check_operands",
    "dump",
    "dumps",
    "from_dict",
    "load",
    "load_config",
    "loads",
    "preset_yaml",
    "presets",
    "register",
    "to_dict",
    "write_presets",
]
