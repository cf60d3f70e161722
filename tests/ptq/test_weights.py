"""qbits.ptq.quantize_weights: the driver, on a model that is no Flax layer stack."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits import ptq

D, H, N_HEADS, F, LAYERS = 32, 16, 4, 64, 2  # wq, wo: the shapes of up, down


def _model(params, x):
    """Raw einsums, ``@`` and a ``lax.scan`` over stacked weights."""
    q = jnp.einsum("btd,dnh->btnh", x, params["wq"])
    x = x + jnp.einsum("btnh,nhd->btd", jax.nn.tanh(q), params["wo"])

    def block(x, w):
        return x + jax.nn.gelu(x @ w["up"]) @ w["down"], None

    return jax.lax.scan(block, x, params["mlp"])[0]


def _setup():
    k = jax.random.split(jax.random.key(0), 6)
    # Correlated inputs with a few loud channels: what GPTQ and AWQ exploit.
    mix = jax.random.normal(k[0], (D, D)) / np.sqrt(D) + jnp.eye(D)
    loud = jnp.ones(D).at[:3].set(8.0)
    params = {
        "wq": jax.random.normal(k[1], (D, N_HEADS, H)) / np.sqrt(D),
        "wo": jax.random.normal(k[2], (N_HEADS, H, D)) / np.sqrt(D),
        "mlp": {
            "up": jax.random.normal(k[3], (LAYERS, D, F)) / np.sqrt(D),
            "down": jax.random.normal(k[4], (LAYERS, F, D)) / np.sqrt(F),
        },
    }
    xs = jax.random.normal(k[5], (3, 4, 16, D)) @ mix * loud
    return params, list(xs)


INT4 = qbits.Quantizer(qbits.IntNumerics(bits=4), granularity=qbits.PerChannel())
W4 = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=INT4, mode="fake"))


def test_gptq_and_awq_beat_round_to_nearest_on_every_weight():
    params, batches = _setup()
    config = qbits.QuantConfig(default=W4)
    rtn = ptq.quantize_weights(_model, params, batches, config, method="rtn")
    # Round to nearest is what the engine computes with the same config.
    want = jax.jit(qbits.quantize(_model, config))(params, batches[0])
    model = jax.jit(_model)
    np.testing.assert_allclose(model(rtn.params, batches[0]), want, rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    paths = [r.path for r in rtn.layers]
    assert paths == [row.path for row in
                     qbits.layer_table(_model, config, params, batches[0]).rows
                     if "weight" in row.kind]  # fmt: skip

    def model_error(p):
        return sum(
            float(jnp.sum((model(p, x) - model(params, x)) ** 2)) for x in batches
        )

    stats = ptq.collect_stats(_model, params, batches, config=config)
    # The statistics once, for both methods.
    for method in (ptq.Gptq(), ptq.Awq(grid=6, clip_grid=3)):
        out = ptq.quantize_weights(
            _model, params, None, config, stats=stats, method=method
        )
        assert jax.tree.map(jnp.shape, out.params) == jax.tree.map(jnp.shape, params)
        for r in out.layers:
            assert r.error <= r.error_rtn * (1 + 1e-5), (method, r)
        total, total_rtn = (sum(getattr(r, e) for r in out.layers)
                            for e in ("error", "error_rtn"))  # fmt: skip
        assert total < 0.9 * total_rtn, method
        assert model_error(out.params) < model_error(rtn.params), method
        assert {r.method for r in out.layers} == {method.name}
        if method.name == "gptq":  # per-channel: 16 levels at most in each column
            for col in np.asarray(out.params["mlp"]["up"])[1].T:
                assert len(np.unique(col)) <= 16
            gptq = out
    # QEP on heads and scanned layers: the paired run's statistics line up
    # with the float ones (per group, per layer), and the model's error drops.
    qep = ptq.quantize_weights(_model, params, batches, config, method=ptq.Qep())
    assert [r.path for r in qep.layers] == paths
    assert model_error(qep.params) < 0.8 * model_error(gptq.params)


def test_result_config_quantizes_what_the_config_quantizes_besides_the_weights():
    params, batches = _setup()
    int8 = qbits.Quantizer(qbits.IntNumerics(bits=8))
    w4a8 = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(lhs=int8, rhs=INT4))
    config = qbits.QuantConfig((qbits.Rule("mlp/down", None),), w4a8)
    out = ptq.quantize_weights(_model, params, batches, config, method="rtn")
    rules = {r.pattern: r.config for r in out.config.rules}
    assert rules["mlp/up"].fwd == qbits.MatmulConfig(lhs=int8)  # weight removed
    assert out.config.rules[-1] == config.rules[0] and out.config.default == w4a8
    # RTN weights (on their grids) with the activation-only rules give the
    # engine's W4A8 output.
    want = qbits.quantize(_model, config)(params, batches[0])
    got = qbits.quantize(_model, out.config)(out.params, batches[0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(qbits.InvalidArgumentError, match="either batches or stats"):
        ptq.quantize_weights(_model, params, None, config)


def test_float_rules_keep_their_weights_and_errors_name_the_layer():
    params, batches = _setup()
    config = qbits.QuantConfig(default=W4, rules=(qbits.Rule("mlp/.*", None),))
    out = ptq.quantize_weights(_model, params, batches, config, method="rtn")
    assert [r.path for r in out.layers] == ["wq", "wo"]
    np.testing.assert_array_equal(out.params["mlp"]["up"], params["mlp"]["up"])
    tiled = W4.replace(
        fwd=W4.fwd.replace(rhs=INT4.replace(granularity=qbits.Tiled(tile_size=24)))
    )
    with pytest.raises(qbits.InvalidArgumentError, match=r"(?s)'wq'.*tile_size=24"):
        ptq.quantize_weights(_model, params, batches, tiled)
    with pytest.raises(qbits.InvalidArgumentError, match=r"method='sgd'.*Gptq\(\)"):
        ptq.quantize_weights(_model, params, batches, config, method="sgd")
    with pytest.raises(qbits.InvalidArgumentError, match="batches"):
        ptq.quantize_weights(_model, params, iter([]), config)


def _mlp(params, x):
    return jnp.tanh(x @ params["fc"]) @ params["out"]


def test_nothing_to_quantize_and_non_finite_inputs_are_refused_before_any_method():
    rng = np.random.default_rng(3)
    params = {"fc": rng.standard_normal((16, 24)).astype(np.float32),
              "out": rng.standard_normal((24, 4)).astype(np.float32)}  # fmt: skip
    x = rng.standard_normal((8, 16)).astype(np.float32)
    # A config that quantizes no weight: refused, as the command refuses it.
    int8 = qbits.Quantizer(qbits.IntNumerics(bits=8))
    activations = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(lhs=int8))
    for config, name in (("none", "'none'"), (activations, "'the QuantConfig'")):
        with pytest.raises(
            qbits.InvalidArgumentError, match=rf"config={name}.*no weight"
        ):
            ptq.quantize_weights(_mlp, params, [x], config, method="rtn")
    # An inf in a calibration batch: named by the matmul that sees it (after
    # the tanh: 'out' sees a finite input), for every method.
    bad = x.copy()
    bad[5, 2] = np.inf
    stats = ptq.collect_stats(_mlp, params, [x, bad], config=W4)
    for method in ("rtn", "gptq", "awq"):
        with pytest.raises(
            qbits.InvalidArgumentError, match=r"stats=.*'fc'.*NaN or inf"
        ):
            ptq.quantize_weights(_mlp, params, None, W4, stats=stats, method=method)
    with pytest.raises(qbits.InvalidArgumentError, match=r"batches=.*'fc'.*overflows"):
        ptq.quantize_weights(_mlp, params, [x * 1e20], W4, method="gptq")
    nan = {**params, "out": params["out"].copy()}
    nan["out"][3, 1] = np.nan
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"params=.*'out'.*1 of the 96"
    ):
        ptq.quantize_weights(_mlp, nan, [x], W4, method="awq")


def _transformed_reference(params, x, transforms):
    """``_model`` with each matmul's activation divided and rotated by hand."""

    def act(x, data):  # over the last axis (K)
        if "scale" in data:
            x = x / data["scale"]
        if "rotation" in data:
            x = x @ data["rotation"]
        return x

    t = transforms
    q = jnp.einsum("btd,dnh->btnh", act(x, t["wq"]), params["wq"])
    h = jax.nn.tanh(q).reshape(*q.shape[:2], -1)  # K = (n, h) flattened
    x = x + jnp.einsum("btk,kd->btd", act(h, t["wo"]), params["wo"].reshape(-1, D))
    for i in range(LAYERS):
        up = jax.tree.map(lambda a, i=i: a[i], t["mlp/up"])
        down = jax.tree.map(lambda a, i=i: a[i], t["mlp/down"])
        w = jax.tree.map(lambda a, i=i: a[i], params["mlp"])
        x = x + act(jax.nn.gelu(act(x, up) @ w["up"]), down) @ w["down"]
    return x


