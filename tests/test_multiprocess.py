"""The sharded example LM as 2 ``jax.distributed`` processes x 4 CPU devices.

``examples/sharded_lm_launch.py`` starts both processes (gloo collectives
between them) and the same training as one process of 8 devices (a
``jax.distributed`` job of one process: gloo's collectives too), at the
smallest sizes (2 steps, the checkpoint after step 1). The full record,
with the one-process run on XLA's in-process collectives beside, is
``benchmarks/multiprocess.py``'s.
"""

import json
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "examples" / "sharded_lm_launch.py"
TINY = ["--steps", "2", "--width", "16", "--layers", "1", "--heads", "2",
        "--batch", "8", "--context", "8"]  # fmt: skip


def test_two_processes_train_as_one_and_both_checkpoint():
    result = subprocess.run(
        [sys.executable, str(LAUNCH), "--json", "--no-in-process",
         "--timeout", "240", "--", "--config", "int8", *TINY],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    one, many = report["one_process"], report["processes"]
    assert (one["processes"], one["local_devices"]) == (1, 8)
    assert [(r["process"], r["processes"], r["local_devices"]) for r in many] == [
        (0, 2, 4),
        (1, 2, 4),
    ]
    assert one["mesh"] == many[0]["mesh"] == {"data": 4, "model": 2}
    # The loss is one replicated value: both processes hold the same, and
    # it is the one-process run's bit for bit.
    assert many[0]["losses"] == many[1]["losses"] == one["losses"]
    assert "in_process" not in report
    # Each process built only the batch rows its devices hold.
    rows = [set(map(tuple, r["batch_rows"])) for r in many]
    assert rows[0] and rows[1] and rows[0].isdisjoint(rows[1])
    # Both processes wrote their shards of the checkpoint (OCDBT: one
    # directory of files per process) and, restored, repeat step 1.
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(many[0]["checkpoint_files"])
    for r in (one, *many):
        assert r["checkpoint_step"] == 1
        assert r["resumed_losses"] == r["losses"][1:]


def test_a_failure_is_one_line_and_stops_everything():
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, str(LAUNCH), "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"port {port} is in use" in result.stderr
