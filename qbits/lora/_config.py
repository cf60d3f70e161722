"""``LoraConfig``: which matmuls get low-rank adapters, and the frozen base.

A config is a frozen dataclass, and YAML (``qbits.config.dump``,
``qbits.load_config``) like every qbits config: rank, alpha, dropout, the initialiser of
``A``, ordered rules (a regex full match on the matmul path, first match
wins, as in :class:`~qbits.QuantConfig`) and the format the frozen base's
weights are held in (any quantization config: a preset such as ``"nf4"``,
a :class:`~qbits.DotGeneralConfig`, per-layer rules; ``None``: float).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from qbits._errors import ConfigError, InvalidArgumentError
from qbits.config import (
    QuantConfig,
    Rule,
    _as_quant_config,
    _from_dict,
    _rule_tuple,
    _to_dict,
    presets,
)
from qbits.ops import DotGeneralConfig

__all__ = ["INITS", "LoraConfig", "LoraRule"]

#: How ``A`` starts (``B`` starts at zero, so the adapted model starts as
#: the base): ``"kaiming"``: uniform in ``[-1/sqrt(K), 1/sqrt(K)]`` (PEFT's
#: default, Kaiming-uniform with ``a = sqrt(5)``); ``"gaussian"``: normal
#: with standard deviation ``1 / rank``.
INITS = ("kaiming", "gaussian")


def _check_rank(value: Any, path: str, none: bool) -> None:
    if value is None and none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            path,
            value,
            "an int >= 1 (the adapter's rank; at most the smaller of the "
            "matmul's contraction and output sizes)"
            + (", or null (the config's rank)" if none else ""),
        )


def _check_alpha(value: Any, path: str, none: bool) -> None:
    if value is None and none:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not (math.isfinite(value) and value > 0):
        raise ConfigError(
            path,
            value,
            "a finite number > 0 (the adapter's output is scaled by "
            "alpha / rank)" + (", or null (the config's alpha)" if none else ""),
        )


@dataclasses.dataclass(frozen=True)
class LoraRule:
    """The matmuls whose path fully matches ``pattern``: adapted, or not.

    Attributes:
      pattern: A regular expression matched against the whole matmul path,
        as :func:`qbits.layer_table` names it (``"blocks/0/attn/query"``);
        a later use ``"fc1#2"`` is matched as itself and as ``"fc1"``. The
        same patterns as :class:`~qbits.Rule` (bounded-time matching).
      rank: The rank of these matmuls' adapters (``None``: the config's).
      alpha: Their alpha (``None``: the config's).
      adapt: ``False``: the matched matmuls get no adapter.

    Raises:
      ConfigError: For a bad pattern, a rank below 1 or an alpha that is
        not a finite number > 0.

    Example:
      >>> rule = qbits.lora.LoraRule(".*attn/(query|value)", rank=4)
      >>> rule.matches("blocks/0/attn/query"), rule.matches("blocks/0/attn/key")
      (True, False)
    """

    pattern: str
    rank: int | None = None
    alpha: float | None = None
    adapt: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rule", Rule(self.pattern))
        _check_rank(self.rank, "rank", none=True)
        _check_alpha(self.alpha, "alpha", none=True)
        if not isinstance(self.adapt, bool):
            raise ConfigError("adapt", self.adapt, "true or false")

    def matches(self, path: str) -> bool:
        """Whether ``path`` (or its base name, for ``path#2``) fully matches."""
        rule: Rule = self._rule  # type: ignore[attr-defined]
        base = path.split("#", 1)[0]
        return rule.matches(path) or (base != path and rule.matches(base))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA, QLoRA) on the matmuls the rules match.

    Each adapted weight matmul ``x . W`` computes ``x . W + (alpha / rank)
    * (dropout(x) . A) . B`` with ``A`` of shape ``(K, rank)`` and ``B`` of
    shape ``(rank, N)`` (``K`` the contraction size, ``N`` the output
    size; one pair per group for a weight with batch axes, stacked along
    a scan over stacked layers). ``B`` starts at zero, so the adapted
    model starts as the base. ``W`` is frozen; with ``base`` it is held
    quantized (QLoRA: ``base="nf4"``).

    Attributes:
      rank: The adapters' rank (an int >= 1).
      alpha: The scale numerator (a finite number > 0): the adapter's
        output is multiplied by ``alpha / rank``.
      dropout: Dropout on the adapter's input, in [0, 1); applied when the
        adapted function is given a ``dropout_key`` (training).
      rules: Ordered :class:`LoraRule` s, first full match wins; a weight
        matmul no rule matches gets no adapter. Every rule must match a
        matmul, and an adapting rule a weight matmul.
      init: How ``A`` starts (``B`` starts at zero, so the adapted model
        starts as the base): ``"kaiming"``: uniform in
        ``[-1/sqrt(K), 1/sqrt(K)]`` (PEFT's default, Kaiming-uniform with
        ``a = sqrt(5)``); ``"gaussian"``: normal with standard deviation
        ``1 / rank``.
      base: The format of the frozen base weights: a preset name
        (``"nf4"``, ``"w4g128_asym"``, ``"int4_weight_only"``...), a
        :class:`~qbits.DotGeneralConfig`, a :class:`~qbits.QuantConfig`
        (per-layer rules; ``None`` in a rule keeps a layer float), the path
        of a YAML file, or ``None`` (float: plain LoRA). Its forward config
        applies to the weight matmuls: their weights are stored quantized
        once (as :func:`qbits.serving.convert` stores them); activation x
        activation matmuls and convolutions run float. The config must
        leave the activations float (weight-only).

    Raises:
      ConfigError: For a value out of range (naming the field), rules that
        are not :class:`LoraRule` s, an unknown ``init`` or a bad ``base``.

    Example:
      >>> cfg = qbits.lora.LoraConfig(rank=4, alpha=8, base="nf4",
      ...     rules=(qbits.lora.LoraRule("head", adapt=False),
      ...            qbits.lora.LoraRule(".*")))
      >>> cfg.resolve("head"), cfg.resolve("blocks/0/mlp/fc1")
      ((0, None), (1, (4, 8)))
      >>> qbits.config.dump(cfg).splitlines()[-1]
      'base: nf4'
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    rules: tuple[LoraRule, ...] = (LoraRule(".*"),)
    init: str = "kaiming"
    base: Any = None

    def __post_init__(self) -> None:
        _check_rank(self.rank, "rank", none=False)
        _check_alpha(self.alpha, "alpha", none=False)
        d = self.dropout
        ok = isinstance(d, int | float) and not isinstance(d, bool)
        if not ok or not 0.0 <= d < 1.0:
            raise ConfigError(
                "dropout", d, "a number in [0, 1) (the probability of dropping "
                "an input of the adapter; 0 for none)",
            )  # fmt: skip
        rules = _rule_tuple(self.rules, LoraRule, "qbits.lora.LoraRule")
        object.__setattr__(self, "rules", rules)
        if self.init not in INITS:
            raise ConfigError("init", self.init, "one of " + ", ".join(INITS))
        try:
            _as_quant_config("qbits.lora.LoraConfig", self.base, allow_none=True)
        except InvalidArgumentError as e:
            raise ConfigError("base", self.base, e.allowed, why=e.why) from None
        except ConfigError as e:
            raise e.within("base") from None

    def resolve(self, path: str) -> tuple[int | None, tuple[int, float] | None]:
        """The rule that decides ``path``, and its adapter's ``(rank, alpha)``.

        Returns:
          ``(rule index, (rank, alpha))``; ``(index, None)`` for a rule that
          says no adapter, ``(None, None)`` when no rule matches.
        """
        for i, rule in enumerate(self.rules):
            if rule.matches(path):
                if not rule.adapt:
                    return i, None
                rank = self.rank if rule.rank is None else rule.rank
                alpha = self.alpha if rule.alpha is None else rule.alpha
                return i, (rank, alpha)
        return None, None

    def base_rules(self) -> QuantConfig:
        """``base`` as per-layer rules (``default=None`` for a float base)."""
        return _as_quant_config("qbits.lora.LoraConfig", self.base, allow_none=True)

    def to_data(self) -> dict[str, Any]:
        """The config as plain data (what :func:`qbits.config.dump` writes)."""
        default = LoraConfig()
        out: dict[str, Any] = {"rank": self.rank, "alpha": self.alpha}
        if self.dropout != default.dropout:
            out["dropout"] = self.dropout
        rules = []
        for rule in self.rules:
            data: dict[str, Any] = {"pattern": rule.pattern}
            data.update({k: getattr(rule, k) for k in ("rank", "alpha")
                         if getattr(rule, k) is not None})  # fmt: skip
            if not rule.adapt:
                data["adapt"] = False
            rules.append(data)
        out["rules"] = rules
        if self.init != default.init:
            out["init"] = self.init
        base = self.base
        out["base"] = base if base is None or isinstance(base, str) else _to_dict(base)
        return out

    @classmethod
    def from_data(cls, data: Any, path: str = "") -> LoraConfig:
        """A config from plain data (:func:`qbits.load_config` of it).

        Raises:
          ConfigError: Naming the path of the first bad value.
        """

        def at(key: Any) -> str:
            return f"{path}.{key}" if path else str(key)

        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, Mapping):
            raise ConfigError(
                path, data, "a mapping with keys among: " + ", ".join(fields)
            )
        for key in data:
            if key not in fields:
                raise ConfigError(at(key), key, "one of the keys: " + ", ".join(fields))
        kwargs = {k: v for k, v in data.items() if k not in ("rules", "base")}
        if "rules" in data:
            rules = data["rules"]
            if not isinstance(rules, list | tuple):
                raise ConfigError(at("rules"), rules, "a list of rules")
            kwargs["rules"] = tuple(
                _rule(r, f"{at('rules')}[{i}]") for i, r in enumerate(rules)
            )
        if "base" in data:
            kwargs["base"] = _base(data["base"], at("base"))
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise e.within(path) from None


def _rule(data: Any, path: str) -> LoraRule:
    keys = [f.name for f in dataclasses.fields(LoraRule)]
    if not isinstance(data, Mapping) or "pattern" not in data:
        raise ConfigError(
            path, data, "a mapping with a pattern (and rank, alpha, adapt)"
        )
    for key in data:
        if key not in keys:
            raise ConfigError(
                f"{path}.{key}", key, "one of the keys: " + ", ".join(keys)
            )
    try:
        return LoraRule(**data)
    except ConfigError as e:
        raise e.within(path) from None


def _base(data: Any, path: str) -> Any:
    if data is None or isinstance(data, str):
        if isinstance(data, str) and not data.endswith((".yaml", ".yml")):
            presets.check_name(data, path)
        return data
    if isinstance(data, Mapping) and set(data) <= {"rules", "default"} and data:
        return _from_dict(data, QuantConfig, path)
    return _from_dict(data, DotGeneralConfig, path)
