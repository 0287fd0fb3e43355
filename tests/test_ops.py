"""Operating a root of 2,000 entries (on moto every kind, a few of each): scan, verify,
mark-complete and clean (issue 7).

The root mixes every kind of entry an operator meets, each made the way it happens:

- COMPLETE: written through `Entry.writing()` (and a few single objects by `atomic_write`);
- corrupted: written whole, then a chunk truncated, or one byte flipped, in place;
- unmarked: whole data written without durable (before it was deployed);
- killed: a child process inside `Entry.writing()` for many entries at once, SIGKILLed
  before any commit: attempt records and objects, no marker (on disk also half-written
  temp files, of an entry's object and of `atomic_write`s);
- abandoned: killed writers whose attempt started 3 days ago. Ages are made without
  sleeping: the attempt record's started_at is set back (and on disk the files' mtimes);
- leased: killed writers holding a lease file, one kept alive by a heartbeat, one stale;
- orphan records: killed writers whose data another tool deleted since.

On disk the data written before the killed writers is also set 10 days back, so that an
age alone never protects a COMPLETE or unmarked entry in these tests: only the rules do.

Everything is checked from outside durable: files read with os, objects listed with boto3
(the ETag of a single PUT is the MD5 of its bytes, so equal listings mean equal bytes).
The CLI runs in-process (click's CliRunner), as an operator would run it.

Run as a script (``python test_ops.py kill ROOT OPTIONS NAMES STRAYS``) this file is the
killed writer: it opens every writer, reports "ready" and waits to be SIGKILLed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

SIZES = {"complete": 1790, "object": 10, "unmarked": 100, "trunc": 10, "flip": 10,
         "killed": 30, "abandoned": 30, "live": 5, "stale": 5, "orphan": 10}
# On moto every kind again, each a few times (every request there costs a millisecond or
# more: 2,000 entries took 150 s). What only scale shows, a listing longer than one page,
# is covered on S3 by test_s3.py's test_listing_follows_every_page; the rules are the same
# per entry, and two or more of a kind still tell "all of a kind" from "the first one".
S3_SIZES = {"complete": 20, "object": 3, "unmarked": 4, "trunc": 2, "flip": 2,
            "killed": 3, "abandoned": 3, "live": 2, "stale": 2, "orphan": 2}
MARKED_KINDS = ("complete", "object", "trunc", "flip")  # written through durable
KILLED_KINDS = ("killed", "abandoned", "live", "stale", "orphan")
OLD = 3 * 86400  # abandoned: started 3 days ago
OLDER = 10 * 86400  # data written before the killed writers ran (local disk only)
STALE_AFTER = 0.5  # seconds, in the lease files this test writes
ZARR_JSON = b'{"zarr_format": 3, "node_type": "array"}'


def names(kind: str, sizes: dict[str, int]) -> list[str]:
    if kind == "object":
        return [f"object-{i:02d}.bin" for i in range(sizes[kind])]
    return [f"{kind}-{i:04d}.zarr" for i in range(sizes[kind])]


def count(sizes: dict[str, int], kinds: tuple[str, ...]) -> int:
    return sum(sizes[k] for k in kinds)


def kind_of(name: str) -> str:
    return name.partition("-")[0]


def chunk(name: str, size: int = 16) -> bytes:
    return (name.encode() * size)[:size]


def iso(when: float) -> str:
    return dt.datetime.fromtimestamp(when, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# the killed writer (a child process) ------------------------------------------------------
def _child(root: str, options: dict[str, Any], entry_names: list[str], strays: bool) -> None:
    from durable import Entry, atomic_write

    keep: list[Any] = []  # referenced until the kill: a collected writer would clean up

    def start(name: str) -> None:
        cm = Entry(f"{root}/{name}", storage_options=options).writing()
        w = cm.__enter__()
        w.write_bytes("zarr.json", ZARR_JSON)
        w.fs.pipe_file(f"{w.path}/c/0", chunk(name, 64))  # the fsspec way, as zarr writes
        keep.append((cm, w))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(start, entry_names))
    if strays:
        # Half-written objects: one inside an abandoned entry, two atomic_writes beside.
        w = next(w for _, w in keep if w.path.endswith("/abandoned-0000.zarr"))
        f = w.open("c/1")
        f.write(b"half an object")
        keep.append(f)
        for stray in ("stray-old.bin", "stray-new.bin"):
            cm = atomic_write(f"{root}/{stray}", storage_options=options)
            handle = cm.__enter__()
            handle.write(b"half a file")
            handle.flush()
            keep.append((cm, handle))
    print("ready", flush=True)
    sys.stdin.readline()  # SIGKILLed here


def _child_leased(root: str, options: dict[str, Any], entry_names: list[str]) -> None:
    """Writers holding a real `durable.Lease`, killed: their lease files stop changing."""
    from durable import Entry, Lease

    keep: list[Any] = []
    for name in entry_names:
        lease = Lease(f"{root}/{name}", storage_options=options, heartbeat=0.05,
                      stale_after=0.3).acquire()
        cm = Entry(f"{root}/{name}", storage_options=options).writing(lease=lease)
        w = cm.__enter__()
        w.write_bytes("c/0", chunk(name))
        keep.append((lease, cm, w))
    print("ready", flush=True)
    sys.stdin.readline()  # SIGKILLed here


def _child_upload(url: str, options: dict[str, Any]) -> None:
    """An atomic_write past one part of an S3 multipart upload, killed before commit."""
    from durable import atomic_write

    cm = atomic_write(url, storage_options=options)
    handle = cm.__enter__()
    handle.write(b"u" * (9 * 1024 * 1024))  # over the 8 MiB part size: an upload starts
    handle.flush()
    print("ready", flush=True)
    sys.stdin.readline()  # SIGKILLed here


def kill_writers(root: str, options: dict[str, Any], entry_names: list[str],
                 strays: bool, *, mode: str = "kill") -> None:
    proc = subprocess.Popen(
        [sys.executable, __file__, mode, root, json.dumps(options), ",".join(entry_names),
         "1" if strays else "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"child said {line!r}: {proc.communicate()[1]}")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


#: Writers "killed" in this process, kept referenced: a collected ``writing()`` generator
#: would clean up after all (GeneratorExit), which a killed process never does.
_KILLED: list[Any] = []


def dead_leased_writer(url: str, *, stale_after: float) -> None:
    """A writer of ``url`` holding its lease, killed in this process: one object written,
    no more renewals, nothing cleaned up (its lease and records stay)."""
    from durable import Entry, Lease

    dead = Lease(url, heartbeat=0.05, stale_after=stale_after).acquire()
    killed = Entry(url).writing(lease=dead)  # kept, never ended: nothing cleaned up
    killed.__enter__().write_bytes("c/0", b"dead writer's")
    dead._stop.set()  # killed: no more renewals
    assert dead._thread is not None
    dead._thread.join()
    _KILLED.append(killed)


# stores, seen from outside durable --------------------------------------------------------
class LocalStore:
    kind = "file"
    sizes = SIZES

    def __init__(self, root: str) -> None:
        self.root = root
        self.options: dict[str, Any] = {}

    def url(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def canonical(self, name: str) -> str:
        return f"file://{self.root}/{name}"

    def write(self, rel: str, data: bytes) -> None:
        full = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        tmp = f"{full}.test-tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, full)  # a new inode: a lease's version changes with each beat

    def read(self, rel: str) -> bytes:
        with open(os.path.join(self.root, rel), "rb") as f:
            return f.read()

    def keys(self, rel: str) -> list[str]:
        out = []
        for dirpath, _, files in os.walk(os.path.join(self.root, rel)):
            out += [os.path.relpath(os.path.join(dirpath, f), self.root) for f in files]
        return out

    def remove_tree(self, rel: str) -> None:
        shutil.rmtree(os.path.join(self.root, rel))

    def set_mtime(self, rel: str, when: float) -> None:
        """Set back the files at and below ``rel``."""
        alone = [rel] if os.path.lexists(os.path.join(self.root, rel)) else []
        for key in self.keys(rel) or alone:
            os.utime(os.path.join(self.root, key), (when, when))

    def snapshot(self) -> dict[str, Any]:
        return {k: self.read(k) for k in self.keys("")}


class S3Store:
    kind = "s3"
    sizes = S3_SIZES

    def __init__(self, bucket: Any, prefix: str = "root") -> None:
        import boto3

        self.bucket = bucket.name
        self.prefix = prefix
        self.options = dict(bucket.storage_options)
        from botocore.config import Config

        # No flexible checksum on plain test uploads: moto parses aws-chunked bodies slowly.
        config = Config(request_checksum_calculation="when_required", max_pool_connections=16)
        self.client = boto3.client("s3", endpoint_url=bucket.server.url,
                                   aws_access_key_id="testing",
                                   aws_secret_access_key="testing", region_name="us-east-1",
                                   config=config)

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}/{self.prefix}", *parts])

    def canonical(self, name: str) -> str:
        return self.url(name)

    def write(self, rel: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{rel}", Body=data)

    def read(self, rel: str) -> bytes:
        body: bytes = self.client.get_object(Bucket=self.bucket,
                                             Key=f"{self.prefix}/{rel}")["Body"].read()
        return body

    def listing(self, rel: str = "") -> dict[str, tuple[int, str]]:
        start = f"{self.prefix}/{rel}"
        out = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=start):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(self.prefix) + 1:]] = (obj["Size"], obj["ETag"])
        return out

    def keys(self, rel: str) -> list[str]:
        return list(self.listing(rel))

    def remove_tree(self, rel: str) -> None:
        for key in self.keys(rel + "/"):
            self.client.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")

    def set_mtime(self, rel: str, when: float) -> None:
        pass  # an object store's modification times cannot be set

    def snapshot(self) -> dict[str, Any]:
        return self.listing()

    def upload_tree(self, local: str) -> None:
        files = [os.path.join(d, f) for d, _, fs in os.walk(local) for f in fs]

        def put(path: str) -> None:
            with open(path, "rb") as f:
                self.write(os.path.relpath(path, local), f.read())

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, files))


Store = LocalStore | S3Store


# building the root ------------------------------------------------------------------------
def build_static(root: str, sizes: dict[str, int]) -> None:
    """COMPLETE, corrupted and unmarked entries, on the local disk, through durable."""
    from durable import Entry, atomic_write

    def write(name: str) -> None:
        kind = kind_of(name)
        if kind == "object":
            with atomic_write(f"{root}/{name}") as f:
                f.write(chunk(name))
        elif kind == "unmarked":
            os.makedirs(f"{root}/{name}/c")
            for rel, data in (("zarr.json", ZARR_JSON), ("c/0", chunk(name, 64))):
                with open(f"{root}/{name}/{rel}", "wb") as f:
                    f.write(data)
        else:
            with Entry(f"{root}/{name}").writing() as w:
                if kind == "complete":
                    w.fs.pipe_file(f"{w.path}/c/0", chunk(name))
                else:
                    w.write_bytes("zarr.json", ZARR_JSON)
                    w.fs.pipe_file(f"{w.path}/c/0", chunk(name, 64))

    todo = [n for k in ("complete", "object", "unmarked", "trunc", "flip")
            for n in names(k, sizes)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(write, todo))
    for name in names("trunc", sizes):
        os.truncate(f"{root}/{name}/c/0", 10)  # a chunk cut short, as incident 002's were
    for name in names("flip", sizes):
        path = f"{root}/{name}/c/0"
        with open(path, "r+b") as f:
            f.seek(7)
            byte = f.read(1)[0]
            f.seek(7)
            f.write(bytes([byte ^ 0xFF]))  # same size: only a deep verify sees it


def lease_body(beat: int) -> bytes:
    # As durable.Lease writes it; the renewal counter makes every beat a new version.
    return json.dumps({"format": "durable.lease", "holder": "6f1c0a9e", "host": "worker-7",
                       "pid": 4242, "acquired_at": iso(time.time() - OLD), "renewal": beat,
                       "heartbeat": STALE_AFTER / 5, "stale_after": STALE_AFTER}).encode()


def records_of(name: str) -> str:
    parent, _, base = name.rpartition("/")
    return "/".join([p for p in (parent, ".durable", base) if p])


def set_back(store: Store, name: str, when: float) -> None:
    """Make a killed writer's attempt look started at ``when`` (and its files written)."""
    for rel in store.keys(f"{records_of(name)}/attempts/"):
        doc = json.loads(store.read(rel))
        doc["started_at"] = iso(when)
        store.write(rel, json.dumps(doc).encode())
    store.set_mtime(records_of(name), when)
    store.set_mtime(name, when)


