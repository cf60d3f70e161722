"""Post-training quantization of the example LM: RTN, GPTQ, AWQ, rotation, SmoothQuant.

Trains the ``lm`` example model (``qbits train``'s default) in float32 with
:func:`qbits._experiments.train`, then quantizes its weights with
:func:`qbits.ptq.quantize_weights` on calibration windows of the training
text, per weight format and method, and reports the held-out loss over
float32's (the same eval windows as training). Weight-only formats: the
quantized weights are float values on their grids, so each row is the float
model on them. Every weight matmul of the model is quantized (attention
projections, MLP, head), per the config's default rule.

GPTQ + rotation rotates every quantized matmul's input channels by a
randomized Hadamard matrix first (weights offline, activations online).

W8A8 (``int8_fwd``: int8 weights per output channel, int8 activations per
token) is compared as RTN, SmoothQuant (alpha 0.5) and rotation, on the
trained model and on an outlier copy of it: the same function with
activation outlier channels. Trained LLMs have a few input channels of
their matmuls 10-100x larger than the rest, mostly made by the LayerNorm
gains before them (SmoothQuant, arXiv 2211.10438, Fig. 4); the small
example model has none. The copy makes them the same way: the gain and
bias of ``OUTLIERS`` channels of every LayerNorm are multiplied by
``FACTOR`` and the rows of the weights that read the norm's output divided
by it, which leaves the float model's outputs unchanged (checked: eval
loss within 1e-4 relative) and gives those channels of the q/k/v, fc1 and
head inputs a ``FACTOR`` times larger range.

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
from qbits._experiments import _data as data_lib
from qbits._experiments import build_model, spec, train


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
METHODS = {
    "rtn": {"method": "rtn"},
    "gptq": {"method": "gptq"},
    "awq": {"method": "awq"},
    "gptq+rot": {"method": "gptq", "rotate": True, "key": jax.random.key(7)},
}
LABELS = {"rtn": "RTN", "gptq": "GPTQ", "awq": "AWQ", "gptq+rot": "GPTQ + rotation"}
W8A8 = {
    "RTN": {"method": "rtn"},
    "SmoothQuant": {"method": "rtn", "smooth": 0.5},
    "rotation": {"method": "rtn", "rotate": True, "key": jax.random.key(7)},
}
OUTLIERS, FACTOR = 4, 30.0


def with_outliers(params, seed: int):
    """The same function with activation outlier channels (see the docstring)."""
    width = params["norm"]["scale"][...].shape[0]
    channels = jax.random.choice(
        jax.random.key(20_000 + seed), width, (OUTLIERS,), replace=False
    )
    gain = jnp.ones(width).at[channels].set(FACTOR)
    readers = {"norm1": ("attn/query", "attn/key", "attn/value"), "norm2": ("mlp/fc1",)}
    new = jax.tree.map(lambda x: x, params)  # a copy of the tree

    def scale(node, names, by):
        for name in names:
            node[name][...] = node[name][...] * by

    def divide_rows(node, path):
        for part in path.split("/"):
            node = node[part]
        k = node["kernel"][...]
        node["kernel"][...] = k / gain.reshape(-1, *([1] * (k.ndim - 1)))

    for i in new["blocks"]:
        block = new["blocks"][i]
        for norm, consumers in readers.items():
            scale(block[norm], ("scale", "bias"), gain)
            for path in consumers:
                divide_rows(block, path)
    scale(new["norm"], ("scale", "bias"), gain)
    divide_rows(new, "head")
    return new


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

    def eval_loss_of(model):
        @jax.jit
        def eval_loss(params):
            def one(x, y):
                logits, _ = model(params, x)  # as_function: (output, new state)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y)

            return jnp.mean(jax.vmap(one)(eval_x, eval_y))

        return eval_loss

    eval_loss = eval_loss_of(fn)
    base = float(eval_loss(params))
    rows = [{"seed": seed, "format": "float32", "method": "", "eval_loss": base,
             "ratio": 1.0, "train_eval_loss": result.eval_loss}]  # fmt: skip
    for name, config in FORMATS.items():
        tic = time.perf_counter()
        stats = ptq.collect_stats(fn, params, calibration, config=config)
        collect = time.perf_counter() - tic
        for method, kwargs in METHODS.items():
            tic = time.perf_counter()
            out = ptq.quantize_weights(fn, params, None, config, stats=stats, **kwargs)
            seconds = time.perf_counter() - tic + collect  # statistics included
            # Weight-only: the float model on the new weights; with a rotation,
            # its activations rotated online and nothing else quantized (the
            # formats' default rule would also quantize attention's K and V).
            weights_only = out._replace(config=qbits.QuantConfig())
            model = weights_only.function(fn) if out.transforms else fn
            loss = float(
                (eval_loss_of(model) if out.transforms else eval_loss)(out.params)
            )
            rows.append({
                "seed": seed, "format": name, "method": method, "eval_loss": loss,
                "ratio": loss / base, "seconds": seconds, "layers": len(out.layers),
                "error_vs_rtn": sum(r.error for r in out.layers)
                / max(sum(r.error_rtn for r in out.layers), 1e-30),
            })  # fmt: skip
            print(f"seed {seed} {name:15s} {method:8s} eval/f32 {loss / base:.4f} "
                  f"({seconds:.1f}s, {len(out.layers)} layers)")  # fmt: skip
    rows += w8a8(seed, fn, params, calibration, eval_loss_of, base)
    return rows


def w8a8(seed, fn, params, calibration, eval_loss_of, base) -> list[dict]:
    """W8A8 RTN vs SmoothQuant vs rotation, on the model and its outlier copy."""
    rows = []
    for model_name, p in (
        ("trained", params),
        ("outliers", with_outliers(params, seed)),
    ):
        float_loss = float(eval_loss_of(fn)(p))
        stats = ptq.collect_stats(fn, p, calibration, config="int8_fwd")
        absmax = jnp.concatenate([jnp.ravel(ms.stats.absmax) for ms in stats.values()])
        spread = float(jnp.max(absmax) / jnp.median(absmax))
        rows.append({"seed": seed, "format": "w8a8", "model": model_name,
                     "method": "float32", "eval_loss": float_loss,
                     "ratio": float_loss / base,
                     "absmax_over_median": spread})  # fmt: skip
        for method, kwargs in W8A8.items():
            out = ptq.quantize_weights(fn, p, None, "int8_fwd", stats=stats, **kwargs)
            loss = float(eval_loss_of(out.function(fn))(out.params))
            rows.append({"seed": seed, "format": "w8a8", "model": model_name,
                         "method": method, "eval_loss": loss,
                         "ratio": loss / base})  # fmt: skip
            print(f"seed {seed} w8a8 {model_name:8s} {method:12s} eval/f32 "
                  f"{loss / base:.4f}")  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in rows})
    header = "| format | " + " | ".join(LABELS[m] for m in METHODS) + " |"
    rule = "|---|" + "---|" * len(METHODS)
    lines = [
        "Eval loss / float32 of the example LM after post-training weight "
        f"quantization (seeds {', '.join(map(str, seeds))}; calibration-set "
        "output error vs RTN, summed over layers, in brackets)",
        "",
        header,
        rule,
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
        header,
        rule,
    ]
    for name in FORMATS:
        cells = []
        for method in METHODS:
            got = [r["seconds"] for r in rows
                   if r["format"] == name and r["method"] == method]  # fmt: skip
            cells.append(f"{sum(got) / len(got):.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    w8 = [r for r in rows if r["format"] == "w8a8"]
    spread = {m: [r["absmax_over_median"] for r in w8
                  if r["model"] == m and r["method"] == "float32"]
              for m in ("trained", "outliers")}  # fmt: skip
    lines += [
        "",
        f"W8A8 (int8_fwd) eval loss / float32, seeds {', '.join(map(str, seeds))}: "
        f"the trained model, and its outlier copy ({OUTLIERS} channels of every "
        f"LayerNorm x{FACTOR:g}, the weights reading them /{FACTOR:g}: the same "
        "float function). Largest input-channel max |x| over the median: "
        + ", ".join(f"{m} {max(v):.0f}x" for m, v in spread.items()),
        "",
        "| model | float32 | " + " | ".join(W8A8) + " |",
        "|---|---|" + "---|" * len(W8A8),
    ]
    for model in ("trained", "outliers"):
        cells = []
        for method in ("float32", *W8A8):
            got = [r for r in w8 if r["model"] == model and r["method"] == method]
            cells.append(", ".join(f"{r['ratio']:.4f}" for r in got))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
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
