"""What makes a serving checkpoint trustworthy: checksums and path checks.

:func:`~qbits.serving.save` records every array's path, shape, dtype and the
SHA-256 of its bytes (computed on the host; an array sharded over several
hosts is gathered, one array at a time) in the checkpoint's ``meta`` item;
:func:`~qbits.serving.restore` refuses a target whose arrays have other
shapes or dtypes before reading, and arrays whose bytes do not match after.
Every array must have its checksum: metadata without one (edited, or of
another format version) is refused, never read unverified.

The path checks turn what Orbax would report as a raw ``KeyError``,
``FileNotFoundError`` or TensorStore dump into one
:class:`~qbits.InvalidArgumentError` that names the checkpoint's path; and
they recognise a checkpoint qbits wrote exactly (:func:`not_a_checkpoint`), so
that ``save(..., force=True)`` never deletes anything else.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import shutil
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qbits._errors import InvalidArgumentError

__all__ = [
    "CHECKPOINT",
    "bad_directory",
    "cause",
    "check_arrays",
    "check_destination",
    "check_directory",
    "checksums",
    "not_a_checkpoint",
    "orbax_cause",
    "read_checksums",
    "remove_unfinished",
    "swap",
    "verify",
]

CHECKPOINT = "a checkpoint written by qbits.serving.save"
FORMAT = "qbits.serving"
# Where save(..., force=True) writes the new checkpoint, and moves the old one.
NEW, OLD = ".qbits-new", ".qbits-old"
# Where Orbax writes a checkpoint before renaming it (it removes what is there).
TMP = ".orbax-checkpoint-tmp"


def bad_directory(
    owner: str, directory: str, why: str, allowed: str = CHECKPOINT
) -> InvalidArgumentError:
    """InvalidArgumentError for ``directory``, its full path always shown."""
    if len(repr(directory)) > 80:  # the value is shortened in the message
        why = f"at {directory}: {why}"
    return InvalidArgumentError(owner, "directory", directory, allowed, why=why)


def cause(error: BaseException) -> str:
    """The innermost cause's type and first line (TensorStore's run long)."""
    error = _innermost(error)
    lines = str(error).strip().splitlines() or [""]
    text = lines[0] if len(lines[0]) <= 300 else lines[0][:297] + "..."
    return f"{type(error).__name__}: {text}"


def _innermost(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def orbax_cause(error: BaseException) -> BaseException:
    """What to chain to an error that replaces Orbax's ``error``.

    When one of the reads (or writes) Orbax runs at once fails, Orbax leaves
    the others pending in an event loop it closes; each reports a long
    TensorStore dump as "Exception ignored" once garbage collected, at a
    random later time. This returns the innermost cause without its
    traceback, which is what kept them alive, and collects them now,
    dropping only those reports.
    """
    inner = _innermost(error).with_traceback(None)
    inner.__context__ = None
    error.__traceback__ = error.__context__ = error.__cause__ = None
    previous = sys.unraisablehook

    def hook(report: Any) -> None:
        code = getattr(report.object, "cr_code", None)
        exc = report.exc_value
        abandoned = code is not None and "orbax" in code.co_filename
        if not (abandoned and isinstance(exc.__context__, GeneratorExit)):
            previous(report)

    sys.unraisablehook = hook
    try:
        gc.collect()
    finally:
        sys.unraisablehook = previous
    return inner


# --- checksums --------------------------------------------------------------


def _path(keys: tuple[Any, ...]) -> str:
    """``"params/block/fc1/bias"`` for a tree path."""
    parts = []
    for k in keys:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _leaves(tree: Any) -> dict[str, Any]:
    return {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _sha256(x: Any) -> str:
    """SHA-256 of an array's bytes, on the host.

    An array sharded over several hosts is gathered onto each (every process
    calls this for the same arrays, in the same order, as ``save`` and
    ``restore`` do).
    """
    if isinstance(x, jax.Array):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
    a = np.ascontiguousarray(np.asarray(x))
    return hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()


_DIGEST = re.compile(r"[0-9a-f]{64}")


def _record(x: Any, digest: bool) -> dict[str, Any]:
    return {
        "shape": [int(d) for d in x.shape],
        "dtype": str(x.dtype),
        "sha256": _sha256(x) if digest else None,
    }


def _show(record: dict[str, Any] | None) -> str:
    if record is None:
        return "no such array"
    return f"shape {tuple(record['shape'])} ({record['dtype']})"


def checksums(tree: Any) -> dict[str, dict[str, Any]]:
    """``{array path: {"shape", "dtype", "sha256"}}`` for the arrays saved."""
    return {p: _record(x, True) for p, x in _leaves(tree).items()}


def read_checksums(owner: str, directory: str, meta: dict[str, Any]) -> dict:
    """The checkpoint's array records, each with its SHA-256, checked."""
    records = meta.get("checksums")
    if not isinstance(records, dict):
        raise bad_directory(
            owner, directory, "its meta item has no valid 'checksums' entry"
        )
    for path, r in records.items():
        ok = (
            isinstance(r, dict)
            and isinstance(r.get("shape"), list)
            and isinstance(r.get("dtype"), str)
        )
        if not ok:
            raise bad_directory(
                owner,
                directory,
                f"its meta item has no valid 'checksums' entry (array {path!r})",
            )
        digest = r.get("sha256")
        if not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
            raise bad_directory(
                owner,
                directory,
                f"array {path!r} has no valid SHA-256 checksum in the meta item "
                f"(sha256={digest!r}): its metadata was changed after saving, so "
                "its arrays cannot be verified",
                allowed=f"an intact {CHECKPOINT.removeprefix('a ')}",
            )
    return records


