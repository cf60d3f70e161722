"""Training-step speed: a float baseline vs qbits int8 and fp8, in one process.

Two setups, each run side by side with its float baseline:

* CPU (default): the MLP 512 -> 2048 -> 512 (ReLU, biases), batch 256,
  float32 parameters, MSE loss, one SGD step under ``jax.jit``; variants are
  hand-written int8 and fp8 configs.
* ``--gpu``: an LLM MLP block 4096 -> 16384 -> 4096 (GELU, no biases) on
  8192 tokens, bfloat16 parameters and activations, against bfloat16; the
  variants are the presets ``fp8``, ``fp8_delayed``, ``int8`` and
  ``int8_fwd``. It also lists the GEMM kinds of the optimized HLO (cuBLASLt
  FP8, s8 GEMMs, ...) and profiles one step of each variant to split the
  device time into GEMMs, quantization passes and the rest.
* ``--gpu --model lm``: the example transformer (``qbits train``'s model:
  pre-norm blocks of attention and a GELU MLP, learned positions) at a GPU
  size, d_model 2048, 8 blocks, 16 heads, 4 sequences of 2048 tokens, bf16
  parameters and activations, every matmul quantized by the preset
  (attention's einsums included), cross-entropy loss, one SGD step:
  what a model gains, not only its largest GEMMs.

Variants run interleaved, round after round, so that machine noise hits all
of them alike; each figure is a median of per-round ratios. Writes a JSON
file and a markdown table (``--md``, also printed).

Run: python benchmarks/train_step.py --json OUT.json [--md OUT.md] [--gpu]
     [--model mlp|lm] [--small]
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

if "--gpu" in sys.argv:
    # Before jax starts: the profiling process (no CUDA graphs, whose kernels
    # the profiler cannot see) reuses the timing process's autotuning results.
    _cache = os.environ.setdefault(
        "QBITS_BENCH_AUTOTUNE_CACHE", tempfile.mkdtemp(prefix="qbits-autotune-")
    )
    _flags = f" --xla_gpu_per_fusion_autotune_cache_dir={_cache}"
    if "--profile-only" in sys.argv:
        _flags += " --xla_gpu_enable_command_buffer="
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + _flags

import jax
import jax.numpy as jnp
import paired

import qbits
import qbits.hlo
from qbits._experiments import LM_RECIPES, gpu_step

DN = (((1,), (0,)), ((), ()))


# --------------------------------------------------------------------- CPU --

BATCH, IN, HIDDEN, OUT = 256, 512, 2048, 512


def cpu_configs() -> dict[str, qbits.DotGeneralConfig | None]:
    int8 = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=qbits.PerChannel())
    int8_mm = qbits.MatmulConfig(lhs=int8, rhs=int8)
    reuse = int8_mm.replace(use_fwd_quant=True)
    e4m3 = qbits.Quantizer(
        qbits.numerics.Fp8Numerics("float8_e4m3fn"), granularity=qbits.PerTensor()
    )
    e5m2 = qbits.Quantizer(
        qbits.numerics.Fp8Numerics("float8_e5m2"), granularity=qbits.PerTensor()
    )
    return {
        "float32": None,
        "int8 fwd": qbits.DotGeneralConfig(fwd=int8_mm),
        "int8 fwd+bwd": qbits.DotGeneralConfig(fwd=int8_mm, dlhs=int8_mm, drhs=int8_mm),
        # AQT's fully_quantized default: the backward matmuls reuse the
        # forward's quantized operands and quantize only the gradient.
        "int8 fwd+bwd, reusing fwd": qbits.DotGeneralConfig(
            fwd=int8_mm, dlhs=reuse, drhs=reuse
        ),
        "fp8 (e4m3 fwd, e5m2 grads)": qbits.DotGeneralConfig(
            fwd=qbits.MatmulConfig(lhs=e4m3, rhs=e4m3),
            dlhs=qbits.MatmulConfig(lhs=e5m2, rhs=e4m3),
            drhs=qbits.MatmulConfig(lhs=e5m2, rhs=e4m3),
        ),
    }


def cpu_step(config: qbits.DotGeneralConfig | None, lr: float = 1e-3):
    dot = jax.lax.dot_general if config is None else qbits.dot_general(config)

    def loss(params, x, y):
        h = jax.nn.relu(dot(x, params["w1"], DN) + params["b1"])
        out = dot(h, params["w2"], DN) + params["b2"]
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)

    return step


def cpu_variants() -> tuple[str, dict[str, tuple[Callable, tuple]]]:
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (IN, HIDDEN)) / IN**0.5,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k[1], (HIDDEN, OUT)) / HIDDEN**0.5,
        "b2": jnp.zeros(OUT),
    }
    x = jax.random.normal(k[2], (BATCH, IN))
    y = jax.random.normal(k[3], (BATCH, OUT))
    model = f"MLP {IN}->{HIDDEN}->{OUT}, batch {BATCH}, SGD, jit"
    out = {
        name: (functools.partial(cpu_step, config), (params, x, y))
        for name, config in cpu_configs().items()
    }
    try:
        import qwix  # noqa: F401  (benchmark-only extra: pip install -e '.[compare]')
    except ImportError:
        return model, out
    out["Qwix QT int8 (for comparison)"] = (qwix_step, (_qwix_params(params), x, y))
    return model, out


def _qwix_params(params: dict[str, jax.Array]) -> dict[str, Any]:
    return {
        "params": {
            "fc1": {"kernel": params["w1"], "bias": params["b1"]},
            "fc2": {"kernel": params["w2"], "bias": params["b2"]},
        }
    }


def qwix_step(lr: float = 1e-3):
    """The same MLP step under Qwix's QT int8 rule (forward and both backward
    matmuls int8, rounding to nearest, the backward reusing the forward's
    quantized operands)."""
    import flax.linen as nn
    import qwix

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(HIDDEN, name="fc1")(x))
            return nn.Dense(OUT, name="fc2")(h)

    rule = qwix.QtRule(
        module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8, bwd_qtype=jnp.int8
    )
    model = qwix.quantize_model(Mlp(), qwix.QtProvider([rule]))

    def loss(variables, x, y):
        return jnp.mean((model.apply(variables, x) - y) ** 2)

    @jax.jit
    def step(variables, x, y):
        grads = jax.grad(loss)(variables, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, variables, grads)

    return step


# --------------------------------------------------------------------- GPU --

GPU_PRESETS = ("fp8", "fp8_delayed", "int8", "int8_fwd")


def _presets(only: tuple[str, ...] | None) -> tuple[str | None, ...]:
    """The baseline (``None``: bf16) and the presets, or those named in ``only``."""
    every = (None, *GPU_PRESETS)
    return every if only is None else tuple(p for p in every if (p or "bf16") in only)


def gpu_variants(
    tokens: int, d_model: int, d_ff: int, only: tuple[str, ...] | None = None
) -> tuple[str, dict[str, tuple[Callable, tuple]]]:
    model = (
        f"MLP block {d_model}->{d_ff}->{d_model} (GELU), {tokens} tokens, "
        "bf16 params and activations, SGD, jit"
    )
    return model, {
        preset or "bf16": gpu_step(
            "block", preset, tokens=tokens, d_model=d_model, d_ff=d_ff
        )
        for preset in _presets(only)
    }


LM_SMALL = {"batch": 2, "context": 64, "width": 64, "depth": 2, "heads": 4}


def lm_variants(
    batch: int = 4,
    context: int = 2048,
    width: int = 2048,
    depth: int = 8,
    heads: int = 16,
    only: tuple[str, ...] | None = None,
) -> tuple[str, dict[str, tuple[Callable, tuple]]]:
    model = (
        f"example LM: d_model {width}, {depth} blocks, {heads} heads, "
        f"{batch} x {context} tokens, bf16 params and activations, SGD, jit"
    )
    sizes = dict(batch=batch, context=context, width=width, depth=depth, heads=heads)
    variants = {
        preset or "bf16": gpu_step("lm", preset, **sizes) for preset in _presets(only)
    }
    for name in LM_RECIPES:  # attention's einsums in bf16: asked for by name
        if only is not None and name in only:
            variants[name] = gpu_step("lm", name, **sizes)
    return model, variants


# ----------------------------------------------------------------- profile --

_LOW = ("f8e4m3fn", "f8e5m2", "s8[", "f8e4m3fnuz", "f8e5m2fnuz")


def _computations(text: str) -> dict[str, str]:
    comps, name, body = {}, None, []
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line and "(" in line:
            name = line.split(" ", 1)[0].lstrip("%")
            if name == "ENTRY":
                name = line.split(" ", 2)[1].lstrip("%")
            body = []
        elif line.startswith("}") and name:
            comps[name] = "\n".join(body)
            name = None
        elif name:
            body.append(line)
    return comps


def _category(op: str, text: str, comps: dict[str, str]) -> str:
    """``gemm``, ``quantize`` or ``other`` for the top-level instruction ``op``."""
    line = next(
        (
            ln
            for ln in text.splitlines()
            if ln.strip().startswith((f"%{op} =", f"ROOT %{op} =", f"{op} ="))
        ),
        "",
    )
    if "custom_call_target" in line and ("cublas" in line or "cudnn" in line):
        return "gemm"
    if "__triton_gemm" in line:
        return "gemm"
    body = line
    if "calls=" in line:
        called = line.split("calls=", 1)[1].split(",", 1)[0].split(" ", 1)[0]
        body += "\n" + comps.get(called.lstrip("%"), "")
    if any(t in body for t in _LOW):
        return "quantize"
    if "u32[" in body:  # random bits (stochastic rounding)
        return "quantize"
    if "reduce(" in body and "abs(" in body:  # amax
        return "quantize"
    return "other"


def profile(compiled, args: tuple, steps: int, text: str) -> dict[str, Any]:
    """Device time per step by kernel category, from a profiler trace."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        jax.block_until_ready(compiled(*args))
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                jax.block_until_ready(compiled(*args))
        path = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0]
        data = ProfileData.from_file(path)
    # Kernels: on a GPU the events of the device's stream lines; on CPU (a
    # smoke test) the host threads' events that name an HLO op.
    device = [p for p in data.planes if p.name.startswith("/device:")]
    lines = [
        ln
        for p in (device or data.planes)
        for ln in p.lines
        if not device or ln.name.startswith("Stream")
    ]
    per_op: dict[str, float] = {}
    for line in lines:
        for ev in line.events:
            stats = dict(ev.stats)
            if not device and "hlo_op" not in stats:
                continue
            op = stats.get("hlo_op", ev.name)
            per_op[op] = per_op.get(op, 0.0) + ev.duration_ns / steps
    comps = _computations(text)
    totals = {"gemm": 0.0, "quantize": 0.0, "other": 0.0}
    kernels = []
    for op, ns in sorted(per_op.items(), key=lambda kv: -kv[1]):
        cat = _category(op, text, comps)
        totals[cat] += ns
        kernels.append({"op": op, "us": round(ns / 1e3, 2), "category": cat})
    total = sum(totals.values()) or 1.0
    return {
        "device_ms": round(total / 1e6, 3),
        **{f"{c}_ms": round(v / 1e6, 3) for c, v in totals.items()},
        "quantize_fraction": round(totals["quantize"] / total, 3),
        "kernels": kernels[:40],
    }


