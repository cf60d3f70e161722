"""A quantized KV cache on the example transformer: bytes, speed, agreement.

Trains the ``lm`` example model (``qbits train``'s default) in float32 with
:func:`qbits._experiments.train`, then decodes a fixed prompt set (16 windows
of 16 characters from the held-out text, 48 new tokens each: the context of
64 exactly) with every cache preset of :mod:`qbits.kvcache`, side by side
with the float cache in one process:

- cache bytes at full context (keys, values and scales of both blocks) over
  the float32 cache's;
- decoding speed: tokens per second of :func:`qbits.kvcache.generate`
  (compiled; prefill included), one sequence and the 16 at once, as a ratio
  to the float cache in the same round (median of paired rounds);
- agreement with the float cache's greedy decode: free-running (the share of
  the 16 x 48 generated tokens equal to the float cache's, and the share
  before each sequence's first difference), and teacher-forced (each cache
  decodes the float cache's tokens: the share of positions whose greedy
  token is the float cache's, and the largest absolute difference of the
  logits).

Run: python benchmarks/kv_cache.py --json OUT.json --md OUT.md [--steps N]
     [--seed S] [--rounds R]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

import qbits
from qbits import kvcache
from qbits._experiments import build_model, spec, train

PROMPTS, PROMPT_LENGTH, NEW = 16, 16, 48


@functools.partial(jax.jit, static_argnums=(0, 3))
def _teacher_forced(graphdef, state, sequence, config):
    """Logits of every new position, decoding ``sequence`` one token at a time."""
    model = nnx.merge(graphdef, state)
    cache = model.init_cache(sequence.shape[0], config)
    logits, cache = model.decode(sequence[:, :PROMPT_LENGTH], cache)

    def step(cache, token):
        logits, cache = model.decode(token[:, None], cache)
        return cache, logits[:, 0]

    _, rest = jax.lax.scan(step, cache, sequence[:, PROMPT_LENGTH:-1].T)
    return jnp.concatenate([logits[:, -1:], rest.transpose(1, 0, 2)], axis=1)


def _tokens_per_second(model, prompts, config) -> float:
    tic = time.perf_counter()
    jax.block_until_ready(kvcache.generate(model, prompts, NEW, cache=config))
    return prompts.shape[0] * NEW / (time.perf_counter() - tic)


def run(seed: int, steps: int | None, rounds: int) -> dict:
    model_spec = spec("lm")
    kept = []
    result = train(model_spec, None, seed=seed, steps=steps, on_trained=kept.append)
    model = kept[0]
    _, data = build_model(model_spec, seed)
    starts = np.linspace(0, data.eval.shape[0] - PROMPT_LENGTH - 1, PROMPTS)
    prompts = jnp.stack(
        [data.eval[int(s) : int(s) + PROMPT_LENGTH] for s in starts]
    ).astype(jnp.int32)
    names = ("kv_float", "kv_int8", "kv_fp8", "kv_int8_per_head", "kv_fp8_per_head")
    configs = {n: qbits.load_config(n, kvcache.CacheConfig) for n in names}
    graphdef, state = nnx.split(model)

    ref_tokens = kvcache.generate(model, prompts, NEW, cache="kv_float")
    sequence = jnp.concatenate([prompts, ref_tokens], axis=1)
    ref_logits = np.asarray(
        _teacher_forced(graphdef, state, sequence, configs["kv_float"])
    )
    float_bytes = sum(c.nbytes for c in model.init_cache(1, None))
    rows = []
    for name, config in configs.items():
        tokens = np.asarray(kvcache.generate(model, prompts, NEW, cache=config))
        same = tokens == np.asarray(ref_tokens)
        first_diff = np.where(same.all(1), NEW, np.argmin(same, axis=1))
        forced = np.asarray(_teacher_forced(graphdef, state, sequence, config))
        nbytes = sum(c.nbytes for c in model.init_cache(1, config))
        rows.append({
            "cache": name, "describe": config.describe(), "bytes": nbytes,
            "bytes_ratio": nbytes / float_bytes,
            "free_running_same": float(same.mean()),
            "free_running_before_first_difference": float(first_diff.mean() / NEW),
            "teacher_forced_same": float(
                (forced.argmax(-1) == ref_logits.argmax(-1)).mean()),
            "teacher_forced_max_abs_logit_diff": float(
                np.abs(forced - ref_logits).max()),
            "logit_range": float(np.abs(ref_logits).max()),
        })  # fmt: skip
    # Speed: compiled (one warm-up call each), paired rounds, configs in turn.
    speeds: dict[tuple[str, int], list[float]] = {}
    for batch in (1, PROMPTS):
        for name in names:
            _tokens_per_second(model, prompts[:batch], configs[name])
        for _ in range(rounds):
            for name in names:
                tps = _tokens_per_second(model, prompts[:batch], configs[name])
                speeds.setdefault((name, batch), []).append(tps)
    for row in rows:
        for batch in (1, PROMPTS):
            tps = speeds[row["cache"], batch]
            base = speeds["kv_float", batch]
            row[f"tokens_per_s_batch{batch}"] = statistics.median(tps)
            row[f"speed_ratio_batch{batch}"] = statistics.median(
                t / b for t, b in zip(tps, base, strict=True)
            )
        print(row)
    return {
        "jax": jax.__version__, "seed": seed, "steps": steps or model_spec.steps,
        "eval_loss": result.eval_loss, "prompts": PROMPTS,
        "prompt_length": PROMPT_LENGTH, "new_tokens": NEW, "rounds": rounds,
        "float32_cache_bytes": float_bytes, "load_average": os.getloadavg(),
        "rows": rows,
    }  # fmt: skip


def markdown(report: dict) -> str:
    lines = [
        f"KV cache of the example LM (float32-trained, {report['steps']} steps, "
        f"seed {report['seed']}, eval loss {report['eval_loss']:.4f}): "
        f"{report['prompts']} held-out prompts of {report['prompt_length']} "
        f"characters, {report['new_tokens']} greedy tokens each. Bytes at full "
        f"context (float32 cache: {report['float32_cache_bytes'] / 1024:.0f} KiB "
        "per sequence); tokens/s and their ratio to the float cache (median of "
        f"{report['rounds']} paired rounds, 2-core CPU, load average "
        f"{report['load_average'][0]:.1f}); agreement with the float cache's "
        "greedy decode.",
        "",
        "| cache | stored | bytes / f32 | tokens/s, batch 1 (ratio) "
        "| tokens/s, batch 16 (ratio) | free-running: same tokens "
        "| same before the first difference | teacher-forced: same greedy token "
        "| max abs logit difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| `{r['cache']}` | {r['describe']} | {r['bytes_ratio']:.3f} "
            f"| {r['tokens_per_s_batch1']:.0f} ({r['speed_ratio_batch1']:.2f}) "
            f"| {r['tokens_per_s_batch16']:.0f} ({r['speed_ratio_batch16']:.2f}) "
            f"| {100 * r['free_running_same']:.1f}% "
            f"| {100 * r['free_running_before_first_difference']:.1f}% "
            f"| {100 * r['teacher_forced_same']:.2f}% "
            f"| {r['teacher_forced_max_abs_logit_diff']:.3g} |"
        )
    rng = max(r["logit_range"] for r in report["rows"])
    lines += ["", f"(Largest |logit| of the float cache's decode: {rng:.1f}.)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    report = run(args.seed, args.steps, args.rounds)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    table = markdown(report)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
