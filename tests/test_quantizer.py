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
from qbits._formats import FLOAT_FORMATS
from qbits._tensor import storage_dtype
from tests.helpers import (
    FLOAT_DTYPES,
    bits_equal,
    float_arrays,
    half_ulp,
    quant,
)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_no_numerics_returns_the_input_bit_for_bit(dtype):
    x = jnp.array([[0.1, -0.0, jnp.nan], [jnp.inf, 3e4, 1e-5]], dtype)
    q = Quantizer(qbits.numerics.NoNumerics(), granularity=PerChannel((0,)))
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
    as a multiplication by its reciprocal, which can differ by 1 ulp). The
    numerics are elementwise, so they run once on the whole scaled tensor.
    """
    x = np.asarray(x, np.float32)
    split = [d for n, b in zip(x.shape, blocks, strict=True) for d in (n // b, b)]
    absmax = np.abs(x.reshape(split)).max(axis=tuple(range(1, len(split), 2)))
    out = None
    if scales is not None:
        s = np.asarray(scales, np.float32)
        for axis, b in enumerate(blocks):
            s = np.repeat(s, b, axis=axis)
        out = np.asarray(numerics_fn(jnp.asarray(x / s)), np.float32) * s
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
    qt = quant(Quantizer(numerics, granularity=granularity), x)  # compiled
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
        q = qbits.presets.mx_quantizer(element, axis=-1)
        qt = quant(q, x, store=True)
        assert qt.scale.shape == (4, 3)
        s = np.asarray(qt.scale)
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)  # powers of 2
        # Rounded up: no element clips.
        blocks = np.abs(np.asarray(x)).reshape(4, 3, 32).max(-1)
        assert np.all(blocks / s <= q.numerics.abs_val_mapped_to())
        rel = np.abs(np.asarray(qt.dequant()) - np.asarray(x)) / np.repeat(s, 32, 1)
        assert rel.max() <= q.numerics.abs_val_mapped_to()  # sanity
    with pytest.raises(InvalidArgumentError, match=r"mx_quantizer: element='fp8'"):
        qbits.presets.mx_quantizer("fp8")


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

    @jax.jit
    def run(x):
        stored, grid = q.quant(x, store=True), q.quant(x)
        return stored, grid, stored.dequant(), grid.dequant()

    stored, grid, stored_dq, grid_dq = run(x)
    assert stored.qvalue.dtype == storage and stored.is_stored
    assert grid.qvalue.dtype == jnp.float32 and not grid.is_stored
    assert stored.qdtype == numerics.get_dtype()
    np.testing.assert_array_equal(
        np.asarray(stored.qvalue).astype(np.float32), grid.qvalue
    )
    assert bits_equal(stored_dq, grid_dq)
    assert stored_dq.dtype == dtype


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
        IntNumerics(bits=4, noise_fn=qbits.numerics.UniformNoise()),
        granularity=PerChannel((1,)),
    )
    x = jax.random.normal(jax.random.key(0), (5, 3, 16))
    keys = jax.random.split(jax.random.key(1), 5)

    @jax.jit
    def f(x, keys):
        def one(x, key):
            return jax.grad(
                lambda x: jnp.sum(q.quant(x, qbits.numerics.Context(key)).dequant())
            )(x)

        return jax.vmap(one)(x, keys)

    np.testing.assert_allclose(f(x, keys), jnp.ones_like(x), rtol=1e-6)

    def one(x, k):
        return q.quant(x, qbits.numerics.Context(k)).dequant()

    y = jax.jit(jax.vmap(one))(x, keys)
    np.testing.assert_array_equal(y[2], jax.jit(one)(x[2], keys[2]))
    with pytest.raises(InvalidArgumentError, match=r"context"):
        q.quant(x)


def test_stochastic_rounding_through_the_quantizer_is_unbiased():
    q = Quantizer(
        IntNumerics(bits=2, noise_fn=qbits.numerics.UniformNoise()), ConstantBound(1.5)
    )
    x = jnp.array([0.3, -0.8, 0.9, 0.05])  # inside the grid's range [-1, 1]
    keys = jax.random.split(jax.random.key(2), 20000)
    dq = jax.jit(jax.vmap(lambda k: q.quant(x, qbits.numerics.Context(k)).dequant()))(
        keys
    )
    np.testing.assert_allclose(dq.mean(0), x, atol=6 * 0.5 / np.sqrt(20000))


# --- Properties. --------------------------------------------------------------


# Values, magnitudes and dtypes are drawn; shapes from three (per tensor or
# per channel, the properties hold whatever the shape): a new shape compiles
# anew.
FEW_SHAPES = st.sampled_from([(9,), (4, 9), (2, 3, 7)])


@functools.partial(jax.jit, static_argnums=0)
def _grid_and_fake_quant(q, x):
    """``quant(q, x).qvalue`` and ``fake_quant(q, x)``: one compile."""
    return q.quant(x).qvalue, q.quant(x).dequant()


@given(
    x=FEW_SHAPES.flatmap(lambda shape: float_arrays(shape=shape, max_log10=2)),
    fmt=st.sampled_from(sorted(FLOAT_FORMATS)),
    per_channel=st.booleans(),
    rounding=st.sampled_from(["none", "pow2", "e8m0"]),
)
def test_float_quantizer_output_is_on_the_scaled_grid(x, fmt, per_channel, rounding):
    granularity = PerChannel((0,)) if per_channel else qbits.PerTensor()
    q = Quantizer(FpNumerics(fmt), AbsMax(), granularity, rounding)
    grid, fake = _grid_and_fake_quant(q, x)
    grid = np.asarray(grid)
    f = FLOAT_FORMATS[fmt]
    assert np.all(np.isfinite(grid)) and np.all(np.abs(grid) <= f.max)
    np.testing.assert_array_equal(grid.astype(f.dtype).astype(np.float32), grid)
    assert np.isfinite(np.asarray(fake, np.float32)).all()


@functools.partial(jax.jit, static_argnums=0)
def _grad_fake_quant(q, x):
    return jax.grad(lambda x: jnp.sum(q.quant(x).dequant().astype(jnp.float32)))(x)


@given(
    x=FEW_SHAPES.flatmap(lambda shape: float_arrays(shape=shape)),
    bits=st.integers(2, 8),
)
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


# --- Regressions: zero blocks, huge values, x64, zero-size input. ------------


def test_a_binary_layer_with_an_all_zero_weight_outputs_zero():
    # Binary has no zero: a zero block used to come back as +0.5 * scale.
    w = jnp.stack([jnp.zeros(4), jnp.array([0.3, -1.0, 0.2, -0.1])], axis=1)
    q = Quantizer(
        IntNumerics(bits=1, preserve_zero=False), granularity=PerChannel((0,))
    )
    dq = q.quant(w).dequant()
    np.testing.assert_array_equal(dq[:, 0], 0.0)
    np.testing.assert_array_equal(dq[:, 1], [0.5, -0.5, 0.5, -0.5])
    x = jnp.ones((2, 4))
    np.testing.assert_array_equal((x @ dq)[:, 0], 0.0)
    qt, grad = q.quant_vjp(w)
    np.testing.assert_array_equal(qt.dequant(), dq)
    np.testing.assert_array_equal(grad(jnp.ones_like(w)), jnp.ones_like(w))


@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("rounding", ["none", "pow2", "e8m0"])
def test_low_bit_grids_keep_huge_values_signs_and_gradients(bits, rounding):
    # int1..int3 used to return zeros with zero gradient: 1 / scale was
    # subnormal and flushed to zero.
    x = jnp.array([3.4e38, -3.4e38, 1e38, -2e37])
    q = Quantizer(
        IntNumerics(bits=bits, preserve_zero=bits > 1), scale_rounding=rounding
    )
    dq, _, g, g_vjp = _fake_quant_and_grads(q, x, jnp.ones_like(x))
    assert np.isfinite(dq).all()
    np.testing.assert_array_equal(np.sign(dq[:2]), [1.0, -1.0])
    # Binary on a power-of-two scale holds at most 0.5 * 2**127 (see the
    # property test below for the exact bounds).
    assert float(dq[0]) >= 3.4e38 / 4
    np.testing.assert_allclose(g, 1.0, rtol=1e-6)
    np.testing.assert_array_equal(g_vjp, 1.0)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_grids_without_a_zero_keep_every_sign(bits):
    # Far below its block's scale, x / s underflows to a zero (XLA:CPU
    # flushes it, to -0.0 or 0.0), which a grid without a zero rounds up,
    # as the seed's floor(y) + 0.5 does: -0.4 next to 3.3e38 came back as
    # +1.65e38.
    x = jnp.array([-0.4, 3.3e38, 0.7, -2.5, -1e-30, 1e-30])
    dq, _, g, g_vjp = _fake_quant_and_grads(
        Quantizer(IntNumerics(bits=bits, preserve_zero=False)), x, jnp.ones_like(x)
    )
    np.testing.assert_array_equal(np.sign(dq), np.sign(x))
    assert np.isfinite(dq).all()
    np.testing.assert_array_equal(g_vjp, 1.0)
    np.testing.assert_allclose(g, 1.0, rtol=1e-6)


@pytest.mark.parametrize("numerics", [IntNumerics(bits=8), FpNumerics("float8_e4m3fn")])
def test_e8m0_near_float32_max_is_finite(numerics):
    # The scale rounded up, times the largest code, used to overflow to inf.
    x = jnp.array([3.4e38, -3.4e38, 1e38, F32_MAX])
    qt = Quantizer(numerics, scale_rounding="e8m0").quant(x, store=True)
    dq = np.asarray(qt.dequant())
    assert np.isfinite(dq).all()
    np.testing.assert_array_equal(np.sign(dq), np.sign(x))
    np.testing.assert_allclose(dq, x, rtol=0.15)  # e4m3 clips at 448 * 2**119


X64_NUMERICS = [
    IntNumerics(bits=8),
    IntNumerics(bits=4, noise_fn=qbits.numerics.UniformNoise()),
    IntNumerics(bits=1, preserve_zero=False),
    FpNumerics("float8_e4m3fn"),
    FpNumerics("float6_e2m3fn"),
    FpNumerics("float4_e2m1fn", noise_fn=qbits.numerics.UniformNoise()),
]


def test_x64_keeps_the_input_dtype_and_the_numbers():
    # Python floats become float64 arrays under jax_enable_x64; lax.clamp
    # used to reject float32 input mixed with them.
    context = qbits.numerics.Context(jax.random.key(0))
    x = jnp.array([[1.5, -2.25, 300.0, 0.0], [1e-3, 7.0, -7.0, 2.0]])
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    cases = [
        (Quantizer(n, granularity=PerChannel((1,)), scale_rounding="e8m0"), t, s)
        for n in X64_NUMERICS
        for t in dtypes
        for s in ((False, True) if n.get_dtype() and t == jnp.float32 else (False,))
    ]

    def run(x, x64):
        qts = [q.quant(x.astype(t), context, store=s) for q, t, s in cases]
        grads = [
            jax.grad(lambda x, q=q: jnp.sum(q.quant(x, context).dequant()))(x)
            for q, t, s in cases
            if t == jnp.float32 and not s
        ]
        q = cases[0][0]
        f64 = None
        if x64:  # computed, and given back as the scale (as PTQ's GPTQ does)
            qt64 = q.quant(x.astype(jnp.float64), context)
            again, _ = q.quant_vjp(x.astype(jnp.float64), context, scale=qt64.scale)
            f64 = (qt64.dequant(), again.dequant())
        return [(qt, qt.dequant()) for qt in qts], grads, f64

    expected, _, _ = jax.jit(run, static_argnums=1)(x, False)
    with jax.enable_x64(True):
        got, grads, (f64, given) = jax.jit(run, static_argnums=1)(x, True)
    assert f64.dtype == given.dtype == jnp.float64
    np.testing.assert_array_equal(given, f64)
    for g in grads:
        np.testing.assert_array_equal(g, jnp.ones_like(x))
    for (q, t, s), (qt, dq), (_, want) in zip(cases, got, expected, strict=True):
        assert qt.scale.dtype == jnp.float32
        stored = storage_dtype(q.numerics.get_dtype()) if s else jnp.float32
        assert qt.qvalue.dtype == stored and dq.dtype == t
        np.testing.assert_array_equal(dq, want)


ZERO_SIZE_GRANULARITIES = [
    (qbits.PerTensor(), (1, 1)),
    (PerChannel((0,)), (1, 8)),
    (PerChannel((1,)), (0, 1)),
    (PerChannel(()), (0, 8)),
    (Tiled(axis=1, tile_size=4), (0, 2)),
    (Tiled(axis=0, tile_size=4, free_tile_size=2), (0, 4)),
]


@pytest.mark.parametrize("granularity, scale_shape", ZERO_SIZE_GRANULARITIES)
def test_zero_size_input_gives_an_empty_qtensor(granularity, scale_shape):
    # Used to raise ZeroDivisionError in the block layout.
    x = jnp.ones((0, 8))

    @jax.jit
    def run(x):  # one program: the checks are of shapes, dtypes and scales
        out = []
        for numerics in (
            IntNumerics(bits=8),
            IntNumerics(1, False),
            FpNumerics("float4_e2m1fn"),
        ):
            q = Quantizer(numerics, granularity=granularity)
            store = numerics.get_dtype() is not None
            qt = q.quant(x, store=store)
            _, grad = q.quant_vjp(x, store=store)
            out.append((qt.qvalue, qt.scale, qt.dequant(), grad(x)))
        out.append(jax.grad(lambda x: jnp.sum(q.quant(x).dequant()))(x))
        return out

    *quantized, g = run(x)
    for qvalue, scale, dq, dx in quantized:
        assert qvalue.shape == (0, 8) and scale.shape == scale_shape
        np.testing.assert_array_equal(scale, 1.0)
        assert dq.shape == (0, 8) and dq.dtype == jnp.float32
        assert dx.shape == (0, 8)
    assert g.shape == (0, 8)
    # As a matmul operand: the granularity's axes from the contraction.
    q = Quantizer(IntNumerics(bits=8), granularity=PerChannel())
    qt, _ = q.quant_vjp(x, store=True, contracting_axes=(1,))
    assert qt.scale.shape == (0, 1)


# --- Edge blocks: zero, tiny, huge, mixed sign (see qbits._calibration). --------

F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).tiny)
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)
ROUNDINGS = ("none", "pow2", "e8m0")


def grid_top_and_half_step(numerics):
    """The grid's largest magnitude, and half its spacing at ``|y|`` (units)."""
    if isinstance(numerics, IntNumerics):
        top = 2.0 ** (numerics.bits - 1) - (1.0 if numerics.preserve_zero else 0.5)
        return top, lambda y: np.full_like(y, 0.5)
    f = numerics.format

    def half_step(y):
        e = np.floor(np.log2(np.maximum(y, 2.0**f.min_exp)))
        return np.exp2(e - f.nmant - 1)

    return f.max, half_step


