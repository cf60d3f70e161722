"""qbits.optim: the maps, blockwise quantization against bitsandbytes, states."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qbits
from qbits import optim
from qbits.numerics._dynamic import count_below as _count_below
from qbits.numerics._dynamic import dynamic_map
from qbits.optim._blockwise import dequantize, levels, quantize

FIXTURE = pathlib.Path(__file__).parents[1] / "data" / "bnb_optim.npz"
FORMATS = [(8, "dynamic"), (8, "linear"), (8, "fp8"), (4, "dynamic"), (4, "linear")]


def _standard(fn):
    """optax's bias correction computes float ** int32 (strict promotion refuses)."""

    def run(*args):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args)

    return run


def _moments(state):
    """The ScaleByAdamState inside an optim.adamw state."""
    return state[0].inner


def test_maps_are_sorted_bounded_and_keep_their_shape():
    for signed in (True, False):
        m = dynamic_map(signed)
        assert m.dtype == np.float32 and m.shape == (256,)
        assert np.all(np.diff(m) > 0) and m[-1] == 1.0 and 0.0 in m
        assert m[0] < -0.99 if signed else m[0] == 0.0
    # The unsigned dynamic map reaches 1e-7 (its smallest level but zero).
    assert 1e-7 < dynamic_map(False)[1] < 1e-6
    for bits, fmt in FORMATS[:2] + FORMATS[3:]:
        for signed in (True, False):
            table = levels(fmt, bits, signed)
            assert table.size <= 2**bits and np.all(np.diff(table) > 0)
            assert table[-1] == 1.0 and (table[0] < -0.8 if signed else table[0] >= 0)
    # The second moment's 4-bit and linear maps have no zero (torchao).
    assert levels("dynamic", 4, False)[0] == 1 / 16
    assert levels("linear", 8, False)[0] == 1 / 256
    assert levels("fp8", 8, True) is None


def test_the_level_lookup_is_a_searchsorted_of_every_map():
    # The nearest level is a count of midpoints below (a tie to the lower
    # level), stochastic rounding's a count of levels at or below: one
    # bucket lookup on the float's top bits and one comparison, which must
    # agree with counting on every value, the midpoints and their neighbours.
    rng = np.random.default_rng(2)
    spread = rng.uniform(-1, 1, 4096) * 10.0 ** rng.uniform(-10, 0, 4096)
    tables = []
    for bits, fmt in FORMATS[:2] + FORMATS[3:]:
        for signed in (True, False):
            t = levels(fmt, bits, signed)
            tables += [((t[:-1] + t[1:]) / np.float32(2), False), (t, True)]
    xs = []
    for table, _ in tables:
        up = np.nextafter(table, np.float32(np.inf))
        down = np.nextafter(table, np.float32(-np.inf))
        special = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf]
        x = np.concatenate([table, up, down, spread, special]).astype(np.float32)
        # (not the neighbours of 0: XLA on CPU reads subnormal numbers as 0)
        xs.append(x[(x == 0) | (np.abs(x) >= np.finfo(np.float32).tiny)])

    @jax.jit
    def count(xs):
        return [_count_below(t, x, inc) for (t, inc), x in zip(tables, xs, strict=True)]

    for (table, inclusive), x, got in zip(tables, xs, count(xs), strict=True):
        below = table <= x[:, None] if inclusive else table < x[:, None]
        np.testing.assert_array_equal(np.asarray(got), below.sum(1))
    assert int(count([jnp.full_like(x, jnp.nan) for x in xs])[0][0]) == 0


