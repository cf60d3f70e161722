"""Quantized matmuls inside ``jax.shard_map`` on 8 CPU devices (run as a script).

Gradients inside ``shard_map`` (``check_vma=True``, the default) must have
the varying mesh axes of their operands: the weight gradient is summed over
the data axis, as JAX's own transpose of a replicated operand does. With
per-tensor scales computed per shard, the reference is the sum, over the
shards, of each shard's own quantized gradient. Delayed-scaling state sees
the amax of the whole batch (maxed over the shards).
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


if __name__ == "__main__":
    main()
