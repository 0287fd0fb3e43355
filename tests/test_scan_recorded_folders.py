"""Folders of objects that carry their own commit record: scan, verify ROOT, mark-complete.

The README's layout, ``atomic_write("s3://b/ckpt/model.pt")`` and more files under ``ckpt/``,
leaves on S3, GCS and Azure objects carrying their record in their own metadata and no
records directory at all. A listing does not show metadata, so `durable._scan.split_recorded`
stats each object of an unmarked folder: each one carrying a record is an entry of its own,
as a file with its sidecar marker is on a local disk. Before it, ``ckpt`` scanned as one
INCOMPLETE entry, ``verify ROOT`` verified 0 entries and said OK, and ``mark-complete``
adopted ``ckpt`` under a directory marker that the next ``atomic_write`` of a checkpoint
broke. Written against moto (requests counted through the fault proxy), gcp-storage-emulator
and azurite; plain objects are put by the stores' own fsspec filesystems, around durable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import durable
from durable._scan import scan
from durable.testing import faults
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket
from test_object_metadata_record import Outside, _cli, _meta
from test_ops import kill_writers

CKPT = {"ckpt/step-0.pt": 1000, "ckpt/step-1.pt": 1001, "ckpt/sub/step-2.pt": 1002}

BUCKETS = [pytest.param("s3_bucket", marks=pytest.mark.s3, id="s3"),
           pytest.param("gcs_bucket", marks=pytest.mark.gcs, id="gcs"),
           pytest.param("azure_container", marks=pytest.mark.azure, id="azure")]


@pytest.fixture(params=BUCKETS)
def bucket(request: pytest.FixtureRequest) -> Bucket:
    found: Bucket = request.getfixturevalue(request.param)
    return found


def _write(url: str, data: bytes, options: dict[str, Any]) -> None:
    with durable.atomic_write(url, storage_options=options) as f:
        f.write(data)


def _checkpoints(root: str, options: dict[str, Any]) -> dict[str, bytes]:
    """The README's layout: checkpoints written by atomic_write into a folder."""
    data = {key: os.urandom(size) for key, size in CKPT.items()}
    for key, body in data.items():
        _write(f"{root}/{key}", body, options)
    return data


def _key(url: str, b: Bucket) -> str:
    """The key inside the bucket of a URL durable gave, whatever its scheme."""
    return url.partition(f"{b.name}/")[2]


def _states(doc: dict[str, Any], b: Bucket) -> dict[str, str]:
    return {_key(e["url"], b): e["state"] for e in doc["entries"]}


def _listing(b: Bucket) -> list[str]:
    fs = b.filesystem()
    fs.invalidate_cache()
    return sorted(k.partition("/")[2] for k in fs.find(b.name))


def test_a_folder_of_atomic_writes_scans_as_on_a_local_disk(bucket: Bucket,
                                                            tmp_path: Path) -> None:
    """Each object is a COMPLETE entry of its own, the folder no entry at all; the same
    layout on a local disk (sidecar markers) scans as the same entries."""
    options = bucket.storage_options
    _checkpoints(bucket.url, options)
    code, doc = _cli("scan", bucket.url, "--fail-on-incomplete", options=options)
    assert code == 0, doc
    assert _states(doc, bucket) == dict.fromkeys(CKPT, "COMPLETE")
    assert all(e["objects"] == 1 and "own metadata" in e["reason"] for e in doc["entries"])
    assert [e["size"] for e in doc["entries"]] == list(CKPT.values())

    _checkpoints(str(tmp_path), {})
    local = {r.url.removeprefix(f"file://{tmp_path}/"): r.state for r in scan(str(tmp_path))}
    assert local == _states(doc, bucket)


def test_verify_deep_of_the_root_checks_each_object(bucket: Bucket) -> None:
    options = bucket.storage_options
    data = _checkpoints(bucket.url, options)
    code, doc = _cli("verify", "--deep", bucket.url, options=options)
    assert code == 0 and doc["ok"] and doc["state"] is None, doc
    assert [_key(r["url"], bucket) for r in doc["results"]] == list(CKPT)
    assert doc["bytes_checked"] == sum(map(len, data.values()))
    assert doc["not_verified"] == []


