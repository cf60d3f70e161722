"""The program qbits hands XLA, per backend, pinned without a GPU.

qbits emits some forms only for XLA:CPU (optimization barriers around int8
transposes, a variadic NaN-flagging absmax, a barrier-divided scale). On GPU
the program must be the plain pattern XLA's GPU compiler rewrites into
cuBLASLt FP8 and int8 GEMMs. Lowering for the "cuda" platform works on a
CPU-only machine, so these checks run in CI; ``tests/test_gpu.py`` checks the
compiled result on a GPU.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import qbits
import qbits.hlo

DN = (((1,), (0,)), ((), ()))
_DOT = re.compile(
    r"stablehlo\.dot_general .*contracting_dims = \[(\d+)\] x \[(\d+)\].*"
    r": \(tensor<([^>]+)>, tensor<([^>]+)>\) -> tensor<([^>]+)>"
)


def _training_step_text(preset: str, platform: str, dtype=jnp.bfloat16) -> str:
    config = qbits.presets.get(preset)
    dg = qbits.dot_general(config, jax.random.key(0))

    def loss(x, w1, w2):
        h = jax.nn.gelu(dg(x, w1, DN))
        return jnp.sum(dg(h, w2, DN).astype(jnp.float32) ** 2)

    x = jnp.ones((64, 128), dtype)
    w1 = jnp.ones((128, 256), dtype)
    w2 = jnp.ones((256, 128), dtype)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with qbits.hlo.lowering_platforms(platform):
        return step.trace(x, w1, w2).lower(lowering_platforms=(platform,)).as_text()


def _dots(text: str) -> list[tuple[int, int, str, str, str]]:
    found = []
    for line in text.splitlines():
        m = _DOT.search(line)
        if m:
            lc, rc, a, b, out = m.groups()
            found.append((int(lc), int(rc), a, b, out))
    return found


def _element(t: str) -> str:
    return t.rsplit("x", 1)[-1]


def _fp8_dots(text: str) -> list[tuple[list[str], str, str]]:
    """Each dot's operand definitions, its output's uses and its line.

    Per function (SSA names are per function): for every dot, the lines
    defining its two operands (and, for a multiply, its operands' too).
    """
    found = []
    for body in text.split("func.func")[1:]:
        lines = body.splitlines()
        defs = {}
        for ln in lines:
            m = re.match(r"\s*(%[\w#]+) = ", ln)
            if m:
                defs[m.group(1)] = ln
        for ln in lines:
            if "stablehlo.dot_general" not in ln:
                continue
            name = ln.split("=", 1)[0].strip()
            operands = re.findall(r"%[\w#]+", ln.split("=", 1)[1])[:2]
            chain = []
            for o in operands:
                d = defs.get(o, "")
                chain.append(d)
                if "stablehlo.multiply" in d:
                    chain.extend(
                        defs.get(a, "")
                        for a in re.findall(r"%[\w#]+", d.split("=", 1)[1])
                    )
            uses = [
                u
                for u in lines
                if re.search(rf"{re.escape(name)}\b", u) and u is not ln
            ]
            found.append((chain, " ".join(uses), ln))
    return found


def _widened(chain: list[str]) -> list[str]:
    """The fp8 element types an operand chain converts from."""
    return re.findall(
        r"stablehlo\.convert %[\w#]+ : \(tensor<[\dx]+x(f8E\w+)>\)", " ".join(chain)
    )


@pytest.mark.parametrize("preset", ["fp8", "int8"])
def test_gpu_program_has_gemm_layout_dots_and_no_cpu_forms(preset):
    text = _training_step_text(preset, "cuda")
    dots = _dots(text)
    assert len(dots) == 6  # two layers x (forward + two gradient matmuls)
    for lc, rc, a, b, out in dots:
        # Both operands contracted along their last (contiguous) axis: the
        # "TN" layout cuBLASLt runs int8 and fp8 GEMMs in.
        assert lc == 1 and rc == 1, (lc, rc, a, b)
        if preset == "int8":
            assert (_element(a), _element(b), _element(out)) == ("i8", "i8", "i32")
        else:
            # XLA's FP8 form: both operands widened from fp8 codes (see
            # test_fp8_dot_is_xlas_fp8_form_on_gpu). The GEMM writes the
            # compute dtype itself (no float32 output converted by another
            # kernel).
            assert _element(out) == "bf16"
    if preset == "fp8":
        for chain, _, line in _fp8_dots(text):
            codes = _widened(chain)
            assert len(codes) == 2, line
            assert codes.count("f8E5M2") < 2, "never E5M2 x E5M2"
    # No CPU workaround: no variadic reduction, and barriers only hold fp8
    # values (they keep XLA from dropping the fp8 rounding as excess
    # precision) or, for int8, one quantization's tensor, inverse scale and
    # clip bounds (each chain apart, laid out for its own GEMM: see
    # qbits._quantizer._quantizer._clamps_apart).
    assert not re.search(r"stablehlo\.reduce\(%\S+ init: %\S+\), \(", text)
    apart = re.compile(
        r": tensor<[\dx]+xbf16>, tensor<([\dx]+)xf32>, tensor<2x\1xf32>$"
    )
    barriers = [
        ln for ln in text.splitlines() if "stablehlo.optimization_barrier" in ln
    ]
    for line in barriers:
        if preset == "fp8":
            assert re.search(r": tensor<[^>]*xf8E", line), line
        else:
            assert apart.search(line), line
    # int8: the four forward operands and the four the backward matmuls keep;
    # the output gradients round stochastically (their noise keeps the
    # chains apart already).
    assert len(barriers) == (8 if preset == "int8" else len(barriers))


def test_fp8_program_has_e4m3_forward_and_e5m2_gradients():
    dots = _fp8_dots(_training_step_text("fp8", "cuda"))
    pairs = sorted(tuple(_widened(chain)) for chain, _, _ in dots)
    assert len(pairs) == 6
    assert pairs.count(("f8E4M3FN", "f8E4M3FN")) == 2
    assert all("f8E5M2" in p for p in pairs if p != ("f8E4M3FN", "f8E4M3FN"))


def test_fp8_dot_is_xlas_fp8_form_on_gpu():
    # dot(convert(a) * s, convert(b)) -> bf16, s the two per-tensor scales'
    # product: cuBLASLt takes s as the lhs's scale and writes the output
    # once, in bf16 and in the layout its user wants. Multiplied after the
    # dot, the scale stayed behind in the user's kernel when that user
    # widened the output (an SGD update in float32), and XLA wrote weight
    # gradients column-major for it to transpose.
    dots = _fp8_dots(_training_step_text("fp8", "cuda"))
    assert len(dots) == 6
    for chain, uses, line in dots:
        lhs, rhs = chain[0], chain[-1]
        assert "stablehlo.multiply" in lhs and "stablehlo.convert" in rhs, line
        assert "f8E" in rhs and len(_widened(chain)) == 2, line
        assert "stablehlo.multiply" not in uses, uses


def test_fp8_forms_scale_product_is_the_product_to_float32_ulps():
    # XLA's FP8 form takes the scales' product from the inverses the casts
    # use (one small kernel for all three on a GPU): 1 / ((1/a)(1/b)) is
    # a * b within a few float32 ulps, then rounded to bfloat16 by the form.
    from qbits.ops._rescale import _scale_product

    e = jax.random.uniform(jax.random.key(0), (2, 4096), minval=-60, maxval=60)
    a, b = (jnp.exp2(e[i]).reshape(-1, 1, 1) for i in range(2))
    got = jax.jit(jax.vmap(_scale_product))(a, b)
    want = (a * b).reshape(-1)
    ulp = jnp.finfo(jnp.float32).eps
    assert float(jnp.max(jnp.abs(got / want - 1))) <= 4 * ulp


def test_fp8_dots_of_float16_write_float32_on_gpu():
    # float16 cannot hold the scales' product of small operands (2.5e-7 is a
    # subnormal with two significant bits): its dots write float32, scaled
    # there, and XLA's FP8 form is bfloat16's alone.
    dots = _dots(_training_step_text("fp8", "cuda", jnp.float16))
    assert len(dots) == 6
    for *_, a, b, out in dots:
        assert (_element(a)[:2], _element(b)[:2], _element(out)) == ("f8", "f8", "f32")


def test_cpu_program_keeps_its_forms():
    text = _training_step_text("int8", "cpu")
    assert "stablehlo.optimization_barrier" in text
    assert re.search(r"stablehlo\.reduce\(%\S+ init: %\S+\), \(", text)


def test_one_program_for_cpu_and_gpu_exports():
    # A multi-platform lowering keeps both forms and picks one per platform.
    config = qbits.presets.get("int8_fwd")
    dg = qbits.dot_general(config)
    f = jax.jit(lambda x, w: dg(x, w, DN))
    x = jnp.ones((8, 16))
    with qbits.hlo.lowering_platforms("cpu", "cuda"):
        text = f.trace(x, x.T).lower(lowering_platforms=("cpu", "cuda")).as_text()
    assert "stablehlo.case" in text


def test_a_program_traced_for_one_platform_is_refused_for_another():
    # By default the CPU's form alone is traced (no cond in the jaxpr, no
    # case in the program); lowering it for a GPU is refused, never run in
    # the CPU's form, and the error names the fix.
    dg = qbits.dot_general("int8_fwd")
    f = jax.jit(lambda x, w: dg(x, w, DN))
    x = jnp.ones((8, 16))
    assert "cond" not in str(jax.make_jaxpr(f)(x, x.T))
    assert "stablehlo.case" not in f.trace(x, x.T).lower().as_text()
    with pytest.raises(
        qbits.InvalidArgumentError, match="lowering_platforms\\('cuda'\\)"
    ):
        f.trace(x, x.T).lower(lowering_platforms=("cuda",))
    bad = qbits.hlo.lowering_platforms("metal")
    with pytest.raises(qbits.InvalidArgumentError, match="'metal'"):
        bad.__enter__()


def _normalized(body: str) -> str:
    """A fused computation's instructions without names or metadata."""
    names: dict[str, str] = {}
    lines = []
    for line in body.splitlines():
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        lhs, _, rhs = line.partition(" = ")
        names[lhs.split()[-1]] = f"v{len(names)}"
        lines.append(re.sub(r"%[\w.\-]+", lambda m: names.get(m[0], "?"), rhs))
    return "\n".join(sorted(lines))


def _noise_kernels(depth: int) -> int:
    """Distinct fused computations that draw noise, in an int8 step of ``depth``."""
    config = qbits.presets.get("int8")

    def loss(ws, x, key):
        for i, w in enumerate(ws):
            k = qbits.numerics._derive_key(key, i)
            x = jax.nn.relu(qbits.dot_general(config, k)(x, w, DN))
        return jnp.sum(x**2)

    ws = [jnp.full((32, 32), 0.1 + i) for i in range(depth)]
    x = jnp.ones((16, 32))
    step = jax.jit(jax.grad(loss))
    hlo = step.trace(ws, x, jax.random.key(0)).lower().compile().as_text()
    kernels = set()
    for body in re.findall(r"\n%fused[^\n]*\{\n(.*?)\n\}", hlo, re.S):
        if " iota(" not in body:  # only the noise hash uses iota here
            continue
        kernels.add(_normalized(body))
    return len(kernels)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU fusions")
def test_noise_kernels_are_shared_by_equal_layers_with_their_own_keys():
    # XLA:CPU compiles each distinct fused computation once (a kernel of its
    # own, ~20 ms). The layer's key (derive_key(key, i): a per-layer constant)
    # must stay out of the noise kernels, or each layer compiles its own.
    shallow, deep = _noise_kernels(3), _noise_kernels(6)
    assert shallow > 0
    assert deep == shallow


def _kernels(depth: int, keys: str) -> tuple[int, int]:
    """(distinct, all) fused computations of an int8 training step of
    ``depth`` equal layers, whose keys are ``"chained"`` (next_key) or
    ``"indexed"`` (derive_key with the layer index)."""
    config = qbits.presets.get("int8")

    def loss(ws, x, key):
        for i, w in enumerate(ws):
            if keys == "chained":
                key = qbits.numerics.next_key(key)
                k = key
            else:
                k = qbits.numerics._derive_key(key, i)
            x = jax.nn.relu(qbits.dot_general(config, k)(x, w, DN))
        return jnp.sum(x**2)

    ws = [jnp.full((32, 32), 0.1 + i) for i in range(depth)]
    x = jnp.ones((16, 32))
    step = jax.jit(jax.grad(loss))
    hlo = step.trace(ws, x, jax.random.key(0)).lower().compile().as_text()
    bodies = re.findall(r"\n%fused[^\n]*\{\n(.*?)\n\}", hlo, re.S)
    return len({_normalized(b) for b in bodies}), len(bodies)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU fusions")
def test_equal_layers_compile_to_the_same_kernels():
    # XLA:CPU compiles each distinct fused computation once (~10 ms each);
    # with chained keys a deeper model adds no kernel of its own (the first
    # layer, which computes no input gradient, included), only instances.
    shallow, deep = _kernels(3, "chained"), _kernels(6, "chained")
    assert deep[0] == shallow[0]
    assert deep[1] > shallow[1]
    # A layer index in the key costs one small kernel per layer.
    indexed = _kernels(3, "indexed"), _kernels(6, "indexed")
    assert indexed[1][0] - indexed[0][0] == 3


@pytest.mark.parametrize("preset, codes", [("int8", "i8"), ("fp8", "f8E")])
def test_a_bf16_dot_algorithm_does_not_cast_the_codes(preset, codes):
    # jax.nn.dot_product_attention (and so Flax's attention) passes
    # precision=BF16_BF16_F32 for bfloat16 inputs: on the codes it would cast
    # int8 and fp8 to bfloat16, a bf16 GEMM in place of an s8 or FP8 one.
    dg = qbits.dot_general(qbits.presets.get(preset), jax.random.key(0))
    algorithm = jax.lax.DotAlgorithmPreset.BF16_BF16_F32

    def loss(q, k):
        dims = (((2,), (2,)), ((0,), (0,)))
        out = dg(q, k, dims, precision=algorithm, preferred_element_type=jnp.float32)
        return jnp.sum(out * out)

    q = jnp.ones((2, 8, 16), jnp.bfloat16)
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    with qbits.hlo.lowering_platforms("cuda"):
        text = step.trace(q, q).lower(lowering_platforms=("cuda",)).as_text()
    dots = _dots(text)
    assert len(dots) == 3  # forward and the two gradient matmuls
    for _, _, a, b, _ in dots:
        assert _element(a).startswith(codes) and _element(b).startswith(codes)
    assert "algorithm" not in text


def test_a_bf16_dot_algorithm_does_not_cast_a_ragged_dots_codes():
    rd = qbits.ops.ragged_dot(qbits.presets.get("int8_fwd"))
    algorithm = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
    x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 16, 4), jnp.bfloat16)
    sizes = jnp.array([3, 5], jnp.int32)
    f = jax.jit(lambda x, w: rd(x, w, sizes, precision=algorithm))
    with qbits.hlo.lowering_platforms("cuda"):
        text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    dots = [ln for ln in text.splitlines() if "ragged_dot" in ln]
    assert dots and all("tensor<8x16xi8>, tensor<2x16x4xi8>" in ln for ln in dots)


