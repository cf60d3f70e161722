"""Training-step speed: float32 vs qbits int8 and fp8, in one process.

The MLP 512 -> 2048 -> 512 (ReLU, biases), batch 256, float32 parameters,
mean-squared-error loss, one SGD step under ``jax.jit``. Variants run
interleaved, round after round, so that machine noise hits all of them alike;
each figure is a median. Writes one JSON entry per variant and prints a
markdown table with the time and compile-time ratios to float32 and the
dtypes of every dot in the optimized HLO.

Run: python benchmarks/train_step.py --json OUT.json [--rounds 30]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import paired  # benchmarks/paired.py

import qbits

BATCH, IN, HIDDEN, OUT = 256, 512, 2048, 512


def configs() -> dict[str, qbits.DotGeneralConfig | None]:
    int8 = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=qbits.PerChannel())
    int8_mm = qbits.MatmulConfig(lhs=int8, rhs=int8)
    reuse = int8_mm.replace(use_fwd_quant=True)
    e4m3 = qbits.Quantizer(
        qbits.Fp8Numerics("float8_e4m3fn"), granularity=qbits.PerTensor()
    )
    e5m2 = qbits.Quantizer(
        qbits.Fp8Numerics("float8_e5m2"), granularity=qbits.PerTensor()
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


def make_step(config: qbits.DotGeneralConfig | None, lr: float = 1e-3):
    dot = jax.lax.dot_general if config is None else qbits.dot_general(config)
    dn = (((1,), (0,)), ((), ()))

    def loss(params, x, y):
        h = jax.nn.relu(dot(x, params["w1"], dn) + params["b1"])
        out = dot(h, params["w2"], dn) + params["b2"]
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3, help="runs per round")
    args = parser.parse_args()

    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (IN, HIDDEN)) / IN**0.5,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k[1], (HIDDEN, OUT)) / HIDDEN**0.5,
        "b2": jnp.zeros(OUT),
    }
    x = jax.random.normal(k[2], (BATCH, IN))
    y = jax.random.normal(k[3], (BATCH, OUT))

    # One-off compiler start-up costs must not land on the first variant.
    jax.jit(lambda a: a * 2).lower(x).compile()
    variants = {}
    for name, config in configs().items():
        # Compile time: trace + lower + XLA compile of a fresh function, best
        # of three (a fresh function misses every cache).
        compile_s = float("inf")
        for _ in range(3):
            step = make_step(config)
            start = time.perf_counter()
            compiled = step.lower(params, x, y).compile()
            compile_s = min(compile_s, time.perf_counter() - start)
        jax.block_until_ready(compiled(params, x, y))
        variants[name] = {
            "run": compiled,
            "compile_s": compile_s,
            "dots": [
                f"{a} x {b} -> {o}"
                for a, b, o in qbits.ops.dot_dtypes(compiled.as_text())
            ],
        }
    times = paired.measure(
        {
            name: functools.partial(v["run"], params, x, y)
            for name, v in variants.items()
        },
        args.rounds,
        args.reps,
    )
    base = variants["float32"]
    results = []
    for name, v in variants.items():
        stats = paired.ratio_stats(times[name], times["float32"])
        results.append(
            {
                "variant": name,
                "step_ms": stats.pop("ms"),
                **stats,
                "compile_s": round(v["compile_s"], 3),
                "compile_ratio": round(v["compile_s"] / base["compile_s"], 3),
                "dots": v["dots"],
            }
        )
    meta = paired.machine(
        "train_step",
        f"MLP {IN}->{HIDDEN}->{OUT}, batch {BATCH}, SGD, jit",
        args.rounds,
        args.reps,
    )
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)

    print(
        f"{meta['model']} on {meta['backend']} ({meta['devices']}), jax {meta['jax']}"
    )
    print()
    print("| variant | time / f32 (IQR) | compile / f32 | dots in the optimized HLO |")
    print("|---|---|---|---|")
    for r in results:
        dots = "; ".join(sorted(set(r["dots"]), key=r["dots"].index))
        q1, q3 = r["time_ratio_iqr"]
        ratios = f"{r['time_ratio']:.2f} ({q1:.2f}-{q3:.2f}) | {r['compile_ratio']:.2f}"
        print(f"| {r['variant']} | {ratios} | {dots} |")


if __name__ == "__main__":
    main()
