"""Blocks stacked with nnx.vmap and run with nnx.scan, quantized."""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits

LAYERS, WIDTH = 4, 16
WRT = nnx.DiffState(0, (nnx.Param, qbits.nnx.ScaleState))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class Scanned(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def step(block, x):
            return block(x)

        return step(self.blocks, x)


def _x():
    return jax.random.normal(jax.random.key(1), (8, WIDTH))


@pytest.mark.parametrize("preset", ["int8", "int8_fwd", "fp8", "fp8_delayed"])
def test_scanned_blocks_run_and_differentiate(preset):
    x = _x()
    model = qbits.nnx.quantize(Scanned(nnx.Rngs(0)), preset, x, rngs=nnx.Rngs(quant=0))
    grads = nnx.jit(nnx.grad(lambda m: (m(x) ** 2).sum(), argnums=WRT))(model)
    kernel_grad = grads["blocks"]["lin"]["kernel"][...]
    assert kernel_grad.shape == (LAYERS, WIDTH, WIDTH)
    assert bool(jnp.all(jnp.isfinite(kernel_grad)))
    if preset == "fp8_delayed":  # state stacked: one history per layer
        hist = grads["qbits"]["state"]["blocks/lin"]["lhs_amax_history"][...]
        assert hist.shape == (LAYERS, 1024)
        first = hist[:, 0]
        assert first[0] == jnp.max(jnp.abs(x))
        assert len(set(np.asarray(first).tolist())) == LAYERS  # each its own


def test_stochastic_rounding_keys_differ_per_layer_and_per_step():
    model = qbits.nnx.quantize(Scanned(nnx.Rngs(0)), "int8", rngs=nnx.Rngs(quant=0))
    x = _x()
    step = nnx.jit(nnx.grad(lambda m: (m(x) ** 2).sum()))
    g1 = step(model)["blocks"]["lin"]["kernel"][...]
    g2 = step(model)["blocks"]["lin"]["kernel"][...]
    assert not np.array_equal(g1, g2)  # new keys every step
    assert int(model.qbits.rngs.count[...]) == 2  # one key per call
    # One key per call, a stream of its own per scanned layer: with equal
    # layers (and equal inputs), the noise still differs between layers.
    same = nnx.clone(model)
    same.blocks.lin.kernel[...] = jnp.broadcast_to(
        jnp.eye(WIDTH), (LAYERS, WIDTH, WIDTH)
    )
    same.blocks.lin.bias[...] = jnp.zeros((LAYERS, WIDTH))
    g = nnx.jit(nnx.grad(lambda m: m(jnp.zeros_like(x) + 0.3).sum()))(same)
    per_layer = g["blocks"]["lin"]["kernel"][...]
    assert not np.array_equal(per_layer[0], per_layer[-1])


def test_scanned_equals_unrolled_for_a_deterministic_config():
    float_model = Scanned(nnx.Rngs(0))
    x = _x()
    scanned = qbits.nnx.quantize(float_model, "int8_fwd")
    got = nnx.jit(lambda m: m(x))(scanned)
    dg = qbits.dot_general(qbits.presets.get("int8_fwd"))

    @jax.jit  # compiled, as the scan is: the same fusions, the same roundings
    def unrolled(kernels, biases):
        h = x
        for i in range(LAYERS):
            h = jnp.tanh(dg(h, kernels[i], (((1,), (0,)), ((), ()))) + biases[i])
        return h

    lin = float_model.blocks.lin
    np.testing.assert_array_equal(got, unrolled(lin.kernel[...], lin.bias[...]))
