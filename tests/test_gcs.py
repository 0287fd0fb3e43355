"""The GCS adapter against real emulators: whole objects or nothing, CRC32C the store checks,
create-only, reads pinned to a generation.

Two emulators, because each enforces a different part (docs: GCSAdapter.capabilities):
gcp-storage-emulator checks the crc32c of an upload, fake-gcs-server enforces
ifGenerationMatch=0 on single-request uploads and generation= on reads. Where neither
enforces a precondition, the requests are recorded through a proxy instead. The store is
read and written *around* durable, with plain HTTP against the emulator's JSON API.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import crc32c
import pytest
from click.testing import CliRunner
from gcsfs.retry import HttpError

import durable
from durable import Entry, IntegrityError, atomic_write, read_verified
from durable._checksum import crc_to_b64
from durable.adapters import adapter_for_fs
from durable.adapters import gcs as gcs_adapter
from durable.adapters.base import Adapter
from durable.adapters.gcs import CHUNK, GCSAdapter
from durable.cli import cli
from durable.testing.conformance import AdapterTests
from durable.testing.faults import (
    FaultProxy,
    Match,
    RequestInfo,
    corrupt_part_bytes,
    delay,
    drop_connection,
    error,
    error_body_with_200,
    rewrite_body,
    truncate_body,
)
from durable.testing.faults import short_object as short_object_fault
from durable.testing.pytest_plugin import Bucket

pytestmark = pytest.mark.gcs

SMALL = os.urandom(100_000)
LARGE = os.urandom(2 * CHUNK + 12_345)  # two pieces, then the finalizing request


# --------------------------------------------------------------------------- around durable
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(url: str, method: str = "GET", body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with _opener.open(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read()


class Raw:
    """The bucket as another tool sees it: plain JSON API requests, no gcsfs, no durable."""

    def __init__(self, bucket: Bucket) -> None:
        self.base = bucket.server.url
        self.bucket = bucket.name

    def get(self, key: str) -> bytes | None:
        status, body = _http(f"{self.base}/download/storage/v1/b/{self.bucket}/o/"
                             f"{quote(key, safe='')}?alt=media")
        return body if status == 200 else None

    def put(self, key: str, data: bytes) -> None:
        status, body = _http(f"{self.base}/upload/storage/v1/b/{self.bucket}/o?uploadType=media"
                             f"&name={quote(key, safe='')}", "POST", data,
                             {"Content-Type": "application/octet-stream"})
        assert status == 200, body

    def put_with_metadata(self, key: str, data: bytes, metadata: object) -> None:
        """A multipart upload: the bytes and an object resource carrying ``metadata``."""
        resource = json.dumps({"name": key, "metadata": metadata}).encode()
        boundary = "b" + os.urandom(8).hex()
        body = b"".join([f"--{boundary}\r\nContent-Type: application/json\r\n\r\n".encode(),
                         resource, f"\r\n--{boundary}\r\nContent-Type: application/"
                         "octet-stream\r\n\r\n".encode(), data,
                         f"\r\n--{boundary}--\r\n".encode()])
        status, reply = _http(f"{self.base}/upload/storage/v1/b/{self.bucket}/o?uploadType="
                              "multipart", "POST", body,
                              {"Content-Type": f'multipart/related; boundary="{boundary}"'})
        assert status == 200, reply

    def resource(self, key: str) -> dict[str, object]:
        status, body = _http(f"{self.base}/storage/v1/b/{self.bucket}/o/{quote(key, safe='')}")
        assert status == 200, body
        doc: dict[str, object] = json.loads(body)
        return doc

    def keys(self, prefix: str = "") -> list[str]:
        status, body = _http(f"{self.base}/storage/v1/b/{self.bucket}/o"
                             f"?prefix={quote(prefix, safe='')}")
        assert status == 200, body
        return sorted(item["name"] for item in json.loads(body).get("items", []))


class Recorder:
    """Every request that passes the proxy: method, path, query and all headers."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.seen: list[RequestInfo] = []
        self._lock = threading.Lock()
        # A fault that never applies: its matcher only takes notes.
        proxy.add(delay(0, match=Match(where=self._note)))

    def _note(self, info: RequestInfo) -> bool:
        with self._lock:
            self.seen.append(info)
        return False

    def requests(self, method: str, **query: str) -> list[RequestInfo]:
        with self._lock:
            return [r for r in self.seen if r.method == method
                    and all(r.query.get(k, [None])[0] == v for k, v in query.items())]


@pytest.fixture(params=["gcs_bucket", "fake_gcs_bucket"])
def gcs(request: pytest.FixtureRequest) -> Bucket:
    """A fresh bucket on each emulator: every guarantee both enforce runs on both."""
    bucket: Bucket = request.getfixturevalue(request.param)
    return bucket


