import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import qbits
import qbits.hlo
from qbits import (
    ConstantBound,
    DotGeneralConfig,
    IntNumerics,
    InvalidArgumentError,
    MatmulConfig,
    PerChannel,
    Quantizer,
)

NONE = Quantizer(qbits.numerics.NoNumerics())
INT8 = Quantizer(IntNumerics(bits=8), granularity=PerChannel())

# (lhs shape, rhs shape, dimension numbers): plain matmuls, batch dims, several
# contracting dims, contracting dims out of order, batch dims not leading.
DIMS = [
    ((4, 6), (6, 5), (((1,), (0,)), ((), ()))),
    ((4, 6), (5, 6), (((1,), (1,)), ((), ()))),
    ((6, 4), (6, 5), (((0,), (0,)), ((), ()))),
    ((2, 4, 6), (2, 6, 5), (((2,), (1,)), ((0,), (0,)))),
    ((4, 2, 6), (6, 5, 2), (((2,), (0,)), ((1,), (2,)))),
    ((3, 4, 6), (6, 3, 5), (((0, 2), (1, 0)), ((), ()))),
    ((2, 3, 4, 5), (2, 5, 3, 7), (((3, 1), (1, 2)), ((0,), (0,)))),
    ((7,), (7, 3), (((0,), (0,)), ((), ()))),
    ((4, 6), (6,), (((1,), (0,)), ((), ()))),
    ((2, 3), (4, 5), (((), ()), ((), ()))),
]


def operands(lhs_shape, rhs_shape, dtype=jnp.float32, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, lhs_shape).astype(dtype)
    rhs = jax.random.normal(k2, rhs_shape).astype(dtype)
    return lhs, rhs


def cotangent(lhs, rhs, dn, seed=1):
    out = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dn), lhs, rhs
    )
    return jax.random.normal(jax.random.key(seed), out.shape).astype(out.dtype)


def vjp(f, lhs, rhs, g):
    """Output and both cotangents, compiled (eager JAX compiles op by op)."""

    def run(lhs, rhs, g):
        out, pullback = jax.vjp(f, lhs, rhs)
        return (out, *pullback(g))

    return jax.jit(run)(lhs, rhs, g)


def vjps(fs, lhs, rhs, g):
    """``vjp`` of each of ``fs``, compiled as one program (one compile, not one
    per function: compiles are most of this file's time)."""

    def run(lhs, rhs, g):
        results = []
        for f in fs:
            out, pullback = jax.vjp(f, lhs, rhs)
            results.append((out, *pullback(g)))
        return results

    return jax.jit(run)(lhs, rhs, g)


def assert_bits_equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_signature_is_exactly_lax_dot_general_plus_keywords_state_diagnostics():
    def params(f):
        return [
            (p.name, p.kind, p.default)
            for p in inspect.signature(f).parameters.values()
        ]

    ours = params(qbits.dot_general(DotGeneralConfig()))
    assert ours[:-2] == params(lax.dot_general)
    assert ours[-2:] == [
        ("state", inspect.Parameter.KEYWORD_ONLY, None),
        ("diagnostics", inspect.Parameter.KEYWORD_ONLY, None),
    ]


IDENTITY_CASES = [(*d, jnp.float32, None) for d in DIMS] + [
    (*d, dtype, pet)
    for d in DIMS[:5]
    for dtype, pet in ((jnp.bfloat16, None), (jnp.bfloat16, jnp.float32))
]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dn, dtype, pet", IDENTITY_CASES)
def test_identity_config_is_lax_dot_general_bit_for_bit(
    lhs_shape, rhs_shape, dn, dtype, pet
):
    lhs, rhs = operands(lhs_shape, rhs_shape, dtype)
    identity = MatmulConfig()
    dg = qbits.dot_general(DotGeneralConfig(identity, identity, identity))
    ours = functools.partial(dg, dimension_numbers=dn, preferred_element_type=pet)
    ref = functools.partial(
        lax.dot_general, dimension_numbers=dn, preferred_element_type=pet
    )
    g = cotangent(lhs, rhs, dn).astype(pet or dtype)
    got, want = vjps((ours, ref), lhs, rhs, g)
    assert_bits_equal(got, want)
    if len(lhs_shape) == 2 and pet is None:  # eagerly too, for a few
        eager = jax.vjp(ours, lhs, rhs)
        assert_bits_equal((eager[0], *eager[1](g)), want)


# Every layout in float32; bfloat16 with a float32 result (the dtype path,
# which does not depend on the layout) on the first five, as above.
@pytest.mark.parametrize(
    "lhs_shape, rhs_shape, dn, dtype, pet",
    [(*d, jnp.float32, None) for d in DIMS]
    + [(*d, jnp.bfloat16, jnp.float32) for d in DIMS[:5]],
)
def test_custom_vjp_transposes_exactly_like_jax(lhs_shape, rhs_shape, dn, dtype, pet):
    # A forward-only config goes through qbits' custom VJP, but its backward
    # matmuls are float: with the same cotangent, both gradients must be the
    # ones JAX computes for lax.dot_general, bit for bit.
    lhs, rhs = operands(lhs_shape, rhs_shape, dtype)
    fwd = MatmulConfig(lhs=INT8, rhs=INT8)
    dg = qbits.dot_general(DotGeneralConfig(fwd=fwd))
    ours = functools.partial(dg, dimension_numbers=dn, preferred_element_type=pet)
    ref = functools.partial(
        lax.dot_general, dimension_numbers=dn, preferred_element_type=pet
    )
    g = cotangent(lhs, rhs, dn).astype(pet or dtype)
    (_, dl, dr), (_, dl_ref, dr_ref) = vjps((ours, ref), lhs, rhs, g)
    assert_bits_equal((dl, dr), (dl_ref, dr_ref))


