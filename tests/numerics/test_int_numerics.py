import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.test_util import check_grads

import qbits
from qbits import IntNumerics, InvalidArgumentError
from tests.helpers import bits_equal, fake_quant, float_arrays, half_ulp, quant


def seed_reference(x, bits, preserve_zero, preserve_max_val, clip, round_, noise=None):
    """The seed's IntNumerics.fwd, transcribed to numpy (float64)."""
    edge = 2.0 ** (bits - 1) - (0.5 if preserve_zero else 0.0)
    x = np.asarray(x, np.float64)
    if noise is not None:
        x = x + noise
    if clip:
        bound = edge - 0.5 if round_ else edge
        x = np.clip(x, -bound, bound)
    if round_:
        x = np.floor(x) + 0.5 if not preserve_zero else np.round(x)  # np: half-even
    return x


CONFIGS = [
    (bits, pz, pmv, clip, rnd)
    for bits, pz, pmv, clip, rnd in itertools.product(
        range(1, 17), (True, False), (True, False), (True, False), (True, False)
    )
    if not (bits == 1 and pz)
]


def make(bits, pz, pmv, clip, rnd, **kw):
    return IntNumerics(
        bits=bits, preserve_zero=pz, preserve_max_val=pmv, clip=clip, round=rnd, **kw
    )


@pytest.mark.parametrize("bits,pz,pmv,clip,rnd", CONFIGS)
def test_matches_seed_semantics(bits, pz, pmv, clip, rnd):
    edge = 2.0 ** (bits - 1)
    rng = np.random.default_rng(bits)
    x = np.concatenate(
        [
            rng.uniform(-1.3 * edge, 1.3 * edge, 512),
            np.arange(-edge - 2, edge + 2, 0.5) if bits <= 10 else [],
            [0.0, -0.0, 0.5, -0.5, 1.5, 2.5, edge - 0.5, edge, -edge, edge + 7],
        ]
    ).astype(np.float32)
    got = make(bits, pz, pmv, clip, rnd)(jnp.asarray(x))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(got, np.float64), seed_reference(x, bits, pz, pmv, clip, rnd)
    )


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("pz", [True, False])
@pytest.mark.parametrize("pmv", [True, False])
def test_grid_constants(bits, pz, pmv):
    if bits == 1 and pz:
        return
    n = IntNumerics(bits=bits, preserve_zero=pz, preserve_max_val=pmv)
    edge = 2.0 ** (bits - 1) - (0.5 if pz else 0.0)
    assert n.abs_val_mapped_to() == (edge - 0.5 if pmv else edge)
    if pz:
        assert n.get_dtype() == (
            np.dtype("int4")
            if bits <= 4
            else np.dtype("int8")
            if bits <= 8
            else np.int16
        )
    else:
        assert n.get_dtype() is None


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("pz", [True, False])
def test_number_of_levels(bits, pz):
    if bits == 1 and pz:
        return
    edge = 2.0 ** (bits - 1)
    ramp = jnp.arange(-edge - 3, edge + 3, 0.25, dtype=jnp.float32)
    levels = np.unique(
        np.asarray(jax.jit(IntNumerics(bits=bits, preserve_zero=pz))(ramp))
    )
    assert len(levels) == (2**bits - 1 if pz else 2**bits)
    top = edge - 1 if pz else edge - 0.5
    assert levels[0] == -top and levels[-1] == top
    np.testing.assert_array_equal(np.diff(levels), 1.0)  # evenly spaced


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_binary_and_low_bit_grids_through_quantizer(bits):
    q = qbits.Quantizer(IntNumerics(bits=bits, preserve_zero=bits > 1))
    x = jnp.linspace(-1.0, 1.0, 1001)
    dq = np.unique(np.asarray(q.quant(x).dequant()))
    assert len(dq) == (2 if bits == 1 else 2**bits - 1)
    if bits == 1:
        np.testing.assert_allclose(dq, [-0.5, 0.5])  # absmax 1 maps to edge 1


