"""Per-layer rules: which config each matmul of a model gets.

A :class:`QuantConfig` is an ordered list of :class:`Rule` s plus a default.
A layer's path (``"blocks_0/attn/query"``) is matched against each rule's
regex in turn (full match); the first match decides. The injection layers
(:mod:`qbits.flax`, :mod:`qbits.nnx`) build a :class:`LayerTable` from it:
the resolved config of every layer, and the rules that matched nothing.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from qbits._errors import ConfigError, InvalidArgumentError
from qbits.config import _schema as schema
from qbits.config import presets
from qbits.config._patterns import backtracking
from qbits.ops import DotGeneralConfig

__all__ = [
    "LayerRow",
    "LayerTable",
    "QuantConfig",
    "Resolution",
    "Rule",
    "UnusedRuleWarning",
    "as_dot_general_config",
    "as_quant_config",
]

ConfigRef = DotGeneralConfig | str | None


class UnusedRuleWarning(UserWarning):
    """Some rules of a :class:`QuantConfig` matched no layer of the model.

    Example:
      A rule that matches nothing is reported, never silently ignored:

      >>> import warnings
      >>> qc = qbits.QuantConfig(rules=(qbits.Rule("mlp/.*", "int8_fwd"),))
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     qc.table([("head", "Dense")]).warn_unused()
      >>> str(caught[0].message)
      "rules[0] (pattern 'mlp/.*') matched no layer"
    """


def _check_ref(ref: Any, path: str) -> ConfigRef:
    if ref is None or isinstance(ref, DotGeneralConfig):
        return ref
    if isinstance(ref, str):
        return presets.check_name(ref, path)
    raise ConfigError(
        path, ref, "a preset name, a qbits.DotGeneralConfig or None (keep float)"
    )


def _resolve_ref(ref: ConfigRef) -> DotGeneralConfig | None:
    return presets.get(ref) if isinstance(ref, str) else ref


def as_dot_general_config(owner: str, config: Any) -> DotGeneralConfig:
    """``config`` as a DotGeneralConfig: itself, or the preset it names.

    Raises:
      InvalidArgumentError: Naming ``owner``, for anything else.
    """
    if isinstance(config, DotGeneralConfig):
        return config
    if isinstance(config, str) and config in presets.names():
        return presets.get(config)
    raise InvalidArgumentError(
        owner,
        "config",
        config,
        "a qbits.DotGeneralConfig or a preset name: " + ", ".join(presets.names()),
    )


def as_quant_config(
    owner: str, config: Any, *, allow_none: bool = False
) -> QuantConfig:
    """``config`` as a QuantConfig; one config or preset name becomes the default.

    Args:
      owner: Who asks, for the error message.
      config: A :class:`QuantConfig`, a :class:`~qbits.DotGeneralConfig`, a
        preset name, or (with ``allow_none``) ``None``: every layer float.
      allow_none: Whether ``None`` is accepted.

    Raises:
      InvalidArgumentError: Naming ``owner``, for anything else.
    """
    if isinstance(config, QuantConfig):
        return config
    if (
        isinstance(config, DotGeneralConfig)
        or (config is None and allow_none)
        or (isinstance(config, str) and config in presets.names())
    ):
        return QuantConfig(default=config)
    none = ", None (float)" if allow_none else ""
    raise InvalidArgumentError(
        owner,
        "config",
        config,
        f"a qbits.QuantConfig, a qbits.DotGeneralConfig{none} or a preset name: "
        + ", ".join(presets.names()),
    )


@dataclasses.dataclass(frozen=True)
class Rule:
    """Layers whose path fully matches ``pattern`` get ``config``.

    Attributes:
      pattern: A regular expression, matched against the whole module path
        (``re.fullmatch``), e.g. ``".*/attn/.*"``. Patterns whose matching
        could take exponential time are refused (a quantifier over a group
        holding a quantifier or ``|``, as in ``(a+)+``; more than 4 of
        ``*``, ``+``, ``{m,}``; more than 16 of ``?``, ``{m,n}``).
      config: A preset name (``"int8"``), a :class:`~qbits.DotGeneralConfig`,
        or ``None`` to keep the matched layers float.

    Raises:
      ConfigError: For an invalid regex, one whose matching could take
        exponential time, or an unknown preset.

    Example:
      >>> rule = qbits.Rule(r"head", None)
      >>> rule.matches("head"), rule.matches("blocks_0/head")
      (True, False)
    """

    pattern: str
    config: ConfigRef = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ConfigError("pattern", self.pattern, "a regular expression (str)")
        try:
            compiled = re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(
                "pattern", self.pattern, "a valid regular expression", why=str(e)
            ) from None
        why = backtracking(self.pattern)
        if why:
            raise ConfigError(
                "pattern",
                self.pattern,
                "a regular expression that matches in bounded time (write it "
                "without a quantifier over a group holding a quantifier or '|', "
                "e.g. 'a+b' for '(a+)+b' or '(.*/)?head' for '(\\w+/)*head', or "
                "split it into several rules)",
                why=f"{why}: matching it could take exponential time",
            )
        object.__setattr__(self, "_regex", compiled)
        _check_ref(self.config, "config")

    def matches(self, path: str) -> bool:
        """Whether ``path`` fully matches the pattern."""
        return self._regex.fullmatch(path) is not None  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What a :class:`QuantConfig` decides for one layer.

    Attributes:
      config: The resolved config, ``None`` for float.
      rule: Index of the matching rule, ``None`` when the default applied.
      name: The preset name when the config came from one, else ``None``.
    """

    config: DotGeneralConfig | None
    rule: int | None
    name: str | None

    @property
    def where(self) -> str:
        """The config's path inside the file: ``rules[i].config`` or ``default``."""
        return "default" if self.rule is None else f"rules[{self.rule}].config"


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Per-layer quantization: ordered rules, first full match wins.

    Attributes:
      rules: The rules, tried in order.
      default: What layers matching no rule get (a preset name, a config or
        ``None`` for float).

    Raises:
      ConfigError: For rules that are not :class:`Rule` s or a bad default.

    Example:
      >>> qc = qbits.QuantConfig(
      ...     rules=(qbits.Rule(".*attn.*", "int8_fwd"), qbits.Rule("head", None)),
      ...     default="int8_fwd")
      >>> qc.resolve("head").config is None
      True
      >>> qc.resolve("blocks_0/mlp/fc1").where
      'default'
    """

    rules: tuple[Rule, ...] = ()
    default: ConfigRef = None

    def __post_init__(self) -> None:
        if not isinstance(self.rules, Sequence) or isinstance(self.rules, str):
            raise ConfigError("rules", self.rules, "a sequence of qbits.Rule")
        object.__setattr__(self, "rules", tuple(self.rules))
        for i, rule in enumerate(self.rules):
            if not isinstance(rule, Rule):
                raise ConfigError(f"rules[{i}]", rule, "a qbits.Rule")
        _check_ref(self.default, "default")

    def to_data(self) -> dict[str, Any]:
        """The rules as plain data (:func:`qbits.config.to_dict` of them)."""
        return {
            "rules": [
                {"pattern": r.pattern, "config": schema.ref_to_data(r.config)}
                for r in self.rules
            ],
            "default": schema.ref_to_data(self.default),
        }

    @classmethod
    def from_data(cls, data: Any, path: str = "") -> QuantConfig:
        """Rules from plain data (:func:`qbits.config.from_dict` of them).

        Raises:
          ConfigError: Naming the path of the first bad value.
        """
        join, mapping, ref = schema._join, schema._mapping, schema._ref_from_data
        data = mapping(data, path, "a mapping with keys among: rules, default")
        for key in data:
            if key not in ("rules", "default"):
                raise ConfigError(
                    join(path, key), key, "one of the keys: rules, default"
                )
        rules_data = data.get("rules", [])
        rules_path = join(path, "rules")
        if not isinstance(rules_data, list):
            raise ConfigError(rules_path, rules_data, "a list of rules")
        rules = []
        for i, rule in enumerate(rules_data):
            where = f"{rules_path}[{i}]"
            rule = mapping(rule, where, "a mapping with keys pattern and config")
            for key in rule:
                if key not in ("pattern", "config"):
                    raise ConfigError(
                        join(where, key),
                        key,
                        "one of the keys: pattern, config",
                    )
            for key in ("pattern", "config"):
                if key not in rule:
                    raise ConfigError(
                        join(where, key),
                        schema.MISSING,
                        "a value (the key is required; write `config: null` to keep "
                        "matching layers float)"
                        if key == "config"
                        else "a value (the key is required)",
                    )
            config = ref(rule["config"], join(where, "config"))
            try:
                rules.append(Rule(rule["pattern"], config))
            except ConfigError as e:
                raise e.within(where) from None
        default = ref(data.get("default"), join(path, "default"))
        return cls(tuple(rules), default)

    def resolve(self, path: str) -> Resolution:
        """The config of the layer at ``path`` (module names joined by ``/``)."""
        for i, rule in enumerate(self.rules):
            if rule.matches(path):
                return self._resolution(rule.config, i)
        return self._resolution(self.default, None)

    @staticmethod
    def _resolution(ref: ConfigRef, rule: int | None) -> Resolution:
        name = ref if isinstance(ref, str) else None
        return Resolution(_resolve_ref(ref), rule, name)

    def table(
        self, layers: Iterable[tuple[str, str]], explicit: Iterable[str] = ()
    ) -> LayerTable:
        """The per-layer table.

        Args:
          layers: ``(path, kind)`` of every quantizable matmul, in model order.
          explicit: Paths of layers that already carry their own quantized
            function (an explicit ``dot_general=``); they keep it, and their
            rows say ``explicit``.

        Returns:
          A :class:`LayerTable`.
        """
        explicit = frozenset(explicit)
        rows = tuple(
            LayerRow(path, kind, self.resolve(path), path in explicit)
            for path, kind in layers
        )
        used = {row.resolution.rule for row in rows}
        unused = tuple(i for i in range(len(self.rules)) if i not in used)
        return LayerTable(rows, unused, tuple(r.pattern for r in self.rules))


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One quantizable matmul of a model and what it gets.

    Attributes:
      path: The module path, e.g. ``"blocks_0/attn/query"``.
      kind: The layer type, e.g. ``"Dense"`` or ``"MultiHeadAttention.qk"``.
      resolution: The resolved config and where it came from.
      explicit: The layer keeps the function the model gave it explicitly;
        ``resolution`` is then not applied.
      operands: The operand types, e.g. ``"f32[8,16] x f32[16,32]"``, where
        known (:func:`qbits.layer_table`), else ``""``.
    """

    path: str
    kind: str
    resolution: Resolution
    explicit: bool = False
    operands: str = ""

    def describe(self) -> str:
        """A short name of the config: a preset name, ``float`` or ``inline``."""
        res = self.resolution
        if self.explicit:
            return "explicit"
        if res.config is None:
            return "float"
        return res.name if res.name is not None else "inline"

    def as_dict(self) -> dict[str, Any]:
        """The row as plain data (the config as :func:`qbits.config.to_dict`)."""
        res = self.resolution
        operands = {"operands": self.operands} if self.operands else {}
        return {
            "path": self.path,
            "kind": self.kind,
            **operands,
            "config": self.describe(),
            "source": "model" if self.explicit else res.where,
            "resolved": None
            if res.config is None or self.explicit
            else schema.to_dict(res.config),
        }


