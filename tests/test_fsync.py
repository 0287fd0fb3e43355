"""fsync order on the local disk: data durable before it is named, names durable after.

Incident 003: a checkpoint renamed into place without fsync was read from another node
as a prefix. The system calls durable.adapters.local makes are recorded as they happen by
wrapping its `os` (each call still goes to the real os), and their order is checked; one
case is cross-checked under strace, outside Python altogether.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import durable.adapters.local as local_adapter
from durable import Entry, atomic_write

Event = tuple[str, ...]


class RecordingOS:
    """The real os module, with fsync/replace/link/open/unlink calls logged in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _log(self, *event: str) -> None:
        with self._lock:
            self.events.append(event)

    def fsync(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        os.fsync(fd)
        self._log("fsync", path)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)
        self._log("publish", src, dst)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)
        self._log("publish", src, dst)

    def open(self, path: str, flags: int, mode: int = 0o777, **kw: Any) -> int:
        fd = os.open(path, flags, mode, **kw)
        self._log("open", path)
        return fd

    def unlink(self, path: str) -> None:
        os.unlink(path)
        self._log("unlink", path)

    def where(self, match: Callable[[Event], bool]) -> list[int]:
        return [i for i, e in enumerate(self.events) if match(e)]

    def first(self, *event: str) -> int:
        found = self.where(lambda e: e == event)
        assert found, f"{event} never happened; events: {self.events}"
        return found[0]

    def publish_of(self, dst: str) -> tuple[int, str]:
        found = [(i, e[1]) for i, e in enumerate(self.events)
                 if e[0] == "publish" and e[2] == dst]
        assert len(found) == 1, f"{dst} published {len(found)} times: {self.events}"
        return found[0]

    def fsyncs(self, path: str) -> list[int]:
        return self.where(lambda e: e == ("fsync", path))


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> RecordingOS:
    recording = RecordingOS()
    monkeypatch.setattr(local_adapter, "os", recording)
    return recording


@pytest.fixture
def root(tmp_path: os.PathLike[str]) -> str:
    return os.path.realpath(tmp_path)


def assert_published_durably(rec: RecordingOS, target: str) -> int:
    """The temp file was fsynced before it took the name, the directory after."""
    i, tmp = rec.publish_of(target)
    assert os.path.dirname(tmp) == os.path.dirname(target)  # same dir: rename is atomic
    assert any(j < i for j in rec.fsyncs(tmp)), f"{target}: not fsynced before publish"
    after = [j for j in rec.fsyncs(os.path.dirname(target)) if j > i]
    assert after, f"{target}: directory not fsynced after publish: {rec.events}"
    return after[0]


@pytest.mark.parametrize("mode", ["wb", "xb"])
def test_atomic_write_order(rec: RecordingOS, root: str, mode: str) -> None:
    target = f"{root}/a.bin"
    with atomic_write(target, mode) as f:
        f.write(b"data" * 1000)
    data_dir_synced = assert_published_durably(rec, target)
    marker = f"{root}/.durable/a.bin/commit.json"
    marker_published, _ = rec.publish_of(marker)
    # The record is written only once the data it describes is durable under its name.
    assert data_dir_synced < marker_published
    assert_published_durably(rec, marker)
    # The records directories were new: their names are made durable in their parents.
    assert any(j > marker_published for j in rec.fsyncs(f"{root}/.durable"))
    assert any(j > marker_published for j in rec.fsyncs(root))


def test_atomic_write_into_new_directories(rec: RecordingOS, root: str) -> None:
    target = f"{root}/x/y/z.bin"
    with atomic_write(target, record=False) as f:
        f.write(b"deep")
    i, _ = rec.publish_of(target)
    for d in (f"{root}/x/y", f"{root}/x", root):
        assert any(j > i for j in rec.fsyncs(d)), f"{d} not fsynced after the publish"


