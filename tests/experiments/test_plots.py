"""The report's plots, drawn from synthetic run histories (nothing trains)."""

import json
import math

import matplotlib
import numpy as np
import pytest

from qbits._experiments import _plots as plots
from qbits._experiments import _report as report_lib
from qbits._experiments import _sweep as sweep_lib
from qbits._experiments import build_model, summarize, write_report
from qbits._experiments._loss_curves import loss_figure
from qbits._experiments._train import RunResult
from qbits.cli import main

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STEPS = 40  # under 50 steps the moving average is one step: the raw losses


def run(name, seed, bits, curve):
    """One run file's data, as :func:`qbits._experiments.run_sweep` writes it."""
    curve = [float(x) for x in curve]
    half = len(curve) // 2
    return {
        "name": name,
        "seed": seed,
        "bits": bits,
        "result": {
            "train_loss": float(np.mean(curve[-max(1, len(curve) // 10) :])),
            "eval_loss": curve[-1],
            "eval_accuracy": 0.5,
            "seconds": 1.0,
            "curve": curve,
            "eval_curve": [[half, curve[half - 1]], [len(curve), curve[-1]]],
        },
    }


def sweep_bits_history():
    """Like ``examples/sweep_bits.yaml``: 14 configs x 2 seeds, two diverge."""
    names = [("none", 32.0), ("int4_percentile", 4.0)]
    for fwd in (8, 4, 2):
        for bwd in ("8", "float"):
            for granularity in ("per_channel", "per_tensor"):
                names.append((f"fwd{fwd}_bwd{bwd}_{granularity}", float(fwd)))
    t = np.arange(STEPS)
    runs = []
    for i, (name, bits) in enumerate(names):
        for seed in (0, 1):
            curve = 2.3 * np.exp(-t / 8) + 0.1 * (1 + i / 10) + 0.01 * seed
            if name == "fwd2_bwd8_per_tensor":
                curve = 2.3 + 100 * t / STEPS  # ends near 100
            if name == "fwd2_bwdfloat_per_tensor":
                curve = np.where(t < 30, 2.3, math.nan)  # NaN from step 30
            runs.append(run(name, seed, bits, curve))
    return runs


DIVERGED = {"fwd2_bwd8_per_tensor", "fwd2_bwdfloat_per_tensor"}


def _draw_only(monkeypatch):
    """Figures are drawn, not rendered: which files are written is the test."""

    def save(fig, path):
        plt.close(fig)
        report_lib.replace_file(path, b"\x89PNG stub")

    monkeypatch.setattr(report_lib, "_save", save)


@pytest.fixture
def no_png(monkeypatch):
    _draw_only(monkeypatch)


def labelled(ax):
    return [line for line in ax.lines if not line.get_label().startswith("_")]


def test_styles_are_distinct_however_many():
    for n in (14, 280, 300):
        s = plots.styles(n)
        assert len({(x["color"], x["linestyle"], x["marker"]) for x in s}) == n


def test_divergence_is_non_finite_or_far_above_the_reference():
    runs = sweep_bits_history()
    assert plots.diverged(runs, "none") == DIVERGED
    # No baseline: the reference is the (lower) median final loss.
    assert plots.diverged(runs) == DIVERGED
    # Poor but learning (10x the baseline, below the first-step loss): kept.
    poor = [run("none", 0, 32.0, [2.3, 0.1]), run("int2", 0, 2.0, [2.3, 1.0])]
    assert plots.diverged(poor, "none") == set()
    # Two runs and no baseline: the lower middle one is the reference.
    two = [run("a", 0, 8.0, [2.3, 0.5]), run("b", 0, 8.0, [2.3, 90.0])]
    assert plots.diverged(two) == {"b"}


def test_sweep_loss_curves_keep_14_series_distinct_and_diverged_clipped():
    runs = sweep_bits_history()
    names = list(dict.fromkeys(r["name"] for r in runs))
    fig = loss_figure("mlp_bits", runs, names, "none")
    try:
        full, tail, ratio, evals = fig.axes
        lines = labelled(full)
        assert [line.get_label().split(" ")[0] for line in lines] == names
        styles = {
            (
                matplotlib.colors.to_rgba(x.get_color()),
                x.get_linestyle(),
                x.get_marker(),
            )
            for x in lines
        }
        assert len(styles) == len(names) == 14
        marked = {x.get_label() for x in lines if x.get_label().endswith("(diverged)")}
        assert marked == {f"{n} (diverged)" for n in DIVERGED}
        assert [t.get_text() for t in fig.legends[0].get_texts()] == [
            x.get_label() for x in lines
        ]
        # The diverged runs do not flatten the rest: y fits the others, log scale.
        for ax in (full, tail):
            top = ax.get_ylim()[1]
            kept = [x for x in labelled(ax) if "diverged" not in x.get_label()]
            highest = max(np.max(x.get_ydata()) for x in kept)
            assert highest < top < 1.5 * highest
            for x in labelled(ax):
                y = np.asarray(x.get_ydata())
                assert np.all(np.isfinite(y)) and np.all(y <= top)
                if "diverged" in x.get_label():
                    assert y[-1] > highest  # clipped at the top edge
        assert full.get_yscale() == "log" and tail.get_yscale() == "linear"
        assert tail.get_xlim()[0] >= 0.7 * STEPS - 2
        assert len(labelled(ratio)) == 13  # every config but the baseline
        assert len(labelled(evals)) == 14
        # Mean over the two seeds, band from the lowest to the highest.
        line = lines[names.index("int4_percentile")]
        group = [r["result"]["curve"] for r in runs if r["name"] == "int4_percentile"]
        np.testing.assert_allclose(line.get_ydata(), np.mean(group, axis=0))
        assert len(full.collections) == 12  # one band per non-diverged config
    finally:
        plt.close(fig)


def test_ratio_panel_is_loss_over_the_baseline_at_the_same_step_and_seed():
    rng = np.random.default_rng(0)
    curves = {
        (name, seed): 2 + rng.random(STEPS)
        for name in ("float32", "int8")
        for seed in (0, 1)
    }
    runs = [
        run(n, s, 32.0 if n == "float32" else 8.0, c) for (n, s), c in curves.items()
    ]
    fig = loss_figure("train", runs, ["float32", "int8"], "float32")
    try:
        ratio = fig.axes[2]
        assert ratio.get_title() == "training loss / float32 at the same step and seed"
        (line,) = labelled(ratio)
        want = np.mean(
            [curves["int8", s] / curves["float32", s] for s in (0, 1)], axis=0
        )
        np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-12)
        np.testing.assert_array_equal(line.get_xdata(), np.arange(1, STEPS + 1))
    finally:
        plt.close(fig)


def test_no_baseline_no_ratio_panel():
    runs = [run("a", 0, 8.0, [2.0] * 4), run("b", 0, 4.0, [2.1] * 4)]
    fig = loss_figure("x", runs, ["a", "b"], None)
    try:
        assert not fig.axes[2].axison and not labelled(fig.axes[2])
    finally:
        plt.close(fig)


def test_quality_vs_bits_has_a_legend_error_bars_and_clips_the_diverged():
    runs = sweep_bits_history()
    fig = plots.quality_figure("mlp_bits", runs, summarize(runs, "none"), "none")
    try:
        (ax,) = fig.axes
        bars = ax.containers
        assert len(bars) == 14 and all(b.has_yerr for b in bars)
        points = {(b.lines[0].get_color(), b.lines[0].get_marker()) for b in bars}
        assert len(points) == 14
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert sum(label.endswith("(diverged)") for label in labels) == 2
        top = ax.get_ylim()[1]
        assert top < 3  # the others' ratios, not the diverged ~100
        for b in bars:
            assert b.lines[0].get_ydata()[0] <= top
    finally:
        plt.close(fig)


def test_quality_vs_bits_only_for_several_bit_widths(tmp_path, no_png):
    one = [run("none", 0, 32.0, [2.0] * 4), run("int8", 0, 8.0, [2.02] * 4)]
    several = [*one, run("int4", 0, 4.0, [2.2] * 4)]
    write_report("sweep", several, tmp_path, "none")
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["files"][-1] == "quality_vs_bits.png"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(summary["files"])
    write_report("train", one, tmp_path, "none")  # the last report's is removed
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["files"] == [
        "results.md",
        "results.csv",
        "results.json",
        "loss_curves.png",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(summary["files"])


def test_a_ptq_report_shows_eval_losses_not_one_training_curve(tmp_path, no_png):
    """Runs evaluated, not trained (qbits ptq): eval_loss.png, "—" for nan."""
    base = run("float32", 0, 32.0, [3.0, 2.5, 2.0])
    base["result"]["seconds"] = math.nan  # evaluated, not timed
    quantized = [run(f"w3 {m}", 0, 3.0, [x]) for m, x in (("rtn", 2.2), ("awq", 2.1))]
    for r in quantized:  # no training: no curve, no training loss
        r["result"] |= {"train_loss": math.nan, "curve": [], "eval_curve": []}
    (tmp_path / "loss_curves.png").write_bytes(b"an earlier report's")
    rows = write_report("ptq", [base, *quantized], tmp_path, "float32")
    assert [r["config"] for r in rows] == ["float32", "w3 rtn", "w3 awq"]
    files = json.loads((tmp_path / "results.json").read_text())["files"]
    assert files[-1] == "eval_loss.png" and "loss_curves.png" not in files
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    table = (tmp_path / "results.md").read_text()
    assert "nan" not in table
    assert "| float32 | float | 1 | 2.0000 | 2.0000 | 1.0000 | 0.500 | — |" in table
    assert "| w3 rtn | 3 | 1 | — | 2.2000 | 1.1000 |" in table
    csv_row = (tmp_path / "results.csv").read_text().splitlines()[2]
    assert csv_row.startswith("w3 rtn,3.0,1,,2.2,") and "nan" not in csv_row
    # A trained report in the same folder: the curves again, no eval_loss.png.
    write_report("train", [base, run("int8", 0, 8.0, [3.0, 2.6, 2.1])], tmp_path)
    assert not (tmp_path / "eval_loss.png").exists()
    assert (tmp_path / "loss_curves.png").exists()


def diagnostics_records(steps, every, sqnr):
    """What train(..., diagnostics=every) records, made up."""
    return [
        {"step": step, "matmul": matmul, "operand": op, "sqnr_db": sqnr + i,
         "clipped": 0.0, "flushed": 0.002 if op == "fwd.rhs" else 0.0,
         "wasted_bits": 0.0, "log2_scale_min": -7.0, "log2_scale_max": -6.0}
        for step in [*range(every, steps, every), steps]
        for i, matmul in enumerate(("layers/0", "head"))
        for op in ("fwd.lhs", "fwd.rhs", "dlhs.grad")
    ]  # fmt: skip


def fake_train(
    spec, config, *, seed, steps, progress=None, on_trained=None, diagnostics=0
):
    loss = 2.0 if config is None else 2.0 + 0.01 * seed
    if on_trained is not None:  # qbits train saves the float32 params
        on_trained(build_model(spec, seed)[0])
    records = []
    if diagnostics and config is not None:
        records = diagnostics_records(steps, diagnostics, 20.0 + seed)
    return RunResult(
        loss, loss, 0.5, [loss] * steps, [(steps, loss)], 0.0, diagnostics=records
    )


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_wrote_line_lists_every_file(command, tmp_path, monkeypatch, capsys, no_png):
    monkeypatch.setattr(sweep_lib, "train", fake_train)
    out = tmp_path / "out"
    if command == "train":
        argv = ["train", "int8", "--size", "tiny", "--steps", "3", "--out", str(out)]
    else:
        (tmp_path / "s.yaml").write_text(
            "model: mlp\nsize: tiny\nsteps: 3\nconfigs: [none]\n"
            "grid: {fwd_bits: [8, 4]}\n"
        )
        argv = ["sweep", str(tmp_path / "s.yaml"), "--out", str(out)]
    assert main([*argv, "-q"]) == 0
    wrote = capsys.readouterr().out.strip().splitlines()[-1]
    if command == "train":  # and where the float32 params are, for qbits ptq
        wrote, params = wrote.split("; the float32 params in ")
        assert params.startswith(f"{out}/runs/float32__seed0.params")
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    assert ("quality_vs_bits.png" in files) == (command == "sweep")
    runs = 2 if command == "train" else 3
    listed = json.loads((out / "results.json").read_text())["files"]
    assert wrote == f"wrote {out}/{', '.join(listed)}; {runs} run files in {out}/runs/"
    for name in files:
        assert name in wrote


def test_diagnostics_tables_and_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep_lib, "train", fake_train)
    (tmp_path / "s.yaml").write_text(
        "model: mlp\nsize: tiny\nsteps: 4\nseeds: [0, 1]\nconfigs: [none, int8]\n"
    )
    out = tmp_path / "out"
    argv = ["sweep", str(tmp_path / "s.yaml"), "--out", str(out), "-q"]
    assert main([*argv, "--diagnostics", "2"]) == 0
    listed = json.loads((out / "results.json").read_text())["files"]
    for name in ("diagnostics.md", "diagnostics.csv", "diagnostics_sqnr.png",
                 "diagnostics_layers.png"):  # fmt: skip
        assert name in listed and (out / name).is_file()
    table = (out / "diagnostics.md").read_text()
    assert "| layers/0 | 20.5 | 20.5 | 20.5 |" in table  # the last step, mean of seeds
    assert "| layers/0 | 0.0 | 0.2 | 0.0 |" in table  # flushed, in %
    assert "Clipped" not in table  # nothing clipped
    lines = (out / "diagnostics.csv").read_text().splitlines()
    assert lines[0].startswith("config,seed,step,matmul,operand,sqnr_db")
    assert len(lines) == 1 + 2 * 2 * 2 * 3  # seeds x steps x matmuls x operands
    # A finished run measured otherwise is run again; one measured alike is not
    # (the figures drawn, not rendered again).
    _draw_only(monkeypatch)
    assert main([*argv, "--diagnostics", "2"]) == 0
    assert main([*argv, "--diagnostics", "4"]) == 0
    run = json.loads((out / "runs" / "int8__seed0.json").read_text())
    assert {r["step"] for r in run["result"]["diagnostics"]} == {4}


def test_diagnostics_table_names_a_nonfinite_operand():
    from qbits._experiments._diagnostic_plots import diagnostics_table, write_csv

    def rec(matmul, operand, sqnr, nonfinite=0):
        return {"step": 3, "matmul": matmul, "operand": operand, "sqnr_db": sqnr,
                "clipped": 0.0, "flushed": 0.0, "wasted_bits": 0.0,
                "log2_scale_min": -4.0, "log2_scale_max": -2.0,
                "nonfinite": nonfinite}  # fmt: skip

    records = [rec("fc1", "fwd.lhs", 30.0), rec("fc2", "fwd.lhs", math.nan, 5)]
    runs = [{"name": "int8", "seed": 0, "result": {"diagnostics": records}}]
    table = diagnostics_table(runs)
    assert "| fc1 | 30.0 |" in table
    assert "| fc2 | non-finite |" in table
    header, *lines = write_csv(runs).splitlines()  # the CSV keeps the count
    columns = ["config", "seed", "step", "matmul", "operand", "sqnr_db"]
    assert header.split(",")[:6] == columns
    assert header.split(",")[-1] == "nonfinite" and lines[1].endswith(",5")
