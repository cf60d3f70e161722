"""Orbax, quietly: a failed save or restore is one qbits error, nothing else.

When one of the reads or writes Orbax runs at once fails (a damaged array
file, a full disk), Orbax raises, and its event loop is closed while the
other reads or writes are still pending in TensorStore. Each of those then
reports "RuntimeError: Event loop is closed" (or, garbage collected, a
TensorStore dump) from TensorStore's threads, at a random later time; and
Orbax logs the failure itself, traceback included, as ``ERROR:absl``. The
caller already gets that failure as one
:class:`~qbits.InvalidArgumentError` with Orbax's error chained, so
:func:`quietly` removes the noise at its source:

- every event loop made while it runs finishes its pending tasks before it
  closes, so nothing is left to report later;
- Orbax's error log records are held back, and dropped if the block raises
  (the error raised says it all), or logged as usual if it does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["DRAIN_SECONDS", "drains", "quietly"]

_lock = threading.Lock()
_users = 0
_previous: asyncio.AbstractEventLoopPolicy | None = None


#: Longest wait for a closing loop's pending tasks; those left are cancelled.
DRAIN_SECONDS = 60.0


def drains(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
    """``loop``, made to finish its pending tasks when it is closed.

    The tasks get :data:`DRAIN_SECONDS` (they wait for reads or writes
    already under way); any still pending then are cancelled, so closing
    never hangs. A loop that cannot be changed (a compiled one, e.g.
    uvloop's) is given back as it is.
    """
    close = loop.close

    def finish_then_close() -> None:
        if not loop.is_closed() and not loop.is_running():
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            if pending:
                _, late = loop.run_until_complete(
                    asyncio.wait(pending, timeout=DRAIN_SECONDS)
                )
                for task in late:
                    task.cancel()
                done = asyncio.gather(*pending, return_exceptions=True)
                loop.run_until_complete(done)  # retrieves every exception
        close()

    with contextlib.suppress(AttributeError):
        loop.close = finish_then_close  # type: ignore[method-assign]
    return loop


class _Draining(asyncio.AbstractEventLoopPolicy):
    """The policy in place, except that its new loops finish before closing."""

    def __init__(self, base: asyncio.AbstractEventLoopPolicy):
        self._base = base

    def get_event_loop(self) -> asyncio.AbstractEventLoop:
        return self._base.get_event_loop()

    def set_event_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._base.set_event_loop(loop)

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return drains(self._base.new_event_loop())

    def __getattr__(self, name: str) -> Any:  # e.g. the child watchers of 3.11
        return getattr(self._base, name)


@contextlib.contextmanager
def _draining_loops() -> Iterator[None]:
    global _users, _previous
    with _lock:
        if _users == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                _previous = asyncio.get_event_loop_policy()
                asyncio.set_event_loop_policy(_Draining(_previous))
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    asyncio.set_event_loop_policy(_previous)
                _previous = None


class _HoldOrbaxErrors(logging.Filter):
    """Holds back the error records Orbax logs (it logs through absl)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and "orbax" in record.pathname:
            self.held.append(record)
            return False
        return True


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    """Runs a block of Orbax calls without Orbax's noise (see the module).

    Example:
      >>> with quietly():
      ...     pass
    """
    logger = logging.getLogger("absl")
    hold = _HoldOrbaxErrors()
    logger.addFilter(hold)
    failed = True
    try:
        with _draining_loops():
            yield
        failed = False
    finally:
        logger.removeFilter(hold)
        if not failed:
            for record in hold.held:
                logger.handle(record)
