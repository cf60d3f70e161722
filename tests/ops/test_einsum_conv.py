import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qbits
from qbits import (
    DotGeneralConfig,
    IntNumerics,
    InvalidArgumentError,
    MatmulConfig,
    Quantizer,
)

INT8 = Quantizer(IntNumerics(bits=8), granularity=qbits.PerChannel())
TENSOR8 = Quantizer(IntNumerics(bits=8))
INT4 = Quantizer(IntNumerics(bits=4))
NONE = Quantizer(qbits.numerics.NoNumerics())


def all3(lhs, rhs, mode="real"):
    m = MatmulConfig(lhs=lhs, rhs=rhs, mode=mode)
    return DotGeneralConfig(m, m, m)


EINSUMS = [
    ("ij,jk->ik", (3, 4), (4, 5)),
    ("bd,dh->bh", (2, 8), (8, 4)),
    ("jk,ij->ik", (4, 5), (3, 4)),  # jnp.einsum swaps these operands
    ("hd,bd->bh", (4, 8), (2, 8)),  # and these
    ("bthd,bshd->bhts", (2, 5, 4, 8), (2, 7, 4, 8)),
    ("...d,dh->...h", (2, 3, 8), (8, 4)),
    ("...ij,...jk->...ik", (2, 3, 4), (2, 4, 5)),
    ("...ij,...jk", (1, 3, 4), (2, 4, 5)),  # implicit output, broadcast '...'
    ("ij,jk", (3, 4), (4, 5)),
    ("btd,dx->bt", (2, 3, 4), (4, 6)),  # x is summed out of the rhs first
    ("i,i->", (5,), (5,)),
    ("ij,kl->ijkl", (2, 3), (4, 5)),
]


def operands(sa, sb, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, sa), jax.random.normal(k2, sb)


@pytest.mark.parametrize("subscripts, sa, sb", EINSUMS)
def test_identity_einsum_matches_jnp_einsum(subscripts, sa, sb):
    a, b = operands(sa, sb)
    op = qbits.einsum(DotGeneralConfig())
    ours, ref = jax.jit(  # one compile
        lambda a, b: (op(subscripts, a, b), jnp.einsum(subscripts, a, b))
    )(a, b)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("subscripts, sa, sb", EINSUMS)
def test_config_sides_follow_the_users_operand_order(subscripts, sa, sb):
    # int4 on the lhs only: the result is jnp.einsum of the quantized lhs,
    # also where jnp.einsum would exchange the operands.
    a, b = operands(sa, sb)
    q = Quantizer(IntNumerics(bits=4))  # per tensor, so independent of the plan
    op = qbits.einsum(DotGeneralConfig(fwd=MatmulConfig(lhs=q, rhs=NONE, mode="fake")))
    ours, ref = jax.jit(  # one compile
        lambda a, b: (
            op(subscripts, a, b),
            jnp.einsum(subscripts, q.quant(a).dequant(), b),
        )
    )(a, b)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("subscripts, sa, sb", EINSUMS[:7])
