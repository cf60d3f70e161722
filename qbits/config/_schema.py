"""Configs as plain data: ``to_dict`` and ``from_dict``.

Behind :func:`qbits.config.dump` and :func:`qbits.load_config`.

The typed, frozen dataclasses of layers 1-4 (numerics, calibrations,
granularities, :class:`~qbits.Quantizer`, :class:`~qbits.MatmulConfig`,
:class:`~qbits.DotGeneralConfig`) *are* the schema: this module walks their
fields, so a config has one definition and its constructor's validation is
the validation of a file. A polymorphic field (``numerics``, ``calibration``,
``granularity``, ``noise_fn``) is a mapping whose ``type`` key names the
class, or just the name when every field keeps its default::

    fwd:
      lhs:
        numerics: {type: int, bits: 8}
        granularity: per_channel
      rhs:
        numerics: {type: fp8, dtype: float8_e4m3fn}

Fields equal to their defaults are left out of a dump, except the ones a
reader looks for first (``bits``, ``dtype``, ``tile_size``). Lists load as tuples.
Every error is a :class:`~qbits.ConfigError` naming the path of the bad value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from qbits._calibration import (
    AbsMax,
    AbsMean,
    Calibration,
    ConstantBound,
    MseSearch,
    Percentile,
)
from qbits._errors import ConfigError, InvalidArgumentError
from qbits._granularity import Granularity, PerChannel, PerTensor, Tiled
from qbits._providers import DelayedScaling, LearnedScale, ScaleProvider
from qbits._quantizer import Quantizer
from qbits.config import presets
from qbits.config._matmul import DotGeneralConfig, MatmulConfig
from qbits.numerics import (
    Fp8Numerics,
    FpNumerics,
    IntNumerics,
    Nf4Numerics,
    NoNumerics,
    QNumerics,
    TernaryNumerics,
    UintNumerics,
    UniformNoise,
)

__all__ = ["from_dict", "register", "to_dict"]

# Polymorphic fields: field name -> (base class, {type name: class}).
_KINDS: dict[str, tuple[type, dict[str, type]]] = {
    "numerics": (
        QNumerics,
        {
            "int": IntNumerics,
            "fp": FpNumerics,
            "fp8": Fp8Numerics,
            "none": NoNumerics,
            "uint": UintNumerics,
            "nf4": Nf4Numerics,
            "ternary": TernaryNumerics,
        },
    ),
    "calibration": (
        Calibration,
        {
            "absmax": AbsMax,
            "percentile": Percentile,
            "mse": MseSearch,
            "constant": ConstantBound,
            "absmean": AbsMean,
        },
    ),
    "provider": (
        ScaleProvider,
        {"delayed": DelayedScaling, "learned": LearnedScale},
    ),
    "granularity": (
        Granularity,
        {"per_tensor": PerTensor, "per_channel": PerChannel, "tiled": Tiled},
    ),
    "noise_fn": (object, {"uniform": UniformNoise}),
}
# Fields that always hold one class.
_FIXED: dict[str, type] = {
    "lhs": Quantizer,
    "rhs": Quantizer,
    "fwd": MatmulConfig,
    "dlhs": MatmulConfig,
    "drhs": MatmulConfig,
}


# Fields written even when they hold their default: what a reader looks for.
_ALWAYS = frozenset({"bits", "dtype", "tile_size"})


class _Missing:
    def __repr__(self) -> str:
        return "nothing"


MISSING = _Missing()


def register(field: str, name: str, cls: type) -> None:
    """Makes a custom class loadable and dumpable under ``type: name``.

    Args:
      field: ``"numerics"``, ``"calibration"``, ``"provider"``,
        ``"granularity"`` or ``"noise_fn"``.
      name: The ``type`` name the class gets in files.
      cls: A frozen dataclass (``flax.struct.PyTreeNode``) subclass of the
        field's base class, whose fields are plain data.

    Raises:
      InvalidArgumentError: For an unknown field, a name taken by another
        class (re-registering a redefinition of the same class is fine) or a
        class of the wrong kind.

    Example:
      >>> from flax import struct
      >>> class Sigmas(qbits.Calibration):
      ...     n: float = struct.field(pytree_node=False, default=3.0)
      ...     def bound(self, x, axes, quantize=None):
      ...         return self.n * jnp.sqrt(jnp.mean(x * x, axis=axes, keepdims=True))
      >>> qbits.config.register("calibration", "sigmas", Sigmas)
      >>> q = qbits.Quantizer(qbits.IntNumerics(bits=8), Sigmas(n=4.0))
      >>> print(qbits.config.dump(q.calibration), end="")
      n: 4.0
      >>> text = qbits.config.dump(q)
      >>> "type: sigmas" in text, qbits.load_config(text, qbits.Quantizer) == q
      (True, True)
    """
    if field not in _KINDS:
        raise InvalidArgumentError(
            "register", "field", field, "one of " + _names(_KINDS)
        )
    base, registry = _KINDS[field]
    if not (
        isinstance(cls, type)
        and issubclass(cls, base)
        and dataclasses.is_dataclass(cls)
    ):
        raise InvalidArgumentError(
            "register",
            "cls",
            cls,
            "a dataclass subclass of "
            + " or ".join(
                b.__name__ for b in (base if isinstance(base, tuple) else (base,))
            ),
        )
    taken = registry.get(name, cls) if isinstance(name, str) else None
    redefined = taken is not None and (taken.__module__, taken.__qualname__) == (
        cls.__module__,
        cls.__qualname__,
    )
    if taken is None or not redefined:
        raise InvalidArgumentError(
            "register",
            "name",
            name,
            "a str not taken by another class: taken are " + _names(registry),
        )
    registry[name] = cls


def _names(items: Any) -> str:
    return ", ".join(map(str, items))


def _type_name(field: str, obj: Any) -> str:
    for name, cls in _KINDS[field][1].items():
        if type(obj) is cls:
            return name
    raise InvalidArgumentError(
        "qbits.config.dump",
        field,
        obj,
        f"an instance of a registered class ({_names(_KINDS[field][1])}); "
        "register others with qbits.config.register",
    )


def to_dict(obj: Any) -> Any:
    """A config object as plain data (dicts, lists, str, numbers, bools, None).

    Args:
      obj: A :class:`~qbits.DotGeneralConfig`, :class:`~qbits.QuantConfig` or
        any piece of one (:class:`~qbits.MatmulConfig`,
        :class:`~qbits.Quantizer`, numerics, ...).

    Returns:
      A dict that :func:`from_dict` turns back into an equal object. Fields
      equal to their default are left out.

    Raises:
      InvalidArgumentError: For an object that is not a config (or holds a
        custom class that was not :func:`register` ed).

    Example:
      >>> lhs = qbits.config._to_dict(qbits.presets.get("int8_fwd"))["fwd"]["lhs"]
      >>> lhs["numerics"], lhs["granularity"]
      ({'type': 'int', 'bits': 8, 'dtype': 'int8'}, 'per_channel')
    """
    to_data = getattr(obj, "to_data", None)
    if to_data is not None and not isinstance(obj, type):  # a QuantConfig
        return to_data()
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise InvalidArgumentError(
            "qbits.config.dump", "config", obj, "a qbits config object"
        )
    return _fields_to_data(obj)


def ref_to_data(ref: Any) -> Any:
    """A rule's config as plain data: a preset name, ``None`` or a mapping."""
    return ref if ref is None or isinstance(ref, str) else to_dict(ref)


