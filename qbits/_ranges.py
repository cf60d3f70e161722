"""Static ranges: freeze activation ranges measured on data into a config.

Post-training calibration in two steps:

1. Collect: run the float model on a few batches and record, per weight
   matmul, the largest magnitude of its activation operand (the one a
   config's ``fwd.lhs`` quantizes), the max over all batches:
   :func:`qbits.collect_ranges` returns ``{matmul path: absmax}`` (for a
   linen model, of ``model.apply``; for an nnx model, of
   :func:`qbits.nnx.as_function`).
2. Freeze: :func:`freeze_ranges` turns the ranges into a
   :class:`~qbits.QuantConfig` in which each measured layer's
   ``fwd.lhs`` calibration is ``ConstantBound(range)``: the forward then
   uses the frozen bound whatever the batch holds (larger values clip). The
   result is a plain config: it serialises to YAML with the ranges in it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from qbits._calibration import ConstantBound
from qbits._errors import InvalidArgumentError
from qbits.config import QuantConfig, Rule, _as_quant_config

__all__ = ["freeze_ranges"]


def freeze_ranges(config: Any, ranges: Mapping[str, float]) -> QuantConfig:
    """The config with each measured layer's activation bound frozen.

    Args:
      config: The per-layer rules (a :class:`~qbits.QuantConfig`, a
        :class:`~qbits.DotGeneralConfig` or a preset name for every layer).
      ranges: ``{matmul path: absmax}`` from :func:`qbits.collect_ranges`.

    Returns:
      A :class:`~qbits.QuantConfig` with one rule per measured layer
      (its exact path, first) whose config is the layer's own with
      ``fwd.lhs.calibration = ConstantBound(absmax)``, then the original
      rules. Layers that stay float are left out.

    Raises:
      InvalidArgumentError: For a range that is not a finite positive number
        (a layer whose input was all zeros or held NaN), naming the layer.

    Example:
      >>> frozen = qbits.freeze_ranges("int8_fwd", {"fc1": 3.5})
      >>> frozen.resolve("fc1").config.fwd.lhs.calibration
      ConstantBound(value=3.5)
      >>> frozen.resolve("fc2").name
      'int8_fwd'
    """
    qc = _as_quant_config("freeze_ranges", config, allow_none=True)
    if not isinstance(ranges, Mapping):
        raise InvalidArgumentError(
            "freeze_ranges", "ranges", ranges, "a mapping {layer path: absmax}"
        )
    rules = []
    for path, value in ranges.items():
        v = float(value)
        if not (math.isfinite(v) and v > 0):
            raise InvalidArgumentError(
                "freeze_ranges",
                f"ranges[{path!r}]",
                value,
                "a finite positive absmax (the layer's input was all zeros "
                "or not finite on the calibration data)",
            )
        cfg = qc.resolve(path).config
        if cfg is None or cfg.fwd.lhs.numerics.get_dtype() is None:
            continue
        lhs = dataclasses.replace(cfg.fwd.lhs, calibration=ConstantBound(v))
        fwd = dataclasses.replace(cfg.fwd, lhs=lhs)
        rules.append(Rule(re.escape(path), dataclasses.replace(cfg, fwd=fwd)))
    return QuantConfig(tuple(rules) + tuple(qc.rules), qc.default)
