"""Quantized matmuls inside ``jax.shard_map`` on 8 CPU devices (run as a script).

Gradients inside ``shard_map`` (``check_vma=True``, the default) must have
the varying mesh axes of their operands: the weight gradient is summed over
the data axis, as JAX's own transpose of a replicated operand does. With
per-tensor scales computed per shard, the reference is the sum, over the
shards, of each shard's own quantized gradient. Delayed-scaling state sees
the amax of the whole batch (maxed over the shards).

``qbits.quantize`` reaches into a ``shard_map`` body (tensor parallelism
written by hand): each matmul there equals ``qbits.dot_general(config)``
called in the body, forward and gradients bit for bit, per-tensor scales
computed per shard; per-tensor delayed scaling (``fp8_delayed``) with its
state crossing the body, the amaxes maxed over the shards.
"""

import os

# Keeps the runner's flags and adds the devices. Level 0 leaves LLVM's
# optimizations of the kernels out (a third of the CPU time here): the
# optimized HLO, its shardings and collectives, is the same.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
    " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import qbits
from qbits.numerics import next_key

DN = (((1,), (0,)), ((), ()))


def main():
    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (64, 32)) * jnp.arange(1.0, 65.0)[:, None]
    w = jax.random.normal(k[1], (32, 16))
    for preset in ("int8", "fp8", "int8_fwd"):
        config = qbits.presets.get(preset)
        dg = qbits.dot_general(config, k[2] if config.needs_key else None)

        def local(x, w, dg=dg):
            return jnp.sum(jnp.tanh(dg(x, w, DN)))

        def body(x, w, local=local):
            return jax.lax.psum(local(x, w), "data")

        sharded = jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P()
        )
        gx, gw = jax.jit(jax.grad(sharded, (0, 1)))(x, w)
        ref_grad = jax.jit(jax.grad(local, (0, 1)))  # eagerly, op by op: slower
        ref = [ref_grad(xs, w) for xs in jnp.split(x, 8)]
        ref_x, ref_w = jnp.concatenate([r[0] for r in ref]), sum(r[1] for r in ref)
        # int8's stochastic rounding draws other noise on each shard than
        # the unsharded reference (the shard's index is in its key).
        tol = 0.03 if config.needs_key else 1e-5
        np.testing.assert_allclose(gx, ref_x, rtol=tol, atol=tol * jnp.abs(ref_x).max())
        np.testing.assert_allclose(gw, ref_w, rtol=tol, atol=tol * jnp.abs(ref_w).max())

    dg = qbits.dot_general(qbits.presets.get("fp8_delayed"))
    state = dg.init_state(x, w, DN)

    def body(x, w, s):
        return jax.lax.psum(jnp.sum(dg(x, w, DN, state=s) ** 2), "data")

    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P()
    )
    _, _, new = jax.jit(jax.grad(sharded, (0, 1, 2)))(x, w, state)
    np.testing.assert_allclose(new["lhs_amax_history"][0], jnp.max(jnp.abs(x)))
    assert new["grad_amax_history"][0] > 0
    # Every shard holds the same 8 rows: the output gradient is the same on
    # every shard, and its stochastic rounding must still differ (the psum of
    # a replicated weight's gradient adds independent errors, not copies).
    config = qbits.presets.get("int8")
    dg = qbits.dot_general(config, k[2])

    def input_grad(x, w):
        return jax.grad(lambda x: jnp.sum(jnp.tanh(dg(x, w, DN))))(x)

    same = jnp.tile(x[:8], (8, 1))
    gx = jax.jit(
        jax.shard_map(
            input_grad, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")
        )
    )(same, w)
    rows = {np.asarray(b).tobytes() for b in jnp.split(gx, 8)}
    assert len(rows) == 8, f"{len(rows)} distinct shards of 8"
    print("shard_map gradients are right")
    engine_inside_shard_map(mesh, x[:, :16], w)
    print("the engine quantizes inside shard_map as by hand")


