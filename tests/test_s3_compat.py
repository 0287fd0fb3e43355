"""Quirks of S3-compatible stores that are not AWS S3 (MinIO, Ceph RGW, Cloudflare R2,
Backblaze B2, Wasabi, AIStore), each emulated by the fault proxy in front of moto: durable
falls back where it safely can and says what it then guarantees, or refuses naming the
object, what it expected and what it found; it never returns a short or error body as data
nor commits one COMPLETE."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

from durable import (
    Entry,
    IntegrityError,
    Lease,
    State,
    UnsupportedError,
    atomic_write,
    open_verified,
    read_verified,
)
from durable import _background as background
from durable._checksum import crc32c
from durable._fragments import FragmentRecorder
from durable._scan import scan
from durable.adapters import _s3_light, adapter_for_fs
from durable.adapters.s3 import MIN_PART_SIZE, S3Adapter
from durable.testing import faults
from durable.testing.faults import FaultProxy, Match
from durable.testing.pytest_plugin import Bucket

pytestmark = pytest.mark.s3


@pytest.fixture
def store(s3_bucket: Bucket) -> Iterator[tuple[FaultProxy, dict[str, Any]]]:
    """A fault proxy in front of moto and storage options through it, probed afresh: what
    durable learns of an endpoint is kept per URL, and an earlier proxy may have had this
    port."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        S3Adapter.forget_endpoint(proxy.url)
        yield proxy, {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        S3Adapter.forget_endpoint(proxy.url)


def _in_parts(options: dict[str, Any]) -> S3Adapter:
    """The adapter every writer with ``options`` gets (one per filesystem instance), with
    S3's smallest part size: 11 MiB go in three parts."""
    adapter = adapter_for_fs(fsspec.filesystem("s3", **options))
    assert isinstance(adapter, S3Adapter)
    adapter.part_size = MIN_PART_SIZE
    return adapter


def _with_header(name: str) -> Match:
    return Match(where=lambda request: name in request.headers)


def _sent_with(proxy: FaultProxy, header: str) -> int:
    return sum(1 for r in proxy.requests if header in r.headers)


# --- conditional writes not implemented ----------------------------------------------------

# A store answers a header it lacks with 501 NotImplemented ("A header you provided implies
# functionality that is not implemented", S3's own wording), some gateways with 400.
REFUSALS = [(501, "NotImplemented"), (400, "InvalidArgument")]


@pytest.mark.parametrize(("status", "code"), REFUSALS)
def test_an_endpoint_refusing_if_none_match_falls_back_and_says_so(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]], status: int,
        code: str) -> None:
    proxy, options = store
    proxy.add(faults.error(status, code, "A header you provided implies functionality that "
                           "is not implemented", match=_with_header("if-none-match")))
    entry = Entry(s3_bucket.path("ds"), storage_options=options)
    with entry.writing() as w:
        w.write_bytes("part-0", b"tokens")
    assert entry.state() is State.COMPLETE
    with atomic_write(s3_bucket.path("ckpt.pt"), storage_options=options) as f:
        f.write(b"weights")
    assert read_verified(s3_bucket.path("ckpt.pt"), storage_options=options) == b"weights"

    caps = entry.adapter.capabilities
    assert caps.create_only is False
    assert f"refuses If-None-Match (HTTP {status} {code}" in caps.note
    assert _sent_with(proxy, "if-none-match") == 1  # the probe alone: never sent again
    # Create-only is the HEAD check the guarantees promise there, nothing more.
    with pytest.raises(FileExistsError, match=r"ckpt\.pt already exists"):
        entry.adapter.put(s3_bucket.path("ckpt.pt"), b"other", create_only=True)
    assert read_verified(s3_bucket.path("ckpt.pt"), storage_options=options) == b"weights"
    with pytest.raises(UnsupportedError, match=f"refuses If-None-Match .HTTP {status}"):
        Lease(s3_bucket.path("ds"), storage_options=options).acquire()


