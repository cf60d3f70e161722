"""``qbits import``/``export``: pre-quantized checkpoints in and out."""

from __future__ import annotations

import argparse
import functools
import pathlib
from typing import Any

import numpy as np

from qbits.cli._common import UsageError, _config


def _import(args: argparse.Namespace) -> int:
    """Reads ``args.checkpoint`` with :func:`qbits.interop.read_checkpoint`.

    Prints each quantized weight as qbits stores it (its PyTorch module,
    format and grid: NF4's codebook, 2-D block scales, E4M3 block scales
    under a tensor scale, act-order's input order; the ``[in, out]`` shape;
    bits per weight held, with scales, zero points and input order, and in
    the checkpoint's files, :attr:`~qbits.interop.Checkpoint.stored_bytes`)
    and the float tensors beside them; a bad checkpoint is the reader's
    one-line error (status 2).
    """
    import qbits.interop

    ckpt = qbits.interop.read_checkpoint(args.checkpoint)
    width = max(24, *(len(m) for m in ckpt.weights))
    print(f"{args.checkpoint}: {ckpt.format}, {len(ckpt.weights)} quantized weights")
    print(
        f"{'module':<{width}} {'stored':<51} {'[in, out]':>10} "
        f"{'bits/weight':>11} {'in file':>7}"
    )
    held = count = stored = 0
    for m, qt in sorted(ckpt.weights.items()):
        what = _stored(qt, ckpt.quantizers[m].granularity, m in ckpt.input_orders)
        n = int(np.prod(qt.shape))
        order = ckpt.input_orders.get(m)
        here = qt.nbytes + (0 if order is None else order.nbytes)
        held, count, stored = held + here, count + n, stored + ckpt.stored_bytes[m]
        print(
            f"{m:<{width}} {what:<51} {list(qt.shape)!s:>10} "
            f"{8 * here / n:>11.3f} {8 * ckpt.stored_bytes[m] / n:>7.3f}"
        )
    floats = sum(int(np.prod(t.shape)) for t in ckpt.tensors.values())
    print(
        f"{8 * held / count:.3f} bits a quantized weight held "
        f"({8 * stored / count:.3f} in the checkpoint); {len(ckpt.tensors)} "
        f"float tensors ({floats} values) beside them"
    )
    if ckpt.activations:  # W8A8: the inputs as the checkpoint's engine runs them
        kinds = {_stored_input(q) for q in ckpt.activations.values()}
        print(
            f"inputs quantized as they come: {', '.join(sorted(kinds))} "
            f"({len(ckpt.activations)} layers)"
        )
    return 0


def _stored_input(q: Any) -> str:
    """An input quantizer, e.g. ``float8_e4m3fn per token``."""
    grid = q.granularity
    per = {"PerChannel": "per token", "PerTensor": "per tensor"}.get(
        type(grid).__name__, f"per token and {getattr(grid, 'tile_size', '?')} inputs"
    )
    static = " on a static scale" if hasattr(q.calibration, "value") else ""
    return f"{q.numerics.get_dtype().name} {per}{static}"


def _stored(qt: Any, grid: Any, ordered: bool) -> str:
    """A stored weight's format and grid, e.g. ``NF4 (uint4 codes) Tiled(64)``."""
    what = f"{qt.qdtype.name}"
    if qt.codebook is not None:
        what = f"NF4 ({what} codes)" if len(qt.codebook) == 16 else f"{what} codebook"
    what += f" {type(grid).__name__}"
    tile, free = getattr(grid, "tile_size", None), getattr(grid, "free_tile_size", 1)
    if tile:
        what += f"({tile} x {free})" if free > 1 else f"({tile})"
    if qt.tensor_scale is not None:
        what += " + E4M3 scales, tensor scale"  # NVFP4's
    if qt.scale_absmax is not None:
        what += " + 8-bit scales"  # double quantization (QLoRA's)
    what += " + zero points" if qt.zero_point is not None else ""
    return what + (" + input order" if ordered else "")


