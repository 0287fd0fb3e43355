"""The Azure adapter against azurite: whole blobs or nothing, Content-MD5 the store checks,
create-only, reads pinned to an ETag.

The store is read and written *around* durable with the synchronous azure-storage-blob
client (not adlfs, not durable). Requests are corrupted or recorded by a fault proxy between
the adapter and azurite.
"""

from __future__ import annotations

import gc
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import fsspec
import pytest
from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
from azure.storage.blob import ContainerClient
from click.testing import CliRunner

import durable
from durable import Entry, IntegrityError, atomic_write, read_verified
from durable.adapters import adapter_for_fs
from durable.adapters.azure import BLOCK, SINGLE_PUT, AzureAdapter
from durable.adapters.base import Adapter
from durable.cli import cli
from durable.testing.conformance import AdapterTests
from durable.testing.faults import (
    Error,
    FaultProxy,
    Match,
    RequestInfo,
    corrupt_part_bytes,
    delay,
    drop_connection,
    error,
    error_body_with_200,
    rewrite_body,
    rewrite_etag,
    truncate_body,
)
from durable.testing.faults import short_object as short_object_fault
from durable.testing.pytest_plugin import Bucket
from durable.testing.servers import AzuriteServer

pytestmark = pytest.mark.azure

SMALL = os.urandom(100_000)
MEDIUM = os.urandom(SINGLE_PUT + 1)  # one block and a block list
LARGE = os.urandom(2 * BLOCK + 12_345)  # two blocks staged while writing, one at commit


# --------------------------------------------------------------------------- around durable
class Raw:
    """The container as another tool sees it: the plain synchronous SDK."""

    def __init__(self, bucket: Bucket) -> None:
        server = bucket.server
        assert isinstance(server, AzuriteServer)
        self.client = ContainerClient.from_connection_string(server.connection_string,
                                                             bucket.name)

    def get(self, key: str) -> bytes | None:
        try:
            data: bytes = self.client.download_blob(key).readall()
        except ResourceNotFoundError:
            return None
        return data

    def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> None:
        self.client.upload_blob(key, data, overwrite=True, metadata=metadata)

    def metadata(self, key: str) -> dict[str, str]:
        return dict(self.client.get_blob_client(key).get_blob_properties().metadata)

    def keys(self, prefix: str | None = None) -> list[str]:
        return sorted(b.name for b in self.client.list_blobs(name_starts_with=prefix))

    def blocks(self, key: str) -> tuple[int, int]:
        """(committed, uncommitted) block counts of ``key``."""
        committed, uncommitted = self.client.get_blob_client(key).get_block_list("all")
        return len(committed), len(uncommitted)


@pytest.fixture
def raw(azure_container: Bucket) -> Iterator[Raw]:
    r = Raw(azure_container)
    with r.client:
        yield r


@pytest.fixture
def proxied(azure_container: Bucket) -> Iterator[tuple[Bucket, FaultProxy]]:
    """azurite behind a fault proxy (the SharedKey signature does not cover the host)."""
    server = azure_container.server
    assert isinstance(server, AzuriteServer)
    with FaultProxy(server.url) as proxy:
        conn = server.connection_string.replace(server.url, proxy.url)
        yield Bucket(azure_container.name, "az", {"connection_string": conn}, server), proxy


def adapter(bucket: Bucket) -> AzureAdapter:
    a = adapter_for_fs(bucket.filesystem())
    assert isinstance(a, AzureAdapter)
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
@pytest.mark.parametrize("data", [b"", SMALL, MEDIUM, LARGE],
                         ids=["empty", "small", "medium", "large"])
def test_atomic_write_round_trip(azure_container: Bucket, raw: Raw, data: bytes) -> None:
    url = azure_container.path("d", "a.bin")
    options = azure_container.storage_options
    with atomic_write(url, storage_options=options) as f:
        f.write(data)

    assert raw.get("d/a.bin") == data
    assert read_verified(url, storage_options=options) == data
    assert Entry(url, storage_options=options).state() is durable.State.COMPLETE
    # One Put Blob, or blocks staged as written and one block list committed.
    blocks = {SMALL: (0, 0), MEDIUM: (1, 0), LARGE: (3, 0)}.get(data, (0, 0))
    assert raw.blocks("d/a.bin") == blocks


