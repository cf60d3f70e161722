"""The qbits command: help, errors as one line, inspect, the default train."""

import json
import subprocess
import sys

import pytest

from qbits.cli import main

RULES = """\
rules:
  - pattern: '.*attn/(qk|pv)'
    config: null
  - pattern: 'nothing/.*'
    config: int8
default: int8_fwd
"""


@pytest.mark.parametrize(
    "command", [[], ["train"], ["sweep"], ["inspect"], ["presets"]]
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
        (["train", "--steps", "many"], "expected a positive int, got 'many'"),
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
        "| blocks/0/attn/qk | MultiHeadAttention.qk | float | rules[0].config |" in out
    )
    assert "| blocks/1/mlp/fc2 | Linear | int8_fwd | default |" in out
    assert "| head | Linear | int8_fwd | default |" in out
    assert "unused rules: rules[1] (pattern 'nothing/.*') matched no layer" in out


def test_inspect_preset_on_mlp(capsys):
    assert main(["inspect", "w4a8", "--model", "mlp"]) == 0
    out = capsys.readouterr().out
    assert "| layers/0 | Linear | w4a8 | default |" in out
    assert "unused rules: none" in out


def test_presets_lists_every_preset(capsys):
    import qbits

    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in qbits.presets.names():
        assert f"\n{name} " in "\n" + out


def test_default_train_end_to_end(tmp_path, capsys):
    """`qbits train` with its defaults (lm, int8), shrunk to a smoke test."""
    out = tmp_path / "train"
    rc = main(["train", "--size", "tiny", "--steps", "2", "--out", str(out), "-q"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "float32" in stdout and "int8" in stdout
    for name in ("results.md", "results.csv", "results.json", "loss_curves.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "results.json").read_text())
    assert [r["config"] for r in summary["rows"]] == ["float32", "int8"]
    assert summary["rows"][0]["ratio"] == 1.0
    assert all(len(r["result"]["curve"]) == 2 for r in summary["runs"])
    table = (out / "results.md").read_text()
    assert "| int8 | 8 | 1 |" in table
