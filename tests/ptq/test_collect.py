"""Calibration statistics of every weight matmul, against NumPy references.

Each matmul's activation is recomputed by hand (a plain float forward in
NumPy) and laid out as rows over the weight's contraction channels; the
statistics must be those of these rows, and ``matrix(weight)`` the weight
those rows multiply.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits.ptq import InputStats, collect_stats

RNG = np.random.default_rng(0)


def _normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _check(ms, rows, groups=()):
    """``ms.stats`` are those of ``rows`` (``(*groups, R, K)``, float64)."""
    s = ms.stats
    x = np.asarray(rows, np.float64)
    want_h = np.einsum("...rk,...rl->...kl", x, x)
    np.testing.assert_allclose(s.hessian, want_h, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(s.absmax, np.abs(x).max(-2), rtol=1e-6)
    np.testing.assert_allclose(s.abssum, np.abs(x).sum(-2), rtol=1e-5)
    np.testing.assert_array_equal(s.rows, np.full(groups, x.shape[-2]))
    np.testing.assert_allclose(s.mean_hessian, want_h / x.shape[-2], rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def _raw(p, x):
    h = x @ p["w_in"]  # (B, T, 6) @ (6, 8)
    q = jnp.tanh(jnp.einsum("btd,dnh->btnh", h, p["w_qk"]))
    o = jnp.einsum("btnh,nhd->btd", q, p["w_out"])  # contracts two axes
    heads = jnp.einsum("bth,thd->btd", o[..., :4], p["per_t"])  # a weight per t
    y = p["w_head"] @ o.reshape(-1, 8).T  # the weight on the left
    wide = jnp.broadcast_to(p["shared"], (x.shape[0], 8, 3))
    z = jnp.matmul(o, wide)  # a weight broadcast along a batch axis
    return y.sum() + heads.sum() + z.sum()


RAW = {
    "w_in": _normal(6, 8),
    "w_qk": _normal(8, 2, 4),
    "w_out": _normal(2, 4, 8),
    "per_t": _normal(5, 4, 3),
    "w_head": _normal(7, 8),
    "shared": _normal(8, 3),
}


def _raw_rows(p, x):
    """Each matmul's activation, by hand, as rows over its contraction channels."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    x = np.asarray(x, np.float64)
    h = x @ p["w_in"]
    q = np.tanh(np.einsum("btd,dnh->btnh", h, p["w_qk"]))
    o = np.einsum("btnh,nhd->btd", q, p["w_out"])
    return {
        "w_in": x.reshape(-1, 6),
        "w_qk": h.reshape(-1, 8),
        "w_out": q.reshape(-1, 8),  # (n, h) flattened as the weight's (n, h)
        "per_t": np.transpose(o[..., :4], (1, 0, 2)),  # (t, b, h): one per t
        "w_head": o.reshape(-1, 8),
        "shared": o.reshape(-1, 8),  # the broadcast batch axis is rows
    }


def test_raw_function_stats_are_those_of_each_matmuls_rows():
    x = _normal(2, 5, 6)
    stats = collect_stats(_raw, RAW, [x])
    table = qbits.layer_table(_raw, None, RAW, x)
    assert list(stats) == [row.path for row in table.rows]
    rows = _raw_rows(RAW, x)
    for path, ms in stats.items():
        groups = (5,) if path == "per_t" else ()
        _check(ms, rows[path], groups=groups)
        assert ms.keys == (jax.tree_util.DictKey(path),)
        assert ms.layers == ()
    # K is the weight's contracting axes in order: (n, h) of w_out's (n, h, d).
    assert stats["w_out"].contracting == (0, 1) and stats["w_out"].free == (2,)
    np.testing.assert_array_equal(
        stats["w_out"].matrix(RAW["w_out"]), RAW["w_out"].reshape(8, 8)
    )
    # The rows times the weight as (K, N) give the matmul's outputs.
    x64 = rows["w_out"]
    out = x64 @ np.asarray(stats["w_out"].matrix(RAW["w_out"]), np.float64)
    want = np.einsum("btnh,nhd->btd", x64.reshape(2, 5, 2, 4), RAW["w_out"])
    np.testing.assert_allclose(out, want.reshape(-1, 8), rtol=1e-5, atol=1e-5)
    per_t = np.asarray(stats["per_t"].matrix(RAW["per_t"]))
    np.testing.assert_array_equal(per_t, RAW["per_t"])  # (t, K, N) already
    head = stats["w_head"]
    assert head.side == "rhs" and head.contracting == (1,) and head.free == (0,)
    np.testing.assert_array_equal(head.matrix(RAW["w_head"]), RAW["w_head"].T)
    assert stats["w_in"].side == "lhs"
    assert stats["per_t"].grouped and not stats["shared"].grouped


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, name="fc1")(x))
        return nn.Dense(4, name="head")(x)


