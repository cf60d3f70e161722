"""Model code written the ways real model code is written, quantized whole.

Custom layer classes with their own parameters (a Gemma-style ``Einsum``
module, a Griffin-style block-diagonal linear), raw ``jnp.einsum`` and
``@``, attention written with einsums, a tied embedding head, scanned and
rematerialised blocks; linen and nnx. None of these layers is a Flax layer
class that qbits knows: ``qbits.quantize`` reaches their matmuls through
the traced program.

Run as a script, it lists every matmul of the scanned language model with
the ``int8`` preset and trains it beside float32 on generated data (same
seed), printing both losses.

Run: python examples/custom_models.py [--steps 150]
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


class Einsum(nn.Module):
    """A Gemma-style projection: its own parameter, a raw ``jnp.einsum``."""

    shape: tuple[int, ...]

    @nn.compact
    def __call__(self, spec, x):
        w = self.param("w", nn.initializers.normal(0.2), self.shape)
        return jnp.einsum(spec, x, w)


class BlockDiagonalLinear(nn.Module):
    """Griffin-style: one weight per block, batched over the blocks."""

    blocks: int
    width: int

    @nn.compact
    def __call__(self, x):
        w = self.param(
            "w", nn.initializers.normal(0.2), (self.blocks, self.width, self.width)
        )
        x = x.reshape((*x.shape[:-1], self.blocks, self.width))
        y = jnp.einsum("...hi,hij->...hj", x, w)
        return y.reshape((*y.shape[:-2], -1))


class Attention(nn.Module):
    """Attention with its own einsums (query . key and weights . value)."""

    heads: int
    head_dim: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        q = Einsum((d, self.heads, self.head_dim), name="q")("btd,dnh->btnh", x)
        k = Einsum((d, self.heads, self.head_dim), name="k")("btd,dnh->btnh", x)
        v = Einsum((d, self.heads, self.head_dim), name="v")("btd,dnh->btnh", x)
        logits = jnp.einsum("btnh,bsnh->bnts", q, k) / self.head_dim**0.5
        probs = jax.nn.softmax(logits, axis=-1)
        ctx = jnp.einsum("bnts,bsnh->btnh", probs, v)
        return Einsum((self.heads, self.head_dim, d), name="o")("btnh,nhd->btd", ctx)


class RawMlp(nn.Module):
    """Two parameters of one module, multiplied with ``@``."""

    hidden: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        w_in = self.param("w_in", nn.initializers.normal(0.2), (d, self.hidden))
        w_out = self.param("w_out", nn.initializers.normal(0.2), (self.hidden, d))
        return jax.nn.gelu(x @ w_in) @ w_out


class Block(nn.Module):
    width: int = 16

    @nn.compact
    def __call__(self, x, _=None):
        x = x + Attention(heads=2, head_dim=8, name="attn")(nn.LayerNorm()(x))
        x = x + BlockDiagonalLinear(2, self.width // 2, name="mix")(x)
        x = x + RawMlp(32, name="mlp")(nn.LayerNorm()(x))
        return x, None


class LM(nn.Module):
    """Tokens -> logits: embedding, blocks (unrolled or scanned), tied head."""

    vocab: int = 32
    width: int = 16
    depth: int = 2
    scan: bool = False
    remat: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width, name="embed")
        x = embed(tokens)
        block = nn.remat(Block) if self.remat else Block
        if self.scan:
            stack = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.depth,
            )
            x, _ = stack(self.width, name="blocks")(x, None)
        else:
            for i in range(self.depth):
                x, _ = block(self.width, name=f"blocks_{i}")(x)
        return embed.attend(x)


class NnxMlp(nnx.Module):
    """nnx: raw ``@`` with ``nnx.Param``s, and an ``nnx.Linear``."""

    def __init__(self, rngs: nnx.Rngs):
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (16, 32)) * 0.2)
        self.proj = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.proj(jax.nn.relu(x @ self.w1[...]))


def lm_batch(batch=2, length=8, vocab=32, seed=0):
    key = jax.random.key(seed)
    return jax.random.randint(key, (batch, length), 0, vocab)


def _train(model, steps, quantized):
    import optax

    import qbits

    tokens = lm_batch(batch=8, length=16)
    targets = jnp.roll(tokens, -1, axis=1)  # a learnable shift of the input
    params = model.init(jax.random.key(0), tokens)["params"]
    opt = optax.adam(3e-3)
    state = opt.init(params)

    def loss(params, key):
        apply = model.apply
        if quantized:
            apply = qbits.quantize(model.apply, "int8", key)
        logits = apply({"params": params}, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(params, state, key):
        value, grads = jax.value_and_grad(loss)(params, key)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, value

    for i in range(steps):
        params, state, value = step(params, state, jax.random.key(i))
    return float(value)


def main() -> None:
    import qbits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    model = LM(scan=True, remat=True, depth=2)
    tokens = lm_batch()
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    print(qbits.layer_table(model.apply, "int8", variables, tokens))
    f32 = _train(model, args.steps, quantized=False)
    int8 = _train(model, args.steps, quantized=True)
    print(f"final loss after {args.steps} steps: float32 {f32:.4f}, int8 {int8:.4f}")


if __name__ == "__main__":
    main()
