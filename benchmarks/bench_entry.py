"""What a committed entry costs against writing its files by hand (issue 2).

One entry of N files of SIZE bytes (default 1000 x 64 KiB) in a fresh directory, in
interleaved rounds:

- plain:        open, write, close for each file; no fsync at all (not durable: context)
- naive:        the hand-written durable recipe for each file: temp file, write, fsync,
                rename, directory fsync (what a careful pipeline does without `durable`)
- durable:      Entry.writing(), each file through writer.fs.pipe_file (the fsspec path
                zarr and pandas take); the commit fsyncs all files from a thread pool, each
                directory once, then writes the marker
- durable.open: Entry.writing(), each file through writer.open (an atomic file)

Target: durable faster than naive (ratio durable/naive < 1).

    python benchmarks/bench_entry.py             # 1000 files, 5 rounds
    python benchmarks/bench_entry.py --quick     # 200 files, 3 rounds (CI smoke)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from _util import (
    Case,
    case_record,
    load_snapshot,
    machine_info,
    print_table,
    ratios,
    remove,
    run_interleaved,
    scratch_dir,
    write_results,
)

import durable

KiB = 1024


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="200 files, 3 rounds (CI smoke)")
    p.add_argument("--files", type=int, help="files per entry (default 1000, quick 200)")
    p.add_argument("--size-kib", type=int, default=64, help="bytes per file, in KiB")
    p.add_argument("--rounds", type=int, help="measured rounds (default 5, quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    p.add_argument("--dir", help="where to write (default: the system temp dir)")
    p.add_argument("--cases", help="comma-separated subset of the cases to run (the first "
                                   "one kept is the base of the ratios)")
    p.add_argument("--seed", type=int, default=0, help="seed of the order of cases per round")
    p.add_argument("--out", help="results name (default bench_entry, or bench_entry_quick)")
    args = p.parse_args(argv)
    nfiles = args.files or (200 if args.quick else 1000)
    rounds = args.rounds or (3 if args.quick else 5)
    size = args.size_kib * KiB
    blobs = [os.urandom(size) for _ in range(16)]
    names = [f"part-{i:05d}.bin" for i in range(nfiles)]

    def plain(path: str) -> None:
        os.mkdir(path)
        for i, name in enumerate(names):
            with open(os.path.join(path, name), "wb") as f:
                f.write(blobs[i % 16])

    def naive(path: str) -> None:
        os.mkdir(path)
        fsync_dir(os.path.dirname(path))
        for i, name in enumerate(names):
            final = os.path.join(path, name)
            tmp = os.path.join(path, f".{name}.tmp")
            with open(tmp, "wb") as f:
                f.write(blobs[i % 16])
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_dir(path)

    def with_durable(how: str) -> Callable[[str], None]:
        def run(path: str) -> None:
            with durable.Entry(path).writing() as w:
                if how == "pipe_file":
                    for i, name in enumerate(names):
                        w.fs.pipe_file(f"{w.path}/{name}", blobs[i % 16])
                else:
                    for i, name in enumerate(names):
                        with w.open(name) as f:
                            f.write(blobs[i % 16])
        return run

    def cleanup(path: str) -> None:
        d, name = os.path.split(path)
        remove(path)
        remove(os.path.join(d, ".durable", name))

    cases = [
        Case("naive", "per file: tmp, write, fsync, rename, dir fsync", naive),
        Case("plain", "per file: write, close; no fsync (not durable)", plain),
        Case("durable", "Entry.writing() + writer.fs.pipe_file", with_durable("pipe_file")),
        Case("durable.open", "Entry.writing() + writer.open", with_durable("open")),
    ]
    if args.cases:
        wanted = args.cases.split(",")
        unknown = set(wanted) - {c.name for c in cases}
        if unknown:
            p.error(f"unknown cases {sorted(unknown)}; there are {[c.name for c in cases]}")
        cases = [next(c for c in cases if c.name == n) for n in wanted]
    workdir = scratch_dir(args.dir, "bench-entry")
    print(f"entry of {nfiles} x {size // KiB} KiB files, {rounds} rounds "
          f"(+{args.warmup} warm-up), in {workdir}")
    load_before = load_snapshot()
    try:
        run_interleaved(cases, rounds=rounds, warmup=args.warmup, workdir=workdir,
                        cleanup=cleanup, seed=args.seed)
    finally:
        remove(workdir)
    by_name = {c.name: c for c in cases}
    bases = [by_name[n] for n in ("naive", "plain") if n in by_name] or cases[:1]
    print_table(f"entry of {nfiles} x {size // KiB} KiB", cases, bases)
    for c in cases if "naive" in by_name else ():
        if not c.name.startswith("durable"):
            continue
        r = ratios(c, by_name["naive"])
        met = "met" if max(r["best"], r["median"]) < 1 else "MISSED"
        print(f"target {c.name}/naive < 1: best {r['best']:.3f}, median {r['median']:.3f}, "
              f"median of per-round ratios {r['paired_median']:.3f} -> {met}")
    out = write_results(args.out or ("bench_entry_quick" if args.quick else "bench_entry"), {
        "benchmark": "bench_entry",
        "machine": machine_info(workdir),
        "load": {"before": load_before, "after": load_snapshot()},
        "params": {"files": nfiles, "file_bytes": size, "rounds": rounds,
                   "warmup": args.warmup, "quick": args.quick, "seed": args.seed},
        "target": {"ratio": 1.0, "of": "durable / naive", "below": True},
        "cases": {c.name: case_record(c, bases) for c in cases},
    })
    print(f"machine load before/after: {load_before} / {load_snapshot()}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
