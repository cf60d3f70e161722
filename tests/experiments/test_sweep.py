"""Sweeps: the file format, one real sweep end to end, reruns and interruptions."""

import builtins
import contextlib
import errno
import io
import json
import os
import shutil
import time

import pytest

import qbits
from qbits._experiments import SweepError, load_sweep, run_sweep
from qbits._experiments import _report as report_lib
from qbits._experiments import _sweep as sweep_lib
from qbits._experiments._train import RunResult
from qbits.cli import main

# The module fixtures run once: these tests share one worker.
pytestmark = pytest.mark.xdist_group("sweep")

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
    want = "warning: int8_fwd: rules[0] (pattern 'nothing') matched no matmul"
    assert lines == [want]


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
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "quality_vs_bits.png").exists()  # one bit width below 32
    assert sorted(os.listdir(out / "runs")) == [
        "int8_fwd__seed0.json",
        "none__seed0.json",
    ]


def _forbid_training(monkeypatch):
    """Training records its calls and returns at once; the report's figures
    are drawn, not rendered (which runs run is what these tests test)."""
    calls = []

    def fake_train(
        spec, config, *, seed, steps, progress=None, on_trained=None, diagnostics=0
    ):
        calls.append(config)
        return RunResult(1.0, 1.0, 0.5, [1.0] * steps, [(steps, 1.0)], 0.0)

    def save(fig, path):
        import matplotlib.pyplot as plt

        plt.close(fig)
        report_lib.replace_file(path, b"\x89PNG stub")

    monkeypatch.setattr(sweep_lib, "train", fake_train)
    monkeypatch.setattr(report_lib, "_save", save)
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

    def fake_train(
        spec, config, *, seed, steps, progress=None, on_trained=None, diagnostics=0
    ):
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
        ("configs: [none\n", "s.yaml: expected valid YAML"),
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


# ---------------------------------------------------------------------------
# Nothing silent: sweep files are never misread, results never half-written.

MISREAD = [
    # (name, sweep file, text of the one-line SweepError)
    ("duplicate key", "configs: [none]\nseeds: [0]\nseeds: [1]", "duplicate key"),
    ("duplicate seed", "configs: [none]\nseeds: [0, 1, 0]", "distinct seeds"),
    ("seed 2**64", "configs: [none]\nseeds: [18446744073709551616]", "0..4294967295"),
    ("negative seed", "configs: [none]\nseeds: [-1]", "0..4294967295"),
    ("seed 2**32", "configs: [none]\nseeds: [4294967296]", "0..4294967295"),
    ("name escapes", "name: ../../x\nconfigs: [none]", "name: expected a plain"),
    ("name with a folder", "name: a/b\nconfigs: [none]", "name: expected a plain"),
    ("name ..", "name: '..'\nconfigs: [none]", "name: expected a plain"),
    ("name .", "name: .\nconfigs: [none]", "name: expected a plain"),
    ("backslash name", "name: 'a\\\\b'\nconfigs: [none]", "expected a plain"),
    ("size a list", "size: [tiny]\nconfigs: [none]", "unknown size ['tiny']"),
    ("model a list", "model: [mlp]\nconfigs: [none]", "unknown model ['mlp']"),
    ("steps 2**64", "configs: [none]\nsteps: 18446744073709551616", "steps: expected"),
    ("bits inf", "configs: [{name: a, config: int8, bits: .inf}]", "finite number"),
    (
        "grid too big",
        "grid: {fwd_bits: ["
        + ", ".join(["8"] * 100)
        + "], bwd_bits: ["
        + ", ".join(["8"] * 100)
        + "], calibration: ["
        + ", ".join(["absmax"] * 100)
        + "]}",
        "grid: expected at most 10000 combinations",
    ),
    ("unhashable key", "? [a]\n: 1\nconfigs: [none]", "as a key"),
    (
        "grad_rounding typo, backward float",  # no combination used it
        "grid: {fwd_bits: [4], bwd_bits: [null], grad_rounding: [up]}",
        "grid.grad_rounding[0]: expected nearest or stochastic, got 'up'",
    ),
    (
        "granularity typo, all float",
        "grid: {fwd_bits: [null], granularity: [per_row]}",
        "grid.granularity[0]: expected one of per_tensor",
    ),
    (
        "bad tile size, all float",
        "grid: {fwd_bits: [null], granularity: [{type: tiled, tile_size: -2}]}",
        "grid.granularity[0].tile_size: expected an int >= 1, got -2",
    ),
    ("bits a word", "grid: {fwd_bits: [four]}", "grid.fwd_bits[0]: expected an int"),
    (
        "tab in a config name",
        'configs: [{name: "w4\\tx", config: int8}]',
        "configs[0].name: expected a name without control characters",
    ),
    (
        "carriage return in the name",
        'name: "ablation\\r"\nconfigs: [none]',
        "name: expected a name without control characters",
    ),
    (
        "steps of 5000 digits",
        "configs: [none]\nsteps: " + "9" * 5000,
        "expected an integer of at most 100 characters",
    ),
    ("deep nesting", "configs: " + "[" * 20_000, "nested at most 32 deep"),
    (
        "alias bomb",
        "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
        + "".join(
            f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n"
            for a, b in zip("abcdefgh", "bcdefghi", strict=True)
        ),
        "aliases (*name) expanded",
    ),
]


