"""The diagnostics of a sweep: per-layer tables, a heatmap, per-layer bars.

Runs trained with ``diagnostics=N`` (``qbits train/sweep --diagnostics N``)
hold the metrics of every quantized operand of every matmul every ``N``
steps (:attr:`~qbits._experiments.RunResult.diagnostics`). From them
:func:`write_diagnostics` writes:

- ``diagnostics.csv``: every record of every run (config, seed, step,
  matmul, operand and the metrics of :class:`qbits.diagnostics.Metrics`);
- ``diagnostics.md``: per config, the SQNR (dB) of each operand of each
  matmul at the last measurement, mean over seeds, and the fractions
  flushed to zero and clipped (where any reaches 0.1%);
- ``diagnostics_sqnr.png``: per config (a row of panels) and operand (a
  column), a heatmap of SQNR over matmuls (y) and training steps (x), of
  the first seed; a shared colour scale, grey where an operand is not
  quantized;
- ``diagnostics_layers.png``: per operand (a panel), the last SQNR of each
  matmul (bars grouped by matmul, one bar per config, mean over seeds;
  error bars from the lowest to the highest seed).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from qbits._experiments._plots import palette, pyplot

__all__ = ["diagnostics_figures", "diagnostics_table", "write_csv"]


def _records(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"config": run["name"], "seed": run["seed"], **rec}
        for run in runs
        for rec in run["result"].get("diagnostics") or []
    ]


def write_csv(runs: Sequence[dict[str, Any]]) -> str:
    """``diagnostics.csv``: one line per record of every run (see the module).

    The columns are the records' fields, in order: config, seed, step,
    matmul, operand, then the metrics :meth:`qbits.diagnostics.Metrics.rows`
    gives.
    """
    records = _records(runs)
    fields = list(dict.fromkeys(k for r in records for k in r))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    return buffer.getvalue()


def _last(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict]]:
    """``(config, matmul, operand) -> the last record of each seed``."""
    last_step: dict[tuple[str, int], int] = {}
    for r in records:
        key = (r["config"], r["seed"])
        last_step[key] = max(last_step.get(key, 0), r["step"])
    out: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        if r["step"] == last_step[r["config"], r["seed"]]:
            out.setdefault((r["config"], r["matmul"], r["operand"]), []).append(r)
    return out


def _ordered(records: list[dict[str, Any]], field: str) -> list[str]:
    return list(dict.fromkeys(r[field] for r in records))


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if finite else math.nan


# (metric, heading, scale, format): the tables of each config in diagnostics.md.
_TABLES = (
    ("sqnr_db", "SQNR (dB):", 1, ".1f"),
    ("flushed", "Flushed to zero (% of the nonzero values):", 100, ".1f"),
    ("clipped", "Clipped (% of the values):", 100, ".2f"),
)


def _nonfinite(record: dict[str, Any]) -> bool:
    """Whether the operand held a NaN or an inf (its other metrics are NaN)."""
    return record.get("nonfinite", 0) > 0


def _cell(value: float, scale: float, fmt: str) -> str:
    return "" if value != value else format(scale * value, fmt)


def diagnostics_table(runs: Sequence[dict[str, Any]]) -> str | None:
    """``diagnostics.md`` (see the module), or ``None`` without diagnostics."""
    records = _records(runs)
    if not records:
        return None
    last = _last(records)
    lines = [
        "# Diagnostics",
        "",
        "Each quantized operand at the last measurement (mean over seeds): "
        "its SQNR, and where any value is flushed to zero or clipped, the "
        "fractions (tables left out where none reaches 0.1%); a blank cell "
        "is an operand that is not quantized, `non-finite` one that held a "
        "NaN or an inf. "
        "Operands: `fwd.lhs` the activation, `fwd.rhs` the weight (for the "
        "attention einsums, q and the scores), `dlhs.grad`/`drhs.grad` the "
        "output gradient as each backward matmul quantizes it, `dlhs.rhs` "
        "and `drhs.lhs` the forward operands as the backward matmuls "
        "quantize them.",
    ]
    for config in _ordered(records, "config"):
        mine = [r for r in records if r["config"] == config]
        operands = [
            op
            for op in _ordered(mine, "operand")
            if any(
                r["sqnr_db"] == r["sqnr_db"] or _nonfinite(r)
                for r in mine
                if r["operand"] == op
            )
        ]
        step = max(r["step"] for r in mine)
        lines += ["", f"## {config} (step {step})"]
        for metric, title, scale, fmt in _TABLES:
            rows = []
            for matmul in _ordered(mine, "matmul"):
                groups = [last.get((config, matmul, op), []) for op in operands]
                cells = [
                    "non-finite"
                    if any(_nonfinite(r) for r in group)
                    else _cell(_mean([r[metric] for r in group]), scale, fmt)
                    for group in groups
                ]
                rows.append(f"| {matmul} | " + " | ".join(cells) + " |")
            if metric != "sqnr_db" and all(
                not (r[metric] >= 1e-3) for r in mine if r["step"] == step
            ):
                continue  # nothing clipped (flushed) worth a table
            lines += ["", title, "", "| matmul | " + " | ".join(operands) + " |"]
            lines += ["|---" * (len(operands) + 1) + "|", *rows]
    return "\n".join(lines) + "\n"


def _sqnr_limits(records: list[dict[str, Any]]) -> tuple[float, float]:
    values = [r["sqnr_db"] for r in records if r["sqnr_db"] == r["sqnr_db"]]
    values = [v for v in values if v < 140] or values  # lossless ones: capped
    if not values:
        return 0.0, 1.0
    return float(np.floor(min(values) / 5) * 5), float(np.ceil(max(values) / 5) * 5)


def _heatmap(name: str, records: list[dict[str, Any]]) -> Any:
    plt = pyplot()
    configs = _ordered(records, "config")
    operands = [
        op
        for op in _ordered(records, "operand")
        if any(r["sqnr_db"] == r["sqnr_db"] for r in records if r["operand"] == op)
    ]
    matmuls = _ordered(records, "matmul")
    lo, hi = _sqnr_limits(records)
    fig, axes = plt.subplots(
        len(configs),
        len(operands),
        figsize=(
            1.2 + 2.2 * len(operands),
            0.8 + (0.9 + 0.22 * len(matmuls)) * len(configs),
        ),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    cmap = plt.get_cmap("viridis").with_extremes(bad="0.85")
    image = None
    for i, config in enumerate(configs):
        mine = [r for r in records if r["config"] == config]
        seed = min(r["seed"] for r in mine)
        mine = [r for r in mine if r["seed"] == seed]
        steps = sorted({r["step"] for r in mine})
        for j, op in enumerate(operands):
            grid = np.full((len(matmuls), len(steps)), np.nan)
            for r in mine:
                if r["operand"] == op:
                    grid[matmuls.index(r["matmul"]), steps.index(r["step"])] = r[
                        "sqnr_db"
                    ]
            ax = axes[i, j]
            if np.all(np.isnan(grid)):
                ax.text(0.5, 0.5, "not quantized", ha="center", va="center",
                        transform=ax.transAxes, fontsize=8, color="0.4")  # fmt: skip
            image = ax.imshow(
                np.ma.masked_invalid(np.minimum(grid, hi)),
                aspect="auto",
                cmap=cmap,
                vmin=lo,
                vmax=hi,
                interpolation="nearest",
            )
            ax.set_xticks(range(len(steps)))
            ax.set_xticklabels([str(s) for s in steps], rotation=90, fontsize=6)
            ax.set_yticks(range(len(matmuls)))
            ax.set_yticklabels(matmuls, fontsize=7)
            if i == 0:
                ax.set_title(op, fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{config} (seed {seed})", fontsize=9)
            if i == len(configs) - 1:
                ax.set_xlabel("step", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.8, label="SQNR (dB)")
    fig.suptitle(f"{name}: SQNR per matmul and operand over training")
    return fig


def _bars(name: str, records: list[dict[str, Any]], baseline: str | None) -> Any:
    plt = pyplot()
    last = _last(records)
    configs = _ordered(records, "config")
    matmuls = _ordered(records, "matmul")
    operands = [
        op
        for op in _ordered(records, "operand")
        if any(r["sqnr_db"] == r["sqnr_db"] for r in records if r["operand"] == op)
    ]
    styles = palette(configs, baseline)
    fig, axes = plt.subplots(
        len(operands),
        1,
        figsize=(
            max(6.0, 0.55 * len(matmuls) * max(1, len(configs)) ** 0.5 + 2),
            2.3 * len(operands) + 0.8,
        ),
        squeeze=False,
        sharex=True,
        layout="constrained",
    )
    width = 0.8 / len(configs)
    x = np.arange(len(matmuls))
    for ax, op in zip(axes[:, 0], operands, strict=True):
        for k, config in enumerate(configs):
            recs = [last.get((config, m, op), []) for m in matmuls]
            values = [
                [r["sqnr_db"] for r in rs if r["sqnr_db"] == r["sqnr_db"]]
                for rs in recs
            ]
            mean = np.array([np.mean(v) if v else np.nan for v in values])
            low = np.array([mean[i] - min(v) if v else 0 for i, v in enumerate(values)])
            high = np.array(
                [max(v) - mean[i] if v else 0 for i, v in enumerate(values)]
            )
            if np.all(np.isnan(mean)):
                continue
            ax.bar(
                x + (k - (len(configs) - 1) / 2) * width,
                np.nan_to_num(mean),
                width,
                yerr=np.stack([low, high]),
                color=styles[config]["color"],
                label=config,
                capsize=1.5,
                error_kw={"elinewidth": 0.7},
            )
        ax.set_ylabel(f"{op}\nSQNR (dB)", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[-1, 0].set_xticks(x)
    axes[-1, 0].set_xticklabels(matmuls, rotation=45, ha="right", fontsize=7)
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(
        handles,
        labels,
        fontsize=8,
        loc="outside right upper",
    )
    fig.suptitle(f"{name}: SQNR per matmul at the last measurement (mean over seeds)")
    return fig


def diagnostics_figures(
    name: str, runs: Sequence[dict[str, Any]], baseline: str | None = None
) -> dict[str, Any]:
    """``{file: figure}`` of the diagnostics plots (empty without diagnostics)."""
    records = _records(runs)
    if not records:
        return {}
    return {
        "diagnostics_sqnr.png": _heatmap(name, records),
        "diagnostics_layers.png": _bars(name, records, baseline),
    }
