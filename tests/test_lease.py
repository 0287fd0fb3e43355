"""`durable.Lease` on its own and around `Entry.writing()`: exclusive, renewed, fenced.

Real stores (local disk, fsspec memory, S3 on moto), real processes (SIGKILLed holders,
racing conditional writes from forked processes) and the fault proxy for an unreachable
store. Small heartbeats (0.2 s) and staleness (1 s) keep it quick.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.memory import MemoryFileSystem

import _cached_child
import durable._lease
from _cached_child import Child
from conftest import forkserver
from durable import (
    Entry,
    IncompleteExistsError,
    Lease,
    LeaseLostError,
    State,
    UnsupportedError,
)
from durable._lease import LeaseWatch
from durable.adapters import resolve
from durable.adapters.base import VersionMismatchError
from durable.testing.faults import FaultProxy, Match, delay, error, strip_headers
from durable.testing.pytest_plugin import Bucket
from test_ops import zarr_write_held_at_its_marker

BEAT, STALE = 0.2, 1.0


@dataclass
class Place:
    kind: str
    url: str  # an entry's URL
    options: dict[str, Any] = field(default_factory=dict)

    def lease(self, **kw: Any) -> Lease:
        kw.setdefault("heartbeat", BEAT)
        kw.setdefault("stale_after", STALE)
        return Lease(self.url, storage_options=self.options or None, **kw)

    def entry(self) -> Entry:
        return Entry(self.url, storage_options=self.options or None)


@pytest.fixture
def local(tmp_path: Path) -> Place:
    return Place("local", os.path.realpath(tmp_path / "ent"))


@pytest.fixture
def memory() -> Iterator[Place]:
    root = f"/lease-{uuid.uuid4().hex[:12]}"
    yield Place("memory", f"memory://{root}/ent")
    MemoryFileSystem().rm(root, recursive=True)


@pytest.fixture
def s3(s3_bucket: Bucket) -> Place:
    return Place("s3", s3_bucket.path("ent"), dict(s3_bucket.storage_options))


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def place(request: pytest.FixtureRequest) -> Place:
    p: Place = request.getfixturevalue(request.param)
    return p


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def shared(request: pytest.FixtureRequest) -> Place:
    p: Place = request.getfixturevalue(request.param)
    return p


def raw_exists(place: Place, path: str) -> bool:
    """Whether an object exists, asked of fsspec directly (around durable)."""
    fs, _ = fsspec.core.url_to_fs(place.url, **place.options)
    fs.invalidate_cache()
    return bool(fs.exists(path))


def wait_for(cond: Any, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


# acquiring and releasing ------------------------------------------------------------------
def test_one_holder_at_a_time_and_release_removes_it(place: Place) -> None:
    entry = place.entry()
    with place.lease() as first:
        assert first.held and entry.state() is State.INCOMPLETE
        assert raw_exists(place, entry.layout.lease)
        with pytest.raises(IncompleteExistsError, match=f"pid {os.getpid()}"):
            place.lease().acquire()
    assert not first.held
    assert not raw_exists(place, entry.layout.lease)
    assert entry.state() is State.ABSENT  # nothing left behind, not even a directory
    with place.lease() as second:
        assert second.held


def test_heartbeat_renews_and_a_watcher_sees_it_live(shared: Place) -> None:
    watch = LeaseWatch(shared.url, storage_options=shared.options or None, stale_after=STALE)
    with shared.lease() as lease:
        versions = set()
        until = time.monotonic() + 2.5 * STALE
        while time.monotonic() < until:
            view = watch.poll()
            assert view is not None and not view.stale, view
            versions.add(view.version)
            time.sleep(0.05)
        assert len(versions) >= 3  # renewed, each time a new version
        assert lease.held


ROUNDS = 50
PROCESS_ROUNDS = 150  # processes leave a barrier less together than threads do


def one_winner_per_round(outcomes: dict[int, list[str]]) -> None:
    assert all(isinstance(o, list) for o in outcomes.values()), outcomes
    for r in range(len(next(iter(outcomes.values())))):
        won = [i for i, o in outcomes.items() if o[r] == "won"]
        assert len(won) == 1, f"round {r}: {len(won)} writers won one version"


@pytest.mark.parametrize("how", ["processes", "threads"])
def test_conditional_write_has_one_winner(local: Place, how: str) -> None:
    adapter, path = resolve(f"{local.url}/obj")
    adapter.put(path, b"start")
    n = 8
    if how == "processes":
        ctx = forkserver()
        barrier, results = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_cached_child.cas_racer,
                             args=(path, {}, PROCESS_ROUNDS, barrier, results, i))
                 for i in range(n)]
        for p in procs:
            p.start()
        outcomes = dict(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join()
    else:
        outcomes = race_threads(adapter, path, n)
    one_winner_per_round(outcomes)


def test_a_conditional_delete_on_a_local_disk_never_removes_what_took_the_objects_place(
        local: Place, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain deletes and writes take no lock: another writer removing the checked object
    and publishing its own (an atomic_write's marker, a new holder's lease) between the
    version check and the unlink had its object unlinked instead: a commit lost. The other
    writer is run at exactly that instant (after the real check), on the real disk."""
    import durable.adapters.local as local_adapter

    adapter, path = resolve(f"{local.url}/records/commit.json")
    checked = adapter.put(path, b"mine", durable=False)
    real_check = local_adapter._current_version
    other: list[Any] = []

    def check_then_another_writer(p: str) -> str | None:
        found = real_check(p)
        if p == path and not other:
            adapter.delete([path])
            other.append(adapter.put(path, b"theirs", create_only=True, durable=False))
        return found

    monkeypatch.setattr(local_adapter, "_current_version", check_then_another_writer)
    with pytest.raises(VersionMismatchError):
        adapter.delete_if(path, checked.version)
    monkeypatch.undo()
    assert adapter.read(path) == b"theirs"
    assert adapter.info(path).version == other[0].version  # type: ignore[union-attr]
    assert sorted(os.listdir(os.path.dirname(path))) == ["commit.json"]  # nothing aside
    adapter.delete_if(path, other[0].version)  # the version it is at: removed
    assert adapter.info(path) is None


