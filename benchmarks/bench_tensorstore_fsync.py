"""Where the W1 file write's time goes: ways of making tensorstore's chunks durable, same run.

The data phase of `durable.tensorstore.write` on a local disk (tensorstore writes each chunk
with its own fsyncs off; durable fsyncs) against plain tensorstore's write with its own
fsyncs, for W1 (2000 x 2000 float32, 250 x 250 chunks, the crc32c codec in every case):

- ts:           plain tensorstore, its file driver fsyncs each chunk and its directory
- ts-nocrc:     the same without the crc32c codec (what bench_tensorstore's target is
                against)
- batch:        one tensorstore write, fsyncs off; then every chunk, zarr.json and every
                directory fsynced from a pool of 8
- batch-wb:     the same, with writeback started on every chunk (sync_file_range) first
- early:        one tensorstore write per chunk, each chunk's fsync handed to a pool of 8 as
                its write lands, then zarr.json and the directories (what `write` does)
- early-wb:     the same, writeback started as each chunk lands, every fsync at the end
- nosync:       one tensorstore write, no fsync at all (what the disk work costs)
- durable:      durable.tensorstore.write, all of it (attempt record, create, marker)

    python benchmarks/bench_tensorstore_fsync.py --rounds 21
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import tensorstore as ts
from _util import (
    Case,
    case_record,
    load_snapshot,
    machine_info,
    print_table,
    run_interleaved,
    scratch_dir,
    write_results,
)

import durable.tensorstore as dts
from durable.adapters.local import _fsync_file as _fsync  # durable's own fsync of a file

SIDE, CHUNK = 2000, 250
CRC = {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                  {"name": "crc32c"}]}
_POOL = ThreadPoolExecutor(8)
_LIBC = ctypes.CDLL(None, use_errno=True)
_SFR = _LIBC.sync_file_range
_SFR.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def _writeback(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _SFR(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE: start writing, wait for nothing
    finally:
        os.close(fd)


def _open(target: str, sync: bool, crc: bool = True) -> Any:
    spec: dict[str, Any] = {"driver": "zarr3",
                            "kvstore": {"driver": "file", "path": target, "file_io_sync": sync}}
    if crc:
        spec["metadata"] = CRC
    return ts.open(spec, create=True, dtype=ts.float32, shape=[SIDE, SIDE],
                   chunk_layout=ts.ChunkLayout(chunk_shape=[CHUNK, CHUNK])).result()


def _chunks(target: str) -> list[tuple[str, Any]]:
    n = SIDE // CHUNK
    return [(f"{target}/c/{i}/{j}", np.s_[i * CHUNK:(i + 1) * CHUNK, j * CHUNK:(j + 1) * CHUNK])
            for i in range(n) for j in range(n)]


def _rest(target: str) -> list[str]:
    """zarr.json and every directory."""
    return [f"{target}/zarr.json", target, f"{target}/c",
            *(f"{target}/c/{i}" for i in range(SIDE // CHUNK))]


def cases(data: Any) -> list[Case]:
    def plain(target: str) -> None:
        _open(target, True).write(data).result()

    def plain_nocrc(target: str) -> None:
        _open(target, True, crc=False).write(data).result()

    def nosync(target: str) -> None:
        _open(target, False).write(data).result()

    def batch(wb: bool) -> Callable[[str], None]:
        def run(target: str) -> None:
            _open(target, False).write(data).result()
            files = [p for p, _ in _chunks(target)]
            if wb:
                list(_POOL.map(_writeback, files))
            list(_POOL.map(_fsync, files + _rest(target)))
        return run

    def early(wb: bool) -> Callable[[str], None]:
        def run(target: str) -> None:
            array = _open(target, False)
            started = [(p, array[w].write(data[w])) for p, w in _chunks(target)]
            landed = []
            for path, future in started:
                future.result()
                landed.append(_POOL.submit(_writeback if wb else _fsync, path))
            for f in landed:
                f.result()
            last = [p for p, _ in started] if wb else []
            list(_POOL.map(_fsync, last + _rest(target)))
        return run

    def durable(target: str) -> None:
        dts.write(target, data, chunks=[CHUNK, CHUNK])

    return [Case("ts", "plain tensorstore, its own fsyncs", plain),
            Case("ts-nocrc", "the same without the crc32c codec", plain_nocrc),
            Case("batch", "fsyncs off, then every file and directory from a pool",
                 batch(False)),
            Case("batch-wb", "the same, writeback started on every chunk first", batch(True)),
            Case("early", "a write per chunk, its fsync as it lands (durable's way)",
                 early(False)),
            Case("early-wb", "a write per chunk, writeback as it lands, fsyncs at the end",
                 early(True)),
            Case("nosync", "one write, no fsync", nosync),
            Case("durable", "durable.tensorstore.write, all of it", durable)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=21, help="measured rounds (default 21)")
    p.add_argument("--warmup", type=int, default=2, help="discarded rounds first (default 2)")
    p.add_argument("--dir", help="where to write (default: system temp dir)")
    p.add_argument("--out", default="bench_tensorstore_fsync", help="results name")
    args = p.parse_args(argv)
    data = np.random.default_rng(0).random((SIDE, SIDE), dtype="float32")
    workdir = scratch_dir(args.dir, "bench_tensorstore_fsync")
    load_before = load_snapshot()
    all_cases = cases(data)
    run_interleaved(all_cases, rounds=args.rounds, warmup=args.warmup, workdir=workdir)
    print_table("W1 on file: making the chunks durable", all_cases, all_cases[:2])
    out = write_results(args.out, {
        "benchmark": "bench_tensorstore_fsync",
        "machine": machine_info(workdir),
        "load": {"before": load_before, "after": load_snapshot()},
        "params": {"side": SIDE, "chunk": CHUNK, "rounds": args.rounds,
                   "warmup": args.warmup},
        "cases": {c.name: case_record(c, all_cases[:2]) for c in all_cases},
    })
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
