"""Results tables and plots of a sweep, rebuilt from its run files.

:func:`write_report` writes, to the output folder:

- ``results.md``: one row per config (mean over seeds, ``± std`` with more
  than one seed): bits, final train and eval loss, eval loss relative to the
  baseline, accuracy, time per run;
- ``results.csv`` and ``results.json``: the same rows as data (the JSON also
  has every run);
- ``loss_curves.png``: training loss per step (smoothed) and the evaluations;
- ``quality_vs_bits.png``: eval loss relative to the baseline against the
  forward weight bits.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["replace_file", "summarize", "write_report"]

_COLUMNS = (
    "config",
    "bits",
    "seeds",
    "train_loss",
    "eval_loss",
    "eval_loss_std",
    "ratio",
    "eval_accuracy",
    "seconds",
    "compile_seconds",
    "step_seconds",
)


def summarize(
    runs: Sequence[dict[str, Any]], baseline: str | None = None
) -> list[dict[str, Any]]:
    """One row per config: means over seeds, ratio of eval loss to ``baseline``.

    Example:
      >>> from qbits.experiments._report import summarize
      >>> run = lambda name, loss: {"name": name, "seed": 0, "bits": 8.0,
      ...     "result": {"train_loss": loss, "eval_loss": loss,
      ...                "eval_accuracy": 0.5, "seconds": 1.0}}
      >>> rows = summarize([run("none", 2.0), run("int8", 2.02)], "none")
      >>> [round(r["ratio"], 3) for r in rows]
      [1.0, 1.01]
    """
    order: list[str] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if run["name"] not in groups:
            order.append(run["name"])
        groups.setdefault(run["name"], []).append(run)
    rows = []
    for name in order:
        group = groups[name]

        def mean(key, group=group):
            return float(np.mean([r["result"].get(key, math.nan) for r in group]))

        evals = [r["result"]["eval_loss"] for r in group]
        rows.append(
            {
                "config": name,
                "bits": group[0]["bits"],
                "seeds": len(group),
                "train_loss": mean("train_loss"),
                "eval_loss": mean("eval_loss"),
                "eval_loss_std": float(np.std(evals)) if len(evals) > 1 else 0.0,
                "ratio": math.nan,
                "eval_accuracy": mean("eval_accuracy"),
                "seconds": mean("seconds"),
                "compile_seconds": mean("compile_seconds"),
                "step_seconds": mean("step_seconds"),
            }
        )
    base = next((r["eval_loss"] for r in rows if r["config"] == baseline), None)
    for row in rows:
        if base:
            row["ratio"] = row["eval_loss"] / base
    return rows


def _markdown(name: str, rows: list[dict[str, Any]], baseline: str | None) -> str:
    rel = f"eval / {baseline}" if baseline else "eval / baseline"
    lines = [
        f"| config | bits | seeds | train loss | eval loss | {rel} | accuracy "
        "| time / run (s) | compile (s) | step (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bits = "float" if r["bits"] >= 32 else f"{r['bits']:g}"
        ev = f"{r['eval_loss']:.4f}"
        if r["seeds"] > 1:
            ev += f" ± {r['eval_loss_std']:.4f}"
        ratio = "" if math.isnan(r["ratio"]) else f"{r['ratio']:.4f}"
        lines.append(
            f"| {r['config']} | {bits} | {r['seeds']} | {r['train_loss']:.4f} | "
            f"{ev} | {ratio} | {r['eval_accuracy']:.3f} | {r['seconds']:.1f} | "
            f"{r['compile_seconds']:.1f} | {1000 * r['step_seconds']:.1f} |"
        )
    return f"# {name}\n\n" + "\n".join(lines) + "\n"


def _plots(
    name: str, runs: Sequence[dict[str, Any]], rows: list[dict[str, Any]], out
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r["config"] for r in rows]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, config in enumerate(names):
        group = [r for r in runs if r["name"] == config]
        curves = [np.asarray(r["result"]["curve"], np.float64) for r in group]
        length = min(len(c) for c in curves)
        if length == 0:
            continue
        curve = np.mean([c[:length] for c in curves], axis=0)
        window = max(1, length // 25)
        smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
        color = colors[i % len(colors)]
        steps = np.arange(window, length + 1)
        ax.plot(steps, smooth, color=color, lw=1.2, label=f"{config} (train)")
        evals = group[0]["result"]["eval_curve"]
        if evals:
            points = np.mean(
                [[p[1] for p in r["result"]["eval_curve"]] for r in group], axis=0
            )
            ax.plot([p[0] for p in evals], points, "o--", color=color, ms=3, lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (solid: train, smoothed; dots: eval)")
    ax.set_title(f"{name}: loss curves")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, out / "loss_curves.png")

    fig, ax = plt.subplots(figsize=(6, 4.5))
    has_ratio = any(not math.isnan(r["ratio"]) for r in rows)
    key = "ratio" if has_ratio else "eval_loss"
    labels_at: dict[float, int] = {}
    for r in sorted(rows, key=lambda r: (r["bits"], -r[key])):
        color = colors[names.index(r["config"]) % len(colors)]
        ax.scatter(r["bits"], r[key], color=color, zorder=3)
        n = labels_at[r["bits"]] = labels_at.get(r["bits"], -1) + 1
        ax.annotate(
            r["config"],
            (r["bits"], r[key]),
            textcoords="offset points",
            xytext=(6, 4 - 11 * n),  # points at the same bits: labels stacked
            fontsize=8,
            color=color,
        )
    ax.set_xscale("log", base=2)
    ticks = sorted({r["bits"] for r in rows})
    ax.set_xticks(ticks, [("float32" if t >= 32 else f"{t:g}") for t in ticks])
    ax.set_xlabel("forward weight bits")
    ax.set_ylabel("eval loss / baseline" if has_ratio else "eval loss")
    if has_ratio:
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_title(f"{name}: quality vs bits")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, out / "quality_vs_bits.png")


def _save(fig: Any, path: pathlib.Path) -> None:
    """Saves a figure as PNG, atomically (see :func:`replace_file`); closes it."""
    import matplotlib.pyplot as plt

    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=110, format="png")
    finally:
        plt.close(fig)
    replace_file(path, buffer.getvalue())


def replace_file(path: pathlib.Path, data: str | bytes) -> None:
    """Writes ``data`` to ``path`` atomically: a temporary file, then ``os.replace``.

    Readers see the old file or the new one, never a part. If writing fails
    (a full disk), the temporary file is removed and the error names ``path``.

    Args:
      path: The file.
      data: Text (written as UTF-8) or bytes.

    Raises:
      OSError: With ``filename`` set to ``path`` and the cause's ``errno``.

    Example:
      >>> import pathlib, tempfile
      >>> from qbits.experiments._report import replace_file
      >>> f = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
      >>> replace_file(f, "hello")
      >>> f.read_text(), [p.name for p in f.parent.iterdir()]
      ('hello', ['a.txt'])
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(
            e.errno, f"cannot write the file ({e.strerror or e})", os.fspath(path)
        ) from None


