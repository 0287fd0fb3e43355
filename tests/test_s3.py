"""The S3 adapter against a real moto server, and against the fault proxy in front of it.

What is written through durable is checked *around* it, with a plain boto3 client on the
same server (listing multipart uploads, reading stored bytes and checksums, overwriting an
object behind durable's back), so the adapter never grades its own homework.
"""

from __future__ import annotations

import gc
import json
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

from durable import (
    Entry,
    IntegrityError,
    MarkerError,
    State,
    atomic_write,
    open_verified,
    read_verified,
)
from durable import _background as background
from durable._checksum import Checksum, crc32c, crc_to_b64
from durable._scan import scan
from durable.adapters import adapter_for_fs
from durable.adapters.s3 import MIN_PART_SIZE, PROBE_PREFIX, S3Adapter
from durable.testing import faults
from durable.testing.faults import FaultProxy, Match
from durable.testing.pytest_plugin import Bucket

pytestmark = pytest.mark.s3

PART = MIN_PART_SIZE
# Three parts (5 + 5 + 1 MiB) at the smallest part size S3 allows: multipart, kept small.
MULTI = 2 * PART + 1024 * 1024


def _adapter(storage_options: dict[str, Any]) -> S3Adapter:
    """The adapter durable resolves for these options, with the smallest part size."""
    adapter = adapter_for_fs(fsspec.filesystem("s3", **storage_options))
    assert isinstance(adapter, S3Adapter)
    adapter.part_size = PART
    return adapter


@pytest.fixture
def adapter(s3_bucket: Bucket) -> S3Adapter:
    return _adapter(s3_bucket.storage_options)


@pytest.fixture
def proxy(s3_bucket: Bucket) -> Iterator[FaultProxy]:
    with FaultProxy(upstream=s3_bucket.server.url) as p:
        yield p


@pytest.fixture
def via_proxy(s3_bucket: Bucket, proxy: FaultProxy) -> dict[str, Any]:
    """Storage options that reach the bucket through the fault proxy."""
    options = dict(s3_bucket.storage_options, endpoint_url=proxy.url)
    _adapter(options)
    return options


def _written_checksum(data: bytes) -> Checksum:
    ck = Checksum()
    ck.update(data)
    return ck


def _only(key: str) -> str:
    """A proxy path pattern for exactly this key (not the records beside it)."""
    return rf"^/[^/]+/{re.escape(key)}$"


def uploads(boto: Any, bucket: Bucket) -> list[Any]:
    return list(boto.list_multipart_uploads(Bucket=bucket.name).get("Uploads", []))


def stored(boto: Any, bucket: Bucket, key: str) -> bytes | None:
    try:
        return bytes(boto.get_object(Bucket=bucket.name, Key=key)["Body"].read())
    except boto.exceptions.NoSuchKey:
        return None


def requests(proxy: FaultProxy, method: str, key: str) -> list[faults.RequestRecord]:
    return [r for r in proxy.requests if r.method == method and r.key == key]


# --- whole objects, checksums sent --------------------------------------------------------

def test_small_object_is_one_put_carrying_its_crc32c(
        s3_bucket: Bucket, via_proxy: dict[str, Any], proxy: FaultProxy, boto: Any) -> None:
    data = os.urandom(300_000)
    with atomic_write(s3_bucket.path("small.bin"), storage_options=via_proxy) as f:
        f.write(data)

    puts = requests(proxy, "PUT", "small.bin")
    assert len(puts) == 1 and "uploadId" not in puts[0].query
    assert puts[0].headers["x-amz-checksum-crc32c"] == crc_to_b64(crc32c(data))
    assert not requests(proxy, "POST", "small.bin")  # no multipart upload
    head = boto.head_object(Bucket=s3_bucket.name, Key="small.bin", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == crc_to_b64(crc32c(data))
    assert read_verified(s3_bucket.path("small.bin"), storage_options=via_proxy) == data


def test_multipart_object_sends_part_and_full_object_checksums(
        s3_bucket: Bucket, via_proxy: dict[str, Any], proxy: FaultProxy, boto: Any) -> None:
    data = os.urandom(MULTI)
    with atomic_write(s3_bucket.path("big.bin"), storage_options=via_proxy) as f:
        f.write(data)

    parts = sorted((r for r in requests(proxy, "PUT", "big.bin") if "partNumber" in r.query),
                   key=lambda r: int(r.query["partNumber"][0]))
    chunks = [data[0:PART], data[PART:2 * PART], data[2 * PART:]]
    assert [r.headers["x-amz-checksum-crc32c"] for r in parts] == \
        [crc_to_b64(crc32c(c)) for c in chunks]
    (complete,) = [r for r in requests(proxy, "POST", "big.bin") if "uploadId" in r.query]
    assert complete.headers["x-amz-checksum-crc32c"] == crc_to_b64(crc32c(data))
    assert complete.headers["x-amz-checksum-type"] == "FULL_OBJECT"
    assert complete.headers["x-amz-mp-object-size"] == str(len(data))

    head = boto.head_object(Bucket=s3_bucket.name, Key="big.bin", ChecksumMode="ENABLED")
    assert head["ETag"].endswith('-3"') and head["ContentLength"] == len(data)
    assert head["ChecksumType"] == "FULL_OBJECT"
    assert head["ChecksumCRC32C"] == crc_to_b64(crc32c(data))
    assert uploads(boto, s3_bucket) == []
    assert read_verified(s3_bucket.path("big.bin"), storage_options=via_proxy) == data


# --- nothing visible, nothing dangling ----------------------------------------------------

def _leave_by_exception(adapter: S3Adapter, path: str, data: bytes, boto: Any,
                        bucket: Bucket) -> None:
    with pytest.raises(RuntimeError), adapter.open_atomic(path) as f:
        f.write(data)
        assert uploads(boto, bucket)  # parts really went out before the failure
        raise RuntimeError("writer failed mid-upload")


def _leave_by_interrupt(adapter: S3Adapter, path: str, data: bytes, boto: Any,
                        bucket: Bucket) -> None:
    with pytest.raises(KeyboardInterrupt), adapter.open_atomic(path) as f:
        f.write(data)
        assert uploads(boto, bucket)
        raise KeyboardInterrupt


def _leave_by_close(adapter: S3Adapter, path: str, data: bytes, boto: Any,
                    bucket: Bucket) -> None:
    f = adapter.open_atomic(path)
    f.write(data)
    assert uploads(boto, bucket)
    f.close()  # s3fs's own files commit here; ours must not


def _leave_by_gc(adapter: S3Adapter, path: str, data: bytes, boto: Any,
                 bucket: Bucket) -> None:
    f = adapter.open_atomic(path)
    f.write(data)
    assert uploads(boto, bucket)
    del f
    gc.collect()


def _leave_atomic_write(adapter: S3Adapter, path: str, data: bytes, boto: Any,
                        bucket: Bucket) -> None:
    with pytest.raises(ValueError, match="half-way"), \
            atomic_write(bucket.path(path.split("/", 1)[1]),
                         storage_options=bucket.storage_options) as f:
        f.write(data)
        f.flush()
        assert uploads(boto, bucket)
        raise ValueError("half-way")


@pytest.mark.parametrize("leave", [_leave_by_exception, _leave_by_interrupt, _leave_by_close,
                                   _leave_by_gc, _leave_atomic_write])
def test_unfinished_upload_leaves_no_object_and_no_multipart_upload(
        s3_bucket: Bucket, adapter: S3Adapter, boto: Any, leave: Any) -> None:
    path = f"{s3_bucket.name}/dir/obj.bin"
    leave(adapter, path, os.urandom(2 * PART + 10), boto, s3_bucket)
    assert stored(boto, s3_bucket, "dir/obj.bin") is None
    assert uploads(boto, s3_bucket) == []
    assert boto.list_objects_v2(Bucket=s3_bucket.name).get("KeyCount") == 0


def test_a_completed_upload_counting_other_parts_is_taken_away(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], boto: Any) -> None:
    # The store answers CompleteMultipartUpload with an ETag for 2 parts where 3 were sent.
    proxy.add(faults.rewrite_etag(lambda etag: etag.replace("-3", "-2"), method="POST",
                                  path=_only("obj.bin"), query="uploadId"))
    with pytest.raises(IntegrityError, match=r"obj\.bin: completed from 3 parts, the store's "
                                              r"ETag .*-2\" counts 2"), \
            atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy) as f:
        f.write(os.urandom(MULTI))
    assert stored(boto, s3_bucket, "obj.bin") is None
    assert uploads(boto, s3_bucket) == []


