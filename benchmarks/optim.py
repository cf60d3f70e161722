"""8-bit and 4-bit optimizer states against float32 AdamW on the example LM.

For each optimizer of ``qbits train --optimizer`` (``adamw``: optax's,
float32 moments; ``adamw8bit``, ``adamw4bit``: :func:`qbits.optim.adamw`,
bitsandbytes' 8-bit dynamic states in blocks of 256 and torchao's 4-bit
states in blocks of 128):

- the bytes of the optimizer state of the ``lm`` example model (``qbits
  train``'s default), summed over the arrays of ``nnx.Optimizer``'s state;
- the time of one optimizer update alone (``tx.update`` jitted over the
  model's parameters) and of one whole training step (gradient, update,
  new parameters), medians of 20, the optimizers taking turns;
- the held-out loss after training the model in float32 (no matmul
  quantization) with that optimizer, same data, schedule and seed, for
  each seed;
- ``--part long``: the held-out losses again at another length (``--steps``,
  default the LM's 800), added to the existing ``--json``;
- ``--part drift``: why the quantized states differ (:func:`drift`): their
  Adam step against float32 states fed the same gradients, added to it.

Run: nice python benchmarks/optim.py --json OUT.json --md OUT.md
     [--seeds 0 1] [--steps N] [--part all|timing|loss|long|drift]
     [--runs RUNS.jsonl] [--drift-steps 100]

``--part timing`` (or ``loss``) measures only that part and keeps the
other part's numbers from the existing ``--json`` file. ``--runs FILE``
keeps every finished training run as a line of FILE and reuses the runs
already there (same optimizer, seed and steps); ``--train OPTIMIZER SEED``
only adds that run to FILE, so that runs can go on side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import qbits.optim
from qbits._experiments import build_model, spec, train
from qbits._experiments._train import (
    OPTIMIZERS,
    loss_and_accuracy,
    make_optimizer,
    train_batch,
)
from qbits.optim import QuantizedMoment
from qbits.optim._blockwise import dequantize as _dequantize


def _is_moment(x) -> bool:
    return isinstance(x, QuantizedMoment)


NAMES = {
    "adamw": "AdamW, float32 states",
    "adamw8bit": "AdamW, 8-bit dynamic states",
    "adamw4bit": "AdamW, 4-bit states",
}


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def state_bytes(name: str) -> tuple[int, int]:
    """Bytes of ``nnx.Optimizer``'s state for the LM, and of its parameters."""
    model, _ = build_model(spec("lm"), 0)
    optimizer = nnx.Optimizer(model, make_optimizer(name, 1e-3), wrt=nnx.Param)
    return (
        _nbytes(nnx.state(optimizer, nnx.OptState)),
        _nbytes(nnx.state(model, nnx.Param)),
    )


def timings(reps: int = 20) -> dict[str, dict[str, float]]:
    """Median ms of one update alone and of one training step, per optimizer.

    The optimizers take turns within each repetition, so a change in the
    machine's load falls on all of them alike.
    """
    model_spec = spec("lm")
    model, data = build_model(model_spec, 0)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.as_pure(params)
    x, y = train_batch(model_spec, data, 0, 0)
    fns = {}
    for name in OPTIMIZERS:
        tx = make_optimizer(name, 1e-3)

        @jax.jit
        def update(grads, opt_state, params, tx=tx):
            with jax.numpy_dtype_promotion("standard"):
                return tx.update(grads, opt_state, params)

        @jax.jit
        def step(params, opt_state, tx=tx):
            def loss(p):
                return loss_and_accuracy(nnx.merge(graphdef, p)(x), y)[0]

            grads = jax.grad(loss)(params)
            with jax.numpy_dtype_promotion("standard"):
                updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        fns[name] = (update, step, tx.init(params))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    for update, step, opt_state in fns.values():  # compile
        jax.block_until_ready(
            (update(grads, opt_state, params), step(params, opt_state))
        )
    times = {n: {"update": [], "step": []} for n in fns}
    for _ in range(reps):
        for name, (update, step, opt_state) in fns.items():
            tic = time.perf_counter()
            jax.block_until_ready(update(grads, opt_state, params))
            times[name]["update"].append(time.perf_counter() - tic)
            tic = time.perf_counter()
            jax.block_until_ready(step(params, opt_state))
            times[name]["step"].append(time.perf_counter() - tic)
    return {
        n: {f"{k}_ms": 1e3 * statistics.median(v) for k, v in t.items()}
        for n, t in times.items()
    }


DRIFT = {
    "adamw8bit": {"state_bits": 8},
    "adamw8bit, stochastic rounding": {"state_bits": 8, "stochastic_rounding": True},
}