def add_killed_writers(store: Store) -> None:
    """The killed writers, then their ages, leases and deleted data (see the module doc)."""
    killed = [n for k in KILLED_KINDS for n in names(k, store.sizes)]
    kill_writers(store.url(), store.options, killed, strays=store.kind == "file")
    back = time.time() - OLD
    for name in killed:
        if kind_of(name) == "killed":
            continue
        if kind_of(name) in ("live", "stale"):
            store.write(f".durable/{name}/lease.json", lease_body(0))
        if kind_of(name) == "orphan":
            store.remove_tree(name)  # another tool deleted the data since
        set_back(store, name, back)
    if store.kind == "file":
        (old_temp,) = [k for k in store.keys("") if k.startswith(".stray-old.bin.durable-tmp-")]
        store.set_mtime(old_temp, back)


def expected_states(sizes: dict[str, int]) -> dict[str, str]:
    states = {}
    for kind in sizes:
        state = "COMPLETE" if kind in ("complete", "object", "flip") else "INCOMPLETE"
        states.update(dict.fromkeys(names(kind, sizes), state))
    return states


@pytest.fixture(scope="session")
def static_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("ops-static") / "root")
    build_static(root, SIZES)
    return root


@pytest.fixture(scope="session")
def local_template(static_root: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("ops-template") / "root")
    shutil.copytree(static_root, root)
    store = LocalStore(root)
    store.set_mtime("", time.time() - OLDER)
    add_killed_writers(store)
    return root


@pytest.fixture
def local(local_template: str, tmp_path: Path) -> LocalStore:
    root = os.path.realpath(tmp_path / "root")
    # Hard links: a copy in no time, with the template's mtimes (the ages). Safe because
    # nothing here writes a file in place: durable publishes by rename, tests replace.
    shutil.copytree(local_template, root, copy_function=os.link)
    return LocalStore(root)


@pytest.fixture
def _no_ambient_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from durable.cli import ENV_OPTIONS

    monkeypatch.delenv(ENV_OPTIONS, raising=False)