# --- Properties, through the Quantizer (the way numerics are used). ------------


@st.composite
def int_quantizers(draw):
    bits = draw(st.integers(1, 16))
    pz = draw(st.booleans()) if bits > 1 else False
    pmv = draw(st.booleans())
    gran = draw(
        st.sampled_from(
            [
                qbits.PerTensor(),
                qbits.PerChannel(shared_axes=(0,)),
                qbits.PerChannel(()),
            ]
        )
    )
    return qbits.Quantizer(
        IntNumerics(bits=bits, preserve_zero=pz, preserve_max_val=pmv), granularity=gran
    )


@given(q=int_quantizers(), x=float_arrays())
def test_error_at_most_half_a_step(q, x):
    qt = quant(q, x)
    dq = np.asarray(qt.dequant(), np.float64)
    assert qt.dequant().dtype == x.dtype
    scale = np.broadcast_to(np.asarray(qt.scale, np.float64), x.shape)
    err = np.abs(np.asarray(x, np.float64) - dq)
    # Half a step, plus float32 rounding of the scaling, plus the rounding of
    # the result to x's dtype.
    tol = scale / 2 * (1 + 1e-5) + half_ulp(dq, x.dtype)
    assert np.all(err <= tol), (err - tol).max()


@given(q=int_quantizers(), x=float_arrays())
def test_levels_at_most_the_grid(q, x):
    qt = quant(q, x.astype(jnp.float32))
    pz = q.numerics.preserve_zero
    codes = np.unique(np.asarray(qt.qvalue))
    assert len(codes) <= (2**q.numerics.bits - (1 if pz else 0))
    np.testing.assert_array_equal(codes, np.round(codes * 2) / 2)
    if pz:
        np.testing.assert_array_equal(codes, np.round(codes))


@given(q=int_quantizers(), x=float_arrays())
def test_quantizing_twice_equals_once(q, x):
    x = x.astype(jnp.float32)
    once = quant(q, x)
    # The numerics are idempotent on their grid...
    np.testing.assert_array_equal(q.numerics(once.qvalue), once.qvalue)
    # ...so with absmax calibration the grid codes are idempotent...
    twice = quant(q, once.dequant())
    np.testing.assert_array_equal(twice.qvalue, once.qvalue)
    # ...and with a fixed range so are the values. Absmax maps onto
    # abs_val_mapped_to (m), but the top code can be lower (127 < 127.5), so
    # requantizing shrinks the scale (see below). A scale rounded *up* to a
    # power of two comes back the same exactly when each block's top code
    # exceeds m / 2 (then ceil2(top * s / m) = s), or the block is zero.
    exact = [q.replace(calibration=qbits.ConstantBound(3.0))]
    e8m0 = q.replace(scale_rounding="e8m0")
    codes = np.abs(np.asarray(quant(e8m0, x).qvalue))
    shared = tuple(a for a, n in enumerate(once.scale.shape) if n == 1)
    top = codes.max(axis=shared) if shared else codes
    if np.all((top > q.numerics.abs_val_mapped_to() / 2) | (top == 0)):
        exact.append(e8m0)
    for fixed in exact:
        once = fake_quant(fixed, x)
        np.testing.assert_array_equal(fake_quant(fixed, once), once)


def test_e8m0_requantization_changes_scale_when_top_code_is_below_half():
    # Half-integer grid mapped onto the bucket centre 1.5: absmax 0.8 * s
    # rounds down to code 0.5 < 1.5 / 2, so the next e8m0 scale halves.
    q = qbits.Quantizer(
        IntNumerics(bits=2, preserve_zero=False, preserve_max_val=True),
        scale_rounding="e8m0",
    )
    once = q.quant(jnp.array([0.0125]))
    assert float(once.qvalue[0]) == 0.5
    twice = q.quant(once.dequant())
    assert float(twice.scale[0]) == float(once.scale[0]) / 2


