"""What a `durable.cached` hit costs against a `joblib.Memory` hit, and what a hit and a miss
cost in store requests (issue 6).

Timing, on the local disk, in interleaved rounds; each case makes CALLS calls of a cached
function whose result (a 1 MiB float64 NumPy array) is already stored:

- joblib.hit    ``joblib.Memory(location).cache(f)(x)``: hash the arguments, find the
                output, load it (no checksum: a corrupt file is silently recomputed or
                returned, STYLE.md)
- durable.hit   ``durable.cached(root)(f)(x)``: canonical key, read the commit marker,
                read the value and check its size and CRC32C against the marker, np.load
- npy.load      ``np.load(path)`` of a .npy of the same array: the floor (just the bytes)

Ratio reported: durable.hit / joblib.hit (and / npy.load), same run.

Requests: one miss and one hit of the same function on S3 (moto on 127.0.0.1 behind the
fault proxy, no fault injected), counted by kind from the proxy's log; the first miss of a
process also probes the endpoint once (create-only and If-Match enforcement) and is
reported apart. On the local disk the same calls are counted as adapter operations.
tests/test_cached.py pins the S3 counts, with what each request is for.

    python benchmarks/bench_cached.py                   # 200 calls per case, 7 rounds
    python benchmarks/bench_cached.py --quick           # 50 calls, 3 rounds
    python benchmarks/bench_cached.py --requests-only   # the counts alone, no results file
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import urllib.request
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
    scratch_dir,
    write_results,
)

import durable

MiB = 1024 * 1024
_ADAPTER_OPS = ("info", "list", "exists", "read", "put", "open_atomic", "open_read", "delete",
                "delete_prefix", "replace_if", "delete_if", "sync", "prune")


def result(x: int) -> Any:
    import numpy as np

    return np.random.default_rng(x).random(MiB // 8)  # 1 MiB of float64


def count_adapter_ops(adapter: Any) -> collections.Counter[str]:
    """Count calls of the adapter's operations (wrapping this one instance)."""
    counts: collections.Counter[str] = collections.Counter()

    def wrap(name: str) -> None:
        inner = getattr(adapter, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return inner(*args, **kwargs)

        setattr(adapter, name, counted)

    for name in _ADAPTER_OPS:
        wrap(name)
    return counts


def requests_on_s3() -> dict[str, Any]:
    from durable.testing.faults import FaultProxy
    from durable.testing.servers import set_network_guards, start_moto

    set_network_guards()
    server = start_moto()
    try:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        opener.open(urllib.request.Request(f"{server.url}/{bucket}", method="PUT")).close()
        with FaultProxy(upstream=server.url) as proxy:
            options = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
            f = durable.cached(f"s3://{bucket}/cache", storage_options=options)(result)
            out = {}
            for label, x in (("first miss of a process (endpoint probes)", 0), ("miss", 1),
                             ("hit", 1)):
                proxy.clear_requests()
                f(x)
                kinds = collections.Counter(_kind(r) for r in proxy.requests)
                out[label] = {"requests": sum(kinds.values()), "by_kind": dict(kinds)}
            assert not proxy.errors, proxy.errors
            return out
    finally:
        server.stop()


def _kind(r: Any) -> str:
    if "list-type" in r.query:
        # Which listing: the entry's records (marker, lease, attempts) or its data.
        prefix = r.query.get("prefix", [""])[0]
        what = "records" if "/.durable/" in f"/{prefix}" else "data"
        return f"LIST {what}" + (" max-keys=1" if "max-keys" in r.query else "")
    if r.method == "POST" and "delete" in r.query:
        return "DeleteObjects"
    key = r.key
    name = key.rsplit("/", 1)[-1] if key else "(bucket)"
    if name.startswith(".durable-probe-"):
        name = "probe"
    elif name.endswith(".json") and "/attempts/" in key:
        name = "attempt record"
    cond = " If-Match" if "if-match" in r.headers else (
        " If-None-Match" if "if-none-match" in r.headers else "")
    query = " ?" + r.raw_query.split("=")[0] if r.raw_query else ""
    return f"{r.method} {name}{query}{cond}"


def requests_on_disk(workdir: str) -> dict[str, Any]:
    f = durable.cached(os.path.join(workdir, "counted"))(result)
    counts = count_adapter_ops(f._adapter)
    out = {}
    for label, x in (("miss", 1), ("hit", 1)):
        counts.clear()
        f(x)
        out[label] = {"operations": sum(counts.values()), "by_kind": dict(counts)}
    return out


def _print_counts(disk: dict[str, Any], s3: dict[str, Any] | None) -> None:
    for where, counted in (("local disk (adapter operations)", disk), ("S3 (requests)", s3)):
        if counted is None:
            continue
        print(f"\n{where}:")
        for label, doc in counted.items():
            total = doc.get("requests", doc.get("operations"))
            shown = ", ".join(f"{k} {v}" for k, v in sorted(doc["by_kind"].items()))
            print(f"  {label}: {total}  ({shown})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="50 calls, 3 rounds")
    p.add_argument("--calls", type=int, help="calls per case per round (default 200)")
    p.add_argument("--rounds", type=int, help="measured rounds (default 7, quick 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", help="where to cache (default: the system temp dir)")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 request count")
    p.add_argument("--requests-only", action="store_true",
                   help="count requests, no timing; print only (no results file)")
    p.add_argument("--out", help="results name (default bench_cached[_quick])")
    args = p.parse_args(argv)
    calls = args.calls or (50 if args.quick else 200)
    rounds = args.rounds or (3 if args.quick else 7)

    if args.requests_only:
        workdir = scratch_dir(args.dir, "bench-cached")
        try:
            disk = requests_on_disk(workdir)
        finally:
            remove(workdir)
        _print_counts(disk, None if args.no_s3 else requests_on_s3())
        return 0

    import joblib
    import numpy as np

    workdir = scratch_dir(args.dir, "bench-cached")
    try:
        memory = joblib.Memory(os.path.join(workdir, "joblib"), verbose=0)
        jf = memory.cache(result)
        df = durable.cached(os.path.join(workdir, "durable"))(result)
        npy = os.path.join(workdir, "plain.npy")
        np.save(npy, result(7))
        assert (jf(7) == df(7)).all()  # computed and stored once, outside the timing

        def repeat(call: Callable[[], Any]) -> Callable[[str], None]:
            def run(_: str) -> None:
                for _i in range(calls):
                    call()
            return run

        cases = [
            Case("joblib.hit", "joblib.Memory(...).cache(f)(x), stored", repeat(lambda: jf(7))),
            Case("durable.hit", "durable.cached(root)(f)(x), stored, verified",
                 repeat(lambda: df(7))),
            Case("npy.load", "np.load(path): the bytes alone", repeat(lambda: np.load(npy))),
        ]
        print(f"{calls} hits per case of a 1 MiB result, {rounds} rounds (+{args.warmup} "
              f"warm-up), in {workdir}")
        load_before = load_snapshot()
        run_interleaved(cases, rounds=rounds, warmup=args.warmup, workdir=workdir,
                        cleanup=lambda _: None)
        by = {c.name: c for c in cases}
        bases = [by["joblib.hit"], by["npy.load"]]
        print_table(f"{calls} cache hits of a 1 MiB NumPy result", cases, bases)
        r = ratios(by["durable.hit"], by["joblib.hit"])
        per_hit = {c.name: c.best / calls for c in cases}
        print(f"durable.hit / joblib.hit: best {r['best']:.3f}, median {r['median']:.3f}, "
              f"median of per-round ratios {r['paired_median']:.3f}")
        print("per hit (best): " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in
                                             per_hit.items()))
        disk = requests_on_disk(workdir)
    finally:
        remove(workdir)
    s3 = None if args.no_s3 else requests_on_s3()
    _print_counts(disk, s3)
    out = write_results(args.out or ("bench_cached_quick" if args.quick else "bench_cached"), {
        "benchmark": "bench_cached",
        "machine": machine_info(tempfile.gettempdir()),
        "load": {"before": load_before, "after": load_snapshot()},
        "params": {"calls": calls, "rounds": rounds, "warmup": args.warmup,
                   "result_bytes": MiB, "quick": args.quick},
        "cases": {c.name: case_record(c, bases) for c in cases},
        "per_hit_best_s": per_hit,
        "requests": {"local": disk, "s3": s3},
    })
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
