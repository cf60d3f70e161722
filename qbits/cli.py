"""The ``qbits`` command: train example models, run ablation sweeps, inspect configs.

::

    qbits train [CONFIG] [--model lm|mlp] [--steps N] [--seed S] [--out DIR] [--rerun]
    qbits sweep SWEEP.yaml [--out DIR] [--rerun]
    qbits ptq CONFIG --run DIR [--method rtn gptq awq ...] [--calibration N] [--out DIR]
    qbits inspect CONFIG [--model lm|mlp]
    qbits generate [--prompt TEXT | --prompt-file FILE] [--cache CACHE] [--run DIR]
    qbits presets

CONFIG is a preset name (``qbits presets``) or a YAML config file (a single
config, or per-layer rules; see docs/guides/configs.md). Every user
error (bad argument, bad file, unknown preset, unwritable folder or full
disk, a config that does not fit a layer) prints one line,
``qbits: error: ...``, and exits with status 2; an interrupted command
(Ctrl-C) exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import pathlib
import shutil
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence

__all__ = [
    "main",
]

_PROG = "qbits"
_MAX_SEED = 2**32 - 1  # JAX keys of larger seeds repeat those of smaller ones
_MAX_STEPS = 2**31 - 1  # the step counter is an int32


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


def _config(arg: str):
    """A preset name or a YAML file -> (name, QuantConfig or None, origin).

    ``origin`` holds the :class:`~qbits.experiments.Entry` fields that place
    the config's errors found during training: the file, or the preset.
    """
    import qbits

    path = pathlib.Path(arg)
    if arg in qbits.presets.names() and not path.is_file():
        config = None if arg == "none" else qbits.QuantConfig(default=arg)
        return arg, config, {"where": arg, "single": True}
    if path.suffix in (".yaml", ".yml") or path.exists():
        config = qbits.config.load(path)
        origin = {"source": os.fspath(path)}
        if isinstance(config, qbits.QuantConfig):
            return path.stem, config, origin
        return path.stem, qbits.QuantConfig(default=config), origin | {"single": True}
    raise UsageError(
        f"unknown config {arg!r}: expected a YAML file or a preset name: "
        + ", ".join(qbits.presets.names())
    )


def _out_dir(path: str) -> pathlib.Path:
    """Creates ``path`` and checks it can be written, before any training."""
    out = pathlib.Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".qbits-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(
            f"cannot write to the output folder {path!r} ({e.strerror or e})"
        ) from None
    return out


class _Progress:
    """The progress bars (tqdm) of a command's runs.

    ``self(run_id, index, total)`` gives a run's per-step callback;
    :meth:`close` closes any bar still open (an error or Ctrl-C mid-run), so
    the last line printed is the message.
    """

    def __init__(self, steps: int):
        self.steps = steps
        self.bars: list = []

    def __call__(self, run_id: str, index: int, total: int):
        from tqdm.auto import tqdm

        bar = tqdm(
            total=self.steps,
            desc=f"[{index + 1}/{total}] {run_id}",
            unit="step",
            leave=False,
            # A terminal that reports no size (0 columns) still gets a bar.
            ncols=shutil.get_terminal_size().columns or 100,
            file=sys.stderr,
        )
        self.bars.append(bar)

        def update(step: int, loss: float) -> None:
            bar.update(1)
            if step % 10 == 0 or step == self.steps:
                bar.set_postfix(loss=f"{loss:.3f}")
            if step == self.steps:
                bar.close()

        return update

    def close(self) -> None:
        for bar in self.bars:
            bar.close()
        self.bars.clear()


@contextlib.contextmanager
def _progress(quiet: bool, steps: int) -> Iterator[_Progress | None]:
    """The progress bars of a command (``None`` when quiet or not a terminal)."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    progress = _Progress(steps)
    try:
        yield progress
    finally:
        progress.close()


def _log(quiet: bool):
    def log(line: str) -> None:
        if not quiet or line.startswith("warning"):
            print(line, file=sys.stderr if line.startswith("warning") else sys.stdout)

    return log


