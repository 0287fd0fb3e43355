"""Records in object metadata on Azure and GCS: an object carries its own size and CRC32C.

`atomic_write` publishes a blob's record as ``x-ms-meta-durable_*`` in the request that
publishes its bytes (Put Blob, or Put Block List for a blob of staged blocks), so a 1 MiB
write is one request and `read_verified` one GET; every reader judges such a blob by that
record, never by a marker beside it. Written against azurite (through the fault proxy where
requests are counted or a fault is injected); the "outside" view is the plain synchronous
Azure SDK, so hostile metadata and overwrites keeping the metadata are real requests.

GCS (the last section, on gcp-storage-emulator, which stores and returns custom metadata
as GCS does): the single-request upload (up to 8 MiB) carries the record in its object
resource; a resumable upload keeps its sidecar marker. The outside view there is plain
JSON API requests (test_gcs.py's `Raw`). S3 is tested in test_object_metadata_record.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

import durable
from durable import Entry, IncompleteError, IntegrityError, MarkerError, State
from durable._checksum import crc32c, crc_to_hex
from durable._ops import apply_clean, mark_complete_root, plan_clean, verify_root
from durable._scan import scan, survey
from durable.adapters import resolve
from durable.cli import EXIT_ERROR
from durable.testing.faults import FaultProxy, Match, drop_connection, strip_headers
from durable.testing.pytest_plugin import Bucket
from durable.testing.servers import AzuriteServer
from test_azure import Raw
from test_gcs import Raw as GCSRaw
from test_object_metadata_record import _cli, _readers
from test_ops import kill_writers

MiB = 1024 * 1024
MULTI = 9 * MiB  # over the adapter's 8 MiB block: staged blocks and one Put Block List


class Outside(Raw):
    """The container as another tool sees it: the plain synchronous Azure SDK."""

    def overwrite_keeping_metadata(self, key: str, data: bytes) -> None:
        """New bytes under the blob's name, its metadata (its record) copied over."""
        self.put(key, data, self.metadata(key))

    def listing(self) -> list[str]:
        return self.keys()


@pytest.fixture
def outside(azure_container: Bucket) -> Iterator[Outside]:
    o = Outside(azure_container)
    with o.client:
        yield o


@pytest.fixture
def proxied(azure_container: Bucket) -> Iterator[tuple[dict[str, Any], FaultProxy]]:
    """Storage options reaching azurite through a fault proxy, and the proxy."""
    server = azure_container.server
    assert isinstance(server, AzuriteServer)
    with FaultProxy(server.url) as proxy:
        yield {"connection_string": server.connection_string.replace(server.url,
                                                                     proxy.url)}, proxy


def _write(url: str, data: bytes, options: dict[str, Any], mode: str = "wb") -> None:
    with durable.atomic_write(url, mode, storage_options=options) as f:
        f.write(data)


def _record(data: bytes, **changes: str | None) -> dict[str, str]:
    """A valid record of ``data`` as Azure metadata, fields changed (None removes one)."""
    meta = {"durable_version": "1", "durable_size": str(len(data)),
            "durable_crc32c": crc_to_hex(crc32c(data)),
            "durable_attempt": "0123456789abcdef0123456789abcdef",
            "durable_committed_at": "2026-01-02T03:04:05.000000Z"}
    for key, value in changes.items():
        if value is None:
            meta.pop(f"durable_{key}")
        else:
            meta[f"durable_{key}"] = value
    return meta


def _requests(proxy: FaultProxy, container: str) -> list[tuple[str, str]]:
    """(method, what) of each request since the last call: the blob's key, with
    ``?comp=...`` for block and block-list requests."""
    seen = []
    for r in proxy.requests:
        key = r.path.partition(f"/{container}/")[2]
        comp = r.query.get("comp", [""])[0]
        seen.append((r.method, f"{key}?comp={comp}" if comp else key))
    proxy.clear_requests()
    return seen


def _name(url: str) -> str:
    return url.rpartition("/")[2]


# ------------------------------------------------------------------------ requests, records
# The marker of the folder above a write in "d": is "d" a committed entry (read-only then)?
ABOVE = ("GET", ".durable/d/commit.json")


