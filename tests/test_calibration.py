import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qbits
from qbits import AbsMax, ConstantBound, InvalidArgumentError, MseSearch, Percentile
from qbits._calibration import make_scale, round_scale
from qbits._formats import FLOAT_FORMATS
from tests.helpers import fake_quant, float_arrays, quant

X = jnp.array([[1.0, -4.0, 0.5, 2.0], [0.25, 0.5, -0.125, 0.0]])


def test_absmax_and_clip_factor():
    np.testing.assert_array_equal(AbsMax()(X, (1,)), [[4.0], [0.5]])
    np.testing.assert_array_equal(AbsMax(0.5)(X, (0, 1)), [[2.0]])
    np.testing.assert_array_equal(AbsMax()(X, ()), jnp.abs(X))


def test_percentile_matches_numpy():
    x = jax.random.normal(jax.random.key(0), (3, 1000))
    for p in (50.0, 99.0, 100.0):
        np.testing.assert_allclose(
            Percentile(p)(x, (1,)),
            np.percentile(np.abs(np.asarray(x)), p, axis=1, keepdims=True),
            rtol=1e-6,
        )


def test_constant_bound():
    np.testing.assert_array_equal(ConstantBound(3.0)(X, (0,)), [[3.0] * 4])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_mse_search_is_the_best_candidate(bits):
    x = jax.random.laplace(jax.random.key(bits), (8, 256))
    cal = MseSearch()
    q = qbits.Quantizer(qbits.IntNumerics(bits=bits), cal, qbits.PerChannel((1,)))
    got = np.asarray(q.quant(x).dequant())
    # Brute force: quantize each row with each candidate, keep the best.
    rows = []
    for i in range(8):
        best = None
        for f in cal.clip_factors:
            b = f * float(jnp.max(jnp.abs(x[i])))
            row = qbits.Quantizer(qbits.IntNumerics(bits=bits), ConstantBound(b))
            dq = np.asarray(row.quant(x[i]).dequant())
            err = np.sum((dq - np.asarray(x[i])) ** 2)
            if best is None or err < best[0] - 1e-9 * err:
                best = (err, dq)
        rows.append(best[1])
    np.testing.assert_allclose(got, np.stack(rows), rtol=1e-6, atol=1e-7)


# The values, magnitude and dtype are drawn; the shape from three (the
# property is over the whole tensor, whatever its shape): each new shape
# compiles 11 candidate quantizations.
FEW_SHAPES = st.sampled_from([(9,), (4, 9), (2, 3, 7)])


@settings(max_examples=10)
@given(x=FEW_SHAPES.flatmap(lambda shape: float_arrays(shape=shape)))
def test_mse_search_never_worse_than_absmax(x):
    x = x.astype(jnp.float32)
    n = qbits.IntNumerics(bits=3)
    mse = fake_quant(qbits.Quantizer(n, MseSearch()), x)
    absmax = fake_quant(qbits.Quantizer(n), x)
    err = lambda y: float(jnp.sum((y - x) ** 2))  # noqa: E731
    assert err(mse) <= err(absmax) * (1 + 1e-6)


def test_mse_search_picks_the_same_bound_at_any_magnitude():
    # Its squared errors overflowed float32 in a huge block (every candidate
    # inf: the first, 1.0, won) and underflowed to 0 in a tiny one.
    x = jax.random.laplace(jax.random.key(3), (4, 256))
    q = qbits.Quantizer(qbits.IntNumerics(bits=4), MseSearch(), qbits.PerChannel((1,)))
    scale = np.asarray(quant(q, x).scale)
    for e in (100, -100):
        got = np.asarray(quant(q, x * 2.0**e).scale)
        np.testing.assert_array_equal(got, scale * 2.0**e)


def test_mse_search_needs_the_quantize_function():
    with pytest.raises(InvalidArgumentError, match=r"MseSearch: quantize=None"):
        MseSearch()(X, (1,))


# --- Non-finite input: the documented rule. ------------------------------------


