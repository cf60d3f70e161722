"""The qbits command: help, errors as one line, inspect, the default train."""

import contextlib
import io
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import qbits
from qbits.cli import main

# The default training run is shared by the tests that need one (one worker).
pytestmark = pytest.mark.xdist_group("cli")

RULES = """\
rules:
  - pattern: '.*attn/(qk|pv)'
    config: null
  - pattern: 'nothing/.*'
    config: int8
default: int8_fwd
"""


@pytest.mark.parametrize(
    "command",
    [[], ["train"], ["sweep"], ["inspect"], ["ptq"], ["search"], ["presets"]],
)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: qbits")
    if command:
        assert command[0] in out.splitlines()[0]


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "train" in capsys.readouterr().out


def _one_error_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qbits"), err
    assert "error:" in lines[0]
    return lines[0]


def _run(argv):
    """main's status, also when argparse exits (it raises SystemExit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["train", "nosuch"], "unknown config 'nosuch'"),
        (["train", "--model", "cnn"], "invalid choice: 'cnn'"),
        (["train", "--steps", "many"], "expected a positive int of at most"),
        (["train", "--steps", "0"], "int32), got '0'"),
        (["train", "--seed", "1.5"], "--seed"),
        (["sweep", "missing.yaml"], "missing.yaml: cannot read"),
        (["inspect", "missing.yaml"], "missing.yaml"),
        (["inspect"], "CONFIG"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_are_one_line(argv, expected, capsys):
    assert _run(argv) == 2
    assert expected in _one_error_line(capsys)


def test_bad_config_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("fwd:\n  lhs: {numerics: {type: int, bits: 32}}\n")
    assert main(["inspect", str(bad)]) == 2
    line = _one_error_line(capsys)
    assert "bad.yaml: fwd.lhs.numerics.bits: expected an int in 1..16, got 32" in line


def test_unwritable_out_dir_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["train", "--model", "mlp", "--out", str(blocker / "sub")]) == 2
    assert "cannot write to the output folder" in _one_error_line(capsys)


def test_errors_have_no_traceback_in_a_real_process(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - pattern: '(attn'\n    config: int8\n")
    result = subprocess.run(
        [sys.executable, "-m", "qbits.cli", "inspect", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qbits: error: ")
    assert "rules[0].pattern" in lines[0]


def test_inspect_shows_the_table_and_unused_rules(tmp_path, capsys):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    assert main(["inspect", str(rules)]) == 0
    out = capsys.readouterr().out
    assert (
        "| blocks/0/attn/qk | einsum (activation x activation) | "
        "f32[32,64,4,1,32] x f32[32,64,4,32] | float | rules[0].config |" in out
    )
    rows = {line.split(" | ")[0][2:]: line for line in out.splitlines() if "|" in line}
    assert rows["blocks/1/mlp/fc2"].endswith("| int8_fwd | default |")
    assert rows["head"].endswith("| int8_fwd | default |")
    assert "unused rules: rules[1] (pattern 'nothing/.*') matched no matmul" in out


def test_inspect_preset_on_mlp(capsys):
    assert main(["inspect", "w4a8", "--model", "mlp"]) == 0
    out = capsys.readouterr().out
    assert "| layers/0 | dot_general (activation x weight) |" in out
    assert "| w4a8 | default |" in out
    assert "unused rules: none" in out


def test_inspect_target_says_what_it_needs(capsys):
    # Compiling for a GPU needs XLA's GPU compiler (tests/hlo runs it where
    # it is installed); without it the command says how to install it.
    assert _run(["inspect", "fp8", "--target", "h100", "--model", "mlp"]) == 2
    assert "expected --model block" in _one_error_line(capsys)
    from qbits.hlo._program import _cuda_plugin

    if not _cuda_plugin():
        argv = ["inspect", "fp8", "--target", "h100", "--model", "block", "--small"]
        assert _run(argv) == 2
        assert "pip install 'qbits[gpu]'" in _one_error_line(capsys)


def test_presets_lists_every_preset(capsys):
    import qbits

    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in qbits.presets.names():
        assert f"\n{name} " in "\n" + out


@pytest.fixture(scope="module")
def default_train(tmp_path_factory):
    """`qbits train` with its defaults (lm, int8), shrunk to a smoke test:
    its folder and what it printed."""
    out = tmp_path_factory.mktemp("default") / "train"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["train", "--size", "tiny", "--steps", "2", "--out", str(out), "-q"])
    assert rc == 0
    return out, stdout.getvalue()


def test_default_train_end_to_end(default_train, tmp_path, capsys):
    """`qbits train` with its defaults (lm, int8), then `qbits ptq` on it."""
    trained, stdout = default_train
    out = tmp_path / "train"
    shutil.copytree(trained, out)  # ptq writes beside the run
    assert "float32" in stdout and "int8" in stdout
    for name in ("results.md", "results.csv", "results.json", "loss_curves.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "results.json").read_text())
    assert [r["config"] for r in summary["rows"]] == ["float32", "int8"]
    assert summary["rows"][0]["ratio"] == 1.0
    assert all(len(r["result"]["curve"]) == 2 for r in summary["runs"])
    table = (out / "results.md").read_text()
    assert "| int8 | 8 | 1 |" in table
    assert (out / "runs" / "float32__seed0.params").is_dir()  # for qbits ptq

    # qbits ptq on the saved float32 params: int4 in groups of 8 (the tiny
    # model is 16 wide) by GPTQ after a rotation and by QEP (the batches run
    # again before each weight, fn mapped over the float and quantized
    # params), a table beside float32's.
    config = tmp_path / "w4g8.yaml"
    config.write_text(
        "fwd:\n  rhs:\n    numerics: {type: int, bits: 4}\n"
        "    granularity: {type: tiled, tile_size: 8}\n"
    )
    capsys.readouterr()
    argv = ["ptq", str(config), "--run", str(out), "--calibration", "2", "-q"]
    assert main([*argv, "--method", "gptq+rot", "qep"]) == 0
    stdout = capsys.readouterr().out
    report = out / "ptq-w4g8"
    summary = json.loads((report / "results.json").read_text())
    rows = {r["config"]: r for r in summary["rows"]}
    assert list(rows) == ["float32", "w4g8 gptq+rot", "w4g8 qep"]
    assert rows["float32"]["ratio"] == 1.0
    assert rows["float32"]["eval_loss"] == pytest.approx(
        json.loads((out / "results.json").read_text())["rows"][0]["eval_loss"],
        rel=1e-5,
    )  # the saved params are the trained ones
    assert all(math.isfinite(r["eval_loss"]) for r in rows.values())
    assert rows["w4g8 gptq+rot"]["eval_loss"] != rows["float32"]["eval_loss"]
    assert rows["w4g8 qep"]["eval_loss"] != rows["float32"]["eval_loss"]
    assert "w4g8 gptq+rot" in stdout and (report / "results.md").stat().st_size > 0
    # What the PTQ run is about: eval losses, not float32's training curve;
    # "—" where a row has no figure (float32 was not timed here), never nan.
    assert summary["files"][-1] == "eval_loss.png"
    assert not (report / "loss_curves.png").exists()
    assert "nan" not in (report / "results.md").read_text()
    # --out on the training run's folder would replace its report: refused.
    trained = (out / "results.json").read_text()
    assert main([*argv, "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"qbits: error: --out {out}: ")
    assert str(out / "ptq-w4g8") in line
    assert (out / "results.json").read_text() == trained


def test_ptq_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    missing = tmp_path / "nothing"
    assert main(["ptq", "nf4", "--run", str(missing), "-q"]) == 2
    assert "holds no saved params" in _one_error_line(capsys)
    assert not missing.exists()
    assert main(["ptq", "none", "--run", str(tmp_path)]) == 2
    assert "quantizes nothing" in _one_error_line(capsys)
    assert _run(["ptq", "nf4", "--run", str(tmp_path), "--calibration", "0"]) == 2
    assert "--calibration" in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_search_end_to_end(tmp_path, capsys):
    """`qbits search` on a float32 run of the tiny MLP: rules as YAML, report."""
    run = tmp_path / "run"
    train = ["train", "none", "--model", "mlp", "--size", "tiny", "--steps", "1"]
    assert main([*train, "--out", str(run), "-q"]) == 0
    capsys.readouterr()
    out = tmp_path / "found.yaml"
    argv = ["search", "w4a8", "none", "--run", str(run), "--budget", "5",
            "--batches", "1", "--out", str(out), "-q"]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    # What qbits train FILE trains with: w4a8 on both weight matmuls.
    assert qbits.load_config(out) == qbits.QuantConfig((), default="w4a8")
    report = out.with_suffix(".md").read_text()
    assert report.startswith("Budget 5 bits per weight: chose ")
    assert "| layers/0 | w4a8 |" in report and "| head | w4a8 |" in report
    assert "Held-out loss: " in report and "nan" not in report
    assert report in stdout and f"qbits train {out}" in stdout


def test_search_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    """`qbits search`'s bad input, refused before any measurement."""
    missing = tmp_path / "nothing"
    argv = ["search", "w4a8", "none", "--budget", "5", "-q"]
    assert main([*argv, "--run", str(missing)]) == 2
    assert "holds no saved params" in _one_error_line(capsys)
    assert main(["search", "int9", "--run", str(tmp_path), "--budget", "5"]) == 2
    assert "unknown candidate 'int9'" in _one_error_line(capsys)
    assert _run(["search", "w4a8", "--run", str(tmp_path), "--budget", "x"]) == 2
    assert "--budget" in _one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_ptq_out_is_never_the_folder_of_a_training_run(tmp_path, capsys):
    """A sweep's (or training run's) folder holds a report that ptq's replaces."""
    sweep = tmp_path / "sweep"
    (sweep / "runs").mkdir(parents=True)
    (sweep / "results.json").write_text("{}")
    argv = ["ptq", "w4a8", "--run", str(tmp_path / "run"), "--out", str(sweep)]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"qbits: error: --out {sweep}: ")
    assert "report of a training run" in line and "ptq-w4a8" in line
    assert sorted(p.name for p in sweep.iterdir()) == ["results.json", "runs"]
    with pytest.raises(qbits.InvalidArgumentError, match=r"out.*training run"):
        qbits._experiments.post_train(tmp_path / "run", "nf4", sweep)


