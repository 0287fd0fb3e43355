"""Housekeeping nobody waits for: what a committed attempt leaves behind, removed later.

Once an entry's marker is written, the attempt's record (and its fragments and spent
records) only say that a writer *was* there. Removing them is housekeeping; on a store
across a network it is a round trip (one DeleteObjects on S3: about 2% of a 64-chunk
tensorstore write on moto, a whole round trip on a real store), so `later` hands it to one
background thread and the commit returns.

What this cannot break:

- The protocol's order. A removal is handed over only after the marker's PUT returned, so
  a failing writer that finds no attempt record finds the marker (`Entry.writing`).
- A process that ends. At interpreter exit the work already queued is waited for: a
  normal exit leaves nothing behind. But only while it moves: once no piece has finished
  for `EXIT_PATIENCE` seconds (a store that stalls: a client retries a request that never
  answers for many minutes, 25 tries of 60 s on S3) the rest is left, with a warning, and
  the process ends; its thread is a daemon for that. A process whose commits had returned
  could not exit for over 6 minutes behind a stalled DeleteObjects. What is left, as what
  a killed process leaves, is records beside the marker: the entry is COMPLETE all the
  same, and `durable clean` removes them.
- The caller. A failed removal is logged, never raised: a leftover record is harmless.

Local disk and memory answer in microseconds: there the work runs at once, in the caller.
`wait` blocks until everything handed over so far has run (tests that count requests, a
caller that wants the store quiet).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

__all__ = ["EXIT_PATIENCE", "later", "wait"]

log = logging.getLogger(__name__)

#: At interpreter exit, how long to wait for the next piece of queued work to finish
#: before leaving the rest (seconds): a healthy store answers a removal in milliseconds.
EXIT_PATIENCE = 30.0

_Work = tuple[Callable[[], None], str, "Future[None]"]
_lock = threading.Lock()
_queue: queue.SimpleQueue[_Work] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_pending: dict[Future[None], str] = {}
_exiting = False


def later(work: Callable[[], None], what: str, *, now: bool = False) -> None:
    """Run ``work`` on the background thread (at once, in the caller, with ``now``);
    ``what`` names it in the warning if it fails."""
    if now:
        _run(work, what)
        return
    global _thread
    future: Future[None] = Future()
    with _lock:
        if _thread is None and not _exiting:
            # A daemon: a stalled store must not keep the process from ending (at exit
            # `_wait_quietly` waits while the work moves, then leaves it).
            thread = threading.Thread(target=_work, name="durable-housekeeping", daemon=True)
            with contextlib.suppress(RuntimeError):  # no new thread at interpreter shutdown
                thread.start()
                _thread = thread
                _drain_before_executors_close()
        # Past the exit wait (a commit in an atexit handler), or with no thread: a daemon
        # would be stopped with the work undone; the caller does it.
        queued = _thread is not None and not _exiting
        if queued:
            _pending[future] = what
            _queue.put((work, what, future))
    if not queued:
        _run(work, what)
        return
    future.add_done_callback(_done)


def wait(timeout: float | None = None) -> None:
    """Block until the work handed to `later` so far has run; ``timeout``: seconds to wait
    for each piece at most (TimeoutError past it)."""
    with _lock:
        futures = list(_pending)
    for future in futures:
        future.result(timeout)


def _drain_before_executors_close() -> None:
    """At interpreter exit, wait for the work handed over before `concurrent.futures`
    stops taking new work anywhere. Its own exit hook closes every executor, asyncio's
    default one included, where a new connection's DNS lookup goes (aiohttp): a removal
    still to connect then failed ("cannot schedule new futures after interpreter
    shutdown", on Azure, whose SDK opens a client per blob), logged a warning and left
    the record for `durable clean`. Hooks registered here run in reverse order, so this
    one, registered after that module's, runs first."""
    # Another Python: atexit's hooks still run before daemon threads stop.
    register = getattr(threading, "_register_atexit", atexit.register)
    with contextlib.suppress(RuntimeError):  # already shutting down: nothing to hook
        register(_wait_quietly)


def _wait_quietly() -> None:
    global _exiting
    with _lock:
        _exiting = True
    while True:
        with _lock:
            futures = [f for f in _pending if not f.done()]
        if not futures:
            return
        try:
            futures[0].result(EXIT_PATIENCE)
        except FutureTimeout:
            with _lock:
                left = [what for f, what in _pending.items() if not f.done()]
            log.warning("leaving %d pieces of housekeeping the store did not answer for "
                        "%.0f s at exit (left for `durable clean`): %s", len(left),
                        EXIT_PATIENCE, "; ".join(left))
            return


def _work() -> None:
    while True:
        work, what, future = _queue.get()
        if future.set_running_or_notify_cancel():
            _run(work, what)
            future.set_result(None)


def _run(work: Callable[[], None], what: str) -> None:
    try:
        work()
    except Exception as exc:
        log.warning("%s failed (left for `durable clean`): %s", what, exc)


def _done(future: Future[None]) -> None:
    with _lock:
        _pending.pop(future, None)


def _forget() -> None:
    # A forked child has no copy of the parent's thread: its queue is not the child's.
    global _thread, _lock, _queue
    _lock = threading.Lock()
    _queue = queue.SimpleQueue()
    _thread = None
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
