"""Writers racing to commit one entry on S3 (moto): exactly one marker, every time.

Each writer is `Entry.writing(resume=True)` writing the same objects with the same bytes,
as workers computing one cache entry do. ``resume=True`` lets a writer that starts while
another is at work go on (plain ``writing()`` refuses it at the start with
IncompleteExistsError), so every writer reaches the commit and the marker decides.

Two ways to make them race:

- threads on one client, direct to moto, released together by a barrier just before the
  commit (the real configuration; which writer reaches the store first is up to chance);
- real processes, each with its own client, through the fault proxy (no fault), which
  holds every PUT of the marker until the PUTs of all writers have arrived and then lets
  them go at once: no writer can see another's marker before sending its own, so the
  store's create-only (``If-None-Match: *``) alone decides, in every round.

What is checked around durable, with boto3: exactly one writer returns, every other one
gets AlreadyCompleteError; the marker that stands is the winner's (its attempt id); the
records dir holds the marker and nothing else (no attempt record of a loser is left); no
multipart upload is left; the entry verifies deep.

A store that ignores If-None-Match (made of moto by taking the header off at the proxy):
the S3 adapter probes the endpoint, declares ``create_only=False``, and writes the marker
after a HEAD. That is the weaker guarantee, shown here as it is: writers whose HEADs all
come before the first marker lands are each told they committed (with the proxy holding
the PUTs, all of them, deterministically), and the last marker written stands. What still
holds: every one of them checked its records against the objects as stored before writing
its marker, so the marker that stands describes the data (the entry verifies deep), and a
writer whose bytes were replaced by another's does not commit (IntegrityError).

Two more ways a commit can be misreported, each made happen at the proxy: a marker PUT
that landed but whose answer was lost is sent again by the client and refused (412) by the
writer's own marker (the adapter recognises its own write by a token in the object's
metadata, so the writer is told it committed); and a writer failing while another commits,
whose cleanup must not take the committed entry for its own leftovers.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import pytest

from conftest import forkserver
from durable import AlreadyCompleteError, Entry, IntegrityError
from durable import _background as background
from durable._checksum import crc32c
from durable._protocol import Layout, Marker
from durable.adapters import adapter_for_fs
from durable.adapters.s3 import S3Adapter
from durable.testing import faults
from durable.testing.faults import FaultProxy, Match
from durable.testing.pytest_plugin import Bucket

MiB = 1024 * 1024
ROUNDS = 30
# What every writer writes: the same keys with the same bytes (a deterministic result).
OBJECTS = {"a.bin": 10_000, "sub/b.bin": 100_001}


def _payload(key: str) -> bytes:
    return random.Random(key).randbytes(OBJECTS[key])


@dataclass(frozen=True)
class Outcome:
    attempt: str
    won: bool


def write_entry(url: str, options: dict[str, Any],
                before_commit: Callable[[], object] = lambda: None) -> Outcome:
    """One writer: write the entry's objects, then commit (or lose to another writer)."""
    attempt = ""
    try:
        with Entry(url, storage_options=options).writing(resume=True) as w:
            attempt = w.attempt
            w.fs.pipe_file(f"{w.path}/a.bin", _payload("a.bin"))
            w.write_bytes("sub/b.bin", _payload("sub/b.bin"))
            before_commit()
    except AlreadyCompleteError:
        return Outcome(attempt, won=False)
    return Outcome(attempt, won=True)


def _child(prefix: str, rounds: int, options: dict[str, Any], results: Any) -> None:
    """A writer process: one entry per round; puts its (round, Outcome)s on ``results``,
    or the error that stopped it."""
    try:
        outcomes = [(r, write_entry(f"{prefix}/{r}/entry", options)) for r in range(rounds)]
    except BaseException as exc:
        results.put(f"{type(exc).__name__}: {exc}")
        raise
    results.put(outcomes)


pytestmark = pytest.mark.s3


class MarkerGate:
    """A proxy predicate that holds each PUT of a commit marker until the PUTs of all
    ``writers`` for that marker have arrived, then lets them go together.

    It never selects its (inert) fault; it only blocks the proxy thread of the request.
    """

    def __init__(self, writers: int) -> None:
        self.writers = writers
        self.broken: list[str] = []
        self._lock = threading.Lock()
        self._barriers: dict[str, threading.Barrier] = {}
        self.released: Counter[str] = Counter()

    def __call__(self, request: faults.RequestInfo) -> bool:
        with self._lock:
            barrier = self._barriers.setdefault(
                request.path, threading.Barrier(self.writers, timeout=60))
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            # A writer never sent its marker: the test fails on the counts, not by hanging.
            self.broken.append(request.path)
        with self._lock:
            self.released[request.path] += 1
        return False


