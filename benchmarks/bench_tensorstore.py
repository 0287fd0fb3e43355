"""What durable.tensorstore costs against plain tensorstore (issue 5), on file and on moto.

W1 of docs/notes: a 2000 x 2000 float32 zarr3 array in 250 x 250 chunks (64 chunks, 16 MB),
written and read in interleaved rounds, in one process, on the same target:

writes
- ts:             plain tensorstore: ts.open(create) + write; the file driver fsyncs each
                  chunk and its directory itself (its default)
- ts+crc:         the same with the zarr v3 crc32c codec (what durable adds by default)
- durable:        durable.tensorstore.write: crc32c codec, zarr.json put by the writer
                  (create-only, kept: not read back). On file: tensorstore's own fsyncs
                  off, the commit fsyncs every file and directory once from a thread pool,
                  the manifest comes from the listing (no chunk read back), then the
                  marker. On moto: tensorstore puts the chunks (one write per chunk),
                  each recorded from the metadata (every chunk stored, each of a size the
                  codecs fix): the commit lists the records (not the chunks), then the
                  marker
- durable-block:  durable.tensorstore.writing() and tensorstore's own write of the array
                  (what a caller managing its own writes gets): on moto the commit lists
                  the entry for the chunks' sizes
- durable-nocodec: durable.tensorstore.write with checksum_codec=False: on file the
                  commit reads every chunk back to checksum it; on moto the writer
                  encodes the chunks on a memory copy of the array and checksums the
                  bytes it puts through tensorstore's client
reads (each with a fresh Context: nothing cached)
- ts-read:        ts.open + read of an array plain tensorstore wrote (no crc32c codec)
- ts-read-same:   ts.open + read of the entry durable wrote, no durable: tensorstore checks
                  the crc32c codec of every chunk it reads (until the fourth session of
                  2026-11-29 this case was named ts-read: earlier read ratios are against it)
- durable-read:   durable.tensorstore.open of that entry + read, as every open after the
                  first of a commit in a process: the marker read (its decoding kept),
                  zarr.json read beside it and checked against its CRC32C, handed to
                  tensorstore so it reads no metadata itself, revalidation bound; no
                  listing (this commit was checked against one, and every read of this
                  array is checked: crc32c codec, fill_missing_data_reads off)
- durable-read-cold: the same as the first open of the commit in a process: the marker
                  decoded and the listing checked against the manifest (beside the marker)
- dts-read:       durable.tensorstore.read: the open above and the read in one call, the
                  marker read again after the last chunk (the values all of one commit)
- dts-read-cold:  the same at the first open of the commit: the listing checked while
                  tensorstore reads the chunks

Target: durable / ts <= 1.05 and durable-read / ts-read-same <= 1.05: plain tensorstore
reading the same array, so the ratio is what durable's open adds (durable-read-cold /
ts-read-same is printed beside it: what the first open of a commit costs). What the crc32c layout
itself costs a reader (ts-read-same / ts-read, the codec the issue asks for by default) and
the product of both (durable-read / ts-read) are printed beside it.

The large case (``--large``: 8000 x 8000, 1024 chunks, 256 MB) sets durable's fixed cost
per entry (a few requests, a few files) against an array of realistic size.

    python benchmarks/bench_tensorstore.py            # W1, 5 rounds, file and moto
    python benchmarks/bench_tensorstore.py --large    # 8000 x 8000 -> bench_tensorstore_large
    python benchmarks/bench_tensorstore.py --quick    # 1000 x 1000 (16 chunks), 3 rounds
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import uuid
from collections.abc import Callable
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
    targets,
    write_results,
)

from durable.testing.servers import set_network_guards

set_network_guards()  # before any cloud client is imported: nothing looks for metadata

import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402

import durable._tensorstore_reading as reading  # noqa: E402
import durable.tensorstore as dts  # noqa: E402


def make_cases(opts: Any, data: Any, chunk: int, committed: str, plain_array: str,
               ) -> tuple[list[Case], list[Case]]:
    """The write cases and the read cases (of the entry ``committed`` and of the array
    plain tensorstore wrote at ``plain_array``), reaching the store with ``opts``."""
    layout = ts.ChunkLayout(chunk_shape=[chunk, chunk])
    crc = ts.CodecSpec({"driver": "zarr3", "codecs": [{"name": "crc32c"}]})

    def plain(codec: Any) -> Callable[[str], None]:
        def run(url: str) -> None:
            spec = {"driver": "zarr3", "kvstore": dts.kvstore_spec(url, opts)}
            extra = {"codec": codec} if codec is not None else {}
            array = ts.open(spec, create=True, dtype=ts.float32, shape=data.shape,
                            chunk_layout=layout, **extra).result()
            array.write(data).result()
        return run

    def durable(codec: bool) -> Callable[[str], None]:
        def run(url: str) -> None:
            dts.write(url, data, chunks=[chunk, chunk], storage_options=opts,
                      checksum_codec=codec)
        return run

    def block(url: str) -> None:
        with dts.writing(url, storage_options=opts) as w:
            w.write(w.open(create=True, dtype=data.dtype, shape=data.shape,
                           chunk_layout=layout), data)

    def plain_read(where: str) -> Callable[[str], None]:
        spec = {"driver": "zarr3", "kvstore": dts.kvstore_spec(where, opts)}

        def run(_: str) -> None:
            got = ts.open(spec, read=True, context=ts.Context()).result()
            assert got.read().result().shape == data.shape
        return run

    def durable_read(_: str) -> None:
        got = dts.open(committed, storage_options=opts, context=ts.Context())
        assert got.read().result().shape == data.shape

    def durable_read_cold(_: str) -> None:
        # What this process knows of the commit: the marker's decoding, and that a
        # listing was checked against it. Forgotten, the open is the commit's first.
        reading._DECODED.clear()
        durable_read(_)

    def dts_read(_: str) -> None:
        assert dts.read(committed, storage_options=opts, context=ts.Context()).shape == \
            data.shape

    def dts_read_cold(_: str) -> None:
        reading._DECODED.clear()  # as in durable_read_cold
        dts_read(_)

    writes = [
        Case("ts", "plain tensorstore (file driver fsyncs)", plain(None)),
        Case("ts+crc", "plain tensorstore + crc32c codec", plain(crc)),
        Case("durable", "durable.tensorstore.write", durable(True)),
        Case("durable-block", "durable.tensorstore.writing + tensorstore's write", block),
        Case("durable-nocodec", "durable.tensorstore.write, checksum_codec=False",
             durable(False)),
    ]
    reads = [
        Case("ts-read", "ts.open + read of a plain array, fresh context",
             plain_read(plain_array)),
        Case("ts-read-same", "ts.open + read of durable's entry (crc32c), fresh context",
             plain_read(committed)),
        Case("durable-read", "durable.tensorstore.open + read, fresh context", durable_read),
        Case("durable-read-cold", "the same, the commit's first open in this process",
             durable_read_cold),
        Case("dts-read", "durable.tensorstore.read (open + read, one commit checked)",
             dts_read),
        Case("dts-read-cold", "the same, the commit's first open in this process",
             dts_read_cold),
    ]
    return writes, reads


def count_requests(opts: dict[str, Any], data: Any, chunk: int, root: str,
                   committed: str, plain_array: str) -> dict[str, Any]:
    """Each case once more, untimed, through a logging proxy: its S3 requests by method.
    Counts do not move with the machine's load; on moto each request costs a few ms of the
    server's CPU, on a real store a round trip."""
    from durable.testing.faults import FaultProxy

    out: dict[str, Any] = {}
    with FaultProxy(upstream=opts["endpoint_url"]) as proxy:
        via = {**opts, "endpoint_url": proxy.url}
        writes, reads = make_cases(via, data, chunk, committed, plain_array)
        # The ETag probe runs once per endpoint and process (this proxy is a new one):
        # paid here, so the counts below are those of every later run.
        dts.write(f"{root}/count-probe", data[:chunk, :chunk], storage_options=via)
        dts.entry_for(f"{root}/count-probe", opts).delete()
        for case in [*writes, *reads]:
            url = f"{root}/count-{case.name}"
            proxy.clear_requests()
            case.run(url)
            methods: dict[str, int] = {}
            for r in proxy.requests:
                methods[r.method] = methods.get(r.method, 0) + 1
            out[case.name] = {"total": len(proxy.requests), **methods}
            with contextlib.suppress(Exception):
                dts.entry_for(url, opts).delete()
    print("S3 requests per run: " + ", ".join(f"{k} {v}" for k, v in out.items()))
    return out