def test_round_trip_is_within_half_a_level_and_idempotent():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 256)).astype(np.float32) * np.exp(
        rng.uniform(-6, 0, (8, 256))
    ).astype(np.float32)
    x[3] = 0.0  # an all-zero block stays zero
    key = jnp.asarray([7, 9], jnp.uint32)

    @jax.jit
    def run(x):
        out = {}
        for bits, fmt in FORMATS:
            for signed in (True, False):
                v = x if signed else x * x
                q = quantize(v, fmt, bits, signed, 128)
                back = dequantize(q)
                again = quantize(back, fmt, bits, signed, 128)
                sr = dequantize(quantize(v, fmt, bits, signed, 128, key))
                out[bits, fmt, signed] = (v, q, back, again, sr)
        return out

    for (bits, fmt, signed), (v, q, back, again, sr) in run(x).items():
        v, back, sr = np.asarray(v), np.asarray(back), np.asarray(sr)
        absmax = np.abs(v.reshape(-1, 128)).max(1).repeat(128).reshape(v.shape)
        assert q.codes.dtype == (jnp.float8_e4m3fn if fmt == "fp8" else jnp.uint8)
        assert q.codes.shape == (8, 256 if bits == 8 else 128)
        assert np.all(back[3] == 0.0)
        # Dequantized values are levels: quantizing them again changes nothing
        # (where the block's absmax is a level: not under the signed dynamic
        # maps, whose most negative level is -0.993 or -0.8875).
        if not (signed and fmt == "dynamic"):
            np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(q.codes))
        if fmt == "fp8":
            assert np.all(np.abs(back - v) <= absmax / 16)  # 3 mantissa bits
            continue
        table = levels(fmt, bits, signed)
        gap = np.diff(table).max() / 2 + (table[0] if not signed else 0)
        assert np.all(np.abs(back - v) <= gap * absmax * 1.001)
        # Stochastic rounding gives one of the two levels around a value.
        ratio = np.where(absmax > 0, sr / np.where(absmax > 0, absmax, 1), 0)
        nearest_level = np.abs(ratio[..., None] - table).min(-1)
        assert np.all((nearest_level <= 1e-5) | (absmax == 0))
        assert np.all(np.abs(sr - v) <= 2 * gap * absmax * 1.001)


def test_agrees_with_bitsandbytes_blockwise_quantization_and_adamw8bit():
    ref = np.load(FIXTURE)
    np.testing.assert_array_equal(dynamic_map(True), ref["map_signed"])
    np.testing.assert_array_equal(dynamic_map(False), ref["map_unsigned"])
    x = jnp.asarray(ref["x"])
    for name, values, signed, size in (
        ("signed", x, True, 2048),
        ("unsigned", x * x, False, 256),
    ):
        q = jax.jit(quantize, static_argnums=(1, 2, 3, 4))(
            values, "dynamic", 8, signed, size
        )  # compiled: one program, not one an op
        np.testing.assert_array_equal(np.asarray(q.codes), ref[f"codes_{name}"])
        np.testing.assert_array_equal(np.asarray(q.absmax), ref[f"absmax_{name}"])

    # Two steps of bitsandbytes' AdamW8bit (block size 256) on 5000 params.
    tx = optim.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    params = jnp.asarray(ref["p0"])
    state = jax.jit(tx.init)(params)
    step = jax.jit(_standard(lambda g, s, p: tx.update(g, s, p)))
    for k in (1, 2):
        updates, state = step(jnp.asarray(ref[f"g{k}"]), state, params)
        params = optax.apply_updates(params, updates)
        adam = _moments(state)
        for moment, n in ((adam.mu, 1), (adam.nu, 2)):
            codes = np.asarray(moment.codes)
            same = codes == ref[f"state{n}_{k}"]
            # float32 m, v computed in another order: a value on a midpoint
            # may round the other way (one code at most, a handful).
            assert same.mean() >= 0.998, (k, n, same.mean())
            off = codes[~same].astype(int) - ref[f"state{n}_{k}"][~same]
            assert np.all(np.abs(off) == 1)
            np.testing.assert_allclose(moment.absmax, ref[f"absmax{n}_{k}"], rtol=1e-6)
        np.testing.assert_allclose(params, ref[f"p{k}"], rtol=0, atol=1e-6)


def test_states_bytes_dtypes_and_small_leaves_kept_float():
    params = {
        "w": jnp.ones((256, 128)),
        "b": jnp.zeros((128,)),
        "e": jnp.ones((64, 96)),
    }

    def nbytes(state):  # of the shapes and dtypes (the benchmark measures arrays)
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))

    base = nbytes(jax.eval_shape(optax.adamw(1e-3).init, params))
    sizes = {}
    for bits, fmt in FORMATS:
        state = jax.eval_shape(
            optim.adamw(1e-3, state_bits=bits, state_format=fmt).init, params
        )
        adam = _moments(state)
        assert adam.mu["b"].dtype == jnp.float32  # 128 < 4096 elements
        assert adam.nu["w"].codes.dtype == (
            jnp.float8_e4m3fn if fmt == "fp8" else jnp.uint8
        )
        sizes[bits, fmt] = nbytes(state) / base
    assert sizes[8, "dynamic"] <= 0.27 and sizes[4, "dynamic"] <= 0.15
    # Everything below min_size stays float32.
    state = optim.adamw(1e-3, min_size=2**20).init(params)
    assert nbytes(state) == base
    float_state = optax.adamw(1e-3).init(params)
    assert [x.dtype for x in jax.tree.leaves(state)] == [
        x.dtype for x in jax.tree.leaves(float_state)
    ]


