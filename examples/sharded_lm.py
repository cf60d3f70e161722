"""A quantized LM sharded FSDP x tensor parallel, on one process or several.

A small character-level transformer LM (linen, logical axis names), its
parameters sharded over a ``data`` x ``model`` mesh: the ``embed`` axis
over ``data`` (FSDP), the ``mlp``, ``heads`` and ``vocab`` axes over
``model`` (tensor parallel), the batch over ``data``. Every matmul is
quantized by ``qbits.flax.quantize`` with the config given on the command
line (a preset name such as ``int8`` or ``fp8_delayed``, or a YAML file),
trained with AdamW on the corpus that ships with qbits. Halfway, params,
optimizer state and qbits' scale state are saved with Orbax; at the end
they are restored and the second half is trained again from the
checkpoint, which must give the same losses.

The same code runs as one process over all its devices, or as one of N
processes of a ``jax.distributed`` job (one per host on TPUs and GPUs):
every process runs the same program on global arrays; each builds only
the rows of a batch its own devices hold
(``jax.make_array_from_callback``); Orbax writes each process's shards
and restores them onto the same shardings. Add ``--coordinator`` with
``--num-processes 1`` to run one process as a ``jax.distributed`` job
(on CPU, with gloo's collectives rather than XLA's in-process ones). On
one machine's CPU, ``examples/sharded_lm_launch.py`` starts the processes
and compares their losses with the one-process run::

    python examples/sharded_lm.py --cpu-devices 8             # 1 process
    python examples/sharded_lm_launch.py --processes 2        # 2 x 4, and 1 x 8

On each of N hosts (TPU or GPU; leave ``--cpu-devices`` out)::

    python examples/sharded_lm.py --coordinator HOST0:PORT \\
        --num-processes N --process-id I --checkpoint-dir /shared/ckpt

The last line printed is a JSON record: the losses of every step, the
losses after restoring, the mesh and the time taken.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import NoReturn

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import qbits

# The character corpus that ships with qbits (what `qbits train` uses):
# nothing is downloaded. qbits._experiments is not library API.
from qbits._experiments import _corpus

# Logical axis -> mesh axis: FSDP over `data`, tensor parallel over `model`.
RULES = (
    ("batch", "data"),
    ("embed", "data"),
    ("mlp", "model"),
    ("heads", "model"),
    ("vocab", "model"),
    ("kv", None),
    ("context", None),
)


def _init(axes):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes)


def _dense(features, axes, name):
    """A Dense layer whose kernel and bias are sharded by their logical axes."""
    bias = nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[-1:])
    return nn.Dense(features, kernel_init=_init(axes), bias_init=bias, name=name)


class Block(nn.Module):
    """Pre-norm causal self-attention and a GELU MLP."""

    width: int
    heads: int

    @nn.compact
    def __call__(self, x):
        kv = self.width // self.heads
        h = nn.LayerNorm(use_bias=False)(x)
        qkv = nn.DenseGeneral(
            (3, self.heads, kv),
            kernel_init=_init(("embed", None, "heads", "kv")),
            use_bias=False,
            name="qkv",
        )(h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(kv)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        ctx = jnp.einsum("bnts,bsnh->btnh", probs, v)
        x = x + nn.DenseGeneral(
            self.width,
            axis=(-2, -1),
            kernel_init=_init(("heads", "kv", "embed")),
            use_bias=False,
            name="out",
        )(ctx)
        h = nn.LayerNorm(use_bias=False)(x)
        h = _dense(4 * self.width, ("embed", "mlp"), "fc1")(h)
        h = _dense(self.width, ("mlp", "embed"), "fc2")(jax.nn.gelu(h))
        return x + h


class LM(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a vocabulary head."""

    vocab: int
    width: int
    heads: int
    layers: int
    context: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.width, embedding_init=_init(("vocab", "embed")))(
            tokens
        )
        pos = self.param("pos", _init(("context", "embed")), (self.context, self.width))
        x = x + pos[: tokens.shape[1]]
        for i in range(self.layers):
            x = Block(self.width, self.heads, name=f"blocks_{i}")(x)
        x = nn.LayerNorm(use_bias=False)(x)
        return _dense(self.vocab, ("embed", "vocab"), "head")(x)


