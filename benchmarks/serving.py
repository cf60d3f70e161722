"""Serving forward speed and weight bytes: float32 vs stored int8 / int4.

The MLP of ``train_step.py`` (512 -> 2048 -> 512, ReLU, biases, batch 256,
float32), as a linen model, served from the params of
``qbits.serving.convert``: the jitted forward takes the serving params as
inputs (no float kernel anywhere). Variants run interleaved, round after
round, so that machine noise hits all of them alike; each figure is a
median of per-round ratios to float32. Writes one JSON entry per variant and
prints a markdown table: time ratio (with IQR), weight-bytes ratio to
float32 (the two kernels, scales included), and the dtypes of every dot in
the optimized HLO. A reference row times the two bare int8 x int8 -> int32
dots alone (the floor for w8a8).

Run: python benchmarks/serving.py --json OUT.json [--rounds 40] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import paired  # benchmarks/paired.py

import qbits
import qbits.hlo
import qbits.serving

BATCH, IN, HIDDEN, OUT = 256, 512, 2048, 512


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(HIDDEN, name="fc1")(x))
        return nn.Dense(OUT, name="fc2")(x)


def configs(static: qbits.QuantConfig) -> dict[str, object]:
    def per_channel(bits: int) -> qbits.Quantizer:
        return qbits.Quantizer(
            qbits.IntNumerics(bits=bits), granularity=qbits.PerChannel()
        )

    def weight_only(bits: int) -> qbits.DotGeneralConfig:
        return qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=per_channel(bits)))

    tiled = qbits.presets.get("int4_weight_only")
    tiled_fake = tiled.replace(fwd=tiled.fwd.replace(mode="fake"))
    return {
        "w8a8 (int8_fwd)": "int8_fwd",
        # Post-training calibration: activation ranges collected over 8
        # batches and frozen (no absmax reduction at serving time).
        "w8a8, static activation ranges (freeze_ranges)": static,
        "int8 weight-only": weight_only(8),
        "int4 weight-only (int4_weight_only, tiles of 128)": "int4_weight_only",
        # The same int4 weights, dequantized before a float32 dot: the
        # tiled real-mode dot (a batched dot per tile, then a sum) is slow.
        "int4 weight-only, tiles of 128, mode fake (dequantize, f32 dot)": (tiled_fake),
        "int4 weight-only, per channel": weight_only(4),
        "w4a8 (int4 weights per channel, int8 activations)": "w4a8",
    }


def int8_dots_alone():
    """The two int8 x int8 -> int32 dots of the w8a8 forward, nothing else."""

    def run(a, w1, h, w2):
        y1 = jax.lax.dot(a, w1, preferred_element_type=jnp.int32)
        y2 = jax.lax.dot(h, w2, preferred_element_type=jnp.int32)
        return y1, y2

    k = jax.random.split(jax.random.key(1), 4)

    def ints(key, shape):
        return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)

    args = (
        ints(k[0], (BATCH, IN)),
        ints(k[1], (IN, HIDDEN)),
        ints(k[2], (BATCH, HIDDEN)),
        ints(k[3], (HIDDEN, OUT)),
    )
    return jax.jit(run), args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--md", help="where to write the markdown table")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3, help="runs per round")
    args = parser.parse_args()

    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (BATCH, IN))
    model = Mlp()
    params = jax.jit(model.init)(k[1], x)
    jax.jit(lambda a: a * 2).lower(x).compile()  # compiler start-up

    variants = {}

    def add(name, fn, fn_args, weight_ratio, report=None):
        compiled = jax.jit(fn).lower(*fn_args).compile()
        jax.block_until_ready(compiled(*fn_args))
        variants[name] = {
            "run": compiled,
            "args": fn_args,
            "weight_ratio": weight_ratio,
            "report": report,
            "dots": [
                f"{a} x {b} -> {o}"
                for a, b, o in qbits.hlo.dot_dtypes(compiled.as_text())
            ],
        }

    add("float32", model.apply, (params, x), 1.0)
    batches = [jax.random.normal(jax.random.key(10 + i), (BATCH, IN)) for i in range(8)]
    ranges = qbits.collect_ranges(model.apply, params, batches)
    static = qbits.freeze_ranges("int8_fwd", ranges)
    for name, config in configs(static).items():
        sp = qbits.serving.convert(model, config, params, x)
        served = qbits.serving.serve(model, config)
        qat = jax.jit(qbits.flax.quantize(model, config).apply)(params, x)
        out = jax.jit(served)(sp, x)
        if not bool((out == qat).all()):
            raise SystemExit(f"{name}: serving != QAT forward")
        report = qbits.serving.size_report(sp)
        add(name, served, (sp, x), report.ratio, report)
    dots, dot_args = int8_dots_alone()
    add("reference: the two int8 dots alone", dots, dot_args, None)

    times = paired.measure(
        {name: functools.partial(v["run"], *v["args"]) for name, v in variants.items()},
        args.rounds,
        args.reps,
    )
    results = []
    for name, v in variants.items():
        stats = paired.ratio_stats(times[name], times["float32"])
        entry = {
            "variant": name,
            "forward_ms": stats.pop("ms"),
            **stats,
            "weight_bytes_ratio": None
            if v["weight_ratio"] is None
            else round(v["weight_ratio"], 4),
            "dots": v["dots"],
        }
        if v["report"] is not None:
            entry["weight_bytes"] = v["report"].bytes
            entry["float32_weight_bytes"] = v["report"].float32_bytes
            entry["layers"] = [
                {k: r[k] for k in ("path", "format", "value_bytes", "scale_bytes")}
                for r in v["report"].as_dicts()[:-2]
            ]
        results.append(entry)
    meta = paired.machine(
        "serving",
        f"MLP {IN}->{HIDDEN}->{OUT}, batch {BATCH}, forward, jit",
        args.rounds,
        args.reps,
    )
    meta["load_average"] = os.getloadavg()
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)

    lines = [
        f"{meta['model']} on {meta['backend']} ({meta['devices']}), jax "
        f"{meta['jax']}; load average at the end {meta['load_average'][0]:.1f}",
        "",
        "| variant | time / f32 (IQR) | weight bytes / f32 | dots in the "
        "optimized HLO |",
        "|---|---|---|---|",
    ]
    for r in results:
        dots = "; ".join(sorted(set(r["dots"]), key=r["dots"].index))
        q1, q3 = r["time_ratio_iqr"]
        w = r["weight_bytes_ratio"]
        w = "—" if w is None else f"{w:.4f}"
        lines.append(
            f"| {r['variant']} | {r['time_ratio']:.2f} ({q1:.2f}-{q3:.2f}) | {w} "
            f"| {dots} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
