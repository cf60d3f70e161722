"""Layer 4: typed configs, YAML files, presets and per-layer rules.

One way to read a config, whatever form it comes in (a file, YAML text,
plain data, a preset name, an object): :func:`qbits.load_config`; one way
to write one: :func:`dump`. Presets: :mod:`qbits.presets`.

- :mod:`~qbits.config._schema`: configs as plain data; the dataclasses of
  layers 1-4 are the schema (:func:`register` adds a class of your own).
- :mod:`~qbits.config._yamlio`: YAML files (safe loading only).
- :mod:`qbits.presets`: named recipes, also ``configs/<name>.yaml``.
- :mod:`~qbits.config._rules`: :class:`QuantConfig`, per-layer rules and the
  per-layer table; :mod:`~qbits.config._patterns`: rule patterns that match
  in bounded time.
- :mod:`~qbits.config._refs`: what every entry point takes as a config (an
  object, a preset name, a YAML file, text or data), resolved by one
  function.
"""

from qbits.config._rules import LayerRow, LayerTable, Resolution, UnusedRuleWarning
from qbits.config._rules import QuantConfig as QuantConfig  # qbits.QuantConfig
from qbits.config._rules import Rule as Rule  # qbits.Rule
from qbits.config._schema import register
from qbits.config._yamlio import dump

__all__ = [
    "LayerRow",
    "LayerTable",
    "Resolution",
    "UnusedRuleWarning",
    "dump",
    "register",
]

# For the other packages of qbits (not public): the matmul configs (public
# as qbits.DotGeneralConfig, qbits.MatmulConfig; here so that the ops, above
# this layer, take preset names and files), the one resolution of a config
# argument, plain data both ways, and the YAML reader.
from qbits.config._matmul import IDENTITY as _IDENTITY  # isort: skip  # noqa: F401
from qbits.config._matmul import DotGeneralConfig as _DotGeneralConfig  # isort: skip  # noqa: F401
from qbits.config._matmul import MatmulConfig as _MatmulConfig  # isort: skip  # noqa: F401
from qbits.config._refs import as_dot_general_config as _as_dot_general_config  # isort: skip  # noqa: F401
from qbits.config._refs import as_quant_config as _as_quant_config  # isort: skip  # noqa: F401
from qbits.config._refs import resolve as _resolve  # isort: skip  # noqa: F401
from qbits.config._rules import rule_tuple as _rule_tuple  # isort: skip  # noqa: F401
from qbits.config._schema import construct as _construct  # isort: skip  # noqa: F401
from qbits.config._schema import from_dict as _from_dict  # isort: skip  # noqa: F401
from qbits.config._schema import to_dict as _to_dict  # isort: skip  # noqa: F401
from qbits.config._yamlio import read_yaml as _read_yaml  # isort: skip  # noqa: F401
