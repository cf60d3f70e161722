"""Named recipes: ready-made :class:`~qbits.DotGeneralConfig` s.

A preset is a recipe built from the blocks of layers 1-4, never new math.
Each one is also a YAML file, ``configs/<name>.yaml``, written from
:func:`yaml_text`; a test keeps the two identical.

A config's forward ``lhs`` is the activation quantizer and its ``rhs`` the
weight quantizer. A matmul with no weight (attention's ``q . k`` and
``p . v``) runs :meth:`~qbits.DotGeneralConfig.for_activations` of it:
float under a weight-only preset, the activation quantizer on both operands
under the others (unchanged where both sides are quantized alike). Each
preset's docstring says what it does there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from qbits._calibration import AbsMax, AbsMean
from qbits._errors import ConfigError
from qbits._granularity import PerChannel, PerTensor, Tiled
from qbits._providers import DelayedScaling
from qbits._quantizer import Quantizer, mx_quantizer
from qbits.config._matmul import DotGeneralConfig, MatmulConfig
from qbits.numerics import (
    Fp8Numerics,
    FpNumerics,
    IntNumerics,
    Nf4Numerics,
    TernaryNumerics,
    UintNumerics,
    UniformNoise,
)

__all__ = [
    "describe",
    "get",
    "mx_quantizer",
    "names",
]


def _int(bits: int, *, stochastic: bool = False) -> Quantizer:
    """AQT v2's integer quantizer: absmax shared along the contracting axes."""
    noise = UniformNoise() if stochastic else None
    return Quantizer(IntNumerics(bits=bits, noise_fn=noise), AbsMax(), PerChannel())


def _fp8(dtype: str) -> Quantizer:
    """Per-tensor current scaling: the scale is the tensor's own absmax."""
    return Quantizer(Fp8Numerics(dtype), AbsMax(), PerTensor())


def none() -> DotGeneralConfig:
    """No quantization: exactly ``lax.dot_general``.

    The float baseline of every ablation, and the config to give layers that
    must stay float (or use ``null`` in a rule).
    """
    return DotGeneralConfig()


def int8_fwd() -> DotGeneralConfig:
    """int8 forward matmul, float backward: quantization-aware training.

    Both operands int8 with AQT v2's defaults (symmetric grid with a zero,
    bound mapped to 127.5 and clipped to +-127, absmax shared along the
    contracting axes: per-row activations, per-column weights), so the
    forward numbers equal AQT's. Follows AQT (Abdolrashidi et al., "Pareto-
    Optimal Quantized ResNet Is Mostly 4-bit", arXiv 2105.03536).
    """
    return DotGeneralConfig(fwd=MatmulConfig(lhs=_int(8), rhs=_int(8)))


def int8() -> DotGeneralConfig:
    """int8 forward and both backward matmuls, stochastic rounding on gradients.

    The forward is :func:`int8_fwd`; in the two backward matmuls the incoming
    gradient is quantized to int8 with stochastic rounding (unbiased below
    the top code, so gradient noise averages out; each block's largest
    element comes back 0.39% low, absmax·254/255, a bias of 2e-4 to 2e-3 of
    the gradient's norm: see :class:`~qbits.IntNumerics`) and the other
    operand to int8 with rounding to nearest. Needs a PRNG key. Follows
    AQT's int8 training of transformers (arXiv 2105.03536) and the int8
    training recipe of Jin et al./SwitchBack.
    """
    fwd = MatmulConfig(lhs=_int(8), rhs=_int(8))
    bwd = MatmulConfig(lhs=_int(8, stochastic=True), rhs=_int(8))
    return DotGeneralConfig(fwd=fwd, dlhs=bwd, drhs=bwd)


def int4_fwd() -> DotGeneralConfig:
    """int4 forward matmul (both operands), float backward.

    4-bit QAT as in AQT's ResNet study (arXiv 2105.03536), with the int4
    operands widened to int8 for the matmul where the backend lacks int4.
    """
    return DotGeneralConfig(fwd=MatmulConfig(lhs=_int(4), rhs=_int(4)))


def w4a8() -> DotGeneralConfig:
    """int4 per-channel weights, int8 activations, float backward.

    The serving format of GPTQ/AWQ-style deployments (W4A8, e.g. QServe,
    arXiv 2405.04532): weights (the rhs) int4 with one scale per output
    channel, activations (the lhs) int8 with one scale per row.

    Matmuls of two activations (attention's ``q . k`` and ``p . v``) have
    no weight: they run int8 x int8 (the activation quantizer on both
    operands), never 4 bits.
    """
    return DotGeneralConfig(fwd=MatmulConfig(lhs=_int(8), rhs=_int(4)))


