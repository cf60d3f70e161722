"""qbits.transform.adapt: adapters added to weight matmuls, in any layout.

An adapter that adds ``rows @ D`` (``D`` a ``(K, N)`` matrix per group) must
give what the model gives with its weight replaced by ``W + D`` put back in
the weight's own axes, whatever the dimension numbers: weight on either
side, batch axes on the weight, broadcast weights, stacked (scanned)
layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits import transform

ADD = transform.Adapter(lambda m, rows, d, key: rows @ d)

# (einsum, activation shape, weight shape): the weight is the second operand.
EINSUMS = {
    "xw": ("bd,dn->bn", (2, 4), (4, 3)),  # x @ w
    "xwt": ("bd,nd->bn", (2, 4), (3, 4)),  # x @ w.T
    "free2": ("btd,dhk->bthk", (2, 3, 4), (4, 2, 3)),  # two free axes
    "heads": ("bhd,hdk->bhk", (2, 2, 4), (2, 4, 3)),  # one matrix per head
    "heads2": ("hbd,dkh->bhk", (2, 2, 4), (4, 3, 2)),  # batch axes in another order
}


def _unmatrix(m, d):
    """``d`` (``(*layers, *groups, K, N)``) in the weight operand's layout."""
    order = (*m.batch, *m.contracting, *m.free)
    moved = d.reshape(*m.layers, *(m.shape[a] for a in order))
    n = len(m.layers)
    return np.transpose(moved, (*range(n), *(n + a for a in np.argsort(order))))


def model(p, xs):
    out = {
        name: jnp.einsum(eq, xs[name], p[name]) for name, (eq, _, _) in EINSUMS.items()
    }
    out["left"] = p["left"] @ xs["left"]  # the weight on the left
    wide = jnp.broadcast_to(p["bcast"], (2, 3, 4))  # broadcast along a batch axis
    out["bcast"] = jnp.einsum("bmk,bkn->bmn", xs["bcast"], wide)
    step = lambda h, w: (jnp.tanh(h @ w), None)  # noqa: E731
    out["scan"] = jax.lax.scan(step, xs["scan"], p["scan"])[0]  # stacked layers
    return out


def _inputs():
    rng = np.random.default_rng(0)  # numpy: jax.random compiles per shape
    shapes = {n: (xs, ws) for n, (_, xs, ws) in EINSUMS.items()}
    shapes.update(
        left=((4, 5), (3, 4)), bcast=((2, 5, 3), (3, 4)), scan=((2, 4), (3, 4, 4))
    )
    xs = {n: rng.normal(size=s[0]).astype(np.float32) for n, s in shapes.items()}
    params = {
        n: (rng.normal(size=s[1]) * 0.5).astype(np.float32) for n, s in shapes.items()
    }
    return params, xs


def test_adapter_equals_its_update_folded_into_the_weight_in_every_layout():
    params, xs = _inputs()
    found = transform._weight_matmuls(transform._Caller(), model, params, xs)
    assert set(found) == set(params)
    assert found["heads"].matmul.grouped and not found["bcast"].matmul.grouped
    assert found["left"].matmul.side == "rhs" and found["scan"].matmul.layers == (3,)
    rng = np.random.default_rng(1)
    data, merged = {}, {}
    for name, w in params.items():
        m = found[name].matmul
        d = rng.normal(size=(*m.layers, *m.groups, m.k, m.n)).astype(np.float32)
        data[name] = d
        # A weight broadcast along batch axes is one (K, N) matrix: w itself.
        merged[name] = w + (d if name == "bcast" else _unmatrix(m, d))
    got = jax.jit(transform.adapt(model, None, ADD, data))(params, xs)
    want = jax.jit(model)(merged, xs)
    for name in params:
        np.testing.assert_allclose(
            got[name], want[name], rtol=1e-5, atol=1e-4, err_msg=name
        )


def test_non_weight_matmuls_are_refused():
    def f(p, x):
        h = x @ p["w"]
        return jnp.einsum("bi,ci->bc", h, h)

    params, x = {"w": jnp.ones((4, 3))}, jnp.ones((2, 4))
    with pytest.raises(qbits.InvalidArgumentError, match="activation x activation"):
        transform.adapt(f, None, ADD, {"bi,ci->bc": jnp.ones((3, 2))})(params, x)
    with pytest.raises(qbits.InvalidArgumentError, match="no matmul of fn"):
        transform.adapt(f, None, ADD, {"nope": jnp.ones((3, 2))})(params, x)
    needs = transform.Adapter(ADD.apply, needs_key=True)
    with pytest.raises(qbits.InvalidArgumentError, match="draws random numbers"):
        transform.adapt(f, None, needs, {"w": jnp.ones((4, 3))})


ROTATE = transform.Adapter(before=lambda m, rows, r: rows @ r)


def _matrix(m, w):
    """The weight operand (``(*layers, *shape)``) as ``(*layers, *groups, K, N)``."""
    n = len(m.layers)
    order = (*m.batch, *m.contracting, *m.free)
    moved = np.transpose(w, (*range(n), *(n + a for a in order)))
    return moved.reshape(*m.layers, *m.groups, m.k, m.n)


def test_before_equals_its_transform_folded_into_the_weight_in_every_layout():
    # (x R) W == x (R W): an adapter that multiplies the activation's rows by
    # R gives the model with each weight matrix replaced by R W.
    params, xs = _inputs()
    found = transform._weight_matmuls(transform._Caller(), model, params, xs)
    rng = np.random.default_rng(2)
    data, merged = {}, {}
    for name, w in params.items():
        m = found[name].matmul
        r = rng.normal(size=(*m.layers, *m.groups, m.k, m.k)).astype(np.float32)
        data[name] = r
        if name == "bcast":  # one (K, N) matrix, the parameter itself
            merged[name] = r @ w
        else:
            merged[name] = _unmatrix(m, r @ _matrix(m, w))
    got = jax.jit(transform.adapt(model, None, ROTATE, data))(params, xs)
    want = jax.jit(model)(merged, xs)
    for name in params:
        np.testing.assert_allclose(
            got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name
        )


def test_before_runs_ahead_of_quantization_and_is_differentiated():
    def f(p, x):
        return x @ p["w"]

    rng = np.random.default_rng(3)
    p = {"w": rng.normal(size=(8, 4)).astype(np.float32)}
    x = rng.normal(size=(5, 8)).astype(np.float32)
    s = np.linspace(0.5, 4.0, 8).astype(np.float32)
    divide = transform.Adapter(before=lambda m, rows, s: rows / s)
    got = transform.adapt(f, "int8_fwd", divide, {"w": s})
    want = qbits.quantize(lambda p, x: f(p, x / s), "int8_fwd")
    np.testing.assert_array_equal(got(p, x), want(p, x))
    loss = lambda g: lambda x: jnp.sum(g(p, x) ** 2)  # noqa: E731
    np.testing.assert_array_equal(jax.grad(loss(got))(x), jax.grad(loss(want))(x))
    with pytest.raises(qbits.InvalidArgumentError, match=r"apply .* before"):
        transform.adapt(f, None, transform.Adapter(), {"w": s})
