import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import qbits
from tests.helpers import run_script

DN = (((1,), (0,)), ((), ()))


def _run(script: str):
    return run_script(pathlib.Path(__file__).with_name(script))


def test_sharded_equals_unsharded_on_8_cpu_devices():
    result = _run("sharded_check.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sharded results equal unsharded" in result.stdout


def test_gradients_inside_shard_map_on_8_cpu_devices():
    result = _run("shard_map_check.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "shard_map gradients are right" in result.stdout


@pytest.mark.parametrize("preset", ["int8_fwd", "fp8"])
def test_shard_map_with_a_replicated_weight(preset):
    # Data parallel: x split along "d", w replicated. The quantizer lays the
    # scales of tensors quantized together end to end (one kernel); a
    # replicated weight's with a varying activation's broke the per-platform
    # branches' types (on one device, where they are laid together).
    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))
    config = qbits.presets.get(preset)
    dg = qbits.dot_general(config, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 16))
    w = jax.random.normal(jax.random.key(2), (16, 8))

    def loss(x, w):
        return jnp.sum(jnp.tanh(dg(x, w, DN)))

    forward = jax.shard_map(
        lambda x, w: dg(x, w, DN), mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")
    )
    want = jax.jit(lambda x, w: dg(x, w, DN))(x, w)
    np.testing.assert_array_equal(jax.jit(forward)(x, w), want)
    sharded = jax.shard_map(
        lambda x, w: jax.lax.psum(loss(x, w), "d"),
        mesh=mesh,
        in_specs=(P("d"), P()),
        out_specs=P(),
    )
    got = jax.jit(jax.grad(sharded, (0, 1)))(x, w)
    want = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