def int8_all(mode="real", **kw):
    m = MatmulConfig(lhs=INT8, rhs=INT8, mode=mode, **kw)
    return DotGeneralConfig(m, m, m)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dn", [d for d in DIMS if d[2][0][0]])
def test_int8_real_equals_fake_within_float32_rounding(lhs_shape, rhs_shape, dn):
    lhs, rhs = operands(lhs_shape, rhs_shape)
    g = cotangent(lhs, rhs, dn)
    real, fake, exact = vjps(
        [
            functools.partial(qbits.dot_general(int8_all(mode)), dimension_numbers=dn)
            for mode in ("real", "fake")
        ]
        + [functools.partial(lax.dot_general, dimension_numbers=dn)],
        lhs,
        rhs,
        g,
    )
    for r, f in zip(real, fake, strict=True):
        np.testing.assert_allclose(r, f, rtol=2e-5, atol=2e-5 * float(jnp.abs(f).max()))
    # And the quantization is real: far from float.
    assert not np.allclose(real[0], exact[0], rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=(0, 2))
def quant(quantizer, x, contracting):
    """``quantizer.quant``, compiled (eagerly, each of its ops compiles alone)."""
    return quantizer.quant(x, contracting_axes=contracting)


@functools.partial(jax.jit, static_argnums=(0, 2))
def fq(quantizer, x, contracting):
    return quantizer.quant(x, contracting_axes=contracting).dequant()


def test_gradients_are_what_the_configured_backward_matmuls_compute():
    # x [B, I] . w [I, O]; each backward matmul quantizes with its own config.
    x, w = operands((8, 16), (16, 12))
    g = jax.random.normal(jax.random.key(5), (8, 12))
    int4 = Quantizer(IntNumerics(bits=4), granularity=PerChannel())
    e5m2 = Quantizer(qbits.numerics.Fp8Numerics("float8_e5m2"))
    e4m3 = Quantizer(qbits.numerics.Fp8Numerics("float8_e4m3fn"))
    config = DotGeneralConfig(
        fwd=MatmulConfig(lhs=INT8, rhs=INT8),
        dlhs=MatmulConfig(lhs=int4, rhs=INT8, mode="fake"),
        drhs=MatmulConfig(lhs=e5m2, rhs=e4m3, mode="fake"),
    )
    dn = (((1,), (0,)), ((), ()))
    out, dx, dw = vjp(
        functools.partial(qbits.dot_general(config), dimension_numbers=dn), x, w, g
    )
    np.testing.assert_allclose(
        out, fq(INT8, x, (1,)) @ fq(INT8, w, (0,)), rtol=1e-5, atol=1e-5
    )
    # dx = g . w^T: g contracted over O (axis 1), w over O (axis 1).
    np.testing.assert_allclose(
        dx, fq(int4, g, (1,)) @ fq(INT8, w, (1,)).T, rtol=1e-6, atol=1e-6
    )
    # dw = x^T . g: g contracted over B (axis 0), x over B (axis 0).
    np.testing.assert_allclose(
        dw, fq(e4m3, x, (0,)).T @ fq(e5m2, g, (0,)), rtol=1e-6, atol=1e-6
    )


def test_clip_gradient_masks_the_forward_operands():
    clipped = Quantizer(IntNumerics(bits=8, clip_gradient=True), ConstantBound(1.0))
    config = DotGeneralConfig(fwd=MatmulConfig(lhs=clipped, rhs=clipped))
    x = jnp.array([[0.5, -2.0, 0.25]])
    w = jnp.array([[0.9], [0.5], [3.0]])  # int8 clips at 127/127.5 of the bound
    dx, dw = jax.grad(
        lambda x, w: qbits.dot_general(config)(x, w, (((1,), (0,)), ((), ()))).sum(),
        argnums=(0, 1),
    )(x, w)
    # Straight-through inside [-1, 1], zero outside, on each operand.
    np.testing.assert_array_equal(dx, w.T * jnp.array([[1.0, 0.0, 1.0]]))  # g . w
    np.testing.assert_array_equal(dw, [[0.5], [-2.0], [0.0]])


