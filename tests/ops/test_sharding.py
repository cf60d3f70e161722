import pathlib
import subprocess
import sys


def test_sharded_equals_unsharded_on_8_cpu_devices():
    script = pathlib.Path(__file__).with_name("sharded_check.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sharded results equal unsharded" in result.stdout


def test_gradients_inside_shard_map_on_8_cpu_devices():
    script = pathlib.Path(__file__).with_name("shard_map_check.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "shard_map gradients are right" in result.stdout