def _export(args: argparse.Namespace) -> int:
    """``qbits export``: a PTQ result of a trained example LM as a checkpoint.

    Quantizes the float32 LM that ``qbits train`` saved in ``--run`` by
    ``--method`` (as ``qbits ptq`` does, on its calibration batches) and
    writes the stored weights (:attr:`qbits.ptq.PtqResult.stored`) with
    :func:`qbits.interop.write_checkpoint` under the PyTorch names of the
    LM's twin (``blocks.0.attn.query``, the ``"qbits-lm"`` name table),
    every other tensor in float, and ``config.json``'s ``qbits`` entry
    (model and size) that ``qbits generate --checkpoint`` reads.
    """
    import qbits.interop
    from qbits._experiments import ptq_trained, spec

    name, config, _ = _config(args.config)
    if config is None:
        raise UsageError("config 'none' quantizes nothing: give a weight format")
    out = pathlib.Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not an empty folder")
    model, _, run, result = ptq_trained(
        args.run_dir,
        config,
        args.method,
        calibration=args.calibration,
        seed=args.seed,
    )
    if run["model"] != "lm":
        raise UsageError(
            f"--run {args.run_dir}: a {run['model']} model; qbits export writes "
            "the lm (qbits train --model lm)"
        )
    if not result.stored:
        raise UsageError(f"{name} {args.method}: no weight stored on a grid")
    weights, tensors = _torch_layout(model, result, args.format)
    s = spec("lm", run["size"])
    meta = {
        "architectures": ["QbitsTransformerLM"],
        "model_type": "qbits-lm",
        "vocab_size": int(model.embed.num_embeddings),
        "hidden_size": s.width,
        "num_hidden_layers": s.depth,
        "num_attention_heads": s.heads,
        "max_position_embeddings": s.context,
        "torch_dtype": "float32",
        "qbits": {"model": "lm", "size": run["size"], "ptq": f"{name} {args.method}"},
    }
    # the stored layers' input quantizers, where the format can declare
    # them (one dynamic E4M3 for all: write_checkpoint checks, before
    # writing anything); else the weights alone
    inputs = {m: _lhs(config, m) for m in weights}
    inputs = {} if None in inputs.values() else inputs
    write = functools.partial(
        qbits.interop.write_checkpoint, out, weights, args.format, tensors, meta
    )
    try:
        write(activations=inputs)
    except qbits.InvalidArgumentError as e:
        if e.argument != "activations":
            raise
        inputs = {}
        write()
    held = sum(qt.nbytes for qt in weights.values())
    count = sum(int(np.prod(qt.shape)) for qt in weights.values())
    floats = sorted(
        m[: -len(".weight")]
        for m, t in tensors.items()
        if m.endswith(".weight") and np.ndim(t) == 2 and not m.startswith("embed")
    )
    written = qbits.interop.read_checkpoint(out).format  # and checked
    print(f"wrote {out}: {written}, lm ({run['size']}) by {name} {args.method}")
    print(
        f"{len(weights)} quantized weights, {8 * held / count:.3f} bits a weight "
        f"({held / (4 * count):.3f}x float32's bytes): {', '.join(sorted(weights))}"
    )
    refs = [config.default, *(rule.config for rule in config.rules)]
    configs = [qbits.presets.get(r) if isinstance(r, str) else r for r in refs]
    if inputs:
        print(
            f"inputs: {name} quantizes them as the checkpoint's "
            "input_activations declare (serving engines do the same)"
        )
    elif any(getattr(getattr(c, "fwd", None), "lhs", None) for c in configs):
        print(
            f"note: {name} quantizes activations too; the checkpoint holds the "
            "weights only (served with float activations: compressed-tensors "
            "declares dynamic E4M3 inputs alone)"
        )
    if floats:
        print(
            f"kept float: {', '.join(floats)} (left off a grid by the method, or "
            f"codes or zero points {args.format} cannot hold; their values are "
            "the PTQ result's)"
        )
    return 0


def _lhs(config: Any, module: str) -> Any:
    """The input quantizer ``config`` gives the stored layer ``module``."""
    resolved = config.resolve(module.replace(".", "/")).config
    return getattr(getattr(resolved, "fwd", None), "lhs", None)


