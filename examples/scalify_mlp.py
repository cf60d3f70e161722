"""An MNIST-sized MLP trained under `qbits.scaled.scalify` in FP16 and FP8.

784 -> 512 -> 512 -> 10 on generated MNIST-shaped data (60000 training and
10000 held-out examples, nothing downloaded), 1000 SGD steps of batch 128,
the same init and batches for every precision:

- float32: plain JAX;
- float16: parameters, activations and gradients are float16 ScaledArrays;
- fp8: float16 storage, E4M3 matmul operands forward, E5M2 gradients.

Run: python examples/scalify_mlp.py [--steps 1000]
"""

import argparse

from qbits.experiments import train_scalify_mlp

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=1000)
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
