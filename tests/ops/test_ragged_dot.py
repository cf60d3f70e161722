"""qbits.ops.ragged_dot: lax.ragged_dot with its three matmuls quantized."""

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
    PerChannel,
    Quantizer,
)

INT8 = Quantizer(IntNumerics(bits=8), granularity=PerChannel())
BASIC = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))


def _int8(mode="real"):
    """int8 in all three matmuls, rounding to nearest (no key)."""
    mm = MatmulConfig(lhs=INT8, rhs=INT8, mode=mode)
    return DotGeneralConfig(fwd=mm, dlhs=mm, drhs=mm)


def _normal(*shapes):
    rng = np.random.default_rng(0)  # numpy: no random kernels to compile
    return [jnp.asarray(rng.standard_normal(s).astype(np.float32)) for s in shapes]


def _operands(m=9, k=16, n=8, groups=3):
    return _normal((m, k), (groups, k, n), (m, n))


@jax.jit(static_argnums=0)
def _value_and_grads(f, x, w, cotangent):
    out, vjp = jax.vjp(f, x, w)
    return (out, *vjp(cotangent))


# Group sizes with an empty group, summing to m, to less (the last rows in no
# group: zeros) and to more (the last group cut off at m) than m = 9.
SIZES = [[2, 0, 7], [2, 0, 4], [3, 0, 8]]


def test_identity_config_is_lax_ragged_dot_bit_for_bit():
    x, w, ct = _operands()
    rd = qbits.ops.ragged_dot(DotGeneralConfig())

    def both(x, w, gs):
        return [
            jax.vjp(lambda a, b, f=f: f(a, b, gs), x, w) for f in (rd, lax.ragged_dot)
        ]

    for sizes in SIZES:
        gs = jnp.array(sizes, jnp.int32)
        (got, got_vjp), (want, want_vjp) = both(x, w, gs)  # not jitted
        np.testing.assert_array_equal(got, want)
        for g, v in zip(got_vjp(ct), want_vjp(ct), strict=True):
            np.testing.assert_array_equal(g, v)


def test_int8_is_a_loop_of_dot_general_over_the_groups():
    """Per-channel int8 in all three matmuls: the values and both gradients
    are those of qbits.dot_general on each group's rows and weight, bit for
    bit (scales per row; per group and channel of the weight; in the weight
    gradient per group and channel of both operands). An empty group, and
    rows in no group."""
    x, w, ct = _operands()
    config = _int8()
    rd, dg = qbits.ops.ragged_dot(config), qbits.dot_general(config)
    sizes = SIZES[1]
    gs = jnp.array(sizes, jnp.int32)

    def loop(x, w):
        outs, start = [], 0
        for j, n in enumerate(sizes):
            outs.append(dg(x[start : start + n], w[j], (((1,), (0,)), ((), ()))))
            start += n
        outs.append(jnp.zeros((x.shape[0] - start, w.shape[2])))
        return jnp.concatenate(outs)

    got = _value_and_grads(lambda a, b: rd(a, b, gs), x, w, ct)
    want = _value_and_grads(loop, x, w, ct)
    for g, v in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, v)


def test_ragged_dot_general_with_a_batch_axis():
    """The ragged axis in the middle, a batch axis, the group axis last:
    JAX's transposes of the dimension numbers (values and both gradients
    near float's). Fake mode: dequantized operands."""
    x, w, ct = _normal((2, 7, 6), (2, 5, 6, 3), (2, 7, 5))  # [b, m, k], [b, n, k, g]
    gs = jnp.array([3, 0, 2], jnp.int32)
    dn = lax.RaggedDotDimensionNumbers((((2,), (2,)), ((0,), (0,))), (1,), (3,))
    rd = qbits.ops.ragged_dot(_int8("fake"))
    got = _value_and_grads(lambda a, b: rd.general(a, b, gs, dn), x, w, ct)
    want = _value_and_grads(lambda a, b: lax.ragged_dot_general(a, b, gs, dn), x, w, ct)
    for g, v in zip(got, want, strict=True):
        assert g.shape == v.shape
        np.testing.assert_allclose(g, v, atol=0.03 * np.abs(v).max())
    np.testing.assert_array_equal(got[0][:, 5:], 0.0)  # rows of no group


