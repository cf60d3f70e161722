import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qbits
from qbits import FpNumerics, InvalidArgumentError
from qbits._formats import FLOAT_FORMATS, emulated_round_to_format
from qbits.numerics import Fp8Numerics
from tests.helpers import FLOAT_DTYPES, bits_equal

FORMATS = sorted(FLOAT_FORMATS)
EIGHT_BIT = [n for n in FORMATS if FLOAT_FORMATS[n].bits == 8]


def all_values(fmt):
    """Every finite value of a format, sorted, from its bit patterns."""
    f = FLOAT_FORMATS[fmt]
    values = np.arange(2**f.bits, dtype=np.uint8).view(f.dtype).astype(np.float32)
    return np.unique(values[np.isfinite(values)])


def ml_dtypes_cast(x, fmt):
    """The reference: numpy's cast through ml_dtypes, in float32."""
    return np.asarray(x, np.float32).astype(FLOAT_FORMATS[fmt].dtype).astype(np.float32)


@functools.partial(jax.jit, static_argnums=0)
def apply(numerics, x, context=None):
    return numerics(x, context)


@st.composite
def values_around(draw, fmt):
    """float32 values spanning a format: subnormals, normals, beyond max."""
    f = FLOAT_FORMATS[fmt]
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, 300))
    rng = np.random.default_rng(seed)
    log2 = rng.uniform(f.min_exp - f.nmant - 4, np.log2(f.max) + 2, n)
    x = rng.choice([-1.0, 1.0], n) * np.exp2(log2)
    return x.astype(np.float32)


# XLA's default CPU emitters: the suite's faster ones cast to the fnuz
# float8 formats and float4 otherwise (conftest.py).
@pytest.mark.parametrize(
    "fmt",
    [
        pytest.param(f, marks=pytest.mark.optimized) if "fnuz" in f else f
        for f in FORMATS
    ],
)
@settings(max_examples=10)  # per format
@given(data=st.data())
def test_outputs_are_representable_finite_and_match_the_cast(fmt, data):
    # The drawn values repeated to one length: one program per format and
    # dtype, not one per example (the numerics are elementwise).
    x = np.resize(data.draw(values_around(fmt)), 300)
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    x = jnp.asarray(x).astype(dtype)
    f = FLOAT_FORMATS[fmt]
    y = apply(FpNumerics(fmt), x)
    assert y.dtype == dtype
    y32 = np.asarray(y, np.float32)
    # Every output survives a round trip through the format.
    assert bits_equal(ml_dtypes_cast(y32, fmt), y32)
    # Finite input never gives NaN (or inf): out-of-range values saturate.
    assert np.all(np.isfinite(y32))
    x32 = np.asarray(x, np.float32)
    inside = np.abs(x32) <= f.max
    # In range, the result is exactly the format's own cast.
    assert bits_equal(y32[inside], ml_dtypes_cast(x32[inside], fmt))
    np.testing.assert_array_equal(y32[~inside], np.sign(x32[~inside]) * f.max)


