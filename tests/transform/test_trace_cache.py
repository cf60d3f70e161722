"""An eager quantized call traces once per signature of its arguments.

The traces are counted: ``trace`` (``make_jaxpr`` and the walk) as the
engine's ``quantize`` calls it.
"""

import gc
import types

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits.transform import _cache, _transform


@pytest.fixture
def traces(monkeypatch):
    """The number of traces ``quantize`` makes, counted from now."""
    count = [0]
    real = _transform.trace

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_transform, "trace", counting)
    return count


def _mlp(params, x):
    for w in params:
        x = jax.nn.relu(x @ w)
    return x


def _params(n=3, width=16):
    keys = jax.random.split(jax.random.key(0), n)
    return [jax.random.normal(k, (width, width)) for k in keys]


def test_same_signature_traces_once_a_new_shape_or_tree_again(traces):
    def f(params, x, scale=1.0):  # its own function: nothing kept from elsewhere
        return _mlp(params, x) * scale

    qf = qbits.quantize(f, "int8_fwd")
    params, x = _params(), jnp.ones((4, 16))
    for _ in range(10):
        qf(params, x)
    assert traces[0] == 1
    qf(params, jnp.ones((5, 16)))  # a new shape
    assert traces[0] == 2
    qf(params[:2], x)  # a new tree
    assert traces[0] == 3
    qf(params, x, scale=2.0)  # a new static leaf (a Python number)
    assert traces[0] == 4
    bf16 = [p.astype(jnp.bfloat16) for p in params]
    qf(bf16, x.astype(jnp.bfloat16))  # new dtypes
    assert traces[0] == 5
    qf(params, x)  # the first signature: kept
    assert traces[0] == 5
    # Another quantize of the same function and config: the same program.
    qbits.quantize(f, "int8_fwd")(params, x)
    assert traces[0] == 5


@pytest.mark.parametrize("preset", ["int8", "fp8", "fp8_delayed"])
def test_eager_call_equals_jit_bit_for_bit(preset):
    params, x = _params(), jax.random.normal(jax.random.key(1), (8, 16))
    state = qbits.init_state(_mlp, preset, params, x) or None
    qf = qbits.quantize(_mlp, preset, jax.random.key(2), state=state)
    eager = qf(params, x)
    np.testing.assert_array_equal(eager, jax.jit(qf)(params, x))
    np.testing.assert_array_equal(qf(params, x), eager)  # the kept program


def test_per_call_data_are_arguments_and_checked_each_call(traces):
    def f(params, x):
        return _mlp(params, x)

    params, x = _params(), jax.random.normal(jax.random.key(1), (8, 16))
    state = qbits.init_state(f, "fp8_delayed", params, x)
    traces[0] = 0
    out = qbits.quantize(f, "fp8_delayed", state=state)(params, x)
    # Other scales through the same program: the state is not a constant.
    scaled = jax.tree.map(lambda a: a * 64, state)
    other = qbits.quantize(f, "fp8_delayed", state=scaled)(params, x)
    assert traces[0] == 1
    assert not np.array_equal(out, other)
    # The per-call checks run on a kept program too.
    with pytest.raises(qbits.InvalidArgumentError, match="state"):
        qbits.quantize(f, "fp8_delayed", state={})(params, x)
    qbits.quantize(f, "int8", jax.random.key(0))(params, x)
    with pytest.raises(qbits.InvalidArgumentError, match="key"):
        qbits.quantize(f, "int8")(params, x)
    assert traces[0] == 2


def test_a_jit_trace_keeps_its_program_but_not_its_tracers(traces):
    def f(params, x):
        return _mlp(params, x)

    qf = qbits.quantize(f, "int8_fwd")
    params, x = _params(), jnp.ones((4, 16))
    jitted = jax.jit(qf)(params, x)
    np.testing.assert_array_equal(qf(params, x), jitted)  # eager: kept
    assert traces[0] == 1

    cell = {}

    def g(x):  # reads a weight that is not an argument
        return x @ cell["w"]

    qg = qbits.quantize(g, "int8_fwd", params_argnum=None)

    @jax.jit
    def h(w, x):
        cell["w"] = w  # a tracer of h's trace: a constant of g's program
        return qg(x)

    h(params[0], x)
    cell["w"] = params[1]
    expected = qbits.quantize(lambda x: x @ params[1], "int8_fwd", params_argnum=None)
    np.testing.assert_array_equal(qg(x), expected(x))
    assert traces[0] == 4  # h's program was not kept: g traced again


def test_an_unhashable_static_leaf_runs_uncached(traces):
    def f(params, x, names):
        return _mlp(params, x) * len(names)

    qf = qbits.quantize(f, "int8_fwd")
    params, x = _params(), jnp.ones((4, 16))
    a, b = qf(params, x, {"a"}), qf(params, x, {"a", "b"})
    np.testing.assert_array_equal(b, 2 * a)
    assert traces[0] == 2


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.relu(nn.Dense(16, name="fc1")(x))
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(4, name="fc2")(x)


def test_linen_apply_traces_once(traces):
    qmodel = qbits.flax.quantize(_Mlp(), "int8_fwd")
    x = jnp.ones((2, 8))
    variables = qmodel.init(jax.random.key(0), x)
    traces[0] = 0
    outs = [qmodel.apply(variables, x) for _ in range(10)]
    assert traces[0] == 1
    np.testing.assert_array_equal(outs[0], jax.jit(qmodel.apply)(variables, x))
    # Another method or flag is another program; each kept.
    rngs = {"dropout": jax.random.key(1)}
    for _ in range(3):
        qmodel.apply(variables, x, train=True, rngs=rngs, mutable=["stats"])
    assert traces[0] == 2
    # Another model is another function.
    other = qbits.flax.quantize(_Mlp(), "int8_fwd")
    other.apply(variables, x)
    assert traces[0] == 3


def test_nnx_model_call_traces_once(traces):
    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(8, 16, rngs=rngs)
            self.fc2 = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.fc2(jax.nn.relu(self.fc1(x)))

    x = jnp.ones((2, 8))
    model = qbits.nnx.quantize(Mlp(nnx.Rngs(0)), "int8", rngs=nnx.Rngs(quant=1))
    traces[0] = 0
    before = [model(x) for _ in range(10)][-1]
    assert traces[0] == 1
    model.fc1.kernel[...] = model.fc1.kernel[...] * 2  # new values: no new trace
    after = model(x)
    assert traces[0] == 1
    # The kept program reads the new kernel (an argument, not a constant).
    assert not np.allclose(after, before)
    model(jnp.ones((3, 8)))
    assert traces[0] == 2


def test_the_kept_programs_are_bounded_and_go_with_their_owner():
    programs = _cache.Programs(size=2)

    def f():
        pass

    entries = [types.SimpleNamespace() for _ in range(3)]
    for i, e in enumerate(entries):
        programs.put(f, ("k", i), e)
    assert len(programs) == 2
    assert programs.get(f, ("k", 0)) is None
    assert programs.get(f, ("k", 2)) is entries[2]
    assert programs.get(lambda: None, ("k", 2)) is None  # another owner
    programs.put(f, ("k", 1), entries[1])
    del f
    gc.collect()
    assert len(programs) == 0
