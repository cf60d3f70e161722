"""Mixed precision under a bit budget on the example LM (post-training).

Reads float32 runs of ``qbits train none --seed S --out DIR`` (the example
transformer, 800 steps), runs :func:`qbits.diagnostics.search_budget` on 4
calibration batches of its training text (steps training never reaches)
with the candidates W4A8 (int4 per-channel weights), W4A8 with int4 weights
in groups of 128, W8A8 (``int8_fwd``) and float32, and evaluates on the
held-out batches training evaluated on:

- ``float32``, uniform ``w4a8`` (int8 x int8 attention einsums) and the
  hand-picked ``w4a8_sensitive8`` (examples/w4a8_sensitive8.yaml: fc2 and
  the attention einsums at int8, from the diagnostics sweep);
- the searched config at the stored-weight bytes of ``w4a8_sensitive8``
  (the budget of "w4a8 + the sensitive layers at 8 bits"), its YAML read
  back and evaluated again (it must give the same loss);
- the searched config at a few more budgets (mean bits per weight), from
  the same measurements (:meth:`~qbits.diagnostics.BudgetSearch.with_budget`).

Bytes are the stored weights of the 13 weight matmuls (codes, scales; the
embedding and norms are the same in every row and left out). Matmuls
without a weight (the attention einsums) store nothing: every quantized
row runs them int8 x int8.

Quantization-aware training: ``--qat ROWS.json`` trains the example LM with
the first run's searched config (800 steps) for each of ``--qat-seeds``;
``--qat-rows ROWS.json`` attaches those rows to the report (with no
``--runs``: to the existing ``--json``).

Run: python benchmarks/budget_search.py --runs DIR0 DIR1 --json OUT.json --md OUT.md
     python benchmarks/budget_search.py --json OUT.json --qat ROWS.json
     python benchmarks/budget_search.py --json OUT.json --md OUT.md --qat-rows ROWS.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import tempfile
import time

import jax

import qbits
from qbits._experiments import search_trained

W4G128A8 = qbits.DotGeneralConfig(
    fwd=qbits.MatmulConfig(
        lhs=qbits.presets.get("w4a8").fwd.lhs,
        rhs=qbits.Quantizer(
            qbits.IntNumerics(bits=4), qbits.AbsMax(), qbits.Tiled(tile_size=128)
        ),
    )
)
CANDIDATES = {
    "w4a8": "w4a8",
    "w4g128a8": W4G128A8,
    "int8_fwd": "int8_fwd",
    "float": None,
}
SENSITIVE8 = os.path.join(
    os.path.dirname(__file__), "..", "examples", "w4a8_sensitive8.yaml"
)
BITS = (4.25, 4.5, 5.0, 6.0, 8.0)


def _bytes(found, pick) -> int:
    """Stored bytes of a choice ``pick(path) -> label``."""
    return sum(found.costs[p][pick(p)] for p in found.costs)


def one_seed(run_dir: str, batches: int) -> dict:
    cpu = time.process_time()
    found, evaluate = search_trained(run_dir, CANDIDATES, 32.0, batches=batches)
    cpu = time.process_time() - cpu
    total = sum(found.elements.values())
    fc2 = re.compile(r"blocks/\d+/mlp/fc2")
    budget = _bytes(found, lambda p: "int8_fwd" if fc2.fullmatch(p) else "w4a8")
    rows = []

    def row(name, config, nbytes, expected=None, **extra):
        tic = time.perf_counter()
        loss = evaluate(config)
        rows.append({
            "config": name, "bits": 8 * nbytes / total, "bytes": nbytes,
            "eval_loss": loss, "expected_loss": expected,
            "eval_seconds": time.perf_counter() - tic, **extra,
        })  # fmt: skip
        print(f"{run_dir} {name}: {loss:.4f} ({8 * nbytes / total:.3f} bits)")

    row("float32", None, _bytes(found, lambda p: "float"))
    row("w4a8", "w4a8", _bytes(found, lambda p: "w4a8"))
    row("w4a8_sensitive8", qbits.load_config(SENSITIVE8), budget)
    searched = found.with_budget(budget, "bytes")
    row("searched", searched.config, searched.nbytes, searched.expected_loss,
        choices=searched.choices)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "searched.yaml")
        qbits.config.dump(searched.config, path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        row("searched (from YAML)", qbits.load_config(path), searched.nbytes)
    for bits in BITS:
        at = found.with_budget(bits, "bits")
        row(f"searched {bits:g} bits", at.config, at.nbytes, at.expected_loss,
            choices=at.choices)  # fmt: skip
    return {
        "run": os.path.basename(os.path.normpath(run_dir)),
        "search_seconds": found.seconds,
        "search_cpu_seconds": cpu,
        "calibration_batches": batches,
        "matmuls": len(found.costs),
        "reference_loss": found.reference_loss,
        "sensitivity": found.sensitivity,
        "costs": found.costs,
        "yaml": text,
        "rows": rows,
    }


def qat(yaml_text: str, seeds: list[int]) -> list[dict]:
    """Trains the example LM with the searched config (800 steps) per seed."""
    from qbits._experiments import spec, train

    config = qbits.load_config(yaml_text)
    rows = []
    for seed in seeds:
        result = train(spec("lm"), config, seed=seed)
        rows.append({"seed": seed, "eval_loss": result.eval_loss,
                     "seconds": result.seconds})  # fmt: skip
        print(f"QAT seed {seed}: {result.eval_loss:.4f} ({result.seconds:.0f} s)")
    return rows


def markdown(result: dict) -> str:
    seeds = result["seeds"]
    names = [r["config"] for r in seeds[0]["rows"]]
    lines = [
        "Mixed precision under a bit budget, post-training, example LM "
        f"({len(seeds)} float32 runs; {result['machine']}). Held-out loss / "
        "float32 per run; bits: mean stored bits per weight of the "
        f"{seeds[0]['matmuls']} weight matmuls (scales included)",
        "",
        "| config | bits | bytes | eval / float32 | expected / float32 |",
        "|---|---|---|---|---|",
    ]
    for i, name in enumerate(names):
        rs = [s["rows"][i] for s in seeds]
        fl = [s["rows"][0]["eval_loss"] for s in seeds]
        ratio = ", ".join(
            f"{r['eval_loss'] / f:.4f}" for r, f in zip(rs, fl, strict=True)
        )
        exp = ", ".join(
            f"{r['expected_loss'] / s['reference_loss']:.4f}"
            for r, s in zip(rs, seeds, strict=True)
            if r["expected_loss"] is not None
        )
        bits = ", ".join(dict.fromkeys(f"{r['bits']:.3f}" for r in rs))
        nbytes = ", ".join(dict.fromkeys(str(r["bytes"]) for r in rs))
        lines.append(f"| {name} | {bits} | {nbytes} | {ratio} | {exp or '—'} |")
    secs = ", ".join(
        f"{s['search_seconds']:.0f} ({s['search_cpu_seconds']:.0f})" for s in seeds
    )
    lines += [
        "",
        f"Search time per run, s wall (s CPU): {secs}; {result['load']}",
        "",
    ]
    if "qat" in result:
        lines += [
            "Quantization-aware training with the first run's searched config "
            "(800 steps): held-out loss per seed: "
            + ", ".join(
                f"seed {r['seed']} {r['eval_loss']:.4f}" for r in result["qat"]["rows"]
            ),
            "",
        ]
    for s in seeds:
        name = os.path.basename(os.path.normpath(s["run"]))  # not where it lay
        lines.append(f"Searched choice (run {name}):")
        lines += ["", "```yaml", s["yaml"].rstrip(), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument(
        "--qat", metavar="JSON",
        help="train the first run's searched config per seed (QAT) and write "
        "its rows to JSON (then pass --qat-rows JSON to a PTQ run)",
    )  # fmt: skip
    parser.add_argument("--qat-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--qat-rows", metavar="JSON", help="QAT rows to report")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    if args.qat:  # --json: a PTQ result (its first run's searched config)
        with open(args.json, encoding="utf-8") as f:
            yaml_text = json.load(f)["seeds"][0]["yaml"]
        rows = {"yaml": yaml_text, "rows": qat(yaml_text, args.qat_seeds)}
        with open(args.qat, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
        return
    if not args.runs:  # --json: a PTQ result; attach --qat-rows, write --md
        with open(args.json, encoding="utf-8") as f:
            result = json.load(f)
    else:
        result = _measure(args.runs, args.batches)
    if args.qat_rows:
        with open(args.qat_rows, encoding="utf-8") as f:
            result["qat"] = json.load(f)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    with open(args.md, "w", encoding="utf-8") as f:
        f.write(markdown(result) + "\n")
    print(markdown(result))


def _measure(runs: list[str], batches: int) -> dict:
    return {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, "
        f"jax {jax.__version__}",
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "candidates": list(CANDIDATES),
        "load": f"load average {os.getloadavg()[0]:.1f} at the start (a shared "
        "machine: wall time is several times the CPU time)",
        "seeds": [one_seed(run, batches) for run in runs],
    }


if __name__ == "__main__":
    main()