def drift(options: dict, steps: int, schedule_steps: int) -> list[dict]:
    """The quantized states' Adam step against float32 states on one trajectory.

    The LM trains (seed 0, the schedule of a ``schedule_steps`` run) with
    AdamW over quantized states; a float32 ``scale_by_adam`` is fed the same
    gradients. Every 25 steps: the norm of the quantized run's Adam
    direction (before weight decay and learning rate) over the float one's,
    their cosine, and the median over the quantized leaves' elements of
    ``sqrt(nu_quantized / nu_float)`` (the second moment's share in it).
    """
    model_spec = spec("lm")
    model, data = build_model(model_spec, 0)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.as_pure(params)
    lr = optax.warmup_cosine_decay_schedule(
        0.0, model_spec.lr, schedule_steps // 10, schedule_steps, model_spec.lr / 10
    )
    quantized = qbits.optim.quantize_states(optax.scale_by_adam(), **options)
    exact = optax.scale_by_adam()
    states = (quantized.init(params), exact.init(params))

    def moment(tree, name):  # the float32 values of the quantized leaves
        leaves = jax.tree.leaves(getattr(tree, name), is_leaf=_is_moment)
        return [_dequantize(v) if _is_moment(v) else None for v in leaves]

    @jax.jit
    def step(params, states, i):
        x, y = train_batch(model_spec, data, 0, i)
        grads = jax.grad(lambda p: loss_and_accuracy(nnx.merge(graphdef, p)(x), y)[0])(
            params
        )
        with jax.numpy_dtype_promotion("standard"):
            u, q_state = quantized.update(grads, states[0], params)
            v, f_state = exact.update(grads, states[1], params)
        flat = [
            jnp.concatenate([a.ravel() for a in jax.tree.leaves(t)]) for t in (u, v)
        ]
        norms = [jnp.linalg.norm(a) for a in flat]
        nu_q, nu_f = moment(q_state.inner, "nu"), jax.tree.leaves(f_state.nu)
        ratio = jnp.concatenate(
            [
                jnp.sqrt(a / b).ravel()
                for a, b in zip(nu_q, nu_f, strict=True)
                if a is not None
            ]
        )
        stats = {"update_norm_ratio": norms[0] / norms[1],
                 "cosine": flat[0] @ flat[1] / (norms[0] * norms[1]),
                 "sqrt_nu_ratio_median": jnp.nanmedian(ratio)}  # fmt: skip
        new = jax.tree.map(lambda p, a: p - lr(i) * (a + 0.01 * p), params, u)
        return new, (q_state, f_state), stats

    out = []
    for i in range(steps):
        params, states, stats = step(params, states, jnp.asarray(i, jnp.int32))
        if (i + 1) % 25 == 0:
            out.append({"step": i + 1, **{k: float(v) for k, v in stats.items()}})
            print(out[-1], flush=True)
    return out


