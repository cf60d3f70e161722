"""Post-training quantization of the example transformer: RTN vs GPTQ vs AWQ.

Trains the ``lm`` example model (``qbits train``'s default) in float32 with
:func:`qbits.experiments.train`, then quantizes its weights with
:func:`qbits.ptq.quantize_weights` on calibration windows of the training
text, per weight format and method, and reports the held-out loss over
float32's (the same eval windows as training). Weight-only formats: the
quantized weights are float values on their grids, so each row is the float
model on them. Every weight matmul of the model is quantized (attention
projections, MLP, head), per the config's default rule.

Run: python benchmarks/ptq_lm.py --json OUT.json --md OUT.md [--seeds 0 1]
     [--steps N] [--calibration 16]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax

import qbits
from qbits import ptq
from qbits.experiments import _data as data_lib
from qbits.experiments import build_model, spec, train


def _weight_only(bits: int, group: int | None) -> qbits.QuantConfig:
    granularity = qbits.PerChannel() if group is None else qbits.Tiled(tile_size=group)
    rhs = qbits.Quantizer(qbits.IntNumerics(bits=bits), granularity=granularity)
    fwd = qbits.MatmulConfig(rhs=rhs, mode="fake")
    return qbits.QuantConfig(default=qbits.DotGeneralConfig(fwd=fwd))


FORMATS = {
    "w4 per channel": _weight_only(4, None),
    "w4 g32": _weight_only(4, 32),
    "w3 g32": _weight_only(3, 32),
    "w4 g128 asym": "w4g128_asym",
    "nf4 g64": "nf4",
    "nvfp4": "nvfp4_weight_only",
}
METHODS = ("rtn", "gptq", "awq")


def run(seed: int, steps: int | None, n_calibration: int) -> list[dict]:
    model_spec = spec("lm")
    kept = []
    result = train(model_spec, None, seed=seed, steps=steps, on_trained=kept.append)
    fn, params = qbits.nnx.as_function(kept[0])
    _, data = build_model(model_spec, seed)
    keys = jax.random.split(jax.random.key(10_000 + seed), n_calibration)
    calibration = [
        data_lib.char_batch(data.train, k, model_spec.batch, model_spec.context)[0]
        for k in keys
    ]
    eval_x, eval_y = data_lib.char_eval_batches(
        data.eval, model_spec.eval_batches, model_spec.batch, model_spec.context
    )

    @jax.jit
    def eval_loss(params):
        def one(x, y):
            logits, _ = fn(params, x)  # as_function: (output, new state)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

        return jnp.mean(jax.vmap(one)(eval_x, eval_y))

    base = float(eval_loss(params))
    rows = [{"seed": seed, "format": "float32", "method": "", "eval_loss": base,
             "ratio": 1.0, "train_eval_loss": result.eval_loss}]  # fmt: skip
    for name, config in FORMATS.items():
        tic = time.perf_counter()
        stats = ptq.collect_stats(fn, params, calibration, config=config)
        collect = time.perf_counter() - tic
        for method in METHODS:
            tic = time.perf_counter()
            out = ptq.quantize_weights(
                fn, params, None, config, stats=stats, method=method
            )
            seconds = time.perf_counter() - tic + collect  # statistics included
            loss = float(eval_loss(out.params))
            rows.append({
                "seed": seed, "format": name, "method": method, "eval_loss": loss,
                "ratio": loss / base, "seconds": seconds, "layers": len(out.layers),
                "error_vs_rtn": sum(r.error for r in out.layers)
                / max(sum(r.error_rtn for r in out.layers), 1e-30),
            })  # fmt: skip
            print(f"seed {seed} {name:15s} {method:5s} eval/f32 {loss / base:.4f} "
                  f"({seconds:.1f}s, {len(out.layers)} layers)")  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in rows})
    lines = [
        "Eval loss / float32 of the example LM after post-training weight "
        f"quantization (seeds {', '.join(map(str, seeds))}; calibration-set "
        "output error vs RTN, summed over layers, in brackets)",
        "",
        "| format | RTN | GPTQ | AWQ |",
        "|---|---|---|---|",
    ]
    for name in FORMATS:
        cells = []
        for method in METHODS:
            got = [r for r in rows if r["format"] == name and r["method"] == method]
            ratios = ", ".join(f"{r['ratio']:.4f}" for r in got)
            err = sum(r["error_vs_rtn"] for r in got) / len(got)
            cells.append(ratios if method == "rtn" else f"{ratios} ({err:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Seconds per model (13 weight matmuls; calibration statistics included; "
        "mean over seeds; CPU, machine-dependent)",
        "",
        "| format | RTN | GPTQ | AWQ |",
        "|---|---|---|---|",
    ]
    for name in FORMATS:
        cells = []
        for method in METHODS:
            got = [r["seconds"] for r in rows
                   if r["format"] == name and r["method"] == method]  # fmt: skip
            cells.append(f"{sum(got) / len(got):.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--calibration", type=int, default=16)
    args = parser.parse_args()
    rows = [r for s in args.seeds for r in run(s, args.steps, args.calibration)]
    with open(args.json, "w") as f:
        json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
    table = markdown(rows)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
