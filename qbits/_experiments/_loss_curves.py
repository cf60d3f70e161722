"""The loss curves of a report (``loss_curves.png``): four panels, one legend.

- the training loss over every step, smoothed by a moving average over 1/25
  of the steps;
- the tail: the last 30% of the steps, its y range fitted to the configs
  that did not diverge;
- each config's smoothed training loss divided by the baseline's at the same
  step and seed (when the baseline is among the runs): where two configs'
  curves lie on top of each other, this panel shows how far apart they are;
- the eval loss at each evaluation.

Seeds, styles, log scales and diverged runs: see :mod:`qbits._experiments._plots`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from qbits._experiments._plots import (
    DIVERGED_FACTOR,
    clip,
    diverged,
    edge_of,
    limits,
    palette,
    pyplot,
    run_curve,
    set_yscale,
)

__all__ = ["SMOOTH", "TAIL", "loss_figure"]

TAIL = 0.3  # the tail panel: the last 30% of the steps
SMOOTH = 25  # moving average over 1/25 of the steps


@dataclasses.dataclass
class _Series:
    """One config's curves, one row per seed."""

    name: str
    style: dict[str, Any]
    diverged: bool
    x: np.ndarray  # the steps of the smoothed curves
    loss: np.ndarray  # (seeds, steps): smoothed training loss
    ratio: np.ndarray | None  # (seeds, steps): loss / the baseline's
    eval_x: np.ndarray
    eval_y: np.ndarray  # (seeds, evaluations)