# --- listings -----------------------------------------------------------------------------
def _truncated_with(token: str, body: bytes) -> bytes:
    """A ListObjectsV2 page made to say: more follows, at ``token``."""
    body = re.sub(rb"<NextContinuationToken>[^<]*</NextContinuationToken>", b"", body)
    return re.sub(rb"<IsTruncated>\w+</IsTruncated>", b"<IsTruncated>true</IsTruncated>"
                  b"<NextContinuationToken>" + token.encode() + b"</NextContinuationToken>",
                  body)


@pytest.mark.parametrize("store", ["token stuck", "pages restart"])
def test_a_listing_that_goes_round_in_circles_is_an_error_never_a_hang(
        s3_bucket: Bucket, proxy: FaultProxy, boto: Any, store: str) -> None:
    """A store whose continuation token never advances (the same token on every page), or
    whose pages start over: following it listed for ever (scan, verify, every commit)."""
    for k in ("p/a", "p/b", "p/c"):
        boto.put_object(Bucket=s3_bucket.name, Key=k, Body=b"x")
    # Tokens moto knows (after p/a, after p/b), so the requests that follow them are valid.
    after = [boto.list_objects_v2(Bucket=s3_bucket.name, Prefix="p/", MaxKeys=n
                                  )["NextContinuationToken"] for n in (1, 2)]
    pages = iter(range(1000))

    def circles(body: bytes) -> bytes:
        page = next(pages)
        if store == "token stuck":  # p/a, p/b, p/c, then empty pages, all "more at T"
            if page:
                body = re.sub(rb"<Contents>.*?</Contents>", b"", body, flags=re.S)
            return _truncated_with(after[0], body)
        return _truncated_with(after[page % 2], body)  # p/b, p/c again, then p/c ...

    proxy.add(faults.rewrite_body(circles, method="GET", query="list-type"))
    adapter = _adapter({**s3_bucket.storage_options, "endpoint_url": proxy.url})
    with pytest.raises(OSError, match=rf"s3://{s3_bucket.name}/p: .*round in circles"):
        adapter.list(f"{s3_bucket.name}/p")
    assert next(pages) == 2  # it stopped at the first page that repeated a key or a token


# --- create-only --------------------------------------------------------------------------

def test_create_only_race_has_exactly_one_winner(
        s3_bucket: Bucket, adapter: S3Adapter, boto: Any) -> None:
    writers = 8
    for round_ in range(20):
        key = f"race/{round_}"
        barrier = threading.Barrier(writers)
        outcome: dict[int, str] = {}

        def write(i: int, key: str = key, barrier: threading.Barrier = barrier,
                  outcome: dict[int, str] = outcome) -> None:
            barrier.wait()
            try:
                adapter.put(f"{s3_bucket.name}/{key}", b"writer %d" % i, create_only=True)
                outcome[i] = "won"
            except FileExistsError:
                outcome[i] = "refused"

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, o in outcome.items() if o == "won"]
        assert len(outcome) == writers and len(winners) == 1, (round_, outcome)
        assert stored(boto, s3_bucket, key) == b"writer %d" % winners[0]
    assert adapter.capabilities.create_only is True


def test_create_only_multipart_loses_cleanly(
        s3_bucket: Bucket, adapter: S3Adapter, boto: Any) -> None:
    path = f"{s3_bucket.name}/mp.bin"
    first, second = os.urandom(MULTI), os.urandom(MULTI)
    a = adapter.open_atomic(path, create_only=True)
    b = adapter.open_atomic(path, create_only=True)
    a.write(first)
    b.write(second)
    a.commit()
    with pytest.raises(FileExistsError, match=r"mp\.bin"):
        b.commit()  # refused by If-None-Match on CompleteMultipartUpload
    assert stored(boto, s3_bucket, "mp.bin") == first
    assert uploads(boto, s3_bucket) == []


def test_an_endpoint_ignoring_if_none_match_is_declared_not_pretended(
        s3_bucket: Bucket, proxy: FaultProxy, fresh_endpoint: dict[str, Any],
        boto: Any) -> None:
    # A store that ignores If-None-Match, made of moto (which enforces it) by taking the
    # header off every request on its way through the proxy (moto does not check SigV4).
    # The predicate edits the request it is shown and never selects the (inert) fault.
    def strip_if_none_match(request: faults.RequestInfo) -> bool:
        request.headers.remove("if-none-match")
        return False

    proxy.add(faults.delay(0, match=Match(where=strip_if_none_match)))
    # Probed afresh (`fresh_endpoint`): an earlier test's proxy may have had this port,
    # and its verdict would be taken for this store's.
    adapter = _adapter(fresh_endpoint)
    assert "probed" in adapter.capabilities.note
    _check_declared_weaker(s3_bucket, proxy, adapter, boto)