def test_atomic_write_over_recorded_object_drops_record_durably_first(
        rec: RecordingOS, root: str) -> None:
    target = f"{root}/a.bin"
    with atomic_write(target) as f:
        f.write(b"old")
    rec.events.clear()
    with atomic_write(target) as f:
        f.write(b"new, longer")
    marker = f"{root}/.durable/a.bin/commit.json"
    removed = rec.first("unlink", marker)
    published, _ = rec.publish_of(target)
    # A crash between the two leaves new bytes with no record (INCOMPLETE), never the old
    # record over the new bytes: the removal is durable before the new bytes take the name.
    assert any(removed < j < published for j in rec.fsyncs(f"{root}/.durable/a.bin"))


def write_entry(root: str) -> tuple[Entry, list[str]]:
    e = Entry(f"{root}/ent")
    keys = ["zarr.json", "c/0/0", "c/0/1", "c/1/0", "d/deep/er/x"]
    with e.writing() as w:
        for k in keys:
            w.write_bytes(k, k.encode() * 100)
    return e, [f"{root}/ent/{k}" for k in keys]


def dirs_to_sync(root: str, files: list[str]) -> set[str]:
    """Every directory whose entries name a new file or directory of the commit."""
    out = {f"{root}/.durable", f"{root}/.durable/ent"}
    for f in files:
        d = os.path.dirname(f)
        while d != os.path.dirname(root):
            out.add(d)
            d = os.path.dirname(d)
    return out


def check_commit_order(rec: RecordingOS, root: str, files: list[str]) -> None:
    marker = f"{root}/.durable/ent/commit.json"
    # Before the marker takes its name (its bytes may be written and fsynced beside the
    # data's: a marker that is not yet published says nothing).
    published, _ = rec.publish_of(marker)
    before = rec.events[:published]
    for f in files:
        assert before.count(("fsync", f)) == 1, f"{f} not fsynced once before the marker"
    for d in dirs_to_sync(root, files):
        # Once: the commit batches directory fsyncs, it does not repeat them per file.
        assert before.count(("fsync", d)) == 1, f"{d}: {before.count(('fsync', d))} fsyncs"
    assert_published_durably(rec, marker)


def test_entry_commit_order(rec: RecordingOS, root: str) -> None:
    _, files = write_entry(root)
    check_commit_order(rec, root, files)
    # Objects inside writing() are not fsynced one by one: the commit does it in a batch.
    last_object = max(rec.publish_of(f)[0] for f in files)
    assert not [e for e in rec.events[:last_object] if e[0] == "fsync"]