@pytest.fixture
def proxied(gcs_bucket: Bucket) -> Iterator[tuple[Bucket, FaultProxy]]:
    """gcp-storage-emulator behind a fault proxy. It builds session URIs from the Host the
    request named, so the pieces of a resumable upload pass the proxy too."""
    with FaultProxy(gcs_bucket.server.url) as proxy:
        options = {**gcs_bucket.storage_options, "endpoint_url": proxy.url}
        yield Bucket(gcs_bucket.name, "gs", options, gcs_bucket.server), proxy


@pytest.fixture
def fake_proxied(fake_gcs_bucket: Bucket) -> Iterator[tuple[Bucket, FaultProxy]]:
    """fake-gcs-server (it enforces ifGenerationMatch=0) behind a fault proxy."""
    with FaultProxy(fake_gcs_bucket.server.url) as proxy:
        options = {**fake_gcs_bucket.storage_options, "endpoint_url": proxy.url}
        yield Bucket(fake_gcs_bucket.name, "gs", options, fake_gcs_bucket.server), proxy


def adapter(bucket: Bucket) -> GCSAdapter:
    a = adapter_for_fs(bucket.filesystem())
    assert isinstance(a, GCSAdapter)
    return a


def race(write: Callable[[int], object], threads: int = 8) -> list[str]:
    """Run ``write(i)`` in ``threads`` threads released at once: "won" or "refused" each."""
    barrier = threading.Barrier(threads)
    results = [""] * threads

    def run(i: int) -> None:
        barrier.wait()
        try:
            write(i)
            results[i] = "won"
        except FileExistsError:
            results[i] = "refused"

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return results


# ------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("data", [b"", SMALL, LARGE], ids=["empty", "small", "large"])
def test_atomic_write_round_trip(gcs: Bucket, data: bytes) -> None:
    with atomic_write(gcs.path("d", "a.bin"), storage_options=gcs.storage_options) as f:
        f.write(data)

    assert Raw(gcs).get("d/a.bin") == data
    assert read_verified(gcs.path("d", "a.bin"), storage_options=gcs.storage_options) == data
    assert Entry(gcs.path("d", "a.bin"),
                 storage_options=gcs.storage_options).state() is durable.State.COMPLETE


def test_large_object_is_one_session_finalized_once(proxied: tuple[Bucket, FaultProxy]) -> None:
    bucket, proxy = proxied
    rec = Recorder(proxy)
    adapter(bucket).put(f"{bucket.name}/big", LARGE)

    assert len(rec.requests("POST", uploadType="resumable")) == 1
    pieces = rec.requests("PUT")
    ranges = [p.headers.get("Content-Range") for p in pieces]
    n = len(LARGE)
    assert ranges == [f"bytes 0-{CHUNK - 1}/*", f"bytes {CHUNK}-{2 * CHUNK - 1}/*",
                      f"bytes {2 * CHUNK}-{n - 1}/{n}"]
    # Only the finalizing request carries the CRC32C, and it is the whole object's.
    assert [p.headers.get("X-Goog-Hash") for p in pieces] == [
        None, None, f"crc32c={crc_to_b64(crc32c.crc32c(LARGE))}"]
    assert Raw(bucket).get("big") == LARGE


# ----------------------------------------------------------------- whole object or nothing
@pytest.mark.parametrize("exc", [ValueError("boom"), KeyboardInterrupt()])
def test_exception_mid_upload_leaves_no_object(proxied: tuple[Bucket, FaultProxy],
                                               exc: BaseException) -> None:
    bucket, proxy = proxied
    rec = Recorder(proxy)
    with pytest.raises(type(exc)), atomic_write(bucket.path("a.bin"),
                                                storage_options=bucket.storage_options) as f:
        f.write(LARGE)
        f.flush()
        # Two pieces really went out: the session exists and holds data.
        assert len(rec.requests("PUT")) == 2
        raise exc

    assert Raw(bucket).keys() == []
    # Nothing finalized the session (every piece left the total open), and abort cancelled it.
    assert all(p.headers.get("Content-Range", "").endswith("/*") for p in rec.requests("PUT"))
    assert len(rec.requests("DELETE", uploadType="resumable")) == 1


def test_file_dropped_without_close_publishes_nothing(gcs: Bucket) -> None:
    f = adapter(gcs).open_atomic(f"{gcs.name}/a.bin")
    f.write(LARGE)
    del f
    gc.collect()
    assert Raw(gcs).keys() == []


def test_exception_keeps_previous_object(gcs: Bucket) -> None:
    Raw(gcs).put("a.bin", SMALL)
    with pytest.raises(ValueError), adapter(gcs).open_atomic(f"{gcs.name}/a.bin") as f:
        f.write(LARGE)
        raise ValueError("boom")
    assert Raw(gcs).get("a.bin") == SMALL


