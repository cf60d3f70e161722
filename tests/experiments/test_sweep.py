"""Sweeps: the file format, one real sweep end to end, reruns and interruptions."""

import contextlib
import io
import json
import os
import shutil

import pytest

import qbits
from qbits.cli import main
from qbits.experiments import sweep as sweep_lib
from qbits.experiments.sweep import SweepError, load_sweep, run_sweep
from qbits.experiments.train import RunResult

SWEEP = """\
name: tiny
model: mlp
size: tiny
steps: 2
seeds: [0]
configs:
  - none
  - name: int8_fwd
    config: {rules: [{pattern: nothing, config: null}], default: int8_fwd}
"""


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A real two-config sweep, run once through the command."""
    root = tmp_path_factory.mktemp("sweep")
    (root / "sweep.yaml").write_text(SWEEP)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = main(["sweep", str(root / "sweep.yaml"), "--out", str(root / "out"), "-q"])
    assert rc == 0
    (root / "stderr.txt").write_text(stderr.getvalue())
    return root


def test_unused_rules_are_a_warning_line(finished):
    lines = (finished / "stderr.txt").read_text().splitlines()
    assert lines == ["warning: int8_fwd: rules[0] (pattern 'nothing') matched no layer"]


def test_sweep_writes_table_and_plots(finished):
    out = finished / "out"
    table = (out / "results.md").read_text()
    assert "| none | float | 1 |" in table
    assert "| int8_fwd | 8 | 1 |" in table
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("config,bits,seeds,train_loss,eval_loss")
    assert [line.split(",")[0] for line in csv_lines[1:]] == ["none", "int8_fwd"]
    summary = json.loads((out / "results.json").read_text())
    assert summary["baseline"] == "none"
    assert summary["rows"][0]["ratio"] == 1.0
    for png in ("loss_curves.png", "quality_vs_bits.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(out / "runs")) == [
        "int8_fwd__seed0.json",
        "none__seed0.json",
    ]


def _forbid_training(monkeypatch):
    calls = []

    def fake_train(spec, config, *, seed, steps, progress=None):
        calls.append(config)
        return RunResult(1.0, 1.0, 0.5, [1.0] * steps, [(steps, 1.0)], 0.0)

    monkeypatch.setattr(sweep_lib, "train", fake_train)
    return calls


def test_rerun_skips_finished_runs(finished, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    shutil.copytree(finished / "out", out)
    before = {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    calls = _forbid_training(monkeypatch)
    assert main(["sweep", str(finished / "sweep.yaml"), "--out", str(out)]) == 0
    assert calls == []
    assert "done before, skipped" in capsys.readouterr().out
    after = {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    assert after == before


def test_interrupted_sweep_reruns_only_what_is_missing(finished, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(finished / "out", out)
    runs = out / "runs"
    (runs / "int8_fwd__seed0.json").unlink()  # never finished
    (runs / ".int8_fwd__seed0.json.999.tmp").write_text('{"name": "int8_f')  # partial
    calls = _forbid_training(monkeypatch)
    assert main(["sweep", str(finished / "sweep.yaml"), "--out", str(out), "-q"]) == 0
    assert len(calls) == 1 and calls[0].resolve("x").name == "int8_fwd"
    assert json.loads((runs / "int8_fwd__seed0.json").read_text())["seed"] == 0


def test_a_truncated_run_file_is_rerun(finished, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(finished / "out", out)
    (out / "runs" / "none__seed0.json").write_text('{"name": "no')
    calls = _forbid_training(monkeypatch)
    assert main(["sweep", str(finished / "sweep.yaml"), "--out", str(out), "-q"]) == 0
    assert calls == [None]


def test_interrupt_keeps_finished_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "s.yaml").write_text(SWEEP.replace("[0]", "[0, 1]"))
    done = []

    def fake_train(spec, config, *, seed, steps, progress=None):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(seed)
        return RunResult(1.0, 1.0, 0.5, [1.0], [(1, 1.0)], 0.0)

    monkeypatch.setattr(sweep_lib, "train", fake_train)
    assert (
        main(["sweep", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "o")]) == 130
    )
    assert "interrupted" in capsys.readouterr().err
    names = sorted(p.name for p in (tmp_path / "o" / "runs").iterdir())
    assert names == ["none__seed0.json", "none__seed1.json"]


def test_changed_settings_change_the_fingerprint(tmp_path):
    (tmp_path / "a.yaml").write_text(SWEEP)
    (tmp_path / "b.yaml").write_text(SWEEP.replace("steps: 2", "steps: 3"))
    a, b = load_sweep(tmp_path / "a.yaml"), load_sweep(tmp_path / "b.yaml")
    assert a.fingerprint(a.entries[1], 0) != b.fingerprint(b.entries[1], 0)
    assert a.fingerprint(a.entries[1], 0) != a.fingerprint(a.entries[1], 1)
    assert a.fingerprint(a.entries[1], 0) == load_sweep(
        tmp_path / "a.yaml"
    ).fingerprint(a.entries[1], 0)


def test_grid_and_inline_configs(tmp_path):
    (tmp_path / "rules.yaml").write_text("rules: [{pattern: head, config: null}]\n")
    (tmp_path / "s.yaml").write_text(
        """\
