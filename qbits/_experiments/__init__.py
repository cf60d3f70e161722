"""Layer 9: example models, their training loop, ablation sweeps and reports.

What the ``qbits`` command runs (:mod:`qbits.cli`); the examples, benchmarks
and tests use it too. Not library API (private: names may change in any
release):

- :func:`spec`, :class:`ModelSpec`: the ``lm`` (a character-level decoder-only
  transformer on a corpus that ships with qbits) and ``mlp`` (a classifier on
  generated data) example models, at ``default`` or ``tiny`` size.
- :func:`train`: trains one with every matmul quantized as a per-layer
  config says (:func:`qbits.nnx.quantize`); :class:`RunResult`; with
  ``diagnostics=N``, every quantized operand measured every ``N`` steps
  (:mod:`qbits.diagnostics`; :func:`diagnose_batches` at initialisation).
- :func:`load_sweep`, :func:`run_sweep`: a grid of configs and seeds from a
  YAML file, one result file per run (a rerun skips finished runs), then the
  table and plots (:func:`write_report`).
- :func:`post_train`: post-training quantization of a saved float run, by
  several methods (:func:`qbits.ptq.quantize_weights`), and the same report.
- :func:`search_trained`: per-layer formats of a saved float run under a
  bit budget (:func:`qbits.diagnostics.search_budget`, ``qbits search``).
- :func:`gpu_step`: training steps at GPU sizes (an LLM's MLP block, the
  example transformer), for the GPU benchmark and ``qbits inspect --target``;
  :data:`LM_RECIPES`: the transformer's GPU recipes (attention's einsums in
  bf16).
"""

from qbits._experiments._budget import search_trained
from qbits._experiments._gpu_steps import LM_RECIPES, gpu_step
from qbits._experiments._models import Classifier, ModelSpec, TransformerLM, spec
from qbits._experiments._ptq import post_train, ptq_trained
from qbits._experiments._report import summarize, write_report
from qbits._experiments._saved import load_trained
from qbits._experiments._scalify_mlp import train_scalify_mlp
from qbits._experiments._sweep import run_sweep
from qbits._experiments._sweep_file import (
    Entry,
    Sweep,
    SweepError,
    config_bits,
    load_sweep,
)
from qbits._experiments._train import (
    RunResult,
    build_model,
    diagnose_batches,
    sample_batch,
    train,
)

__all__ = [
    "LM_RECIPES",
    "Classifier",
    "Entry",
    "ModelSpec",
    "RunResult",
    "Sweep",
    "SweepError",
    "TransformerLM",
    "build_model",
    "config_bits",
    "diagnose_batches",
    "gpu_step",
    "load_sweep",
    "load_trained",
    "post_train",
    "ptq_trained",
    "run_sweep",
    "sample_batch",
    "search_trained",
    "spec",
    "summarize",
    "train",
    "train_scalify_mlp",
    "write_report",
]