def int4_weight_only() -> DotGeneralConfig:
    """int4 weights in tiles of 128 along the contracting axis, float activations.

    Weight-only subchannel quantization (group size 128) as in GPTQ
    (arXiv 2210.17323) and AWQ (arXiv 2306.00978): the activations stay
    float. The contracting size of every layer it applies to must be a
    multiple of 128. Matmuls without a weight (attention's ``q . k`` and
    ``p . v``) stay float.
    """
    rhs = Quantizer(IntNumerics(bits=4), AbsMax(), Tiled(tile_size=128))
    return DotGeneralConfig(fwd=MatmulConfig(rhs=rhs))


def fp8() -> DotGeneralConfig:
    """FP8 training: E4M3 forward, E5M2 gradients, per-tensor current scaling.

    The recipe of Micikevicius et al., "FP8 Formats for Deep Learning"
    (arXiv 2209.05433), and Transformer Engine: forward operands E4M3, the
    incoming gradient E5M2 (the other backward operand E4M3, never both
    E5M2), one scale per tensor from its own absmax. On Hopper-class GPUs each
    matmul becomes a cuBLASLt FP8 GEMM; the gradient matmuls accumulate in
    full float32 (Transformer Engine's split accumulation), the forward in
    the tensor cores' fast mode.
    """
    fwd = MatmulConfig(lhs=_fp8("float8_e4m3fn"), rhs=_fp8("float8_e4m3fn"))
    bwd = MatmulConfig(
        lhs=_fp8("float8_e5m2"), rhs=_fp8("float8_e4m3fn"), accumulator="float32"
    )
    return DotGeneralConfig(fwd=fwd, dlhs=bwd, drhs=bwd)


def fp8_delayed() -> DotGeneralConfig:
    """FP8 training with delayed scaling: E4M3 forward, E5M2 gradients.

    Per-tensor scales from an amax history of the last 1024 steps (the
    largest amax, no margin), as production FP8 training does (Transformer
    Engine; Flax's ``Fp8DirectDotGeneralOp``, whose scales and histories
    this reproduces). The backward matmuls reuse the forward's E4M3
    operands. Stateful: use it through ``qbits.flax.quantize`` or
    ``qbits.nnx.quantize`` (or pass ``state=`` to ``qbits.dot_general``),
    and write the new state back each step. Follows "FP8 Formats for Deep Learning"
    (arXiv 2209.05433).
    """
    e4m3 = Quantizer(Fp8Numerics("float8_e4m3fn"), provider=DelayedScaling())
    e5m2 = Quantizer(Fp8Numerics("float8_e5m2"), provider=DelayedScaling())
    fwd = MatmulConfig(lhs=e4m3, rhs=e4m3)
    bwd = MatmulConfig(lhs=e5m2, rhs=e4m3, accumulator="float32", use_fwd_quant=True)
    return DotGeneralConfig(fwd=fwd, dlhs=bwd, drhs=bwd)


def fp8_blockwise() -> DotGeneralConfig:
    """FP8 training with fine-grained scales, as DeepSeek-V3 was trained.

    Every operand E4M3 (fine-grained scales make E5M2 unnecessary for the
    gradients); activations and gradients scaled per 1 x 128 tile (one scale
    per row for each 128 elements of the contracting axis), weights per
    128 x 128 block; each scale from its block's own absmax. Real mode
    contracts each 128-wide slice of the contracting axis separately and
    sums the scaled partial products in float32: the accumulation promotion
    of DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437, section
    3.3). Every dimension of a layer it applies to must be a multiple of 128.
    Matmuls of two activations (attention's ``q . k`` and ``p . v``) have no
    weight: both operands are scaled per 1 x 128 tile (the activation
    quantizer), not per 128 x 128 block.
    """
    tiles = Quantizer(Fp8Numerics("float8_e4m3fn"), AbsMax(), Tiled(tile_size=128))
    blocks = Quantizer(
        Fp8Numerics("float8_e4m3fn"),
        AbsMax(),
        Tiled(tile_size=128, free_tile_size=128),
    )
    fwd = MatmulConfig(lhs=tiles, rhs=blocks)
    dlhs = MatmulConfig(lhs=tiles, rhs=blocks)  # g . w^T: w's blocks again
    drhs = MatmulConfig(lhs=tiles, rhs=tiles)  # x^T . g: 128 x 1 tiles along tokens
    return DotGeneralConfig(fwd=fwd, dlhs=dlhs, drhs=drhs)


