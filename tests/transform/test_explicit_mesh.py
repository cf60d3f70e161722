"""Explicit mesh axes: every scale, history, stored code and adapter qbits
makes is sharded as its parameter, leaf by leaf (8 CPU devices)."""

import os
import pathlib
import subprocess
import sys

import qbits


def test_every_leaf_is_sharded_as_its_parameter_and_restores_onto_another_mesh():
    # Run on the qbits this test imports (a script run by path would import
    # whichever qbits is installed).
    root = str(pathlib.Path(qbits.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
    script = pathlib.Path(__file__).with_name("explicit_mesh_check.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600,
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: "), result.stdout
    assert int(result.stdout.split()[1]) >= 90  # leaves checked
