r"""Ablation sweep files: a grid of configs and seeds, read and checked.

A sweep file::

    name: lm_presets          # optional; default: the file name
    model: lm                 # lm | mlp
    size: default             # default | tiny (smoke tests) | deep (lm only)
    steps: 400                # optional; default: the model's
    seeds: [0, 1]             # optional; default [0]
    baseline: none            # the entry ratios are taken to; default: none
    configs:
      - none                  # a preset name
      - int8_fwd
      - {name: rules, config: rules.yaml}       # a config file (relative to
                                                # the sweep file)
      - {name: int4_pct, config: {fwd: {rhs: {numerics: {type: int, bits: 4},
                                              calibration: percentile}}}}
      - {name: w4, config: w4a8, bits: 4}       # bits: the plot's x value
    grid:                     # optional: IntNumerics configs, every combination
      fwd_bits: [8, 4]        # forward operands; null keeps the forward float
      bwd_bits: [8, null]     # both backward matmuls; null keeps them float
      granularity: [per_channel]      # optional, per_channel | per_tensor
      calibration: [absmax]           # optional, any calibration of the schema
      grad_rounding: [nearest]        # optional, nearest | stochastic

The file is read like a config file (:func:`qbits.config._yamlio.read_yaml`):
plain YAML only, each key once per mapping, and bounded in size, nesting and
alias expansion. ``name`` must be a plain file name (it names the default
output folder ``runs/<name>``: no ``/``, ``\``, ``.`` or ``..``); seeds are
distinct ints in ``0..2**32 - 1`` (JAX keys of larger seeds repeat smaller
ones); a sweep has at most :data:`MAX_RUNS` runs (configs times seeds).

"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import math
import os
import pathlib
import re
from typing import Any

import ml_dtypes
import numpy as np

import qbits
from qbits._experiments._models import ModelSpec, spec
from qbits.config import _read_yaml as read_yaml

__all__ = ["MAX_RUNS", "Entry", "Sweep", "SweepError", "config_bits", "load_sweep"]

_KEYS = ("name", "model", "size", "steps", "seeds", "baseline", "configs", "grid")
_GRID_KEYS = ("fwd_bits", "bwd_bits", "granularity", "calibration", "grad_rounding")
#: Most runs (configs times seeds) in one sweep.
MAX_RUNS = 10_000
_MAX_SEED = 2**32 - 1
_MAX_STEPS = 2**31 - 1  # the step counter is an int32


class SweepError(ValueError):
    """A sweep file is invalid; the message is one line naming the place.

    Example:
      >>> from qbits._experiments import SweepError
      >>> str(SweepError("sweep.yaml: seeds: expected a list of ints, got 'x'"))
      "sweep.yaml: seeds: expected a list of ints, got 'x'"
    """


@dataclasses.dataclass(frozen=True)
class Entry:
    """One config of a sweep.

    Attributes:
      name: The name in tables, plots and run files.
      config: The :class:`~qbits.QuantConfig` (``None`` for float32).
      bits: The forward weight bits, the x value of the quality-vs-bits plot
        (32 for float).
      source: Where the config is written, for errors found while training:
        its file (a config file, or the sweep file), or ``None``.
      where: The config's place in ``source``, e.g. ``"configs[2].config"``
        or ``"grid (fwd4_bwd8)"``; ``""`` for the whole file.
      single: The config is one :class:`~qbits.DotGeneralConfig` (a file or
        mapping with ``fwd``/``dlhs``/``drhs``, or a preset name), made the
        ``default`` of ``config``: its paths start at ``fwd``, not ``default``.

    Example:
      >>> from qbits._experiments import Entry
      >>> entry = Entry("w", qbits.QuantConfig(default="int8"), 8.0,
      ...               source="s.yaml", where="configs[1]", single=True)
      >>> e = qbits.ConfigError("default.fwd.rhs.granularity.tile_size", 48,
      ...                       "a divisor of 64", layer="head")
      >>> print(entry.locate(e))  # doctest: +NORMALIZE_WHITESPACE
      s.yaml: configs[1].fwd.rhs.granularity.tile_size: expected a divisor of
      64, got 48 (in layer 'head').
    """

    name: str
    config: qbits.QuantConfig | None
    bits: float
    source: str | None = None
    where: str = ""
    single: bool = False

    def locate(self, error: qbits.ConfigError) -> qbits.ConfigError:
        """``error``, raised by this entry's config, with its place in the file.

        Args:
          error: A :class:`~qbits.ConfigError` whose path starts where the
            config's :class:`~qbits.Resolution` says (``default`` or
            ``rules[i].config``).

        Returns:
          The error with :attr:`source` and the path inside it.
        """
        path = error.path
        if self.single and (path == "default" or path.startswith("default.")):
            path = path[len("default") :].lstrip(".")
        path = ".".join(p for p in (self.where, path) if p).replace(".[", "[")
        return qbits.ConfigError(
            path,
            error.value,
            error.allowed,
            why=error.why,
            source=self.source or error.source,
            layer=error.layer,
        )


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A parsed sweep file (see the module docstring for the format).

    Attributes:
      name: The sweep's name.
      spec: The model and its hyperparameters.
      steps: Training steps of every run.
      seeds: The seeds; every entry runs once per seed.
      entries: The configs.
      baseline: Name of the entry the ratios are relative to, or ``None``.
      size: ``default``, ``tiny`` or (lm) ``deep``.

    Example:
      >>> sweep = qbits._experiments.load_sweep("examples/sweep_lm.yaml")
      >>> sweep.spec.model, [e.name for e in sweep.entries][:3], sweep.seeds
      ('lm', ['none', 'int8_fwd', 'int8'], (0, 1))
    """

    name: str
    spec: ModelSpec
    steps: int
    seeds: tuple[int, ...]
    entries: tuple[Entry, ...]
    baseline: str | None
    size: str = "default"

    def run_id(self, entry: Entry, seed: int) -> str:
        """The run file's stem: ``<entry>__seed<S>``."""
        return f"{_safe(entry.name)}__seed{seed}"

    def fingerprint(self, entry: Entry, seed: int) -> str:
        """A hash of everything that determines one run's result."""
        config = "float" if entry.config is None else qbits.config.dump(entry.config)
        # The spec's default steps do not matter: self.steps is what runs.
        model = dataclasses.asdict(self.spec) | {"steps": None}
        if model["optimizer"] == "adamw":  # the runs from before it was a choice
            del model["optimizer"]
        text = json.dumps([model, self.steps, seed, config, qbits.__version__])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "config"


