"""Training a small mixture-of-experts model: float32 vs int8 vs fp8 (CPU).

A character-level next-token model on the corpus that ships with qbits
(``qbits._experiments``): the previous ``CONTEXT`` characters, embedded and
projected, go through one mixture-of-experts block (a top-2 router over 4
experts whose two matmuls are one ``lax.ragged_dot`` each,
``qbits/_experiments/_moe.py``), then the output head. Trained with Adam for
``--steps`` steps per seed, the same batches for every config, every matmul
quantized by :func:`qbits.quantize` with the preset as its one rule (the
experts' ragged dots through :func:`qbits.ops.ragged_dot`, forward and both
backward matmuls):

- **float32**: no quantization.
- **int8** (preset ``int8``): int8 forward, int8 gradients with stochastic
  rounding in both backward matmuls, per-channel scales (per group in the
  experts' weight gradients).
- **fp8** (preset ``fp8``): E4M3 forward, E5M2 gradient x E4M3 operand in
  the backward matmuls, per-tensor current scaling.

Reports the final held-out loss (the model's own forward: quantized as
trained) and its ratio to float32's for the same seed.

Memory (``--memory-only`` measures only this): the temporary bytes of the
compiled programs (``compiled.memory_analysis()``, XLA:CPU) of one ragged
dot ``[2048, 128] x [experts, 128, 128]`` at 4, 16 and 64 experts: the
forward, the weight gradient alone and both gradients, ``lax.ragged_dot``
(float32) and ``qbits.ops.ragged_dot`` with the int8 preset. ``--before
FILE``: a ``--memory-only`` JSON of an earlier qbits, kept beside.

Run: python benchmarks/moe.py --json OUT.json --md OUT.md [--seeds 0 1]
     [--steps 400] [--before MEMORY.json]
     python benchmarks/moe.py --memory-only --json MEMORY.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import optax

import qbits
from qbits._experiments import _data as data_lib
from qbits._experiments._moe import init_moe, moe

CONTEXT, EMBED, D_MODEL, D_HIDDEN, EXPERTS, TOP_K = 8, 16, 64, 128, 4, 2
BATCH, EVAL_BATCHES, LEARNING_RATE = 128, 8, 3e-3
CONFIGS = {"float32": None, "int8": "int8", "fp8": "fp8"}


def init(key: jax.Array, vocab: int) -> dict:
    k_embed, k_ctx, k_moe, k_head = jax.random.split(key, 4)
    return {
        "embed": jax.random.normal(k_embed, (vocab, EMBED)),
        "ctx": jax.random.normal(k_ctx, (CONTEXT * EMBED, D_MODEL))
        / math.sqrt(CONTEXT * EMBED),
        "moe": init_moe(k_moe, D_MODEL, D_HIDDEN, EXPERTS),
        "head": jax.random.normal(k_head, (D_MODEL, vocab)) / math.sqrt(D_MODEL),
    }


def _norm(h: jax.Array) -> jax.Array:
    return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def logits(params: dict, tokens: jax.Array) -> jax.Array:
    """Next-character logits ``[batch, vocab]`` from ``[batch, CONTEXT]``."""
    x = params["embed"][tokens].reshape(tokens.shape[0], CONTEXT * EMBED)
    h = _norm(x @ params["ctx"])
    h = h + moe(params["moe"], h, TOP_K)
    return _norm(h) @ params["head"]


def loss_fn(params: dict, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits(params, tokens), targets
    ).mean()


def run(seed: int, steps: int, name: str, preset: str | None, data: object) -> dict:
    params = init(jax.random.key(seed), data.vocab)
    optimizer = optax.adam(LEARNING_RATE)
    opt_state = optimizer.init(params)
    rounding = jax.random.key(1_000 + seed)  # stochastic rounding (int8)

    def quantized(key: jax.Array) -> object:
        return loss_fn if preset is None else qbits.quantize(loss_fn, preset, key)

    @jax.jit
    def step(params, opt_state, i):
        key = jax.random.fold_in(jax.random.key(seed), i)
        tokens, targets = data_lib.char_batch(data.train, key, BATCH, CONTEXT)
        f = quantized(jax.random.fold_in(rounding, i))
        loss, grads = jax.value_and_grad(f)(params, tokens, targets[:, -1])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_x, eval_y = data_lib.char_eval_batches(data.eval, EVAL_BATCHES, 256, CONTEXT)

    @jax.jit
    def eval_loss(params):
        f = quantized(rounding)
        # lax.map, not vmap: JAX batches no ragged_dot over group sizes.
        batches = jax.lax.map(lambda b: f(params, b[0], b[1][:, -1]), (eval_x, eval_y))
        return jnp.mean(batches)

    tic = time.perf_counter()
    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, i)
        losses.append(float(loss))
    final = float(eval_loss(params))
    seconds = time.perf_counter() - tic
    train = sum(losses[-20:]) / len(losses[-20:])
    print(f"seed {seed} {name:8s} eval {final:.4f} train {train:.4f} ({seconds:.0f}s)")
    return {"seed": seed, "config": name, "eval_loss": final, "train_loss": train,
            "first_loss": losses[0], "seconds": seconds}  # fmt: skip


ROWS, FEATURES, EXPERT_COUNTS = 2048, 128, (4, 16, 64)


def memory() -> list[dict]:
    """Temporary MiB of a ragged dot's programs, per expert count and op."""
    ops = {
        "lax (float32)": jax.lax.ragged_dot,
        "int8": qbits.ops.ragged_dot(qbits.presets.get("int8"), jax.random.key(0)),
    }
    out = []
    for experts in EXPERT_COUNTS:
        args = (
            jax.ShapeDtypeStruct((ROWS, FEATURES), jnp.float32),
            jax.ShapeDtypeStruct((experts, FEATURES, FEATURES), jnp.float32),
            jax.ShapeDtypeStruct((experts,), jnp.int32),
        )
        for name, rd in ops.items():

            def loss(x, w, sizes, rd=rd):
                return jnp.sum(rd(x, w, sizes) ** 2)

            programs = {
                "forward": rd,
                "weight_grad": lambda x, w, sizes, loss=loss: jax.grad(loss, 1)(
                    x, w, sizes
                ),
                "both_grads": lambda x, w, sizes, loss=loss: jax.grad(loss, (0, 1))(
                    x, w, sizes
                ),
            }
            row = {"experts": experts, "op": name}
            for what, f in programs.items():
                compiled = jax.jit(f).lower(*args).compile()
                row[what] = compiled.memory_analysis().temp_size_in_bytes / 2**20
            out.append(row)
            print(row)
    return out


