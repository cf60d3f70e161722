"""Orbax save and restore of serving params, checked and checksummed.

A checkpoint is an Orbax composite checkpoint with two items: ``arrays``
(the serving variables, or the nnx state, stored as they are: int8, packed
uint8, fp8, float32 scales, biases) and ``meta`` (JSON: format version,
``"params"`` (serving params of a linen model or a function) or ``"nnx"``,
every stored layer's
``LayerInfo``, its forward config included, and every
array's path, shape, dtype and SHA-256 checksum). Restoring compares the
metadata with the target's before reading any array, so a checkpoint of
another config is refused with a :class:`~qbits.ConfigError` naming the layer
and both configs; after reading, every array is checked against its
checksum, so a damaged checkpoint is refused instead of serving other
weights. Every failure to read or write names the checkpoint's path and what
is wrong, with Orbax's own error chained.
"""

from __future__ import annotations

import json
import os
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from qbits import nnx as qnnx
from qbits._errors import ConfigError, InvalidArgumentError, check_bool
from qbits._sharding import abstract as _abstract
from qbits.serving import _integrity as integrity
from qbits.serving._layout import LayerInfo
from qbits.serving._nnx import served_layers
from qbits.serving._orbax import quietly
from qbits.serving._params import ServingParams, replaced

__all__ = ["restore", "save"]

FORMAT = integrity.FORMAT
# 1: layers only (no longer read: unverifiable). 2: adds "checksums" (path ->
# shape, dtype, sha256), one for every array. 3: the stored weights beside
# the params (kind "params", for linen models and functions of any pytree),
# an nnx copy's in its qbits node.
VERSION = 3


def _saved_state(model: nnx.Module) -> Any:
    # The empty placeholders stay out (Orbax refuses zero-size arrays), and
    # so do the key streams a quantized copy trained with stochastic
    # rounding keeps (nnx.RngState): serving draws no keys.
    return nnx.state(model, nnx.Not(nnx.Any(qnnx._Placeholder, nnx.RngState)))


def _placeholders(layers: tuple[LayerInfo, ...]) -> dict[str, Any]:
    return {info.param: (info.param_shape, info.param_dtype)
            for info in layers if info.param}  # fmt: skip


def _saved_params(serving: ServingParams) -> Any:
    """The params without their empty placeholders (``None`` in their place)."""
    return replaced(serving.params, _placeholders(serving.layers), lambda *_: None)


def _restored_params(target: Any, arrays: Any, layers: tuple[LayerInfo, ...]) -> Any:
    """The target's params tree with the restored arrays and empty placeholders."""
    fills = _placeholders(layers)
    restored = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]
    }

    def leaf(path: Any, x: Any) -> Any:
        name = jax.tree_util.keystr(path)
        if name in fills:
            return jnp.zeros((0,), np.dtype(x.dtype))
        return restored[name]

    return jax.tree_util.tree_map_with_path(leaf, target)


