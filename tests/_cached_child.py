"""Cached functions and lease holders in child processes that the tests kill, stop and race.

Both sides import this module under the same name (children run
``python -c "import _cached_child; _cached_child.main()"``), so `compute` has the same cache
key in the parent and in every child. Every computation appends ``"<x> <pid>"`` to the
counter file (O_APPEND: whole lines, from any number of processes), and returns
``[x, pid]``, so a test can tell which process's result a caller got.

`rounds` is the target of the racing callers (multiprocessing children, forked from a
forkserver that imported this module once). Modes of the line-driven children (``argv[0]``):

- ``hold ROOT OPTS COUNTER X WHERE``: call ``compute(X)`` with ``on_incomplete="raise"``,
  stopping at WHERE: ``compute`` (prints ``computing``) or ``write`` (prints ``writing``,
  inside the serializer, so inside ``Entry.writing()``), waiting for a line on stdin; then
  print the result, or the error's type and message.
- ``lease URL OPTS``: acquire a Lease and print ``held``; on a line, enter ``fenced()`` and
  print ``fenced``; on another, leave it, release, and print ``released``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import durable

HERE = os.path.dirname(os.path.abspath(__file__))
STALE_AFTER = 1.0

#: set by the side that runs compute: where computations are counted, and what to stop at
COUNTER: str | None = None
ON_COMPUTE: Callable[[], None] | None = None
ON_WRITE: Callable[[], None] | None = None
WRAP = False


class Tagged:
    """A result whose serializer can be made to stop mid-write (see ON_WRITE)."""

    def __init__(self, array: Any) -> None:
        self.array = array


def _tagged_dumps(value: Tagged) -> bytes:
    if ON_WRITE is not None:
        ON_WRITE()
    return json.dumps(value.array.tolist()).encode()


def _tagged_loads(data: bytes) -> np.ndarray:
    return np.array(json.loads(data))


durable.register_serializer(Tagged, name="tagged-test", dumps=_tagged_dumps,
                            loads=_tagged_loads)


def compute(x: int) -> Any:
    assert COUNTER is not None
    fd = os.open(COUNTER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{x} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    if ON_COMPUTE is not None:
        ON_COMPUTE()
    result = np.array([x, os.getpid()], dtype=np.int64)
    return Tagged(result) if WRAP else result


def cached_compute(root: str, options: dict[str, Any], on_incomplete: str | None,
                   stale_after: float = STALE_AFTER) -> Any:
    """`compute` cached under ``root``; ``on_incomplete`` None: cached's default."""
    policy = {} if on_incomplete is None else {"on_incomplete": on_incomplete}
    return durable.cached(root, storage_options=options or None, stale_after=stale_after,
                          **policy)(compute)  # type: ignore[arg-type]


def computations(counter: str) -> list[tuple[int, int]]:
    """Every computation so far, as (x, pid)."""
    try:
        with open(counter) as f:
            return [(int(a), int(b)) for a, b in (line.split() for line in f)]
    except FileNotFoundError:
        return []


# the child side ----------------------------------------------------------------------------
def _step(name: str) -> None:
    print(name, flush=True)
    sys.stdin.readline()


def rounds(root: str, options: dict[str, Any], counter: str, barrier: Any, n_rounds: int,
           results: Any, ident: int) -> None:
    """A racing caller (a multiprocessing child): ``compute(r)`` with "wait" for each round,
    every caller entering each round together; puts (ident, {round: [x, pid]}) or
    (ident, "error text") on ``results``."""
    global COUNTER
    COUNTER = counter
    try:
        f = cached_compute(root, options, "wait")
        got = {}
        for r in range(n_rounds):
            barrier.wait(timeout=120)
            got[r] = f(r).tolist()
        results.put((ident, got))
    except BaseException as exc:
        barrier.abort()
        results.put((ident, f"{type(exc).__name__}: {exc}"))