def test_binary_edge_mapping_halves_the_scale_when_requantizing():
    q = qbits.Quantizer(IntNumerics(bits=1, preserve_zero=False), scale_rounding="e8m0")
    once = q.quant(jnp.array([0.125, -0.01]))
    np.testing.assert_array_equal(once.dequant(), [0.0625, -0.0625])
    np.testing.assert_array_equal(
        q.quant(once.dequant()).dequant(), [0.03125, -0.03125]
    )


def test_absmax_scale_shrinks_when_requantizing_aqt_default():
    # AQT's int8 default maps the absmax onto the bucket edge 127.5, but the
    # largest code is 127: requantizing finds absmax 127 * s, a smaller scale.
    q = qbits.Quantizer(IntNumerics(bits=8))
    x = jnp.array([1.0, -0.3, 0.25])
    once = q.quant(x)
    twice = q.quant(once.dequant())
    np.testing.assert_allclose(twice.scale / once.scale, 127 / 127.5, rtol=1e-6)


# --- Stochastic rounding. ------------------------------------------------------


def test_stochastic_rounding_is_unbiased():
    n = IntNumerics(bits=4, noise_fn=qbits.numerics.UniformNoise())
    x = jnp.array([0.1, -2.3, 3.5, 6.9, -6.95, 0.0, 5.25], jnp.float32)
    draws = 20000
    keys = jax.random.split(jax.random.key(0), draws)
    samples = jax.vmap(lambda k: n(x, qbits.numerics.Context(k)))(keys)
    assert set(np.unique(np.asarray(samples))) <= set(range(-7, 8))
    # Each draw is floor or ceil of x; variance <= 1/4, so 6 sigma is 3/sqrt(n).
    np.testing.assert_allclose(samples.mean(0), x, atol=6 * 0.5 / np.sqrt(draws))
    lo, hi = np.floor(np.asarray(x)), np.ceil(np.asarray(x))
    s = np.asarray(samples)
    assert np.all((s == lo) | (s == hi))


def test_stochastic_rounding_on_half_integer_grid_is_unbiased():
    n = IntNumerics(bits=2, preserve_zero=False, noise_fn=qbits.numerics.UniformNoise())
    x = jnp.array([0.2, -0.7, 1.4, -1.1], jnp.float32)
    keys = jax.random.split(jax.random.key(1), 20000)
    samples = jax.vmap(lambda k: n(x, qbits.numerics.Context(k)))(keys)
    assert set(np.unique(np.asarray(samples))) <= {-1.5, -0.5, 0.5, 1.5}
    np.testing.assert_allclose(samples.mean(0), x, atol=6 * 0.5 / np.sqrt(20000))


@pytest.mark.parametrize("bits", [8, 3])
def test_stochastic_rounding_is_biased_only_above_the_top_code(bits):
    """AQT's grid: the bound at top + 0.5, codes up to top. Documented bias:
    an input in (top, top + 0.5] always comes back as top; below, unbiased;
    with preserve_max_val (bound at top) every input's mean is itself."""
    noise = qbits.numerics.UniformNoise()
    top = 2 ** (bits - 1) - 1
    edge = IntNumerics(bits=bits, noise_fn=noise)
    assert edge.abs_val_mapped_to() == top + 0.5
    x = jnp.repeat(jnp.array([top + 0.5, top + 0.2, top - 0.3], jnp.float32), 20000)
    got = np.asarray(edge(x, qbits.numerics.Context(jax.random.key(5))))
    got = got.reshape(3, -1)
    assert (got[:2] == top).all()  # (top, top + 0.5]: always top, never above
    assert got[2].mean() == pytest.approx(top - 0.3, abs=6 * 0.5 / np.sqrt(20000))
    centre = IntNumerics(bits=bits, preserve_max_val=True, noise_fn=noise)
    assert centre.abs_val_mapped_to() == top
    x = jnp.repeat(jnp.array([top, top - 0.4], jnp.float32), 20000)
    got = np.asarray(centre(x, qbits.numerics.Context(jax.random.key(6))))
    means = got.reshape(2, -1).mean(1)
    np.testing.assert_allclose(means, [top, top - 0.4], atol=6 * 0.5 / np.sqrt(20000))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU flushes")