def engine_inside_shard_map(mesh, x, w):
    """A Megatron MLP by hand: fc1 split by columns, fc2 by rows, one psum."""
    params = {"fc1": {"kernel": w[:16]}, "fc2": {"kernel": w[16:, :8]}}

    def mlp(dots):
        def body(w1, w2, x):
            return jax.lax.psum(dots[1](jnp.tanh(dots[0](x, w1)), w2), "data")

        def f(params, x):
            layer = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(None, "data"), P("data", None), P()),
                out_specs=P(),
            )
            return layer(params["fc1"]["kernel"], params["fc2"]["kernel"], x)

        return f

    f = mlp([jnp.matmul, jnp.matmul])
    table = qbits.layer_table(f, "fp8", params, x)
    got = [(r.path, r.kind, r.operands) for r in table.rows]
    kind = "dot_general (activation x weight), in shard_map"
    assert got == [
        ("fc1", kind, "f32[64,16] x f32[16,2]"),  # each shard's blocks
        ("fc2", kind, "f32[64,2] x f32[2,8]"),
    ], got
    key = jax.random.key(7)
    # The engine's key chain: the body's link, then one per site in order.
    k1 = next_key(next_key(key))
    keys = (k1, next_key(k1))
    presets = ("fp8", "int8", "w4a8")
    pairs = []
    for preset in presets:
        config = qbits.presets.get(preset)
        dots = [
            qbits.dot_general(config, k)
            for k in (keys if config.needs_key else (None, None))
        ]
        hand = mlp([lambda a, b, dg=dg: dg(a, b, DN) for dg in dots])
        quantized = qbits.quantize(f, preset, key if config.needs_key else None)
        pairs.append((quantized, hand))

    def grads(g, params, x):
        return jax.value_and_grad(lambda p, x: jnp.sum(g(p, x) ** 2), (0, 1))(params, x)

    @jax.jit  # one compile for all (CSE merges only what is the same)
    def run(params, x):
        return [[grads(g, params, x) for g in pair] for pair in pairs]

    for preset, (got, want) in zip(presets, run(params, x), strict=True):
        for a, b in zip(*map(jax.tree.leaves, (got, want)), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=preset)
    delayed_inside_shard_map(mesh, f, params, x)


def delayed_inside_shard_map(mesh, f, params, x):
    """Per-tensor delayed scaling inside the body: its state enters
    replicated and each shard's amax is maxed over the shards. A training
    step from a state past its start (scales not 1, a history) equals the
    hand-written body's (the state made outside, passed in replicated) bit
    for bit: output, gradients and new state."""
    state = qbits.init_state(f, "fp8_delayed", params, x)
    state = jax.tree_util.tree_map_with_path(
        lambda path, v: v + (0.75 if "scale" in jax.tree_util.keystr(path) else 2.0),
        state,
    )
    dg = qbits.dot_general(qbits.presets.get("fp8_delayed"))

    def by_hand(params, x, state):
        def body(w1, w2, x, s1, s2):
            h = jnp.tanh(dg(x, w1, DN, state=s1))
            return jax.lax.psum(dg(h, w2, DN, state=s2), "data")

        specs = (P(None, "data"), P("data", None), P(), P(), P())
        layer = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())
        return layer(params["fc1"]["kernel"], params["fc2"]["kernel"], x,
                     state["fc1"], state["fc2"])  # fmt: skip

    def engine(params, x, state):
        return qbits.quantize(f, "fp8_delayed", state=state)(params, x)

    def step(g, params, x, state):
        loss = lambda p, x, s: jnp.sum(g(p, x, s) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, (0, 1, 2))(params, x, state)

    @jax.jit
    def steps(params, x, state):
        return [step(g, params, x, state) for g in (engine, by_hand)]

    got, want = steps(params, x, state)
    for a, b in zip(*map(jax.tree.leaves, (got, want)), strict=True):
        np.testing.assert_array_equal(a, b, err_msg="fp8_delayed")
    new = got[1][2]["fc1"]  # the whole weight's amax, not a shard's
    w1 = params["fc1"]["kernel"]
    np.testing.assert_array_equal(new["rhs_amax_history"][0], jnp.max(jnp.abs(w1)))
    assert float(new["rhs_scale"][0]) != 1.75  # the scale moved with the history


if __name__ == "__main__":
    main()