def _split(owner: str, serving: Any) -> tuple[str, Any, tuple[LayerInfo, ...]]:
    """``(kind, array tree, layers)`` of serving params or a served nnx model."""
    if isinstance(serving, ServingParams):
        tree = {"params": _saved_params(serving), "weights": serving.weights}
        return "params", tree, serving.layers
    if isinstance(serving, nnx.Module):
        layers = tuple(info for info, _ in served_layers(serving))
        if not layers:
            raise InvalidArgumentError(
                owner,
                "serving",
                type(serving).__name__,
                "a served nnx model from qbits.serving.convert(model, config, x)",
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

    Besides the arrays and every stored layer's
    ``LayerInfo``, the checkpoint holds each array's
    shape, dtype and SHA-256 checksum (of its bytes, computed on the host),
    which :func:`restore` checks. Orbax writes to a temporary directory and
    renames it when complete, so a save that fails leaves nothing at
    ``directory`` (and its temporary directory is removed); with
    ``force=True`` the new checkpoint is written beside the old one, which is
    replaced only once the new one is complete. ``force=True`` replaces only
    an empty directory or a checkpoint that qbits wrote, recognised exactly
    (Orbax's files of its ``meta`` and ``arrays`` items, and nothing else):
    a directory holding anything else is refused, and nothing in it removed.

    Args:
      directory: A new directory (absolute, or made absolute); missing parent
        directories are made.
      serving: :class:`~qbits.serving.ServingParams` or a served nnx model.
      force: Replace an existing checkpoint written by qbits (or an empty
        directory).

    Raises:
      InvalidArgumentError: For anything but serving params or a served model,
        or a ``directory`` that cannot be written: it exists (without
        ``force``), it is a file or a directory that is not a checkpoint qbits
        wrote (with ``force``, naming what it holds), its parent is a file or
        not writable, or writing fails (the Orbax error is chained).

    Example:
      >>> import tempfile, flax.linen as nn
      >>> x = jnp.ones((2, 8))
      >>> params = nn.Dense(4).init(jax.random.key(0), x)
      >>> sp = qbits.serving.convert(nn.Dense(4), "int4_fwd", params, x)
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> qbits.serving.save(path, sp)
      >>> back = qbits.serving.restore(path, sp)
      >>> stored = (sp.weights["kernel"], back.weights["kernel"])
      >>> bool((stored[0]["qvalue"] == stored[1]["qvalue"]).all())
      True
    """
    owner = "qbits.serving.save"
    kind, tree, layers = _split(owner, serving)
    check_bool(owner, "force", force)
    directory = os.path.abspath(directory)
    replace = integrity.check_destination(owner, directory, force)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "layers": [info.as_dict() for info in layers],
        "checksums": integrity.checksums(tree),
    }
    primary = jax.process_index() == 0
    target = directory + integrity.NEW if replace else directory
    ocp, ckpt = _checkpointer()
    try:
        with quietly(), ckpt:
            ckpt.save(
                target,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
                ),
                force=replace,  # a leftover of an interrupted save
            )
        if replace and primary:
            integrity.swap(target, directory)
    except Exception as e:
        if primary:
            integrity.remove_unfinished(target)
        why = f"writing the checkpoint failed: {integrity.cause(e)}"
        error = integrity.bad_directory(owner, directory, why, "a writable path")
        raise error from integrity.orbax_cause(e)
    if replace and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("qbits.serving.save")


def _read_meta(owner: str, directory: str, ocp: Any, ckpt: Any) -> dict[str, Any]:
    """The ``meta`` item, its fields checked."""
    try:
        meta = ckpt.restore(
            directory, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )["meta"]
    except Exception as e:
        why = (
            "its meta item is not valid JSON"
            if isinstance(e, json.JSONDecodeError)
            else "its meta item cannot be read"
        )
        error = integrity.bad_directory(
            owner, directory, f"{why} ({integrity.cause(e)})"
        )
        raise error from integrity.orbax_cause(e)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise integrity.bad_directory(
            owner, directory, f"its meta item has no format {FORMAT!r}"
        )
    version = meta.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise integrity.bad_directory(
            owner, directory, f"its meta item has version={version!r}"
        )
    if version == 1:
        raise integrity.bad_directory(
            owner,
            directory,
            "it has format version 1, written before qbits stored checksums, so "
            f"its arrays cannot be verified; this qbits reads version {VERSION}: "
            "convert the float model and save it again",
        )
    if version == 2:
        raise integrity.bad_directory(
            owner,
            directory,
            "it has format version 2, written by an older qbits whose layout "
            f"this one does not read (it reads version {VERSION}): convert the "
            "float model and save it again",
        )
    if version != VERSION:
        newer = " (a newer qbits wrote it?)" if version > VERSION else ""
        raise integrity.bad_directory(
            owner,
            directory,
            f"it has format version {version}; this qbits reads version "
            f"{VERSION}{newer}",
        )
    if meta.get("kind") not in ("params", "nnx"):
        raise integrity.bad_directory(
            owner, directory, f"its meta item has kind={meta.get('kind')!r}"
        )
    try:
        meta["layers"] = [LayerInfo.from_dict(d) for d in meta["layers"]]
    except (KeyError, TypeError, ValueError) as e:
        raise integrity.bad_directory(
            owner, directory, f"its meta item has bad layers ({integrity.cause(e)})"
        ) from e
    return meta


def _check(directory: str, meta: Any, kind: str, layers: tuple[LayerInfo, ...]) -> None:
    owner = "qbits.serving.restore"
    if meta["kind"] != kind:
        raise InvalidArgumentError(
            owner,
            "target",
            f"a {kind} target",
            f"a {meta['kind']} target (the checkpoint holds a {meta['kind']} model)",
        )
    saved = {info.path: info for info in meta["layers"]}
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
    checkpoint's config, and its arrays' shapes and dtypes, are checked
    against ``target``'s first; every array read is then checked against the
    SHA-256 checksum saved with it. Metadata without a checksum for every
    array (edited after saving, or format version 1, written before
    checksums existed) is refused: nothing is restored unverified.

    Args:
      directory: A checkpoint written by :func:`save`.
      target: What to restore into: serving params, or a served nnx model,
        converted with the same config (real arrays or
        ``jax.eval_shape`` / ``nnx.eval_shape`` results: shapes and dtypes
        are read, and shardings where the arrays have them: the restored
        arrays then come back sharded alike, on that mesh whatever mesh
        they were saved from).

    Returns:
      New :class:`~qbits.serving.ServingParams` (linen) or a served nnx
      model (``target`` itself, updated in place).

    Raises:
      ConfigError: If the checkpoint was converted with another config
        (naming the first layer that differs and both configs).
      InvalidArgumentError: For a target of another kind or model (naming
        the first layer or array that differs); or a ``directory`` that is
        not an intact serving checkpoint: it does not exist, is a file or an
        empty directory, lacks its ``meta`` or ``arrays`` item, has unreadable
        or invalid metadata (an array without its checksum included), has
        array files Orbax cannot read (the Orbax error is chained), or holds
        an array whose bytes do not match their checksum (naming the array).
        The target is left unchanged then.

    Example:
      >>> import tempfile, flax.nnx as nnx
      >>> layer, x = nnx.Linear(8, 4, rngs=nnx.Rngs(0)), jnp.ones((2, 8))
      >>> served = qbits.serving.convert(layer, "int8_fwd", x)
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> qbits.serving.save(path, served)
      >>> other = qbits.serving.convert(layer, "w4a8", x)
      >>> try:
      ...     qbits.serving.restore(path, other)
      ... except qbits.ConfigError as e:
      ...     print(e.path, "|", e.value, "|", e.allowed)
      layers['kernel'].config | int8_fwd | w4a8, the target's config
    """
    owner = "qbits.serving.restore"
    kind, tree, layers = _split(owner, target)
    directory = os.path.abspath(directory)
    integrity.check_directory(owner, directory)
    abstract = jax.tree.map(_abstract, tree)
    ocp, ckpt = _checkpointer()
    with quietly(), ckpt:
        meta = _read_meta(owner, directory, ocp, ckpt)
        _check(directory, meta, kind, layers)
        records = integrity.read_checksums(owner, directory, meta)
        integrity.check_arrays(owner, directory, records, abstract)
        try:
            arrays = ckpt.restore(
                directory,
                args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract)),
            )["arrays"]
        except Exception as e:
            why = f"its arrays cannot be read ({integrity.cause(e)})"
            error = integrity.bad_directory(owner, directory, why)
            raise error from integrity.orbax_cause(e)
    integrity.verify(owner, directory, records, arrays)
    if kind == "params":
        params = _restored_params(target.params, arrays["params"], layers)
        return ServingParams(params, arrays["weights"], layers)
    state = _saved_state(target)
    nnx.replace_by_pure_dict(state, arrays)
    nnx.update(target, state)
    for _, variable in nnx.iter_graph(target):  # an abstract target's placeholders
        if isinstance(variable, qnnx._Placeholder):
            variable.set_value(jnp.zeros((0,), variable.get_raw_value().dtype))
    return target
