"""Delayed scaling: the math, dot_general with state, Flax fp8_ops parity."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops

import qbits
from qbits import DelayedScaling
from qbits._providers import scale_from_history, update_history

DN = (((1,), (0,)), ((), ()))
E4M3 = qbits.numerics.Fp8Numerics("float8_e4m3fn")
E5M2 = qbits.numerics.Fp8Numerics("float8_e5m2")


def delayed_config(history=16, mode="real", amax_compute="max", margin=0.0):
    cal = DelayedScaling(history, amax_compute, margin)
    e4m3 = qbits.Quantizer(E4M3, provider=cal)
    e5m2 = qbits.Quantizer(E5M2, provider=cal)
    fwd = qbits.MatmulConfig(lhs=e4m3, rhs=e4m3, mode=mode)
    bwd = qbits.MatmulConfig(lhs=e5m2, rhs=e4m3, mode=mode, use_fwd_quant=True)
    return qbits.DotGeneralConfig(fwd, bwd, bwd)


# ---------------------------------------------------------------- the math


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"history_length": 0}, "history_length"),
        ({"history_length": -3}, "history_length"),
        ({"history_length": 2.0}, "history_length"),
        ({"history_length": 4_000_000_000}, "history_length"),
        ({"amax_compute": "mean"}, "amax_compute"),
        ({"margin": -1.0}, "margin"),
        ({"margin": float("nan")}, "margin"),
        ({"margin": 40.0}, "margin"),  # 2**40: beyond any grid's range
        ({"margin": 5e8}, "margin"),  # 2.0**5e8: OverflowError
    ],
)
def test_bad_settings_raise_naming_the_argument(kwargs, name):
    with pytest.raises(qbits.InvalidArgumentError, match=f"DelayedScaling: {name}="):
        DelayedScaling(**kwargs)


def test_a_margin_that_maps_the_amax_to_zero_is_refused_for_its_numerics():
    # int8's amax lands on 127.5 / 2**9 < 0.5 (rounds to 0, and every value
    # below it): all outputs were zero. E4M3 still resolves 448 / 2**9.
    int8 = qbits.IntNumerics(bits=8)
    cal = DelayedScaling(history_length=4, margin=9.0)
    with pytest.raises(qbits.InvalidArgumentError, match=r"margin=9\.0 .*below 7\.99"):
        cal.init_state((), None, int8)
    with pytest.raises(qbits.InvalidArgumentError, match="every output would be"):
        cal.scale(DelayedScaling(4).init_state((), None, int8), int8)
    dg = qbits.dot_general(delayed_config(history=4, margin=9.0))
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    state = dg.init_state(x, w, DN)
    state["lhs_amax_history"] = state["lhs_amax_history"].at[0].set(1.0)
    state["rhs_amax_history"] = state["rhs_amax_history"].at[0].set(1.0)
    out = dg(x, w, DN, state=state)
    np.testing.assert_allclose(out, x @ w, rtol=0.1)
    with pytest.raises(qbits.InvalidArgumentError, match="margin"):
        scale_from_history(jnp.ones(2), jnp.ones(()), 448.0, margin=1e9)


def test_scale_matches_flax_compute_scale_and_keeps_old_on_zero_or_nonfinite():
    old = jnp.array([0.25], jnp.float32)
    for amax in (3.0, 1e-30, 7e4, 0.0, np.inf, np.nan):
        for margin in (0, 2):
            hist = jnp.array([amax, 0.0, 0.0], jnp.float32)
            ours = scale_from_history(hist, old, 448.0, margin)
            theirs = fp8_ops.compute_scale(
                jnp.max(hist), old, jnp.float32(448.0), margin
            )
            np.testing.assert_array_equal(ours, theirs)
    assert scale_from_history(jnp.zeros(3), old, 448.0) == old
    assert scale_from_history(jnp.array([np.inf, 1.0]), old, 448.0) == old


def test_history_ring_buffer_matches_flax_and_most_recent():
    hist = jnp.zeros((4,), jnp.float32)
    ref = hist
    for i, a in enumerate((3.0, 1.0, 5.0, 2.0, 0.5)):
        x = jnp.array([a, -a / 2])
        hist = update_history(hist, jnp.max(jnp.abs(x)))
        ref = fp8_ops.compute_amax_history(x, ref)
        np.testing.assert_array_equal(hist, ref)
        assert hist[0] == a  # index 0 is the most recent
        recent = scale_from_history(hist, jnp.ones(1), 1.0, amax_compute="most_recent")
        np.testing.assert_allclose(recent, [a])
        assert i < 3 or scale_from_history(hist, jnp.ones(1), 1.0) == 5.0


def test_bad_history_and_unknown_amax_compute_raise():
    with pytest.raises(qbits.InvalidArgumentError, match=r"history\.shape"):
        scale_from_history(jnp.zeros((0,)), jnp.ones(1), 448.0)
    with pytest.raises(qbits.InvalidArgumentError, match="amax_compute"):
        scale_from_history(jnp.zeros(3), jnp.ones(1), 448.0, amax_compute="avg")


# ----------------------------------------------------- the stateful op


def _dot(config, x, w):
    dg = qbits.dot_general(config)
    return dg, dg.init_state(x, w, DN)


def test_delayed_config_needs_state_and_a_quantizer_alone_refuses_it():
    dg = qbits.dot_general(qbits.presets.get("fp8_delayed"))
    with pytest.raises(qbits.InvalidArgumentError, match="state=None"):
        dg(jnp.ones((2, 4)), jnp.ones((4, 3)), DN)
    q = qbits.Quantizer(E4M3, provider=DelayedScaling(4))
    with pytest.raises(qbits.InvalidArgumentError, match="scale"):
        q.quant(jnp.ones(3))


def test_bad_state_and_configs_raise():
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    dg, state = _dot(delayed_config(history=8), x, w)
    with pytest.raises(qbits.InvalidArgumentError, match="state="):
        dg(x, w, DN, state={"lhs_scale": state["lhs_scale"]})
    bad = dict(state, lhs_amax_history=jnp.zeros((5,)))
    with pytest.raises(qbits.InvalidArgumentError, match="lhs_amax_history"):
        dg(x, w, DN, state=bad)
    with pytest.raises(qbits.InvalidArgumentError, match="state="):
        qbits.dot_general(qbits.presets.get("fp8"))(x, w, DN, state=state)
    # Two quantizers of one tensor (the output gradient) with different
    # providers cannot share its one state.
    cfg = delayed_config()
    other = qbits.MatmulConfig(
        lhs=qbits.Quantizer(E5M2, provider=DelayedScaling(3)), rhs=cfg.drhs.rhs
    )
    with pytest.raises(qbits.InvalidArgumentError, match=r"drhs\.lhs"):
        qbits.dot_general(qbits.DotGeneralConfig(cfg.fwd, cfg.dlhs, other))(
            x, w, DN, state=state
        )
    rounded = qbits.Quantizer(E4M3, scale_rounding="pow2", provider=DelayedScaling(4))
    with pytest.raises(qbits.InvalidArgumentError, match="scale_rounding"):
        qbits.dot_general(qbits.DotGeneralConfig(qbits.MatmulConfig(lhs=rounded)))


def test_per_channel_delayed_scales_keep_one_history_per_channel():
    per_channel = qbits.Quantizer(
        E4M3, granularity=qbits.PerChannel(), provider=DelayedScaling(3)
    )
    cfg = qbits.DotGeneralConfig(qbits.MatmulConfig(rhs=per_channel))
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 3)) * jnp.array([1.0, 10.0, 100.0])
    dg, state = _dot(cfg, x, w)
    assert state["rhs_scale"].shape == (3,)
    assert state["rhs_amax_history"].shape == (3, 3)
    step = jax.jit(jax.grad(lambda s: dg(x, w, DN, state=s).sum()))
    new = step(state)
    np.testing.assert_allclose(
        new["rhs_amax_history"][0], jnp.max(jnp.abs(w), axis=0), rtol=1e-6
    )
    new = step(new)  # scales from step one's amaxes, one per output channel
    np.testing.assert_allclose(
        new["rhs_scale"], jnp.max(jnp.abs(w), axis=0) / 448.0, rtol=1e-6
    )
    y = dg(x, w, DN, state=new)
    wq = (w / new["rhs_scale"]).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    np.testing.assert_allclose(y, x @ (wq * new["rhs_scale"]), rtol=1e-5, atol=1e-5)


def _flax_state(s):
    names = {"lhs": "input", "rhs": "kernel", "grad": "output_grad"}
    out = {}
    for ours, theirs in names.items():
        out[f"{theirs}_scale"] = s[f"{ours}_scale"]
        out[f"{theirs}_amax_history"] = s[f"{ours}_amax_history"]
    return out


@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated")
@pytest.mark.parametrize(
    ("mode", "flax_op"),
    [("real", nn.Fp8DirectDotGeneralOp), ("fake", nn.Fp8DotGeneralOp)],
)
def test_scales_and_histories_equal_flax_fp8_ops_over_steps(mode, flax_op):
    """Same history length, no margin: the same state, step after step.

    Real mode is Flax's ``Fp8DirectDotGeneralOp`` (fp8 x fp8 dots, scales
    applied to the output); fake mode its quantize-dequantize
    ``Fp8DotGeneralOp`` (float dots on dequantized operands).
    """
    length = 2
    dense = nn.Dense(8, dot_general_cls=lambda: flax_op(amax_history_length=length))
    keys = jax.random.split(jax.random.key(0), 6)
    x0 = jax.random.normal(keys[0], (6, 16))
    variables = dense.init(keys[1], x0)
    kernel = variables["params"]["kernel"]
    flax_state = variables[fp8_ops.OVERWRITE_WITH_GRADIENT]
    dg, state = _dot(delayed_config(history=length, mode=mode), x0, kernel)

    def flax_loss(params, owg, x):
        y = dense.apply({"params": params, fp8_ops.OVERWRITE_WITH_GRADIENT: owg}, x)
        return jnp.sum(y * y)

    def our_loss(w, st, x):
        y = dg(x, w, DN, state=st)
        return jnp.sum(y * y)

    flax_step = jax.jit(jax.value_and_grad(flax_loss, argnums=(0, 1)))
    our_step = jax.jit(jax.value_and_grad(our_loss, argnums=(0, 1)))
    for step in range(4):  # more steps than the history holds
        x = jax.random.normal(keys[2 + step], (6, 16)) * (1.0 + 3 * step)
        lf, (gp, flax_state) = flax_step(variables["params"], flax_state, x)
        lo, (gw, state) = our_step(kernel, state, x)
        owg = flax_state[f"{flax_op.__name__}_0"]
        for k, v in _flax_state(state).items():
            np.testing.assert_array_equal(v, owg[k], err_msg=f"step {step}: {k}")
        np.testing.assert_allclose(lo, lf, rtol=1e-5)
        np.testing.assert_allclose(gw, gp["kernel"], rtol=1e-4, atol=1e-4)
    # Four steps happened: the scales are no longer the initial ones.
    assert float(state["lhs_scale"][0]) != 1.0
    assert float(state["grad_scale"][0]) != 1.0


def test_forward_uses_the_delayed_scale_and_evaluation_leaves_state():
    x = jnp.array([[1.0, 7.0]])  # 0.1 and 0.7 round on the E4M3 grid
    w = jnp.eye(2)
    dg, state = _dot(delayed_config(history=3), x, w)
    state["lhs_amax_history"] = jnp.array([0.0, 0.0, 4480.0])  # scale 10
    y = dg(x, w, DN, state=state)
    expected = (x / 10.0).astype(jnp.float8_e4m3fn).astype(jnp.float32) * 10.0
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    new = jax.jit(jax.grad(lambda s: dg(x, w, DN, state=s).sum()))(state)
    np.testing.assert_allclose(new["lhs_scale"], [10.0], rtol=1e-6)
    np.testing.assert_array_equal(new["lhs_amax_history"], [7.0, 4480.0, 0.0])


def test_grad_amax_is_recorded_in_backward_with_e5m2():
    x, w = jnp.ones((3, 4)), jnp.ones((4, 5))
    dg, state = _dot(delayed_config(history=2), x, w)
    _, new = jax.jit(
        jax.grad(lambda x, s: jnp.sum(dg(x, w, DN, state=s) * 3.5), argnums=(0, 1))
    )(x, state)
    np.testing.assert_array_equal(new["grad_amax_history"], [3.5, 0.0])
    np.testing.assert_array_equal(new["rhs_amax_history"], [1.0, 0.0])


def test_identity_forward_operands_are_exact_when_only_grad_is_delayed():
    e5m2 = qbits.Quantizer(E5M2, provider=DelayedScaling(4))
    bwd = qbits.MatmulConfig(lhs=e5m2)
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 3))
    dg, state = _dot(qbits.DotGeneralConfig(dlhs=bwd, drhs=bwd), x, w)
    assert sorted(state) == ["grad_amax_history", "grad_scale"]
    np.testing.assert_allclose(dg(x, w, DN, state=state), x @ w, rtol=1e-6)


# ------------------------------------------------------ combining with max


def _batches():
    keys = jax.random.split(jax.random.key(3), 3)
    w = jax.random.normal(keys[0], (16, 8))
    xs = (
        jax.random.normal(keys[1], (3, 4, 16))
        * jnp.array([1.0, 5.0, 2.0])[:, None, None]
    )
    return w, xs


def test_scan_sharing_one_state_combines_with_max_not_sum():
    w, xs = _batches()
    dg, start = _dot(delayed_config(history=4), xs[0], w)
    start["lhs_amax_history"] = jnp.array([0.0, 0.0, 0.0, 2.0])
    start["grad_amax_history"] = jnp.array([0.0, 0.0, 0.0, 9.0])

    def loss(state):
        state = qbits.DelayedScaling.max_combining(state)  # once, outside the loop

        def body(total, x):
            return total + jnp.sum(dg(x, w, DN, state=state) ** 2), None

        total, _ = jax.lax.scan(body, jnp.float32(0.0), xs)
        return total

    new = jax.jit(jax.grad(loss))(start)
    # The same as one call on all micro-batches together.
    full = jax.jit(  # compiled, as the scan is
        jax.grad(lambda s: jnp.sum(dg(xs.reshape(12, 16), w, DN, state=s) ** 2))
    )(start)
    for k in start:
        np.testing.assert_array_equal(new[k], full[k], err_msg=k)
    assert new["lhs_amax_history"][0] == jnp.max(jnp.abs(xs))
    np.testing.assert_allclose(new["lhs_scale"], [2.0 / 448.0], rtol=1e-6)


def test_grad_accumulation_over_micro_batches_takes_the_max():
    w, xs = _batches()
    dg, start = _dot(delayed_config(history=4), xs[0], w)

    def loss(w, state, x):
        return jnp.sum(dg(x, w, DN, state=state) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    # Two micro-batches, gradients computed separately and combined.
    gw0, s0 = grad(w, start, xs[0])
    gw1, s1 = grad(w, start, xs[1])
    combined = jax.tree.map(jnp.maximum, s0, s1)
    both = xs[:2].reshape(8, 16)
    gw, full = grad(w, start, both)
    for k in start:
        np.testing.assert_array_equal(combined[k], full[k], err_msg=k)
    np.testing.assert_allclose(gw0 + gw1, gw, rtol=1e-5, atol=1e-5)

    # Both micro-batches in one loss: one conversion, max inside autodiff.
    def two(state):
        state = qbits.DelayedScaling.max_combining(state)
        return loss(w, state, xs[0]) + loss(w, state, xs[1])

    inside = jax.jit(jax.grad(two))(start)
    for k in start:
        np.testing.assert_array_equal(inside[k], full[k], err_msg=k)
    # A plain float32 sum would double the scales (and add the histories).
    assert not np.array_equal(s0["lhs_scale"] + s1["lhs_scale"], full["lhs_scale"])


def test_max_combining_refuses_other_dtypes():
    with pytest.raises(qbits.InvalidArgumentError, match="max_combining"):
        qbits.DelayedScaling.max_combining({"s": jnp.ones(2, jnp.int32)})
    st = qbits.DelayedScaling.max_combining({"s": jnp.ones(2)})
    assert qbits.DelayedScaling.max_combining(st)["s"] is st["s"]


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import qbits
assert jax.device_count() == 8
from jax.sharding import AxisType
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
dg = qbits.dot_general(qbits.presets.get("fp8_delayed"))
dn = (((1,), (0,)), ((), ()))
k = jax.random.split(jax.random.key(0), 2)
x = jax.random.normal(k[0], (32, 64)) * jnp.arange(32.0)[:, None]
w = jax.random.normal(k[1], (64, 16))

def step(x, w, s):
    return jax.grad(lambda w, s: jnp.sum(dg(x, w, dn, state=s) ** 3), (0, 1))(w, s)

state = dg.init_state(x, w, dn)
ref_w, ref = jax.jit(step)(x, w, state)
ref_w, ref = jax.jit(step)(x, w, ref)  # second step: scales from step one
xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
got_w, got = jax.jit(step)(xs, ws, state)
got_w, got = jax.jit(step)(xs, ws, got)
for key in ref:
    np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(ref[key]), key)
np.testing.assert_allclose(np.asarray(got_w), np.asarray(ref_w), rtol=1e-4)
print("sharded scales equal unsharded", float(ref["lhs_scale"][0]))
"""


def test_sharded_amax_is_the_max_over_all_shards_on_8_devices():
    import os
    import subprocess
    import sys

    # The runner's flags (its optimization level), and 8 devices.
    flags = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sharded scales equal unsharded" in result.stdout


def test_a_quantizer_says_by_name_whether_it_calibrates_or_takes_a_provider():
    with pytest.raises(qbits.InvalidArgumentError, match=r"provider=DelayedScaling"):
        qbits.Quantizer(E4M3, DelayedScaling(4))  # a provider in calibration
    q = qbits.Quantizer(E4M3, provider=DelayedScaling(4))
    data = qbits.config._to_dict(q)
    assert data["provider"] == {"type": "delayed", "history_length": 4}
    assert "calibration" not in data
    assert qbits.load_config(data, qbits.Quantizer) == q
