"""The ``fp8_blockwise`` preset (DeepSeek-V3) against a float64 reference."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qbits

DN = (((1,), (0,)), ((), ()))
E4M3 = ml_dtypes.float8_e4m3fn


def _blocks(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """``a`` quantized to E4M3 per ``rows x cols`` block, as float64."""
    out = np.empty(a.shape, np.float64)
    for i in range(0, a.shape[0], rows):
        for j in range(0, a.shape[1], cols):
            block = a[i : i + rows, j : j + cols].astype(np.float32)
            scale = np.float32(np.abs(block).max()) / np.float32(448.0)
            q = np.clip(block * (np.float32(1) / scale), -448, 448).astype(E4M3)
            out[i : i + rows, j : j + cols] = q.astype(np.float64) * scale
    return out


def _operands(m=256, k=384, n=256, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (m, k)) * jnp.exp(jax.random.normal(ks[1], (m, 1)))
    w = jax.random.normal(ks[2], (k, n)) / np.sqrt(k)
    return x, w


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_forward_and_gradients_equal_float64_blockwise_reference(mode):
    config = qbits.presets.get("fp8_blockwise")
    if mode == "fake":
        config = jax.tree.map(lambda c: c, config)  # a copy
        config = config.replace(
            fwd=config.fwd.replace(mode="fake"),
            dlhs=config.dlhs.replace(mode="fake"),
            drhs=config.drhs.replace(mode="fake"),
        )
    dg = qbits.dot_general(config)
    x, w = _operands()
    r = jax.random.normal(jax.random.key(9), (x.shape[0], w.shape[1]))

    def loss(x, w):
        return jnp.sum(dg(x, w, DN) * r)

    out = np.asarray(jax.jit(lambda x, w: dg(x, w, DN))(x, w), np.float64)
    dx, dw = (np.asarray(g, np.float64) for g in jax.jit(jax.grad(loss, (0, 1)))(x, w))

    xn, wn, rn = (np.asarray(v) for v in (x, w, r))
    want = _blocks(xn, 1, 128) @ _blocks(wn, 128, 128)
    # dlhs: g (1 x 128 tiles along the contracted outputs) . w^T (w's blocks).
    want_dx = _blocks(rn, 1, 128) @ _blocks(wn, 128, 128).T
    # drhs: x^T . g, both in 128 x 1 tiles along the contracted tokens.
    want_dw = _blocks(xn, 128, 1).T @ _blocks(rn, 128, 1)

    for got, ref in ((out, want), (dx, want_dx), (dw, want_dw)):
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 2e-6, err


def test_scales_are_tiles_and_blocks():
    config = qbits.presets.get("fp8_blockwise")
    x, w = _operands()
    # Shapes and dtypes: traced, not run.
    xq = jax.eval_shape(
        lambda x: config.fwd.lhs.quant(x, store=True, contracting_axes=(1,)), x
    )
    wq = jax.eval_shape(
        lambda w: config.fwd.rhs.quant(w, store=True, contracting_axes=(0,)), w
    )
    assert xq.scale.shape == (256, 3)  # one per row per 128 columns
    assert wq.scale.shape == (3, 2)  # one per 128 x 128 block
    assert xq.qvalue.dtype == jnp.float8_e4m3fn


def test_fine_grained_scales_confine_an_outlier():
    # An activation 10^6 times the others pushes them, under one scale per
    # tensor, below E4M3's smallest subnormal; with 1 x 128 tiles only its
    # own row's outputs change.
    x, w = _operands()
    spiked = x.at[5, 7].set(1e6)
    others = np.arange(x.shape[0]) != 5

    def run(preset, x):
        return np.asarray(qbits.dot_general(qbits.presets.get(preset))(x, w, DN))

    np.testing.assert_array_equal(
        run("fp8_blockwise", spiked)[others], run("fp8_blockwise", x)[others]
    )
    exact = (np.asarray(x, np.float64) @ np.asarray(w, np.float64))[others]
    per_tensor = run("fp8", spiked)[others]
    assert np.linalg.norm(per_tensor - exact) / np.linalg.norm(exact) > 0.2


def test_layer_dimensions_must_be_multiples_of_128():
    dg = qbits.dot_general(qbits.presets.get("fp8_blockwise"))
    with pytest.raises(qbits.InvalidArgumentError, match="tile_size"):
        dg(jnp.ones((8, 100)), jnp.ones((100, 128)), DN)