def _gate(proxy: FaultProxy, writers: int) -> MarkerGate:
    gate = MarkerGate(writers)
    proxy.add(faults.delay(0, match=Match(methods="PUT", path=r"/commit\.json$", where=gate)))
    return gate


def _strip_if_none_match(proxy: FaultProxy) -> None:
    # moto enforces If-None-Match; without the header it is a store that ignores it.
    def strip(request: faults.RequestInfo) -> bool:
        request.headers.remove("if-none-match")
        return False

    proxy.add(faults.delay(0, match=Match(where=strip)))


@pytest.fixture
def proxy(s3_bucket: Bucket) -> Iterator[FaultProxy]:
    with FaultProxy(upstream=s3_bucket.server.url) as p:
        yield p
        assert p.errors == []


@pytest.fixture
def via_proxy(s3_bucket: Bucket, proxy: FaultProxy) -> Iterator[dict[str, Any]]:
    # The proxy forgets what was probed of its URL when it stops (FaultProxy.stop).
    yield dict(s3_bucket.storage_options, endpoint_url=proxy.url)


def _records(boto: Any, bucket: Bucket, entry_key: str) -> list[str]:
    background.wait()  # a commit's removal of its attempt record runs in the background
    layout = Layout(f"{bucket.name}/{entry_key}")
    start = layout.records.split("/", 1)[1] + "/"
    resp = boto.list_objects_v2(Bucket=bucket.name, Prefix=start)
    return sorted(o["Key"][len(start):] for o in resp.get("Contents", []))


def _check_round(boto: Any, bucket: Bucket, entry_key: str, outcomes: list[Outcome],
                 *, round_: int, winners: int = 1) -> Outcome:
    """The round's outcome as seen from outside durable; returns the writer whose marker
    stands."""
    won = [o for o in outcomes if o.won]
    assert len(won) == winners, f"round {round_}: {len(won)} writers committed: {outcomes}"
    assert len({o.attempt for o in outcomes}) == len(outcomes)
    # The marker and nothing else: no attempt record of any writer, winner or loser, left.
    assert _records(boto, bucket, entry_key) == ["commit.json"], round_
    marker_key = Layout(f"{bucket.name}/{entry_key}").marker.split("/", 1)[1]
    data = boto.get_object(Bucket=bucket.name, Key=marker_key)["Body"].read()
    marker = Marker.decode(data, marker_key)
    (standing,) = [o for o in won if o.attempt == marker.attempt]
    assert marker.kind == "prefix" and marker.manifest is not None
    assert {k: (r.size, r.crc32c) for k, r in marker.manifest.objects.items()} == {
        k: (n, crc32c(_payload(k))) for k, n in OBJECTS.items()}
    assert boto.list_multipart_uploads(Bucket=bucket.name).get("Uploads", []) == []
    return standing


def _verify_deep(bucket: Bucket, entry_key: str) -> None:
    report = Entry(bucket.path(entry_key), storage_options=bucket.storage_options).verify(
        deep=True)
    assert report.ok and report.objects == len(OBJECTS)
    assert report.bytes_checked == sum(OBJECTS.values())


def _race_threads(url: str, options: dict[str, Any], writers: int,
                  before_commit: Callable[[], object] = lambda: None) -> list[Outcome]:
    with ThreadPoolExecutor(writers) as pool:
        return list(pool.map(lambda _: write_entry(url, options, before_commit),
                             range(writers)))


# -- direct to moto --------------------------------------------------------------------------
@pytest.mark.parametrize(("writers", "rounds"), [(2, ROUNDS), (8, 10)])
def test_threads_racing_to_commit_have_exactly_one_winner(
        s3_bucket: Bucket, boto: Any, writers: int, rounds: int) -> None:
    for r in range(rounds):
        key = f"threads/{r}/entry"
        barrier = threading.Barrier(writers, timeout=60)
        outcomes = _race_threads(s3_bucket.path(key), s3_bucket.storage_options, writers,
                                 barrier.wait)
        _check_round(boto, s3_bucket, key, outcomes, round_=r)
        _verify_deep(s3_bucket, key)