def test_smoothing_and_rotation_run_online_in_every_layout_and_cut_w8a8_error():
    params, batches = _setup()
    x = batches[0]
    stats = ptq.collect_stats(_model, params, batches, config="int8_fwd")
    run = functools.partial(ptq.quantize_weights, _model, params, None, stats=stats)
    # Weight-only: the transformed model is the reference's, layout by layout
    # (scanned layers, two contracting axes), in float.
    both = run(qbits.QuantConfig(default=W4), method="rtn", smooth=0.5,
               rotate=True, key=jax.random.key(1))  # fmt: skip
    assert set(both.transforms) == {"wq", "wo", "mlp/up", "mlp/down"}
    assert both.transforms["mlp/up"]["scale"].shape == (LAYERS, D)
    got = jax.jit(both.function(_model))(both.params, x)
    want = jax.jit(_transformed_reference)(both.params, x, both.transforms)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # W8A8 on loud input channels: both transforms cut the model's error.
    errors, want = {}, jax.jit(_model)(params, x)
    for name, kw in {
        "rtn": {},
        "smooth": {"smooth": 0.5},
        "rotate": {"rotate": True, "key": jax.random.key(2)},
    }.items():
        out = run("int8_fwd", method="rtn", **kw)
        got = jax.jit(out.function(_model))(out.params, x)
        errors[name] = float(jnp.sum((got - want) ** 2))
    assert errors["smooth"] < 0.7 * errors["rtn"], errors
    assert errors["rotate"] < 0.7 * errors["rtn"], errors
    with pytest.raises(qbits.InvalidArgumentError, match=r"mean .x Q."):
        run("int8_fwd", method="awq", rotate=True)
    with pytest.raises(qbits.InvalidArgumentError, match="smooth"):
        run("int8_fwd", smooth=1.5)


def test_a_weight_only_result_runs_without_a_nothing_to_quantize_warning():
    # After weight-only PTQ the config quantizes nothing besides the written
    # weights (attention's scores run float under it): running the result
    # is not a config that quantizes nothing by mistake.
    w4 = qbits.Quantizer(qbits.IntNumerics(bits=4), qbits.AbsMax(), qbits.PerChannel())
    config = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=w4))

    def fn(params, x):
        h = x @ params["w"]
        return jnp.einsum("bi,ci->bc", h, h)  # a matmul of two activations

    params = {"w": jax.random.normal(jax.random.key(0), (8, 6))}
    x = jax.random.normal(jax.random.key(1), (5, 8))
    out = qbits.ptq.quantize_weights(fn, params, [x], config, method="rtn")
    got = out.function(fn)(out.params, x)  # warnings are errors here
    np.testing.assert_allclose(got, fn(out.params, x), rtol=1e-6, atol=1e-6)