def test_int8_einsum_real_equals_fake_with_gradients(subscripts, sa, sb):
    a, b = operands(sa, sb)

    def f(config, a, b):
        op = qbits.einsum(config)

        def loss(a, b):
            out = op(subscripts, a, b)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

        return jax.value_and_grad(loss, argnums=(0, 1))(a, b)

    # Real and fake in one program (one compile).
    (lr, (ar, br)), (lf, (af, bf)) = jax.jit(
        lambda a, b: (f(all3(INT8, INT8), a, b), f(all3(INT8, INT8, "fake"), a, b))
    )(a, b)
    np.testing.assert_allclose(lr, lf, rtol=1e-5)
    np.testing.assert_allclose(ar, af, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(br, bf, rtol=1e-5, atol=1e-5)


def test_einsum_in_nnx_einsum():
    import flax.nnx as nnx

    op = qbits.einsum(all3(INT8, INT8))
    layer = nnx.Einsum("bsd,dh->bsh", (8, 4), (4,), einsum_op=op, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    y = layer(x)
    expected = jnp.einsum("bsd,dh->bsh", x, layer.kernel[...]) + layer.bias[...]
    assert y.shape == (2, 3, 4)
    np.testing.assert_allclose(y, expected, rtol=0.05, atol=0.05)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
    assert grads.kernel[...].shape == (8, 4)


@pytest.mark.parametrize(
    "subscripts, pattern",
    [
        ("ij,jk,kl->il", r"3 operands"),
        ("ii,ij->j", r"repeats within 'ii'"),
        ("i1,1k->ik", r"'1' is not a letter"),
        ("ij,jk->iz", r"output label 'z' is in no operand"),
        ("ijk,jk->i", r"3 labels for an operand of rank 2"),
    ],
)
def test_bad_subscripts(subscripts, pattern):
    a, b = operands((2, 3), (3, 4))
    with pytest.raises(InvalidArgumentError, match=pattern):
        qbits.einsum(DotGeneralConfig())(subscripts, a, b)


# --- Convolutions. -------------------------------------------------------------

CONVS = [  # lhs shape, rhs shape, kwargs
    ((2, 3, 9, 9), (4, 3, 3, 3), dict(window_strides=(1, 1), padding="SAME")),
    ((2, 3, 9, 9), (4, 3, 3, 3), dict(window_strides=(2, 2), padding="VALID")),
    (
        (2, 4, 9, 9),
        (6, 2, 3, 3),
        dict(window_strides=(1, 1), padding=((1, 1), (0, 2)), feature_group_count=2),
    ),
    (
        (2, 3, 9, 9),
        (4, 3, 3, 3),
        dict(window_strides=(1, 1), padding="SAME", rhs_dilation=(2, 2)),
    ),
    (
        (2, 9, 9, 3),
        (3, 3, 3, 4),
        dict(
            window_strides=(1, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
    ),
    (
        (2, 3, 16),
        (5, 3, 4),
        dict(window_strides=(2,), padding="SAME", lhs_dilation=(1,)),
    ),
]


def conv_vjp(conv, lhs, rhs, kw, g=None):
    def run(lhs, rhs):
        out, pullback = jax.vjp(functools.partial(conv, **kw), lhs, rhs)
        ct = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
        return (out, *pullback(ct))

    return jax.jit(run)(lhs, rhs)


def conv_vjps(convs, lhs, rhs, kw):
    """``conv_vjp`` of each of ``convs``, compiled as one program (one
    compile, not one per convolution: compiles are most of the time)."""

    def run(lhs, rhs):
        results = []
        for conv in convs:
            out, pullback = jax.vjp(functools.partial(conv, **kw), lhs, rhs)
            ct = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
            results.append((out, *pullback(ct)))
        return results

    return jax.jit(run)(lhs, rhs)


@pytest.mark.parametrize("sa, sb, kw", CONVS)
def test_identity_conv_is_lax_conv(sa, sb, kw):
    lhs, rhs = operands(sa, sb)
    ours, ref = conv_vjps(
        [qbits.conv_general_dilated(DotGeneralConfig()), lax.conv_general_dilated],
        lhs,
        rhs,
        kw,
    )
    for o, r in zip(ours, ref, strict=True):
        np.testing.assert_array_equal(o, r)


@pytest.mark.parametrize("sa, sb, kw", CONVS)
def test_identity_backward_convs_through_the_custom_vjp(sa, sb, kw):
    # Forward-only quantization: the backward convolutions are JAX's own.
    lhs, rhs = operands(sa, sb)
    fwd_only = DotGeneralConfig(fwd=MatmulConfig(lhs=INT8, rhs=INT8))
    (_, dl, dr), (_, dl_ref, dr_ref) = conv_vjps(
        [qbits.conv_general_dilated(fwd_only), lax.conv_general_dilated],
        lhs,
        rhs,
        kw,
    )
    np.testing.assert_allclose(dl, dl_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dr, dr_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sa, sb, kw", CONVS)
def test_int8_conv_real_equals_fake(sa, sb, kw):
    lhs, rhs = operands(sa, sb)
    real, fake, exact = conv_vjps(
        [
            qbits.conv_general_dilated(all3(INT8, INT8)),
            qbits.conv_general_dilated(all3(INT8, INT8, "fake")),
            lax.conv_general_dilated,
        ],
        lhs,
        rhs,
        kw,
    )
    for r, f in zip(real, fake, strict=True):
        np.testing.assert_allclose(r, f, rtol=1e-5, atol=1e-5 * float(jnp.abs(f).max()))
    assert not np.allclose(real[0], exact[0], rtol=1e-5, atol=1e-5)


def test_one_by_one_conv_gradients_match_the_quantized_matmul():
    # A 1x1 NHWC convolution is a matmul over the channels: the forward and
    # both gradient convolutions must quantize exactly like dot_general's.
    x, w = operands((2, 5, 5, 8), (1, 1, 8, 6))
    g4 = Quantizer(IntNumerics(bits=4))
    config = DotGeneralConfig(
        fwd=MatmulConfig(lhs=TENSOR8, rhs=TENSOR8, mode="fake"),
        dlhs=MatmulConfig(lhs=g4, rhs=TENSOR8, mode="fake"),
        drhs=MatmulConfig(lhs=g4, rhs=TENSOR8, mode="fake"),
    )
    kw = dict(
        window_strides=(1, 1),
        padding="VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    conv_out = conv_vjp(qbits.conv_general_dilated(config), x, w, kw)
    dn = (((1,), (0,)), ((), ()))

    def as_matmul(x, w):
        out, pullback = jax.vjp(
            lambda a, b: qbits.dot_general(config)(a, b, dn),
            x.reshape(-1, 8),
            w.reshape(8, 6),
        )
        ct = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
        da, db = pullback(ct)
        return out.reshape(2, 5, 5, 6), da.reshape(x.shape), db.reshape(w.shape)

    for c, m in zip(conv_out, jax.jit(as_matmul)(x, w), strict=True):
        np.testing.assert_allclose(c, m, rtol=1e-5, atol=1e-5)


def test_conv_in_flax_layers():
    import flax.linen as nn
    import flax.nnx as nnx

    conv = qbits.conv_general_dilated(all3(INT8, INT8))
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    linen = nn.Conv(4, (3, 3), conv_general_dilated=conv)
    params = linen.init(jax.random.key(1), x)
    y = linen.apply(params, x)
    ref = nn.Conv(4, (3, 3)).apply(params, x)
    np.testing.assert_allclose(y, ref, rtol=0.05, atol=0.05)
    jax.grad(lambda p: jnp.sum(linen.apply(p, x) ** 2))(params)
    layer = nnx.Conv(3, 4, (3, 3), conv_general_dilated=conv, rngs=nnx.Rngs(0))
    assert layer(x).shape == (2, 8, 8, 4)


def test_conv_bad_input():
    lhs, rhs = operands((2, 3, 9, 9), (4, 3, 3, 3))
    elementwise = Quantizer(
        IntNumerics(bits=8), granularity=qbits.PerChannel(shared_axes=())
    )
    config = DotGeneralConfig(fwd=MatmulConfig(lhs=elementwise, rhs=INT8))
    with pytest.raises(
        InvalidArgumentError, match=r"real-mode convolutions need the input scale"
    ):
        qbits.conv_general_dilated(config)(lhs, rhs, (1, 1), "SAME")
    with pytest.raises(InvalidArgumentError, match=r"lhs.dtype=int32"):
        qbits.conv_general_dilated(all3(INT8, INT8))(
            lhs.astype(jnp.int32), rhs, (1, 1), "SAME"
        )
    noisy = Quantizer(IntNumerics(bits=8, noise_fn=qbits.numerics.UniformNoise()))
    with pytest.raises(InvalidArgumentError, match=r"conv_general_dilated: key=None"):
        qbits.conv_general_dilated(all3(noisy, INT8))


def test_conv_signature_is_exactly_lax():
    import inspect

    def params(f):
        return [
            (p.name, p.kind, p.default)
            for p in inspect.signature(f).parameters.values()
        ]

    conv = qbits.conv_general_dilated(DotGeneralConfig())
    assert params(conv)[:-2] == params(lax.conv_general_dilated)
    assert params(conv)[-2:] == [
        ("state", inspect.Parameter.KEYWORD_ONLY, None),
        ("diagnostics", inspect.Parameter.KEYWORD_ONLY, None),
    ]


OPS = [
    qbits.ops.dot_general,
    qbits.ops.einsum,
    qbits.ops.conv_general_dilated,
    qbits.ops.ragged_dot,
]


@pytest.mark.parametrize("make", OPS, ids=lambda f: f.__name__)
def test_ops_are_equal_by_config_and_key(make):
    """Two ops of equal configs and the same key are equal (one way, all four)."""
    cfg, key = qbits.presets.get("int8"), jax.random.key(0)
    a, b = make(cfg, key), make(qbits.presets.get("int8"), key)
    assert a == b and hash(a) == hash(b)
    assert a != make(cfg, jax.random.key(0))  # another key object
    assert a != make(qbits.presets.get("int8_fwd"))
    others = [f(qbits.presets.get("int8_fwd")) for f in OPS if f is not make]
    assert all(make(qbits.presets.get("int8_fwd")) != o for o in others)


def test_an_equal_conv_op_as_a_static_argument_does_not_recompile():
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def run(conv, x, w):
        traces.append(conv)
        return conv(x, w, (1, 1), "SAME")

    x, w = jnp.ones((1, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
    for _ in range(2):
        run(qbits.ops.conv_general_dilated(qbits.presets.get("int8_fwd")), x, w)
    assert len(traces) == 1