def test_a_renewal_racing_a_removal_never_puts_the_lease_back(local: Place) -> None:
    """A renewal on a disk is a version check, then a rename, under a lock; removals took
    no lock. Entry.delete(force=True) removing the lease between a renewal's check and its
    rename lost the removal: the rename put the lease back, and its holder wrote on, held,
    into a deleted entry (or its temp file went with the records: an OSError, not the
    lease lost). Real processes: the holder renews back to back while this one deletes,
    round after round; every time the holder must find the lease lost."""
    ctx = forkserver()
    held, removed, out, go = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    rounds = 40
    holder = ctx.Process(target=_cached_child.renewing_holder,
                         args=(local.url, rounds, held, removed, out, go))
    holder.start()
    entry = local.entry()
    outcomes: collections.Counter[str] = collections.Counter()
    try:
        for _ in range(rounds):
            assert held.wait(timeout=60)
            held.clear()
            # While it renews: most of its time is spent between a check and a rename.
            time.sleep(random.uniform(0.001, 0.01))
            entry.delete(force=True)
            removed.set()  # a renewal that starts from here on must find the lease lost
            outcomes[out.get(timeout=60)] += 1
            removed.clear()
            go.put(1)
    finally:
        holder.join(timeout=60)
        if holder.is_alive():
            holder.kill()
    assert outcomes == {"lost": rounds}
    assert entry.state() is State.ABSENT


def race_threads(adapter: Any, path: str, n: int, rounds: int = ROUNDS) -> dict[int, list[str]]:
    barrier = threading.Barrier(n)
    outcomes: dict[int, list[str]] = {i: [] for i in range(n)}

    def run(i: int) -> None:
        for _ in range(rounds):
            barrier.wait()
            version = adapter.info(path).version
            barrier.wait()
            try:
                # Bodies never repeat: an ETag is a hash of the bytes, so a body written
                # before would bring an old version back (ABA) and let a stale If-Match pass.
                adapter.replace_if(path, f"racer {i} {uuid.uuid4()}".encode(), version)
                outcomes[i].append("won")
            except VersionMismatchError:
                outcomes[i].append("lost")

    # Switch threads as often as possible: a check and a write not made one step would
    # be interleaved (in-process stores; a remote store's own threads decide there).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6 if adapter.name in ("local", "memory") else interval)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    return outcomes


@pytest.mark.parametrize("kind", ["memory", pytest.param("s3", marks=pytest.mark.s3)])
def test_conditional_write_has_one_winner_on_stores(kind: str,
                                                    request: pytest.FixtureRequest) -> None:
    place: Place = request.getfixturevalue(kind)
    adapter, path = resolve(f"{place.url}/obj", place.options or None)
    adapter.put(path, b"start")
    one_winner_per_round(race_threads(adapter, path, 8, ROUNDS if kind == "memory" else 5))
    version = adapter.info(path).version
    assert version is not None
    with pytest.raises(VersionMismatchError):
        adapter.delete_if(path, '"0"' if kind == "s3" else "g0:1")
    adapter.delete_if(path, version)
    assert adapter.info(path) is None