def _wrote(out: pathlib.Path, runs: int | None = None) -> str:
    """The last line of ``train``, ``sweep`` and ``ptq``: every file of the report.

    The report lists them in ``results.json`` (``quality_vs_bits.png`` is
    drawn only for more than one bit width).
    """
    import json

    files = json.loads((out / "results.json").read_text(encoding="utf-8"))["files"]
    wrote = f"wrote {out}/{', '.join(files)}"
    return wrote if runs is None else f"{wrote}; {runs} run files in {out / 'runs'}/"


def _train(args: argparse.Namespace) -> int:
    from qbits.experiments import Entry, Sweep, config_bits, run_sweep, spec

    name, config, origin = _config(args.config)
    model_spec = spec(args.model, args.size)
    steps = model_spec.steps if args.steps is None else args.steps
    out = _out_dir(args.out or f"runs/train/{args.model}-{name}-seed{args.seed}")
    entries = [Entry("float32", None, 32.0)]
    if config is not None:
        entries.append(Entry(name, config, config_bits(config), **origin))
    sweep = Sweep(
        f"qbits train {args.model} {name}",
        model_spec,
        steps,
        (args.seed,),
        tuple(entries),
        "float32",
        args.size,
    )
    if not args.quiet:
        print(
            f"training {args.model} ({args.size}) for {steps} steps, seed "
            f"{args.seed}: float32 and {name}; results in {out}"
        )
    with _progress(args.quiet, steps) as progress:
        runs = run_sweep(
            sweep,
            out,
            resume=not args.rerun,
            progress=progress,
            log=_log(args.quiet),
            save_params="float32",
            diagnostics=args.diagnostics,
        )
    from qbits.experiments import summarize

    rows = summarize(runs, "float32")
    metric = "char accuracy" if args.model == "lm" else "accuracy"
    _print_rows(rows, metric)
    print(
        f"\n{_wrote(out, len(runs))}; the float32 params in "
        f"{out}/runs/float32__seed{args.seed}.params (for qbits ptq CONFIG --run "
        f"{out})"
    )
    return 0


def _print_rows(rows: list[dict], metric: str) -> None:
    """The results table on stdout (``nan`` cells blank)."""
    width = max(16, *(len(r["config"]) for r in rows))
    print(
        f"\n{'run':<{width}} {'train loss':>10} {'eval loss':>10} "
        f"{'eval / f32':>10} {metric:>13} {'time':>7} {'compile':>8} {'step':>9}"
    )

    def cell(value: float, spec: str, width: int, unit: str = "") -> str:
        text = "" if value != value else f"{value:{spec}}{unit}"
        return f"{text:>{width}}"

    for r in rows:
        print(
            f"{r['config']:<{width}} {cell(r['train_loss'], '.4f', 10)} "
            f"{cell(r['eval_loss'], '.4f', 10)} {cell(r['ratio'], '.4f', 10)} "
            f"{cell(r['eval_accuracy'], '.3f', 13)} "
            f"{cell(r['seconds'], '.0f', 7, 's')} "
            f"{cell(r['compile_seconds'], '.1f', 8, 's')} "
            f"{cell(1000 * r['step_seconds'], '.1f', 9, 'ms')}"
        )


