"""Expert parallelism: the MoE's experts split over 8 CPU devices (a subprocess)."""

import os
import pathlib
import subprocess
import sys

import qbits


def test_expert_parallel_moe_equals_unsharded_on_8_cpu_devices():
    # qbits/_experiments/_moe.py's moe_expert_parallel inside shard_map:
    # experts split over 8 devices, tokens dispatched with all_to_all. Run
    # by path on the qbits this test imports (expert_parallel_check.py).
    root = str(pathlib.Path(qbits.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
    script = pathlib.Path(__file__).with_name("expert_parallel_check.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True,
        timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "expert-parallel MoE equals unsharded" in result.stdout
    assert "per-tensor scales refused" in result.stdout
