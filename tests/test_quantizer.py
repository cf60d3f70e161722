import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qbits
from qbits import (
    AbsMax,
    ConstantBound,
    FpNumerics,
    IntNumerics,
    InvalidArgumentError,
    PerChannel,
    Quantizer,
    Tiled,
)
from qbits.numerics import FLOAT_FORMATS
from tests.helpers import FLOAT_DTYPES, bits_equal, fake_quant, float_arrays, quant


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_no_numerics_returns_the_input_bit_for_bit(dtype):
    x = jnp.array([[0.1, -0.0, jnp.nan], [jnp.inf, 3e4, 1e-5]], dtype)
    q = Quantizer(qbits.NoNumerics(), granularity=PerChannel((0,)))
    for store in (False, True):
        y = q.quant(x, store=store).dequant()
        assert y.dtype == dtype
        np.testing.assert_array_equal(
            np.asarray(y).view(np.uint16 if dtype.itemsize == 2 else np.uint32),
            np.asarray(x).view(np.uint16 if dtype.itemsize == 2 else np.uint32),
        )
    g = jax.grad(lambda x: jnp.sum(q.quant(x).dequant() ** 2))(jnp.array([1.5, -2.0]))
    np.testing.assert_array_equal(g, [3.0, -4.0])


def reference(x, numerics_fn, mapped, blocks, scales=None):
    """numpy reference: absmax per block, scale, numerics, dequant.

    With ``scales`` given, uses them (XLA divides by the constant ``mapped``
    as a multiplication by its reciprocal, which can differ by 1 ulp).
    """
    x = np.asarray(x, np.float32)
    out = np.empty_like(x)
    absmax = np.empty(
        [n // b for n, b in zip(x.shape, blocks, strict=True)], np.float32
    )
    for idx in np.ndindex(*absmax.shape):
        sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, blocks, strict=True))
        absmax[idx] = np.abs(x[sl]).max()
        if scales is not None:
            s = np.float32(scales[idx])
            out[sl] = np.asarray(numerics_fn(jnp.asarray(x[sl] / s)), np.float32) * s
    return out, absmax / np.float32(mapped)


@pytest.mark.parametrize(
    "granularity, blocks",
    [
        (qbits.PerTensor(), (6, 8)),
        (PerChannel((0,)), (6, 1)),
        (PerChannel((1,)), (1, 8)),
        (Tiled(axis=1, tile_size=4), (1, 4)),
        (Tiled(axis=0, tile_size=2, shared_axes=(1,)), (2, 8)),
    ],
)
@pytest.mark.parametrize(
    "numerics",
    [
        IntNumerics(bits=8),
        IntNumerics(bits=3, preserve_zero=False),
        FpNumerics("float8_e4m3fn"),
        FpNumerics("float6_e3m2fn"),
    ],
)
def test_matches_a_numpy_reference(granularity, blocks, numerics):
    x = jax.random.normal(jax.random.key(0), (6, 8)) * 3
    qt = Quantizer(numerics, granularity=granularity).quant(x)
    mapped = numerics.abs_val_mapped_to()
    _, scales = reference(x, numerics, mapped, blocks)
    np.testing.assert_array_max_ulp(qt.scale, scales, maxulp=1)
    expected, _ = reference(x, numerics, mapped, blocks, np.asarray(qt.scale))
    np.testing.assert_array_equal(qt.dequant(), expected)


def test_mx_quantizer():
    x = jax.random.normal(jax.random.key(3), (4, 96)) * jnp.logspace(-3, 3, 96)
    for element in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float6_e2m3fn",
        "float4_e2m1fn",
        "int8",
    ):
        q = qbits.mx_quantizer(element, axis=-1)
        qt = q.quant(x, store=True)
        assert qt.scale.shape == (4, 3)
        s = np.asarray(qt.scale)
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)  # powers of 2
        # Rounded up: no element clips.
        blocks = np.abs(np.asarray(x)).reshape(4, 3, 32).max(-1)
        assert np.all(blocks / s <= q.numerics.abs_val_mapped_to())
        rel = np.abs(np.asarray(qt.dequant()) - np.asarray(x)) / np.repeat(s, 32, 1)
        assert rel.max() <= q.numerics.abs_val_mapped_to()  # sanity
    with pytest.raises(InvalidArgumentError, match=r"mx_quantizer: element='fp8'"):
        qbits.mx_quantizer("fp8")


