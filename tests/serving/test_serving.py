"""qbits.serving: convert, serve, save/restore, size report, bad input."""

import functools
import warnings

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qbits
import qbits.hlo
import qbits.serving as serving

# The module fixtures run once: these tests share one worker.
pytestmark = pytest.mark.xdist_group("serving")

# Served equals QAT for each kind of model: tests/transform/test_model_kinds.py.
CONFIGS = {"w4a8": "w4a8", "fp8": "fp8"}


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Dense(256, name="fc1")(x))
        return nn.Dropout(0.5, deterministic=not train)(x)


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = Block(name="block")(x, train)
        x = nn.DenseGeneral((2, 8), name="proj")(x)
        x = nn.LayerNorm(name="norm")(x.reshape(x.shape[0], -1))
        return nn.Dense(10, name="head")(x)


def nnx_mlp(seed=0):
    return nnx.Sequential(
        nnx.Linear(128, 256, rngs=nnx.Rngs(seed)),
        nnx.relu,
        nnx.LinearGeneral(256, (2, 8), rngs=nnx.Rngs(seed + 1)),
        lambda x: x.reshape(x.shape[0], -1),
        nnx.Linear(16, 10, rngs=nnx.Rngs(seed + 2)),
    )


@pytest.fixture(scope="module")
def linen_setup():
    x = jax.random.normal(jax.random.key(0), (4, 128))
    model = Mlp()
    return model, jax.jit(model.init)(jax.random.key(1), x), x


@pytest.fixture(scope="module")
def nnx_setup():
    return nnx_mlp(), jax.random.normal(jax.random.key(0), (4, 128))


def _bits(a):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a).view(np.uint8)


def _rules(config):
    # head stays float: a served model mixes stored and float layers.
    return qbits.QuantConfig(rules=(qbits.Rule("head|layers/4", None),), default=config)


def test_linen_stochastic_backward_configs_serve_without_keys(linen_setup):
    model, params, x = linen_setup
    sp = serving.convert(model, "int8", params, x)  # backward rounds stochastically
    served = jax.jit(serving.serve(model, "int8").apply)(sp, x)
    qat = jax.jit(qbits.flax.quantize(model, "int8").apply)(
        params, x, rngs={"quant": jax.random.key(2)}
    )
    np.testing.assert_array_equal(served, qat)


def test_linen_bfloat16_layers_and_methods():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, dtype=jnp.bfloat16, name="fc")(x)

        def twice(self, x):
            return self(x) * 2

    x = jax.random.normal(jax.random.key(0), (2, 256))
    model = Model()
    params = model.init(jax.random.key(1), x)
    sp = serving.convert(model, "int8_fwd", params, x)
    served = serving.serve(model, "int8_fwd")
    qat = qbits.flax.quantize(model, "int8_fwd")
    out = jax.jit(functools.partial(served.apply, method="twice"))(sp, x)
    assert out.dtype == jnp.bfloat16
    expected = jax.jit(functools.partial(qat.apply, method="twice"))(params, x)
    np.testing.assert_array_equal(out, expected)


def test_size_report_counts_values_and_scales(linen_setup, nnx_setup):
    model, params, x = linen_setup
    sp = serving.convert(model, _rules("int4_weight_only"), params, x)
    report = serving.size_report(sp)
    fc1 = report.layers[0]
    assert fc1.value_bytes == 128 * 256 // 2  # two int4 per byte
    assert fc1.scale_bytes == 256 * 4  # one tile of 128 per column
    assert fc1.float32_bytes == 128 * 256 * 4
    assert report.bytes == sum(r.value_bytes + r.scale_bytes for r in report.layers)
    assert report.ratio == pytest.approx(report.bytes / report.float32_bytes)
    assert report.other_bytes > 0  # biases, the norm, the float head
    text = str(report)
    assert text.startswith("| layer |") and "| fc1 | uint4" not in text
    assert "int4 (packed)" in text and "**stored weights**" in text
    assert report.as_dicts()[-1]["path"] == "all parameters"
    nnx_model, nnx_x = nnx_setup
    nnx_report = serving.size_report(serving.convert(nnx_model, "int8_fwd", nnx_x))
    assert nnx_report.ratio < 0.26
    # Shapes are enough: eval_shape'd params give the same report.
    abstract = jax.eval_shape(lambda: serving.convert(model, "int8_fwd", params, x))
    concrete = serving.size_report(serving.convert(model, "int8_fwd", params, x))
    assert serving.size_report(abstract) == concrete


