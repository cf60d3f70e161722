"""The GPU training step's program and device time, estimated without a GPU.

Compiles ``benchmarks/train_step.py --gpu``'s MLP block step (bf16 and the
8-bit presets) for an H100 and an H200 on this machine
(:func:`qbits.hlo.program`, deviceless), and estimates each program's device
time at the rates measured on an H200 (:meth:`qbits.hlo.Program.estimate`).
Beside it: the estimate of the programs the H200 actually ran on
2026-11-27 (``tests/data/h200_mlp_hlo.tar.xz``, before qbits' GPU changes)
and that run's profiled device time, so that the estimate's error and what
the changes removed are read side by side. Also counts, per program, the
kernels that move codes, convert GEMM outputs or widen weights.

Needs XLA's GPU compiler: run it with ``.venv-gpu/bin/python`` (made by
``tests/gpu_program.sh``). Writes a JSON file and a markdown table.

Run: python benchmarks/gpu_estimate.py --json OUT.json [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tarfile
import time

import qbits.hlo

qbits.hlo.prepare_environment()  # before jax starts

import jax  # noqa: E402
import paired  # noqa: E402

from qbits._experiments import gpu_step  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data"
VARIANTS = ("bf16", "fp8", "fp8_delayed", "int8", "int8_fwd")
WASTE = ("code_layout", "output_convert", "wide_copy")


def _before() -> dict[str, qbits.hlo.Program]:
    """The programs the H200 ran (2026-11-27) and their profiled times."""
    with tarfile.open(DATA / "h200_mlp_hlo.tar.xz") as tar:
        texts = {
            m.name.removesuffix(".hlo.txt"): tar.extractfile(m).read().decode()
            for m in tar.getmembers()
        }
    return {n: qbits.hlo.Program(t, "h200") for n, t in texts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    measured = json.loads((DATA / "h200_mlp_profile.json").read_text())["variants"]
    before = _before()
    rows = []
    for name in VARIANTS:
        make, fargs = gpu_step("block", None if name == "bf16" else name)
        row = {"variant": name}
        for target in ("h200", "h100"):
            start = time.perf_counter()
            p = qbits.hlo.program(make(), *fargs, target=target)
            e = p.estimate()
            row[target] = {
                "device_ms": round(e.total_ms, 3),
                "gemm_ms": round(e.gemm_ms, 3),
                "by_category": {k: round(v, 3) for k, v in e.by_category.items()},
                "kernels": len(p.kernels),
                "gemms": [str(g) for g in p.gemms],
                "waste_kernels": {c: p.count(c) for c in WASTE},
                "temp_mib": round(p.temp_bytes / 2**20, 1),
                "deviceless_compile_s": round(time.perf_counter() - start, 1),
            }
        old = before[name].estimate()
        row["h200_before"] = {
            "measured_device_ms": measured[name]["device_ms"],
            "estimate_ms": round(old.total_ms, 3),
            "waste_kernels": {c: before[name].count(c) for c in WASTE},
        }
        rows.append(row)
        print(f"{name}: {row['h200']['device_ms']:.2f} ms on an H200", flush=True)
    meta = paired.machine("gpu_estimate", "MLP block 4096->16384->4096, 8192 "
                          "tokens, bf16, SGD (deviceless)", 0, 0)  # fmt: skip
    meta["jax"] = jax.__version__
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    table = markdown(rows)
    if args.md:
        pathlib.Path(args.md).write_text(table)
    print(table)


def markdown(rows: list[dict]) -> str:
    base = {t: rows[0][t]["device_ms"] for t in ("h200", "h100")}
    old_base = rows[0]["h200_before"]
    lines = [
        "MLP block 4096->16384->4096 (GELU), 8192 tokens, bf16, one SGD step: "
        "device time over bf16's, estimated by qbits.hlo from the optimized HLO "
        "(H200-measured rates). Before: the programs an H200 ran on 2026-11-27 "
        "(its profile's measured ratio; the estimate of the same HLO). Now: this "
        "code compiled deviceless with qbits.hlo.GPU_COMPILER_OPTIONS.",
        "",
        "| variant | H200 before, measured | H200 before, estimate | H200 now, "
        "estimate | H100 now, estimate | code moves / output converts / wide "
        "copies, before -> now |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["h200_before"]
        waste = " / ".join(
            f"{b['waste_kernels'][c]} -> {r['h200']['waste_kernels'][c]}" for c in WASTE
        )
        lines.append(
            f"| {r['variant']} "
            f"| {old_base['measured_device_ms'] / b['measured_device_ms']:.2f}x "
            f"| {old_base['estimate_ms'] / b['estimate_ms']:.2f}x "
            f"| {base['h200'] / r['h200']['device_ms']:.2f}x "
            f"| {base['h100'] / r['h100']['device_ms']:.2f}x | {waste} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
