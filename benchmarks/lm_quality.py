"""Quality of the example LM under the main presets, relative to float32.

Runs the default sweep, ``examples/sweep_lm.yaml`` (the ``qbits train
--model lm`` model at its default size and steps; the same init, data order
and seed for every config, nothing tuned per config), into
``benchmarks/results/lm_presets/`` (table, run files, loss curves,
quality-vs-bits plot; finished runs are reused), then writes the final eval
loss of each config, its ratio to float32 and the target it must meet to
``benchmarks/results/lm_quality.{md,json}``.

Run: python benchmarks/lm_quality.py
"""

import json
import pathlib
import platform

import jax

from qbits._experiments import load_sweep, run_sweep, summarize

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
TARGETS = {"int8_fwd": 0.005, "int8": 0.01, "fp8": 0.01, "w4a8": 0.03}


def main():
    sweep = load_sweep(ROOT / "examples" / "sweep_lm.yaml")
    runs = run_sweep(sweep, OUT / "lm_presets", log=print)
    rows = summarize(runs, sweep.baseline)
    base = {r["seed"]: r["result"]["eval_loss"] for r in runs if r["name"] == "none"}
    for row in rows:
        row["ratio_per_seed"] = [
            r["result"]["eval_loss"] / base[r["seed"]]
            for r in runs
            if r["name"] == row["config"]
        ]
        target = TARGETS.get(row["config"])
        row["target"] = None if target is None else 1 + target
        row["met"] = None if target is None else bool(row["ratio"] <= 1 + target)
    s = sweep.spec
    meta = {
        "sweep": "examples/sweep_lm.yaml",
        "steps": sweep.steps,
        "seeds": list(sweep.seeds),
        "spec": s.__dict__,
        "jax": jax.__version__,
        "machine": f"{platform.machine()}, {jax.devices()[0].platform}, "
        "2 shared CPU cores",
    }
    text = json.dumps({"meta": meta, "rows": rows}, indent=1)
    (OUT / "lm_quality.json").write_text(text + "\n")
    lines = [
        "# Example LM: quality relative to float32",
        "",
        f"`qbits sweep examples/sweep_lm.yaml` (`python benchmarks/lm_quality.py`): "
        f"the `lm` model ({s.depth} pre-norm blocks, d_model {s.width}, "
        f"{s.heads} heads, context {s.context}, character-level on the shipped "
        f"corpus), {sweep.steps} steps of batch {s.batch}, AdamW (peak lr "
        f"{s.lr}, warm-up and cosine decay), seeds {list(sweep.seeds)} (loss: "
        "mean over seeds; ratio: of the means); the same "
        "init, data order and hyperparameters for every config. Every matmul "
        "is quantized (projections, MLP, both attention einsums, the head); "
        "the embedding is a gather and stays float. Eval: 8 x 32 held-out "
        "windows of the last 10% of the corpus.",
        "",
        "| config | train loss | eval loss | eval / float32 | per seed | target "
        "| met | char accuracy | time / run (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = "" if r["target"] is None else f"<= {r['target']:.3f}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        per_seed = ", ".join(f"{x:.4f}" for x in r["ratio_per_seed"])
        lines.append(
            f"| {r['config']} | {r['train_loss']:.4f} | {r['eval_loss']:.4f} | "
            f"{r['ratio']:.4f} | {per_seed} | {target} | {met} | "
            f"{r['eval_accuracy']:.3f} | "
            f"{r['seconds']:.0f} |"
        )
    lines += [
        "",
        f"Machine: {meta['machine']} (shared with other jobs, so the times "
        f"are rough); jax {jax.__version__}. Plots: "
        "`lm_presets/loss_curves.png`, `lm_presets/quality_vs_bits.png`.",
    ]
    (OUT / "lm_quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