@pytest.fixture
def gpu_forms_on_cpu():
    """Programs traced for a GPU compile for the CPU (the platform mark off)."""
    from jax._src.interpreters import mlir

    from qbits import _platform

    mlir.register_lowering(_platform.traced_for_p, lambda ctx, x, **_: [x])
    try:
        yield
    finally:
        mlir.register_lowering(_platform.traced_for_p, _platform._check)


@pytest.mark.parametrize("preset", ["int8", "int8_fwd", "fp8", "fp8_delayed"])
def test_gpu_forms_compute_the_cpu_forms_numbers(preset, gpu_forms_on_cpu):
    # The GPU's forms (GEMM layouts, no barriers, XLA's FP8 form, delayed
    # scaling's stacked state) run here on the CPU: the integer ones give
    # the CPU form's values and both gradients bit for bit, delayed
    # scaling's next state is the CPU's bit for bit; the FP8 form rounds the
    # scale product, each scaled code and the output to bfloat16 (on a GPU
    # cuBLASLt applies the scale in float32), within 1e-2 of the largest
    # output.
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (64, 128), jnp.bfloat16)
    w = 0.05 * jax.random.normal(k[1], (128, 256), jnp.bfloat16)
    g = jax.random.normal(k[2], (64, 256), jnp.bfloat16)
    dg = qbits.dot_general(qbits.presets.get(preset), jax.random.key(0))
    state = None
    if preset == "fp8_delayed":  # histories of earlier steps
        state = jax.tree.map(
            lambda s: s + 0.5 * (s.ndim == 1 and s.shape[0] > 1),
            dg.init_state(x, w, DN),
        )

    @jax.jit
    def f(x, w, g, state):
        y, vjp = jax.vjp(lambda x, w, s: dg(x, w, DN, state=s), x, w, state)
        return (y, *vjp(g))

    cpu = f(x, w, g, state)
    with qbits.hlo.lowering_platforms("cuda"):
        traced = f.trace(x, w, g, state)
    gpu = traced.lower(lowering_platforms=("cpu",)).compile()(x, w, g, state)
    for a, b in zip(cpu[:3], gpu[:3], strict=True):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        if preset.startswith("fp8"):
            assert float(jnp.abs(a - b).max()) <= 1e-2 * float(jnp.abs(a).max())
        else:
            assert bool((a == b).all())
    for a, b in zip(jax.tree.leaves(cpu[3]), jax.tree.leaves(gpu[3]), strict=True):
        assert bool((a == b).all())  # the next state
