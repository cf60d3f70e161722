"""The sharded example LM on 2 processes x 4 CPU devices vs 1 process x 8 (CPU).

``examples/sharded_lm.py`` (a transformer LM, FSDP over ``data`` x tensor
parallel over ``model``, every matmul quantized by ``qbits.flax.quantize``)
trained for ``--steps`` steps with each config (``none`` is float32) by
``examples/sharded_lm_launch.py``: as two ``jax.distributed`` processes of
4 CPU devices, as a ``jax.distributed`` job of one process of 8 (gloo
collectives in both; the launcher checks that they agree bit for bit),
and as one process of 8 without ``jax.distributed`` (XLA's in-process
collectives: its relative difference is recorded). Records every step's
loss of every process, and the losses after restoring each run's halfway
Orbax checkpoint.

Run: python benchmarks/multiprocess.py --json OUT.json --md OUT.md
     [--configs none int8 fp8_delayed] [--steps 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _launcher():
    path = ROOT / "examples" / "sharded_lm_launch.py"
    spec = importlib.util.spec_from_file_location("sharded_lm_launch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    parser.add_argument("--configs", nargs="+", default=["none", "int8", "fp8_delayed"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    launcher = _launcher()
    runs = {}
    for config in args.configs:
        worker = ["--config", config, "--steps", str(args.steps)]
        runs[config] = launcher.launch(worker, timeout=args.timeout)
        print(launcher.markdown(runs[config]), flush=True)
    first = runs[args.configs[0]]["one_process"]
    meta = {
        "benchmark": "multiprocess",
        "jax": first["jax"],
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "mesh": first["mesh"],
        "steps": args.steps,
    }
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1)
        f.write("\n")
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n\n".join(launcher.markdown(r) for r in runs.values()) + "\n")


if __name__ == "__main__":
    main()