def edge_blocks(seed, dtype):
    """Rows, one scale block each: zero, tiny, huge, mixed magnitudes and signs."""
    rng = np.random.default_rng(seed)
    n = 12

    def signed(log10_lo, log10_hi):
        mag = 10.0 ** rng.uniform(log10_lo, log10_hi, n)
        return rng.choice([-1.0, 1.0], n) * mag

    rows = [
        np.where(rng.random(n) < 0.5, -0.0, 0.0),  # zeros, some negative
        signed(-45, -30),  # tiny, subnormals included
        signed(-38, -36),  # tiny but normal: the scale is the smallest normal
        signed(-44, -39),  # only subnormals (zero on XLA:CPU, which flushes them)
        signed(30, 38.5),  # huge
        np.append(signed(37, 38.5)[: n - 1], rng.choice([-1, 1]) * F32_MAX),
        signed(-1, 1) * 10.0 ** rng.integers(-6, 6),  # ordinary mixed sign
        np.concatenate([signed(30, 38)[: n // 2], signed(-40, -20)[n // 2 :]]),
    ]
    top = BF16_MAX if dtype == jnp.bfloat16 else F32_MAX
    x = np.stack(rows)
    x = np.sign(x) * np.minimum(np.abs(x), top)
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnums=0)
def _fake_quant_and_grads(q, x, w):
    def f(x):
        qt = q.quant(x)
        return jnp.sum(qt.dequant().astype(jnp.float32) * w), (qt.dequant(), qt.scale)

    g, (dq, scale) = jax.grad(f, has_aux=True)(x)
    _, grad = q.quant_vjp(x)
    return dq, scale, g, grad(w.astype(x.dtype))


def check_edge_blocks(q, x):
    """Finite, zeros stay zeros, signs kept, error and scale bounds, gradients."""
    rows = x.shape[0]
    w = jnp.linspace(0.5, 1.0, x.size, dtype=jnp.float32).reshape(x.shape)
    dq, scale, g, g_vjp = _fake_quant_and_grads(q, x, w)
    x64 = np.asarray(x, np.float64)
    dq64 = np.asarray(dq, np.float64)
    s = np.asarray(scale, np.float64).reshape(rows, 1)
    mapped = q.numerics.abs_val_mapped_to()
    top, half_step = grid_top_and_half_step(q.numerics)
    assert dq.dtype == x.dtype
    assert np.isfinite(dq64).all(), "finite input must give finite output"
    assert np.isfinite(s).all() and (s > 0).all()
    top_of_dtype = min(F32_MAX, float(jnp.finfo(x.dtype).max))
    grid_top = np.float32(mapped) * s.astype(np.float32)  # as dequant computes it
    assert (grid_top <= top_of_dtype).all(), "the scaled grid must fit x.dtype"
    # Zeros stay zeros, with scale 1.
    absmax = np.abs(x64).max(axis=1, keepdims=True)
    zero = (absmax == 0)[:, 0]
    assert (dq64[zero] == 0).all() and (s[zero] == 1).all()
    # The scale: bound / mapped, at least the smallest normal, rounded as
    # asked, and lowered only where the grid would overflow float32.
    for i in np.flatnonzero(absmax[:, 0] >= TINY):
        lo = min(max(absmax[i, 0] / mapped, TINY), top_of_dtype / mapped, F32_MAX)
        si = s[i, 0]
        capped = 2 * si * mapped > top_of_dtype or 2 * si > F32_MAX
        if q.scale_rounding == "none":
            assert abs(si - lo) <= 1e-6 * lo, (i, si, lo)
            continue
        assert si == 2.0 ** np.round(np.log2(si)), "a power of two"
        if q.scale_rounding == "pow2":
            assert lo / 2**0.5 <= si * (1 + 1e-7) or capped, (i, si, lo)
            assert si <= lo * 2**0.5 * (1 + 1e-7), (i, si, lo)
        else:
            assert lo <= si * (1 + 1e-7) or capped, (i, si, lo)
            assert si < 2 * lo, (i, si, lo)
    for i in np.flatnonzero((absmax[:, 0] > 0) & (absmax[:, 0] < TINY)):
        assert s[i, 0] in (1.0, TINY)  # 1 where the backend flushes subnormals
    # Error: half a step of the grid at the value (at the scale found above),
    # plus what clips beyond the grid's top; float32's own resolution (its
    # smallest normal, as XLA:CPU flushes subnormals) and input rounding.
    y = np.abs(x64) / s
    inside = np.minimum(y, top)
    tol = half_step(inside) * s * (1 + 1e-5) + (y - inside) * s
    tol += 1e-6 * np.abs(x64) + TINY + half_ulp(dq64, x.dtype)
    err = np.abs(dq64 - x64)
    assert (err <= tol).all(), (np.argwhere(err > tol), err[err > tol])
    # Signs: a value the grid resolves (no float32 underflow in x / s) keeps
    # its sign or becomes 0; on a grid without a zero every value keeps it.
    resolved = (np.abs(x64) >= TINY) & (y >= 2.0**-100)
    flipped = resolved & (dq64 != 0) & (np.sign(dq64) != np.sign(x64))
    assert not flipped.any(), np.argwhere(flipped)
    if isinstance(q.numerics, IntNumerics) and not q.numerics.preserve_zero:
        # (0 only in a block whose bound is 0: zeros, or flushed subnormals)
        flipped = (dq64 * x64 != 0) & (np.sign(dq64) != np.sign(x64))
        assert not flipped.any(), np.argwhere(flipped)
    # Straight-through gradients, finite everywhere, zero blocks included:
    # exact from quant_vjp; through dequant's autodiff, (w * scale) / scale,
    # which float32 flushes to 0 where w * scale is below its smallest normal.
    w64 = np.asarray(w, np.float64)
    np.testing.assert_array_equal(g_vjp, w.astype(x.dtype))
    g64 = np.asarray(g, np.float64)
    assert np.isfinite(g64).all()
    rtol = 1e-5 if x.dtype == jnp.float32 else 1e-2
    flushed = (w64 * s < TINY) & (g64 == 0)
    np.testing.assert_allclose(np.where(flushed, w64, g64), w64, rtol=rtol)


@st.composite
def int_numerics(draw):
    bits = draw(st.integers(1, 16))
    pz = draw(st.booleans()) if bits > 1 else False
    return IntNumerics(
        bits=bits, preserve_zero=pz, preserve_max_val=draw(st.booleans())
    )


@given(
    numerics=int_numerics() | st.sampled_from(sorted(FLOAT_FORMATS)).map(FpNumerics),
    rounding=st.sampled_from(ROUNDINGS),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**32 - 1),
)
def test_edge_blocks_on_every_grid(numerics, rounding, dtype, seed):
    q = Quantizer(numerics, granularity=PerChannel((1,)), scale_rounding=rounding)
    check_edge_blocks(q, edge_blocks(seed, dtype))


def _mixed_requests(x, w, key):
    """Requests of every kind quantize_all groups: per-channel int8 along two
    axes of one tensor, a tiled MX quantizer, int3 (its huge-scale division
    in two steps), stochastic rounding, a given scale, float16 input,
    NoNumerics, a zero-size tensor, and a repeat of the first request."""
    from qbits._quantizer import Request

    int8 = Quantizer(IntNumerics(bits=8), granularity=PerChannel())
    noisy = Quantizer(
        IntNumerics(bits=8, noise_fn=qbits.numerics.UniformNoise()),
        granularity=PerChannel(),
    )
    provided = Quantizer(
        IntNumerics(bits=8), granularity=PerChannel(), provider=qbits.DelayedScaling()
    )
    return [
        Request(int8, x, None, True, (1,)),
        Request(int8, x, None, True, (0,)),
        Request(int8, w.astype(jnp.float16), None, False, (0,)),
        Request(qbits.presets.mx_quantizer("float8_e4m3fn"), w, None, True, (0,)),
        Request(Quantizer(IntNumerics(bits=3)), x, None, False, (1,)),
        Request(noisy, w, qbits.numerics.Context(key), True, (1,)),
        Request(provided, w, None, True, (0,), jnp.full((1, 32), 0.01)),
        Request(Quantizer(qbits.numerics.NoNumerics()), x, None, False, (1,)),
        Request(int8, jnp.zeros((0, 32)), None, True, (1,)),
        Request(int8, x, None, True, (1,)),
    ]


def test_quantizing_together_equals_quantizing_alone():
    # quantize_all runs the scale arithmetic of tensors with the same
    # arithmetic in one kernel, on their bounds laid end to end: the numbers
    # are exactly those of quantizing each tensor on its own.
    from qbits._quantizer import quantize_all

    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (16, 64)) * jnp.linspace(1e-3, 1e3, 64)
    w = jax.random.normal(k[1], (64, 32))

    def together(x, w, key):
        out = quantize_all(_mixed_requests(x, w, key), vjp=False)
        return [qt for qt, _ in out]

    def alone(x, w, key):
        return [quantize_all([r], vjp=False)[0][0] for r in _mixed_requests(x, w, key)]

    got, want = jax.jit(together)(x, w, k[2]), jax.jit(alone)(x, w, k[2])
    assert len(got) == len(want) == 10
    for a, b in zip(got, want, strict=True):
        assert a.qvalue.dtype == b.qvalue.dtype and a.dtype == b.dtype
        assert bits_equal(a.qvalue, b.qvalue) and bits_equal(a.scale, b.scale)