@pytest.mark.azure
def test_a_1_mib_write_is_one_put_blob_and_read_verified_one_get(
        azure_container: Bucket, proxied: tuple[dict[str, Any], FaultProxy],
        outside: Outside) -> None:
    options, proxy = proxied
    c = azure_container.name
    url, data = azure_container.path("d", "obj.bin"), os.urandom(MiB)
    proxy.clear_requests()
    _write(url, data, options)
    # Before: a marker stat, the Put Blob, a verify stat, the marker's Put Blob. Now the
    # Put Blob with its record, after one GET: no committed entry around it ("d").
    assert _requests(proxy, c) == [ABOVE, ("PUT", "d/obj.bin")]
    assert outside.listing() == ["d/obj.bin"]  # no marker beside it
    meta = outside.metadata("d/obj.bin")
    assert (meta["durable_version"], meta["durable_size"], meta["durable_crc32c"]) == (
        "1", str(MiB), crc_to_hex(crc32c(data)))
    assert durable.read_verified(url, storage_options=options) == data
    assert _requests(proxy, c) == [("GET", "d/obj.bin")]
    st = Entry(url, storage_options=options).status()
    assert st.state is State.COMPLETE and "own metadata" in st.reason


@pytest.mark.azure
def test_a_blob_of_staged_blocks_carries_its_record_in_the_block_list(
        azure_container: Bucket, proxied: tuple[dict[str, Any], FaultProxy],
        outside: Outside) -> None:
    options, proxy = proxied
    c = azure_container.name
    url, data = azure_container.path("d", "big.bin"), os.urandom(MULTI)
    proxy.clear_requests()
    _write(url, data, options)
    # Two blocks, the block list with the record, and the verify stat (a block list's
    # answer carries no digest of the whole blob); the GET of the marker above ("d") made
    # while the blocks go, answered before the block list.
    got = _requests(proxy, c)
    assert sorted(got) == sorted([ABOVE, ("PUT", "d/big.bin?comp=block"),
                                  ("PUT", "d/big.bin?comp=block"),
                                  ("PUT", "d/big.bin?comp=blocklist"), ("HEAD", "d/big.bin")])
    assert got.index(ABOVE) < got.index(("PUT", "d/big.bin?comp=blocklist"))
    assert outside.listing() == ["d/big.bin"]
    assert outside.metadata("d/big.bin")["durable_crc32c"] == crc_to_hex(crc32c(data))
    assert durable.read_verified(url, storage_options=options) == data
    # The first 8 MiB come with the record, the rest pinned to the ETag it gave.
    got = _requests(proxy, c)
    assert got == [("GET", "d/big.bin"), ("GET", "d/big.bin")]
    assert Entry(url, storage_options=options).verify(deep=True).ok


@pytest.mark.azure
def test_a_put_blob_answered_without_its_md5_is_stat_ed(
        azure_container: Bucket, proxied: tuple[dict[str, Any], FaultProxy]) -> None:
    """No request is saved on the word of an answer that does not prove the bytes."""
    options, proxy = proxied
    proxy.add(strip_headers(r"^content-md5$", match=Match(methods="PUT")))
    url, data = azure_container.path("d", "obj.bin"), os.urandom(1000)
    proxy.clear_requests()
    _write(url, data, options)
    assert _requests(proxy, azure_container.name) == [ABOVE, ("PUT", "d/obj.bin"),
                                                      ("HEAD", "d/obj.bin")]
    assert durable.read_verified(url, storage_options=options) == data


@pytest.mark.azure
def test_a_create_only_write_retried_after_a_lost_answer_keeps_token_and_record(
        azure_container: Bucket, proxied: tuple[dict[str, Any], FaultProxy],
        outside: Outside) -> None:
    options, proxy = proxied
    url, data = azure_container.path("d", "obj.bin"), os.urandom(1000)
    # The store takes the Put Blob, the answer is lost; the SDK's retry is refused (409).
    proxy.add(drop_connection(forward=True, match=Match(methods="PUT"), times=1))
    _write(url, data, options, mode="xb")
    meta = outside.metadata("d/obj.bin")
    assert "durable_write" in meta and meta["durable_crc32c"] == crc_to_hex(crc32c(data))
    assert durable.read_verified(url, storage_options=options) == data
    with pytest.raises(FileExistsError):
        _write(url, b"other", options, mode="xb")