def test_errors_name_the_argument():
    x, w, _ = _operands()
    rd = qbits.ops.ragged_dot(_int8())
    gs3 = jnp.array([3, 0, 2])
    with pytest.raises(InvalidArgumentError, match=r"group_sizes\.dtype=float32"):
        rd(x, w, jnp.array([2.0, 0.0, 7.0]))
    with pytest.raises(InvalidArgumentError, match=r"group_sizes\.shape=\(1, 3\)"):
        rd(x, w, jnp.array([[2, 0, 7]]))
    with pytest.raises(
        InvalidArgumentError, match=r"group_sizes\.shape=\(2,\).*rhs has 3 groups"
    ):
        rd(x, w, jnp.array([2, 4]))
    with pytest.raises(InvalidArgumentError, match="group_offset"):
        rd(x, w, jnp.array([2, 0, 7]), group_offset=jnp.array([1]))
    weight_grad = lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())
    with pytest.raises(
        InvalidArgumentError, match=r"ragged_dot_dimension_numbers.*contracted"
    ):
        rd.general(x, x, jnp.array([2, 7]), weight_grad)
    # Contracting (batch) axes of different sizes: both shapes named.
    for f in (rd, qbits.ops.ragged_dot(DotGeneralConfig())):
        with pytest.raises(
            InvalidArgumentError, match=r"(?s)rhs\.shape.*\(3, 15, 8\).*\(9, 16\)"
        ):
            f(x, w[:, 1:], jnp.array([2, 0, 7]))
    batched = lax.RaggedDotDimensionNumbers((((2,), (2,)), ((0,), (0,))), (1,), (3,))
    with pytest.raises(
        InvalidArgumentError, match=r"(?s)\(3, 5, 6, 3\).*\(2, 7, 6\).*batch"
    ):
        rd.general(jnp.ones((2, 7, 6)), jnp.ones((3, 5, 6, 3)), gs3, batched)
    with pytest.raises(InvalidArgumentError, match=r"lhs\.shape.*\[m, k\]"):
        rd(x[None], w, jnp.array([2, 0, 7]))
    percentile = Quantizer(IntNumerics(bits=8), qbits.Percentile(99.0))
    drhs = MatmulConfig(lhs=percentile, rhs=INT8)
    with pytest.raises(InvalidArgumentError, match=r"config\.drhs\.lhs\.calibration"):
        qbits.ops.ragged_dot(DotGeneralConfig(drhs=drhs))


@pytest.mark.parametrize("config", [DotGeneralConfig(), _int8()], ids=["lax", "int8"])
@pytest.mark.parametrize(
    ("sizes", "dtype", "why"),
    [
        ([3, -4, 10], jnp.int32, r"negative.*group_sizes\[1\] = -4"),
        ([100, 28, 1], jnp.int8, r"sum to 129.*int8"),  # wraps in their dtype
        ([9, 2**31 - 9, 0], jnp.int32, r"sum to 2147483648.*int32"),
    ],
)
def test_concrete_group_sizes_that_lax_does_not_define_are_refused(
    config, sizes, dtype, why
):
    x, w, _ = _operands()
    rd = qbits.ops.ragged_dot(config)
    gs = jnp.array(sizes, dtype)
    with pytest.raises(InvalidArgumentError, match=f"(?s)group_sizes.*{why}"):
        rd(x, w, gs)
    with pytest.raises(InvalidArgumentError, match=f"(?s)group_sizes.*{why}"):
        rd.general(x, w, gs, BASIC)


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_traced_group_sizes_that_lax_does_not_define_give_nan(mode):
    # lax computes something for them (on CPU a row sums the products of
    # every group whose range holds it); quantized, the output is NaN.
    x, w, _ = _operands(m=7, k=8, n=4)
    rd = jax.jit(qbits.ops.ragged_dot(_int8(mode)))
    for sizes in ([1, -2, 8], [2**31 - 3, 4, 0]):
        out = rd(x, w, jnp.array(sizes, jnp.int32))
        assert np.isnan(out).all(), sizes
    valid = rd(x, w, jnp.array([1, 0, 8], jnp.int32))  # the sum past m: cut off
    want = lax.ragged_dot(x, w, jnp.array([1, 0, 8], jnp.int32))
    np.testing.assert_allclose(valid, want, atol=0.03 * np.abs(want).max())


def test_weight_gradient_copies_no_operand_per_group():
    # 32 groups: a float32 copy of the lhs per group is 8 MiB. The program's
    # temporaries stay below half of it: 3.2 MiB, 2 of them the forward's
    # (JAX's own CPU lowering holds the lhs codes per group); before, 10.3.
    m, k, groups = 1024, 64, 32
    rd = qbits.ops.ragged_dot(_int8())
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.float32),
        jax.ShapeDtypeStruct((groups, k, k), jnp.float32),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
    )
    weight_grad = jax.grad(lambda x, w, gs: jnp.sum(rd(x, w, gs) ** 2), 1)
    compiled = jax.jit(weight_grad).lower(*args).compile()
    expanded = groups * m * k * 4
    assert compiled.memory_analysis().temp_size_in_bytes < expanded / 2