# ------------------------------------------------------------------------------ checksums
def test_store_refuses_a_single_upload_corrupted_in_transit(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    bucket, proxy = proxied
    rec = Recorder(proxy)
    # One byte of the data part flipped (the body ends with the closing boundary).
    proxy.add(corrupt_part_bytes(offset=-100, match=Match(methods="POST",
                                                          query="uploadType")))
    with pytest.raises(IntegrityError, match="refused the upload"):
        adapter(bucket).put(f"{bucket.name}/a.bin", SMALL)
    assert Raw(bucket).keys() == []
    assert rec.requests("DELETE") == []  # refused by the store: nothing had to be removed


def test_object_stored_corrupt_is_removed(proxied: tuple[Bucket, FaultProxy]) -> None:
    """A resumable upload whose piece was corrupted on the way: the emulator does not check
    X-Goog-Hash (GCS does), so the CRC32C in its reply is what catches it."""
    bucket, proxy = proxied
    proxy.add(corrupt_part_bytes(offset=5, match=Match(methods="PUT"), times=1))
    with pytest.raises(IntegrityError, match="the store kept"):
        adapter(bucket).put(f"{bucket.name}/a.bin", LARGE)
    assert Raw(bucket).keys() == []


# ---------------------------------------------------------------------------- create-only
def test_a_listing_of_a_missing_bucket_names_it(gcs: Bucket) -> None:
    """gcsfs's own error is "b/NAME/o", which names neither the URL nor the bucket."""
    a = adapter(gcs)
    with pytest.raises(FileNotFoundError,
                       match=r"^gs://no-such-bucket-x/p: no such bucket 'no-such-bucket-x'$"):
        a.list("no-such-bucket-x/p")
    assert a.list(f"{gcs.name}/no-such-prefix") == {}  # an empty prefix is no error


@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["single-request", "resumable"])
@pytest.mark.parametrize("create_only", [False, True], ids=["replace", "create-only"])
def test_a_write_into_a_missing_bucket_names_it(gcs: Bucket, data: bytes,
                                                create_only: bool) -> None:
    """gcsfs's own error named the upload API ("http://HOST/upload/storage/v1/b/NAME/o"),
    neither the object nor that the bucket is missing (an entry's first write, its attempt
    record, into a mistyped bucket)."""
    a = adapter(gcs)
    with pytest.raises(FileNotFoundError,
                       match=r"^gs://no-such-bucket-x/p/o: no such bucket 'no-such-bucket-x'"
                       ), a.open_atomic("no-such-bucket-x/p/o", create_only=create_only) as f:
        f.write(data)


def test_create_only_race_has_exactly_one_winner(fake_gcs_bucket: Bucket) -> None:
    a = adapter(fake_gcs_bucket)
    for round_ in range(20):
        key = f"race/{round_}"
        results = race(lambda i, key=key: a.put(f"{fake_gcs_bucket.name}/{key}",
                                                 f"writer {i}".encode(), create_only=True))
        assert sorted(results) == ["refused"] * 7 + ["won"], round_
        assert Raw(fake_gcs_bucket).get(key) == f"writer {results.index('won')}".encode()


def test_create_only_refused_on_existing_object(fake_gcs_bucket: Bucket) -> None:
    Raw(fake_gcs_bucket).put("a.bin", SMALL)
    with pytest.raises(FileExistsError, match="create-only"):
        adapter(fake_gcs_bucket).put(f"{fake_gcs_bucket.name}/a.bin", b"x", create_only=True)
    assert Raw(fake_gcs_bucket).get("a.bin") == SMALL


@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["single-request", "resumable"])
def test_create_only_sends_if_generation_match_0(proxied: tuple[Bucket, FaultProxy],
                                                 data: bytes) -> None:
    """The client side, where no emulator enforces it (resumable uploads): GCS does."""
    bucket, proxy = proxied
    rec = Recorder(proxy)
    adapter(bucket).put(f"{bucket.name}/a.bin", data, create_only=True)
    kind = "multipart" if data is SMALL else "resumable"
    assert len(rec.requests("POST", uploadType=kind, ifGenerationMatch="0")) == 1


# ------------------------------------------------ a create-only write whose answer was lost
# The store applies the request and the connection dies before its answer: gcsfs sends it
# again (after a second or two of backoff), and the store refuses the retry. A writer whose
# object stands must not be told that it failed, nor that another writer was first.
_UPLOAD = Match(methods="POST", query="uploadType")


def test_a_create_only_upload_whose_answer_was_lost_is_not_refused_by_itself(
        fake_proxied: tuple[Bucket, FaultProxy], no_backoff: None) -> None:
    bucket, proxy = fake_proxied
    a = adapter(bucket)
    proxy.add(drop_connection(forward=True, match=_UPLOAD, times=1))
    info = a.put(f"{bucket.name}/a.bin", SMALL, create_only=True)
    assert [r.status for r in proxy.requests if r.method == "POST"] == [None, 412]
    assert Raw(bucket).get("a.bin") == SMALL
    assert info.version == Raw(bucket).resource("a.bin")["generation"]

    # Another writer's object, even byte for byte the same, is still a refusal.
    with pytest.raises(FileExistsError, match="create-only write refused"):
        a.put(f"{bucket.name}/a.bin", SMALL, create_only=True)