@pytest.mark.parametrize(("status", "code"), REFUSALS)
def test_an_endpoint_refusing_if_match_has_no_leases_and_says_why(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]], status: int,
        code: str) -> None:
    proxy, options = store
    # Refused on writes only: reads pinned by If-Match work on every store durable supports.
    proxy.add(faults.error(status, code, "Not implemented", match=Match(
        methods=("PUT", "DELETE"), where=lambda request: "if-match" in request.headers)))
    entry = Entry(s3_bucket.path("ds"), storage_options=options)
    with entry.writing() as w:
        w.write_bytes("part-0", b"tokens")
    with pytest.raises(UnsupportedError, match=rf"refuses If-Match \(HTTP {status} {code}"):
        Lease(entry).acquire()
    adapter = entry.adapter
    assert adapter.supports_conditional(s3_bucket.path("x")) is False
    assert adapter.capabilities.conditional_writes is False
    # Leases are out; everything else goes on: a best-effort lease, the entry's reads.
    with Lease(entry, best_effort=True):
        pass
    assert entry.state() is State.COMPLETE


# --- answers missing what durable checks ---------------------------------------------------

def test_a_head_without_content_length_is_named_never_a_key_error(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = store
    entry = Entry(s3_bucket.path("ds"), storage_options=options)
    with entry.writing() as w:
        w.write_bytes("part-0", b"tokens")
    # A gateway that leaves Content-Length off its HEAD answers (chunked framing instead).
    proxy.add(faults.strip_headers("^content-length$", method="HEAD"))
    for check in (entry.state, lambda: entry.adapter.info(s3_bucket.path("ds", "part-0"))):
        with pytest.raises(IntegrityError, match=r"ds/(\.durable/commit\.json|part-0): HEAD "
                           r"answered without a Content-Length") as caught:
            check()
        assert caught.value.found is None
    # A GET without one: each read path names it (a pinned read said "the store answers
    # Content-Length -1").
    proxy.clear()
    proxy.add(faults.strip_headers("^content-length$", method="GET", path=r"/ds/part-0$"))
    url = s3_bucket.path("ds", "part-0")
    with pytest.raises(IntegrityError, match=r"part-0: GET answered without a Content-Length"):
        read_verified(url, storage_options=options)
    with pytest.raises(IntegrityError, match=r"part-0: GET of 6 bytes from byte 0 answered "
                       "without a Content-Length"), \
            open_verified(url, storage_options=options) as f:
        f.read()
    proxy.clear()
    # A PUT answered without the CRC32C sent is checked by a HEAD: without a size, refused.
    proxy.add(faults.strip_headers("^content-length$", method="HEAD"))
    proxy.add(faults.strip_headers(method="PUT"))
    with pytest.raises(IntegrityError, match=r"ckpt: HEAD( after write)? answered without a "
                       "Content-Length"), \
            atomic_write(s3_bucket.path("ckpt"), storage_options=options) as f:
        f.write(b"weights")


# --- listings ------------------------------------------------------------------------------

def _pages_by_marker_only(bucket: str, keys: int) -> faults.RewriteBody:
    """A store that pages ``keys`` keys at a time and answers ListObjectsV2 as the original
    ListObjects: no continuation token, no KeyCount; it goes on from a ``marker``."""
    def page(body: bytes) -> bytes:
        found = re.findall(rb"<Contents>.*?</Contents>", body, flags=re.S)
        body = re.sub(rb"<(NextContinuationToken|KeyCount)>.*?</\1>", b"", body)
        if len(found) <= keys:
            return body
        for cut in found[keys:]:
            body = body.replace(cut, b"", 1)
        return re.sub(rb"<IsTruncated>false</IsTruncated>", b"<IsTruncated>true</IsTruncated>",
                      body)

    return faults.rewrite_body(page, match=Match(
        methods="GET", where=lambda request: request.path.strip("/") == bucket))


def test_a_store_paging_without_continuation_tokens_is_listed_whole(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    proxy, options = store
    proxy.add(_pages_by_marker_only(s3_bucket.name, 3))
    entry = Entry(s3_bucket.path("ds"), storage_options=options)
    with entry.writing() as w:
        for i in range(7):
            w.write_bytes(f"part-{i}", b"tokens %d" % i)
    assert entry.state() is State.COMPLETE
    assert entry.verify(deep=True).objects == 7
    # Records listed through obstore, which stops at the first page without a token: a
    # page's worth is asked again of s3fs (S3's pages hold 1000 keys; this store's 3).
    monkeypatch.setattr(_s3_light, "_PAGE", 3)
    adapter = entry.adapter
    records = s3_bucket.path("ds", ".durable", "fragments")
    for i in range(5):
        adapter.put(f"{records}/{i}.json", b"{}")
    assert sorted(adapter.list(records)) == [f"{i}.json" for i in range(5)]
    listings = [r for r in proxy.requests if r.method == "GET" and not r.key]
    assert any("marker" in r.query for r in listings)  # went on by ListObjects' Marker


def _unlisted(key: str) -> Any:
    """A listing body without ``key``: a store whose listing lags a PUT that returned."""
    return lambda body: re.sub(rb"<Contents><Key>" + re.escape(key.encode()) +
                               rb"</Key>.*?</Contents>", b"", body, flags=re.S)


def test_a_listing_that_lags_the_writes_neither_fails_nor_shortens_a_commit(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = store
    entry = Entry(s3_bucket.path("ds"), storage_options=options)
    with entry.writing() as w:
        w.write_bytes("part-0", b"tokens 0")
        w.write_bytes("part-1", b"tokens 1")
        proxy.add(faults.rewrite_body(_unlisted("ds/part-1"), method="GET",
                                      query="list-type"))
    proxy.clear()  # the listing caught up
    assert entry.state() is State.COMPLETE
    report = entry.verify(deep=True)
    assert report.objects == 2 and not report.problems  # part-1 is in the manifest
    # One truly gone is still refused, naming it.
    gone = Entry(s3_bucket.path("gone"), storage_options=options)
    with pytest.raises(IntegrityError, match=r"gone/part-1: written by this writer but "
                       "gone at commit"), gone.writing() as w:
        w.write_bytes("part-0", b"tokens 0")
        w.write_bytes("part-1", b"tokens 1")
        gone.adapter.delete([s3_bucket.path("gone", "part-1")])
    assert gone.state() is not State.COMPLETE


# --- checksums -----------------------------------------------------------------------------

@pytest.mark.parametrize(("status", "code"), REFUSALS)
def test_an_endpoint_refusing_the_full_object_checksum_type_still_takes_large_objects(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]], status: int,
        code: str) -> None:
    # FULL_OBJECT came to S3 in December 2024; a store without it refuses the header.
    proxy, options = store
    proxy.add(faults.error(status, code, "x-amz-checksum-type is not implemented",
                           match=_with_header("x-amz-checksum-type")))
    adapter = _in_parts(options)
    data = os.urandom(2 * MIN_PART_SIZE + 1000)  # three parts
    for name in ("a.pt", "b.pt"):
        url = s3_bucket.path(name)
        with atomic_write(url, storage_options=options) as f:
            f.write(data)
        assert read_verified(url, storage_options=options) == data
    # Refused once, then never sent again; each part's CRC32C still was.
    assert _sent_with(proxy, "x-amz-checksum-type") == 1
    assert sum(1 for r in proxy.requests if "partNumber" in r.query) == 6
    assert f"refuses the FULL_OBJECT checksum type (HTTP {status} {code}" in \
        adapter.capabilities.note


def test_a_part_answered_without_an_etag_is_named_and_the_upload_aborted(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]], boto: Any) -> None:
    proxy, options = store
    _in_parts(options)
    proxy.add(faults.rewrite_etag("missing", method="PUT", query="partNumber", times=1))
    with pytest.raises(IntegrityError, match=r"big: UploadPart \d+ answered without an ETag"), \
            atomic_write(s3_bucket.path("big"), storage_options=options) as f:
        f.write(os.urandom(2 * MIN_PART_SIZE + 1000))
    assert "Contents" not in boto.list_objects_v2(Bucket=s3_bucket.name)
    assert not boto.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads")


