import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import qbits
from qbits import InvalidArgumentError, QTensor
from qbits._tensor import pack_nibbles, unpack_nibbles

NIBBLE_VALUES = {
    "int4": np.arange(-8, 8),
    "uint4": np.arange(16),
    "float4_e2m1fn": np.array(
        [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6]
    ),
}


@pytest.mark.parametrize("name", sorted(NIBBLE_VALUES))
@settings(max_examples=10)  # per dtype
@given(
    shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=7),
    data=st.data(),
)
def test_pack_unpack_round_trip_is_exact(name, shape, data):
    dtype = getattr(jnp, name)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    values = jnp.asarray(rng.choice(NIBBLE_VALUES[name], shape)).astype(dtype)
    odd = bool(shape[axis] % 2)

    @jax.jit  # one compile per example (pack and unpack)
    def round_trip(values):
        packed = pack_nibbles(values, axis)
        return packed, unpack_nibbles(packed, dtype, axis, odd)

    packed, back = round_trip(values)
    assert packed.dtype == jnp.uint8
    expected = list(shape)
    expected[axis] = (shape[axis] + 1) // 2
    assert packed.shape == tuple(expected)
    assert back.dtype == dtype and back.shape == values.shape
    np.testing.assert_array_equal(back.astype(jnp.float32), values.astype(jnp.float32))


def test_packing_layout_low_nibble_first():
    packed = pack_nibbles(jnp.array([1, -2, 7], jnp.int4))
    # 1 -> 0x1, -2 -> 0xE, 7 -> 0x7 and a zero pad nibble.
    np.testing.assert_array_equal(packed, [0xE1, 0x07])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_packed_qtensor_dequantizes_like_unpacked(axis):
    x = jax.random.normal(jax.random.key(0), (5, 7))
    for q in (
        qbits.Quantizer(qbits.IntNumerics(bits=4), granularity=qbits.PerChannel((1,))),
        qbits.Quantizer(qbits.FpNumerics("float4_e2m1fn")),
    ):
        qt = q.quant(x, store=True)
        packed = qt.pack(axis)
        assert packed.shape == qt.shape == (5, 7)
        assert packed.packed_axis < 0 and packed.is_stored
        np.testing.assert_array_equal(packed.dequant(), qt.dequant())
        np.testing.assert_array_equal(packed.unpack().qvalue, qt.qvalue)
        assert packed.qvalue.nbytes < qt.qvalue.nbytes


def test_packed_qtensor_through_jit_and_vmap():
    x = jax.random.normal(jax.random.key(1), (3, 4, 9))
    q = qbits.Quantizer(qbits.IntNumerics(bits=4), granularity=qbits.PerChannel((2,)))
    packed = q.quant(x, store=True).pack(-1)
    expected = q.quant(x, store=True).dequant()
    np.testing.assert_array_equal(jax.jit(lambda t: t.dequant())(packed), expected)
    np.testing.assert_array_equal(jax.vmap(lambda t: t.dequant())(packed), expected)


def test_nbytes_int4_packed_is_half_a_byte_per_value():
    w = jax.random.normal(jax.random.key(2), (512, 2048))
    q = qbits.Quantizer(qbits.IntNumerics(bits=4), granularity=qbits.PerChannel((0,)))
    qt, packed = jax.jit(lambda w: (qt := q.quant(w, store=True), qt.pack(0)))(w)
    assert qt.nbytes == 512 * 2048 + 2048 * 4
    assert packed.nbytes == 256 * 2048 + 2048 * 4
    assert packed.nbytes / (w.size * 4) < 0.135


def test_dequant_with_tiled_scales():
    q = jnp.arange(12.0).reshape(2, 6)
    scale = jnp.array([[1.0, 10.0, 100.0], [2.0, 20.0, 200.0]])
    t = QTensor(q, scale)
    expected = q * jnp.repeat(scale, 2, axis=1)
    np.testing.assert_array_equal(t.dequant(), expected)


def test_dequant_dtype_and_shape():
    t = QTensor(
        jnp.array([1, -2], jnp.int8),
        jnp.array([0.5]),
        qdtype=jnp.int8,
        dtype=jnp.bfloat16,
    )
    assert t.dequant().dtype == jnp.bfloat16
    assert t.shape == (2,) and t.ndim == 1 and t.is_stored


def test_dequant_of_an_empty_qtensor():
    # An empty axis takes a scale of size 0 (per index) or 1 (shared).
    for q, scale in [
        (jnp.ones((0, 6), jnp.int8), jnp.ones((0, 1))),
        (jnp.ones((0, 6), jnp.int8), jnp.ones((1, 3))),
        (jnp.ones((6, 0)), jnp.ones((2, 0))),
    ]:
        t = QTensor(q, scale, qdtype=q.dtype)
        assert t.dequant().shape == q.shape and t.dequant().dtype == jnp.float32
    with pytest.raises(InvalidArgumentError, match=r"scale.shape=\(0, 1\)"):
        QTensor(jnp.ones((2, 6)), jnp.ones((0, 1))).dequant()


def test_qtensor_is_a_pytree():
    t = qbits.Quantizer(qbits.IntNumerics()).quant(jnp.ones((2, 3)), store=True)
    leaves, tree = jax.tree_util.tree_flatten(t)
    assert len(leaves) == 2
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert back.qdtype == t.qdtype and back.dtype == t.dtype
    np.testing.assert_array_equal(back.qvalue, t.qvalue)
    np.testing.assert_array_equal(back.scale, t.scale)
    out = jax.jit(lambda t: t)(t)
    assert out.qdtype == t.qdtype and out.dtype == t.dtype


@pytest.mark.parametrize(
    "build, pattern",
    [
        (
            lambda: pack_nibbles(jnp.ones(3, jnp.int8)),
            r"values.dtype=int8 .*int4, uint4",
        ),
        (
            lambda: QTensor(jnp.ones(4), jnp.ones(1)).pack(),
            r"values.dtype=float32",
        ),
        (
            lambda: QTensor(jnp.ones(4, jnp.int4), jnp.ones(1)).pack().pack(),
            r"QTensor.pack: self='a packed QTensor'",
        ),
        (
            lambda: QTensor(jnp.ones(4, jnp.int4), jnp.ones(1)).pack(axis=1),
            r"QTensor.pack: axis=1",
        ),
        (
            lambda: QTensor(jnp.ones((2, 6)), jnp.ones((2, 4))).dequant(),
            r"scale.shape=\(2, 4\) .*divide qvalue's \(2, 6\)",
        ),
        (lambda: QTensor(jnp.ones((2, 6)), jnp.ones(6)).dequant(), r"rank 2"),
        (lambda: unpack_nibbles(jnp.ones(2, jnp.int8), jnp.int4), r"packed.dtype=int8"),
        (lambda: unpack_nibbles(jnp.ones(2, jnp.uint8), jnp.int8), r"dtype=int8"),
    ],
)
def test_bad_input(build, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        build()