def _torch_layout(model: Any, result: Any, format: str) -> tuple[dict, dict]:
    """``result``'s stored weights and float params under PyTorch's names.

    Stored weights ``[*in, *out]`` become ``[in, out]`` QTensors (codes,
    scales and zero points reshaped, never dequantized); float kernels
    PyTorch's ``[out, in]``, biases flat; ``kernel``, ``embedding`` and a
    norm's ``scale`` are named ``weight``. A stored weight ``format`` cannot
    hold (zero points outside its ``0 .. 2^b - 1``, GPTQ v1's ``1 .. 2^b``:
    qbits' asymmetric grid spans a group's own [min, max], GPTQ's includes
    0; for GPTQ, sizes that are not whole int32 words of codes) is written
    as its float parameter (the PTQ result's, on the grid).
    """
    import jax

    def module(path: str) -> Any:
        node = model
        for key in path.split("/"):
            node = node[int(key)] if key.isdigit() else getattr(node, key)
        return node

    def axes_in(path: str) -> int:
        features = getattr(module(path), "in_features", 0)
        return len(features) if isinstance(features, tuple) else 1

    weights = {}
    for path, qt in result.stored.items():
        k, qt = axes_in(path), qt.unpack()

        def two_d(a: Any, k: int = k) -> Any:
            return a.reshape(int(np.prod(a.shape[:k])), int(np.prod(a.shape[k:])))

        flat = qt.replace(
            qvalue=two_d(qt.qvalue),
            scale=two_d(qt.scale),
            zero_point=None if qt.zero_point is None else two_d(qt.zero_point),
            tensor_scale=None if qt.tensor_scale is None else two_d(qt.tensor_scale),
        )
        bits = (
            4 if np.dtype(qt.qdtype).name in ("int4", "uint4", "float4_e2m1fn") else 8
        )
        lo = 1 if format == "gptq" else 0
        zero = None if qt.zero_point is None else np.asarray(qt.zero_point)
        gptq = format.startswith("gptq")
        if (gptq and any(n % (32 // bits) for n in flat.shape)) or (
            zero is not None and (zero.min() < lo or zero.max() >= lo + (1 << bits))
        ):
            continue  # written as its float parameter below
        weights[path.replace("/", ".")] = flat.pack() if bits == 4 else flat
    tensors = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(result.params)[0]:
        parts = [
            str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
            for k in keys
        ]
        parts = parts[:-1] if parts[-1] == "value" else parts
        where, last = "/".join(parts[:-1]), parts[-1]
        if where.replace("/", ".") in weights and last == "kernel":
            continue
        a = np.asarray(leaf)
        if last == "kernel":
            k = axes_in(where)
            a = a.reshape(int(np.prod(a.shape[:k])), -1).T
        elif last == "bias":
            a = a.reshape(-1)
        named = "weight" if last in ("kernel", "embedding", "scale") else last
        tensors[".".join([*parts[:-1], named])] = a
    return weights, tensors


def _checkpoint_lm(path: str, cache: Any) -> tuple[Any, Any]:
    """The example LM served from a checkpoint: ``(model, data)``.

    ``model`` decodes as :func:`qbits.kvcache.generate` needs, every weight
    matmul of its :meth:`~qbits._experiments.TransformerLM.decode` through
    :func:`qbits.serving.serve` on the checkpoint's codes and scales
    (:func:`qbits.interop.serving_params`, names ``"qbits-lm"``); ``cache``:
    the cache config it is traced with.
    """
    import json

    import flax.nnx as nnx
    import jax
    import jax.numpy as jnp

    import qbits.interop
    from qbits._experiments import build_model, spec

    ckpt = qbits.interop.read_checkpoint(path)
    info = json.loads((pathlib.Path(path) / "config.json").read_text()).get("qbits")
    size = info.get("size") if isinstance(info, dict) else None
    if (
        not isinstance(info, dict)
        or info.get("model") != "lm"
        or size
        not in (
            "default",
            "tiny",
        )
    ):
        raise UsageError(
            f"--checkpoint {path}: config.json has no qbits entry naming the "
            'example LM ("qbits": {"model": "lm", "size": "tiny"}, as qbits '
            "export writes it)"
        )
    built: list = []

    def build() -> Any:
        model, data = build_model(spec("lm", size), 0)
        built.append(data)
        return model

    lm = nnx.eval_shape(build)
    decode, state = decoder(lm), nnx.state(lm)
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    caches = jax.eval_shape(lambda: lm.init_cache(1, cache))
    sp, config = qbits.interop.serving_params(
        ckpt, decode, state, tokens, caches, names="qbits-lm"
    )
    return served_lm(lm, sp, config), built[0]


def decoder(lm: Any) -> Any:
    """``decode(state, tokens, caches)``: the LM's decode as a function of its state."""
    import flax.nnx as nnx

    graphdef = nnx.graphdef(lm)

    def decode(state: Any, tokens: Any, caches: Any) -> Any:
        return nnx.merge(graphdef, state).decode(tokens, caches)

    return decode


def served_lm(lm: Any, sp: Any, config: Any) -> Any:
    """An nnx model that decodes ``lm`` served from ``sp`` (of :func:`decoder`).

    Its ``decode`` is ``qbits.serving.serve(decoder(lm), config)``: the
    weight matmuls compute on the stored codes and scales of ``sp``, in the
    engine (the LM's own ``decode`` calls its float layers); its
    ``init_cache`` is the LM's. What :func:`qbits.kvcache.generate` takes.
    """
    import flax.nnx as nnx

    import qbits

    served = qbits.serving.serve(decoder(lm), config)
    init = lm.init_cache  # shapes only: lm may hold no weights

    class Served(nnx.Module):
        def __init__(self) -> None:
            self.params = nnx.Variable(sp)

        def init_cache(self, batch: int, config: Any = None) -> Any:
            return init(batch, config)

        def decode(self, tokens: Any, caches: Any) -> Any:
            return served(self.params.get_value(), tokens, caches)

    return Served()