def check_arrays(owner: str, directory: str, records: dict, abstract: Any) -> None:
    """Refuses a target whose arrays are not the checkpoint's (before reading)."""
    wanted = {p: _record(x, False) for p, x in _leaves(abstract).items()}
    for path in list(wanted) + [p for p in records if p not in wanted]:
        w, s = wanted.get(path), records.get(path)
        same = w is not None and s is not None
        if same and (w["shape"], w["dtype"]) == (s["shape"], s["dtype"]):
            continue
        raise InvalidArgumentError(
            owner,
            "target",
            f"array {path!r}: {_show(w) if w else 'missing'}",
            f"{_show(s)}, as in the checkpoint",
            why=f"the checkpoint at {directory} holds another model",
        )


def verify(owner: str, directory: str, records: dict, arrays: Any) -> None:
    """Refuses restored arrays whose bytes do not match their saved checksum."""
    for path, x in _leaves(arrays).items():
        if _sha256(x) != records[path]["sha256"]:
            raise bad_directory(
                owner,
                directory,
                f"array {path!r} does not match the SHA-256 checksum saved with "
                "it: the checkpoint is damaged or was changed after saving",
                allowed=f"an intact {CHECKPOINT.removeprefix('a ')}",
            )


# --- paths ------------------------------------------------------------------


# What Orbax writes for a checkpoint of qbits' two items, ``meta`` and ``arrays``.
_TOP = frozenset({"meta", "arrays", "_CHECKPOINT_METADATA", "commit_success.txt"})
_META = frozenset({"metadata", "commit_success.txt"})
_ARRAYS = re.compile(
    r"_METADATA|_CHECKPOINT_METADATA|_sharding|commit_success\.txt|manifest\.ocdbt"
    r"|array_metadatas|d|ocdbt\.process_[0-9]+"
)
_MAX_META = 1 << 26  # bytes of meta/metadata read to recognise a checkpoint


