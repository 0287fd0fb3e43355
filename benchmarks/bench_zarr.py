"""What durable.zarr costs against plain zarr-python, writing and reading (issue 4).

Two arrays, random float32 (incompressible), zstd as zarr's default:

- W1: 2000 x 2000 in 250 x 250 chunks (64 chunks of 250 KB, 16 MB)
- W2: a many-chunk array, 1-d, chunks of 100 values (400 B): 100,000 chunks on local disk;
      on S3 (moto) 10,000 by default, since moto spends about 3 ms of CPU per PUT
      (``--s3-chunks 100000`` for the full count: about 5 minutes per case per round)

Cases, in interleaved rounds, each into a fresh array:

- local, write: ``plain`` (zarr LocalStore: temp file + rename, no fsync, not durable),
  ``plain+fsync`` (plain, then fsync of every file and directory from a pool of 8
  threads: what durability costs without durable), ``durable`` (`durable.zarr.write`:
  chunks recorded, metadata held back and published, every file and directory fsynced
  from a pool, marker). Targets: durable / plain+fsync <= 1.10.
- S3 (moto), write: ``plain`` (FsspecStore) and ``durable``. Target: <= 1.10.
- reads of one committed entry: ``plain`` (zarr.open_array(...)[:]) and ``durable``
  (`durable.zarr.open(...)[:]`: marker read, two stats, size + CRC32C of every chunk).
  Target: <= 1.10.

    python benchmarks/bench_zarr.py             # 5 rounds
    python benchmarks/bench_zarr.py --quick     # 3 rounds, W2 with 5,000 / 1,000 chunks
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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

TARGET = 1.10


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (and root's parent), 8 threads."""
    files, dirs = [], [os.path.dirname(root)]
    for dirpath, _, names in os.walk(root):
        dirs.append(dirpath)
        files.extend(os.path.join(dirpath, n) for n in names)

    def one(path: str, flags: int) -> None:
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: one(p, os.O_RDONLY), files))
        list(pool.map(lambda p: one(p, os.O_RDONLY | os.O_DIRECTORY), dirs))


def workloads(quick: bool, chunks: int | None, s3_chunks: int | None) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    n_local = chunks or (5_000 if quick else 100_000)
    n_s3 = s3_chunks or (1_000 if quick else 10_000)
    return {
        "W1": {"data": rng.random((2000, 2000), dtype="float32"), "chunks": (250, 250),
               "s3": True},
        f"W2-{n_local}": {"data": rng.random(n_local * 100, dtype="float32"),
                          "chunks": (100,), "s3": False},
        f"W2-{n_s3}": {"data": rng.random(n_s3 * 100, dtype="float32"), "chunks": (100,),
                       "s3": True, "local": n_s3 == n_local},
    }