# ----------------------------------------------------------------- whole object or nothing
@pytest.mark.parametrize("exc", [ValueError("boom"), KeyboardInterrupt()])
def test_exception_mid_upload_leaves_no_blob(azure_container: Bucket, raw: Raw,
                                             exc: BaseException) -> None:
    with pytest.raises(type(exc)), atomic_write(
            azure_container.path("a.bin"),
            storage_options=azure_container.storage_options) as f:
        f.write(LARGE)
        f.flush()
        # Two blocks really are staged on the store, under the blob's name.
        assert raw.blocks("a.bin") == (0, 2)
        raise exc

    assert raw.keys() == []
    assert raw.get("a.bin") is None


def test_file_dropped_without_close_publishes_nothing(azure_container: Bucket,
                                                      raw: Raw) -> None:
    f = adapter(azure_container).open_atomic(f"{azure_container.name}/a.bin")
    f.write(LARGE)
    del f
    gc.collect()
    assert raw.keys() == []


def test_exception_keeps_previous_blob(azure_container: Bucket, raw: Raw) -> None:
    raw.put("a.bin", SMALL)
    with pytest.raises(ValueError), adapter(azure_container).open_atomic(
            f"{azure_container.name}/a.bin") as f:
        f.write(LARGE)
        raise ValueError("boom")
    assert raw.get("a.bin") == SMALL


# ------------------------------------------------------------------------------ checksums
@pytest.mark.parametrize(("data", "request_kind"), [
    (SMALL, "!comp"),  # Put Blob
    (LARGE, "comp"),   # Put Block (the first staged block)
], ids=["put-blob", "put-block"])
def test_store_refuses_bytes_that_do_not_match_content_md5(
        proxied: tuple[Bucket, FaultProxy], raw: Raw, data: bytes, request_kind: str) -> None:
    bucket, proxy = proxied
    proxy.add(corrupt_part_bytes(offset=7, match=Match(methods="PUT", query=request_kind),
                                 times=1))
    with pytest.raises(IntegrityError, match="Content-MD5"):
        adapter(bucket).put(f"{bucket.name}/a.bin", data)
    assert raw.keys() == []
    assert all("content-md5" in r.headers for r in proxy.requests if r.method == "PUT"
               and "blocklist" not in r.query.get("comp", []))


# ---------------------------------------------------------------------------- create-only
@pytest.mark.parametrize("data", [SMALL, MEDIUM, LARGE], ids=["put-blob", "one-block",
                                                            "blocks-while-writing"])
@pytest.mark.parametrize("create_only", [False, True], ids=["replace", "create-only"])
def test_a_write_into_a_missing_container_names_it(azure_container: Bucket, data: bytes,
                                                   create_only: bool) -> None:
    """A write into a mistyped container (an entry's first write is its attempt record)
    is a FileNotFoundError naming the blob and the container, as on GCS and S3: it was
    the SDK's ResourceNotFoundError (no OSError), which named neither."""
    a = adapter(azure_container)
    with pytest.raises(FileNotFoundError,
                       match=r"^abfs://no-such-container-x/p/o: no such container "
                             r"'no-such-container-x'") as raised, \
            a.open_atomic("no-such-container-x/p/o", create_only=create_only) as f:
        f.write(data)
    assert not isinstance(raised.value, HttpResponseError)
    with pytest.raises(FileNotFoundError, match=r"^az://no-such-container-x/\S*: no such "
                                                r"container 'no-such-container-x'"), \
            Entry("az://no-such-container-x/run",
                  storage_options=azure_container.storage_options).writing() as w:
        w.write_bytes("a.bin", b"a")


def test_create_only_race_has_exactly_one_winner(azure_container: Bucket, raw: Raw) -> None:
    a = adapter(azure_container)
    for round_ in range(20):
        key = f"race/{round_}"
        results = race(lambda i, key=key: a.put(f"{azure_container.name}/{key}",
                                                 f"writer {i}".encode(), create_only=True))
        assert sorted(results) == ["refused"] * 7 + ["won"], round_
        assert raw.get(key) == f"writer {results.index('won')}".encode()


def test_create_only_race_of_block_lists_has_exactly_one_winner(azure_container: Bucket,
                                                                 raw: Raw) -> None:
    """Each writer stages a block under the same name, then commits its block list with
    If-None-Match: *: exactly one list is committed, and it is one writer's whole blob."""
    a = adapter(azure_container)
    payloads = [bytes([i]) * len(MEDIUM) for i in range(8)]
    for round_ in range(5):
        key = f"race/{round_}"
        results = race(lambda i, key=key: a.put(f"{azure_container.name}/{key}", payloads[i],
                                                 create_only=True))
        assert sorted(results) == ["refused"] * 7 + ["won"], round_
        assert raw.get(key) == payloads[results.index("won")]