def _check_declared_weaker(s3_bucket: Bucket, proxy: FaultProxy, adapter: S3Adapter,
                           boto: Any) -> None:
    adapter.put(f"{s3_bucket.name}/k", b"first", create_only=True)

    caps = adapter.capabilities
    assert caps.create_only is False and "ignores If-None-Match" in caps.note
    puts_before = len(requests(proxy, "PUT", "k"))
    with pytest.raises(FileExistsError, match="/k already exists"):
        adapter.put(f"{s3_bucket.name}/k", b"second", create_only=True)
    assert len(requests(proxy, "PUT", "k")) == puts_before  # refused by the HEAD, not sent
    assert stored(boto, s3_bucket, "k") == b"first"
    assert [k for k in (o["Key"] for o in boto.list_objects_v2(
        Bucket=s3_bucket.name).get("Contents", []))] == ["k"]  # the probe cleaned up


def test_a_stopped_proxy_takes_what_was_probed_of_it_along(s3_bucket: Bucket) -> None:
    """durable keeps what it probed of an endpoint for the process; a FaultProxy stands for
    a store only while it runs. The next proxy given the same port, in front of a store
    that enforces If-None-Match, is probed afresh instead of inheriting "ignores it"."""
    def strip_if_none_match(request: faults.RequestInfo) -> bool:
        request.headers.remove("if-none-match")
        return False

    with FaultProxy(upstream=s3_bucket.server.url) as first:
        first.add(faults.delay(0, match=Match(where=strip_if_none_match)))
        port = first.port
        adapter = _adapter({**s3_bucket.storage_options, "endpoint_url": first.url})
        adapter.put(f"{s3_bucket.name}/k", b"first", create_only=True)
        assert adapter.capabilities.create_only is False
    with FaultProxy(upstream=s3_bucket.server.url, port=port) as second:
        adapter = _adapter({**s3_bucket.storage_options, "endpoint_url": second.url})
        assert "probed" in adapter.capabilities.note
        adapter.put(f"{s3_bucket.name}/k2", b"x", create_only=True)
        assert adapter.capabilities.create_only is True


# --- entries ------------------------------------------------------------------------------

def test_entry_on_s3_commits_verifies_and_catches_corruption(
        s3_bucket: Bucket, adapter: S3Adapter, boto: Any) -> None:
    url = s3_bucket.path("runs", "ds")
    entry = Entry(url, storage_options=s3_bucket.storage_options)
    small, big = os.urandom(1000), os.urandom(MULTI)
    with entry.writing() as w:
        w.fs.pipe_file(f"{w.path}/a/small.bin", small)
        with w.fs.open(f"{w.path}/big.bin", "wb") as f:
            f.write(big)
    assert entry.state() is State.COMPLETE
    report = entry.verify(deep=True)
    assert report.ok and report.objects == 2 and report.bytes_checked == len(small) + len(big)
    assert read_verified(f"{url}/big.bin", storage_options=s3_bucket.storage_options) == big

    # Behind durable's back: same size, other bytes.
    boto.put_object(Bucket=s3_bucket.name, Key="runs/ds/a/small.bin", Body=os.urandom(1000))
    with pytest.raises(IntegrityError, match=r"ds/a/small\.bin: crc32c expected"):
        entry.verify(deep=True)
    with pytest.raises(IntegrityError, match="CRC32C"):
        read_verified(f"{url}/a/small.bin", storage_options=s3_bucket.storage_options)


def test_object_replaced_during_a_read_is_an_error(
        s3_bucket: Bucket, adapter: S3Adapter, boto: Any) -> None:
    path = f"{s3_bucket.name}/obj"
    adapter.put(path, b"version one")
    info = adapter.info(path)
    assert info is not None
    boto.put_object(Bucket=s3_bucket.name, Key="obj", Body=b"version two")
    with adapter.open_read(path, info) as f, \
            pytest.raises(IntegrityError, match="obj: replaced since it was listed"):
        f.read()


def test_listing_is_one_paginated_listing(
        s3_bucket: Bucket, adapter: S3Adapter, proxy: FaultProxy,
        via_proxy: dict[str, Any], boto: Any) -> None:
    for i in range(3):
        boto.put_object(Bucket=s3_bucket.name, Key=f"p/{i}/x", Body=b"x" * i)
    boto.put_object(Bucket=s3_bucket.name, Key="p/folder/", Body=b"")
    boto.put_object(Bucket=s3_bucket.name, Key="p/", Body=b"")  # the prefix's own folder
    boto.put_object(Bucket=s3_bucket.name, Key="pq", Body=b"not below p/")
    proxied = _adapter(via_proxy)
    listing = proxied.list(f"{s3_bucket.name}/p")
    assert {k: v.size for k, v in listing.items()} == {"0/x": 0, "1/x": 1, "2/x": 2}
    assert len(proxy.requests) == 1  # no request per object
    assert proxied.exists(f"{s3_bucket.name}/p") and not proxied.exists(f"{s3_bucket.name}/z")
    proxied.delete_prefix(f"{s3_bucket.name}/p")
    keys = [o["Key"] for o in boto.list_objects_v2(Bucket=s3_bucket.name).get("Contents", [])]
    assert keys == ["pq"]


