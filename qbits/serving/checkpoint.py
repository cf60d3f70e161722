"""Orbax save and restore of serving params, with their config checked.

A checkpoint is an Orbax composite checkpoint with two items: ``arrays``
(the serving variables, or the nnx state, stored as they are: int8, packed
uint8, fp8, float32 scales, biases) and ``meta`` (JSON: format version,
``"linen"`` or ``"nnx"``, and every stored layer's
:class:`~qbits.serving.LayerInfo`, its forward config included). Restoring
compares the metadata with the target's before reading any array, so a
checkpoint of another config is refused with a :class:`~qbits.ConfigError`
naming the layer and both configs.
"""

from __future__ import annotations

import os
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from qbits.errors import ConfigError, InvalidArgumentError
from qbits.serving._layout import LayerInfo
from qbits.serving.linen import ServingParams
from qbits.serving.nnx import KernelPlaceholder, served_layers

__all__ = ["restore", "save"]

FORMAT = "qbits.serving"
VERSION = 1


def _saved_state(model: nnx.Module) -> Any:
    # The empty kernel placeholders stay out (Orbax refuses zero-size arrays).
    return nnx.state(model, nnx.Not(KernelPlaceholder))


def _split(owner: str, serving: Any) -> tuple[str, Any, tuple[LayerInfo, ...]]:
    """``(kind, array tree, layers)`` of serving params or a served nnx model."""
    if isinstance(serving, ServingParams):
        return "linen", serving.variables, serving.layers
    if isinstance(serving, nnx.Module):
        layers = tuple(info for info, _, _ in served_layers(serving))
        if not layers:
            raise InvalidArgumentError(
                owner,
                "serving",
                type(serving).__name__,
                "a served nnx model from qbits.serving.convert(model, config)",
                why="it has no stored layers (a float model?)",
            )
        return "nnx", nnx.to_pure_dict(_saved_state(serving)), layers
    raise InvalidArgumentError(
        owner,
        "serving",
        serving,
        "qbits.serving.ServingParams or a served nnx model (from "
        "qbits.serving.convert)",
    )


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save(directory: str | os.PathLike[str], serving: Any, *, force: bool = False):
    """Writes serving params (or a served nnx model) to ``directory``.

    Args:
      directory: A new directory (absolute, or made absolute).
      serving: :class:`~qbits.serving.ServingParams` or a served nnx model.
      force: Overwrite an existing checkpoint.

    Raises:
      InvalidArgumentError: For anything but serving params or a served model.

    Example:
      >>> import tempfile, flax.linen as nn
      >>> x = jnp.ones((2, 8))
      >>> params = nn.Dense(4).init(jax.random.key(0), x)
      >>> sp = qbits.serving.convert(nn.Dense(4), "int4_fwd", params, x)
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> qbits.serving.save(path, sp)
      >>> back = qbits.serving.restore(path, sp)
      >>> bool((back.variables["qbits_serving"]["qvalue"]
      ...       == sp.variables["qbits_serving"]["qvalue"]).all())
      True
    """
    kind, tree, layers = _split("qbits.serving.save", serving)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "layers": [info.as_dict() for info in layers],
    }
    ocp, ckpt = _checkpointer()
    with ckpt:
        ckpt.save(
            os.path.abspath(directory),
            args=ocp.args.Composite(
                arrays=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )


def _check(directory: str, meta: Any, kind: str, layers: tuple[LayerInfo, ...]) -> None:
    owner = "qbits.serving.restore"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InvalidArgumentError(
            owner, "directory", directory, "a checkpoint written by qbits.serving.save"
        )
    if meta.get("kind") != kind:
        raise InvalidArgumentError(
            owner,
            "target",
            f"a {kind} target",
            f"a {meta.get('kind')} target (the checkpoint holds a {meta.get('kind')} "
            "model)",
        )
    saved = {d["path"]: LayerInfo.from_dict(d) for d in meta["layers"]}
    wanted = {info.path: info for info in layers}
    for path in list(saved) + [p for p in wanted if p not in saved]:
        s, w = saved.get(path), wanted.get(path)
        if s is not None and w is not None and s.config == w.config:
            if s.shape != w.shape or s.dtype != w.dtype:
                raise InvalidArgumentError(
                    owner,
                    "target",
                    f"layer {path!r} of shape {w.shape} ({w.dtype})",
                    f"shape {s.shape} ({s.dtype}), as in the checkpoint",
                    why=f"the checkpoint at {directory} holds another model",
                )
            continue
        got = s.describe() if s is not None else "a float weight (not stored)"
        expected = w.describe() if w is not None else "a float weight (not stored)"
        raise ConfigError(
            f"layers[{path!r}].config",
            got,
            f"{expected}, the target's config",
            why="the checkpoint was converted with another config: restore "
            "into a target converted with the checkpoint's config",
            source=directory,
        )


def restore(directory: str | os.PathLike[str], target: Any) -> Any:
    """Reads serving params (or a served nnx model's state) from ``directory``.

    The arrays come back exactly as saved (same dtypes and bits). The
    checkpoint's config is checked against ``target``'s first.

    Args:
      directory: A checkpoint written by :func:`save`.
      target: What to restore into: serving params, or a served nnx model,
        converted with the same config (real arrays or
        ``jax.eval_shape`` / ``nnx.eval_shape`` results: only shapes and
        dtypes are read).

    Returns:
      New :class:`~qbits.serving.ServingParams` (linen) or a served nnx
      model (``target`` itself, updated in place).

    Raises:
      ConfigError: If the checkpoint was converted with another config
        (naming the first layer that differs and both configs).
      InvalidArgumentError: For a target of another kind or model, or a
        directory that is not a serving checkpoint.

    Example:
      >>> import tempfile, flax.nnx as nnx
      >>> layer = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
      >>> served = qbits.serving.convert(layer, "int8_fwd")
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> qbits.serving.save(path, served)
      >>> other = qbits.serving.convert(layer, "w4a8")
      >>> try:
      ...     qbits.serving.restore(path, other)
      ... except qbits.ConfigError as e:
      ...     print(e.path, "|", e.value, "|", e.allowed)
      layers[''].config | int8_fwd | w4a8, the target's config
    """
    owner = "qbits.serving.restore"
    kind, tree, layers = _split(owner, target)
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        raise InvalidArgumentError(
            owner, "directory", directory, "a checkpoint written by qbits.serving.save"
        )
    ocp, ckpt = _checkpointer()
    with ckpt:
        meta = ckpt.restore(
            directory, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )
        _check(directory, meta["meta"], kind, layers)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype(x.dtype)), tree
        )
        arrays = ckpt.restore(
            directory,
            args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract)),
        )["arrays"]
    if kind == "linen":
        return ServingParams(arrays, layers)
    state = _saved_state(target)
    nnx.replace_by_pure_dict(state, arrays)
    nnx.update(target, state)
    for _, module in nnx.iter_modules(target):  # an abstract target's placeholders
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, KernelPlaceholder):
            empty = jnp.zeros((0,), kernel.get_raw_value().dtype)
            module.kernel = KernelPlaceholder(empty)
    return target