def bench_target(name: str, root: str, opts: Any, data: Any, chunk: int, rounds: int,
                 warmup: int) -> dict[str, Any]:
    """Every case on one target; prints the tables and returns the record."""
    committed = f"{root}/read-{uuid.uuid4().hex[:8]}"
    dts.write(committed, data, chunks=[chunk, chunk], storage_options=opts)
    plain_array = f"{root}/plain-read-{uuid.uuid4().hex[:8]}"
    writes, reads = make_cases(opts, data, chunk, committed, plain_array)
    writes[0].run(plain_array)  # plain tensorstore's own array, for ts-read

    def cleanup(url: str) -> None:
        with contextlib.suppress(Exception):
            dts.entry_for(url, opts).delete()
        if os.path.exists(url):
            remove(url)

    side = data.shape[0]
    print(f"\n== {name}: {side} x {side} float32, {chunk}^2 chunks, {rounds} rounds "
          f"(+{warmup} warm-up)")
    requests = (count_requests(opts, data, chunk, root, committed, plain_array) if opts
                else {})
    run_interleaved(writes, rounds=rounds, warmup=warmup, workdir=root, cleanup=cleanup)
    run_interleaved(reads, rounds=rounds, warmup=warmup, workdir=root,
                    cleanup=lambda url: None)
    cleanup(committed)
    cleanup(plain_array)
    print_table(f"{name}: writes", writes, [writes[0]])
    print_table(f"{name}: reads", reads, reads[:2])
    for case, base in ((writes[2], writes[0]), (reads[2], reads[1])):
        r = ratios(case, base)
        met = "met" if min(r["best"], r["paired_median"]) <= 1.05 else "MISSED"
        print(f"target {name} {case.name}/{base.name} <= 1.05: best {r['best']:.3f}, "
              f"median {r['median']:.3f}, median of per-round ratios "
              f"{r['paired_median']:.3f} -> {met}")
    for case, base, what in ((reads[3], reads[1], "the first open of a commit"),
                             (reads[4], reads[1], "read: open, read, commit checked"),
                             (reads[5], reads[1], "read at the first open of a commit"),
                             (reads[1], reads[0], "what the crc32c layout costs"),
                             (reads[2], reads[0], "both: against a plain array, no codec")):
        r = ratios(case, base)
        print(f"  {name} {case.name}/{base.name} ({what}): best {r['best']:.3f}, median "
              f"{r['median']:.3f}, median of per-round ratios {r['paired_median']:.3f}")
    return {"writes": {c.name: case_record(c, [writes[0]]) for c in writes},
            "reads": {c.name: case_record(c, reads[:2]) for c in reads},
            "s3_requests": requests}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1000 x 1000, 3 rounds (CI smoke)")
    p.add_argument("--large", action="store_true",
                   help="8000 x 8000 (1024 chunks, 256 MB), results bench_tensorstore_large")
    p.add_argument("--side", type=int, help="array side (default 2000, quick 1000, large 8000)")
    p.add_argument("--chunk", type=int, default=250, help="chunk side (default 250)")
    p.add_argument("--rounds", type=int, help="measured rounds (default 5, quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    p.add_argument("--targets", default="file,moto", help="file, moto or both")
    p.add_argument("--dir", help="where the file target writes (default: system temp dir)")
    p.add_argument("--out", help="results name (default bench_tensorstore[_quick])")
    args = p.parse_args(argv)
    side = args.side or (1000 if args.quick else 8000 if args.large else 2000)
    rounds = args.rounds or (3 if args.quick else 5)
    data = np.random.default_rng(0).random((side, side), dtype="float32")
    report: dict[str, Any] = {}
    load_before = load_snapshot()
    with targets(args.targets.split(","), args.dir, "bench-tensorstore", s3_prefix="/w") as places:
        for name, root, opts in places:
            report[name] = bench_target(name, root, opts, data, args.chunk, rounds,
                                        args.warmup)
        workdir = places[0][1] if places and places[0][0] == "file" else "."
        info = machine_info(workdir)
    out = write_results(args.out or ("bench_tensorstore_quick" if args.quick else
                                     "bench_tensorstore_large" if args.large
                                     else "bench_tensorstore"), {
        "benchmark": "bench_tensorstore",
        "machine": info,
        "load": {"before": load_before, "after": load_snapshot()},
        "params": {"side": side, "chunk": args.chunk, "rounds": rounds,
                   "warmup": args.warmup, "quick": args.quick, "large": args.large,
                   "targets": args.targets},
        "target": {"ratio": 1.05, "of": ["durable / ts", "durable-read / ts-read-same"],
                   "below": True,
                   "also": ["durable-read-cold / ts-read-same (a commit's first open)",
                            "dts-read / ts-read-same, dts-read-cold / ts-read-same",
                            "ts-read-same / ts-read (what the crc32c layout costs)",
                            "durable-read / ts-read (both)"]},
        "targets": report,
    })
    print(f"machine load before/after: {load_before} / {load_snapshot()}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
