"""The PTQ formats: asymmetric uint grids, NF4, NVFP4 (two-level scales)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from scipy.stats import norm

import qbits
from qbits import InvalidArgumentError
from qbits.numerics import NF4_LEVELS, Nf4Numerics, UintNumerics

# The table of Dettmers et al. (QLoRA, arXiv 2305.14314) as bitsandbytes ships it.
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0, 2))
def quant(q, x, store=False):
    return q.quant(x, store=store)


def asym(bits=4, calibration=None, granularity=None):
    return qbits.Quantizer(
        UintNumerics(bits=bits),
        calibration or qbits.AbsMax(),
        granularity or qbits.Tiled(axis=0, tile_size=32),
    )


NF4 = qbits.Quantizer(Nf4Numerics(), qbits.AbsMax(), qbits.Tiled(axis=-1, tile_size=64))
E2M1 = qbits.FpNumerics("float4_e2m1fn")
NVFP4 = qbits.Quantizer(
    E2M1, qbits.AbsMax(), qbits.Tiled(axis=-1, tile_size=16), "e4m3"
)


def test_nf4_levels_are_the_published_table_and_its_normal_quantiles():
    assert tuple(PUBLISHED_NF4) == NF4_LEVELS
    # bitsandbytes' construction: 8 positive and 7 negative normal quantiles
    # between 1 - offset and offset, and 0, normalised to [-1, 1].
    offset = 0.9677083
    pos = norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    neg = -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    levels = np.sort(np.concatenate([pos, [0.0], neg]))
    np.testing.assert_allclose(levels / levels.max(), NF4_LEVELS, atol=3e-7)


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_grids_round_trip_their_own_values(bits):
    codes = jnp.arange(2**bits, dtype=jnp.float32)
    assert (UintNumerics(bits=bits)(codes) == codes).all()
    levels = jnp.asarray(NF4_LEVELS, jnp.float32)
    assert (Nf4Numerics()(levels) == levels).all()
    assert (Nf4Numerics().codes(levels) == jnp.arange(16, dtype=jnp.uint4)).all()
    # Through the quantizers: quantizing a dequantized tensor gives its codes.
    x = jax.random.normal(jax.random.key(bits), (64, 128)) * 2 + 1
    for q in (asym(bits), NF4, NVFP4):
        stored = quant(q, x, True)
        again = quant(q, stored.dequant(), True)
        np.testing.assert_array_equal(again.qvalue, stored.qvalue)
        if stored.zero_point is None:  # absmax-based: the very same scales
            np.testing.assert_array_equal(again.scale, stored.scale)
        else:  # min-max: the same range, up to float32 rounding
            np.testing.assert_array_equal(again.zero_point, stored.zero_point)
            np.testing.assert_allclose(again.scale, stored.scale, rtol=1e-6)


def test_nf4_rounds_to_the_nearest_level():
    x = jax.random.uniform(jax.random.key(0), (4096,), minval=-1.2, maxval=1.2)
    got = np.asarray(Nf4Numerics()(x))
    table = np.asarray(NF4_LEVELS, np.float32)
    dist = np.abs(np.asarray(x)[:, None] - table[None, :])
    nearest = table[np.argmin(dist, axis=1)]
    np.testing.assert_array_equal(got, nearest)
    assert np.isnan(Nf4Numerics()(jnp.array([jnp.nan]))).all()


@pytest.mark.parametrize(
    "granularity",
    [qbits.PerChannel(shared_axes=(0,)), qbits.Tiled(axis=0, tile_size=32)],
)
def test_asymmetric_min_max_maps_min_and_max_onto_the_ends(granularity):
    x = jax.random.normal(jax.random.key(1), (64, 8)) + 3.0  # shifted, mostly > 0
    q = asym(4, granularity=granularity)
    qt = quant(q, x, True)
    codes = np.asarray(qt.unpack().qvalue).astype(np.int32)
    size = 64 if isinstance(granularity, qbits.PerChannel) else 32
    blocks = codes.reshape(-1, size, 8)
    xb = np.asarray(x).reshape(-1, size, 8)
    lo = np.take_along_axis(blocks, xb.argmin(1)[:, None], 1)
    hi = np.take_along_axis(blocks, xb.argmax(1)[:, None], 1)
    assert (lo == 0).all()  # the zero point rounds min/s by at most 1/2
    assert ((hi == 15) | (hi == 14)).all() and (hi == 15).mean() > 0.9
    scale = np.asarray(qt.scale)
    zero = np.asarray(qt.zero_point)
    np.testing.assert_allclose(scale, (xb.max(1) - xb.min(1)) / 15, rtol=1e-5)
    assert zero.dtype == np.int16 and np.array_equal(zero, np.round(zero))
    # Dequantized: every value within half a step.
    err = np.abs(np.asarray(qt.dequant()) - np.asarray(x)).reshape(-1, size, 8)
    assert (err <= scale.reshape(-1, 1, 8) * 0.5001).all()
    # A shifted distribution: far less error than the symmetric int4 grid.
    sym = qbits.Quantizer(qbits.IntNumerics(bits=4), qbits.AbsMax(), granularity)
    mse = lambda q: float(jnp.mean((quant(q, x).dequant() - x) ** 2))  # noqa: E731
    assert mse(q) < 0.5 * mse(sym)
    # The searched range is never worse than min-max (factor 1.0 is a candidate).
    assert mse(asym(4, qbits.MseSearch(), granularity)) <= mse(q)


def test_asymmetric_edge_blocks():
    x = jnp.concatenate(
        [
            jnp.zeros((32, 2)),  # zeros
            jnp.full((32, 2), 1000.5),  # constant, far from zero
            jnp.full((32, 2), -3.25).at[0, 0].set(jnp.nan),  # a NaN
            jnp.linspace(5.0, 5.001, 64).reshape(32, 2),  # narrow, far from zero
        ],
        axis=1,
    )
    qt = quant(asym(4), x, True)
    out = np.asarray(qt.dequant())
    assert (out[:, :2] == 0).all() and (qt.scale[0, :2] == 1).all()
    np.testing.assert_allclose(out[:, 2:4], 1000.5, rtol=1e-6)
    assert np.isnan(out[:, 4]).all() and not np.isnan(out[:, 5]).any()
    np.testing.assert_allclose(out[:, 5], -3.25, rtol=1e-6)
    np.testing.assert_allclose(out[:, 6:], np.asarray(x[:, 6:]), atol=2e-4)
    assert int(np.abs(np.asarray(qt.zero_point)[:, [0, 1, 5]]).max()) <= 32767


@functools.partial(jax.jit, static_argnums=0)
def fake_stored_and_gradients(q, x):
    fake = q.quant(x).dequant()
    grad = jax.grad(lambda v: q.quant(v).dequant().sum())(x)
    _, vjp = q.quant_vjp(x, contracting_axes=(1,))
    return fake, q.quant(x, store=True).dequant(), grad, vjp(jnp.ones_like(x))


def test_fake_quant_is_stored_quant_and_straight_through():
    x = jax.random.normal(jax.random.key(2), (64, 64)) + 0.5
    for q in (asym(4), NF4, NVFP4):
        fake, stored, grad, vjp = fake_stored_and_gradients(q, x)
        np.testing.assert_array_equal(fake, stored)
        np.testing.assert_allclose(grad, 1.0, rtol=1e-6)
        np.testing.assert_array_equal(vjp, jnp.ones_like(x))
    codes = lambda v: NF4.quant(v, store=True).qvalue.astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(InvalidArgumentError, match="store"):
        jax.eval_shape(jax.grad(codes), x)


def nvfp4_reference(x):
    """NVFP4 in NumPy: blocks of 16 along the last axis, float32 throughout."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    g = np.float32(np.abs(x).max()) / np.float32(448 * 6)
    amax = np.abs(blocks).max(-1, keepdims=True)
    raw = np.clip(amax / (np.float32(6) * g), 0, 448)
    b = raw.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = b * g
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(b == 0, 0, blocks / np.where(b == 0, 1, s))
    q = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (q * s).reshape(x.shape), q.reshape(x.shape), b[..., 0], g


