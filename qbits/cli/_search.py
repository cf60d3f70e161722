"""``qbits search``: per-layer formats of a trained model under a bit budget."""

from __future__ import annotations

import argparse
import os
import pathlib

from qbits.cli._common import UsageError


def _search(args: argparse.Namespace) -> int:
    import qbits
    from qbits._experiments import search_trained

    candidates = {}
    for arg in args.candidates:
        path = pathlib.Path(arg)
        if arg in ("none", "float") and not path.is_file():
            candidates["float"] = None
        elif arg in qbits.presets.names() and not path.is_file():
            candidates[arg] = arg
        elif path.suffix in (".yaml", ".yml") or path.exists():
            candidates[path.stem] = qbits.load_config(path, qbits.DotGeneralConfig)
        else:
            raise UsageError(
                f"unknown candidate {arg!r}: expected a YAML file of one matmul "
                "config, a preset name or none: " + ", ".join(qbits.presets.names())
            )
    tag = f"{args.budget:g}{'bits' if args.unit == 'bits' else 'B'}"
    out = pathlib.Path(args.out or os.path.join(args.run_dir, f"search-{tag}.yaml"))
    if not args.quiet:
        print(
            f"searching {', '.join(candidates)} per weight matmul of {args.run_dir} "
            f"under {args.budget:g} {args.unit} ({args.batches} calibration "
            f"batches); config in {out}"
        )
    found, evaluate = search_trained(
        args.run_dir,
        candidates,
        args.budget,
        unit=args.unit,
        batches=args.batches,
        seed=args.seed,
    )
    held_out = evaluate(found.config)
    report = (
        found.report()
        + f"\n\nHeld-out loss: {held_out:.4f} (float32: {evaluate(None):.4f}).\n"
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        qbits.config.dump(found.config, out)
        out.with_suffix(".md").write_text(report, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--out {out}: {e.strerror or e}") from None
    print(report)
    md = out.with_suffix(".md")
    print(f"wrote {out} (train with it: qbits train {out}) and {md}")
    return 0