def test_listing_follows_every_page(s3_bucket: Bucket, adapter: S3Adapter) -> None:
    """moto pages listings by 1,000, as S3 does: a scan of a big root, an entry's verify
    must see every key, through s3fs and through obstore (durable's records)."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    # No flexible checksum on these plain uploads: moto parses aws-chunked bodies slowly.
    boto = boto3.client("s3", endpoint_url=s3_bucket.server.url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing",
                        config=Config(request_checksum_calculation="when_required",
                                      max_pool_connections=16))
    keys = [f"many/.durable/{i:04d}" for i in range(1003)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: boto.put_object(Bucket=s3_bucket.name, Key=k,
                                                Body=k.encode()), keys))
    boto.close()
    for below in ("many", "many/.durable"):  # s3fs's listing; obstore's for the records
        listed = adapter.list(f"{s3_bucket.name}/{below}")
        assert sorted(listed) == [k.removeprefix(f"{below}/") for k in keys], below
        assert {info.size for info in listed.values()} == {18}


def test_a_key_holding_a_version_id_is_refused_not_cut(s3_bucket: Bucket) -> None:
    """s3fs cuts "report?versionId=draft" to "report": the write replaced another object."""
    opts = s3_bucket.storage_options
    with atomic_write(f"s3://{s3_bucket.name}/report", storage_options=opts) as f:
        f.write(b"committed data")
    with (pytest.raises(ValueError, match=r"report\?versionId=draft: s3fs reads"),
          atomic_write(f"s3://{s3_bucket.name}/report?versionId=draft",
                       storage_options=opts) as f):
        f.write(b"a draft")
    assert read_verified(f"s3://{s3_bucket.name}/report",
                         storage_options=opts) == b"committed data"


def test_a_console_folder_at_the_entrys_own_prefix_is_not_data(
        s3_bucket: Bucket, boto: Any) -> None:
    """The AWS console's "Create folder" makes an empty object "ds/": listed below "ds" it
    would be the key "", which no manifest can hold, and no commit or adoption went
    through."""
    boto.put_object(Bucket=s3_bucket.name, Key="ds/", Body=b"")
    entry = Entry(f"s3://{s3_bucket.name}/ds", storage_options=s3_bucket.storage_options)
    with entry.writing(resume=True) as w:
        w.write_bytes("part-0", b"hello")
    assert entry.state() is State.COMPLETE
    marker = entry.read_marker()
    assert marker is not None and marker.manifest is not None
    assert set(marker.manifest.objects) == {"part-0"}
    # Data written before durable, in a console folder, adopted.
    boto.put_object(Bucket=s3_bucket.name, Key="dt/", Body=b"")
    boto.put_object(Bucket=s3_bucket.name, Key="dt/part-0", Body=b"world")
    adopted = Entry(f"s3://{s3_bucket.name}/dt", storage_options=s3_bucket.storage_options)
    adopted.mark_complete()
    marker = adopted.read_marker()
    assert marker is not None and marker.manifest is not None
    assert set(marker.manifest.objects) == {"part-0"}


@pytest.mark.parametrize("text", ["2026-11-29T21:00:00.000Z", "2026-11-29T21:00:00Z",
                                  "2026-11-29T21:00:00.123456+02:00", "2026-11-29T21:00:00",
                                  "Sun, 29 Nov 2026 21:00:00 GMT", "1764450000"])
def test_the_fast_listing_timestamp_parser_agrees_with_botocores(text: str) -> None:
    """The stdlib parser that replaces botocore's dateutil one on listings must give the
    same instant for every form a store may send, or ages (`durable clean`) shift."""
    from botocore.utils import parse_timestamp

    from durable.adapters.s3 import _iso_timestamp

    assert _iso_timestamp(text) == parse_timestamp(text)
    assert _iso_timestamp(text).utcoffset() == parse_timestamp(text).utcoffset()


def test_listing_times_are_the_stores(s3_bucket: Bucket, adapter: S3Adapter,
                                      boto: Any) -> None:
    boto.put_object(Bucket=s3_bucket.name, Key="t/a", Body=b"a")
    head = boto.head_object(Bucket=s3_bucket.name, Key="t/a")["LastModified"]
    listed = adapter.list(f"{s3_bucket.name}/t")["a"].modified
    assert listed == head.timestamp()


# --- faults through the proxy -------------------------------------------------------------

def _write(bucket: Bucket, key: str, data: bytes) -> str:
    url = bucket.path(key)
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(data)
    return url


def test_truncated_body_is_an_error_on_every_read_path(
        s3_bucket: Bucket, adapter: S3Adapter, proxy: FaultProxy,
        via_proxy: dict[str, Any]) -> None:
    data = os.urandom(MULTI)
    _write(s3_bucket, "d/obj.bin", data)
    proxy.add(faults.truncate_body(keep=100_000, path=_only("d/obj.bin")))
    url = s3_bucket.path("d/obj.bin")
    with pytest.raises(IntegrityError, match=r"d/obj\.bin: body ended at byte"):
        read_verified(url, storage_options=via_proxy)
    with open_verified(url, storage_options=via_proxy) as f, \
            pytest.raises(IntegrityError, match=r"d/obj\.bin"):
        f.read()
    with pytest.raises(IntegrityError, match=r"d/obj\.bin.*unreadable"):
        Entry(url, storage_options=via_proxy).verify(deep=True)


def test_the_adapters_own_reads_never_return_a_short_body(
        s3_bucket: Bucket, adapter: S3Adapter, proxy: FaultProxy,
        via_proxy: dict[str, Any]) -> None:
    """Below every verified read: the raw reader (and the one-GET read of markers) takes a
    body that keeps ending early for an error, not for the end of the object."""
    data = os.urandom(300_000)
    adapter.put(f"{s3_bucket.name}/obj.bin", data)
    # Each GET is cut after 10,000 bytes at most: three can never reach the end.
    proxy.add(faults.truncate_body(keep=10_000, path=_only("obj.bin")))
    proxied = _adapter(via_proxy)
    info = proxied.info(f"{s3_bucket.name}/obj.bin")
    assert info is not None and info.size == len(data)
    ended = r"obj\.bin: body ended at byte \d+ of 300000 \(3 times: "
    with proxied.open_read(info.path, info) as f, pytest.raises(IntegrityError, match=ended):
        f.read()
    with pytest.raises(IntegrityError, match=ended):
        proxied.read(info.path)
    assert len(requests(proxy, "GET", "obj.bin")) == 6  # a first GET and 2 pinned retries, twice


def test_a_cut_body_is_requested_again_pinned_to_its_etag(
        s3_bucket: Bucket, adapter: S3Adapter, proxy: FaultProxy,
        via_proxy: dict[str, Any]) -> None:
    data = os.urandom(MULTI)
    _write(s3_bucket, "obj.bin", data)
    etag = adapter.info(f"{s3_bucket.name}/obj.bin").version  # type: ignore[union-attr]
    proxy.add(faults.truncate_body(keep=100_000, path=_only("obj.bin"), times=1))
    assert read_verified(s3_bucket.path("obj.bin"), storage_options=via_proxy) == data
    gets = requests(proxy, "GET", "obj.bin")
    assert [g.truncated for g in gets] == [True, False]
    # read_verified's one GET takes the version it answers with; the re-request after the
    # cut is pinned to it (open_verified pins its first GET too: to the version it stat'ed).
    assert [g.headers.get("if-match") for g in gets] == [None, etag]
    proxy.clear_requests()
    proxy.add(faults.truncate_body(keep=100_000, path=_only("obj.bin"), times=1))
    with open_verified(s3_bucket.path("obj.bin"), storage_options=via_proxy) as f:
        assert f.read() == data
    gets = requests(proxy, "GET", "obj.bin")
    assert [g.headers["if-match"] for g in gets] == [etag, etag]


def test_a_cut_body_never_resumes_into_another_version(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], boto: Any) -> None:
    _write(s3_bucket, "obj.bin", os.urandom(MULTI))
    seen = []

    def replace_before_second_get(request: faults.RequestInfo) -> bool:
        seen.append(request)
        if len(seen) == 2:  # the re-request after the cut: the object is replaced first
            boto.put_object(Bucket=s3_bucket.name, Key="obj.bin", Body=os.urandom(MULTI))
        return False

    proxy.add(faults.delay(0, match=Match(methods="GET", path=_only("obj.bin"),
                                          where=replace_before_second_get)))
    proxy.add(faults.truncate_body(keep=100_000, path=_only("obj.bin"), times=1))
    with pytest.raises(IntegrityError, match=r"obj\.bin: replaced since it was listed"):
        read_verified(s3_bucket.path("obj.bin"), storage_options=via_proxy)
    assert len(seen) == 2


@pytest.mark.parametrize("mode", ["cut", "consistent"])
@pytest.mark.parametrize("verify", ["probe", "full"])
def test_object_short_by_whole_parts_is_caught_at_write_time(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], boto: Any,
        mode: str, verify: Any) -> None:
    proxy.add(faults.short_object(part_size=PART, parts_missing=1, mode=mode,  # type: ignore[arg-type]
                                  path=_only("obj.bin")))
    with pytest.raises(IntegrityError, match=r"obj\.bin"), \
            atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy,
                         verify=verify) as f:
        f.write(os.urandom(MULTI))
    assert stored(boto, s3_bucket, "obj.bin") is None  # taken away, never left as whole
    assert uploads(boto, s3_bucket) == []


@pytest.mark.parametrize("mode", ["cut", "consistent"])
def test_an_entrys_object_short_by_whole_parts_is_caught_at_write_time(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], boto: Any,
        mode: str) -> None:
    """Incident 002 inside an entry: the commit's listing says the full size, as the HEAD
    does, and the entry was committed COMPLETE over an object short by a part. Probed as
    atomic_write probes one: refused, and the fresh entry's objects removed."""
    proxy.add(faults.short_object(part_size=PART, parts_missing=1, mode=mode,  # type: ignore[arg-type]
                                  path=_only("e/obj.bin")))
    entry = Entry(s3_bucket.path("e"), storage_options=via_proxy)
    with pytest.raises(IntegrityError, match=r"e/obj\.bin"), entry.writing() as w:
        w.write_bytes("small", b"one PutObject: whole by its framing")
        with w.open("obj.bin") as f:
            f.write(os.urandom(MULTI))
    assert Entry(s3_bucket.path("e"), storage_options=s3_bucket.storage_options
                 ).state() is State.ABSENT
    assert uploads(boto, s3_bucket) == []


