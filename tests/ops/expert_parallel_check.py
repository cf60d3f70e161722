"""Expert-parallel MoE on 8 CPU devices equals the unsharded one (a script).

``moe_expert_parallel`` (``qbits/_experiments/_moe.py``) inside
``jax.shard_map``: 16 experts, 2 per device, the tokens split over the
same axis; every ragged dot quantized int8 with per-row and per-expert
scales (round to nearest, real mode), ReLU between them. The output and
both experts' weight gradients equal the unsharded :func:`moe` bit for bit.
The router (float, replicated, data parallel) runs its matmuls on 8 tokens
per device instead of 64 and has its weight gradient summed over the
devices: its gradient and its share of the input gradient agree within
float32 rounding.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import qbits
from qbits import DotGeneralConfig, IntNumerics, MatmulConfig, PerChannel, Quantizer
from qbits._experiments._moe import init_moe, moe, moe_expert_parallel

INT8 = Quantizer(IntNumerics(bits=8), granularity=PerChannel())
MM = MatmulConfig(lhs=INT8, rhs=INT8, mode="real")


def main():
    assert jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    rd = qbits.ops.ragged_dot(DotGeneralConfig(fwd=MM, dlhs=MM, drhs=MM))
    params = init_moe(jax.random.key(0), 16, 32, 16)
    k = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(k[0], (64, 16))
    ct = jax.random.normal(k[1], (64, 16))
    specs = {"router": P(), "w_in": P("expert"), "w_out": P("expert")}
    sharded = jax.shard_map(
        lambda p, x: moe_expert_parallel(
            p, x, axis_name="expert", ragged_dot=rd, activation=jax.nn.relu
        ),
        mesh=mesh,
        in_specs=(specs, P("expert")),
        out_specs=P("expert"),
    )

    @jax.jit
    def both(params, x, ct):
        out = []
        unsharded = lambda p, x: moe(p, x, ragged_dot=rd, activation=jax.nn.relu)  # noqa: E731
        for f in (sharded, unsharded):
            y, vjp = jax.vjp(f, params, x)
            out.append((y, *vjp(ct)))
        return out

    (y, gp, gx), (y0, gp0, gx0) = both(params, x, ct)
    assert float(jnp.abs(y0).max()) > 0 and float(jnp.abs(gp0["w_in"]).max()) > 0
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(gp["w_in"], gp0["w_in"])
    np.testing.assert_array_equal(gp["w_out"], gp0["w_out"])
    np.testing.assert_allclose(gx, gx0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gp["router"], gp0["router"], rtol=1e-5, atol=1e-6)
    print("expert-parallel MoE equals unsharded")

    fp8 = qbits.ops.ragged_dot(qbits.presets.get("fp8"))
    try:
        jax.eval_shape(
            jax.shard_map(
                lambda p, x: moe_expert_parallel(p, x, axis_name="expert",
                                                 ragged_dot=fp8),
                mesh=mesh, in_specs=(specs, P("expert")), out_specs=P("expert"),
            ),
            params, x,
        )  # fmt: skip
    except qbits.InvalidArgumentError as e:
        assert "per-tensor scale spans all experts" in str(e), e
        print("per-tensor scales refused")
    else:
        raise AssertionError("fp8's per-tensor scales were not refused")


if __name__ == "__main__":  # before JAX starts its backend: 8 CPU devices
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
        " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    )
    main()
