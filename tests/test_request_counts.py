"""Requests the commit protocol makes on S3, pinned: on object stores each one is a round
trip (and on moto, CPU), so a change that adds one should be seen and justified.

Counted through the fault proxy (no fault injected) in front of the moto server. The
comments say what each request is for; a count going down is good news: update it.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

import durable
from durable.testing.faults import FaultProxy, RequestRecord
from durable.testing.pytest_plugin import Bucket

pytestmark = pytest.mark.s3


def _kind(r: RequestRecord) -> str:
    if r.method == "GET" and "list-type" in r.query:
        return "LIST"
    if r.method == "POST" and "delete" in r.query:
        return "DELETE"
    return r.method



def _counts(proxy: FaultProxy, skip: str | None = None) -> dict[str, int]:
    kinds = collections.Counter(_kind(r) for r in proxy.requests
                                if skip is None or skip not in r.path)
    proxy.clear_requests()
    return dict(kinds)


def test_a_fresh_entry_write_on_s3(s3_bucket: Bucket,
                                   proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = proxied
    entry = durable.Entry(s3_bucket.path("e"), storage_options=options)
    with entry.writing() as w:
        # Start: PUT of the attempt record, then (at once) a LIST of the records (no
        # marker, no other writer) and one LIST of the entry's name with delimiter "/" (no
        # object there and none below it).
        assert _counts(proxy) == {"LIST": 2, "PUT": 1}
        w.write_bytes("a", b"1" * 100)
        w.write_bytes("b/c", b"2" * 100)
        assert _counts(proxy) == {"PUT": 2}  # the data, nothing else
    # Commit: LIST of the records (another writer's marker, this attempt's fragments),
    # LIST of the entry (what is there vs what was written), the create-only marker PUT,
    # one DeleteObjects for the attempt record (and fragments).
    assert _counts(proxy) == {"LIST": 2, "PUT": 1, "DELETE": 1}
    assert entry.state() is durable.State.COMPLETE
    # A reader's status: the marker, then the first and last objects of its manifest.
    assert _counts(proxy) == {"GET": 1, "HEAD": 2}


def test_state_of_an_entry_with_an_external_manifest_on_s3(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """state() of an entry whose manifest is external (over 10,000 objects; here 6) GETs
    the marker and HEADs the manifest and its first and last objects, named by the
    marker's summary: it no longer GETs the manifest (5.4 MB for 100,000 objects, parsed
    at every state()). verify() still does, once."""
    import durable._protocol as protocol

    proxy, options = proxied
    monkeypatch.setattr(protocol, "INLINE_MANIFEST_OBJECTS", 3)
    entry = durable.Entry(s3_bucket.path("wide"), storage_options=options)
    with entry.writing() as w:
        for i in range(6):
            w.write_bytes(f"k/{i}", b"x" * (i + 1))
    proxy.clear_requests()
    assert entry.state() is durable.State.COMPLETE
    manifest = [r for r in proxy.requests if "/manifest-" in r.path]
    assert _counts(proxy) == {"GET": 1, "HEAD": 3}
    assert [r.method for r in manifest] == ["HEAD"]
    assert entry.verify().objects == 6
    # The marker and the manifest (the data's sizes from one LIST).
    assert _counts(proxy) == {"GET": 2, "LIST": 1}


def test_a_zarr_write_on_s3_adds_a_fixed_number_of_requests(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    import durable.zarr as dz

    proxy, options = proxied
    data = np.arange(64 * 64, dtype="f4").reshape(64, 64)
    for name, chunks in (("small", (32, 32)), ("large", (8, 8))):
        dz.write(s3_bucket.path(name), data, chunks=chunks, storage_options=options)
        per_chunk = collections.Counter(r.method for r in proxy.requests if "/c/" in r.path)
        assert per_chunk == {"PUT": (64 // chunks[0]) ** 2}
        # Besides one PUT per chunk: the 3 requests of writing()'s start; at publish
        # zarr.json's PUT into the entry (plain zarr's own PUT) and beside it a LIST of
        # the records (this attempt's alone: nobody started or cleared the entry since,
        # so the commit takes the manifest from what was recorded, with no LIST of the
        # entry, one per 1,000 chunks); the marker PUT and DeleteObjects (of the attempt
        # record): 7, whatever the number of chunks (plain zarr makes 3: a HEAD and a LIST
        # looking for an existing array, the zarr.json PUT). Gone: zarr's look (2 GETs; a
        # fresh write answers it from what it holds), the document's PUT into staging
        # and its GET at publish (it is held in memory, never staged: nobody else needs
        # it), and every LIST of the entry's objects.
        assert not [r for r in proxy.requests if "/staged" in r.path], name
        assert not [r for r in proxy.requests if "list-type" in r.query and "delimiter"
                    not in r.query and r.query["prefix"] == [f"{name}/"]], name
        assert _counts(proxy, skip="/c/") == {"LIST": 3, "PUT": 3, "DELETE": 1}, name
        assert dz.open(s3_bucket.path(name), storage_options=options)[...].tolist() == \
            data.tolist()
        proxy.clear_requests()


def test_a_zarr_write_that_stages_adds_the_staging_requests(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    """`writing()` stages eagerly (a killed writer can be resumed on its metadata), and a
    deferred write stages at its first hand-off: both pay the staging PUT and the records
    LIST at publish (another writer's marker, what is staged), and the DeleteObjects of
    the staged copies before the marker: 10."""
    import pickle

    import zarr

    import durable.zarr as dz

    proxy, options = proxied
    data = np.arange(64 * 64, dtype="f4").reshape(64, 64)
    with dz.writing(s3_bucket.path("eager"), storage_options=options) as store:
        zarr.create_array(store, data=data, chunks=(32, 32))
    assert _counts(proxy, skip="/c/") == {"LIST": 4, "PUT": 4, "DELETE": 2}
    with dz.writing(s3_bucket.path("handed"), storage_options=options,
                    stage="on_handoff") as store:
        zarr.create_array(store, data=data, chunks=(32, 32))
        assert _counts(proxy, skip="/c/") == {"LIST": 2, "PUT": 1}  # the start only
        pickle.dumps(store)
        assert _counts(proxy, skip="/c/") == {"PUT": 1}  # zarr.json into staging
        pickle.dumps(store)
        assert _counts(proxy, skip="/c/") == {}  # handed off already
    # The publish as an eager write's: records and entry LISTs, zarr.json's PUT (no GET:
    # listed with the ETag the hand-off's PUT got); the staged copy's DeleteObjects; the
    # marker; DeleteObjects (the attempt record).
    assert _counts(proxy, skip="/c/") == {"LIST": 2, "PUT": 2, "DELETE": 2}
    for name in ("eager", "handed"):
        assert dz.open(s3_bucket.path(name), storage_options=options)[...].tolist() == \
            data.tolist()


def test_atomic_write_and_read_verified_on_s3(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = proxied
    url = s3_bucket.path("d", "obj.bin")
    with durable.atomic_write(url, storage_options=options) as f:
        f.write(b"x" * 1000)
    # One PutObject carrying the record (size, CRC32C) in its own metadata: no marker to
    # write, and the store echoes the CRC32C it checked (verify "size" and "probe" need no
    # HEAD). Before it, one GET of the marker of the folder above ("d"): a committed entry
    # there would be changed by the write (every level above at once: one round trip; none
    # for a write into a folder seen clear in the last seconds, see test_cached).
    assert _counts(proxy) == {"GET": 1, "PUT": 1}
    assert durable.read_verified(url, storage_options=options) == b"x" * 1000
    # One GET: its headers carry the record, its body is checked against it.
    assert _counts(proxy) == {"GET": 1}


def test_a_1_mib_atomic_write_and_its_readers_on_s3(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = proxied
    url = s3_bucket.path("d", "one.bin")
    data = bytes(range(256)) * 4096
    with durable.atomic_write(url, storage_options=options, verify="size") as f:
        f.write(data)
    assert _counts(proxy) == {"GET": 1, "PUT": 1}  # the GET: the marker of "d", above
    assert durable.read_verified(url, storage_options=options) == data
    assert _counts(proxy) == {"GET": 1}
    with durable.open_verified(url, storage_options=options) as f:
        assert f.read() == data
    # The HEAD carries the record; one GET of the bytes.
    assert _counts(proxy) == {"HEAD": 1, "GET": 1}
    assert durable.Entry(url, storage_options=options).state() is durable.State.COMPLETE
    # No marker (a GET answered 404), then the HEAD that carries the record.
    assert _counts(proxy) == {"GET": 1, "HEAD": 1}