def _series(
    runs: Sequence[dict[str, Any]], names: Sequence[str], baseline: str | None
) -> tuple[list[_Series], int]:
    """Every config's smoothed curves, ratios and evaluations; the window."""
    bad = diverged(runs, baseline)
    longest = max((len(run_curve(r)) for r in runs), default=0)
    window = max(1, longest // SMOOTH)

    def smooth(run):
        c = run_curve(run)
        return np.convolve(c, np.ones(window) / window, mode="valid")

    base_runs = [
        r for r in runs if r["name"] == baseline and len(run_curve(r)) >= window
    ]
    base = {r["seed"]: smooth(r) for r in base_runs}
    base_mean = None
    if base:
        n = min(len(b) for b in base.values())
        base_mean = np.mean([b[:n] for b in base.values()], axis=0)
    style_of = palette(names, baseline)
    out = []
    for name in names:
        group = [r for r in runs if r["name"] == name]
        drawn = [r for r in group if len(run_curve(r)) >= window]
        curves = [smooth(r) for r in drawn]
        length = min((len(c) for c in curves), default=0)
        loss = np.array([c[:length] for c in curves]).reshape(len(curves), length)
        ratio = None
        if base_mean is not None and name != baseline and length:
            under = [base.get(r.get("seed"), base_mean) for r in drawn]  # same seed
            n = min(length, *(len(b) for b in under))
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.array(
                    [c[:n] / b[:n] for c, b in zip(curves, under, strict=True)]
                )
        evals = [r["result"].get("eval_curve") or [] for r in group]
        n_evals = min(len(e) for e in evals)
        eval_y = np.array(
            [[p[1] for p in e[:n_evals]] for e in evals], np.float64
        ).reshape(len(group), n_evals)
        out.append(
            _Series(
                name,
                style_of[name],
                name in bad,
                np.arange(window, window + length),
                loss,
                ratio,
                np.array([p[0] for p in evals[0][:n_evals]], np.float64),
                eval_y,
            )
        )
    return out, window


def _panel(ax, series, pick, title, keep=None, every=6):
    """Draws ``pick(s) -> (x, ys)`` of every series on ``ax``; fits y to the rest.

    ``keep(x)`` selects the steps shown (the tail). Returns nothing.
    """
    data = []
    for s in series:
        got = pick(s)
        if got is None or not got[1].size:
            continue
        x, ys = got
        if keep is not None:
            ys = ys[:, keep(x)]
            x = x[keep(x)]
        if len(x):
            data.append((s, x, ys))
    fit = [ys for s, _, ys in data if not s.diverged] or [ys for _, _, ys in data]
    lo, hi, log = limits([np.concatenate([y.min(0), y.max(0)]) for y in fit])
    edge = edge_of(lo, hi, log)
    for i, (s, x, ys) in enumerate(data):
        mean = ys.mean(axis=0)
        if s.diverged:
            mean = clip(mean, edge)
        elif len(ys) > 1:
            ax.fill_between(
                x, ys.min(0), ys.max(0), color=s.style["color"], alpha=0.15, lw=0
            )
        step = max(1, len(x) // every)
        ax.plot(
            x,
            mean,
            label=s.name + (" (diverged)" if s.diverged else ""),
            markevery=(i * step // max(1, len(data)) % step, step),
            markersize=5,
            **s.style,
        )
    set_yscale(ax, lo, hi, log)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3, which="both" if log else "major")


def _notes(series: Sequence[_Series], seeds: int) -> str:
    notes = []
    if seeds > 1:
        notes.append("mean over seeds, band: lowest to highest seed")
    if any(s.diverged for s in series):
        notes.append(
            f"diverged: a loss not finite, or a final loss > {DIVERGED_FACTOR:g}x "
            "the baseline's (or the median's) and above the first step's; drawn "
            "clipped at the top edge"
        )
    return "; ".join(notes) if len(" ".join(notes)) < 120 else "\n".join(notes)


def loss_figure(
    name: str,
    runs: Sequence[dict[str, Any]],
    names: Sequence[str],
    baseline: str | None = None,
) -> Any:
    """The loss curves of ``runs``: a matplotlib figure (see the module).

    Args:
      name: The title.
      runs: Data of the run files.
      names: The configs, in the order of the legend.
      baseline: The config the ratio panel divides by.

    Returns:
      The figure (``matplotlib.figure.Figure``; close it when done).

    Example:
      >>> from qbits._experiments._loss_curves import loss_figure
      >>> run = lambda name, loss: {"name": name, "seed": 0, "result": {
      ...     "curve": [loss] * 8, "eval_curve": [[8, loss]], "eval_loss": loss}}
      >>> fig = loss_figure("demo", [run("none", 2.0), run("int8", 2.02)],
      ...                   ["none", "int8"], "none")
      >>> [ax.get_title() for ax in fig.axes]  # doctest: +NORMALIZE_WHITESPACE
      ['training loss (moving average over 1 step)', 'last 30% of the steps',
       'training loss / none at the same step and seed', 'eval loss']
      >>> fig.axes[2].lines[1].get_ydata()
      array([1.01, 1.01, 1.01, 1.01, 1.01, 1.01, 1.01, 1.01])
    """
    plt = pyplot()
    series, window = _series(runs, names, baseline)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), layout="constrained")
    (full, tail), (ratio, evals) = axes
    steps = "step" if window == 1 else "steps"
    _panel(
        full,
        series,
        lambda s: (s.x, s.loss),
        f"training loss (moving average over {window} {steps})",
    )
    last = max((s.x[-1] for s in series if len(s.x)), default=0)
    start = last - TAIL * last
    _panel(
        tail,
        series,
        lambda s: (s.x, s.loss),
        f"last {TAIL:.0%} of the steps",
        keep=lambda x: x >= start,
    )
    if any(s.ratio is not None for s in series):
        ratio.axhline(1.0, color="black", lw=1.5, label="_baseline")
        _panel(
            ratio,
            [s for s in series if s.ratio is not None],
            lambda s: (s.x[: s.ratio.shape[1]], s.ratio),
            f"training loss / {baseline} at the same step and seed",
        )
    else:
        ratio.set_title("training loss / baseline", fontsize=10)
        ratio.text(
            0.5,
            0.5,
            "no baseline among the runs",
            ha="center",
            transform=ratio.transAxes,
        )
        ratio.set_axis_off()
    _panel(evals, series, lambda s: (s.eval_x, s.eval_y), "eval loss", every=100)
    full.set_ylabel("loss")
    evals.set_ylabel("loss")
    seeds = max(len(s.loss) for s in series) if series else 0
    fig.suptitle(f"{name}: loss curves", fontsize=11)
    notes = _notes(series, seeds)
    if notes:
        fig.supxlabel(notes, fontsize=9)
    handles, labels = full.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    return fig
