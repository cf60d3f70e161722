"""Per-layer rules: which config each matmul of a model gets.

A :class:`QuantConfig` is an ordered list of :class:`Rule` s plus a default.
A matmul's path (``"blocks_0/attn/query"``) is matched against each rule's
regex in turn (full match); the first match decides. The engine
(:mod:`qbits.transform`) builds a :class:`LayerTable` from it: the resolved
config of every matmul, and the rules that matched nothing.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any

from qbits._errors import ConfigError
from qbits.config import _schema as schema
from qbits.config import presets
from qbits.config._matmul import DotGeneralConfig
from qbits.config._patterns import backtracking

ConfigRef = DotGeneralConfig | str | None


class UnusedRuleWarning(UserWarning):
    """Some rules of a :class:`QuantConfig` matched no layer of the model.

    Example:
      A rule that matches nothing is reported, never silently ignored:

      >>> import warnings
      >>> qc = qbits.QuantConfig((qbits.Rule("mlp/.*", None),), default="int8_fwd")
      >>> def head(params, x):
      ...     return x @ params["head"]
      >>> params = {"head": jnp.ones((4, 2))}
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = qbits.quantize(head, qc)(params, jnp.ones((1, 4)))
      >>> str(caught[0].message)
      "rules[0] (pattern 'mlp/.*') matched no matmul"
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

    Example:
      >>> qc = qbits.QuantConfig((qbits.Rule("head", None),), default="int8")
      >>> res = qc.resolve("head")
      >>> res.config, res.rule, res.where, qc.resolve("fc").name
      (None, 0, 'rules[0].config', 'int8')
    """

    config: DotGeneralConfig | None
    rule: int | None
    name: str | None

    @property
    def where(self) -> str:
        """The config's path inside the file: ``rules[i].config`` or ``default``."""
        return "default" if self.rule is None else f"rules[{self.rule}].config"


def rule_tuple(rules: Any, cls: type, name: str) -> tuple:
    """``rules`` as a tuple of ``cls`` (``name`` in the error); ConfigError else."""
    if not isinstance(rules, Sequence) or isinstance(rules, str):
        raise ConfigError("rules", rules, f"a sequence of {name}")
    for i, rule in enumerate(rules):
        if not isinstance(rule, cls):
            raise ConfigError(f"rules[{i}]", rule, f"a {name}")
    return tuple(rules)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Per-layer quantization: ordered rules, first full match wins.

    Attributes:
      rules: The rules, tried in order.
      default: What layers matching no rule get (a preset name, a config or
        ``None`` for float).
      source: The file the rules were read from (named in errors), or
        ``None``; not part of the config (equal rules from two files are
        equal).

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
    source: str | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", rule_tuple(self.rules, Rule, "qbits.Rule"))
        _check_ref(self.default, "default")

    def to_data(self) -> dict[str, Any]:
        """The rules as plain data (what :func:`qbits.config.dump` writes)."""
        return {
            "rules": [
                {"pattern": r.pattern, "config": schema.ref_to_data(r.config)}
                for r in self.rules
            ],
            "default": schema.ref_to_data(self.default),
        }

    @classmethod
    def from_data(cls, data: Any, path: str = "") -> QuantConfig:
        """Rules from plain data (what :func:`qbits.load_config` reads).

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

    def all_configs(self) -> tuple[DotGeneralConfig, ...]:
        """Every config the rules and the default can give (float left out).

        Example:
          >>> qc = qbits.QuantConfig((qbits.Rule("head", None),), default="int8")
          >>> [c.needs_key for c in qc.all_configs()]
          [True]
        """
        refs = [self.default, *(rule.config for rule in self.rules)]
        return tuple(_resolve_ref(r) for r in refs if r is not None)

    def resolve(self, path: str) -> Resolution:
        """The config of the matmul at ``path`` (module names joined by ``/``).

        The later uses of a name, ``path#2``, ``path#3``..., are matched as
        themselves and as ``path``: a rule for a layer reaches every call
        of it, and ``re.escape("fc1#2")`` only the second.
        """
        base = path.split("#", 1)[0]
        for i, rule in enumerate(self.rules):
            if rule.matches(path) or (base != path and rule.matches(base)):
                return self._resolution(rule.config, i)
        return self._resolution(self.default, None)

    @staticmethod
    def _resolution(ref: ConfigRef, rule: int | None) -> Resolution:
        name = ref if isinstance(ref, str) else None
        return Resolution(_resolve_ref(ref), rule, name)


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One quantizable matmul of a model and what it gets.

    Attributes:
      path: The matmul's unique path, e.g. ``"blocks_0/attn/query"``.
      kind: What it is, e.g. ``"einsum (activation x weight), scanned x4"``.
      resolution: The resolved config and where it came from.
      kept: Why the matmul runs as it is (``"inside custom_vjp"``: the
        model's own quantized function; ``"integer operands"``; ``"weight-only
        config, no weight"``: a matmul of two activations under a config
        that quantizes weights only), or ``""``.
      operands: The operand types, e.g. ``"f32[8,16] x f32[16,32]"``.
      applied: The config the matmul runs with (``None``: float or kept).
        For a matmul of two activations it is the rule's config as
        :meth:`~qbits.DotGeneralConfig.for_activations` adapts it.
      note: How ``applied`` differs from the rule's config, or ``""``:
        ``"activations: lhs quantizer on both operands"``.

    Example:
      >>> def f(p, x):
      ...     return x @ p["fc"]
      >>> table = qbits.layer_table(f, "int8_fwd", {"fc": jnp.ones((4, 2))},
      ...                           jnp.ones((3, 4)))
      >>> row = table["fc"]
      >>> row.kind, row.operands, row.describe(), row.kept
      ('dot_general (activation x weight)', 'f32[3,4] x f32[4,2]', 'int8_fwd', '')

      A matmul of two activations runs the rule's config adapted to it:

      >>> def scores(p, q):
      ...     k = q @ p["key"]
      ...     return jnp.einsum("td,sd->ts", q, k)
      >>> table = qbits.layer_table(scores, "w4a8", {"key": jnp.ones((4, 4))},
      ...                           jnp.ones((3, 4)))
      >>> for row in table.rows:
      ...     print(row.path, "|", row.describe())
      key | w4a8
      td,sd->ts | w4a8 (activations: lhs quantizer on both operands)
    """

    path: str
    kind: str
    resolution: Resolution
    kept: str = ""
    operands: str = ""
    applied: DotGeneralConfig | None = None
    note: str = ""

    def describe(self) -> str:
        """A short name: a preset name, ``float``, ``inline`` or ``kept``.

        With the :attr:`note` of a config adapted to the matmul in
        parentheses.
        """
        res = self.resolution
        if self.kept:
            return "kept"
        if res.config is None:
            return "float"
        name = res.name if res.name is not None else "inline"
        return f"{name} ({self.note})" if self.note else name

    def as_dict(self) -> dict[str, Any]:
        """The row as plain data (the config as :func:`qbits.config.dump` writes it)."""
        res = self.resolution
        operands = {"operands": self.operands} if self.operands else {}
        return {
            "path": self.path,
            "kind": self.kind,
            **operands,
            "config": self.describe(),
            "source": f"kept: {self.kept}" if self.kept else res.where,
            "resolved": None
            if self.applied is None or self.kept
            else schema.to_dict(self.applied),
        }


