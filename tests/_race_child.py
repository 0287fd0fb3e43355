"""A writer process for the racing-writers tests, driven line by line over stdin.

Run as ``python _race_child.py MODE`` (``entry``: `Entry.writing()`; ``zarr``:
`durable.zarr.writing()`). Commands, each answered with one line:

- ``prep URL VALUE OPTIONS_JSON``: get ready to write VALUE to URL (imports done, the
  Entry built) -> ``ready``
- ``go``: start the writer (enter its ``with`` block) -> ``started``, or ``refused NAME``
  (NAME: the exception's class; the writer is gone)
- ``write``: write every object with VALUE and commit -> ``won``, or ``lost NAME``

The parent sends ``go`` to two of these at once: the start is what races.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
OBJECTS = 8
SHAPE = (40, 40)
CHUNKS = (10, 10)


def payload(value: int, i: int) -> bytes:
    """Object i of the writer of ``value``: tells apart whose bytes an object holds."""
    return bytes([value]) * (1000 + i)


def _serve(mode: str) -> None:
    import zarr  # imported up front, so that "go" pays no import

    import durable.zarr as dz
    from durable import DurableError, Entry

    url, value, options = "", 0, None
    entry: Entry | None = None
    cm: contextlib.AbstractContextManager[Any] | None = None
    handle: Any = None
    for line in sys.stdin:
        cmd, *args = line.split(" ", 3)
        cmd = cmd.strip()
        if cmd == "prep":
            url, value, options = args[0], int(args[1]), json.loads(args[2]) or None
            entry = Entry(url, storage_options=options)
            print("ready", flush=True)
        elif cmd == "go":
            assert entry is not None
            cm = (entry.writing() if mode == "entry"
                  else dz.writing(url, storage_options=options))
            try:
                handle = cm.__enter__()
            except DurableError as exc:
                print(f"refused {type(exc).__name__}", flush=True)
                continue
            print("started", flush=True)
        elif cmd == "write":
            assert cm is not None
            try:
                if mode == "entry":
                    for i in range(OBJECTS):
                        handle.write_bytes(f"o/{i}", payload(value, i))
                else:
                    a = zarr.create_array(handle, shape=SHAPE, chunks=CHUNKS, dtype="int32")
                    for row in range(0, SHAPE[0], CHUNKS[0]):
                        a[row:row + CHUNKS[0]] = value
            except BaseException as exc:
                cm.__exit__(type(exc), exc, exc.__traceback__)
                raise
            try:
                cm.__exit__(None, None, None)
            except DurableError as exc:
                print(f"lost {type(exc).__name__}", flush=True)
                continue
            print("won", flush=True)
        else:
            raise SystemExit(f"unknown command {line!r}")


class RaceChild:
    """The parent's handle on one child."""

    def __init__(self, mode: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_race_child.py"), mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().rstrip("\n")
        if not got:
            self.proc.kill()
            _, err = self.proc.communicate()
            raise AssertionError(f"child ended without an answer; stderr:\n{err}")
        return got

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
            self.proc.stdin = None
        _, err = self.proc.communicate()
        assert self.proc.returncode == 0, err


if __name__ == "__main__":
    _serve(sys.argv[1])