@pytest.mark.parametrize("mode", ["cut", "consistent"])
def test_object_short_by_whole_parts_behind_a_full_head_is_caught_on_read(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], mode: str) -> None:
    data = os.urandom(MULTI)
    proxy.add(faults.short_object(part_size=PART, parts_missing=1, mode=mode,  # type: ignore[arg-type]
                                  path=_only("obj.bin")))
    # "size" sees only the HEAD, which reports the full size: the write passes...
    with atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy,
                      verify="size") as f:
        f.write(data)
    # ... and every read refuses it.
    with pytest.raises(IntegrityError, match=r"obj\.bin"):
        read_verified(s3_bucket.path("obj.bin"), storage_options=via_proxy)
    with pytest.raises(IntegrityError, match=r"obj\.bin"):
        Entry(s3_bucket.path("obj.bin"), storage_options=via_proxy).verify(deep=True)


def test_403_error_document_is_never_returned(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any]) -> None:
    _write(s3_bucket, "obj.bin", b"payload")
    proxy.add(faults.error(403, method="GET", path=_only("obj.bin")))
    url = s3_bucket.path("obj.bin")
    with pytest.raises(PermissionError, match=r"s3://.*/obj\.bin: .*HTTP 403 AccessDenied"):
        read_verified(url, storage_options=via_proxy)
    with pytest.raises(PermissionError, match="HTTP 403"):
        _adapter(via_proxy).read(f"{s3_bucket.name}/obj.bin")


def test_a_stalled_body_is_a_timeout_naming_the_object(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any]) -> None:
    """A body that never comes (botocore's read timeout, shortened here by the storage
    option, every time the reader asks again): a TimeoutError saying it stalled, as on GCS
    and Azure; it was an IntegrityError calling it a body that "ended at byte 0"."""
    _write(s3_bucket, "obj.bin", b"payload" * 100)
    options = {**via_proxy, "config_kwargs": {"read_timeout": 1}}
    proxy.add(faults.delay(600, where="body", method="GET", path=_only("obj.bin")))
    with pytest.raises(TimeoutError, match=r"s3://.*/obj\.bin: the body stalled at byte 0 "
                                           "of 700: no data within the client's read "
                                           "timeout") as raised:
        read_verified(s3_bucket.path("obj.bin"), storage_options=options)
    assert not isinstance(raised.value, IntegrityError)


def test_error_document_served_as_200_is_refused_by_the_record(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any]) -> None:
    _write(s3_bucket, "obj.bin", b"payload")  # its record in its own metadata
    s3_bucket.filesystem().pipe_file(f"{s3_bucket.name}/adopted.bin", b"payload")
    Entry(s3_bucket.path("adopted.bin"), storage_options=s3_bucket.storage_options
          ).mark_complete()  # its record in a marker beside it
    proxy.add(faults.error_body_with_200(path=_only("obj.bin")))
    proxy.add(faults.error_body_with_200(path=_only("adopted.bin")))
    with pytest.raises(IntegrityError, match=r"adopted\.bin: recorded with 7 bytes"):
        read_verified(s3_bucket.path("adopted.bin"), storage_options=via_proxy)
    # The error page comes without the object's metadata, so without its record: refused
    # as what it is (the sniff of durable._verified.error_document), never returned.
    with pytest.raises(IntegrityError, match=r"obj\.bin: .*error document with code"):
        read_verified(s3_bucket.path("obj.bin"), storage_options=via_proxy)


