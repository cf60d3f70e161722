"""Post-training quantization of a trained example model (``qbits ptq``).

:func:`post_train` reads the float32 params that ``qbits train`` saves
(``runs/float32__seed<S>.params`` in its output folder), quantizes their
weights with :func:`qbits.ptq.quantize_weights` by each method on
calibration batches of the training data (drawn from keys that training
never uses), evaluates each result on the held-out batches that training
evaluated on, and writes the same table, CSV and JSON as a sweep
(:func:`~qbits._experiments.write_report`), the float32 model first, and
``eval_loss.png`` (each method's eval loss beside float32's) in place of
the loss curves: nothing here trains. The float32 row keeps its training
loss; the time columns of the table are "—" for it (evaluated here, not
trained), and a method's time is its statistics and quantization.
"""

from __future__ import annotations

import math
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import qbits
from qbits import ptq
from qbits._errors import InvalidArgumentError, check_int
from qbits._experiments._models import spec as model_spec
from qbits._experiments._report import write_report
from qbits._experiments._saved import load_trained
from qbits._experiments._sweep_file import config_bits
from qbits._experiments._train import (
    eval_batches,
    loss_and_accuracy,
    train_batch,
)

__all__ = ["post_train", "ptq_trained"]

_OWNER = "qbits ptq"
#: Calibration batches are training batches at steps from here on: no
#: training run of the example models gets that far.
_CALIBRATION_STEP = 2**30


#: The methods of ``qbits ptq``: :func:`qbits.ptq.quantize_weights`' keywords.
METHODS = {
    "rtn": {"method": ptq.Rtn()},
    "gptq": {"method": ptq.Gptq()},
    "awq": {"method": ptq.Awq()},
    "smoothquant": {"method": ptq.Rtn(), "smooth": 0.5},
    "rtn+rot": {"method": ptq.Rtn(), "rotate": True},
    "gptq+rot": {"method": ptq.Gptq(), "rotate": True},
    "qep": {"method": ptq.Qep()},
}