# --- Storage. ----------------------------------------------------------------


@pytest.mark.parametrize(
    "numerics, storage",
    [
        (IntNumerics(bits=8), jnp.int8),
        (IntNumerics(bits=4), jnp.int4),
        (IntNumerics(bits=12), jnp.int16),
        (IntNumerics(bits=8, dtype=jnp.int32), jnp.int32),
        (FpNumerics("float8_e4m3fn"), jnp.float8_e4m3fn),
        (FpNumerics("float8_e5m2fnuz"), jnp.float8_e5m2fnuz),
        (FpNumerics("float4_e2m1fn"), jnp.float4_e2m1fn),
        (FpNumerics("float6_e2m3fn"), jnp.bfloat16),  # XLA cannot hold fp6
    ],
)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_stored_values_equal_the_float_grid(numerics, storage, dtype):
    x = (jax.random.normal(jax.random.key(4), (16, 8)) * 5).astype(dtype)
    q = Quantizer(numerics, granularity=PerChannel((0,)))
    stored = jax.jit(lambda x: q.quant(x, store=True))(x)
    grid = q.quant(x)
    assert stored.qvalue.dtype == storage and stored.is_stored
    assert grid.qvalue.dtype == jnp.float32 and not grid.is_stored
    assert stored.qdtype == numerics.get_dtype()
    np.testing.assert_array_equal(stored.qvalue.astype(jnp.float32), grid.qvalue)
    assert bits_equal(stored.dequant(), grid.dequant())
    assert stored.dequant().dtype == dtype


def test_stored_integers_saturate_and_nan_becomes_zero():
    n = IntNumerics(bits=8, clip=False)
    q = Quantizer(n, ConstantBound(1.0))
    qt = q.quant(jnp.array([0.5, 3.0, -9.0]), store=True)
    np.testing.assert_array_equal(qt.qvalue, [64, 127, -128])
    qt = Quantizer(IntNumerics(bits=8)).quant(jnp.array([1.0, jnp.nan]), store=True)
    np.testing.assert_array_equal(qt.qvalue, [0, 0])
    assert np.isnan(qt.dequant()).all()


def test_store_needs_a_storage_dtype():
    q = Quantizer(IntNumerics(bits=1, preserve_zero=False))
    with pytest.raises(InvalidArgumentError, match=r"store=True .*no storage dtype"):
        q.quant(jnp.ones(3), store=True)


# --- Gradients and transformations. -------------------------------------------


@pytest.mark.parametrize(
    "numerics, mask_bound",
    [
        (IntNumerics(bits=8), None),
        (IntNumerics(bits=4, clip_gradient=True), 7.0 / 7.5),
        (FpNumerics("float8_e4m3fn", clip_gradient=True), 1.0),
        (FpNumerics("float6_e2m3fn"), None),
    ],
)
def test_fake_quant_carries_the_numerics_gradient(numerics, mask_bound):
    q = Quantizer(numerics, ConstantBound(2.0))
    x = jnp.linspace(-3.0, 3.0, 25)
    w = jnp.linspace(0.5, 1.5, 25)
    g = jax.grad(lambda x: jnp.sum(q.quant(x).dequant() * w))(x)
    expected = np.asarray(w)
    if mask_bound is not None:
        expected = expected * (np.abs(np.asarray(x)) <= 2.0 * mask_bound)
    np.testing.assert_allclose(g, expected, rtol=1e-6)


def test_absmax_scale_carries_no_gradient():
    q = Quantizer(IntNumerics(bits=8))
    x = jnp.array([0.3, -1.7, 0.9])
    g = jax.grad(lambda x: jnp.sum(q.quant(x).dequant()))(x)
    np.testing.assert_allclose(g, [1.0, 1.0, 1.0], rtol=1e-6)


