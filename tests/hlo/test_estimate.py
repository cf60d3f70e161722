"""Reading optimized HLO and estimating its device time, pinned on an H200 run.

``tests/data/h200_mlp_hlo.tar.xz`` holds the optimized HLO an H200 ran for
the MLP training step of ``benchmarks/train_step.py --gpu`` (bf16 and four
quantized variants, before qbits' GPU changes), and
``h200_mlp_profile.json`` the device time its profile measured: the
estimate is checked against it, and the parser against what the profile's
reading found in each program (``../shared/gpu/h200-2026-11-27``).
``h200_mlp_hlo_2.tar.xz`` and ``h200_mlp_profile_2.json`` are the second
H200 run that day, of the programs after qbits' GPU changes: the estimate
was not fitted to it (apart from the rate of one kernel it newly showed).
"""

import json
import pathlib
import tarfile

import jax
import jax.numpy as jnp
import pytest

import qbits
import qbits.hlo
from qbits.hlo._targets import TARGETS

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
H200 = "h200"


def _programs(archive: str) -> dict[str, qbits.hlo.Program]:
    with tarfile.open(DATA / archive) as tar:
        texts = {
            m.name.removesuffix(".hlo.txt"): tar.extractfile(m).read().decode()
            for m in tar.getmembers()
        }
    return {name: qbits.hlo.Program(text, H200) for name, text in texts.items()}


def _measured(name: str) -> dict:
    return json.loads((DATA / name).read_text())["variants"]


@pytest.fixture(scope="module")
def programs():
    return _programs("h200_mlp_hlo.tar.xz")


@pytest.fixture(scope="module")
def measured():
    return _measured("h200_mlp_profile.json")


def test_estimate_is_within_ten_percent_of_the_measured_device_time(programs, measured):
    for name, program in programs.items():
        want = measured[name]["device_ms"]
        got = program.estimate().total_ms
        assert abs(got - want) <= 0.1 * want, (name, got, want)
    # And it ranks them as the GPU did.
    order = sorted(programs, key=lambda n: programs[n].estimate().total_ms)
    assert order[-1] == "int8" and order[0] == "fp8_delayed"


def test_the_second_run_is_estimated_within_ten_percent_too():
    programs = _programs("h200_mlp_hlo_2.tar.xz")
    measured = _measured("h200_mlp_profile_2.json")
    for name, program in programs.items():
        want = measured[name]["device_ms"]
        got = program.estimate().total_ms
        assert abs(got - want) <= 0.1 * want, (name, got, want)
    # What made int8 slow there: XLA's transpose folding handed cuBLASLt's
    # int8 GEMM w2's codes not contiguous along K (8.6 of its 14.6 ms).
    int8 = programs["int8"]
    (slow,) = [g for g in int8.gemms if not all(g.contraction_minor)]
    assert slow.kind == "cublaslt" and slow.contraction_minor == (True, False)
    us = dict(int8.estimate().kernels)
    (name,) = [k.name for k in int8.kernels if k.gemm is slow]
    assert abs(us[name] - measured["int8"]["kernels_us"][name]) < 0.1 * us[name]
    assert "rhs: 8-bit, not contiguous along K (not TN): cuBLASLt" in str(int8)


def test_kernels_are_the_profiled_ones(programs, measured):
    for name, program in programs.items():
        names = {k.name for k in program.kernels}
        # The profile lists the kernels of one step (its top 40): all of them
        # are kernels of the program, none a free instruction.
        assert set(measured[name]["kernels_us"]) <= names, name


def test_gemms_of_each_variant(programs):
    kinds = {n: sorted(str(g) for g in p.gemms) for n, p in programs.items()}
    assert kinds["bf16"] == ["cublaslt: bf16 x bf16 -> bf16"] * 5
    assert sum(g.startswith("cublaslt_fp8") for g in kinds["fp8"]) == 5
    int8 = programs["int8"].gemms
    assert sorted(g.kind for g in int8) == ["cublaslt"] * 4 + ["triton"]
    (slow,) = [g for g in int8 if g.kind == "triton"]
    # w2's codes reach the dgrad not contiguous along K: Triton's slow path.
    assert slow.contraction_minor == (True, False) and slow.low_precision
    assert all(g.flops == 2 * 8192 * 4096 * 16384 for g in int8)


def test_what_sits_between_quantization_and_gemm(programs):
    fp8, int8, bf16 = programs["fp8"], programs["int8"], programs["bf16"]
    # The profile's reading: int8 transposes codes (2 ms), fp8 too (0.3 ms);
    # both compute a weight's amax on a float32 copy; fp8 GEMMs write float32
    # that another kernel converts.
    assert int8.count("code_layout") == 4 and fp8.count("code_layout") == 5
    assert fp8.count("wide_copy") == 2 and int8.count("wide_copy") == 2
    assert fp8.count("output_convert") == 5
    for p in (bf16,):
        assert p.count("code_layout") == p.count("wide_copy") == 0
    e = int8.estimate()
    assert 1.8 < e.by_category["code_layout"] < 2.3  # the 0.33 TB/s transposes
    table = str(fp8)
    assert "codes re-laid out" in table and "amax of a float32 copy" in table
    assert "a separate convert to bf16" in table