def test_use_fwd_quant_reuses_the_forward_operands():
    x, w = operands((8, 16), (16, 12))
    g = jax.random.normal(jax.random.key(6), (8, 12))
    reuse = MatmulConfig(lhs=INT8, rhs=INT8, use_fwd_quant=True)
    config = DotGeneralConfig(
        fwd=MatmulConfig(lhs=INT8, rhs=INT8), dlhs=reuse, drhs=reuse
    )
    dn = (((1,), (0,)), ((), ()))
    for mode in ("real", "fake"):
        cfg = config.replace(
            dlhs=reuse.replace(mode=mode), drhs=reuse.replace(mode=mode)
        )
        _, dx, dw = vjp(
            functools.partial(qbits.dot_general(cfg), dimension_numbers=dn), x, w, g
        )
        wq = quant(INT8, w, (0,))  # the forward's w: scale per column
        xq = quant(INT8, x, (1,))  # the forward's x: scale per row
        # dx = g . w^T with w's scale folded into g, then g quantized.
        g_l = fq(INT8, g * wq.scale, (1,))
        np.testing.assert_allclose(dx, g_l @ wq.qvalue.T, rtol=2e-5, atol=1e-5)
        # dw = x^T . g with x's (per-row) scale folded into g.
        g_r = fq(INT8, g * xq.scale.reshape(8, 1), (0,))
        np.testing.assert_allclose(dw, xq.qvalue.T @ g_r, rtol=2e-5, atol=1e-5)


def test_tiled_and_mx_real_equal_fake():
    # Every matmul's contracting axis (128, 64, 32) holds whole tiles of 32.
    x, w = operands((32, 128), (128, 64))
    g = jax.random.normal(jax.random.key(7), (32, 64))
    dn = (((1,), (0,)), ((), ()))
    for quantizer in (
        Quantizer(IntNumerics(bits=8), granularity=qbits.Tiled(tile_size=32)),
        qbits.presets.mx_quantizer("float8_e4m3fn"),
        qbits.presets.mx_quantizer("float4_e2m1fn"),
        qbits.presets.mx_quantizer("int8"),
    ):
        fs = []
        for mode in ("real", "fake"):
            m = MatmulConfig(lhs=quantizer, rhs=quantizer, mode=mode)
            fs.append(
                functools.partial(
                    qbits.dot_general(DotGeneralConfig(m, m, m)), dimension_numbers=dn
                )
            )
        results = vjps(fs, x, w, g)
        for r, f in zip(*results, strict=True):
            np.testing.assert_allclose(
                r, f, rtol=1e-5, atol=1e-5 * float(jnp.abs(f).max())
            )


@pytest.mark.parametrize(
    "numerics",
    [
        qbits.numerics.Fp8Numerics(),
        IntNumerics(bits=4),
        qbits.FpNumerics("float6_e2m3fn"),
    ],
)
def test_other_formats_real_equal_fake(numerics):
    x, w = operands((4, 32), (32, 8))
    q = Quantizer(numerics, granularity=PerChannel())
    dn = (((1,), (0,)), ((), ()))
    out = {
        mode: jax.jit(
            qbits.dot_general(
                DotGeneralConfig(fwd=MatmulConfig(lhs=q, rhs=q, mode=mode))
            ),
            static_argnums=2,
        )(x, w, dn)
        for mode in ("real", "fake")
    }
    np.testing.assert_allclose(out["real"], out["fake"], rtol=1e-5, atol=1e-5)


def test_weight_only_int8_with_float_activations():
    x, w = operands((4, 32), (32, 8))
    config = DotGeneralConfig(fwd=MatmulConfig(lhs=NONE, rhs=INT8))
    dn = (((1,), (0,)), ((), ()))
    out = qbits.dot_general(config)(x, w, dn)
    np.testing.assert_allclose(out, x @ fq(INT8, w, (0,)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        qbits.presets.get("int4_weight_only"),
        DotGeneralConfig(fwd=MatmulConfig(lhs=NONE, rhs=INT8)),
        DotGeneralConfig(dlhs=MatmulConfig(lhs=NONE, rhs=INT8)),  # g . Q(w)^T
    ],
    ids=["int4_weight_only", "int8_weight_only", "int8_weight_only_dlhs"],
)
def test_weight_only_results_that_float32_holds_stay_finite(config):
    # Float activations meet the weight's codes (up to 7 or 127) before the
    # scales: 4e36 * 127 * 128 overflowed float32, the result (~3e36) does
    # not. Rows that cannot overflow keep their bits.
    small, w = operands((3, 128), (128, 5), seed=2)
    x = small.at[:2].multiply(4e36)
    dg = qbits.dot_general(config)

    @jax.jit
    def run(x):
        out, vjp = jax.vjp(lambda x: dg(x, w, MM), x)
        return out, vjp(jnp.ones_like(out) * 4e36)[0]

    out, gx = run(x)
    fwd_w = fq(config.fwd.rhs, w, (0,))
    bwd_w = fq(config.dlhs.rhs, w, (1,))
    want = np.asarray(x, np.float64) @ np.asarray(fwd_w, np.float64)
    want_gx = np.full((3, 5), 4e36) @ np.asarray(bwd_w, np.float64).T
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(gx))
    np.testing.assert_allclose(out, want, rtol=1e-5)
    np.testing.assert_allclose(gx, want_gx, rtol=1e-5)
    np.testing.assert_array_equal(out[2], run(small)[0][2])


