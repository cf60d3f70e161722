r"""Running an ablation sweep: one result file per run, resumable.

Every run (one config, one seed) writes ``runs/<config>__seed<S>.json`` in
the output folder, atomically (a temporary file, then ``os.replace``), with
a fingerprint of everything that determines it. A rerun skips every run whose
file exists with the same fingerprint, so an interrupted sweep loses no
finished run and a changed setting reruns what it changes. The table and the
plots are rebuilt from the run files (:func:`qbits._experiments.write_report`).
A file that cannot be written (a full disk) leaves no partial file behind,
and the error names the file.

A config that fits no layer of the model (a tile size that does not divide
an axis) is found when the layer is first traced; the error names the file
and place of the config (``sweep.yaml: grid (fwd4_bwd8).fwd.rhs...``) and the
layer.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import qbits
from qbits._experiments._report import replace_file
from qbits._experiments._sweep_file import Sweep
from qbits._experiments._train import RunResult, train

__all__ = ["run_sweep"]


def write_json_atomic(path: pathlib.Path, data: Any) -> None:
    """Writes JSON to ``path`` via a temporary file and ``os.replace``.

    Raises:
      OSError: Naming ``path`` (e.g. a full disk); no temporary file is left.
    """
    replace_file(path, json.dumps(data, indent=1))


def params_dir(run_file: pathlib.Path) -> pathlib.Path:
    """Where the trained params of a run are saved: ``<run id>.params``."""
    return run_file.with_suffix(".params")


def save_model_params(directory: pathlib.Path, model: Any) -> None:
    """Saves an nnx model's params (:func:`qbits.nnx.as_function`'s) with Orbax.

    Replaces a checkpoint qbits wrote there before; a save that fails leaves
    nothing at ``directory``.
    """
    _, params = qbits.nnx.as_function(model)
    serving = qbits.serving.ServingParams(params, {}, ())
    qbits.serving.save(directory, serving, force=directory.exists())


def read_run(path: pathlib.Path) -> dict[str, Any] | None:
    """A run file's data, or ``None`` for a missing or unreadable file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "result" in data else None


def run_sweep(
    sweep: Sweep,
    out: str | os.PathLike,
    *,
    resume: bool = True,
    progress: Callable[[str, int, int], Callable[[int, float], None] | None]
    | None = None,
    log: Callable[[str], None] = lambda _: None,
    save_params: str | None = None,
    diagnostics: int = 0,
) -> list[dict[str, Any]]:
    r"""Runs every (config, seed) of ``sweep`` not yet finished, and reports.

    Args:
      sweep: From :func:`load_sweep`.
      out: The output folder (created); run files go to ``out/runs/``.
      resume: Skip runs whose file exists with the same fingerprint.
      progress: ``progress(run_id, index, total)`` returns the per-step
        callback of that run (e.g. a progress bar's update), or ``None``.
      log: Called with one line per run (ran or skipped).
      save_params: The name of an entry whose trained parameters are saved
        beside its run file, as ``runs/<run id>.params`` (an Orbax checkpoint
        of :func:`qbits.nnx.as_function`'s params, read back by
        :func:`post_train`); a finished run whose checkpoint is missing is
        run again.
      diagnostics: Measure every quantized operand every this many steps
        (:func:`train`'s ``diagnostics``; ``0``: never); the report then
        has their tables and plots. A finished quantized run measured
        otherwise is run again.

    Returns:
      The data of every run file, in sweep order.

    Raises:
      ConfigError: For a config that does not fit a layer of the model (found
        when the layer is first traced), naming the config's file and place
        (:meth:`Entry.locate`) and the layer.
      OSError: For a file that cannot be written, naming it (no partial file
        is left).

    Example:
      >>> import pathlib, tempfile
      >>> from qbits._experiments import load_sweep, run_sweep
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> text = "model: mlp\nsize: tiny\nsteps: 2\nconfigs: [none]"
      >>> _ = (d / "s.yaml").write_text(text)
      >>> runs = run_sweep(load_sweep(d / "s.yaml"), d / "out")
      >>> sorted(p.name for p in (d / "out").iterdir())  # one config: no bits plot
      ['loss_curves.png', 'results.csv', 'results.json', 'results.md', 'runs']
    """
    from qbits._experiments._report import write_report

    out = pathlib.Path(out)
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    todo = [(e, s) for e in sweep.entries for s in sweep.seeds]
    runs = []
    for index, (entry, seed) in enumerate(todo):
        run_id = sweep.run_id(entry, seed)
        path = runs_dir / f"{run_id}.json"
        fingerprint = sweep.fingerprint(entry, seed)
        done = read_run(path) if resume else None
        keep = entry.name == save_params
        saved = params_dir(path)
        if keep and not saved.is_dir():
            done = None
        if (
            diagnostics
            and entry.config is not None
            and done is not None
            and done.get("diagnostics") != diagnostics
        ):
            done = None  # measured otherwise (or not at all)
        if done is not None and done.get("fingerprint") == fingerprint:
            log(f"[{index + 1}/{len(todo)}] {run_id}: done before, skipped")
            runs.append(done)
            continue
        callback = progress(run_id, index, len(todo)) if progress else None
        trained: list[Any] = []
        try:
            result: RunResult = train(
                sweep.spec,
                entry.config,
                seed=seed,
                steps=sweep.steps,
                progress=callback,
                on_trained=trained.append if keep else None,
                diagnostics=diagnostics,
            )
        except qbits.ConfigError as e:  # found when a layer was traced
            raise entry.locate(e) from None
        if keep:
            save_model_params(saved, trained[0])
        data = {
            "name": entry.name,
            "seed": seed,
            "bits": entry.bits,
            "fingerprint": fingerprint,
            "model": sweep.spec.model,
            "size": sweep.size,
            "steps": sweep.steps,
            "optimizer": sweep.spec.optimizer,
            "config": None if entry.config is None else qbits.config.dump(entry.config),
            "result": result.as_dict(),
        }
        if diagnostics and entry.config is not None:
            data["diagnostics"] = diagnostics
        write_json_atomic(path, data)
        if result.unused_rules:
            log(f"warning: {entry.name}: {result.unused_rules}")
        log(
            f"[{index + 1}/{len(todo)}] {run_id}: eval loss {result.eval_loss:.4f} "
            f"({result.seconds:.0f} s)"
        )
        runs.append(data)
    write_report(sweep.name, runs, out, baseline=sweep.baseline)
    return runs
