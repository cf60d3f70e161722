"""The program a GPU and a TPU would run for qbits' quantized steps, without one.

XLA compiles for an H100 and a TPU v5e on this machine (deviceless); these
tests pin what matters for speed in the compiled program: every quantized
matmul a cuBLASLt FP8 or s8 GEMM (int8 on the TPU's MXU), no float32 copy of
a weight for its amax, no transpose of activation codes, FP8 GEMMs writing
the compute dtype, a bound on the number of kernels.

They need XLA's GPU compiler (the CUDA plugin) and ``libtpu``, which CI's
suite does not install: ``tests/gpu_program.sh`` installs both in a virtual
environment of its own and runs this file; elsewhere the tests skip, saying
why.
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import pytest

import qbits
import qbits.hlo
from qbits.hlo._program import _device

# Each xdist worker loads libtpu when it collects this file (_needs below);
# without this, every worker after the first took libtpu's lock file as
# "in use" and the TPU test skipped wherever it landed there. A deviceless
# compile uses no TPU chip, so several processes may load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _can_compile_for(target: str) -> str:
    """``""`` where this process can compile for ``target``, else why not."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if target != "v5e" and "cuda" not in platforms:
        return "JAX_PLATFORMS has no cuda (run tests/gpu_program.sh)"
    try:
        _device(target)
    except RuntimeError as e:
        return str(e).split(". Install")[0]
    return ""


def _needs(target: str):
    why = _can_compile_for(target)
    return pytest.mark.skipif(bool(why), reason=f"{target}: {why}")


BF16 = jnp.bfloat16
# The benchmark's MLP block (benchmarks/train_step.py --gpu): XLA's fusion
# decisions depend on sizes (small casts are not fused with their
# transposes), so the program is pinned at the size that is timed.
TOKENS, D_MODEL, D_FF = 8192, 4096, 16384


def _mlp(params, x):
    return jax.nn.gelu(x @ params["w1"]) @ params["w2"]


def _step(preset):
    def loss(params, state, x, y, key):
        f = _mlp if preset is None else qbits.quantize(_mlp, preset, key, state=state)
        return jnp.mean((f(params, x).astype(jnp.float32) - y) ** 2)

    def step(params, state, x, y, key):
        grads, new_state = jax.grad(loss, argnums=(0, 1))(params, state, x, y, key)
        params = jax.tree.map(lambda p, g: p - 0.01 * g.astype(p.dtype), params, grads)
        return params, new_state

    return step


@functools.cache
def _program(preset, target="h100"):
    spec = jax.ShapeDtypeStruct
    params = {"w1": spec((D_MODEL, D_FF), BF16), "w2": spec((D_FF, D_MODEL), BF16)}
    x, y = spec((TOKENS, D_MODEL), BF16), spec((TOKENS, D_MODEL), jnp.float32)
    key = spec((), jax.random.key(0).dtype)
    state = None
    if preset is not None and qbits.presets.get(preset).needs_state:
        state = jax.eval_shape(
            lambda p, x: qbits.init_state(_mlp, preset, p, x), params, x
        )
    return qbits.hlo.program(_step(preset), params, state, x, y, key, target=target)


@_needs("h100")
@pytest.mark.parametrize(
    "preset, kind, out, kernels",
    [
        # fp8: the two inverse scales and their product in one small kernel
        # per GEMM (ops/_rescale.py, _scale_product), 36 before.
        ("fp8", "cublaslt_fp8", "bf16", 31),
        ("fp8_delayed", "cublaslt_fp8", "bf16", 32),
        ("int8", "cublaslt", "s32", 46),
    ],
)
def test_quantized_step_is_8bit_gemms_and_no_waste(preset, kind, out, kernels):
    p = _program(preset)
    gemms = p.gemms
    assert len(gemms) == 5  # forward x2, dgrad of layer 2, two weight gradients
    for g in gemms:
        assert g.kind == kind and g.low_precision, g
        # FP8 GEMMs write the compute dtype; cuBLASLt's s8 GEMMs only int32.
        assert g.out == out, g
    assert p.count("wide_copy") == 0  # no float32 copy of a weight for its amax
    assert p.count("output_convert") == 0  # no lone convert of a GEMM's output
    # No codes transposed: each cast writes the layouts its GEMMs take. For
    # int8 one weight's codes may be left (w2's, whose forward and
    # input-gradient GEMMs take the two layouts), half the bytes of a cast;
    # FP8's weight casts write both (XLA's FP8 form leaves them no copy).
    layouts = [k for k in p.kernels if k.category == "code_layout"]
    assert len(layouts) <= (1 if preset == "int8" else 0)
    assert all(k.nbytes <= 2 * D_MODEL * D_FF for k in layouts)
    assert len(p.kernels) <= kernels
    e = p.estimate()
    assert e.by_category.get("code_layout", 0) < 0.05 * e.total_ms


@_needs("h100")
def test_temporaries_stay_near_bf16s():
    # XLA's buffer assignment: fp8's codes and scales add ~3% to bf16's
    # temporaries; int8's s32 GEMM outputs (cuBLASLt's s8 GEMMs write int32)
    # ~28%.
    bf16 = _program(None).temp_bytes
    assert _program("fp8").temp_bytes <= 1.05 * bf16
    assert _program("int8").temp_bytes <= 1.3 * bf16


