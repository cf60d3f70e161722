"""``qbits inspect`` (a config's layer table; its GPU program) and ``qbits presets``."""

from __future__ import annotations

import argparse

from qbits.cli._common import (
    UsageError,
    _config,
)


def _inspect(args: argparse.Namespace) -> int:
    if args.target:
        return _inspect_target(args)

    import qbits
    from qbits._experiments import build_model, sample_batch, spec

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
        from qbits._experiments import diagnose_batches

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
    from qbits._experiments import gpu_step

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
    memory = ""
    if programs[name].temp_bytes is not None:
        memory = (
            f"; temporaries {programs[name].temp_bytes / 2**20:.0f} MiB against "
            f"bf16's {programs['bf16'].temp_bytes / 2**20:.0f} MiB"
        )
    print(
        f"bf16: {len(programs['bf16'].gemms)} GEMMs, estimated {base:.2f} ms; "
        f"{name} estimated {base / mine:.2f}x bf16's device time "
        f"({programs[name].target.measured}){memory}"
    )
    return 0


def _presets(args: argparse.Namespace) -> int:
    import qbits

    del args
    for name in qbits.presets.names():
        print(f"{name:<18} {qbits.presets.describe(name).splitlines()[0]}")
    return 0