def test_differentiating_through_stored_values_raises():
    q = Quantizer(IntNumerics(bits=8))
    with pytest.raises(InvalidArgumentError, match=r"store=True .*carry no gradient"):
        jax.grad(lambda x: jnp.sum(q.quant(x, store=True).dequant()))(jnp.ones(3))
    # Not differentiating through it is fine, also inside a differentiated fn.
    w = q.quant(jnp.ones(3), store=True)
    jax.grad(lambda x: jnp.sum(w.dequant() * x))(jnp.ones(3))


def test_jit_vmap_grad_with_stochastic_rounding():
    q = Quantizer(
        IntNumerics(bits=4, noise_fn=qbits.UniformNoise()), granularity=PerChannel((1,))
    )
    x = jax.random.normal(jax.random.key(0), (5, 3, 16))
    keys = jax.random.split(jax.random.key(1), 5)

    @jax.jit
    def f(x, keys):
        def one(x, key):
            return jax.grad(
                lambda x: jnp.sum(q.quant(x, qbits.Context(key)).dequant())
            )(x)

        return jax.vmap(one)(x, keys)

    np.testing.assert_allclose(f(x, keys), jnp.ones_like(x), rtol=1e-6)
    y = jax.vmap(lambda x, k: q.quant(x, qbits.Context(k)).dequant())(x, keys)
    np.testing.assert_array_equal(y[2], q.quant(x[2], qbits.Context(keys[2])).dequant())
    with pytest.raises(InvalidArgumentError, match=r"context"):
        q.quant(x)


def test_stochastic_rounding_through_the_quantizer_is_unbiased():
    q = Quantizer(
        IntNumerics(bits=2, noise_fn=qbits.UniformNoise()), ConstantBound(1.5)
    )
    x = jnp.array([0.3, -0.8, 0.9, 0.05])  # inside the grid's range [-1, 1]
    keys = jax.random.split(jax.random.key(2), 20000)
    dq = jax.jit(jax.vmap(lambda k: q.quant(x, qbits.Context(k)).dequant()))(keys)
    np.testing.assert_allclose(dq.mean(0), x, atol=6 * 0.5 / np.sqrt(20000))


# --- Properties. --------------------------------------------------------------


@given(
    x=float_arrays(max_log10=2),
    fmt=st.sampled_from(sorted(FLOAT_FORMATS)),
    per_channel=st.booleans(),
    rounding=st.sampled_from(["none", "pow2", "e8m0"]),
)
def test_float_quantizer_output_is_on_the_scaled_grid(x, fmt, per_channel, rounding):
    granularity = PerChannel((0,)) if per_channel else qbits.PerTensor()
    q = Quantizer(FpNumerics(fmt), AbsMax(), granularity, rounding)
    qt = quant(q, x)
    grid = np.asarray(qt.qvalue)
    f = FLOAT_FORMATS[fmt]
    assert np.all(np.isfinite(grid)) and np.all(np.abs(grid) <= f.max)
    np.testing.assert_array_equal(grid.astype(f.dtype).astype(np.float32), grid)
    assert np.isfinite(np.asarray(fake_quant(q, x), np.float32)).all()


@functools.partial(jax.jit, static_argnums=0)
def _grad_fake_quant(q, x):
    return jax.grad(lambda x: jnp.sum(q.quant(x).dequant().astype(jnp.float32)))(x)


@given(x=float_arrays(), bits=st.integers(2, 8))
def test_fake_quant_gradient_is_straight_through_for_absmax(x, bits):
    q = Quantizer(IntNumerics(bits=bits), granularity=PerChannel((0,)))
    g = _grad_fake_quant(q, x)
    assert g.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), 1.0, rtol=1e-2)


# --- Bad input. ----------------------------------------------------------------


@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda: Quantizer("int8"), r"Quantizer: numerics='int8' .*QNumerics"),
        (
            lambda: Quantizer(IntNumerics(), calibration="absmax"),
            r"calibration='absmax'",
        ),
        (lambda: Quantizer(IntNumerics(), granularity=(0,)), r"granularity=\(0,\)"),
        (lambda: Quantizer(IntNumerics(), scale_rounding="up"), r"scale_rounding='up'"),
        (
            lambda: Quantizer(IntNumerics()).quant(jnp.arange(4)),
            r"Quantizer.quant: x.dtype=int32 .*floating-point",
        ),
    ],
)
def test_bad_input(build, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        build()
