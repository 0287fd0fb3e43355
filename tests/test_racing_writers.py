"""Two fresh writers starting on one entry at once: at most one of them writes (incident 001).

Found by a user-scenario probe: two processes ran `durable.zarr.writing(url)` on one fresh
URL at the same moment. Both looked (no marker, no writer), then both announced themselves
and wrote; one committed, and the other's chunks, landing after that commit, overwrote the
winner's: COMPLETE, and plain zarr read a mix of both writers' values. A writer that
expects the entry absent now PUTs its attempt record first and only then lists the
records, so of two racing writers at most one gets past the start.

The races run in real processes started once per test and driven over pipes: both are
told "go" at once, each answers "started" or "refused". What the tests check is read
around durable, with plain fsspec and plain zarr.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import pytest
import zarr

import durable
from _race_child import CHUNKS, OBJECTS, SHAPE, RaceChild, payload
from conftest import Place
from durable import AlreadyCompleteError, Entry, IncompleteExistsError, MarkerError, State
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket

VALUES = (1, 2)  # child i writes VALUES[i]


@pytest.fixture(params=["entry", "zarr"])
def racers(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[RaceChild]]]:
    kids = [RaceChild(request.param) for _ in VALUES]
    yield request.param, kids
    for kid in kids:
        kid.close()


def _plain_fs(url: str, options: dict[str, Any] | None) -> Any:
    """fsspec with no cache shared with durable: what is there, seen around durable."""
    return fsspec.core.url_to_fs(url, skip_instance_cache=True, **(options or {}))[0]


def _files(fs: Any, url: str) -> set[str]:
    fs.invalidate_cache()
    path = fs._strip_protocol(url).rstrip("/")
    return {p[len(path) + 1:] for p in fs.find(path)}


def _records(fs: Any, url: str) -> set[str]:
    parent, _, name = url.rstrip("/").rpartition("/")
    return _files(fs, f"{parent}/.durable/{name}")


def _holds_only(mode: str, fs: Any, url: str, options: dict[str, Any] | None,
                value: int) -> None:
    """The entry is COMPLETE, verifies deep, and holds the writer of ``value``'s data only."""
    entry = Entry(url, storage_options=options)
    assert entry.state() is State.COMPLETE
    assert entry.verify(deep=True).ok
    assert _records(fs, url) == {"commit.json"}  # no attempt record left behind
    if mode == "entry":
        assert _files(fs, url) == {f"o/{i}" for i in range(OBJECTS)}
        path = fs._strip_protocol(url).rstrip("/")
        for i in range(OBJECTS):
            assert fs.cat_file(f"{path}/o/{i}") == payload(value, i), i
    else:
        # Plain zarr, as a user without durable reads it: one writer's values, never a mix.
        arr = zarr.open_array(url, mode="r", storage_options=options)
        assert arr.shape == SHAPE and arr.chunks == CHUNKS
        assert np.unique(arr[...]).tolist() == [value]


def _race(mode: str, kids: list[RaceChild], fs: Any, url: str,
          options: dict[str, Any] | None, outcomes: collections.Counter[str]) -> None:
    """One round: both start at once; whoever got past the start writes and commits."""
    for kid, value in zip(kids, VALUES, strict=True):
        kid.send(f"prep {url} {value} {json.dumps(options or {})}")
    for kid in kids:
        assert kid.answer() == "ready"
    for kid in kids:  # both blocked on their pipe: released together
        kid.send("go")
    starts = [kid.answer() for kid in kids]
    started = [i for i, s in enumerate(starts) if s == "started"]
    assert len(started) <= 1, f"both writers got past the start of {url}: {starts}"
    # The other saw a writer at work: refused as INCOMPLETE, never as anything else.
    assert all(s in ("started", "refused IncompleteExistsError") for s in starts), starts
    if not started:
        # A tight race: both saw each other's record and refused. Each removed its own
        # record, so the entry is ABSENT and a retry starts.
        outcomes["both refused"] += 1
        assert Entry(url, storage_options=options).state() is State.ABSENT
        assert _records(fs, url) == set()
        kids[0].send("go")
        assert kids[0].answer() == "started"
        started = [0]
    else:
        outcomes["one started"] += 1
    winner = started[0]
    kids[winner].send("write")
    assert kids[winner].answer() == "won"
    _holds_only(mode, fs, url, options, VALUES[winner])


