"""How a KV cache stores keys and values: :class:`CacheConfig` and its presets.

A cache config names the numerics of the stored keys and of the stored
values (``None``: float, the model's dtype) and which elements share a
scale. It is plain data, like every qbits config: a frozen dataclass whose
YAML form is::

    keys: {type: int, bits: 8}          # a numerics, as a quantizer's numerics
    values: {type: fp8, dtype: float8_e4m3fn}
    granularity: per_token              # per_token | per_head

(``keys: null`` or leaving the key out keeps float.) The stored values are
written by a :class:`~qbits.Quantizer` built from the config
(:meth:`CacheConfig.quantizer`): the numerics, ``AbsMax`` calibration and a
``PerChannel`` granularity over the cache layout ``[batch, position, heads,
head_dim]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from qbits._calibration import AbsMax
from qbits._errors import ConfigError, InvalidArgumentError
from qbits._granularity import PerChannel
from qbits._quantizer import Quantizer
from qbits.config import _construct, _from_dict, _resolve, _to_dict
from qbits.numerics import Fp8Numerics, IntNumerics, QNumerics

__all__ = ["CacheConfig", "as_cache_config"]

# Which elements of the cache share a scale.
_GRANULARITIES = ("per_token", "per_head")

# The axes a scale is shared over, in the cache layout [batch, position,
# heads, head_dim]: per token, over head_dim; per head, over the positions too.
_SHARED_AXES = {"per_token": (3,), "per_head": (1, 3)}

_FIELDS = ("keys", "values", "granularity")


def _check_numerics(name: str, numerics: Any) -> QNumerics | None:
    """``numerics`` if a cache can store with it (``NoNumerics`` is float)."""
    if numerics is None or getattr(numerics, "is_identity", False):
        return None
    allowed = (
        "None (float), IntNumerics stored in int8 or FpNumerics of an fp8 "
        "format (e.g. IntNumerics(bits=8), Fp8Numerics('float8_e4m3fn')), "
        "rounding to nearest and clipping"
    )
    # Codes that are the values (no zero point, no codebook), one byte each.
    if not isinstance(numerics, QNumerics) or numerics.asymmetric:
        raise InvalidArgumentError("CacheConfig", name, numerics, allowed)
    dtype = np.dtype(numerics.get_dtype())
    if numerics.codebook or not (dtype == np.int8 or dtype.name[:6] == "float8"):
        raise InvalidArgumentError(
            "CacheConfig",
            name,
            numerics,
            allowed,
            why=f"it stores {dtype.name}; the cache holds one byte per value",
        )
    if getattr(numerics, "noise_fn", None) is not None:
        raise InvalidArgumentError(
            "CacheConfig",
            name,
            numerics,
            allowed,
            why="it rounds stochastically; a cache is written without a key",
        )
    if not numerics.clips:
        raise InvalidArgumentError(
            "CacheConfig",
            name,
            numerics,
            allowed,
            why="clip=False; a value beyond a per-head scale must saturate, "
            "not overflow",
        )
    return numerics


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """How a KV cache stores the keys and values of decoded tokens.

    Each token's keys and values are quantized once, when the token is
    appended (quantize on write), and stored with their scales; attention
    reads them back (dequantize on read). ``None`` numerics store float
    values in the model's dtype.

    Presets, by name wherever a cache config is taken (and
    ``qbits.load_config(name, qbits.kvcache.CacheConfig)``): ``kv_float``
    (float keys and values), ``kv_int8`` and ``kv_fp8`` (int8 / fp8 E4M3,
    one scale per token and head), ``kv_int8_per_head`` and
    ``kv_fp8_per_head`` (one scale per head, set by the prompt).

    Attributes:
      keys: The numerics of the stored keys: ``IntNumerics(bits=8)`` (int8),
        ``Fp8Numerics("float8_e4m3fn")`` (fp8 E4M3; any fp8 format works),
        or ``None`` (float; ``NoNumerics()`` is the same).
      values: The numerics of the stored values, as ``keys``.
      granularity: Which elements share a scale. ``"per_token"``: one
        scale per token and head (shared over ``head_dim``), from that
        token's own absmax. ``"per_head"``: one scale per sequence and head
        (shared over positions and ``head_dim``), from the absmax of the
        first write (the prompt); later tokens are quantized with it and
        saturate beyond it.

    Raises:
      InvalidArgumentError: For numerics a cache cannot store (not int8 or
        fp8, stochastic rounding, no clipping) or an unknown granularity.

    Example:
      >>> from qbits import kvcache
      >>> cfg = kvcache.CacheConfig(keys=qbits.IntNumerics(bits=8),
      ...                           values=qbits.IntNumerics(bits=8))
      >>> cfg == qbits.load_config("kv_int8", kvcache.CacheConfig)
      True
      >>> print(qbits.config.dump(cfg), end="")
      keys:
        type: int
        bits: 8
        dtype: int8
      values:
        type: int
        bits: 8
        dtype: int8
      granularity: per_token
      >>> kvcache.CacheConfig(granularity="per_channel")
      Traceback (most recent call last):
      ...
      qbits.InvalidArgumentError: CacheConfig: granularity='per_channel' is not
      allowed; expected one of per_token, per_head.
    """

    keys: QNumerics | None = None
    values: QNumerics | None = None
    granularity: str = "per_token"

    def __post_init__(self) -> None:
        for name in ("keys", "values"):
            object.__setattr__(self, name, _check_numerics(name, getattr(self, name)))
        if not isinstance(self.granularity, str) or (
            self.granularity not in _GRANULARITIES
        ):
            raise InvalidArgumentError(
                "CacheConfig",
                "granularity",
                self.granularity,
                "one of " + ", ".join(_GRANULARITIES),
            )

    @property
    def is_float(self) -> bool:
        """Whether keys and values are both stored in float."""
        return self.keys is None and self.values is None

    def quantizer(self, which: str) -> Quantizer | None:
        """The quantizer that writes ``"keys"`` or ``"values"`` (``None``: float).

        Its granularity is on the cache layout ``[batch, position, heads,
        head_dim]``: shared over ``head_dim`` (per token) or over positions
        and ``head_dim`` (per head).

        Example:
          >>> from qbits import kvcache
          >>> cfg = qbits.load_config("kv_fp8_per_head", kvcache.CacheConfig)
          >>> q = cfg.quantizer("values")
          >>> q.numerics.dtype, q.granularity
          (dtype(float8_e4m3fn), PerChannel(shared_axes=(1, 3)))
        """
        if which not in ("keys", "values"):
            raise InvalidArgumentError(
                "CacheConfig.quantizer", "which", which, "'keys' or 'values'"
            )
        numerics = getattr(self, which)
        if numerics is None:
            return None
        return Quantizer(numerics, AbsMax(), PerChannel(_SHARED_AXES[self.granularity]))

    def describe(self) -> str:
        """A one-line description, e.g. ``"int8 keys and values, per-token scales"``.

        Example:
          >>> from qbits import kvcache
          >>> qbits.load_config("kv_fp8", kvcache.CacheConfig).describe()
          'float8_e4m3fn keys and values, per-token scales'
        """
        names = [
            "float" if n is None else np.dtype(n.get_dtype()).name
            for n in (self.keys, self.values)
        ]
        if names[0] == names[1]:
            stored = f"{names[0]} keys and values"
        else:
            stored = f"{names[0]} keys, {names[1]} values"
        if self.is_float:
            return stored
        return f"{stored}, {self.granularity.replace('_', '-')} scales"

    def to_data(self) -> dict[str, Any]:
        """The config as plain data (what :func:`qbits.config.dump` writes)."""
        return {
            "keys": _numerics_to_data(self.keys),
            "values": _numerics_to_data(self.values),
            "granularity": self.granularity,
        }

    @classmethod
    def from_data(cls, data: Any, path: str = "") -> CacheConfig:
        """A config from plain data (what :func:`qbits.load_config` calls).

        Raises:
          ConfigError: Naming the path of the first bad value, the value and
            what is allowed.

        Example:
          >>> from qbits import kvcache
          >>> data = {"keys": {"type": "int", "bits": 8}, "granularity": "per_head"}
          >>> qbits.load_config(data, kvcache.CacheConfig).describe()
          'int8 keys, float values, per-head scales'
          >>> qbits.load_config({"granularity": "per_row"}, kvcache.CacheConfig)
          Traceback (most recent call last):
          ...
          qbits.ConfigError: granularity: expected one of per_token, per_head,
          got 'per_row'.
        """
        if isinstance(data, str):  # a preset name
            if data not in _PRESETS:
                raise ConfigError(path, data, "a cache preset: " + ", ".join(_PRESETS))
            return _PRESETS[data]
        if not isinstance(data, Mapping) or not all(isinstance(k, str) for k in data):
            raise ConfigError(
                path,
                data,
                "a mapping with keys among: "
                + ", ".join(_FIELDS)
                + ", or a cache preset name",
            )
        for key in data:
            if key not in _FIELDS:
                raise ConfigError(
                    _join(path, key),
                    key,
                    "one of the keys of CacheConfig: " + ", ".join(_FIELDS),
                )
        kwargs: dict[str, Any] = {}
        for name in ("keys", "values"):
            if data.get(name) is not None:
                kwargs[name] = _numerics_from_data(data[name], _join(path, name))
        if "granularity" in data:
            kwargs["granularity"] = data["granularity"]
        return _construct(cls, kwargs, path)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _numerics_to_data(numerics: QNumerics | None) -> Any:
    """A numerics as a quantizer's ``numerics`` field is written (type tag)."""
    if numerics is None:
        return None
    return _to_dict(Quantizer(numerics))["numerics"]