def test_objects_synced_early_are_synced_before_the_marker(
        rec: RecordingOS, root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`EntryWriter.sync_soon` starts an object's fsync before the block ends; the commit
    waits for it (a slow one included), and one written again afterwards is synced again:
    the early fsync covered the old bytes."""
    slow = f"{root}/ent/slow"
    fsync = rec.fsync

    def slow_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == slow:
            threading.Event().wait(0.3)  # still flushing when the block ends
        fsync(fd)

    monkeypatch.setattr(rec, "fsync", slow_fsync)
    e = Entry(f"{root}/ent")
    with e.writing() as w:
        for key in ("slow", "again", "kept"):
            w.write_bytes(key, key.encode())
        w.sync_soon(["slow", "again", "kept"])
        again = f"{root}/ent/again"
        deadline = time.monotonic() + 10
        while not rec.fsyncs(again) and time.monotonic() < deadline:
            time.sleep(0.005)  # its early fsync done: it covered the first bytes only
        w.write_bytes("again", b"written again")
    check_commit_order(rec, root, [f"{root}/ent/{k}" for k in ("slow", "kept")])
    published = max(i for i, ev in enumerate(rec.events)
                    if ev[0] == "publish" and ev[2] == again)
    marker_published = rec.publish_of(f"{root}/.durable/ent/commit.json")[0]
    assert any(published < j < marker_published for j in rec.fsyncs(again))


def test_mark_complete_order(rec: RecordingOS, root: str) -> None:
    files = [f"{root}/ent/a", f"{root}/ent/b/c"]
    for f in files:
        os.makedirs(os.path.dirname(f), exist_ok=True)
        with open(f, "wb") as fh:
            fh.write(b"plain")
    Entry(f"{root}/ent").mark_complete()
    marker = f"{root}/.durable/ent/commit.json"
    before = rec.events[:rec.publish_of(marker)[0]]
    for f in files:
        assert ("fsync", f) in before
    for d in (f"{root}/ent", f"{root}/ent/b", root):
        assert ("fsync", d) in before
    assert_published_durably(rec, marker)


def test_overwrite_drops_marker_durably_before_new_data(rec: RecordingOS, root: str) -> None:
    e, _ = write_entry(root)
    rec.events.clear()
    with e.writing(overwrite=True) as w:
        w.write_bytes("new", b"new data")
    marker = f"{root}/.durable/ent/commit.json"
    removed = rec.first("unlink", marker)
    new_data = rec.where(lambda ev: ev[0] == "open" and "/ent/.new" in ev[1])[0]
    assert any(removed < j < new_data for j in rec.fsyncs(f"{root}/.durable/ent"))


TREE = {"zarr.json": b"{}", "a/zarr.json": b"{}", "a/c/0/0": b"chunk", "a/c/0/1": b"chunk",
        "b/.zarray": b"{}", "b/.zattrs": b"{}", "b/0.0": b"chunk", "notes.txt": b"data"}


@pytest.mark.parametrize("how", ["overwrite COMPLETE", "overwrite INCOMPLETE", "delete"])
def test_a_removal_takes_what_readers_open_first_first(
        rec: RecordingOS, root: str, how: str) -> None:
    """Incident 001 in reverse: a removal killed part-way (an overwrite clearing the old
    entry, a delete) must never leave zarr.json over missing chunks, which a plain zarr or
    tensorstore reader opens and reads as fill values. Every metadata document goes
    before any other object."""
    e = Entry(f"{root}/ent")
    with e.writing() as w:
        for key, data in TREE.items():
            w.write_bytes(key, data)
    if how == "overwrite INCOMPLETE":
        e.adapter.delete([e.layout.marker])  # a killed rewrite: no marker, data there
    rec.events.clear()
    if how == "delete":
        e.delete()
    else:
        with e.writing(overwrite=True) as w:
            w.write_bytes("new", b"new")
    gone = [ev[1][len(root) + len("/ent/"):] for ev in rec.events
            if ev[0] == "unlink" and ev[1].startswith(f"{root}/ent/")]
    assert sorted(gone) == sorted(TREE)
    metadata = {"zarr.json", "a/zarr.json", "b/.zarray", "b/.zattrs"}
    assert set(gone[:len(metadata)]) == metadata, gone


STRACE_SCRIPT = """
import sys
from durable import atomic_write
with atomic_write(sys.argv[1]) as f:
    f.write(b"x" * 100_000)
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_atomic_write_order_under_strace(root: str) -> None:
    """The same order seen by the kernel: no Python wrapper between durable and the calls."""
    target = f"{root}/a.bin"
    log = f"{root}/strace.log"
    subprocess.run(
        ["strace", "-f", "-y", "-qq", "-o", log, "-e",
         "trace=fsync,fdatasync,rename,renameat,renameat2,link,linkat",
         sys.executable, "-c", STRACE_SCRIPT, target], check=True, timeout=60)
    with open(log) as f:
        lines = [line.split(None, 1)[1] for line in f if line.strip()]
    publish = [i for i, line in enumerate(lines) if line.startswith("rename")
               and f'"{target}")' in line]
    assert len(publish) == 1, lines
    i = publish[0]
    tmp = lines[i].split('"')[1]
    assert any(line.startswith("fsync(") and f"<{tmp}>" in line for line in lines[:i]), lines
    assert any(line.startswith("fsync(") and f"<{root}>)" in line for line in lines[i:]), lines