@pytest.mark.parametrize(
    "cal", [AbsMax(), Percentile(90.0), MseSearch(), ConstantBound(2.0)]
)
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_a_non_finite_value_poisons_only_its_own_block(cal, bad):
    x = X.at[0, 2].set(bad)
    q = qbits.Quantizer(qbits.IntNumerics(bits=8), cal, qbits.PerChannel((1,)))
    for store in (False, True):
        qt = quant(q, x, store=store)
        dq = np.asarray(qt.dequant())
        assert np.isnan(qt.scale[0, 0]) and np.isfinite(qt.scale[1, 0])
        assert np.isnan(dq[0]).all()  # the whole block: never a plausible number
        np.testing.assert_array_equal(dq[1], quant(q, X).dequant()[1])


@pytest.mark.parametrize(
    "cal", [AbsMax(), Percentile(99.0), MseSearch(), ConstantBound(2.0)]
)
@pytest.mark.parametrize("granularity", [qbits.PerTensor(), qbits.PerChannel((0,))])
def test_nan_in_a_large_tensor_is_not_lost(cal, granularity):
    # XLA:CPU's vectorized max reductions drop NaN on arrays this large.
    x = jnp.ones((512, 2048)).at[300, 1000].set(jnp.nan)
    q = qbits.Quantizer(qbits.IntNumerics(bits=8), cal, granularity)
    dq = fake_quant(q, x)
    block = x.size if isinstance(granularity, qbits.PerTensor) else 512
    assert int(jnp.isnan(dq).sum()) == block
    assert bool(jnp.isnan(dq[:, 1000]).all())


@pytest.mark.parametrize("cal", [AbsMax(), Percentile(99.0), MseSearch()])
def test_a_finite_block_whose_sum_overflows_is_finite(cal):
    # 4096 values up to 3e35 sum past float32's largest; the check for
    # non-finite values was whether the block's sum is finite.
    x = jnp.linspace(1e35, 3e35, 4096).reshape(2, 2048)
    dq = fake_quant(qbits.Quantizer(qbits.IntNumerics(bits=8), cal), x)
    assert np.isfinite(dq).all()
    np.testing.assert_allclose(dq, x, rtol=0.02)


ZERO_BLOCK_CASES = [
    (qbits.IntNumerics(bits=4), "none"),
    (qbits.numerics.Fp8Numerics(), "e8m0"),
    # Grids without a zero: the all-zero block gets code 0, off the grid.
    (qbits.IntNumerics(bits=1, preserve_zero=False), "none"),
    (qbits.IntNumerics(bits=4, preserve_zero=False, preserve_max_val=True), "pow2"),
]


@pytest.mark.parametrize("numerics, rounding", ZERO_BLOCK_CASES)
def test_all_zero_blocks_give_scale_one_and_exact_zeros(numerics, rounding):
    x = jnp.zeros((3, 3)).at[1].set(jnp.array([0.5, -1.0, 0.0]))
    x = x.at[2].set(jnp.array([1e-45, -1e-44, 0.0]))  # subnormals: 0 on XLA:CPU
    q = qbits.Quantizer(
        numerics, granularity=qbits.PerChannel((1,)), scale_rounding=rounding
    )
    qt = quant(q, x, store=numerics.get_dtype() is not None)
    assert float(qt.scale[0, 0]) == 1.0 and np.isfinite(qt.scale).all()
    dq = np.asarray(qt.dequant())
    np.testing.assert_array_equal(dq[0], 0.0)
    assert not np.signbit(dq[0]).any()
    assert np.all(np.abs(dq[2]) <= 2.0**-126)  # 0, or on the grid at 2**-126
    np.testing.assert_array_equal(np.sign(dq[1, :2]), [1.0, -1.0])
    # The fake quantization keeps its straight-through gradient there.
    w = jnp.arange(1.0, 10.0).reshape(3, 3)
    g = jax.jit(jax.grad(lambda x: jnp.sum(q.quant(x).dequant() * w)))(x)
    np.testing.assert_allclose(g, w, rtol=1e-6)


