"""What makes a serving checkpoint trustworthy: checksums and path checks.

:func:`~qbits.serving.save` records every array's path, shape, dtype and the
SHA-256 of its bytes (computed on the host) in the checkpoint's ``meta``
item; :func:`~qbits.serving.restore` refuses a target whose arrays have other
shapes or dtypes before reading, and arrays whose bytes do not match after.
The path checks turn what Orbax would report as a raw ``KeyError``,
``FileNotFoundError`` or TensorStore dump into one
:class:`~qbits.InvalidArgumentError` that names the checkpoint's path.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import sys
import warnings
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
    "orbax_cause",
    "read_checksums",
    "swap",
    "verify",
]

CHECKPOINT = "a checkpoint written by qbits.serving.save"
# Where save(..., force=True) writes the new checkpoint, and moves the old one.
NEW, OLD = ".qbits-new", ".qbits-old"


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


def _sha256(x: Any) -> str | None:
    """SHA-256 of an array's bytes, on the host; None unless all are here."""
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:  # sharded over hosts: not checksummed
            return None
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
    a = np.ascontiguousarray(np.asarray(x))
    return hashlib.sha256(a.reshape(-1).view(np.uint8)).hexdigest()


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


def read_checksums(owner: str, directory: str, meta: dict[str, Any]) -> dict | None:
    """The checkpoint's array records; None (with a warning) for version 1."""
    if meta["version"] == 1:
        warnings.warn(
            f"qbits.serving.restore: the checkpoint at {directory} was written "
            "before qbits stored checksums (format version 1), so its arrays "
            "are restored unverified; save it again to add checksums.",
            UserWarning,
            stacklevel=3,
        )
        return None
    records = meta.get("checksums")
    ok = isinstance(records, dict) and all(
        isinstance(r, dict)
        and isinstance(r.get("shape"), list)
        and isinstance(r.get("dtype"), str)
        and (r.get("sha256") is None or isinstance(r.get("sha256"), str))
        for r in records.values()
    )
    if not ok:
        raise bad_directory(
            owner, directory, "its meta item has no valid 'checksums' entry"
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
        saved = records[path]["sha256"]
        if saved is not None and _sha256(x) not in (None, saved):
            raise bad_directory(
                owner,
                directory,
                f"array {path!r} does not match the SHA-256 checksum saved with "
                "it: the checkpoint is damaged or was changed after saving",
                allowed=f"an intact {CHECKPOINT}",
            )


# --- paths ------------------------------------------------------------------


def check_destination(owner: str, directory: str, force: bool) -> bool:
    """Checks where ``save`` writes; True if a checkpoint there is replaced."""
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
        entries = set(os.listdir(directory))
        if entries and not entries & {"meta", "arrays", "_CHECKPOINT_METADATA"}:
            raise bad_directory(
                owner,
                directory,
                "it holds other files, and force=True replaces only a checkpoint",
                "a checkpoint (or an empty directory) to replace",
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
    if os.path.lexists(old):  # left by an interrupted save
        shutil.rmtree(old)
    os.rename(directory, old)
    os.rename(new, directory)
    shutil.rmtree(old)


def check_directory(owner: str, directory: str) -> None:
    """Refuses, by name, a path that cannot hold a serving checkpoint."""
    if not os.path.exists(directory):
        raise bad_directory(owner, directory, "it does not exist")
    if not os.path.isdir(directory):
        raise bad_directory(owner, directory, "it is a file, not a directory")
    if ".orbax-checkpoint-tmp" in os.path.basename(directory):
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