@dataclasses.dataclass(frozen=True)
class LayerTable:
    """The config of every matmul of a model or function.

    Made by :func:`qbits.layer_table` (and the linen and nnx adapters' own
    ``layer_table``, which run the same engine).

    Attributes:
      rows: One :class:`LayerRow` per matmul, in program order.
      unused_rules: Indices of rules that matched no matmul.
      patterns: The patterns of all rules (to name the unused ones).
      idle: For unused rules that match modules holding parameters the
        model never multiplies with (an embedding looked up, a norm's
        scale): ``{rule index: those module paths}``.
      source: The file the rules were read from, or ``None``.

    Example:
      >>> def mlp(params, x):
      ...     h = jax.nn.relu(jnp.einsum("bi,ih->bh", x, params["fc1"]))
      ...     return h @ params["head"]
      >>> params = {"fc1": jnp.ones((4, 8)), "head": jnp.ones((8, 2))}
      >>> qc = qbits.QuantConfig(rules=(qbits.Rule("head", None),), default="int8_fwd")
      >>> table = qbits.layer_table(mlp, qc, params, jnp.ones((3, 4)))
      >>> for row in table.rows:
      ...     print(row.path, row.kind, row.describe(), row.resolution.where, sep=" | ")
      fc1 | einsum (activation x weight) | int8_fwd | default
      head | dot_general (activation x weight) | float | rules[0].config
      >>> table.configs()["head"] is None
      True
    """

    rows: tuple[LayerRow, ...]
    unused_rules: tuple[int, ...] = ()
    patterns: tuple[str, ...] = ()
    idle: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    source: str | None = None

    def __getitem__(self, path: str) -> LayerRow:
        for row in self.rows:
            if row.path == path:
                return row
        raise KeyError(path)

    def configs(self) -> dict[str, DotGeneralConfig | None]:
        """``{path: applied config or None}`` (kept matmuls are left out)."""
        return {row.path: row.applied for row in self.rows if not row.kept}

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
                text += " matched no matmul"
            parts.append(text)
        where = f"{self.source}: " if self.source else ""
        return where + "; ".join(parts)

    def warn_unused(self) -> None:
        """Warns with :class:`UnusedRuleWarning` if some rule matched nothing."""
        if self.unused_rules:
            warnings.warn(self.unused_message(), UnusedRuleWarning, stacklevel=3)

    def __str__(self) -> str:
        lines = [
            "| layer | kind | operands | config | from |",
            "|---|---|---|---|---|",
        ]
        for r in self.rows:
            where = f"kept: {r.kept}" if r.kept else r.resolution.where
            lines.append(
                f"| {r.path} | {r.kind} | {r.operands} | {r.describe()} | {where} |"
            )
        if self.unused_rules:
            lines += ["", "Unused: " + self.unused_message() + "."]
        return "\n".join(lines)
