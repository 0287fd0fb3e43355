"""What `Entry.state()` costs on an entry of many objects, with and without the summary.

An entry of more than 10,000 objects keeps its manifest in a separate object
(``manifest-<attempt>.json``, 5.4 MB for 100,000 keys). Its marker now also summarises it
(``count``, ``total_size`` and ``ends``: the records of the first and last keys), so
`state()` stats those two objects and the manifest (all at once across a network) and
fetches nothing else; the manifest is fetched, checked and parsed where its keys are used.
A marker without ``ends`` (written before) reads as it did: the manifest is fetched and
parsed at every `state()`. Both are timed on the same entry in interleaved rounds (the
marker swapped between them, outside the timing):

- summary:     state(), the marker as written now
- no summary:  state(), the same marker without ``ends`` (as written before the summary)
- load:        read_marker() and its manifest's objects: what verify(), `durable scan`,
               `durable.zarr.open` pay once (fetch, CRC32C, parse, checks of every key)

On moto the requests of one call are counted through a proxy.

    python benchmarks/bench_state.py                 # 100,000 objects, file and moto
    python benchmarks/bench_state.py --quick         # 20,000 objects
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import fsspec
from _util import load_snapshot, machine_info, targets, write_results

import durable
from durable._checksum import crc32c
from durable._protocol import Layout, Manifest, Marker, ObjectRecord, new_attempt_id


def build(root: str, options: dict[str, Any] | None, objects: int) -> tuple[str, bytes, bytes]:
    """An entry of ``objects`` 64-byte objects committed as a writer commits it; its URL,
    and its marker's bytes with and without ``ends``."""
    url = f"{root}/shard"
    fs, path = fsspec.url_to_fs(url, **(options or {"auto_mkdir": True}))
    body = b"x" * 64
    rec = ObjectRecord(len(body), crc32c(body))
    keys = [f"{i // 1000:03d}/part-{i:06d}.bin" for i in range(objects)]
    fs.pipe({f"{path}/{k}": body for k in keys})
    marker, (name, blob) = _encoded(Marker.new("prefix", new_attempt_id(),
                                               Manifest(dict.fromkeys(keys, rec))))
    layout = Layout(path)
    fs.pipe_file(layout.external_manifest(name), blob)
    doc = json.loads(marker)
    old = json.dumps({k: v for k, v in doc.items() if k != "ends"},
                     separators=(",", ":")).encode()
    return url, marker, old


def _encoded(marker: Marker) -> tuple[bytes, tuple[str, bytes]]:
    data, external = marker.encode()
    assert external is not None, "too few objects for an external manifest"
    return data, external


def count_requests(server_url: str, options: dict[str, Any], call: Callable[[dict[str, Any]],
                                                                               object]) -> int:
    from durable.testing.faults import FaultProxy

    with FaultProxy(upstream=server_url) as proxy:
        call({**options, "endpoint_url": proxy.url, "skip_instance_cache": True})
        return len(proxy.requests)


def run(name: str, root: str, options: dict[str, Any] | None, objects: int, rounds: int
        ) -> dict[str, Any]:
    t0 = time.perf_counter()
    url, new, old = build(root, options, objects)
    print(f"{name}: built {objects:,} objects in {time.perf_counter() - t0:.1f} s", flush=True)
    fs, path = fsspec.url_to_fs(url, **(options or {"auto_mkdir": True}))
    marker_path = Layout(path).marker

    def state(opts: dict[str, Any] | None = None) -> None:
        assert durable.Entry(url, storage_options=opts or options).state() is \
            durable.State.COMPLETE

    def load(opts: dict[str, Any] | None = None) -> None:
        marker = durable.Entry(url, storage_options=opts or options).read_marker()
        assert marker is not None and marker.manifest is not None
        assert len(marker.manifest.objects) == objects

    cases: dict[str, tuple[bytes, Callable[..., None]]] = {
        "summary": (new, state), "no summary": (old, state), "load": (new, load)}
    times: dict[str, list[float]] = {c: [] for c in cases}
    rng = random.Random(0)
    for r in range(rounds + 1):  # the first round warms up, and is dropped
        order = list(cases)
        rng.shuffle(order)
        for case in order:
            data, call = cases[case]
            fs.pipe_file(marker_path, data)
            t0 = time.perf_counter()
            call()
            if r:
                times[case].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"objects": objects, "marker_bytes": len(new),
                           "cases": {c: {"median_s": statistics.median(t), "best_s": min(t),
                                         "times_s": t} for c, t in times.items()}}
    base = out["cases"]["no summary"]
    for c in cases:
        out["cases"][c]["vs_no_summary_median"] = out["cases"][c]["median_s"] / base["median_s"]
    if name == "moto":
        assert options is not None
        server = options["endpoint_url"]
        for case, (data, call) in cases.items():
            fs.pipe_file(marker_path, data)
            out["cases"][case]["requests"] = count_requests(server, options, call)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="20,000 objects, 3 rounds")
    p.add_argument("--objects", type=int, help="objects of the entry (default 100,000)")
    p.add_argument("--rounds", type=int, help="measured rounds (default 7, quick 3)")
    p.add_argument("--target", action="append", choices=["file", "moto"],
                   help="where (default both)")
    p.add_argument("--dir", help="scratch directory for the file target")
    p.add_argument("--out", help="results name (default bench_state, or bench_state_quick)")
    args = p.parse_args(argv)
    objects = args.objects or (20_000 if args.quick else 100_000)
    rounds = args.rounds or (3 if args.quick else 7)
    before = load_snapshot()
    results = {}
    with targets(args.target or ["file", "moto"], args.dir, "bench_state") as where:
        for name, root, options in where:
            results[name] = run(name, root, options, objects, rounds)
    print(f"\n{'target':<6} {'case':<11} {'median s':>9} {'best s':>8} {'/no summary':>11} "
          f"{'requests':>8}")
    for name, res in results.items():
        for case, c in res["cases"].items():
            print(f"{name:<6} {case:<11} {c['median_s']:>9.4f} {c['best_s']:>8.4f} "
                  f"{c['vs_no_summary_median']:>11.3f} {c.get('requests', '-'):>8}")
    print("(ratios between cases of this run, medians of the rounds)")
    out = write_results(args.out or ("bench_state_quick" if args.quick else "bench_state"), {
        "benchmark": "bench_state", "machine": machine_info(args.dir or tempfile.gettempdir()),
        "load_before": before, "load_after": load_snapshot(), "results": results})
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
