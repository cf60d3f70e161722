"""What quantized training keeps for the backward pass: residual bytes.

An 8-layer MLP (width 1024, batch 512, tanh), float32 parameters, one
training step. For each config, the residuals autodiff keeps between the
forward and the backward pass (the leaves of ``jax.vjp``'s backward
function), split into those of the matmuls (the operands the quantized
core saves: int8/fp8 codes and their scales, or float operands) and the
rest (tanh outputs, which no matmul config changes); and the compiled
training step's temporary memory (XLA's memory analysis). Ratios are to
float32 in the same run.

``use_fwd_quant=True`` on the backward matmuls makes them reuse the
forward's quantized operands: the residuals are then int8 even where the
gradient matmuls run in float (``int8_fwd`` + reuse).

Run: python benchmarks/residuals.py --json OUT.json [--md OUT.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp

import qbits

LAYERS, WIDTH, BATCH = 8, 1024, 512
DN = (((1,), (0,)), ((), ()))


def _reuse(config: qbits.DotGeneralConfig) -> qbits.DotGeneralConfig:
    return dataclasses.replace(
        config,
        dlhs=dataclasses.replace(config.dlhs, use_fwd_quant=True),
        drhs=dataclasses.replace(config.drhs, use_fwd_quant=True),
    )


def _configs() -> dict[str, qbits.DotGeneralConfig | None]:
    get = qbits.presets.get
    return {
        "float32": None,
        "int8": get("int8"),
        "int8 + reuse": _reuse(get("int8")),
        "int8_fwd": get("int8_fwd"),
        "int8_fwd + reuse": _reuse(get("int8_fwd")),
        "fp8": get("fp8"),
    }


def _dot(config, i):
    if config is None:
        return jax.lax.dot_general
    key = jax.random.key(i) if config.needs_key else None
    return qbits.dot_general(config, key)


def _loss(config):
    def loss(params, x):
        h = x
        for i, w in enumerate(params):
            h = _dot(config, i)(h, w, DN)
            if i + 1 < len(params):
                h = jnp.tanh(h)
        return jnp.mean(h**2)

    return loss


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def measure(config) -> dict[str, float]:
    """Residual bytes of the step and of its matmuls; compiled temp bytes."""
    params = [
        jax.random.normal(jax.random.key(i), (WIDTH, WIDTH)) / WIDTH**0.5
        for i in range(LAYERS)
    ]
    x = jax.random.normal(jax.random.key(99), (BATCH, WIDTH))
    _, backward = jax.vjp(_loss(config), params, x)
    total = _bytes(backward)
    # The matmuls alone: one layer's dot, residuals as its core keeps them.
    h = jnp.tanh(x)
    matmuls = sum(
        _bytes(jax.vjp(lambda a, b, i=i: _dot(config, i)(a, b, DN), h, w)[1])
        for i, w in enumerate(params)
    )
    step = jax.jit(jax.grad(_loss(config)))
    memory = step.lower(params, x).compile().memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", float("nan"))
    return {"residual_bytes": total, "matmul_residual_bytes": matmuls,
            "temp_bytes": temp}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    results = {name: measure(cfg) for name, cfg in _configs().items()}
    base = results["float32"]
    for r in results.values():
        for k in ("residual_bytes", "matmul_residual_bytes", "temp_bytes"):
            r[k.replace("bytes", "ratio")] = r[k] / base[k]
    meta = {"jax": jax.__version__, "layers": LAYERS, "width": WIDTH,
            "batch": BATCH, "backend": jax.default_backend()}  # fmt: skip
    pathlib.Path(args.json).write_text(
        json.dumps({"meta": meta, "results": results}, indent=1)
    )
    lines = [
        f"MLP {LAYERS} x {WIDTH}, batch {BATCH}, tanh; jax {jax.__version__} "
        f"({jax.default_backend()}); ratios to float32",
        "",
        "| config | matmul residuals | all residuals | compiled step temp memory |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['matmul_residual_ratio']:.2f} "
            f"({r['matmul_residual_bytes'] / 2**20:.1f} MiB) "
            f"| {r['residual_ratio']:.2f} | {r['temp_ratio']:.2f} "
            f"({r['temp_bytes'] / 2**20:.1f} MiB) |"
        )
    table = "\n".join(lines)
    print(table)
    if args.md:
        pathlib.Path(args.md).write_text(table + "\n")


if __name__ == "__main__":
    main()
