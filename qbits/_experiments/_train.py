"""The training loop of the example models, quantized by a per-layer config.

:func:`train` builds the model from a seed, quantizes a copy with
:func:`qbits.nnx.quantize` (so the float and the quantized run start from the
same parameters), and trains it with AdamW (linear warm-up, cosine decay) on
batches that are a function of ``(seed, step)`` only. The float32 baseline is
the same call with ``config=None``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import qbits
import qbits.diagnostics
import qbits.hlo
import qbits.optim
from qbits._errors import check_int
from qbits._experiments import _data as data_lib
from qbits._experiments._models import Classifier, ModelSpec, TransformerLM

__all__ = ["RunResult", "build_model", "diagnose_batches", "train"]


@dataclasses.dataclass(frozen=True)
class RunResult:
    """The outcome of one training run.

    Attributes:
      train_loss: Mean training loss over the last 10% of the steps.
      eval_loss: Loss on the held-out data after the last step.
      eval_accuracy: Next-character (``lm``) or class (``mlp``) accuracy on
        the held-out data.
      curve: Training loss at every step.
      eval_curve: ``(step, eval loss)`` at each evaluation.
      seconds: Wall-clock time of the run, compilation included.
      compile_seconds: Time to trace, lower and compile the training step.
      step_seconds: Median wall-clock time of one training step (compiled).
      unused_rules: A sentence naming the config's rules that matched no
        matmul, or ``""``.
      diagnostics: With ``train(..., diagnostics=N)``: the quantization
        metrics of every quantized operand every ``N`` steps and after the
        last, one record per step, matmul (and layer) and operand
        (:meth:`qbits.diagnostics.Metrics.rows` with ``"step"``).

    Example:
      >>> from qbits._experiments import spec, train
      >>> result = train(spec("mlp", "tiny"), "int8_fwd", steps=2)
      >>> sorted(result.as_dict())[:3]
      ['compile_seconds', 'curve', 'diagnostics']
    """

    train_loss: float
    eval_loss: float
    eval_accuracy: float
    curve: list[float]
    eval_curve: list[tuple[int, float]]
    seconds: float
    unused_rules: str = ""
    compile_seconds: float = math.nan
    step_seconds: float = math.nan
    diagnostics: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The result as plain JSON-able data."""
        return dataclasses.asdict(self)


def build_model(spec: ModelSpec, seed: int) -> tuple[nnx.Module, Any]:
    """The float model of ``spec`` initialised from ``seed``, and its data.

    Example:
      >>> from qbits._experiments import build_model, spec
      >>> model, data = build_model(spec("mlp", "tiny"), seed=0)
      >>> type(model).__name__, data.classes
      ('Classifier', 10)
    """
    rngs = nnx.Rngs(params=seed)
    if spec.model == "lm":
        data = data_lib.char_data()
        return TransformerLM(data.vocab, spec, rngs=rngs), data
    data = data_lib.class_data()
    return Classifier(data.x.shape[1], data.classes, spec, rngs=rngs), data


def sample_batch(spec: ModelSpec, data: Any) -> Any:
    """Inputs of one training batch: what the model is quantized and traced on.

    Abstract data (from ``nnx.eval_shape``) gives a ``jax.ShapeDtypeStruct``.

    Example:
      >>> from qbits._experiments import build_model, sample_batch, spec
      >>> s = spec("lm", "tiny")
      >>> sample_batch(s, build_model(s, seed=0)[1]).shape == (s.batch, s.context)
      True
    """
    lm = spec.model == "lm"
    inputs = data.train if lm else data.x
    shape = (spec.batch, spec.context) if lm else (spec.batch, *inputs.shape[1:])
    if isinstance(inputs, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, inputs.dtype)
    if lm:
        return inputs[: spec.batch * spec.context].reshape(shape)
    return inputs[: spec.batch]


def train_batch(spec: ModelSpec, data: Any, seed: int, step: Any) -> tuple[Any, Any]:
    """``(inputs, labels)`` of training step ``step`` of a run with ``seed``.

    A function of ``(seed, step)`` only (traceable: ``step`` may be traced).

    Example:
      >>> from qbits._experiments._train import build_model, train_batch
      >>> from qbits._experiments import spec
      >>> s = spec("mlp", "tiny")
      >>> x, y = train_batch(s, build_model(s, 0)[1], 0, 3)
      >>> x.shape[0] == y.shape[0] == s.batch
      True
    """
    key = jax.random.fold_in(jax.random.key(seed), step)
    if spec.model == "lm":
        return data_lib.char_batch(data.train, key, spec.batch, spec.context)
    idx = jax.random.randint(key, (spec.batch,), 0, data.x.shape[0])
    return data.x[idx], data.y[idx]


