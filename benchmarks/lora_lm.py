"""Fine-tuning the example transformer on shifted text: full vs LoRA vs QLoRA.

Trains the ``lm`` example model (``qbits train``'s default) in float32 with
:func:`qbits._experiments.train`, then fine-tunes it on a shifted slice of
its corpus: the corpus grammar's arithmetic facts alone (``"37 + 45 =
82."``; a fifth of the pretraining sentences, here all of the text), drawn
with other seeds for training and for evaluation. Every method runs the same
steps, batches and schedule (AdamW, warm-up and cosine decay):

- full fine-tuning: every float32 parameter trains;
- LoRA: rank-8 adapters on every weight matmul (:func:`qbits.lora.apply`,
  13 of them: attention projections, MLP, head), float32 base frozen;
- QLoRA: the same adapters over a base whose weights are held as NF4
  (blocks of 64; float32 absmax, or double-quantized as QLoRA stores them:
  ``nf4_dq``) or int4 in groups of 64 (symmetric), packed (the
  attention output projection, which contracts heads x head size 4 x 32,
  in groups of 32 along the head size).

Reported: the held-out loss on the shifted text and on the original text
(forgetting), and the bytes of the trainable parameters, the frozen base,
and the optimizer state.

Run: python benchmarks/lora_lm.py --json OUT.json --md OUT.md [--seed 0]
     [--pretrain-steps N] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import qbits
from qbits import lora
from qbits._experiments import _corpus as corpus
from qbits._experiments import _data as data_lib
from qbits._experiments import spec, train


def _nbytes(tree):
    """The bytes of a pytree's arrays."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _weight_only(
    numerics: qbits.numerics.QNumerics, group: int, double_quant: bool
) -> qbits.DotGeneralConfig:
    tiled = qbits.Tiled(tile_size=group)
    rhs = qbits.Quantizer(numerics, granularity=tiled, double_quant=double_quant)
    return qbits.DotGeneralConfig(fwd=qbits.MatmulConfig(rhs=rhs, mode="fake"))


def _base(
    numerics: qbits.numerics.QNumerics, double_quant: bool = False
) -> qbits.QuantConfig:
    """Weights in groups of 64 along K; the attention output projection
    contracts (heads 4, head size 32), and a group lies along one axis: 32.
    ``double_quant``: the scales stored as QLoRA stores them (``nf4_dq``)."""
    return qbits.QuantConfig(
        rules=(qbits.Rule(".*attn/out", _weight_only(numerics, 32, double_quant)),),
        default=_weight_only(numerics, 64, double_quant),
    )


RANK, ALPHA, DROPOUT = 8, 16.0, 0.05
METHODS = {
    "full fine-tuning (float32)": None,
    "LoRA r8 (float32 base)": lora.LoraConfig(rank=RANK, alpha=ALPHA, dropout=DROPOUT),
    "QLoRA r8 (NF4 base)": lora.LoraConfig(
        rank=RANK,
        alpha=ALPHA,
        dropout=DROPOUT,
        base=_base(qbits.numerics.Nf4Numerics()),
    ),
    "QLoRA r8 (NF4 double-quant base)": lora.LoraConfig(
        rank=RANK,
        alpha=ALPHA,
        dropout=DROPOUT,
        base=_base(qbits.numerics.Nf4Numerics(), double_quant=True),
    ),
    "QLoRA r8 (int4 g64 base)": lora.LoraConfig(
        rank=RANK, alpha=ALPHA, dropout=DROPOUT, base=_base(qbits.IntNumerics(bits=4))
    ),
}


def arithmetic(n_chars: int, seed: int) -> str:
    """The corpus grammar's arithmetic facts alone, ``n_chars`` of them."""
    rng = random.Random(seed)
    facts, size = [], 0
    while size < n_chars:
        facts.append(corpus._arithmetic(rng))
        size += len(facts[-1]) + 1
    return " ".join(facts)


def tokens(text: str, chars: str) -> jax.Array:
    index = {c: i for i, c in enumerate(chars)}
    return jnp.asarray(np.array([index[c] for c in text], np.int32))


