"""Quantized training of a small MLP with qbits.dot_general.

Trains the same MLP, on the same generated data and seed, three ways: in
float32; with int8 in the forward matmuls and in both backward matmuls (real
int8 x int8 -> int32 dots); and with int4 weights and int8 activations in the
forward pass (int8 backward). Prints the final eval loss and accuracy of each.

Run: python examples/qat_mlp.py [--steps 400]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import qbits

IN, HIDDEN, CLASSES = 64, 256, 10
DN = (((1,), (0,)), ((), ()))  # x [batch, in] . w [in, out]


def make_data(key, n):
    """A nonlinear 10-class problem drawn from a fixed random teacher net."""
    k_teacher, k_x = jax.random.split(key)
    w1 = jax.random.normal(k_teacher, (IN, 128)) / jnp.sqrt(IN)
    w2 = jax.random.normal(jax.random.fold_in(k_teacher, 1), (128, CLASSES))
    x = jax.random.normal(k_x, (n, IN))
    y = jnp.argmax(jnp.tanh(x @ w1) @ w2, axis=-1)
    return x, y


def init(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / jnp.sqrt(IN),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / jnp.sqrt(HIDDEN),
        "b2": jnp.zeros(CLASSES),
    }


def make_model(dot_general):
    def apply(params, x):
        h = jax.nn.relu(dot_general(x, params["w1"], DN) + params["b1"])
        return dot_general(h, params["w2"], DN) + params["b2"]

    return apply


def train(apply, steps, seed=0):
    x, y = make_data(jax.random.key(42), 8192)
    x_eval, y_eval = make_data(jax.random.key(42), 10240)
    x_eval, y_eval = x_eval[8192:], y_eval[8192:]  # same teacher, new inputs
    params = init(jax.random.key(seed))
    opt = optax.adam(3e-3)
    state = opt.init(params)

    def loss_fn(params, x, y):
        logits = apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, state, i):
        key = jax.random.fold_in(jax.random.key(seed), i)
        idx = jax.random.randint(key, (256,), 0, 8192)
        loss, grads = jax.value_and_grad(loss_fn)(params, x[idx], y[idx])
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    for i in range(steps):
        params, state, _ = step(params, state, i)
    eval_loss = float(jax.jit(loss_fn)(params, x_eval, y_eval))
    accuracy = float(jnp.mean(jnp.argmax(apply(params, x_eval), -1) == y_eval))
    return eval_loss, accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()

    # AQT's int8: one scale per row of the activations and per output channel
    # of the weights (shared along the contracting axes).
    int8 = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=qbits.PerChannel())
    int4 = qbits.Quantizer(qbits.IntNumerics(bits=4), granularity=qbits.PerChannel())
    int8_mm = qbits.MatmulConfig(lhs=int8, rhs=int8)
    variants = {
        "float32": jax.lax.dot_general,
        "int8 forward and backward": qbits.dot_general(
            qbits.DotGeneralConfig(fwd=int8_mm, dlhs=int8_mm, drhs=int8_mm)
        ),
        "int4 weights, int8 elsewhere": qbits.dot_general(
            qbits.DotGeneralConfig(
                fwd=qbits.MatmulConfig(lhs=int8, rhs=int4), dlhs=int8_mm, drhs=int8_mm
            )
        ),
    }
    print(f"{'variant':30s} {'eval loss':>9s} {'accuracy':>9s} {'time':>6s}")
    for name, dot_general in variants.items():
        start = time.perf_counter()
        loss, acc = train(make_model(dot_general), args.steps)
        print(f"{name:30s} {loss:9.4f} {acc:9.3f} {time.perf_counter() - start:5.1f}s")


if __name__ == "__main__":
    main()