@pytest.mark.parametrize("how", ["served with 200", "stored XML", "stored GCS JSON"])
def test_a_marker_that_is_an_error_document_is_named_as_one(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], how: str) -> None:
    """A commit marker whose body is an object store's error page (a broken proxy's 200,
    or a 403 body stored in its place): a MarkerError naming the marker and saying what
    it is, with its code; it said only "not valid JSON (Expecting value: line 1 ...)"."""
    url = s3_bucket.path("runs", "ds")
    with Entry(url, storage_options=s3_bucket.storage_options).writing() as w:
        w.write_bytes("a.bin", b"payload")
    marker = f"{s3_bucket.name}/runs/.durable/ds/commit.json"
    if how == "served with 200":
        proxy.add(faults.error_body_with_200(path=_only("runs/.durable/ds/commit.json")))
    elif how == "stored XML":
        s3_bucket.filesystem().pipe_file(marker, faults.s3_error_document("AccessDenied",
                                                                          "Access Denied"))
    else:
        s3_bucket.filesystem().pipe_file(marker, json.dumps(
            {"error": {"code": 403, "message": "Access Denied"}}).encode())
    code = "403" if how == "stored GCS JSON" else "AccessDenied"
    with pytest.raises(MarkerError, match=rf"s3://{marker}: the body is an object "
                                          rf"store's error document with code {code}"):
        Entry(url, storage_options=via_proxy).state()


def test_corrupt_part_is_caught_at_write_time_by_the_crc32c_the_store_computed(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], boto: Any) -> None:
    """moto keeps a corrupted part without checking the CRC32C sent with it (a real S3
    refuses it), but computes the full-object CRC32C from what it stored: the HEAD of
    verify="size" compares that with the CRC32C the writer computed."""
    proxy.add(faults.corrupt_part_bytes(offset=10, path=_only("obj.bin"), times=1))
    with pytest.raises(IntegrityError, match=r"obj\.bin: the store recorded CRC32C"), \
            atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy,
                         verify="size") as f:
        f.write(os.urandom(MULTI))
    assert stored(boto, s3_bucket, "obj.bin") is None
    assert uploads(boto, s3_bucket) == []


def test_corrupt_part_without_a_full_object_checksum_is_caught_by_full_verify(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], boto: Any) -> None:
    """A store without FULL_OBJECT checksums keeps only a checksum of part checksums,
    which a HEAD cannot compare: reading back and comparing the CRC32C is what is left."""
    adapter = _adapter(via_proxy)
    adapter.full_object_checksum = False
    try:
        proxy.add(faults.corrupt_part_bytes(offset=10, path=_only("obj.bin"), times=1))
        with pytest.raises(IntegrityError, match=r"obj\.bin: read back .* with CRC32C"), \
                atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy,
                             verify="full") as f:
            f.write(os.urandom(MULTI))
    finally:
        adapter.full_object_checksum = True
    assert stored(boto, s3_bucket, "obj.bin") is None


_PUT_OBJECT = Match(methods="PUT", path=_only("obj.bin"), query="!uploadId")


def test_corrupt_single_put_is_refused_by_a_full_verify(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], boto: Any) -> None:
    proxy.add(faults.corrupt_part_bytes(offset=10, match=_PUT_OBJECT, times=1))
    with pytest.raises(IntegrityError, match=r"obj\.bin"), \
            atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy,
                         verify="full") as f:
        f.write(os.urandom(1000))
    assert stored(boto, s3_bucket, "obj.bin") is None


def test_corrupt_stored_bytes_fail_the_stores_own_crc32c_on_every_whole_get(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any]) -> None:
    """moto stores the CRC32C sent with a corrupted PutObject: a whole-object GET checks
    the body against it (ChecksumMode, awscrt), so even a read with no record is refused."""
    proxy.add(faults.corrupt_part_bytes(offset=10, match=_PUT_OBJECT, times=1))
    with atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy, record=False,
                      verify="size") as f:
        f.write(os.urandom(1000))
    with pytest.raises(IntegrityError, match=r"obj\.bin: the body does not match the CRC32C"):
        _adapter(via_proxy).read(f"{s3_bucket.name}/obj.bin")


def test_unquoted_etag_is_normalised_and_still_pins(
        s3_bucket: Bucket, adapter: S3Adapter, proxy: FaultProxy,
        via_proxy: dict[str, Any]) -> None:
    data = os.urandom(1000)
    _write(s3_bucket, "obj.bin", data)
    etag = adapter.info(f"{s3_bucket.name}/obj.bin").version  # type: ignore[union-attr]
    proxy.add(faults.rewrite_etag("unquoted", path=_only("obj.bin")))
    assert read_verified(s3_bucket.path("obj.bin"), storage_options=via_proxy) == data
    with open_verified(s3_bucket.path("obj.bin"), storage_options=via_proxy) as f:
        assert f.read() == data  # stat, then a GET pinned to the normalised ETag
    assert requests(proxy, "GET", "obj.bin")[-1].headers["if-match"] == etag


@pytest.mark.parametrize("style", ["weak", "empty", "missing"])
def test_unusable_etag_is_a_clear_error(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any], style: str) -> None:
    _write(s3_bucket, "obj.bin", b"payload")
    proxy.add(faults.rewrite_etag(style, path=_only("obj.bin")))  # type: ignore[arg-type]
    with pytest.raises(IntegrityError, match=r"obj\.bin: the store answered .*ETag"):
        read_verified(s3_bucket.path("obj.bin"), storage_options=via_proxy)


def test_a_store_ignoring_if_match_cannot_serve_another_version(
        s3_bucket: Bucket, proxy: FaultProxy, via_proxy: dict[str, Any]) -> None:
    _write(s3_bucket, "obj.bin", b"payload")
    proxy.add(faults.rewrite_etag(lambda _: '"another"', method="GET", path=_only("obj.bin")))
    # open_verified stats, then reads pinned: a GET answered with another version is
    # refused. (read_verified's single GET is one version by itself, and is checked
    # against the record.)
    with pytest.raises(IntegrityError, match=r"obj\.bin: replaced since it was listed"), \
            open_verified(s3_bucket.path("obj.bin"), storage_options=via_proxy) as f:
        f.read()