# --- removing ------------------------------------------------------------------------------

# No multi-object delete (501), or one that insists on the Content-MD5 botocore replaced by
# a CRC32 in 2025 (400).
@pytest.mark.parametrize(("status", "code"), [(501, "NotImplemented"),
                                              (400, "MissingContentMD5")])
def test_an_endpoint_refusing_delete_objects_has_objects_deleted_one_by_one(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]], boto: Any, status: int,
        code: str) -> None:
    proxy, options = store
    entry = Entry(s3_bucket.path("ds"), storage_options=options)
    with entry.writing() as w:
        for i in range(3):
            w.write_bytes(f"part-{i}", b"tokens")
    background.wait()  # the commit's own housekeeping done: one delete at a time below
    proxy.clear_requests()
    proxy.add(faults.error(status, code, "DeleteObjects is not implemented", method="POST",
                           query="delete"))
    with entry.writing(overwrite=True) as w:
        w.write_bytes("part-0", b"other tokens")
    assert entry.state() is State.COMPLETE
    assert entry.verify(deep=True).objects == 1
    entry.delete()
    assert entry.state() is State.ABSENT
    left = [o["Key"] for o in boto.list_objects_v2(Bucket=s3_bucket.name).get("Contents", [])]
    assert [k for k in left if k.startswith(("ds/", ".durable/ds/"))] == []
    assert sum(1 for r in proxy.requests if "delete" in r.query) == 1  # refused once


