"""Train with int4 weights (w4a8), convert to stored weights, serve, checkpoint.

The serving forward equals the training (QAT) forward bit for bit; the
stored weights take an eighth of float32's bytes (int4 packed two per byte,
plus float32 scales).

Run: python examples/serving_mlp.py
"""

import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import qbits


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(512, name="fc1")(x))
        return nn.Dense(10, name="head")(x)


def make_step(qat: nn.Module, tx: optax.GradientTransformation):
    """One jitted training step of the QAT model.

    The batch is an argument, not an array the step closes over: XLA folds
    a captured array as a constant at compile time, and folding the
    quantization of a 256x256 one takes seconds ("Constant folding an
    instruction is taking > 1s" alarms).
    """

    @jax.jit
    def step(params, opt_state, x, y):
        def loss(p):
            logits = qat.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def main() -> None:
    rules = qbits.QuantConfig(rules=[qbits.Rule("head", "int8_fwd")], default="w4a8")
    model = Mlp()
    qat = qbits.flax.quantize(model, rules)
    kx, kw, ki = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (256, 256))
    y = jnp.argmax(x @ jax.random.normal(kw, (256, 10)), axis=-1)  # a teacher
    params = model.init(ki, x)
    tx = optax.sgd(0.05, momentum=0.9)
    opt_state = tx.init(params)
    step = make_step(qat, tx)
    for i in range(200):
        params, opt_state, value = step(params, opt_state, x, y)
        if i % 50 == 0 or i == 199:
            print(f"step {i:3d}  loss {float(value):.4f}")

    serving = qbits.serving.convert(model, rules, params, x)
    served = qbits.serving.serve(model, rules)
    out = jax.jit(served)(serving, x)
    same = bool((out == jax.jit(qat.apply)(params, x)).all())
    print(f"serving forward == QAT forward, bit for bit: {same}")
    print(qbits.serving.size_report(serving))

    path = tempfile.mkdtemp() + "/served"
    qbits.serving.save(path, serving)
    like = jax.eval_shape(lambda: qbits.serving.convert(model, rules, params, x))
    restored = qbits.serving.restore(path, like)
    again = jax.jit(served)(restored, x)
    print(f"restored checkpoint gives the same outputs: {bool((again == out).all())}")


if __name__ == "__main__":
    main()
