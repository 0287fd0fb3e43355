"""Time and peak memory of durable at data-engineering sizes, on the local disk.

Two shapes that broke before (session 15):

- a wide entry: N small objects (a tokenized shard dir, a zarr v2 array of many chunks):
  the commit, state(), verify() and verify(deep=True). Peak memory must grow with the
  manifest (about 0.6 KB an object), never with one future or one 8 MiB buffer per object;
- a large file: atomic_write, then read back every way (open_verified streamed in 8 MiB
  reads, open_verified(...).read(), read_verified, durable::'s cat_file). Streamed reads
  stay at a few MB; a whole read holds about the object once or twice, never 8 KiB at a
  time.

    python benchmarks/bench_scale.py                   # 100,000 x 64 B; 1 GiB file
    python benchmarks/bench_scale.py --quick           # 5,000 x 64 B; 128 MiB file

Absolute times are of one noisy shared machine: compare peaks and orders of magnitude,
not seconds between runs. Peaks are tracemalloc's (Python allocations, the bytes returned
included).
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import fsspec
from _util import load_snapshot, machine_info, remove, scratch_dir, write_results

import durable

MiB = 1024 * 1024


def measure(label: str, fn: Callable[[], Any], rows: list[dict[str, Any]]) -> None:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    rows.append({"case": label, "seconds": round(seconds, 3), "peak_mb": round(peak / 1e6, 1)})
    print(f"{label:34s} {seconds:8.2f} s  peak {peak / 1e6:9.1f} MB", flush=True)


def wide_entry(workdir: str, files: int, rows: list[dict[str, Any]]) -> None:
    entry = durable.Entry(os.path.join(workdir, "shard"))

    def commit() -> None:
        with entry.writing() as w:
            for i in range(files):
                w.fs.pipe_file(f"{w.path}/{i // 1000:03d}/part-{i:06d}.bin", b"x" * 64)

    measure(f"commit ({files:,} objects)", commit, rows)
    measure("state", entry.state, rows)
    measure("verify", entry.verify, rows)
    measure("verify(deep=True)", lambda: entry.verify(deep=True), rows)
    remove(entry.path)


def large_file(workdir: str, size: int, rows: list[dict[str, Any]]) -> None:
    url = os.path.join(workdir, "big.bin")
    block = os.urandom(4 * MiB)

    def write() -> None:
        with durable.atomic_write(url) as f:
            for _ in range(size // len(block)):
                f.write(block)

    def streamed() -> None:
        with durable.open_verified(url) as f:
            while f.read(8 * MiB):
                pass

    def whole() -> None:
        with durable.open_verified(url) as f:
            f.read()

    fs, path = fsspec.url_to_fs(f"durable::{url}")
    measure(f"atomic_write ({size // MiB} MiB)", write, rows)
    measure("open_verified, 8 MiB reads", streamed, rows)
    measure("open_verified(...).read()", whole, rows)
    measure("read_verified", lambda: durable.read_verified(url), rows)
    measure("durable:: cat_file", lambda: fs.cat_file(path), rows)
    remove(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--files", type=int)
    parser.add_argument("--size-mib", type=int)
    parser.add_argument("--dir")
    parser.add_argument("--out")
    args = parser.parse_args()
    files = args.files or (5_000 if args.quick else 100_000)
    size = (args.size_mib or (128 if args.quick else 1024)) * MiB
    workdir = scratch_dir(args.dir, "bench_scale")
    rows: list[dict[str, Any]] = []
    before, machine = load_snapshot(), machine_info(workdir)
    try:
        wide_entry(workdir, files, rows)
        large_file(workdir, size, rows)
    finally:
        remove(workdir)
    out = write_results(args.out or ("bench_scale_quick" if args.quick else "bench_scale"), {
        "machine": machine, "load_before": before, "load_after": load_snapshot(),
        "params": {"files": files, "size_bytes": size}, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