def test_subnormal_blocks_quantize_to_zero_on_cpu():
    """As the calibration docstring says: XLA:CPU reads float32 subnormals
    (below 2**-126) as zero, so such a block gets the bound 0."""
    q = qbits.Quantizer(IntNumerics(bits=4), qbits.AbsMax(), qbits.PerChannel((0,)))
    tiny = np.float32(2.0**-126)
    x = np.array([[0.3, 3.0, 0.7], [-0.9, 1.0, 0.2]], np.float32) * tiny
    qt = q.quant(jnp.asarray(x))
    assert np.asarray(qt.scale)[0, 0] == 1.0  # column 0: absmax 0.9 * 2**-126
    np.testing.assert_array_equal(np.asarray(qt.dequant())[:, [0, 2]], 0.0)
    assert np.asarray(qt.dequant())[0, 1] == 3.0 * tiny  # a normal column


def test_stochastic_rounding_same_key_same_bits():
    n = IntNumerics(bits=8, noise_fn=qbits.numerics.UniformNoise())
    x = jax.random.normal(jax.random.key(3), (64,)) * 40
    a = n(x, qbits.numerics.Context(jax.random.key(7)))
    b = jax.jit(n)(x, qbits.numerics.Context(jax.random.key(7)))
    c = n(x, qbits.numerics.Context(jax.random.key(8)))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_stochastic_rounding_without_key_is_a_clear_error():
    n = IntNumerics(bits=8, noise_fn=qbits.numerics.UniformNoise())
    for context in (None, qbits.numerics.Context()):
        with pytest.raises(InvalidArgumentError, match=r"context.*key"):
            n(jnp.ones(3), context)
    with pytest.raises(InvalidArgumentError, match=r"noise_fn"):
        jax.jit(lambda x: n(x))(jnp.ones(3))


# --- Gradients. ----------------------------------------------------------------


@pytest.mark.parametrize("pz", [True, False])
def test_gradient_is_straight_through(pz):
    n = IntNumerics(bits=4, preserve_zero=pz)
    x = jnp.linspace(-20.0, 20.0, 41)
    g = jax.grad(lambda x: jnp.sum(n(x) * jnp.arange(41.0)))(x)
    np.testing.assert_array_equal(g, jnp.arange(41.0))


@pytest.mark.parametrize("pz", [True, False])
def test_clip_gradient_masks_outside_the_clip_range(pz):
    n = IntNumerics(bits=4, preserve_zero=pz, clip_gradient=True)
    bound = n._clip_bound()  # 7 with preserve_zero, 7.5 without
    x = jnp.array([-bound - 0.01, -bound, -1.0, 0.0, 3.3, bound, bound + 0.01, 100.0])
    g = jax.grad(lambda x: jnp.sum(n(x)))(x)
    np.testing.assert_array_equal(g, [0, 1, 1, 1, 1, 1, 0, 0])


def test_check_grads_where_the_numerics_is_differentiable():
    # Without rounding, the clip-gradient VJP is the true derivative of clip.
    clip_only = IntNumerics(bits=2, round=False, clip_gradient=True)  # clip at 1.5
    check_grads(clip_only, (jnp.array([-2.0, -0.7, 0.4, 1.0, 1.9]),), 1, modes="rev")
    identity = IntNumerics(bits=4, round=False, clip=False)
    check_grads(identity, (jnp.array([-0.3, 0.4, 0.9]),), order=2, modes="rev")


