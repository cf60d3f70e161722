"""The ``qbits`` command: train example models, run ablation sweeps, inspect configs.

::

    qbits train [CONFIG] [--model lm|mlp] [--steps N] [--seed S] [--out DIR] [--rerun]
    qbits sweep SWEEP.yaml [--out DIR] [--rerun]
    qbits ptq CONFIG --run DIR [--method rtn gptq awq ...] [--calibration N] [--out DIR]
    qbits search CANDIDATE... --run DIR --budget B [--unit bits|bytes] [--out FILE]
    qbits inspect CONFIG [--model lm|mlp]
    qbits generate [--prompt TEXT | --prompt-file FILE] [--cache CACHE] [--run DIR]
                   [--checkpoint DIR]
    qbits presets
    qbits import DIR
    qbits export CONFIG OUT --run DIR [--method rtn|gptq|qep] [--format FORMAT]

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
import os
import signal
import sys
import warnings
from collections.abc import Sequence

from qbits.cli._common import (
    _PROG,
    UsageError,
)
from qbits.cli._parser import (
    _parser,
)

__all__ = [
    "main",
]


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
    from qbits._experiments import SweepError

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