@pytest.mark.parametrize(
    ("text", "message"), [m[1:] for m in MISREAD], ids=[m[0] for m in MISREAD]
)
def test_sweep_files_are_never_misread(tmp_path, text, message):
    (tmp_path / "s.yaml").write_text(text)
    start = time.perf_counter()
    with pytest.raises(SweepError) as info:
        load_sweep(tmp_path / "s.yaml")
    assert time.perf_counter() - start < 10  # refused, never expanded
    assert str(info.value).startswith(str(tmp_path / "s.yaml"))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "data",
    ["configs: [none]\n".encode("utf-16"), b"configs: [none]  # caf\xe9\n"],
    ids=["utf-16", "latin-1"],
)
def test_non_utf8_sweep_file_is_a_sweep_error(tmp_path, data):
    (tmp_path / "s.yaml").write_bytes(data)
    with pytest.raises(SweepError, match="expected UTF-8 text"):
        load_sweep(tmp_path / "s.yaml")


def test_seeds_and_a_plain_name_are_accepted(tmp_path):
    text = "name: my-sweep_1.b\nconfigs: [none]\nseeds: [0, 4294967295, 7]"
    (tmp_path / "s.yaml").write_text(text)
    sweep = load_sweep(tmp_path / "s.yaml")
    assert sweep.name == "my-sweep_1.b" and sweep.seeds == (0, 4294967295, 7)


def test_sweep_name_cannot_leave_the_runs_folder(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "s.yaml").write_text("name: ../../escaped\nmodel: mlp\nconfigs: [none]")
    monkeypatch.chdir(work)
    _forbid_training(monkeypatch)
    assert main(["sweep", "s.yaml", "-q"]) == 2
    assert "name: expected a plain file name" in capsys.readouterr().err
    assert not (tmp_path / "escaped").exists()
    assert list(work.iterdir()) == [work / "s.yaml"]


def test_full_disk_names_the_file_and_leaves_no_partial_file(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "s.yaml").write_text(SWEEP)
    _forbid_training(monkeypatch)
    real_open = builtins.open

    class FullDisk:
        """A file being written on a full disk: created, then every write fails."""

        def __init__(self, file):
            self.file = file

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    def full_disk_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode and "runs" in os.fspath(file) else f

    monkeypatch.setattr(builtins, "open", full_disk_open)
    out = tmp_path / "o"
    assert main(["sweep", str(tmp_path / "s.yaml"), "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"qbits: error: {out / 'runs' / 'none__seed0.json'}: cannot write the file "
        f"({os.strerror(errno.ENOSPC)})"
    ]
    assert list((out / "runs").iterdir()) == []  # no 0-byte temporary file


def test_full_disk_while_writing_the_report(tmp_path, monkeypatch):
    (tmp_path / "s.yaml").write_text(SWEEP)
    _forbid_training(monkeypatch)
    real_replace = os.replace

    def failing_replace(src, dst):
        if os.fspath(dst).endswith("results.csv"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    out = tmp_path / "o"
    with pytest.raises(OSError) as info:
        run_sweep(load_sweep(tmp_path / "s.yaml"), out)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == os.fspath(out / "results.csv")
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


GRID_TILE_5 = """\
model: mlp
size: tiny
steps: 1
configs: [none]
grid:
  fwd_bits: [8]
  granularity: [{type: tiled, tile_size: 5}]
"""


def test_error_found_when_tracing_names_the_grid_entry_and_the_layer(tmp_path):
    (tmp_path / "s.yaml").write_text(GRID_TILE_5)
    sweep = load_sweep(tmp_path / "s.yaml")
    with pytest.raises(qbits.ConfigError) as info:
        run_sweep(sweep, tmp_path / "o")
    e = info.value
    assert e.source == os.fspath(tmp_path / "s.yaml")
    # The forward lhs is the MLP's input, 64 features: 5 divides no axis.
    assert e.path == "grid (fwd8_bwdfloat_tiled).fwd.lhs.granularity.tile_size"
    assert e.layer == "layers/0"
    assert str(e).startswith(
        f"{tmp_path / 's.yaml'}: grid (fwd8_bwdfloat_tiled).fwd.lhs.granularity."
    )
    assert str(e).endswith(", in layer 'layers/0').")


@pytest.mark.parametrize(
    ("item", "source", "where", "path"),
    [
        ("int8", "s.yaml", "configs[0] (int8)", "configs[0] (int8).fwd.rhs.x"),
        ("{name: a, config: {fwd: {}}}", "s.yaml", "configs[0].config", None),
        ("{name: a, config: r.yaml}", "r.yaml", "", "rules[0].config.fwd.rhs.x"),
    ],
)
def test_entries_know_where_their_config_is_written(
    tmp_path, item, source, where, path
):
    (tmp_path / "r.yaml").write_text("rules: [{pattern: x, config: int8}]\n")
    (tmp_path / "s.yaml").write_text(f"configs: [{item}]\n")
    entry = load_sweep(tmp_path / "s.yaml").entries[0]
    assert entry.source == os.fspath(tmp_path / source)
    assert entry.where == where
    raised = qbits.ConfigError(
        entry.config.resolve("x").where + ".fwd.rhs.x", 1, "2", layer="fc"
    )
    located = entry.locate(raised)
    assert located.path == (path or "configs[0].config.fwd.rhs.x")
    assert located.layer == "fc" and located.source == entry.source