def test_linen_stats_stream_over_batches_as_one_concatenated_batch():
    model = Mlp()
    batches = [_normal(4, 3, 8) * s for s in (1.0, 3.0, 0.5)]
    variables = model.init(jax.random.key(0), batches[0])
    streamed = collect_stats(model.apply, variables, batches)
    whole = collect_stats(model.apply, variables, [np.concatenate(batches)])
    assert list(streamed) == ["fc1", "head"]
    p = variables["params"]
    x = np.concatenate(batches).reshape(-1, 8).astype(np.float64)
    h = np.maximum(x @ np.asarray(p["fc1"]["kernel"]) + p["fc1"]["bias"], 0)
    for ms, rows in zip(streamed.values(), (x, h), strict=True):
        _check(ms, rows)
    for a, b in zip(streamed.values(), whole.values(), strict=True):
        np.testing.assert_allclose(a.stats.hessian, b.stats.hessian, rtol=1e-5)
        np.testing.assert_array_equal(a.stats.absmax, b.stats.absmax)
        np.testing.assert_array_equal(a.stats.rows, b.stats.rows)
    assert streamed["fc1"].keys == tuple(
        jax.tree_util.DictKey(k) for k in ("params", "fc1", "kernel")
    )
    np.testing.assert_array_equal(
        streamed["head"].matrix(p["head"]["kernel"]), p["head"]["kernel"]
    )


def _scanned(p, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, x, p["layers"])  # stacked layers: one per step

    def step(h, _):
        return jnp.tanh(h @ p["loop"]), None  # one weight, every step

    h, _ = jax.lax.scan(step, h, None, length=2)
    return jax.lax.cond(h.sum() > 0, lambda h: h @ p["cond"], lambda h: h, h)


def test_scanned_layers_get_stats_per_layer_and_a_loop_sums_its_steps():
    p = {"layers": _normal(3, 4, 4), "loop": _normal(4, 4), "cond": _normal(4, 4)}
    x = _normal(6, 4)
    stats = collect_stats(_scanned, p, [x, -x])
    # The matmul in a cond branch is left out (its statistics cannot leave).
    assert list(stats) == ["layers", "loop"]
    assert stats["layers"].layers == (3,) and stats["loop"].layers == ()
    per_layer, steps = [], []
    for sign in (1, -1):
        h = sign * x.astype(np.float64)
        for w in p["layers"]:
            per_layer.append(h)
            h = np.tanh(h @ w)
        for _ in range(2):
            steps.append(h)
            h = np.tanh(h @ p["loop"])
    layer_rows = np.stack(
        [np.concatenate(per_layer[i::3]) for i in range(3)]
    )  # (layer, rows over both batches, K)
    _check(stats["layers"], layer_rows, groups=(3,))
    _check(stats["loop"], np.concatenate(steps))


def test_config_selects_the_matmuls_its_rules_quantize():
    rules = qbits.QuantConfig(
        rules=(qbits.Rule("w_head|shared|per_t", None),), default="int8"
    )
    x = _normal(2, 5, 6)
    stats = collect_stats(_raw, RAW, [x], config=rules)
    assert list(stats) == ["w_in", "w_qk", "w_out"]
    _check(stats["w_qk"], _raw_rows(RAW, x)["w_qk"])


def _tiny(p, batch):
    return batch["x"] @ p["w"]


def test_bad_batches_are_named_by_index_and_difference():
    p = {"w": np.ones((3, 2), np.float32)}
    good = {"x": np.ones((2, 3), np.float32)}
    with pytest.raises(qbits.InvalidArgumentError, match="at least one batch"):
        collect_stats(_tiny, p, [])
    cases = {
        r"batches\[1\].*\['x'\] float32\[4, 3\] \(batches\[0\]: float32\[2, 3\]\)": (
            {"x": np.ones((4, 3), np.float32)}
        ),
        r"batches\[1\].*\['x'\] float16\[2, 3\]": {"x": np.ones((2, 3), np.float16)},
        r"batches\[1\].*structure": {"x": good["x"], "y": good["x"]},
    }
    for match, bad in cases.items():
        with pytest.raises(qbits.InvalidArgumentError, match=match):
            collect_stats(_tiny, p, [good, bad])
    with pytest.raises(qbits.InvalidArgumentError, match="batches=3"):
        collect_stats(_tiny, p, 3)


def test_input_stats_merge_is_update_and_rejects_other_shapes():
    x = _normal(5, 3)
    a = InputStats.zeros(3).update(x[:2]).update(x[2:])
    b = InputStats.of(x[:2]).merge(InputStats.of(x[2:]))
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-6)
    stacked = InputStats.of(np.stack([x[:2], x[3:]]))  # two groups of two rows
    merged = stacked.merge_leading()
    want = InputStats.of(np.delete(x, 2, 0)).hessian
    np.testing.assert_allclose(merged.hessian, want, rtol=1e-5)
    with pytest.raises(qbits.InvalidArgumentError, match="same shapes"):
        a.merge(InputStats.zeros(4))
    with pytest.raises(qbits.InvalidArgumentError, match="positive int"):
        InputStats.zeros(0)
    with pytest.raises(qbits.InvalidArgumentError, match="float rows"):
        InputStats.of(np.ones((3,), np.float32))
    with pytest.raises(qbits.InvalidArgumentError, match="leading axis"):
        a.merge_leading()