def test_fp8_delayed_trains_the_default_model_with_every_matmul(
    default_train, tmp_path, capsys
):
    """Every listed preset runs on the default model (delayed scaling included)."""
    assert main(["inspect", "fp8_delayed"]) == 0
    table = capsys.readouterr().out
    for part in ("attn/qk", "attn/pv", "attn/query", "mlp/fc1", "head"):
        assert f"{part} |" in table
    assert "| float |" not in table
    # The float32 run (same model, seed and steps) is the default run's: kept.
    out = tmp_path / "train"
    shutil.copytree(default_train[0] / "runs", out / "runs")
    argv = ["train", "fp8_delayed", "--size", "tiny", "--steps", "2", "--out"]
    assert main([*argv, str(out)]) == 0
    assert "float32__seed0: done before, skipped" in capsys.readouterr().out
    summary = json.loads((out / "results.json").read_text())
    assert [r["config"] for r in summary["rows"]] == ["float32", "fp8_delayed"]
    assert all(math.isfinite(x) for x in summary["runs"][1]["result"]["curve"])


# ---------------------------------------------------------------------------
# Nothing silent: no traceback, no crash, whatever the file or the moment.

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bomb(levels):
    """A YAML "billion laughs": 8 * 9**(levels - 1) numbers in a few hundred bytes."""
    lines = ["        - &l0 [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]"]
    for i in range(1, levels):
        lines.append(f"        - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    head = "fwd:\n  rhs:\n    numerics: int\n    calibration:\n      type: mse\n"
    return head + "      clip_factors:\n" + "\n".join(lines) + "\n"


BAD_BYTES = [
    # (name, file content, text the one-line error must contain)
    ("utf-16", "fwd: {}\n".encode("utf-16"), "expected UTF-8 text"),
    ("latin-1", "rules: []  # café\n".encode("latin-1"), "expected UTF-8 text"),
    ("binary", bytes(range(256)) * 8, "expected UTF-8 text"),
    ("nul bytes", b"fwd: {}\x00\x00\n", "printable characters"),
    ("deep nesting", b"[" * 20_000, "nested at most 32 deep"),
    ("alias bomb", _bomb(9).encode(), "aliases (*name) expanded"),
    ("huge list", b"[" + b"1, " * 600_000 + b"1]", "at most 1048576 bytes"),
    (
        "integer of 4400 digits",  # Python reads at most 4300
        b"fwd: {rhs: {granularity: {type: tiled, tile_size: " + b"3" * 4400 + b"}}}",
        "an integer of at most 100 characters",
    ),
]


@pytest.mark.parametrize(
    ("data", "needle"), [b[1:] for b in BAD_BYTES], ids=[b[0] for b in BAD_BYTES]
)
@pytest.mark.parametrize("command", ["inspect", "train"])
def test_hostile_config_files_are_one_line(tmp_path, capsys, command, data, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(data)
    argv = [command, str(bad), "--model", "mlp"]
    if command == "train":
        argv += ["--size", "tiny", "--steps", "1", "--out", str(tmp_path / "o")]
    start = time.perf_counter()
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"qbits: error: {bad}: "), line
    assert needle in line
    assert time.perf_counter() - start < 20  # refused, never expanded


@pytest.mark.parametrize("steps", ["30000000000", "-5", "9" * 5000])
def test_step_counts_beyond_int32_are_one_line(tmp_path, steps, capsys):
    # The step counter is an int32: 3e10 steps raised OverflowError from optax.
    argv = ["train", "none", "--model", "mlp", "--size", "tiny", "-q"]
    assert _run([*argv, "--steps", steps, "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert "--steps: expected a positive int of at most 2147483647" in line
    assert len(line) < 200


def test_train_optimizer_is_a_choice(capsys):
    assert _run(["train", "--model", "mlp", "--optimizer", "sgd"]) == 2
    line = _one_error_line(capsys)
    assert "invalid choice: 'sgd'" in line and "adamw8bit" in line


@pytest.mark.parametrize("seed", ["18446744073709551616", "-1", "4294967296"])
def test_seed_out_of_range_is_one_line(seed, capsys):
    assert _run(["train", "--model", "mlp", "--seed", seed]) == 2
    assert "expected an int in 0..4294967295" in _one_error_line(capsys)


RULES_HEAD_TILE_5 = """\
rules:
  - pattern: head
    config: {fwd: {rhs: {numerics: int, granularity: {type: tiled, tile_size: 5}}}}
default: int8_fwd
"""


@pytest.mark.parametrize(
    ("name", "text", "expected", "layer"),
    [
        (
            "rules.yaml",
            RULES_HEAD_TILE_5,
            "rules.yaml: rules[0].config.fwd.rhs.granularity.tile_size: expected a "
            "divisor of 16",
            "head",  # the only layer rules[0] matches: kernel 16 x 10
        ),
        (
            "single.yaml",
            "fwd: {rhs: {numerics: int, granularity: {type: tiled, tile_size: 5}}}\n",
            "single.yaml: fwd.rhs.granularity.tile_size: expected a divisor of 64",
            "layers/0",  # kernel 64 x 16 (the head's 16 x 10 fails too, later)
        ),
        (
            "int4_weight_only",
            None,
            "error: int4_weight_only.fwd.rhs.granularity.tile_size: expected a "
            "divisor of 64",
            "layers/0",
        ),
    ],
)
def test_errors_found_when_tracing_name_the_file_and_the_layer(
    tmp_path, capsys, name, text, expected, layer
):
    """A tile size that does not divide a layer's axis: file, place, layer."""
    config = name
    if text is not None:
        config = str(tmp_path / name)
        pathlib.Path(config).write_text(text)
    argv = ["train", config, "--model", "mlp", "--size", "tiny", "--steps", "1"]
    assert main([*argv, "-q", "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert expected in line
    assert "default" not in line  # none of these has a `default` key
    assert line.endswith(f", in layer {layer!r})."), line


def test_ctrl_c_exits_130_every_time(tmp_path):
    """SIGINT while the example model compiles or trains: status 130, no crash.

    Interpreter teardown while XLA still compiled on its threads crashed with
    a segmentation fault in most interrupted runs.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for attempt, delay in enumerate((0.4, 0.9, 1.6)):
        command = ["train", "--model", "mlp", "--size", "tiny", "--steps", "1000000"]
        out = ["--out", str(tmp_path / f"run{attempt}")]
        with subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "qbits.cli", *command, *out],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc:
            # Printed just before the first model is built and compiled.
            assert proc.stdout.readline().startswith("training mlp (tiny)")
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                # faulthandler prints every thread's stack on SIGABRT.
                proc.send_signal(signal.SIGABRT)
                _, err = proc.communicate()
                pytest.fail(f"still running 120 s after SIGINT:\n{err[-6000:]}")
        assert "Fatal Python error" not in err, err
        assert "Traceback" not in err, err
        assert proc.returncode == 130, (proc.returncode, err)
        assert err.strip().splitlines()[-1].startswith("qbits: interrupted")


def _overflowing_margin(self):
    2.0**self.margin  # what the scale computed from margin: 100000 (OverflowError)


def test_config_constructor_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """Any error of a config class' constructor: one line naming file and place."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("fwd: {accumulator: '1e-3'}\n")  # numpy's own ValueError
    assert main(["inspect", str(bad), "--model", "mlp"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"qbits: error: {bad}: fwd: expected arguments that ")
    assert "MatmulConfig(...) raised ValueError" in line
    # A scale provider whose constructor overflows on a huge margin.
    monkeypatch.setattr(qbits.DelayedScaling, "__post_init__", _overflowing_margin)
    bad.write_text(
        "fwd: {rhs: {numerics: {type: fp8, dtype: float8_e4m3fn}, provider: "
        "{type: delayed, margin: 20000}}}\n"
    )
    argv = ["train", str(bad), "--model", "mlp", "--size", "tiny", "--steps", "1"]
    assert main([*argv, "-q", "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"qbits: error: {bad}: fwd.rhs.provider: expected ")
    assert "DelayedScaling(...) raised OverflowError" in line


def test_a_fifo_as_config_is_one_line_not_a_hang(tmp_path, capsys):
    fifo = tmp_path / "rules.yaml"
    os.mkfifo(fifo)

    def writer():  # gives a reader that waits what it waits for
        with contextlib.suppress(OSError), open(fifo, "w") as f:
            f.write("default: int8\n")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        status = main(["inspect", str(fifo), "--model", "mlp"])
    finally:
        release = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        thread.join()
        os.close(release)
    assert status == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"qbits: error: {fifo}: expected a regular file")
    assert "FIFO" in line


def test_rerun_after_ctrl_c_keeps_the_finished_float32_run(
    tmp_path, capsys, monkeypatch
):
    """Ctrl-C says "finished runs are kept, rerun to continue": a rerun does so."""
    from qbits._experiments import _report as report_lib
    from qbits._experiments import _sweep as sweep_lib
    from qbits._experiments import build_model
    from qbits._experiments._train import RunResult

    trained = []

    def fake_train(
        spec, config, *, seed, steps, progress=None, on_trained=None, diagnostics=0
    ):
        trained.append("float32" if config is None else "int8_fwd")
        if len(trained) == 2 and interrupt:
            raise KeyboardInterrupt
        if on_trained is not None:  # qbits train keeps the float32 params
            on_trained(build_model(spec, seed)[0])
        return RunResult(1.0, 1.0, 0.5, [1.0] * steps, [(steps, 1.0)], 0.0)

    def draw_only(fig, path):  # which runs run is the test, not the figures
        import matplotlib.pyplot as plt

        plt.close(fig)
        report_lib.replace_file(path, b"\x89PNG stub")

    monkeypatch.setattr(sweep_lib, "train", fake_train)
    monkeypatch.setattr(report_lib, "_save", draw_only)
    argv = ["train", "int8_fwd", "--model", "mlp", "--size", "tiny", "--steps", "2"]
    argv += ["-q", "--out", str(tmp_path / "o")]
    interrupt = True
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "finished runs are kept, rerun the command to continue" in err
    interrupt = False
    trained.clear()
    assert main(argv) == 0
    assert trained == ["int8_fwd"]  # float32 finished before the interrupt
    trained.clear()
    assert main([*argv, "--rerun"]) == 0
    assert trained == ["float32", "int8_fwd"]