def test_a_zero_bound_zeroes_the_block_whatever_the_calibration():
    # The median magnitude of a mostly-zero block is 0: the block clips to it.
    x = jnp.array([[0.0, 0.0, 0.0, 5.0, -300.0], [1.0, -2.0, 3.0, 0.0, 0.0]])
    for numerics in (qbits.IntNumerics(bits=8), qbits.IntNumerics(3, False)):
        q = qbits.Quantizer(numerics, Percentile(50.0), qbits.PerChannel((1,)))
        qt = quant(q, x)
        assert float(qt.scale[0, 0]) == 1.0
        np.testing.assert_array_equal(qt.dequant()[0], 0.0)
        assert np.all(qt.dequant()[1, :3] != 0)


def test_tiny_values_get_a_normal_scale():
    x = jnp.array([1e-39, -3e-40, 0.0], jnp.float32)  # float32 subnormals
    qt = qbits.Quantizer(qbits.IntNumerics(bits=8)).quant(x)
    assert float(qt.scale[0]) >= float(jnp.finfo(jnp.float32).tiny)
    assert np.isfinite(qt.dequant()).all()


TINY = float(jnp.finfo(jnp.float32).tiny)
F32_MAX = float(jnp.finfo(jnp.float32).max)


@pytest.mark.parametrize("rounding", ["none", "pow2", "e8m0"])
def test_a_tiny_positive_bound_gets_the_smallest_normal_scale_not_one(rounding):
    # bound / mapped is subnormal or underflows to 0: compare the bound.
    bound = jnp.array([1e-37, 2e-38, 1.2e-38, 0.0])
    for mapped in (127.5, 448.0, 57344.0):
        s = np.asarray(make_scale(bound, mapped, rounding))
        np.testing.assert_array_equal(s, [TINY, TINY, TINY, 1.0])


TINY_NUMERICS = [qbits.IntNumerics(bits=b) for b in (6, 8, 11, 16)] + [
    qbits.FpNumerics(f) for f in sorted(FLOAT_FORMATS)
]


@pytest.mark.parametrize("numerics", TINY_NUMERICS, ids=lambda n: str(n.get_dtype()))
def test_tiny_tensors_quantize_as_finely_as_float32_allows(numerics):
    x = jnp.array([1e-37, -3e-37, 2e-37])
    qt = qbits.Quantizer(numerics).quant(x)
    mapped = numerics.abs_val_mapped_to()
    np.testing.assert_allclose(qt.scale, max(3e-37 / mapped, TINY), rtol=1e-6)
    dq = np.asarray(qt.dequant())
    assert np.all(np.sign(dq) == np.sign(x)), dq  # not rounded to zeros
    # Half a step of the coarsest grid here (fp4: 1 mantissa bit) is 25%.
    np.testing.assert_allclose(dq, x, rtol=0.25)


def test_scales_keep_the_grid_finite_near_float32_max():
    big = jnp.array([F32_MAX])
    for mapped, rounding, expected in [
        (127.5, "none", F32_MAX / 127.5),
        (127.5, "e8m0", 2.0**121),  # 2**122 * 127 overflows: rounded down
        (448.0, "e8m0", 2.0**119),
        (448.0, "pow2", 2.0**119),
        (1.0, "e8m0", 2.0**127),
        (0.5, "none", F32_MAX),  # binary, bound on the bucket centre
    ]:
        s = np.asarray(make_scale(big, mapped, rounding))
        np.testing.assert_allclose(s, expected, rtol=1e-6)
        assert np.isfinite(np.float32(mapped) * s.astype(np.float32)).all()
    # The scaled grid also fits the dtype the values are returned in.
    s = make_scale(jnp.array([65504.0]), 127.5, "e8m0", jnp.float16)
    assert float(s[0]) == 512.0 and 127 * 512 <= 65504