# --------------------------------------------------------------------------------- readers
@pytest.mark.azure
def test_a_body_not_matching_its_record_is_refused_on_every_path(
        azure_container: Bucket, outside: Outside) -> None:
    options = azure_container.storage_options
    url, data = azure_container.path("d", "obj.bin"), os.urandom(4096)
    _write(url, data, options)
    flipped = bytes([data[0] ^ 1]) + data[1:]  # same size: only the CRC32C can tell
    outside.overwrite_keeping_metadata("d/obj.bin", flipped)
    assert outside.get("d/obj.bin") == flipped
    readers = _readers(url, options)
    for name in ("read_verified", "open_verified"):
        with pytest.raises(IntegrityError, match=r"obj\.bin: CRC32C .* the record says"):
            readers[name]()
    with pytest.raises(IntegrityError, match="crc32c"):
        readers["verify deep"]()
    code, doc = _cli("verify", url, "--deep", options=options)
    assert code == 5 and [p["issue"] for p in doc["problems"]] == ["crc32c"]


@pytest.mark.azure
def test_a_stale_marker_beside_a_blob_carrying_its_record_is_ignored(
        azure_container: Bucket, outside: Outside) -> None:
    options = azure_container.storage_options
    url = azure_container.path("d", "obj.bin")
    # A marker of other bytes: an object written before, adopted by mark-complete.
    outside.put("d/obj.bin", os.urandom(5000))
    Entry(url, storage_options=options).mark_complete()
    assert outside.listing() == ["d/.durable/obj.bin/commit.json", "d/obj.bin"]
    data = b"new, smaller bytes"
    _write(url, data, options)
    assert outside.listing() == ["d/.durable/obj.bin/commit.json", "d/obj.bin"]
    readers = _readers(url, options)
    assert readers["read_verified"]() == data
    assert readers["open_verified"]() == data
    assert readers["status"]().state is State.COMPLETE  # type: ignore[attr-defined]
    assert readers["verify deep"]().ok  # type: ignore[attr-defined]
    assert [(r.state, r.objects) for r in scan(azure_container.path("d"), options)] == [
        ("COMPLETE", 1)]
    # A plain overwrite by another tool drops the metadata: the stale marker then governs,
    # and it does not match: loud on every path.
    outside.put("d/obj.bin", b"plain overwrite")
    for name, read in readers.items():
        if name == "status":
            assert read().state is State.INCOMPLETE, name  # type: ignore[attr-defined]
        else:
            with pytest.raises(IntegrityError, match=r"obj\.bin"):
                read()


HOSTILE: dict[str, dict[str, str | None]] = {
    "size not a number": {"size": "12abc"},
    "huge size": {"size": "9" * 30},
    "crc32c not hex": {"crc32c": "zzzzzzzz"},
    "future version": {"version": "2"},
    "size missing": {"size": None},
    "attempt not alphanumeric": {"attempt": "../../x"},
}


@pytest.mark.azure
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_metadata_record_is_a_marker_error_naming_the_blob(
        azure_container: Bucket, outside: Outside, case: str) -> None:
    options = azure_container.storage_options
    url, data = azure_container.path("d", "obj.bin"), b"payload"
    outside.put("d/obj.bin", data, _record(data, **HOSTILE[case]))
    for name, read in _readers(url, options).items():
        with pytest.raises(MarkerError, match=r"d/obj\.bin: metadata record") as info:
            read()
        assert info.value.url.endswith("/d/obj.bin"), name
    code, message = _cli("status", url, options=options)
    assert code == EXIT_ERROR and "d/obj.bin: metadata record" in message
    (row,) = scan(azure_container.path("d"), options)
    assert row.state == "ERROR" and "metadata record" in row.reason


@pytest.mark.azure
def test_a_record_named_in_other_case_is_still_the_blobs_record(
        azure_container: Bucket, outside: Outside) -> None:
    """Azure metadata names are case-insensitive: another tool's Durable_Size is the same
    field (so a flipped byte under it is still caught)."""
    options = azure_container.storage_options
    url, data = azure_container.path("d", "obj.bin"), b"payload"
    meta = {k.title(): v for k, v in _record(data).items()}
    outside.put("d/obj.bin", data, meta)
    assert durable.read_verified(url, storage_options=options) == data
    outside.put("d/obj.bin", b"Payload", meta)
    with pytest.raises(IntegrityError, match=r"obj\.bin: CRC32C"):
        durable.read_verified(url, storage_options=options)