def test_jit_vmap_grad_compose():
    n = IntNumerics(bits=8, clip_gradient=True)
    x = jnp.linspace(-200.0, 200.0, 24).reshape(4, 6)
    f = jax.jit(jax.vmap(jax.grad(lambda row: jnp.sum(n(row) ** 2))))
    expected = 2 * n(x) * (jnp.abs(x) <= 127).astype(x.dtype)
    np.testing.assert_array_equal(f(x), expected)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_low_precision_inputs_keep_their_dtype(dtype):
    n = IntNumerics(bits=8)
    x = jnp.array([1.25, -100.5, 300.0], dtype)  # exact in every dtype
    y = n(x)
    assert y.dtype == dtype
    assert bits_equal(y, [1.0, -100.0, 127.0])


@pytest.mark.parametrize("pz", [True, False])
def test_x64_keeps_the_input_dtype(pz):
    # The clip bounds were python floats: float64 arrays in lax.clamp under x64.
    n = IntNumerics(bits=4, preserve_zero=pz)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = jnp.array([1.25, -100.5, 3.0, -0.0], dtype)
        expected = n(x)
        with jax.enable_x64(True):
            y = n(x)
        assert y.dtype == dtype
        np.testing.assert_array_equal(y, expected)


def test_grid_not_representable_in_input_dtype_is_an_error():
    with pytest.raises(InvalidArgumentError, match=r"x.dtype=bfloat16.*significand"):
        IntNumerics(bits=12)(jnp.ones(3, jnp.bfloat16))
    IntNumerics(bits=12)(jnp.ones(3, jnp.float16))  # 11 significand bits suffice
    # The Quantizer computes in float32, so any input dtype works there.
    q = qbits.Quantizer(IntNumerics(bits=16))
    assert q.quant(jnp.ones(3, jnp.bfloat16)).dequant().dtype == jnp.bfloat16


# --- Bad input. ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"bits": 0}, r"bits=0 .*an int in 1\.\.16"),
        ({"bits": 17}, r"bits=17 .*an int in 1\.\.16"),
        ({"bits": 8.0}, r"bits=8\.0 .*an int in 1\.\.16"),
        ({"bits": True}, r"bits=True .*an int"),
        (
            {"bits": 8, "dtype": jnp.int4},
            r"dtype=int4 .*int4 holds \[-8, 7\].*\[-127, 127\]",
        ),
        ({"bits": 16, "dtype": jnp.int8}, r"dtype=int8 .*\[-32767, 32767\]"),
        ({"bits": 8, "dtype": jnp.uint8}, r"dtype=uint8 .*signed"),
        ({"bits": 8, "dtype": jnp.float32}, r"dtype=float32 .*signed integer"),
        ({"bits": 8, "preserve_zero": False, "dtype": jnp.int8}, r"not integers"),
        ({"bits": 8, "round": False, "dtype": jnp.int8}, r"not integers"),
        ({"bits": 1}, r"preserve_zero=True .*single level"),
        ({"clip": 1}, r"clip=1 .*True or False"),
        ({"noise_fn": 3}, r"noise_fn=3 .*callable"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern) as info:
        IntNumerics(**kwargs)
    assert info.value.owner == "IntNumerics"
    assert isinstance(info.value, ValueError)


def test_non_float_input_is_an_error():
    with pytest.raises(InvalidArgumentError, match=r"x.dtype=int32"):
        IntNumerics()(jnp.arange(3))


def test_is_a_hashable_static_pytree():
    n = IntNumerics(bits=4, noise_fn=qbits.numerics.UniformNoise())
    assert jax.tree_util.tree_leaves(n) == []
    assert hash(n) == hash(IntNumerics(bits=4, noise_fn=qbits.numerics.UniformNoise()))
    assert n == IntNumerics(
        bits=4, dtype=jnp.int4, noise_fn=qbits.numerics.UniformNoise()
    )
    with pytest.raises(AttributeError):
        n.bits = 8