def test_size_report_counts_a_tied_embedding_once():
    """The table a lookup and the head (its transpose) share: float32 once."""
    vocab, width = 24, 40

    def lm(params, tokens):
        h = jnp.tanh(params["embed"][tokens] @ params["mix"])
        return h @ params["embed"].T + params["bias"]

    params = {
        "embed": jnp.zeros((vocab, width)),
        "mix": jnp.zeros((width, width)),
        "bias": jnp.zeros((vocab,)),
    }
    tokens = jnp.arange(6) % vocab
    report = serving.size_report(serving.convert(lm, "int8_fwd", params, tokens))
    assert sorted(r.float32_bytes for r in report.layers) == [
        vocab * width * 4,
        width * width * 4,
    ]
    f32 = 4 * (vocab * width + width * width + vocab)  # every parameter once
    assert report.as_dicts()[-1]["float32_bytes"] == f32
    assert f"| {f32:,} |" in str(report).splitlines()[-1]
    assert report.total_float32_bytes == f32
    # Served: both stored weights, the float table (the lookup reads it), bias.
    assert report.other_bytes == 4 * (vocab * width + vocab)
    assert report.total_ratio == pytest.approx(
        (report.bytes + report.other_bytes) / f32
    )


@pytest.mark.parametrize("name", ["w4a8", "fp8"])
def test_linen_checkpoint_round_trips_exactly(tmp_path, linen_setup, name):
    model, params, x = linen_setup
    config = _rules(CONFIGS[name])
    sp = serving.convert(model, config, params, x)
    serving.save(tmp_path / "ckpt", sp)
    target = jax.eval_shape(lambda: serving.convert(model, config, params, x))
    back = serving.restore(tmp_path / "ckpt", target)
    assert back.layers == sp.layers
    for a, b in zip(jax.tree.leaves(sp), jax.tree.leaves(back), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(_bits(a), _bits(b))
    run = jax.jit(serving.serve(model, config).apply)
    np.testing.assert_array_equal(run(back, x), run(sp, x))


def test_nnx_checkpoint_round_trips_exactly(tmp_path, nnx_setup):
    model, x = nnx_setup
    served = serving.convert(model, "w4a8", x)
    serving.save(tmp_path / "ckpt", served)
    target = serving.convert(nnx_mlp(seed=5), "w4a8", x)  # other weights, same config
    restored = serving.restore(tmp_path / "ckpt", target)
    assert restored is target
    abstract = nnx.eval_shape(lambda: serving.convert(nnx_mlp(), "w4a8", x))
    from_abstract = serving.restore(tmp_path / "ckpt", abstract)
    assert from_abstract.layers[0].kernel[...].shape == (0,)  # made concrete
    for other in (restored, from_abstract):
        for a, b in zip(
            jax.tree.leaves(nnx.state(served)),
            jax.tree.leaves(nnx.state(other)),
            strict=True,
        ):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(_bits(a), _bits(b))


def test_checkpoint_of_the_wrong_config_is_refused(tmp_path, linen_setup, nnx_setup):
    model, params, x = linen_setup
    serving.save(tmp_path / "w8", serving.convert(model, "int8_fwd", params, x))
    wrong = serving.convert(model, "w4a8", params, x)
    with pytest.raises(
        qbits.ConfigError, match=r"layers\['block/fc1'\].config.*w4a8.*int8_fwd"
    ):
        serving.restore(tmp_path / "w8", wrong)
    # A rule that keeps a layer float differs too.
    partly = serving.convert(model, _rules("int8_fwd"), params, x)
    serving.save(tmp_path / "partly", partly)
    with pytest.raises(qbits.ConfigError, match=r"head.*float weight"):
        serving.restore(
            tmp_path / "partly", serving.convert(model, "int8_fwd", params, x)
        )
    # A checkpoint of serving params into an nnx target.
    with pytest.raises(qbits.InvalidArgumentError, match="params"):
        serving.restore(tmp_path / "w8", serving.convert(*nnx_setup[:1], "int8_fwd", x))
    with pytest.raises(qbits.InvalidArgumentError, match="directory"):
        serving.restore(tmp_path / "missing", wrong)


def test_serving_params_of_the_wrong_config_are_refused(linen_setup):
    model, params, x = linen_setup
    sp = serving.convert(model, "int8_fwd", params, x)
    with pytest.raises(qbits.ConfigError, match=r"default: expected w4a8.*int8_fwd"):
        serving.serve(model, "w4a8").apply(sp, x)
    # int8_fwd and int8 share the forward matmul: interchangeable for serving.
    jax.eval_shape(serving.serve(model, "int8").apply, sp, x)
    # A layer the serving model stores but the params keep float.
    partly = serving.convert(model, _rules("int8_fwd"), params, x)
    with pytest.raises(qbits.InvalidArgumentError, match=r"missing \['head'\]"):
        jax.jit(serving.serve(model, "int8_fwd").apply)(partly, x)


def test_linen_serving_model_given_float_params(linen_setup):
    model, params, x = linen_setup
    served = serving.serve(model, "int8_fwd")
    with pytest.raises(
        qbits.InvalidArgumentError, match="float parameters: run convert"
    ):
        served.apply(params, x)
    sp = serving.convert(model, "int8_fwd", params, x)
    # Float values where the stored weight should be.
    floats = jax.tree.map(lambda a: a, sp.weights)
    floats["block/fc1"]["qvalue"] = jnp.zeros((128, 256))
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"fc1.*run qbits.serving.convert"
    ):
        served.apply(sp.replace(weights=floats), x)
    # A float kernel beside the stored one.
    both = jax.tree.map(lambda a: a, sp.params)
    both["params"]["block"]["fc1"]["kernel"] = params["params"]["block"]["fc1"][
        "kernel"
    ]
    with pytest.raises(qbits.InvalidArgumentError, match=r"a float32\[128, 256\] leaf"):
        served.apply(sp.replace(params=both), x)