def not_a_checkpoint(directory: str) -> str:
    """Why ``directory`` is not a checkpoint qbits wrote; ``""`` if it is one.

    A checkpoint qbits wrote is a directory (not a link) holding only what
    Orbax writes for its two items: ``meta/`` (whose ``metadata`` is JSON with
    ``"format": "qbits.serving"``) and ``arrays/`` (Orbax's array files), plus
    Orbax's ``_CHECKPOINT_METADATA`` (and ``commit_success.txt``).
    """
    if os.path.islink(directory) or not os.path.isdir(directory):
        return "it is not a directory"
    entries = sorted(os.listdir(directory))
    for name in entries:
        if name not in _TOP:
            return f"it holds {name!r}, which qbits does not write"
    for name in ("meta", "arrays"):
        if name not in entries:
            return f"it has no {name!r} item"
    for name in entries:
        path = os.path.join(directory, name)
        is_dir = name in ("meta", "arrays")
        if os.path.islink(path) or os.path.isdir(path) != is_dir:
            kind = "a directory" if is_dir else "a file"
            return f"its {name!r} is not {kind} as qbits writes it"
    for name in sorted(os.listdir(os.path.join(directory, "arrays"))):
        if not _ARRAYS.fullmatch(name):
            return f"it holds 'arrays/{name}', which qbits does not write"
    meta = os.path.join(directory, "meta")
    for name in sorted(os.listdir(meta)):
        if name not in _META:
            return f"it holds 'meta/{name}', which qbits does not write"
    try:
        with open(os.path.join(meta, "metadata"), "rb") as f:
            data = json.loads(f.read(_MAX_META))
    except (OSError, ValueError):
        data = None
    if not (isinstance(data, dict) and data.get("format") == FORMAT):
        return f"its 'meta/metadata' is not qbits' (no format {FORMAT!r})"
    return ""


def check_destination(owner: str, directory: str, force: bool) -> bool:
    """Checks where ``save`` writes; True if a checkpoint there is replaced.

    With ``force``, only an empty directory or a checkpoint qbits wrote (see
    :func:`not_a_checkpoint`) is replaced, and only such checkpoints may lie
    where the replacement passes (``<directory>.qbits-new``,
    ``<directory>.qbits-old``, left by an interrupted save); anything else is
    refused before anything is written or removed.
    """
    if os.path.lexists(directory):
        if not force:
            raise bad_directory(
                owner,
                directory,
                "it exists already",
                "a path that does not exist yet, or force=True to replace a checkpoint",
            )
        if os.path.islink(directory) or not os.path.isdir(directory):
            raise bad_directory(
                owner, directory, "it is not a directory", "a checkpoint to replace"
            )
        why = not_a_checkpoint(directory) if os.listdir(directory) else ""
        if why:
            raise bad_directory(
                owner,
                directory,
                f"force=True replaces only a checkpoint qbits wrote, and {why}",
                "a checkpoint written by qbits.serving.save (or an empty "
                "directory) to replace, or a new path",
            )
        for leftover in (directory + NEW, directory + OLD):
            why = not_a_checkpoint(leftover) if os.path.lexists(leftover) else ""
            if why:
                raise bad_directory(
                    owner,
                    directory,
                    f"force=True would first remove {leftover}, which is not a "
                    f"checkpoint qbits wrote ({why})",
                    f"a path without {os.path.basename(leftover)} beside it",
                )
        return True
    parent = os.path.dirname(directory)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise bad_directory(owner, directory, f"{parent} is a file", "a writable path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise bad_directory(
            owner, directory, f"no permission to write in {parent}", "a writable path"
        )
    return False


def swap(new: str, directory: str) -> None:
    """Puts the complete checkpoint ``new`` at ``directory``, removing the old."""
    old = directory + OLD
    if os.path.lexists(old):  # left by an interrupted save (checked before)
        shutil.rmtree(old)
    os.rename(directory, old)
    os.rename(new, directory)
    shutil.rmtree(old)


def remove_unfinished(target: str) -> None:
    """Removes what a failed save of ``target`` left: Orbax's temporary directory.

    Orbax writes ``<target>.orbax-checkpoint-tmp`` and removes whatever is there
    before each save, so nothing but its own unfinished writes is removed.
    """
    shutil.rmtree(target + TMP, ignore_errors=True)


def check_directory(owner: str, directory: str) -> None:
    """Refuses, by name, a path that cannot hold a serving checkpoint."""
    if not os.path.exists(directory):
        raise bad_directory(owner, directory, "it does not exist")
    if not os.path.isdir(directory):
        raise bad_directory(owner, directory, "it is a file, not a directory")
    if TMP in os.path.basename(directory):
        raise bad_directory(
            owner, directory, "it is the temporary directory of an unfinished save"
        )
    entries = set(os.listdir(directory))
    if not entries:
        raise bad_directory(owner, directory, "it is an empty directory")
    for item in ("meta", "arrays"):
        if item not in entries:
            raise bad_directory(
                owner,
                directory,
                f"it has no {item!r} item ({item}/ is missing): not a serving "
                "checkpoint, or a damaged one",
            )