model: lm
configs:
  - none
  - {name: rules, config: rules.yaml}
  - {name: pct4, config: {fwd: {rhs: {numerics: {type: int, bits: 4},
                                      calibration: percentile}}}}
  - {name: fp8, config: fp8}
grid:
  fwd_bits: [8, 4]
  bwd_bits: [8, null]
  grad_rounding: [stochastic]
"""
    )
    sweep = load_sweep(tmp_path / "s.yaml")
    names = [e.name for e in sweep.entries]
    assert names == [
        "none",
        "rules",
        "pct4",
        "fp8",
        "fwd8_bwd8_stochastic",
        "fwd8_bwdfloat_stochastic",
        "fwd4_bwd8_stochastic",
        "fwd4_bwdfloat_stochastic",
    ]
    bits = {e.name: e.bits for e in sweep.entries}
    assert bits == {
        "none": 32.0,
        "rules": 32.0,
        "pct4": 4.0,
        "fp8": 8.0,
        "fwd8_bwd8_stochastic": 8.0,
        "fwd8_bwdfloat_stochastic": 8.0,
        "fwd4_bwd8_stochastic": 4.0,
        "fwd4_bwdfloat_stochastic": 4.0,
    }
    grid = sweep.entries[6].config.resolve("x").config
    assert grid.fwd.rhs.numerics.bits == 4
    assert grid.dlhs.lhs.numerics.noise_fn is not None
    assert grid.dlhs.rhs.numerics.noise_fn is None
    assert sweep.entries[7].config.resolve("x").config.dlhs.is_identity
    assert sweep.baseline == "none" and sweep.steps == 800 and sweep.seeds == (0,)
    assert isinstance(sweep.entries[1].config, qbits.QuantConfig)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("configs: [int9]", "s.yaml: configs[0]: expected a preset name"),
        ("configs: [none]\nseeds: 0", "s.yaml: seeds: expected a non-empty list"),
        ("configs: [none]\nsteps: -1", "s.yaml: steps: expected a positive int"),
        ("configs: [none]\nmodel: cnn", "s.yaml: unknown model 'cnn'"),
        ("configs: [none]\nepochs: 3", "s.yaml: epochs: expected one of the keys"),
        ("configs: [none, none]", "s.yaml: configs: expected distinct names"),
        ("configs: [none]\nbaseline: int8", "s.yaml: baseline: expected the name"),
        ("configs: []", "s.yaml: configs: expected at least one config"),
        (
            "grid: {fwd_bits: [3, 40]}",
            "fwd.lhs.numerics.bits: expected an int in 1..16",
        ),
        ("grid: {bits: [8]}", "s.yaml: grid.bits: expected one of fwd_bits"),
        (
            "configs: [{name: x, config: {fwd: {lhs: {numerics: {bits: 4}}}}}]",
            "s.yaml: configs[0].config.fwd.lhs.numerics",
        ),
        (
            "configs: [{name: x, config: gone.yaml}]",
            "s.yaml: configs[0].config: no config file 'gone.yaml'",
        ),
        ("configs: [none\n", "s.yaml: line"),
        ("- none", "s.yaml: the document: expected a mapping"),
    ],
)
def test_bad_sweep_files(tmp_path, text, message):
    (tmp_path / "s.yaml").write_text(text)
    with pytest.raises(SweepError) as info:
        load_sweep(tmp_path / "s.yaml")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_run_sweep_resume_false_retrains(tmp_path, monkeypatch):
    (tmp_path / "s.yaml").write_text(SWEEP)
    calls = _forbid_training(monkeypatch)
    sweep = load_sweep(tmp_path / "s.yaml")
    run_sweep(sweep, tmp_path / "o")
    run_sweep(sweep, tmp_path / "o", resume=False)
    assert len(calls) == 4
