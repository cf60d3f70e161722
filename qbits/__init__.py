"""qbits: quantized matmuls for JAX and Flax, forward and backward.

The public API, layer by layer (each layer imports only the ones above it
in this file):

1. numerics: :class:`IntNumerics`, :class:`FpNumerics`, :class:`Fp8Numerics`,
   :class:`NoNumerics`, :class:`UniformNoise`.
2. calibration: :class:`AbsMax`, :class:`Percentile`, :class:`MseSearch`,
   :class:`ConstantBound`; scale providers (scales from state,
   :mod:`providers`): :class:`DelayedScaling`, :class:`LearnedScale`
   (:mod:`lsq`); granularity: :class:`PerTensor`, :class:`PerChannel`,
   :class:`Tiled`.
3. :class:`QTensor` and :class:`Quantizer` (:func:`mx_quantizer`).
   :mod:`qbits.scaled`: :class:`~qbits.scaled.ScaledArray` and
   :func:`~qbits.scaled.scalify`, scale propagation through a whole graph
   (float16 and fp8 training without overflow).
4. ops: :func:`dot_general`, :func:`einsum` and :func:`conv_general_dilated`,
   configured by :class:`DotGeneralConfig` and :class:`MatmulConfig`, one
   quantized-matmul core (scale state through ``state=``).
5. config: YAML files (:func:`load_config`), :mod:`presets`, per-layer rules
   (:class:`QuantConfig`, :class:`Rule`); bad configs raise
   :class:`ConfigError`; :func:`freeze_ranges` (:mod:`ranges`) turns
   collected activation ranges into static bounds.
6. :func:`quantize` (:mod:`qbits.transform`, the engine): every matmul of
   any function or model (custom layers, raw einsums and ``@``, scanned
   blocks), quantized by per-layer rules as a function transformation;
   :func:`layer_table` lists them, :func:`init_state` gives their scale
   state, :func:`collect_ranges` their activation ranges.
7. Flax: :mod:`qbits.flax` (linen) and :mod:`qbits.nnx` quantize unmodified
   models by per-layer rules (``quantize``, ``layer_table``), through the
   engine.
8. :mod:`qbits.serving`: convert trained params to stored int8/int4/fp8
   weights, serve them, save/restore, size report.
"""

from qbits import (
    calibration,
    config,
    granularity,
    numerics,
    ops,
    providers,
    scaled,
    tensor,
)
from qbits._context import Context
from qbits._errors import ConfigError, InvalidArgumentError
from qbits._quantizer import Quantizer, mx_quantizer
from qbits.calibration import (
    AbsMax,
    Calibration,
    ConstantBound,
    MseSearch,
    Percentile,
)
from qbits.config import (
    LayerTable,
    QuantConfig,
    Rule,
    UnusedRuleWarning,
    load_config,
    presets,
)
from qbits.granularity import Granularity, PerChannel, PerTensor, Tiled
from qbits.numerics import (
    Fp8Numerics,
    FpNumerics,
    IntNumerics,
    NoNumerics,
    QNumerics,
    UniformNoise,
)
from qbits.ops import (
    ConvGeneralDilated,
    DotGeneral,
    DotGeneralConfig,
    Einsum,
    MatmulConfig,
)
from qbits.providers import DelayedScaling, LearnedScale, ScaleProvider
from qbits.tensor import QTensor

from qbits import lsq  # isort: skip  (layer 2)
from qbits.config._refs import conv_general_dilated, dot_general, einsum  # isort: skip
from qbits._ranges import freeze_ranges  # isort: skip
from qbits import transform  # isort: skip  (layer 6)
from qbits.transform import collect_ranges, init_state, layer_table, quantize  # isort: skip
from qbits import flax, nnx  # isort: skip  (layer 7 imports everything above)
from qbits import serving  # isort: skip  (layer 8)

__version__ = "0.1.0"

__all__ = [
    "AbsMax",
    "Calibration",
    "ConfigError",
    "ConstantBound",
    "Context",
    "ConvGeneralDilated",
    "DelayedScaling",
    "DotGeneral",
    "DotGeneralConfig",
    "Einsum",
    "Fp8Numerics",
    "FpNumerics",
    "Granularity",
    "IntNumerics",
    "InvalidArgumentError",
    "LayerTable",
    "LearnedScale",
    "MatmulConfig",
    "MseSearch",
    "NoNumerics",
    "PerChannel",
    "PerTensor",
    "Percentile",
    "QNumerics",
    "QTensor",
    "QuantConfig",
    "Quantizer",
    "Rule",
    "ScaleProvider",
    "Tiled",
    "UniformNoise",
    "UnusedRuleWarning",
    "calibration",
    "collect_ranges",
    "config",
    "conv_general_dilated",
    "dot_general",
    "einsum",
    "flax",
    "freeze_ranges",
    "granularity",
    "init_state",
    "layer_table",
    "load_config",
    "lsq",
    "mx_quantizer",
    "nnx",
    "numerics",
    "ops",
    "presets",
    "providers",
    "quantize",
    "scaled",
    "serving",
    "tensor",
    "transform",
]
