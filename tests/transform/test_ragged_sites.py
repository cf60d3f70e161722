"""The engine quantizes grouped matmuls (lax.ragged_dot) like other matmuls."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import qbits
from qbits._experiments._moe import moe

INT8 = qbits.Quantizer(qbits.IntNumerics(bits=8), granularity=qbits.PerChannel())
MM = qbits.MatmulConfig(lhs=INT8, rhs=INT8)
CONFIG = qbits.DotGeneralConfig(fwd=MM, dlhs=MM, drhs=MM)  # rounds to nearest


def _normal(*shapes, scale=1.0):
    rng = np.random.default_rng(0)  # numpy: no random kernels to compile
    return [
        jnp.asarray((rng.standard_normal(s) * scale).astype(np.float32)) for s in shapes
    ]


def test_quantize_runs_a_moe_blocks_ragged_dots_through_the_core():
    """The experts' ragged dots are sites named by their weights, listed as
    quantized; the quantized block is the block written with
    qbits.ops.ragged_dot and qbits.dot_general."""
    (x,) = _normal((12, 8))
    router, w_in, w_out = _normal((8, 4), (4, 8, 16), (4, 16, 8), scale=0.3)
    params = {"router": router, "w_in": w_in, "w_out": w_out}
    table = qbits.layer_table(moe, CONFIG, params, x)
    assert [(r.path, r.kind, r.kept) for r in table.rows] == [
        ("router", "dot_general (activation x weight)", ""),
        ("w_in", "ragged_dot (activation x weight)", ""),
        ("w_out", "ragged_dot (activation x weight)", ""),
    ]
    direct = functools.partial(
        moe,
        ragged_dot=qbits.ops.ragged_dot(CONFIG),
        dot_general=qbits.dot_general(CONFIG),
    )
    got = jax.jit(qbits.quantize(moe, CONFIG))(params, x)
    np.testing.assert_array_equal(got, jax.jit(direct)(params, x))


def test_scale_state_of_a_ragged_dot():
    """Delayed scaling: the engine initialises a ragged dot's state, and a
    training step's gradient of it is the next state."""

    def f(params, x):
        return jax.lax.ragged_dot(x, params["experts"], jnp.array([5, 0, 7]))

    x, w = _normal((12, 8), (3, 8, 4))
    params = {"experts": w}
    state = qbits.init_state(f, "fp8_delayed", params, x)

    @jax.jit
    @jax.grad
    def new_state(state):
        return jnp.sum(qbits.quantize(f, "fp8_delayed", state=state)(params, x) ** 2)

    history = new_state(state)["experts"]["rhs_amax_history"]
    np.testing.assert_allclose(history[0], np.abs(w).max())