def run(name: str, seed: int, steps: int, runs: str | None) -> dict:
    """The example LM trained with optimizer ``name``: a line of ``runs``."""
    lines = []
    if runs is not None and os.path.exists(runs):
        with open(runs) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    for line in lines:
        if (line["optimizer"], line["seed"], line["steps"]) == (name, seed, steps):
            return line["run"]
    model_spec = dataclasses.replace(spec("lm"), optimizer=name)
    result = train(model_spec, None, seed=seed, steps=steps)
    out = {
        "seed": seed,
        "eval_loss": result.eval_loss,
        "train_loss": result.train_loss,
        "run_step_ms": 1e3 * result.step_seconds,
        "seconds": result.seconds,
        "eval_curve": result.eval_curve,
    }
    print(f"{name} seed {seed}: eval loss {result.eval_loss:.4f} "
          f"({result.seconds:.0f}s, step {1e3 * result.step_seconds:.1f} ms)",
          flush=True)  # fmt: skip
    if runs is not None:
        with open(runs, "a") as f:
            line = {"optimizer": name, "seed": seed, "steps": steps, "run": out}
            f.write(json.dumps(line) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--part", choices=("all", "timing", "loss", "drift", "long"), default="all"
    )
    parser.add_argument("--runs", default=None)
    parser.add_argument("--drift-steps", type=int, default=100)
    parser.add_argument("--train", nargs=2, default=None)
    args = parser.parse_args()
    base_spec = spec("lm")
    steps = base_spec.steps if args.steps is None else args.steps
    if args.part in ("drift", "long"):
        with open(args.json) as f:
            old = json.load(f)
        if args.part == "drift":
            old["drift"] = {"steps_of_schedule": steps, "runs": {}}
            for name, options in DRIFT.items():
                old["drift"]["runs"][name] = drift(options, args.drift_steps, steps)
        else:  # the training runs again at another length (--steps)
            runs = {n: [run(n, s, steps, args.runs) for s in args.seeds]
                    for n in OPTIMIZERS}  # fmt: skip
            old["long"] = {"steps": steps, "seeds": args.seeds, "runs": runs}
        with open(args.json, "w") as f:
            json.dump(old, f, indent=1)
        with open(args.md, "w") as f:
            f.write(markdown(old) + "\n")
        return
    if args.train is not None:
        run(args.train[0], int(args.train[1]), steps, args.runs)
        return
    old: dict = {"meta": {}, "rows": []}
    if args.part != "all":
        with open(args.json) as f:
            old = json.load(f)
    old_rows = {r["optimizer"]: r for r in old["rows"]}
    if args.part == "loss":
        timed = {n: {k: old_rows[n][k] for k in ("update_ms", "step_ms")}
                 for n in OPTIMIZERS}  # fmt: skip
    else:
        timed = timings()
        print(json.dumps(timed), flush=True)
    rows = []
    for name in OPTIMIZERS:
        state, param_bytes = state_bytes(name)
        row = {"optimizer": name, "state_bytes": state, "param_bytes": param_bytes,
               **timed[name], "runs": []}  # fmt: skip
        rows.append(row)
        if args.part == "timing":
            row["runs"] = old_rows[name]["runs"]
            continue
        row["runs"] = [run(name, seed, steps, args.runs) for seed in args.seeds]
    base = rows[0]
    for row in rows:
        row["state_ratio"] = row["state_bytes"] / base["state_bytes"]
        row["update_ratio"] = row["update_ms"] / base["update_ms"]
        row["step_ratio"] = row["step_ms"] / base["step_ms"]
        row["eval_ratios"] = [
            r["eval_loss"] / b["eval_loss"]
            for r, b in zip(row["runs"], base["runs"], strict=True)
        ]
    if args.part == "timing":
        steps, args.seeds = old["meta"]["steps"], old["meta"]["seeds"]
    meta = {
        "model": "lm (qbits train's default), float32 matmuls",
        "steps": steps,
        "seeds": args.seeds,
        "machine": f"{platform.machine()} CPU, {jax.device_count()} device(s); "
        "2 cores shared with other work",
        "jax": jax.__version__,
    }
    with open(args.json, "w") as f:
        data = {"meta": meta, "rows": rows}
        data |= {k: old[k] for k in ("long", "drift") if k in old}
        json.dump(data, f, indent=1)
    with open(args.md, "w") as f:
        f.write(markdown(data) + "\n")
    print(markdown(data))


def markdown(data: dict) -> str:
    """The tables of ``data`` (the JSON this script writes)."""
    meta, rows = data["meta"], data["rows"]
    seeds = ", ".join(str(s) for s in meta["seeds"])
    lines = [
        f"Example LM, {meta['steps']} steps, seeds {seeds}; ratios against "
        "float32 AdamW.",
        "",
        "| optimizer | state bytes | state / f32 | update ms (ratio) "
        "| train step ms (ratio) | eval loss per seed | eval / f32 (worst) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        losses = " / ".join(f"{r['eval_loss']:.4f}" for r in row["runs"])
        worst = max(row["eval_ratios"], key=lambda v: abs(v - 1))
        lines.append(
            f"| {NAMES[row['optimizer']]} | {row['state_bytes']:,} "
            f"| {row['state_ratio']:.3f}x | {row['update_ms']:.2f} "
            f"({row['update_ratio']:.2f}x) | {row['step_ms']:.1f} "
            f"({row['step_ratio']:.2f}x) "
            f"| {losses} | {worst:.4f} |"
        )
    if "long" in data:
        long = data["long"]
        base = long["runs"]["adamw"]
        lines += ["", f"{long['steps']} steps (the LM's default), seeds "
                  + ", ".join(str(s) for s in long["seeds"]) + ":", "",
                  "| optimizer | eval loss per seed | eval / f32 |",
                  "|---|---|---|"]  # fmt: skip
        for name, got in long["runs"].items():
            losses = " / ".join(f"{r['eval_loss']:.4f}" for r in got)
            ratios = " / ".join(
                f"{r['eval_loss'] / b['eval_loss']:.4f}"
                for r, b in zip(got, base, strict=True)
            )
            lines.append(f"| {NAMES[name]} | {losses} | {ratios} |")
    if "drift" in data:
        drift = data["drift"]
        lines += ["", "Quantized states against float32 states fed the same "
                  f"gradients ({drift['steps_of_schedule']}-step schedule, seed 0):",
                  "", "| states | step | Adam step norm / f32 | cosine "
                  "| median sqrt(nu / nu f32) |", "|---|---|---|---|---|"]  # fmt: skip
        for name, points in drift["runs"].items():
            for p in points:
                lines.append(
                    f"| {name} | {p['step']} | {p['update_norm_ratio']:.4f} "
                    f"| {p['cosine']:.4f} | {p['sqrt_nu_ratio_median']:.4f} |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
