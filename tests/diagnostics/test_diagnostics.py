"""Diagnostics: the metrics against NumPy, the layer axis, free when off."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qbits
from qbits import diagnostics

DN = (((1,), (0,)), ((), ()))


def _reference(x, xq, scale, top, mapped, amax):
    """The metrics of one operand, in NumPy (float64)."""
    x, xq = np.asarray(x, np.float64), np.asarray(xq, np.float64)
    noise = np.sum((x - xq) ** 2)
    used = amax > 0
    return {
        "sqnr_db": 10 * np.log10(np.sum(x**2) / noise),
        "clipped": np.mean(np.abs(x) > top * scale),
        "flushed": np.sum((x != 0) & (xq == 0)) / np.sum(x != 0),
        "wasted_bits": np.mean(np.log2(mapped * scale[used] / amax[used])),
        "log2_scale_min": np.log2(scale.min()),
        "log2_scale_max": np.log2(scale.max()),
    }


def _forward_metrics(config, x, w):
    dg = qbits.dot_general(config)
    loss = lambda w, probe: jnp.sum(dg(x, w, DN, diagnostics=probe))  # noqa: E731
    raw = jax.jit(jax.grad(loss, argnums=1))(w, qbits.ops._init_probe())
    return qbits.ops._read_probe(raw)


def test_metrics_equal_numpy_int8_clipping_calibration():
    # A bound of half the amax: the largest values saturate; per-channel
    # weights, tiny values flush to zero.
    q = qbits.Quantizer(
        qbits.IntNumerics(bits=8), qbits.AbsMax(clip_factor=0.5), qbits.PerChannel()
    )
    cfg = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=q))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
    w = rng.standard_t(3, size=(32, 6)).astype(np.float32)
    w[:4] = 1e-5  # below half a step: flushed
    m = _forward_metrics(cfg, x, jnp.asarray(w))["fwd.rhs"]

    amax = np.abs(w).max(axis=0, keepdims=True)
    scale = 0.5 * amax / 127.5  # the bound maps onto the top bucket's edge
    xq = np.clip(np.round(w / scale), -127, 127) * scale
    ref = _reference(w, xq, scale, 127.5, 127.5, amax)
    assert ref["clipped"] > 0.05 and ref["flushed"] > 0.05  # the test means it
    for name, want in ref.items():
        np.testing.assert_allclose(float(m[name]), want, rtol=2e-4, atol=1e-6)


def test_metrics_equal_numpy_fp8_per_tensor():
    cfg = qbits.presets.get("fp8")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 32)) * np.exp(rng.normal(size=(16, 32)) * 3)
    x = x.astype(np.float32)
    w = jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)
    m = _forward_metrics(cfg, jnp.asarray(x), w)["fwd.lhs"]

    amax = np.abs(x).max(keepdims=True)
    scale = (amax / 448).astype(np.float32)
    xq = (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    ref = _reference(x, xq, scale, 464, 448, amax)
    assert ref["flushed"] > 0  # the wide spread reaches E4M3's bottom
    for name, want in ref.items():
        np.testing.assert_allclose(float(m[name]), want, rtol=2e-4, atol=1e-6)


def test_backward_operands_and_no_error_cap():
    x = jax.random.normal(jax.random.key(0), (8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 4))
    dg = qbits.dot_general(qbits.presets.get("fp8"))

    def loss(x, w, probe):
        return jnp.sum(dg(x, w, DN, diagnostics=probe) ** 2)

    raw = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, qbits.ops._init_probe())[2]
    m = qbits.ops._read_probe(raw)
    # The gradient 2y, quantized to E5M2 (2 mantissa bits) for both matmuls.
    g = np.asarray(2 * dg(x, w, DN))
    scale = np.abs(g).max() / float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)
    gq = (g / scale).astype(ml_dtypes.float8_e5m2).astype(np.float32) * scale
    want = 10 * np.log10(np.sum(g**2) / np.sum((g - gq) ** 2))
    for slot in ("dlhs.grad", "drhs.grad"):
        np.testing.assert_allclose(float(m[slot]["sqnr_db"]), want, rtol=1e-4)
    # An operand quantized without error is capped.
    exact = jnp.full((16, 4), 448.0)  # E4M3's largest value, scale 1
    m8 = _forward_metrics(qbits.presets.get("fp8"), x, exact)
    assert float(m8["fwd.rhs"]["sqnr_db"]) == 150.0


def _scanned(params, x):
    def body(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, x, params["ws"])
    return jnp.mean(h**2)


def test_metrics_under_scan_have_a_layer_axis():
    params = {"ws": jax.random.normal(jax.random.key(1), (3, 8, 8))}
    x = jax.random.normal(jax.random.key(0), (4, 8))
    probes = diagnostics.init(_scanned, "fp8", params, x)
    assert probes["ws"]["sums"].shape[0] == 3
    _, metrics = diagnostics.diagnose(_scanned, "fp8")(params, x)
    assert metrics.values["ws"]["drhs.grad"]["sqnr_db"].shape == (3,)
    assert [r["matmul"] for r in metrics.rows()][::6] == ["ws[0]", "ws[1]", "ws[2]"]
    # Each layer's weight metrics are that layer's alone.
    alone = _forward_metrics(qbits.presets.get("fp8"), x, params["ws"][2])
    got = metrics.values["ws"]["fwd.rhs"]["sqnr_db"][2]
    np.testing.assert_allclose(got, float(alone["fwd.rhs"]["sqnr_db"]), rtol=1e-5)


def test_a_shared_weight_sums_its_uses():
    # One weight applied at every step of a loop: one probe, no layer axis,
    # the measurements of all its uses added up.
    params = {"w": jax.random.normal(jax.random.key(1), (8, 8))}
    xs = jax.random.normal(jax.random.key(0), (2, 4, 8))

    def f(params, xs):
        return jnp.sum(jax.lax.map(lambda x: x @ params["w"], xs))

    probes = diagnostics.init(f, "int8_fwd", params, xs)
    assert probes["w"]["sums"].shape == qbits.ops._init_probe()["sums"].shape  # 1 layer

    def loss(probes):
        return qbits.quantize(f, "int8_fwd", diagnostics=probes)(params, xs)

    raw = jax.jit(jax.grad(loss))(probes)
    assert float(raw["w"]["sums"][0, 0]) == xs.size  # fwd.lhs: values, both uses
    metrics = diagnostics.read(raw)
    assert metrics.values["w"]["fwd.lhs"]["sqnr_db"].shape == ()
    assert np.isfinite(metrics.values["w"]["fwd.lhs"]["sqnr_db"])


def test_a_nonfinite_operand_is_reported_not_read_as_lossless():
    # A NaN reaching the second matmul's activation and an inf in the third
    # one's weight: those operands are flagged and counted, their metrics
    # are NaN, the table says so; the first matmul is measured as usual.
    rng = np.random.default_rng(3)
    params = {n: rng.standard_normal((6, 6)).astype(np.float32) for n in "abc"}
    params["c"][2, 4] = -np.inf
    x = rng.standard_normal((5, 6)).astype(np.float32)

    def logits(params, x):
        h = jnp.tanh(x @ params["a"]).at[1:3, 0].set(jnp.nan)
        return jnp.tanh(h @ params["b"]) @ params["c"]

    out, metrics = diagnostics.diagnose(logits, "fp8")(params, x)
    assert not np.isfinite(out).any()
    for path, slot, count in (("b", "fwd.lhs", 2), ("c", "fwd.rhs", 1)):
        m = metrics.values[path][slot]
        assert np.isnan(m["sqnr_db"])  # not 150 dB: nothing is lossless here
        assert m["nonfinite"] == count
        assert all(np.isnan(v) for k, v in m.items() if k != "nonfinite")
    assert metrics.values["a"]["fwd.lhs"]["nonfinite"] == 0
    assert 20 < metrics.values["a"]["fwd.lhs"]["sqnr_db"] < 150
    assert metrics.operands == ("fwd.lhs", "fwd.rhs")  # logits: forward only
    rows = metrics.table().splitlines()
    assert rows[2].startswith("| a | 3") and "non-finite" not in rows[2]
    assert rows[3].startswith("| b | non-finite | 3")  # b's weight is fine
    assert rows[4] == "| c | non-finite | non-finite |"  # (NaN spreads)
    assert "| b | non-finite |" in metrics.table("clipped")
    assert "| b | 2 |" in metrics.table("nonfinite", digits=0)


def test_a_while_loop_leaves_out_what_flows_into_it_and_says_so():
    # Reverse mode cannot pass a while_loop: the matmul in its body ("mid")
    # and the one feeding it ("pre") are not measured, nor differentiated;
    # the one after it ("post") is, backward operands included.
    k = jax.random.split(jax.random.key(5), 4)
    params = {n: 0.5 * jax.random.normal(kk, (5, 5)) for n, kk in
              zip(("pre", "mid", "post"), k[:3], strict=True)}  # fmt: skip
    x = jax.random.normal(k[3], (2, 5))

    def loss(params, x, steps):
        def body(carry):
            i, h = carry
            return i + 1, jnp.sin(h @ params["mid"])

        h = jnp.tanh(x @ params["pre"])
        h = jax.lax.cond(steps > 0, lambda h: jax.lax.while_loop(
            lambda c: c[0] < steps, body, (0, h))[1], lambda h: h, h)  # fmt: skip
        return jnp.sum((h @ params["post"]) ** 2)

    with pytest.warns(UserWarning, match=r"while_loop.*'mid', 'pre'.*2 \(of 3\)"):
        value, metrics = diagnostics.diagnose(loss, "fp8")(params, x, 2)
    np.testing.assert_allclose(value, qbits.quantize(loss, "fp8")(params, x, 2))
    for path in ("pre", "mid"):
        assert np.isnan(metrics.values[path]["fwd.rhs"]["sqnr_db"])
    post = metrics.values["post"]
    assert all(post[op]["sqnr_db"] > 20 for op in ("fwd.lhs", "drhs.grad"))


@pytest.mark.parametrize(
    ("grads", "named"),
    [
        ([jnp.zeros((6, 9))], "grads="),  # not a mapping
        ({"w": jnp.ones((4, 2))}, r"grads\['w'\]"),  # the parameters' gradient
        (qbits.ops._init_probe(), r"grads\['sums'\]"),  # one probe, no path
        (
            {"fc": {"sums": jnp.zeros((3, 6, 9)), "maxima": jnp.zeros((2, 6, 2))}},
            r"grads\['fc'\]",  # layer axes that disagree
        ),
    ],
)
def test_read_refuses_what_is_not_probe_gradients(grads, named):
    with pytest.raises(qbits.InvalidArgumentError, match=f"(?s){named}.*probe"):
        diagnostics.read(grads)


def _train_step(diagnose):
    def f(params, x):
        return jnp.mean(jax.nn.relu(x @ params["w1"]) @ params["w2"])

    params = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 8))}
    x = jnp.ones((4, 16))
    kwargs = {} if diagnose == "absent" else {"diagnostics": None}

    def step(params, x):
        g = jax.grad(qbits.quantize(f, "fp8", **kwargs))(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    text = jax.jit(step).lower(params, x).compile().as_text()
    # Source locations differ (the two steps are written on other lines).
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r"line=\d+ end_line=\d+ column=\d+ end_column=\d+", "", text)


def test_diagnostics_off_leaves_the_optimized_hlo_unchanged():
    plain = _train_step("absent")
    assert _train_step("off") == plain
    # No measurement is compiled in: its logarithms appear only with probes.
    assert " log(" not in plain and "log-plus-one" not in plain


def test_metrics_table_and_rows():
    params = {"w": jax.random.normal(jax.random.key(1), (8, 4))}
    x = jax.random.normal(jax.random.key(0), (16, 8))
    logits, metrics = diagnostics.diagnose(
        lambda p, x: x @ p["w"],
        "int8_fwd",  # not a scalar: forward only
    )(params, x)
    assert logits.shape == (16, 4)
    assert metrics.operands == ("fwd.lhs", "fwd.rhs")  # the backward is float
    assert np.isnan(metrics.values["w"]["dlhs.grad"]["sqnr_db"])
    table = metrics.table("clipped", digits=3)
    assert table.splitlines()[2] == "| w | 0.000 | 0.000 |"
    with pytest.raises(qbits.InvalidArgumentError, match="sqnr_db"):
        metrics.table("snr")


def test_wrong_probes_are_refused():
    f = lambda p, x: jnp.sum(x @ p["w"])  # noqa: E731
    params, x = {"w": jnp.ones((4, 2))}, jnp.ones((3, 4))
    with pytest.raises(qbits.InvalidArgumentError, match="diagnostics"):
        qbits.quantize(f, "int8_fwd", diagnostics={"v": None})(params, x)
    dg = qbits.dot_general(qbits.presets.get("int8_fwd"))
    with pytest.raises(qbits.InvalidArgumentError, match=r"diagnostics\.init"):
        dg(x, params["w"], DN, diagnostics={"sums": jnp.zeros(3)})
