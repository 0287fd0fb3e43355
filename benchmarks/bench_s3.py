"""What `durable.atomic_write` costs over a plain s3fs write, on a moto S3 server (issue 3).

Cases, each writing one object of SIZE bytes to the same moto server (started here, on
127.0.0.1), in interleaved rounds:

- s3fs.open     ``fs.open(path, "wb")``, write in 8 MiB blocks, close (the baseline: what
                code writing through fsspec does; an exception would publish a partial
                object, and nothing is checked or recorded)
- s3fs.pipe     ``fs.pipe_file(path, data)``: s3fs's own upload of bytes in memory
- atomic.size   ``durable.atomic_write(url, verify="size")`` in 8 MiB blocks: whole or
                nothing, CRC32C sent per part and per object, a HEAD after the write, and a
                commit marker recording size and CRC32C (the default ``record=True``)
- atomic.probe  the same with ``verify="probe"`` (the S3 default): also a 1-byte GET at
                the end of every part
- atomic.full   the same with ``verify="full"``: reads the object back, compares CRC32C
- atomic.unrec  ``atomic_write(url, record=False, verify="size")``: whole or nothing,
                CRC32C sent and checked by the store, size verified, no marker (what
                s3fs.open does, made whole and checked)
- atomic.bare   ``atomic_write(url, record=False, verify="none")``: the same requests as
                s3fs.open (no marker, no check after), so its ratio is the cost of
                durable's data path itself (CRC32C of every byte, parts in flight, abort
                on error); the other cases add requests on top of it

Target: atomic.size / s3fs.open <= 1.05 (best and median).

moto is the bottleneck here (notes/performance.md: about 2.7 ms of its CPU per upload,
and it answers a range by reading the whole object), so wall-clock ratios say how much
work moto is given, not what a real store would take. Two more measures go with them:

- client CPU: this process's CPU time per write (s3fs's event loop runs in this process),
  and per request;
- requests per write, by kind, counted through the fault proxy with no fault injected
  (one extra write per case, outside the timing). The server's CPU per write is recorded
  too.

    python benchmarks/bench_s3.py            # 1, 64, 256 MiB; 5 rounds (5-10 minutes)
    python benchmarks/bench_s3.py --quick    # 1 and 64 MiB, 3 rounds (< 60 s)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from _util import (
    Case,
    case_record,
    load_snapshot,
    machine_info,
    print_table,
    ratios,
    run_interleaved,
    write_results,
)

from durable.testing.servers import MotoServer, set_network_guards, start_moto

set_network_guards()  # before s3fs/botocore are imported: no metadata lookups

import fsspec  # noqa: E402

import durable  # noqa: E402
from durable.testing.faults import FaultProxy, RequestRecord  # noqa: E402

MiB = 1024 * 1024
BLOCK = 8 * MiB
TARGET = 1.05
BASE = "s3fs.open"


def _server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kind(r: RequestRecord) -> str:
    """A request as S3 names it."""
    q = r.query
    if r.method == "PUT":
        return "UploadPart" if "partNumber" in q else "PutObject"
    if r.method == "POST":
        return "CreateMultipartUpload" if "uploads" in q else (
            "CompleteMultipartUpload" if "uploadId" in q else "POST")
    if r.method == "GET":
        if "list-type" in q or not r.key:
            return "ListObjectsV2"
        return "GET (range)" if "range" in r.headers else "GET"
    if r.method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in q else "DeleteObject"
    return r.method


def make_cases(options: dict[str, Any], block: bytes, nblocks: int,
               server_pid: int) -> tuple[list[Case], dict[str, list[float]]]:
    data = block * nblocks
    server_cpu: dict[str, list[float]] = collections.defaultdict(list)

    def fs() -> Any:
        return fsspec.filesystem("s3", **options)

    def s3fs_open(url: str) -> None:
        with fs().open(url, "wb") as f:
            for _ in range(nblocks):
                f.write(block)

    def s3fs_pipe(url: str) -> None:
        fs().pipe_file(url, data)

    def atomic(verify: Any, record: bool = True) -> Callable[[str], None]:
        def run(url: str) -> None:
            with durable.atomic_write(url, storage_options=options, verify=verify,
                                      record=record) as f:
                for _ in range(nblocks):
                    f.write(block)
        return run

    def timed_server(name: str, run: Callable[[str], None]) -> Callable[[str], None]:
        def wrapped(url: str) -> None:
            c0 = _server_cpu(server_pid)
            run(url)
            server_cpu[name].append(_server_cpu(server_pid) - c0)
        return wrapped

    specs = [
        ("s3fs.open", "fs.open('wb'), 8 MiB writes, close: the baseline", s3fs_open),
        ("s3fs.pipe", "fs.pipe_file(bytes)", s3fs_pipe),
        ("atomic.size", "durable.atomic_write(verify='size'), recorded", atomic("size")),
        ("atomic.probe", "... verify='probe' (S3 default)", atomic("probe")),
        ("atomic.full", "... verify='full' (read back, CRC32C)", atomic("full")),
        ("atomic.unrec", "atomic_write(record=False, verify='size')", atomic("size", False)),
        ("atomic.bare", "atomic_write(record=False, verify='none')", atomic("none", False)),
    ]
    return [Case(n, about, timed_server(n, run)) for n, about, run in specs], server_cpu


def cleanup_for(options: dict[str, Any]) -> Callable[[str], None]:
    def cleanup(url: str) -> None:
        # The object and, for recorded writes, its marker in PARENT/.durable/NAME.
        fs = fsspec.filesystem("s3", **options)
        parent, _, name = url.rpartition("/")
        fs.rm([url, f"{parent}/.durable/{name}/commit.json"])
        fs.invalidate_cache()
    return cleanup


@contextlib.contextmanager
def moto_bucket() -> Iterator[tuple[MotoServer, dict[str, Any], str]]:
    with start_moto() as server:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        request = urllib.request.Request(f"{server.url}/{bucket}", method="PUT")
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request).close()
        yield server, server.storage_options(), bucket


def run_size(server: MotoServer, options: dict[str, Any], bucket: str, size: int,
             rounds: int, warmup: int) -> dict[str, Any]:
    nblocks = max(1, size // BLOCK)
    block_size = min(size, BLOCK)
    block = os.urandom(block_size)  # random: nothing on the way can shortcut the bytes
    cases, server_cpu = make_cases(options, block, nblocks, server.process.pid)
    # Counted with the same block layout: the counting cases are rebuilt over the proxy.
    requests = _count_with_blocks(server, options, bucket, block, nblocks)
    print(f"\n{size // MiB} MiB in {block_size // MiB or block_size} "
          f"{'MiB' if block_size >= MiB else 'B'} blocks, {rounds} rounds (+{warmup} warm-up)")
    run_interleaved(cases, rounds=rounds, warmup=warmup, workdir=f"s3://{bucket}/{size}",
                    cleanup=cleanup_for(options))
    base = next(c for c in cases if c.name == BASE)
    pipe = next(c for c in cases if c.name == "s3fs.pipe")
    print_table(f"{size // MiB} MiB to moto", cases, [base, pipe])
    records: dict[str, Any] = {}
    for c in cases:
        n = requests[c.name]["total"]
        cpu = statistics.median(c.cpu)
        srv = statistics.median(server_cpu[c.name][-rounds:])
        rec = case_record(c, [base, pipe])
        rec.update({"requests": requests[c.name],
                    "client_cpu_ms_per_write": cpu * 1e3,
                    "client_cpu_ms_per_request": cpu * 1e3 / n,
                    "server_cpu_s": server_cpu[c.name][-rounds:],
                    "server_cpu_ms_per_write": srv * 1e3})
        records[c.name] = rec
        print(f"  {c.name:<13} {n:>3} requests  client CPU {cpu * 1e3:8.1f} ms/write "
              f"{cpu * 1e3 / n:6.2f} ms/request   moto CPU {srv * 1e3:8.1f} ms/write   "
              + " ".join(f"{k}={v}" for k, v in requests[c.name].items() if k != "total"))
    for name in ("atomic.size", "atomic.unrec", "atomic.bare"):
        r = ratios(next(c for c in cases if c.name == name), base)
        met = "met" if max(r["best"], r["median"]) <= TARGET else "MISSED"
        print(f"  target {name}/{BASE} <= {TARGET}: best {r['best']:.3f}, median "
              f"{r['median']:.3f}, per-round median {r['paired_median']:.3f} -> {met}")
    return {"size_bytes": size, "block_bytes": block_size, "cases": records}


def _count_with_blocks(server: MotoServer, options: dict[str, Any], bucket: str,
                       block: bytes, nblocks: int) -> dict[str, dict[str, int]]:
    with FaultProxy(upstream=server.url) as proxy:
        via = dict(options, endpoint_url=proxy.url)
        cases, _ = make_cases(via, block, nblocks, server.process.pid)
        out: dict[str, dict[str, int]] = {}
        for case in cases:
            url = f"s3://{bucket}/count/{case.name}"
            proxy.clear_requests()
            case.run(url)
            counts = collections.Counter(_kind(r) for r in proxy.requests)
            out[case.name] = dict(sorted(counts.items())) | {"total": sum(counts.values())}
            cleanup_for(via)(url)
        assert not proxy.errors, proxy.errors
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 and 64 MiB, 3 rounds (< 60 s)")
    p.add_argument("--sizes-mib", type=int, nargs="+", help="object sizes (default 1 64 256)")
    p.add_argument("--rounds", type=int, help="measured rounds (default 5, quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    p.add_argument("--out", help="results name (default bench_s3, or bench_s3_quick)")
    args = p.parse_args(argv)
    sizes = args.sizes_mib or ([1, 64] if args.quick else [1, 64, 256])
    rounds = args.rounds or (3 if args.quick else 5)
    t0 = time.perf_counter()
    load_before = load_snapshot()
    with moto_bucket() as (server, options, bucket):
        results = [run_size(server, options, bucket, s * MiB, rounds, args.warmup)
                   for s in sizes]
        import moto
        import s3fs

        versions = {"moto": moto.__version__, "s3fs": s3fs.__version__}
    out = write_results(args.out or ("bench_s3_quick" if args.quick else "bench_s3"), {
        "benchmark": "bench_s3",
        "machine": machine_info(os.getcwd()) | {"versions": versions},
        "load": {"before": load_before, "after": load_snapshot()},
        "params": {"sizes_mib": sizes, "block_bytes": BLOCK, "rounds": rounds,
                   "warmup": args.warmup, "quick": args.quick},
        "target": {"ratio": TARGET, "of": f"atomic.size / {BASE}"},
        "sizes": results,
        "elapsed_s": time.perf_counter() - t0,
    })
    print(f"\nmachine load before/after: {load_before} / {load_snapshot()}")
    print(f"results: {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