def test_an_endpoint_ignoring_if_none_match_on_complete_never_claims_a_create_only_upload(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]], boto: Any) -> None:
    # A store that takes If-None-Match on PutObject but not on CompleteMultipartUpload (S3
    # added the two together in 2024; a store may have only the first).
    proxy, options = store

    def strip_on_complete(request: faults.RequestInfo) -> bool:
        if request.method == "POST" and "uploadId" in request.query:
            request.headers.remove("if-none-match")
        if request.path.endswith("/ckpt.pt") and request.query.get("partNumber") == ["3"]:
            # Another writer's object, landed after this writer's look before publishing,
            # while its last part goes out: create-only must lose to it.
            boto.put_object(Bucket=s3_bucket.name, Key="ckpt.pt", Body=b"first")
        return False

    proxy.add(faults.delay(0, match=Match(where=strip_on_complete)))
    adapter = _in_parts(options)
    url = s3_bucket.path("ckpt.pt")
    with pytest.raises(FileExistsError, match=r"ckpt\.pt already exists"), \
            atomic_write(url, storage_options=options, mode="xb") as f:
        f.write(os.urandom(2 * MIN_PART_SIZE + 1000))  # a multipart upload
    assert boto.get_object(Bucket=s3_bucket.name, Key="ckpt.pt")["Body"].read() == b"first"
    assert not boto.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads")
    assert "If-None-Match on CompleteMultipartUpload: this endpoint ignores it" in \
        adapter.capabilities.note
    # A new name is still written whole.
    data = os.urandom(2 * MIN_PART_SIZE + 1000)
    with atomic_write(s3_bucket.path("new.pt"), storage_options=options, mode="xb") as f:
        f.write(data)
    assert read_verified(s3_bucket.path("new.pt"), storage_options=options) == data


def test_a_listing_that_lags_a_workers_writes_neither_fails_nor_shortens_a_commit(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]]) -> None:
    # As a dask worker writes: the object, then its record in a fragment of the attempt.
    proxy, options = store
    entry = Entry(s3_bucket.path("ds"), storage_options=options)
    with entry.writing() as w:
        w.write_bytes("part-0", b"tokens 0")
        data = b"a worker's tokens"
        entry.adapter.put(s3_bucket.path("ds", "part-1"), data)
        worker = FragmentRecorder(entry.url, options, w.attempt)
        worker.record("part-1", len(data), crc32c(data))
        worker.flush()
        proxy.add(faults.rewrite_body(_unlisted("ds/part-1"), method="GET",
                                      query="list-type"))
    proxy.clear()
    report = entry.verify(deep=True)
    assert report.objects == 2 and not report.problems


# --- listings without ETags ----------------------------------------------------------------

def _listing(request: faults.RequestInfo) -> bool:
    return request.method == "GET" and "list-type" in request.query


def _no_etags(body: bytes) -> bytes:
    return re.sub(rb"<ETag>[^<]*</ETag>", b"", body)


