"""Every scaled rule against the unscaled computation.

Each case runs ``scalify(fn)`` on ScaledArrays (float32 data, so that the
only differences are the rounding of rescaled data) and compares with ``fn``
on the values the ScaledArrays represent. Scales are powers of two (the
default rounding) or arbitrary (rounding ``none``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from qbits.scaled import ScaledArray, as_scaled_array, asarray, scalify

RNG = np.random.default_rng(0)
A = RNG.normal(size=(4, 6)).astype(np.float32)
B = RNG.normal(size=(4, 6)).astype(np.float32)
W = RNG.normal(size=(6, 3)).astype(np.float32)
POS = (np.abs(A) + 0.1).astype(np.float32)
IDX = np.array([2, 0, 3])

dn = lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))

# (name, fn, inputs); inputs marked "s" are scaled, others passed plain.
CASES = [
    ("add", lambda a, b: a + b, "ss"),
    ("sub", lambda a, b: a - b, "ss"),
    ("add const", lambda a: a + 1.5, "s"),
    ("const sub", lambda a: 2.0 - a, "s"),
    ("add plain", lambda a, b: a + b, "sp"),
    ("mul", lambda a, b: a * b, "ss"),
    ("mul const", lambda a: a * 0.1, "s"),
    ("mul plain", lambda a, b: a * b, "sp"),
    ("div", lambda a, p: a / p, "ss"),
    ("div const", lambda a: a / 3.0, "s"),
    ("const div", lambda p: 3.0 / p, "s"),
    ("max", jnp.maximum, "ss"),
    ("relu", lambda a: jnp.maximum(a, 0.0), "s"),
    ("jax.nn.relu", jax.nn.relu, "s"),
    ("min const", lambda a: jnp.minimum(a, -0.5), "s"),
    ("clamp", lambda a: lax.clamp(-1.0, a, 1.0), "s"),
    ("clip", lambda a: jnp.clip(a, -0.5, 0.7), "s"),
    ("rem", lambda a, p: lax.rem(a, p), "ss"),
    ("where", lambda a, b: jnp.where(a > 0, a, b), "ss"),
    ("where const", lambda a, b: jnp.where(a > b, a, 0.0), "ss"),
    ("neg", lambda a: -a, "s"),
    ("abs", jnp.abs, "s"),
    ("sign", jnp.sign, "s"),
    ("sqrt", jnp.sqrt, "s+"),
    ("rsqrt", lax.rsqrt, "s+"),
    ("cbrt", jnp.cbrt, "s"),
    ("square", jnp.square, "s"),
    ("integer_pow 3", lambda a: a**3, "s"),
    ("integer_pow -2", lambda p: p**-2, "s+"),
    ("pow", lambda p: p**1.5, "s+"),
    ("exp", jnp.exp, "s"),
    ("log", jnp.log, "s+"),
    ("log1p", jnp.log1p, "s+"),
    ("expm1", jnp.expm1, "s"),
    ("tanh", jnp.tanh, "s"),
    ("sigmoid", jax.nn.sigmoid, "s"),
    ("sin", jnp.sin, "s"),
    ("cos", jnp.cos, "s"),
    ("erf", jax.scipy.special.erf, "s"),
    ("gelu", jax.nn.gelu, "s"),
    ("round", jnp.round, "s"),
    ("floor", jnp.floor, "s"),
    ("ceil", jnp.ceil, "s"),
    ("atan2", jnp.arctan2, "ss"),
    ("convert f16", lambda a: a.astype(jnp.float16).astype(jnp.float32), "s"),
    ("convert int", lambda a: (a * 4).astype(jnp.int32), "s"),
    ("is_finite", jnp.isfinite, "s"),
    ("compare", lambda a, b: (a > b, a <= b, a == a, a != b), "ss"),
    ("reduce_sum", lambda a: a.sum(0), "s"),
    ("reduce_sum all", jnp.sum, "s"),
    ("mean", lambda a: jnp.mean(a, axis=1), "s"),
    ("var", jnp.var, "s"),
    ("cumsum", lambda a: jnp.cumsum(a, axis=1), "s"),
    ("cumsum reverse", lambda a: lax.cumsum(a, axis=0, reverse=True), "s"),
    ("reduce_max", lambda a: a.max(1), "s"),
    ("reduce_min", lambda a: a.min(), "s"),
    ("argmax", lambda a: jnp.argmax(a, 1), "s"),
    ("cummax", lambda a: lax.cummax(a, axis=1), "s"),
    ("logsumexp", lambda a: jax.nn.logsumexp(a, axis=1), "s"),
    ("softmax", lambda a: jax.nn.softmax(a, axis=1), "s"),
    ("log_softmax", lambda a: jax.nn.log_softmax(a, axis=1), "s"),
    (
        "layer norm",
        lambda a: (
            (a - a.mean(1, keepdims=True)) * lax.rsqrt(a.var(1, keepdims=True) + 1e-5)
        ),
        "s",
    ),
    ("matmul", lambda a, w: a @ w, "ss"),
    ("matmul plain", lambda a, w: a @ w, "sp"),
    (
        "matmul f16 out",
        lambda a, w: jnp.matmul(a, w, preferred_element_type=jnp.float32),
        "ss",
    ),
    ("einsum batched", lambda a, b: jnp.einsum("bi,bj->bij", a, b), "ss"),
    (
        "dot_general 2 contracting",
        lambda a, b: lax.dot_general(a, b, (((0, 1), (0, 1)), ((), ()))),
        "ss",
    ),
    (
        "conv",
        lambda x, k: lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=dn
        ),
        "cc",
    ),
    ("reshape", lambda a: a.reshape(3, 8), "s"),
    ("transpose", lambda a: a.T, "s"),
    ("broadcast", lambda a: jnp.broadcast_to(a[None], (2, 4, 6)), "s"),
    ("squeeze expand", lambda a: jnp.squeeze(a[:, None, :], 1)[None], "s"),
    ("slice", lambda a: a[1:3, ::2], "s"),
    ("rev", lambda a: jnp.flip(a, 1), "s"),
    ("gather", lambda a: a[IDX], "s"),
    ("dynamic_slice", lambda a: lax.dynamic_slice(a, (1, 2), (2, 3)), "s"),
    ("concatenate", lambda a, b: jnp.concatenate([a, b, a], axis=1), "ss"),
    ("pad", lambda a: jnp.pad(a, ((1, 0), (0, 2)), constant_values=1.0), "s"),
    (
        "dynamic_update_slice",
        lambda a, b: lax.dynamic_update_slice(a, b[:2, :3], (1, 2)),
        "ss",
    ),
    ("scatter add", lambda a, b: jnp.asarray(a).at[IDX].add(b[:3]), "ss"),
    ("scatter set", lambda a, b: jnp.asarray(a).at[IDX].set(b[:3]), "ss"),
    ("split", lambda a: jnp.split(a, 2, axis=1), "s"),
    ("sort", lambda a: jnp.sort(a, axis=1), "s"),
    ("argsort", lambda a: jnp.argsort(a, axis=1), "s"),
    ("sort two keys", lambda a, b: jax.lax.sort((a, b), num_keys=1), "ss"),
    ("top_k", lambda a: lax.top_k(a, 3), "s"),
    ("median", lambda a: jnp.median(a, axis=0), "s"),
    (
        "avg pool",
        lambda a: lax.reduce_window(a, 0.0, lax.add, (2, 2), (2, 2), "VALID") / 4,
        "s",
    ),
    (
        "max pool grad",
        jax.grad(
            lambda a: jnp.sum(
                lax.reduce_window(a, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID") ** 2
            )
        ),
        "s",
    ),
    ("cumlogsumexp", lambda a: lax.cumlogsumexp(a, axis=1), "s"),
    (
        "variadic max reduce",
        lambda a, b: lax.reduce(
            (a, b),
            (-jnp.inf, jnp.inf),
            lambda p, q: (lax.max(p[0], q[0]), lax.min(p[1], q[1])),
            (1,),
        ),
        "ss",
    ),
    ("scatter max", lambda a, b: jnp.asarray(a).at[IDX].max(b[:3]), "ss"),
    ("stop_gradient", lax.stop_gradient, "s"),
    ("nested jit", jax.jit(lambda a, b: jnp.tanh(a) * b + 1.0), "ss"),
    ("checkpoint", jax.checkpoint(lambda a: jnp.sin(a) * 2.0), "s"),
    ("optimization_barrier", lambda a: lax.optimization_barrier((a, a * 2))[1], "s"),
]


def _matching_inputs(name, fn, kinds, scales):
    """Inputs with the shapes each case needs."""
    positive = kinds.endswith("+")
    kinds = kinds.rstrip("+")
    if name.startswith("matmul"):
        arrays = [A, W]
    elif name in ("div", "rem"):
        arrays = [A, POS]
    elif positive or name == "const div":
        arrays = [POS]
    elif kinds == "cc":
        arrays = [
            RNG.normal(size=(2, 5, 5, 3)).astype(np.float32),
            RNG.normal(size=(3, 3, 3, 4)).astype(np.float32),
        ]
    else:
        arrays = [A, B]
    inputs, values = [], []
    for i, kind in enumerate(kinds):
        x = arrays[i]
        if kind == "p":
            inputs.append(x)
            values.append(x)
            continue
        s = as_scaled_array(x, scale=np.float32(scales[i % len(scales)]))
        inputs.append(s)
        values.append(np.asarray(s.to_array(jnp.float32)))
    return inputs, values


# Each case runs with power-of-two scales rounded to powers of two and with
# arbitrary scales unrounded, both in one compiled program.
ROUNDINGS = (((2.0**-7, 2.0**5), "pow2"), ((0.37, 13.1), "none"))


@pytest.mark.parametrize("name, fn, kinds", CASES, ids=[c[0] for c in CASES])
def test_rule_matches_unscaled_with_pow2_and_arbitrary_scales(name, fn, kinds):
    cases = [_matching_inputs(name, fn, kinds, scales) for scales, _ in ROUNDINGS]
    scaled = [scalify(fn, rounding=rounding) for _, rounding in ROUNDINGS]
    outs = jax.jit(lambda ins: [f(*i) for f, i in zip(scaled, ins, strict=True)])(
        [inputs for inputs, _ in cases]
    )
    for (_, values), (_, rounding), got_tree in zip(
        cases, ROUNDINGS, outs, strict=True
    ):
        want = jax.tree.leaves(fn(*values))
        got = jax.tree.leaves(got_tree, is_leaf=lambda x: isinstance(x, ScaledArray))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _check_leaf(name, rounding, g, np.asarray(w))


def _check_leaf(name, rounding, g, w):
    if jnp.issubdtype(w.dtype, jnp.floating):
        assert isinstance(g, ScaledArray), f"{name}: a float output lost its scale"
        if rounding == "pow2":
            e = np.log2(float(np.asarray(g.scale, np.float32)))
            assert e == np.round(e), f"{name}: scale {g.scale} is not a power of two"
        g = np.asarray(asarray(g, jnp.float32))
        scale = max(float(np.max(np.abs(w))), 1e-30)
        err = np.max(np.abs(g - w)) / scale
        # Rounding to float16 rounds the data, not the value: float16 eps.
        tol = 1e-3 if name == "convert f16" else 2e-6
        assert err < tol, f"{name}: relative error {err:.2e}"
    else:
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)


@settings(max_examples=10, deadline=None)
@given(
    e_a=st.integers(-60, 60),
    e_b=st.integers(-60, 60),
    op=st.sampled_from(["add", "mul", "div", "matmul", "max", "sum"]),
)
def test_scales_far_outside_float16_range(e_a, e_b, op):
    """float16 data, scales 2**-60 .. 2**60: the result has the right value."""
    fns = {
        "add": lambda a, b: a + b,
        "mul": lambda a, b: a * b,
        "div": lambda a, b: a / (jnp.abs(b) + 1.0),
        "matmul": lambda a, b: a @ b.T,
        "max": jnp.maximum,
        "sum": lambda a, b: jnp.sum(a, 0) + jnp.sum(b, 0),
    }
    fn = fns[op]
    a = as_scaled_array(A, scale=np.float32(1)).astype(jnp.float16)
    b = as_scaled_array(B, scale=np.float32(1)).astype(jnp.float16)
    a, b = (
        ScaledArray(a.data, np.float32(2.0**e_a)),
        ScaledArray(b.data, np.float32(2.0**e_b)),
    )
    got = jax.jit(scalify(fn))(a, b)
    assert isinstance(got, ScaledArray) and got.data.dtype == jnp.float16
    # The reference in float64 on the represented values.
    va = np.asarray(a.data, np.float64) * 2.0**e_a
    vb = np.asarray(b.data, np.float64) * 2.0**e_b
    f64 = {
        "add": lambda: va + vb,
        "mul": lambda: va * vb,
        "div": lambda: va / (np.abs(vb) + 1.0),
        "matmul": lambda: va @ vb.T,
        "max": lambda: np.maximum(va, vb),
        "sum": lambda: va.sum(0) + vb.sum(0),
    }[op]()
    g = np.asarray(got.data, np.float64) * float(got.scale)
    ref = np.max(np.abs(f64))
    if op in ("add", "sum", "max") and abs(e_a - e_b) > 14:
        # The smaller operand falls below float16 resolution of the larger.
        ref = max(ref, 1e-300)
        assert np.max(np.abs(g - f64)) / ref < 2e-3
    else:
        assert np.max(np.abs(g - f64)) / ref < 5e-3