def numerics_bits(numerics: Any) -> float:
    """Bits of a numerics (32 for no quantization)."""
    bits = getattr(numerics, "bits", None)
    if isinstance(bits, int):
        return float(bits)
    dtype = getattr(numerics, "dtype", None)
    if dtype is not None:
        try:
            return float(ml_dtypes.finfo(np.dtype(dtype)).bits)
        except (TypeError, ValueError):
            pass
    return 32.0


def config_bits(config: qbits.QuantConfig | None) -> float:
    """Forward weight bits of a config: its default's, else its first rule's.

    The x value of a sweep's quality-versus-bits plot.

    Example:
      >>> from qbits._experiments import config_bits
      >>> config_bits(qbits.load_config("configs/w4a8.yaml")), config_bits(None)
      (4.0, 32.0)
    """
    if config is None:
        return 32.0
    for dg in config.all_configs():
        if not dg.fwd.is_identity:
            return numerics_bits(dg.fwd.rhs.numerics)
    return 32.0


def _fail(source: str, path: str, expected: str, got: Any) -> SweepError:
    return SweepError(f"{source}: {path}: expected {expected}, got {got!r}")


def _as_config(
    value: Any, source: str, path: str, base: pathlib.Path
) -> tuple[qbits.QuantConfig | None, dict[str, Any]]:
    """A preset name, a config file or an inline config -> (config, origin).

    ``origin`` holds the :class:`Entry` fields ``source``, ``where`` and
    ``single``.
    """
    if value is None or value == "none":
        return None, {}
    try:
        if isinstance(value, str):
            if value in qbits.presets.names():
                origin = {"source": source, "where": f"{path} ({value})"}
                return qbits.QuantConfig(default=value), origin | {"single": True}
            if value.endswith((".yaml", ".yml")):
                if not (base / value).is_file():
                    raise SweepError(
                        f"{source}: {path}: no config file {value!r} "
                        f"(paths are relative to the sweep file's folder)"
                    )
                config = qbits.load_config(base / value, None)
                origin = {"source": os.fspath(base / value)}
            else:
                raise _fail(
                    source,
                    path,
                    "a preset name (" + ", ".join(qbits.presets.names()) + "), a "
                    ".yaml file or an inline config",
                    value,
                )
        elif isinstance(value, dict):
            config = qbits.load_config(value, None)
            origin = {"source": source, "where": path}
        else:
            raise _fail(source, path, "a preset name, a .yaml file or a mapping", value)
    except qbits.ConfigError as e:
        if isinstance(value, str):
            raise SweepError(f"{source}: {path}: {e}") from None
        raise SweepError(f"{source}: {path}.{e}".replace(".: ", ": ")) from None
    if isinstance(config, qbits.QuantConfig):
        return config, origin
    return qbits.QuantConfig(default=config), origin | {"single": True}