@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["put-blob", "block-list"])
def test_create_only_refused_on_existing_blob(azure_container: Bucket, raw: Raw,
                                              data: bytes) -> None:
    raw.put("a.bin", b"first")
    with pytest.raises(FileExistsError, match="create-only"):
        adapter(azure_container).put(f"{azure_container.name}/a.bin", data, create_only=True)
    assert raw.get("a.bin") == b"first"


# ------------------------------------------------ a create-only write whose answer was lost
# The store applies the request and the connection dies before its answer: the SDK sends it
# again, and the store refuses the retry (409). A writer whose blob stands must not be told
# that another writer was first.
_PUT_BLOB = Match(methods="PUT", query="!comp")
_PUT_BLOCK_LIST = Match(methods="PUT", query=lambda q: q.get("comp") == ["blocklist"])


@pytest.mark.parametrize(("data", "final"), [(SMALL, _PUT_BLOB), (MEDIUM, _PUT_BLOCK_LIST)],
                         ids=["put-blob", "block-list"])
def test_a_create_only_write_whose_answer_was_lost_is_not_refused_by_itself(
        proxied: tuple[Bucket, FaultProxy], raw: Raw, data: bytes, final: Match) -> None:
    bucket, proxy = proxied
    a = adapter(bucket)
    proxy.add(drop_connection(forward=True, match=final, times=1))
    info = a.put(f"{bucket.name}/a.bin", data, create_only=True)
    finals = [r.status for r in proxy.requests if r.method == "PUT" and
              r.query.get("comp") in (None, ["blocklist"])]
    assert finals == [None, 409]  # the answer lost, then the retry refused
    assert raw.get("a.bin") == data
    stat = a.info(f"{bucket.name}/a.bin")
    assert stat is not None and info.version == stat.version

    # Another writer's blob, even byte for byte the same, is still a refusal.
    with pytest.raises(FileExistsError, match="create-only write refused"):
        a.put(f"{bucket.name}/a.bin", data, create_only=True)


def test_a_writer_whose_marker_landed_but_whose_answer_was_lost_has_committed(
        proxied: tuple[Bucket, FaultProxy], raw: Raw) -> None:
    bucket, proxy = proxied
    entry = Entry(bucket.path("e"), storage_options=bucket.storage_options)
    with entry.writing() as w:
        w.write_bytes("a.bin", SMALL)
        # From here the only Put Blob is the marker's, at commit.
        proxy.add(drop_connection(forward=True, match=_PUT_BLOB, times=1))
    puts = [r.status for r in proxy.requests if r.method == "PUT" and "comp" not in r.query]
    assert puts[-2:] == [None, 409]
    assert entry.state() is durable.State.COMPLETE
    assert entry.verify(deep=True).ok
    assert raw.keys() == [".durable/e/commit.json", "e/a.bin"]


# ----------------------------------------------------------------- modification times
def test_stat_and_listing_carry_the_stores_modification_time(azure_container: Bucket,
                                                             raw: Raw) -> None:
    raw.put("d/a.bin", SMALL)
    props = raw.client.get_blob_client("d/a.bin").get_blob_properties()
    when = props.last_modified.timestamp()
    a = adapter(azure_container)
    info = a.info(f"{azure_container.name}/d/a.bin")
    assert info is not None and info.modified == when
    assert a.list(f"{azure_container.name}/d")["a.bin"].modified == when


# ------------------------------------------------------------------------- entries, verify
def test_entry_writing_is_complete_and_verifies(azure_container: Bucket, raw: Raw) -> None:
    entry = Entry(azure_container.path("runs", "e1"),
                  storage_options=azure_container.storage_options)
    with entry.writing() as w:
        with w.fs.open(f"{w.path}/big.bin", "wb") as f:
            f.write(LARGE)
        w.fs.pipe_file(f"{w.path}/sub/small.bin", SMALL)

    assert entry.state() is durable.State.COMPLETE
    report = entry.verify(deep=True)
    assert report.ok and report.objects == 2
    assert report.bytes_checked == len(LARGE) + len(SMALL)
    assert raw.get("runs/e1/big.bin") == LARGE