def test_states_keep_their_sharding_under_jit_and_through_orbax(tmp_path):
    import orbax.checkpoint as ocp

    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("d", None)))
        params = {"w": w, "rest": [jnp.zeros(5), (jnp.ones((16, 256)),)]}  # any tree
        tx = optim.quantize_states(
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
            state_bits=4,
            stochastic_rounding=True,
        )
        state = jax.jit(tx.init)(params)  # compiled: one program, not one an op
        updates, state = jax.jit(_standard(tx.update))(params, state, params)
        adam = state.inner[1][0]
        for moment in (adam.mu["w"], adam.nu["w"]):
            assert moment.codes.sharding.spec == P("d", None)
            assert moment.absmax.sharding.spec == P("d", None)
        assert updates["w"].sharding.spec == P("d", None)
        assert isinstance(adam.nu["rest"][1][0], optim.QuantizedMoment)

        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp_path / "state", state)
            ckpt.wait_until_finished()
            target = jax.tree.map(qbits._sharding.abstract, state)
            restored = ckpt.restore(tmp_path / "state", target)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_quantized_adamw_tracks_float_adamw_on_a_small_regression():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32)
    y = jnp.tanh(x @ target)
    params = {
        "w": jnp.zeros((64, 64)),
        "v": jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32),
    }

    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w"]) @ (jnp.eye(64) + p["v"]) - y) ** 2)

    def train(tx):
        def body(carry, _):
            p, s = carry
            value, grads = jax.value_and_grad(loss)(p)
            updates, s = tx.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), value

        _, curve = jax.lax.scan(body, (params, tx.init(params)), length=60)
        return curve

    float_tx = optax.adamw(3e-3, weight_decay=1e-4)
    tx8 = optim.adamw(3e-3, min_size=1024)
    # 4-bit first moments rounded to nearest lose the small steps of a short
    # run (0.04 against 0.021 here); stochastic rounding keeps them.
    tx4 = optim.adamw(3e-3, min_size=1024, state_bits=4, stochastic_rounding=True)
    curves = jax.jit(_standard(lambda: [train(t) for t in (float_tx, tx8, tx4)]))()
    base, q8, q4 = (np.asarray(c) for c in curves)
    assert base[-1] < 0.5 * base[0]
    assert abs(q8[-1] / base[-1] - 1) < 0.03 and abs(q4[-1] / base[-1] - 1) < 0.25


def test_errors_name_the_argument():
    with pytest.raises(qbits.InvalidArgumentError, match="state_format"):
        optim.adamw(1e-3, state_bits=4, state_format="fp8")
    with pytest.raises(qbits.InvalidArgumentError, match="bits"):
        optim.quantize_states(optax.adam(1e-3), state_bits=2)
    with pytest.raises(qbits.InvalidArgumentError, match="inner"):
        optim.quantize_states(optax.adam)
    tx = optim.quantize_states(optax.sgd(0.1))  # no momentum: no moment to store
    with pytest.raises(qbits.InvalidArgumentError, match="moment field"):
        jax.jit(tx.init)({"w": jnp.ones(8)})  # raised while tracing
    tx = optim.quantize_states(optax.sgd(0.1, momentum=0.9), min_size=0)
    assert isinstance(
        jax.jit(tx.init)({"w": jnp.ones(8)}).inner[0].trace["w"], optim.QuantizedMoment
    )


def test_the_example_models_adamw8bit_in_an_nnx_optimizer():
    import flax.nnx as nnx

    from qbits._experiments._train import make_optimizer

    model = nnx.Linear(64, 128, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_optimizer("adamw8bit", 1e-3), wrt=nnx.Param)
    # The functional style of qbits train: the state out of one step goes in
    # the next (a moment's codes and scales stay two arrays of nnx's state).
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        with jax.numpy_dtype_promotion("standard"):
            optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    new = step(step(state, jnp.ones((4, 64))), jnp.ones((4, 64)))
    assert jax.tree.structure(new) == jax.tree.structure(state)
    _, optimizer = nnx.merge(graphdef, new)
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(optimizer, nnx.OptState))}
    assert jnp.dtype(jnp.uint8) in dtypes  # the kernel's moments
    assert int(optimizer.step[...]) == 2