@pytest.mark.parametrize("create_only", [False, True], ids=["replace", "create-only"])
def test_a_session_whose_finalizing_answer_was_lost_is_not_a_failure(
        proxied: tuple[Bucket, FaultProxy], create_only: bool) -> None:
    """The retried finalizing request finds no session (404): the first one finalized it."""
    bucket, proxy = proxied
    final = Match(methods="PUT", where=lambda r: not r.headers.get("Content-Range",
                                                                   "").endswith("/*"))
    proxy.add(drop_connection(forward=True, match=final, times=1))
    adapter(bucket).put(f"{bucket.name}/a.bin", LARGE, create_only=create_only)
    assert [r.status for r in proxy.requests if r.method == "PUT"] == [308, 308, None, 404]
    assert Raw(bucket).get("a.bin") == LARGE


def test_a_writer_whose_marker_landed_but_whose_answer_was_lost_has_committed(
        fake_proxied: tuple[Bucket, FaultProxy], no_backoff: None) -> None:
    bucket, proxy = fake_proxied
    entry = Entry(bucket.path("e"), storage_options=bucket.storage_options)
    with entry.writing() as w:
        w.write_bytes("a.bin", SMALL)
        # From here the only upload is the marker's, at commit.
        proxy.add(drop_connection(forward=True, match=_UPLOAD, times=1))
    uploads = [r.status for r in proxy.requests if r.method == "POST" and "uploadType" in r.query]
    assert uploads[-2:] == [None, 412]
    assert entry.state() is durable.State.COMPLETE
    assert entry.verify(deep=True).ok
    assert Raw(bucket).keys() == [".durable/e/commit.json", "e/a.bin"]


# ----------------------------------------------------------------- modification times
def test_the_conditional_probe_writes_nothing_into_an_entrys_records(
        fake_proxied: tuple[Bucket, FaultProxy]) -> None:
    """The probe of conditional writes (once per endpoint, at the first lease or
    conditional delete) wrote its object beside the path asked about: into an entry's
    records. Another clean listing them then saw a new record and kept the entry as "a
    writer started while its data was being removed" (failed, exit 6), and one left by a
    crash made the entry look started. It goes in the bucket's own records folder, which
    no entry owns, as on S3."""
    from urllib.parse import unquote

    bucket, proxy = fake_proxied
    records = f"{bucket.name}/root/.durable/e/attempts/{'0' * 32}.json"
    assert adapter(bucket).supports_conditional(records)
    named = [unquote(n) for r in proxy.requests for n in r.query.get("name", [])]
    named += [unquote(r.path) for r in proxy.requests if r.method == "DELETE"]
    assert named and not [n for n in named if "root/" in n], named
    assert all(".durable/.durable-probe-" in n for n in named), named


def test_stat_and_listing_carry_the_stores_modification_time(gcs: Bucket) -> None:
    Raw(gcs).put("d/a.bin", SMALL)
    stamp = Raw(gcs).resource("d/a.bin")["updated"]
    assert isinstance(stamp, str)
    when = dt.datetime.fromisoformat(stamp).timestamp()
    a = adapter(gcs)
    info = a.info(f"{gcs.name}/d/a.bin")
    assert info is not None and info.modified == when
    assert a.list(f"{gcs.name}/d")["a.bin"].modified == when


# ------------------------------------------------------------------------- entries, verify
def test_entry_writing_is_complete_and_verifies(gcs: Bucket) -> None:
    entry = Entry(gcs.path("runs", "e1"), storage_options=gcs.storage_options)
    with entry.writing() as w:
        with w.fs.open(f"{w.path}/big.bin", "wb") as f:
            f.write(LARGE)
        w.fs.pipe_file(f"{w.path}/sub/small.bin", SMALL)

    assert entry.state() is durable.State.COMPLETE
    report = entry.verify(deep=True)
    assert report.ok and report.objects == 2
    assert report.bytes_checked == len(LARGE) + len(SMALL)
    assert Raw(gcs).get("runs/e1/big.bin") == LARGE


def test_corruption_behind_durables_back_is_caught(gcs: Bucket) -> None:
    url = gcs.path("a.bin")
    with atomic_write(url, storage_options=gcs.storage_options) as f:
        f.write(SMALL)
    flipped = bytes([SMALL[0] ^ 1]) + SMALL[1:]  # same size: only the CRC32C can tell
    raw = Raw(gcs)
    # The object's record (its metadata) kept: a multipart upload carrying it.
    raw.put_with_metadata("a.bin", flipped, raw.resource("a.bin")["metadata"])

    with pytest.raises(IntegrityError, match="crc32c"):
        Entry(url, storage_options=gcs.storage_options).verify(deep=True)
    with pytest.raises(IntegrityError, match="CRC32C"):
        read_verified(url, storage_options=gcs.storage_options)