def write_report(
    name: str,
    runs: Sequence[dict[str, Any]],
    out: str | os.PathLike,
    baseline: str | None = None,
) -> list[dict[str, Any]]:
    """Writes the tables and plots of ``runs`` (run-file data) to ``out``.

    Args:
      name: The title.
      runs: Data of the run files (see :func:`qbits.experiments.run_sweep`).
      out: The folder.
      baseline: The config the ratios are relative to.

    Returns:
      The summary rows (:func:`summarize`).

    Example:
      >>> import pathlib, tempfile
      >>> run = lambda name, loss: {"name": name, "seed": 0, "bits": 8.0,
      ...     "result": {"train_loss": loss, "eval_loss": loss, "curve": [loss],
      ...                "eval_curve": [(1, loss)], "eval_accuracy": 0.5,
      ...                "seconds": 1.0}}
      >>> out = pathlib.Path(tempfile.mkdtemp())
      >>> rows = qbits.experiments.write_report(
      ...     "demo", [run("none", 2.0), run("int8", 2.02)], out, "none")
      >>> sorted(p.name for p in out.iterdir())[:3]
      ['loss_curves.png', 'quality_vs_bits.png', 'results.csv']
    """
    import json

    out = pathlib.Path(out)
    rows = summarize(runs, baseline)
    replace_file(out / "results.md", _markdown(name, rows, baseline))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    replace_file(out / "results.csv", buffer.getvalue())
    summary = {
        "name": name,
        "baseline": baseline,
        "rows": [{k: (None if v != v else v) for k, v in r.items()} for r in rows],
        "runs": [{k: v for k, v in r.items() if k != "config"} for r in runs],
    }
    replace_file(out / "results.json", json.dumps(summary, indent=1))
    _plots(name, runs, rows, out)
    return rows
