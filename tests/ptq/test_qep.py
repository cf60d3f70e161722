"""qbits.ptq.Qep: quantization error propagation (Arai and Ichikawa, 2025)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
from qbits import ptq

FLOAT = qbits.Quantizer(qbits.numerics.NoNumerics())  # leaves the corrected weight


def _one_layer(rows=256, k=16, n=8, noise=0.3):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, k)) @ (np.eye(k) + rng.standard_normal((k, k)) / 4)
    x_hat = x + noise * rng.standard_normal((rows, k))  # earlier layers' error
    w = rng.standard_normal((k, n))
    return x, x_hat, w


def _stats(x, x_hat):
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return dataclasses.replace(
        ptq.InputStats.of(f32(x)),
        hessian=f32(x.T @ x),
        quantized_hessian=f32(x_hat.T @ x_hat),
        cross=f32(x_hat.T @ x),
    )


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_the_correction_is_the_papers_closed_form(alpha):
    x, x_hat, w = _one_layer()
    stats = _stats(x, x_hat)
    got = ptq.Qep(alpha=alpha, damping=0.0, then=ptq.Rtn()).quantize(
        jnp.asarray(w, jnp.float32), stats, FLOAT
    )
    # alpha = 1: the least-squares fit of the float output X w on X_hat.
    fit = np.linalg.lstsq(x_hat, x @ w, rcond=None)[0]
    want = w + alpha * (fit - w)
    np.testing.assert_allclose(got.weight, want, rtol=2e-4, atol=2e-4)
    # It fits the float output on the quantized inputs better than w itself.
    assert np.linalg.norm(x @ w - x_hat @ got.weight) < np.linalg.norm(
        x @ w - x_hat @ w
    )


def test_damping_adds_to_the_diagonal_of_the_quantized_hessian():
    x, x_hat, w = _one_layer(rows=24)  # few rows: the damping matters
    h_hat = x_hat.T @ x_hat
    damped = h_hat + 0.1 * np.mean(np.diag(h_hat)) * np.eye(len(h_hat))
    want = w + 0.5 * np.linalg.solve(damped, x_hat.T @ (x - x_hat) @ w)
    got = ptq.Qep(damping=0.1, then=ptq.Rtn()).quantize(
        jnp.asarray(w, jnp.float32), _stats(x, x_hat), FLOAT
    )
    np.testing.assert_allclose(got.weight, want, rtol=2e-4, atol=2e-4)


def _mlp(params, x):
    for name in ("w1", "w2"):
        x = jax.nn.gelu(x @ params[name])
    return x @ params["w3"]


def test_qep_cuts_the_models_output_error_below_rtn_and_gptq():
    d = 32
    k = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k[0], (3, d, d)) / np.sqrt(d)
    params = {"w1": w[0], "w2": w[1], "w3": w[2]}
    mix = jax.random.normal(k[1], (d, d)) / np.sqrt(d) + jnp.eye(d)  # correlated
    batches = list(jax.random.normal(k[2], (2, 64, d)) @ mix)
    held_out = jax.random.normal(k[3], (64, d)) @ mix
    int3 = qbits.Quantizer(qbits.IntNumerics(bits=3), granularity=qbits.PerChannel())
    config = qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=int3, mode="fake"))
    model = jax.jit(_mlp)

    def error(method):
        out = ptq.quantize_weights(_mlp, params, batches, config, method=method)
        assert {r.method for r in out.layers} == {method.name}
        return [
            float(jnp.sum((model(out.params, x) - model(params, x)) ** 2))
            for x in (*batches, held_out)
        ]

    errors = {
        "rtn": error(ptq.Rtn()),
        "gptq": error(ptq.Gptq()),
        "qep+rtn": error(ptq.Qep(then=ptq.Rtn())),
        "qep+gptq": error(ptq.Qep()),
    }
    print(errors)
    calibration = {name: sum(e[:-1]) for name, e in errors.items()}
    assert calibration["qep+rtn"] < 0.8 * calibration["rtn"], errors
    assert calibration["qep+gptq"] < 0.9 * calibration["gptq"], errors
    # On rows it was not fitted on, too.
    assert errors["qep+rtn"][-1] < errors["rtn"][-1], errors
    assert errors["qep+gptq"][-1] < errors["gptq"][-1], errors


def test_qep_needs_the_model_and_checks_its_settings():
    params = {"w": jnp.ones((4, 2))}
    x = jnp.ones((3, 4))
    f = lambda p, x: x @ p["w"]  # noqa: E731
    stats = ptq.collect_stats(f, params, [x])
    with pytest.raises(qbits.InvalidArgumentError, match="batches"):
        ptq.quantize_weights(f, params, None, "int8_fwd", stats=stats, method="qep")
    with pytest.raises(qbits.InvalidArgumentError, match="alpha"):
        ptq.Qep(alpha=1.5)
    with pytest.raises(qbits.InvalidArgumentError, match="then"):
        ptq.Qep(then=ptq.Qep())
    with pytest.raises(qbits.InvalidArgumentError, match="rotate"):  # AWQ's refusal
        ptq.quantize_weights(f, params, [x], "int8_fwd", rotate=True,
                             method=ptq.Qep(then=ptq.Awq()))  # fmt: skip
    plain = ptq.InputStats.of(jnp.ones((3, 4)))
    with pytest.raises(qbits.InvalidArgumentError, match="quantized_hessian"):
        ptq.Qep().quantize(params["w"], plain, FLOAT)