@pytest.mark.s3
def test_verify_deep_of_the_root_names_a_flipped_byte(s3_bucket: Bucket) -> None:
    """New bytes of the same size under the name, its metadata record copied over (another
    tool rewriting it, or bit rot): only a deep verify sees it, and it names the object."""
    options = s3_bucket.storage_options
    data = _checkpoints(s3_bucket.url, options)
    outside = Outside(s3_bucket)
    key = "ckpt/sub/step-2.pt"
    flipped = bytearray(data[key])
    flipped[7] ^= 0x01
    outside.put(key, bytes(flipped), outside.metadata(key))
    code, doc = _cli("verify", s3_bucket.url, options=options)
    assert code == 0 and doc["ok"], doc  # the size still matches
    code, doc = _cli("verify", "--deep", s3_bucket.url, options=options)
    assert code == 5 and not doc["ok"] and doc["failed"] == 1, doc
    (bad,) = [r for r in doc["results"] if not r["ok"]]
    assert bad["url"] == s3_bucket.path(key)
    assert [(p["url"], p["issue"]) for p in bad["problems"]] == [(s3_bucket.path(key), "crc32c")]


def test_mark_complete_does_not_adopt_the_folder(bucket: Bucket) -> None:
    """Nothing is adopted; an ordinary rewrite of one checkpoint afterwards leaves every
    entry COMPLETE and the root verified."""
    options = bucket.storage_options
    _checkpoints(bucket.url, options)
    before = _listing(bucket)
    code, doc = _cli("mark-complete", bucket.url, "--apply", options=options)
    assert code == 0 and doc["entries"] == [], doc
    assert sorted(_key(s["url"], bucket) for s in doc["skipped"]) == list(CKPT)
    assert _listing(bucket) == before  # no marker written anywhere
    _write(bucket.path("ckpt/step-0.pt"), os.urandom(999), options)
    code, doc = _cli("verify", "--deep", bucket.url, options=options)
    assert code == 0 and doc["ok"] and len(doc["results"]) == len(CKPT), doc
    code, doc = _cli("scan", bucket.url, "--fail-on-incomplete", options=options)
    assert code == 0 and _states(doc, bucket) == dict.fromkeys(CKPT, "COMPLETE"), doc


def test_a_folder_with_a_recorded_and_a_plain_object(bucket: Bucket) -> None:
    """The plain object stays unmarked data of its folder (INCOMPLETE), the recorded one is
    COMPLETE; mark-complete refuses the folder, naming it and the recorded object."""
    options = bucket.storage_options
    _write(bucket.path("ckpt/model.pt"), b"recorded in its metadata", options)
    bucket.filesystem().pipe_file(f"{bucket.name}/ckpt/notes.txt", b"plain, by another tool")
    code, doc = _cli("scan", bucket.url, options=options)
    assert code == 0 and _states(doc, bucket) == {"ckpt": "INCOMPLETE",
                                                      "ckpt/model.pt": "COMPLETE"}, doc
    folder = doc["entries"][0]
    assert (folder["objects"], folder["size"]) == (1, len(b"plain, by another tool"))
    assert folder["reason"].startswith("data present but no commit marker")
    assert "1 objects in it carry their own commit records" in folder["reason"]
    code, _ = _cli("scan", bucket.url, "--fail-on-incomplete", options=options)
    assert code == 3

    code, doc = _cli("verify", "--deep", bucket.url, options=options)
    assert code == 0 and doc["ok"], doc
    assert [_key(r["url"], bucket) for r in doc["results"]] == ["ckpt/model.pt"]
    assert [_key(n["url"], bucket) for n in doc["not_verified"]] == ["ckpt"]
    assert doc["not_verified_objects"] == 1

    before = _listing(bucket)
    code, doc = _cli("mark-complete", bucket.url, "--apply", options=options)
    assert code == 0 and doc["entries"] == [], doc
    why = {_key(s["url"], bucket): s["reason"] for s in doc["skipped"]}
    assert set(why) == {"ckpt", "ckpt/model.pt"}
    assert "ckpt/model.pt" in why["ckpt"] and "own commit record" in why["ckpt"]
    assert _listing(bucket) == before