def post_train(
    run_dir: str | os.PathLike,
    config: Any,
    out: str | os.PathLike,
    *,
    name: str = "ptq",
    methods: Sequence[str] = ("rtn", "gptq", "awq"),
    calibration: int = 16,
    seed: int | None = None,
    progress: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> list[dict[str, Any]]:
    """Quantizes a trained float32 example model after training, by each method.

    Each method's weights are evaluated with the rest of the config applied
    (:attr:`qbits.ptq.PtqResult.config`: a weight-only config runs the float
    model on the quantized weights; W8A8 quantizes the activations too).

    Args:
      run_dir: The output folder of ``qbits train``.
      config: The weight rules: a :class:`~qbits.QuantConfig`, a config, a
        preset name or a YAML path.
      out: The folder the report is written to (made when the results are
        in: a call that fails leaves nothing behind). Not the folder of a
        training run or sweep (its report would be replaced).
      name: The config's name in the table (rows ``<name> <method>``).
      methods: Names in :data:`METHODS`: ``"rtn"``, ``"gptq"``, ``"awq"``
        (:func:`qbits.ptq.quantize_weights`' methods), ``"smoothquant"``
        (round to nearest after SmoothQuant's scales, alpha 0.5: for W8A8),
        ``"rtn+rot"`` and ``"gptq+rot"`` (after a randomized Hadamard
        rotation of every quantized matmul's input channels), ``"qep"``
        (:class:`qbits.ptq.Qep`: GPTQ after correcting each weight for the
        error of the weights before it; a calibration pass per weight).
      calibration: Number of calibration batches (training batches at steps
        training never reaches).
      seed: Which saved run (needed only when ``run_dir`` has several).
      progress: A progress bar over the layers of each method.
      log: Called with one line per method.

    Returns:
      The summary rows (:func:`~qbits._experiments.summarize`): float32 first.

    Raises:
      InvalidArgumentError: For a folder without saved params (or with
        several, and no ``seed``), ``calibration < 1``, an ``out`` that
        holds the report of a training run or sweep (``run_dir`` itself,
        say), and the errors of :func:`qbits.ptq.quantize_weights`.
      ConfigError: For a bad config.

    Example:
      After ``qbits train --out run`` (which saves the float32 params),
      ``post_train("run", "w4g128_asym", "run/ptq")`` writes the report. A
      folder without them is refused:

      >>> import tempfile
      >>> from qbits._experiments import post_train
      >>> post_train(tempfile.mkdtemp(), "nf4", "out")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      qbits.InvalidArgumentError: qbits ptq: run_dir=... is not
      allowed (it holds no saved params); expected the output folder of 'qbits
      train' (it saves the float32 params as runs/float32__seed<S>.params).
    """
    check_int(_OWNER, "calibration", calibration, 1, 1 << 20)
    for method in methods:
        if method not in METHODS:
            raise InvalidArgumentError(
                _OWNER, "methods", method, "names among " + ", ".join(METHODS)
            )
    quant = qbits.config._as_quant_config(_OWNER, config)
    _check_out(run_dir, out, name)
    model, data, run = load_trained(run_dir, seed, owner=_OWNER)
    spec = model_spec(run["model"], run["size"])
    fn, params = qbits.nnx.as_function(model)
    batches = _calibration_batches(spec, data, run["seed"], calibration)
    eval_x, eval_y = eval_batches(spec, data)

    def evaluate(fn: Callable[..., Any], params: Any) -> tuple[float, float]:
        @jax.jit
        def metrics(params):
            def one(x, y):
                return jnp.stack(loss_and_accuracy(fn(params, x)[0], y))

            return jax.lax.map(lambda xy: one(*xy), (eval_x, eval_y)).mean(0)

        loss, accuracy = metrics(params)
        return float(loss), float(accuracy)

    loss, accuracy = evaluate(fn, params)
    # Evaluated here, not trained: no time (the report shows "—", never nan).
    result, nan = run["result"], math.nan
    runs = [_row(run["name"], run, 32.0, result["train_loss"], loss, accuracy, nan)]
    bits = config_bits(quant)
    tic = time.perf_counter()
    stats = ptq.collect_stats(fn, params, batches, config=quant)
    collect_seconds = time.perf_counter() - tic
    for method in methods:
        tic = time.perf_counter()
        kwargs = _method_kwargs(method, run, spec)
        # A propagated method runs the batches again (the statistics of the
        # quantized model's activations), as a folded one does (those of
        # the folded layers' inputs).
        again = kwargs["method"].propagated or "fold" in kwargs
        given = (batches, None) if again else (None, stats)
        got = ptq.quantize_weights(  # the config as given: its name in errors
            fn, params, given[0], config, stats=given[1], progress=progress, **kwargs
        )
        # Each method's time includes collecting the statistics once.
        seconds = time.perf_counter() - tic + collect_seconds
        # A key for configs whose backward rounds stochastically (unused).
        quantized = got.function(fn, key=jax.random.key(0))
        loss, accuracy = evaluate(quantized, got.params)
        runs.append(_row(f"{name} {method}", run, bits, nan, loss, accuracy, seconds))
        log(f"{name} {method}: eval loss {loss:.4f} ({seconds:.1f} s)")
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    title = f"qbits ptq {run['model']} {name} ({run['name']}, seed {run['seed']})"
    return write_report(title, runs, out, baseline=run["name"])


def _calibration_batches(spec: Any, data: Any, seed: int, n: int) -> list[Any]:
    """``n`` training batches at steps that training never reaches."""
    steps = range(_CALIBRATION_STEP, _CALIBRATION_STEP + n)
    return [train_batch(spec, data, seed, s)[0] for s in steps]


def ptq_trained(
    run_dir: str | os.PathLike,
    config: Any,
    method: str,
    *,
    calibration: int = 16,
    seed: int | None = None,
) -> tuple[Any, Any, dict[str, Any], ptq.PtqResult]:
    """One method of :func:`post_train` on a saved float32 run, its result kept.

    The LM's AWQ folds its scales into the layers before (:func:`lm_fold`),
    as :func:`post_train` does: its weights lie on their grids and are
    stored (``qbits export --method awq``).

    Returns:
      ``(model, data, run, result)``: the float model (as
      :func:`load_trained` gives it), its data, the run file's data and the
      :class:`qbits.ptq.PtqResult` of ``nnx.as_function(model)`` (``method``
      in :data:`METHODS`, on the calibration batches ``qbits ptq`` uses).

    Raises:
      InvalidArgumentError: As :func:`post_train`.

    Example:
      >>> import tempfile
      >>> from qbits._experiments import ptq_trained
      >>> ptq_trained(tempfile.mkdtemp(), "int8_fwd", "rtn")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      qbits.InvalidArgumentError: ...holds no saved params...
    """
    check_int(_OWNER, "calibration", calibration, 1, 1 << 20)
    if method not in METHODS:
        raise InvalidArgumentError(
            _OWNER, "method", method, "one of " + ", ".join(METHODS)
        )
    model, data, run = load_trained(run_dir, seed, owner=_OWNER)
    spec = model_spec(run["model"], run["size"])
    fn, params = qbits.nnx.as_function(model)
    batches = _calibration_batches(spec, data, run["seed"], calibration)
    kwargs = _method_kwargs(method, run, spec)
    return model, data, run, ptq.quantize_weights(fn, params, batches, config, **kwargs)


def _method_kwargs(method: str, run: dict[str, Any], spec: Any) -> dict[str, Any]:
    """``quantize_weights``' arguments for ``method`` on a saved run.

    QuaRot's random signs from the run's seed; the LM's AWQ folded into the
    layers before (:func:`lm_fold`), so that the AWQ a report shows is the
    one that is stored, served and exported (the MLP's layers before are
    ReLUs: its AWQ keeps ``Q(s w) / s`` in float).
    """
    kwargs = dict(METHODS[method])
    if kwargs.get("rotate"):
        kwargs["key"] = jax.random.key(run["seed"])
    if method == "awq" and run["model"] == "lm":
        kwargs["fold"] = lm_fold(spec.depth)
    return kwargs


def lm_fold(depth: int) -> dict[str, tuple[str, ...]]:
    """Where AWQ's scales fold in the example LM (``quantize_weights(fold=)``).

    Per block: ``value``'s output channels before ``out`` (attention mixes
    positions, not channels: ``out`` reads ``value``'s channels as they
    are), then ``norm1`` (its scale and bias) before ``query``, ``key`` and
    ``value``, ``norm2`` before ``fc1``; the final ``norm`` before
    ``head``. ``fc2`` follows a GELU: nothing to fold into (``s = 1``).

    Example:
      >>> from qbits._experiments._ptq import lm_fold
      >>> lm_fold(1)["blocks/0/norm1"]
      ('blocks/0/attn/query', 'blocks/0/attn/key', 'blocks/0/attn/value')
    """
    fold: dict[str, tuple[str, ...]] = {}
    for i in range(depth):
        b = f"blocks/{i}"
        fold[f"{b}/attn/value"] = (f"{b}/attn/out",)
        fold[f"{b}/norm1"] = tuple(f"{b}/attn/{m}" for m in ("query", "key", "value"))
        fold[f"{b}/norm2"] = (f"{b}/mlp/fc1",)
    fold["norm"] = ("head",)
    return fold


def _check_out(run_dir: str | os.PathLike, out: str | os.PathLike, name: str) -> None:
    """Refuses an ``out`` whose report a PTQ report would replace.

    That is ``run_dir`` itself, or any folder that holds the report and run
    files of ``qbits train`` or ``qbits sweep`` (``results.json`` and
    ``runs/``); a PTQ report has no ``runs/``.
    """
    folder = pathlib.Path(out)
    try:
        same = os.path.samefile(folder, run_dir)
    except (OSError, ValueError):  # one of them does not exist
        same = False
    trained = (folder / "runs").is_dir() and (folder / "results.json").is_file()
    if same or trained:
        raise InvalidArgumentError(
            _OWNER,
            "out",
            os.fspath(out),
            f"a folder of its own, e.g. {os.path.join(run_dir, f'ptq-{name}')} "
            "(qbits ptq's default)",
            why="it holds the report of a training run, which the PTQ report "
            "would replace",
        )


def _row(
    name: str,
    run: dict[str, Any],
    bits: float,
    train_loss: float,
    eval_loss: float,
    accuracy: float,
    seconds: float,
) -> dict[str, Any]:
    """One row in the run-file format that :func:`write_report` reads."""
    curves = run["result"] if name == run["name"] else {"curve": [], "eval_curve": []}
    return {
        "name": name,
        "seed": run["seed"],
        "bits": bits,
        "model": run["model"],
        "size": run["size"],
        "result": {
            "train_loss": train_loss,
            "eval_loss": eval_loss,
            "eval_accuracy": accuracy,
            "curve": curves["curve"],
            "eval_curve": curves["eval_curve"],
            "seconds": seconds,
        },
    }