def _ptq(args: argparse.Namespace) -> int:
    import qbits
    from qbits.experiments import post_train

    name, config, _ = _config(args.config)
    if config is None:
        raise UsageError("config 'none' quantizes nothing: give a weight format")
    # Made once the results are in: a failed command leaves nothing behind.
    out = pathlib.Path(args.out or os.path.join(args.run_dir, f"ptq-{name}"))
    if not args.quiet:
        print(
            f"post-training quantization of {args.run_dir} with {name} by "
            f"{', '.join(args.method)} ({args.calibration} calibration batches); "
            f"results in {out}"
        )
    try:
        rows = post_train(
            args.run_dir,
            config,
            out,
            name=name,
            methods=args.method,
            calibration=args.calibration,
            seed=args.seed,
            progress=not args.quiet and sys.stderr.isatty(),
            log=_log(args.quiet),
        )
    except qbits.InvalidArgumentError as e:
        if e.argument != "out":
            raise
        raise UsageError(f"--out {out}: {e.why}; expected {e.allowed}") from None
    _print_rows(rows, "accuracy")
    print(f"\n{_wrote(out)}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from qbits.experiments import load_sweep, run_sweep

    sweep = load_sweep(args.file)
    out = _out_dir(args.out or f"runs/{sweep.name}")
    total = len(sweep.entries) * len(sweep.seeds)
    if not args.quiet:
        print(
            f"sweep {sweep.name!r}: {len(sweep.entries)} configs x "
            f"{len(sweep.seeds)} seeds = {total} runs of {sweep.spec.model} "
            f"({sweep.size}, {sweep.steps} steps); results in {out}"
        )
    with _progress(args.quiet, sweep.steps) as progress:
        runs = run_sweep(
            sweep,
            out,
            resume=not args.rerun,
            progress=progress,
            log=_log(args.quiet),
            diagnostics=args.diagnostics,
        )
    if not args.quiet:
        print((out / "results.md").read_text(encoding="utf-8"))
    print(_wrote(out, len(runs)))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.target:
        return _inspect_target(args)

    import qbits
    from qbits.experiments import build_model, sample_batch, spec

    name, config, _ = _config(args.config)
    model_spec = spec(args.model)
    model, data = build_model(model_spec, 0)
    table = qbits.nnx.layer_table(
        model, config if config is not None else "none", sample_batch(model_spec, data)
    )
    print(f"{args.model}: {name}\n")
    print(table)
    message = table.unused_message()
    print(f"\nunused rules: {message}" if message else "\nunused rules: none")
    if args.diagnostics:
        if config is None:
            raise UsageError("--diagnostics: config 'none' quantizes nothing")
        from qbits.experiments import diagnose_batches

        metrics = diagnose_batches(model_spec, config, args.diagnostics)
        print(
            f"\nSQNR (dB) of each quantized operand, mean over {args.diagnostics} "
            f"training batches of the model at initialisation (seed 0):\n"
        )
        print(metrics.table())
        for metric, digits in (("clipped", 4), ("flushed", 4)):
            values = [r[metric] for r in metrics.rows()]
            if any(v > 0 for v in values):
                print(f"\n{metric} (fraction of values):\n")
                print(metrics.table(metric, digits))
    return 0


def _inspect_target(args: argparse.Namespace) -> int:
    """``qbits inspect CONFIG --target T``: the GPU (TPU) program of a step."""
    if args.model == "mlp":
        raise UsageError(
            "--target compiles a training step at a GPU's size: expected --model "
            "block (an LLM's MLP block) or lm (the example transformer)"
        )
    import qbits
    import qbits.hlo

    qbits.hlo.prepare_environment()  # before jax starts its backends
    from qbits.experiments import gpu_step

    name, config, _ = _config(args.config)
    if config is None:
        raise UsageError("--target: config 'none' quantizes nothing")
    if args.model == "block":
        sizes = {"tokens": 1024, "d_model": 512, "d_ff": 2048} if args.small else {}
        what = "MLP block " + ("512->2048->512, 1024 tokens" if args.small else
                               "4096->16384->4096, 8192 tokens")  # fmt: skip
    else:
        small = {"batch": 2, "context": 256, "width": 256, "depth": 2, "heads": 4}
        sizes = small if args.small else {}
        what = "example transformer " + (
            "d_model 256, 2 blocks, 2 x 256 tokens"
            if args.small
            else "d_model 2048, 8 blocks, 4 x 2048 tokens"
        )
    # The block's matmuls take one config (qbits.dot_general's), the LM rules.
    given = args.config if args.model == "block" else config
    programs = {}
    for label, preset in (("bf16", None), (name, given)):
        step, step_args = gpu_step(args.model, preset, **sizes)
        try:
            programs[label] = qbits.hlo.program(step(), *step_args, target=args.target)
        except RuntimeError as e:  # the compiler for the target is missing
            raise UsageError(str(e).splitlines()[0]) from None
    print(f"{what}, training step (bf16 parameters), for {args.target}:\n")
    print(f"{name}: {programs[name]}\n")
    base, mine = (programs[k].estimate().total_ms for k in ("bf16", name))
    print(
        f"bf16: {len(programs['bf16'].gemms)} GEMMs, estimated {base:.2f} ms; "
        f"{name} estimated {base / mine:.2f}x bf16's device time "
        f"({programs[name].target.measured})"
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    """``qbits generate``: decode text from the example LM with a KV cache."""
    import time

    import flax.nnx as nnx
    import jax.numpy as jnp
    import numpy as np

    from qbits import kvcache
    from qbits.experiments import build_model, load_trained, spec, train

    config = kvcache.as_cache_config("qbits generate", args.cache)
    if args.run_dir and (args.steps or args.size != "default"):
        raise UsageError("--steps and --size train a model; --run loads one")
    if not 1 <= args.tokens <= 1_000_000:
        raise UsageError(f"--tokens: expected an int in 1..1000000, got {args.tokens}")
    if not 0 <= args.temperature < float("inf"):
        raise UsageError(
            f"--temperature: expected a finite number >= 0, got {args.temperature}"
        )
    prompt = args.prompt if args.prompt_file is None else _prompt(args.prompt_file)
    if args.run_dir:  # the float32 model that qbits train saved
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
    if not args.run_dir:
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
    from tqdm.auto import tqdm

    bar = tqdm(
        total=args.tokens,
        desc=f"generate ({args.cache})",
        unit="token",
        leave=False,
        ncols=shutil.get_terminal_size().columns or 100,
        file=sys.stderr,
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


def _presets(args: argparse.Namespace) -> int:
    import qbits

    del args
    for name in qbits.presets.names():
        print(f"{name:<18} {qbits.presets.describe(name).splitlines()[0]}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's own status)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _run_options(parser: argparse.ArgumentParser) -> None:
    """The options of the commands that run training: --rerun, -q, --diagnostics."""
    parser.add_argument(
        "--rerun", action="store_true", help="rerun runs that are already finished"
    )
    parser.add_argument(
        "--diagnostics",
        type=_steps,
        default=0,
        metavar="EVERY_N",
        help="every EVERY_N steps, measure each quantized operand of each layer "
        "(SQNR, clipped, flushed, wasted bits): diagnostics.{md,csv} and heatmaps",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=_PROG,
        description="qbits: quantized training and ablations for JAX and Flax.",
        epilog="Run 'qbits COMMAND --help' for the options of a command.",
    )
    try:
        version = importlib.metadata.version("qbits")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        version = "unknown"
    parser.add_argument("--version", action="version", version=f"qbits {version}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    model_help = (
        "the example model: lm (char transformer) or mlp (default: %(default)s)"
    )

    train = sub.add_parser(
        "train",
        help="train an example model quantized by CONFIG, beside float32",
        description="Train an example model with every matmul quantized as CONFIG "
        "says, and the same model, data and seed in float32; print the final "
        "train/eval metrics of both and write results.{md,csv,json} and "
        "loss_curves.png to --out. A run finished before in --out with the same "
        "settings is kept, not retrained (so an interrupted command continues "
        "where it stopped); --rerun trains it again.",
    )
    train.add_argument(
        "config",
        nargs="?",
        default="int8",
        metavar="CONFIG",
        help="a preset name or a YAML config file (default: %(default)s)",
    )
    train.add_argument("--model", choices=("lm", "mlp"), default="lm", help=model_help)
    train.add_argument("--steps", type=_steps, help=f"training steps, 1..{_MAX_STEPS}")
    train.add_argument(
        "--seed", type=_seed, default=0, help="seed, 0..2**32-1 (default: 0)"
    )
    train.add_argument(
        "--out", help="output folder (default: runs/train/MODEL-CONFIG-seedS)"
    )
    train.add_argument(
        "--size",
        choices=("default", "tiny", "deep"),
        default="default",
        help="model size; tiny is for smoke tests, deep (lm) is 12 scanned blocks "
        "(default: %(default)s)",
    )
    _run_options(train)
    train.set_defaults(run=_train)

    sweep = sub.add_parser(
        "sweep",
        help="run an ablation sweep from a YAML file",
        description="Run every config x seed of SWEEP.yaml (runs finished before "
        "are skipped), then write results.{md,csv,json}, loss_curves.png and, "
        "when the configs have more than one bit width, quality_vs_bits.png to "
        "--out.",
    )
    sweep.add_argument("file", metavar="SWEEP.yaml", help="the sweep file")
    sweep.add_argument("--out", help="output folder (default: runs/NAME)")
    _run_options(sweep)
    sweep.set_defaults(run=_sweep)

    ptq = sub.add_parser(
        "ptq",
        help="quantize the weights of a trained float32 model after training",
        description="Read the float32 params that 'qbits train' saved in --run, "
        "quantize the weights as CONFIG says by each --method (round to "
        "nearest, GPTQ, AWQ) on calibration batches of the training data, "
        "evaluate each on the held-out data (activations quantized too where "
        "CONFIG says so: W8A8), and write results.{md,csv,json} and "
        "eval_loss.png (each method's eval loss beside float32's) to --out, "
        "which may not be a training run's folder (its report would be "
        "replaced).",
    )
    ptq.add_argument(
        "config",
        metavar="CONFIG",
        help="a preset name (e.g. w4g128_asym, nf4, int8_fwd) or a YAML config file",
    )
    ptq.add_argument(
        "--run",
        required=True,
        metavar="DIR",
        dest="run_dir",
        help="the output folder of qbits train",
    )
    ptq.add_argument(
        "--method",
        nargs="+",
        choices=("rtn", "gptq", "awq", "smoothquant", "rtn+rot", "gptq+rot"),
        default=["rtn", "gptq", "awq"],
        help="methods to compare (default: rtn gptq awq): round to nearest, "
        "GPTQ, AWQ; smoothquant: RTN after SmoothQuant's scales (alpha 0.5, "
        "for W8A8); rtn+rot, gptq+rot: after a random Hadamard rotation",
    )
    ptq.add_argument(
        "--calibration",
        type=_count,
        default=16,
        metavar="N",
        help="calibration batches (default: %(default)s)",
    )
    ptq.add_argument(
        "--seed", type=_seed, help="which saved run, if --run holds several"
    )
    ptq.add_argument("--out", help="output folder (default: DIR/ptq-CONFIG)")
    ptq.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ptq.set_defaults(run=_ptq)

    inspect = sub.add_parser(
        "inspect",
        help="show which config each layer of an example model gets",
        description="Print the per-layer table (layer path -> config) of CONFIG "
        "applied to an example model, and the rules that match no layer.",
    )
    inspect.add_argument(
        "config", metavar="CONFIG", help="a preset name or a YAML config file"
    )
    inspect.add_argument(
        "--model",
        choices=("lm", "mlp", "block"),
        default="lm",
        help=model_help + "; with --target, block: an LLM's MLP block",
    )
    inspect.add_argument(
        "--target",
        choices=("h100", "h200", "v5e"),
        help="compile the model's training step for this GPU or TPU on this "
        "machine (no device needed; pip install 'qbits[gpu]' or 'qbits[tpu]') "
        "and print each GEMM XLA emits, what sits between the quantization "
        "and it, and the device time estimated against bf16's",
    )
    inspect.add_argument(
        "--small",
        action="store_true",
        help="with --target: the model at a small size (seconds to compile)",
    )
    inspect.add_argument(
        "--diagnostics",
        nargs="?",
        type=_count,
        const=4,
        default=0,
        metavar="BATCHES",
        help="also run BATCHES training batches (default 4) through the model "
        "and print each quantized operand's SQNR per layer",
    )
    inspect.set_defaults(run=_inspect)

    generate = sub.add_parser(
        "generate",
        help="generate text with the example transformer and a KV cache",
        description="Decode text after a prompt with the example transformer "
        "(lm), token by token, its keys and values kept in a KV cache stored as "
        "--cache says (quantized once per token, when it is written). Without "
        "--run (the output folder of qbits train, which saves the float32 "
        "model), the model is first trained in float32 (--size, --steps). The "
        "cache presets: kv_float, kv_int8, kv_fp8, "
        "kv_int8_per_head, kv_fp8_per_head; or a YAML file (keys, values, "
        "granularity).",
    )
    text = generate.add_mutually_exclusive_group()
    text.add_argument(
        "--prompt", default="The ", help="the prompt (default: %(default)r)"
    )
    text.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE")
    generate.add_argument(
        "--tokens", type=int, default=200, help="tokens to generate (default: 200)"
    )
    generate.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (default); > 0: sample from softmax(logits / T)",
    )
    generate.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="seed of the model (when trained) and of sampling (default: 0)",
    )
    generate.add_argument(
        "--cache",
        default="kv_int8",
        metavar="CACHE",
        help="a cache preset or a YAML cache config (default: %(default)s)",
    )
    generate.add_argument(
        "--run",
        metavar="DIR",
        dest="run_dir",
        help="the output folder of qbits train: decode with its float32 model",
    )
    generate.add_argument(
        "--size",
        choices=("default", "tiny"),
        default="default",
        help="size of the model trained first; tiny is for smoke tests "
        "(default: %(default)s)",
    )
    generate.add_argument(
        "--steps", type=_steps, help=f"training steps, 1..{_MAX_STEPS}"
    )
    generate.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars, text only"
    )
    generate.set_defaults(run=_generate)

    presets = sub.add_parser(
        "presets",
        help="list the presets",
        description="List the preset configs and what each is for.",
    )
    presets.set_defaults(run=_presets)
    return parser


def _shown(text: str) -> str:
    """An argument as the error shows it: quoted, cut after 40 characters."""
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


def _positive(top: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an int in ``1..top`` (``why`` says where ``top`` is from)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # not an int, or more than 4300 digits
            value = 0
        if not 1 <= value <= top:
            raise argparse.ArgumentTypeError(
                f"expected a positive int of at most {top}{why}, got {_shown(text)}"
            )
        return value

    return parse


_steps = _positive(_MAX_STEPS, " (the step counter is an int32)")
_count = _positive(1 << 20)


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= _MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"expected an int in 0..{_MAX_SEED}, got {_shown(text)}"
        )
    return value


def _exit_now(status: int, message: str) -> None:
    """Writes ``message``, flushes stdout and stderr, ends the process at once.

    Called from the SIGINT handler: the message goes to file descriptor 2
    directly (a buffered write could be the one the signal interrupted).

    After Ctrl-C, XLA may still be compiling on its own threads (the
    interrupt only stops Python waiting for it). Tearing the interpreter
    down then destroys the XLA client under that thread, which crashes
    ("Fatal Python error: Segmentation fault", status -11) in most
    interrupted runs. Nothing is left to save: run files are written
    atomically as each run finishes.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, f"\n{message}\n".encode())
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``qbits`` command; returns its exit status.

    Args:
      argv: The arguments (default ``sys.argv[1:]``).

    Returns:
      0 on success, 2 for a user error (one line on stderr), 130 when
      interrupted. Run as the command (``argv`` is ``None``), an interrupt
      ends the process at once with status 130 (``os._exit``, after
      flushing the output): interpreter teardown while XLA still compiles
      on its threads crashes.

    Example:
      >>> from qbits.cli import main
      >>> main(["presets"])  # doctest: +ELLIPSIS
      none ...
      0
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    kept = (
        "; finished runs are kept, rerun the command to continue"
        if args.command in ("train", "sweep")
        else ""
    )
    message = f"{_PROG}: interrupted{kept}"
    if argv is None:
        # As the command, Ctrl-C ends the process at once: a KeyboardInterrupt
        # raised inside JAX's Python frames can be swallowed or turned into
        # another error (seen: a run that kept training, a traceback).
        signal.signal(signal.SIGINT, lambda *_: _exit_now(130, message))
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(message, file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    """Runs a command; a user error is one line on stderr and status 2."""
    import qbits
    from qbits.experiments import SweepError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", qbits.config.UnusedRuleWarning)
            return args.run(args)
    except (UsageError, SweepError, qbits.ConfigError, qbits.InvalidArgumentError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{_PROG}: error: {message}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f" {os.fsdecode(e.filename)}:" if e.filename else ""
        print(f"{_PROG}: error:{where} {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