def test_nnx_serving_copy_given_other_weights(nnx_setup):
    model, x = nnx_setup
    run = nnx.jit(lambda m, x: m(x))
    served = serving.convert(model, "int8_fwd", x)
    # The float model's params in its placeholders: the stored weights serve.
    nnx.update(served, nnx.state(model, nnx.Param))
    np.testing.assert_array_equal(
        run(served, x), run(serving.convert(model, "int8_fwd", x), x)
    )
    served = serving.convert(model, "int8_fwd", x)
    served.qbits.stored["layers/2"]["qvalue"].set_value(jnp.zeros((256, 2, 8)))
    with pytest.raises(qbits.InvalidArgumentError, match=r"stored\['layers/2'\]"):
        served(x)


class ConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.fc = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.fc(nnx.relu(self.conv(x)).mean(axis=(1, 2)))


def test_nnx_trained_quantized_copy_with_a_conv_serves_reports_and_saves(tmp_path):
    # Regression (issue 16): the trained copy's Conv keeps its key stream (the
    # int8 preset's backward rounds stochastically); size_report took its PRNG
    # key for a weight (TypeError: Cannot interpret 'key<fry>' as a data type)
    # and restore could not read it back.
    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
    qmodel = qbits.nnx.quantize(ConvNet(nnx.Rngs(0)), "int8", rngs=nnx.Rngs(quant=1))
    opt = nnx.Optimizer(qmodel, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        opt.update(model, nnx.grad(lambda m: (m(x) ** 2).sum())(model))

    step(qmodel, opt)
    served = serving.convert(qmodel, "int8", x)
    # The same trained weights in a float model serve and report the same.
    trained = ConvNet(nnx.Rngs(5))
    nnx.update(trained, nnx.state(qmodel, nnx.Param))
    reference = serving.convert(trained, "int8", x)
    report = serving.size_report(served)
    assert report == serving.size_report(reference)
    assert [r.path for r in report.layers] == ["fc"]
    assert report.other_bytes == (3 * 3 * 3 * 8 + 8 + 4) * 4  # conv, biases
    run = nnx.jit(lambda m, x: m(x))
    np.testing.assert_array_equal(run(served, x), run(reference, x))
    # Saved without the key stream: it restores into a target converted from
    # a float model.
    serving.save(tmp_path / "ckpt", served)
    target = nnx.eval_shape(lambda: serving.convert(ConvNet(nnx.Rngs(6)), "int8", x))
    restored = serving.restore(tmp_path / "ckpt", target)
    np.testing.assert_array_equal(run(restored, x), run(served, x))


def test_linen_convert_without_sample_inputs_says_they_are_needed():
    # Regression (issue 16): an IndexError from inside qbits before.
    class Probe(nn.Module):
        def setup(self):
            self.fc = nn.Dense(8)

        def __call__(self, x):
            return self.fc(x)

        def probe(self):  # takes no inputs
            return self.fc(jnp.ones((2, 256)))

    x = jnp.ones((2, 256))
    params = nn.Dense(8).init(jax.random.key(0), x)
    with pytest.raises(qbits.InvalidArgumentError) as info:
        serving.convert(nn.Dense(8), "int8_fwd", params)
    message = str(info.value)
    assert message.startswith("qbits.serving.convert: *args='no sample inputs'")
    assert "Dense.__call__(inputs)" in message
    assert "convert(model, config, params, x)" in message
    assert info.value.argument == "*args"
    quantized = qbits.flax.quantize(Probe(), "int8_fwd")  # unwrapped: the same
    params = Probe().init(jax.random.key(0), x)
    with pytest.raises(qbits.InvalidArgumentError, match=r"Probe.__call__\(x\)"):
        serving.convert(quantized, "int8_fwd", params)
    # A method that takes no inputs needs none.
    for method in ("probe", Probe.probe):
        sp = serving.convert(Probe(), "int8_fwd", params, method=method)
        assert [info.path for info in sp.layers] == ["fc"]


def test_bad_arguments(linen_setup, nnx_setup, tmp_path):
    model, params, x = linen_setup
    with pytest.raises(qbits.InvalidArgumentError, match="model"):
        serving.convert("model", "int8_fwd")
    with pytest.raises(qbits.InvalidArgumentError, match="params=None"):
        serving.convert(model, "int8_fwd")
    with pytest.raises(qbits.InvalidArgumentError, match="config"):
        serving.convert(model, 8, params, x)
    with pytest.raises(qbits.InvalidArgumentError, match="converted already"):
        sp = serving.convert(model, "int8_fwd", params, x)
        serving.convert(model, "int8_fwd", sp, x)
    with pytest.raises(qbits.InvalidArgumentError, match="sample inputs"):
        serving.convert(nnx_setup[0], "int8_fwd")
    with pytest.raises(qbits.InvalidArgumentError, match="serving"):
        serving.size_report(params)
    with pytest.raises(qbits.InvalidArgumentError, match="no stored layers"):
        serving.save(tmp_path / "x", nnx_setup[0])
    with pytest.raises(qbits.InvalidArgumentError, match="model"):
        serving.serve(nnx_setup[0], "int8_fwd")
    noisy = qbits.Quantizer(
        qbits.IntNumerics(bits=8, noise_fn=qbits.numerics.UniformNoise())
    )
    config = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(lhs=noisy, rhs=noisy))
    with pytest.raises(qbits.ConfigError, match="stochastically"):
        serving.convert(model, config, params, x)
    with pytest.raises(qbits.ConfigError, match="stochastically"):
        serving.convert(nnx_setup[0], config, nnx_setup[1])


