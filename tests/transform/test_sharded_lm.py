"""An FSDP + tensor-parallel LM on 8 CPU devices, quantized by the one engine."""

import json
import pathlib
import subprocess
import sys


def test_sharded_lm_equals_unsharded_and_collectives_are_counted():
    script = pathlib.Path(__file__).with_name("sharded_lm_check.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    counts = report["collectives"]
    assert set(counts) == {"float32", "int8", "fp8_delayed"}
    # Quantization moves no more bytes through all-reduces than float32
    # does (the gradient reductions); scales add small collectives only.
    for variant in ("int8", "fp8_delayed"):
        assert (
            counts[variant]["all-reduce"]["bytes"]
            <= 1.01 * counts["float32"]["all-reduce"]["bytes"]
        )