def _grid_entries(grid: Any, source: str) -> list[Entry]:
    if not isinstance(grid, dict):
        raise _fail(source, "grid", "a mapping of " + ", ".join(_GRID_KEYS), grid)
    for key, values in grid.items():
        if key not in _GRID_KEYS:
            raise _fail(source, f"grid.{key}", "one of " + ", ".join(_GRID_KEYS), key)
        if not isinstance(values, list) or not values:
            raise _fail(source, f"grid.{key}", "a non-empty list", values)
    defaults = (8, None, None, None, None)
    axes = {k: grid.get(k, [d]) for k, d in zip(_GRID_KEYS, defaults, strict=True)}
    count = math.prod(len(values) for values in axes.values())
    if count > MAX_RUNS:
        raise _fail(source, "grid", f"at most {MAX_RUNS} combinations", f"{count:,}")
    _check_grid_values(grid, source)
    entries = []
    for combo in itertools.product(*axes.values()):
        fwd, bwd, gran, cal, rounding = combo
        parts = [f"fwd{fwd or 'float'}", f"bwd{bwd or 'float'}"]
        parts += [
            str(v) if not isinstance(v, dict) else v.get("type", "custom")
            for k, v in zip(_GRID_KEYS[2:], combo[2:], strict=True)
            if k in grid
        ]
        name = "_".join(parts)

        def quantizer(bits, noise=False, gran=gran, cal=cal):
            q: dict[str, Any] = {"numerics": {"type": "int", "bits": bits}}
            if noise:
                q["numerics"]["noise_fn"] = "uniform"
            if gran is not None:
                q["granularity"] = gran
            if cal is not None:
                q["calibration"] = cal
            return q

        doc: dict[str, Any] = {}
        if fwd is not None:
            doc["fwd"] = {"lhs": quantizer(fwd), "rhs": quantizer(fwd)}
        if bwd is not None:
            g = quantizer(bwd, noise=rounding == "stochastic")
            doc["dlhs"] = doc["drhs"] = {"lhs": g, "rhs": quantizer(bwd)}
        config, origin = _as_config(doc, source, f"grid ({name})", pathlib.Path("."))
        bits = float(fwd) if fwd is not None else 32.0
        entries.append(Entry(name, config, bits, **origin))
    return entries


def _check_grid_values(grid: dict[str, Any], source: str) -> None:
    """Checks every value of every grid axis, also those no combination uses.

    (A grid whose backward matmuls are all float never uses ``grad_rounding``,
    and one that is float throughout never uses ``granularity``: a typo there
    would otherwise pass unnoticed.)
    """
    for key, values in grid.items():
        for i, value in enumerate(values):
            where = f"grid.{key}[{i}]"
            if key in ("fwd_bits", "bwd_bits"):
                ok = value is None or (
                    isinstance(value, int) and not isinstance(value, bool)
                )
                if not ok:
                    raise _fail(source, where, "an int (bits) or null (float)", value)
            elif key == "grad_rounding":
                if value not in ("nearest", "stochastic"):
                    raise _fail(source, where, "nearest or stochastic", value)
            else:  # granularity, calibration: as a quantizer's field
                data = {"numerics": {"type": "int", "bits": 8}, key: value}
                try:
                    qbits.load_config(data, qbits.Quantizer)
                except qbits.ConfigError as e:
                    message = str(e).removeprefix(f"{e.path}: ")
                    place = where + e.path.removeprefix(key)
                    raise SweepError(f"{source}: {place}: {message}") from None


def _check_text(value: Any, source: str, path: str) -> str:
    """A non-empty name without control characters (it names files and rows)."""
    if not isinstance(value, str) or not value:
        raise _fail(source, path, "a non-empty string", value)
    bad = re.search(r"[\x00-\x1f\x7f]", value)
    if bad:
        raise _fail(
            source,
            path,
            f"a name without control characters (it names files, table rows "
            f"and plot labels; found {bad.group()!r})",
            value,
        )
    return value


def _check_name(name: Any, source: str) -> str:
    """The sweep's name: a plain file name, so ``runs/<name>`` stays in ``runs``."""
    if isinstance(name, str) and name:
        _check_text(name, source, "name")
    plain = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not re.search(r"[/\\\x00]", name)
        and pathlib.PurePath(name).name == name
    )
    if not plain:
        raise _fail(
            source,
            "name",
            "a plain file name (no '/', '\\', '.' or '..': it names the "
            "output folder runs/<name>)",
            name,
        )
    return name


