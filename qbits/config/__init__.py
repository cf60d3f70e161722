"""Layer 5: typed configs, YAML files, presets and per-layer rules."""

from qbits.config import presets
from qbits.config.rules import (
    LayerRow,
    LayerTable,
    QuantConfig,
    Resolution,
    Rule,
    UnusedRuleWarning,
    check_operands,
)

__all__ = [
    "LayerRow",
    "LayerTable",
    "QuantConfig",
    "Resolution",
    "Rule",
    "UnusedRuleWarning",
    "check_operands",
    "presets",
]
