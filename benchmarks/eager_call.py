"""Eager (un-jitted) calls of a quantized function against the float call.

A 4-layer MLP (width 256, ReLU, batch 64, float32) as a plain function of
``(params, x)`` and as a linen model, called outside ``jax.jit``, as a
notebook or a test calls it. Variants: the float function (the baseline),
``qbits.quantize(mlp, "int8")`` (int8 forward and backward, stochastic
rounding of the gradients: a key), ``qbits.quantize(mlp, "fp8")``, the
float linen model's ``apply`` (the linen baseline) and
``qbits.flax.quantize(model, "int8").apply``.

Reports, per variant: the first call (fresh caches: tracing and compiling
included), the steady state (paired, interleaved rounds: the median of
per-round ratios to the float call of the same kind, with its IQR, and
the median milliseconds) and how many times the engine traced the
function over 10 further calls (``qbits.transform._transform.trace``,
counted). Writes a JSON file and a markdown table (``--md``, also printed).
Also runs against an older qbits (``PYTHONPATH=...``): the figures of
before a change.

Run: python benchmarks/eager_call.py --json OUT.json [--md OUT.md]
     [--rounds 30] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import flax.linen as nn
import jax
import paired  # benchmarks/paired.py

import qbits
from qbits.transform import _transform

DEPTH, WIDTH, BATCH = 4, 256, 64


def mlp(params, x):
    for w in params:
        x = jax.nn.relu(x @ w)
    return x


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(DEPTH):
            x = nn.relu(nn.Dense(WIDTH, use_bias=False, name=f"fc{i}")(x))
        return x


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class _Counted:
    """Counts the engine's traces (``_transform.trace`` calls)."""

    def __init__(self) -> None:
        self.count = 0
        self.real = _transform.trace

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.real(*args, **kwargs)


def _fresh() -> None:
    """Forgets every compiled and traced program (a first call is cold)."""
    jax.clear_caches()
    programs = getattr(getattr(qbits.transform, "_cache", None), "PROGRAMS", None)
    if programs is not None:
        programs.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--md", help="where to write the markdown table")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    keys = jax.random.split(jax.random.key(0), DEPTH + 2)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys[:DEPTH]]
    x = jax.random.normal(keys[DEPTH], (BATCH, WIDTH))
    key = keys[DEPTH + 1]
    model = Mlp()
    variables = model.init(jax.random.key(1), x)
    qmodel = qbits.flax.quantize(model, "int8")
    rngs = {"quant": key}
    int8 = qbits.quantize(mlp, "int8", key)
    fp8 = qbits.quantize(mlp, "fp8")

    calls = {
        "float32": (lambda: mlp(params, x), "float32"),
        "qbits.quantize int8": (lambda: int8(params, x), "float32"),
        "qbits.quantize fp8": (lambda: fp8(params, x), "float32"),
        "linen float32": (lambda: model.apply(variables, x), "linen float32"),
        "qbits.flax.quantize int8": (
            lambda: qmodel.apply(variables, x, rngs=rngs),
            "linen float32",
        ),
    }
    counted = _Counted()
    _transform.trace = counted

    results: dict[str, dict] = {}
    for name, (call, _) in calls.items():
        _fresh()
        start = time.perf_counter()
        jax.block_until_ready(call())
        first = time.perf_counter() - start
        counted.count = 0
        for _ in range(10):
            jax.block_until_ready(call())
        results[name] = {"first_call_s": round(first, 3)}
        results[name]["traces_per_10"] = counted.count

    times = paired.measure(
        {n: c for n, (c, _) in calls.items()}, args.rounds, args.reps
    )
    for name, (_, base) in calls.items():
        results[name].update(paired.ratio_stats(times[name], times[base]))
        results[name]["baseline"] = base

    meta = paired.machine(
        "eager_call",
        f"{DEPTH}-layer MLP {WIDTH}x{WIDTH}, batch {BATCH}, eager forward",
        args.rounds,
        args.reps,
    )
    meta["cpu_model"] = _cpu_model()
    meta["qbits"] = os.path.dirname(qbits.__file__)
    meta["load_average"] = os.getloadavg()
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)

    lines = [
        f"{meta['model']} on {meta['backend']} ({meta['cpu_model']}, "
        f"{meta['cpu_count']} cores), jax {meta['jax']}; load average at the "
        f"end {meta['load_average'][0]:.1f}",
        "",
        "| variant | steady ms | / float call (IQR) | first call s | "
        "traces in 10 calls after the first |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        q1, q3 = r["time_ratio_iqr"]
        lines.append(
            f"| {name} | {r['ms']:.2f} | {r['time_ratio']:.2f} ({q1:.2f}-{q3:.2f}) "
            f"| {r['first_call_s']:.2f} | {r['traces_per_10']} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