def cas_racer(path: str, options: dict[str, Any], n_rounds: int, barrier: Any, results: Any,
              ident: int) -> None:
    """Conditional writes racing others on one version, round after round (a
    multiprocessing child); puts (ident, ["won" | "lost", ...]) or (ident, "error")."""
    from durable.adapters import resolve
    from durable.adapters.base import VersionMismatchError

    adapter, p = resolve(path, options or None)
    outcomes = []
    try:
        for r in range(n_rounds):
            barrier.wait(timeout=60)  # the last round is over: everyone sees one version
            version = adapter.info(p).version
            barrier.wait(timeout=60)
            try:
                adapter.replace_if(p, f"racer {ident} {os.getpid()} {r}".encode(), version)
                outcomes.append("won")
            except VersionMismatchError:
                outcomes.append("lost")
        results.put((ident, outcomes))
    except BaseException as exc:
        barrier.abort()
        results.put((ident, f"{type(exc).__name__}: {exc}"))


def renewing_holder(url: str, n_rounds: int, held: Any, removed: Any, out: Any,
                    go: Any) -> None:
    """Round after round (a multiprocessing child): take the lease of ``url``, set ``held``,
    renew it back to back until a renewal finds it lost (puts "lost"), or until one that
    started once ``removed`` was set went through ("still held": removed, yet renewed;
    or the error a renewal raised); then wait for ``go``. (Events, not the queue, say
    "held": a queue's feeder thread gets no turn while the loop runs.)"""
    from durable import Lease, LeaseLostError

    for _ in range(n_rounds):
        try:
            # No heartbeat of its own to speak of: every renewal is this loop's.
            with Lease(url, heartbeat=1000, stale_after=3600) as lease:
                held.set()
                until = time.monotonic() + 60
                try:
                    while time.monotonic() < until:
                        after_removal = removed.is_set()
                        lease.renew()
                        if after_removal:
                            break
                    out.put("still held")
                except LeaseLostError:
                    out.put("lost")
        except Exception as exc:
            held.set()  # (if it failed to take the lease: the round is over all the same)
            out.put(f"{type(exc).__name__}: {exc}")
        go.get(timeout=60)


def lock_taker(path: str, out: Any, go: Any) -> None:
    """Take the local disk's lock guarding ``path`` (a multiprocessing child), put the
    inode of the lock file it holds, and hold it until ``go``."""
    from durable.adapters import resolve
    from durable.adapters.local import _cas_locks, _lock_path

    with resolve(path)[0].exclusive(path):
        fd = _cas_locks[_lock_path(path)].fd
        assert fd is not None
        out.put(os.fstat(fd).st_ino)
        go.get(timeout=60)


def _hold(root: str, options: dict[str, Any], x: int, where: str) -> None:
    global ON_COMPUTE, ON_WRITE, WRAP
    if where == "compute":
        ON_COMPUTE = lambda: _step("computing")  # noqa: E731
    else:
        WRAP = True
        ON_WRITE = lambda: _step("writing")  # noqa: E731
    f = cached_compute(root, options, "raise")
    try:
        print(json.dumps(f(x).tolist()), flush=True)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)


def _lease(url: str, options: dict[str, Any]) -> None:
    with durable.Lease(url, storage_options=options or None, heartbeat=STALE_AFTER / 5,
                       stale_after=STALE_AFTER) as lease:
        _step("held")
        with lease.fenced():
            _step("fenced")
    print("released", flush=True)


def main(argv: list[str] | None = None) -> None:
    global COUNTER
    args = sys.argv[1:] if argv is None else argv
    mode, root, options = args[0], args[1], json.loads(args[2])
    if mode == "hold":
        COUNTER = args[3]
        _hold(root, options, int(args[4]), args[5])
    elif mode == "lease":
        _lease(root, options)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


# the parent side ---------------------------------------------------------------------------
class Child:
    """One child process, driven line by line over stdin/stdout."""

    def __init__(self, *args: str) -> None:
        code = (f"import sys; sys.path.insert(0, {HERE!r}); import _cached_child; "
                "_cached_child.main()")
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def expect(self, line: str) -> None:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().rstrip("\n")
        if got != line:
            self.proc.kill()
            _, err = self.proc.communicate()
            raise AssertionError(f"child said {got!r}, expected {line!r}; stderr:\n{err}")

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate()
        assert self.proc.returncode == -signal.SIGKILL

    def finish(self) -> str:
        """Let it run to the end; its last line of output."""
        out, err = self.proc.communicate("go\n" * 10)
        assert self.proc.returncode == 0, err
        lines = out.strip().splitlines()
        assert lines, err
        return lines[-1]


if __name__ == "__main__":
    main()
