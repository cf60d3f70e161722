"""Reading a user's file without waiting on it: regular files only.

Opening a FIFO (named pipe) for reading waits for a writer, forever if none
comes, and a device can stream without end. :func:`read_regular_file` opens
without blocking and reads only a regular file; config and sweep files
(:func:`qbits.load_config`) and ``qbits generate --prompt-file`` are
read through it.
"""

from __future__ import annotations

import os
import stat

__all__ = ["read_regular_file"]


def read_regular_file(path: str | os.PathLike, limit: int) -> tuple[bytes, str | None]:
    """The first ``limit`` bytes of ``path``, or what it is if not a regular file.

    Args:
      path: The file.
      limit: The most bytes read (a caller that refuses larger files asks
        for one byte more than it accepts).

    Returns:
      ``(data, None)`` for a regular file; ``(b"", kind)`` for anything else,
      ``kind`` saying what it is, e.g. ``"a FIFO (named pipe)"``, ``"a
      directory"``: nothing is read from it.

    Raises:
      OSError: When the file cannot be opened or read.
      ValueError: For a path with a NUL byte.

    Example:
      >>> import os, tempfile
      >>> from qbits._files import read_regular_file
      >>> folder = tempfile.mkdtemp()
      >>> os.mkfifo(os.path.join(folder, "pipe"))
      >>> read_regular_file(os.path.join(folder, "pipe"), 10)
      (b'', 'a FIFO (named pipe)')
      >>> read_regular_file(folder, 10)
      (b'', 'a directory')
    """
    # Opening a FIFO for reading waits for a writer: not without O_NONBLOCK.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        return b"", _kind(mode)
    with open(fd, "rb") as f:
        return f.read(limit), None


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, e.g. ``"a FIFO (named pipe)"``."""
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((what for test, what in kinds if test(mode)), "not a regular file")