def test_listing_follows_every_page(fake_gcs_bucket: Bucket) -> None:
    """fake-gcs-server pages listings by 1000, as GCS does: an entry's verify must see all."""
    raw = Raw(fake_gcs_bucket)
    keys = [f"many/{i:04d}" for i in range(1003)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: raw.put(k, k.encode()), keys))
    listed = adapter(fake_gcs_bucket).list(f"{fake_gcs_bucket.name}/many")
    assert sorted(listed) == [k.removeprefix("many/") for k in keys]
    assert {info.size for info in listed.values()} == {9}


# -------------------------------------------------------------------------- pinned reads
def test_object_replaced_mid_read_is_an_error(fake_gcs_bucket: Bucket) -> None:
    a = adapter(fake_gcs_bucket)
    path = f"{fake_gcs_bucket.name}/a.bin"
    a.put(path, LARGE)
    info = a.info(path)
    assert info is not None
    other = os.urandom(len(LARGE))
    with a.open_read(path, info) as f:
        assert f.read(1000) == LARGE[:1000]
        Raw(fake_gcs_bucket).put("a.bin", other)
        f.seek(CHUNK + 10)  # past what the first GET fetched: the next GET sees the swap
        with pytest.raises(IntegrityError, match="replaced"):
            f.read(1000)


def test_every_read_names_the_generation(proxied: tuple[Bucket, FaultProxy]) -> None:
    """The client side on gcp-storage-emulator, which ignores both parameters."""
    bucket, proxy = proxied
    a = adapter(bucket)
    info = a.put(f"{bucket.name}/a.bin", LARGE)
    rec = Recorder(proxy)
    assert a.read(f"{bucket.name}/a.bin") == LARGE
    gets = rec.requests("GET", alt="media")
    assert gets and gets == rec.requests("GET", alt="media", generation=str(info.version),
                                         ifGenerationMatch=str(info.version))


@pytest.mark.parametrize(("status", "builtin"), [(403, PermissionError), (400, OSError)])
@pytest.mark.parametrize("request_kind", ["resource", "media"])
def test_a_refused_read_is_the_builtin_naming_the_object(proxied: tuple[Bucket, FaultProxy],
                                                         status: int, builtin: type[OSError],
                                                         request_kind: str) -> None:
    """An error answer to a GET (the object's resource, or its bytes) is the builtin a
    caller catches, as on S3 and Azure, naming the object, the request and the status:
    never gcsfs's HttpError (no OSError), which made `durable verify` of many entries abort
    at one object instead of listing it, nor its bare "Forbidden: <http URL>"."""
    bucket, proxy = proxied
    options = bucket.storage_options
    for name in ("a", "b"):
        with Entry(bucket.path("root", name), storage_options=options).writing() as w:
            w.write_bytes("x.bin", b"x" * 1000)
    with atomic_write(bucket.path("one.bin"), storage_options=options) as f:
        f.write(b"y" * 1000)
    # The resource GET is /storage/v1/b/B/o/KEY, the media GET /download/...?alt=media.
    query = "alt" if request_kind == "media" else "!alt"
    proxy.add(error(status, match=Match(methods="GET", key="one.bin", query=query)))
    proxy.add(error(status, match=Match(methods="GET", key="root/a/x.bin", query="alt")))

    with pytest.raises(builtin, match=f"{bucket.name}/one.bin: GET of .* answered HTTP "
                                      f"{status}") as raised:
        read_verified(bucket.path("one.bin"), storage_options=options)
    assert not isinstance(raised.value, HttpError | IntegrityError)

    result = CliRunner().invoke(cli, ["verify", "--deep", "--json", bucket.path("root"),
                                      "--storage-options", json.dumps(options)])
    assert result.exit_code == 5, result.output  # a mismatch listed, not an abort (1)
    problems = [p for e in json.loads(result.output)["results"] for p in e["problems"]]
    assert [(p["key"], p["issue"]) for p in problems] == [("x.bin", "unreadable")]
    assert f"root/a/x.bin: GET of bytes 0-999 answered HTTP {status}" in problems[0]["found"]


@pytest.mark.parametrize(("status", "builtin"), [(403, PermissionError), (400, OSError)])
@pytest.mark.parametrize("upload", ["single", "resumable-start", "resumable-piece"])
def test_a_refused_upload_is_the_builtin_naming_the_object(
        proxied: tuple[Bucket, FaultProxy], status: int, builtin: type[OSError],
        upload: str) -> None:
    """An error answer to an upload request is the builtin naming the object and the
    status, as on S3 and Azure: never gcsfs's HttpError (no OSError) nor "Forbidden: <an
    http URL>"; nothing is published."""
    bucket, proxy = proxied
    url = bucket.path("a.bin")
    size = {"single": 1000, "resumable-start": CHUNK + 1, "resumable-piece": CHUNK + 1}[upload]
    match = {"single": Match(methods="POST", query="uploadType"),
             "resumable-start": Match(methods="POST", query="uploadType"),
             "resumable-piece": Match(methods="PUT", query="upload_id")}[upload]
    proxy.add(error(status, match=match))
    with pytest.raises(builtin, match=f"{bucket.name}/a.bin: .*answered HTTP {status}") \
            as raised, atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(b"u" * size)
    assert not isinstance(raised.value, HttpError | IntegrityError)
    assert Entry(url, storage_options=bucket.storage_options).state() is durable.State.ABSENT


