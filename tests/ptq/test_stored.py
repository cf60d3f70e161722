"""Serving what PTQ quantized: GPTQ's (and RTN's) own codes and scales.

``quantize_weights`` hands over each weight stored as serving stores it
(``PtqResult.stored``); ``serving.convert(fn, config, result, x)`` keeps
them, instead of quantizing the weights on their grids again.
"""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.serving as serving
from qbits import ptq

# The module fixtures run once: these tests share one worker.
pytestmark = pytest.mark.xdist_group("ptq_stored")

# One format per weight, in a scan over two stacked layers: symmetric int4
# in groups of 128, uint4 with zero points (an einsum's transposed weight),
# NF4, NVFP4. Bytes of one [K, N] layer, as convert stores them.
CONFIG = qbits.QuantConfig(
    rules=(
        qbits.Rule(r".*asym.*", "w4g128_asym"),
        qbits.Rule(r".*nf4.*", "nf4"),
        qbits.Rule(r".*nvfp4.*", "nvfp4_weight_only"),
    ),
    default="int4_weight_only",
)
BYTES = {  # packed codes; float32 scales, int16 zero points, e4m3 + one float32
    "int4": 128 * 64 + 128 * 4,
    "asym": 128 * 64 + 128 * 6,
    "nf4": 128 * 64 + 256 * 4,
    "nvfp4": 128 * 64 + 1024 + 4,
}


def model(params, x):
    def layer(h, p):
        h = jax.nn.relu(h @ p["int4"])
        h = jax.nn.relu(jnp.einsum("bk,nk->bn", h, p["asym"]))  # (N, K) weight
        h = jax.nn.relu(h @ p["nf4"])
        return jax.nn.relu(h @ p["nvfp4"]), None

    return jax.lax.scan(layer, x, params)[0]


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)

    def w(*shape, shift=0.0):
        return (rng.standard_normal(shape) * 0.1 + shift).astype(np.float32)

    params = {"int4": w(2, 128, 128), "asym": w(2, 128, 128, shift=0.03),
              "nf4": w(2, 128, 128), "nvfp4": w(2, 128, 128)}  # fmt: skip
    scales = np.geomspace(0.1, 10, 128).astype(np.float32)  # outlier channels
    x = rng.standard_normal((64, 128)).astype(np.float32) * scales
    return params, x


def _mse(a, b):
    return float(jnp.mean((a - b) ** 2))


@pytest.mark.optimized  # float4 casts: XLA's default CPU emitters
def test_gptq_serves_its_own_codes_and_scales_in_every_format(setup):
    params, x = setup
    out = ptq.quantize_weights(model, params, [x], CONFIG, method="gptq")
    assert list(out.stored) == list(params)
    # Each stored weight dequantizes to GPTQ's weight bit for bit (the
    # transposed einsum weight as its operand, the scan's layers stacked).
    dequant = jax.jit(lambda s: {k: qt.dequant() for k, qt in s.items()})
    for path, w in dequant(out.stored).items():
        assert out.stored[path].shape == params[path].shape
        np.testing.assert_array_equal(w, out.params[path], err_msg=path)

    sp = serving.convert(model, CONFIG, out, x)  # the one way to serve it
    y = jax.jit(serving.serve(model, CONFIG))(sp, x)
    fake = jax.jit(model)(out.params, x)  # GPTQ's weights in float
    # Equal up to the int4 matmul's rounding (its scales multiply the dot);
    # the served error is GPTQ's.
    assert np.abs(y - fake).max() < 1e-6 * np.abs(fake).max()
    ref = jax.jit(model)(params, x)
    assert _mse(y, ref) == pytest.approx(_mse(fake, ref), rel=1e-4)
    for r in serving.size_report(sp).layers:  # the bytes convert stores
        assert r.bytes == 2 * BYTES[r.path], r.path


class Heads(nnx.Module):  # a weight per head, its own (K, N) matrix: w @ x
    def __init__(self, w):
        self.w = nnx.Param(jnp.asarray(w))

    def __call__(self, x):
        return jnp.einsum("bhk,hkn->bhn", x, self.w[...])


def test_round_to_nearest_stores_what_convert_stores_and_errors_say_why():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 128, 16)).astype(np.float32)
    x = rng.standard_normal((8, 2, 128)).astype(np.float32)
    model, int4 = Heads(w), "int4_weight_only"
    fn, state = qbits.nnx.as_function(model)  # PTQ runs on the model's function
    out = ptq.quantize_weights(fn, state, [x], int4, method="rtn")
    served = serving.convert(model, int4, out, x)  # the model on out.params
    # RTN's grid is the engine's own: its stored weight is bit for bit what
    # convert stores from the float weight (the rounded weight, rounded
    # again, gets other scales on a symmetric grid).
    want = qbits.ops._store_weight(w, qbits.presets.get(int4).fwd, (1,))
    for k in ("qvalue", "scale"):
        got = served.qbits.stored["w"][k][...]
        np.testing.assert_array_equal(got, getattr(want, k), err_msg=k)
    y = nnx.jit(lambda m, x: m(x))(served, x)
    fake = jax.jit(fn)(out.params, x)[0]
    assert np.abs(y - fake).max() < 1e-6 * np.abs(fake).max()
    with pytest.warns(UserWarning, match="'w' again"):  # as AWQ: nothing stored
        again = serving.convert(model, int4, out._replace(stored={}), x)
    assert not np.array_equal(again.qbits.stored["w"]["scale"][...], want.scale)

    with pytest.raises(qbits.InvalidArgumentError, match=r"stored\['w'\]"):
        serving.convert(model, "nf4", out, x)  # NF4's groups of 64, not 128
    with pytest.raises(qbits.InvalidArgumentError, match="'v'"):
        serving.convert(model, int4, out._replace(stored={**out.stored, "v": 0}), x)
    with pytest.raises(qbits.InvalidArgumentError, match="online"):
        smoothed = out._replace(transforms={"w": {"scale": jnp.ones((2, 128))}})
        serving.convert(fn, int4, smoothed, x)


def test_blocks_that_fit_the_matrix_but_not_the_operand_are_not_stored():
    # The output projection of attention contracts (heads, head_dim) = 4 x 32:
    # groups of 128 fit the flattened K = 128 that PTQ works on, not the
    # operand's 32-wide axis that serving quantizes along. The weights are
    # still written; only the stored copy is left out.
    rng = np.random.default_rng(2)
    p = {"w": rng.standard_normal((4, 32, 16)).astype(np.float32)}
    x = rng.standard_normal((8, 4, 32)).astype(np.float32)
    out = ptq.quantize_weights(
        lambda p, x: jnp.einsum("bhk,hkn->bn", x, p["w"]), p, [x], "w4g128_asym"
    )
    assert [r.path for r in out.layers] == ["w"] and not out.stored
    assert not np.array_equal(out.params["w"], p["w"])