# -- every marker PUT at the store at once, from real processes --------------------------------
# The gate makes every round the same race (all markers at the store at once, in every
# round): a few rounds show it, and that one round's entry never disturbs the next's.
@pytest.mark.parametrize(("writers", "rounds"), [(2, 5), (8, 3)])
def test_processes_racing_to_commit_have_exactly_one_winner(
        s3_bucket: Bucket, boto: Any, proxy: FaultProxy, via_proxy: dict[str, Any],
        writers: int, rounds: int) -> None:
    gate = _gate(proxy, writers)
    prefix = s3_bucket.path("procs")
    # Forked from a server that imported durable and the S3 stack once (as test_cached's
    # and test_lease's racers): 8 interpreters importing it on two cores took 10 s.
    ctx = forkserver()
    results = ctx.Queue()
    children = [ctx.Process(target=_child, args=(prefix, rounds, via_proxy, results))
                for _ in range(writers)]
    for c in children:
        c.start()
    got = [results.get(timeout=240) for _ in children]
    for c in children:
        c.join(timeout=60)
    assert [g for g in got if isinstance(g, str)] == []
    assert [c.exitcode for c in children] == [0] * writers
    by_round: dict[int, list[Outcome]] = {}
    for outcomes in got:
        for r, outcome in outcomes:
            by_round.setdefault(r, []).append(outcome)
    assert sorted(by_round) == list(range(rounds))
    for r, outcomes in sorted(by_round.items()):
        assert len(outcomes) == writers
        _check_round(boto, s3_bucket, f"procs/{r}/entry", outcomes, round_=r)
        _verify_deep(s3_bucket, f"procs/{r}/entry")
    assert gate.broken == [] and set(gate.released.values()) == {writers}
    assert proxy.count(method="PUT", path=r"/commit\.json$", status=412) == \
        rounds * (writers - 1)


# -- a store that ignores If-None-Match -------------------------------------------------------
@pytest.mark.parametrize("writers", [2, 8])
def test_on_a_store_ignoring_if_none_match_racing_writers_can_all_commit(
        s3_bucket: Bucket, boto: Any, proxy: FaultProxy, via_proxy: dict[str, Any],
        writers: int) -> None:
    _strip_if_none_match(proxy)
    gate = _gate(proxy, writers)
    rounds = 3
    for r in range(rounds):
        key = f"weak/{r}/entry"
        outcomes = _race_threads(s3_bucket.path(key), via_proxy, writers)
        # The weaker guarantee, as it is: every writer is told it committed, and the last
        # marker to land stands. It still describes the data, which verifies deep.
        standing = _check_round(boto, s3_bucket, key, outcomes, round_=r, winners=writers)
        assert standing.won
        _verify_deep(s3_bucket, key)
    assert gate.broken == []
    assert proxy.count(method="PUT", path=r"/commit\.json$", status=200) == rounds * writers
    caps = adapter_for_fs(fsspec.filesystem("s3", **via_proxy)).capabilities
    assert caps.create_only is False and "ignores If-None-Match" in caps.note


def test_on_a_store_ignoring_if_none_match_a_writer_whose_bytes_were_replaced_never_commits(
        s3_bucket: Bucket, boto: Any, proxy: FaultProxy, via_proxy: dict[str, Any]) -> None:
    """Two writers, different bytes under one key: whichever wrote last is the only one
    whose records match the store, so it is the only one that can commit."""
    _strip_if_none_match(proxy)
    url = s3_bucket.path("diff/entry")
    first = Entry(url, storage_options=via_proxy).writing(resume=True)
    second = Entry(url, storage_options=via_proxy).writing(resume=True)
    # Same size, other bytes: only the version (ETag) and then the CRC32C can tell.
    ours, theirs = b"first writer's bytes", b"2nd writer's, others"
    first.__enter__().write_bytes("x.bin", ours)
    try:
        second.__enter__().write_bytes("x.bin", theirs)
        with pytest.raises(IntegrityError, match=r"diff/entry/x\.bin: replaced after this "
                                                 r"writer wrote it"):
            first.__exit__(None, None, None)
    finally:
        second.__exit__(None, None, None)
    stored = boto.get_object(Bucket=s3_bucket.name, Key="diff/entry/x.bin")["Body"].read()
    assert stored == theirs
    assert _records(boto, s3_bucket, "diff/entry") == ["commit.json"]
    assert Entry(url, storage_options=s3_bucket.storage_options).verify(deep=True).ok


# -- a writer failing while another commits -----------------------------------------------------
class _Boom(Exception):
    pass