def _fields_to_data(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        shown = f.name in _ALWAYS and value is not None
        if not shown and _is_default(obj, f, value):
            continue
        out[f.name] = _value_to_data(f.name, value)
    return out


def _is_default(obj: Any, f: dataclasses.Field, value: Any) -> bool:
    if f.default is dataclasses.MISSING:
        return False
    try:
        return dataclasses.replace(obj, **{f.name: f.default}) == obj
    except (InvalidArgumentError, TypeError, ValueError):
        return False


def _value_to_data(name: str, value: Any) -> Any:
    if name in _KINDS and value is not None:
        tag = _type_name(name, value)
        data = _fields_to_data(value)
        return {"type": tag, **data} if data else tag
    if name in _FIXED:
        return _fields_to_data(value)
    if isinstance(value, tuple | list):
        return [_value_to_data("", v) for v in value]
    if isinstance(value, np.dtype):
        return value.name
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise InvalidArgumentError("qbits.config.dump", name, value, "plain data")


def from_dict(data: Any, cls: type = DotGeneralConfig, path: str = "") -> Any:
    """Builds a config object from plain data, validating every value.

    Args:
      data: What :func:`to_dict` (or ``yaml.safe_load``) gives.
      cls: The class to build: :class:`~qbits.DotGeneralConfig` (default),
        :class:`~qbits.QuantConfig`, :class:`~qbits.MatmulConfig` or
        :class:`~qbits.Quantizer`.
      path: Prefix of the paths in error messages.

    Returns:
      An instance of ``cls``.

    Raises:
      ConfigError: Naming the path of the first bad value, the value and what
        is allowed.

    Example:
      >>> cfg = qbits.config._from_dict(
      ...     {"fwd": {"rhs": {"numerics": {"type": "int", "bits": 4}}}})
      >>> cfg.fwd.rhs.numerics.bits
      4
    """
    from_data = getattr(cls, "from_data", None)
    if from_data is not None:  # a QuantConfig
        return from_data(data, path)
    return _build(cls, data, path)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _mapping(data: Any, path: str, what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(path, data, what)
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(path, key, "string keys", why="keys name fields")
    return data


def _build(cls: type, data: Any, path: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data = _mapping(data, path, f"a mapping with keys among: {_names(fields)}")
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(
                _join(path, key),
                key,
                f"one of the keys of {cls.__name__}: " + _names(fields),
            )
        kwargs[key] = _value_from_data(key, value, _join(path, key))
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and (
            f.default_factory is dataclasses.MISSING
        )
        if required and name not in kwargs:
            raise ConfigError(
                _join(path, name), MISSING, "a value (the key is required)"
            )
    return construct(cls, kwargs, path)


def construct(cls: type, kwargs: dict[str, Any], path: str) -> Any:
    """``cls(**kwargs)``, its refusal as a ConfigError naming the place."""
    try:
        return cls(**kwargs)
    except InvalidArgumentError as e:
        raise ConfigError(
            _join(path, e.argument), e.value, e.allowed, why=e.why
        ) from None
    except ConfigError as e:
        raise e.within(path) from None
    except (TypeError, ValueError, ArithmeticError) as e:
        # A constructor that fails without naming its argument (a custom class,
        # or a check that overflows): still one error naming the place.
        lines = str(e).strip().splitlines() or [""]
        raise ConfigError(
            path,
            dict(kwargs),
            f"arguments that {cls.__name__} accepts",
            why=f"{cls.__name__}(...) raised {type(e).__name__}: {lines[0][:200]}",
        ) from e


def _value_from_data(name: str, value: Any, path: str) -> Any:
    if name in _KINDS:
        return _polymorphic(name, value, path)
    if name in _FIXED:
        return _build(_FIXED[name], value, path)
    return _plain(value, path)


def _plain(value: Any, path: str) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_plain(v, f"{path}[{i}]") for i, v in enumerate(value))
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ConfigError(path, value, "a number, a string, a bool, a list or null")


def _polymorphic(field: str, value: Any, path: str) -> Any:
    registry = _KINDS[field][1]
    allowed = f"a type name ({_names(registry)}) or a mapping with a 'type' key"
    if value is None and field == "noise_fn":
        return None
    if isinstance(value, str):
        tag, rest, tag_path = value, {}, path
    elif isinstance(value, Mapping):
        if "type" not in value:
            raise ConfigError(
                _join(path, "type"), MISSING, f"one of {_names(registry)}"
            )
        rest = {k: v for k, v in value.items() if k != "type"}
        tag, tag_path = value["type"], _join(path, "type")
    else:
        raise ConfigError(path, value, allowed)
    if not isinstance(tag, str) or tag not in registry:
        raise ConfigError(tag_path, tag, f"one of {_names(registry)}")
    return _build(registry[tag], rest, path)


def _ref_from_data(value: Any, path: str) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        return presets.check_name(value, path)
    if isinstance(value, Mapping):
        return _build(DotGeneralConfig, value, path)
    raise ConfigError(
        path, value, "a preset name, a mapping (an inline config) or null (float)"
    )