def test_corruption_behind_durables_back_is_caught(azure_container: Bucket,
                                                   raw: Raw) -> None:
    url = azure_container.path("a.bin")
    options = azure_container.storage_options
    with atomic_write(url, storage_options=options) as f:
        f.write(SMALL)
    # Same size, and the blob's record (its metadata) kept: only the CRC32C tells.
    raw.put("a.bin", bytes([SMALL[0] ^ 1]) + SMALL[1:], raw.metadata("a.bin"))

    with pytest.raises(IntegrityError, match="crc32c"):
        Entry(url, storage_options=options).verify(deep=True)
    with pytest.raises(IntegrityError, match="CRC32C"):
        read_verified(url, storage_options=options)


@pytest.mark.parametrize("name", ["p#", "p?", "a?b#c", "q?x/b#y"])
def test_a_name_adlfs_would_change_is_refused_never_another_blob(
        azure_container: Bucket, raw: Raw, name: str) -> None:
    """adlfs parses a path as a URL: a trailing '#' or '?' is dropped and 'a?b#c' becomes
    'a#c?b'. A write of "p#" replaced the blob "p" (and a read of "p#" returned "p"), and
    an entry's key "a?b#c" was written as "a#c?b" and listed under both names. Such a name
    is a ValueError naming it, on every way in; the names around it are untouched."""
    options = azure_container.storage_options
    raw.put("p", b"plain")
    raw.put("a#c?b", b"other")
    url = azure_container.path(name)
    for attempt in (lambda: atomic_write(url, storage_options=options).__enter__(),
                    lambda: read_verified(url, storage_options=options),
                    # (fsspec.open("durable::az://...") hands durable the path adlfs
                    # already made of it: no way to tell, see the guarantees page)
                    lambda: fsspec.filesystem("durable", target_protocol="az",
                                              target_options=options).cat(url),
                    lambda: Entry(url, storage_options=options).state()):
        with pytest.raises(ValueError, match=re.escape(name)):
            attempt()
    with pytest.raises(ValueError, match=re.escape(name)), \
            Entry(azure_container.path("run"), storage_options=options).writing() as w:
        w.write_bytes("ok.bin", b"ok")
        w.write_bytes(name, b"x")
    assert raw.get("p") == b"plain" and raw.get("a#c?b") == b"other"
    # (run/ok.bin: written before the refusal, in an entry never committed)
    names = raw.keys()
    assert {n for n in names if not n.startswith(".durable/")} <= {"p", "a#c?b", "run/ok.bin"}


@pytest.mark.parametrize("scheme", ["az", "abfs"])
def test_every_url_shown_uses_the_callers_scheme(azure_container: Bucket, raw: Raw,
                                                 scheme: str) -> None:
    """adlfs names itself abfs://: a user of az:// URLs was shown abfs:// ones (in errors,
    entry URLs, `durable scan`, durable::), names they never wrote; each is shown as
    written."""
    options = azure_container.storage_options
    root = f"{scheme}://{azure_container.name}"
    other = "abfs" if scheme == "az" else "az"
    with pytest.raises(FileNotFoundError) as missing:
        read_verified(f"{root}/nope.bin", storage_options=options)
    raw.put("e/x.bin", b"x")
    raw.put(".durable/e/commit.json", b"not json")
    with pytest.raises(durable.MarkerError) as corrupt:
        Entry(f"{root}/e", storage_options=options).state()
    entry = Entry(f"{root}/e2", storage_options=options)
    with entry.writing() as w:
        w.fs.pipe_file(f"{w.path}/y.bin", b"y")
    result = CliRunner().invoke(cli, ["scan", "--json", root, "--storage-options",
                                      json.dumps(options)])
    chained, inner = fsspec.core.url_to_fs(f"durable::{root}/nope.bin", **{scheme: options})
    with pytest.raises(FileNotFoundError) as through_fs:
        chained.cat_file(inner)
    shown = [str(missing.value), str(corrupt.value), entry.url, result.output,
             str(through_fs.value)]
    assert f"{root}/nope.bin" in shown[0]
    assert f"durable::{root}/nope.bin" in shown[4]
    assert f"{root}/.durable/e/commit.json" in shown[1]
    assert entry.url == f"{root}/e2"
    assert f"{root}/e2" in shown[3], result.output
    assert not [text for text in shown if f"{other}://" in text]