def test_a_writer_failing_while_another_commits_never_removes_the_committed_entry(
        s3_bucket: Bucket, boto: Any, proxy: FaultProxy, via_proxy: dict[str, Any]) -> None:
    url = s3_bucket.path("failing/entry")
    start = threading.Barrier(2, timeout=30)
    cleanup_listing, committed = threading.Event(), threading.Event()
    first_two = threading.Semaphore(2)

    def both_start_fresh(request: faults.RequestInfo) -> bool:
        # Each writer's attempt record waits for the other's: both saw the entry ABSENT.
        # Writers that resume look before they announce themselves, so two of them can
        # both start on an ABSENT entry (fresh ones cannot: tests/test_racing_writers.py).
        if first_two.acquire(blocking=False):
            start.wait()
        return False

    def hold_cleanup_listing(request: faults.RequestInfo) -> bool:
        # The failing writer's listing of the attempt records waits for the commit.
        if request.query.get("prefix", [""])[0].endswith("/attempts/"):
            cleanup_listing.set()
            committed.wait(30)
        return False

    proxy.add(faults.delay(0, match=Match(methods="PUT", path=r"/attempts/[0-9a-f]+\.json$",
                                          where=both_start_fresh)))
    proxy.add(faults.delay(0, match=Match(methods="GET", where=hold_cleanup_listing)))

    def winner() -> Outcome:
        with Entry(url, storage_options=via_proxy).writing(resume=True) as w:
            w.write_bytes("x.bin", b"the winner's data")
            assert cleanup_listing.wait(30)  # the other writer is in its cleanup
            attempt = w.attempt
        committed.set()
        return Outcome(attempt, won=True)

    with ThreadPoolExecutor(1) as pool:
        won = pool.submit(winner)
        with pytest.raises(_Boom), Entry(url, storage_options=via_proxy).writing(resume=True):
            raise _Boom
        assert won.result(timeout=60).won
    assert _records(boto, s3_bucket, "failing/entry") == ["commit.json"]
    assert Entry(url, storage_options=s3_bucket.storage_options).verify(deep=True).ok


# -- a marker PUT that landed but whose answer was lost -----------------------------------------
def test_a_writer_whose_marker_landed_but_whose_answer_was_lost_has_committed(
        s3_bucket: Bucket, boto: Any, proxy: FaultProxy, via_proxy: dict[str, Any]) -> None:
    """The store applies the marker PUT and the connection dies before the answer: the
    client sends the PUT again, and the store answers the retry 412 (the marker exists,
    its own). The writer committed: it must not be told that another writer did."""
    proxy.add(faults.drop_connection(forward=True, method="PUT", path=r"/commit\.json$",
                                     times=1))
    outcome = write_entry(s3_bucket.path("retried/entry"), via_proxy)
    puts = [r.status for r in proxy.requests
            if r.method == "PUT" and r.path.endswith("/commit.json")]
    assert puts == [None, 412]  # the first answer was lost; the retry was refused
    assert outcome.won, "a writer whose own marker stands was told it lost"
    _check_round(boto, s3_bucket, "retried/entry", [outcome], round_=0)
    _verify_deep(s3_bucket, "retried/entry")


@pytest.mark.parametrize("how", ["PutObject", "Complete, retry answered 200 (moto)",
                                 "Complete, retry answered NoSuchUpload"])
def test_a_create_only_write_whose_answer_was_lost_is_not_refused_by_itself(
        s3_bucket: Bucket, boto: Any, proxy: FaultProxy, via_proxy: dict[str, Any],
        how: str) -> None:
    adapter = adapter_for_fs(fsspec.filesystem("s3", **via_proxy))
    assert isinstance(adapter, S3Adapter)
    saved, adapter.part_size = adapter.part_size, 5 * MiB
    try:
        if how == "PutObject":
            size, final = 1000, Match(methods="PUT", path=r"/obj$", query="!uploadId")
        else:
            size, final = 6 * MiB, Match(methods="POST", path=r"/obj$", query="uploadId")
        proxy.add(faults.drop_connection(forward=True, match=final, times=1))
        if how.endswith("NoSuchUpload"):
            # What a store that forgets a completed upload answers the retry.
            def retried(request: faults.RequestInfo) -> bool:
                return proxy.count(method="POST", path=r"/obj$", query="uploadId") >= 2

            proxy.add(faults.error(404, "NoSuchUpload", times=1, match=Match(
                methods="POST", path=r"/obj$", query="uploadId", where=retried)))
        data = os.urandom(size)
        f = adapter.open_atomic(f"{s3_bucket.name}/obj", create_only=True)
        f.write(data)
        info = f.commit()
        assert info.size == size
        assert boto.get_object(Bucket=s3_bucket.name, Key="obj")["Body"].read() == data
        assert boto.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", []) == []
        final_method = "PUT" if how == "PutObject" else "POST"
        finals = [r.status for r in proxy.requests if r.key == "obj" and r.method ==
                  final_method and ("uploadId" in r.query) == (how != "PutObject")]
        assert finals[0] is None and len(finals) == 2  # the answer lost, then the retry

        # Another writer's object, even byte for byte the same, is still a refusal.
        proxy.clear()
        g = adapter.open_atomic(f"{s3_bucket.name}/obj", create_only=True)
        g.write(data)
        with pytest.raises(FileExistsError, match="obj already exists"):
            g.commit()
    finally:
        adapter.part_size = saved