def test_two_fresh_writers_on_local_disk_never_both_write(
        racers: tuple[str, list[RaceChild]], tmp_path: os.PathLike[str]) -> None:
    mode, kids = racers
    outcomes: collections.Counter[str] = collections.Counter()
    fs = _plain_fs(str(tmp_path), None)
    for round_ in range(20):
        _race(mode, kids, fs, os.path.join(os.path.realpath(tmp_path), f"r{round_}.zarr"),
              None, outcomes)
    assert sum(outcomes.values()) == 20


@pytest.mark.s3
def test_two_fresh_writers_on_s3_never_both_write(racers: tuple[str, list[RaceChild]],
                                                  s3_bucket: Bucket) -> None:
    mode, kids = racers
    outcomes: collections.Counter[str] = collections.Counter()
    options = dict(s3_bucket.storage_options)
    fs = _plain_fs(s3_bucket.url, options)
    for round_ in range(5):
        _race(mode, kids, fs, s3_bucket.path(f"r{round_}.zarr"), options, outcomes)
    assert sum(outcomes.values()) == 5


# the start, step by step -------------------------------------------------------------------
def _attempts(place: Place, name: str = "ent") -> set[str]:
    return {k for k in place.files() if k.startswith(f".durable/{name}/attempts/")}


def test_a_writers_own_attempt_record_never_makes_its_start_incomplete(place: Place) -> None:
    entry = Entry(place.url("ent"))
    with entry.writing() as w:
        # Its record was written before it looked, and it still started.
        assert _attempts(place) == {f".durable/ent/attempts/{w.attempt}.json"}
        assert entry.state() is State.INCOMPLETE  # as anyone else sees it
        w.write_bytes("a", b"1")
    assert entry.state() is State.COMPLETE
    leased = Entry(place.url("leased"))
    with durable.Lease(leased) as lease, leased.writing(lease=lease) as w:
        assert _attempts(place, "leased") == {f".durable/leased/attempts/{w.attempt}.json"}
        w.write_bytes("a", b"2")
    assert leased.state() is State.COMPLETE


def test_a_refused_start_leaves_no_attempt_record_behind(place: Place) -> None:
    done = Entry(place.url("done"))
    with done.writing() as w:
        w.write_bytes("a", b"1")
    before = place.files()
    with pytest.raises(AlreadyCompleteError), done.writing():
        pass
    assert place.files() == before

    busy = Entry(place.url("busy"))
    with busy.writing() as other:
        with pytest.raises(IncompleteExistsError, match="may be at work right now"), \
                busy.writing():
            pass
        # Only the writer at work's record: the refused one removed its own, nothing else.
        assert _attempts(place, "busy") == {f".durable/busy/attempts/{other.attempt}.json"}
        other.write_bytes("a", b"2")
    assert busy.state() is State.COMPLETE

    place.write(".durable/bad/commit.json", b"{not json")
    place.write("bad/a", b"3")
    before = place.files()
    with pytest.raises(MarkerError), Entry(place.url("bad")).writing():
        pass
    assert place.files() == before