def test_nvfp4_equals_a_numpy_reference_of_the_two_level_scaling():
    k1, k2 = jax.random.split(jax.random.key(3))
    x = jax.random.normal(k1, (8, 64)) * jnp.exp(jax.random.normal(k2, (8, 1)) * 3)
    x = x.at[0, :16].set(0.0).at[1, :16].multiply(1e-9)  # zero and underflowing blocks
    want, codes, b, g = nvfp4_reference(x)
    assert (b == 0).sum() >= 2 and (b == 448).any()
    np.testing.assert_array_equal(quant(NVFP4, x).dequant(), want)
    stored = quant(NVFP4, x, True)
    assert (
        stored.scale.dtype == jnp.float8_e4m3fn
        and stored.qvalue.dtype == jnp.float4_e2m1fn
    )
    np.testing.assert_array_equal(stored.qvalue.astype(np.float32), codes)
    np.testing.assert_array_equal(stored.scale.astype(np.float32), b)
    np.testing.assert_array_equal(stored.tensor_scale, np.full((1, 1), g))
    np.testing.assert_array_equal(stored.pack().dequant(), want)


def test_packed_bytes():
    w = jax.random.normal(jax.random.key(4), (256, 512))
    n = w.size
    nf4 = jax.eval_shape(lambda: NF4.quant(w, store=True).pack())
    nvfp4 = jax.eval_shape(lambda: NVFP4.quant(w, store=True).pack())
    u4 = asym(4, granularity=qbits.Tiled(axis=-1, tile_size=128))
    u4 = jax.eval_shape(lambda: u4.quant(w, store=True).pack())
    assert nf4.qvalue.dtype == nvfp4.qvalue.dtype == jnp.uint8
    assert nf4.nbytes == n // 2 + (n // 64) * 4  # codes + a float32 absmax per 64
    assert nvfp4.nbytes == n // 2 + n // 16 + 4  # codes + e4m3 per 16 + one float32
    assert u4.nbytes == n // 2 + (n // 128) * (4 + 2)  # + scale, int16 zero
    # 4.5 bits a value: 0.140625 x float32 (4 bytes more for NVFP4's tensor scale)
    for qt in (nf4, nvfp4):
        assert qt.nbytes / (4 * n) <= 0.1407


