"""Which weights :func:`~qbits.ptq.quantize_weights` quantizes, checked first.

Each weight matmul whose rule quantizes its weight (``fwd.rhs``) reads the
weight from a parameter, and several may read the same one: a weight used
twice (``x @ w + relu(x @ w)``: matmuls ``w`` and ``w#2``). Each reads it
whole, as it is or rearranged (:func:`~._layout.check_rearranged`), and a
parameter's entries lie on one grid: the matmuls that read it in the same
layout are one :class:`Weight`, quantized once on the statistics of all
of them merged (``H = sum X^T X`` over the uses: the output error of
every use) and served by one stored weight. Two that read it in other
layouts, or with other weight quantizers, are refused: no weight lies on
both grids. Matmuls whose rule keeps the weight float read the quantized
parameter as it is (as a tied embedding's lookup does).

Before any method runs, :func:`check_inputs` checks every weight's
statistics and values (NaN or inf would read as a perfect layer, or as a
Hessian that needs more damping), :func:`check_some` that there is a
weight to quantize, and :func:`check_alone` that a transformed weight is
read by its matmuls only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import InvalidArgumentError
from qbits._quantizer import Quantizer
from qbits.config import QuantConfig
from qbits.ops import DotGeneralConfig
from qbits.ptq._collect import MatmulStats
from qbits.ptq._layout import check_rearranged
from qbits.ptq._stats import InputStats

__all__ = ["Weight", "check_alone", "check_inputs", "check_some", "plan"]


@dataclasses.dataclass
class Weight:
    """One weight to quantize: the matmuls that read it, their rules, their stats.

    Attributes:
      uses: The matmuls, in program order: they read the parameter in the
        same layout.
      configs: Each use's config (their forward weight quantizers are
        ``quantizer``).
      leaf: The parameter's index among the flattened parameters.
      param: The parameter's key path (``jax.tree_util.keystr``).
      quantizer: The weight quantizer.
      stats: The uses' statistics, merged.
    """

    uses: list[MatmulStats]
    configs: list[DotGeneralConfig]
    leaf: int
    param: str
    quantizer: Quantizer
    stats: InputStats

    @property
    def ms(self) -> MatmulStats:
        """The first use: the layout of all."""
        return self.uses[0]

    @property
    def paths(self) -> tuple[str, ...]:
        """The uses' paths."""
        return tuple(ms.path for ms in self.uses)


def _layout(ms: MatmulStats) -> tuple[Any, ...]:
    return (ms.shape, ms.contracting, ms.batch, ms.free, ms.layers, ms.grouped)


def _same_layout(a: MatmulStats, b: MatmulStats) -> bool:
    if _layout(a) != _layout(b):
        return False
    if a.index is None or b.index is None:
        return a.index is None and b.index is None
    return np.array_equal(a.index, b.index)


def plan(
    owner: str,
    stats: Mapping[str, MatmulStats],
    quant: QuantConfig,
    params: list[Any],
    where: Mapping[str, int],
) -> list[Weight]:
    """The weights to quantize, each once, in the order of their first use.

    Args:
      owner: Named in errors.
      stats: The statistics (:func:`~qbits.ptq.collect_stats`).
      quant: The rules.
      params: The flattened parameters.
      where: ``{key path: index in params}``.

    Raises:
      InvalidArgumentError: For a double-quantized weight quantizer, for a
        parameter read by two quantized matmuls in
        other layouts or with other weight quantizers (naming both), and
        for a weight the model reads from its parameter other than whole and
        rearranged (a broadcast, a slice).
    """
    weights: list[Weight] = []
    for ms in stats.values():
        cfg = quant.resolve(ms.path).config
        if cfg is None or cfg.fwd.rhs.numerics.is_identity:
            continue  # float, or the activations only: the weight is kept
        if cfg.fwd.rhs.double_quant:
            raise InvalidArgumentError(
                owner, "config", f"double_quant=True for {ms.path!r}",
                "a weight quantizer without double_quant ('nf4', not 'nf4_dq')",
                why="the methods choose codes for the float32 scales they "
                "compute; quantizing those scales after would change them "
                "(not yet modelled: qbits.lora and serving store nf4_dq)",
            )  # fmt: skip
        name = jax.tree_util.keystr(ms.keys)
        if name not in where:
            raise InvalidArgumentError(
                owner, "stats", f"the statistics of {ms.path!r}",
                "statistics that qbits.ptq.collect_stats collected from fn and "
                "these params",
                why=f"params has no parameter {name}",
            )  # fmt: skip
        leaf = where[name]
        size = int(np.size(params[leaf]))
        if ms.index is not None:
            check_rearranged(owner, ms.path, name, ms.index, size)
        for w in weights:  # each reads the whole parameter (check_rearranged)
            if w.leaf != leaf:
                continue
            if not _same_layout(w.ms, ms):
                raise _two_layouts(owner, w.ms.path, ms.path, name)
            if w.quantizer != cfg.fwd.rhs:
                raise _two_grids(owner, w.ms.path, ms.path, name)
            w.uses.append(ms)
            w.configs.append(cfg)
            w.stats = w.stats.merge(ms.stats)
            break
        else:
            weights.append(Weight([ms], [cfg], leaf, name, cfg.fwd.rhs, ms.stats))
    return weights