def corpus_tokens() -> tuple[np.ndarray, int]:
    """The shipped corpus as int32 character ids, and the vocabulary size
    (rounded up to a multiple of 8, so that it splits over ``model``)."""
    text = np.frombuffer(_corpus.read().encode("latin-1"), np.uint8)
    chars, tokens = np.unique(text, return_inverse=True)
    return tokens.astype(np.int32), -(-len(chars) // 8) * 8


filled: set[tuple[int, int]] = set()  # the batch rows this process built


def global_batch(tokens, step, seed, batch, context, sharding):
    """Inputs and next-character targets of ``step``, as global arrays.

    Where each window starts is a function of ``(seed, step)`` that every
    process computes alike; each process fills only the rows its own
    devices hold (a data loader on many hosts reads only its shard).
    """
    starts = np.random.default_rng([seed, step]).integers(
        0, len(tokens) - context - 1, batch
    )

    def rows(offset):
        def fill(index):
            rows_, cols = index
            filled.add((rows_.start or 0, rows_.stop or batch))
            picked = starts[rows_][:, None] + np.arange(context)[cols][None, :]
            return tokens[picked + offset]

        return jax.make_array_from_callback((batch, context), sharding, fill)

    return rows(0), rows(1)


def _fail(message: str) -> NoReturn:
    print(f"sharded_lm: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    if args.cpu_devices:
        # Before anything touches a backend: N host devices per process.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.num_processes > 1 and not args.coordinator:
        _fail("--num-processes > 1 needs --coordinator HOST:PORT")
    if args.coordinator:
        if args.cpu_devices:
            # Cross-process collectives on CPU (gloo, over TCP).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            initialization_timeout=args.timeout,
            heartbeat_timeout_seconds=args.timeout,
        )
    start = time.perf_counter()
    devices = jax.device_count()
    if devices % args.model_parallel:
        _fail(
            f"{devices} devices do not split over --model-parallel "
            f"{args.model_parallel} (on CPU, --cpu-devices 8 makes 8)"
        )
    data = devices // args.model_parallel
    if args.batch % data:
        _fail(f"--batch {args.batch} does not split over {data} data-parallel shards")
    mesh = jax.make_mesh(
        (data, args.model_parallel), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )

    tokens, vocab = corpus_tokens()
    model = LM(vocab, args.width, args.heads, args.layers, args.context)
    qmodel = qbits.flax.quantize(model, args.config)
    sample = jnp.zeros((args.batch, args.context), jnp.int32)
    init = jax.jit(lambda key: qmodel.init(key, sample))
    logical = nn.get_partition_spec(jax.eval_shape(init, jax.random.key(args.seed)))
    shardings = nn.logical_to_mesh_sharding(logical, mesh, RULES)
    batch_sharding = NamedSharding(mesh, P("data", None))
    tx = optax.adamw(args.lr)

    @jax.jit
    def create(key):
        variables = jax.lax.with_sharding_constraint(nn.unbox(init(key)), shardings)
        state = qbits.flax.TrainState.create(
            apply_fn=qmodel.apply, params=variables, tx=tx
        )
        return state.replace(step=jnp.zeros((), jnp.int32))  # not weakly typed

    def step(state, inputs, targets):
        # Stochastic rounding (where the config has it): a key per step.
        key = jax.random.fold_in(jax.random.key(args.seed + 1), state.step)

        def loss_fn(variables):
            logits = state.apply_fn(variables, inputs, rngs={"quant": key})
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def train(state, first, last):
        losses = []
        for s in range(first, last):
            batch = global_batch(tokens, s, args.seed, args.batch, args.context,
                                 batch_sharding)  # fmt: skip
            state, loss = step(state, *batch)
            losses.append(float(loss))  # replicated: every process has it
            if jax.process_index() == 0 and args.verbose:
                print(f"step {s}: loss {losses[-1]:.6f}", file=sys.stderr)
        return state, losses

    def saved(state):  # what the checkpoint holds (not the functions)
        return {
            "step": state.step,
            "params": state.params,
            "opt_state": state.opt_state,
        }

    times = {}

    def timed(name, fn, *args):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times[name] = round(time.perf_counter() - t, 2)
        return out

    with jax.set_mesh(mesh):
        state = timed("init", create, jax.random.key(args.seed))
        # One program for every step: the state keeps its shardings.
        replicated = NamedSharding(mesh, P())
        step = jax.jit(
            step,
            out_shardings=(jax.tree.map(lambda x: x.sharding, state), replicated),
            donate_argnums=0,
        )
        half = args.steps // 2
        state, losses = timed("first half", train, state, 0, half)
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            saved(state),
        )
        # Every process calls save and restore: each writes and reads the
        # shards it holds; process 0 writes the metadata.
        path = pathlib.Path(args.checkpoint_dir).absolute() / f"step_{half}"
        # Replicated shards written whole (by one replica), not split into
        # one slice per replica: each slice would be a small compiled program.
        ocp.type_handlers.register_type_handler(
            jax.Array,
            ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
            override=True,
        )
        checkpointer = ocp.StandardCheckpointer()

        def save(state):
            checkpointer.save(path, saved(state), force=True)
            checkpointer.wait_until_finished()

        timed("save", save, state)
        template = state
        state, rest = timed("second half", train, state, half, args.steps)
        losses += rest
        restored = timed("restore", checkpointer.restore, path, target)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target),
                             strict=True):  # fmt: skip
            if got.sharding != want.sharding:
                _fail(f"restored {got.sharding}, saved {want.sharding}")
        _, resumed = train(template.replace(**restored), half, args.steps)
        if resumed != losses[half:]:
            _fail(f"restored at step {half}: losses {resumed}, not {losses[half:]}")
    record = {
        "config": args.config,
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "devices": devices,
        "local_devices": jax.local_device_count(),
        "mesh": dict(mesh.shape),
        "losses": losses,
        "batch_rows": sorted(filled),
        "checkpoint_step": half,
        "checkpoint_files": sorted(os.listdir(path)),
        "resumed_losses": resumed,
        "seconds": round(time.perf_counter() - start, 2),
        "phase_seconds": times,
        "jax": jax.__version__,
    }
    print(json.dumps(record), flush=True)
    if args.coordinator:
        jax.distributed.shutdown()
    return record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="int8", help="preset name or YAML file")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="global batch")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-parallel", type=int, default=2, help="size of `model`")
    p.add_argument("--checkpoint-dir", default=tempfile.gettempdir() + "/sharded_lm")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="CPU only: host devices per process")  # fmt: skip
    p.add_argument("--coordinator", help="HOST:PORT of process 0")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--timeout", type=int, default=300,
                   help="seconds to wait for the other processes")  # fmt: skip
    p.add_argument("--verbose", action="store_true", help="print each step's loss")
    return p


if __name__ == "__main__":
    main()