# -------------------------------------------------------------------------- pinned reads
@pytest.mark.parametrize("source", ["stat", "listing"])
def test_blob_replaced_mid_read_is_an_error(azure_container: Bucket, raw: Raw,
                                            source: str) -> None:
    a = adapter(azure_container)
    path = f"{azure_container.name}/d/a.bin"
    a.put(path, LARGE)
    stat, listed = a.info(path), a.list(f"{azure_container.name}/d")["a.bin"]
    assert stat == listed  # one version string for one blob, whichever way it was found
    info = stat if source == "stat" else listed
    assert info is not None
    with a.open_read(path, info) as f:
        assert f.read(1000) == LARGE[:1000]
        raw.put("d/a.bin", os.urandom(len(LARGE)))
        f.seek(BLOCK + 10)  # past what the first GET fetched: the next GET sees the swap
        with pytest.raises(IntegrityError, match="replaced"):
            f.read(1000)


def test_short_body_is_an_error(proxied: tuple[Bucket, FaultProxy]) -> None:
    """A store serving fewer bytes with consistent framing (incident 002/003)."""
    bucket, proxy = proxied
    a = adapter(bucket)
    info = a.put(f"{bucket.name}/a.bin", SMALL)
    proxy.add(short_object_fault(missing_bytes=1000, mode="consistent",
                                 match=Match(methods="GET")))
    with a.open_read(f"{bucket.name}/a.bin", info) as f, pytest.raises(
            IntegrityError, match=f"the body had {len(SMALL) - 1000} bytes"):
        f.read(1000)  # bytes the short body does hold: still refused, the body is not whole


@pytest.mark.parametrize("create_only", [False, True], ids=["overwrite", "create-only"])
def test_blocks_discarded_by_another_writers_commit_publish_nothing(
        proxied: tuple[Bucket, FaultProxy], create_only: bool) -> None:
    """Another writer's blob committed while this one staged blocks discards them: Azure
    answers Put Block List with 400 InvalidBlockList (azurite keeps the blocks: the
    proxy answers for it). An OSError saying so, or for a create-only write, the blob
    being there, the FileExistsError of a lost race."""
    bucket, proxy = proxied
    a = adapter(bucket)
    f = a.open_atomic(f"{bucket.name}/a.bin", create_only=create_only)
    f.write(LARGE)  # two blocks staged
    a.put(f"{bucket.name}/a.bin", b"the other writer's")
    proxy.add(Error(status=400, code="InvalidBlockList", message="The block list is invalid.",
                    extra_headers={"x-ms-error-code": "InvalidBlockList"},
                    match=Match(methods="PUT", query=lambda q: q.get("comp") == ["blocklist"])))
    expected = (FileExistsError, "exists: create-only") if create_only else \
        (OSError, "staged blocks were discarded")
    with pytest.raises(expected[0], match=expected[1]):
        f.commit()
    assert a.read(f"{bucket.name}/a.bin") == b"the other writer's"


@pytest.mark.parametrize(("status", "builtin"), [(403, PermissionError), (400, OSError)])
def test_a_refused_read_is_the_builtin_naming_the_blob(proxied: tuple[Bucket, FaultProxy],
                                                       status: int,
                                                       builtin: type[OSError]) -> None:
    """An error answer to a GET is the builtin a caller catches, as on S3 and GCS, naming
    the blob, the request and the status: never the SDK's HttpResponseError (no OSError),
    which made `durable verify` of many entries abort at one blob instead of listing it."""
    bucket, proxy = proxied
    options = bucket.storage_options
    for name in ("a", "b"):
        with Entry(bucket.path("root", name), storage_options=options).writing() as w:
            w.write_bytes("x.bin", SMALL)
    with atomic_write(bucket.path("one.bin"), storage_options=options) as f:
        f.write(SMALL)
    proxy.add(error(status, match=Match(methods="GET", key="one.bin")))
    proxy.add(error(status, match=Match(methods="GET", key="root/a/x.bin")))

    with pytest.raises(builtin, match=f"{bucket.name}/one.bin: GET of bytes .* answered "
                                      f"HTTP {status}") as raised:
        read_verified(bucket.path("one.bin"), storage_options=options)
    assert not isinstance(raised.value, HttpResponseError | IntegrityError)

    result = CliRunner().invoke(cli, ["verify", "--deep", "--json", bucket.path("root"),
                                      "--storage-options", json.dumps(options)])
    assert result.exit_code == 5, result.output  # a mismatch listed, not an abort (1)
    problems = [p for e in json.loads(result.output)["results"] for p in e["problems"]]
    assert [(p["key"], p["issue"]) for p in problems] == [("x.bin", "unreadable")]
    assert f"HTTP {status}" in problems[0]["found"]