def read_cases(url: str, options: dict[str, Any] | None, zarr: Any, dz: Any) -> list[Case]:
    plain_opts = {"storage_options": options} if options else {}

    def plain(_: str) -> None:
        zarr.open_array(url, mode="r", **plain_opts)[...]

    def durable(_: str) -> None:
        dz.open(url, storage_options=options)[...]

    return [Case("plain", "zarr.open_array(...)[...]", plain),
            Case("durable", "durable.zarr.open(...)[...], every chunk checked", durable)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds, small W2 (CI smoke)")
    p.add_argument("--rounds", type=int, help="measured rounds (default 5, quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    p.add_argument("--chunks", type=int, help="W2 chunks on local disk (default 100000)")
    p.add_argument("--s3-chunks", type=int, help="W2 chunks on S3 (default 10000)")
    p.add_argument("--no-s3", action="store_true", help="skip the moto cases")
    p.add_argument("--no-local", action="store_true", help="skip the local disk cases")
    p.add_argument("--dir", help="where to write (default: the system temp dir)")
    p.add_argument("--out", help="results name (default bench_zarr, or bench_zarr_quick)")
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)

    from durable.testing.servers import set_network_guards

    set_network_guards()
    import zarr

    import durable.zarr as dz

    loads = {"before": load_snapshot()}
    workdir = scratch_dir(args.dir, "bench-zarr")
    record: dict[str, Any] = {}
    verdicts: list[str] = []

    def report(title: str, cases: list[Case], base: Case, target_of: Case,
               bases: list[Case]) -> None:
        print_table(title, cases, bases)
        r = ratios(target_of, base)
        met = "met" if r["best"] <= TARGET else "MISSED"
        line = (f"{title}: {target_of.name}/{base.name} best {r['best']:.3f}, median "
                f"{r['median']:.3f}, per-round median {r['paired_median']:.3f} "
                f"(target <= {TARGET}) -> {met}")
        verdicts.append(line)
        record[title] = {c.name: case_record(c, bases) for c in cases}

    def cleanup_local(path: str) -> None:
        d, name = os.path.split(path)
        remove(path)
        remove(os.path.join(d, ".durable", name))

    def local_cases(w: dict[str, Any]) -> list[Case]:
        data, chunks = w["data"], w["chunks"]

        def plain(path: str) -> None:
            zarr.create_array(path, data=data, chunks=chunks)

        def plain_fsync(path: str) -> None:
            plain(path)
            fsync_tree(path)

        def durable(path: str) -> None:
            dz.write(path, data, chunks=chunks)

        return [Case("plain+fsync", "zarr LocalStore, then fsync every file and dir",
                     plain_fsync),
                Case("plain", "zarr LocalStore: no fsync (not durable)", plain),
                Case("durable", "durable.zarr.write", durable)]

    try:
        for name, w in workloads(args.quick, args.chunks, args.s3_chunks).items():
            if w.get("local", True) and not args.no_local:
                cases = local_cases(w)
                print(f"\n{name} local write, {rounds} rounds (+{args.warmup} warm-up)")
                run_interleaved(cases, rounds=rounds, warmup=args.warmup, workdir=workdir,
                                cleanup=cleanup_local)
                report(f"{name} local write", cases, cases[0], cases[2], cases[:2])
                url = os.path.join(workdir, f"{name}-read")
                dz.write(url, w["data"], chunks=w["chunks"])
                cases = read_cases(url, None, zarr, dz)
                print(f"\n{name} local read, {rounds} rounds")
                run_interleaved(cases, rounds=rounds, warmup=args.warmup, workdir=workdir,
                                cleanup=lambda _: None)
                report(f"{name} local read", cases, cases[0], cases[1], cases[:1])
        if not args.no_s3:
            record.update(s3_runs(args, rounds, workdir, report, zarr, dz))
    finally:
        remove(workdir)
    loads["after"] = load_snapshot()
    print()
    for line in verdicts:
        print(line)
    out = write_results(args.out or ("bench_zarr_quick" if args.quick else "bench_zarr"), {
        "benchmark": "bench_zarr",
        "machine": machine_info(workdir),
        "load": loads,
        "params": {"rounds": rounds, "warmup": args.warmup, "quick": args.quick,
                   "chunks": args.chunks, "s3_chunks": args.s3_chunks},
        "target": {"ratio": TARGET, "of": "durable / plain (S3, reads), durable / "
                                          "plain+fsync (local writes)", "below": True},
        "verdicts": verdicts,
        "cases": record,
    })
    print(f"machine load before/after: {loads['before']} / {loads['after']}")
    print(f"results: {out}")
    return 0


def s3_runs(args: argparse.Namespace, rounds: int, workdir: str,
            report: Callable[..., None], zarr: Any, dz: Any) -> dict[str, Any]:
    import urllib.request

    import fsspec

    from durable.testing.servers import start_moto

    with start_moto() as server:
        options = server.storage_options()
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        opener.open(urllib.request.Request(f"{server.url}/{bucket}", method="PUT"))
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)

        def url_of(path: str) -> str:
            return f"s3://{bucket}/{os.path.basename(path)}"

        def cleanup(path: str) -> None:
            name = os.path.basename(path)
            for prefix in (f"{bucket}/{name}", f"{bucket}/.durable/{name}"):
                if fs.exists(prefix):
                    fs.rm(prefix, recursive=True)

        for name, w in workloads(args.quick, args.chunks, args.s3_chunks).items():
            if not w["s3"]:
                continue
            data, chunks = w["data"], w["chunks"]

            def plain(path: str, data: Any = data, chunks: Any = chunks) -> None:
                zarr.create_array(url_of(path), data=data, chunks=chunks,
                                  storage_options=options)

            def durable(path: str, data: Any = data, chunks: Any = chunks) -> None:
                dz.write(url_of(path), data, chunks=chunks, storage_options=options)

            cases = [Case("plain", "zarr FsspecStore (s3fs) to moto", plain),
                     Case("durable", "durable.zarr.write to moto", durable)]
            print(f"\n{name} S3 write, {rounds} rounds (+{args.warmup} warm-up)")
            run_interleaved(cases, rounds=rounds, warmup=args.warmup, workdir=workdir,
                            cleanup=cleanup)
            report(f"{name} S3 write", cases, cases[0], cases[1], cases[:1])
            url = f"s3://{bucket}/{name}-read"
            dz.write(url, data, chunks=chunks, storage_options=options)
            cases = read_cases(url, options, zarr, dz)
            print(f"\n{name} S3 read, {rounds} rounds")
            run_interleaved(cases, rounds=rounds, warmup=args.warmup, workdir=workdir,
                            cleanup=lambda _: None)
            report(f"{name} S3 read", cases, cases[0], cases[1], cases[:1])
    return {}


if __name__ == "__main__":
    sys.exit(main())
