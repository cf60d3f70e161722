"""The safetensors file format, read and written with NumPy alone.

A file is an 8-byte little-endian header length, a JSON header (``{name:
{"dtype", "shape", "data_offsets": [begin, end]}}``, offsets into the data
after it, plus an optional ``"__metadata__"``) and the tensors' bytes. A
checkpoint is one file or shards listed by ``model.safetensors.index.json``
(``{"weight_map": {tensor: file}}``). Every header is checked against its
file's size before a byte of data is used: a truncated shard is an error
naming the file and tensor, never a half-read checkpoint.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qbits._errors import InvalidArgumentError

__all__ = ["DTYPES", "bad", "read_tensors", "write_tensors"]

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
OWNER = "qbits.interop.read_checkpoint"


def bad(where: str, value: object, allowed: str, why: str = "") -> InvalidArgumentError:
    """The one-line error of a checkpoint: ``where`` names the file and tensor."""
    return InvalidArgumentError(OWNER, where, value, allowed, why=why)


def modules_with(
    tensors: Mapping[str, Any], suffix: str, where: str, what: str, declared: str
) -> list[str]:
    """The modules with a tensor ``<module><suffix>``, sorted; none is an error.

    ``what`` names the tensors a format needs, ``declared`` the
    ``config.json`` entry that says the checkpoint is in that format.
    """
    modules = sorted(n[: -len(suffix)] for n in tensors if n.endswith(suffix))
    if not modules:
        raise bad(
            f"{where}: *{suffix}", "missing", what,
            why=f"config.json declares {declared}",
        )  # fmt: skip
    return modules


def _files(folder: pathlib.Path) -> dict[str, list[str] | None]:
    """``{shard file: tensors the index puts there (None: all)}``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise bad(
                str(index), "unreadable", 'JSON with a "weight_map"', why=e
            ) from None
        files: dict[str, list[str] | None] = {}
        for tensor, file in weight_map.items():
            files.setdefault(file, []).append(tensor)  # type: ignore[union-attr]
        return files
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if not found:
        raise bad(str(folder), "no *.safetensors file", "a checkpoint folder")
    return dict.fromkeys(found)


def _header(path: pathlib.Path, size: int) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(str(path), f"{size} bytes", "a safetensors file", why="truncated")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise bad(
                str(path),
                f"a {n}-byte header in {size} bytes",
                "a whole file",
                why="truncated shard",
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise bad(
                str(path), "an unreadable header", "a JSON header", why=e
            ) from None
    return header, 8 + n


def read_tensors(folder: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint folder (one file or indexed shards), checked.

    Raises:
      InvalidArgumentError: For a missing or truncated shard, an unknown
        dtype, offsets that do not fit the shape, or a tensor listed by the
        index but absent from its shard; nothing is returned half-read.
    """
    folder = pathlib.Path(folder)
    out: dict[str, np.ndarray] = {}
    for file, listed in _files(folder).items():
        path = folder / file
        if not path.is_file():
            raise bad(str(path), "missing", "a shard the index lists")
        size = path.stat().st_size
        header, start = _header(path, size)
        header.pop("__metadata__", None)
        for name in listed or ():
            if name not in header:
                raise bad(f"{path}: {name}", "missing", "a tensor the index puts here")
        data = np.memmap(path, np.uint8, mode="r") if size > start else None
        for name, info in header.items():
            where = f"{path}: {name}"
            dtype = DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise bad(where, info.get("dtype"), "one of " + ", ".join(DTYPES))
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != nbytes:
                raise bad(
                    where,
                    f"{end - begin} bytes",
                    f"{nbytes} for {info['dtype']}{list(shape)}",
                )
            if start + end > size:
                raise bad(
                    where,
                    f"bytes {begin}..{end}",
                    f"within the file's {size - start}",
                    why="truncated shard",
                )
            raw = data[start + begin : start + end] if nbytes else np.zeros(0, np.uint8)
            out[name] = np.array(raw).view(dtype).reshape(shape)  # type: ignore[index]
    return out


def write_tensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
    """Writes ``tensors`` as one safetensors file (sorted names, aligned to 8 bytes)."""
    header: dict[str, object] = {}
    chunks, offset = [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        raw = a.tobytes()
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in chunks:
            f.write(raw)
