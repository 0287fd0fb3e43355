"""Housekeeping nobody waits for: what a committed attempt leaves behind, removed later.

Once an entry's marker is written, the attempt's record (and its fragments and spent
records) only say that a writer *was* there. Removing them is housekeeping; on a store
across a network it is a round trip (one DeleteObjects on S3: about 2% of a 64-chunk
tensorstore write on moto, a whole round trip on a real store), so `later` hands it to one
background thread and the commit returns.

What this cannot break:

- The protocol's order. A removal is handed over only after the marker's PUT returned, so
  a failing writer that finds no attempt record finds the marker (`Entry.writing`).
- A process that ends. `concurrent.futures` joins its worker at interpreter exit, after
  the work already queued: a normal exit leaves nothing behind. A killed process leaves
  the records beside the marker, as a kill between the marker and the removal always
  could: the entry is COMPLETE all the same, and `durable clean` removes them.
- The caller. A failed removal is logged, never raised: a leftover record is harmless.

Local disk and memory answer in microseconds: there the work runs at once, in the caller.
`wait` blocks until everything handed over so far has run (tests that count requests, a
caller that wants the store quiet).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["later", "wait"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pending: set[Future[None]] = set()


def later(work: Callable[[], None], what: str, *, now: bool = False) -> None:
    """Run ``work`` on the background thread (at once, in the caller, with ``now``);
    ``what`` names it in the warning if it fails."""
    if now:
        _run(work, what)
        return
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="durable-housekeeping")
            _drain_before_executors_close()
        future = _pool.submit(_run, work, what)
        _pending.add(future)
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
    stops taking new work anywhere. Its own exit hook joins this thread only after it has
    closed every executor, asyncio's default one included, where a new connection's DNS
    lookup goes (aiohttp): a removal still to connect then failed ("cannot schedule new
    futures after interpreter shutdown", on Azure, whose SDK opens a client per blob),
    logged a warning and left the record for `durable clean`. Hooks registered here run
    in reverse order, so this one, registered after that module's, runs first."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return  # another Python: the join at exit still runs the work, as before
    with contextlib.suppress(RuntimeError):  # already shutting down: nothing to hook
        register(_wait_quietly)


def _wait_quietly() -> None:
    with contextlib.suppress(Exception):
        wait()


def _run(work: Callable[[], None], what: str) -> None:
    try:
        work()
    except Exception as exc:
        log.warning("%s failed (left for `durable clean`): %s", what, exc)


def _done(future: Future[None]) -> None:
    with _lock:
        _pending.discard(future)


def _forget() -> None:
    # A forked child has no copy of the parent's thread: its queue is not the child's.
    global _pool, _lock
    _lock = threading.Lock()
    _pool = None
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
