"""An MNIST-sized MLP trained under `qbits.scaled.scalify` in FP16 and FP8.

784 -> 512 -> 512 -> 10 on generated MNIST-shaped data (60000 training and
10000 held-out examples, nothing downloaded), 1000 SGD steps of batch 128,
the same init and batches for every precision:

- float32: plain JAX;
- float16: parameters, activations and gradients are float16 ScaledArrays;
- fp8: float16 storage, E4M3 matmul operands forward, E5M2 gradients.

Run: python examples/scalify_mlp.py [--steps 1000] [--json OUT.json]
(the committed run: benchmarks/results/scalify_mlp_cpu.json)
"""

import argparse
import json

import jax

# The qbits command's example models (qbits._experiments): not library API.
from qbits._experiments import train_scalify_mlp

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--json", help="also write the results to this file")
args = parser.parse_args()

results = {
    p: train_scalify_mlp(p, steps=args.steps) for p in ("float32", "float16", "fp8")
}
base = results["float32"]
print("| precision | train loss | / float32 | eval loss | / float32 | eval accuracy |")
print("|---|---|---|---|---|---|")
for name, r in results.items():
    train, evl = r.final_loss, r.eval_loss
    print(
        f"| {name} | {train:.4f} | {train / base.final_loss:.4f} | {evl:.4f} | "
        f"{evl / base.eval_loss:.4f} | {r.eval_accuracy:.4f} |"
    )
if args.json:
    rows = {
        name: {
            "train_loss": r.final_loss,
            "eval_loss": r.eval_loss,
            "eval_accuracy": r.eval_accuracy,
        }
        for name, r in results.items()
    }
    meta = {"example": "examples/scalify_mlp.py", "steps": args.steps}
    meta["jax"] = jax.__version__
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