# ------------------------------------------------------------------- scans, verify, clean
@pytest.mark.azure
def test_scan_and_verify_of_a_prefix_of_recorded_blobs(
        azure_container: Bucket, outside: Outside) -> None:
    options = azure_container.storage_options
    data = {"a.bin": b"recorded a", "b.bin": os.urandom(MULTI)}
    for name, body in data.items():
        _write(azure_container.path("p", name), body, options)
    assert outside.listing() == ["p/a.bin", "p/b.bin"]  # no sidecar records at all
    prefix = azure_container.path("p")
    code, doc = _cli("verify", prefix, "--deep", options=options)
    assert code == 0 and doc["ok"], doc
    assert [_name(r["url"]) for r in doc["results"]] == sorted(data)
    assert doc["bytes_checked"] == sum(map(len, data.values()))
    rows = scan(prefix, options)
    assert [(_name(r.url), r.state) for r in rows] == [("a.bin", "COMPLETE"),
                                                       ("b.bin", "COMPLETE")]
    # A plain blob beside them: listed, but not verified (it has no record).
    outside.put("p/plain.bin", b"written by another tool")
    report = verify_root(survey(*resolve(prefix, options)), deep=True)
    assert report.ok and [_name(r.url) for r in report.reports] == sorted(data)
    assert {_name(r.url): r.state for r in scan(prefix, options)} == {
        "a.bin": "COMPLETE", "b.bin": "COMPLETE", "plain.bin": "INCOMPLETE"}


def _stale_attempt(outside: Outside, parent: str, name: str) -> None:
    """Records of a writer killed long ago: an attempt record, no marker."""
    body = {"format": "durable.commit.attempt", "attempt": "a" * 32,
            "started_at": "2000-01-01T00:00:00.000000Z", "writer": {}}
    outside.put(f"{parent}/.durable/{name}/attempts/{'a' * 32}.json",
                json.dumps(body).encode())


@pytest.mark.azure
def test_clean_never_deletes_a_blob_recorded_in_its_metadata(
        azure_container: Bucket, outside: Outside) -> None:
    options = azure_container.storage_options
    root = azure_container.path("r")
    _write(f"{root}/started.bin", b"recorded in its metadata", options)
    _stale_attempt(outside, "r", "started.bin")
    # Recorded only after the plan was made: apply checks again.
    outside.put("r/late.bin", b"plain")
    _stale_attempt(outside, "r", "late.bin")
    outside.put("r/dead.bin", b"half")  # a true leftover, for contrast: removed
    _stale_attempt(outside, "r", "dead.bin")

    sv = survey(*resolve(root, options))
    report = plan_clean(sv, older_than=0, lease_wait=0, clock="local")
    assert sorted(_name(i.url) for i in report.items) == ["dead.bin", "late.bin"]
    assert any(_name(k.url) == "started.bin" and "own metadata" in k.reason
               for k in report.kept)
    _write(f"{root}/late.bin", b"committed since the plan", options)
    apply_clean(sv, report)
    assert {_name(i.url): i.status for i in report.items} == {"dead.bin": "removed",
                                                              "late.bin": "skipped"}
    assert "r/dead.bin" not in outside.listing()
    assert outside.get("r/started.bin") == b"recorded in its metadata"
    assert outside.get("r/late.bin") == b"committed since the plan"
    for name in ("started.bin", "late.bin"):
        assert Entry(f"{root}/{name}", storage_options=options).state() is State.COMPLETE


@pytest.mark.azure
def test_clean_keeps_a_dead_writers_entry_that_holds_a_recorded_blob(
        azure_container: Bucket, outside: Outside) -> None:
    options = azure_container.storage_options
    root = azure_container.path("runs")
    kill_writers(root, options, ["42", "44"], strays=False)
    model = os.urandom(1000)
    _write(f"{root}/42/model.bin", model, options)
    sv = survey(*resolve(root, options))
    report = plan_clean(sv, older_than=0, lease_wait=0, clock="local")
    assert [_name(i.url) for i in report.items] == ["44"]
    (kept,) = [k for k in report.kept if _name(k.url) == "42"]
    assert "42/model.bin" in kept.reason and "own metadata" in kept.reason
    apply_clean(sv, report)
    keys = outside.listing()
    assert not [k for k in keys if k.startswith(("runs/44/", "runs/.durable/44/"))]
    assert {"runs/42/zarr.json", "runs/42/c/0", "runs/42/model.bin"} <= set(keys)
    assert durable.read_verified(f"{root}/42/model.bin", storage_options=options) == model


