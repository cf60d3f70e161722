"""The plots of a report: what they share, eval loss against bits, eval loss.

The loss curves are :mod:`qbits._experiments._loss_curves`.
:func:`eval_figure` (``eval_loss.png``) draws each config's eval loss beside
the baseline's, one point per config: the figure of a report whose runs
were evaluated, not trained (``qbits ptq``: the float32 model and each
method's quantized weights), where training curves would show the
baseline's alone.
:func:`quality_figure` (``quality_vs_bits.png``) draws each config's eval
loss, relative to the baseline's when the baseline is among the runs,
against its forward weight bits, with error bars of one standard deviation
over seeds (the ``±`` of the table); the legend names the configs. It is
drawn only when the configs other than the baseline have more than one bit
width below 32: with one, every point sits in one column and the table says
the same.

In both, a config run with several seeds is the mean over its seeds (in the
loss panels, with a band from its lowest to its highest seed). Every config
has its own (colour, line style, marker), however many there are
(:func:`styles`); the baseline is black. A y axis is logarithmic when the
values it shows span more than a factor of 4. A config with a diverged run
(:func:`diverged`) is named "(diverged)" in the legend, left out when the y
ranges are fitted, and drawn clipped at the top edge of each panel, so that
it does not flatten the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "BASELINE",
    "DIVERGED_FACTOR",
    "LOG_SPAN",
    "clip",
    "diverged",
    "edge_of",
    "eval_figure",
    "limits",
    "palette",
    "pyplot",
    "quality_figure",
    "run_curve",
    "set_yscale",
    "styles",
]

DIVERGED_FACTOR = 4.0  # final loss above this many times the reference
LOG_SPAN = 4.0  # a y axis whose values span more than this factor is log

_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:gray",
    "tab:olive",
    "tab:cyan",
)
_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X")
BASELINE = {"color": "black", "linestyle": "-", "marker": "s", "linewidth": 2.2}


def styles(n: int) -> list[dict[str, Any]]:
    """``n`` distinct (colour, line style, marker) styles, as ``plot`` keywords.

    Style ``i`` has colour ``i % 10`` (matplotlib's ``tab10``), marker
    ``i % 7`` and line style ``(i // 10) % 4``: neighbours differ in colour
    and marker, and the first 280 are all distinct (the colour and marker
    fix ``i`` modulo 70, and the line style tells the four blocks of 70
    apart). Past 280, the colours are ``n`` distinct hues.

    Example:
      >>> from qbits._experiments._plots import styles
      >>> s = styles(14)
      >>> s[0]["color"], s[10]["color"], s[10]["linestyle"], s[10]["marker"]
      ('tab:blue', 'tab:blue', '--', 'v')
      >>> len({(x["color"], x["linestyle"], x["marker"]) for x in s})
      14
    """
    import matplotlib.colors

    out = []
    for i in range(n):
        if n <= 280:
            color: Any = _COLORS[i % 10]
        else:
            color = tuple(
                float(c) for c in matplotlib.colors.hsv_to_rgb((i / n, 0.85, 0.8))
            )
        out.append(
            {
                "color": color,
                "linestyle": _LINESTYLES[(i // 10) % 4],
                "marker": _MARKERS[i % 7],
                "linewidth": 1.3,
            }
        )
    return out


def palette(names: Sequence[str], baseline: str | None) -> dict[str, Any]:
    """Each config's style: the baseline's is black, the others' :func:`styles`."""
    others = [n for n in names if n != baseline]
    out = dict(zip(others, styles(len(others)), strict=True))
    return out | ({baseline: BASELINE} if baseline in names else {})


def _final(curve: np.ndarray) -> float:
    """The final training loss: the mean over the last 10% of the steps."""
    return float(np.mean(curve[-max(1, len(curve) // 10) :]))


def run_curve(run: dict[str, Any]) -> np.ndarray:
    """A run's training loss at every step (empty for a run of 0 steps)."""
    return np.asarray(run["result"].get("curve") or [], np.float64)


def diverged(runs: Sequence[dict[str, Any]], baseline: str | None = None) -> set[str]:
    """The configs with a diverged run.

    A run diverged when one of its training losses or its eval loss is not
    finite, or when its final training loss (the mean over its last 10% of
    steps, as ``train_loss``) is both more than 4 times the reference and
    above the median first-step loss of all runs (worse than before
    training). The reference is the baseline's final loss (the mean over its
    seeds) when the baseline is among the runs and finite, else the median of
    every run's final loss (the lower middle one for an even count). A poor
    config that still learns (a 2-bit run ending at 10 times the baseline's
    loss but below where it started) has not diverged.

    Args:
      runs: Data of the run files (see :func:`qbits._experiments.run_sweep`).
      baseline: The config the reference loss comes from.

    Returns:
      The names of the configs with at least one diverged run.

    Example:
      >>> from qbits._experiments._plots import diverged
      >>> run = lambda name, curve: {"name": name, "result": {
      ...     "curve": curve, "eval_loss": curve[-1]}}
      >>> runs = [run("none", [2.3, 0.5]), run("int2", [2.3, 1.5]),
      ...         run("int1", [2.3, 90.0]), run("nan", [2.3, float("nan")])]
      >>> sorted(diverged(runs, "none"))
      ['int1', 'nan']
    """
    out = set()
    finals, firsts = {}, []
    for i, run in enumerate(runs):
        curve = run_curve(run)
        eval_loss = run["result"].get("eval_loss", math.nan)
        if not np.all(np.isfinite(curve)) or not math.isfinite(
            math.nan if eval_loss is None else eval_loss
        ):
            out.add(run["name"])
        elif len(curve):
            finals[i] = _final(curve)
            firsts.append(curve[0])
    base = [finals.get(i) for i, r in enumerate(runs) if r["name"] == baseline]
    if base and None not in base:
        reference = float(np.mean(base))
    elif finals:
        reference = sorted(finals.values())[(len(finals) - 1) // 2]
    else:
        return out
    start = float(np.median(firsts))
    for i, final in finals.items():
        if final > DIVERGED_FACTOR * reference and final > start:
            out.add(runs[i]["name"])
    return out


def limits(arrays: Sequence[np.ndarray]) -> tuple[float, float, bool]:
    """The y range of the finite values of ``arrays``, padded; whether log."""
    finite = [a[np.isfinite(a)] for a in arrays]
    values = np.concatenate([np.ravel(a) for a in finite] or [np.zeros(0)])
    if not len(values):
        return 0.0, 1.0, False
    lo, hi = float(values.min()), float(values.max())
    if lo > 0 and hi / lo > LOG_SPAN:
        pad = (hi / lo) ** 0.06
        return lo / pad, hi * pad, True
    pad = 0.06 * (hi - lo) or 0.06 * abs(hi) or 0.06
    return lo - pad, hi + pad, False


def set_yscale(ax: Any, lo: float, hi: float, log: bool) -> None:
    """Sets the y range; a log axis labels its ticks as plain numbers (0.3, 2)."""
    import matplotlib.ticker as ticker

    class Plain(ticker.LogFormatter):  # labels the ticks it would, as 0.3
        def __call__(self, x, pos=None):
            return f"{x:.3g}" if super().__call__(x, pos) else ""

    ax.set_yscale("log" if log else "linear")
    ax.set_ylim(lo, hi)
    if log:
        ax.yaxis.set_major_formatter(Plain(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(
            Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5))
        )


def edge_of(lo: float, hi: float, log: bool) -> float:
    """Where a clipped (diverged) curve is drawn: just below the top edge."""
    return hi / (hi / lo) ** 0.015 if log else hi - 0.015 * (hi - lo)


def clip(y: np.ndarray, edge: float) -> np.ndarray:
    """A diverged curve as drawn: above ``edge`` or not finite, at ``edge``."""
    return np.where(np.isfinite(y), np.minimum(y, edge), edge)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _against_baseline(
    runs: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], baseline: str | None
) -> tuple[set[str], dict[str, Any], float, bool]:
    """Diverged configs, styles, the baseline's eval loss, whether it is the unit.

    The losses are drawn relative to the baseline's where it is finite, > 0.
    """
    base = next((r["eval_loss"] for r in rows if r["config"] == baseline), math.nan)
    style_of = palette([r["config"] for r in rows], baseline)
    return diverged(runs, baseline), style_of, base, math.isfinite(base) and base > 0


def _set_title(
    ax: Any, title: str, rows: Sequence[dict[str, Any]], notes: list[str], bad: str
) -> None:
    """``title``, then a line each: ``notes``, the error bars, ``bad`` (if any)."""
    seeds = max((r["seeds"] for r in rows), default=1)
    if seeds > 1:
        notes.append(f"mean over seeds; error bars: ± one std over {seeds} seeds")
    if bad:
        notes.append(bad)
    ax.set_title(title + "".join(f"\n{n}" for n in notes), fontsize=10)


def quality_figure(
    name: str,
    runs: Sequence[dict[str, Any]],
    rows: Sequence[dict[str, Any]],
    baseline: str | None = None,
) -> Any:
    """Eval loss against forward weight bits (see the module), or ``None``.

    Args:
      name: The title.
      runs: Data of the run files (for :func:`diverged`).
      rows: The summary rows (:func:`qbits._experiments.summarize`).
      baseline: The config the eval losses are relative to.

    Returns:
      The figure (close it when done), or ``None`` when the configs other
      than the baseline have fewer than two bit widths below 32.

    Example:
      >>> from qbits._experiments import summarize
      >>> from qbits._experiments._plots import quality_figure
      >>> run = lambda name, bits, loss: {"name": name, "seed": 0, "bits": bits,
      ...     "result": {"curve": [loss], "eval_loss": loss, "train_loss": loss}}
      >>> runs = [run("none", 32.0, 2.0), run("int8", 8.0, 2.02)]
      >>> print(quality_figure("demo", runs, summarize(runs, "none"), "none"))
      None
      >>> runs.append(run("int4", 4.0, 2.2))
      >>> fig = quality_figure("demo", runs, summarize(runs, "none"), "none")
      >>> fig.axes[0].get_legend_handles_labels()[1]
      ['none', 'int8', 'int4']
    """
    widths = {r["bits"] for r in rows if r["config"] != baseline and r["bits"] < 32}
    if len(widths) < 2:
        return None
    plt = pyplot()
    bad, style_of, base, relative = _against_baseline(runs, rows, baseline)
    scale = base if relative else 1.0
    fit = [1.0] if relative else []
    for r in rows:
        y, err = r["eval_loss"] / scale, r["eval_loss_std"] / scale
        if r["config"] not in bad and math.isfinite(y):
            fit += [y - err, y + err]
    lo, hi, log = limits([np.array(fit)])
    edge = edge_of(lo, hi, log)
    columns: dict[float, list[str]] = {}
    for r in rows:
        columns.setdefault(r["bits"], []).append(r["config"])
    fig, ax = plt.subplots(figsize=(9, 5.5), layout="constrained")
    for r in rows:
        config, style = r["config"], style_of[r["config"]]
        column = columns[r["bits"]]
        spread = min(0.5, 0.1 * (len(column) - 1))  # in octaves
        offset = column.index(config) * spread / max(1, len(column) - 1) - spread / 2
        y, err = r["eval_loss"] / scale, r["eval_loss_std"] / scale
        if config in bad:  # at the top edge, its value beside it
            shown = f"{y:.3g}" if math.isfinite(y) else "not finite"
            y, err = edge if not math.isfinite(y) else min(y, edge), 0.0
            ax.annotate(
                shown,
                (r["bits"] * 2**offset, y),
                textcoords="offset points",
                xytext=(5, -12),
                fontsize=7,
                color=style["color"],
            )
        ax.errorbar(
            r["bits"] * 2**offset,
            y,
            yerr=err if r["seeds"] > 1 else None,
            fmt=style["marker"],
            color=style["color"],
            markersize=7,
            capsize=3,
            label=config + (" (diverged)" if config in bad else ""),
        )
    if relative:
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ticks = sorted(columns)
    ax.set_xticks(ticks, [("float32" if t >= 32 else f"{t:g}") for t in ticks])
    ax.set_xlim(ticks[0] / 2**0.5, ticks[-1] * 2**0.5)
    set_yscale(ax, lo, hi, log)
    ax.set_xlabel("forward weight bits")
    ax.set_ylabel(f"eval loss / {baseline}" if relative else "eval loss")
    ax.grid(alpha=0.3)
    title = f"{name}: eval loss vs forward weight bits"
    bad_note = "diverged: drawn clipped at the top edge" if bad else ""
    _set_title(ax, title, rows, [], bad_note)
    fig.legend(loc="outside right upper", fontsize=8)
    return fig


def eval_figure(
    name: str,
    runs: Sequence[dict[str, Any]],
    rows: Sequence[dict[str, Any]],
    baseline: str | None = None,
) -> Any:
    """Each config's eval loss, one point per config, beside the baseline's.

    Each point is labelled with its eval loss relative to the baseline's (a
    dotted line); with several seeds, the mean and an error bar of one
    standard deviation. A loss that is not finite, or a diverged config's
    (:func:`diverged`), is drawn at the top edge, labelled. The arguments are
    :func:`quality_figure`'s.

    Returns:
      The figure (close it when done).

    Example:
      >>> from qbits._experiments import summarize
      >>> from qbits._experiments._plots import eval_figure
      >>> run = lambda name, loss: {"name": name, "seed": 0, "bits": 4.0,
      ...     "result": {"eval_loss": loss, "train_loss": loss}}
      >>> runs = [run("float32", 2.0), run("w4 rtn", 2.1), run("w4 gptq", 2.02)]
      >>> fig = eval_figure("demo", runs, summarize(runs, "float32"), "float32")
      >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
      ['float32', 'w4 rtn', 'w4 gptq']
      >>> [t.get_text() for t in fig.axes[0].texts]
      ['1.0000', '1.0500', '1.0100']
    """
    plt = pyplot()
    bad, style_of, base, relative = _against_baseline(runs, rows, baseline)
    names = [r["config"] for r in rows]
    fit = [
        r["eval_loss"] + sign * r["eval_loss_std"]
        for r in rows
        if r["config"] not in bad
        for sign in (-1, 1)
    ]
    lo, hi, log = limits([np.array(fit, np.float64)])
    edge = edge_of(lo, hi, log)
    fig, ax = plt.subplots(figsize=(max(6.0, 3 + 1.1 * len(rows)), 5))
    if relative:
        ax.axhline(base, color="black", lw=0.8, ls=":")
    for i, r in enumerate(rows):
        style, y = style_of[r["config"]], r["eval_loss"]
        shown = f"{y / base:.4f}" if relative else f"{y:.4f}"
        if not math.isfinite(y):
            shown, y = "not finite", edge
        elif r["config"] in bad:
            y = min(y, edge)
        ax.errorbar(
            i,
            y,
            yerr=r["eval_loss_std"] if r["seeds"] > 1 else None,
            fmt=style["marker"],
            color=style["color"],
            markersize=8,
            capsize=3,
        )
        ax.annotate(
            shown,
            (i, y),
            textcoords="offset points",
            xytext=(0, 9),
            ha="center",
            fontsize=8,
        )
    tilted = len(rows) > 4
    ax.set_xticks(
        range(len(rows)),
        names,
        rotation=25 if tilted else 0,
        ha="right" if tilted else "center",
    )
    ax.set_xlim(-0.6, len(rows) - 0.4)
    set_yscale(ax, lo, hi, log)
    ax.set_ylabel("eval loss")
    ax.grid(alpha=0.3, axis="y")
    notes = [f"labels: eval loss / {baseline} (dotted)"] if relative else []
    bad_note = "diverged or not finite: drawn at the top edge" if bad else ""
    _set_title(ax, f"{name}: eval loss of each config", rows, notes, bad_note)
    fig.set_layout_engine("constrained")
    return fig
