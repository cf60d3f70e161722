"""FP8 training of the example transformer, beside float32.

The `fp8` preset: E4M3 forward operands, E5M2 incoming gradients (E4M3 for
the other backward operand), one scale per tensor from its current absmax.
The same as `qbits train fp8`, from Python: same init, data order and seed.
On CPU, XLA computes fp8 dots in float32 after exact fp8 rounding; on Hopper
GPUs they become FP8 GEMMs.

Run: python examples/fp8_training.py [--steps 200]
"""

import argparse

# The qbits command's training loop (qbits._experiments): not library API.
from qbits._experiments import spec, train

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()

lm = spec("lm")
for name, config in (("float32", None), ("fp8", "fp8")):
    result = train(lm, config, seed=0, steps=args.steps)
    print(
        f"{name:8s} train loss {result.train_loss:.4f}  eval loss "
        f"{result.eval_loss:.4f}  ({result.seconds:.0f} s)"
    )