def mxfp8() -> DotGeneralConfig:
    """MXFP8 in all three matmuls: tiles of 32 with E8M0 scales.

    OCP Microscaling v1.0 and Rouhani et al., "Microscaling Data Formats for
    Deep Learning" (arXiv 2310.10537): E4M3 elements forward, E5M2 for the
    incoming gradient, each tile of 32 along the contracting axis sharing a
    power-of-two scale (rounded up, so nothing clips).
    """
    e4m3 = mx_quantizer("float8_e4m3fn")
    fwd = MatmulConfig(lhs=e4m3, rhs=e4m3)
    bwd = MatmulConfig(lhs=mx_quantizer("float8_e5m2"), rhs=e4m3)
    return DotGeneralConfig(fwd=fwd, dlhs=bwd, drhs=bwd)


def mxfp4() -> DotGeneralConfig:
    """MXFP4 forward matmul (E2M1 elements, tiles of 32, E8M0 scales).

    The 4-bit MX format of OCP Microscaling v1.0 (arXiv 2310.10537) for both
    forward operands; the backward stays float, as 4-bit gradients need more
    than rounding to train well.
    """
    e2m1 = mx_quantizer("float4_e2m1fn")
    return DotGeneralConfig(fwd=MatmulConfig(lhs=e2m1, rhs=e2m1))


def w4g128_asym() -> DotGeneralConfig:
    """uint4 weights with zero points, groups of 128, float activations.

    Asymmetric weight-only quantization as GPTQ (arXiv 2210.17323) and AWQ
    (arXiv 2306.00978) deploy it: each group of 128 weights along the
    contracting axis maps its [min, max] onto the codes 0..15 with a scale
    and an integer zero point, so a group whose values are shifted away from
    zero uses all 16 levels. Stored: packed uint4 codes, a float32 scale and
    an int16 zero point per group (4.375 bits per weight). The contracting
    size of every layer it applies to must be a multiple of 128. With
    ``calibration: mse`` (``MseSearch``) each group's range is searched
    instead: shrunk around its midpoint to the least squared error.
    Matmuls without a weight (attention's ``q . k`` and ``p . v``) stay
    float.
    """
    rhs = Quantizer(UintNumerics(bits=4), AbsMax(), Tiled(tile_size=128))
    return DotGeneralConfig(fwd=MatmulConfig(rhs=rhs))


def nf4() -> DotGeneralConfig:
    """NF4 weights in blocks of 64, float activations: QLoRA's storage format.

    The 4-bit NormalFloat of Dettmers et al., "QLoRA: Efficient Finetuning
    of Quantized LLMs" (arXiv 2305.14314): each block of 64 weights along
    the contracting axis is divided by its absmax and rounded to the nearest
    of 16 levels spaced as the quantiles of a normal distribution. Stored:
    packed 4-bit codes and a float32 absmax per block (4.5 bits per weight;
    :func:`nf4_dq` stores the absmax double-quantized, as QLoRA does). The
    contracting size of every layer it applies to must be a multiple of 64.
    Matmuls without a weight (attention's ``q . k`` and ``p . v``) stay
    float.
    """
    rhs = Quantizer(Nf4Numerics(), AbsMax(), Tiled(tile_size=64))
    return DotGeneralConfig(fwd=MatmulConfig(rhs=rhs))


def nf4_dq() -> DotGeneralConfig:
    """NF4 weights with double-quantized absmax: QLoRA's storage, 4.127 bits.

    :func:`nf4` (blocks of 64 along the contracting axis) with the double
    quantization of QLoRA (arXiv 2305.14314; ``double_quant: true``,
    bitsandbytes' ``bnb_4bit_use_double_quant``): the weights are rounded with their
    blocks' float32 absmax, then the absmax minus their mean are stored as
    uint8 codes on bitsandbytes' dynamic map, in groups of 256 with a
    float32 absmax each, and the mean as one float32. Stored: packed 4-bit
    codes, a byte per block, 4 bytes per 256 blocks (4.127 bits per weight).
    Each weight differs from :func:`nf4`'s by at most its block's scale
    error, below 0.71% of the largest distance of a block's absmax from
    their mean. Matmuls without a weight stay float.
    """
    rhs = Quantizer(Nf4Numerics(), AbsMax(), Tiled(tile_size=64), double_quant=True)
    return DotGeneralConfig(fwd=MatmulConfig(rhs=rhs))