def test_a_placeholder_takes_no_part_but_its_place():
    from qbits._quantizer import Request, quantize_all

    int8 = Quantizer(IntNumerics(bits=8), granularity=PerChannel())
    x = jax.random.normal(jax.random.key(0), (8, 16))
    spec = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    out = quantize_all(
        [Request(int8, spec, None, True, (0,)), Request(int8, x, None, True, (1,))],
        vjp=True,
    )
    assert out[0] is None
    qt, _ = out[1]
    want = int8.quant(x, store=True, contracting_axes=(1,))
    np.testing.assert_array_equal(qt.qvalue, want.qvalue)
    np.testing.assert_array_equal(qt.scale, want.scale)


def test_a_fixed_tensor_amax_sets_the_two_level_tensor_scale():
    # NVFP4 under a calibrated global scale: tensor_amax replaces the
    # tensor's own amax (equal to it, the same result; smaller, the top
    # blocks clip at E4M3's 448 block scale; larger, coarser block scales)
    base = qbits.presets.get("nvfp4").fwd.lhs
    x = jax.random.normal(jax.random.key(0), (4, 64))
    own = float(jnp.abs(x).max())

    def q(amax):
        return base.replace(tensor_amax=amax).quant(x, contracting_axes=(1,)).dequant()

    plain = base.quant(x, contracting_axes=(1,)).dequant()
    np.testing.assert_array_equal(q(own), plain)
    assert float(jnp.abs(q(own / 4)).max()) < own * 0.3  # clipped
    assert not np.array_equal(q(own * 3), plain)  # (x4: the same, exactly)
    for bad, rounding in ((0.0, "e4m3"), (float("inf"), "e4m3"), (1.0, "none")):
        with pytest.raises(qbits.InvalidArgumentError, match="tensor_amax"):
            base.replace(tensor_amax=bad, scale_rounding=rounding)
