"""Saving and restoring adapters alone, with Orbax.

A checkpoint is an Orbax composite checkpoint with two items: ``adapters``
(the ``{matmul path: {"a", "b"}}`` arrays as they are) and ``meta`` (JSON:
the format, its version, the :class:`~qbits.lora.LoraConfig` as plain data,
and every array's shape, dtype and SHA-256 checksum). The base is not
saved: it is the model's own checkpoint, frozen (``apply`` quantizes it
again, the same way every time). Restoring checks the metadata against the
target and the config before reading, and every array against its
checksum after.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from qbits._errors import ConfigError, InvalidArgumentError
from qbits._sharding import abstract as _abstract
from qbits.lora._config import LoraConfig

__all__ = ["restore_adapters", "save_adapters"]

FORMAT = "qbits.lora"
VERSION = 1


def _records(adapters: Any) -> dict[str, list[Any]]:
    """``{array path: [shape, dtype, sha256]}`` of the adapters' arrays."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(adapters)[0]:
        data = np.ascontiguousarray(np.asarray(x))
        digest = hashlib.sha256(data.tobytes()).hexdigest()
        out[jax.tree_util.keystr(path)] = [list(data.shape), data.dtype.name, digest]
    return out


def _specs(tree: Any) -> dict[str, list[Any]]:
    """``{array path: [shape, dtype]}`` of arrays or ``ShapeDtypeStruct`` s."""
    return {
        jax.tree_util.keystr(path): [list(np.shape(x)), np.dtype(x.dtype).name]
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _check_adapters(owner: str, argument: str, adapters: Any) -> None:
    ok = isinstance(adapters, Mapping) and all(
        isinstance(ab, Mapping) and set(ab) == {"a", "b"} for ab in adapters.values()
    )
    if not ok or not adapters:
        raise InvalidArgumentError(
            owner, argument, type(adapters).__name__,
            "adapters as qbits.lora.apply makes them: {matmul path: {'a': A, 'b': B}}",
        )  # fmt: skip


def _checkpointer() -> tuple[Any, Any]:
    import orbax.checkpoint as ocp

    return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _bad(owner: str, directory: str, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        owner, "directory", directory, "a checkpoint written by "
        "qbits.lora.save_adapters", why=why,
    )  # fmt: skip


def save_adapters(
    directory: str | os.PathLike[str],
    adapters: Mapping[str, Any],
    config: LoraConfig,
    *,
    force: bool = False,
) -> None:
    """Writes the adapters (and their config), not the base, to ``directory``.

    Args:
      directory: A new directory (made absolute; parents are made).
      adapters: ``{matmul path: {"a": A, "b": B}}``, as :func:`~qbits.lora.apply`
        makes them (trained).
      config: Their :class:`~qbits.lora.LoraConfig` (saved with them:
        ``alpha / rank`` scales their output).
      force: Replace an existing adapters checkpoint (or an empty
        directory); anything else at ``directory`` is refused.

    Raises:
      InvalidArgumentError: For adapters or a config of another kind, or a
        ``directory`` that exists (without ``force``, or holding something
        other than an adapters checkpoint), or when writing fails (Orbax's
        error chained).

    Example:
      >>> import tempfile
      >>> params = {"w": jnp.ones((8, 4))}
      >>> cfg = qbits.lora.LoraConfig(rank=2)
      >>> _, _, adapters = qbits.lora.apply(lambda p, x: x @ p["w"], cfg, params,
      ...                                   jnp.ones((1, 8)), key=jax.random.key(0))
      >>> path = tempfile.mkdtemp() + "/adapters"
      >>> qbits.lora.save_adapters(path, adapters, cfg)
      >>> back = qbits.lora.restore_adapters(path, adapters, cfg)
      >>> bool((back["w"]["a"] == adapters["w"]["a"]).all())
      True
    """
    owner = "qbits.lora.save_adapters"
    _check_adapters(owner, "adapters", adapters)
    if not isinstance(config, LoraConfig):
        raise InvalidArgumentError(owner, "config", config, "a qbits.lora.LoraConfig")
    if not isinstance(force, bool):
        raise InvalidArgumentError(owner, "force", force, "True or False")
    directory = os.path.abspath(os.fspath(directory))
    replace = False
    if os.path.lexists(directory):
        if not force:
            raise _bad(owner, directory, "it exists: pass force=True to replace it")
        if not (os.path.isdir(directory) and not os.path.islink(directory)):
            raise _bad(owner, directory, "it is not a directory")
        if os.listdir(directory):
            _read_meta(owner, directory)  # only an adapters checkpoint is replaced
        replace = True
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "config": config.to_data(),
        "arrays": _records(adapters),
    }
    ocp, ckpt = _checkpointer()
    tree = {path: dict(ab) for path, ab in adapters.items()}
    try:
        with ckpt:
            ckpt.save(
                directory,
                args=ocp.args.Composite(
                    adapters=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
                ),
                force=replace,
            )
    except Exception as e:
        raise _bad(owner, directory, f"writing failed: {e}") from e