@pytest.mark.s3
def test_on_s3_the_attempt_record_is_put_before_the_records_are_listed(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    """The order the race analysis rests on, pinned; and a refusal costs one DELETE."""
    proxy, options = proxied
    entry = Entry(s3_bucket.path("e"), storage_options=options)
    with entry.writing() as w:
        steps = [("PUT" if r.method == "PUT" else "LIST records") for r in proxy.requests
                 if (r.method == "PUT" and "/attempts/" in r.path)
                 or ("list-type" in r.query and ".durable/e/" in r.query.get("prefix", [""])[0])]
        assert steps == ["PUT", "LIST records"]
        w.write_bytes("a", b"1")
    proxy.clear_requests()
    with pytest.raises(AlreadyCompleteError), entry.writing():
        pass
    assert [r.method for r in proxy.requests if r.method in ("PUT", "POST", "DELETE")] == \
        ["PUT", "POST"]  # the attempt record, and its removal (one DeleteObjects)
    assert _records(_plain_fs(entry.url, dict(s3_bucket.storage_options)),
                    entry.url) == {"commit.json"}


@pytest.mark.s3
def test_a_start_whose_own_record_was_removed_meanwhile_never_goes_on_unannounced(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    """A clean or delete of the records landing between a writer's PUT of its attempt record
    and its look removes that record: the writer must not go on without it (a third writer
    would then see nobody at work). It refuses and tries once more, and goes on announced."""
    from durable.testing import faults

    proxy, options = proxied
    entry = Entry(s3_bucket.path("e"), storage_options=options)
    plain = _plain_fs(entry.url, dict(s3_bucket.storage_options))
    records = f"{s3_bucket.name}/.durable/e"
    removed: list[str] = []

    def remove_the_record_once(request: faults.RequestInfo) -> bool:
        # The writer's first look at its records: a deleter got there just before.
        if not removed and ".durable/e/" in request.query.get("prefix", [""])[0]:
            removed.extend(plain.find(f"{records}/attempts/"))
            plain.rm(removed)
        return False

    proxy.add(faults.delay(0, match=faults.Match(methods="GET",
                                                 where=remove_the_record_once)))
    with entry.writing() as w:
        assert len(removed) == 1  # it was there, and went
        plain.invalidate_cache()
        assert plain.find(f"{records}/attempts/") == [f"{records}/attempts/{w.attempt}.json"]
        w.write_bytes("a", b"1")
    assert entry.state() is State.COMPLETE


@pytest.mark.s3
def test_a_start_whose_put_landed_but_failed_removes_its_record(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]],
        no_backoff: None) -> None:
    """The attempt record's PUT reaches the store and every answer is lost (the client
    retries, then gives up): the writer fails, and the record it cannot know landed is
    removed, so the entry is ABSENT for the next writer, not INCOMPLETE."""
    from durable.testing import faults

    proxy, options = proxied
    # Few retries: each dropped answer costs the client a wait.
    options = {**options, "config_kwargs": {"retries": {"max_attempts": 1}}}
    entry = Entry(s3_bucket.path("e"), storage_options=options)
    plain = _plain_fs(entry.url, dict(s3_bucket.storage_options))
    proxy.add(faults.drop_connection(forward=True, match=faults.Match(
        methods="PUT", path=r"/attempts/[0-9a-f]+\.json$")))
    with pytest.raises(OSError), entry.writing():
        pytest.fail("the start cannot have succeeded")
    # Forwarded to the store (so it landed), and its answers dropped.
    assert [r.method for r in proxy.requests if "/attempts/" in r.path][:1] == ["PUT"]
    assert plain.find(f"{s3_bucket.name}/.durable/e/") == []
    assert Entry(s3_bucket.path("e"), storage_options=s3_bucket.storage_options).state() \
        is State.ABSENT


@pytest.mark.parametrize("how", ["fresh", "overwrite"])
def test_an_attempt_record_removed_as_it_is_written_is_a_refusal_naming_the_entry(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """Another writer clearing the entry's records removes this writer's attempt record
    (its temp file) between its write and its rename: the writer failed with a bare
    FileNotFoundError naming only the temp file. A fresh writer tries once more; an
    overwriting one is refused, naming the entry and the record."""
    from durable.adapters.local import LocalAdapter

    url = os.path.join(os.path.realpath(tmp_path), "ent")
    original = LocalAdapter.put
    removed: list[str] = []

    def removed_meanwhile(self: LocalAdapter, path: str, data: bytes, **kw: Any) -> Any:
        if "/attempts/" in path and not removed:
            removed.append(path)
            temp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.durable-tmp-0"
            raise FileNotFoundError(2, "No such file or directory", temp)
        return original(self, path, data, **kw)

    monkeypatch.setattr(LocalAdapter, "put", removed_meanwhile)
    if how == "fresh":
        with Entry(url).writing() as w:  # the second try goes through
            w.write_bytes("a", b"1")
        assert removed and Entry(url).state() is State.COMPLETE
        return
    with pytest.raises(IncompleteExistsError) as refused, \
            Entry(url).writing(overwrite=True):
        pass  # pragma: no cover
    assert removed and Entry(url).url in str(refused.value)
    assert "attempt record" in str(refused.value)