@pytest.mark.parametrize(("status", "builtin"), [(403, PermissionError), (400, OSError)])
@pytest.mark.parametrize("data", [SMALL, LARGE], ids=["put-blob", "blocks"])
def test_a_refused_upload_is_the_builtin_naming_the_blob(
        proxied: tuple[Bucket, FaultProxy], status: int, builtin: type[OSError],
        data: bytes) -> None:
    """An error answer to Put Blob or Put Block is the builtin naming the blob and the
    status, as on S3 and GCS, never the SDK's HttpResponseError; nothing is published."""
    bucket, proxy = proxied
    url = bucket.path("a.bin")
    proxy.add(error(status, match=Match(methods="PUT")))
    with pytest.raises(builtin, match=f"{bucket.name}/a.bin: .*answered HTTP {status}") \
            as raised, atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(data)
    assert not isinstance(raised.value, HttpResponseError | IntegrityError)
    proxy.clear()
    assert Entry(url, storage_options=bucket.storage_options).state() is durable.State.ABSENT


def test_a_connection_dropped_on_every_retry_is_an_oserror_naming_the_blob(
        proxied: tuple[Bucket, FaultProxy], no_backoff: None) -> None:
    """A store that closes the connection on every request (the client's retries spent,
    a bounded number): an OSError naming the blob and the request, as on S3; it was
    the SDK's ServiceRequestError, no OSError, naming nothing. (The SDK's retries
    without their backoff: no_backoff.)"""
    bucket, proxy = proxied
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(b"d" * 1000)
    retry = bucket.filesystem().service_client._config.retry_policy
    proxy.add(drop_connection(match=Match(methods="GET")))
    with pytest.raises(OSError, match=f"{bucket.name}/a.bin: GET of bytes 0-.* failed: "
                                      "Serv[A-Za-z]*Error: Server disconnected"):
        read_verified(url, storage_options=bucket.storage_options)
    # The retry path ran: the GET was sent again, each time on a new connection.
    assert len([r for r in proxy.requests if r.method == "GET"]) > retry.total_retries


def test_a_stalled_body_is_a_timeout_naming_the_blob(
        proxied: tuple[Bucket, FaultProxy], no_backoff: None) -> None:
    """A body that never comes: with adlfs's read_timeout storage option (which the
    adapter's own requests ignored: they waited the SDK's 60 s per attempt, 3 minutes), a
    TimeoutError naming the blob and saying it stalled; it said "answered HTTP None"."""
    bucket, proxy = proxied
    options = {**bucket.storage_options, "read_timeout": 1}
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=options) as f:
        f.write(b"s" * 1000)
    proxy.add(delay(600, where="body", match=Match(methods="GET")))
    with pytest.raises(TimeoutError, match=f"{bucket.name}/a.bin: GET of bytes 0-.* "
                                           "stalled: no data within the read timeout") \
            as raised:
        read_verified(url, storage_options=options)
    assert "HTTP None" not in str(raised.value)
    # Every stalled attempt's response closed: each held its connection until exit
    # ("ResourceWarning: Unclosed response", three per stalled read).
    gc.collect()
    assert [r for r in gc.get_objects() if isinstance(r, aiohttp.ClientResponse)
            and r.connection is not None and bucket.name in str(r.url)] == []


@pytest.mark.parametrize("call", ["now", "list_uploads"])
def test_a_refused_listing_for_clean_is_the_builtin_naming_the_prefix(
        proxied: tuple[Bucket, FaultProxy], call: str) -> None:
    """What `durable clean` lists (the store's clock, uploads left open) refused with 403:
    a PermissionError naming the prefix, as every other listing's; it was the SDK's
    HttpResponseError (no OSError), naming nothing."""
    bucket, proxy = proxied
    proxy.add(error(403, match=Match(methods="GET", query="comp")))
    a = adapter(bucket)
    with pytest.raises(PermissionError, match=f"{bucket.name}/d.*: listing answered HTTP "
                                              "403") as raised:
        getattr(a, call)(f"{bucket.name}/d/x")
    assert not isinstance(raised.value, HttpResponseError)