def _read_meta(owner: str, directory: str) -> dict[str, Any]:
    ocp, ckpt = _checkpointer()
    try:
        with ckpt:
            meta = ckpt.restore(
                directory, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]
    except Exception as e:
        why = "its meta item is not JSON" if isinstance(e, json.JSONDecodeError) else (
            f"its meta item cannot be read ({type(e).__name__})"
        )  # fmt: skip
        raise _bad(owner, directory, why) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(owner, directory, f"its meta item has no format {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise _bad(
            owner, directory, f"it has version {meta.get('version')!r}; "
            f"this qbits reads version {VERSION}",
        )  # fmt: skip
    if not isinstance(meta.get("arrays"), dict):
        raise _bad(owner, directory, "its meta item lists no arrays")
    return meta


def restore_adapters(
    directory: str | os.PathLike[str],
    like: Mapping[str, Any],
    config: LoraConfig | None = None,
) -> dict[str, dict[str, jax.Array]]:
    """Reads adapters saved by :func:`save_adapters`, checked.

    Args:
      directory: The checkpoint.
      like: Adapters of the same model and config (arrays, or
        ``jax.ShapeDtypeStruct`` s from ``jax.eval_shape``): their paths,
        shapes and dtypes are checked against the checkpoint's; where they
        have mesh shardings, the adapters come back sharded alike, on that
        mesh whatever mesh they were saved from.
      config: The :class:`~qbits.lora.LoraConfig` the adapters will run
        with: checked against the saved one (``None``: not checked).

    Returns:
      ``{matmul path: {"a": A, "b": B}}``, bit for bit as saved.

    Raises:
      ConfigError: For a checkpoint saved with another config.
      InvalidArgumentError: For a directory that holds no intact adapters
        checkpoint (missing, another kind, an array whose bytes do not
        match its checksum: naming it), or adapters of another model
        (naming the first array that differs).

    Example:
      >>> import tempfile
      >>> cfg = qbits.lora.LoraConfig(rank=2)
      >>> _, _, adapters = qbits.lora.apply(lambda p, x: x @ p["w"], cfg,
      ...     {"w": jnp.ones((8, 4))}, jnp.ones((1, 8)), key=jax.random.key(0))
      >>> path = tempfile.mkdtemp() + "/adapters"
      >>> qbits.lora.save_adapters(path, adapters, cfg)
      >>> try:
      ...     qbits.lora.restore_adapters(path, adapters, qbits.lora.LoraConfig(rank=4))
      ... except qbits.ConfigError as e:
      ...     print(e.path, e.value)
      rank 2
    """
    owner = "qbits.lora.restore_adapters"
    _check_adapters(owner, "like", like)
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise _bad(owner, directory, "no such directory")
    meta = _read_meta(owner, directory)
    if config is not None:
        if not isinstance(config, LoraConfig):
            raise InvalidArgumentError(
                owner, "config", config, "a qbits.lora.LoraConfig"
            )
        saved = meta.get("config")
        want = config.to_data()
        if saved != want:
            field = next(
                (
                    k
                    for k in want
                    if not isinstance(saved, dict) or saved.get(k) != want[k]
                ),
                "",
            )
            got = saved.get(field) if isinstance(saved, dict) else saved
            raise ConfigError(
                field,
                got,
                f"{want.get(field)!r}, the config given",
                why="the adapters were saved with another config",
                source=directory,
            )
    records = meta["arrays"]
    want_specs = _specs(like)
    for name in sorted(set(records) | set(want_specs)):
        have = records.get(name)
        spec = want_specs.get(name)
        if have is None or spec is None or list(have[:2]) != spec:
            raise InvalidArgumentError(
                owner, "like", f"{name}: {spec or 'missing'}",
                f"the checkpoint's {name}: {have[:2] if have else 'missing'}",
                why=f"the checkpoint at {directory} holds adapters of another model",
            )  # fmt: skip
    abstract = jax.tree.map(_abstract, {path: dict(ab) for path, ab in like.items()})
    ocp, ckpt = _checkpointer()
    try:
        with ckpt:
            arrays = ckpt.restore(
                directory,
                args=ocp.args.Composite(adapters=ocp.args.StandardRestore(abstract)),
            )["adapters"]
    except Exception as e:
        raise _bad(owner, directory, f"its arrays cannot be read ({e})") from e
    got = _records(arrays)
    for name, record in records.items():
        if got.get(name) != record:
            raise _bad(owner, directory, f"array {name} does not match its checksum")
    return arrays