def test_a_refused_delete_is_the_builtin_naming_the_object(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    """A DELETE refused (403): a PermissionError naming the object, as on S3; it was
    gcsfs's "Forbidden: b/NAME/o/KEY" (a URL path, not the object's URL)."""
    bucket, proxy = proxied
    a = adapter(bucket)
    a.put(f"{bucket.name}/d/a.bin", b"a")
    proxy.add(error(403, match=Match(methods="DELETE")))
    with pytest.raises(PermissionError, match=f"gs://{bucket.name}/d/a.bin: DELETE answered "
                                              "HTTP 403"):
        a.delete([f"{bucket.name}/d/a.bin"])


def test_a_stalled_body_is_a_timeout_naming_the_object(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    """A body that never comes, with gcsfs's requests_timeout set (without it gcsfs waits
    as long as the server stalls): a TimeoutError naming the object, not fsspec's
    FSTimeoutError with an empty message."""
    bucket, proxy = proxied
    options = {**bucket.storage_options, "requests_timeout": 2}
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=options) as f:
        f.write(b"s" * 1000)
    proxy.add(delay(60, where="body", match=Match(methods="GET", query="alt")))
    with pytest.raises(TimeoutError, match=f"{bucket.name}/a.bin: GET of bytes 0-999 "
                                           "stalled: no whole answer within the storage "
                                           "option requests_timeout"):
        read_verified(url, storage_options=options)


def test_a_stalled_body_is_given_up_on_by_default(proxied: tuple[Bucket, FaultProxy],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  no_backoff: None) -> None:
    """gcsfs sets no timeout: without requests_timeout in the storage options, a body that
    never came was waited for as long as the store stalled (forever). The adapter sets
    one (`gcs.READ_TIMEOUT` between reads, shortened here): the stalled GET is given up
    and sent again, and the read gets the object."""
    bucket, proxy = proxied
    monkeypatch.setattr(gcs_adapter, "READ_TIMEOUT", 0.5)
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(b"s" * 1000)
    assert bucket.filesystem().requests_timeout.sock_read == 0.5
    proxy.add(delay(600, where="body", match=Match(methods="GET", query="alt"), times=1))
    assert read_verified(url, storage_options=bucket.storage_options) == b"s" * 1000
    assert proxy.count(method="GET", query="alt") == 2


def test_a_ranged_get_answered_with_another_range_is_refused(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    """A store (or a proxy) answering a ranged GET with another range of the same length:
    refused by its Content-Range, as on S3. Only the length was checked, so an object
    without a record (read with require_record=False, or through durable::) was handed
    out with the wrong bytes."""
    bucket, proxy = proxied
    data = os.urandom(2 * CHUNK + 4096)  # over one read-ahead: ranged GETs after the first
    Raw(bucket).put("plain.bin", data)  # no record

    def shifted(request: RequestInfo) -> bool:
        start, _, end = (request.headers.get("Range") or "").removeprefix("bytes=").partition(
            "-")
        if start.isdigit() and end.isdigit() and int(start) > 0:
            request.headers.set("Range", f"bytes={int(start) - 4096}-{int(end) - 4096}")
        return False  # a fault that applies to nothing: the request was changed in passing

    proxy.add(delay(0, match=Match(methods="GET", where=shifted)))
    with pytest.raises(IntegrityError, match=r"plain\.bin: asked for bytes 8388608-.*, the "
                                             r"store answers Content-Range bytes 8384512-"):
        read_verified(bucket.path("plain.bin"), storage_options=bucket.storage_options,
                      require_record=False)
    with pytest.raises(IntegrityError, match="the store answers Content-Range"), \
            durable.open_verified(bucket.path("plain.bin"),
                                  storage_options=bucket.storage_options,
                                  require_record=False) as f:
        f.seek(CHUNK + 10)
        f.read(1000)


def test_a_connection_dropped_on_every_retry_is_an_oserror_naming_the_object(
        proxied: tuple[Bucket, FaultProxy], no_backoff: None) -> None:
    """A store that closes the connection on every request (the client's retries spent,
    a bounded number): an OSError naming the object and the request, as on S3; it was
    aiohttp's ServerDisconnectedError, no OSError, naming nothing. (gcsfs's six tries
    without their 1 + 2 + 4 + 8 + 16 s of sleep: no_backoff.)"""
    bucket, proxy = proxied
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(b"d" * 1000)
    proxy.add(drop_connection(match=Match(methods="GET", query="alt")))
    with pytest.raises(OSError, match=f"{bucket.name}/a.bin: GET of bytes 0-.* failed: "
                                      "Serv[A-Za-z]*Error: Server disconnected"):
        read_verified(url, storage_options=bucket.storage_options)
    assert proxy.count(method="GET", query="alt") > 1  # the retry path ran


def test_an_error_page_served_as_200_for_the_resource_names_the_object(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    """A gateway serving an XML error page as 200 to the JSON resource GET: an
    IntegrityError naming the object, never a bare JSONDecodeError naming nothing."""
    bucket, proxy = proxied
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(b"z" * 1000)
    proxy.add(error_body_with_200(match=Match(methods="GET", query="!alt")))
    with pytest.raises(IntegrityError, match=f"{bucket.name}/a.bin: GET of its resource "
                                             "answered a body that is not JSON"):
        read_verified(url, storage_options=bucket.storage_options)


GCS_ERROR_JSON = json.dumps({"error": {"code": 403, "message": "Access denied."}}).encode()


@pytest.mark.parametrize("body", [GCS_ERROR_JSON, b"{}"], ids=["error-document", "empty"])
def test_json_that_is_not_the_answer_asked_for_is_refused_naming_it(
        proxied: tuple[Bucket, FaultProxy], body: bytes) -> None:
    """A gateway serving GCS's own JSON error document (or any JSON but the resource or
    listing asked for) as 200: an IntegrityError naming the object or the listing. The
    resource was a bare KeyError 'size' naming nothing; the listing was taken for an empty
    one, so verify called every object "missing" and a writer was told a clean had removed
    its attempt record."""
    bucket, proxy = proxied
    options = bucket.storage_options
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=options) as f:
        f.write(b"z" * 1000)
    with Entry(bucket.path("ent"), storage_options=options).writing() as w:
        w.write_bytes("k.bin", b"k" * 100)

    resource = Match(methods="GET", path=r"/o/", query="!alt")
    proxy.add(rewrite_body(lambda _: body, match=resource))
    with pytest.raises(IntegrityError, match=f"{bucket.name}/a.bin: GET of its resource "
                                             "answered .*not the object's resource"):
        read_verified(url, storage_options=options)
    proxy.clear()

    proxy.add(rewrite_body(lambda _: body, match=Match(methods="GET", path=r"/o$")))
    with pytest.raises(IntegrityError, match=f"{bucket.name}/ent: the listing answered "
                                             ".*not a listing of objects"):
        adapter(bucket).list(f"{bucket.name}/ent")
    with pytest.raises(IntegrityError, match="not a listing of objects"):
        Entry(bucket.path("ent"), storage_options=options).verify()
    with pytest.raises(IntegrityError, match="not a listing of objects"), \
            Entry(bucket.path("ent2"), storage_options=options).writing() as w:
        w.write_bytes("a.bin", b"a")


def test_short_body_is_an_error(proxied: tuple[Bucket, FaultProxy]) -> None:
    """A store serving fewer bytes with consistent framing (incident 002/003)."""
    bucket, proxy = proxied
    a = adapter(bucket)
    info = a.put(f"{bucket.name}/a.bin", SMALL)
    proxy.add(short_object_fault(missing_bytes=1000, mode="consistent",
                                 match=Match(methods="GET", query="alt")))
    with a.open_read(f"{bucket.name}/a.bin", info) as f, pytest.raises(
            IntegrityError, match=f"the body had {len(SMALL) - 1000} bytes"):
        f.read(1000)  # bytes the short body does hold: still refused, the body is not whole


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """gcsfs's retries without their sleeps (1 + 2 + 4 + 8 + 16 s): the same six requests,
    at once."""
    import types

    import gcsfs.retry

    async def no_sleep(seconds: float) -> None:
        return None

    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=no_sleep))