@pytest.mark.s3
def test_records_in_a_folder_are_judged_by_themselves(s3_bucket: Bucket) -> None:
    """A record whose size is not the object's: INCOMPLETE; a hostile record: ERROR naming
    the object, and verify fails on it; neither makes the folder adoptable."""
    options = s3_bucket.storage_options
    outside = Outside(s3_bucket)
    body = b"twenty bytes of data"
    outside.put("ckpt/short.pt", body, _meta(body + b"!"))
    outside.put("ckpt/hostile.pt", body, _meta(body, crc32c="not-hex"))
    _write(s3_bucket.path("ckpt/good.pt"), body, options)
    rows = {r.url.rpartition("/")[2]: r for r in scan(s3_bucket.url, options)}
    assert {k: r.state for k, r in rows.items()} == {
        "good.pt": "COMPLETE", "short.pt": "INCOMPLETE", "hostile.pt": "ERROR"}
    assert f"{s3_bucket.path('ckpt/short.pt')} is 20 bytes, the marker recorded 21" in \
        rows["short.pt"].reason
    assert s3_bucket.path("ckpt/hostile.pt") in rows["hostile.pt"].reason
    assert "CRC32C must be 8 lowercase hex digits, got 'not-hex'" in rows["hostile.pt"].reason
    code, doc = _cli("verify", s3_bucket.url, options=options)
    assert code == 5 and doc["failed"] == 2, doc
    issues = {r["url"].rpartition("/")[2]: [p["issue"] for p in r["problems"]]
              for r in doc["results"]}
    assert issues == {"good.pt": [], "hostile.pt": ["unreadable"], "short.pt": ["size"]}
    code, doc = _cli("mark-complete", s3_bucket.url, "--apply", options=options)
    assert code == 0 and doc["entries"] == [], doc