def run(seed: int, pretrain_steps: int | None, steps: int, lr_full: float,
        lr_lora: float) -> list[dict]:  # fmt: skip
    model_spec = spec("lm")
    kept = []
    tic = time.perf_counter()
    result = train(model_spec, None, seed=seed, steps=pretrain_steps,
                   on_trained=kept.append)  # fmt: skip
    print(f"pretrained: eval loss {result.eval_loss:.4f} "
          f"({time.perf_counter() - tic:.0f}s)")  # fmt: skip
    model = kept[0]
    fn, params = qbits.nnx.as_function(model)
    data = data_lib.char_data()
    shifted_train = tokens(arithmetic(60_000, 1000 + seed), data.chars)
    shifted_eval = tokens(arithmetic(12_000, 2000 + seed), data.chars)
    batch, context = model_spec.batch, model_spec.context
    evals = {
        "shifted": data_lib.char_eval_batches(shifted_eval, 8, batch, context),
        "original": data_lib.char_eval_batches(data.eval, 8, batch, context),
    }
    x0 = evals["shifted"][0][0]

    def xent(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def evaluate(forward) -> dict[str, float]:
        @jax.jit
        def loss(xs, ys):
            return jnp.mean(jax.vmap(lambda x, y: xent(forward(x), y))(xs, ys))

        return {name: float(loss(*xy)) for name, xy in evals.items()}

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, 1.0, max(1, steps // 10), max(steps, 2), 0.1
    )

    def finetune(trainable, loss_fn, lr):
        tx = optax.adamw(lambda i: lr * schedule(i), weight_decay=0.0)
        state = tx.init(trainable)

        @jax.jit
        def step(trainable, state, i):
            key = jax.random.fold_in(jax.random.key(seed), i)
            x, y = data_lib.char_batch(shifted_train, key, batch, context)
            value, grads = jax.value_and_grad(loss_fn)(trainable, x, y, key)
            updates, state = tx.update(grads, state, trainable)
            return optax.apply_updates(trainable, updates), state, value

        tic = time.perf_counter()
        for i in range(steps):
            trainable, state, value = step(trainable, state, i)
        value = float(value)
        seconds = time.perf_counter() - tic
        return trainable, _nbytes(state), value, seconds

    rows = []
    before = evaluate(lambda x: fn(params, x)[0])
    rows.append({"method": "pretrained (no fine-tuning)", "trainable_bytes": 0,
                 "frozen_bytes": _nbytes(params), "optimizer_bytes": 0,
                 **{f"eval_{k}": v for k, v in before.items()}})  # fmt: skip
    print(f"{'pretrained':28s} shifted {before['shifted']:.4f} "
          f"original {before['original']:.4f}")  # fmt: skip
    for name, cfg in METHODS.items():
        if cfg is None:

            def loss_full(p, x, y, key):
                return xent(fn(p, x)[0], y)

            tuned, opt_bytes, train_loss, seconds = finetune(params, loss_full, lr_full)
            after = evaluate(lambda x, tuned=tuned: fn(tuned, x)[0])
            trainable, frozen = _nbytes(params), 0
            extra = {}
        else:
            lfn, base, adapters = lora.apply(model, cfg, x0, key=jax.random.key(seed))

            def loss_lora(ad, x, y, key, lfn=lfn, base=base):
                return xent(lfn(ad, base, x, dropout_key=key)[0], y)

            start = evaluate(
                lambda x, lfn=lfn, base=base, a=adapters: lfn(a, base, x)[0]
            )
            tuned, opt_bytes, train_loss, seconds = finetune(
                adapters, loss_lora, lr_lora
            )
            after = evaluate(lambda x, lfn=lfn, base=base, a=tuned: lfn(a, base, x)[0])
            trainable, frozen = _nbytes(adapters), _nbytes(base)
            weights = _nbytes(base.weights)
            extra = {
                "adapted_matmuls": sum(la.rank is not None for la in lfn.layers),
                "start_shifted": start["shifted"],
                "stored_weight_bytes": weights,
            }
            if base.weights:  # merged, then quantized again for a server
                merged = lora.merge(lfn, tuned, base)
                served = jax.jit(qbits.quantize(fn, lfn.base_rules))
                requant = evaluate(lambda x, m=merged, s=served: s(m, x)[0])
                extra["requantized_shifted"] = requant["shifted"]
        evals_after = {f"eval_{k}": v for k, v in after.items()}
        rows.append({"method": name, "trainable_bytes": trainable,
                     "frozen_bytes": frozen, "optimizer_bytes": opt_bytes,
                     "train_loss": train_loss, "seconds": seconds,
                     **evals_after, **extra})  # fmt: skip
        print(f"{name:28s} shifted {after['shifted']:.4f} original "
              f"{after['original']:.4f} ({seconds:.0f}s; trainable {trainable} B, "
              f"frozen {frozen} B)")  # fmt: skip
    return rows


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "Fine-tuning the example LM (float32-pretrained, "
        f"{meta['pretrain_steps']} steps) on the corpus grammar's arithmetic "
        f"facts alone, {meta['steps']} steps of batch 32 (seed {meta['seed']}; "
        f"AdamW, lr {meta['lr_full']:g} full, {meta['lr_lora']:g} adapters; "
        f"rank {RANK}, alpha {ALPHA:g}, dropout {DROPOUT:g}, all 13 weight "
        "matmuls). Held-out loss on the shifted text and on the original "
        "text; bytes of the parameters the optimizer updates, of the frozen "
        "base (packed codes and scales, plus the float embedding, norms, "
        "biases), and of AdamW's state.",
        "",
        "| method | eval loss, shifted | eval loss, original | trainable | "
        "frozen base | trainable + base | AdamW state |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        total = r["trainable_bytes"] + r["frozen_bytes"]
        lines.append(
            f"| {r['method']} | {r['eval_shifted']:.4f} | {r['eval_original']:.4f} | "
            f"{_kib(r['trainable_bytes'])} | {_kib(r['frozen_bytes'])} | "
            f"{_kib(total)} | {_kib(r['optimizer_bytes'])} |"
        )
    quantized = [r for r in rows if "requantized_shifted" in r]
    if quantized:
        lines += ["", "QLoRA served: adapters merged into the dequantized base, "
                  "then quantized again to the base's format (shifted eval loss): "
                  + ", ".join(f"{r['method']}: {r['requantized_shifted']:.4f} "
                              f"(unmerged {r['eval_shifted']:.4f})"
                              for r in quantized) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pretrain-steps", type=int, default=800)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr-full", type=float, default=1e-3)
    parser.add_argument("--lr-lora", type=float, default=5e-3)
    args = parser.parse_args()
    tic = time.perf_counter()
    rows = run(args.seed, args.pretrain_steps, args.steps, args.lr_full, args.lr_lora)
    meta = {"jax": jax.__version__, "seed": args.seed, "steps": args.steps,
            "pretrain_steps": args.pretrain_steps, "lr_full": args.lr_full,
            "lr_lora": args.lr_lora, "seconds": time.perf_counter() - tic}  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    table = markdown(rows, meta)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
