"""Small models written the ways real model code is written.

Custom layer classes with their own parameters, raw ``jnp.einsum`` and
``@``, a tied embedding head, a block-diagonal linear, attention written
with einsums, scanned and rematerialised blocks; linen and nnx.
"""

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
