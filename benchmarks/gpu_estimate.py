"""The GPU training step's program and device time, estimated without a GPU.

Compiles ``benchmarks/train_step.py --gpu``'s MLP block step (bf16 and the
8-bit presets) for an H100 and an H200 on this machine
(:func:`qbits.hlo.program`, deviceless), and estimates each program's device
time at the rates measured on an H200 (:meth:`qbits.hlo.Program.estimate`).
``--part lm``: the same for the example LM at its GPU size (``--model lm``:
bf16, fp8, fp8_delayed, and both with attention's einsums in bf16, the
``_proj`` recipes), for an H200 only (each compile takes minutes here),
its device time split into GEMMs, the work on attention's ``[batch, heads,
S, S]`` scores and probabilities, and the rest; beside it the estimate of
the programs the H200 ran on 2026-11-27 (``results/train_step_gpu_hlo.tgz``)
and their measured step times.
Beside it: the estimate of the programs the H200 actually ran on
2026-11-27 (``tests/data/h200_mlp_hlo.tar.xz``, before qbits' GPU changes)
and that run's profiled device time, so that the estimate's error and what
the changes removed are read side by side. Also counts, per program, the
kernels that move codes, convert GEMM outputs or widen weights.

Needs XLA's GPU compiler: run it with ``.venv-gpu/bin/python`` (made by
``tests/gpu_program.sh``). Writes a JSON file and a markdown table.

Run: python benchmarks/gpu_estimate.py --json OUT.json [--md OUT.md]
     [--part mlp|lm|all] (a part's rows replace that part's in OUT.json)
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import pathlib
import re
import tarfile
import time
from typing import Any

import qbits.hlo

qbits.hlo.prepare_environment()  # before jax starts

import jax  # noqa: E402
import paired  # noqa: E402

from qbits._experiments import gpu_step  # noqa: E402
from qbits.hlo._estimate import estimate, kernel_us  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data"
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
VARIANTS = ("bf16", "fp8", "fp8_delayed", "int8", "int8_fwd")
LM_VARIANTS = ("bf16", "fp8", "fp8_delayed", "fp8_proj", "fp8_delayed_proj")
LM_SIZES = {"batch": 4, "context": 2048, "width": 2048, "depth": 8, "heads": 16}
WASTE = ("code_layout", "output_convert", "wide_copy")


def _before() -> dict[str, qbits.hlo.Program]:
    """The programs the H200 ran (2026-11-27) and their profiled times."""
    with tarfile.open(DATA / "h200_mlp_hlo.tar.xz") as tar:
        texts = {
            m.name.removesuffix(".hlo.txt"): tar.extractfile(m).read().decode()
            for m in tar.getmembers()
        }
    return {n: qbits.hlo.Program(t, "h200") for n, t in texts.items()}


def lm_split(p: qbits.hlo.Program, sizes: dict[str, int]) -> dict[str, float]:
    """The LM program's estimate (ms) split by what each kernel works on.

    ``attention_gemm``: the batched GEMMs of attention's einsums (one batch
    of ``batch * heads``); ``gemm``: the other GEMMs (projections, MLP,
    head); ``attention_scores``: every other kernel that reads or writes a
    ``[batch, heads, S, S]`` tensor (softmax, mask, the quantization of the
    probabilities and of their gradients); ``rest``: everything else.
    """
    b, h, s = sizes["batch"], sizes["heads"], sizes["context"]
    scores = re.compile(rf"\[(?:{b},{h}|{b * h}),(?:1,)?{s},{s}\]")
    batched = re.compile(rf"^\w+\[{b * h},")
    by_name = {k.name: k for k in p.kernels}
    out = dict.fromkeys(("gemm", "attention_gemm", "attention_scores", "rest"), 0.0)
    for k in p.kernels:
        ms = kernel_us(k, p.target) / 1e3
        if k.gemm is not None:
            out["attention_gemm" if batched.match(k.output) else "gemm"] += ms
            continue
        shapes = [k.output] + [by_name[i].output for i in k.inputs if i in by_name]
        out["attention_scores" if any(map(scores.search, shapes)) else "rest"] += ms
    return {key: round(v, 3) for key, v in out.items()}


def loop_as_tiled(p: qbits.hlo.Program) -> float:
    """The estimate with every loop-emitter transpose at the tiled rate.

    The estimate prices those that keep the minor axis (the LM's head
    permutations, ``[b, S, h, d] <-> [b, h, S, d]``) so already
    (:attr:`qbits.hlo._module.Kernel.keeps_rows`); the others at the rate
    measured for one-byte 2-D transposes: this is the other end of the range.
    """
    t = dataclasses.replace(
        p.target, loop_transpose_bandwidth=p.target.transpose_bandwidth
    )
    return round(estimate(p.kernels, t).total_ms, 3)


def fast_accumulation(p: qbits.hlo.Program) -> float:
    """The estimate with every FP8 GEMM at the fast-accumulation rate.

    qbits' presets run the backward FP8 GEMMs with ``precision=HIGHEST``
    (full float32 accumulation, Transformer Engine's split accumulator);
    this is what CUBLASLT_MATMUL_DESC_FAST_ACCUM would give them, a
    precision decision the presets leave alone. The same program, repriced.
    """
    rates = dict(p.target.gemm_rates, fp8_exact=p.target.gemm_rates["fp8"])
    t = dataclasses.replace(p.target, gemm_rates=rates)
    return round(estimate(p.kernels, t).total_ms, 3)


def no_excess_precision(make: Any, fargs: tuple) -> dict[str, Any]:
    """The program compiled with ``xla_allow_excess_precision=False`` too.

    XLA then keeps every bfloat16 rounding the program asks for instead of
    reading float32 values it has at hand (a GEMM output, an attention
    gradient): fewer bytes in places, other GPU numerics. A precision
    decision left to users; its estimate (and with fast accumulation too).
    """
    options = dict(qbits.hlo.GPU_COMPILER_OPTIONS, xla_allow_excess_precision=False)
    p = qbits.hlo.program(make(), *fargs, target="h200", compiler_options=options)
    return {
        "device_ms": round(p.estimate().total_ms, 3),
        "device_ms_fast_accumulation": fast_accumulation(p),
        "kernels": len(p.kernels),
    }


def _lm_before() -> dict[str, qbits.hlo.Program]:
    """The LM programs the H200 ran on 2026-11-27."""
    with tarfile.open(RESULTS / "train_step_gpu_hlo.tgz") as tar:
        return {
            pathlib.Path(m.name).name.removesuffix(".hlo.txt"): qbits.hlo.Program(
                io.TextIOWrapper(tar.extractfile(m)).read(), "h200"
            )
            for m in tar.getmembers()
            if m.isfile() and m.name.startswith("./lm/")
        }


def lm_rows(hlo_dir: str | None = None) -> list[dict]:
    """The example LM's rows: now (deviceless) and the H200's programs."""
    measured = {
        r["variant"]: r["step_ms"]
        for r in json.loads((RESULTS / "train_step_lm_gpu.json").read_text())["results"]
    }
    before = _lm_before()
    rows = []
    for name in LM_VARIANTS:
        start = time.perf_counter()
        make, fargs = gpu_step("lm", None if name == "bf16" else name, **LM_SIZES)
        p = qbits.hlo.program(make(), *fargs, target="h200")
        if hlo_dir:
            (pathlib.Path(hlo_dir) / f"{name}.hlo.txt").write_text(p.text)
        e = p.estimate()
        row = {
            "variant": name,
            "h200": {
                "device_ms": round(e.total_ms, 3),
                "device_ms_loop_transposes_tiled": loop_as_tiled(p),
                "device_ms_fast_accumulation": fast_accumulation(p),
                "split_ms": lm_split(p, LM_SIZES),
                "by_category": {k: round(v, 3) for k, v in e.by_category.items()},
                "kernels": len(p.kernels),
                "waste_kernels": {c: p.count(c) for c in WASTE},
                "temp_mib": round(p.temp_bytes / 2**20, 1),
                "deviceless_compile_s": round(time.perf_counter() - start, 1),
            },
        }
        if name.endswith("_proj"):
            row["h200"]["no_excess_precision"] = no_excess_precision(make, fargs)
        if name in before:
            row["h200_before"] = {
                "measured_step_ms": measured[name],
                "estimate_ms": round(before[name].estimate().total_ms, 3),
                "split_ms": lm_split(before[name], LM_SIZES),
            }
        rows.append(row)
        print(f"lm {name}: {row['h200']['device_ms']:.2f} ms on an H200", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    parser.add_argument("--part", choices=("mlp", "lm", "all"), default="all")
    parser.add_argument("--hlo-dir", help="--part lm: write each LM program here")
    args = parser.parse_args()
    path = pathlib.Path(args.json)
    data = json.loads(path.read_text()) if path.exists() else {}
    if args.part in ("lm", "all"):
        data["lm"] = {
            "model": "example LM: d_model 2048, 8 blocks, 16 heads, 4 x 2048 "
            "tokens, bf16, SGD (deviceless)",
            "results": lm_rows(args.hlo_dir),
        }
    if args.part in ("mlp", "all"):
        data.update(mlp_part())
    path.write_text(json.dumps(data, indent=2))
    table = markdown(data["results"]) + "\n" + lm_markdown(data.get("lm"))
    if args.md:
        pathlib.Path(args.md).write_text(table)
    print(table)


def mlp_part() -> dict:
    """The MLP block's rows and the JSON's ``meta``."""
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
    return {"meta": meta, "results": rows}


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


def lm_markdown(lm: dict | None) -> str:
    if lm is None:
        return ""
    rows = lm["results"]
    base, old = rows[0]["h200"], rows[0]["h200_before"]
    lines = [
        "Example LM (d_model 2048, 8 blocks, 16 heads, 4 x 2048 tokens, bf16, "
        "one SGD step) on an H200: device time over bf16's, estimated by "
        "qbits.hlo. Measured: the step time over bf16's on 2026-11-27 "
        "(results/train_step_lm_gpu.json); before: the estimate of the "
        "programs that run ran; now: this code. ms: now, estimated.",
        "",
        "| variant | measured | before, estimate | now, estimate | now, loop "
        "transposes at the tiled rate | GEMMs ms | attention GEMMs ms | "
        "attention scores ms | rest ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        now, b = r["h200"], r.get("h200_before")
        split = now["split_ms"]
        tiled = base["device_ms_loop_transposes_tiled"]
        was = ("—", "—") if b is None else (
            f"{old['measured_step_ms'] / b['measured_step_ms']:.2f}x",
            f"{old['estimate_ms'] / b['estimate_ms']:.2f}x",
        )  # fmt: skip
        lines.append(
            f"| {r['variant']} | {was[0]} | {was[1]} "
            f"| {base['device_ms'] / now['device_ms']:.2f}x "
            f"| {tiled / now['device_ms_loop_transposes_tiled']:.2f}x "
            f"| {split['gemm']:.2f} "
            f"| {split['attention_gemm']:.2f} | {split['attention_scores']:.2f} "
            f"| {split['rest']:.2f} |"
        )
    lines += [
        "",
        "Precision decisions the presets leave alone, priced (H200, estimated, "
        "over bf16's): FP8 GEMMs with fast accumulation (the backward ones run "
        "`precision=HIGHEST` now: repriced, the same program), "
        "`xla_allow_excess_precision=False` (compiled again), both.",
        "",
        "| variant | now | fast accumulation | no excess precision | both |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        now, strict = r["h200"], r["h200"].get("no_excess_precision")
        if strict is None:
            continue
        fast = "device_ms_fast_accumulation"
        cells = (now["device_ms"], now[fast], strict["device_ms"], strict[fast])
        lines.append(
            f"| {r['variant']} | "
            + " | ".join(f"{base['device_ms'] / ms:.3f}x ({ms:.2f} ms)" for ms in cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