@pytest.mark.azure
def test_an_unrecorded_write_stays_unrecorded(azure_container: Bucket,
                                              outside: Outside) -> None:
    """record=False sends no record; a plain blob is INCOMPLETE, never COMPLETE."""
    options = azure_container.storage_options
    url = azure_container.path("d", "obj.bin")
    with durable.atomic_write(url, storage_options=options, record=False) as f:
        f.write(b"unrecorded")
    assert not any(k.startswith("durable_") for k in outside.metadata("d/obj.bin"))
    assert Entry(url, storage_options=options).state() is State.INCOMPLETE
    with pytest.raises(IncompleteError, match="no commit record"):
        durable.read_verified(url, storage_options=options)



# -------------------------------------------------------------------------------------- GCS
@pytest.fixture
def gcs_proxied(gcs_bucket: Bucket) -> Iterator[tuple[dict[str, Any], FaultProxy]]:
    with FaultProxy(gcs_bucket.server.url) as proxy:
        yield {**gcs_bucket.storage_options, "endpoint_url": proxy.url}, proxy


def _gcs_requests(proxy: FaultProxy) -> list[tuple[str, str]]:
    """(method, kind) of each request since the last call."""
    seen = [(r.method, "upload" if r.path.startswith("/upload/") else
             "media" if "alt" in r.query else "resource") for r in proxy.requests]
    proxy.clear_requests()
    return seen


@pytest.mark.gcs
def test_gcs_a_1_mib_write_is_one_upload_carrying_its_record(
        gcs_bucket: Bucket, gcs_proxied: tuple[dict[str, Any], FaultProxy]) -> None:
    options, proxy = gcs_proxied
    raw = GCSRaw(gcs_bucket)
    url, data = gcs_bucket.path("d", "obj.bin"), os.urandom(MiB)
    proxy.clear_requests()
    _write(url, data, options)
    # Before: a marker stat, the upload, a verify stat, the marker's upload. Now the
    # upload with its record, after one GET: no committed entry around it ("d").
    assert _gcs_requests(proxy) == [("GET", "resource"), ("POST", "upload")]
    assert raw.keys("d/") == ["d/obj.bin"]  # no marker beside it
    meta = raw.resource("d/obj.bin")["metadata"]
    assert isinstance(meta, dict) and meta["durable-crc32c"] == crc_to_hex(crc32c(data))
    assert durable.read_verified(url, storage_options=options) == data
    # The object resource (its metadata: the record), then the media GET.
    assert _gcs_requests(proxy) == [("GET", "resource"), ("GET", "media")]
    st = Entry(url, storage_options=options).status()
    assert st.state is State.COMPLETE and "own metadata" in st.reason


@pytest.mark.gcs
def test_gcs_a_resumable_upload_keeps_its_sidecar_marker(gcs_bucket: Bucket) -> None:
    options, raw = gcs_bucket.storage_options, GCSRaw(gcs_bucket)
    url, data = gcs_bucket.path("d", "big.bin"), os.urandom(MULTI)
    _write(url, b"small first", options)  # its record in its metadata
    _write(url, data, options)
    assert raw.keys("d/") == ["d/.durable/big.bin/commit.json", "d/big.bin"]
    meta = raw.resource("d/big.bin").get("metadata") or {}
    assert isinstance(meta, dict) and not any(k in meta for k in ("durable-size",
                                                                  "durable-crc32c"))
    assert durable.read_verified(url, storage_options=options) == data
    assert Entry(url, storage_options=options).verify(deep=True).ok


