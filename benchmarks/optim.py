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
  each seed.

Run: nice python benchmarks/optim.py --json OUT.json --md OUT.md
     [--seeds 0 1] [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from qbits._experiments import build_model, spec, train
from qbits._experiments._train import (
    OPTIMIZERS,
    loss_and_accuracy,
    make_optimizer,
    train_batch,
)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    base_spec = spec("lm")
    steps = base_spec.steps if args.steps is None else args.steps
    timed = timings()
    print(json.dumps(timed), flush=True)
    rows = []
    for name in OPTIMIZERS:
        state, param_bytes = state_bytes(name)
        row = {"optimizer": name, "state_bytes": state, "param_bytes": param_bytes,
               **timed[name], "runs": []}  # fmt: skip
        for seed in args.seeds:
            model_spec = dataclasses.replace(base_spec, optimizer=name)
            result = train(model_spec, None, seed=seed, steps=steps)
            row["runs"].append(
                {
                    "seed": seed,
                    "eval_loss": result.eval_loss,
                    "train_loss": result.train_loss,
                    "run_step_ms": 1e3 * result.step_seconds,
                    "seconds": result.seconds,
                }
            )
            print(f"{name} seed {seed}: eval loss {result.eval_loss:.4f} "
                  f"({result.seconds:.0f}s, step {1e3 * result.step_seconds:.1f} ms)",
                  flush=True)  # fmt: skip
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["state_ratio"] = row["state_bytes"] / base["state_bytes"]
        row["update_ratio"] = row["update_ms"] / base["update_ms"]
        row["step_ratio"] = row["step_ms"] / base["step_ms"]
        row["eval_ratios"] = [
            r["eval_loss"] / b["eval_loss"]
            for r, b in zip(row["runs"], base["runs"], strict=True)
        ]
    meta = {
        "model": "lm (qbits train's default), float32 matmuls",
        "steps": steps,
        "seeds": args.seeds,
        "machine": f"{platform.machine()} CPU, {jax.device_count()} device(s); "
        "2 cores shared with other work",
        "jax": jax.__version__,
    }
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    seeds = ", ".join(str(s) for s in args.seeds)
    lines = [
        f"Example LM, {steps} steps, seeds {seeds}; ratios against float32 AdamW.",
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
    with open(args.md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
