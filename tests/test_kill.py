"""A writer SIGKILLed at any point leaves an entry that is INCOMPLETE, never COMPLETE.

Incident 001: a killed writer left a zarr that looked cached. The writer here is a real
child process (tests/_writer_child.py) that reports each step on stdout and waits on stdin,
so the kill lands exactly between two steps, with no sleeps.
"""

from __future__ import annotations

import json
import os

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
