"""The trained float32 params that ``qbits train`` saves, read back.

``qbits train`` saves the float32 run's trained params beside its run file
(``runs/float32__seed<S>.params``: an Orbax checkpoint of
:func:`qbits.nnx.as_function`'s params, with checksums; see
:func:`~qbits._experiments.run_sweep`'s ``save_params``).
:func:`load_trained` rebuilds the model they belong to and loads them: what
``qbits ptq`` quantizes and ``qbits generate`` decodes with.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import flax.nnx as nnx

import qbits
from qbits._errors import InvalidArgumentError
from qbits._experiments._models import spec as model_spec
from qbits._experiments._sweep import read_run
from qbits._experiments._train import build_model

__all__ = ["load_trained"]


def _saved_run(
    owner: str, run_dir: pathlib.Path, seed: int | None
) -> tuple[dict, pathlib.Path]:
    """The data of the run whose params were saved in ``run_dir``, and their path."""
    found = sorted((run_dir / "runs").glob("*__seed*.params"))
    if seed is not None:
        found = [p for p in found if p.stem.endswith(f"__seed{seed}")]
    where = os.fspath(run_dir) + ("" if seed is None else f" (seed {seed})")
    if not found:
        raise InvalidArgumentError(
            owner,
            "run_dir",
            where,
            "the output folder of 'qbits train' (it saves the float32 params as "
            "runs/float32__seed<S>.params)",
            why="it holds no saved params",
        )
    if len(found) > 1:
        runs = ", ".join(p.stem for p in found)
        raise InvalidArgumentError(
            owner, "seed", seed, f"the seed of one of the saved runs: {runs}"
        )
    data = read_run(found[0].with_suffix(".json"))
    if data is None:
        raise InvalidArgumentError(
            owner,
            "run_dir",
            where,
            "a folder whose run finished: rerun 'qbits train'",
            why=f"runs/{found[0].with_suffix('.json').name} is missing or unreadable",
        )
    return data, found[0]


def load_trained(
    run_dir: str | os.PathLike,
    seed: int | None = None,
    *,
    owner: str = "qbits._experiments.load_trained",
) -> tuple[nnx.Module, Any, dict[str, Any]]:
    """The trained model whose params ``qbits train`` saved in ``run_dir``.

    Args:
      run_dir: The output folder of ``qbits train`` (or of a sweep run with
        ``save_params``).
      seed: Which saved run, when the folder holds several.
      owner: The caller named in errors.

    Returns:
      ``(model, data, run)``: the nnx model with the saved params, its
      dataset (as :func:`~qbits._experiments.build_model` gives it) and the
      run file's data (``model``, ``size``, ``seed``, ``result``...).

    Raises:
      InvalidArgumentError: For a folder without saved params (or with
        several and no ``seed``), a missing run file, or a checkpoint that
        does not fit the model (the restore error, naming the array).

    Example:
      >>> import tempfile
      >>> from qbits._experiments import load_trained
      >>> load_trained(tempfile.mkdtemp())  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      qbits.InvalidArgumentError: qbits._experiments.load_trained: run_dir=...
      is not allowed (it holds no saved params); expected the output folder
      of 'qbits train' (it saves the float32 params as
      runs/float32__seed<S>.params).
    """
    run, saved = _saved_run(owner, pathlib.Path(run_dir), seed)
    model, data = build_model(model_spec(run["model"], run["size"]), run["seed"])
    _, template = qbits.nnx.as_function(model)
    target = qbits.serving.ServingParams(template, {}, ())
    nnx.update(model, qbits.serving.restore(saved, target).params)
    return model, data, run