def test_bad_input_names_the_argument_and_the_fix():
    for bits in (0, 9, True):
        with pytest.raises(InvalidArgumentError, match=r"UintNumerics: bits=.*1\.\.8"):
            UintNumerics(bits=bits)
    with pytest.raises(InvalidArgumentError, match="UintNumerics: dtype=int8"):
        UintNumerics(bits=4, dtype=jnp.int8)
    with pytest.raises(InvalidArgumentError, match=r"tile_size=64.*multiple of 64"):
        NF4.quant(jnp.ones((4, 96)))
    with pytest.raises(InvalidArgumentError, match=r"tile_size=16.*multiple of 16"):
        NVFP4.quant(jnp.ones((4, 40)))
    with pytest.raises(InvalidArgumentError, match="provider=.*zero point"):
        qbits.Quantizer(UintNumerics(bits=4), provider=qbits.DelayedScaling())
    with pytest.raises(InvalidArgumentError, match="provider=.*two-level"):
        qbits.Quantizer(
            qbits.FpNumerics("float4_e2m1fn"), scale_rounding="e4m3",
            provider=qbits.DelayedScaling(),
        )  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="scale_rounding='pow2'"):
        qbits.Quantizer(UintNumerics(bits=4), scale_rounding="pow2")
    with pytest.raises(InvalidArgumentError, match="Nf4Numerics: x.dtype=bfloat16"):
        Nf4Numerics()(jnp.ones(3, jnp.bfloat16))