def test_absmax_clip_factor_never_makes_a_block_of_zeros():
    # 1e-20 * 1e-20 underflows float32: a bound of 0 means a block of zeros.
    x = jnp.array([[1e-20, -3e-21], [1.0, -2.0]])
    q = qbits.Quantizer(
        qbits.IntNumerics(bits=8), AbsMax(1e-20), qbits.PerChannel((1,))
    )
    dq = np.asarray(q.quant(x).dequant())
    np.testing.assert_array_equal(np.sign(dq), np.sign(x))


def test_absmax_clip_factor_above_one_saturates_instead_of_overflowing():
    x = jnp.array([[3e38, -1.0], [jnp.inf, 1.0], [1.0, 2.0]])
    bound = np.asarray(AbsMax(clip_factor=2.0)(x, (1,)))
    np.testing.assert_array_equal(bound[:, 0], [F32_MAX, np.nan, 4.0])
    dq = (
        qbits.Quantizer(qbits.IntNumerics(bits=8), AbsMax(2.0), qbits.PerChannel((1,)))
        .quant(x[::2])
        .dequant()
    )
    assert np.isfinite(dq).all() and float(dq[0, 0]) > 1e38


# --- Scales. -----------------------------------------------------------------


def test_round_scale():
    s = jnp.array([0.3, 0.75, 4.0, 0.70, 0.71, 1.0, 2.0**-130, 2.0**127 * 1.5, jnp.nan])
    pow2 = np.asarray(round_scale(s, "pow2"))
    e8m0 = np.asarray(round_scale(s, "e8m0"))
    np.testing.assert_array_equal(pow2[:6], [0.25, 1.0, 4.0, 0.5, 1.0, 1.0])
    np.testing.assert_array_equal(e8m0[:6], [0.5, 1.0, 4.0, 1.0, 1.0, 1.0])
    # Clamped to the normal float32 part of E8M0's range.
    assert pow2[6] == e8m0[6] == 2.0**-126
    assert pow2[7] == e8m0[7] == 2.0**127
    assert np.isnan(pow2[8]) and np.isnan(e8m0[8])
    # Every e8m0 scale is exactly representable as float8_e8m0fnu.
    finite = e8m0[:8]
    np.testing.assert_array_equal(
        finite.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), finite
    )
    np.testing.assert_array_equal(round_scale(s, "none"), s)


@given(x=FEW_SHAPES.flatmap(lambda shape: float_arrays(shape=shape)))
def test_e8m0_scales_round_up_so_nothing_clips(x):
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x))
    s = float(make_scale(amax, 448.0, "e8m0"))
    raw = float(amax) / 448.0
    assert raw <= s < 2 * raw or (raw == 0 and s == 1.0)
    assert float(amax) / s <= 448.0


def test_make_scale():
    np.testing.assert_array_equal(
        make_scale(jnp.array([255.0, 0.0, jnp.nan]), 127.5), [2.0, 1.0, jnp.nan]
    )


# --- Bad input. ----------------------------------------------------------------


@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda: AbsMax(0.0), r"AbsMax: clip_factor=0\.0 .*\[1\.17.*e-38, inf\)"),
        (lambda: AbsMax(1e-40), r"AbsMax: clip_factor=1e-40"),  # 0 in float32
        (lambda: AbsMax(float("nan")), r"AbsMax: clip_factor=nan"),
        (lambda: AbsMax("1"), r"AbsMax: clip_factor='1'"),
        (lambda: Percentile(0.0), r"Percentile: percentile=0\.0 .*\(0\.0, 100\.0\]"),
        (lambda: Percentile(100.5), r"percentile=100\.5"),
        (lambda: MseSearch(()), r"MseSearch: clip_factors=\(\) .*non-empty"),
        (lambda: MseSearch((1.0, -0.5)), r"clip_factors\[1\]=-0\.5"),
        (lambda: ConstantBound(-1.0), r"ConstantBound: value=-1\.0"),
        (lambda: round_scale(jnp.ones(2), "up"), r"rounding='up' .*none, pow2, e8m0"),
    ],
)
def test_bad_arguments(build, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        build()


def test_clip_factors_accept_any_sequence():
    assert MseSearch([1, 0.5]).clip_factors == (1.0, 0.5)