# -------------------------------------------------------------------- main --


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--md", help="where to write the markdown table")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3, help="runs per round")
    parser.add_argument("--gpu", action="store_true", help="the GPU setup")
    parser.add_argument(
        "--small", action="store_true", help="--gpu at a small size (smoke test)"
    )
    parser.add_argument(
        "--model", choices=("mlp", "lm"), default="mlp",
        help="--gpu: the MLP block or the example transformer",
    )  # fmt: skip
    parser.add_argument("--hlo-dir", help="write each variant's optimized HLO here")
    parser.add_argument(
        "--cold-compile", action="store_true",
        help="--gpu: also each variant's compile in a fresh process, split into "
        "trace, lower and XLA compile (and, on a GPU, XLA compile without "
        "autotuning)",
    )  # fmt: skip
    parser.add_argument(
        "--variants",
        help="--gpu: the variants to run, comma-separated (default: bf16 and "
        "every preset)",
    )
    parser.add_argument("--only", help=argparse.SUPPRESS)  # internal: one variant
    parser.add_argument(
        "--profile-only", action="store_true", help=argparse.SUPPRESS
    )  # internal: the profiling process of --gpu
    args = parser.parse_args()
    # The profile first, in a process of its own, while this one holds no GPU
    # memory yet (JAX takes 75% of it on its first use; the example LM's
    # profiling process did not fit in the rest).
    child = args.only is not None or args.profile_only
    profiles = (
        profile_in_subprocess(args.small, args.model, args.variants)
        if args.gpu and not child
        else {}
    )
    if args.gpu and jax.default_backend() != "gpu" and not args.small:
        sys.exit(
            "train_step.py --gpu needs a GPU (jax's backend is "
            f"{jax.default_backend()!r}); add --small to smoke-test it here"
        )

    only = None if args.only is None else (args.only,)
    if only is None and args.variants:
        only = tuple(args.variants.split(","))

    def options(name: str) -> dict[str, Any]:
        """XLA options: on a GPU, quantized steps skip Triton GEMMs."""
        if not args.gpu or name == "bf16":
            return {}
        return dict(qbits.hlo.GPU_COMPILER_OPTIONS)

    if args.gpu and args.model == "lm":
        size = LM_SMALL if args.small else {}
        model, variants = lm_variants(**size, only=only)
        base_name = "bf16"
    elif args.gpu:
        dims = (256, 256, 512) if args.small else (8192, 4096, 16384)
        model, variants = gpu_variants(*dims, only=only)
        base_name = "bf16"
    else:
        model, variants = cpu_variants()
        base_name = "float32"

    if args.only is not None:  # the child of --cold-compile: one variant, cold
        make, fargs = variants[args.only]
        split = {}
        start = time.perf_counter()
        traced = make().trace(*fargs)
        split["trace_s"] = time.perf_counter() - start
        start = time.perf_counter()
        lowered = traced.lower()
        split["lower_s"] = time.perf_counter() - start
        start = time.perf_counter()
        lowered.compile(options(args.only))
        split["compile_s"] = time.perf_counter() - start
        with open(args.json, "w") as f:
            json.dump(split, f)
        return

    # One-off compiler start-up costs must not land on the first variant.
    first_args = next(iter(variants.values()))[1]
    jax.jit(lambda a: a * 2).lower(first_args[-1]).compile()
    built = {}
    for name, (make, fargs) in variants.items():
        # Compile time: trace + lower + XLA compile of a fresh function, best
        # of three on CPU, once on a GPU (autotuning makes repeats slow).
        compile_s = float("inf")
        for _ in range(1 if args.gpu else 3):
            step = make()
            start = time.perf_counter()
            compiled = step.lower(*fargs).compile(options(name))
            compile_s = min(compile_s, time.perf_counter() - start)
        jax.block_until_ready(compiled(*fargs))
        text = compiled.as_text()
        if args.hlo_dir and not args.profile_only:
            os.makedirs(args.hlo_dir, exist_ok=True)
            fname = name.replace(" ", "_").replace("/", "_") + ".hlo.txt"
            with open(os.path.join(args.hlo_dir, fname), "w") as f:
                f.write(text)
        built[name] = {
            "run": compiled,
            "args": fargs,
            "compile_s": compile_s,
            "gemms": [
                {"kind": g.kind, "lhs": g.lhs, "rhs": g.rhs, "out": g.out}
                for g in qbits.hlo.Program(text).gemms
            ],
            "text": text,
        }
        print(f"compiled {name} in {compile_s:.1f} s", file=sys.stderr, flush=True)
    if args.profile_only:
        profiles = {
            n: profile(v["run"], v["args"], 5, v["text"]) for n, v in built.items()
        }
        with open(args.json, "w") as f:
            json.dump(profiles, f, indent=2)
        return
    times = paired.measure(
        {n: functools.partial(v["run"], *v["args"]) for n, v in built.items()},
        args.rounds,
        args.reps,
    )
    cold = (
        {n: cold_compile(n, args.small, args.model) for n in built}
        if args.gpu and args.cold_compile
        else {}
    )
    results = []
    for name, v in built.items():
        stats = paired.ratio_stats(times[name], times[base_name])
        entry = {
            "variant": name,
            "step_ms": stats.pop("ms"),
            **stats,
            "speedup": round(1.0 / stats["time_ratio"], 3),
            "compile_s": round(v["compile_s"], 3),
            "compile_ratio": round(v["compile_s"] / built[base_name]["compile_s"], 3),
            "gemms": v["gemms"],
        }
        if args.gpu:
            entry["profile"] = profiles.get(name, {})
            entry["xla_options"] = options(name)
            target = _target()
            if target is not None:  # the estimate beside the measurement
                program = qbits.hlo.Program(v["text"], target)
                entry["estimate_device_ms"] = round(program.estimate().total_ms, 3)
        if name in cold:
            entry["cold_compile"] = cold[name]
        results.append(entry)
    meta = paired.machine("train_step", model, args.rounds, args.reps)
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    table = markdown(meta, results, base_name, args.gpu)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    print(table)