def test_int8_dots_are_native_s8_in_the_optimized_hlo():
    x, w = operands((16, 64), (64, 32))
    dg = qbits.dot_general(int8_all())
    dn = (((1,), (0,)), ((), ()))

    def loss(x, w):
        return jnp.sum(dg(x, w, dn) ** 2)

    dots = qbits.hlo.dot_dtypes(jax.grad(loss, argnums=(0, 1)), x, w)
    # The forward and both gradient matmuls (dlhs is live: x is differentiated)
    # stay s8 x s8 -> s32; XLA widens what it cannot run natively.
    assert dots == [("s8", "s8", "s32")] * 3


def test_preferred_element_type_and_precision_are_honoured():
    lhs, rhs = operands((4, 8), (8, 3), jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    for config in (int8_all("real"), int8_all("fake")):
        dg = qbits.dot_general(config)
        assert dg(lhs, rhs, dn).dtype == jnp.bfloat16
        # The rest traced only (the dtypes are the traced ones).
        pet = jax.eval_shape(lambda a, dg=dg: dg(a, rhs, dn, None, jnp.float32), lhs)
        assert pet.dtype == jnp.float32
        grad = jax.grad(lambda a, dg=dg: dg(a, rhs, dn, None, jnp.float32).sum())
        assert jax.eval_shape(grad, lhs).dtype == jnp.bfloat16
    fake = qbits.dot_general(int8_all("fake"))
    jaxpr = str(
        jax.make_jaxpr(lambda a, b: fake(a, b, dn, lax.Precision.HIGHEST))(lhs, rhs)
    )
    assert "precision=(Precision.HIGHEST, Precision.HIGHEST)" in jaxpr


def test_works_under_jit_vmap_checkpoint_and_scan():
    dg = qbits.dot_general(int8_all())
    dn = (((1,), (0,)), ((), ()))
    ws = jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (5, 16))

    def layer(h, w):
        return jnp.tanh(dg(h, w, dn)), None

    def loss(ws, x):
        h, _ = lax.scan(jax.checkpoint(layer), x, ws)
        return jnp.sum(h**2)

    grads = jax.jit(jax.grad(loss))(ws, x)
    unrolled = jax.jit(
        jax.grad(
            lambda ws, x: jnp.sum(
                layer(layer(layer(x, ws[0])[0], ws[1])[0], ws[2])[0] ** 2
            )
        )
    )(ws, x)
    np.testing.assert_allclose(grads, unrolled, rtol=1e-5, atol=1e-6)
    # vmap over a batch of examples equals the batched call per example.
    per_example = jax.vmap(lambda xi: dg(xi[None], ws[0], dn)[0])(x)
    np.testing.assert_allclose(
        per_example,
        jnp.concatenate([dg(x[i : i + 1], ws[0], dn) for i in range(5)]),
        rtol=1e-6,
        atol=1e-6,
    )
    g = jax.jit(jax.vmap(jax.grad(lambda xi: dg(xi[None], ws[0], dn).sum())))(x)
    assert g.shape == x.shape


def test_stochastic_rounding_needs_a_key_up_front():
    noisy = Quantizer(
        IntNumerics(bits=8, noise_fn=qbits.numerics.UniformNoise()),
        granularity=PerChannel(),
    )
    config = DotGeneralConfig(
        fwd=MatmulConfig(lhs=INT8, rhs=INT8),
        dlhs=MatmulConfig(lhs=noisy, rhs=INT8),
        drhs=MatmulConfig(lhs=noisy, rhs=INT8),
    )
    with pytest.raises(
        InvalidArgumentError, match=r"dot_general: key=None .*stochastic"
    ):
        qbits.dot_general(config)
    x, w = operands((4, 8), (8, 3))
    r = jax.random.normal(jax.random.key(9), (4, 3))  # a cotangent with variety
    dn = (((1,), (0,)), ((), ()))

    def grads(key):
        return jax.grad(lambda x: (qbits.dot_general(config, key)(x, w, dn) * r).sum())(
            x
        )

    a, b = grads(jax.random.key(0)), jax.jit(grads)(jax.random.key(0))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, grads(jax.random.key(1)))


def test_jnp_einsum_with_dot_general():
    dg = qbits.dot_general(int8_all("fake"))
    a, b = operands((2, 3, 8), (2, 8, 5))
    ours = jnp.einsum("bij,bjk->bik", a, b, _dot_general=dg)
    ref = fq(INT8, a, (2,)).reshape(2, 3, 8) @ fq(INT8, b, (1,))
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    jax.jit(
        jax.grad(lambda a: jnp.einsum("bij,bjk->bik", a, b, _dot_general=dg).sum())
    )(a)


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda dg, a, b: dg(a, b, ((1,), (0,))), r"dimension_numbers="),
        (
            lambda dg, a, b: dg(a, b, (((3,), (0,)), ((), ()))),
            r"within the operand ranks",
        ),
        (
            lambda dg, a, b: dg(a.astype(jnp.int32), b, (((1,), (0,)), ((), ()))),
            r"lhs.dtype=int32",
        ),
    ],
)
def test_bad_calls(call, pattern):
    a, b = operands((4, 8), (8, 3))
    with pytest.raises(InvalidArgumentError, match=pattern):
        call(qbits.dot_general(int8_all()), a, b)


