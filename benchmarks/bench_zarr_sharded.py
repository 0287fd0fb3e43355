"""What durable.zarr's reads of a sharded array cost against plain zarr-python.

A 2048 x 2048 float32 zarr v3 array in 128 x 128 chunks inside 512 x 512 shards (16 shards
of 16 inner chunks, zstd), written once by `durable.zarr.write`, then read in interleaved
rounds, each read through a fresh open:

- ``plain`` / ``durable``: the whole array (zarr reads each shard whole: one GET per
  shard, checked against its CRC32C by durable);
- ``plain-ranges`` / ``durable-ranges``: one row and one column of chunks (32 inner chunks
  in 7 shards, read by byte ranges: the index, then each chunk). durable pins each shard's
  version at its first range read (a stat, then the marker read again, shared by the
  shards stat'ed before it starts) and asks every range of that version only, so a
  rewrite of the entry is refused rather than decoded under the old metadata.

Ratios are of the same run (the machine is shared and noisy): ``durable / plain`` and
``durable-ranges / plain-ranges``. No target: this says what pinning costs.

    python benchmarks/bench_zarr_sharded.py                 # 7 rounds, file and moto
    python benchmarks/bench_zarr_sharded.py --targets file  # local disk only
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from _util import (
    Case,
    case_record,
    load_snapshot,
    machine_info,
    print_table,
    ratios,
    run_interleaved,
    scratch_dir,
    targets,
    write_results,
)

from durable.testing.servers import set_network_guards

set_network_guards()  # before any cloud client is imported: nothing looks for metadata

import numpy as np  # noqa: E402
import zarr  # noqa: E402

import durable.zarr as dz  # noqa: E402


def cases(url: str, opts: Any) -> list[Case]:
    plain_opts = {"storage_options": opts} if opts else {}

    def read(opener: Any, ranges: bool) -> Any:
        def run(_: str) -> None:
            a = opener()
            if ranges:
                a[0:128, :]
                a[:, 0:128]
            else:
                a[...]
        return run

    def plain() -> Any:
        return zarr.open_array(url, mode="r", **plain_opts)

    def durable() -> Any:
        return dz.open(url, storage_options=opts)

    return [Case("plain", "zarr.open_array(...)[...]: each shard whole", read(plain, False)),
            Case("durable", "durable.zarr.open(...)[...]", read(durable, False)),
            Case("plain-ranges", "a row and a column of chunks: byte ranges",
                 read(plain, True)),
            Case("durable-ranges", "the same, each shard pinned to the commit",
                 read(durable, True))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--targets", default="file,moto", help="file, moto or both")
    p.add_argument("--dir", help="where the file target writes (default: system temp dir)")
    p.add_argument("--out", default="bench_zarr_sharded")
    args = p.parse_args(argv)
    data = np.random.default_rng(0).random((2048, 2048), dtype="float32")
    loads = {"before": load_snapshot()}
    record: dict[str, Any] = {}
    with targets(args.targets.split(","), args.dir, "bench-zarr-sharded") as places:
        for name, root, opts in places:
            url = f"{root}/sharded.zarr"
            dz.write(url, data, chunks=(128, 128), shards=(512, 512), storage_options=opts)
            run = cases(url, opts)
            print(f"\n== {name}: {args.rounds} rounds (+{args.warmup} warm-up)")
            run_interleaved(run, rounds=args.rounds, warmup=args.warmup,
                            workdir=root if opts is None else scratch_dir(args.dir, "x"),
                            cleanup=lambda _: None)
            print_table(f"{name}: reads", run, [run[0], run[2]])
            for case, base in ((run[1], run[0]), (run[3], run[2])):
                r = ratios(case, base)
                print(f"  {name} {case.name}/{base.name}: best {r['best']:.3f}, median "
                      f"{r['median']:.3f}, median of per-round ratios {r['paired_median']:.3f}")
            record[name] = {c.name: case_record(c, [run[0], run[2]]) for c in run}
    loads["after"] = load_snapshot()
    out = write_results(args.out, {
        "benchmark": "bench_zarr_sharded", "machine": machine_info(args.dir or "/tmp"),
        "load": loads, "params": {"rounds": args.rounds, "warmup": args.warmup},
        "cases": record})
    print(f"machine load before/after: {loads['before']} / {loads['after']}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
