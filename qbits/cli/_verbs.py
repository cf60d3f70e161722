"""``qbits train``, ``qbits sweep`` and ``qbits ptq``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from typing import Any

from qbits.cli._common import (
    UsageError,
    _config,
    _log,
    _out_dir,
    _print_rows,
    _progress,
    _wrote,
)


def _run_sweep(
    args: argparse.Namespace, sweep: Any, out: pathlib.Path, **kwargs: Any
) -> list[dict[str, Any]]:
    """Runs ``sweep`` into ``out`` as the training commands' options say.

    (``--rerun``, ``-q``, ``--diagnostics``: ``_run_options`` of the parser),
    with a progress bar over each run's steps.
    """
    from qbits._experiments import run_sweep

    with _progress(args.quiet, sweep.steps) as progress:
        return run_sweep(
            sweep,
            out,
            resume=not args.rerun,
            progress=progress,
            log=_log(args.quiet),
            diagnostics=args.diagnostics,
            **kwargs,
        )


def _train(args: argparse.Namespace) -> int:
    from qbits._experiments import Entry, Sweep, config_bits, spec

    name, config, origin = _config(args.config)
    model_spec = dataclasses.replace(
        spec(args.model, args.size), optimizer=args.optimizer
    )
    steps = model_spec.steps if args.steps is None else args.steps
    tail = "" if args.optimizer == "adamw" else f"-{args.optimizer}"
    out = _out_dir(args.out or f"runs/train/{args.model}-{name}{tail}-seed{args.seed}")
    entries = [Entry("float32", None, 32.0)]
    if config is not None:
        entries.append(Entry(name, config, config_bits(config), **origin))
    sweep = Sweep(
        f"qbits train {args.model} {name}",
        model_spec,
        steps,
        (args.seed,),
        tuple(entries),
        "float32",
        args.size,
    )
    if not args.quiet:
        print(
            f"training {args.model} ({args.size}) for {steps} steps, seed "
            f"{args.seed}: float32 and {name}"
            + ("" if args.optimizer == "adamw" else f", {args.optimizer} states")
            + f"; results in {out}"
        )
    runs = _run_sweep(args, sweep, out, save_params="float32")
    from qbits._experiments import summarize

    rows = summarize(runs, "float32")
    metric = "char accuracy" if args.model == "lm" else "accuracy"
    _print_rows(rows, metric)
    print(
        f"\n{_wrote(out, len(runs))}; the float32 params in "
        f"{out}/runs/float32__seed{args.seed}.params (for qbits ptq CONFIG --run "
        f"{out})"
    )
    return 0


def _ptq(args: argparse.Namespace) -> int:
    import qbits
    from qbits._experiments import post_train

    name, config, _ = _config(args.config)
    if config is None:
        raise UsageError("config 'none' quantizes nothing: give a weight format")
    # Made once the results are in: a failed command leaves nothing behind.
    out = pathlib.Path(args.out or os.path.join(args.run_dir, f"ptq-{name}"))
    if not args.quiet:
        print(
            f"post-training quantization of {args.run_dir} with {name} by "
            f"{', '.join(args.method)} ({args.calibration} calibration batches); "
            f"results in {out}"
        )
    try:
        rows = post_train(
            args.run_dir,
            config,
            out,
            name=name,
            methods=args.method,
            calibration=args.calibration,
            seed=args.seed,
            progress=not args.quiet and sys.stderr.isatty(),
            log=_log(args.quiet),
        )
    except qbits.InvalidArgumentError as e:
        if e.argument != "out":
            raise
        raise UsageError(f"--out {out}: {e.why}; expected {e.allowed}") from None
    _print_rows(rows, "accuracy")
    print(f"\n{_wrote(out)}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from qbits._experiments import load_sweep

    sweep = load_sweep(args.file)
    out = _out_dir(args.out or f"runs/{sweep.name}")
    total = len(sweep.entries) * len(sweep.seeds)
    if not args.quiet:
        print(
            f"sweep {sweep.name!r}: {len(sweep.entries)} configs x "
            f"{len(sweep.seeds)} seeds = {total} runs of {sweep.spec.model} "
            f"({sweep.size}, {sweep.steps} steps); results in {out}"
        )
    runs = _run_sweep(args, sweep, out)
    if not args.quiet:
        print((out / "results.md").read_text(encoding="utf-8"))
    print(_wrote(out, len(runs)))
    return 0
