"""qbits: quantized matmuls for JAX and Flax, forward and backward.

The public API, layer by layer (each layer imports only the ones above it
in this file):

1. numerics: :class:`IntNumerics`, :class:`FpNumerics` (:mod:`qbits.numerics`:
   the base class, no quantization, fp8, NF4, ternary, stochastic rounding).
2. calibration: :class:`AbsMax`, :class:`AbsMean`, :class:`Percentile`,
   :class:`MseSearch`, :class:`ConstantBound` (base :class:`Calibration`);
   scale providers (scales from state): :class:`DelayedScaling`,
   :class:`LearnedScale` (base :class:`ScaleProvider`); granularity:
   :class:`PerTensor`, :class:`PerChannel`, :class:`Tiled` (base
   :class:`Granularity`).
3. :class:`QTensor` and :class:`Quantizer`. :mod:`qbits.scaled`:
   :class:`~qbits.scaled.ScaledArray` and :func:`~qbits.scaled.scalify`,
   scale propagation through a whole graph (float16 and fp8 training
   without overflow).
4. config: :class:`DotGeneralConfig` and :class:`MatmulConfig` (one
   quantized matmul and a dot_general's three), :func:`load_config` (the
   one way to read a config: a file, YAML text, data, a preset name),
   :mod:`qbits.config` (:func:`~qbits.config.dump`), :mod:`presets`,
   per-layer rules (:class:`QuantConfig`, :class:`Rule`); bad configs raise
   :class:`ConfigError`.
5. ops: :func:`dot_general`, :func:`einsum` and :func:`conv_general_dilated`
   (and :func:`qbits.ops.ragged_dot`, grouped matmuls), each taking a
   config, a preset name or a YAML file; one quantized-matmul core (scale
   state through ``state=``; :mod:`qbits.ops`); :func:`freeze_ranges` turns
   collected activation ranges into static bounds.
6. The engine (:mod:`qbits.transform`): :func:`quantize` quantizes every
   matmul of any function or model (custom layers, raw einsums and ``@``,
   scanned blocks) by per-layer rules, as a function transformation;
   :func:`layer_table` lists them, :func:`init_state` gives their scale
   state, :func:`collect_ranges` their activation ranges.
7. Flax: :mod:`qbits.flax` (linen) and :mod:`qbits.nnx` quantize unmodified
   models by per-layer rules, through the engine.
8. :mod:`qbits.serving`: convert trained params to stored int8/int4/fp8
   weights, serve them, save/restore, size report.
"""

from qbits import config, numerics, ops, scaled
from qbits._calibration import (
    AbsMax,
    AbsMean,
    Calibration,
    ConstantBound,
    MseSearch,
    Percentile,
)
from qbits._errors import ConfigError, InvalidArgumentError
from qbits._granularity import Granularity, PerChannel, PerTensor, Tiled
from qbits._providers import DelayedScaling, LearnedScale, ScaleProvider
from qbits._quantizer import Quantizer
from qbits._tensor import QTensor
from qbits.config import QuantConfig, Rule, presets
from qbits.numerics import FpNumerics, IntNumerics
from qbits.ops import (
    DotGeneralConfig,
    MatmulConfig,
    conv_general_dilated,
    dot_general,
    einsum,
)

from qbits.config._refs import load_config  # isort: skip
from qbits._ranges import freeze_ranges  # isort: skip
from qbits.transform._transform import init_state, layer_table, quantize  # isort: skip  (layer 6)
from qbits.transform._observing import collect_ranges  # isort: skip
from qbits import flax, nnx  # isort: skip  (layer 7 imports everything above)
from qbits import serving  # isort: skip  (layer 8)

__version__ = "0.1.0"

# Where the function defined in a private module is documented.
load_config.__module__ = "qbits"

__all__ = [
    "AbsMax",
    "AbsMean",
    "Calibration",
    "ConfigError",
    "ConstantBound",
    "DelayedScaling",
    "DotGeneralConfig",
    "FpNumerics",
    "Granularity",
    "IntNumerics",
    "InvalidArgumentError",
    "LearnedScale",
    "MatmulConfig",
    "MseSearch",
    "PerChannel",
    "PerTensor",
    "Percentile",
    "QTensor",
    "QuantConfig",
    "Quantizer",
    "Rule",
    "ScaleProvider",
    "Tiled",
    "collect_ranges",
    "config",
    "conv_general_dilated",
    "dot_general",
    "einsum",
    "flax",
    "freeze_ranges",
    "init_state",
    "layer_table",
    "load_config",
    "nnx",
    "numerics",
    "ops",
    "presets",
    "quantize",
    "scaled",
    "serving",
]
