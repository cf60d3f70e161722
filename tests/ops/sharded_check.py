"""Run with 8 CPU devices: sharded quantized matmuls equal unsharded ones.

Invoked by test_sharding.py in a subprocess (XLA_FLAGS must be set before JAX
starts). Exits non-zero on a mismatch.
"""

import functools
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
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qbits


def main():
    assert jax.device_count() == 8, jax.devices()
    per_channel = qbits.Quantizer(
        qbits.IntNumerics(bits=8), granularity=qbits.PerChannel()
    )
    per_tensor = qbits.Quantizer(qbits.IntNumerics(bits=8))
    fp8 = qbits.Quantizer(qbits.numerics.Fp8Numerics())
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (32, 64))
    w1 = jax.random.normal(k[1], (64, 128)) / 8
    w2 = jax.random.normal(k[2], (128, 16)) / 11
    dn = (((1,), (0,)), ((), ()))
    # fp8 in fake mode is per_tensor's fake float dot with another rounding
    # (elementwise, nothing a sharding changes): fp8_fake_with_sharded_contraction
    # runs it where the sharding matters, along the contracting axis.
    cases = [(per_channel, "real"), (per_channel, "fake"), (per_tensor, "real"),
             (per_tensor, "fake"), (fp8, "real")]  # fmt: skip
    for q, mode in cases:
        m = qbits.MatmulConfig(lhs=q, rhs=q, mode=mode)
        dg = qbits.dot_general(qbits.DotGeneralConfig(m, m, m))

        def loss(x, w1, w2, dg=dg):
            h = jax.nn.relu(dg(x, w1, dn))
            return jnp.sum(dg(h, w2, dn) ** 2)

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        expected = f(x, w1, w2)
        sx = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        sw1 = jax.device_put(w1, NamedSharding(mesh, P(None, "model")))
        sw2 = jax.device_put(w2, NamedSharding(mesh, P("model", None)))
        got = f(sx, sw1, sw2)
        assert len(got[1][1].sharding.device_set) == 8
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(
                a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max())
            )
    fp8_fake_with_sharded_contraction(mesh, x, w1, w2, dn)
    explicit_sharding(x, w1, w2, dn)
    print("sharded results equal unsharded")


def fp8_fake_with_sharded_contraction(mesh, x, w1, w2, dn):
    """The documented bound when the contracting axis is sharded.

    Partial sums in another order change the forward output by float32
    rounding; a quantized value that sits on a rounding boundary of the
    gradient's grid can then land one grid step apart. Most elements agree
    to float32 rounding; none differs by more than one E5M2 step (2**-2
    relative, plus the scale's own float32 change).
    """
    cfg = qbits.presets.get("fp8")
    fake = {m: getattr(cfg, m).replace(mode="fake") for m in ("fwd", "dlhs", "drhs")}
    dg = qbits.dot_general(cfg.replace(**fake))

    def loss(x, w1, w2):
        h = jax.nn.relu(dg(x, w1, dn))
        return jnp.sum(dg(h, w2, dn) ** 2)

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    expected = f(x, w1, w2)
    got = f(
        jax.device_put(x, NamedSharding(mesh, P("data", "model"))),
        jax.device_put(w1, NamedSharding(mesh, P("model", None))),
        jax.device_put(w2, NamedSharding(mesh, P(None, "model"))),
    )
    for a, b in zip(got, expected, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-6 * np.abs(b).max())
        assert np.median(rel) < 1e-5, np.median(rel)
        assert rel.max() <= 0.25 + 1e-5, rel.max()


BATCH_SHARDED = P("data", None)


def explicit_sharding(x, w1, w2, dn):
    """Explicit sharding (the mesh axes in the types): gradients have their
    operands' shardings, as with lax.dot_general."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    q = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=qbits.PerChannel())
    m = qbits.MatmulConfig(lhs=q, rhs=q)
    results = {}
    for name, dg in (
        ("lax", jax.lax.dot_general),
        ("qbits", qbits.dot_general(qbits.DotGeneralConfig(m, m, m))),
    ):

        def loss(x, w1, w2, dg=dg, out_sharding=BATCH_SHARDED):
            h = jax.nn.relu(dg(x, w1, dn))
            return jnp.sum(dg(h, w2, dn, out_sharding=out_sharding) ** 2)

        with jax.set_mesh(mesh):
            args = (
                jax.device_put(x, P("data", None)),
                jax.device_put(w1, P(None, "model")),
                jax.device_put(w2, P("model", None)),
            )
            _, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
        results[name] = [g.sharding.spec for g in grads]
        plain = functools.partial(loss, out_sharding=None)
        unsharded = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(x, w1, w2)[1]
        for a, b in zip(grads, unsharded, strict=True):
            np.testing.assert_allclose(
                a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max())
            )
    assert results["qbits"] == results["lax"], results


if __name__ == "__main__":
    main()