@pytest.mark.parametrize("fmt", FORMATS)
def test_emulation_is_bit_exact_on_every_format(fmt):
    # The float32 emulation (used for fp6, which XLA:CPU cannot cast) agrees
    # with ml_dtypes on every format: ties, subnormals, overflow, signed zero.
    f = FLOAT_FORMATS[fmt]
    rng = np.random.default_rng(0)
    grid = all_values(fmt)
    ties = (grid[1:].astype(np.float64) + grid[:-1]) / 2
    x = np.concatenate(
        [
            grid,
            ties,
            np.nextafter(ties.astype(np.float32), np.inf),
            np.nextafter(ties.astype(np.float32), -np.inf),
            rng.standard_normal(50000) * np.exp(rng.uniform(-25, 12, 50000)),
            [0.0, -0.0, f.max * 1.1, -f.max * 3, np.inf, -np.inf, np.nan, 1e-30],
        ]
    ).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: emulated_round_to_format(v, f))(x))
    ref = ml_dtypes_cast(x, fmt)
    # NaN stays NaN in the emulation even where the format has no NaN (fp6,
    # fp4: ml_dtypes gives -0); every other value matches bit for bit.
    assert np.isnan(got[np.isnan(x)]).all()
    number = ~np.isnan(ref) & ~np.isnan(x)
    np.testing.assert_array_equal(
        got[number].view(np.uint32), ref[number].view(np.uint32)
    )
    assert np.isnan(got[~number]).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_stays_nan_and_overflow_follows_the_format_without_clip(fmt):
    f = FLOAT_FORMATS[fmt]
    x = jnp.array([jnp.nan, 10 * f.max, -10 * f.max, 1.0], jnp.float32)
    y = np.asarray(apply(FpNumerics(fmt, clip=False), x))
    assert np.isnan(y[0])
    expected = {"inf": np.inf, "nan": np.nan, "saturate": f.max}[f.overflow]
    assert bits_equal(y[1:3], [expected, -expected])
    y = np.asarray(apply(FpNumerics(fmt), x))
    assert np.isnan(y[0])
    np.testing.assert_array_equal(y[1:], [f.max, -f.max, 1.0])