@pytest.mark.parametrize("request_kind", ["resource", "listing", "media"])
@pytest.mark.usefixtures("no_backoff")
def test_an_answer_cut_short_on_every_attempt_names_the_object(
        proxied: tuple[Bucket, FaultProxy], request_kind: str) -> None:
    """The JSON answer to an object's resource GET, or to a listing, cut short on every
    attempt gcsfs made: an IntegrityError naming the object (or prefix) and the request;
    it was aiohttp's bare ClientPayloadError, naming nothing. (The object's bytes were
    already: never short data.)"""
    bucket, proxy = proxied
    url = bucket.path("e", "a.bin")
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(b"c" * 1000)
    if request_kind == "resource":
        proxy.add(truncate_body(keep=10, match=Match(methods="GET", query="!alt",
                                                     path=r"/o/e/a\.bin$")))
        with pytest.raises(IntegrityError, match=f"{bucket.name}/e/a.bin: GET of its "
                                                 "resource arrived short on every attempt"):
            read_verified(url, storage_options=bucket.storage_options)
    elif request_kind == "media":
        proxy.add(truncate_body(keep=10, match=Match(methods="GET", query="alt")))
        with pytest.raises(IntegrityError, match=f"{bucket.name}/e/a.bin: GET of bytes 0-999 "
                                                 "arrived short on every attempt"):
            read_verified(url, storage_options=bucket.storage_options)
    else:
        proxy.add(truncate_body(keep=10, match=Match(methods="GET", path=r"/o$")))
        with pytest.raises(IntegrityError, match=f"{bucket.name}/e: listing arrived short "
                                                 "on every attempt"):
            Entry(bucket.path("e"), storage_options=bucket.storage_options).verify()