def test_a_listing_without_etags_is_completed_by_heads(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]], boto: Any) -> None:
    """A gateway whose ListObjectsV2 leaves the ETags off: every commit, verify and scan of
    an entry was refused ("no usable ETag"). Each object listed so is stat-ed (HEAD), and
    its ETag still pins reads and catches an object replaced behind the listing."""
    proxy, options = store
    proxy.add(faults.rewrite_body(_no_etags, match=Match(where=_listing)))
    url = s3_bucket.path("ent")
    data = {f"c/{i}": os.urandom(1000 + i) for i in range(3)}
    with Entry(url, storage_options=options).writing() as w:
        for k, v in data.items():
            w.write_bytes(k, v)
    listings = [r for r in proxy.requests if r.method == "GET" and "list-type" in r.query]
    assert listings and all("rewrite_body" in r.faults for r in listings)
    e = Entry(url, storage_options=options)
    assert e.state() is State.COMPLETE
    assert e.verify(deep=True).ok
    assert read_verified(s3_bucket.path("ent", "c/1"), storage_options=options) == data["c/1"]
    (row,) = scan(url, storage_options=options)
    assert row.state == "COMPLETE"
    adapter = _in_parts(options)
    listed = adapter.list(f"{s3_bucket.name}/ent")["c/2"]
    boto.put_object(Bucket=s3_bucket.name, Key="ent/c/2", Body=b"other bytes")
    with pytest.raises(IntegrityError, match="replaced since it was listed"):
        adapter.read_range(listed.path, listed, 0, 10)


def test_a_listing_and_head_without_etags_is_a_clear_error(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = store
    with atomic_write(s3_bucket.path("d", "obj.bin"), storage_options=options) as f:
        f.write(b"payload")
    proxy.add(faults.rewrite_body(_no_etags, match=Match(where=_listing)))
    proxy.add(faults.rewrite_etag("missing", method="HEAD"))
    with pytest.raises(IntegrityError) as info:
        _in_parts(options).list(f"{s3_bucket.name}/d")
    message = str(info.value)
    assert "d/obj.bin" in message and proxy.url in message
    assert "lists objects without an ETag" in message and "send ETags" in message


# --- flexible checksums refused ------------------------------------------------------------

def _uploads_with_any_checksum_header(request: faults.RequestInfo) -> bool:
    """A request that uploads (PUT, POST) with any ``x-amz-checksum-*`` header: what B2
    and OVH refuse ("Unsupported header 'x-amz-checksum-crc32' received for this API
    call"); a GET's ``x-amz-checksum-mode`` they ignore."""
    return request.method in ("PUT", "POST") and any(
        name.lower().startswith("x-amz-checksum-") and name.lower() != "x-amz-checksum-mode"
        for name, _ in request.headers.items())


def _sent_md5(proxy: FaultProxy) -> int:
    return sum(1 for r in proxy.requests if "content-md5" in r.headers)


@pytest.mark.parametrize(("status", "code"), REFUSALS)
@pytest.mark.parametrize("large_first", [False, True])
def test_an_endpoint_refusing_the_crc32c_header_takes_content_md5_instead(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]], status: int,
        code: str, large_first: bool) -> None:
    """A store without CRC32C (it takes botocore's default CRC32): every write failed with
    its 400/501 and no advice. Each upload is sent again with Content-MD5, which the store
    checks as well, and the header is never sent there again."""
    proxy, options = store
    proxy.add(faults.error(status, code, "Unsupported header 'x-amz-checksum-crc32c' "
                           "received for this API call.",
                           match=_with_header("x-amz-checksum-crc32c")))
    adapter = _in_parts(options)
    small, large = os.urandom(100_000), os.urandom(2 * MIN_PART_SIZE + 1000)
    writes = [("small.bin", small), ("large.bin", large), ("again.bin", small)]
    for name, data in (writes[1::-1] + writes[2:] if large_first else writes):
        with atomic_write(s3_bucket.path(name), storage_options=options) as f:
            f.write(data)
        assert read_verified(s3_bucket.path(name), storage_options=options) == data
    # Refused once (or by each of the 3 parts in the air at once, of an upload created
    # with ChecksumAlgorithm), then never sent again.
    assert _sent_with(proxy, "x-amz-checksum-crc32c") == (3 if large_first else 1)
    # Every request sent again, and each later one, with its MD5: 3 parts, 2 PutObjects.
    assert _sent_md5(proxy) == 5
    assert f"refuses x-amz-checksum-crc32c (HTTP {status} {code}" in adapter.capabilities.note