def w1_58a8() -> DotGeneralConfig:
    """BitNet b1.58: ternary weights with an absmean scale, int8 activations.

    Ma et al., "The Era of 1-bit LLMs: All Large Language Models are in 1.58
    Bits" (arXiv 2402.17764): each weight matrix is divided by the mean of
    its magnitudes (one scale per tensor) and rounded and clipped to -1, 0
    or +1 (``TernaryNumerics``, ``calibration: absmean``); the activations
    (the lhs) are int8 with one absmax scale per token. Training keeps float
    weights and gradients: the forward matmul is quantized, the gradient is
    straight-through, the backward float. Stored: 4-bit codes (packed two
    per byte) and one float32 per weight matrix.

    Matmuls of two activations (attention's ``q . k`` and ``p . v``) have
    no weight: they run int8 x int8 (the activation quantizer on both
    operands).
    """
    rhs = Quantizer(TernaryNumerics(), AbsMean(), PerTensor())
    return DotGeneralConfig(fwd=MatmulConfig(lhs=_int(8), rhs=rhs))


def _nvfp4() -> Quantizer:
    """E2M1 in blocks of 16, E4M3 block scales under a float32 tensor scale."""
    return Quantizer(FpNumerics("float4_e2m1fn"), AbsMax(), Tiled(tile_size=16), "e4m3")


def nvfp4() -> DotGeneralConfig:
    """NVFP4 forward matmul, weights and activations; float backward.

    NVIDIA's 4-bit float format of the Blackwell GPUs: E2M1 elements in
    blocks of 16 along the contracting axis, each block with an E4M3 scale,
    and a float32 scale per tensor (amax / (448 * 6)) under them, so that
    the block scales use E4M3's whole range (NVIDIA, "Pretraining Large
    Language Models with NVFP4", arXiv 2509.25149; ``scale_rounding=
    "e4m3"``). Both forward operands, each scaled
    from its own amax at every step (W4A4); the backward stays float. The
    contracting size of every layer it applies to must be a multiple of 16.
    The tensor scale is floored at 2^-126 (float32's smallest normal): below
    an amax of about 3.2e-35 the block scales no longer reach 448, at no
    measured cost in error.
    """
    return DotGeneralConfig(fwd=MatmulConfig(lhs=_nvfp4(), rhs=_nvfp4()))


def nvfp4_weight_only() -> DotGeneralConfig:
    """NVFP4 weights (blocks of 16, E4M3 scales, a tensor scale), float activations.

    The weight format of :func:`nvfp4` alone (arXiv 2509.25149): stored as
    packed E2M1 codes, one E4M3 byte per 16 weights and one float32 per
    tensor (4.5 bits per weight). Matmuls without a weight (attention's
    ``q . k`` and ``p . v``) stay float.
    """
    return DotGeneralConfig(fwd=MatmulConfig(rhs=_nvfp4()))


_PRESETS: dict[str, Callable[[], DotGeneralConfig]] = {
    f.__name__: f
    for f in (
        none,
        int8_fwd,
        int8,
        int4_fwd,
        w4a8,
        int4_weight_only,
        fp8,
        fp8_delayed,
        fp8_blockwise,
        mxfp8,
        mxfp4,
        w4g128_asym,
        nf4,
        nf4_dq,
        nvfp4,
        nvfp4_weight_only,
        w1_58a8,
    )
}


def names() -> tuple[str, ...]:
    """The names of all presets.

    Example:
      >>> "int8" in qbits.presets.names()
      True
    """
    return tuple(_PRESETS)


def check_name(name: object, path: str = "") -> str:
    """Returns ``name`` if it names a preset.

    Raises:
      ConfigError: Naming ``path``, for anything else.
    """
    if not isinstance(name, str) or name not in _PRESETS:
        raise ConfigError(path, name, "a preset name: " + ", ".join(_PRESETS))
    return name


def get(name: str) -> DotGeneralConfig:
    """The preset called ``name``.

    Args:
      name: One of :func:`names`.

    Returns:
      A :class:`~qbits.DotGeneralConfig`.

    Raises:
      ConfigError: For an unknown name.

    Example:
      >>> cfg = qbits.presets.get("int8_fwd")
      >>> cfg.fwd.rhs.numerics.bits, cfg.dlhs.is_identity
      (8, True)
    """
    return _PRESETS[check_name(name)]()


def describe(name: str) -> str:
    """What the preset is for and which paper or system it follows.

    Example:
      >>> qbits.presets.describe("fp8").splitlines()[0]
      'FP8 training: E4M3 forward, E5M2 gradients, per-tensor current scaling.'
    """
    return inspect.getdoc(_PRESETS[check_name(name)]) or ""
