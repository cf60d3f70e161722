"""Quantize a Flax linen layer by giving it a quantized dot_general.

`qbits.dot_general(config)` has exactly the signature of `jax.lax.dot_general`,
so any layer that takes `dot_general=` takes it. Here: int8 in the forward
matmul and in both backward matmuls, AQT-style per-channel scales.

Run: python examples/linen_dot_general.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import qbits

config = qbits.presets.get("int8")  # stochastic rounding of gradients: needs a key


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x, key):
        k1, k2 = jax.random.split(key)
        x = nn.relu(nn.Dense(128, dot_general=qbits.dot_general(config, k1))(x))
        return nn.Dense(10, dot_general=qbits.dot_general(config, k2))(x)


x = jax.random.normal(jax.random.key(0), (256, 32))
y = jnp.argmax(x[:, :10], axis=-1)  # a toy target
model = Mlp()
params = model.init(jax.random.key(1), x, jax.random.key(2))
opt = optax.adam(1e-2)
state = opt.init(params)


@jax.jit
def step(params, state, key):
    def loss_fn(p):
        logits = model.apply(p, x, key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state)
    return optax.apply_updates(params, updates), state, loss


for i in range(100):
    params, state, loss = step(params, state, jax.random.key(i))
print(f"int8 forward and backward: loss after 100 steps {float(loss):.4f}")
