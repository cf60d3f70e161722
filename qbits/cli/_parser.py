"""The ``qbits`` command's arguments: one subparser per verb."""

from __future__ import annotations

import argparse
import importlib.metadata

from qbits.cli._common import (
    _MAX_STEPS,
    _PROG,
    _count,
    _seed,
    _steps,
)
from qbits.cli._generate import (
    _generate,
)
from qbits.cli._inspect import (
    _inspect,
    _presets,
)
from qbits.cli._interop import _export, _import
from qbits.cli._search import (
    _search,
)
from qbits.cli._verbs import (
    _ptq,
    _sweep,
    _train,
)


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


def _saved_run_options(
    parser: argparse.ArgumentParser, batches: str, default: int
) -> None:
    """Adds ``--run DIR``, its calibration batches and ``--seed``.

    For a verb that reads the float32 runs ``qbits train`` saved.
    """
    parser.add_argument(
        "--run", required=True, metavar="DIR", dest="run_dir",
        help="the output folder of qbits train",
    )  # fmt: skip
    parser.add_argument(
        batches, type=_count, default=default, metavar="N",
        help="calibration batches (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=_seed, help="which saved run, if --run holds several"
    )


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
    train.add_argument(
        "--optimizer",
        choices=("adamw", "adamw8bit", "adamw4bit"),
        default="adamw",
        help="AdamW with float32 states, or with 8-bit or 4-bit states "
        "(qbits.optim; both runs use it) (default: %(default)s)",
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
    _saved_run_options(ptq, "--calibration", 16)
    ptq.add_argument(
        "--method",
        nargs="+",
        choices=("rtn", "gptq", "awq", "smoothquant", "rtn+rot", "gptq+rot", "qep"),
        default=["rtn", "gptq", "awq"],
        help="methods to compare (default: rtn gptq awq): round to nearest, "
        "GPTQ, AWQ; smoothquant: RTN after SmoothQuant's scales (alpha 0.5, "
        "for W8A8); rtn+rot, gptq+rot: after a random Hadamard rotation; "
        "qep: GPTQ after quantization error propagation",
    )
    ptq.add_argument("--out", help="output folder (default: DIR/ptq-CONFIG)")
    ptq.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ptq.set_defaults(run=_ptq)

    search = sub.add_parser(
        "search",
        help="choose each layer's format of a trained float32 model under a bit budget",
        description="Read the float32 params that 'qbits train' saved in --run, "
        "measure each weight matmul's loss change under each CANDIDATE on "
        "calibration batches of the training data, choose one per matmul so "
        "that the stored weights fit --budget (an exact knapsack), and write "
        "the per-layer rules as YAML (--out) and a report beside it (.md) with "
        "the held-out loss. The YAML trains too: qbits train FILE.",
    )
    search.add_argument(
        "candidates",
        nargs="+",
        metavar="CANDIDATE",
        help="the formats a layer may take: preset names (e.g. w4a8 int8_fwd), "
        "YAML files of one matmul config, or none (float)",
    )
    _saved_run_options(search, "--batches", 4)
    search.add_argument(
        "--budget", type=float, required=True,
        help="mean stored bits per weight (scales included), or bytes with --unit",
    )  # fmt: skip
    search.add_argument("--unit", choices=("bits", "bytes"), default="bits")
    search.add_argument(
        "--out", help="the YAML file to write (default: DIR/search-BUDGET.yaml)"
    )
    search.add_argument("-q", "--quiet", action="store_true", help="no progress")
    search.set_defaults(run=_search)

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
        "--checkpoint",
        metavar="DIR",
        help="decode from the LM's checkpoint that qbits export wrote (GPTQ, "
        "compressed-tensors), served on its stored codes and scales",
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

    imported = sub.add_parser(
        "import",
        help="read and check a pre-quantized checkpoint (GPTQ, compressed-tensors)",
        description="Read a checkpoint folder that PyTorch tools quantized "
        "(config.json's quantization_config and the safetensors shards) into "
        "qbits' stored weights, check every tensor against the declared "
        "format, and list each weight as qbits stores it. See "
        "docs/guides/checkpoint-formats.md.",
    )
    imported.add_argument("checkpoint", metavar="DIR", help="the checkpoint folder")
    imported.set_defaults(run=_import)

    export = sub.add_parser(
        "export",
        help="write a PTQ result of a trained LM as a GPTQ or compressed-tensors "
        "checkpoint",
        description="Quantize the float32 LM that 'qbits train' saved in --run by "
        "--method as CONFIG says (as 'qbits ptq' does, on its calibration batches) "
        "and write the stored weights to OUT as a safetensors checkpoint with "
        "config.json's quantization_config, for PyTorch serving engines and "
        "'qbits generate --checkpoint OUT'. See docs/guides/checkpoint-formats.md.",
    )
    export.add_argument(
        "config", metavar="CONFIG", help="a weight format: preset or YAML file"
    )
    export.add_argument("out", metavar="OUT", help="the checkpoint folder to write")
    _saved_run_options(export, "--calibration", 16)
    export.add_argument(
        "--format", choices=("gptq", "gptq_v2", "compressed-tensors"),
        default="compressed-tensors", help="(default: %(default)s)",
    )  # fmt: skip
    export.add_argument(
        "--method", choices=("rtn", "gptq", "qep", "awq"),
        default="gptq", help="(default: %(default)s; awq folds its scales into the "
        "layers before: see the guide)",
    )  # fmt: skip
    export.set_defaults(run=_export)
    return parser