def test_convert_says_which_weights_are_quantized_on_the_fly():
    """Weights in a shard_map or cond body are not stored (a stored weight
    cannot enter the body): the warning names them and says so."""
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, whole = jax.sharding.PartitionSpec("d"), jax.sharding.PartitionSpec()

    def fn(params, x):
        body = jax.shard_map(
            lambda x, w: x @ w, mesh=mesh, in_specs=(rows, whole), out_specs=rows
        )
        y = body(x, params["w1"])
        return jax.lax.cond(x[0, 0] > 0, lambda y: y @ params["w2"], lambda y: y, y)

    params = {"w1": jnp.ones((16, 8)), "w2": jnp.ones((8, 8))}
    x = jnp.ones((2, 16))
    with pytest.warns(UserWarning, match="quantized on the fly") as caught:
        served = serving.convert(fn, "int8_fwd", params, x)
    message = str(caught[0].message)
    assert "'w1' (in a shard_map body)" in message, message
    assert "'w2' (in a cond body)" in message, message
    assert served.layers == () and served.params["w1"].shape == (16, 8)


def test_serving_dots_are_int8_on_xla_cpu(linen_setup):
    model, params, x = linen_setup
    sp = serving.convert(model, _rules("int8_fwd"), params, x)
    served = serving.serve(model, _rules("int8_fwd"))
    dots = qbits.hlo.dot_dtypes(served.apply, sp, x)
    assert dots.count(("s8", "s8", "s32")) == 2  # fc1 and proj; head is float