def test_a_refused_delete_is_the_builtin_naming_the_blob(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    """A Delete Blob refused (403): a PermissionError naming the blob, as on S3; it was
    the SDK's HttpResponseError, naming nothing (a `durable clean` stopped on it)."""
    bucket, proxy = proxied
    a = adapter(bucket)
    a.put(f"{bucket.name}/d/a.bin", b"a")
    proxy.add(error(403, match=Match(methods="DELETE")))
    with pytest.raises(PermissionError, match=f"{bucket.name}/d/a.bin: delete_blob answered "
                                              "HTTP 403") as raised:
        a.delete([f"{bucket.name}/d/a.bin"])
    assert not isinstance(raised.value, HttpResponseError)


def test_an_error_page_served_as_200_to_a_listing_is_refused(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    """A gateway serving an error page as 200 to List Blobs: an IntegrityError naming the
    prefix, never an empty listing (entries would look ABSENT) nor the SDK's
    AttributeError; `durable verify ROOT` says so and exits 1, as on S3 and GCS."""
    bucket, proxy = proxied
    options = bucket.storage_options
    with Entry(bucket.path("root", "a"), storage_options=options).writing() as w:
        w.write_bytes("x.bin", SMALL)
    proxy.add(error_body_with_200(match=Match(
        methods="GET", query=lambda q: q.get("comp") == ["list"])))
    with pytest.raises(IntegrityError, match=f"{bucket.name}/root/a/?: the listing's answer "
                                             "is not a blob listing"):
        Entry(bucket.path("root", "a"), storage_options=options).verify()
    result = CliRunner().invoke(cli, ["verify", bucket.path("root"),
                                      "--storage-options", json.dumps(options)])
    assert result.exit_code == 1
    assert "the listing's answer is not a blob listing" in " ".join(result.output.split())


def test_an_error_page_served_as_200_to_a_ranged_get_names_the_blob(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    """A gateway serving an error page as 200 (no Content-Range) to the ranged GET that
    reads a blob: an IntegrityError naming the blob, never the SDK's bare ValueError."""
    bucket, proxy = proxied
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(SMALL)
    proxy.add(error_body_with_200(match=Match(methods="GET")))
    with pytest.raises(IntegrityError, match=f"{bucket.name}/a.bin: the GET of bytes 0-.* "
                                             "without a usable Content-Range"):
        read_verified(url, storage_options=bucket.storage_options)


@pytest.mark.parametrize("style", ["weak", "empty", "missing"])
@pytest.mark.parametrize("size", [len(SMALL), BLOCK + 1], ids=["one-get", "pinned-get"])
def test_an_unusable_etag_is_named_not_passed_on(proxied: tuple[Bucket, FaultProxy],
                                                 style: str, size: int) -> None:
    """A proxy's weak, empty or missing ETag is an IntegrityError saying so, as on S3: it
    was quoted as it came ('"W/"0x.."', '"None"'), and the pinned GET it made (a blob over
    one read-ahead) was refused by the store, reported as the blob replaced since opened."""
    bucket, proxy = proxied
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(LARGE[:size])
    proxy.add(rewrite_etag(style, match=Match(methods="GET")))  # type: ignore[arg-type]
    with pytest.raises(IntegrityError, match=f"{bucket.name}/a.bin: the store answered .*"
                                             "ETag") as raised:
        read_verified(url, storage_options=bucket.storage_options)
    assert "replaced" not in str(raised.value)


def test_an_unquoted_etag_still_pins_reads(proxied: tuple[Bucket, FaultProxy]) -> None:
    bucket, proxy = proxied
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(LARGE)
    proxy.add(rewrite_etag("unquoted", match=Match(methods="GET")))
    assert read_verified(url, storage_options=bucket.storage_options) == LARGE


def test_a_store_ignoring_if_match_cannot_serve_another_version(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    """A blob over one read-ahead is read by a first GET and then pinned ranged GETs; an
    endpoint that ignores If-Match answers one with another version (its ETag says so):
    refused, as on S3, never another version's bytes spliced onto the first."""
    bucket, proxy = proxied
    url = bucket.path("a.bin")
    with atomic_write(url, storage_options=bucket.storage_options) as f:
        f.write(LARGE)
    def later(r: RequestInfo) -> bool:  # every GET but the first, from byte 0
        asked = r.headers.get("x-ms-range") or r.headers.get("Range") or ""
        return not asked.startswith("bytes=0-")

    proxy.add(rewrite_etag(lambda _: '"0xANOTHER"', match=Match(methods="GET", where=later)))
    with pytest.raises(IntegrityError, match=f"{bucket.name}/a.bin: replaced since it was "
                                             'opened .*served ETag "0xANOTHER"'):
        read_verified(url, storage_options=bucket.storage_options)


@pytest.mark.parametrize("times", [1, None], ids=["once", "always"])
def test_body_cut_mid_way_is_never_returned_short(proxied: tuple[Bucket, FaultProxy],
                                                  times: int | None, no_backoff: None) -> None:
    """A connection dropped mid-body (full Content-Length, 1000 bytes): the SDK retries
    the same pinned range; cut every time, it is an IntegrityError naming the blob."""
    bucket, proxy = proxied
    a = adapter(bucket)
    a.put(f"{bucket.name}/a.bin", SMALL)
    proxy.add(truncate_body(keep=1000, match=Match(methods="GET"), times=times))
    if times is None:
        with pytest.raises(IntegrityError, match=f"{bucket.name}/a.bin.*arrived short"):
            a.read(f"{bucket.name}/a.bin")
    else:
        assert a.read(f"{bucket.name}/a.bin") == SMALL


# --------------------------------------------------------------------- conformance suite
class TestAzureConformance(AdapterTests):
    """The shared adapter contract on azurite."""

    raw: Raw

    @pytest.fixture
    def place(self, azure_container: Bucket) -> Iterator[tuple[Adapter, str]]:
        self.raw = Raw(azure_container)
        with self.raw.client:
            yield adapter(azure_container), f"{azure_container.name}/base"

    def _key(self, path: str) -> str:
        container, _, key = path.partition("/")
        assert container == self.raw.client.container_name
        return key

    def raw_put(self, path: str, data: bytes) -> None:
        self.raw.put(self._key(path), data)

    def raw_get(self, path: str) -> bytes | None:
        return self.raw.get(self._key(path))

    def raw_list(self, prefix: str) -> list[str]:
        below = self._key(prefix).rstrip("/") + "/"
        return [f"{self.raw.client.container_name}/{k}" for k in self.raw.keys(below)]


# ------------------------------------------------------------------- racing entry commits
def test_writers_racing_to_commit_one_entry_leave_exactly_one_marker(
        azure_container: Bucket, raw: Raw) -> None:
    """Two (then eight) writers finish the same entry at once, over many rounds: one
    marker, the others AlreadyCompleteError, and the standing entry verifies deep."""
    for writers, rounds in ((2, 15), (8, 5)):
        for r in range(rounds):
            key = f"race/{writers}-{r}/entry"
            url = azure_container.path(*key.split("/"))
            opts = azure_container.storage_options
            ready = threading.Barrier(writers, timeout=60)

            def one(i: int, url: str = url, ready: threading.Barrier = ready,
                    opts: dict[str, object] = opts) -> str:
                # Every writer joins the same attempt window, writes identical bytes, and
                # waits for the others before committing.
                with Entry(url, storage_options=opts).writing(resume=True) as w:
                    w.fs.pipe_file(f"{w.path}/a.bin", b"a" * 1000)
                    w.fs.pipe_file(f"{w.path}/b/c.bin", b"c" * 3000)
                    ready.wait()
                return "won"

            def run(i: int) -> str:
                try:
                    return one(i)
                except durable.AlreadyCompleteError:
                    return "lost"

            with ThreadPoolExecutor(writers) as pool:
                outcomes = sorted(pool.map(run, range(writers)))
            assert outcomes == ["lost"] * (writers - 1) + ["won"], (key, outcomes)
            parent = key.rpartition("/")[0]
            assert raw.keys(f"{parent}/.durable/entry/") == [
                f"{parent}/.durable/entry/commit.json"]
            entry = Entry(url, storage_options=opts)
            assert entry.state() is durable.State.COMPLETE
            assert entry.verify(deep=True).ok


def test_a_listing_whose_pages_start_over_is_an_error_never_a_hang(
        proxied: tuple[Bucket, FaultProxy]) -> None:
    """A store whose continuation marker restarts the listing (azurite answers a marker it
    did not make with the first page again): the SDK's pager followed it for ever."""
    bucket, proxy = proxied
    a = adapter(bucket)
    for k in ("p/a", "p/b"):
        a.put(f"{bucket.name}/{k}", b"x")
    pages = iter(range(1000))

    def restarts(body: bytes) -> bytes:
        next(pages)
        body = re.sub(rb"<NextMarker\s*/>|<NextMarker>[^<]*</NextMarker>", b"", body)
        return body.replace(b"</Blobs>", b"</Blobs><NextMarker>T</NextMarker>")

    proxy.add(rewrite_body(restarts, method="GET", query="comp"))
    with pytest.raises(OSError, match=rf"{bucket.name}/p: .*round in circles"):
        a.list(f"{bucket.name}/p")
    assert next(pages) == 2  # it stopped at the first page that repeated a key
