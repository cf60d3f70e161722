"""qbits generate: text from the example LM with a KV cache; errors as one line."""

import contextlib
import os
import threading

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits._experiments
from qbits._experiments import build_model, spec
from qbits._experiments._sweep import save_model_params, write_json_atomic
from qbits.cli import main


def _tiny_lm():
    """The tiny LM with random weights from numpy (no compiled initialisers)."""
    model = nnx.eval_shape(lambda: build_model(spec("lm", "tiny"), 0)[0])
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    state = jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), state
    )
    return nnx.merge(graphdef, state)


def test_generate_trains_or_loads_what_qbits_train_saved(tmp_path, monkeypatch, capsys):
    trained = []

    def fake_train(model_spec, config, *, seed, steps, progress, on_trained):
        # qbits train's loop is tested elsewhere: hand over a model at once.
        assert (model_spec, config, seed, steps) == (spec("lm", "tiny"), None, 0, 3)
        trained.append(_tiny_lm())
        on_trained(trained[0])

    monkeypatch.setattr(qbits._experiments, "train", fake_train)
    argv = ["generate", "--prompt", "The ", "--tokens", "12"]
    assert main([*argv, "--size", "tiny", "--steps", "3"]) == 0
    captured = capsys.readouterr()
    text = captured.out.splitlines()[0]
    assert text.startswith("The ") and len(text) == 4 + 12
    assert "training lm (tiny) in float32 for 3 steps" in captured.err
    assert "cache kv_int8 (int8 keys and values, per-token scales)" in captured.err
    # The same model, as qbits train saves it (run file + Orbax params).
    runs = tmp_path / "run" / "runs"
    runs.mkdir(parents=True)
    save_model_params(runs / "float32__seed0.params", trained[0])
    run = {"name": "float32", "seed": 0, "model": "lm", "size": "tiny"}
    write_json_atomic(runs / "float32__seed0.json", run | {"result": {}})
    assert main([*argv, "--run", str(tmp_path / "run"), "-q"]) == 0
    assert capsys.readouterr().out.splitlines() == [text]


def _one_error_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qbits"), err
    assert "error: " in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--cache", "int8"], "cache='int8' is not allowed; expected"),
        (["--cache", "nosuch.yaml"], "cache='nosuch.yaml' is not allowed (no such"),
        (["--size", "deep"], "invalid choice: 'deep'"),
        (["--prompt", "é"], "characters the model does not know: ['é']"),
        (["--prompt", ""], "the prompt is empty"),
        (["--tokens", "0"], "--tokens: expected an int in 1..1000000, got 0"),
        (["--temperature", "-1"], "--temperature: expected a finite number >= 0"),
        (["--temperature", "nan"], "--temperature"),
        (["--run", "x", "--steps", "2"], "--steps and --size train a model"),
        (["--run", "/nonexistent/run"], "holds no saved params"),
        (["--prompt", "a", "--prompt-file", "f"], "not allowed with argument"),
    ],
)
def test_generate_errors_are_one_line(argv, expected, capsys):
    try:
        status = main(["generate", *argv])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    assert status == 2
    assert expected in _one_error_line(capsys)


def test_prompt_file_is_read_only_from_a_regular_file(tmp_path, capsys):
    """A FIFO is refused, not waited for (it hung); so are a folder, a huge file."""
    fifo = tmp_path / "words.txt"
    os.mkfifo(fifo)

    def writer():  # gives a reader that waits what it waits for
        with contextlib.suppress(OSError), open(fifo, "w") as f:
            f.write("\u00e9t\u00e9\n")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    argv = ["generate", "--size", "tiny", "--steps", "1", "--prompt-file"]
    try:
        status = main([*argv, str(fifo)])
    finally:
        release = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        thread.join()
        os.close(release)
    assert status == 2
    line = _one_error_line(capsys)
    assert f"--prompt-file {fifo}: expected a regular file, got a FIFO" in line
    assert main([*argv, str(tmp_path)]) == 2
    assert "expected a regular file, got a directory" in _one_error_line(capsys)
    big = tmp_path / "big.txt"
    big.write_text("ab" * 600_000)
    assert main([*argv, str(big)]) == 2
    assert "at most 1000000 bytes" in _one_error_line(capsys)