def _two_grids(owner: str, a: str, b: str, param: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        owner, "config", f"other weight quantizers for {a!r} and {b!r}",
        "one weight quantizer (fwd.rhs) for the matmuls that read one "
        "parameter: one rule that matches both (a rule for a name also "
        "matches its later uses, name#2...), or a config without a weight "
        "quantizer for one of them (it then multiplies by the other's "
        "quantized weight)",
        why=f"{a!r} and {b!r} both multiply by parameter {param}, whose "
        "entries can lie on one grid only (one stored weight serves both)",
    )  # fmt: skip


def _two_layouts(owner: str, a: str, b: str, param: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        owner, "config", f"quantized weights for {a!r} and {b!r}",
        f"a weight quantizer for one of them only (e.g. qbits.Rule(re.escape("
        f"{b!r}), None) first: it then multiplies by the other's "
        f"quantized weight in float), or a model that reads the parameter "
        f"in one layout",
        why=f"both multiply by parameter {param}, {b!r} in another layout "
        "(transposed, reshaped or sliced otherwise): their statistics do "
        "not add, and no weight lies on the grids of both",
    )  # fmt: skip


def check_alone(owner: str, argument: str, value: Any, weights: list) -> None:
    """Raises unless each weight's matmuls are all that read its parameter.

    For a transform (SmoothQuant's scales, a rotation): the parameter then
    holds the transformed weight, which only the transformed matmuls undo.

    Args:
      owner: Named in errors.
      argument: The transform's argument (``"smooth"``, ``"rotate"``).
      value: Its value.
      weights: The :func:`plan`.
    """
    for w in weights:
        if all(ms.exclusive for ms in w.uses):
            continue
        raise InvalidArgumentError(
            owner, argument, value,
            f"no transform (smooth=None, rotate=False), or a config that "
            f"keeps {w.ms.path!r}'s weight float (e.g. qbits.Rule("
            f"re.escape({w.ms.path!r}), None) first)",
            why=f"parameter {w.param} is read by more than {w.ms.path!r} "
            "(another matmul, or a lookup: a tied embedding), which would "
            "read the transformed weight",
        )  # fmt: skip


def check_some(owner: str, config: Any, quant: QuantConfig, weights: list) -> None:
    """Raises unless there is a weight to quantize.

    Args:
      owner: Named in errors.
      config: The config as given (named in the error).
      quant: It as rules.
      weights: The :func:`plan`.
    """
    if weights:
        return
    name = config if isinstance(config, str) else quant.source or "the QuantConfig"
    raise InvalidArgumentError(
        owner, "config", name,
        "a config that quantizes the weight of at least one weight matmul "
        "in the forward pass (fwd.rhs: a weight format, such as "
        "'int4_weight_only', 'w4g128_asym', 'nf4' or 'int8_fwd')",
        why="it quantizes no weight of fn: every weight matmul's rule keeps "
        "its weight float, or fn has no weight matmul",
    )  # fmt: skip


def check_inputs(
    owner: str, argument: str, weights: list[Weight], params: list[Any]
) -> None:
    """Raises unless every weight's statistics and values are finite.

    Args:
      owner: Named in errors.
      argument: Where the statistics came from: ``"batches"`` or ``"stats"``.
      weights: The :func:`plan`.
      params: The flattened parameters.
    """
    for w in weights:  # on the host: a check per shape would compile
        for ms in w.uses:
            bad = [
                not np.isfinite(np.asarray(a)).all()
                for a in (ms.stats.absmax, ms.stats.abssum, ms.stats.hessian)
            ]
            if any(bad):
                raise _activations(owner, argument, ms, bad)
        values = np.asarray(w.ms.operand(params[w.leaf]))
        if jnp.issubdtype(values.dtype, jnp.floating):
            count = int(np.sum(~np.isfinite(values)))
            if count:
                raise InvalidArgumentError(
                    owner, "params", f"{w.param} with NaN or inf",
                    "finite float parameters",
                    why=f"{count} of the {values.size} entries that "
                    f"{w.ms.path!r} multiplies by are NaN or inf",
                )  # fmt: skip


def _activations(
    owner: str, argument: str, ms: MatmulStats, bad: list[bool]
) -> InvalidArgumentError:
    """The error for statistics that are not finite."""
    source = (
        "in the calibration batches"
        if argument == "batches"
        else "in the batches the statistics were collected on"
    )
    if bad[0] or bad[1]:  # the activations themselves (max may skip a NaN)
        why = (
            f"the activation that {ms.path!r} multiplies by its weight holds "
            f"NaN or inf {source}"
        )
    else:  # finite activations whose squares overflow
        top = float(np.max(np.asarray(ms.stats.absmax)))
        why = (
            f"the activation of {ms.path!r} reaches {top:.3g}: its Hessian "
            "X^T X (squares summed over the rows) overflows float32"
        )
    return InvalidArgumentError(
        owner, argument, f"non-finite statistics of {ms.path!r}",
        "calibration batches on which the float model's activations are "
        "finite (check fn(params, batch) in float)",
        why=why,
    )  # fmt: skip