def test_known_values():
    e4m3 = FpNumerics("float8_e4m3fn")
    x = jnp.array([448.0, 464.0, 465.0, 1e6, 0.001953125, 0.0009765625, 0.0029296875])
    # 464 is the tie between 448 and (NaN) 480: to even, 448; beyond it
    # saturates; the smallest subnormal 2**-9 stays; its half ties to 0; 1.5
    # of it rounds to 2 of it.
    np.testing.assert_array_equal(
        e4m3(x), [448.0, 448.0, 448.0, 448.0, 2.0**-9, 0.0, 2.0**-8]
    )
    assert float(FpNumerics("float8_e5m2")(jnp.float32(60000.0))) == 57344.0
    fp4 = FpNumerics("float4_e2m1fn")
    np.testing.assert_array_equal(
        fp4(jnp.array([0.25, 0.26, 2.5, 3.5, 5.0, 7.0])), [0.0, 0.5, 2.0, 4.0, 4.0, 6.0]
    )
    fp6 = FpNumerics("float6_e2m3fn")
    np.testing.assert_array_equal(
        fp6(jnp.array([0.0625, 0.07, 7.3, 7.9, -1.0625])), [0.0, 0.125, 7.5, 7.5, -1.0]
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_mapped_to_and_dtype(fmt):
    n = FpNumerics(fmt)
    assert n.abs_val_mapped_to() == float(ml_dtypes.finfo(FLOAT_FORMATS[fmt].dtype).max)
    assert n.get_dtype() == FLOAT_FORMATS[fmt].dtype
    assert n == FpNumerics(getattr(jnp, fmt))  # name or dtype


def test_fp8_numerics_defaults_to_e4m3_and_takes_only_8_bit_formats():
    assert Fp8Numerics().get_dtype() == jnp.float8_e4m3fn
    for fmt in EIGHT_BIT:
        Fp8Numerics(fmt)
    for fmt in ("float6_e2m3fn", "float4_e2m1fn"):
        with pytest.raises(InvalidArgumentError, match=rf"Fp8Numerics: dtype='{fmt}'"):
            Fp8Numerics(fmt)


# --- Stochastic rounding. ------------------------------------------------------


@pytest.mark.parametrize(
    "fmt",
    [
        "float8_e4m3fn",
        "float8_e5m2",
        "float4_e2m1fn",
        "float6_e3m2fn",
        "float8_e4m3fnuz",
    ],
)
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(fmt):
    f = FLOAT_FORMATS[fmt]
    n = FpNumerics(fmt, noise_fn=qbits.numerics.UniformNoise())
    tiny = 2.0**f.min_exp
    x = np.array(
        [
            0.3 * tiny,  # subnormal
            1.01 * tiny,  # just above the normal range start
            2.0 * tiny * (1 + 2.0**-f.nmant / 3),  # just above a binade edge
            0.7 * f.max,
            -0.9 * f.max,
            -3.3 * tiny,
            f.max,  # the top stays put
        ],
        np.float32,
    )
    draws = 20000
    keys = jax.random.split(jax.random.key(0), draws)
    samples = np.asarray(
        jax.jit(jax.vmap(lambda k: n(jnp.asarray(x), qbits.numerics.Context(k))))(keys)
    )
    grid = all_values(fmt)
    for i, xi in enumerate(x):
        lo = grid[grid <= xi].max()
        hi = grid[grid >= xi].min()
        assert set(np.unique(samples[:, i])) <= {lo, hi}, (xi, lo, hi)
        # Each draw is lo or hi, so its std is at most (hi - lo) / 2.
        tol = 6 * (hi - lo) / 2 / np.sqrt(draws) + 1e-12
        assert abs(samples[:, i].mean() - xi) <= tol, (xi, samples[:, i].mean())


def test_stochastic_rounding_same_key_same_bits_and_needs_a_key():
    n = Fp8Numerics(noise_fn=qbits.numerics.UniformNoise())
    x = jax.random.normal(jax.random.key(1), (128,)) * 10
    a = apply(n, x, qbits.numerics.Context(jax.random.key(5)))
    np.testing.assert_array_equal(a, n(x, qbits.numerics.Context(jax.random.key(5))))
    assert not np.array_equal(a, n(x, qbits.numerics.Context(jax.random.key(6))))
    with pytest.raises(InvalidArgumentError, match=r"Fp8Numerics: context=None"):
        n(x)


# --- Gradients. ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float6_e2m3fn", "float4_e2m1fn"])
def test_gradients(fmt):
    f = FLOAT_FORMATS[fmt]
    x = jnp.array([-2 * f.max, -f.max, -0.3, 0.0, 1.7, f.max, 1.01 * f.max])
    w = jnp.arange(1.0, 8.0)
    ste = jax.grad(lambda x: jnp.sum(FpNumerics(fmt)(x) * w))(x)
    np.testing.assert_array_equal(ste, w)
    masked = jax.grad(lambda x: jnp.sum(FpNumerics(fmt, clip_gradient=True)(x) * w))(x)
    np.testing.assert_array_equal(masked, w * jnp.array([0.0, 1, 1, 1, 1, 1, 0]))


def test_x64_keeps_the_input_dtype():
    # The clip bound was a python float: a float64 array in lax.clamp under x64.
    n = FpNumerics("float6_e3m2fn", noise_fn=qbits.numerics.UniformNoise())  # emulated
    context = qbits.numerics.Context(jax.random.key(0))
    for dtype in FLOAT_DTYPES:
        x = jnp.array([6e4, -0.3, 1.06, -0.0], dtype)
        expected = apply(n, x, context)
        with jax.enable_x64(True):
            y = jax.jit(n)(x, context)
        assert y.dtype == dtype
        np.testing.assert_array_equal(y, expected)


def test_jit_vmap_grad_compose():
    n = Fp8Numerics("float8_e5m2", clip_gradient=True)
    x = jnp.linspace(-70000.0, 70000.0, 12).reshape(3, 4)
    f = jax.jit(jax.vmap(jax.grad(lambda r: jnp.sum(n(r) ** 2))))
    expected = 2 * n(x) * (jnp.abs(x) <= 57344.0).astype(x.dtype)
    np.testing.assert_array_equal(f(x), expected)


# --- Bad input. ----------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt", ["e4m3fn", "float8_e8m0fnu", jnp.float8_e8m0fnu, jnp.float32, "int8", 3]
)
def test_unknown_formats_are_rejected_with_the_allowed_list(fmt):
    with pytest.raises(
        InvalidArgumentError, match=r"FpNumerics: dtype=.*float8_e4m3fn, "
    ):
        FpNumerics(fmt)


def test_bad_flags():
    with pytest.raises(InvalidArgumentError, match=r"clip=None"):
        FpNumerics("float8_e4m3fn", clip=None)
    with pytest.raises(InvalidArgumentError, match=r"noise_fn='uniform'"):
        FpNumerics("float8_e4m3fn", noise_fn="uniform")