def _check_seeds(seeds: Any, source: str) -> tuple[int, ...]:
    """Distinct ints in 0..2**32 - 1."""
    ok = isinstance(seeds, list) and seeds
    ok = ok and all(
        isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= _MAX_SEED
        for s in seeds
    )
    if not ok:
        raise _fail(
            source,
            "seeds",
            f"a non-empty list of ints in 0..{_MAX_SEED} (larger seeds give "
            "the keys of smaller ones)",
            seeds,
        )
    repeated = sorted(s for s, n in collections.Counter(seeds).items() if n > 1)
    if repeated:
        raise _fail(
            source,
            "seeds",
            "distinct seeds (a repeated seed repeats the same run: its spread "
            "would be 0)",
            repeated[0],
        )
    return tuple(seeds)


def load_sweep(path: str | os.PathLike) -> Sweep:
    r"""Reads and checks a sweep file.

    Args:
      path: The YAML file (format in :mod:`qbits._experiments._sweep`).

    Returns:
      A :class:`Sweep`.

    Raises:
      SweepError: For a file that cannot be read or is invalid; one line
        naming the file, the place in it, the value and what is allowed.

    Example:
      >>> import pathlib, tempfile
      >>> from qbits._experiments import load_sweep
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "s.yaml"
      >>> _ = f.write_text("model: mlp\nconfigs: [none, int8]\nseeds: [0, 1]")
      >>> sweep = load_sweep(f)
      >>> [e.name for e in sweep.entries], sweep.seeds, sweep.name
      (['none', 'int8'], (0, 1), 's')
    """
    path = pathlib.Path(path)
    source = os.fspath(path)
    try:
        data = read_yaml(path)
    except qbits.ConfigError as e:
        if e.allowed == "a readable file":
            why = f"cannot read the sweep file ({e.why})"
            raise SweepError(f"{source}: {why}") from None
        raise SweepError(str(e)) from None
    if not isinstance(data, dict):
        raise _fail(source, "the document", "a mapping with configs", data)
    for key in data:
        if key not in _KEYS:
            raise _fail(source, str(key), "one of the keys " + ", ".join(_KEYS), key)
    model = data.get("model", "lm")
    size = data.get("size", "default")
    try:
        model_spec = spec(model, size)
    except ValueError as e:
        raise SweepError(f"{source}: {e}") from None
    steps = data.get("steps", model_spec.steps)
    if (
        not isinstance(steps, int)
        or isinstance(steps, bool)
        or not 1 <= steps <= _MAX_STEPS
    ):
        raise _fail(source, "steps", f"a positive int (at most {_MAX_STEPS})", steps)
    seeds = _check_seeds(data.get("seeds", [0]), source)
    name = _check_name(data.get("name", path.stem), source)
    entries: list[Entry] = []
    configs = data.get("configs", [])
    if not isinstance(configs, list):
        raise _fail(source, "configs", "a list", configs)
    for i, item in enumerate(configs):
        where = f"configs[{i}]"
        if isinstance(item, str | None):
            config, origin = _as_config(item, source, where, path.parent)
            entries.append(Entry(item or "none", config, config_bits(config), **origin))
            continue
        if not isinstance(item, dict) or "config" not in item:
            raise _fail(source, where, "a preset name or {name, config[, bits]}", item)
        extra = set(item) - {"name", "config", "bits"}
        if extra:
            raise _fail(source, where, "the keys name, config, bits", sorted(extra))
        config, origin = _as_config(
            item["config"], source, f"{where}.config", path.parent
        )
        entry_name = item.get(
            "name", item["config"] if isinstance(item["config"], str) else f"config{i}"
        )
        _check_text(entry_name, source, f"{where}.name")
        bits = item.get("bits", config_bits(config))
        if (
            not isinstance(bits, int | float)
            or isinstance(bits, bool)
            or not 0 < bits < math.inf
        ):
            raise _fail(source, f"{where}.bits", "a positive finite number", bits)
        entries.append(Entry(entry_name, config, float(bits), **origin))
    if "grid" in data:
        entries += _grid_entries(data["grid"], source)
    if not entries:
        raise _fail(source, "configs", "at least one config (configs or grid)", [])
    names = [_safe(e.name) for e in entries]
    dupes = sorted(n for n, count in collections.Counter(names).items() if count > 1)
    if dupes:
        raise _fail(source, "configs", "distinct names", dupes[0])
    runs = len(entries) * len(seeds)
    if runs > MAX_RUNS:
        allowed = f"at most {MAX_RUNS} runs (configs x seeds)"
        raise _fail(source, "configs", allowed, runs)
    baseline = data.get("baseline", "none" if "none" in names else None)
    if baseline is not None and baseline not in [e.name for e in entries]:
        raise _fail(source, "baseline", "the name of one of the configs", baseline)
    return Sweep(name, model_spec, steps, seeds, tuple(entries), baseline, size)
