"""dynamic_rescale_*, cast_ml_dtype (values and gradients), wasted_bits, MLP example."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qbits import InvalidArgumentError
from qbits._experiments import train_scalify_mlp
from qbits.scaled import (
    as_scaled_array,
    asarray,
    cast_ml_dtype,
    dynamic_rescale_l2,
    dynamic_rescale_max,
    is_scaled,
    scalify,
    wasted_bits,
)

RNG = np.random.default_rng(2)
X = (RNG.normal(size=(64,)) * 64).astype(np.float32)


@pytest.mark.parametrize("rescale", [dynamic_rescale_max, dynamic_rescale_l2])
def test_dynamic_rescale_is_identity_on_plain_arrays(rescale):
    np.testing.assert_array_equal(jax.jit(rescale)(X), X)
    np.testing.assert_array_equal(scalify(rescale)(X), X)


def test_dynamic_rescale_moves_the_magnitude_into_the_scale():
    sx = as_scaled_array(X, np.float32(4))
    by_max = scalify(dynamic_rescale_max)(sx)
    by_l2 = jax.jit(scalify(dynamic_rescale_l2))(sx)
    for out in (by_max, by_l2):
        np.testing.assert_array_equal(asarray(out), X)  # power-of-two factors: exact
    assert 2**-0.5 <= np.max(np.abs(by_max.data)) <= 2**0.5
    rms = np.sqrt(np.mean(np.square(np.asarray(by_l2.data))))
    assert 2**-0.5 <= rms <= 2**0.5
    # Outside scalify a ScaledArray is rescaled directly; trees work too.
    tree = dynamic_rescale_l2({"a": sx, "n": jnp.array(3)})
    np.testing.assert_array_equal(tree["a"].data, by_l2.data)
    assert int(tree["n"]) == 3


def test_dynamic_rescale_keeps_all_zero_and_scale():
    z = as_scaled_array(np.zeros(4, np.float32), np.float32(8))
    out = scalify(dynamic_rescale_max)(z)
    assert float(out.scale) == 8 and not np.any(out.data)


@pytest.mark.parametrize(
    "rescale, stat",
    [
        (dynamic_rescale_max, lambda d: np.max(np.abs(d))),
        (dynamic_rescale_l2, lambda d: np.sqrt(np.mean(np.square(d)))),
    ],
)
def test_grad_true_rescales_the_gradient_only(rescale, stat):
    c = jnp.asarray(RNG.normal(size=X.shape) * 1e-3, jnp.float32)

    def f(x, c):
        return jnp.sum(rescale(x, grad=True) * c)

    sx, sc = as_scaled_array(X, np.float32(4)), as_scaled_array(c)
    value, grad = jax.jit(scalify(jax.value_and_grad(f)))(sx, sc)
    np.testing.assert_allclose(asarray(value), np.sum(X * np.asarray(c)), rtol=1e-4)
    np.testing.assert_allclose(asarray(grad), c, rtol=1e-6)
    assert 2**-0.5 <= stat(np.asarray(grad.data)) <= 2**0.5
    # Without the rescale the gradient keeps c's magnitude in its data.
    plain = scalify(jax.grad(lambda x, c: jnp.sum(x * c)))(sx, sc)
    assert stat(np.asarray(plain.data)) < 0.01


def test_cast_ml_dtype_saturates_and_rounds_like_ml_dtypes():
    x = jnp.array([400.0, 448.0, 500.0, -1000.0, 0.3, 1e-4], jnp.float32)
    got = jax.jit(lambda v: cast_ml_dtype(v, jnp.float8_e4m3fn))(x)
    want = (
        np.clip(np.asarray(x), -448, 448)
        .astype(ml_dtypes.float8_e4m3fn)
        .astype(np.float32)
    )
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.float32
    with pytest.raises(InvalidArgumentError, match="dtype"):
        cast_ml_dtype(x, jnp.float32)


def test_cast_ml_dtype_on_scaled_data_keeps_the_range():
    sx = as_scaled_array(jnp.array([400.0, 448.0, 512.0]), np.float32(128))
    out = scalify(lambda v: cast_ml_dtype(v, jnp.float8_e4m3fn))(sx)
    np.testing.assert_array_equal(out.data, [3.0, 3.5, 4.0])
    np.testing.assert_array_equal(asarray(out), [384.0, 448.0, 512.0])


def test_cast_ml_dtype_grad_true_rounds_the_gradient_to_e5m2():
    c = jnp.asarray(RNG.normal(size=(16,)), jnp.float32)
    x = jnp.asarray(RNG.normal(size=(16,)), jnp.float32)

    def f(v, c):
        return jnp.sum(cast_ml_dtype(v, jnp.float8_e5m2, grad=True) * c)

    grad = jax.grad(f)(x, c)
    np.testing.assert_array_equal(
        grad, np.asarray(c).astype(ml_dtypes.float8_e5m2).astype(np.float32)
    )
    # Under scalify the gradient's data (not its value) is rounded.
    sgrad = scalify(jax.grad(f))(
        as_scaled_array(x), as_scaled_array(c, np.float32(2**-20))
    )
    assert is_scaled(sgrad)
    np.testing.assert_array_equal(
        sgrad.data,
        np.asarray(sgrad.data).astype(ml_dtypes.float8_e5m2).astype(np.float32),
    )


def test_grad_is_a_bool():
    def cast(x, grad):
        return cast_ml_dtype(x, "float8_e5m2", grad=grad)

    for op in (dynamic_rescale_max, dynamic_rescale_l2, cast):
        with pytest.raises(InvalidArgumentError, match="grad"):
            op(X, grad=1)


def test_wasted_bits():
    assert float(wasted_bits(np.array([1, 2, -16], np.int8))) == 3
    assert float(wasted_bits(jnp.array([448.0, 1.0]).astype(jnp.float8_e4m3fn))) == 0
    assert float(wasted_bits(jnp.zeros(3, jnp.float16))) == 16
    np.testing.assert_allclose(
        float(wasted_bits(jnp.array([1.0], jnp.float16))), np.log2(65504.0), rtol=1e-6
    )
    sx = as_scaled_array(jnp.array([0.25, -0.5]), np.float32(1024))
    np.testing.assert_allclose(
        float(wasted_bits(sx)), np.log2(float(np.finfo(np.float32).max)) + 11, rtol=1e-6
    )
    with pytest.raises(InvalidArgumentError, match="dtype"):
        wasted_bits(jnp.array([True]))


def test_mlp_trained_in_fp8_tracks_float32():
    """docs/guides/scalify.md's MLP, shortened (full run: examples/scalify_mlp.py)."""
    kwargs = dict(steps=60, hidden=64, n_train=2048, n_eval=512)
    base = train_scalify_mlp("float32", **kwargs)
    assert base.losses[-1] < 0.8 * base.losses[0]
    for precision in ("fp8",):
        r = train_scalify_mlp(precision, **kwargs)
        assert np.all(np.isfinite(r.losses))
        assert abs(r.final_loss / base.final_loss - 1) < 0.02, precision
        assert abs(r.eval_loss / base.eval_loss - 1) < 0.02, precision
    with pytest.raises(ValueError, match="precision"):
        train_scalify_mlp("int8")
