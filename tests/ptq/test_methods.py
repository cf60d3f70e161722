"""PTQ methods as values: their settings, names, and what the driver gives them."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits import ptq

W4 = qbits.DotGeneralConfig(
    fwd=qbits.MatmulConfig(
        rhs=qbits.Quantizer(qbits.IntNumerics(bits=4), granularity=qbits.PerChannel()),
        mode="fake",
    )
)


def _mlp(params, x):
    h = jax.nn.relu(x @ params["w1"])
    return jax.nn.relu(h @ params["w2"]) @ params["w3"]


def _setup():
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (8, 16)) / np.sqrt(8),
        "w2": jax.random.normal(k[1], (16, 16)) / 4,
        "w3": jax.random.normal(k[2], (16, 4)) / 4,
    }
    return params, list(jax.random.normal(k[3], (2, 32, 8)))


def test_a_name_stands_for_the_default_value_and_old_settings_warn_with_the_new_form():
    params, batches = _setup()
    stats = ptq.collect_stats(_mlp, params, batches, config=W4)
    run = lambda **kw: ptq.quantize_weights(_mlp, params, None, W4, stats=stats, **kw)  # noqa: E731
    by_value = run(method=ptq.Awq(grid=4, clip_grid=2))
    with pytest.warns(
        DeprecationWarning, match=r"method=qbits\.ptq\.Awq\(grid=4, clip_grid=2\)"
    ):
        old = run(method="awq", grid=4, clip_grid=2)
    assert old.layers == by_value.layers
    for a, b in zip(
        jax.tree.leaves(old.params), jax.tree.leaves(by_value.params), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    default = run(method="gptq")
    assert default.layers == run(method=ptq.Gptq()).layers
    assert {r.method for r in default.layers} == {"gptq"}
    with pytest.warns(DeprecationWarning, match=r"Rtn\(\) \(rtn ignores the rest\)"):
        run(method="rtn", damping=0.1)
    with pytest.raises(qbits.InvalidArgumentError, match=r"Gptq\(damping=0.02\)"):
        run(method=ptq.Gptq(), damping=0.02)
    with pytest.raises(TypeError, match="'dampening'"):
        run(method="gptq", dampening=0.02)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ptq.Gptq(damping=-1.0), "damping"),
        (lambda: ptq.Gptq(act_order=1), "act_order"),
        (lambda: ptq.Gptq(block_size=0), "block_size"),
        (lambda: ptq.Awq(grid=0), "grid"),
        (lambda: ptq.Awq(clip_grid=0), "clip_grid"),
    ],
)
def test_settings_are_checked_when_the_value_is_made(make, field):
    with pytest.raises(qbits.InvalidArgumentError, match=field):
        make()


def test_values_are_frozen_and_equal_by_settings():
    assert ptq.Gptq(damping=0.02) == ptq.Gptq(damping=0.02) != ptq.Gptq()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ptq.Gptq().damping = 0.5


@dataclasses.dataclass(frozen=True)
class _Seen(ptq.Method):
    """Round to nearest, keeping what the driver gave it (a propagated method)."""

    name: ClassVar[str] = "test_seen"
    propagated: ClassVar[bool] = True
    seen: list = dataclasses.field(default_factory=list, compare=False)

    def quantize(self, w, stats, quantizer):
        self.seen.append(stats)
        return ptq.Rtn().quantize(w, stats, quantizer)


def test_a_propagated_method_gets_the_inputs_of_the_weights_quantized_before_it():
    params, batches = _setup()
    method = _Seen()
    out = ptq.quantize_weights(_mlp, params, batches, W4, method=method)
    assert [r.method for r in out.layers] == ["test_seen"] * 3
    seen = dict(zip(("w1", "w2", "w3"), method.seen, strict=True))  # program order
    x = jnp.concatenate(batches)
    # The first weight's input is the model's input: no error to propagate.
    s = seen["w1"]
    np.testing.assert_allclose(s.quantized_hessian, s.hessian, rtol=1e-5)
    np.testing.assert_allclose(s.cross, s.hessian, rtol=1e-5)
    # The next ones: the float activations beside those of the model whose
    # earlier weights are quantized (round to nearest, here).
    h_float = np.asarray(jax.nn.relu(x @ params["w1"]), np.float64)
    h_hat = np.asarray(jax.nn.relu(x @ out.params["w1"]), np.float64)
    np.testing.assert_allclose(seen["w2"].hessian, h_float.T @ h_float, rtol=1e-4)
    np.testing.assert_allclose(seen["w2"].quantized_hessian, h_hat.T @ h_hat, rtol=1e-4)
    np.testing.assert_allclose(seen["w2"].cross, h_hat.T @ h_float, rtol=1e-4)
    g_float = np.maximum(h_float @ np.asarray(params["w2"], np.float64), 0)
    g_hat = np.maximum(h_hat @ np.asarray(out.params["w2"], np.float64), 0)
    np.testing.assert_allclose(
        seen["w3"].cross, g_hat.T @ g_float, rtol=1e-4, atol=1e-4
    )
    assert not np.allclose(seen["w3"].cross, seen["w3"].hessian, rtol=1e-3)
    # It needs the model: statistics collected before do not do.
    stats = ptq.collect_stats(_mlp, params, batches, config=W4)
    with pytest.raises(qbits.InvalidArgumentError, match="quantized model"):
        ptq.quantize_weights(_mlp, params, None, W4, stats=stats, method=_Seen())


def test_the_methods_get_plain_statistics_without_propagation():
    params, batches = _setup()
    seen = []

    @dataclasses.dataclass(frozen=True)
    class Plain(ptq.Method):
        def quantize(self, w, stats, quantizer):
            seen.append(stats)
            return ptq.Rtn().quantize(w, stats, quantizer).weight  # off its grid

    Plain.name = "test_plain"
    out = ptq.quantize_weights(_mlp, params, batches, W4, method=Plain())
    assert all(s.cross is None and s.quantized_hessian is None for s in seen)
    assert out.stored == {}  # a plain weight: nothing to store
    assert [r.error == r.error_rtn for r in out.layers] == [True] * 3


def test_a_methods_error_names_the_weight_it_was_quantizing():
    params, batches = _setup()

    @dataclasses.dataclass(frozen=True)
    class Refuses(ptq.Method):
        def quantize(self, w, stats, quantizer):
            raise qbits.InvalidArgumentError("refuses", "w", "it", "nothing")

    Refuses.name = "test_refuses"
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"^refuses: w='it' .*the weight of 'w1'"
    ):
        ptq.quantize_weights(_mlp, params, batches, W4, method=Refuses())
