"""Records in object metadata: a single S3 PutObject carries its own size and CRC32C.

`atomic_write` of an object published by one PutObject sends its record as
``x-amz-meta-durable-*`` in that same request (one request instead of HEAD + PUT + PUT), and
every reader judges such an object by that record: a marker beside it is superseded. Written
against moto (and through the fault proxy where a fault is injected); the "outside" view is
a plain outside3 client, so hostile metadata and plain overwrites are real requests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import fsspec
import pytest

import durable
import durable._nesting
from durable import Entry, IncompleteError, IntegrityError, MarkerError, State
from durable._checksum import crc32c, crc_to_hex
from durable._ops import apply_clean, mark_complete_root, plan_clean, verify_root
from durable._protocol import Layout
from durable._scan import scan, survey
from durable.adapters import resolve
from durable.cli import ENV_OPTIONS, EXIT_ERROR, cli
from durable.testing import faults
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket
from test_ops import kill_writers

pytestmark = pytest.mark.s3

MiB = 1024 * 1024
MULTI = 9 * MiB  # over the adapter's 8 MiB part size: a multipart upload, a sidecar marker


class Outside:
    """Plain s3fs on the same bucket: writes and looks as another tool would."""

    def __init__(self, bucket: Bucket) -> None:
        self.fs = bucket.filesystem()
        self.bucket = bucket.name

    def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> None:
        self.fs.pipe_file(f"{self.bucket}/{key}", data,
                          **({"Metadata": metadata} if metadata else {}))

    def get(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(f"{self.bucket}/{key}"))

    def metadata(self, key: str) -> dict[str, str]:
        return dict(self.fs.metadata(f"{self.bucket}/{key}"))

    def listing(self) -> list[str]:
        self.fs.invalidate_cache()
        return sorted(k.partition("/")[2] for k in self.fs.find(self.bucket))


@pytest.fixture
def outside(s3_bucket: Bucket) -> Outside:
    return Outside(s3_bucket)


def _write(url: str, data: bytes, options: dict[str, Any]) -> None:
    with durable.atomic_write(url, storage_options=options) as f:
        f.write(data)


def _meta(data: bytes, **changes: str | None) -> dict[str, str]:
    """A valid metadata record of ``data``, with fields changed (None removes one)."""
    meta = {"durable-version": "1", "durable-size": str(len(data)),
            "durable-crc32c": crc_to_hex(crc32c(data)),
            "durable-attempt": "0123456789abcdef0123456789abcdef",
            "durable-committed-at": "2026-01-02T03:04:05.000000Z"}
    for key, value in changes.items():
        name = "durable-" + key.replace("_", "-")
        if value is None:
            meta.pop(name)
        else:
            meta[name] = value
    return meta


def _readers(url: str, options: dict[str, Any]) -> dict[str, Callable[[], object]]:
    """Every way to read or judge one object, each returning what it found."""
    def opened() -> bytes:
        with durable.open_verified(url, storage_options=options) as f:
            return f.read()

    entry = Entry(url, storage_options=options)
    return {"read_verified": lambda: durable.read_verified(url, storage_options=options),
            "open_verified": opened,
            "status": entry.status,
            "verify": entry.verify,
            "verify deep": lambda: entry.verify(deep=True)}


def _cli(*args: str, options: dict[str, Any]) -> tuple[int, Any]:
    """Exit code, and the JSON document (or, on an error, the message on stderr)."""
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, [*args, "--json"],
                                env={ENV_OPTIONS: json.dumps(options)})
    return result.exit_code, json.loads(result.stdout) if result.stdout else result.stderr


def test_one_put_carries_the_record_and_every_reader_honours_it(
        s3_bucket: Bucket, outside: Outside) -> None:
    options = s3_bucket.storage_options
    url, data = s3_bucket.path("d", "obj.bin"), os.urandom(MiB)
    _write(url, data, options)
    # No marker beside it: the record is in the object's own metadata.
    assert outside.listing() == ["d/obj.bin"]
    meta = outside.metadata("d/obj.bin")
    assert (meta["durable-version"], meta["durable-size"], meta["durable-crc32c"]) == (
        "1", str(MiB), crc_to_hex(crc32c(data)))
    readers = _readers(url, options)
    assert readers["read_verified"]() == data
    assert readers["open_verified"]() == data
    st = readers["status"]()
    assert isinstance(st, durable.Status) and st.state is State.COMPLETE
    assert "own metadata" in st.reason
    report = readers["verify deep"]()
    assert isinstance(report, durable.VerifyReport)
    assert report.ok and report.objects == 1 and report.bytes_checked == MiB
    assert _cli("status", url, options=options)[0] == 0
    code, doc = _cli("verify", url, "--deep", options=options)
    assert code == 0 and doc["ok"] and doc["objects"] == 1
    # A writer finds it COMPLETE, not INCOMPLETE data without a marker.
    with pytest.raises(durable.AlreadyCompleteError), Entry(url, storage_options=options
                                                             ).writing():
        pass
    rows = scan(s3_bucket.path("d"), options)
    assert [(r.url, r.state, r.objects) for r in rows] == [(url, "COMPLETE", 1)]
    report_root = verify_root(survey(*resolve(s3_bucket.path("d"), options)), deep=True)
    assert report_root.ok and [r.url for r in report_root.reports] == [url]


def test_a_stale_marker_of_an_earlier_multipart_write_is_superseded(
        s3_bucket: Bucket, outside: Outside) -> None:
    options = s3_bucket.storage_options
    url = s3_bucket.path("d", "obj.bin")
    _write(url, os.urandom(MULTI), options)  # multipart: its record is a marker beside it
    assert outside.listing() == ["d/.durable/obj.bin/commit.json", "d/obj.bin"]
    data = b"new, smaller bytes"
    _write(url, data, options)  # one PutObject: the record travels with the bytes
    # The old marker is left (no request spent on it) and names other sizes...
    assert outside.listing() == ["d/.durable/obj.bin/commit.json", "d/obj.bin"]
    # ...but an object carrying its own record is judged by that record alone.
    readers = _readers(url, options)
    assert readers["read_verified"]() == data
    assert readers["open_verified"]() == data
    assert readers["status"]().state is State.COMPLETE  # type: ignore[attr-defined]
    assert readers["verify deep"]().ok  # type: ignore[attr-defined]
    assert [(r.state, r.objects) for r in scan(s3_bucket.path("d"), options)] == [
        ("COMPLETE", 1)]
    # A plain overwrite by another tool drops the metadata: the stale marker then
    # governs, and it does not match: loud on every path.
    outside.put("d/obj.bin", b"plain overwrite")
    for name, read in readers.items():
        if name in ("status",):
            assert read().state is State.INCOMPLETE, name  # type: ignore[attr-defined]
        else:
            with pytest.raises(IntegrityError, match=r"obj\.bin"):
                read()


def test_a_later_multipart_write_removes_the_record_it_cannot_carry(
        s3_bucket: Bucket, outside: Outside) -> None:
    options = s3_bucket.storage_options
    url = s3_bucket.path("d", "obj.bin")
    _write(url, b"small", options)
    big = os.urandom(MULTI)
    _write(url, big, options)
    # The multipart object carries no record (its metadata was fixed before the size and
    # CRC32C were known), only word that a marker follows: a marker beside it records them.
    meta = outside.metadata("d/obj.bin")
    assert {k: v for k, v in meta.items() if k.startswith("durable-")} == {
        "durable-record-follows": "marker"}
    assert outside.listing() == ["d/.durable/obj.bin/commit.json", "d/obj.bin"]
    assert durable.read_verified(url, storage_options=options) == big
    assert Entry(url, storage_options=options).verify(deep=True).ok


def test_a_flipped_byte_under_a_valid_record_is_refused_on_every_path(
        s3_bucket: Bucket, outside: Outside) -> None:
    options = s3_bucket.storage_options
    url, data = s3_bucket.path("d", "obj.bin"), os.urandom(4096)
    flipped = bytes([data[0] ^ 1]) + data[1:]  # same size: only the CRC32C can tell
    outside.put("d/obj.bin", flipped, _meta(data))
    readers = _readers(url, options)
    for name in ("read_verified", "open_verified"):
        with pytest.raises(IntegrityError, match=r"obj\.bin: CRC32C .* the record says"):
            readers[name]()
    with pytest.raises(IntegrityError, match="crc32c"):
        readers["verify deep"]()
    code, doc = _cli("verify", url, "--deep", options=options)
    assert code == 5 and [p["issue"] for p in doc["problems"]] == ["crc32c"]
    report = verify_root(survey(*resolve(s3_bucket.path("d"), options)), deep=True)
    assert [p.issue for r in report.reports for p in r.problems] == ["crc32c"]


HOSTILE: dict[str, dict[str, str | None]] = {
    "size not a number": {"size": "12abc"},
    "negative size": {"size": "-1"},
    "huge size": {"size": "9" * 30},
    "size beyond 2**63": {"size": str(2**63)},
    "crc32c not hex": {"crc32c": "zzzzzzzz"},
    "crc32c too short": {"crc32c": "abc"},
    "crc32c upper case": {"crc32c": "ABCDEF01"},
    "future version": {"version": "2"},
    "version zero": {"version": "0"},
    "version not a number": {"version": "one"},
    "size missing": {"size": None},
    "version missing": {"version": None},
    "attempt not alphanumeric": {"attempt": "../../x"},
    "committed_at too long": {"committed_at": "x" * 200},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_metadata_record_is_a_marker_error_naming_the_object(
        s3_bucket: Bucket, outside: Outside, case: str) -> None:
    options = s3_bucket.storage_options
    url, data = s3_bucket.path("d", "obj.bin"), b"payload"
    outside.put("d/obj.bin", data, _meta(data, **HOSTILE[case]))
    for name, read in _readers(url, options).items():
        with pytest.raises(MarkerError, match=r"d/obj\.bin: metadata record") as info:
            read()
        assert info.value.url == url, name
    for command in ("status", "verify"):
        code, message = _cli(command, url, options=options)
        assert code == EXIT_ERROR and "d/obj.bin: metadata record" in message, command
    (row,) = scan(s3_bucket.path("d"), options)
    assert row.state == "ERROR" and "metadata record" in row.reason


def test_read_verified_is_one_get_and_a_truncated_body_is_still_caught(
        s3_bucket: Bucket) -> None:
    data = os.urandom(256 * 1024)
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        url = s3_bucket.path("d", "obj.bin")
        _write(url, data, options)
        proxy.clear_requests()
        assert durable.read_verified(url, storage_options=options) == data
        assert [(r.method, r.key) for r in proxy.requests] == [("GET", "d/obj.bin")]
        # Every body cut short (a retry too): refused, nothing returned.
        proxy.add(faults.truncate_body(1000, key="d/obj.bin"))
        with pytest.raises(IntegrityError, match=r"obj\.bin"):
            durable.read_verified(url, storage_options=options)
        with pytest.raises(IntegrityError, match=r"obj\.bin"), \
                durable.open_verified(url, storage_options=options) as f:
            f.read()
        with pytest.raises(IntegrityError, match=r"obj\.bin"):
            Entry(url, storage_options=options).verify(deep=True)


def _stale_attempt(outside: Outside, parent: str, name: str) -> None:
    """Records of a writer killed long ago: an attempt record, no marker."""
    key = f"{parent}/.durable/{name}/attempts/{'a' * 32}.json"
    body = {"format": "durable.commit.attempt", "attempt": "a" * 32,
            "started_at": "2000-01-01T00:00:00.000000Z", "writer": {}}
    outside.put(key, json.dumps(body).encode())


def test_clean_never_deletes_an_object_recorded_in_its_metadata(
        s3_bucket: Bucket, outside: Outside) -> None:
    options = s3_bucket.storage_options
    root = s3_bucket.path("r")
    # Beside a stale marker with other sizes (an earlier multipart write of the name).
    _write(f"{root}/marked.bin", os.urandom(MULTI), options)
    _write(f"{root}/marked.bin", b"recorded in its metadata", options)
    # Beside records of a writer killed long ago, and no marker at all.
    _write(f"{root}/started.bin", b"recorded in its metadata too", options)
    _stale_attempt(outside, "r", "started.bin")
    # The same, but recorded only after the plan was made: apply checks again.
    outside.put("r/late.bin", b"plain")
    _stale_attempt(outside, "r", "late.bin")
    # A true leftover, for contrast: removed.
    outside.put("r/dead.bin", b"half")
    _stale_attempt(outside, "r", "dead.bin")
    before = {k: outside.get(k)
              for k in ("r/marked.bin", "r/started.bin")}

    adapter, path = resolve(root, options)
    sv = survey(adapter, path)
    report = plan_clean(sv, older_than=0, lease_wait=0, clock="local")
    assert sorted(i.url for i in report.items) == [f"{root}/dead.bin", f"{root}/late.bin"]
    assert any(k.url == f"{root}/started.bin" and "own metadata" in k.reason
               for k in report.kept)
    _write(f"{root}/late.bin", b"committed since the plan", options)
    apply_clean(sv, report)
    status = {i.url.rpartition("/")[2]: i.status for i in report.items}
    assert status == {"dead.bin": "removed", "late.bin": "skipped"}
    keys = outside.listing()
    assert "r/dead.bin" not in keys
    assert {"r/marked.bin", "r/started.bin", "r/late.bin"} <= set(keys)
    for key, data in before.items():
        assert outside.get(key) == data
    for name in ("marked.bin", "started.bin", "late.bin"):
        assert Entry(f"{root}/{name}", storage_options=options).state() is State.COMPLETE


def test_mark_complete_leaves_an_object_recorded_in_its_metadata_alone(
        s3_bucket: Bucket, outside: Outside) -> None:
    options = s3_bucket.storage_options
    root = s3_bucket.path("r")
    _write(f"{root}/obj.bin", b"recorded", options)
    outside.put("r/plain.bin", b"unrecorded")
    report = mark_complete_root(survey(*resolve(root, options)), apply=True)
    assert [(a.url, a.status) for a in report.adoptions] == [(f"{root}/plain.bin", "adopted")]
    assert [s.url for s in report.skipped] == [f"{root}/obj.bin"]
    assert Layout(f"{s3_bucket.name}/r/obj.bin").marker.partition("/")[2] not in \
        outside.listing()


def test_an_object_without_a_record_stays_unrecorded(s3_bucket: Bucket, outside: Outside) -> None:
    """record=False sends no metadata record; a plain object is INCOMPLETE, never COMPLETE."""
    options = s3_bucket.storage_options
    url = s3_bucket.path("d", "obj.bin")
    with durable.atomic_write(url, storage_options=options, record=False) as f:
        f.write(b"unrecorded")
    meta = outside.metadata("d/obj.bin")
    assert not any(k.startswith("durable-") for k in meta)
    assert Entry(url, storage_options=options).state() is State.INCOMPLETE
    with pytest.raises(IncompleteError, match="no commit record"):
        durable.read_verified(url, storage_options=options)


def test_clean_keeps_a_dead_writers_entry_that_holds_an_object_recorded_in_its_metadata(
        s3_bucket: Bucket, outside: Outside) -> None:
    """A writer of runs/42 SIGKILLed leaves its attempt record; atomic_write of
    runs/42/model.bin (one PutObject, its record in its metadata) is COMPLETE; no listing
    shows that record, so clean stats every object of an entry before removing it."""
    options = s3_bucket.storage_options
    root = s3_bucket.path("runs")
    kill_writers(root, options, ["42", "43", "44"], strays=False)
    model = os.urandom(1000)
    _write(f"{root}/42/model.bin", model, options)
    sv = survey(*resolve(root, options))
    report = plan_clean(sv, older_than=0, lease_wait=0, clock="local")
    assert sorted(i.url for i in report.items) == [f"{root}/43", f"{root}/44"]
    (kept,) = [k for k in report.kept if k.url == f"{root}/42"]
    assert f"{root}/42/model.bin" in kept.reason and "own metadata" in kept.reason
    # Committed inside 43 after the plan: the removal checks each object again.
    late = b"committed since the plan"
    _write(f"{root}/43/model.bin", late, options)
    apply_clean(sv, report)
    result = {i.url.rpartition("/")[2]: (i.status, i.detail) for i in report.items}
    assert result["44"] == ("removed", "")  # a true leftover, for contrast
    assert result["43"][0] == "skipped" and f"{root}/43/model.bin" in result["43"][1]
    assert not [k for k in outside.listing() if k.startswith(("runs/44/", "runs/.durable/44/"))]
    for name, data in (("42", model), ("43", late)):
        url = f"{root}/{name}/model.bin"
        assert Entry(url, storage_options=options).state() is State.COMPLETE
        assert durable.read_verified(url, storage_options=options) == data
        # The whole entry is kept: the dead writer's data and records too.
        assert {f"runs/{name}/zarr.json", f"runs/{name}/c/0"} <= set(outside.listing())


def _mixed_root(s3_bucket: Bucket, outside: Outside) -> tuple[str, bytes, bytes]:
    """A root holding an object recorded in its metadata, a multipart-marked entry and a
    plain object (data written before durable, no record)."""
    options = s3_bucket.storage_options
    root = s3_bucket.path("mixed")
    small, big = b"recorded in its metadata", os.urandom(MULTI)
    _write(f"{root}/recorded.bin", small, options)
    _write(f"{root}/big.bin", big, options)
    outside.put("mixed/plain.bin", b"written by another tool")
    return root, small, big


def test_scan_and_verify_root_with_a_plain_object_beside_recorded_ones(
        s3_bucket: Bucket, outside: Outside) -> None:
    options = s3_bucket.storage_options
    root, small, big = _mixed_root(s3_bucket, outside)
    expected = {"big.bin": "COMPLETE", "recorded.bin": "COMPLETE", "plain.bin": "INCOMPLETE"}
    rows = scan(root, options)
    assert {r.url.rpartition("/")[2]: r.state for r in rows} == expected
    code, doc = _cli("scan", root, options=options)
    assert code == 0 and {e["url"].rpartition("/")[2]: e["state"]
                          for e in doc["entries"]} == expected
    for deep in ((), ("--deep",)):
        code, doc = _cli("verify", root, *deep, options=options)
        assert code == 0 and doc["ok"], doc
        assert [r["url"] for r in doc["results"]] == [f"{root}/big.bin", f"{root}/recorded.bin"]
        assert [n["url"] for n in doc["not_verified"]] == [f"{root}/plain.bin"]
    assert doc["bytes_checked"] == len(small) + len(big)


def test_verify_of_a_prefix_of_recorded_objects_verifies_them_as_a_root(
        s3_bucket: Bucket, outside: Outside) -> None:
    """No sidecar records below the prefix, only objects carrying their own: a root (as
    when atomic_write left markers), not one INCOMPLETE entry; status is unchanged."""
    data = {"a.bin": b"recorded a", "b.bin": b"recorded bb"}
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        prefix = s3_bucket.path("p")
        for name, body in data.items():
            _write(f"{prefix}/{name}", body, options)
        proxy.clear_requests()
        code, doc = _cli("verify", prefix, "--deep", options=options)
        assert code == 0 and doc["ok"] and doc["root"] == prefix, doc
        assert [r["url"] for r in doc["results"]] == [f"{prefix}/{n}" for n in sorted(data)]
        assert doc["bytes_checked"] == sum(map(len, data.values()))
        # One HEAD per object right under the prefix, taken once (the root's decision and
        # its verification share it), then the deep reads.
        heads = sorted(r.key for r in proxy.requests
                       if r.method == "HEAD" and r.key.startswith("p/"))
        assert heads == [f"p/{n}" for n in sorted(data)]
    options = s3_bucket.storage_options
    code, doc = _cli("status", prefix, options=options)
    # Not one entry: INCOMPLETE as one, saying what `verify` found inside it.
    assert code == 3 and doc["state"] == "INCOMPLETE", doc
    assert doc["reason"].startswith("data present but no commit marker; objects carrying "
                                    "records of their own are inside it: a root?"), doc
    # A prefix of plain objects only is still one entry, INCOMPLETE, and no root.
    outside.put("q/plain.bin", b"written by another tool")
    code, doc = _cli("verify", s3_bucket.path("q"), options=options)
    assert code == 3 and doc["state"] == "INCOMPLETE" and "no commit marker" in doc["reason"]
    assert "a root?" not in doc["reason"]


def test_a_durable_fs_write_is_one_put_carrying_its_record(
        s3_bucket: Bucket, outside: Outside) -> None:
    """durable:: writes an object as atomic_write does: one PutObject with its record
    (before: a DELETE of the old marker, the PUT, the marker PUT), after one GET that
    finds no committed entry around it (writing into one left its marker over other
    bytes)."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        fs = fsspec.filesystem("durable", target_protocol="s3", target_options=options)
        path = f"{s3_bucket.name}/d/obj.bin"
        fs.pipe_file(path, b"first")
        data = os.urandom(4096)
        durable._nesting._SEEN_CLEAR.clear()  # "d" not written in the last seconds
        proxy.clear_requests()
        with fs.open(path, "wb") as f:
            f.write(data)
        # The GET: is "d" a committed entry (then it is read-only here)? No: its marker
        # is absent. Then the one PUT, the object with its record.
        assert [(r.method, r.key) for r in proxy.requests] == [
            ("GET", ".durable/d/commit.json"), ("PUT", "d/obj.bin")]
        assert fs.cat_file(path) == data
    assert outside.listing() == ["d/obj.bin"]
    assert outside.metadata("d/obj.bin")["durable-crc32c"] == crc_to_hex(crc32c(data))
    url = s3_bucket.path("d", "obj.bin")
    options = s3_bucket.storage_options
    assert durable.read_verified(url, storage_options=options) == data
    assert Entry(url, storage_options=options).state() is State.COMPLETE


def test_status_of_an_object_recorded_in_its_metadata_says_no_writer_was_recorded(
        s3_bucket: Bucket) -> None:
    """The record in an object's own metadata names no writer (host, pid): `status` said
    an empty "writer" line, which read as a writer that left no trace."""
    from click.testing import CliRunner

    options = s3_bucket.storage_options
    url = s3_bucket.path("d", "obj.bin")
    _write(url, b"weights", options)
    result = CliRunner().invoke(cli, ["status", url], env={ENV_OPTIONS: json.dumps(options)})
    assert result.exit_code == 0, result.output
    writer = [line for line in result.stdout.splitlines() if line.startswith("writer")]
    assert writer and writer[0].split(None, 1)[1] == "not recorded", result.stdout
