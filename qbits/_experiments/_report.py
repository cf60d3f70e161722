"""Results tables and plots of a sweep, rebuilt from its run files.

:func:`write_report` writes, to the output folder:

- ``results.md``: one row per config (mean over seeds, ``± std`` with more
  than one seed): bits, final train and eval loss, eval loss relative to the
  baseline, accuracy, time per run; "—" where a run has no such figure
  (a ``qbits ptq`` row has no training loss, its float32 row no time);
- ``results.csv`` and ``results.json``: the same rows as data (the JSON also
  has every run);
- ``loss_curves.png``: the training loss (all steps, and the tail), its
  ratio to the baseline's at the same step, the eval loss; or, when no
  run but the baseline's has a training curve (``qbits ptq``: quantized
  weights evaluated, not trained), ``eval_loss.png``: each config's eval
  loss beside the baseline's (an earlier report's other figure of the two
  is removed);
- ``quality_vs_bits.png``: eval loss relative to the baseline against the
  forward weight bits, only when the configs other than the baseline have
  more than one bit width below 32 (else one left by an earlier report in
  the folder is removed).

The plots are drawn by :mod:`qbits._experiments._loss_curves` and
:mod:`qbits._experiments._plots` (what they show; when a run has diverged).
With runs trained with diagnostics (``--diagnostics N``), also
``diagnostics.{md,csv}``, ``diagnostics_sqnr.png`` and
``diagnostics_layers.png`` (:mod:`qbits._experiments._diagnostic_plots`).

``results.json`` lists the files written, under ``"files"``.
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

from qbits._experiments._diagnostic_plots import (
    diagnostics_figures,
    diagnostics_table,
    write_csv,
)
from qbits._experiments._loss_curves import loss_figure
from qbits._experiments._plots import eval_figure, quality_figure, run_curve

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
      >>> from qbits._experiments._report import summarize
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
        ev = _cell(r["eval_loss"], ".4f")
        if r["seeds"] > 1:
            ev += f" ± {r['eval_loss_std']:.4f}"
        lines.append(
            f"| {r['config']} | {bits} | {r['seeds']} | "
            f"{_cell(r['train_loss'], '.4f')} | {ev} | {_cell(r['ratio'], '.4f')} | "
            f"{_cell(r['eval_accuracy'], '.3f')} | {_cell(r['seconds'], '.1f')} | "
            f"{_cell(r['compile_seconds'], '.1f')} | "
            f"{_cell(1000 * r['step_seconds'], '.1f')} |"
        )
    return f"# {name}\n\n" + "\n".join(lines) + "\n"


def _cell(value: float, spec: str) -> str:
    """A number of the table; "—" where there is none (nan: not measured)."""
    return "—" if math.isnan(value) else f"{value:{spec}}"


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
      >>> from qbits._experiments._report import replace_file
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


def _run_summary(run: dict[str, Any]) -> dict[str, Any]:
    """A run in ``results.json``, without its config text and diagnostics.

    (Its diagnostics are in ``diagnostics.csv`` and in its run file.)
    """
    out = {k: v for k, v in run.items() if k != "config"}
    if "diagnostics" in run["result"]:
        out["result"] = {k: v for k, v in run["result"].items() if k != "diagnostics"}
    return out


def write_report(
    name: str,
    runs: Sequence[dict[str, Any]],
    out: str | os.PathLike,
    baseline: str | None = None,
) -> list[dict[str, Any]]:
    """Writes the tables and plots of ``runs`` (run-file data) to ``out``.

    Args:
      name: The title.
      runs: Data of the run files (see :func:`qbits._experiments.run_sweep`).
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
      >>> rows = qbits._experiments.write_report(
      ...     "demo", [run("none", 2.0), run("int8", 2.02)], out, "none")
      >>> sorted(p.name for p in out.iterdir())  # one bit width: no quality plot
      ['loss_curves.png', 'results.csv', 'results.json', 'results.md']
    """
    import json

    out = pathlib.Path(out)
    rows = summarize(runs, baseline)
    replace_file(out / "results.md", _markdown(name, rows, baseline))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=_COLUMNS, lineterminator="\n")
    writer.writeheader()
    # An empty cell where nothing was measured (nan), as in the JSON's null.
    writer.writerows({k: "" if v != v else v for k, v in r.items()} for r in rows)
    replace_file(out / "results.csv", buffer.getvalue())
    summary = {
        "name": name,
        "baseline": baseline,
        "rows": [{k: (None if v != v else v) for k, v in r.items()} for r in rows],
        "runs": [_run_summary(r) for r in runs],
    }
    names = [r["config"] for r in rows]
    tables = ["results.md", "results.csv", "results.json"]
    diagnosed = diagnostics_table(runs)
    if diagnosed is not None:
        replace_file(out / "diagnostics.md", diagnosed)
        replace_file(out / "diagnostics.csv", write_csv(runs))
        tables += ["diagnostics.md", "diagnostics.csv"]
    figures: dict[str, Any] = {}
    # Runs evaluated, not trained (qbits ptq: only the baseline has curves):
    # their eval losses, not the baseline's training curve alone.
    others = [r for r in runs if r["name"] != baseline]
    trained = not others or any(len(run_curve(r)) for r in others)
    try:
        figures["loss_curves.png"] = (
            loss_figure(name, runs, names, baseline) if trained else None
        )
        figures["eval_loss.png"] = (
            None if trained else eval_figure(name, runs, rows, baseline)
        )
        figures["quality_vs_bits.png"] = quality_figure(name, runs, rows, baseline)
        figures.update(diagnostics_figures(name, runs, baseline))
        written = [f for f, fig in figures.items() if fig is not None]
        summary["files"] = [*tables, *written]
        replace_file(out / "results.json", json.dumps(summary, indent=1))
        for file, fig in list(figures.items()):
            if fig is None:  # not drawn: one of an earlier report would mislead
                (out / file).unlink(missing_ok=True)
            else:
                _save(figures.pop(file), out / file)
    finally:  # a figure not saved (an error while drawing or writing) is closed
        import matplotlib.pyplot as plt

        for fig in figures.values():
            if fig is not None:
                plt.close(fig)
    return rows