def test_a_store_ignoring_range_cannot_hand_out_the_wrong_bytes(
        s3_bucket: Bucket, adapter: S3Adapter, proxy: FaultProxy,
        via_proxy: dict[str, Any]) -> None:
    data = os.urandom(100_000)
    adapter.put(f"{s3_bucket.name}/obj.bin", data)
    proxied = _adapter(via_proxy)
    info = proxied.info(f"{s3_bucket.name}/obj.bin")
    assert info is not None
    with proxied.open_read(info.path, info) as f:
        f.seek(70_000)
        assert f.read(10) == data[70_000:70_010]

    # A server (or a cache in front of it) that drops the Range header answers with the
    # whole object from byte 0.
    def drop_range(request: faults.RequestInfo) -> bool:
        request.headers.remove("range")
        return False

    proxy.add(faults.delay(0, match=Match(methods="GET", where=drop_range)))
    with proxied.open_read(info.path, info) as f, \
            pytest.raises(IntegrityError, match=r"obj\.bin: asked for 30000 bytes from byte "
                                                r"70000, the store answers Content-Length"):
        f.seek(70_000)
        f.read(10)
    with pytest.raises(IntegrityError, match=r"obj\.bin: asked for 1 bytes from byte 99999"):
        proxied.verify_written(info.path, _written_checksum(data), "probe")
    proxy.clear()

    # A cache that serves a range of the right length from the wrong offset.
    def shift_range(request: faults.RequestInfo) -> bool:
        if request.headers.get("range") == "bytes=70000-99999":
            request.headers.set("range", "bytes=0-29999")
        return False

    proxy.add(faults.delay(0, match=Match(methods="GET", where=shift_range)))
    with proxied.open_read(info.path, info) as f, \
            pytest.raises(IntegrityError, match=r"asked for bytes 70000-99999/100000, the "
                                                r"store answers Content-Range bytes 0-29999"):
        f.seek(70_000)
        f.read(10)


# --- verify after write: what the PutObject's answer already proves ----------------------

def _object_requests(proxy: FaultProxy, key: str) -> list[str]:
    return [r.method for r in proxy.requests if r.key == key]


@pytest.mark.parametrize(("verify", "expected"), [("size", ["PUT"]), ("probe", ["PUT"]),
                                                  ("full", ["PUT", "GET"])])
def test_a_put_answered_with_the_crc32c_sent_needs_no_head(
        s3_bucket: Bucket, via_proxy: dict[str, Any], proxy: FaultProxy, boto: Any,
        verify: Any, expected: list[str]) -> None:
    """The store checked the CRC32C sent over exactly the bytes it took (Content-Length
    framed) and says so in its answer: "size" and "probe" need nothing more; "full" still
    reads the object back, in one GET (its headers say the size and ETag)."""
    data = os.urandom(1024 * 1024)
    with atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy,
                      verify=verify) as f:
        f.write(data)
    assert _object_requests(proxy, "obj.bin") == expected
    (put,) = requests(proxy, "PUT", "obj.bin")
    assert put.headers["x-amz-checksum-crc32c"] == crc_to_b64(crc32c(data))
    assert stored(boto, s3_bucket, "obj.bin") == data


@pytest.mark.parametrize("verify", ["size", "probe"])
def test_a_put_answered_without_a_checksum_is_checked_by_a_head(
        s3_bucket: Bucket, via_proxy: dict[str, Any], proxy: FaultProxy, boto: Any,
        verify: Any) -> None:
    """A store that ignores flexible checksums answers none: nothing vouches for what it
    kept, so the HEAD happens."""
    proxy.add(faults.strip_headers(method="PUT", path=_only("obj.bin")))
    data = os.urandom(1024 * 1024)
    with atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy,
                      verify=verify) as f:
        f.write(data)
    (put,) = requests(proxy, "PUT", "obj.bin")
    assert put.faults == ["strip_headers"]  # the answer really came without its checksum
    assert _object_requests(proxy, "obj.bin") == ["PUT", "HEAD"]
    assert stored(boto, s3_bucket, "obj.bin") == data


@pytest.mark.parametrize("verify", ["probe", "full"])
def test_a_put_answered_with_another_crc32c_is_refused(
        s3_bucket: Bucket, via_proxy: dict[str, Any], proxy: FaultProxy, boto: Any,
        verify: Any) -> None:
    """moto keeps and answers whatever CRC32C it is sent, unchecked (a real S3 refuses a
    mismatch, BadDigest): another value put in the header on the way makes the store's
    answer report a CRC32C other than the one the writer computed."""
    other = crc_to_b64(crc32c(b"other bytes"))

    def send_another_crc32c(request: faults.RequestInfo) -> bool:
        request.headers.set("x-amz-checksum-crc32c", other)
        return False

    proxy.add(faults.delay(0, match=Match(methods="PUT", path=_only("obj.bin"),
                                          where=send_another_crc32c)))
    data = os.urandom(1000)
    sent = crc_to_b64(crc32c(data))
    with pytest.raises(IntegrityError, match=(
            rf"s3://{s3_bucket.name}/obj\.bin: the store answered the PutObject with CRC32C "
            rf"{re.escape(other)}, the writer computed and sent {re.escape(sent)}")) as err, \
            atomic_write(s3_bucket.path("obj.bin"), storage_options=via_proxy,
                         verify=verify) as f:
        f.write(data)
    assert (err.value.expected, err.value.found) == (sent, other)
    # Refused on the answer alone (no GET of the bytes); the HEAD asks whether the object is
    # still this writer's before it is taken away (another writer's is left alone)
    assert _object_requests(proxy, "obj.bin") == ["PUT", "HEAD"]
    assert stored(boto, s3_bucket, "obj.bin") is None  # taken away, and no marker written
    assert boto.list_objects_v2(Bucket=s3_bucket.name).get("KeyCount") == 0


# --- endpoint probes: never inside an entry --------------------------------------------------