def eval_batches(spec: ModelSpec, data: Any) -> tuple[jax.Array, jax.Array]:
    """The held-out ``(inputs, labels)``, stacked: ``spec.eval_batches`` batches.

    Example:
      >>> from qbits._experiments._train import build_model, eval_batches
      >>> from qbits._experiments import spec
      >>> s = spec("mlp", "tiny")
      >>> x, y = eval_batches(s, build_model(s, 0)[1])
      >>> x.shape[:2] == y.shape == (s.eval_batches, s.batch)
      True
    """
    if spec.model == "lm":
        return data_lib.char_eval_batches(
            data.eval, spec.eval_batches, spec.batch, spec.context
        )
    n = spec.eval_batches * spec.batch
    x = data.x_eval[:n].reshape(spec.eval_batches, spec.batch, -1)
    return x, data.y_eval[:n].reshape(spec.eval_batches, spec.batch)


def loss_and_accuracy(
    logits: jax.Array, labels: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy and accuracy of ``logits`` against integer ``labels``.

    Example:
      >>> from qbits._experiments._train import loss_and_accuracy
      >>> loss, acc = loss_and_accuracy(jnp.array([[2.0, 0.0]]), jnp.array([0]))
      >>> round(float(loss), 4), float(acc)
      (0.1269, 1.0)
    """
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    hits = (jnp.argmax(logits, -1) == labels).astype(jnp.float32).mean()
    return loss, hits


#: The optimizers of ``ModelSpec.optimizer``: AdamW and its quantized states.
OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit")


def make_optimizer(name: str, schedule: Any) -> optax.GradientTransformation:
    """The AdamW of the example models (weight decay 0.01), states as ``name`` says.

    Example:
      >>> from qbits._experiments._train import make_optimizer
      >>> type(make_optimizer("adamw8bit", 1e-3)).__name__
      'GradientTransformationExtraArgs'
    """
    if name not in OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {name!r}; expected one of: {', '.join(OPTIMIZERS)}"
        )
    if name == "adamw":
        return optax.adamw(schedule, weight_decay=0.01)
    bits = 8 if name == "adamw8bit" else 4
    return qbits.optim.adamw(schedule, weight_decay=0.01, state_bits=bits)


def _compiler_options(
    spec: ModelSpec, quantized: bool = False
) -> dict[str, Any] | None:
    """XLA options for a training step.

    Quick, unoptimized compilation for smoke-test sizes; on a GPU, a
    quantized step's 8-bit dots straight to cuBLASLt
    (:data:`qbits.hlo.GPU_COMPILER_OPTIONS`).
    """
    options: dict[str, Any] = {}
    if spec.fast_compile:
        options.update(
            xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True
        )
    if quantized and jax.default_backend() == "gpu":
        options.update(qbits.hlo.GPU_COMPILER_OPTIONS)
    return options or None


def train(
    spec: ModelSpec,
    config: Any = None,
    *,
    seed: int = 0,
    steps: int | None = None,
    progress: Callable[[int, float], None] | None = None,
    on_trained: Callable[[nnx.Module], Any] | None = None,
    diagnostics: int = 0,
) -> RunResult:
    """Trains the example model of ``spec`` with its matmuls quantized by ``config``.

    Args:
      spec: The model, its sizes and hyperparameters (:func:`spec`).
      config: A :class:`~qbits.QuantConfig`, a :class:`~qbits.DotGeneralConfig`
        or a preset name; ``None`` (or ``"none"``) trains in float32.
      seed: Seed of the initial parameters, the data order and the keys of
        stochastic rounding (evaluations do not advance those keys, so a
        run's training does not depend on how often it is evaluated).
      steps: Training steps (default ``spec.steps``).
      progress: Called as ``progress(step, loss)`` after every step.
      on_trained: Called with the trained model (the nnx module, quantized
        as ``config`` says) before returning: to keep it, e.g. for
        post-training quantization of a float32 run.
      diagnostics: Every this many steps (and after the last), measure
        every quantized operand on that step's batch
        (:mod:`qbits.diagnostics`: a separate jitted gradient with respect
        to the probes, outside the training step, which stays as it is);
        ``0``: never.

    Returns:
      A :class:`RunResult`.

    Raises:
      InvalidArgumentError: For a seed outside ``0..2**32 - 1`` (JAX keys of
        larger seeds repeat those of smaller ones) or ``steps`` outside
        ``0..2**31 - 1`` (the step counter is an int32).
      ConfigError: For a config that does not fit a layer (e.g. a tile size
        that does not divide its axis), naming the layer.

    Example:
      >>> from qbits._experiments import spec, train
      >>> result = train(spec("mlp", "tiny"), "int8_fwd", steps=2)
      >>> len(result.curve), result.eval_loss > 0
      (2, True)
    """
    start = time.perf_counter()
    check_int("train", "seed", seed, 0, 2**32 - 1)
    steps = spec.steps if steps is None else steps
    check_int("train", "steps", steps, 0, 2**31 - 1)  # the step counter is int32
    check_int("train", "diagnostics", diagnostics, 0, 2**31 - 1)
    model, data = build_model(spec, seed)
    order = []
    if diagnostics and config is not None:  # the matmuls in the model's order
        table = qbits.nnx.layer_table(model, config, sample_batch(spec, data))
        order = [row.path for row in table.rows]
    unused = ""
    if config is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", qbits.config.UnusedRuleWarning)
            model = qbits.nnx.quantize(
                model, config, sample_batch(spec, data), rngs=nnx.Rngs(quant=seed)
            )
        unused = "; ".join(
            str(w.message)
            for w in caught
            if issubclass(w.category, qbits.config.UnusedRuleWarning)
        )
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, spec.lr, max(1, steps // 10), max(steps, 2), spec.lr / 10
    )
    tx = make_optimizer(spec.optimizer, schedule)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    wrt = nnx.DiffState(0, (nnx.Param, qbits.nnx.ScaleState))

    batch_of = functools.partial(train_batch, spec, data, seed)
    eval_x, eval_y = eval_batches(spec, data)

    # The functional nnx style: one jax.jit over the state of the model and
    # the optimizer (the keys of stochastic rounding advance inside it).
    graphdef, state = nnx.split((model, optimizer))
    options = _compiler_options(spec, quantized=config is not None)
    jit = functools.partial(jax.jit, compiler_options=options)

    @jit
    def step_fn(state, step):
        model, optimizer = nnx.merge(graphdef, state)
        x, y = batch_of(step)
        loss, grads = nnx.value_and_grad(
            lambda m: loss_and_accuracy(m(x), y)[0], argnums=wrt
        )(model)
        # Delayed-scaling configs: the "gradient" of their state is the new
        # state; write it and give the optimizer the parameter gradients.
        grads = qbits.nnx.update_state(model, grads)
        # optax's bias correction computes float ** int32, which strict dtype
        # promotion refuses; the model itself runs under the caller's setting.
        with jax.numpy_dtype_promotion("standard"):
            optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    @jit
    def eval_fn(state):
        model, _ = nnx.merge(graphdef, state)
        losses, hits = [], []
        for i in range(spec.eval_batches):
            loss, hit = loss_and_accuracy(model(eval_x[i]), eval_y[i])
            losses.append(loss)
            hits.append(hit)
        return jnp.stack(losses).mean(), jnp.stack(hits).mean()

    diagnose = None
    if diagnostics and config is not None:
        diagnose = _diagnostics_step(graphdef, config, batch_of, seed, jit)
    measured: list[dict[str, Any]] = []
    eval_at = {round(steps * (i + 1) / spec.evals) for i in range(spec.evals)} | {steps}
    curve: list[float] = []
    eval_curve: list[tuple[int, float]] = []
    eval_loss = accuracy = math.nan
    tic = time.perf_counter()
    step_fn = step_fn.lower(state, jnp.asarray(0, jnp.int32)).compile()
    compile_seconds = time.perf_counter() - tic
    step_times: list[float] = []
    for step in range(steps):
        tic = time.perf_counter()
        state, loss = step_fn(state, jnp.asarray(step, jnp.int32))
        curve.append(float(loss))
        step_times.append(time.perf_counter() - tic)
        if progress is not None:
            progress(step + 1, curve[-1])
        if diagnose is not None and (
            (step + 1) % diagnostics == 0 or step + 1 == steps
        ):
            raw = diagnose(state, jnp.asarray(step, jnp.int32))
            metrics = _in_order(qbits.diagnostics.read(raw), order)
            measured += [_record(step + 1, row) for row in metrics.rows()]
        if step + 1 in eval_at:
            ev, acc = eval_fn(state)
            eval_loss, accuracy = float(ev), float(acc)
            eval_curve.append((step + 1, eval_loss))
    if steps == 0:
        ev, acc = eval_fn(state)
        eval_loss, accuracy = float(ev), float(acc)
    if on_trained is not None:
        on_trained(nnx.merge(graphdef, state)[0])
    tail = curve[-max(1, steps // 10) :] or [math.nan]
    return RunResult(
        train_loss=sum(tail) / len(tail),
        eval_loss=eval_loss,
        eval_accuracy=accuracy,
        curve=curve,
        eval_curve=eval_curve,
        seconds=time.perf_counter() - start,
        compile_seconds=compile_seconds,
        step_seconds=float(np.median(step_times)) if step_times else math.nan,
        unused_rules=unused,
        diagnostics=measured,
    )


def diagnose_batches(
    spec: ModelSpec, config: Any, batches: int = 4, seed: int = 0
) -> qbits.diagnostics.Metrics:
    """The diagnostics of the example model at initialisation, over batches.

    The model of ``spec`` (initialised from ``seed``) quantized by
    ``config``, its training loss on ``batches`` training batches
    differentiated as a training step would (:func:`qbits.diagnostics.diagnose`);
    each metric is the mean over the batches (``qbits inspect --diagnostics``).

    Example:
      >>> from qbits._experiments import diagnose_batches, spec
      >>> m = diagnose_batches(spec("mlp", "tiny"), "w4a8")  # doctest: +SKIP
      >>> print(m.table())  # doctest: +SKIP
      | sqnr_db | fwd.lhs | fwd.rhs |
      |---|---|---|
      | layers/0 | 38.1 | 20.3 |
      | head | 40.2 | 20.9 |
    """
    check_int("diagnose_batches", "batches", batches, 1, 1 << 20)
    model, data = build_model(spec, seed)
    fn, params = qbits.nnx.as_function(model)

    def loss(params: Any, x: Any, y: Any) -> jax.Array:
        return loss_and_accuracy(fn(params, x)[0], y)[0]

    diagnose = qbits.diagnostics.diagnose(loss, config, jax.random.key(seed))
    found = [
        diagnose(params, *train_batch(spec, data, seed, i))[1] for i in range(batches)
    ]

    def mean(arrays: list[np.ndarray]) -> np.ndarray:  # NaN where none measured
        stacked = np.stack(arrays)
        n = np.sum(~np.isnan(stacked), axis=0)
        return np.where(n > 0, np.nansum(stacked, axis=0) / np.maximum(n, 1), np.nan)

    values = {
        path: {
            op: {k: mean([m.values[path][op][k] for m in found]) for k in by_metric}
            for op, by_metric in by_op.items()
        }
        for path, by_op in found[0].values.items()
    }
    table = qbits.nnx.layer_table(model, config, sample_batch(spec, data))
    return _in_order(qbits.diagnostics.Metrics(values), [r.path for r in table.rows])


def _record(step: int, row: dict[str, Any]) -> dict[str, Any]:
    """One diagnostics record of a run file: metrics to 5 significant digits."""
    return {"step": step} | {
        k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in row.items()
    }


def _in_order(metrics: qbits.diagnostics.Metrics, paths: list[str]) -> Any:
    """``metrics`` with its matmuls in the order of ``paths`` (the model's)."""
    rank = {p: i for i, p in enumerate(paths)}
    ordered = sorted(metrics.values, key=lambda p: (rank.get(p, len(rank)), p))
    return qbits.diagnostics.Metrics({p: metrics.values[p] for p in ordered})


def _diagnostics_step(
    graphdef: Any, config: Any, batch_of: Callable[[Any], Any], seed: int, jit: Any
) -> Callable[[Any, Any], Any]:
    """A jitted ``(state, step) -> probe gradients`` of the training loss.

    The model's forward (:func:`qbits.nnx.as_function`) quantized by
    ``config`` with probes (:func:`qbits.diagnostics.init`), its loss on
    the step's batch differentiated with respect to the parameters and the
    probes, as the training step differentiates it; its own key stream
    (the training's is not advanced) and the model's scale state.
    """

    @jit
    def diagnose(state: Any, step: Any) -> Any:
        model, _ = nnx.merge(graphdef, state)
        fn, params = qbits.nnx.as_function(model)
        x, y = batch_of(step)
        node = model.qbits  # the quantized copy's own node (qbits.nnx)
        scale = {p: {k: v[...] for k, v in e.items()} for p, e in node.state.items()}
        key = jax.random.fold_in(jax.random.key(seed), step)
        quantized = functools.partial(
            qbits.quantize, fn, config, key, state=scale or None
        )
        probes = qbits.diagnostics.init(fn, config, params, x)

        def loss(params: Any, probes: Any) -> jax.Array:
            out, _ = quantized(diagnostics=probes)(params, x)
            return loss_and_accuracy(out, y)[0]

        # The parameters too: the weight-gradient matmuls then run (and
        # their operands are measured) as in training.
        return jax.grad(loss, argnums=(0, 1))(params, probes)[1]

    return diagnose
