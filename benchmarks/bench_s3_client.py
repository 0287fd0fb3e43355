"""What one small S3 request costs through each client durable could use, on moto.

durable's own requests of a commit (the attempt record, the LISTs of the records, the
marker, the DeleteObjects) are small: their cost is the client's and the server's, not the
bytes'. This measures, in one run against one moto server, a batch of small requests:

- adapter-put:           `S3Adapter.put`, as durable's commits put their attempt records and
                         markers: through obstore where it maps (`_s3_light`, since the
                         seventh session)
- s3fs-put / s3fs-list:  through durable's S3 adapter with ``light_puts`` off (s3fs,
                         aiobotocore): what every request cost before, and what a LIST costs
- ts-put / ts-list:      through tensorstore's kvstore client (C++, libcurl): what plain
                         tensorstore pays per request
- http-put:              a bare unsigned HTTP PUT (urllib): the server's share alone

Each case sends ``--batch`` requests per round (300-byte PUTs; LISTs of a prefix holding 3
keys); times are per request. The ratio s3fs / tensorstore is what a lighter client would
save per request; `bench_tensorstore.py` says how many such requests a commit makes.

    python benchmarks/bench_s3_client.py             # 15 rounds of 20 requests
    python benchmarks/bench_s3_client.py --quick     # 3 rounds of 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import urllib.request
import uuid
from typing import Any

from _util import (
    Case,
    case_record,
    load_snapshot,
    machine_info,
    print_table,
    remove,
    run_interleaved,
    scratch_dir,
    write_results,
)

from durable.testing.servers import set_network_guards

set_network_guards()  # before any cloud client is imported: nothing looks for metadata

import tensorstore as ts  # noqa: E402

import durable.tensorstore as dts  # noqa: E402
from durable import Entry  # noqa: E402

BODY = b"x" * 300


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds of 5 requests")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds (default 15)")
    p.add_argument("--batch", type=int, default=None, help="requests per round (default 20)")
    p.add_argument("--out", default=None, help="results name (default bench_s3_client)")
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    batch = args.batch or (5 if args.quick else 20)
    out = args.out or ("bench_s3_client_quick" if args.quick else "bench_s3_client")

    from durable.testing.servers import start_moto

    load_before = load_snapshot()
    workdir = scratch_dir(None, "bench-s3-client")  # only for run_interleaved's names
    with start_moto() as server:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/{bucket}",
                                                      method="PUT")).close()
        opts: dict[str, Any] = server.storage_options()
        adapter = Entry(f"s3://{bucket}/entry", storage_options=opts).adapter
        kv = ts.KvStore.open(dts.kvstore_spec(f"s3://{bucket}/", opts)).result()
        for i in range(3):  # the prefix the LISTs list
            adapter.put(f"{bucket}/listed/{i}", BODY, durable=False)

        def name(target: str) -> str:
            return target.rpartition("/")[2]

        def adapter_put(target: str) -> None:
            for i in range(batch):
                adapter.put(f"{bucket}/adapter/{name(target)}-{i}", BODY, durable=False)

        def s3fs_put(target: str) -> None:
            type(adapter).light_puts = False
            try:
                for i in range(batch):
                    adapter.put(f"{bucket}/s3fs/{name(target)}-{i}", BODY, durable=False)
            finally:
                type(adapter).light_puts = True

        def ts_put(target: str) -> None:
            for i in range(batch):
                kv.write(f"ts/{name(target)}-{i}".encode(), BODY).result()

        def http_put(target: str) -> None:
            for i in range(batch):
                urllib.request.urlopen(urllib.request.Request(
                    f"{server.url}/{bucket}/http/{name(target)}-{i}", data=BODY,
                    method="PUT")).close()

        def s3fs_list(_: str) -> None:
            for _i in range(batch):
                assert len(adapter.list(f"{bucket}/listed")) == 3

        def ts_list(_: str) -> None:
            for _i in range(batch):
                assert len(kv.list(ts.KvStore.KeyRange(inclusive_min=b"listed/",
                                                       exclusive_max=b"listed0")
                                   ).result()) == 3

        puts = [Case("adapter-put", "durable's S3 adapter (obstore for small PUTs)",
                     adapter_put),
                Case("s3fs-put", "durable's S3 adapter, light_puts off (s3fs)", s3fs_put),
                Case("ts-put", "tensorstore's kvstore client", ts_put),
                Case("http-put", "a bare HTTP PUT (urllib)", http_put)]
        lists = [Case("s3fs-list", "durable's S3 adapter (s3fs)", s3fs_list),
                 Case("ts-list", "tensorstore's kvstore client (keys only)", ts_list)]
        assert adapter._light_stores.get(bucket) is not None, "obstore did not map: no case"
        for cases in (puts, lists):
            run_interleaved(cases, rounds=rounds, warmup=1, workdir=workdir,
                            cleanup=lambda _: None, quiet=True)
            for c in cases:  # per request
                c.times = [t / batch for t in c.times]
                c.cpu = [t / batch for t in c.cpu]
    remove(workdir)
    print(f"== small requests to moto: {rounds} rounds of {batch}, times per request")
    print_table("PUT of 300 bytes", puts, [puts[2]])
    print_table("LIST of 3 keys", lists, [lists[1]])
    for c in (*puts, *lists):
        print(f"  {c.name}: {c.median * 1e3:.2f} ms wall, "
              f"{statistics.median(c.cpu) * 1e3:.2f} ms of this process's CPU (medians)")
    path = write_results(out, {
        "benchmark": "bench_s3_client", "machine": machine_info(workdir="."),
        "load": {"before": load_before, "after": load_snapshot()},
        "params": {"rounds": rounds, "batch": batch, "body_bytes": len(BODY)},
        "cases": {c.name: case_record(c, [puts[2] if c in puts else lists[1]])
                  for c in (*puts, *lists)},
    })
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
