"""The scalify transform: plain pass-through, errors, grad, optimizers, FP16."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qbits
import qbits.hlo
from qbits import InvalidArgumentError
from qbits.scaled import (
    ScaledArray,
    UnsupportedPrimitiveError,
    as_scaled_array,
    asarray,
    dynamic_rescale_max,
    is_scaled,
    scalify,
)

RNG = np.random.default_rng(1)
DN = (((1,), (0,)), ((), ()))


def _mlp_loss(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean(jax.nn.logsumexp(h @ params["w2"], axis=1))


def _params():
    return {
        "w1": jnp.asarray(RNG.normal(size=(8, 16)), jnp.float32),
        "b1": jnp.zeros(16),
        "w2": jnp.asarray(RNG.normal(size=(16, 4)), jnp.float32),
    }


def test_plain_arrays_run_exactly_as_without_scalify():
    x = jnp.asarray(RNG.normal(size=(5, 8)), jnp.float32)
    p = _params()
    fn = jax.value_and_grad(_mlp_loss)
    got, want = scalify(fn)(p, x), fn(p, x)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    f = lambda a: a * 3  # noqa: E731
    assert str(jax.make_jaxpr(scalify(f))(x)) == str(jax.make_jaxpr(f)(x))


def test_seed_example_add_scales_and_rounding():
    a = as_scaled_array(np.array([1.0, 2.0], np.float16), scale=np.float32(2))
    b = as_scaled_array(np.array([3.0, 6.0], np.float16), scale=np.float32(4))
    out = scalify(lambda a, b: a + b)(a, b)
    np.testing.assert_array_equal(out.data, np.array([1.0, 2.0], np.float16))
    assert float(out.scale) == 4.0
    out = scalify(lambda a, b: a + b, rounding="none")(a, b)
    np.testing.assert_allclose(float(out.scale), np.sqrt(20), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out, np.float32), [4.0, 8.0], rtol=1e-3)


def test_unsupported_primitive_is_named():
    x = as_scaled_array(jnp.ones(3))
    with pytest.raises(UnsupportedPrimitiveError, match="'reduce_prod'") as info:
        scalify(jnp.prod)(x)
    assert info.value.primitive == "reduce_prod"
    # Not an error when the operand is not scaled.
    assert scalify(lambda a, b: a + jnp.prod(b))(x, jnp.ones(3)).shape == (3,)


def test_bad_rounding_is_a_clear_error():
    with pytest.raises(InvalidArgumentError, match="rounding"):
        scalify(jnp.sin, rounding="down")


def test_fp16_matmul_with_large_contraction_does_not_overflow():
    """Plain float16 overflows; scalify keeps data near unit scale.

    Measured (M, N, K = 16, 8, 4096; operands of std 128 and 64): plain float16
    leaves 89% of the outputs inf; scalify's float16 result has a normwise
    relative error of 3.0e-4 and a median elementwise one of 3.1e-4 against
    the float64 product.
    """
    rng = np.random.default_rng(5)
    m, n, k = 16, 8, 4096
    a = rng.normal(size=(m, k)).astype(np.float32) * 128
    b = rng.normal(size=(k, n)).astype(np.float32) * 64
    matmul = jax.jit(scalify(lambda x, y: x @ y))
    plain = matmul(jnp.asarray(a, jnp.float16), jnp.asarray(b, jnp.float16))
    assert np.mean(~np.isfinite(np.asarray(plain, np.float32))) > 0.5
    sa = as_scaled_array(a, np.float32(128)).astype(jnp.float16)
    sb = as_scaled_array(b, np.float32(64)).astype(jnp.float16)
    out = matmul(sa, sb)
    assert out.data.dtype == jnp.float16 and float(out.scale) == 128 * 64 * 64
    assert 0.5 < np.std(np.asarray(out.data, np.float32)) < 2
    ref = a.astype(np.float64) @ b.astype(np.float64)
    got = np.asarray(out.data, np.float64) * float(out.scale)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3
    assert np.median(np.abs(got - ref) / np.abs(ref)) < 1e-3


def test_grad_inside_scalify_gives_scaled_gradients():
    x = jnp.asarray(RNG.normal(size=(5, 8)), jnp.float32)
    p = _params()
    fn = jax.value_and_grad(_mlp_loss)
    want = jax.jit(fn)(p, x)  # compiled whole, not op by op
    got = jax.jit(scalify(fn))(as_scaled_array(p, scale=0.25), as_scaled_array(x, 8.0))
    assert all(is_scaled(g) for g in jax.tree.leaves(got, is_leaf=is_scaled))
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(asarray(g), w, rtol=2e-5, atol=1e-6),
        got,
        want,
        is_leaf=is_scaled,
    )


@pytest.mark.parametrize(
    "make_opt", [lambda: optax.sgd(0.1, momentum=0.9), lambda: optax.adam(1e-2)]
)
def test_optax_update_under_scalify(make_opt):
    opt = make_opt()
    p = _params()
    x = jnp.asarray(RNG.normal(size=(5, 8)), jnp.float32)

    def step(p, state, x):
        grads = jax.grad(_mlp_loss)(p, x)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    state = opt.init(p)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes int and float
        want = jax.jit(step)(p, state, x)  # compiled whole, not op by op
        got = jax.jit(scalify(step))(
            as_scaled_array(p), as_scaled_array(state), as_scaled_array(x)
        )
    leaves = jax.tree.leaves(got, is_leaf=is_scaled)
    assert any(is_scaled(v) for v in leaves)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(asarray(g), w, rtol=1e-4, atol=1e-6),
        got,
        want,
        is_leaf=is_scaled,
    )


def test_e8m0_scales_propagate_as_e8m0():
    e8m0 = jnp.float8_e8m0fnu
    a = as_scaled_array(
        jnp.asarray(RNG.normal(size=(4, 8)), jnp.float32), 2.0, scale_dtype=e8m0
    )
    b = as_scaled_array(
        jnp.asarray(RNG.normal(size=(8, 3)), jnp.float32), 0.5, scale_dtype=e8m0
    )
    out = scalify(lambda a, b: jnp.sqrt(jnp.abs(a @ b)) + 1.0, rounding="none")(a, b)
    assert out.scale.dtype == e8m0
    want = np.sqrt(np.abs(np.asarray(asarray(a)) @ np.asarray(asarray(b)))) + 1.0
    np.testing.assert_allclose(asarray(out), want, rtol=1e-6)
    mixed = scalify(lambda a, b: a * b)(a, as_scaled_array(jnp.ones((4, 8))))
    assert mixed.scale.dtype == jnp.float32


def test_scaled_array_feeds_a_quantized_dot_general_and_keeps_its_scale():
    """int8 quantization is scale-equivariant: same integers, scale carried."""
    dg = qbits.dot_general(qbits.presets.get("int8_fwd"))
    x = RNG.normal(size=(4, 16)).astype(np.float32) * 300
    w = RNG.normal(size=(16, 3)).astype(np.float32)
    sx = as_scaled_array(x, np.float32(256))
    out = jax.jit(scalify(lambda a, b: dg(a, b, DN)))(sx, w)
    assert is_scaled(out)
    np.testing.assert_array_equal(asarray(out), dg(x, w, DN))


def test_qbits_ops_called_with_scaled_arrays_return_scaled_arrays():
    cfg = qbits.presets.get("int8_fwd")
    rng = np.random.default_rng(6)
    x = rng.normal(size=(4, 16)).astype(np.float32) * 3e5
    w = jnp.asarray(rng.normal(size=(16, 3)), jnp.float16)
    # float16 data and a scale of 2**18: the values overflow float16.
    sx = as_scaled_array(x, np.float32(2**18)).astype(jnp.float16)
    img = as_scaled_array(jnp.asarray(RNG.normal(size=(1, 6, 6, 2)), jnp.float32), 8.0)
    kernel = jnp.asarray(RNG.normal(size=(3, 3, 2, 4)), jnp.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    dg = qbits.dot_general(cfg)
    conv = qbits.conv_general_dilated(cfg)

    @jax.jit  # one compile (op by op, each of the ops' many ops compiles alone)
    def run(sx, w, img, kernel):
        return (
            dg(sx, w, DN),
            dg(asarray(sx, jnp.float32), w.astype(jnp.float32), DN),
            qbits.einsum(cfg)("bd,dh->bh", sx, w),
            conv(img, kernel, (1, 1), "SAME", dimension_numbers=dn),
            conv(asarray(img), kernel, (1, 1), "SAME", dimension_numbers=dn),
        )

    out, want, ein, got, got_plain = run(sx, w, img, kernel)
    assert is_scaled(out) and out.data.dtype == jnp.float16
    # float16 rounding of the output data (under 4e-4 over 60 seeds).
    err = np.abs(np.asarray(asarray(out, jnp.float32)) - want).max()
    assert err / np.abs(want).max() < 5e-3
    np.testing.assert_array_equal(asarray(ein), asarray(out))
    assert is_scaled(got)
    np.testing.assert_array_equal(asarray(got), got_plain)


def test_quantized_training_gradients_under_scalify():
    dg = qbits.dot_general(qbits.presets.get("int8"), jax.random.key(0))

    def loss(a, b):
        return jnp.sum(dg(a, b, DN) ** 2)

    x = RNG.normal(size=(4, 16)).astype(np.float32) * 300
    w = RNG.normal(size=(16, 3)).astype(np.float32)
    grad = jax.grad(loss, argnums=(0, 1))
    got = jax.jit(scalify(grad))(
        as_scaled_array(x, np.float32(256)), as_scaled_array(w)
    )
    assert all(is_scaled(g) for g in got)
    for g, w_ in zip(got, jax.jit(grad)(x, w), strict=True):
        np.testing.assert_array_equal(asarray(g), w_)


def test_scalify_under_vmap_and_jit_of_jit():
    x = as_scaled_array(jnp.asarray(RNG.normal(size=(3, 4)), jnp.float32), 4.0)
    f = scalify(lambda a: jnp.sum(jnp.tanh(a) * a, axis=-1))
    batched = jax.vmap(f, in_axes=(ScaledArray(0, None),))(x)
    np.testing.assert_allclose(
        asarray(batched), np.sum(np.tanh(asarray(x)) * asarray(x), -1), rtol=1e-6
    )
    assert is_scaled(jax.jit(jax.jit(f))(x))


def _close(got, want, rtol=1e-5):
    """Each leaf within ``rtol``, relative to its largest magnitude."""
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(
            asarray(g), w, rtol=rtol, atol=max(1e-6, rtol * float(np.abs(w).max()))
        ),
        got,
        want,
        is_leaf=is_scaled,
    )


def test_scan_over_layers_forward_and_grad():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(3, 8, 8)).astype(np.float32)
    x = rng.normal(size=(4, 8)).astype(np.float32)

    def forward(x, w):
        def layer(h, wi):
            h = jnp.tanh(h @ wi)
            return h, jnp.sum(h, 1)

        return jax.lax.scan(layer, x, w)

    def grad(x, w):
        return jax.grad(lambda w: jnp.sum(forward(x, w)[0] ** 2))(w)

    sx, sw = as_scaled_array(x, np.float32(4)), as_scaled_array(w, np.float32(0.5))
    for fn in (forward, grad):
        got = jax.jit(scalify(fn))(sx, sw)
        assert all(is_scaled(v) for v in jax.tree.leaves(got, is_leaf=is_scaled))
        # The gradient through three tanh layers: float32 rounding in another
        # order (jax 0.12 differentiates tanh with its own one_minus_square).
        _close(got, fn(x, w), rtol=1e-5 if fn is forward else 1e-4)


def test_loop_carry_started_plain_becomes_scaled():
    w = as_scaled_array(jnp.asarray(RNG.normal(size=(3, 4)), jnp.float32), 2.0)

    def total(w):
        return jax.lax.fori_loop(0, 3, lambda i, c: c + w[i], jnp.zeros(4))

    got = jax.jit(scalify(total))(w)
    assert is_scaled(got)
    _close(got, total(asarray(w)))

    def doubling(x):
        return jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x)
        )

    n, out = scalify(doubling)(w)
    assert int(n) == 3 and is_scaled(out) and float(out.scale) == 16.0
    _close(out, doubling(asarray(w))[1])


def test_cond_branches_agree_on_scaledness():
    x = as_scaled_array(jnp.asarray(RNG.normal(size=(5,)), jnp.float32), 4.0)

    def f(p, x):
        return jax.lax.cond(p, lambda v: v * 2.0, lambda v: jnp.zeros_like(v), x)

    for p in (True, False):
        got = jax.jit(scalify(f))(p, x)
        assert is_scaled(got)
        _close(got, f(p, asarray(x)))


def test_flax_linen_and_nnx_models_run_on_scaled_params():
    import flax.linen as nn
    from flax import nnx

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm()(nn.gelu(nn.Dense(16)(x)))
            return nn.Dense(4)(x)

    x = jnp.asarray(RNG.normal(size=(3, 8)), jnp.float32)
    model = Mlp()
    # Compiled whole (eagerly, each op compiles on its own).
    variables = jax.jit(model.init)(jax.random.key(0), x)

    def grads(v, x):
        return jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v)

    got = jax.jit(scalify(grads))(as_scaled_array(variables), as_scaled_array(x, 4.0))
    _close(got, jax.jit(grads)(variables, x))

    attention = nnx.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0), decode=False)
    graphdef, state = nnx.split(attention)
    xa = jnp.asarray(RNG.normal(size=(2, 5, 8)), jnp.float32)

    def apply(s, v):
        return nnx.merge(graphdef, s)(v)

    out = jax.jit(scalify(apply))(as_scaled_array(state), as_scaled_array(xa, 0.5))
    assert is_scaled(out)
    _close(out, jax.jit(apply)(state, xa))


def test_fp8_storage_feeds_fp8_dots():
    """E4M3 x E5M2 data go straight into the dot (accumulating in float32)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 64)).astype(np.float32) * 1e3
    g = rng.normal(size=(16, 32)).astype(np.float32) * 1e-6
    sx = dynamic_rescale_max(as_scaled_array(x)).astype(jnp.float8_e4m3fn)
    sg = dynamic_rescale_max(as_scaled_array(g)).astype(jnp.float8_e5m2)
    fn = scalify(
        lambda a, b: jax.lax.dot_general(
            a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
    )
    out = jax.jit(fn)(sx, sg)
    assert out.data.dtype == jnp.float32
    dots = qbits.hlo.dot_dtypes(fn, sx, sg, stage="jaxpr")
    assert dots == [("float8_e4m3fn", "float8_e5m2", "float32")]
    ref = np.asarray(asarray(sx, jnp.float32)).T @ np.asarray(asarray(sg, jnp.float32))
    err = np.abs(np.asarray(asarray(out, jnp.float32)) - ref).max() / np.abs(ref).max()
    assert err < 1e-5  # exact products, float32 accumulation


def test_debug_print_sees_the_values(capsys):
    x = as_scaled_array(jnp.array([1.0, 2.0]), np.float32(8))

    def f(v):
        jax.debug.print("value {}", v)
        return v * 2

    out = jax.jit(scalify(f))(x)
    jax.effects_barrier()
    assert "value [1. 2.]" in capsys.readouterr().out
    _close(out, np.array([2.0, 4.0]))
