"""ScaledArray, as_scaled_array, asarray, astype."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qbits import InvalidArgumentError
from qbits.scaled import ScaledArray, as_scaled_array, asarray, is_scaled
from qbits.scaled._array import pow2_split

E8M0 = jnp.float8_e8m0fnu


def test_value_is_data_times_scale_and_repr_is_readable():
    x = ScaledArray(np.array([1.0, 2.0], np.float16), np.float32(4))
    np.testing.assert_array_equal(np.asarray(x), np.array([4.0, 8.0], np.float16))
    assert repr(x) == "ScaledArray(data=array([1., 2.], dtype=float16), scale=4.0)"
    assert x.shape == (2,) and x.dtype == np.float16 and x.ndim == 1 and x.size == 2


def test_as_scaled_array_keeps_the_value():
    a = np.array([1.0, 2.0], np.float16)
    sa = as_scaled_array(a, scale=np.float32(0.5))
    np.testing.assert_array_equal(sa.data, [2.0, 4.0])
    np.testing.assert_array_equal(np.asarray(sa), a)
    assert as_scaled_array(a).scale == 1


def test_scalars_split_into_mantissa_and_power_of_two():
    s = as_scaled_array(3.0)
    assert float(s.data) == 1.5 and float(s.scale) == 2.0
    s = as_scaled_array(np.float32(-0.1))
    assert float(s.data) * float(s.scale) == np.float32(-0.1)
    assert 1 <= abs(float(s.data)) < 2


@given(st.floats(-(2.0**100), 2.0**100, width=32, allow_nan=False))
def test_pow2_split_is_exact(v):
    mantissa, power = pow2_split(v)
    assert mantissa * power == np.float32(v)
    assert power > 0 and np.log2(power) == np.round(np.log2(power))
    assert v == 0 or 1 <= abs(mantissa) < 2


def test_large_and_small_values_survive_float16_through_the_scale():
    big = np.array([2.0, 4.0], np.float32) * 256**2
    assert not np.isfinite(jnp.asarray(big).astype(jnp.float16)).any()
    s = as_scaled_array(big, scale=np.float32(256**2 * 2)).astype(jnp.float16)
    np.testing.assert_array_equal(s.to_array(jnp.float32), big)
    small = np.array([2.0, 4.0], np.float32) * (256 * 32) ** -2
    s = as_scaled_array(small, scale=np.float32(256**-2)).astype(jnp.float16)
    np.testing.assert_array_equal(s.to_array(jnp.float32), small)


@pytest.mark.parametrize(
    "dtype",
    [
        jnp.float16,
        jnp.bfloat16,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
        jnp.float8_e4m3fnuz,
    ],
)
def test_astype_to_low_precision_formats(dtype):
    a = jnp.array([400.0, 448.0, 512.0])
    s = as_scaled_array(a, scale=np.float32(128)).astype(dtype)
    assert s.data.dtype == dtype and float(s.scale) == 128
    want = [384.0, 448.0, 512.0] if jnp.dtype(dtype).itemsize == 1 else a
    np.testing.assert_array_equal(s.to_array(jnp.float32), want)


def test_e8m0_scales():
    s = as_scaled_array(jnp.ones(3), scale=4.0, scale_dtype=E8M0)
    assert s.scale.dtype == E8M0
    np.testing.assert_array_equal(s.to_array(), [1.0, 1.0, 1.0])
    with pytest.raises(InvalidArgumentError, match="scale_dtype"):
        as_scaled_array(jnp.ones(3), scale=4.0, scale_dtype=jnp.float16)


def test_trees_convert_float_leaves_only():
    tree = {
        "w": jnp.ones((2, 2)),
        "step": jnp.array(3),
        "s": as_scaled_array(jnp.ones(2)),
    }
    out = as_scaled_array(tree, scale=2.0)
    assert is_scaled(out["w"]) and float(out["w"].scale) == 2
    assert not is_scaled(out["step"]) and out["s"] is tree["s"]
    back = asarray(out)
    np.testing.assert_array_equal(back["w"], tree["w"])
    assert back["step"] is tree["step"]
    assert asarray(out, jnp.float16)["w"].dtype == jnp.float16


def test_is_a_pytree_through_jit_and_vmap():
    s = as_scaled_array(jnp.arange(6.0).reshape(2, 3), scale=2.0)
    out = jax.jit(lambda t: ScaledArray(t.data * 2, t.scale))(s)
    assert is_scaled(out)
    np.testing.assert_array_equal(asarray(out), np.arange(6.0).reshape(2, 3) * 2)
    rows = jax.vmap(lambda t: t.data.sum(), in_axes=(ScaledArray(0, None),))(s)
    np.testing.assert_array_equal(rows, [1.5, 6.0])


def test_bad_input_is_a_clear_error():
    with pytest.raises(InvalidArgumentError, match="data"):
        ScaledArray(np.arange(3), np.float32(1))
    with pytest.raises(InvalidArgumentError, match="scalar"):
        ScaledArray(np.ones(3, np.float32), np.ones(3, np.float32))
    with pytest.raises(InvalidArgumentError, match="float32 or float8_e8m0fnu"):
        ScaledArray(np.ones(3, np.float32), np.float16(1))
    with pytest.raises(InvalidArgumentError, match="float dtype"):
        as_scaled_array(jnp.ones(3)).astype(jnp.int8)
    assert np.dtype(ml_dtypes.float8_e8m0fnu) == np.dtype(E8M0)
