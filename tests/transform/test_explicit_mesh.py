"""Explicit mesh axes: every scale, history, stored code and adapter qbits
makes is sharded as its parameter, leaf by leaf (8 CPU devices)."""

import pathlib

from tests.helpers import run_script


def test_every_leaf_is_sharded_as_its_parameter_and_restores_onto_another_mesh():
    # Run on the qbits this test imports (a script run by path would import
    # whichever qbits is installed).
    result = run_script(pathlib.Path(__file__).with_name("explicit_mesh_check.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok: "), result.stdout
    assert int(result.stdout.split()[1]) >= 90  # leaves checked