def memory_markdown(rows: list[dict], before: list[dict] | None) -> str:
    lines = [
        f"Temporary MiB of one ragged dot [{ROWS}, {FEATURES}] x [experts, "
        f"{FEATURES}, {FEATURES}] (XLA:CPU)",
        "",
        "| experts | op | forward | weight gradient | both gradients |",
        "|---|---|---|---|---|",
    ]
    for label, group in (("", rows), (" (before)", before or [])):
        for r in group:
            lines.append(
                f"| {r['experts']} | {r['op']}{label} | {r['forward']:.1f} | "
                f"{r['weight_grad']:.1f} | {r['both_grads']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict], steps: int) -> str:
    seeds = sorted({r["seed"] for r in rows})
    base = {r["seed"]: r["eval_loss"] for r in rows if r["config"] == "float32"}
    lines = [
        f"Held-out loss of the MoE char model after {steps} Adam steps "
        f"(seeds {', '.join(map(str, seeds))}; / float32 of the same seed)",
        "",
        "| config | eval loss | / float32 |",
        "|---|---|---|",
    ]
    for name in CONFIGS:
        got = sorted((r for r in rows if r["config"] == name), key=lambda r: r["seed"])
        losses = ", ".join(f"{r['eval_loss']:.4f}" for r in got)
        ratios = ", ".join(f"{r['eval_loss'] / base[r['seed']]:.4f}" for r in got)
        lines.append(f"| {name} | {losses} | {ratios} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--memory-only", action="store_true")
    parser.add_argument("--before", help="a --memory-only JSON to keep beside")
    args = parser.parse_args()
    if args.memory_only:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "memory": memory()}, f, indent=1)
        return
    before = None
    if args.before:
        with open(args.before) as f:
            before = json.load(f)["memory"]
    mem = memory()
    data = data_lib.char_data()
    rows = [
        run(seed, args.steps, name, preset, data)
        for seed in args.seeds
        for name, preset in CONFIGS.items()
    ]
    example = init(jax.random.key(0), data.vocab)
    tokens = jnp.zeros((BATCH, CONTEXT), jnp.int32)
    table = qbits.layer_table(logits, "int8", example, tokens)
    setup = dict(
        context=CONTEXT, embed=EMBED, d_model=D_MODEL, d_hidden=D_HIDDEN,
        experts=EXPERTS, top_k=TOP_K, batch=BATCH, learning_rate=LEARNING_RATE,
        steps=args.steps,
    )  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({"jax": jax.__version__, "setup": setup,
                   "matmuls": [[r.path, r.kind, r.operands] for r in table.rows],
                   "rows": rows, "memory": mem, "memory_before": before},
                  f, indent=1)  # fmt: skip
    out = markdown(rows, args.steps) + "\n" + memory_markdown(mem, before)
    print(table)
    print(out)
    if args.md:
        with open(args.md, "w") as f:
            f.write(out)


if __name__ == "__main__":
    main()