@pytest.mark.gcs
def test_gcs_a_resumable_upload_whose_marker_never_followed_is_never_adopted(
        gcs_bucket: Bucket) -> None:
    """A resumable upload is published before its marker: with the marker gone (the state
    a writer killed between the two leaves) the object was plain data to `durable
    mark-complete`, adopted with bytes nothing checked. Its metadata now says a marker
    follows: readers and scan say so, mark-complete skips it, clean removes it once old."""
    options, raw = gcs_bucket.storage_options, GCSRaw(gcs_bucket)
    url, data = gcs_bucket.path("d", "big.bin"), os.urandom(MULTI)
    _write(url, data, options)
    meta = raw.resource("d/big.bin").get("metadata") or {}
    assert isinstance(meta, dict) and meta.get("durable-record-follows") == "marker"
    gcs_bucket.filesystem().rm(f"{gcs_bucket.name}/d/.durable/big.bin/commit.json")
    assert raw.keys("d/") == ["d/big.bin"]
    with pytest.raises(IncompleteError, match="commit record never followed"):
        durable.read_verified(url, storage_options=options)
    (row,) = scan(gcs_bucket.path("d"), storage_options=options)
    assert row.state == "INCOMPLETE" and "never followed" in row.reason
    adopted = mark_complete_root(survey(*resolve(gcs_bucket.path("d"), options)), apply=True)
    assert adopted.adoptions == [] and "never followed" in adopted.skipped[0].reason
    sv = survey(*resolve(gcs_bucket.path("d"), options))
    report = plan_clean(sv, older_than=0, lease_wait=0)
    assert [(i.url, "never followed" in i.reason) for i in report.items] == [(url, True)]
    apply_clean(sv, report)
    assert [i.status for i in report.items] == ["removed"]
    assert raw.keys("d/") == []


@pytest.mark.gcs
def test_gcs_a_body_not_matching_its_record_or_a_hostile_record_is_refused(
        gcs_bucket: Bucket) -> None:
    options, raw = gcs_bucket.storage_options, GCSRaw(gcs_bucket)
    url, data = gcs_bucket.path("d", "obj.bin"), os.urandom(4096)
    _write(url, data, options)
    raw.put_with_metadata("d/obj.bin", bytes([data[0] ^ 1]) + data[1:],
                          raw.resource("d/obj.bin")["metadata"])
    readers = _readers(url, options)
    for name in ("read_verified", "open_verified"):
        with pytest.raises(IntegrityError, match=r"obj\.bin: CRC32C .* the record says"):
            readers[name]()
    with pytest.raises(IntegrityError, match="crc32c"):
        readers["verify deep"]()
    hostile = {k.replace("_", "-"): v for k, v in _record(data, crc32c="zzzzzzzz").items()}
    raw.put_with_metadata("d/obj.bin", data, hostile)
    for read in _readers(url, options).values():
        with pytest.raises(MarkerError, match=r"d/obj\.bin: metadata record"):
            read()


@pytest.mark.gcs
def test_gcs_scan_verify_and_clean_honour_records_in_metadata(gcs_bucket: Bucket) -> None:
    options, raw = gcs_bucket.storage_options, GCSRaw(gcs_bucket)
    root = gcs_bucket.path("r")
    _write(f"{root}/a.bin", b"recorded a", options)
    _write(f"{root}/b.bin", b"recorded bb", options)
    assert raw.keys("r/") == ["r/a.bin", "r/b.bin"]
    code, doc = _cli("verify", root, "--deep", options=options)
    assert code == 0 and doc["ok"] and [_name(r["url"]) for r in doc["results"]] == [
        "a.bin", "b.bin"], doc
    assert [(_name(r.url), r.state) for r in scan(root, options)] == [
        ("a.bin", "COMPLETE"), ("b.bin", "COMPLETE")]
    # Records of a writer killed long ago beside a recorded object, and beside a leftover.
    body = json.dumps({"format": "durable.commit.attempt", "attempt": "a" * 32,
                       "started_at": "2000-01-01T00:00:00.000000Z", "writer": {}}).encode()
    for name in ("a.bin", "dead.bin"):
        raw.put(f"r/.durable/{name}/attempts/{'a' * 32}.json", body)
    raw.put("r/dead.bin", b"half")
    sv = survey(*resolve(root, options))
    report = plan_clean(sv, older_than=0, lease_wait=0, clock="local")
    assert [_name(i.url) for i in report.items] == ["dead.bin"]
    assert any(_name(k.url) == "a.bin" and "own metadata" in k.reason for k in report.kept)
    apply_clean(sv, report)
    assert "r/dead.bin" not in raw.keys("r/")
    assert durable.read_verified(f"{root}/a.bin", storage_options=options) == b"recorded a"