def _numerics_from_data(value: Any, where: str) -> QNumerics:
    """A numerics from data, read as a quantizer's ``numerics`` field is."""
    try:
        return _from_dict({"numerics": value}, Quantizer).numerics
    except ConfigError as e:
        # from_dict names the place "numerics..."; the cache's is ``where``.
        rest = e.path.removeprefix("numerics")
        raise ConfigError(where + rest, e.value, e.allowed, why=e.why) from None


def _int8() -> IntNumerics:
    return IntNumerics(bits=8)


def _e4m3() -> Fp8Numerics:
    return Fp8Numerics("float8_e4m3fn")


_PRESETS: dict[str, CacheConfig] = {
    "kv_float": CacheConfig(),
    "kv_int8": CacheConfig(_int8(), _int8(), "per_token"),
    "kv_fp8": CacheConfig(_e4m3(), _e4m3(), "per_token"),
    "kv_int8_per_head": CacheConfig(_int8(), _int8(), "per_head"),
    "kv_fp8_per_head": CacheConfig(_e4m3(), _e4m3(), "per_head"),
}


def as_cache_config(owner: str, config: Any) -> CacheConfig:
    r"""``config`` as a :class:`CacheConfig`; ``None`` is float.

    What :func:`qbits.load_config` does with ``cls=CacheConfig``, with the
    caller's name in errors, for the entry points that take a cache config.

    Raises:
      InvalidArgumentError: Naming ``owner``, for anything else (a matmul
        preset such as ``"int8"`` included: it is not a cache config).
      ConfigError: For a file that does not hold a cache config, naming the
        file and the place in it.

    Example:
      >>> import pathlib, tempfile
      >>> from qbits import kvcache
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "cache.yaml"
      >>> _ = f.write_text("keys: {type: fp8}\nvalues: {type: int, bits: 8}\n")
      >>> kvcache._as_cache_config("me", f).describe()
      'float8_e4m3fn keys, int8 values, per-token scales'
      >>> kvcache._as_cache_config("me", "int8")
      Traceback (most recent call last):
      ...
      qbits.InvalidArgumentError: me: cache='int8' is not allowed; expected a
      qbits.kvcache.CacheConfig, the path of a YAML file (*.yaml), YAML text,
      its plain data (a dict), or a cache preset: kv_float, kv_int8, kv_fp8,
      kv_int8_per_head, kv_fp8_per_head.
    """
    if config is None:
        return CacheConfig()
    return _resolve(owner, config, CacheConfig, argument="cache")
