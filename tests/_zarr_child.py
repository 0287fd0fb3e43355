"""A zarr writer in a child process that the tests SIGKILL at chosen points.

Run as ``python _zarr_child.py URL FORMAT HOW`` (HOW: fresh, resume, overwrite, or
write: `durable.zarr.write` of the array alone, see `write_once`; fsspec
storage options as JSON in $DURABLE_TEST_STORAGE_OPTIONS). Inside `durable.zarr.writing`
it makes a group with one xarray-readable array ``a`` and fills it chunk by chunk. After
each step it prints the step's name and waits for a line on stdin, so the parent kills it
exactly between two steps, with no sleeps:

``created`` (group and array metadata set, no chunk), ``chunk I`` after each chunk,
``written`` (every chunk and the consolidated metadata, nothing published),
``published`` (metadata copied into the entry, no marker yet); then the commit, and the
last line is ``committed`` or ``lost`` (another writer committed first).

The parent side (`ZarrChild`) is here too, so the tests share one protocol.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = (40, 30)
CHUNKS = (10, 10)
N_CHUNKS = 12
ENV_OPTIONS = "DURABLE_TEST_STORAGE_OPTIONS"


def expected() -> Any:
    """The array every writer writes: no chunk equals the fill value (0), none is deleted."""
    return np.arange(1, SHAPE[0] * SHAPE[1] + 1, dtype="float32").reshape(SHAPE)


def chunk_slices(i: int) -> tuple[slice, slice]:
    per_row = SHAPE[1] // CHUNKS[1]
    r, c = divmod(i, per_row)
    return (slice(r * CHUNKS[0], (r + 1) * CHUNKS[0]), slice(c * CHUNKS[1], (c + 1) * CHUNKS[1]))


def _step(name: str) -> None:
    print(name, flush=True)
    sys.stdin.readline()  # "go", or EOF once the parent lets it run to the end


def write(url: str, zarr_format: int, how: str, options: dict[str, Any] | None,
          step: Callable[[str], None] = lambda name: None) -> str:
    """The child's whole write (the parent runs it in-process for retries)."""
    import zarr

    import durable.zarr as dz
    from durable import AlreadyCompleteError

    data = expected()
    try:
        with dz.writing(url, storage_options=options, resume=how == "resume",
                        overwrite=how == "overwrite") as store:
            group = zarr.open_group(store, mode="a", zarr_format=zarr_format)
            if "a" in group:
                array = group["a"]  # a resumed write finds the killed attempt's metadata
            else:
                dims = {"dimension_names": ["y", "x"]} if zarr_format == 3 else {
                    "attributes": {"_ARRAY_DIMENSIONS": ["y", "x"]}}
                array = group.create_array("a", shape=SHAPE, chunks=CHUNKS, dtype="float32",
                                           fill_value=0, **dims)
            step("created")
            for i in range(N_CHUNKS):
                array[chunk_slices(i)] = data[chunk_slices(i)]
                step(f"chunk {i}")
            with warnings.catch_warnings():
                # zarr format 3 warns that consolidated metadata is not in its spec yet;
                # written anyway so that plain xarray.open_zarr(url) reads without a warning.
                warnings.filterwarnings("ignore", message="Consolidated metadata")
                zarr.consolidate_metadata(store)
            step("written")
            store.publish()
            step("published")
    except AlreadyCompleteError:
        return "lost"
    return "committed"


class _Paced:
    """`expected()` as `durable.zarr.write` takes it (NumPy-like), reporting ``chunk I``
    once chunk I is stored: zarr, limited to one region at a time, asks for region I+1
    only after storing region I."""

    def __init__(self, step: Callable[[str], None]) -> None:
        self.data = expected()
        self.shape, self.dtype, self.ndim = self.data.shape, self.data.dtype, self.data.ndim
        self._asked = 0
        self._step = step

    def __getitem__(self, selection: Any) -> Any:
        if self._asked:
            self._step(f"chunk {self._asked - 1}")
        self._asked += 1
        return self.data[selection]


def write_once(url: str, zarr_format: int, options: dict[str, Any] | None,
               step: Callable[[str], None] = lambda name: None,
               overwrite: bool = False) -> str:
    """`durable.zarr.write` of `expected()` (no resume offered: its metadata stays in
    memory); steps ``chunk 0`` .. ``chunk 10`` (the last chunk is followed by the commit)."""
    import zarr

    import durable.zarr as dz
    from durable import AlreadyCompleteError

    try:
        with zarr.config.set({"async.concurrency": 1}):
            dz.write(url, _Paced(step), chunks=CHUNKS, zarr_format=zarr_format,
                     fill_value=0, storage_options=options, overwrite=overwrite)
    except AlreadyCompleteError:
        return "lost"
    return "committed"


class ZarrChild:
    """The parent's handle on one child writer."""

    def __init__(self, url: str, zarr_format: int, how: str = "fresh",
                 storage_options: dict[str, Any] | None = None) -> None:
        env = dict(os.environ, **{ENV_OPTIONS: json.dumps(storage_options or {})})
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_zarr_child.py"), url, str(zarr_format), how],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, env=env)

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

    def finish(self) -> str:
        """Let it run to the end; its last line (``committed`` or ``lost``)."""
        out, err = self.proc.communicate("go\n" * 100)
        assert self.proc.returncode == 0, err
        return out.strip().splitlines()[-1]


if __name__ == "__main__":
    opts = json.loads(os.environ.get(ENV_OPTIONS) or "{}") or None
    if sys.argv[3] == "write":
        print(write_once(sys.argv[1], int(sys.argv[2]), opts, _step), flush=True)
    else:
        print(write(sys.argv[1], int(sys.argv[2]), sys.argv[3], opts, _step), flush=True)