def run(store: Store, *args: str) -> Any:
    """The CLI, in-process, on ``store``; returns (exit code, JSON document)."""
    from click.testing import CliRunner

    from durable.cli import cli

    options = ["--storage-options", json.dumps(store.options)] if store.options else []
    result = CliRunner().invoke(cli, [*args, "--json", *options], catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.stderr == "", result.stderr  # --json: no progress bar, no noise
    return result.exit_code, json.loads(result.stdout)


@contextlib.contextmanager
def beating(store: Store) -> Iterator[None]:
    """Renew the "live" leases of a store while the block runs, as their writers would."""
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.wait(STALE_AFTER / 10):  # ten beats per stale_after window
            n += 1
            for name in names("live", store.sizes):
                store.write(f".durable/{name}/lease.json", lease_body(n))

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


# the operator's jobs, checked on one store ------------------------------------------------
def check_scan(store: Store) -> None:
    code, doc = run(store, "scan", store.url())
    assert code == 0
    rows = {e["url"]: e for e in doc["entries"]}
    sizes = store.sizes
    expected = expected_states(sizes)
    assert len(rows) == len(expected) == sum(sizes.values())
    assert {u: r["state"] for u, r in rows.items()} == {
        store.canonical(n): s for n, s in expected.items()}
    complete = count(sizes, ("complete", "object", "flip"))
    assert doc["counts"] == {"COMPLETE": complete, "INCOMPLETE": len(expected) - complete,
                             "ERROR": 0}
    for name in expected:
        row, kind = rows[store.canonical(name)], kind_of(name)
        if kind in ("complete", "object", "flip"):
            assert row["reason"].startswith("committed at ")
            assert (row["age_source"], row["age_clock"]) == ("committed_at", "writer")
            assert 0 <= row["age"] < 3600
        elif kind == "trunc":
            assert "c/0 is 10 bytes, the marker recorded 64" in row["reason"]
        elif kind == "unmarked":
            assert row["reason"] == "data present but no commit marker"
            assert (row["age_source"], row["age_clock"]) == ("object mtime", "store")
            assert row["age"] > (OLDER - 60 if store.kind == "file" else -60)
        else:
            started = ("a writer started but has not committed (attempt records: 1)")
            assert row["reason"] == (started if kind == "orphan" else
                                     f"data present but no commit marker; {started}")
            assert (row["age_source"], row["age_clock"]) == ("started_at", "writer")
            assert (row["age"] > OLD - 60) == (kind != "killed"), name
        if kind in ("live", "stale"):
            assert row["lease"]["host"] == "worker-7" and row["lease"]["pid"] == 4242
            assert row["lease"]["stale_after"] == STALE_AFTER
        else:
            assert row["lease"] is None


def check_verify(store: Store, *, shallow: bool = True) -> None:
    sizes = store.sizes
    corrupted = {store.canonical(n) for k in ("trunc", "flip") for n in names(k, sizes)}
    code, doc = run(store, "verify", store.url(), "--deep")
    assert code == 5
    assert doc["entries"] == count(sizes, MARKED_KINDS) and not doc["ok"]
    assert doc["failed"] == len(corrupted)
    failed = {r["url"]: r for r in doc["results"] if not r["ok"]}
    assert failed.keys() == corrupted
    for url, r in failed.items():
        (p,) = r["problems"]
        assert (p["key"], p["url"]) == ("c/0", f"{url}/c/0")
        if "/trunc-" in url:
            assert (p["issue"], p["expected"], p["found"]) == ("size", 64, 10)
        else:
            assert p["issue"] == "crc32c" and p["expected"] != p["found"]
    assert {n["url"] for n in doc["not_verified"]} == {
        store.canonical(n) for k in ("unmarked", *KILLED_KINDS) for n in names(k, sizes)}
    if shallow:
        code, doc = run(store, "verify", store.url())
        assert code == 5 and doc["bytes_checked"] == 0
        assert {r["url"] for r in doc["results"] if not r["ok"]} == {
            store.canonical(n) for n in names("trunc", sizes)}


def check_mark_complete(store: Store, *, dry_run: bool = True) -> None:
    sizes = store.sizes
    unmarked = {store.canonical(n) for n in names("unmarked", sizes)}
    before = store.snapshot()
    if dry_run:
        code, doc = run(store, "mark-complete", store.url())
        assert code == 0 and not doc["apply"] and "TRUSTS" in doc["trust"]
        assert {e["url"] for e in doc["entries"] if e["status"] == "planned"} == unmarked
        assert store.snapshot() == before  # a dry run writes nothing
    code, doc = run(store, "mark-complete", store.url(), "--apply")
    assert code == 0
    assert {e["url"]: e["status"] for e in doc["entries"]} == dict.fromkeys(unmarked,
                                                                            "adopted")
    assert doc["marked"] == count(sizes, MARKED_KINDS)
    assert {s["url"] for s in doc["skipped"]} == {
        store.canonical(n) for k in KILLED_KINDS for n in names(k, sizes)}
    after = store.snapshot()
    added = set(after) - set(before)
    assert added == {f".durable/{n}/commit.json" for n in names("unmarked", sizes)}
    assert {k: after[k] for k in before} == before  # nothing else written, nothing removed
    from durable import Entry, State

    for name in names("unmarked", sizes)[:10]:
        entry = Entry(store.url(name), storage_options=store.options)
        assert entry.state() is State.COMPLETE
        assert entry.verify(deep=True).objects == 2
    # Idempotent: a second run finds nothing to adopt and writes nothing.
    code, doc = run(store, "mark-complete", store.url(), "--apply")
    assert code == 0 and doc["entries"] == []
    assert doc["marked"] == count(sizes, (*MARKED_KINDS, "unmarked"))
    assert store.snapshot() == after


def check_clean(store: Store, *, dry_run: bool = True) -> None:
    sizes = store.sizes
    gone_entries = [n for k in ("abandoned", "stale", "orphan") for n in names(k, sizes)]
    before = store.snapshot()
    # Ages here are made by setting back the writers' started_at (an object store's
    # modification times cannot be set): measured by this machine's clock.
    args = ("clean", store.url(), "--older-than", "1h", "--lease-wait", "5", "--clock", "local")
    if dry_run:
        with beating(store):
            code, doc = run(store, *args)
        assert code == 0 and {i["status"] for i in doc["items"]} == {"planned"}
        assert store.snapshot().keys() == before.keys()
    with beating(store):
        code, doc = run(store, *args, "--apply")
    assert code == 0, doc
    assert doc["waited"] == STALE_AFTER
    removed = {(i["kind"], i["url"]) for i in doc["items"] if i["status"] == "removed"}
    expected = {("records" if kind_of(n) == "orphan" else "entry", store.canonical(n))
                for n in gone_entries}
    if store.kind == "file":
        (old_temp,) = [k for k in before if k.startswith(".stray-old.bin.durable-tmp-")]
        expected.add(("temp", store.canonical(old_temp)))
    assert removed == expected
    assert len(doc["items"]) == len(expected)
    kept = {k["url"]: k["reason"] for k in doc["kept"]}
    for name in names("live", sizes):
        assert kept[store.canonical(name)].startswith("live lease held by worker-7:4242")
    for name in names("killed", sizes):
        assert "younger than --older-than" in kept[store.canonical(name)]
    # Exactly the abandoned entries' data and records are gone; every other object,
    # COMPLETE entries first of all, is byte for byte as it was.
    after = store.snapshot()
    doomed = {k for k in before if any(
        k.startswith((f"{n}/", f".durable/{n}/")) for n in gone_entries)}
    doomed |= {url.rpartition(f"{store.url()}/")[2] for kind, url in expected
               if kind == "temp"}
    live_leases = {f".durable/{n}/lease.json" for n in names("live", sizes)}
    # On a disk a stale lease is removed under its lock (a renewal falling in between put
    # it back), whose sidecar (``.durable/NAME.durable-lock``) goes with it: nothing more.
    assert after.keys() == before.keys() - doomed
    assert {k: v for k, v in after.items() if k not in live_leases} == {
        k: v for k, v in before.items() if k not in doomed | live_leases}


# local disk -------------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("_no_ambient_options")


def test_scan_reports_every_state(local: LocalStore) -> None:
    check_scan(local)


def test_verify_deep_finds_exactly_the_corrupted(local: LocalStore) -> None:
    check_verify(local)


def test_mark_complete_adopts_exactly_the_unmarked(local: LocalStore) -> None:
    check_mark_complete(local)


def test_clean_removes_exactly_the_abandoned(local: LocalStore) -> None:
    check_clean(local)


# the rules, one at a time, on a small root -------------------------------------------------
SMALL_KILLED = ["dead.zarr", "young.zarr", "live.zarr", "stale.zarr", "outer.zarr/inner",
                "holder"]


@pytest.fixture(scope="session")
def small_template(tmp_path_factory: pytest.TempPathFactory) -> str:
    """done.zarr COMPLETE, legacy unmarked; killed writers: dead.zarr (3 days ago),
    young.zarr (now), live.zarr and stale.zarr (3 days ago, with a lease), outer.zarr/inner
    (3 days ago, inside the COMPLETE entry outer.zarr), holder (3 days ago, holding the
    COMPLETE entry holder/sub.zarr)."""
    from durable import Entry

    root = str(tmp_path_factory.mktemp("ops-small") / "root")
    store = LocalStore(root)
    with Entry(store.url("done.zarr")).writing() as w:
        w.write_bytes("c/0", b"done")
    store.write("legacy/c/0", b"written before durable")
    kill_writers(root, {}, SMALL_KILLED, strays=False)
    back = time.time() - OLD
    for name in SMALL_KILLED:
        if name != "young.zarr":
            set_back(store, name, back)
    for name in ("live.zarr", "stale.zarr"):
        store.write(f".durable/{name}/lease.json", lease_body(0))
    Entry(store.url("outer.zarr")).mark_complete()  # adopts inner's leftovers as its data
    with Entry(store.url("holder", "sub.zarr")).writing() as w:
        w.write_bytes("c/0", b"sub")
    return root


@pytest.fixture
def small(small_template: str, tmp_path: Path) -> LocalStore:
    root = os.path.realpath(tmp_path / "root")
    shutil.copytree(small_template, root, copy_function=os.link)
    return LocalStore(root)


def survey_of(store: Store) -> Any:
    from durable._scan import survey
    from durable.adapters import resolve

    adapter, path = resolve(store.url(), store.options)
    return survey(adapter, path)


class Heartbeat:
    """An injected wait: renews the live lease "during" it, no time passes."""

    def __init__(self, store: Store, renew: tuple[str, ...] = ("live.zarr",)) -> None:
        self.store, self.renew, self.waits = store, renew, []

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        for name in self.renew:
            self.store.write(f".durable/{name}/lease.json", lease_body(len(self.waits)))


def test_plan_clean_keeps_what_it_must(small: LocalStore) -> None:
    from durable._ops import plan_clean

    wait = Heartbeat(small)
    report = plan_clean(survey_of(small), older_than=3600, lease_wait=10, sleep=wait)
    assert wait.waits == [STALE_AFTER]  # the largest stale_after, once, whatever the leases
    assert report.waited == STALE_AFTER
    assert {(i.kind, i.url.rpartition("/")[2]) for i in report.items} == {
        ("entry", "dead.zarr"), ("entry", "stale.zarr")}
    kept = {k.url.removeprefix(f"file://{small.root}/"): k.reason for k in report.kept}
    assert kept.keys() == {"young.zarr", "live.zarr", "outer.zarr/inner", "holder"}
    assert "younger than --older-than" in kept["young.zarr"]
    assert kept["live.zarr"].startswith("live lease held by worker-7:4242")
    assert kept["outer.zarr/inner"].startswith("inside the committed entry ")
    assert kept["holder"] == "it holds other entries"


@pytest.mark.parametrize("case", ["wait too short", "released", "unreadable"])
def test_a_lease_that_cannot_be_judged_is_taken_for_alive(small: LocalStore,
                                                          case: str) -> None:
    from durable._ops import plan_clean

    beat = Heartbeat(small)

    def release(seconds: float) -> None:
        beat(seconds)
        os.remove(os.path.join(small.root, ".durable/stale.zarr/lease.json"))

    if case == "unreadable":
        small.write(".durable/stale.zarr/lease.json", b"{half a lea")
    report = plan_clean(survey_of(small), older_than=3600,
                        lease_wait=0.2 if case == "wait too short" else 10,
                        sleep=release if case == "released" else beat)
    assert {i.url.rpartition("/")[2] for i in report.items} == {"dead.zarr"}
    why = {k.url.rpartition("/")[2]: k.reason for k in report.kept}["stale.zarr"]
    assert {"wait too short": "pass --lease-wait 1 to decide",
            "released": "released during the check",
            "unreadable": "cannot be read"}[case] in why


@pytest.mark.parametrize("stated", ["1" + "0" * 400, "1e12", "Infinity"])
def test_a_lease_stating_a_hostile_stale_after_neither_crashes_nor_stalls_clean(
        small: LocalStore, stated: str) -> None:
    """A lease body stating an integer too large for a float crashed the plan
    (OverflowError); 1e12 or Infinity asked for --lease-wait of that much. Taken as the
    longest stale_after a lease may have (an hour): kept, with the wait that decides."""
    from durable._ops import plan_clean

    body = json.loads(lease_body(0))
    body["stale_after"] = "STATED"
    small.write(".durable/stale.zarr/lease.json",
                json.dumps(body).replace('"STATED"', stated).encode())
    report = plan_clean(survey_of(small), older_than=3600, lease_wait=10,
                        sleep=Heartbeat(small))
    assert {i.url.rpartition("/")[2] for i in report.items} == {"dead.zarr"}
    why = {k.url.rpartition("/")[2]: k.reason for k in report.kept}["stale.zarr"]
    assert "pass --lease-wait 3600 to decide" in why, why


@pytest.mark.parametrize("race", ["committed", "resumed", "marker a symlink",
                                  "marker a directory"])
def test_apply_clean_checks_again_before_removing(small: LocalStore, race: str) -> None:
    """Between plan and removal a writer commits the entry, or starts on it again; or the
    marker's path gets something that is no file (a symlink to a marker elsewhere, a
    directory): not a marker to trust, but nothing to remove the entry on either."""
    from durable import Entry, MarkerError, State
    from durable._ops import apply_clean, plan_clean

    sv = survey_of(small)
    report = plan_clean(sv, older_than=3600, lease_wait=10, sleep=Heartbeat(small))
    assert "dead.zarr" in {i.url.rpartition("/")[2] for i in report.items}
    dead = Entry(small.url("dead.zarr"))
    marker = os.path.join(small.root, ".durable", "dead.zarr", "commit.json")
    if race == "committed":
        dead.mark_complete(force=True)  # what a writer's commit leaves: data and marker
    elif race == "resumed":
        small.write(".durable/dead.zarr/attempts/0123456789abcdef.json", b"{}")
    elif race == "marker a symlink":
        small.write("elsewhere.json", b"{}")
        os.symlink(os.path.join(small.root, "elsewhere.json"), marker)
    else:
        os.mkdir(marker)
    before = small.snapshot()
    apply_clean(sv, report)
    status = {i.url.rpartition("/")[2]: (i.status, i.detail) for i in report.items}
    assert status["dead.zarr"] == ("skipped", "committed since the plan (something is at its "
                                   "marker's path now)" if race != "resumed" else
                                   "its records changed since the plan (a writer at work?)")
    if race.startswith("marker a"):
        # And the entry's own state names what is there instead of calling it unmarked.
        with pytest.raises(MarkerError, match=f"commit.json is {race[len('marker '):]}, "
                                              "not a file"):
            dead.status()
    assert status["stale.zarr"] == ("removed", "")
    after = small.snapshot()
    mine = [k for k in before if k.startswith(("dead.zarr/", ".durable/dead.zarr/"))]
    assert mine and all(after[k] == before[k] for k in mine)
    if race == "committed":
        assert dead.state() is State.COMPLETE


@pytest.mark.parametrize("race", [None, "marker removed"])
def test_clean_removes_attempt_records_left_beside_a_marker(small: LocalStore,
                                                          race: str | None) -> None:
    """A writer killed after its marker, before the removal of its attempt record (a
    background thread on object stores), or a loser killed before removing its own:
    protocol.md says clean removes such records. Only those records, never while their
    marker is gone (a rewrite at work), and the entry stays COMPLETE."""
    from durable import Entry, State
    from durable._ops import apply_clean, plan_clean

    done = Entry(small.url("done.zarr"))
    marker = done.read_marker()
    assert marker is not None
    loser = "0123456789abcdef0123456789abcdef"
    spent = [f".durable/done.zarr/attempts/{marker.attempt}.json",
             f".durable/done.zarr/attempts/{loser}.json",
             f".durable/done.zarr/fragments/{loser}/f-0.json"]
    for rel in spent:
        small.write(rel, b"{}")
    small.set_mtime(".durable/done.zarr", time.time() - 3 * 86400)
    data = {k: v for k, v in small.snapshot().items() if k.startswith("done.zarr/")}
    sv = survey_of(small)
    young = plan_clean(sv, older_than=4 * 86400, lease_wait=10, sleep=Heartbeat(small))
    assert not [i for i in young.items if i.kind == "spent"]
    assert any("done.zarr (records beside its marker)" in k.url and "younger" in k.reason
               for k in young.kept)
    report = plan_clean(sv, older_than=3600, lease_wait=10, sleep=Heartbeat(small))
    (item,) = [i for i in report.items if i.kind == "spent"]
    assert (item.url, item.objects) == (done.url, 3)
    if race:
        os.remove(os.path.join(small.root, ".durable", "done.zarr", "commit.json"))
    apply_clean(sv, report)
    after = small.snapshot()
    if race:
        assert (item.status, item.detail) == ("skipped", "its marker is gone since the plan")
        assert all(rel in after for rel in spent)
        return
    assert item.status == "removed"
    assert not any(rel in after for rel in spent)
    assert ".durable/done.zarr/commit.json" in after
    assert {k: v for k, v in after.items() if k.startswith("done.zarr/")} == data
    assert done.state() is State.COMPLETE and done.verify(deep=True).ok


GONE = "already removed since the plan (by another clean of this root, or a delete)"


def apply_as_another_cleans(first: Any, second: Any, plans: list[Any],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Apply ``plans[0]`` to the survey ``first``; as it comes to remove the records of its
    first item (past every check), the other clean (``plans[1]`` on ``second``) runs whole."""
    from durable._ops import apply_clean

    exclusive = first.adapter.exclusive
    ran: list[bool] = []

    @contextlib.contextmanager
    def second_clean_first(path: str) -> Iterator[bool]:
        if not ran:  # (the adapter may be the second clean's too: it runs once)
            ran.append(True)
            apply_clean(second, plans[1], workers=1)
        with exclusive(path) as locked:
            yield locked

    monkeypatch.setattr(first.adapter, "exclusive", second_clean_first)
    apply_clean(first, plans[0], workers=1)
    assert ran


def test_two_cleans_at_once_report_each_removal_once(small: LocalStore,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two `durable clean --apply` runs of one root, planned together, the second running
    whole while the first is between its checks and the removal of the records: both
    reported "removed" for the same entry (and the same spent records). Only one removed
    it; the other says it was already gone, or (an entry the first holds the lease of
    while it removes it) that another clean is removing it."""
    from durable import Entry, State
    from durable._ops import plan_clean

    done = Entry(small.url("done.zarr"))
    small.write(".durable/done.zarr/attempts/0123456789abcdef0123456789abcdef.json", b"{}")
    small.set_mtime(".durable/done.zarr", time.time() - OLD)
    first, second = survey_of(small), survey_of(small)
    plans = [plan_clean(sv, older_than=3600, lease_wait=10, sleep=Heartbeat(small))
             for sv in (first, second)]
    planned = {(i.kind, i.url.rpartition("/")[2]) for i in plans[0].items}
    assert planned == {(i.kind, i.url.rpartition("/")[2]) for i in plans[1].items} == {
        ("entry", "dead.zarr"), ("entry", "stale.zarr"), ("spent", "done.zarr")}
    apply_as_another_cleans(first, second, plans, monkeypatch)
    for a, b in zip(plans[0].items, plans[1].items, strict=True):
        statuses = sorted([(a.status, a.detail), (b.status, b.detail)])
        assert statuses[0] == ("removed", "") and statuses[1][0] == "skipped", statuses
        assert statuses[1][1] == GONE or statuses[1][1].startswith(
            "another clean is removing it (held by "), (a.url, statuses)
    after = small.snapshot()
    assert not [k for k in after if k.startswith((".durable/dead.zarr", "dead.zarr/",
                                                  ".durable/done.zarr/attempts/"))]
    assert done.state() is State.COMPLETE


def test_a_clean_finding_a_folder_removed_under_it_is_no_failure(
        small: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three cleans of one root at once (1,500 dead entries) listed a few entries each as
    failed, exit 6, "FileNotFoundError: ... No such file or directory: ROOT/eNNN": one
    unlinked the entry's zarr.json, another removed the whole folder, and the first's
    fsync of the folder (to make its unlink durable) found it gone. Each clean now holds
    the entry's lease while it removes it: the other leaves that entry alone, and says
    so."""
    import durable.adapters.local as local
    from durable._ops import apply_clean, plan_clean

    first, second = survey_of(small), survey_of(small)
    plans = [plan_clean(sv, older_than=3600, lease_wait=10, sleep=Heartbeat(small))
             for sv in (first, second)]
    dead = os.path.join(small.root, "dead.zarr")
    fsync_dir = local.fsync_dir
    ran: list[bool] = []

    def second_clean_first(path: str) -> None:
        # The first clean has just unlinked dead.zarr/zarr.json: the other runs whole now.
        if path == dead and not ran:
            ran.append(True)
            apply_clean(second, plans[1], workers=1)
        fsync_dir(path)

    monkeypatch.setattr(local, "fsync_dir", second_clean_first)
    apply_clean(first, plans[0], workers=1)
    assert ran
    status = {i.url.rpartition("/")[2]: (i.status, i.detail) for i in plans[0].items}
    assert status["dead.zarr"] == ("removed", "")
    other = {i.url.rpartition("/")[2]: (i.status, i.detail) for i in plans[1].items}
    assert other["dead.zarr"][0] == "skipped"
    assert other["dead.zarr"][1].startswith("another clean is removing it (held by ")
    assert not os.path.exists(dead)


def check_attempt_record_made_a_directory(store: Any, with_data: bool) -> None:
    """Objects below an attempt record's name (``attempts/<id>.json/x``, a directory on a
    disk): `durable status` said "data present but no commit marker" (or, with no data,
    "a writer started") where clean planned "records but no marker" and mark-complete sent
    the user to `durable status` for records it never named. Every command names it now,
    in the same words; clean removes it as records of no live writer."""
    from durable import Entry, State

    attempt = ".durable/e/attempts/0123456789abcdef0123456789abcdef.json"
    if with_data:
        store.write("e/c/0", b"data")
    store.write(f"{attempt}/x", b"{}")
    said = (f"{store.canonical(attempt)} is a directory (holding "
            f"{store.canonical(attempt + '/x')}), not an attempt record file: no durable "
            "writer made it (a hostile or corrupt layout)")
    st = Entry(store.url("e"), storage_options=store.options).status()
    assert st.state is State.INCOMPLETE and st.reason == (
        "data present but no commit marker" if with_data else
        "records but no commit marker and no data") + f"; {said}", st.reason
    _, doc = run(store, "scan", store.url())
    (row,) = [r for r in doc["entries"] if r["url"] == store.canonical("e")]
    assert (row["state"], row["reason"]) == ("INCOMPLETE", st.reason)
    _, doc = run(store, "mark-complete", store.url())
    if with_data:
        (skipped,) = [s for s in doc["skipped"] if s["url"] == store.canonical("e")]
        assert skipped["reason"].endswith(f": {said}"), skipped
    code, doc = run(store, "clean", store.url(), "--older-than", "0s", "--apply")
    (item,) = doc["items"]
    assert (code, item["url"], item["status"]) == (0, store.canonical("e"), "removed")
    assert item["reason"].endswith(f"; {said}"), item
    assert Entry(store.url("e"), storage_options=store.options).state() is State.ABSENT


@pytest.mark.parametrize("with_data", [True, False], ids=["data", "no-data"])
def test_an_attempt_record_made_a_directory_is_named_alike_everywhere(
        tmp_path: Path, with_data: bool) -> None:
    check_attempt_record_made_a_directory(LocalStore(os.path.realpath(tmp_path)), with_data)


def test_spent_records_inside_a_committed_entry_are_its_data(tmp_path: Path) -> None:
    """An entry committed inside another (``outer/inner``) with an attempt record left
    beside its marker, then ``outer`` committed around it: that record is outer's data,
    in outer's manifest. clean removed it as spent, and outer, COMPLETE, failed its
    verification (missing). It is kept, naming the entry it belongs to."""
    from durable import Entry, State

    root = os.path.realpath(tmp_path)
    store = LocalStore(root)
    with Entry(store.url("outer", "inner")).writing() as w:
        w.write_bytes("c/0", b"inner data")
    store.write(f"outer/.durable/inner/attempts/{'a' * 32}.json", b"{}")
    outer = Entry(store.url("outer"))
    outer.mark_complete()
    store.set_mtime("", time.time() - OLD)
    before = store.snapshot()
    code, doc = run(store, "clean", root, "--older-than", "1h", "--apply")
    assert (code, doc["items"]) == (0, []), doc
    (kept,) = doc["kept"]
    assert kept == {"url": f"file://{root}/outer/inner (records beside its marker)",
                    "reason": f"inside the committed entry file://{root}/outer, whose "
                              "data they are"}
    assert store.snapshot() == before
    assert outer.state() is State.COMPLETE and outer.verify(deep=True).ok


def test_mark_complete_checks_again_before_adopting(small: LocalStore) -> None:
    """A writer that takes a lease on unmarked data after the survey keeps it from adoption
    (Entry.mark_complete itself refuses a started writer, not a lease)."""
    from durable import Entry, State
    from durable._ops import mark_complete_root

    sv = survey_of(small)
    small.write(".durable/legacy/lease.json", lease_body(0))
    report = mark_complete_root(sv, apply=True)
    (legacy,) = report.adoptions
    assert legacy.status == "skipped" and "appeared since the survey" in legacy.reason
    assert Entry(small.url("legacy")).state() is State.INCOMPLETE
    report = mark_complete_root(survey_of(small), apply=True)
    assert report.adoptions == []
    assert {s.url.rpartition("/")[2]: s.reason.split(" (")[0] for s in report.skipped} == {
        "legacy": "a writer holds",
        "dead.zarr": "a durable writer started here and has not committed",
        "young.zarr": "a durable writer started here and has not committed",
        "live.zarr": "a durable writer started here and has not committed",
        "stale.zarr": "a durable writer started here and has not committed",
        "holder": "a durable writer started here and has not committed",
        "inner": "inside the committed entry file://" + small.url("outer.zarr") + ": "
                 "adopting it would change that entry's data"}


def test_clean_judges_leases_written_by_durable_lease(tmp_path: Path) -> None:
    """The lease protocol as `durable.Lease` speaks it: one held by a writer at work (its
    heartbeat renewing it) keeps its entry; one whose writer was killed does not."""
    import socket

    from durable import Entry, Lease, State

    store = LocalStore(os.path.realpath(tmp_path))
    kill_writers(store.url(), {}, ["killed.zarr"], strays=False, mode="kill-leased")
    alive = Entry(store.url("alive.zarr"))
    # Ten renewals per window: a loaded machine must not make a live writer look dead.
    with Lease(alive, heartbeat=0.1, stale_after=1.0) as lease, \
            alive.writing(lease=lease) as w:
        w.write_bytes("c/0", b"at work")
        code, scanned = run(store, "scan", store.url())
        code, doc = run(store, "clean", store.url(), "--older-than", "0s", "--apply")
    holders = {e["url"].rpartition("/")[2]: e["lease"] for e in scanned["entries"]}
    assert holders["alive.zarr"]["host"] == socket.gethostname()
    assert holders["alive.zarr"]["pid"] == os.getpid()
    assert holders["killed.zarr"]["pid"] not in (None, os.getpid())
    assert code == 0 and doc["waited"] == 1.0  # the largest stale_after seen
    assert [(i["url"].rpartition("/")[2], i["status"]) for i in doc["items"]] == [
        ("killed.zarr", "removed")]
    (kept,) = doc["kept"]
    assert kept["reason"].startswith(f"live lease held by {socket.gethostname()}:"
                                     f"{os.getpid()}")
    assert alive.state() is State.COMPLETE
    assert Entry(store.url("killed.zarr")).state() is State.ABSENT


def test_clean_names_the_holder_of_the_stale_lease_it_takes_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """clean's warning on stderr said "took over a stale lease (holder unreadable,
    unchanged for 10.0 s)" of a lease whose holder its own plan named, watched for its
    stale_after: the holder and the time watched are said."""
    import logging
    import socket

    store = LocalStore(os.path.realpath(tmp_path))
    dead_leased_writer(store.url("ent.zarr"), stale_after=0.3)
    with caplog.at_level(logging.WARNING, logger="durable._lease"):
        code, doc = run(store, "clean", store.url(), "--older-than", "0s", "--apply")
    assert code == 0 and [i["status"] for i in doc["items"]] == ["removed"], doc
    (took,) = [r.getMessage() for r in caplog.records
               if "took over a stale lease" in r.getMessage()]
    assert f"held by {socket.gethostname()} pid {os.getpid()}" in took, took
    assert f"unchanged for {doc['waited']:.1f} s" in took, took


def test_verify_root_reports_what_entry_verify_reports(tmp_path: Path) -> None:
    """verify ROOT works from the survey's listing; each entry's report is Entry.verify's."""
    from durable import Entry, atomic_write
    from durable._ops import verify_root

    store = LocalStore(os.path.realpath(tmp_path))
    objects = {"zarr.json": ZARR_JSON, "c/0": b"a" * 100, "c/1": b"b" * 50}
    for name in ("ok", "missing", "short", "flipped", "extra"):
        with Entry(store.url(name)).writing() as w:
            for key, data in objects.items():
                w.write_bytes(key, data)
    with atomic_write(store.url("single.bin")) as f:
        f.write(b"one object")
    os.remove(store.url("missing/c/1"))
    os.truncate(store.url("short/c/0"), 3)
    store.write("flipped/c/1", b"b" * 49 + b"c")
    store.write("extra/c/2", b"not in the manifest")
    store.write("single.bin", b"one ebject")
    report = verify_root(survey_of(store), deep=True)
    for r in report.reports:
        alone = Entry(r.url).verify(deep=True, raise_errors=False)
        assert (r.objects, r.bytes_checked, r.problems) == (
            alone.objects, alone.bytes_checked, alone.problems), r.url
    assert {r.url.rpartition("/")[2]: [p.issue for p in r.problems] for r in report.reports
            } == {"ok": [], "missing": ["missing"], "short": ["size"],
                  "flipped": ["crc32c"], "extra": ["unexpected"], "single.bin": ["crc32c"]}


# S3 ---------------------------------------------------------------------------------------
@pytest.mark.s3
def test_scan_and_clean_requests_grow_with_entries_not_objects(s3_bucket: Any) -> None:
    """Through the fault proxy's request log: listings, and one small GET per record."""
    from durable import Entry
    from durable.cli import ENV_OPTIONS
    from durable.testing.faults import FaultProxy

    store = S3Store(s3_bucket)
    for i, n in enumerate((1, 40, 1, 40)):
        with Entry(store.url(f"e{i}.zarr"), storage_options=store.options).writing() as w:
            for k in range(n):
                w.fs.pipe_file(f"{w.path}/c/{k}", b"x")
    kill_writers(store.url(), store.options, ["dead.zarr"], strays=False)
    set_back(store, "dead.zarr", time.time() - OLD)
    store.write(".durable/dead.zarr/lease.json", lease_body(0))
    assert len(store.keys("")) == 82 + 4 + 2 + 2  # objects, markers, dead's data and records

    from click.testing import CliRunner

    from durable.cli import cli

    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = json.dumps({**store.options, "endpoint_url": proxy.url,
                              "skip_instance_cache": True})

        def requests(*args: str) -> list[tuple[str, str, str]]:
            proxy.clear_requests()
            result = CliRunner().invoke(cli, [*args, "--json"], env={ENV_OPTIONS: options})
            assert result.exit_code == 0, result.output
            return sorted((r.method, r.key, "list" if "list-type" in r.query else
                           "uploads" if "uploads" in r.query else "") for r in proxy.requests)

        listing = ("GET", "", "list")
        markers = [("GET", f"root/.durable/e{i}.zarr/commit.json", "") for i in range(4)]
        (attempt,) = store.keys(".durable/dead.zarr/attempts/")
        dead = [("GET", f"root/{attempt}", ""),
                ("GET", "root/.durable/dead.zarr/lease.json", "")]
        # scan: the root and the root's own records dir, then one GET per record.
        assert requests("scan", store.url()) == sorted([listing, listing, *markers, *dead])
        # clean: no marker read; the leases watched by listing once more; the uploads.
        uploads = ("GET", "", "uploads")
        assert requests("clean", store.url(), "--older-than", "1h", "--lease-wait", "0.01",
                        "--clock", "local"
                        ) == sorted([listing, listing, listing, *dead, uploads])
        # --lease-wait 0: no lease is watched, so none is listed again (all kept).
        assert requests("clean", store.url(), "--older-than", "1h", "--lease-wait", "0",
                        "--clock", "local") == sorted([listing, listing, *dead, uploads])
        # By the store's clock: one listing more, for the Date of the store's answer.
        assert requests("clean", store.url(), "--older-than", "1h", "--lease-wait", "0"
                        ) == sorted([listing, listing, listing, *dead, uploads])


@pytest.mark.s3
def test_clean_keeps_the_lease_of_a_writer_that_took_over_while_it_removed_the_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiter takes a dead writer's stale lease over, and starts writing, while clean
    removes that entry's data: clean removed the whole records directory after the data,
    the new holder's lease and attempt record with it (reported "removed"), and the
    holder, unaware, failed at its commit with LeaseLostError. The clean now takes the
    stale lease over itself and holds it (renewed) while it removes the data: the waiter
    finds it live, and takes it once the clean is done."""
    import durable._ops
    from durable import Entry, IncompleteExistsError, Lease, State
    from durable._lease import LeaseWatch
    from durable._ops import apply_clean, plan_clean
    from durable._scan import survey
    from durable.adapters import resolve

    root = os.path.realpath(tmp_path)
    url = f"{root}/ent.zarr"
    dead_leased_writer(url, stale_after=0.5)
    adapter, path = resolve(root)
    sv = survey(adapter, path)
    report = plan_clean(sv, older_than=0, lease_wait=2.0)
    assert [(i.kind, i.url) for i in report.items] == [("entry", Entry(url).url)]
    original = durable._ops.delete_tree
    taker: list[Any] = []

    def a_takeover_meanwhile(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        if not taker:
            # The clean holds the lease while it removes the data, renewed: the waiter
            # cannot take it over, nor start over the entry without it.
            view = LeaseWatch(url, stale_after=0.5).poll()
            assert view is not None and not view.stale
            assert not Lease(url, heartbeat=0.05, stale_after=0.5).try_acquire()
            with pytest.raises(IncompleteExistsError, match="durable clean removing"):
                Entry(url).writing(overwrite=True).__enter__()
            taker.append(view)

    monkeypatch.setattr(durable._ops, "delete_tree", a_takeover_meanwhile)
    apply_clean(sv, report)
    (item,) = report.items
    assert (item.status, item.detail) == ("removed", "")
    assert taker
    # Once the clean is done, the waiter takes the (free) lease and writes.
    lease = Lease(url, heartbeat=0.05, stale_after=0.5).acquire()
    with Entry(url).writing(lease=lease) as w:
        w.write_bytes("c/0", b"taker's")
    lease.release()
    entry = Entry(url)
    assert entry.state() is State.COMPLETE and entry.verify(deep=True).ok
    assert Path(url, "c/0").read_bytes() == b"taker's"


def test_clean_aborts_uploads_abandoned_by_durable_writers(s3_bucket: Any) -> None:
    from durable import atomic_write

    store = S3Store(s3_bucket)
    with atomic_write(store.url("done.bin"), storage_options=store.options) as f:
        f.write(b"committed")
    kill_writers(store.url("big.bin"), store.options, [], strays=False, mode="upload")
    other = store.client.create_multipart_upload(Bucket=store.bucket, Key="root/other.bin")
    before = store.snapshot()

    def uploads() -> set[str]:
        listed = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix="root/")
        return {u["Key"] for u in listed.get("Uploads", [])}

    assert uploads() == {"root/big.bin", "root/other.bin"}
    # Initiated is the store's clock (moto's is fixed): "0s" makes every upload old enough.
    code, doc = run(store, "clean", store.url(), "--older-than", "0s")
    assert code == 0
    assert [(i["kind"], i["status"], i["url"].partition(" ")[0]) for i in doc["items"]] == [
        ("upload", "planned", store.url("big.bin"))]
    (kept,) = doc["kept"]
    assert kept["url"].startswith(store.url("other.bin")) and "--all-uploads" in kept["reason"]
    code, doc = run(store, "clean", store.url(), "--older-than", "0s", "--apply")
    assert code == 0 and [i["status"] for i in doc["items"]] == ["removed"]
    assert uploads() == {"root/other.bin"}
    code, doc = run(store, "clean", store.url(), "--older-than", "0s", "--apply",
                    "--all-uploads")
    assert [(i["status"], other["UploadId"] in i["url"]) for i in doc["items"]] == [
        ("removed", True)]
    assert uploads() == set()
    assert store.snapshot() == before  # objects, committed or not, untouched


@pytest.mark.s3
def test_clean_lists_what_it_could_not_remove_and_exits_6(s3_bucket: Any) -> None:
    from durable.cli import EXIT_PARTIAL
    from durable.testing.faults import FaultProxy

    store = S3Store(s3_bucket)
    kill_writers(store.url(), store.options, ["a.zarr", "b.zarr"], strays=False)
    for name in ("a.zarr", "b.zarr"):
        set_back(store, name, time.time() - OLD)
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        # DeleteObjects names its keys in the body: with one worker, a.zarr's comes first.
        proxy.inject("error", status=403, code="AccessDenied", method="POST",
                     query="delete", times=1)
        via = S3Store(s3_bucket)
        via.options = {**store.options, "endpoint_url": proxy.url, "skip_instance_cache": True}
        code, doc = run(via, "clean", store.url(), "--older-than", "1h", "--apply",
                        "--workers", "1", "--clock", "local")
    assert code == EXIT_PARTIAL
    status = {i["url"].rpartition("/")[2]: (i["status"], i["detail"]) for i in doc["items"]}
    assert status["b.zarr"] == ("removed", "")
    assert status["a.zarr"][0] == "failed" and "AccessDenied" in status["a.zarr"][1]
    assert status["a.zarr"][1].startswith("PermissionError: ")


@pytest.mark.s3
@pytest.mark.slow
def test_operating_a_root_on_s3(s3_bucket: Any, tmp_path: Path) -> None:
    """The operator's day on moto: scan, verify, adopt, clean, on every kind of entry."""
    store = S3Store(s3_bucket)
    static_root = str(tmp_path / "root")
    build_static(static_root, store.sizes)
    store.upload_tree(static_root)
    add_killed_writers(store)
    check_scan(store)
    check_verify(store, shallow=False)
    check_mark_complete(store, dry_run=False)
    check_clean(store, dry_run=False)


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        _child(sys.argv[2], json.loads(sys.argv[3]), sys.argv[4].split(","),
               sys.argv[5] == "1")
    elif sys.argv[1] == "kill-leased":
        _child_leased(sys.argv[2], json.loads(sys.argv[3]), sys.argv[4].split(","))
    elif sys.argv[1] == "upload":
        _child_upload(sys.argv[2], json.loads(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")


def test_a_lock_sidecar_is_never_data_and_goes_with_its_entry(tmp_path: Path) -> None:
    """Local conditional writes (leases) lock a `.durable/NAME.durable-lock` sidecar. Beside
    a committed entry it is durable's, not data: a scan must not report it, nor
    mark-complete adopt it. It goes with the entry: `clear()` left it for good."""
    import durable
    from durable._scan import scan

    root = str(tmp_path / "cache")

    @durable.cached(root)
    def f(x: int) -> int:
        return x + 1

    assert f(1) == 2
    assert list((tmp_path / "cache").rglob("*.durable-lock")), "the commit's lock sidecar"
    assert [r.state for r in scan(root)] == ["COMPLETE"]
    f.clear(1)
    assert list((tmp_path / "cache").rglob("*.durable-lock")) == []
    assert scan(root) == []


def test_clean_leaves_nothing_of_an_abandoned_entry_in_the_records_folder(
        tmp_path: Path) -> None:
    """A clean of a dead writer's entry removed its data and records, and left the lock
    sidecar its lease's removal took (``.durable/NAME.durable-lock``), for good: the
    records folder never emptied, and `durable status` of the folder (data written before
    durable) then hinted at entries inside it ("a root?") that were no more."""
    from durable import Entry, Lease, State

    folder = tmp_path / "folder"
    store = LocalStore(os.path.realpath(folder))
    store.write("data.bin", b"written before durable")
    url = store.url("ent.zarr")
    dead = Lease(url, heartbeat=0.05, stale_after=0.3).acquire()
    killed = Entry(url).writing(lease=dead)  # kept, never ended: nothing cleaned up
    killed.__enter__().write_bytes("c/0", b"dead writer's")
    dead.renew()
    dead._stop.set()  # killed: no more renewals
    assert dead._thread is not None
    dead._thread.join()
    assert (folder / ".durable" / "ent.zarr.durable-lock").exists()

    code, doc = run(store, "clean", store.url(), "--older-than", "0s", "--apply")
    assert code == 0 and [(i["url"], i["status"]) for i in doc["items"]] == [
        (store.canonical("ent.zarr"), "removed")]
    assert Entry(url).state() is State.ABSENT
    assert sorted(os.listdir(folder)) == [".durable", "data.bin"]
    assert os.listdir(folder / ".durable") == []
    code, doc = run(store, "status", store.url())
    assert doc["state"] == "INCOMPLETE"
    assert doc["reason"] == "data present but no commit marker"  # no "a root?"


def test_a_lock_sidecar_left_by_an_earlier_durable_is_nothing_odd(tmp_path: Path) -> None:
    """An earlier durable never removed a lock sidecar: one outlives its entry in folders
    written before. `status` of an entry holding one (in a folder of its data) hinted at
    entries inside it ("a root?"), and `verify` took the entry for a root of entries."""
    store = LocalStore(os.path.realpath(tmp_path / "ent"))
    store.write("sub/a.bin", b"data")
    store.write(".durable/gone.durable-lock", b"")
    code, doc = run(store, "status", store.url())
    assert doc["state"] == "INCOMPLETE"
    assert doc["reason"] == "data present but no commit marker"
    code, doc = run(store, "verify", store.url())
    assert code == 3 and doc["state"] == "INCOMPLETE"
    assert doc.get("url") == f"file://{store.root}", doc  # one entry, not a root
    code, doc = run(store, "scan", store.url())
    assert [(e["url"], e["state"]) for e in doc["entries"]] == [
        (store.canonical("sub"), "INCOMPLETE")]


# A process killed inside LocalAdapter.delete_if, after it renamed the object aside and
# before it unlinked it: the crash is real (the process exits there), the leftover is what
# such a crash leaves.
_KILLED_IN_DELETE_IF = r"""
import os, sys
from durable.adapters import resolve
adapter, path = resolve(sys.argv[1], None)
unlink = os.unlink
def unlink_or_die(p, *args, **kwargs):
    if ".durable-tmp-del-" in os.fspath(p):
        os._exit(9)
    return unlink(p, *args, **kwargs)
os.unlink = unlink_or_die
adapter.delete_if(path, adapter.info(path).version)
"""


def _killed_in_delete_if(path: str) -> str:
    run = subprocess.run([sys.executable, "-c", _KILLED_IN_DELETE_IF, path], check=False)
    assert run.returncode == 9
    directory, name = os.path.split(path)
    (left,) = [n for n in os.listdir(directory) if n.startswith(f".{name}.durable-tmp-del-")]
    return os.path.join(directory, left)


def test_what_a_conditional_delete_killed_part_way_leaves_is_cleaned(tmp_path: Path) -> None:
    """`delete_if` on a disk renames the object aside, then unlinks it; killed between the
    two, the renamed lease or marker stayed for good. In a records directory it counted
    as records: an entry with nothing else was "a writer started" (INCOMPLETE, refusing
    every fresh writer), a plain object beside it an entry a writer left, which a clean
    then removed whole, and an entry starting over kept it as a lease. Now it is a temp
    file only: status and scan pass over it, a clean removes it (and nothing COMPLETE),
    and so does an entry starting over."""
    import durable
    from durable._ops import apply_clean, plan_clean
    from durable._scan import scan, survey
    from durable.adapters import resolve

    root = str(tmp_path / "root")
    done = durable.Entry(f"{root}/done")  # COMPLETE, its lease's release killed
    with durable.Lease(done.url, heartbeat=0.2, stale_after=1) as lease, \
            done.writing(lease=lease) as w:
        w.write_bytes("a", b"1")
    Path(done.layout.lease).write_text("{}")
    leftovers = [_killed_in_delete_if(done.layout.lease)]
    with durable.atomic_write(f"{root}/obj") as f:  # its marker's withdrawal killed
        f.write(b"plain data now")
    leftovers.append(_killed_in_delete_if(durable.Entry(f"{root}/obj").layout.marker))
    gone = durable.Entry(f"{root}/gone")  # an expired lease's removal killed
    os.makedirs(gone.layout.records)
    Path(gone.layout.lease).write_text("{}")
    leftovers.append(_killed_in_delete_if(gone.layout.lease))

    assert gone.state() is durable.State.ABSENT
    with gone.writing() as w:  # a fresh writer goes on
        w.write_bytes("b", b"2")
    again = durable.Entry(f"{root}/again")  # INCOMPLETE, started over
    os.makedirs(again.path)
    Path(again.path, "x").write_bytes(b"killed writer's")
    os.makedirs(again.layout.records)
    Path(again.layout.lease).write_text("{}")
    aside = _killed_in_delete_if(again.layout.lease)
    with again.writing(overwrite=True) as w:
        w.write_bytes("x", b"new")
    assert not os.path.exists(aside)

    rows = {r.url: r.state for r in scan(root)}
    assert rows == {done.url: "COMPLETE", gone.url: "COMPLETE", again.url: "COMPLETE",
                    durable.Entry(f"{root}/obj").url: "INCOMPLETE"}
    time.sleep(0.05)
    sv = survey(*resolve(root, None))
    report = apply_clean(sv, plan_clean(sv, older_than=0, lease_wait=0))
    removed = sorted(i.url for i in report.items if i.status == "removed")
    assert removed == sorted(f"file://{p}" for p in leftovers)
    assert all("conditional delete killed part-way" in i.reason for i in report.items)
    assert not any(os.path.exists(p) for p in leftovers)
    assert Path(root, "obj").read_bytes() == b"plain data now"
    for e in (done, gone, again):
        assert e.state() is durable.State.COMPLETE and e.verify(deep=True).ok


def test_clean_removes_a_killed_writer_that_left_only_an_empty_folder(tmp_path: Path) -> None:
    """A zarr writer SIGKILLed after its start (found by the kill sweep: 2 kills in 35 of
    `durable.zarr.write` on a local disk) left its attempt record and the entry's folder,
    empty: clean planned the records ("data is gone") and then skipped them for good,
    "data appeared since the plan", the empty folder taken for data. The entry stayed
    INCOMPLETE through every clean. An empty folder is no data: the records go, and the
    folder with them."""
    from durable import Entry, State
    from durable._ops import apply_clean, plan_clean
    from durable._protocol import attempt_record_bytes
    from durable._scan import survey
    from durable.adapters import resolve

    root = os.path.realpath(tmp_path)
    attempt = "0123456789abcdef0123456789abcdef"
    record = Path(root, ".durable", "z.zarr", "attempts", f"{attempt}.json")
    record.parent.mkdir(parents=True)
    record.write_bytes(attempt_record_bytes(attempt))
    Path(root, "z.zarr", "c", "0").mkdir(parents=True)  # made before the first chunk
    entry = Entry(f"{root}/z.zarr")
    assert entry.state() is State.INCOMPLETE
    sv = survey(*resolve(root))
    report = apply_clean(sv, plan_clean(sv, older_than=0, lease_wait=0))
    assert [(i.kind, i.status, i.detail) for i in report.items] == [("records", "removed", "")]
    assert entry.state() is State.ABSENT
    assert os.listdir(root) == [".durable"] and os.listdir(f"{root}/.durable") == []


def test_clean_removes_a_stale_lease_left_beside_a_marker(tmp_path: Path) -> None:
    """A cached function's caller SIGKILLed after its commit, before it released the
    lease (kill sweep: 4 of 35 local @cached kills): the entry is COMPLETE, its lease
    file stays, and clean neither removed nor listed it; every later `Lease` and
    `recompute()` waited it out. Judged stale, it goes as spent records do, on the version
    judged; a live one stays."""
    from durable import Entry, Lease, State
    from durable._ops import apply_clean, plan_clean
    from durable._scan import survey
    from durable.adapters import resolve

    root = os.path.realpath(tmp_path)
    entries = {}
    for name in ("dead", "live"):
        lease = Lease(f"{root}/{name}", heartbeat=0.05, stale_after=0.5).acquire()
        with Entry(f"{root}/{name}").writing(lease=lease) as w:
            w.write_bytes("a", b"x")
        entries[name] = lease
    dead = entries["dead"]
    dead._stop.set()  # killed: no more renewals, no release
    assert dead._thread is not None
    dead._thread.join()
    sv = survey(*resolve(root))
    report = apply_clean(sv, plan_clean(sv, older_than=0, lease_wait=2.0))
    assert [(i.kind, i.url.rpartition("/")[2], i.status) for i in report.items] == [
        ("spent", "dead", "removed")]
    assert "a stale lease left beside its marker" in report.items[0].reason
    assert not Path(root, ".durable", "dead", "lease.json").exists()
    assert Path(root, ".durable", "live", "lease.json").exists()
    assert entries["live"].held
    entries["live"].release()
    for name in entries:
        assert Entry(f"{root}/{name}").state() is State.COMPLETE


def test_clean_never_removes_data_a_killed_mark_complete_was_adopting(tmp_path: Path) -> None:
    """`durable mark-complete --apply` SIGKILLed between staging a folder's marker (its temp
    file, fsynced, in the records dir) and publishing it (kill sweep: 7 of 35 local
    mark-complete kills lost a folder or more). That temp file was taken for a writer's
    records: clean planned the folder, "records but no marker", and deleted the user's data,
    written before durable and never a durable writer's. A temp file in a records dir is a
    temp file only: clean removes it and leaves the data, which mark-complete then adopts."""
    from durable import Entry, State
    from durable._ops import apply_clean, plan_clean
    from durable._scan import scan, survey
    from durable.adapters import resolve
    from durable.adapters.local import TMP_MARK

    root = os.path.realpath(tmp_path)
    Path(root, "f", "sub").mkdir(parents=True)
    for i in range(3):
        Path(root, "f", "sub", f"{i}.bin").write_bytes(bytes([i]) * 100)
    staged = Path(root, ".durable", "f", f".commit.json{TMP_MARK}45cd82d32cd8")
    staged.parent.mkdir(parents=True)
    staged.write_bytes(b'{"format": "durable.commit"}')  # a marker never published
    (row,) = scan(root)
    assert (row.state, row.reason) == ("INCOMPLETE", "data present but no commit marker")
    sv = survey(*resolve(root))
    report = apply_clean(sv, plan_clean(sv, older_than=0, lease_wait=0))
    assert [(i.kind, i.status) for i in report.items] == [("temp", "removed")]
    assert not staged.exists()
    assert sorted(os.listdir(f"{root}/f/sub")) == ["0.bin", "1.bin", "2.bin"]
    entry = Entry(f"{root}/f")
    entry.mark_complete()
    assert entry.state() is State.COMPLETE and entry.verify(deep=True).ok


def test_clean_removes_a_writer_killed_with_its_marker_staged(tmp_path: Path) -> None:
    """A writer SIGKILLed in its commit, its marker's temp file written and fsynced in the
    records dir but not yet linked into place (kill sweep: 2 of 35 local `Entry.writing`
    and 4 of 35 local `durable.tensorstore.write` kills): clean planned the entry without
    that temp file, found it in the records at the removal, and skipped the entry for
    good ("its records changed since the plan"). It goes with the entry."""
    from durable import Entry, State
    from durable._ops import apply_clean, plan_clean
    from durable._protocol import attempt_record_bytes
    from durable._scan import survey
    from durable.adapters import resolve
    from durable.adapters.local import TMP_MARK

    root = os.path.realpath(tmp_path)
    attempt = "0123456789abcdef0123456789abcdef"
    records = Path(root, ".durable", "ent")
    (records / "attempts").mkdir(parents=True)
    (records / "attempts" / f"{attempt}.json").write_bytes(attempt_record_bytes(attempt))
    (records / f".commit.json{TMP_MARK}c0603948e22e").write_bytes(b'{"format": "durable')
    Path(root, "ent").mkdir()
    Path(root, "ent", "a.bin").write_bytes(b"written")
    sv = survey(*resolve(root))
    report = apply_clean(sv, plan_clean(sv, older_than=0, lease_wait=0))
    assert [(i.kind, i.status, i.detail) for i in report.items] == [("entry", "removed", "")]
    assert Entry(f"{root}/ent").state() is State.ABSENT
    assert not records.exists() or not list(records.iterdir())


def test_clean_removes_a_writer_killed_in_its_first_object(tmp_path: Path) -> None:
    """A writer SIGKILLed while it wrote its first object (kill sweep: 6 of 35 local
    @cached kills, the result's temp file open) left its attempt record and that temp file
    alone: clean planned the records ("data is gone"), found the temp file at the removal,
    and skipped the entry for good, "data appeared since the plan". The temp file is the
    entry's data, removed with it."""
    from durable import Entry, State
    from durable._ops import apply_clean, plan_clean
    from durable._protocol import attempt_record_bytes
    from durable._scan import survey
    from durable.adapters import resolve
    from durable.adapters.local import TMP_MARK

    root = os.path.realpath(tmp_path)
    attempt = "0123456789abcdef0123456789abcdef"
    record = Path(root, ".durable", "e", "attempts", f"{attempt}.json")
    record.parent.mkdir(parents=True)
    record.write_bytes(attempt_record_bytes(attempt))
    Path(root, "e").mkdir()
    Path(root, "e", f".value.npy{TMP_MARK}2c048909669f").write_bytes(b"half a result")
    sv = survey(*resolve(root))
    report = apply_clean(sv, plan_clean(sv, older_than=0, lease_wait=0))
    assert [(i.kind, i.status, i.detail) for i in report.items] == [("entry", "removed", "")]
    assert Entry(f"{root}/e").state() is State.ABSENT
    assert not Path(root, "e").exists() and not record.exists()


@contextlib.contextmanager
def zarr_write_held_at_its_marker(proxy: Any, url: str, options: dict[str, Any]
                                  ) -> Iterator[tuple[threading.Event, threading.Thread,
                                                      list[BaseException | None]]]:
    """`durable.zarr.write` of ``url`` on a thread, through ``proxy``, stopped at its
    marker PUT (a commit from its own records: it listed none of its chunks) until the
    event yielded is set: yields (that event, the writer's thread, its outcome once it
    ended: None or what it raised)."""
    import numpy as np

    import durable.zarr as dz
    from durable.testing.faults import Match

    at_marker, release = threading.Event(), threading.Event()
    wrote: list[BaseException | None] = []

    def hold_the_marker(_: Any) -> bool:
        at_marker.set()
        assert release.wait(30)
        return False

    def write() -> None:
        try:
            dz.write(url, np.arange(64, dtype="i4").reshape(8, 8), chunks=(4, 4),
                     storage_options={**options, "endpoint_url": proxy.url})
            wrote.append(None)
        except BaseException as exc:  # handed to the test
            wrote.append(exc)

    name = url.rstrip("/").rpartition("/")[2]
    proxy.inject("delay", seconds=0, match=Match(
        methods="PUT", key=f".durable/{name}/commit.json", where=hold_the_marker))
    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert at_marker.wait(30)
        yield release, writer, wrote
    finally:
        release.set()
        writer.join(30)


# a slow writer cleaned under it -------------------------------------------------------------
@pytest.mark.parametrize("how", ["entry", "zarr"])
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_slow_writer_cleaned_under_it_fails_its_commit_saying_so(
        tmp_path: Path, request: pytest.FixtureRequest, where: str, how: str) -> None:
    """A writer without a lease, alive but slower than `durable clean --older-than`: the
    clean takes its entry for a killed writer's and removes it (its first objects, its
    attempt record) while it writes on. Its commit must fail, naming the cause, and never
    put a marker over what the clean removed; nothing of it is left COMPLETE. On a local
    disk the commit said only "written by this writer but gone at commit" (it did not
    list the records, which would say why)."""
    import numpy as np
    import zarr

    import durable.zarr as dz
    from durable import DurableError, Entry, State
    from durable._ops import apply_clean, plan_clean
    from durable._scan import survey
    from durable.adapters import resolve

    if where == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        root, options = bucket.path("root"), dict(bucket.storage_options)
    else:
        root, options = os.path.realpath(tmp_path), {}
    url = f"{root}/slow.zarr"
    entry = Entry(url, storage_options=options or None)
    if how == "entry":
        cm: Any = entry.writing()
        w = cm.__enter__()
        w.write_bytes("c/0", b"first")
    else:
        cm = dz.writing(url, storage_options=options or None)
        group = cm.__enter__()
        array = zarr.create_array(group, shape=(8, 8), chunks=(4, 4), dtype="i4")
        array[:4] = 1
    report = plan_clean(survey(*resolve(root, options or None)), older_than=0, lease_wait=0)
    assert [i.url for i in report.items] == [entry.url]
    apply_clean(survey(*resolve(root, options or None)), report)
    assert report.items[0].status == "removed", report.items[0].detail
    with pytest.raises(DurableError) as failed:
        if how == "entry":
            w.write_bytes("c/1", b"second")
        else:
            array[4:] = np.full((4, 8), 2, dtype="i4")
        cm.__exit__(None, None, None)
    message = str(failed.value)
    assert "not committing" in message and "durable clean" in message, message
    assert entry.url in message
    assert entry.read_marker() is None
    assert entry.state() is State.ABSENT


@pytest.mark.s3
def test_a_marker_landing_while_clean_removes_the_data_never_vouches_for_it(
        s3_bucket: Any) -> None:
    """`durable.zarr.write` (a commit from its own records, no listing of its chunks)
    looked at its records before `durable clean` took the entry's lease, and its marker
    PUT (held here, as a slow network holds it) lands after the clean removed its
    chunks. The clean kept that marker ("failed"): a marker vouching for data gone, read
    COMPLETE wherever its first and last chunks were written after the removal. It is
    now removed with what is left, and the clean's report says that commit is undone."""
    from durable import Entry, State
    from durable._ops import apply_clean, plan_clean
    from durable._scan import survey
    from durable.adapters import resolve
    from durable.testing.faults import FaultProxy, Match

    direct = dict(s3_bucket.storage_options)
    root, url = s3_bucket.path("root"), s3_bucket.path("root", "slow.zarr")
    deleted = threading.Event()

    def data_deleted(info: Any) -> bool:
        deleted.set()
        return False

    def then_the_marker_lands(_: Any) -> bool:
        # The clean's look at the marker once the chunks are gone: the writer's PUT
        # lands first.
        if deleted.is_set() and not release.is_set():
            release.set()
            writer.join(30)
        return False

    with FaultProxy(upstream=s3_bucket.server.url) as proxy, \
            zarr_write_held_at_its_marker(proxy, url, direct) as (release, writer, wrote):
        sv = survey(*resolve(root, {**direct, "endpoint_url": proxy.url}))
        report = plan_clean(sv, older_than=0, lease_wait=0)
        assert [i.url for i in report.items] == [Entry(url).url]
        proxy.inject("delay", seconds=0, match=Match(
            methods="POST", query="delete", where=data_deleted))
        proxy.inject("delay", seconds=0, match=Match(
            methods="HEAD", key=".durable/slow.zarr/commit.json",
            where=then_the_marker_lands))
        apply_clean(sv, report)
    assert wrote == [None]  # the writer was told it committed
    (item,) = report.items
    assert item.status == "failed", (item.status, item.detail)
    assert "committed it while it was being removed by durable clean" in item.detail
    entry = Entry(url, storage_options=direct)
    assert entry.read_marker() is None and entry.state() is State.ABSENT