@dataclasses.dataclass(frozen=True)
class LayerTable:
    """The resolved config of every quantizable layer of a model.

    Attributes:
      rows: One :class:`LayerRow` per layer, in model order.
      unused_rules: Indices of rules that matched no layer.
      patterns: The patterns of all rules (to name the unused ones).
      idle: For unused rules that match modules holding parameters the
        model never multiplies with (an embedding looked up, a norm's
        scale): ``{rule index: those module paths}``.

    Example:
      >>> qc = qbits.QuantConfig(rules=(qbits.Rule("head", None),), default="int8_fwd")
      >>> table = qc.table([("fc1", "Dense"), ("head", "Dense")])
      >>> print(table)
      | layer | kind | config | from |
      |---|---|---|---|
      | fc1 | Dense | int8_fwd | default |
      | head | Dense | float | rules[0].config |
      >>> table.configs()["head"] is None
      True
    """

    rows: tuple[LayerRow, ...]
    unused_rules: tuple[int, ...] = ()
    patterns: tuple[str, ...] = ()
    idle: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def __getitem__(self, path: str) -> LayerRow:
        for row in self.rows:
            if row.path == path:
                return row
        raise KeyError(path)

    def configs(self) -> dict[str, DotGeneralConfig | None]:
        """``{path: applied config or None}`` (explicit layers are left out)."""
        return {
            row.path: row.resolution.config for row in self.rows if not row.explicit
        }

    def as_dicts(self) -> list[dict[str, Any]]:
        """The rows as plain data."""
        return [row.as_dict() for row in self.rows]

    def unused_message(self) -> str:
        """A sentence naming the unused rules, or ``""``."""
        if not self.unused_rules:
            return ""
        parts = []
        for i in self.unused_rules:
            text = f"rules[{i}] (pattern {self.patterns[i]!r})"
            if self.idle.get(i):
                modules = ", ".join(self.idle[i][:3])
                more = " ..." if len(self.idle[i]) > 3 else ""
                text += f" matches {modules}{more}, which run no matmul"
            else:
                text += " matched no layer"
            parts.append(text)
        return "; ".join(parts)

    def warn_unused(self) -> None:
        """Warns with :class:`UnusedRuleWarning` if some rule matched nothing."""
        if self.unused_rules:
            warnings.warn(self.unused_message(), UnusedRuleWarning, stacklevel=3)

    def __str__(self) -> str:
        if any(r.operands for r in self.rows):
            lines = [
                "| layer | kind | operands | config | from |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {r.path} | {r.kind} | {r.operands} | {r.describe()} | "
                f"{r.resolution.where} |"
                for r in self.rows
            ]
        else:
            lines = ["| layer | kind | config | from |", "|---|---|---|---|"]
            lines += [
                f"| {r.path} | {r.kind} | {r.describe()} | {r.resolution.where} |"
                for r in self.rows
            ]
        if self.unused_rules:
            lines += ["", "Unused: " + self.unused_message() + "."]
        return "\n".join(lines)
