"""What `durable.atomic_write` costs over a plain write of one large file (issue 2).

Cases, each writing SIZE bytes in BLOCK-sized writes to a fresh file on the same file
system, in interleaved rounds:

- plain:        open, write, one fsync at the end, close (the baseline: durable data,
                but the name shows a torn file while it is written, and the name itself
                is not fsynced)
- recipe:       the hand-written durable recipe: temp file, write, fsync, rename,
                directory fsync
- atomic:       durable.atomic_write(record=False): the recipe plus CRC32C of every byte
                and a size check after publishing
- atomic+record durable.atomic_write(record=True): also a commit marker with the size and
                CRC32C (one small write, fsync, rename, directory fsync)
- atomic-no-writeback (with --ablations) atomic without early writeback
                (sync_file_range every 8 MiB): only the final fsync writes the data out

Target: atomic / plain <= 1.05.

    python benchmarks/bench_atomic.py            # 1 GiB, 5 rounds (a couple of minutes)
    python benchmarks/bench_atomic.py --quick    # 256 MiB, 3 rounds (CI smoke, < 30 s)
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

MiB = 1024 * 1024
TARGET = 1.05


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="256 MiB, 3 rounds (CI smoke)")
    p.add_argument("--size-mib", type=int, help="bytes per file, in MiB (default 1024)")
    p.add_argument("--block-mib", type=int, default=8, help="bytes per write() (default 8)")
    p.add_argument("--rounds", type=int, help="measured rounds (default 5, quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    p.add_argument("--dir", help="where to write (default: the system temp dir)")
    p.add_argument("--cases", help="comma-separated subset of the cases to run (the first "
                                   "one kept is the base of the ratios)")
    p.add_argument("--seed", type=int, default=0, help="seed of the order of cases per round")
    p.add_argument("--out", help="results name (default bench_atomic, or bench_atomic_quick)")
    p.add_argument("--ablations", action="store_true",
                   help="add a case with the local adapter's early writeback off, to see "
                        "what it buys in this run")
    args = p.parse_args(argv)
    size = (args.size_mib or (256 if args.quick else 1024)) * MiB
    block_size = args.block_mib * MiB
    rounds = args.rounds or (3 if args.quick else 5)
    if size % block_size:
        p.error("--size-mib must be a multiple of --block-mib")
    nblocks = size // block_size
    # Random bytes: nothing on the way (a compressing file system) can shortcut the write.
    block = os.urandom(block_size)

    def plain(path: str) -> None:
        with open(path, "wb", buffering=0) as f:
            for _ in range(nblocks):
                f.write(block)
            os.fsync(f.fileno())

    def recipe(path: str) -> None:
        d, name = os.path.split(path)
        tmp = os.path.join(d, f".{name}.tmp")
        with open(tmp, "wb", buffering=0) as f:
            for _ in range(nblocks):
                f.write(block)
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def atomic(record: bool) -> Callable[[str], None]:
        def run(path: str) -> None:
            with durable.atomic_write(path, record=record) as f:
                for _ in range(nblocks):
                    f.write(block)
        return run

    def no_writeback(path: str) -> None:
        from durable.adapters import local

        saved = local._sync_file_range
        local._sync_file_range = None  # only the final fsync writes the data out
        try:
            atomic(False)(path)
        finally:
            local._sync_file_range = saved

    def cleanup(path: str) -> None:
        # The marker of a recorded write lives beside it, in .durable/NAME.
        d, name = os.path.split(path)
        remove(path)
        remove(os.path.join(d, ".durable", name))

    cases = [
        Case("plain", "write + one fsync at the end", plain),
        Case("recipe", "tmp, write, fsync, rename, dir fsync", recipe),
        Case("atomic", "durable.atomic_write(record=False)", atomic(False)),
        Case("atomic+record", "durable.atomic_write(record=True)", atomic(True)),
        Case("atomic-no-writeback", "atomic, no early writeback (fsync does it all)",
             no_writeback),
    ]
    if args.cases:
        wanted = args.cases.split(",")
        unknown = set(wanted) - {c.name for c in cases}
        if unknown:
            p.error(f"unknown cases {sorted(unknown)}; there are {[c.name for c in cases]}")
        cases = [next(c for c in cases if c.name == n) for n in wanted]
    elif not args.ablations:
        cases = cases[:-1]
    workdir = scratch_dir(args.dir, "bench-atomic")
    print(f"atomic_write of {size // MiB} MiB in {block_size // MiB} MiB blocks, "
          f"{rounds} rounds (+{args.warmup} warm-up), in {workdir}")
    load_before = load_snapshot()
    try:
        run_interleaved(cases, rounds=rounds, warmup=args.warmup, workdir=workdir,
                        cleanup=cleanup, seed=args.seed)
    finally:
        remove(workdir)
    base = cases[0]
    print_table(f"atomic_write, {size // MiB} MiB", cases, [base])
    headline = {c.name: ratios(c, base) for c in cases[1:]}
    for name in ("atomic", "atomic+record") if base.name == "plain" else ():
        if name not in headline:
            continue
        r = headline[name]
        met = "met" if max(r["best"], r["median"]) <= TARGET else "MISSED"
        print(f"target {name}/plain <= {TARGET}: best {r['best']:.3f}, median "
              f"{r['median']:.3f}, median of per-round ratios {r['paired_median']:.3f} "
              f"-> {met}")
    out = write_results(args.out or ("bench_atomic_quick" if args.quick else "bench_atomic"), {
        "benchmark": "bench_atomic",
        "machine": machine_info(workdir),
        "load": {"before": load_before, "after": load_snapshot()},
        "params": {"size_bytes": size, "block_bytes": block_size, "rounds": rounds,
                   "warmup": args.warmup, "quick": args.quick, "seed": args.seed},
        "target": {"ratio": TARGET, "of": "atomic / plain"},
        "cases": {c.name: case_record(c, [base]) for c in cases},
    })
    print(f"machine load before/after: {load_before} / {load_snapshot()}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
