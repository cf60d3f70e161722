"""Expert parallelism: the MoE's experts split over 8 CPU devices (a subprocess)."""

import pathlib

from tests.helpers import run_script


def test_expert_parallel_moe_equals_unsharded_on_8_cpu_devices():
    # qbits/_experiments/_moe.py's moe_expert_parallel inside shard_map:
    # experts split over 8 devices, tokens dispatched with all_to_all. Run
    # by path on the qbits this test imports (expert_parallel_check.py).
    result = run_script(pathlib.Path(__file__).with_name("expert_parallel_check.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "expert-parallel MoE equals unsharded" in result.stdout
    assert "per-tensor scales refused" in result.stdout
