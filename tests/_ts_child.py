"""A tensorstore writer in another process: rewrites an array, or is SIGKILLed mid-write.

Run as ``python _ts_child.py URL HOW VALUE ROWS`` (HOW: fresh, overwrite, update or resume;
fsspec storage options as JSON in $DURABLE_TEST_STORAGE_OPTIONS). Inside
`durable.tensorstore.writing` it writes an array of ROWS x COLS float32, every element
VALUE, chunk by chunk (``update`` opens the committed array and resizes it to ROWS rows).
After each step it prints the step's name and waits for a line on stdin, so the parent
stops it exactly between two steps, with no sleeps: ``created`` (metadata written, no
chunk), ``chunk I`` after each chunk, then ``committed``.

The parent side (`TsChild`) is here too, so the tests share one protocol.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
COLS = 30
CHUNKS = (10, 10)
ENV_OPTIONS = "DURABLE_TEST_STORAGE_OPTIONS"


def chunk_slices(rows: int) -> list[tuple[slice, slice]]:
    return [(slice(r, r + CHUNKS[0]), slice(c, c + CHUNKS[1]))
            for r in range(0, rows, CHUNKS[0]) for c in range(0, COLS, CHUNKS[1])]


def write(url: str, how: str, value: float, rows: int, options: dict[str, Any] | None,
          step: Callable[[str], None] = lambda name: None) -> None:
    """The child's whole write (the parent may run it in-process, e.g. for memory://)."""
    import numpy as np
    import tensorstore as ts

    import durable.tensorstore as dts

    with dts.writing(url, storage_options=options, overwrite=how == "overwrite",
                     update=how == "update", resume=how == "resume") as w:
        if how in ("update", "resume"):
            array = w.open(open=True)
            if array.shape[0] != rows:
                array = array.resize(exclusive_max=[rows, COLS]).result()
        else:
            array = w.open(create=True, dtype=ts.float32, shape=[rows, COLS],
                           chunk_layout=ts.ChunkLayout(chunk_shape=list(CHUNKS)))
        step("created")
        block = np.full(CHUNKS, value, dtype="float32")
        for i, where in enumerate(chunk_slices(rows)):
            array[where] = block
            step(f"chunk {i}")
    step("committed")


def _step(name: str) -> None:
    print(name, flush=True)
    sys.stdin.readline()  # "go", or EOF once the parent lets it run to the end


class TsChild:
    """The parent's handle on one child writer."""

    def __init__(self, url: str, how: str, value: float, rows: int,
                 storage_options: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> None:
        child_env = dict(os.environ, **(env or {}))
        child_env[ENV_OPTIONS] = json.dumps(storage_options or {})
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_ts_child.py"), url, how, str(value),
             str(rows)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, env=child_env)

    def run_until(self, step: str) -> None:
        """Let the child run step by step until it has reported ``step``."""
        assert self.proc.stdout is not None and self.proc.stdin is not None
        while True:
            got = self.proc.stdout.readline().rstrip("\n")
            if got == step:
                return
            if not got:
                _, err = self.proc.communicate()
                raise AssertionError(f"child ended before {step!r}; stderr:\n{err}")
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate()
        assert self.proc.returncode == -signal.SIGKILL

    def finish(self) -> None:
        """Let it run to the end; it must have committed."""
        out, err = self.proc.communicate("go\n" * 1000)
        assert self.proc.returncode == 0, err
        assert out.strip().splitlines()[-1] == "committed", out


def rewrite(url: str, how: str, value: float, rows: int,
            storage_options: dict[str, Any] | None = None) -> None:
    """Another process rewrites and recommits the array at ``url``."""
    TsChild(url, how, value, rows, storage_options).finish()


if __name__ == "__main__":
    opts = json.loads(os.environ.get(ENV_OPTIONS) or "{}") or None
    write(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), opts, _step)
