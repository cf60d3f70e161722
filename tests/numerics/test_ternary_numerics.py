"""TernaryNumerics and AbsMean: BitNet b1.58's ternary weights."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qbits
from qbits import AbsMean
from qbits.numerics import TernaryNumerics
from tests.helpers import FLOAT_DTYPES, bits_equal

MM = (((1,), (0,)), ((), ()))
# The same grid written with IntNumerics: {-1, 0, 1}, the bound onto 1.
SAME_GRID = qbits.IntNumerics(bits=2, preserve_max_val=True)


def _bitnet(w):
    """BitNet b1.58's absmean quantization, in numpy (arXiv 2402.17764)."""
    gamma = np.mean(np.abs(w))
    return np.clip(np.round(w / gamma), -1, 1) * gamma


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_grid_is_minus_one_zero_one_as_the_two_bit_int_grid(dtype):
    edges = [-np.inf, -1.5, -1.0, -0.5, -0.0, 0.0, 0.49, 0.5, 0.51, 1.5, 7.0, np.inf]
    x = jnp.concatenate(
        [jnp.array([*edges, np.nan]), 2 * jax.random.normal(jax.random.key(0), (999,))]
    ).astype(dtype)
    t = TernaryNumerics()
    y = t(x)
    assert y.dtype == dtype
    assert bits_equal(y, SAME_GRID(x))
    values = np.asarray(y.astype(jnp.float32))
    assert np.isnan(values[len(edges)])
    assert set(np.unique(values[~np.isnan(values)])) == {-1.0, 0.0, 1.0}
    np.testing.assert_array_equal(
        y[: len(edges)].astype(np.float32), [-1, -1, -1, -0, -0, 0, 0, 0, 1, 1, 1, 1]
    )


def test_what_the_grid_says_of_itself():
    t = TernaryNumerics()
    assert t.abs_val_mapped_to() == 1.0 and t.get_dtype() == np.dtype(ml_dtypes.int4)
    assert t.gradient_range() == SAME_GRID.gradient_range() == (-1.0, 1.0)
    assert t.saturation_edge() == SAME_GRID.saturation_edge() == 1.5
    assert t.code_bound() == SAME_GRID.code_bound() == 1
    assert t.smallest_nonzero() == SAME_GRID.smallest_nonzero() == 1.0
    assert t.clips and t.keeps_zero and t.has_zero
    assert not (t.asymmetric or t.is_identity) and t.codebook is None
    with pytest.raises(qbits.InvalidArgumentError, match="clip_gradient"):
        TernaryNumerics(clip_gradient=1)


def test_gradient_is_straight_through_masked_with_clip_gradient():
    x = jnp.array([-2.0, -1.0, -0.3, 0.7, 1.0, 1.2])
    g = jax.grad(lambda x: jnp.sum(TernaryNumerics()(x) * jnp.arange(6.0)))(x)
    np.testing.assert_array_equal(g, np.arange(6.0))
    clipped = TernaryNumerics(clip_gradient=True)
    g = jax.grad(lambda x: jnp.sum(clipped(x)))(x)
    np.testing.assert_array_equal(g, [0, 1, 1, 1, 1, 0])


def test_absmean_is_the_mean_magnitude_and_stays_finite():
    x = jnp.array([[1.0, -3.0, 2.0], [0.5, -0.5, 0.0]])
    want = np.array([[2.0], [1 / 3]], np.float32)
    np.testing.assert_array_equal(AbsMean()(x, axes=(1,)), want)
    np.testing.assert_allclose(AbsMean()(x, axes=(0, 1)), [[7 / 6]], rtol=1e-7)
    big = jnp.full((2, 5), 3e38).at[1, 2].set(-3e38)  # the sum overflows float32
    np.testing.assert_allclose(AbsMean()(big, axes=(1,)), [[3e38], [3e38]], rtol=1e-6)
    with_nan = x.at[0, 1].set(jnp.nan)
    b = AbsMean()(with_nan, axes=(1,))
    assert bool(jnp.isnan(b[0, 0])) and float(b[1, 0]) == pytest.approx(1 / 3)


def test_quantizer_is_bitnets_absmean_quantization():
    w = jax.random.normal(jax.random.key(1), (64, 48)) * 0.02
    q = qbits.Quantizer(TernaryNumerics(), AbsMean(), qbits.PerTensor())
    qt = q.quant(w)
    np.testing.assert_allclose(qt.scale.reshape(()), np.mean(np.abs(w)), rtol=1e-6)
    np.testing.assert_allclose(qt.dequant(), _bitnet(np.asarray(w)), rtol=1e-6)
    stored = q.quant(w, store=True)
    assert stored.qvalue.dtype == ml_dtypes.int4
    codes = np.asarray(stored.qvalue).astype(np.int8)
    assert set(np.unique(codes)) == {-1, 0, 1}
    assert bits_equal(stored.pack().dequant(), qt.dequant())
    zeros = q.quant(jnp.zeros((4, 4)), store=True)
    assert bits_equal(zeros.dequant(), jnp.zeros((4, 4)))


def test_preset_matmul_and_gradient():
    config = qbits.presets.get("w1_58a8")
    assert config == qbits.load_config(
        qbits.config._to_dict(config), qbits.DotGeneralConfig
    )
    rhs = config.fwd.rhs
    assert rhs.numerics == TernaryNumerics() and rhs.calibration == AbsMean()
    x = jax.random.normal(jax.random.key(2), (8, 64))
    w = jax.random.normal(jax.random.key(3), (64, 16))
    dg = qbits.dot_general(config)
    # Forward: int8 activations per row (absmax onto 127.5) times ternary
    # weights, exactly as the fake quantization of each operand.
    lhs = qbits.Quantizer(qbits.IntNumerics(bits=8), qbits.AbsMax(), qbits.PerChannel())
    xq = lhs.quant(x, contracting_axes=(1,)).dequant()
    want = np.asarray(xq, np.float64) @ _bitnet(np.asarray(w, np.float64))
    np.testing.assert_allclose(dg(x, w, MM), want, rtol=2e-5, atol=2e-5)
    # Backward: straight-through, float matmuls with the float operands.
    g = jax.random.normal(jax.random.key(4), (8, 16))
    dx, dw = jax.grad(lambda x, w: jnp.sum(dg(x, w, MM) * g), (0, 1))(x, w)
    np.testing.assert_allclose(dx, g @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, x.T @ g, rtol=1e-5, atol=1e-5)


def test_yaml_kinds():
    cfg = qbits.load_config(
        "fwd:\n  rhs:\n    numerics: ternary\n    calibration: absmean\n", None
    )
    assert cfg.fwd.rhs == qbits.Quantizer(TernaryNumerics(), AbsMean())
