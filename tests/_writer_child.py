"""A writer in a child process that the tests SIGKILL at chosen points.

Run as ``python _writer_child.py MODE URL ...``. After each step it prints the step's name
and waits for a line on stdin, so the parent decides, step by step, whether to let it go
on or to kill it there: no sleeps, the kill lands exactly between two steps.

Modes:
- ``entry URL N [fresh|resume|overwrite]``: ``Entry(URL).writing()``; steps ``attempt``
  (inside writing(), the attempt record written), ``object I`` after each object,
  ``partial`` (an object half written, its temp file open), ``written`` (all objects
  through, marker not yet written); then it commits and prints ``won`` or ``lost``
  (AlreadyCompleteError).
- ``atomic URL N [OPTIONS_JSON]``: ``atomic_write(URL)`` (with those storage options);
  step ``partial`` after N // 2 bytes reached the temp file (on an object store: were
  handed to the writer), then ``committed``.

The parent side (`Child`) is here too, so the tests share one protocol.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OBJECT_SIZE = 64 * 1024


def payload(i: int, size: int = OBJECT_SIZE) -> bytes:
    """Object i's bytes: the same in every process, so racing writers agree."""
    return random.Random(i).randbytes(size + i)


def key(i: int) -> str:
    return f"c/{i // 4}/{i}"  # nested, like zarr chunks


def _step(name: str) -> None:
    print(name, flush=True)
    sys.stdin.readline()  # "go", or EOF once the parent lets it run to the end


def _entry(url: str, n: int, how: str) -> None:
    from durable import AlreadyCompleteError, Entry

    try:
        with Entry(url).writing(resume=how == "resume", overwrite=how == "overwrite") as w:
            _step("attempt")
            for i in range(n):
                with w.fs.open(f"{w.path}/{key(i)}", "wb") as f:
                    f.write(payload(i))
                _step(f"object {i}")
            f = w.fs.open(f"{w.path}/{key(n)}", "wb")
            data = payload(n)
            f.write(data[: len(data) // 2])
            _step("partial")
            f.write(data[len(data) // 2:])
            f.close()
            _step("written")
    except AlreadyCompleteError:
        print("lost", flush=True)
        return
    print("won", flush=True)


def _atomic(url: str, n: int, options: str | None) -> None:
    import json

    from durable import atomic_write

    data = payload(0, n)
    with atomic_write(url, storage_options=json.loads(options) if options else None) as f:
        f.write(data[: n // 2])
        f.flush()  # past the BufferedWriter: the bytes are in the temp file now
        _step("partial")
        f.write(data[n // 2:])
    print("committed", flush=True)


class Child:
    """The parent's handle on one child writer."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_writer_child.py"), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1)

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

    def run_until(self, step: str) -> None:
        """Let the child run step by step until it has reported ``step``."""
        assert self.proc.stdout is not None
        while True:
            got = self.proc.stdout.readline().rstrip("\n")
            if got == step:
                return
            if not got:
                _, err = self.proc.communicate()
                raise AssertionError(f"child ended before {step!r}; stderr:\n{err}")
            self.go()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate()
        assert self.proc.returncode == -signal.SIGKILL

    def release(self) -> None:
        """Let it run to the end without waiting for it (so two children can race)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n" * 1000)
        self.proc.stdin.close()
        self.proc.stdin = None  # so that communicate() does not touch the closed pipe

    def finish(self) -> str:
        """Let it run to the end; its last line (``won``, ``lost``, ``committed``)."""
        if self.proc.stdin is not None:
            self.release()
        out, err = self.proc.communicate()
        assert self.proc.returncode == 0, err
        return out.strip().splitlines()[-1]


if __name__ == "__main__":
    mode, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "entry":
        _entry(url, n, sys.argv[4] if len(sys.argv) > 4 else "fresh")
    elif mode == "atomic":
        _atomic(url, n, sys.argv[4] if len(sys.argv) > 4 else None)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
