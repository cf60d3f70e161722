"""PTQ of weights the model rearranges before multiplying, or shares.

Hugging Face's Flax GPT-2 stores every kernel ``(out, in)`` (Conv1D) and
transposes it before its matmul, and ties its LM head to the embedding
table; a weight may also serve two matmuls (a recurrence). PTQ quantizes
each weight once, in its matmuls' layout, and writes it back where they
read it; serving then computes what the float model computes on the
written parameters.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.serving as serving
from qbits import ptq

# The module fixtures run once: these tests share one worker.
pytestmark = pytest.mark.xdist_group("ptq_layout")

D, HEADS, DH, V = 32, 2, 16, 32  # two (K, N) shapes: two GPTQ compiles
INT4 = qbits.Quantizer(qbits.IntNumerics(bits=4), granularity=qbits.PerChannel())
W4 = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=INT4))
# Weight-only: the attention's activation x activation einsums stay float.
CONFIG = qbits.QuantConfig(rules=(qbits.Rule(r".*->.*", None),), default=W4)


def gpt2(p, ids):
    """One GPT-2 block, its kernels stored as Hugging Face stores them."""
    x = p["wte"][ids]  # the lookup of the tied embedding
    qkv = x @ p["c_attn"].T  # (3D, D): (out, in), transposed
    q, k, v = (a.reshape(*a.shape[:-1], HEADS, DH) for a in jnp.split(qkv, 3, -1))
    att = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(DH), -1)
    o = jnp.einsum("bhts,bshd->bthd", att, v)
    # (heads * dim, D), reshaped to (heads, dim, D): K = heads x dim
    x = x + jnp.einsum("bthd,hde->bte", o, p["o_proj"].reshape(HEADS, DH, D))
    h = jax.nn.gelu(x @ p["c_fc"].T)  # (out, in), square: the shape cannot tell
    x = x + h @ p["c_proj"].T
    return x @ p["wte"].T  # the tied LM head: (V, D), transposed


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    params = {
        "wte": w(V, D), "c_attn": w(3 * D, D), "o_proj": w(HEADS * DH, D),
        "c_fc": w(D, D), "c_proj": w(D, D),
    }  # fmt: skip
    ids = [rng.integers(0, V, (4, 6)).astype(np.int32) for _ in range(2)]
    stats = ptq.collect_stats(gpt2, params, ids, config=CONFIG)
    return params, ids, stats


def _mse(a, b):
    return float(jnp.mean((a - b) ** 2))


def test_transposed_and_reshaped_kernels_are_quantized_in_the_matmuls_layout(setup):
    params, ids, stats = setup
    assert stats["c_fc"].index is not None  # square: the shapes do not tell
    assert stats["c_attn"].operand(params["c_attn"]).shape == (D, 3 * D)
    # Round to nearest in the matmul's layout: what the engine computes from
    # the float weights (the weights it stores), read from the parameters.
    rtn = ptq.quantize_weights(gpt2, params, None, CONFIG, stats=stats, method="rtn")
    assert [r.path for r in rtn.layers] == list(stats)
    engine = qbits.transform._store_weights(
        qbits.transform._Caller(), gpt2, CONFIG, params, ids[0]
    )
    for path, s in engine.items():
        want = np.asarray(s.weight.dequant())
        np.testing.assert_array_equal(stats[path].operand(rtn.params[path]), want)
    # Per output channel N: each column of the operand (a row of the
    # stored (out, in) kernel) holds 15 levels at most.
    for row in np.asarray(rtn.params["c_fc"]):
        assert len(np.unique(row)) <= 15
    out = ptq.quantize_weights(gpt2, params, None, CONFIG, stats=stats)  # GPTQ
    for r in out.layers:  # its errors, of the parameters as written
        ms = stats[r.path]
        written = ms.matrix(ms.operand(out.params[r.path]))
        d = ms.matrix(ms.operand(params[r.path])) - written
        error = jnp.sum(d * (ms.stats.hessian @ d)) / ms.stats.rows  # tr(d^T H d)
        assert r.error == pytest.approx(float(error), rel=1e-4), r.path
        assert r.error < r.error_rtn, r.path
    # GPTQ's weights, stored as serving stores them (the matmuls' layout),
    # dequantize to the written parameters read in that layout.
    dequant = jax.jit(lambda s: {k: qt.dequant() for k, qt in s.items()})
    for path, w in dequant(out.stored).items():
        np.testing.assert_array_equal(w, stats[path].operand(out.params[path]))


def test_smoothing_and_rotation_write_back_the_transformed_kernels(setup):
    params, ids, stats = setup
    # The tied table: the lookup would read the rotated table. Refused.
    with pytest.raises(qbits.InvalidArgumentError, match=r"rotate.*\['wte'\].*lookup"):
        ptq.quantize_weights(gpt2, params, None, CONFIG, stats=stats, rotate=True)
    # The tied head kept float: its lookup reads the table as it is.
    w8a8 = qbits.QuantConfig(
        rules=(*CONFIG.rules, qbits.Rule("wte", None)), default="int8_fwd"
    )
    out = ptq.quantize_weights(gpt2, params, None, w8a8, stats=stats,
                               method="rtn", smooth=0.5, rotate=True,
                               key=jax.random.key(0))  # fmt: skip
    assert set(out.transforms) == set(stats) - {"wte"}
    ref = jax.jit(gpt2)(params, ids[0])
    got = jax.jit(out.function(gpt2))(out.params, ids[0])
    # W8A8 of the transformed model: the float model within int8 error.
    assert _mse(got, ref) < 1e-3 * float(jnp.mean(ref**2))


def _rnn(p, x):
    """One weight, two matmuls: two steps of a recurrence (``w``, ``w#2``)."""
    h = jnp.tanh(x @ p["w"])
    return jnp.tanh(h @ p["w"]) @ p["out"]


def test_a_weight_shared_by_two_matmuls_is_quantized_once_on_both_statistics():
    rng = np.random.default_rng(1)
    params = {
        "w": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32),
        "out": (rng.standard_normal((D, 8)) / np.sqrt(D)).astype(np.float32),
    }
    x = (rng.standard_normal((64, D)) * np.geomspace(0.1, 10, D)).astype(np.float32)
    stats = ptq.collect_stats(_rnn, params, [x], config=W4)
    out = ptq.quantize_weights(_rnn, params, None, W4, stats=stats, method="gptq")
    assert [(r.path, r.uses) for r in out.layers] == [
        ("w", ("w", "w#2")), ("out", ("out",))
    ]  # fmt: skip
    # GPTQ on H = X1^T X1 + X2^T X2: the output error of both uses.
    merged = stats["w"].stats.hessian + stats["w#2"].stats.hessian
    stats_w = dataclasses.replace(stats["w"].stats, hessian=merged)
    want = ptq.Gptq().quantize(params["w"], stats_w, INT4).weight
    np.testing.assert_array_equal(out.params["w"], want)
    # One stored weight serves both matmuls: the written parameter.
    for path in ("w", "w#2"):
        np.testing.assert_array_equal(out.stored[path].dequant(), out.params["w"])
    sp = serving.convert(_rnn, W4, out, x)
    y = jax.jit(serving.serve(_rnn, W4))(sp, x)
    fake = jax.jit(_rnn)(out.params, x)
    assert np.abs(y - fake).max() < 1e-5 * np.abs(fake).max()

    # Other grids for the two uses, or another layout: no weight lies on both.
    int8 = INT4.replace(numerics=qbits.IntNumerics(bits=8))
    two = qbits.QuantConfig(
        rules=(qbits.Rule("w#2", W4.replace(fwd=W4.fwd.replace(rhs=int8))),),
        default=W4,
    )
    with pytest.raises(qbits.InvalidArgumentError, match=r"'w'.*'w#2'.*\['w'\]"):
        ptq.quantize_weights(_rnn, params, None, two, stats=stats)

    def transposed(p, x):
        return jnp.tanh(jnp.tanh(x @ p["w"]) @ p["w"].T) @ p["out"]

    with pytest.raises(qbits.InvalidArgumentError, match=r"'w#2'.*another layout"):
        ptq.quantize_weights(transposed, params, [x], W4, method="rtn")


def test_a_slice_and_a_broadcast_are_refused_naming_the_matmul():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((2 * D, D)).astype(np.float32)
    x = rng.standard_normal((16, D)).astype(np.float32)

    def two(p, x):  # the halves of one parameter as two weights
        return x @ p["w"][:D].T + x @ p["w"][D:].T

    def groups(p, x):  # one weight for 3 groups: the operand repeats it
        wb = jnp.broadcast_to(p["w"], (3, 2 * D, D))
        return jnp.einsum("gbk,gnk->gbn", jnp.stack([x] * 3), wb)

    for fn, how in ((two, "slices"), (groups, "broadcasts")):
        with pytest.raises(qbits.InvalidArgumentError, match=rf"{how}.*'w'"):
            ptq.quantize_weights(fn, {"w": w}, [x], W4, method="rtn")