@_needs("h100")
def test_bf16_step_is_five_bf16_gemms():
    p = _program(None)
    assert [str(g) for g in p.gemms] == ["cublaslt: bf16 x bf16 -> bf16"] * 5


@_needs("h200")
def test_estimated_device_time_on_an_h200_beats_bf16():
    # Device time at the H200's measured rates (the timed step adds ~0.6 ms
    # of launches, as much for bf16). The H100's slower memory leaves fp8
    # at ~1.3x: the work outside the GEMMs moves bytes.
    bf16 = _program(None, "h200").estimate().total_ms
    for preset, least in (("fp8", 1.4), ("fp8_delayed", 1.4)):
        assert bf16 / _program(preset, "h200").estimate().total_ms >= least, preset
        assert all(all(g.contraction_minor) for g in _program(preset, "h200").gemms)


@_needs("h200")
def test_delayed_scaling_costs_no_more_than_current_scaling():
    # Delayed scaling needs no amax before its casts, so it should never be
    # slower: its gradient's amax is taken where the gradient is made (no
    # cast writing the bf16 gradient beside its codes for a second amax
    # pass), and each amax history is written by one kernel (no separate
    # roll and dynamic-update-slice). It was 5.56 ms against fp8's 5.44.
    delayed, current = _program("fp8_delayed", "h200"), _program("fp8", "h200")
    assert delayed.estimate().total_ms <= current.estimate().total_ms
    casts = [k for k in delayed.kernels if k.category == "cast"]
    assert casts and not [k for k in casts if "bf16[" in k.output]
    assert not [k for k in delayed.kernels if "dynamic_update_slice" in k.name]
    # Each matmul's three amax histories are read by one reduction and
    # written by one kernel (each tensor's took two of its own: 12 kernels).
    history = [k for k in delayed.kernels if any("history" in i for i in k.inputs)]
    assert len(history) == 4, [k.name for k in history]


@_needs("h200")
def test_int8_gemms_read_tn_operands_and_beat_bf16():
    # On the H200 (2026-11-27) one s8 GEMM got w2's codes not contiguous
    # along K and ran at 128 TOPS, 8.6 of the step's 14.6 ms: each int8
    # quantization now runs in a chain of its own, laid out for its GEMM.
    p = _program("int8", "h200")
    assert all(all(g.contraction_minor) for g in p.gemms)
    bf16 = _program(None, "h200").estimate().total_ms
    assert bf16 / p.estimate().total_ms >= 1.3


@_needs("v5e")
def test_tpu_int8_dots_stay_int8_on_the_mxu():
    spec = jax.ShapeDtypeStruct
    params = {"w1": spec((D_MODEL, D_FF), BF16), "w2": spec((D_FF, D_MODEL), BF16)}
    x = spec((TOKENS, D_MODEL), BF16)
    p = qbits.hlo.program(qbits.quantize(_mlp, "int8_fwd"), params, x, target="v5e")
    assert len(p.gemms) == 2
    for g in p.gemms:
        assert (g.lhs, g.rhs) == ("s8", "s8"), g  # no float fallback


@_needs("h100")
def test_inspect_target_prints_the_gemms(capsys):
    from qbits.cli import main

    argv = ["inspect", "int8", "--target", "h100", "--model", "block", "--small"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("cublaslt: s8 x s8 -> s32") == 5
    assert "x bf16's device time" in out


@_needs("h200")
def test_lm_proj_recipe_leaves_attention_einsums_bf16_and_the_rest_fp8():
    # The example LM's GPU recipe (qbits._experiments.LM_RECIPES): attention's
    # q k^T and p v stay bf16 (quantizing their [batch, heads, S, S] operands
    # costs more bytes than their FP8 GEMMs save: estimated 24.3 ms against
    # bf16's 10.1 ms on the H200's LM program), every weight matmul FP8.
    from qbits._experiments import gpu_step

    batch, heads, context = 2, 4, 64
    with jax.numpy_dtype_promotion("standard"):  # flax's LayerNorm of bf16
        make, args = gpu_step(
            "lm", "fp8_delayed_proj", batch=batch, context=context, width=64,
            depth=1, heads=heads,
        )  # fmt: skip
        p = qbits.hlo.program(make(), *args, target="h200")
    attention = re.compile(rf"^\w+\[{batch * heads},")  # batched over heads
    scores = re.compile(rf"\[(?:{batch},{heads}|{batch * heads}),{context},{context}\]")
    attn = [k.gemm for k in p.kernels if k.gemm and attention.match(k.output)]
    rest = [k.gemm for k in p.kernels if k.gemm and not attention.match(k.output)]
    # q k^T and p v, forward and both gradients; the rest: 4 projections,
    # 2 MLP matmuls and the head, 3 GEMMs each.
    assert len(attn) == 6 and len(rest) == 21
    assert all(g.kind == "cublaslt" and (g.lhs, g.rhs) == ("bf16",) * 2 for g in attn)
    for g in rest:
        assert g.kind == "cublaslt_fp8" and all(g.contraction_minor), g
    casts = [k for k in p.kernels if k.category in ("cast", "code_layout")]
    assert casts and not [k for k in casts if scores.search(k.output)]
