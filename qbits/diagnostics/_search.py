"""Mixed precision under a bit budget: a per-layer choice of formats.

:func:`search_budget` measures, for every weight matmul of a function and
every candidate format, how much the loss changes when that matmul alone
takes the format (the other weight matmuls float), then picks one format
per matmul so that the stored weights fit a budget and the sum of the
changes is smallest: a multiple-choice knapsack, solved exactly by dynamic
programming over the budget cut into ``resolution`` steps (each cost
rounded *up* to whole steps, so the choice never exceeds the budget). The
choice is written as a :class:`~qbits.QuantConfig`: one rule per format,
its pattern the chosen matmuls' paths.

Why measured loss changes and not the diagnostics' SQNR or a second-order
estimate: the SQNR does not say what an operand costs the loss (4 bits
flush 90% of attention probabilities at a "good" 21 dB), and a Fisher
estimate covers the weights but not the quantized activations. A loss
measurement through the engine covers both and, on a small model, costs a
compilation per (matmul, format): a few minutes on two CPU cores for the
example transformer.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits import config as qconfig
from qbits import transform
from qbits._errors import ConfigError, InvalidArgumentError, check_int

__all__ = ["BudgetSearch", "search_budget"]

_OWNER = "qbits.diagnostics.search_budget"
_CALLER = transform._Caller(_OWNER, whole=False)
_UNITS = ("bits", "bytes")


@dataclasses.dataclass(frozen=True)
class BudgetSearch:
    """What :func:`search_budget` chose, and why.

    Attributes:
      config: The choice as per-layer rules (``qbits.config.dump`` writes it
        as YAML; ``qbits.load_config`` reads it back).
      choices: ``{matmul path: candidate label}`` of every weight matmul.
      budget: The budget as given, in ``unit``.
      unit: ``"bits"`` (mean stored bits per weight) or ``"bytes"``.
      bits: The choice's mean stored bits per weight (scales included).
      nbytes: The choice's stored weight bytes.
      reference_loss: The loss with every weight matmul float (matmuls of
        two activations as ``activations`` says).
      expected_loss: ``reference_loss`` plus the chosen formats' measured
        changes (the knapsack's objective).
      measured_loss: The loss of ``config`` itself (NaN when not measured).
      sensitivity: ``{path: {label: loss change}}``, one matmul at a time.
      costs: ``{path: {label: stored bytes}}`` (a format a matmul cannot
        take is left out).
      seconds: Wall time of the search.

    Example:
      >>> def loss(p, batch):  # the error against the float outputs
      ...     x, y = batch
      ...     return jnp.mean((x @ p["w"] - y) ** 2)
      >>> p = {"w": jax.random.normal(jax.random.key(0), (8, 8))}
      >>> x = jax.random.normal(jax.random.key(1), (4, 8))
      >>> got = qbits.diagnostics.search_budget(
      ...     loss, p, [(x, x @ p["w"])], ["w4a8", None], budget=8.0,
      ...     measure=False)
      >>> [got.with_budget(b).choices["w"] for b in (8.0, 32.0)]
      ['w4a8', 'float']
      >>> print(got.report().splitlines()[0])  # doctest: +ELLIPSIS
      Budget 8 bits per weight: chose 8.000 bits per weight (64 bytes) ...
    """

    config: Any
    choices: dict[str, str]
    budget: float
    unit: str
    bits: float
    nbytes: int
    reference_loss: float
    expected_loss: float
    measured_loss: float
    sensitivity: dict[str, dict[str, float]]
    costs: dict[str, dict[str, int]]
    seconds: float
    candidates: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    activations: Any = dataclasses.field(default=None, repr=False)
    elements: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)

    def with_budget(
        self, budget: float, unit: str | None = None, *, resolution: int = 4096
    ) -> BudgetSearch:
        """The choice under another budget, from the same measurements.

        No loss is measured: ``measured_loss`` is NaN and ``seconds`` the
        time of the search that measured the sensitivities.

        Args:
          budget: Mean stored bits per weight, or bytes.
          unit: ``"bits"`` or ``"bytes"`` (default: this search's unit).
          resolution: As for :func:`search_budget`.

        Raises:
          InvalidArgumentError: For a bad unit, budget or resolution, or a
            budget below the cheapest choice.
        """
        unit = self.unit if unit is None else unit
        _check_budget(budget, unit, resolution)
        paths, costs, total = list(self.costs), self.costs, sum(self.elements.values())
        budget_bytes = budget * total / 8 if unit == "bits" else float(budget)
        if math.floor(budget_bytes) <= resolution:
            step, capacity = 1.0, math.floor(budget_bytes)
        else:
            step, capacity = budget_bytes / resolution, resolution
        options = [list(costs[p]) for p in paths]
        picked = _knapsack(
            [[math.ceil(costs[p][lb] / step - 1e-9) for lb in o]
             for p, o in zip(paths, options, strict=True)],
            [[self.sensitivity[p][lb] for lb in o]
             for p, o in zip(paths, options, strict=True)],
            capacity,
        )  # fmt: skip
        if picked is None:
            least = sum(min(c.values()) for c in costs.values())
            raise InvalidArgumentError(
                _OWNER,
                "budget",
                budget,
                f">= {8 * least / total:.4g} bits per weight ({least} bytes), the "
                "cheapest candidate on every weight matmul",
            )
        choices = {p: o[j] for p, o, j in zip(paths, options, picked, strict=True)}
        nbytes = sum(costs[p][lb] for p, lb in choices.items())
        expected = sum(self.sensitivity[p][lb] for p, lb in choices.items())
        return dataclasses.replace(
            self,
            config=_rules(paths, choices, self.candidates, self.activations),
            choices=choices,
            budget=float(budget),
            unit=unit,
            bits=8 * nbytes / total,
            nbytes=nbytes,
            expected_loss=self.reference_loss + expected,
            measured_loss=math.nan,
        )

    def report(self) -> str:
        """A markdown report: the totals, then one row per weight matmul."""
        labels = list(next(iter(self.sensitivity.values()), {}))
        lines = [
            f"Budget {self.budget:g} {self.unit}"
            f"{' per weight' if self.unit == 'bits' else ''}: chose "
            f"{self.bits:.3f} bits per weight ({self.nbytes} bytes) in "
            f"{self.seconds:.1f} s; loss {self.reference_loss:.6g} with float "
            f"weights, expected {self.expected_loss:.6g}, measured "
            f"{self.measured_loss:.6g}.",
            "",
            "| matmul | choice | bytes | "
            + " | ".join(f"loss change {lb}" for lb in labels)
            + " |",
            "|---|---|---|" + "---|" * len(labels),
        ]
        for path, label in self.choices.items():
            deltas = self.sensitivity[path]
            cells = [f"{deltas[lb]:+.5f}" if lb in deltas else "—" for lb in labels]
            lines.append(
                f"| {path} | {label} | {self.costs[path][label]} | "
                + " | ".join(cells)
                + " |"
            )
        return "\n".join(lines)


def search_budget(
    fn: Callable[..., Any],
    params: Any,
    batches: Sequence[Any],
    candidates: Sequence[Any] | Mapping[str, Any],
    budget: float,
    *,
    unit: str = "bits",
    activations: Any = "cheapest",
    resolution: int = 4096,
    key: jax.Array | None = None,
    measure: bool = True,
) -> BudgetSearch:
    """Per-layer formats for a function's weight matmuls, under a bit budget.

    Each weight matmul (a matmul with a parameter operand, as
    :func:`qbits.layer_table` names it) takes each candidate in turn, the
    others float, and the change of the mean loss over ``batches`` is its
    sensitivity to it (one compilation each; candidates that store the
    same weight, codes and scales, and quantize the activation alike are
    measured once: int4 in tiles of 128 and per channel on a contraction
    of 128, or ``int8`` and ``int8_fwd``). The choice minimises the sum
    of the chosen changes with the stored weights (``qbits.serving``'s
    bytes: codes, scales, zero points) within the budget: a multiple-choice
    knapsack solved exactly by dynamic programming over the budget cut into
    ``resolution`` steps, costs rounded up (so never over the budget).

    Args:
      fn: ``fn(params, batch)``, a scalar loss.
      params: The trained float parameters (a pytree of arrays).
      batches: Batches to measure the loss on (pytrees of arrays of one
        structure and shape); a few are enough, the same for every format.
      candidates: The formats a weight matmul may take: preset names
        (``"w4a8"``), ``qbits.DotGeneralConfig`` s, or ``None`` (float);
        a sequence (labelled by preset name, ``float`` or
        ``candidates[i]``) or a mapping ``{label: format}``.
      budget: Mean stored bits per weight (``unit="bits"``) or the stored
        weights' bytes (``unit="bytes"``).
      unit: ``"bits"`` or ``"bytes"``.
      activations: The format of the matmuls without a weight (attention's
        ``q . k`` and ``p . v``; not chosen: they store nothing); by
        default the cheapest candidate's, as it adapts to two activations.
      resolution: Steps the budget is cut into (a budget of fewer bytes is
        solved byte by byte).
      key: PRNG key, for formats that round stochastically.
      measure: Also evaluate the chosen config (one more compilation).

    Returns:
      A :class:`BudgetSearch`: the config, the choice and the report.

    Raises:
      InvalidArgumentError: For a bad ``unit``, ``budget``, ``resolution``,
        no batches or candidates, a function without weight matmuls, or a
        budget below the cheapest choice.
      ConfigError: For a candidate that is not a format.

    Example:
      >>> def loss(p, x):
      ...     h = jax.nn.relu(x @ p["fc1"])
      ...     return jnp.mean((h @ p["fc2"]) ** 2)
      >>> k = jax.random.split(jax.random.key(0), 3)
      >>> p = {"fc1": jax.random.normal(k[0], (16, 32)),
      ...      "fc2": jax.random.normal(k[1], (32, 16))}
      >>> xs = [jax.random.normal(k[2], (8, 16)) for _ in range(2)]
      >>> got = qbits.diagnostics.search_budget(
      ...     loss, p, xs, ["w4a8", None], budget=6.0, measure=False)
      >>> got.choices, got.bits  # int4 codes and float32 scales per channel
      ({'fc1': 'w4a8', 'fc2': 'w4a8'}, 5.5)
      >>> print(qbits.config.dump(got.config).strip())
      rules: []
      default: w4a8
    """
    tic = time.perf_counter()
    labels, refs = _candidates(candidates)
    _check_budget(budget, unit, resolution)
    if isinstance(batches, str | bytes) or not isinstance(batches, Sequence):
        raise InvalidArgumentError(
            _OWNER, "batches", batches, "a non-empty sequence of batches"
        )
    if not batches:
        raise InvalidArgumentError(
            _OWNER, "batches", batches, "a non-empty sequence of batches"
        )
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
    found = transform._weight_matmuls(_CALLER, fn, params, batches[0])
    paths = [p for p, m in found.items() if not m.why_not]
    if not paths:
        raise InvalidArgumentError(
            _OWNER, "fn", fn, "a function with weight matmuls", why="it has none"
        )

    def config_of(chosen: Mapping[str, Any], rest: Any) -> Any:
        rules = [qconfig.Rule(re.escape(p), r) for p, r in chosen.items()]
        others = "|".join(re.escape(p) for p in paths if p not in chosen)
        if others:
            rules.append(qconfig.Rule(others, None))
        return qconfig.QuantConfig(tuple(rules), default=rest)

    def loss_of(config: Any) -> float:
        q = transform._quantize(_CALLER, fn, config, key)
        run = jax.jit(lambda p, b: jax.lax.map(lambda x: q(p, x), b).mean())
        return float(run(params, stacked))

    leaves = dict(jax.tree_util.tree_flatten_with_path(params)[0])

    def store(part: list[str], ref: Any) -> dict[str, Any]:
        if ref is None:
            return {}
        config = config_of(dict.fromkeys(part, ref), None)
        return transform._store_weights(_CALLER, fn, config, params, batches[0])

    costs: dict[str, dict[str, int]] = {p: {} for p in paths}
    weights: dict[str, dict[str, Any]] = {p: {} for p in paths}
    for label, ref in zip(labels, refs, strict=True):
        try:  # every weight matmul at once
            stored, fits = store(paths, ref), paths
        except ConfigError:  # one by one: some cannot take the format
            stored, fits = {}, []
            for p in paths:
                try:
                    stored.update(store([p], ref))
                    fits.append(p)
                except ConfigError:
                    pass
        for p in fits:
            costs[p][label] = _nbytes(stored.get(p), found[p].matmul, leaves)
            weights[p][label] = stored.get(p)
    elements = {p: math.prod(found[p].matmul.param_shape) for p in paths}
    if activations == "cheapest":
        spent = {lb: sum(c.get(lb, math.inf) for c in costs.values()) for lb in labels}
        activations = refs[labels.index(min(labels, key=spent.__getitem__))]
    reference = loss_of(config_of(dict.fromkeys(paths), activations))
    sensitivity: dict[str, dict[str, float]] = {}
    for path in paths:
        sensitivity[path] = {}
        side = "rhs" if found[path].matmul.side == "lhs" else "lhs"
        for label, ref in zip(labels, refs, strict=True):
            if label not in costs[path]:
                continue
            if ref is None:
                sensitivity[path][label] = 0.0
                continue
            twin = next(
                (
                    other
                    for other in sensitivity[path]
                    if _same_forward(
                        side,
                        (ref, weights[path][label]),
                        (refs[labels.index(other)], weights[path][other]),
                    )
                ),
                None,
            )
            if twin is not None:  # the same weight and activation: no new run
                sensitivity[path][label] = sensitivity[path][twin]
                continue
            got = loss_of(config_of({path: ref}, activations))
            sensitivity[path][label] = got - reference

    measured = BudgetSearch(
        config=None,
        choices={},
        budget=math.nan,
        unit=unit,
        bits=math.nan,
        nbytes=0,
        reference_loss=reference,
        expected_loss=math.nan,
        measured_loss=math.nan,
        sensitivity=sensitivity,
        costs=costs,
        seconds=math.nan,
        candidates=dict(zip(labels, refs, strict=True)),
        activations=activations,
        elements=elements,
    )
    found = measured.with_budget(budget, unit, resolution=resolution)
    loss = loss_of(found.config) if measure else math.nan
    return dataclasses.replace(
        found, measured_loss=loss, seconds=time.perf_counter() - tic
    )


def _check_budget(budget: Any, unit: Any, resolution: Any) -> None:
    """InvalidArgumentError for a bad budget, unit or resolution."""
    if unit not in _UNITS:
        raise InvalidArgumentError(_OWNER, "unit", unit, "'bits' or 'bytes'")
    if (
        isinstance(budget, bool)
        or not isinstance(budget, int | float)
        or not budget > 0
        or not math.isfinite(budget)
    ):
        raise InvalidArgumentError(_OWNER, "budget", budget, "a finite number > 0")
    check_int(_OWNER, "resolution", resolution, 1, 1 << 20)


def _candidates(candidates: Any) -> tuple[list[str], list[Any]]:
    """``(labels, refs)`` of the candidates; refs as :class:`~qbits.Rule` takes."""
    if isinstance(candidates, Mapping):
        items = list(candidates.items())
    elif isinstance(candidates, str) or not isinstance(candidates, Sequence):
        raise InvalidArgumentError(
            _OWNER,
            "candidates",
            candidates,
            "a sequence of formats (preset names, qbits.DotGeneralConfig, None) "
            "or a mapping {label: format}",
        )
    else:
        items = [
            ("float" if c is None else c if isinstance(c, str) else f"candidates[{i}]",
             c)
            for i, c in enumerate(candidates)
        ]  # fmt: skip
    if not items:
        raise InvalidArgumentError(
            _OWNER, "candidates", candidates, "at least one format"
        )
    labels = [str(label) for label, _ in items]
    if len(set(labels)) != len(labels):
        raise InvalidArgumentError(
            _OWNER, "candidates", candidates, "formats with distinct labels"
        )
    refs = []
    for label, ref in items:
        try:
            refs.append(qconfig.Rule(".*", ref).config)
        except ConfigError as e:
            raise e.within(f"candidates[{label!r}]") from None
    return labels, refs


def _same_forward(side: str, a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Whether two candidates run a weight matmul alike: ``(config, stored)`` each.

    The same stored weight (codes and scales: e.g. int4 in tiles of 128
    and per channel on an axis of 128) and the same forward config but for
    the weight's quantizer (``side``): the activation quantized alike.
    Backward configs do not matter to a loss.
    """
    (ref_a, stored_a), (ref_b, stored_b) = a, b
    ref_a, ref_b = (
        qconfig.presets.get(r) if isinstance(r, str) else r for r in a[:1] + b[:1]
    )
    fwd_a, fwd_b = getattr(ref_a, "fwd", None), getattr(ref_b, "fwd", None)
    if None in (fwd_a, fwd_b, stored_a, stored_b) or type(fwd_a) is not type(fwd_b):
        return False
    if any(
        getattr(fwd_a, f.name) != getattr(fwd_b, f.name)
        for f in dataclasses.fields(fwd_a)
        if f.name != side
    ):
        return False
    flat_a, tree_a = jax.tree.flatten(stored_a.weight)
    flat_b, tree_b = jax.tree.flatten(stored_b.weight)
    return tree_a == tree_b and all(
        x.shape == y.shape and x.dtype == y.dtype and bool(jnp.array_equal(x, y))
        for x, y in zip(flat_a, flat_b, strict=True)
    )


def _nbytes(stored: Any, matmul: Any, leaves: dict[Any, Any]) -> int:
    """Stored bytes of a weight: its quantized form, or the float parameter."""
    if stored is not None:
        return int(stored.weight.nbytes)
    dtype = getattr(leaves.get(tuple(matmul.keys)), "dtype", jnp.float32)
    return math.prod(matmul.param_shape) * np.dtype(dtype).itemsize


def _rules(
    paths: list[str], choices: dict[str, str], refs: dict[str, Any], rest: Any
) -> Any:
    """One rule per chosen format (its matmuls' paths); ``rest`` by default.

    The matmuls that chose ``rest`` get no rule of their own.
    """
    rules = []
    for label in dict.fromkeys(choices[p] for p in paths):
        ref = refs[label]
        if ref == rest:
            continue
        group = [re.escape(p) for p in paths if choices[p] == label]
        rules.append(qconfig.Rule("|".join(group), ref))
    return qconfig.QuantConfig(tuple(rules), default=rest)


def _knapsack(
    costs: Sequence[Sequence[int]], values: Sequence[Sequence[float]], capacity: int
) -> list[int] | None:
    """The multiple-choice knapsack, exactly: one option per item.

    Minimises the sum of the chosen ``values[i][j]`` with the sum of the
    chosen ``costs[i][j]`` (non-negative integers) at most ``capacity``;
    among choices of equal value, the cheapest. ``None`` if nothing fits.
    O(items x options x capacity).

    Example:
      >>> _knapsack([[1, 2], [1, 2]], [[1.0, 0.0], [0.5, 0.0]], 3)
      [1, 0]
    """
    best = np.full(capacity + 1, np.inf)
    best[0] = 0.0  # best[b]: the least value of a choice costing exactly b
    back = []
    for cost, value in zip(costs, values, strict=True):
        new = np.full(capacity + 1, np.inf)
        arg = np.full(capacity + 1, -1)
        for j, (c, v) in enumerate(zip(cost, value, strict=True)):
            if c > capacity:
                continue
            cand = np.full(capacity + 1, np.inf)
            cand[c:] = best[: capacity + 1 - c] + v
            better = cand < new
            new[better], arg[better] = cand[better], j
        best = new
        back.append(arg)
    if not np.isfinite(best).any():
        return None
    b = int(np.argmin(best))  # the first (cheapest) of the least values
    picked = []
    for i in range(len(back) - 1, -1, -1):
        j = int(back[i][b])
        picked.append(j)
        b -= costs[i][j]
    return picked[::-1]
