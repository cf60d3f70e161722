"""What the verbs of the ``qbits`` command share: errors, configs, folders, progress."""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import sys
from collections.abc import Callable, Iterator

_PROG = "qbits"


_MAX_SEED = 2**32 - 1  # JAX keys of larger seeds repeat those of smaller ones


_MAX_STEPS = 2**31 - 1  # the step counter is an int32


class UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


def _config(arg: str):
    """A preset name or a YAML file -> (name, QuantConfig or None, origin).

    ``origin`` holds the :class:`~qbits._experiments.Entry` fields that place
    the config's errors found during training: the file, or the preset.
    """
    import qbits

    path = pathlib.Path(arg)
    if arg in qbits.presets.names() and not path.is_file():
        config = None if arg == "none" else qbits.QuantConfig(default=arg)
        return arg, config, {"where": arg, "single": True}
    if path.suffix in (".yaml", ".yml") or path.exists():
        config = qbits.load_config(path, None)
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


def progress_bar(total: int, desc: str, unit: str, *, disable: bool = False):
    """A tqdm bar on stderr that goes away when done."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        leave=False,
        # A terminal that reports no size (0 columns) still gets a bar.
        ncols=shutil.get_terminal_size().columns or 100,
        file=sys.stderr,
        disable=disable,
    )


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
        bar = progress_bar(self.steps, f"[{index + 1}/{total}] {run_id}", "step")
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