def test_an_endpoint_refusing_every_flexible_checksum_says_what_to_configure(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]]) -> None:
    """A store that refuses every x-amz-checksum-* header: botocore adds its own CRC32 to
    the request sent again with Content-MD5, so that one is refused too. The error names
    the object, what was refused, and the setting that makes the Content-MD5 go alone; with
    it, objects of every size are written, the store checking each MD5."""
    proxy, options = store
    proxy.add(faults.error(400, "InvalidArgument", "Unsupported header "
                           "'x-amz-checksum-crc32' received for this API call.",
                           match=Match(where=_uploads_with_any_checksum_header)))
    url = s3_bucket.path("small.bin")
    with pytest.raises(OSError) as info, atomic_write(url, storage_options=options) as f:
        f.write(b"payload")
    message = str(info.value)
    assert message.startswith(f"{url}: PutObject answered HTTP 400 InvalidArgument")
    assert "x-amz-checksum-crc32c" in message and "Content-MD5" in message
    assert "'request_checksum_calculation': 'when_required'" in message

    configured = {**options, "config_kwargs": {"request_checksum_calculation": "when_required"}}
    adapter = _in_parts(configured)
    small, large = os.urandom(100_000), os.urandom(2 * MIN_PART_SIZE + 1000)
    # The large one first: its CreateMultipartUpload is refused (ChecksumAlgorithm), and
    # created again without it.
    for name, data in (("large.bin", large), ("small.bin", small)):
        with atomic_write(s3_bucket.path(name), storage_options=configured) as f:
            f.write(data)
        assert read_verified(s3_bucket.path(name), storage_options=configured) == data
    # Refused with FULL_OBJECT, then without it, then created without ChecksumAlgorithm:
    # only the refusal of the CRC32C header is noted (not FULL_OBJECT's).
    assert [r.status for r in proxy.requests
            if r.method == "POST" and "uploads" in r.query] == [400, 400, 200]
    assert "refuses x-amz-checksum-crc32c" in adapter.capabilities.note
    assert "FULL_OBJECT" not in adapter.capabilities.note
    with Entry(s3_bucket.path("ent"), storage_options=configured).writing() as w:
        w.write_bytes("a", small)
    assert Entry(s3_bucket.path("ent"), storage_options=configured).verify(deep=True).ok


@pytest.mark.parametrize(("status", "code"), REFUSALS)
def test_an_endpoint_refusing_checksum_mode_on_reads_is_read_without_it(
        s3_bucket: Bucket, store: tuple[FaultProxy, dict[str, Any]], status: int,
        code: str) -> None:
    """A store that answers x-amz-checksum-mode (asked on every whole GET and on the HEAD
    after a write) as an unsupported header: every read failed ("GET answered HTTP 400"),
    with no word of what to do. botocore adds the header by itself: the error says which
    setting stops that; with it, durable asks without the header once refused, never sends
    it there again, and its records check what is read."""
    proxy, options = store
    proxy.add(faults.error(status, code, "Unsupported header 'x-amz-checksum-mode' received "
                           "for this API call.", match=_with_header("x-amz-checksum-mode")))
    small, large = os.urandom(100_000), os.urandom(2 * MIN_PART_SIZE + 1000)
    url = s3_bucket.path("small.bin")
    with atomic_write(url, storage_options=options) as f:
        f.write(small)
    with pytest.raises(OSError) as info:
        read_verified(url, storage_options=options)
    assert str(info.value).startswith(f"{url}: GET answered HTTP {status} {code}")
    assert "'response_checksum_validation': 'when_required'" in str(info.value)

    configured = {**options,
                  "config_kwargs": {"response_checksum_validation": "when_required"}}
    adapter = _in_parts(configured)
    proxy.clear_requests()
    for name, data in (("small.bin", small), ("large.bin", large)):
        url = s3_bucket.path(name)
        with atomic_write(url, storage_options=configured) as f:
            f.write(data)
        assert read_verified(url, storage_options=configured) == data
        with open_verified(url, storage_options=configured) as f:
            assert f.read() == data
        assert Entry(url, storage_options=configured).verify(deep=True).ok
    assert _sent_with(proxy, "x-amz-checksum-mode") == 1
    assert f"refuses x-amz-checksum-mode (HTTP {status}" in adapter.capabilities.note