# a dead holder ----------------------------------------------------------------------------
def test_killed_holder_goes_stale_and_exactly_one_waiter_takes_over(shared: Place) -> None:
    import json

    kid = Child("lease", shared.url, json.dumps(shared.options))
    kid.expect("held")
    kid.kill()
    dead = LeaseWatch(shared.url, storage_options=shared.options or None).poll()
    assert dead is not None
    n = 8
    barrier = threading.Barrier(n)
    outcome: dict[int, str] = {}
    takers: dict[int, Lease] = {}

    def wait_and_take(i: int) -> None:
        watch = LeaseWatch(shared.url, storage_options=shared.options or None,
                           stale_after=STALE)
        barrier.wait()
        while True:
            view = watch.poll()
            assert view is not None
            if view.version != dead.version:
                outcome[i] = "too late"  # taken over while this waiter was still counting
                return
            if view.stale and view.holder is not None:
                break  # (no holder: its body could not be read, replaced meanwhile)
            time.sleep(0.05)
        assert view.holder["pid"] == kid.pid
        taker = shared.lease()
        try:
            taker.take_over(view)
            outcome[i], takers[i] = "took", taker
        except IncompleteExistsError:
            outcome[i] = "too late"

    threads = [threading.Thread(target=wait_and_take, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert collections.Counter(outcome.values()) == {"took": 1, "too late": n - 1}
    (taker,) = takers.values()
    assert taker.held
    taker.release()
    assert shared.entry().state() is State.ABSENT


# a holder that lost its lease -------------------------------------------------------------
def take_over_now(place: Place, lease: Lease) -> Lease:
    """What a waiter does once it has seen ``lease`` stale: a conditional write on the
    version it saw (here without waiting for staleness, and the holder still alive)."""
    with lease._lock:  # not between two of the holder's own renewals
        view = LeaseWatch(place.url, storage_options=place.options or None).poll()
        assert view is not None
        stale = type(view)(view.version, view.holder, STALE, STALE, True)
        taker = place.lease()
        taker.take_over(stale)
    return taker


def test_a_holder_that_lost_its_lease_never_commits(place: Place) -> None:
    entry = place.entry()
    holder = place.lease().acquire()
    with pytest.raises(LeaseLostError), entry.writing(lease=holder) as w:
        w.write_bytes("a", b"holder's")
        taker = take_over_now(place, holder)
    assert entry.read_marker() is None  # no marker, and nothing of the taker's removed
    assert holder.lost is not None
    with pytest.raises(LeaseLostError):
        holder.check()
    holder.release()  # leaves the taker's lease alone
    assert taker.held
    with entry.writing(lease=taker, overwrite=True) as w:
        w.write_bytes("a", b"taker's")
    taker.release()
    assert entry.state() is State.COMPLETE
    assert Entry(place.url, storage_options=place.options or None).verify(deep=True).ok


def test_heartbeat_notices_a_takeover(shared: Place) -> None:
    holder = shared.lease().acquire()
    taker = take_over_now(shared, holder)
    wait_for(lambda: holder.lost is not None, "the holder's heartbeat sees the takeover")
    assert "taken over" in (holder.lost or "")
    with pytest.raises(LeaseLostError):
        holder.check()
    holder.release()
    assert taker.held
    taker.release()


@pytest.mark.s3
def test_a_holder_cut_off_from_the_store_loses_its_lease(s3_bucket: Bucket,
                                                         no_backoff: None) -> None:
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        # One attempt per botocore call: with its default retries (on top of s3fs's own),
        # a renewal against a store answering 503 takes about a minute to give up.
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url,
                   "config_kwargs": {"retries": {"max_attempts": 1}}}
        place = Place("s3", s3_bucket.path("cut"), options)
        entry = place.entry()
        holder = place.lease().acquire()
        with pytest.raises(LeaseLostError, match="not renewed"), \
                entry.writing(lease=holder) as w:
            w.write_bytes("a", b"data")
            # From here every write of the lease fails, as in an outage.
            proxy.add(error(503, method="PUT", key="lease.json"))
            wait_for(lambda: holder.lost is not None, "the holder gives its lease up")
        proxy.clear()
        assert entry.read_marker() is None
        holder.release()


# fencing ----------------------------------------------------------------------------------
def test_on_local_disk_no_takeover_lands_inside_the_fence(local: Place) -> None:
    import json

    kid = Child("lease", local.url, json.dumps({}))
    kid.expect("held")
    kid.go()
    kid.expect("fenced")  # the child is inside Lease.fenced(): about to commit
    adapter, _ = resolve(local.url)
    path = local.entry().layout.lease
    version = adapter.info(path).version  # type: ignore[union-attr]
    assert version is not None  # the current version: without the fence, a CAS would pass
    got: list[str] = []

    def take() -> None:
        try:
            adapter.replace_if(path, b"taker", version)
            got.append("won")
        except VersionMismatchError:
            got.append("lost")

    taker = threading.Thread(target=take)
    taker.start()
    taker.join(timeout=3 * STALE)
    assert taker.is_alive() and got == []  # held off however long the holder takes
    assert kid.finish() == "released"
    taker.join()
    # After the fence: the taker's write lands before the holder's release (which then
    # leaves the taker's lease alone) or after it (the version is gone): either way once.
    assert len(got) == 1


@pytest.mark.s3
def test_on_s3_the_fence_stops_a_commit_taken_over_midway(s3_bucket: Bucket) -> None:
    """A holder stalls inside its commit (after the commit's first renewal, before the
    marker) long enough for a waiter to take over: the fence's renewal must stop it."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        slow = Place("s3", s3_bucket.path("ent"),
                     {**s3_bucket.storage_options, "endpoint_url": proxy.url})
        direct = Place("s3", s3_bucket.path("ent"), dict(s3_bucket.storage_options))
        committing = threading.Event()

        def first_look(_: Any) -> bool:
            committing.set()
            return True

        # The commit's listing of the entry's data stalls (a slow network), and from then
        # on so do the holder's renewals: to a waiter, the holder looks dead. (The full
        # listing, no max-keys: writing()'s look for existing data lists at most 1 key.)
        def commit_listing(q: Mapping[str, Sequence[str]]) -> bool:
            prefix = q.get("prefix", [""])[0]
            return ("list-type" in q and "max-keys" not in q and prefix.endswith("ent/")
                    and ".durable" not in prefix)

        proxy.add(delay(3.0, match=Match(methods="GET", query=commit_listing,
                                         where=first_look)))
        proxy.add(delay(6.0, match=Match(methods="PUT", key="lease.json",
                                         where=lambda _: committing.is_set())))
        taken: list[Lease] = []

        def take_over_when_stale() -> None:
            assert committing.wait(30)
            watch = LeaseWatch(direct.url, storage_options=direct.options, stale_after=STALE)
            while not (view := watch.poll()) or not view.stale:  # type: ignore[union-attr]
                time.sleep(0.05)
            taken.append(direct.lease().take_over(view))

        waiter = threading.Thread(target=take_over_when_stale)
        waiter.start()
        holder = slow.lease().acquire()
        with pytest.raises(LeaseLostError), slow.entry().writing(lease=holder) as w:
            w.write_bytes("a", b"holder's")
        waiter.join()
        assert len(taken) == 1 and taken[0].held
        assert direct.entry().read_marker() is None
        taken[0].release()
        proxy.clear()
        holder.release()


# with Entry.writing() --------------------------------------------------------------------
def test_writing_under_a_lease(place: Place) -> None:
    entry = place.entry()
    with place.lease() as lease:
        with pytest.raises(RuntimeError, match="boom"), entry.writing(lease=lease) as w:
            w.write_bytes("x", b"1")
            raise RuntimeError("boom")
        assert lease.held and entry.state() is State.INCOMPLETE  # the lease alone
        with entry.writing(lease=lease) as w:
            w.write_bytes("x", b"2")
        with entry.writing(lease=lease, overwrite=True) as w:
            w.write_bytes("y", b"3")
        assert lease.held
    assert entry.state() is State.COMPLETE
    marker = entry.read_marker()
    assert marker is not None and sorted(marker.manifest.objects) == ["y"]  # type: ignore[union-attr]
    with place.lease() as lease, pytest.raises(RuntimeError), entry.writing(
            lease=lease, overwrite=True) as w:
        w.write_bytes("z", b"4")
        raise RuntimeError("fail an overwrite")
    assert entry.state() is State.ABSENT
    other = Place(place.kind, place.url + "-other", place.options)
    with other.lease() as wrong, pytest.raises(ValueError, match="not the lease"), \
            entry.writing(lease=wrong):
        pass  # pragma: no cover


def test_a_failed_writer_leaves_the_entry_absent(place: Place) -> None:
    entry = place.entry()
    with place.lease() as lease, pytest.raises(ZeroDivisionError), \
            entry.writing(lease=lease) as w:
        w.write_bytes("x", b"1")
        _ = 1 / 0
    assert entry.state() is State.ABSENT


# a writer without the lease ------------------------------------------------------------------
@pytest.mark.parametrize("how", ["overwrite", "resume", "update", "fresh"])
def test_a_writer_without_the_lease_never_starts_over_a_live_holders_entry(
        place: Place, how: str) -> None:
    """Starting over would remove the holder's lease and data while its writes under way
    (it learns of the loss at its next renewal) land in the other writer's entry; resuming
    or updating would commit the holder's partial objects as the other writer's."""
    entry = place.entry()
    if how == "update":
        with entry.writing() as w:
            w.write_bytes("a", b"committed")
    with place.lease() as holder, entry.writing(lease=holder,
                                                overwrite=how == "update") as w:
        w.write_bytes("a", b"holder-a")
        with pytest.raises(IncompleteExistsError) as refused, \
                place.entry().writing(**({} if how == "fresh" else {how: True})) as other:  # type: ignore[arg-type]
            other.write_bytes("a", b"other-aa")  # pragma: no cover
        message = str(refused.value)
        assert entry.url in message and f"pid {os.getpid()}" in message
        assert "expires at" in message and holder.url in message
        assert holder.held
        w.write_bytes("b", b"holder-late")  # lands in the holder's own entry
    report = entry.verify(deep=True)
    assert report.ok and entry.state() is State.COMPLETE
    marker = entry.read_marker()
    assert marker is not None and sorted(marker.manifest.objects) == ["a", "b"]  # type: ignore[union-attr]
    fs, _ = fsspec.core.url_to_fs(place.url, **place.options)
    fs.invalidate_cache()
    assert fs.cat_file(f"{entry.path}/a") == b"holder-a"


def test_delete_refuses_a_live_holders_entry_unless_forced(place: Place) -> None:
    """Deleted under a live lease, the holder would go on writing into a deleted entry
    (or the next writer's): refused, naming the entry and the holder, unless forced; then
    the holder loses its lease and never commits."""
    entry = place.entry()
    with place.lease() as holder, entry.writing(lease=holder) as w:
        w.write_bytes("a", b"holder-a")
        with pytest.raises(IncompleteExistsError) as refused:
            place.entry().delete()
        message = str(refused.value)
        assert entry.url in message and holder.url in message
        assert f"pid {os.getpid()}" in message and "force=True" in message
        assert holder.held and raw_exists(place, f"{entry.path}/a")
        w.write_bytes("b", b"holder-b")
    assert entry.state() is State.COMPLETE and entry.verify(deep=True).ok

    with place.lease() as holder, pytest.raises(LeaseLostError), \
            entry.writing(lease=holder, overwrite=True) as w:
        w.write_bytes("a", b"second")
        place.entry().delete(force=True)
    assert entry.state() is State.ABSENT


# a delete racing writers without a lease -------------------------------------------------
@contextlib.contextmanager
def paused_delete(monkeypatch: pytest.MonkeyPatch, entry: Entry
                  ) -> Iterator[tuple[threading.Event, list[BaseException | None]]]:
    """``entry.delete()`` on a thread, stopped right after it removed the data (before the
    records), until the block ends: yields (the event set once it is stopped there, the
    delete's outcome once the block has ended: None or what it raised)."""
    import durable._entry
    import durable._nesting

    removed, go_on = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []

    def pause_after(original: Any) -> Any:
        def delete_tree(*args: Any, **kwargs: Any) -> None:
            original(*args, **kwargs)
            if threading.current_thread() is deleting and not removed.is_set():
                removed.set()
                assert go_on.wait(30)
        return delete_tree

    for module in (durable._nesting, durable._entry):
        if hasattr(module, "delete_tree"):
            monkeypatch.setattr(module, "delete_tree", pause_after(module.delete_tree))

    def run() -> None:
        try:
            entry.delete()
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    deleting = threading.Thread(target=run)
    deleting.start()
    try:
        assert removed.wait(30), "the delete never reached its removal of the data"
        yield removed, outcome
    finally:
        go_on.set()
        deleting.join(30)


def test_a_writer_starting_while_a_delete_removes_the_entry_is_refused(
        place: Place, monkeypatch: pytest.MonkeyPatch) -> None:
    """A COMPLETE entry being deleted; a rerun starts over it (overwrite=True, the way a
    pipeline reruns a step) while the delete removes the data. The delete only looked for
    a live lease before it began: the rerun cleared, wrote and committed (told it
    succeeded), and the delete then removed its marker with the records, leaving its
    data unmarked: a success undone with no error to anyone. The delete now holds the
    entry's lease while it removes: the rerun is refused, naming it, and its retry once
    the delete is done commits whole data."""
    entry = place.entry()
    with entry.writing() as w:
        w.write_bytes("a", b"old-a")
        w.write_bytes("b", b"old-b")

    def rerun() -> None:
        with place.entry().writing(overwrite=True) as w:
            w.write_bytes("a", b"new-a")
            w.write_bytes("c", b"new-c")

    with paused_delete(monkeypatch, entry) as (_, outcome):
        with pytest.raises(IncompleteExistsError, match=r"Entry\.delete\(\) removing"):
            rerun()
        with pytest.raises(IncompleteExistsError):
            place.entry().writing().__enter__()  # a fresh writer too
    assert outcome == [None]
    assert entry.state() is State.ABSENT
    rerun()
    assert entry.state() is State.COMPLETE and entry.verify(deep=True).ok
    assert sorted(entry.read_marker().manifest.objects) == ["a", "c"]  # type: ignore[union-attr]


def test_a_writer_committing_while_a_delete_removes_the_entry_never_ends_half_done(
        place: Place, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer without a lease started before the delete (its first object removed with
    the entry), writes on and commits while the delete removes the rest. The delete's
    removal of the records took the marker just committed: the writer was told it
    succeeded, the delete too, and the entry held the writer's objects unmarked. Now one
    of the two fails, loudly, and the entry is either whole and COMPLETE or gone: the
    writer finds the delete's lease at its commit, or (on S3, whose commit does not list
    the records) the delete finds the marker and keeps it, all its data written after
    the removal."""
    entry = place.entry()
    cm = place.entry().writing()
    w = cm.__enter__()
    w.write_bytes("a", b"early")
    failed: list[BaseException] = []
    with paused_delete(monkeypatch, entry) as (_, outcome):
        assert not raw_exists(place, f"{entry.path}/a")
        w.write_bytes("a", b"late-a")
        w.write_bytes("b", b"late-b")
        try:
            cm.__exit__(None, None, None)
        except BaseException as exc:  # the commit's failure, checked below
            failed.append(exc)
    (deleted,) = outcome
    assert (deleted is None) != (not failed), (deleted, failed)
    if failed:
        (exc,) = failed
        assert isinstance(exc, IncompleteExistsError), exc
        assert "Entry.delete() removing" in str(exc) and entry.url in str(exc)
        assert entry.state() is State.ABSENT
    else:
        assert isinstance(deleted, durable.AlreadyCompleteError), deleted
        assert "committed it while it was being removed by this delete" in str(deleted)
        assert entry.state() is State.COMPLETE and entry.verify(deep=True).ok


@pytest.mark.s3
def test_a_marker_landing_while_a_delete_removes_the_data_never_vouches_for_it(
        s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """`durable.zarr.write` commits from its own records (no listing of its chunks): its
    look at the records came before the delete took the lease, and its marker PUT (held
    here, as a slow network holds it) lands after the delete removed the chunks. The
    delete's removal of the records then took that marker: the writer was told it
    committed, and its work was gone with no error to anyone. The delete now looks for a
    marker once the data and records are removed: one over data it removed is removed
    too, and the delete says so (IntegrityError naming the writer's commit undone)."""
    from durable import IntegrityError

    direct = dict(s3_bucket.storage_options)
    url = s3_bucket.path("ent.zarr")
    entry = Entry(url, storage_options=direct)
    with FaultProxy(upstream=s3_bucket.server.url) as proxy, \
            zarr_write_held_at_its_marker(proxy, url, direct) as (release, writer, wrote), \
            paused_delete(monkeypatch, entry) as (_, outcome):
        release.set()  # the marker lands now, the chunks already removed
        writer.join(30)
    assert wrote == [None]  # the writer was told it committed...
    (deleted,) = outcome
    # ... and the delete says that commit is undone, rather than nobody.
    assert isinstance(deleted, IntegrityError), deleted
    assert "committed it while it was being removed by this delete" in str(deleted)
    assert "zarr.json" in str(deleted) or "c/" in str(deleted)
    assert entry.read_marker() is None and entry.state() is State.ABSENT


def test_a_writer_refused_by_a_lease_taken_since_it_started_leaves_the_data_to_the_holder(
        place: Place) -> None:
    """A writer without a lease finds at its commit that the entry's lease was taken
    since it started (a waiter about to resume its entry), and refuses. Its cleanup then
    removed the whole entry, its records showing no other writer yet: the objects the
    holder was about to resume were taken from under it, and its resume committed
    without them. The entry is the holder's now: the refused writer removes only its own
    attempt record."""
    entry = place.entry()
    cm = entry.writing()
    w = cm.__enter__()
    w.write_bytes("a", b"kept for the holder")
    with place.lease() as holder:
        with pytest.raises(IncompleteExistsError, match="lease"):
            cm.__exit__(None, None, None)
        assert raw_exists(place, f"{entry.path}/a")
        with entry.writing(lease=holder, resume=True) as w2:
            w2.write_bytes("b", b"holder's")
    assert entry.verify(deep=True).ok
    assert sorted(entry.read_marker().manifest.objects) == ["a", "b"]  # type: ignore[union-attr]


def test_zarr_and_xarray_overwrites_never_start_over_a_live_holders_entry(local: Place) -> None:
    """The writers built on `Entry.writing` refuse the same way, naming the holder."""
    import numpy as np
    import xarray as xr

    import durable.xarray as dx
    import durable.zarr as dz

    entry = local.entry()
    with local.lease() as holder, entry.writing(lease=holder) as w:
        w.write_bytes("zarr.json", b"{}")
        with pytest.raises(IncompleteExistsError, match=f"pid {os.getpid()}"):
            dz.write(local.url, np.arange(4), overwrite=True)
        with pytest.raises(IncompleteExistsError, match=f"pid {os.getpid()}"):
            dx.to_zarr(xr.Dataset({"v": ("x", np.arange(4))}), local.url, mode="w")
        assert raw_exists(local, f"{entry.path}/zarr.json")
    assert entry.verify(deep=True).ok


def test_zarr_and_xarray_writes_under_a_lease(shared: Place) -> None:
    """The dask guide's advice, hold a lease around the write, can be followed: the zarr
    and xarray writers take it (without it their writing refused the entry: the lease read
    as another writer at work)."""
    import numpy as np
    import xarray as xr

    import durable.xarray as dx
    import durable.zarr as dz

    entry = shared.entry()
    ds = xr.Dataset({"v": ("x", np.arange(8))})
    with shared.lease() as lease:
        dx.to_zarr(ds, shared.url, storage_options=shared.options or None, lease=lease)
        assert entry.state() is State.COMPLETE and lease.held
        dz.write(shared.url, np.arange(4), storage_options=shared.options or None,
                 overwrite=True, lease=lease)
        with dz.writing(shared.url, storage_options=shared.options or None, update=True,
                        lease=lease) as store:
            import zarr

            zarr.open_array(store, mode="r+")[:2] = [7, 7]
        assert lease.held
    assert entry.verify(deep=True).ok
    assert not raw_exists(shared, lease.path)
    array = dz.open(shared.url, storage_options=shared.options or None)
    assert array[:].tolist() == [7, 7, 2, 3]


def test_a_zarr_writer_that_lost_its_lease_writes_no_more_chunks(local: Place) -> None:
    """Taken over, the holder's zarr store refuses the next chunk (LeaseLostError), as
    `EntryWriter.open` does; it used to write it into the taker's entry."""
    import zarr

    import durable.zarr as dz

    holder = local.lease().acquire()
    with pytest.raises(LeaseLostError), dz.writing(local.url, lease=holder) as store:
        array = zarr.create_array(store, shape=(4,), chunks=(2,), dtype="int64")
        array[:2] = [1, 2]
        taker = take_over_now(local, holder)
        wait_for(lambda: holder.lost is not None, "the holder's heartbeat sees the takeover")
        with local.entry().writing(lease=taker, overwrite=True) as w:
            w.write_bytes("zarr.json", b"{}")
        array[2:] = [3, 4]
    holder.release()
    taker.release()
    assert local.entry().verify(deep=True).ok  # nothing of the holder's landed in it
    assert sorted(local.entry().read_marker().manifest.objects) == ["zarr.json"]  # type: ignore[union-attr]


def test_an_expired_lease_is_taken_by_a_writer_without_one(shared: Place) -> None:
    """A holder that stopped renewing for its stale_after (by the store's clock) is dead
    or paused: an overwrite without the lease removes its lease (conditionally), and the
    holder, if it comes back, finds it lost."""
    entry = shared.entry()
    holder = shared.lease().acquire()
    with pytest.raises(LeaseLostError), entry.writing(lease=holder) as w:
        w.write_bytes("a", b"holder-a")
        holder._stop.set()  # paused: no more renewals
        assert holder._thread is not None
        holder._thread.join()
        # + up to a second for each of the two times the age is taken from, both to the
        # second (the lease's Last-Modified and the Date of the store's answer)
        time.sleep(STALE + 2.5)
        with pytest.raises(IncompleteExistsError, match=r"expired: not renewed for .* "
                           r"Pass overwrite=True or resume=True"), shared.entry().writing():
            pass  # pragma: no cover
        assert raw_exists(shared, holder.path)  # a refused writer only names it
        with shared.entry().writing(overwrite=True) as other:
            other.write_bytes("a", b"other-aa")
        assert entry.state() is State.COMPLETE
        assert not raw_exists(shared, holder.path)
        w.write_bytes("b", b"holder-late")  # the paused holder is stopped, not landing
    holder.release()
    assert entry.verify(deep=True).ok  # nothing of the holder's landed, nothing removed
    assert sorted(entry.read_marker().manifest.objects) == ["a"]  # type: ignore[union-attr]


# GCS and Azure ------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", [pytest.param("azure_container", marks=pytest.mark.azure),
                                     pytest.param("fake_gcs_bucket", marks=pytest.mark.gcs)])
def test_leases_on_azure_and_gcs(fixture: str, request: pytest.FixtureRequest) -> None:
    bucket: Bucket = request.getfixturevalue(fixture)
    place = Place(bucket.protocol, bucket.path("ent"), dict(bucket.storage_options))
    entry = place.entry()
    adapter, path = resolve(bucket.path("obj"), place.options)
    adapter.put(path, b"start")
    one_winner_per_round(race_threads(adapter, path, 8, 3))
    with place.lease() as lease:
        with pytest.raises(IncompleteExistsError):
            place.lease().acquire()
        first = lease.version
        wait_for(lambda: lease.version != first, "a renewal")
        taker = take_over_now(place, lease)
        wait_for(lambda: lease.lost is not None, "the holder sees the takeover")
    with taker, entry.writing(lease=taker) as w:
        w.write_bytes("a", b"1")
    assert entry.state() is State.COMPLETE
    assert not raw_exists(place, entry.layout.lease)


@pytest.mark.gcs
def test_no_lease_where_the_emulator_ignores_preconditions(gcs_bucket: Bucket) -> None:
    """gcp-storage-emulator enforces no ifGenerationMatch: the probe sees it, and a lease
    there would be a silent race, so it is refused."""
    with pytest.raises(UnsupportedError, match="best_effort=True"):
        Lease(gcs_bucket.path("ent"), storage_options=dict(gcs_bucket.storage_options),
              heartbeat=BEAT, stale_after=STALE).acquire()


# stores without conditional writes --------------------------------------------------------
def test_no_conditional_writes_no_lease_unless_best_effort(tmp_path: Path) -> None:
    fs = DirFileSystem(path=str(tmp_path), fs=fsspec.filesystem("file"))
    options = dict(fs.storage_options)
    with pytest.raises(UnsupportedError, match="best_effort=True"):
        Lease("dir://sub/ent", storage_options=options).acquire()
    entry = Entry("dir://sub/ent", storage_options=options)
    with Lease("dir://sub/ent", storage_options=options, heartbeat=BEAT, stale_after=STALE,
               best_effort=True) as lease, entry.writing(lease=lease) as w:
        w.write_bytes("x", b"1")
    assert entry.state() is State.COMPLETE


def test_a_lease_with_no_modification_time_is_judged_by_the_watchers_clock(
        tmp_path: Path) -> None:
    """The generic adapter gives no modification time: a dead holder's lease counted as
    live forever, and no writer could ever start over. It is watched from the first look:
    unchanged for its stale_after, expired; renewed meanwhile, live."""
    fs = DirFileSystem(path=str(tmp_path), fs=fsspec.filesystem("file"))
    options = dict(fs.storage_options)
    entry = Entry("dir://sub/ent", storage_options=options)
    _plant_lease(Entry(os.path.join(tmp_path, "sub", "ent")), str(STALE))  # a killed holder's
    assert entry.adapter.info(entry.layout.lease).modified is None  # type: ignore[union-attr]
    with pytest.raises(IncompleteExistsError, match="no modification time"), \
            entry.writing():
        pass  # pragma: no cover (a fresh writer is refused at once, naming the lease)
    with entry.writing(overwrite=True) as w:
        w.write_bytes("x", b"after the dead holder")
    assert entry.state() is State.COMPLETE

    with Lease("dir://sub/ent", storage_options=options, heartbeat=BEAT, stale_after=STALE,
               best_effort=True) as live:
        with pytest.raises(IncompleteExistsError, match=r"renewed .* after this writer first"):
            entry.delete()
        assert live.held
    assert entry.state() is State.COMPLETE


class _AnHourAhead:
    """The time module of a machine whose clock is an hour ahead of the store's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        return time.time() + 3600


@pytest.mark.s3
def test_a_store_without_a_date_never_ages_a_live_lease_by_this_machines_clock(
        s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """An S3-compatible store that sends no Date: a live holder's lease was aged by this
    machine's clock against the store's Last-Modified, and a clock an hour ahead made it
    expired: an overwrite removed it and started over under the holder's writes. With no
    Date it is watched instead, as with no modification time: renewed, so live."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        proxy.add(strip_headers("^date$"))
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        entry = Entry(s3_bucket.path("ent"), storage_options=options)
        with Lease(entry, heartbeat=BEAT, stale_after=STALE) as holder, \
                entry.writing(lease=holder) as w:
            w.write_bytes("a", b"holder")
            monkeypatch.setattr(durable._lease, "time", _AnHourAhead())
            other = Entry(s3_bucket.path("ent"), storage_options=options)
            with pytest.raises(IncompleteExistsError, match=r"renewed .* after this writer "
                               "first saw it"), other.writing(overwrite=True):
                pass  # pragma: no cover
            monkeypatch.undo()
            assert holder.held
            w.write_bytes("b", b"holder")
        assert Entry(s3_bucket.path("ent"), storage_options=s3_bucket.storage_options
                     ).verify(deep=True).ok


def test_stale_after_must_leave_room_for_renewals(local: Place) -> None:
    with pytest.raises(ValueError, match="twice the heartbeat"):
        Lease(local.url, heartbeat=1.0, stale_after=1.5)


def test_killed_holder_child_really_held_it(local: Place) -> None:
    """The control for the takeover tests: a live child holder keeps its lease live."""
    import json

    kid = Child("lease", local.url, json.dumps({}))
    kid.expect("held")
    watch = LeaseWatch(local.url, stale_after=STALE)
    until = time.monotonic() + 2 * STALE
    while time.monotonic() < until:
        view = watch.poll()
        assert view is not None and not view.stale
        time.sleep(0.05)
    kid.signal(signal.SIGTERM)
    kid.proc.communicate()


def test_a_lease_file_nested_too_deeply_is_no_lease_to_its_readers(local: Place) -> None:
    """A lease file of a few KiB nested deeper than json parses: its readers (a writer
    refused the lease, a waiter judging it) raised a bare RecursionError instead of taking
    it for what it is, not a lease."""
    entry = local.entry()
    os.makedirs(os.path.dirname(entry.layout.lease))
    with open(entry.layout.lease, "w") as f:
        f.write("[" * 5000 + "]" * 5000)
    assert LeaseWatch(local.url).peek() is None
    with pytest.raises(IncompleteExistsError, match="holds its lease"):
        local.lease().acquire()


def test_a_symlink_at_the_lock_files_path_is_never_followed(local: Place) -> None:
    """Conditional writes on a local disk lock a sidecar file, created if missing: a
    symlink planted at its path made that create (and lock) a file wherever it pointed,
    outside the entry. Now the lease fails, naming the lock file."""
    from durable.adapters.local import _lock_path

    entry = local.entry()
    lock = _lock_path(entry.layout.lease)
    outside = os.path.join(os.path.dirname(local.url), "outside")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    os.symlink(outside, lock)
    lease = local.lease().acquire()  # create-only: no lock taken
    try:
        with pytest.raises(OSError, match="lock file is a symlink"):
            lease.renew()  # a conditional rewrite: under the lock
    finally:
        with contextlib.suppress(Exception):
            lease.release()
    assert not os.path.lexists(outside)


def test_a_lock_sidecar_goes_with_what_it_guards(local: Place) -> None:
    """Conditional writes on a local disk lock a sidecar beside the records directory
    (``.durable/NAME.durable-lock``). It was never removed: a writer that gave up, or an
    entry deleted, left it in the records folder for good. It stays only beside records."""
    from durable.adapters.local import _lock_path

    entry = local.entry()
    lock = _lock_path(entry.layout.lease)
    folder = os.path.dirname(lock)
    with local.lease() as lease, pytest.raises(ZeroDivisionError), \
            entry.writing(lease=lease) as w:
        w.write_bytes("x", b"1")
        lease.renew()  # a conditional write: under the lock
        assert os.path.exists(lock)
        _ = 1 / 0
    assert os.listdir(folder) == []  # the writer gave up: nothing of it
    with local.lease() as lease, entry.writing(lease=lease) as w:
        w.write_bytes("x", b"1")
    assert sorted(os.listdir(folder)) == sorted([os.path.basename(lock), "ent"])
    entry.delete()
    assert os.listdir(folder) == []


def test_a_taker_that_waited_on_a_removed_lock_file_locks_the_one_at_its_path(
        local: Place) -> None:
    """A lock file is unlinked by its holder when what it guards is gone. A process that
    opened it before, and waited, then got the lock of a file no other taker opens any
    more: a third would create a new one and lock it too, two holders at once. A taker
    that holds a file the path no longer names starts over. Real processes: this one
    holds the lock while another waits on the file, empties the folder and lets go."""
    import errno
    import fcntl

    from durable.adapters.local import _lock_path

    entry = local.entry()
    lease = entry.layout.lease
    adapter, _ = resolve(lease)
    os.makedirs(os.path.dirname(lease))
    Path(lease).write_bytes(b"guarded")
    lock = _lock_path(lease)
    ctx = forkserver()
    out, go = ctx.Queue(), ctx.Queue()
    with adapter.exclusive(lease):
        taker = ctx.Process(target=_cached_child.lock_taker, args=(lease, out, go))
        taker.start()
        try:
            def waits_on_it() -> bool:
                with contextlib.suppress(OSError):  # a descriptor closed meanwhile
                    fds = os.listdir(f"/proc/{taker.pid}/fd")
                    return any(os.readlink(f"/proc/{taker.pid}/fd/{fd}") == lock
                               for fd in fds)
                return False

            wait_for(waits_on_it, "the other process opening the lock file")
            unlinked = os.stat(lock).st_ino
            # Kept open here so its inode cannot be reused by the file the taker makes
            # next (a file system hands a freed inode number out again at once).
            keep = os.open(lock, os.O_RDONLY)
            os.unlink(lease)  # nothing left to guard: the lock file goes at the release
        except BaseException:
            taker.kill()
            raise
    try:
        held = out.get(timeout=60)
        assert not os.path.exists(os.path.dirname(lease)) or not os.listdir(
            os.path.dirname(lease))
        assert os.stat(lock).st_ino == held != unlinked  # the file at the path is its
        fd = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(OSError) as refused:  # and locks out a third taker
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert refused.value.errno in (errno.EAGAIN, errno.EACCES)
        finally:
            os.close(fd)
    finally:
        os.close(keep)
        go.put(1)
        taker.join(timeout=60)
        if taker.is_alive():
            taker.kill()
    assert taker.exitcode == 0
    assert not os.path.exists(lock)  # its holder let go of an empty folder: gone too


# what a lease's body states ---------------------------------------------------------------
# id: (the body's stale_after as JSON text, whether it is capped rather than ignored)
_STATED = {"huge": ("1e12", True), "integer-too-large-for-a-float": ("1" + "0" * 400, True),
           "infinity": ("Infinity", True), "nan": ("NaN", False), "negative": ("-5", False),
           "string": ('"30"', False), "null": ("null", False)}


def _plant_lease(entry: Entry, stale_after: str, age: float = 0.0) -> None:
    """A dead holder's lease whose body states ``stale_after`` (JSON text), last written
    ``age`` seconds ago."""
    os.makedirs(os.path.dirname(entry.layout.lease), exist_ok=True)
    with open(entry.layout.lease, "w") as f:
        f.write('{"format": "durable.lease", "holder": "h", "host": "elsewhere", "pid": 1, '
                f'"acquired_at": "then", "renewal": 1, "stale_after": {stale_after}}}')
    when = time.time() - age
    os.utime(entry.layout.lease, (when, when))


@pytest.mark.parametrize(("stated", "capped"), list(_STATED.values()), ids=list(_STATED))
def test_a_hostile_stale_after_never_holds_waiters_forever_nor_crashes_them(
        local: Place, stated: str, capped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body stating 1e12 kept a "wait" waiter (no timeout) waiting forever, one too large
    for a float crashed it (OverflowError), and a writer starting over crashed on the
    expiry date (ValueError: year out of range). More than MAX_STALE_AFTER counts as that;
    garbage counts as nothing (the waiter's own limit)."""
    entry = local.entry()
    _plant_lease(entry, stated)
    with pytest.raises(IncompleteExistsError, match="expires at"), \
            entry.writing(overwrite=True):
        pass  # pragma: no cover
    # Older than the cap by the store's clock: expired, whatever the body states.
    _plant_lease(entry, stated, age=durable._lease.MAX_STALE_AFTER + 60)
    with entry.writing(overwrite=True) as w:
        w.write_bytes("a", b"taken")
    assert entry.state() is State.COMPLETE

    # A waiter judges by its own clock: the cap made short so that the test waits little.
    monkeypatch.setattr(durable._lease, "MAX_STALE_AFTER", 2 * STALE)
    f = durable.cached(str(Path(local.url).parent / "cache"), on_incomplete="wait",
                       stale_after=STALE, timeout=30)(_identity)
    _plant_lease(f.entry(1), stated)
    with pytest.raises(IncompleteExistsError, match="abandoned") as waited:
        f(1)
    assert f"stale after {2 * STALE if capped else STALE:g} s" in str(waited.value)


def _identity(x: int) -> int:
    return x


def test_a_lease_must_not_outlast_what_waiters_wait(local: Place) -> None:
    for bad in (math.inf, durable._lease.MAX_STALE_AFTER * 2):
        with pytest.raises(ValueError, match="at most"):
            local.lease(stale_after=bad)
        with pytest.raises(ValueError, match="at most"):
            durable.cached(local.url, stale_after=bad)(_identity)
