"""``qbits generate``: text from the example transformer with a KV cache."""

from __future__ import annotations

import argparse
import sys

from qbits.cli._common import UsageError, _progress, progress_bar


def _generate(args: argparse.Namespace) -> int:
    """``qbits generate``: decode text from the example LM with a KV cache."""
    import time

    import flax.nnx as nnx
    import jax.numpy as jnp
    import numpy as np

    from qbits import kvcache
    from qbits._experiments import build_model, load_trained, spec, train

    config = kvcache._as_cache_config("qbits generate", args.cache)
    if args.run_dir and (args.steps or args.size != "default"):
        raise UsageError("--steps and --size train a model; --run loads one")
    if not 1 <= args.tokens <= 1_000_000:
        raise UsageError(f"--tokens: expected an int in 1..1000000, got {args.tokens}")
    if not 0 <= args.temperature < float("inf"):
        raise UsageError(
            f"--temperature: expected a finite number >= 0, got {args.temperature}"
        )
    prompt = args.prompt if args.prompt_file is None else _prompt(args.prompt_file)
    if args.checkpoint and (args.run_dir or args.steps or args.size != "default"):
        raise UsageError(
            "--checkpoint decodes the checkpoint's model; --run, --steps and "
            "--size do not apply"
        )
    if args.checkpoint:  # qbits export's (or a PyTorch twin's) checkpoint
        from qbits.cli._interop import _checkpoint_lm

        model, data = _checkpoint_lm(args.checkpoint, config)
    elif args.run_dir:  # the float32 model that qbits train saved
        model, data, run = load_trained(args.run_dir, owner="qbits generate")
        if run["model"] != "lm":
            raise UsageError(
                f"--run {args.run_dir}: a {run['model']} model; qbits generate "
                "decodes the lm (qbits train --model lm)"
            )
        model_spec = spec("lm", run["size"])
    else:
        model_spec = spec("lm", args.size)
        built: list = []  # the data; the model's graph only, no weights computed

        def build() -> nnx.Module:
            model, data = build_model(model_spec, args.seed)
            built.append(data)
            return model

        model = nnx.eval_shape(build)
        data = built[0]
    missing = sorted({c for c in prompt if c not in data.chars})
    if not prompt or missing:
        raise UsageError(
            "the prompt is empty"
            if not prompt
            else f"the prompt has characters the model does not know: {missing!r}"
            f"; expected characters among {data.chars!r}"
        )
    float_bytes = sum(c.nbytes for c in model.init_cache(1, None))
    cache_bytes = sum(c.nbytes for c in model.init_cache(1, config))  # or refuses
    if not (args.run_dir or args.checkpoint):
        steps = model_spec.steps if args.steps is None else args.steps
        if not args.quiet:
            print(
                f"training lm ({args.size}) in float32 for {steps} "
                f"steps, seed {args.seed} (--run DIR loads what qbits train saved)",
                file=sys.stderr,
            )
        kept: list = []
        with _progress(args.quiet, steps) as progress:
            update = progress("float32", 0, 1) if progress else None
            train(
                model_spec,
                None,
                seed=args.seed,
                steps=steps,
                progress=update,
                on_trained=kept.append,
            )
        model = kept[0]
    tokens = jnp.asarray([data.chars.index(c) for c in prompt], jnp.int32)
    bar = progress_bar(
        args.tokens,
        f"generate ({args.cache})",
        "token",
        disable=args.quiet or not sys.stderr.isatty(),
    )
    times = [time.perf_counter()]

    def progress(i: int) -> None:
        times.append(time.perf_counter())
        bar.update(1)

    try:
        out = kvcache.generate(
            model,
            tokens,
            args.tokens,
            cache=config,
            temperature=args.temperature,
            seed=args.seed,
            progress=progress,
        )
        text = "".join(data.chars[i] for i in np.asarray(out))
    finally:
        bar.close()
    print(prompt + text)
    if not args.quiet:
        rest = (
            f", then {(args.tokens - 1) / (times[-1] - times[1]):.0f} tokens/s"
            if args.tokens > 1
            else ""
        )
        print(
            f"\n{args.tokens} tokens in {times[-1] - times[0]:.1f}s: the first after "
            f"{times[1] - times[0]:.1f}s (compiling){rest}; cache {args.cache} "
            f"({config.describe()}): {cache_bytes / 1024:.1f} KiB, "
            f"{cache_bytes / float_bytes:.3f}x float32's",
            file=sys.stderr,
        )
    return 0


def _prompt(path: str) -> str:
    """The text of ``--prompt-file``: a regular file (a FIFO would never end)."""
    from qbits._files import read_regular_file

    limit = 1_000_000
    try:
        data, kind = read_regular_file(path, limit + 1)
    except ValueError as e:  # a NUL byte in the path
        raise UsageError(f"--prompt-file {path}: {e}") from None
    if kind is not None:
        raise UsageError(f"--prompt-file {path}: expected a regular file, got {kind}")
    if len(data) > limit:
        raise UsageError(
            f"--prompt-file {path}: expected a file of at most {limit} bytes"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--prompt-file {path}: not UTF-8 text") from None