def test_a_program_compiled_here_is_read_too():
    f = jax.jit(lambda a, b: jnp.tanh(a @ b))
    text = f.lower(jnp.ones((32, 64)), jnp.ones((64, 16))).compile().as_text()
    p = qbits.hlo.Program(text)
    (g,) = p.gemms
    assert (g.lhs, g.rhs, g.out, g.flops) == ("f32", "f32", "f32", 2 * 32 * 16 * 64)
    with pytest.raises(qbits.InvalidArgumentError, match="target_name"):
        p.estimate()
    assert p.estimate("h100").total_ms > 0
    with pytest.raises(qbits.InvalidArgumentError, match="'h100', 'h200'"):
        p.estimate("a100")


_HEADS = """HloModule heads

%fused_{name} (p: bf16[8192,2048]) -> {out} {{
  %p = bf16[8192,2048]{{1,0}} parameter(0)
  %b = bf16[4,2048,16,128]{{3,2,1,0}} bitcast(%p)
  ROOT %t = {out}{{3,2,1,0}} transpose(%b), dimensions={{{perm}}}
}}

ENTRY %main (x: bf16[8192,2048]) -> {out} {{
  %x = bf16[8192,2048]{{1,0}} parameter(0)
  ROOT %{name} = {out}{{3,2,1,0}} fusion(%x), kind=kLoop, calls=%fused_{name}
}}
"""


@pytest.mark.parametrize(
    "out, perm, keeps",
    [
        ("bf16[4,16,2048,128]", "0,2,1,3", True),  # heads to the front: rows of 128
        ("bf16[4,16,128,2048]", "0,2,3,1", False),  # the minor axis moves
    ],
)
def test_a_loop_transpose_that_keeps_rows_streams(out, perm, keeps):
    # Attention's head permutations keep the minor axis: each row is read and
    # written whole, as the H200's compiler made the same casts a tiled
    # (Triton) kernel where a deviceless compile leaves the loop emitter. A
    # transpose that moves the minor axis stays at the loop emitter's rate.
    text = _HEADS.format(name="loop_transpose_fusion", out=out, perm=perm)
    (k,) = qbits.hlo.Program(text, H200).kernels
    assert k.transposes and k.fusion_kind == "kLoop" and k.keeps_rows is keeps
    target = TARGETS[H200]
    rate = target.transpose_bandwidth if keeps else target.loop_transpose_bandwidth
    us = dict(qbits.hlo.Program(text, H200).estimate().kernels)[k.name]
    assert us == pytest.approx(2 * 8192 * 2048 * 2 / rate / 1e6)


_FP8_FORM = """HloModule fp8_form

%fused (p0: f8e4m3fn[64,128], p1: f8e5m2[256,128], p2: bf16[]) -> bf16[64,256] {
  %p0 = f8e4m3fn[64,128]{1,0} parameter(0)
  %c0 = bf16[64,128]{1,0} convert(%p0)
  %p2 = bf16[] parameter(2)
  %s = bf16[64,128]{1,0} broadcast(%p2), dimensions={}
  %m = bf16[64,128]{1,0} multiply(%c0, %s)
  %p1 = f8e5m2[256,128]{1,0} parameter(1)
  %c1 = bf16[256,128]{1,0} convert(%p1)
  ROOT %d = bf16[64,256]{1,0} dot(%m, %c1), {DIMS}
}

ENTRY %main (a: f8e4m3fn[64,128], b: f8e5m2[256,128], s: bf16[]) -> bf16[64,256] {
  %a = f8e4m3fn[64,128]{1,0} parameter(0)
  %b = f8e5m2[256,128]{1,0} parameter(1)
  %s = bf16[] parameter(2)
  ROOT %f = bf16[64,256]{1,0} fusion(%a, %b, %s), kind=kCustom, {TRITON}
}
""".replace("{DIMS}", "lhs_contracting_dims={1}, rhs_contracting_dims={1}").replace(
    "{TRITON}",
    'calls=%fused, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
)


def test_a_triton_gemm_of_xlas_fp8_form_reads_fp8():
    # qbits writes FP8 GEMMs as dot(convert(a) * s, convert(b)) on GPUs; a
    # Triton GEMM fusion of that form (where autotuning keeps one) reads
    # the 8-bit codes and runs at the FP8 rate, not bf16's.
    (g,) = qbits.hlo.Program(_FP8_FORM, H200).gemms
    assert (g.kind, g.lhs, g.rhs, g.out) == ("triton", "f8e4m3fn", "f8e5m2", "bf16")
    assert g.low_precision and g.contraction_minor == (True, True)
