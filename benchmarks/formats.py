"""4-bit weight formats: the error each leaves on a weight matrix.

The weight quantizer of each 4-bit preset (symmetric int4 in groups of 128,
asymmetric uint4 in groups of 128 with and without the MSE range search,
NF4, NVFP4, MXFP4) applied to a 512 x 256 weight whose contracting axis is
the first, for three weight distributions: N(0, 1), N(1, 1) (shifted away
from zero) and Student-t with 3 degrees of freedom (heavy tails). The
figure is the noise-to-signal ratio, mean((w - w_hat)**2) / mean(w**2);
it depends on the draw (key 0), not on the machine. Beside it, the bytes
each format stores the weight in (``qbits.ops._store_weight``: 4-bit
values packed two per byte, with their scales, zero points and tensor
scale), over float32's.

Run: python benchmarks/formats.py --json OUT.json [--md OUT.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp

import qbits

SHAPE = (512, 256)


def quantizers() -> dict[str, qbits.Quantizer]:
    """The weight (rhs) quantizer of each format, tiled along axis 0."""

    def weight(preset: str, **changes) -> qbits.Quantizer:
        q = qbits.presets.get(preset).fwd.rhs
        q = dataclasses.replace(
            q, granularity=dataclasses.replace(q.granularity, axis=0)
        )
        return dataclasses.replace(q, **changes)

    return {
        "int4 g128 (symmetric)": weight("int4_weight_only"),
        "w4g128_asym": weight("w4g128_asym"),
        "w4g128_asym + MSE search": weight(
            "w4g128_asym", calibration=qbits.MseSearch()
        ),
        "nf4": weight("nf4"),
        "nvfp4": weight("nvfp4_weight_only"),
        "mxfp4": weight("mxfp4"),
    }


def weights() -> dict[str, jax.Array]:
    key = jax.random.key(0)
    return {
        "N(0, 1)": jax.random.normal(key, SHAPE),
        "N(1, 1)": 1.0 + jax.random.normal(key, SHAPE),
        "Student-t(3)": jax.random.t(key, 3.0, SHAPE),
    }


def stored_bytes(q: qbits.Quantizer, w: jax.Array) -> float:
    """What serving stores ``w`` in, over its float32 bytes."""
    qt = qbits.ops._store_weight(w, qbits.MatmulConfig(rhs=q), (0,))
    return sum(a.nbytes for a in jax.tree.leaves(qt)) / w.nbytes


def run() -> dict:
    w = weights()["N(0, 1)"]
    stored = {qname: stored_bytes(q, w) for qname, q in quantizers().items()}
    results = {}
    for wname, w in weights().items():
        results[wname] = {
            qname: float(jnp.mean((w - q.quant(w).dequant()) ** 2) / jnp.mean(w**2))
            for qname, q in quantizers().items()
        }
    return {
        "meta": {
            "benchmark": "formats",
            "shape": list(SHAPE),
            "metric": "mean((w - w_hat)**2) / mean(w**2)",
            "jax": jax.__version__,
        },
        "results": results,
        "stored_over_float32": stored,
    }


def markdown(data: dict) -> str:
    names = list(next(iter(data["results"].values())))
    lines = [
        f"Noise-to-signal of a {data['meta']['shape'][0]}x"
        f"{data['meta']['shape'][1]} weight, jax {data['meta']['jax']}",
        "",
        "| weights | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for wname, row in data["results"].items():
        cells = " | ".join(f"{row[n]:.4f}" for n in names)
        lines.append(f"| {wname} | {cells} |")
    stored = data["stored_over_float32"]
    lines.append("| stored bytes / float32 | "
                 + " | ".join(f"{stored[n]:.4f}" for n in names) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    data = run()
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    text = markdown(data)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