def _target() -> str | None:
    """The ``qbits.hlo`` target name of this GPU, or ``None``."""
    kind = jax.devices()[0].device_kind
    return next((t for t in ("h200", "h100") if t.upper() in kind.upper()), None)


def profile_in_subprocess(
    small: bool, model: str, variants: str | None = None
) -> dict[str, Any]:
    """Per-variant device-time profiles, from a process without CUDA graphs."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "profile.json")
        cmd = [sys.executable, __file__, "--gpu", "--profile-only", "--json", out,
               "--model", model]  # fmt: skip
        if variants:
            cmd += ["--variants", variants]
        done = subprocess.run(cmd + (["--small"] if small else []), check=False)
        if done.returncode != 0 or not os.path.exists(out):
            return {}
        with open(out) as f:
            return json.load(f)


def cold_compile(name: str, small: bool, model: str) -> dict[str, float]:
    """``name``'s trace, lower and XLA compile seconds in a fresh process.

    On a GPU, also XLA's compile with autotuning off
    (``--xla_gpu_autotune_level=0``): the difference is autotuning's share.
    """
    out: dict[str, float] = {}
    runs = [("", "")]  # (prefix of the figure, extra XLA flags)
    if jax.default_backend() == "gpu":
        runs.append(("no_autotune_", " --xla_gpu_autotune_level=0"))
    for prefix, extra in runs:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "cold.json")
            cmd = [sys.executable, __file__, "--gpu", "--model", model,
                   "--only", name, "--json", path]  # fmt: skip
            env = dict(os.environ)
            # No autotuning results from the timing process's cache.
            env["QBITS_BENCH_AUTOTUNE_CACHE"] = tmp
            flags = re.sub(r"--xla_gpu_per_fusion_autotune_cache_dir=\S+", "",
                           env.get("XLA_FLAGS", ""))  # fmt: skip
            env["XLA_FLAGS"] = flags + extra
            done = subprocess.run(cmd + (["--small"] if small else []), env=env)
            if done.returncode == 0 and os.path.exists(path):
                with open(path) as f:
                    got = json.load(f)
                if prefix:
                    out[f"{prefix}compile_s"] = got["compile_s"]
                else:
                    out.update(got)
    return out


def _gemm_summary(gemms: list[dict[str, str]]) -> str:
    counts: dict[str, int] = {}
    for g in gemms:
        key = f"{g['lhs']} x {g['rhs']} -> {g['out']}"
        key = key if g["kind"] == "dot" else f"{g['kind']}: {key}"
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{n}x {k}" for k, n in counts.items())


def markdown(meta: dict, results: list[dict], base: str, gpu: bool) -> str:
    lines = [
        f"{meta['model']} on {meta['backend']} ({meta['devices']}), jax {meta['jax']}",
        "",
    ]
    if gpu:
        lines += [
            f"| variant | time / {base} (IQR) | speedup | device ms (estimate) "
            "| quantize passes / step | compile s (cold: trace + lower + XLA) "
            "| GEMMs in the optimized HLO |",
            "|---|---|---|---|---|---|---|",
        ]
    else:
        lines += [
            "| variant | time / f32 (IQR) | compile / f32 "
            "| dots in the optimized HLO |",
            "|---|---|---|---|",
        ]
    if gpu:
        note = (
            "Quantized steps compiled with qbits.hlo.GPU_COMPILER_OPTIONS "
            "(Triton GEMMs off: 8-bit dots go straight to cuBLASLt); bf16 with "
            "XLA's defaults. Device ms: the profiled step's kernels, and in "
            "brackets qbits.hlo's estimate from the optimized HLO."
        )
        lines = [lines[0], "", note, *lines[1:]]
    for r in results:
        q1, q3 = r["time_ratio_iqr"]
        ratio = f"{r['time_ratio']:.2f} ({q1:.2f}-{q3:.2f})"
        gemms = _gemm_summary(r["gemms"])
        if gpu:
            prof = r.get("profile", {})
            frac = prof.get("quantize_fraction")
            frac = "—" if frac is None else f"{100 * frac:.0f}%"
            device = prof.get("device_ms")
            device = "—" if device is None else f"{device:.2f}"
            estimate = r.get("estimate_device_ms")
            device += "" if estimate is None else f" ({estimate:.2f})"
            cold = r.get("cold_compile", {})
            compile_s = f"{r['compile_s']:.1f}"
            if cold:
                parts = [cold.get(k) for k in ("trace_s", "lower_s", "compile_s")]
                if all(p is not None for p in parts):
                    compile_s += " ({:.1f} + {:.1f} + {:.1f}".format(*parts)
                    untuned = cold.get("no_autotune_compile_s")
                    if untuned is not None:  # the XLA compile's autotuning share
                        compile_s += f"; XLA {untuned:.1f} without autotuning"
                    compile_s += ")"
            lines.append(
                f"| {r['variant']} | {ratio} | {r['speedup']:.2f}x | {device} "
                f"| {frac} | {compile_s} | {gemms} |"
            )
        else:
            lines.append(
                f"| {r['variant']} | {ratio} | {r['compile_ratio']:.2f} | {gemms} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
