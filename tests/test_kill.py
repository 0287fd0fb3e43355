"""A writer SIGKILLed at any point leaves an entry that is INCOMPLETE, never COMPLETE.

Incident 001: a killed writer left a zarr that looked cached. The writer here is a real
child process (tests/_writer_child.py) that reports each step on stdout and waits on stdin,
so the kill lands exactly between two steps, with no sleeps.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import crc32c
import pytest

from _writer_child import Child, key, payload
from conftest import Place
from durable import (
    Entry,
    IncompleteError,
    IncompleteExistsError,
    State,
    atomic_write,
    read_verified,
)
from durable._ops import apply_clean, mark_complete_root, plan_clean
from durable._scan import scan, survey
from durable.adapters import resolve
from durable.testing import faults
from durable.testing.faults import FaultProxy, Match, RequestInfo
from durable.testing.pytest_plugin import Bucket

N_OBJECTS = 8
# attempt record written / one object / some objects / one half-written / all, no marker
KILL_POINTS = ["attempt", "object 0", "object 4", "partial", "written"]


@pytest.fixture
def local(tmp_path: os.PathLike[str]) -> Place:
    return Place("file", os.path.realpath(tmp_path))


def objects_written(point: str) -> int:
    if point == "attempt":
        return 0
    if point.startswith("object "):
        return int(point.split()[1]) + 1
    return N_OBJECTS


def killed_at(local: Place, point: str) -> Entry:
    child = Child("entry", local.url("ent"), str(N_OBJECTS))
    child.run_until(point)
    child.kill()
    return Entry(local.url("ent"))


def temp_files(local: Place) -> list[str]:
    return [k for k in local.files() if ".durable-tmp-" in k]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_killed_writer_leaves_incomplete(local: Place, point: str) -> None:
    e = killed_at(local, point)
    # What the kill left is real: the objects it had finished, whole, and (mid-object) a temp.
    for i in range(objects_written(point)):
        assert local.read(f"ent/{key(i)}") == payload(i)
    assert bool(temp_files(local)) == (point == "partial")
    assert local.read(".durable/ent/commit.json") is None

    assert e.state() is State.INCOMPLETE
    for i in range(objects_written(point)):
        with pytest.raises(IncompleteError):
            read_verified(local.url("ent", key(i)))
    with pytest.raises(IncompleteError) as info:
        e.verify()
    assert info.value.state is State.INCOMPLETE
    before = local.files()
    with pytest.raises(IncompleteExistsError), e.writing():
        pass  # pragma: no cover
    with pytest.raises(IncompleteExistsError):
        e.mark_complete()  # the backfill tool must not adopt a writer that may be alive
    assert local.files() == before
    assert e.state() is State.INCOMPLETE


@pytest.mark.parametrize("point", KILL_POINTS)
def test_overwrite_after_kill_completes(local: Place, point: str) -> None:
    e = killed_at(local, point)
    with e.writing(overwrite=True) as w:
        for i in range(N_OBJECTS + 1):
            w.write_bytes(key(i), payload(i))
    assert e.state() is State.COMPLETE
    assert e.verify(deep=True).ok
    assert temp_files(local) == []
    files = local.files()
    assert sorted(k for k in files if k.startswith(".durable/")) == [".durable/ent/commit.json"]
    manifest = json.loads(files[".durable/ent/commit.json"])["manifest"]
    assert manifest == {k[len("ent/"):]: {"size": len(v), "crc32c": f"{crc32c.crc32c(v):08x}"}
                        for k, v in files.items() if k.startswith("ent/")}
    assert read_verified(local.url("ent", key(3))) == payload(3)


@pytest.mark.parametrize("point", ["object 4", "partial"])
def test_resume_after_kill_keeps_whole_objects_and_drops_temp(local: Place, point: str) -> None:
    e = killed_at(local, point)
    with e.writing(resume=True) as w:
        w.write_bytes(key(N_OBJECTS), payload(N_OBJECTS))
    assert e.state() is State.COMPLETE
    assert temp_files(local) == []
    assert e.verify(deep=True).ok
    for i in range(objects_written(point)):
        assert read_verified(local.url("ent", key(i))) == payload(i)


def test_child_runs_to_commit_when_not_killed(local: Place) -> None:
    """The control: the same child, let go, commits a COMPLETE entry."""
    child = Child("entry", local.url("ent"), str(N_OBJECTS))
    assert child.finish() == "won"
    e = Entry(local.url("ent"))
    assert e.state() is State.COMPLETE
    assert e.verify(deep=True).ok


SIZE = 4 * 1024 * 1024


def test_killed_atomic_write_leaves_no_target(local: Place) -> None:
    child = Child("atomic", local.url("a.bin"), str(SIZE))
    child.run_until("partial")
    child.kill()
    assert local.read("a.bin") is None
    # The kill landed with bytes in a temp file (a killed process cannot clean it up).
    assert [len(v) for k, v in local.files().items() if ".durable-tmp-" in k] == [SIZE // 2]
    with pytest.raises(FileNotFoundError):
        read_verified(local.url("a.bin"))
    assert Entry(local.url("a.bin")).state() is State.ABSENT


def test_killed_atomic_write_leaves_old_version(local: Place) -> None:
    old = os.urandom(10_000)
    with atomic_write(local.url("a.bin")) as f:
        f.write(old)
    marker = local.read(".durable/a.bin/commit.json")
    child = Child("atomic", local.url("a.bin"), str(SIZE))
    child.run_until("partial")
    child.kill()
    assert local.read("a.bin") == old
    assert local.read(".durable/a.bin/commit.json") == marker
    assert read_verified(local.url("a.bin")) == old


def test_atomic_child_commits_when_not_killed(local: Place) -> None:
    child = Child("atomic", local.url("a.bin"), str(SIZE))
    assert child.finish() == "committed"
    assert read_verified(local.url("a.bin")) == payload(0, SIZE)


# ------------------------------------------------------------------ S3: multipart, then killed
BIG = 9 * 1024 * 1024  # over the 8 MiB part size: a multipart upload, its record a marker


@pytest.mark.s3
@pytest.mark.slow  # a child process, a 9 MiB upload and a clean: about 6 s
def test_killed_after_multipart_complete_reads_incomplete_and_clean_removes_it(
        s3_bucket: Bucket, boto: Any) -> None:
    """A writer killed once CompleteMultipartUpload published the object and before its
    marker landed (the marker PUT held by the proxy, the process SIGKILLed there): the
    object is whole in the store, recorded nowhere. Readers must see INCOMPLETE (never
    COMPLETE data), and scan and clean must name it and resolve it."""
    url = s3_bucket.path("big.bin")
    marker_key = ".durable/big.bin/commit.json"
    stalled = threading.Event()

    def marker_put(info: RequestInfo) -> bool:
        if info.method == "PUT" and info.path.endswith(marker_key):
            stalled.set()
            return True
        return False

    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        # Held, and never forwarded: the proxy's stop cuts the delay short.
        proxy.add(faults.delay(600, match=Match(where=marker_put)))
        proxy.add(faults.drop_connection(match=Match(where=marker_put)))
        child = Child("atomic", url, str(BIG), json.dumps(options))
        child.run_until("partial")
        child.go()
        assert stalled.wait(120), "the child never reached its marker PUT"
        child.kill()
    # What the kill left, seen around durable: the whole object, no marker, no upload.
    got = boto.get_object(Bucket=s3_bucket.name, Key="big.bin")["Body"].read()
    assert got == payload(0, BIG)
    keys = [o["Key"] for o in boto.list_objects_v2(Bucket=s3_bucket.name).get("Contents", [])]
    assert marker_key not in keys

    options = s3_bucket.storage_options
    with pytest.raises(IncompleteError, match="commit record never followed"):
        read_verified(url, storage_options=options)
    status = Entry(url, storage_options=options).status()
    assert status.state is State.INCOMPLETE and "never followed" in status.reason
    (row,) = scan(s3_bucket.url, storage_options=options)
    assert (row.url, row.state) == (url, "INCOMPLETE") and "never followed" in row.reason
    # Never adopted as data written before durable: a bulk mark-complete leaves it.
    adopted = mark_complete_root(survey(*resolve(s3_bucket.url, options)), apply=True)
    assert adopted.adoptions == []
    assert [(s.url, "never followed" in s.reason) for s in adopted.skipped] == [(url, True)]
    assert Entry(url, storage_options=options).state() is State.INCOMPLETE
    # durable clean removes it once old, as any dead writer's leftovers.
    young = plan_clean(survey(*resolve(s3_bucket.url, options)), older_than=3600)
    assert young.items == []
    assert [(k.url, "younger than --older-than" in k.reason) for k in young.kept] == [
        (url, True)]
    sv = survey(*resolve(s3_bucket.url, options))
    report = plan_clean(sv, older_than=0)
    assert [(i.kind, i.url, "never followed" in i.reason) for i in report.items] == [
        ("entry", url, True)]
    apply_clean(sv, report)
    assert [i.status for i in report.items] == ["removed"]
    assert boto.list_objects_v2(Bucket=s3_bucket.name).get("Contents", []) == []
    assert Entry(url, storage_options=options).state() is State.ABSENT
    # The next writer writes it, recorded.
    with atomic_write(url, storage_options=options) as f:
        f.write(payload(1, BIG))
    assert read_verified(url, storage_options=options) == payload(1, BIG)