def test_body_cut_mid_way_is_fetched_again_never_returned_short(
        proxied: tuple[Bucket, FaultProxy], no_backoff: None) -> None:
    """A connection dropped mid-body (full Content-Length, 1000 bytes): gcsfs retries the
    same pinned range. (Cut on every attempt, it is an IntegrityError after gcsfs's six
    tries: `test_an_answer_cut_short_on_every_attempt_names_the_object`.)"""
    bucket, proxy = proxied
    a = adapter(bucket)
    a.put(f"{bucket.name}/a.bin", SMALL)
    proxy.add(truncate_body(keep=1000, match=Match(methods="GET", query="alt"), times=1))
    assert a.read(f"{bucket.name}/a.bin") == SMALL
    assert proxy.count(method="GET", query="alt") == 2


# --------------------------------------------------------------------- conformance suite
class TestGCSConformance(AdapterTests):
    """The shared adapter contract, on fake-gcs-server: the emulator that enforces
    create-only (single-request uploads) and generation pins, as GCSAdapter declares."""

    raw: Raw

    @pytest.fixture
    def place(self, fake_gcs_bucket: Bucket) -> Iterator[tuple[Adapter, str]]:
        self.raw = Raw(fake_gcs_bucket)
        yield adapter(fake_gcs_bucket), f"{fake_gcs_bucket.name}/base"

    def _key(self, path: str) -> str:
        bucket, _, key = path.partition("/")
        assert bucket == self.raw.bucket
        return key

    def raw_put(self, path: str, data: bytes) -> None:
        self.raw.put(self._key(path), data)

    def raw_get(self, path: str) -> bytes | None:
        return self.raw.get(self._key(path))

    def raw_list(self, prefix: str) -> list[str]:
        below = self._key(prefix).rstrip("/") + "/"
        return [f"{self.raw.bucket}/{k}" for k in self.raw.keys(below)]


@pytest.mark.parametrize("server", ["gcs_bucket", "fake_gcs_bucket"])
def test_read_small_is_one_bounded_get(server: str, request: pytest.FixtureRequest) -> None:
    """`read_small` (tensorstore's marker reads): the bytes of a small object, an empty
    one too (no byte 0 to range over), None for none, and over the limit a ValueError
    giving the whole size, from the first limit + 1 bytes."""
    bucket: Bucket = request.getfixturevalue(server)
    a = adapter(bucket)
    fs = bucket.filesystem()
    for name, data in (("small", b"0123456789"), ("empty", b"")):
        fs.pipe_file(f"{bucket.name}/{name}", data)
        assert a.read_small(f"{bucket.name}/{name}", 10) == data
    assert a.read_small(f"{bucket.name}/absent", 10) is None
    with pytest.raises(ValueError, match=r"/small is 10 bytes, over the limit of 9"):
        a.read_small(f"{bucket.name}/small", 9)


@pytest.mark.parametrize("store", ["token stuck", "pages restart"])
def test_a_listing_that_goes_round_in_circles_is_an_error_never_a_hang(
        proxied: tuple[Bucket, FaultProxy], store: str) -> None:
    """A store whose page token never advances, or whose pages start over (the emulator
    answers a token it did not make with the first page again): the listing followed it
    for ever (scan, verify, every commit)."""
    bucket, proxy = proxied
    a = adapter(bucket)
    for k in ("p/a", "p/b"):
        a.put(f"{bucket.name}/{k}", b"x")
    pages = iter(range(1000))

    def circles(body: bytes) -> bytes:
        page, doc = next(pages), json.loads(body)
        if store == "token stuck" and page:
            doc["items"] = []  # empty pages, all "more at T"
        doc["nextPageToken"] = "T"
        return json.dumps(doc).encode()

    proxy.add(rewrite_body(circles, method="GET", path=rf"/b/{bucket.name}/o$"))
    with pytest.raises(OSError, match=rf"gs://{bucket.name}/p: .*round in circles"):
        a.list(f"{bucket.name}/p")
    assert next(pages) == 2  # it stopped at the first page that repeated a key or a token