def test_convert_warns_when_it_stores_no_weights():
    """Nothing to store (only a convolution): said so."""
    x = jnp.ones((2, 6, 3))
    conv = nn.Conv(4, (3,))
    with pytest.warns(UserWarning, match="stored no low-precision weights"):
        qbits.serving.convert(conv, "int8_fwd", conv.init(jax.random.key(0), x), x)

    class RawMatmul(nnx.Module):  # an nnx model's own layer is stored too
        def __init__(self):
            self.w = nnx.Param(jnp.ones((16, 4)))

        def __call__(self, x):
            return x @ self.w[...]

    served = qbits.serving.convert(RawMatmul(), "int8_fwd", jnp.ones((2, 16)))
    assert [r.path for r in qbits.serving.size_report(served).layers] == ["w"]
    assert served.w.shape == (0,)
    with warnings.catch_warnings():  # all float on purpose: nothing to say
        warnings.simplefilter("error")
        qbits.serving.convert(
            nnx.Linear(16, 4, rngs=nnx.Rngs(0)), "none", jnp.ones((2, 16))
        )


@pytest.mark.parametrize(("scan", "preset"), [(True, "int8_fwd"), (False, "w4a8")])
def test_custom_layers_einsum_weights_and_scanned_layers_are_stored(scan, preset):
    """Gemma-style Einsum modules, a block-diagonal linear, raw ``@`` with two
    parameters, a tied head; unrolled or scanned (weights stacked): every
    weight is stored, the served forward equals qbits.quantize's bit for bit,
    and its weight dots are integer dots."""
    from examples.custom_models import LM, lm_batch

    model = LM(scan=scan, depth=2)
    tokens = lm_batch()
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    sp = serving.convert(model, preset, variables, tokens)
    table = qbits.layer_table(model.apply, preset, variables, tokens)
    weights = [row.path for row in table.rows if "weight" in row.kind]
    assert sorted(info.path for info in sp.layers) == sorted(weights)
    head = sp.layer("embed")
    assert head.param == ""  # the lookup reads the table too: it stays float
    assert sp.params["params"]["embed"]["embedding"].shape == (32, 16)
    dropped = [info for info in sp.layers if info.param]
    assert len(dropped) == len(sp.layers) - 1
    if scan:  # one stored weight per scanned layer, stacked
        assert all(info.shape[0] == 2 for info in dropped)
    compiled = jax.jit(serving.serve(model, preset).apply).lower(sp, tokens).compile()
    served = compiled(sp, tokens)
    qat = jax.jit(qbits.quantize(model.apply, preset))(variables, tokens)
    np.testing.assert_array_equal(served, qat)
    bits = 8 if preset == "int8_fwd" else 4
    for row in serving.size_report(sp).layers:  # stored values, not floats
        assert row.value_bytes == int(np.prod(row.shape)) * bits // 8, row.path
    if preset == "int8_fwd":
        dots = qbits.hlo.dot_dtypes(compiled.as_text())  # the program that served
        assert set(dots) == {("s8", "s8", "s32")}


def test_a_parameter_read_by_two_stored_matmuls_is_dropped_once():
    def fn(params, x):
        return jnp.tanh(x @ params["w"]) @ params["w"].T

    params = {"w": jax.random.normal(jax.random.key(0), (16, 8))}
    x = jax.random.normal(jax.random.key(1), (4, 16))
    sp = serving.convert(fn, "int8_fwd", params, x)
    assert [info.param for info in sp.layers] == ["['w']", "['w']"]
    assert sp.params["w"].shape == (0,)
    served = jax.jit(serving.serve(fn, "int8_fwd"))(sp, x)
    qat = jax.jit(qbits.quantize(fn, "int8_fwd"))(params, x)
    np.testing.assert_array_equal(served, qat)
