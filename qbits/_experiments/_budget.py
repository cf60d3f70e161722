"""Mixed precision under a bit budget for a trained example model (``qbits search``).

:func:`search_trained` reads the float32 params that ``qbits train`` saved,
runs :func:`qbits.diagnostics.search_budget` on calibration batches of the
training data (drawn from steps training never reaches, as ``qbits ptq``
draws them), and evaluates the chosen config on the held-out batches that
training evaluated on: post-training quantization. The config it writes is
also a training config (``qbits train searched.yaml``: quantization-aware
training with the searched formats).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

import qbits
from qbits import diagnostics
from qbits._errors import check_int
from qbits._experiments._models import spec as model_spec
from qbits._experiments._ptq import _CALIBRATION_STEP
from qbits._experiments._saved import load_trained
from qbits._experiments._train import eval_batches, loss_and_accuracy, train_batch

__all__ = ["held_out_loss", "search_trained"]

_OWNER = "qbits search"


def search_trained(
    run_dir: str | os.PathLike,
    candidates: Sequence[Any] | dict[str, Any],
    budget: float,
    *,
    unit: str = "bits",
    batches: int = 4,
    seed: int | None = None,
) -> tuple[Any, Any]:
    """Searches per-layer formats for a trained example model under a budget.

    Args:
      run_dir: The output folder of ``qbits train`` (float32 params saved).
      candidates: As for :func:`qbits.diagnostics.search_budget`.
      budget: Mean stored bits per weight, or bytes (``unit``).
      unit: ``"bits"`` or ``"bytes"``.
      batches: Calibration batches the sensitivities are measured on.
      seed: Which saved run, if ``run_dir`` holds several.

    Returns:
      ``(search, evaluate)``: the :class:`~qbits.diagnostics.BudgetSearch`
      (its loss measured on the calibration batches) and
      ``evaluate(config) -> held-out loss`` for any config on the same
      model (the held-out batches training evaluated on).

    Example:
      A folder without saved params is refused:

      >>> import tempfile
      >>> from qbits._experiments._budget import search_trained
      >>> search_trained(tempfile.mkdtemp(), ["w4a8"], 5.0)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      qbits.InvalidArgumentError: qbits search: run_dir=... is not allowed...
    """
    check_int(_OWNER, "batches", batches, 1, 1 << 16)
    model, data, run = load_trained(run_dir, seed, owner=_OWNER)
    spec = model_spec(run["model"], run["size"])
    fn, params = qbits.nnx.as_function(model)

    def loss(params: Any, batch: Any) -> jax.Array:
        x, y = batch
        return loss_and_accuracy(fn(params, x)[0], y)[0]

    steps = range(_CALIBRATION_STEP, _CALIBRATION_STEP + batches)
    calibration = [train_batch(spec, data, run["seed"], s) for s in steps]
    found = diagnostics.search_budget(
        loss, params, calibration, candidates, budget, unit=unit
    )
    held_out = eval_batches(spec, data)

    def evaluate(config: Any) -> float:
        return held_out_loss(loss, params, held_out, config)

    return found, evaluate


def held_out_loss(loss: Any, params: Any, batches: Any, config: Any) -> float:
    """Mean ``loss(params, batch)`` over stacked batches, quantized by ``config``.

    Example:
      >>> from qbits._experiments._budget import held_out_loss
      >>> f = lambda p, b: jnp.mean((b[0] @ p["w"]) ** 2)
      >>> held_out_loss(f, {"w": jnp.ones((2, 2))}, (jnp.ones((3, 4, 2)),), None)
      4.0
    """
    q = qbits.quantize(loss, config, jax.random.key(0))
    run = jax.jit(
        lambda p, b: jax.lax.map(lambda xy: q(p, xy), b).mean(), donate_argnums=()
    )
    return float(run(params, jax.tree.map(jnp.asarray, batches)))
