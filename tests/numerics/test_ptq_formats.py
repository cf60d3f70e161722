"""The PTQ formats: asymmetric uint grids, NF4, NVFP4 (two-level scales).

One jitted function per quantizer and one input shape serve every test, so
that the whole file compiles a handful of programs.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qbits
from qbits import InvalidArgumentError
from qbits.numerics import Nf4Numerics, UintNumerics

# The table of Dettmers et al. (QLoRA, arXiv 2305.14314) as bitsandbytes ships it.
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
    0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip

GROUPS = qbits.Tiled(axis=0, tile_size=32)  # two groups of 32 per column
ASYM = qbits.Quantizer(UintNumerics(bits=4), qbits.AbsMax(), GROUPS)
NF4 = qbits.Quantizer(Nf4Numerics(), qbits.AbsMax(), qbits.Tiled(axis=0, tile_size=64))
E2M1 = qbits.FpNumerics("float4_e2m1fn")
NVFP4 = qbits.Quantizer(E2M1, qbits.AbsMax(), qbits.Tiled(axis=0, tile_size=16), "e4m3")
SHAPE = (64, 32)
NF4_LEVELS = Nf4Numerics().levels


@functools.partial(jax.jit, static_argnums=0)
def run(q, x):
    """Fake and stored quantization, requantized, and both gradients."""
    stored = q.quant(x, store=True)
    _, vjp = q.quant_vjp(x, contracting_axes=(0,))
    return {
        "fake": q.quant(x).dequant(),
        "stored": stored,
        "again": q.quant(stored.dequant(), store=True),
        "grad": jax.grad(lambda v: q.quant(v).dequant().sum())(x),
        "vjp": vjp(jnp.ones_like(x)),
    }


def data(seed, shift=0.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(SHAPE) * 2 + shift).astype(np.float32)


def test_nf4_levels_are_the_published_table_and_its_normal_quantiles():
    from scipy.stats import norm  # a second to import: here, not at collection

    assert tuple(PUBLISHED_NF4) == NF4_LEVELS
    # bitsandbytes' construction: 8 positive and 7 negative normal quantiles
    # between 1 - offset and offset, and 0, normalised to [-1, 1].
    offset = 0.9677083
    pos = norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    neg = -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    levels = np.sort(np.concatenate([pos, [0.0], neg]))
    np.testing.assert_allclose(levels / levels.max(), NF4_LEVELS, atol=3e-7)


def test_nf4_rounds_to_the_nearest_level():
    x = np.linspace(-1.2, 1.2, 4001, dtype=np.float32)
    table = np.asarray(NF4_LEVELS, np.float32)
    nearest = table[np.argmin(np.abs(x[:, None] - table[None, :]), axis=1)]
    np.testing.assert_array_equal(Nf4Numerics()(jnp.asarray(x)), nearest)
    assert np.isnan(Nf4Numerics()(jnp.array([jnp.nan]))).all()


def test_grids_round_trip_their_own_values():
    codes = jnp.arange(256, dtype=jnp.float32)
    for bits in (1, 4, 8):
        np.testing.assert_array_equal(
            UintNumerics(bits=bits)(codes), codes.clip(0, 2**bits - 1)
        )
    levels = jnp.asarray(NF4_LEVELS, jnp.float32)
    assert (Nf4Numerics()(levels) == levels).all()
    assert Nf4Numerics().codes(levels).tolist() == list(range(16))


@pytest.mark.parametrize("q", [ASYM, NF4, NVFP4], ids=["asym", "nf4", "nvfp4"])
def test_quantizers_round_trip_and_fake_quant_is_stored_quant(q):
    out = run(q, data(1, shift=1.0))
    stored, again = out["stored"], out["again"]
    # Quantizing the dequantized tensor gives the same codes.
    np.testing.assert_array_equal(again.qvalue, stored.qvalue)
    if stored.zero_point is None:  # absmax-based: the very same scales
        np.testing.assert_array_equal(again.scale, stored.scale)
    else:  # min-max: the same range, up to float32 rounding
        np.testing.assert_array_equal(again.zero_point, stored.zero_point)
        np.testing.assert_allclose(again.scale, stored.scale, rtol=1e-6)
    # Fake quantization is the stored one, packed or not, with the
    # straight-through gradient.
    np.testing.assert_array_equal(out["fake"], stored.dequant())
    np.testing.assert_array_equal(out["fake"], stored.pack(axis=-1).dequant())
    np.testing.assert_allclose(out["grad"], 1.0, rtol=1e-6)
    np.testing.assert_array_equal(out["vjp"], 1.0)


def test_asymmetric_min_max_maps_min_and_max_onto_the_ends():
    x = data(2, shift=5.0)  # shifted: mostly positive
    out = run(ASYM, x)
    qt = out["stored"]
    codes = np.asarray(qt.qvalue).astype(np.int32).reshape(2, 32, -1)
    xb = np.asarray(x).reshape(2, 32, -1)
    lo = np.take_along_axis(codes, xb.argmin(1)[:, None], 1)
    hi = np.take_along_axis(codes, xb.argmax(1)[:, None], 1)
    assert (lo == 0).all()  # the zero point rounds min/s by at most 1/2
    assert ((hi == 15) | (hi == 14)).all() and (hi == 15).mean() > 0.9
    scale = np.asarray(qt.scale)
    np.testing.assert_allclose(scale, (xb.max(1) - xb.min(1)) / 15, rtol=1e-5)
    assert qt.zero_point.dtype == np.int16
    # Every value within half a step.
    err = np.abs(np.asarray(out["fake"]) - np.asarray(x)).reshape(2, 32, -1)
    assert (err <= scale[:, None] * 0.5001).all()
    # Far less error than the symmetric int4 grid; the searched range is
    # never worse than min-max (factor 1.0 is one of its candidates).
    sym = qbits.Quantizer(qbits.IntNumerics(bits=4), qbits.AbsMax(), GROUPS)
    mse_search = qbits.Quantizer(UintNumerics(bits=4), qbits.MseSearch(), GROUPS)
    both = jax.jit(lambda x: (sym.quant(x).dequant(), mse_search.quant(x).dequant()))
    err_sym, err_mse = (float(np.mean((np.asarray(y) - x) ** 2)) for y in both(x))
    err_asym = float(np.mean((np.asarray(out["fake"]) - x) ** 2))
    assert err_asym < 0.5 * err_sym
    assert err_mse <= err_asym


def test_asymmetric_edge_blocks():
    x = np.stack(
        [
            np.zeros(64),  # zeros
            np.full(64, 1000.5),  # constant, far from zero
            np.full(64, -3.25),  # a NaN in the first group, below
            np.linspace(5.0, 5.001, 64),  # narrow, far from zero
        ],
        axis=1,
    ).astype(np.float32)
    x[0, 2] = np.nan
    x = np.tile(x, (1, SHAPE[1] // 4))
    qt = run(ASYM, x)["stored"]
    out = np.asarray(qt.dequant())
    assert (out[:, 0] == 0).all() and (qt.scale[:, 0] == 1).all()
    np.testing.assert_allclose(out[:, 1], 1000.5, rtol=1e-6)  # widened to fit
    assert np.isnan(out[:32, 2]).all()  # the group with the NaN, only
    np.testing.assert_allclose(out[32:, 2], -3.25, rtol=1e-6)
    np.testing.assert_allclose(out[:, 3], np.asarray(x[:, 3]), atol=2e-4)
    assert int(np.abs(np.asarray(qt.zero_point)[:, [0, 1, 3]]).max()) <= 32767


def nvfp4_reference(x):
    """NVFP4 in NumPy: blocks of 16 along axis 0, float32 throughout."""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(-1, 16, x.shape[1])
    g = np.float32(np.abs(x).max()) / np.float32(448 * 6)
    amax = np.abs(blocks).max(1, keepdims=True)
    raw = np.clip(amax / (np.float32(6) * g), 0, 448)
    b = raw.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = b * g
    y = np.where(b == 0, 0, blocks / np.where(b == 0, 1, s))
    q = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (q * s).reshape(x.shape), q.reshape(x.shape), b[:, 0], g


# XLA's default CPU emitters: the suite's faster ones cast to the fnuz
# float8 formats and float4 otherwise (conftest.py).
@pytest.mark.optimized
def test_nvfp4_equals_a_numpy_reference_of_the_two_level_scaling():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(SHAPE) * np.exp(rng.standard_normal((1, SHAPE[1])) * 3)
    x = x.astype(np.float32)
    x[:16, 0], x[:16, 1] = 0.0, x[:16, 1] * 1e-9  # a zero and an underflowing block
    want, codes, b, g = nvfp4_reference(x)
    assert (b == 0).sum() >= 2 and (b == 448).any()
    out = run(NVFP4, x)
    np.testing.assert_array_equal(out["fake"], want)
    stored = out["stored"]
    assert stored.scale.dtype == jnp.float8_e4m3fn
    assert stored.qvalue.dtype == jnp.float4_e2m1fn
    np.testing.assert_array_equal(stored.qvalue.astype(np.float32), codes)
    np.testing.assert_array_equal(stored.scale.astype(np.float32), b)
    np.testing.assert_array_equal(stored.tensor_scale, np.full((1, 1), g))


def test_nvfp4_tensor_scale_is_floored_at_the_smallest_normal():
    """Below amax = 448 * 6 * 2**-126 the tensor scale stays 2**-126 (a
    subnormal one reads as 0 on CPU); the block scales then fall short of
    448, and the relative error stays what it is at amax 1."""
    x = data(7)
    x /= np.abs(x).max()
    errors = []
    for amax in (1.0, 2e-36):
        small = (x * np.float32(amax)).astype(np.float32)
        out = run(NVFP4, small)
        g = float(np.asarray(out["stored"].tensor_scale).ravel()[0])
        top = float(np.asarray(out["stored"].scale.astype(np.float32)).max())
        if amax == 1.0:
            assert g == pytest.approx(1 / (448 * 6)) and top == 448
        else:
            assert g == 2.0**-126 and top < 448 / 8
        err = (np.asarray(out["fake"], np.float64) - small) / amax
        errors.append(np.linalg.norm(err) / np.linalg.norm(x))
    assert errors[1] == pytest.approx(errors[0], rel=0.02)


def test_packed_bytes():
    w = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    n = 256 * 512

    def packed(q):
        return jax.eval_shape(lambda w: q.quant(w, store=True).pack(), w).nbytes

    tiled = lambda q, size: q.replace(granularity=qbits.Tiled(axis=1, tile_size=size))  # noqa: E731
    nf4, nvfp4 = packed(tiled(NF4, 64)), packed(tiled(NVFP4, 16))
    assert nf4 == n // 2 + (n // 64) * 4  # codes + a float32 absmax per 64
    assert nvfp4 == n // 2 + n // 16 + 4  # codes + e4m3 per 16 + one float32
    assert packed(tiled(ASYM, 128)) == n // 2 + (n // 128) * (4 + 2)  # + int16 zero
    # 4.5 bits a value: 0.140625 x float32 (4 bytes more for NVFP4's tensor scale)
    assert nf4 / (4 * n) <= 0.1407 and nvfp4 / (4 * n) <= 0.1407


def test_bad_input_names_the_argument_and_the_fix():
    for bits in (0, 9, True):
        with pytest.raises(InvalidArgumentError, match=r"UintNumerics: bits=.*1\.\.8"):
            UintNumerics(bits=bits)
    with pytest.raises(InvalidArgumentError, match="UintNumerics: dtype=int8"):
        UintNumerics(bits=4, dtype=jnp.int8)
    with pytest.raises(InvalidArgumentError, match=r"tile_size=64.*multiple of 64"):
        jax.eval_shape(NF4.quant, jax.ShapeDtypeStruct((96, 4), jnp.float32))
    with pytest.raises(InvalidArgumentError, match=r"tile_size=16.*multiple of 16"):
        jax.eval_shape(NVFP4.quant, jax.ShapeDtypeStruct((40, 4), jnp.float32))
    with pytest.raises(InvalidArgumentError, match=r"provider=.*zero point"):
        qbits.Quantizer(UintNumerics(bits=4), provider=qbits.DelayedScaling())
    with pytest.raises(InvalidArgumentError, match=r"provider=.*two-level"):
        qbits.Quantizer(E2M1, scale_rounding="e4m3", provider=qbits.DelayedScaling())
    with pytest.raises(InvalidArgumentError, match="scale_rounding='pow2'"):
        qbits.Quantizer(UintNumerics(bits=4), scale_rounding="pow2")
    with pytest.raises(InvalidArgumentError, match=r"Nf4Numerics: x\.dtype=bfloat16"):
        Nf4Numerics()(jnp.ones(3, jnp.bfloat16))
    codes = lambda v: NF4.quant(v, store=True).qvalue.astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(InvalidArgumentError, match="store"):
        jax.eval_shape(jax.grad(codes), jax.ShapeDtypeStruct((64, 2), jnp.float32))
