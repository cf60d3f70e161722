"""Checks that only a GPU can make; skipped cleanly without one.

On a GPU, qbits hands XLA the plain forms (no CPU workarounds): these tests
check that the numbers are still right there (NaN handling, identity
configs, agreement with the CPU) and that XLA's GPU compiler turns the fp8
and int8 matmuls into low-precision GEMMs. The CPU-side tests in
``tests/ops/test_lowering.py`` pin the program qbits emits for the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qbits
import qbits.hlo

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a GPU (jax's backend is not gpu)"
)

DN = (((1,), (0,)), ((), ()))


def _gpu():
    return jax.devices("gpu")[0]


def _cpu():
    return jax.devices("cpu")[0]


def _fp8_capable() -> bool:
    cc = getattr(_gpu(), "compute_capability", "0")
    return float(cc) >= 8.9


@pytest.mark.parametrize("axes", [(1,), (0,), (0, 1)])
def test_absmax_flags_nan_and_inf_blocks_on_gpu(axes):
    x = np.array(jax.random.normal(jax.random.key(0), (64, 256)))
    x[3, 7] = np.nan
    x[40, 100] = np.inf
    got = np.asarray(qbits.AbsMax()(jax.device_put(x, _gpu()), axes))
    want = np.asarray(qbits.AbsMax()(jax.device_put(x, _cpu()), axes))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got).any()
    np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


@pytest.mark.parametrize(
    "numerics",
    [
        qbits.numerics.Fp8Numerics("float8_e4m3fn"),
        qbits.numerics.Fp8Numerics("float8_e5m2"),
        qbits.FpNumerics("float6_e2m3fn"),
        qbits.FpNumerics("float4_e2m1fn"),
        qbits.IntNumerics(bits=8),
    ],
)
def test_fake_quantization_equals_cpu_bit_for_bit(numerics):
    # XLA's GPU compiler drops a narrowing-widening cast pair as "excess
    # precision"; fake quantization must still round there.
    q = qbits.Quantizer(numerics, granularity=qbits.PerChannel(shared_axes=(1,)))
    x = jax.random.normal(jax.random.key(1), (64, 256)) * 3.0

    def run(device):
        fq = jax.jit(lambda v: q.quant(v).dequant())
        return np.asarray(fq(jax.device_put(x, device)))

    got, want = run(_gpu()), run(_cpu())
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, np.asarray(x))


@pytest.mark.parametrize("preset", ["int8", "fp8", "int8_fwd"])
def test_quantized_matmul_equals_cpu(preset):
    # The plain GPU forms compute the same quantization as the CPU forms;
    # outputs differ by the accumulation only (fp8 tensor cores accumulate
    # with less precision than float32 unless asked not to).
    dg = qbits.dot_general(qbits.presets.get(preset), jax.random.key(3))
    x = jax.random.normal(jax.random.key(1), (64, 1024))
    w = jax.random.normal(jax.random.key(2), (1024, 128))

    def run(device):
        a, b = jax.device_put(x, device), jax.device_put(w, device)
        return np.asarray(jax.jit(lambda a, b: dg(a, b, DN))(a, b), np.float64)

    got, want = run(_gpu()), run(_cpu())
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < (2e-3 if preset == "fp8" else 1e-6), err


def test_identity_config_is_lax_bit_for_bit_on_gpu():
    dg = qbits.dot_general(qbits.presets.get("none"))
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = jax.random.normal(jax.random.key(1), (64, 128)).astype(dtype)
        w = jax.random.normal(jax.random.key(2), (128, 32)).astype(dtype)
        got = jax.jit(lambda a, b: dg(a, b, DN))(x, w)
        want = jax.jit(lambda a, b: jax.lax.dot_general(a, b, DN))(x, w)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _training_gemms(preset: str) -> list[dict[str, str]]:
    dg = qbits.dot_general(qbits.presets.get(preset), jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (512, 1024)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (1024, 2048)).astype(jnp.bfloat16)
    loss = lambda x, w: jnp.sum(dg(x, w, DN).astype(jnp.float32) ** 2)  # noqa: E731
    text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).compile().as_text()
    return list(qbits.hlo.Program(text).gemms)


def test_fp8_training_matmuls_are_fp8_gemms():
    if not _fp8_capable():
        pytest.skip("FP8 GEMMs need compute capability 8.9 or higher")
    gemms = _training_gemms("fp8")
    assert len(gemms) == 3
    assert all(g.kind in ("cublaslt_fp8", "triton") for g in gemms), gemms
    assert all(g.lhs.startswith("f8") and g.rhs.startswith("f8") for g in gemms)
    kinds = sorted((g.lhs, g.rhs) for g in gemms)
    assert kinds.count(("f8e4m3fn", "f8e4m3fn")) == 1, kinds


def test_int8_training_matmuls_are_s8_gemms():
    gemms = _training_gemms("int8")
    assert len(gemms) == 3
    assert all(g.lhs == "s8" and g.rhs == "s8" for g in gemms), gemms