@pytest.mark.s3
def test_one_head_per_object_of_an_unmarked_folder_and_none_inside_marked_entries(
        s3_bucket: Bucket) -> None:
    """The cost: the objects of unmarked folders are stat-ed once each (a verify's root
    decision and its verification share them); a marked entry's objects never."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        outside = Outside(s3_bucket)
        for n in range(3):
            outside.put(f"legacy/{n}.bin", b"written before durable")
        code, doc = _cli("mark-complete", s3_bucket.url, "--apply", options=options)
        assert code == 0 and [e["status"] for e in doc["entries"]] == ["adopted"], doc
        _checkpoints(s3_bucket.url, options)
        # verify URL first asks whether URL itself is a marked entry (its marker's HEAD).
        for args, more in ((("scan", s3_bucket.url), []),
                           (("verify", s3_bucket.path("ckpt")), [".durable/ckpt/commit.json"])):
            proxy.clear_requests()
            code, doc = _cli(*args, options=options)
            assert code == 0, doc
            heads = sorted(r.key for r in proxy.requests if r.method == "HEAD")
            assert heads == sorted([*CKPT, *more]), args


def test_verify_of_a_root_that_verified_nothing_is_not_ok(tmp_path: Path) -> None:
    """A root whose only entry a killed writer left: 0 entries verified is not "OK"."""
    kill_writers(str(tmp_path), {}, ["x"], strays=False)
    code, doc = _cli("verify", "--deep", str(tmp_path), options={})
    assert code == 3 and not doc["ok"] and doc["state"] == "INCOMPLETE", doc
    assert doc["entries"] == 0 and [n["url"] for n in doc["not_verified"]] == [
        f"file://{tmp_path}/x"]
    assert doc["not_verified_objects"] > 0
    from click.testing import CliRunner

    from durable.cli import cli
    text = CliRunner().invoke(cli, ["verify", str(tmp_path)])
    assert text.exit_code == 3
    assert "nothing verified" in text.stdout and "OK" not in text.stdout


@pytest.mark.s3
def test_an_object_of_a_folder_that_cannot_be_stat_ed_is_never_taken_for_plain_data(
        s3_bucket: Bucket) -> None:
    """Its HEAD refused (403): the scan says so in an ERROR row naming it, and the folder
    is not adopted, since the object may carry its own record."""
    outside = Outside(s3_bucket)
    outside.put("ckpt/plain.bin", b"written by another tool")
    outside.put("ckpt/locked.bin", b"anyone's guess")
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        proxy.add(faults.error(403, key="ckpt/locked.bin", method="HEAD"))
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        code, doc = _cli("scan", s3_bucket.url, options=options)
        assert code == 0 and _states(doc, s3_bucket) == {"ckpt": "INCOMPLETE",
                                                         "ckpt/locked.bin": "ERROR"}, doc
        locked = doc["entries"][1]
        assert locked["reason"].startswith(f"{locked['url']}: could not be stat-ed")
        assert "PermissionError" in locked["reason"]
        code, doc = _cli("mark-complete", s3_bucket.url, "--apply", options=options)
        assert code == 0 and doc["entries"] == [], doc
        why = {_key(s["url"], s3_bucket): s["reason"] for s in doc["skipped"]}
        assert "could not be stat-ed" in why["ckpt"] and locked["url"] in why["ckpt"]
    assert outside.listing() == ["ckpt/locked.bin", "ckpt/plain.bin"]


@pytest.mark.s3
def test_a_folder_over_the_limit_is_not_stat_ed_by_scan_but_is_by_mark_complete(
        s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """A legacy folder of many plain objects would cost scan one HEAD each: over
    ``SPLIT_LIMIT`` (lowered here to 2) scan takes none and says so; mark-complete, which
    reads every object anyway, still stats them and refuses a folder holding a record."""
    import durable._scan

    monkeypatch.setattr(durable._scan, "SPLIT_LIMIT", 2)
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        outside = Outside(s3_bucket)
        for n in range(3):
            outside.put(f"big/{n}.bin", b"written before durable")
        _write(s3_bucket.path("big/model.pt"), b"recorded", options)
        proxy.clear_requests()
        code, doc = _cli("scan", s3_bucket.url, options=options)
        assert code == 0 and _states(doc, s3_bucket) == {"big": "INCOMPLETE"}, doc
        assert "not checked for objects carrying their own records" in \
            doc["entries"][0]["reason"]
        assert [r for r in proxy.requests if r.method == "HEAD"] == []
        code, doc = _cli("mark-complete", s3_bucket.url, "--apply", options=options)
        assert code == 0 and doc["entries"] == [], doc
        assert "big/model.pt" in {_key(s["url"], s3_bucket) for s in doc["skipped"]}


def test_status_of_a_folder_of_atomic_writes_says_entries_are_inside_it(
        bucket: Bucket, tmp_path: Path) -> None:
    """`durable status s3://b/ckpt` of the README's layout (checkpoints by atomic_write) said
    only "data present but no commit marker", the words for data written without durable
    (mark-complete's case), where a local disk's sidecar records made it say a root."""
    options = bucket.storage_options
    _checkpoints(bucket.url, options)
    url = bucket.path("ckpt")
    code, doc = _cli("status", url, options=options)
    assert code == 3 and doc["reason"] == (
        "data present but no commit marker; objects carrying records of their own are "
        f"inside it: a root? (`durable scan {url}` lists them)"), doc
    # The same layout on a local disk (sidecar markers) says it too.
    _checkpoints(str(tmp_path), {})
    code, doc = _cli("status", str(tmp_path / "ckpt"), options={})
    assert code == 3 and doc["reason"] == (
        "data present but no commit marker; entries with records of their own are inside "
        f"it: a root? (`durable scan {tmp_path / 'ckpt'}` lists them)"), doc
    # A folder of plain objects is still data written without durable.
    bucket.filesystem().pipe_file(f"{bucket.name}/legacy/zarr.json", b"{}")
    code, doc = _cli("status", bucket.path("legacy"), options=options)
    assert code == 3 and doc["reason"] == "data present but no commit marker", doc
