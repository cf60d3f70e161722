"""Quantize an unmodified Flax nnx model by per-layer rules.

`qbits.nnx.quantize` returns a quantized copy (the original stays float): here
the attention projections and the MLP get int8 forward and backward, the two
attention einsums stay float, and the output head gets int4 weights. The
rules live in `examples/transformer_rules.yaml`; `qbits inspect` prints the
same table from the command line:

    qbits inspect examples/transformer_rules.yaml --model lm

Run: python examples/nnx_rules.py
"""

import pathlib

import flax.nnx as nnx
import jax.numpy as jnp

import qbits

# The qbits command's example models (qbits._experiments): not library API.
from qbits._experiments import TransformerLM, spec

rules = pathlib.Path(__file__).with_name("transformer_rules.yaml")  # a YAML path
model = TransformerLM(vocab=64, spec=spec("lm"), rngs=nnx.Rngs(0))
tokens = jnp.zeros((2, 64), jnp.int32)

print(qbits.nnx.layer_table(model, rules, tokens))  # path -> config, unused rules

# int8 rounds gradients stochastically: its keys come from the 'quant' stream.
qmodel = qbits.nnx.quantize(model, rules, rngs=nnx.Rngs(quant=0))
logits = nnx.jit(lambda m, t: m(t))(qmodel, tokens)
difference = float(jnp.abs(model(tokens) - logits).max())
print(f"logits {logits.shape}; largest difference to the float model {difference:.3f}")
