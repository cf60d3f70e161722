"""FP8 on a GPU: does XLA run qbits' fp8 matmuls as cuBLASLt FP8 GEMMs, and how
fast is a 4096-wide MLP training step in fp8 against bf16?

Needs a CUDA GPU of compute capability 8.9 or higher (Ada, Hopper). Checks the
optimized HLO of the fp8 step for cuBLASLt fp8 custom calls and times both
steps interleaved, in one process. Writes JSON and prints a markdown table.

Run: python benchmarks/fp8_gpu.py --json OUT.json [--allow-cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import qbits

WIDTH, BATCH = 4096, 8192


def fp8_config() -> qbits.DotGeneralConfig:
    e4m3 = qbits.Quantizer(qbits.Fp8Numerics("float8_e4m3fn"))  # per-tensor scales
    e5m2 = qbits.Quantizer(qbits.Fp8Numerics("float8_e5m2"))
    return qbits.DotGeneralConfig(
        fwd=qbits.MatmulConfig(lhs=e4m3, rhs=e4m3),
        dlhs=qbits.MatmulConfig(lhs=e5m2, rhs=e4m3),
        drhs=qbits.MatmulConfig(lhs=e5m2, rhs=e4m3),
    )


def make_step(dot):
    dn = (((1,), (0,)), ((), ()))

    def loss(params, x, y):
        h = jax.nn.relu(dot(x, params["w1"], dn, preferred_element_type=jnp.float32))
        h = h.astype(jnp.bfloat16)
        out = dot(h, params["w2"], dn, preferred_element_type=jnp.float32)
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        return jax.tree_util.tree_map(
            lambda p, g: p - 1e-3 * g.astype(p.dtype), params, grads
        )

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run without a GPU (no fp8 check)"
    )
    args = parser.parse_args()
    gpu = jax.default_backend() == "gpu"
    if not gpu and not args.allow_cpu:
        sys.exit(f"fp8_gpu.py needs a GPU; jax's backend is {jax.default_backend()!r}")
    width, batch = (WIDTH, BATCH) if gpu else (512, 256)

    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": (jax.random.normal(k[0], (width, width)) / width**0.5).astype(
            jnp.bfloat16
        ),
        "w2": (jax.random.normal(k[1], (width, width)) / width**0.5).astype(
            jnp.bfloat16
        ),
    }
    x = jax.random.normal(k[2], (batch, width)).astype(jnp.bfloat16)
    y = jax.random.normal(k[3], (batch, width))

    variants = {
        "bf16": make_step(jax.lax.dot_general),
        "fp8 (e4m3 fwd, e5m2 grads)": make_step(qbits.dot_general(fp8_config())),
    }
    compiled, fp8_gemms = {}, {}
    for name, step in variants.items():
        c = step.lower(params, x, y).compile()
        text = c.as_text()
        compiled[name] = c
        fp8_gemms[name] = sum(
            1
            for line in text.splitlines()
            if 'custom_call_target="__cublas$lt$matmul$f8"' in line
        )
        jax.block_until_ready(c(params, x, y))
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, c in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(c(params, x, y))
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["bf16"])
    results = [
        {
            "variant": name,
            "step_ms": round(statistics.median(t) * 1e3, 3),
            "time_ratio_to_bf16": round(statistics.median(t) / base, 3),
            "cublaslt_fp8_gemms": fp8_gemms[name],
        }
        for name, t in times.items()
    ]
    meta = {
        "benchmark": "fp8_gpu",
        "model": f"MLP {width}->{width}->{width}, batch {batch}, bf16 params, jit",
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "rounds": args.rounds,
    }
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(f"{meta['model']} on {meta['device']}, jax {meta['jax']}\n")
    print("| variant | time / bf16 | cuBLASLt fp8 GEMMs in the optimized HLO |")
    print("|---|---|---|")
    for r in results:
        ratio, gemms = r["time_ratio_to_bf16"], r["cublaslt_fp8_gemms"]
        print(f"| {r['variant']} | {ratio:.2f} | {gemms} |")


if __name__ == "__main__":
    main()
