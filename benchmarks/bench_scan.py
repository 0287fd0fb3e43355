"""What `durable scan` asks of an object store: requests and time on moto (issue 7).

Roots of committed entries on a moto S3 server, scanned through the fault proxy with no
fault injected, whose log counts every request:

- ``N1`` entries of one object, ``N2`` entries of one object (default 1,000 and 10,000):
  the count grows with entries (one marker GET each) and listing pages (1,000 keys each);
- ``N1`` entries of ``--objects`` objects each (default 10): ten times the objects, the
  same entries; only the listing pages grow.

The count is checked against the formula ``pages + 1 + entries`` (the root's listing, one
listing of the root's own records dir, one GET per marker), and printed with the time of
the scan (through the proxy, and direct to moto). Times on a shared machine are noisy;
the counts are exact.

Entries are made the way a committed durable entry looks in the store (its objects and a
marker encoded by `durable._protocol.Marker`, as `Entry.writing()` commits it) and uploaded
with boto3 in threads: writing 20,000 objects through `Entry.writing()` would measure the
writer, not the scan.

    python benchmarks/bench_scan.py               # 1,000 and 10,000 entries (minutes)
    python benchmarks/bench_scan.py --quick       # 200 and 1,000 entries
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from _util import load_snapshot, machine_info, write_results

from durable._checksum import crc32c
from durable._protocol import Layout, Manifest, Marker, ObjectRecord, new_attempt_id
from durable._scan import scan
from durable.testing.faults import FaultProxy
from durable.testing.servers import MotoServer, set_network_guards, start_moto

BUCKET = "bench-scan"


def build(client: Any, prefix: str, entries: int, objects: int) -> int:
    """``entries`` committed entries of ``objects`` small objects under ``prefix``."""
    puts: list[tuple[str, bytes]] = []
    for i in range(entries):
        layout = Layout(f"{BUCKET}/{prefix}/e{i:05d}.zarr")
        data = {f"c/{k}": f"{i}.{k}".encode() for k in range(objects)}
        records = {k: ObjectRecord(len(v), crc32c(v)) for k, v in data.items()}
        marker, _ = Marker.new("prefix", new_attempt_id(), Manifest(records)).encode()
        puts += [(f"{layout.root}/{k}", v) for k, v in data.items()]
        puts.append((layout.marker, marker))

    def put(item: tuple[str, bytes]) -> None:
        client.put_object(Bucket=BUCKET, Key=item[0].partition("/")[2], Body=item[1])

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, puts))
    return len(puts)


def measure(server: MotoServer, prefix: str, entries: int, objects: int,
            keys: int) -> dict[str, Any]:
    url = f"s3://{BUCKET}/{prefix}"
    with FaultProxy(upstream=server.url) as proxy:
        options = {**server.storage_options(), "endpoint_url": proxy.url,
                   "skip_instance_cache": True}
        t0 = time.perf_counter()
        rows = scan(url, options)
        through_proxy = time.perf_counter() - t0
        log = proxy.requests
    t0 = time.perf_counter()
    direct_rows = scan(url, {**server.storage_options(), "skip_instance_cache": True})
    direct = time.perf_counter() - t0
    assert len(rows) == len(direct_rows) == entries
    assert all(r.state == "COMPLETE" for r in rows)
    kinds = Counter("list" if "list-type" in r.query else f"{r.method} marker"
                    if r.key.endswith("/commit.json") else f"{r.method} other" for r in log)
    pages = math.ceil(keys / 1000)
    predicted = pages + 1 + entries
    return {"root": url, "entries": entries, "objects_per_entry": objects,
            "objects": entries * objects, "keys": keys, "requests": len(log),
            "predicted": predicted, "by_kind": dict(kinds),
            "seconds_through_proxy": through_proxy, "seconds_direct": direct,
            "requests_per_entry": len(log) / entries}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="200 and 1,000 entries")
    p.add_argument("--small", type=int, help="entries of the small root (default 1000)")
    p.add_argument("--large", type=int, help="entries of the large root (default 10000)")
    p.add_argument("--objects", type=int, default=10,
                   help="objects per entry of the many-objects root (default 10)")
    p.add_argument("--out", help="results name (default bench_scan, or bench_scan_quick)")
    args = p.parse_args(argv)
    small = args.small or (200 if args.quick else 1000)
    large = args.large or (1000 if args.quick else 10000)
    set_network_guards()
    import boto3

    cases = [("small", small, 1), ("large", large, 1), ("many-objects", small, args.objects)]
    results = []
    with start_moto() as server:
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/{BUCKET}", method="PUT"))
        client = boto3.client("s3", endpoint_url=server.url, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        for name, entries, objects in cases:
            t0 = time.perf_counter()
            keys = build(client, name, entries, objects)
            print(f"built {name}: {entries} entries, {keys} keys in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            results.append(measure(server, name, entries, objects, keys))

    print(f"\n{'root':<14} {'entries':>8} {'objects':>8} {'requests':>9} {'predicted':>9} "
          f"{'per entry':>9} {'s (proxy)':>9} {'s (direct)':>10}")
    for (name, *_), r in zip(cases, results, strict=True):
        print(f"{name:<14} {r['entries']:>8} {r['objects']:>8} {r['requests']:>9} "
              f"{r['predicted']:>9} {r['requests_per_entry']:>9.3f} "
              f"{r['seconds_through_proxy']:>9.2f} {r['seconds_direct']:>10.2f}")
    print("(requests = listing pages of 1,000 keys + 1 listing of the root's records + 1 "
          "GET per marker; never one per object)")
    ok = all(r["requests"] == r["predicted"] for r in results)
    out = write_results(args.out or ("bench_scan_quick" if args.quick else "bench_scan"), {
        "benchmark": "bench_scan",
        "machine": machine_info(tempfile.gettempdir()),
        "load": load_snapshot(),
        "results": results,
        "counts_match_formula": ok,
    })
    print(f"\nresults: {out}")
    if not ok:
        print("MISSED: the request count is not the formula's", json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