def test_shape_mismatch_is_reported_by_lax():
    a, b = operands((4, 8), (7, 3))
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        qbits.dot_general(int8_all())(a, b, (((1,), (0,)), ((), ())))


def test_real_mode_needs_factorable_scales():
    elementwise = Quantizer(IntNumerics(bits=8), granularity=PerChannel(shared_axes=()))
    config = DotGeneralConfig(fwd=MatmulConfig(lhs=elementwise, rhs=INT8))
    a, b = operands((4, 8), (8, 3))
    with pytest.raises(
        InvalidArgumentError, match=r"mode='real' .*'fake' for these scales"
    ):
        qbits.dot_general(config)(a, b, (((1,), (0,)), ((), ())))
    fake = DotGeneralConfig(fwd=MatmulConfig(lhs=elementwise, rhs=INT8, mode="fake"))
    qbits.dot_general(fake)(a, b, (((1,), (0,)), ((), ())))


@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda: MatmulConfig(lhs="int8"), r"MatmulConfig: lhs='int8'"),
        (lambda: MatmulConfig(mode="emulated"), r"mode='emulated' .*'real' or 'fake'"),
        (lambda: MatmulConfig(accumulator=jnp.int16), r"accumulator=int16"),
        (
            lambda: DotGeneralConfig(fwd=MatmulConfig(use_fwd_quant=True)),
            r"fwd.use_fwd_quant",
        ),
        (
            lambda: DotGeneralConfig(dlhs=MatmulConfig(use_fwd_quant=True)),
            r"dlhs.use_fwd_quant=True .*fwd.rhs does not quantize",
        ),
        (lambda: qbits.dot_general("int9"), r"dot_general: config='int9'"),
        (lambda: qbits.dot_general("int8"), r"dot_general: key=None"),
    ],
)
def test_bad_configs(build, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        build()


def test_fp8_lowers_to_the_gpu_fp8_gemm_pattern():
    # XLA's GPU compiler rewrites a dot of fp8 operands with per-tensor scales
    # into a cuBLASLt FP8 GEMM; E5M2 x E5M2 is not supported there.
    e4m3 = Quantizer(qbits.numerics.Fp8Numerics("float8_e4m3fn"))
    e5m2 = Quantizer(qbits.numerics.Fp8Numerics("float8_e5m2"))
    config = DotGeneralConfig(
        fwd=MatmulConfig(lhs=e4m3, rhs=e4m3),
        dlhs=MatmulConfig(lhs=e5m2, rhs=e4m3),
        drhs=MatmulConfig(lhs=e5m2, rhs=e4m3),
    )
    dg = qbits.dot_general(config)
    dn = (((1,), (0,)), ((), ()))
    x, w = operands((16, 32), (32, 8))
    text = (
        jax.jit(jax.grad(lambda x, w: jnp.sum(dg(x, w, dn) ** 2), argnums=(0, 1)))
        .lower(x, w)
        .as_text()
    )
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    operand_types = [line.rsplit(":", 1)[1] for line in dots]
    assert len(operand_types) == 3
    assert (
        "(tensor<16x32xf8E4M3FN>, tensor<32x8xf8E4M3FN>) -> tensor<16x8xf32>"
        in operand_types[0]
    )
    assert all(
        "xf8E5M2>, tensor<" in t and "xf8E4M3FN>)" in t for t in operand_types[1:]
    )


# ------------------------------------------------- nothing silent at the edges

MM = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize(
    ("bits", "k", "int32"),
    [(16, 2, True), (16, 3, False), (14, 33, False), (12, 513, False), (8, 4096, True)],
)
def test_integer_accumulator_never_overflows(bits, k, int32):
    q = Quantizer(IntNumerics(bits=bits))
    dg = qbits.dot_general(DotGeneralConfig(MatmulConfig(lhs=q, rhs=q)))
    x, w = jnp.ones((1, k)), jnp.ones((k, 1))
    top = 2 ** (bits - 1) - 1
    expected = k * (top / (top + 0.5)) ** 2  # 1.0 is stored as top, scale 1/(top+.5)
    np.testing.assert_allclose(dg(x, w, MM), [[expected]], rtol=1e-6)
    dtypes = qbits.hlo.dot_dtypes(lambda a, b: dg(a, b, MM), x, w, stage="jaxpr")
    assert (dtypes[0][2] == "int32") == int32, dtypes


def test_explicit_int32_accumulator_that_could_overflow_raises():
    q = Quantizer(IntNumerics(bits=16))
    cfg = DotGeneralConfig(MatmulConfig(lhs=q, rhs=q, accumulator="int32"))
    with pytest.raises(qbits.InvalidArgumentError, match="accumulator"):
        qbits.dot_general(cfg)(jnp.ones((1, 3)), jnp.ones((3, 1)), MM)


def test_real_mode_refuses_unclipped_integer_grids():
    unclipped = Quantizer(IntNumerics(bits=8, clip=False), qbits.ConstantBound(1.0))
    with pytest.raises(qbits.InvalidArgumentError, match=r"lhs\.numerics\.clip"):
        MatmulConfig(lhs=unclipped)
    fake = MatmulConfig(lhs=unclipped, mode="fake")  # unclipped, as documented
    out = qbits.dot_general(DotGeneralConfig(fake))(
        jnp.full((1, 1), 3.0), jnp.ones((1, 1)), MM
    )
    np.testing.assert_allclose(out, [[3.0]], rtol=0.01)


@pytest.mark.parametrize("axis", [1.7, "1", None])
def test_non_integer_dimension_numbers_are_refused(axis):
    dg = qbits.dot_general(qbits.presets.get("int8_fwd"))
    with pytest.raises(qbits.InvalidArgumentError, match="dimension_numbers"):
        dg(jnp.ones((2, 3)), jnp.ones((3, 4)), (((axis,), (0,)), ((), ())))


@pytest.mark.parametrize(
    "forward",
    [
        lambda f, x: jax.jvp(f, (x,), (x,)),
        lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
        lambda f, x: jax.jacfwd(f)(x),
        lambda f, x: jax.linearize(f, x)[1](x),  # linearize traces; apply raises
        lambda f, x: jax.jit(jax.linearize(f, x)[1])(x),
        lambda f, x: jax.jit(jax.jacrev(jax.jacfwd(lambda x: jnp.sum(f(x)))))(x),
    ],
)
def test_forward_mode_autodiff_gives_a_clear_error(forward):
    dg = qbits.dot_general(qbits.presets.get("int8_fwd"))
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    with pytest.raises(qbits.InvalidArgumentError, match=r"forward-mode.*jax\.grad"):
        forward(lambda x: dg(x, w, MM), x)


def _straight_through_hessians(preset):
    """Hessians of 0.5 |x w|^2 in x and in w, and what straight-through gives."""
    config = qbits.presets.get(preset)
    dg = qbits.dot_general(config, jax.random.key(3))
    x, w = operands((2, 3), (3, 4), seed=4)

    def loss(x, w):
        return 0.5 * jnp.sum(dg(x, w, MM) ** 2)

    # y = Q(x) Qf(w); dy = dx Qf(w) + Q(x) dw; the gradients are
    # g Qb(w)^T and Qb(x)^T g with g = y: straight-through in g.
    wf, xf = fq(config.fwd.rhs, w, (0,)), fq(config.fwd.lhs, x, (1,))
    wb, xb = fq(config.dlhs.rhs, w, (1,)), fq(config.drhs.rhs, x, (0,))
    # [2, 3, 2, 3] and [3, 4, 3, 4]: the rows of x are independent, and the
    # columns of w.
    hx, hw = jax.jit(
        lambda x, w: (jax.hessian(loss, 0)(x, w), jax.hessian(loss, 1)(x, w))
    )(x, w)
    want_x = jnp.einsum("kn,jn->kj", wb, wf)
    want_w = jnp.einsum("mk,mj->kj", xb, xf)
    return hx, hw, want_x, want_w


def test_second_derivatives_are_straight_through():
    # int8: the output gradient is quantized (stochastically) in both
    # backward matmuls, which keep the operands as int8 codes.
    hx, hw, want_x, want_w = _straight_through_hessians("int8")
    for i in range(2):
        np.testing.assert_allclose(hx[i, :, i, :], want_x, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(hx[i, :, 1 - i, :], 0.0)
    for n in range(4):
        np.testing.assert_allclose(hw[:, n, :, n], want_w, rtol=1e-6, atol=1e-6)


def test_mixed_second_derivative_through_kept_codes_is_refused():
    # int8's weight gradient keeps x as int8 codes: its derivative in x has
    # nothing to go through (a silent zero before).
    dg = qbits.dot_general(qbits.presets.get("int8"), jax.random.key(0))
    x, w = operands((2, 5), (5, 4))
    with pytest.raises(
        qbits.InvalidArgumentError,
        match=r"mixed second derivative.*keeps rhs as quantized codes.*int8_fwd",
    ):
        jax.jit(jax.hessian(lambda x, w: jnp.sum(dg(x, w, MM) ** 2), (0, 1)))(x, w)


# The smallest operands each preset's granularities fit (tiles of 32 or 128
# along every axis some matmul contracts).
_PRESET_SHAPES = {
    "int4_weight_only": (2, 128, 3),
    "fp8_blockwise": (128, 128, 128),
    "mxfp8": (32, 32, 32),
    "mxfp4": (32, 32, 32),
    "w4g128_asym": (2, 128, 3),
    "nf4": (2, 64, 3),
    "nf4_dq": (2, 64, 3),
    "nvfp4": (2, 16, 3),
    "nvfp4_weight_only": (2, 16, 3),
    "w1_58a8": (16, 64, 16),
}
# Ternary weights are not near the float ones: f'' along x, |u W_q|^2, was
# 0.55 to 0.7 of the float one (40 seeds at these shapes).
_PRESET_TOLERANCE = {"w1_58a8": 0.6}


def _keeps_codes(config):
    """Whether a backward matmul keeps its forward operand as quantized codes."""
    return any(
        m.use_fwd_quant or m.rhs.numerics != qbits.numerics.NoNumerics()
        for m in (config.dlhs, config.drhs)
    )


@pytest.mark.parametrize("preset", qbits.presets.names())
@settings(max_examples=max(1, settings().max_examples // 25))
@given(
    which=st.sampled_from(["lhs", "rhs", "both"]),
    how=st.sampled_from(["hessian", "linearize", "grad_of_grad"]),
    seed=st.integers(0, 2**16),
)
def test_second_derivatives_of_every_preset(preset, which, how, seed):
    # f(t) = 0.5 |x(t) w(t)|^2 along a random direction of x, w or both:
    # f''(0) is straight-through (near the float one, never zero), or a
    # mixed derivative through quantized codes is refused.
    config = qbits.presets.get(preset)
    m, k, n = _PRESET_SHAPES.get(preset, (3, 8, 5))
    keys = jax.random.split(jax.random.key(seed), 5)
    x0, u = (jax.random.normal(kk, (m, k)) for kk in keys[:2])
    w0, v = (jax.random.normal(kk, (k, n)) for kk in keys[2:4])
    u, v = (u if which != "rhs" else 0 * u), (v if which != "lhs" else 0 * v)
    dg = qbits.dot_general(config, keys[4])
    state = dg.init_state(x0, w0, MM) if config.needs_state else None

    def f(t):
        x = x0 + t * u if which != "rhs" else x0
        w = w0 + t * v if which != "lhs" else w0
        return 0.5 * jnp.sum(dg(x, w, MM, state=state) ** 2)

    second = {
        "hessian": jax.hessian(f),
        "linearize": lambda t: jax.linearize(jax.grad(f), t)[1](jnp.ones_like(t)),
        "grad_of_grad": jax.grad(jax.grad(f)),
    }[how]
    t0 = jnp.float32(0.0)
    if which == "both" and _keeps_codes(config):
        with pytest.raises(qbits.InvalidArgumentError, match="mixed second"):
            jax.jit(second)(t0)
        return
    got = float(jax.jit(second)(t0))
    x0, u, w0, v = (np.asarray(a, np.float64) for a in (x0, u, w0, v))
    want = np.sum((u @ w0 + x0 @ v) ** 2) + 2 * np.sum((x0 @ w0) * (u @ v))
    assert np.isfinite(got)
    assert abs(got - want) <= _PRESET_TOLERANCE.get(preset, 0.3) * abs(want), (
        got,
        want,
    )


@pytest.mark.parametrize("preset", ["int8", "fp8", "mxfp8", "int4_weight_only"])
@pytest.mark.parametrize(
    ("lhs_shape", "rhs_shape"), [((0, 128), (128, 128)), ((128, 0), (0, 128))]
)
def test_zero_size_operands_give_what_lax_gives(preset, lhs_shape, rhs_shape):
    config = qbits.presets.get(preset)
    dg = qbits.dot_general(config, jax.random.key(0) if config.needs_key else None)
    x, w = jnp.ones(lhs_shape), jnp.ones(rhs_shape)
    out = dg(x, w, MM)
    np.testing.assert_array_equal(out, lax.dot_general(x, w, MM))
    gx, gw = jax.grad(lambda x, w: dg(x, w, MM).sum(), (0, 1))(x, w)
    assert gx.shape == x.shape and gw.shape == w.shape
    assert not bool(jnp.any(gw)) and not bool(jnp.any(gx))


@pytest.mark.parametrize("preset", ["int8_fwd", "int8", "fp8", "mxfp8", "w4a8"])
@pytest.mark.parametrize("magnitude", [1e-37, 1e30])
def test_tiny_and_huge_operands_keep_their_results(preset, magnitude):
    config = qbits.presets.get(preset)
    dg = qbits.dot_general(config, jax.random.key(0) if config.needs_key else None)
    k = jax.random.split(jax.random.key(1), 2)
    x = jnp.abs(jax.random.normal(k[0], (4, 64))) * magnitude
    w = jnp.abs(jax.random.normal(k[1], (64, 32))) * (1e-3 if magnitude > 1 else 1.0)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    got = np.asarray(jax.jit(dg, static_argnums=2)(x, w, MM), np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=0.15)


@pytest.mark.parametrize(
    ("preset", "policy"),
    [
        ("int8", None),
        ("fp8_delayed", jax.checkpoint_policies.nothing_saveable),
        ("int8", jax.checkpoint_policies.dots_saveable),
        ("fp8", jax.checkpoint_policies.everything_saveable),
        ("fp8_delayed", jax.checkpoint_policies.dots_saveable),
    ],
)
def test_remat_gives_the_same_gradients_and_state(preset, policy):
    config = qbits.presets.get(preset)
    dg = qbits.dot_general(config, jax.random.key(3) if config.needs_key else None)
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (16, 32))
    w1 = jax.random.normal(k[1], (32, 64)) / 6
    w2 = jax.random.normal(k[2], (64, 8)) / 8
    s1 = dg.init_state(x, w1, MM) if config.needs_state else None
    s2 = dg.init_state(x @ w1, w2, MM) if s1 is not None else None

    def block(x, w1, w2, s1, s2):
        h = jnp.tanh(dg(x, w1, MM, state=s1))
        return dg(h, w2, MM, state=s2)

    def loss(block, args):
        return jnp.sum(block(*args) ** 2)

    args = (x, w1, w2, s1, s2)
    argnums = (1, 2, 3, 4) if s1 is not None else (1, 2)
    remat = jax.checkpoint(block, policy=policy)
    # One program (one compile); the remat's recomputation stays its own.
    want, got = jax.jit(
        lambda *a: (
            jax.grad(lambda *a: loss(block, a), argnums)(*a),
            jax.grad(lambda *a: loss(remat, a), argnums)(*a),
        )
    )(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# float16 takes the dtype path bfloat16 takes: it runs with int8 and the
# identity config; fp8 and fp8_delayed run in bfloat16 and float32.
@pytest.mark.parametrize(
    ("preset", "pet", "dtype"),
    [(preset, pet, dtype)
     for preset, pet in (("int8", None), ("none", None), ("none", jnp.float32))
     for dtype in (jnp.bfloat16, jnp.float16, jnp.float32)]
    + [(preset, pet, dtype)
       for preset, pet in (("fp8", jnp.float32), ("fp8_delayed", None))
       for dtype in (jnp.bfloat16, jnp.float32)],
)  # fmt: skip
def test_mixed_precision_keeps_the_dtypes_lax_gives(dtype, pet, preset):
    config = qbits.presets.get(preset)
    dg = qbits.dot_general(config, jax.random.key(0) if config.needs_key else None)
    k = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(k[0], (8, 32)).astype(dtype)
    w = (jax.random.normal(k[1], (32, 16)) / 6).astype(dtype)
    state = dg.init_state(x, w, MM) if config.needs_state else None

    def f(x, w):
        return dg(x, w, MM, preferred_element_type=pet, state=state)

    grad = jax.grad(lambda x, w: f(x, w).astype(jnp.float32).sum(), (0, 1))
    # The lax reference, the output and its gradients: one program.
    want, out, (gx, gw) = jax.jit(
        lambda x, w: (
            lax.dot_general(x, w, MM, preferred_element_type=pet),
            f(x, w),
            grad(x, w),
        )
    )(x, w)
    assert out.dtype == want.dtype
    assert gx.dtype == x.dtype and gw.dtype == w.dtype
    if preset == "none":  # the identity config is lax itself, in every dtype
        np.testing.assert_array_equal(out, want)
    else:
        ref = np.asarray(want, np.float32)
        err = np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max()
        assert err < 0.1, err


@pytest.mark.parametrize("preset", ["int8", "fp8", "fp8_delayed", "int8_fwd"])
def test_a_gradient_nobody_needs_is_not_computed(preset):
    # The first layer's input gradient (or a frozen weight's) is never
    # traced: the same core, differentiated with respect to different
    # arguments (and first in a scan where everything is differentiated),
    # gives the same gradients, and only the dots it needs.
    config = qbits.presets.get(preset)
    dg = qbits.dot_general(config, jax.random.key(2) if config.needs_key else None)
    k = jax.random.split(jax.random.key(0), 3)
    ws = jax.random.normal(k[0], (3, 32, 32)) / 6
    x = jax.random.normal(k[1], (16, 32))
    state = dg.init_state(x, ws[0], MM) if config.needs_state else None

    def layer(h, w):
        return jnp.tanh(dg(h, w, MM, state=state)), None

    def scanned(ws, x):
        return jnp.sum(lax.scan(layer, x, ws)[0] ** 2)

    def unrolled(ws, x):
        for w in ws:
            x = layer(x, w)[0]
        return jnp.sum(x**2)

    # One program (one compile) runs the three.
    _, both, only_ws = jax.jit(
        lambda ws, x: (
            jax.grad(scanned, (0, 1))(ws, x),
            jax.grad(unrolled, (0, 1))(ws, x),
            jax.grad(unrolled)(ws, x),
        )
    )(ws, x)
    np.testing.assert_array_equal(only_ws, both[0])

    @functools.cache
    def jaxpr_of(argnums):
        return jax.make_jaxpr(jax.grad(unrolled, argnums))(ws, x).jaxpr

    def count(argnums, prefix):
        return sum(
            e.primitive.name.startswith(prefix) for e in _eqns(jaxpr_of(argnums))
        )

    # Neither the dots of a gradient nobody needs nor the quantization of
    # their operands (a reduction each for its scale) are traced.
    for unneeded in (0, 1):  # the first input gradient; all weight gradients
        assert count(unneeded, "dot_general") < count((0, 1), "dot_general")
        assert count(unneeded, "reduce") <= count((0, 1), "reduce")
    if preset == "int8":  # its residuals are quantized along their own axes
        assert count(0, "reduce") < count((0, 1), "reduce")


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it, per call site."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple | list) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)