@pytest.fixture
def fresh_endpoint(via_proxy: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``via_proxy``, probed afresh: verdicts are kept per endpoint URL, and an earlier
    proxy may have had this port."""
    endpoint = _adapter(via_proxy)._endpoint()
    verdicts = (S3Adapter._create_only_by_endpoint, S3Adapter._conditional_by_endpoint)
    for v in verdicts:
        v.pop(endpoint, None)
    yield via_proxy
    for v in verdicts:
        v.pop(endpoint, None)


def _bucket_keys(boto: Any, bucket: Bucket) -> list[str]:
    """Every key, once durable's background housekeeping (a commit's removal of its
    attempt record) has run."""
    background.wait()
    return sorted(o["Key"] for o in boto.list_objects_v2(Bucket=bucket.name).get("Contents", []))


def _probe_requests(proxy: FaultProxy) -> list[tuple[str, str, bool, int | None]]:
    """(method, key, If-None-Match sent, status) of every request on a probe object."""
    return [(r.method, r.key, "if-none-match" in r.headers, r.status) for r in proxy.requests
            if PROBE_PREFIX in r.key]


def test_the_first_create_only_write_on_an_endpoint_leaves_nothing_but_the_entry(
        s3_bucket: Bucket, fresh_endpoint: dict[str, Any], proxy: FaultProxy,
        boto: Any) -> None:
    with Entry(s3_bucket.path("runs", "ds"), storage_options=fresh_endpoint).writing() as w:
        w.write_bytes("a.bin", b"payload")  # the marker is the first create-only write
    probe = _probe_requests(proxy)
    assert [(m, cond, status) for m, _, cond, status in probe] == [
        ("PUT", False, 200), ("PUT", True, 412), ("DELETE", False, 204)]
    assert re.fullmatch(r"\.durable/\.durable-probe-[0-9a-f]{32}", probe[0][1])
    assert {k for _, k, _, _ in probe} == {probe[0][1]}
    assert _bucket_keys(boto, s3_bucket) == ["runs/.durable/ds/commit.json", "runs/ds/a.bin"]


def _write_entry_marker_first(url: str, options: dict[str, Any]) -> None:
    with Entry(url, storage_options=options).writing() as w:
        w.write_bytes("a.bin", b"payload")


def _write_object_create_only(url: str, options: dict[str, Any]) -> None:
    with atomic_write(url, "xb", storage_options=options) as f:
        f.write(b"payload")


def _write_entry_creating_inside_it(url: str, options: dict[str, Any]) -> None:
    with Entry(url, storage_options=options).writing() as w:
        w.fs.pipe_file(f"{w.path}/a.bin", b"payload", mode="create")


@pytest.mark.parametrize(("write", "data_key"), [
    (_write_entry_marker_first, "runs/ds/a.bin"),
    (_write_object_create_only, "runs/ds"),
    (_write_entry_creating_inside_it, "runs/ds/a.bin")])
@pytest.mark.parametrize(("credentials", "probe_dir"), [("bucket", ""),
                                                        ("prefix runs/", "runs/")])
def test_a_probe_left_behind_never_touches_an_entry(
        s3_bucket: Bucket, fresh_endpoint: dict[str, Any], proxy: FaultProxy, boto: Any,
        write: Any, data_key: str, credentials: str, probe_dir: str) -> None:
    """A writer killed between the probe's PUT and its DELETE leaves the probe object;
    refusing the DELETE leaves it the same way, every time. It lies in a records folder no
    entry owns, as high as the credentials allow (the bucket's, or for credentials limited
    to ``runs/``, the one of ``runs/``): no entry looks started, none adopts it, a scan
    shows no row for it."""
    if credentials != "bucket":
        proxy.add(faults.error(403, "AccessDenied", method="PUT", path=r"^/[^/]+/(?!runs/)"))
    proxy.add(faults.error(403, "AccessDenied", method="DELETE", key=PROBE_PREFIX))
    url = s3_bucket.path("runs", "ds")
    write(url, fresh_endpoint)

    keys = _bucket_keys(boto, s3_bucket)
    (left,) = [k for k in keys if PROBE_PREFIX in k]
    assert re.fullmatch(rf"{probe_dir}\.durable/\.durable-probe-[0-9a-f]{{32}}", left)
    # A single object carries its record in its own metadata: no marker beside it.
    marker = [] if data_key == "runs/ds" else ["runs/.durable/ds/commit.json"]
    assert sorted(set(keys) - {left}) == sorted([data_key, *marker])
    refused = [(k, status) for m, k, cond, status in _probe_requests(proxy)
               if m == "PUT" and status == 403]
    assert refused == ([] if credentials == "bucket"
                       else [(left.removeprefix("runs/"), 403)])  # the bucket's, first

    options = s3_bucket.storage_options
    entry = Entry(url, storage_options=options)
    assert entry.state() is State.COMPLETE
    report = entry.verify(deep=True)
    assert report.ok and report.objects == 1  # nothing adopted besides the payload
    rows = scan(s3_bucket.url, options)
    assert all(PROBE_PREFIX not in r.url for r in rows)
    if not marker:
        # A listing shows no metadata: the scan stats the objects of the unmarked folder
        # runs/ and finds the one carrying its record in its own metadata (docs/protocol.md).
        (row,) = [r for r in rows if r.url == url]
        assert (row.state, row.objects) == ("COMPLETE", 1) and "own metadata" in row.reason
        return
    assert [(r.url, r.state, r.objects, r.reason.startswith("committed at")) for r in rows] == [
        (url, "COMPLETE", 1, True)]
    assert "not in the manifest" not in rows[0].reason


@pytest.mark.parametrize("page", [1000, 2])
def test_exists_tells_an_object_a_prefix_and_nothing_apart_among_lookalike_siblings(
        s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, page: int) -> None:
    """One listing (prefix KEY, delimiter /) answers exists(); siblings whose names start
    with KEY come along, and a page too short for them falls back to HEAD + LIST."""
    import durable.adapters.s3 as s3_module

    monkeypatch.setattr(s3_module, "_EXISTS_PAGE", page)
    boto = s3_bucket.filesystem()
    for key in ("d/e-0", "d/e-1/x", "d/e.json", "d/ea", "d/obj", "d/pre/x", "d/pre-1",
                "d/pre-2", "d/pre.x"):
        boto.pipe_file(f"{s3_bucket.name}/{key}", b"1")
    adapter = _adapter(s3_bucket.storage_options)
    root = s3_bucket.name
    assert adapter.exists(f"{root}/d/obj")  # an object
    assert adapter.exists(f"{root}/d/pre")  # a prefix, listed after pre-1, pre-2, pre.x
    assert adapter.exists(f"{root}/d/pre/")
    assert not adapter.exists(f"{root}/d/e")  # only lookalikes: e-0, e-1/, e.json, ea
    assert not adapter.exists(f"{root}/d/o")
    assert not adapter.exists(f"{root}/nothing")
    assert adapter.exists(f"{root}/d")
    assert adapter.exists(root)


def test_read_verified_takes_an_object_in_large_blocks(
        s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_verified read the body 8 KiB at a time (io.RawIOBase.readall), each read a hop
    to the client's event loop: a 300 MB object took 9.3 s from moto, where open_verified's
    8 MiB reads took 0.8 s. It is read in blocks of 8 MiB, whole and checked as before."""
    from durable.adapters._ranged import PinnedStreamReader

    data = os.urandom(3 * 1024 * 1024 + 5)
    _write(s3_bucket, "big.bin", data)
    reads: list[int] = []
    real = PinnedStreamReader.readinto

    def counted(self: PinnedStreamReader, buffer: Any) -> int:
        n = real(self, buffer)
        reads.append(n)
        return n

    monkeypatch.setattr(PinnedStreamReader, "readinto", counted)
    assert read_verified(s3_bucket.path("big.bin"),
                         storage_options=s3_bucket.storage_options) == data
    assert sum(reads) == len(data)
    assert len(reads) < 50, len(reads)  # 8 KiB reads: 385
