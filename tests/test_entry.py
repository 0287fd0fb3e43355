"""Entry.writing(): an entry is COMPLETE only with a marker over exactly the data written.

Incident 001: a cache entry counted as cached once its first object existed; a killed or
concurrent writer left one that looked cached. Manifests are checked against CRC32Cs the
test computes itself, with the `crc32c` package, over the files as they are in the store.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c
import pytest

from _writer_child import Child, key, payload
from conftest import Place
from durable import (
    AlreadyCompleteError,
    Entry,
    EntryExistsError,
    IncompleteError,
    IncompleteExistsError,
    IntegrityError,
    MarkerError,
    State,
    atomic_write,
    read_verified,
)
from durable.testing.pytest_plugin import Bucket

MARKER = ".durable/ent/commit.json"


def on_disk(place: Place, prefix: str = "ent/") -> dict[str, dict[str, object]]:
    """The manifest the entry's files deserve, computed without durable."""
    return {k[len(prefix):]: {"size": len(v), "crc32c": f"{crc32c.crc32c(v):08x}"}
            for k, v in place.files().items() if k.startswith(prefix)}


def marker_doc(place: Place, rel: str = MARKER) -> dict[str, object]:
    raw = place.read(rel)
    assert raw is not None, "no marker"
    doc: dict[str, object] = json.loads(raw)
    return doc


def write_complete(place: Place, objects: dict[str, bytes], name: str = "ent") -> Entry:
    e = Entry(place.url(name))
    with e.writing() as w:
        for k, v in objects.items():
            w.write_bytes(k, v)
    assert e.state() is State.COMPLETE
    return e


def test_clean_exit_records_every_object(place: Place, tmp_path: os.PathLike[str]) -> None:
    e = Entry(place.url("ent"))
    big = os.urandom(2 * 1024 * 1024 + 3)
    with e.writing() as w:
        w.write_bytes("zarr.json", b'{"zarr_format": 3}')
        with w.fs.open(f"{w.path}/c/0/0", "wb") as f:
            f.write(big[:100])
            f.write(big[100:])
        w.fs.pipe_file(f"{w.path}/c/0/1", b"")  # an empty object is still an object
        with w.open("deep/er/still") as af:
            af.write(b"x" * 1000)
        assert e.state() is State.INCOMPLETE  # mid-write: never COMPLETE
    assert e.state() is State.COMPLETE
    doc = marker_doc(place)
    assert doc["manifest"] == on_disk(place)
    assert sorted(on_disk(place)) == ["c/0/0", "c/0/1", "deep/er/still", "zarr.json"]
    assert doc["count"] == 4
    assert doc["total_size"] == len(big) + 1000 + len(b'{"zarr_format": 3}')
    # The attempt record is gone: the records hold the marker and nothing else.
    assert [k for k in place.files() if k.startswith(".durable/")] == [MARKER]
    assert e.verify(deep=True).ok
    assert read_verified(place.url("ent", "c", "0", "0")) == big


@pytest.mark.parametrize("exc", [ValueError("boom"), KeyboardInterrupt()])
def test_exception_inside_leaves_nothing(place: Place, exc: BaseException) -> None:
    place.write("sentinel", b"outside")
    before = place.files()
    e = Entry(place.url("ent"))
    with pytest.raises(type(exc)), e.writing() as w:
        w.write_bytes("a", b"aaaa")
        w.fs.pipe_file(f"{w.path}/b/c", os.urandom(5000))
        half = w.fs.open(f"{w.path}/unfinished", "wb")
        half.write(b"half an object")
        if place.kind == "file":
            with open(os.path.join(place.root, "ent", "plain"), "wb") as f:
                f.write(b"written around the writer")
            assert any(".durable-tmp-" in n for n in os.listdir(os.path.join(place.root, "ent")))
        raise exc
    assert place.files() == before
    assert e.state() is State.ABSENT


@pytest.mark.parametrize("mode", ["wb", "w"])
def test_a_file_still_open_when_the_block_ends_refuses_the_commit(
        place: Place, mode: str) -> None:
    """A file opened through the writer and not closed (or a thread still writing it)
    when the block ends: the commit took its temp file for a killed writer's leftover and
    committed the entry without it. It is refused, naming the object, and the file is
    aborted: closing it later publishes nothing."""
    e = Entry(place.url("ent"))
    with pytest.raises(IntegrityError, match=r"still open when it ended: .*ent/open\.bin"), \
            e.writing() as w:
        w.write_bytes("closed.bin", b"closed")
        left = w.fs.open(f"{w.path}/open.bin", mode)
        left.write(b"payload" if "b" in mode else "payload")
    assert e.state() is State.ABSENT
    left.close()
    assert e.state() is State.ABSENT
    assert not [k for k in place.files() if k.startswith("ent/")]


def test_the_writers_filesystem_deletes_nothing_after_the_commit(place: Place) -> None:
    """Writes through ``w.fs`` after the block were refused, deletes were not: they took
    objects out of the COMPLETE entry."""
    e = write_complete(place, {"a": b"aaaa", "d/b": b"bb"})
    with e.writing(overwrite=True) as w:
        w.write_bytes("a", b"aaaa")
        w.write_bytes("d/b", b"bb")
    for act in (lambda: w.fs.rm_file(f"{w.path}/a"), lambda: w.fs.rm(f"{w.path}/a"),
                lambda: w.fs.rm(f"{w.path}/d", recursive=True),
                lambda: w.fs.makedirs(f"{w.path}/new"), lambda: w.fs.mkdir(f"{w.path}/n")):
        with pytest.raises(ValueError, match="the writing\\(\\) block has ended"):
            act()
    assert e.state() is State.COMPLETE and e.verify(deep=True).ok


def test_a_block_that_writes_nothing_commits_an_empty_entry(place: Place) -> None:
    """Zero shards, an empty dataset: on local disk the commit fsynced the entry's
    directory, which nothing had made, and failed."""
    e = Entry(place.url("ent"))
    with e.writing():
        pass
    assert e.state() is State.COMPLETE
    report = e.verify(deep=True)
    assert report.ok and report.objects == 0


@pytest.mark.parametrize("flags", [{"update": True, "overwrite": True},
                                   {"resume": True, "overwrite": True},
                                   {"resume": True, "update": True}])
def test_contradictory_flags_are_refused(place: Place, flags: dict[str, bool]) -> None:
    """update=True with overwrite=True silently overwrote: the data update=True keeps was
    deleted."""
    e = write_complete(place, {"a": b"aaaa"})
    with pytest.raises(ValueError, match="at most one of"), e.writing(**flags):
        pass
    assert e.state() is State.COMPLETE and read_verified(place.url("ent", "a")) == b"aaaa"


def test_writing_onto_complete_is_refused(place: Place) -> None:
    e = write_complete(place, {"a": b"1", "b": b"2"})
    before = place.files()
    with pytest.raises(AlreadyCompleteError) as info, e.writing():
        pass  # pragma: no cover
    assert isinstance(info.value, FileExistsError)
    assert isinstance(info.value, EntryExistsError)
    assert info.value.url == e.url and e.url in str(info.value)
    assert place.files() == before


def test_writing_onto_complete_says_what_to_pass_instead(place: Place) -> None:
    """A pipeline step re-run over its committed output: the error names the arguments
    that replace or change it, and passing one of them works."""
    e = write_complete(place, {"a": b"1"})
    with pytest.raises(AlreadyCompleteError) as info, e.writing():
        pass  # pragma: no cover
    assert "overwrite=True replaces it, update=True changes it" in str(info.value)
    with e.writing(overwrite=True) as w:
        w.fs.pipe_file(f"{w.path}/a", b"2")
    assert e.state() is State.COMPLETE


def test_data_written_without_durable_is_told_how_to_adopt_it(place: Place) -> None:
    """An output folder written before durable, opened by a reader that requires COMPLETE:
    the error says how to adopt it (no durable writer ever started there), and doing what
    it says makes it COMPLETE. A folder where a durable writer started is not told so: a
    killed writer's partial data must never be adopted as whole."""
    place.write("plain/part-0.bin", b"x" * 10)
    e = Entry(place.url("plain"))
    with pytest.raises(IncompleteError) as info:
        e.require_complete()
    assert f"durable.Entry({e.url!r}).mark_complete()" in str(info.value)
    e.mark_complete()
    assert e.state() is State.COMPLETE

    started = Entry(place.url("started"))
    with pytest.raises(RuntimeError), started.writing() as w:
        w.fs.pipe_file(f"{w.path}/part-0.bin", b"y")
        raise RuntimeError("killed")
    with pytest.raises(IncompleteError) as info:
        started.require_complete()
    assert "mark_complete" not in str(info.value)


@pytest.mark.parametrize("how", ["writing", "overwrite", "mark_complete"])
def test_an_entry_inside_a_committed_one_is_refused(place: Place, how: str) -> None:
    """A path under a COMPLETE entry was accepted as an entry of its own: its objects and
    records went into the committed entry's data, whose marker still said COMPLETE."""
    outer = write_complete(place, {"a": b"1", "deep/b": b"2"})
    place.write("ent/deep/plain", b"left by another tool")  # for mark_complete to adopt
    before = place.files()
    # "writing": a path with nothing there yet (ABSENT, so it would go ahead).
    inner = Entry(place.url("ent", "fresh" if how == "writing" else "deep"))
    with pytest.raises(EntryExistsError) as info:
        if how == "mark_complete":
            inner.mark_complete()
        else:
            with inner.writing(overwrite=how == "overwrite") as w:
                w.write_bytes("c", b"3")  # pragma: no cover
    assert not isinstance(info.value, AlreadyCompleteError)  # not "this entry is done"
    assert str(info.value).startswith(f"{inner.url}: ")
    assert f"inside the committed entry {outer.url}," in str(info.value)
    assert place.files() == before
    # An entry nested in one still being written is that entry's data, committed with it.
    second = Entry(place.url("second"))
    with second.writing() as w:
        write_complete(place, {"x": b"4"}, name="second/inner")
        w.write_bytes("y", b"5")
    assert second.verify(deep=True).ok


def test_overwrite_never_shows_old_marker_over_new_data(place: Place) -> None:
    e = write_complete(place, {"a": b"old a", "b": b"old b"})
    with e.writing(overwrite=True) as w:
        # Before the first new byte, the old marker is gone.
        assert place.read(MARKER) is None
        assert e.state() is not State.COMPLETE
        w.write_bytes("a", b"new a, longer")
        assert place.read(MARKER) is None
        assert e.state() is State.INCOMPLETE
        with pytest.raises((IncompleteError, IntegrityError)):
            read_verified(place.url("ent", "a"))
        w.write_bytes("c", b"new c")
    assert e.state() is State.COMPLETE
    assert marker_doc(place)["manifest"] == on_disk(place)
    assert sorted(on_disk(place)) == ["a", "c"]  # the old entry's b went with it
    assert read_verified(place.url("ent", "a")) == b"new a, longer"


def test_failed_overwrite_leaves_nothing_complete(place: Place) -> None:
    e = write_complete(place, {"a": b"old a"})
    with pytest.raises(ValueError), e.writing(overwrite=True) as w:
        w.write_bytes("a", b"new")
        raise ValueError("boom")
    assert e.state() is State.ABSENT
    assert place.files() == {}


def make_incomplete(place: Place) -> Entry:
    """Data with no marker: what a writer without durable, or a killed one, leaves."""
    place.write("ent/left/over", b"leftover bytes")
    e = Entry(place.url("ent"))
    assert e.state() is State.INCOMPLETE
    return e


def test_writing_onto_incomplete_is_refused(place: Place) -> None:
    e = make_incomplete(place)
    before = place.files()
    with pytest.raises(IncompleteExistsError) as info, e.writing():
        pass  # pragma: no cover
    assert isinstance(info.value, FileExistsError)
    assert "INCOMPLETE" in str(info.value) and e.url in str(info.value)
    assert place.files() == before
    assert e.state() is State.INCOMPLETE


def test_overwrite_incomplete_starts_over(place: Place) -> None:
    e = make_incomplete(place)
    with e.writing(overwrite=True) as w:
        w.write_bytes("new", b"fresh")
    assert e.state() is State.COMPLETE
    assert marker_doc(place)["manifest"] == on_disk(place)
    assert sorted(on_disk(place)) == ["new"]


def test_resume_incomplete_adopts_what_is_there(place: Place) -> None:
    e = make_incomplete(place)
    with e.writing(resume=True) as w:
        w.write_bytes("new", b"fresh")
    assert e.state() is State.COMPLETE
    assert marker_doc(place)["manifest"] == on_disk(place)
    assert sorted(on_disk(place)) == ["left/over", "new"]


def test_resume_that_fails_keeps_what_was_there(place: Place) -> None:
    e = make_incomplete(place)
    with pytest.raises(ValueError), e.writing(resume=True):
        raise ValueError("boom")
    assert place.read("ent/left/over") == b"leftover bytes"
    assert e.state() is State.INCOMPLETE


def test_data_removed_by_another_tool_is_not_complete(place: Place) -> None:
    e = write_complete(place, {"a": b"1", "b/c": b"22"})
    place.remove_tree("ent")
    assert e.state() is State.INCOMPLETE
    assert "data gone" in e.status().reason
    with pytest.raises(IntegrityError) as info:
        e.verify()
    assert "missing" in str(info.value)
    with pytest.raises(IntegrityError):
        read_verified(place.url("ent", "a"))
    with pytest.raises(IncompleteExistsError), e.writing():
        pass  # pragma: no cover


def test_one_object_removed_is_caught_by_verify(place: Place) -> None:
    e = write_complete(place, {f"k{i}": bytes([i]) * 10 for i in range(5)})
    files = place.files()
    if place.kind == "file":
        os.remove(os.path.join(place.root, "ent", "k2"))
    else:
        from fsspec.implementations.memory import MemoryFileSystem
        MemoryFileSystem().rm_file(f"{place.root}/ent/k2")
    assert "ent/k2" in files and place.read("ent/k2") is None
    with pytest.raises(IntegrityError) as info:
        e.verify()
    assert info.value.url == e.adapter.url(f"{e.path}/k2")
    assert info.value.expected == 10
    with pytest.raises(IntegrityError):
        read_verified(place.url("ent", "k2"))


def test_delete_removes_entry_and_nothing_else(place: Place) -> None:
    place.write("sentinel", b"outside")
    write_complete(place, {"x": b"sibling"}, name="sibling")
    keep = place.files()
    e = write_complete(place, {"a": b"1", "b/c": b"22"})
    e.delete()
    assert e.state() is State.ABSENT
    assert place.files() == keep
    assert Entry(place.url("sibling")).state() is State.COMPLETE


def test_delete_incomplete(place: Place) -> None:
    e = make_incomplete(place)
    e.delete()
    assert e.state() is State.ABSENT
    assert place.files() == {}


def test_mark_complete_adopts_plain_files(place: Place) -> None:
    e = make_incomplete(place)
    place.write("ent/zarr.json", b"{}")
    place.write("ent/c/0/0", os.urandom(100_000))
    marker = e.mark_complete()
    assert e.state() is State.COMPLETE
    assert marker_doc(place)["manifest"] == on_disk(place)
    assert marker.manifest is not None and len(marker.manifest) == 3
    assert e.verify(deep=True).ok
    with pytest.raises(AlreadyCompleteError):
        e.mark_complete()


def test_mark_complete_single_object(place: Place) -> None:
    data = os.urandom(1234)
    place.write("one.bin", data)
    e = Entry(place.url("one.bin"))
    e.mark_complete()
    doc = marker_doc(place, ".durable/one.bin/commit.json")
    assert doc["kind"] == "object"
    assert doc["manifest"] == {"": {"size": 1234, "crc32c": f"{crc32c.crc32c(data):08x}"}}
    assert read_verified(place.url("one.bin")) == data


def test_mark_complete_refuses_absent(place: Place) -> None:
    e = Entry(place.url("ent"))
    with pytest.raises(IncompleteError):
        e.mark_complete()
    assert place.files() == {}


def test_mark_complete_refuses_a_live_writer(place: Place) -> None:
    e = Entry(place.url("ent"))
    with e.writing() as w:
        w.write_bytes("a", b"1")
        with pytest.raises(IncompleteExistsError):
            Entry(place.url("ent")).mark_complete()
        assert place.read(MARKER) is None
    assert e.state() is State.COMPLETE


@pytest.mark.parametrize("link", ["c/1", "more", "only/link"])
def test_mark_complete_never_adopts_a_folder_holding_symlinks(tmp_path: Any,
                                                              link: str) -> None:
    """A symlinked chunk, a symlinked folder, or a link alone in a folder: listings skip
    links, so Entry.mark_complete adopted the folder without it (`durable mark-complete`
    ROOT skips such folders) and it read COMPLETE, whole. Refused, naming the link."""
    from durable import UnsupportedError

    outside = os.path.join(tmp_path, "outside")
    os.makedirs(os.path.join(outside, "d"))
    with open(os.path.join(outside, "f"), "wb") as f:
        f.write(b"shared chunk")
    ent = os.path.join(os.path.realpath(tmp_path), "root", "ent")
    os.makedirs(os.path.join(ent, "c"))
    os.makedirs(os.path.join(ent, "only"))
    with open(os.path.join(ent, "c", "0"), "wb") as f:
        f.write(b"data")
    os.symlink(os.path.join(outside, "d" if link == "more" else "f"), os.path.join(ent, link))
    e = Entry(ent)
    with pytest.raises(UnsupportedError, match=f"file://{ent}/{link} is a symlink: durable "
                                               "follows no link, so a marker"):
        e.mark_complete()
    assert e.state() is State.INCOMPLETE
    assert not os.path.exists(os.path.join(tmp_path, "root", ".durable", "ent"))


@pytest.mark.parametrize("what", ["a symlink", "a directory", "a special file"])
def test_a_recorded_object_replaced_by_no_file_is_named_for_what_is_there(
        tmp_path: Any, what: str) -> None:
    """A committed object replaced by a symlink, a directory or a FIFO: status, verify
    (of the entry and of the root) and scan all said it was "missing", naming a path
    that is there (readers already say what is there instead)."""
    from click.testing import CliRunner

    from durable.cli import cli

    root = os.path.realpath(tmp_path)
    e = Entry(os.path.join(root, "ent"))
    with e.writing() as w:
        w.write_bytes("c/0", b"x" * 10)
        w.write_bytes("zarr.json", b"{}")
    obj = os.path.join(e.path, "c", "0")
    os.remove(obj)
    if what == "a symlink":
        os.symlink(os.path.join(e.path, "zarr.json"), obj)
    elif what == "a directory":
        os.mkdir(obj)
    else:
        os.mkfifo(obj)
    said = f"{e.url}/c/0 is listed in the marker but is {what}, not an object"
    st = e.status()
    assert (st.state, st.reason) == (State.INCOMPLETE, f"marker present but data gone: {said}")
    (problem,) = e.verify(deep=True, raise_errors=False).problems
    assert (problem.key, problem.issue, problem.expected, problem.found) == (
        "c/0", "missing", 10, f"{what}, not an object")
    run = CliRunner().invoke(cli, ["verify", root, "--json"])
    (result,) = json.loads(run.stdout)["results"]
    assert [(p["key"], p["found"]) for p in result["problems"]] == [
        ("c/0", f"{what}, not an object")], result
    run = CliRunner().invoke(cli, ["scan", root, "--json"])
    (row,) = json.loads(run.stdout)["entries"]
    assert f"{e.url}/c/0 is {what}, not an object (the marker recorded 10 bytes)" in (
        row["reason"]), row


OBJECTS = {key(i): payload(i, 1000) for i in range(6)}


def two_writers(place: Place, name: str) -> tuple[Entry, list[Any]]:
    """A fresh writer and one that joins with resume=True, both with all objects written."""
    e = Entry(place.url(name))
    cms = [e.writing(), e.writing(resume=True)]
    for cm in cms:
        w = cm.__enter__()
        for k, v in OBJECTS.items():
            w.write_bytes(k, v)
    return e, cms


def one_committed(place: Place, e: Entry, name: str) -> None:
    markers = [k for k in place.files() if k.startswith(f".durable/{name}/")
               and k.endswith("commit.json")]
    assert markers == [f".durable/{name}/commit.json"]
    assert e.state() is State.COMPLETE
    assert marker_doc(place, markers[0])["manifest"] == on_disk(place, f"{name}/")
    assert e.verify(deep=True).ok


@pytest.mark.parametrize("first", [0, 1])
def test_second_committer_loses_and_leaves_the_winner_alone(place: Place, first: int) -> None:
    e, cms = two_writers(place, "ent")
    cms[first].__exit__(None, None, None)
    with pytest.raises(AlreadyCompleteError):
        cms[1 - first].__exit__(None, None, None)
    one_committed(place, e, "ent")


def commit_at(barrier: threading.Barrier, cm: Any) -> str:
    barrier.wait()  # both commits start together
    try:
        cm.__exit__(None, None, None)
    except AlreadyCompleteError:
        return "lost"
    return "won"


def test_racing_threads_commit_exactly_once(place: Place) -> None:
    for round_ in range(10):
        name = f"ent{round_}"
        e, cms = two_writers(place, name)
        barrier = threading.Barrier(2)
        with ThreadPoolExecutor(2) as pool:
            results = pool.map(commit_at, [barrier, barrier], cms)
            assert sorted(results) == ["lost", "won"]
        one_committed(place, e, name)


def test_racing_processes_commit_exactly_once(tmp_path: os.PathLike[str]) -> None:
    place = Place("file", os.path.realpath(tmp_path))
    url = place.url("ent")
    first = Child("entry", url, "6", "fresh")
    first.run_until("written")
    # The second sees the first's attempt record (INCOMPLETE) and joins it.
    second = Child("entry", url, "6", "resume")
    second.run_until("written")
    first.release()  # both commit at once; neither waits for the other
    second.release()
    results = sorted([first.finish(), second.finish()])
    assert results == ["lost", "won"]
    one_committed(place, Entry(url), "ent")
    assert place.read("ent/" + key(3)) == payload(3)


def test_every_way_of_writing_is_recorded(place: Place, tmp_path: os.PathLike[str]) -> None:
    src = os.path.join(tmp_path, "upload.src")
    with open(src, "wb") as f:
        f.write(os.urandom(300_000))
    e = Entry(place.url("ent"))
    with e.writing() as w:
        with w.fs.open(f"{w.path}/wb", "wb") as f:
            f.write(b"opened wb")
        with w.fs.open(f"{w.path}/xb", "xb") as f:
            f.write(b"opened xb")
        with w.fs.open(f"{w.path}/text", "w", encoding="utf-8") as f:
            f.write("héllo")
        w.fs.pipe_file(f"{w.path}/piped", b"piped")
        w.fs.put_file(src, f"{w.path}/up/loaded")
        w.fs.get_mapper(w.path)["mapped/key"] = b"through a mapper"
        w.fs.pipe_file(f"{w.path}/removed", b"gone soon")
        w.fs.rm_file(f"{w.path}/removed")
        w.fs.touch(f"{w.path}/touched")
        if place.kind == "file":
            with open(os.path.join(place.root, "ent", "plain"), "wb") as f:
                f.write(b"around the writer, adopted at commit")
    assert e.state() is State.COMPLETE
    expected = on_disk(place)
    assert marker_doc(place)["manifest"] == expected
    keys = ["mapped/key", "piped", "text", "touched", "up/loaded", "wb", "xb"]
    assert sorted(expected) == sorted(keys + (["plain"] if place.kind == "file" else []))
    assert place.read("ent/text") == "héllo".encode()
    assert e.verify(deep=True).ok


def test_a_local_directory_put_recursively_is_recorded_whole(
        place: Place, tmp_path: os.PathLike[str]) -> None:
    """``w.fs.put(local_dir, ..., recursive=True)``, how a checkpoint directory written on
    local disk is uploaded, raised IsADirectoryError: fsspec hands each directory of the
    tree to put_file, which opened it as a file. Every file is recorded; put_file reports
    its bytes to a progress callback, as fsspec's does."""
    from fsspec.callbacks import Callback

    src = os.path.join(tmp_path, "ckpt-local")
    files = {"model.bin": os.urandom(70_000), "optim/state.bin": os.urandom(1_000),
             "optim/deeper/rng.bin": b"rng", "config.json": b"{}"}
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(src, rel)), exist_ok=True)
        with open(os.path.join(src, rel), "wb") as f:
            f.write(data)
    progress = Callback()
    e = Entry(place.url("ent"))
    with e.writing() as w:
        w.fs.put(src + "/", f"{w.path}/step-100/", recursive=True)
        w.fs.put_file(os.path.join(src, "model.bin"), f"{w.path}/step-100/copy.bin",
                      callback=progress)
    assert e.state() is State.COMPLETE
    files["copy.bin"] = files["model.bin"]
    assert {k: place.read(f"ent/step-100/{k}") for k in files} == files
    assert marker_doc(place)["manifest"] == on_disk(place)
    assert sorted(on_disk(place)) == sorted(f"step-100/{k}" for k in files)
    assert e.verify(deep=True).ok
    assert (progress.size, progress.value) == (70_000, 70_000)


def test_a_damaged_local_checkpoint_put_into_an_entry_is_refused(
        place: Place, tmp_path: os.PathLike[str]) -> None:
    """``w.fs.put`` of a checkpoint committed on local disk and damaged there since (a
    flipped byte) read the files unchecked: the entry committed the damage, recorded with
    its own CRC32C, COMPLETE and verifying deep. The source is read against its record,
    and the writer's block fails naming the file; nothing is committed."""
    src = os.path.join(tmp_path, "ckpt-local")
    with Entry(src).writing() as w:
        w.fs.pipe_file(f"{w.path}/model.bin", os.urandom(70_000))
        w.fs.pipe_file(f"{w.path}/config.json", b"{}")
    model = os.path.join(src, "model.bin")
    with open(model, "r+b") as f:
        f.seek(4321)
        byte = f.read(1)
        f.seek(4321)
        f.write(bytes([byte[0] ^ 1]))
    e = Entry(place.url("ent"))
    with pytest.raises(IntegrityError, match=r"model\.bin.*CRC32C"), e.writing() as w:
        w.fs.put(src, w.path, recursive=True)
    assert e.state() is not State.COMPLETE


def test_touch_without_truncate_keeps_the_bytes(place: Place) -> None:
    """``touch(path, truncate=False)`` leaves an existing object's bytes alone (fsspec's
    meaning, and plain fsspec's); the writer's touch emptied it, and the commit recorded
    the empty object as the data."""
    e = Entry(place.url("ent"))
    with e.writing() as w:
        w.fs.pipe_file(f"{w.path}/kept", b"important")
        w.fs.touch(f"{w.path}/kept", truncate=False)
        w.fs.touch(f"{w.path}/new", truncate=False)
        w.fs.pipe_file(f"{w.path}/emptied", b"x")
        w.fs.touch(f"{w.path}/emptied")
    assert e.verify(deep=True).ok
    assert read_verified(place.url("ent", "kept")) == b"important"
    assert read_verified(place.url("ent", "new")) == b""
    assert read_verified(place.url("ent", "emptied")) == b""


def test_a_name_of_durables_temp_files_is_refused_when_written(place: Place) -> None:
    """A key named like durable's temp files (``.x.durable-tmp-...``) was taken for a
    killed writer's leftover at the commit, removed, and the commit then failed with "written
    by this writer but gone at commit" after every other object was written. It is
    refused when written, naming it; the rest of the entry commits."""
    e = Entry(place.url("ent"))
    with e.writing() as w:
        for bad in ("a/.x.durable-tmp-0123456789ab", ".y.durable-tmp-0123456789ab"):
            with pytest.raises(ValueError, match="durable-tmp"):
                w.write_bytes(bad, b"data")
            with pytest.raises(ValueError, match="durable-tmp"):
                w.fs.pipe_file(f"{w.path}/{bad}", b"data")
        w.write_bytes("ok", b"data")
    assert e.state() is State.COMPLETE
    assert sorted(marker_doc(place)["manifest"]) == ["ok"]


def test_a_name_of_durables_records_folder_is_refused_when_written(place: Place) -> None:
    """A key with a ``.durable`` segment (a user's own folder of that name) was written and
    committed, and then no verified read could open it: ``.durable`` names durable's own
    records, where no data is looked up. It is refused when written, naming it, as
    ``durable::`` refuses it; the rest of the entry commits."""
    e = Entry(place.url("ent"))
    with e.writing() as w:
        for bad in (".durable", "sub/.durable/inner"):
            with pytest.raises(ValueError, match=r"\.durable"):
                w.write_bytes(bad, b"data")
            with pytest.raises(ValueError, match=r"\.durable"):
                w.fs.pipe_file(f"{w.path}/{bad}", b"data")
        w.write_bytes(".durable-ok/x", b"data")
    assert e.state() is State.COMPLETE
    assert sorted(marker_doc(place)["manifest"]) == [".durable-ok/x"]
    assert read_verified(place.url("ent", ".durable-ok", "x")) == b"data"


def test_an_entry_named_like_durables_records_folder_is_refused_naming_why(
        place: Place) -> None:
    """An entry or an atomic_write named ``.durable`` was refused as one that "needs a
    name of its own", which sent the user looking for a missing name. The refusal says
    that ``.durable`` is durable's records directory."""
    with pytest.raises(ValueError, match=r"'\.durable' is the name of durable's records"):
        Entry(place.url(".durable")).writing().__enter__()
    with (pytest.raises(ValueError, match=r"'\.durable' is the name of durable's records"),
          atomic_write(place.url("ckpt", ".durable")) as f):
        f.write(b"x")
    assert place.files() == {}


def test_a_copy_into_the_entry_is_of_the_recorded_bytes_only(place: Place) -> None:
    """``w.fs.cp_file`` from another committed entry read the source unchecked: damaged
    bytes there were copied, recorded with their own CRC32C, and committed as good data
    (durable::'s cp_file checks). Now the copy is refused, naming the source."""
    src = Entry(place.url("src"))
    with src.writing() as w:
        w.write_bytes("obj", b"the recorded bytes")
    place.write("src/obj", b"the damaged  bytes")  # same size, around durable
    dst = Entry(place.url("dst"))
    with pytest.raises(IntegrityError, match="src/obj"), dst.writing() as w:
        w.fs.cp_file(place.url("src", "obj"), f"{w.path}/obj")
    assert dst.state() is State.ABSENT
    with dst.writing() as w:  # an unrecorded source is copied as it is
        place.write("plain", b"no record")
        w.fs.cp_file(place.url("plain"), f"{w.path}/plain")
    assert read_verified(place.url("dst", "plain")) == b"no record"


def test_a_copy_into_the_entry_of_a_codeword_chunk_checks_its_tail(place: Place) -> None:
    """A chunk zarr's crc32c codec encoded ends with its own CRC32C, so its whole CRC32C is
    the residue: another attempt's chunk of the same size put over the committed one had
    its record's size and CRC32C, and ``w.fs.cp_file`` copied and committed it as good
    (verify and verified reads check the record's tail, its last 4 bytes)."""
    def codeword(body: bytes) -> bytes:
        return body + crc32c.crc32c(body).to_bytes(4, "little")

    src = Entry(place.url("src"))
    with src.writing() as w:
        w.write_bytes("c/0", codeword(b"the committed chunk"))
    record = src.read_marker().manifest.objects["c/0"]  # type: ignore[union-attr]
    assert record.tail is not None  # kept by the writer (it kept none: nothing to check)
    place.write("src/c/0", codeword(b"a straggler's chunk"))  # around durable
    dst = Entry(place.url("dst"))
    with pytest.raises(IntegrityError, match=r"src/c/0: ends with .*, the record says"), \
            dst.writing() as w:
        w.fs.cp_file(place.url("src", "c", "0"), f"{w.path}/c/0")
    assert dst.state() is State.ABSENT


def test_nothing_is_written_through_a_symlinked_directory(
        tmp_path: os.PathLike[str]) -> None:
    """A directory of an INCOMPLETE entry swapped for a symlink, then a resumed writer:
    its objects below that directory were written wherever the link pointed, and the
    commit (whose listing never follows a link) refused them as "gone at commit", leaving
    them there. Now the write is refused, naming the link; nothing lands outside."""
    root = os.path.realpath(tmp_path)
    outside = os.path.join(root, "outside")
    os.makedirs(outside)
    os.makedirs(os.path.join(root, "ent"))
    os.symlink(outside, os.path.join(root, "ent", "sub"))
    e = Entry(os.path.join(root, "ent"))
    with e.writing(resume=True) as w:
        with pytest.raises(ValueError, match="symlink"):
            w.write_bytes("sub/chunk", b"x")
        with pytest.raises(ValueError, match="symlink"):
            w.fs.pipe_file(f"{w.path}/sub/deeper/chunk", b"x")
        w.write_bytes("kept", b"inside")
    assert os.listdir(outside) == []
    assert e.state() is State.COMPLETE


def test_nothing_is_written_through_an_entry_swapped_for_a_symlink(
        tmp_path: os.PathLike[str]) -> None:
    """The entry's folder itself swapped for a symlink while a writer writes (`writing()`
    refuses one at the start, in every mode, as `status` does): each object was written
    wherever the link pointed (only directories inside the entry were looked at), and the
    commit, whose listing never follows a link, refused them as "gone at commit", leaving
    them out there. Now each write is refused with the error status raises for such an
    entry; nothing lands outside."""
    root = os.path.realpath(tmp_path)
    outside = os.path.join(root, "outside")
    os.makedirs(outside)
    e = Entry(os.path.join(root, "ent"))
    with pytest.raises(IntegrityError, match="gone at commit"), e.writing() as w:
        w.write_bytes("first", b"inside")
        os.rename(e.path, os.path.join(root, "moved"))
        os.symlink(outside, e.path)
        for key, write in (("top", lambda: w.write_bytes("top", b"x")),
                           ("c/0", lambda: w.write_bytes("c/0", b"x")),
                           ("c/1", lambda: w.fs.pipe_file(f"{w.path}/c/1", b"x"))):
            with pytest.raises(MarkerError) as refused:
                write()
            assert isinstance(refused.value, ValueError)
            assert str(refused.value).startswith(f"{e.url}/{key}: not written: {e.url} is "
                                                 "a symlink, which durable never follows")
    assert os.listdir(outside) == []
    assert os.listdir(os.path.join(root, "moved")) == ["first"]


def test_writing_outside_the_entry_is_refused(place: Place) -> None:
    place.write("sentinel", b"outside")
    e = Entry(place.url("ent"))
    with e.writing() as w:
        for bad in [place.url("sentinel"), place.url("other"), f"{w.path}/../sentinel",
                    f"{w.path}/a/../../sentinel", f"{w.path}x/neighbour", "/etc/passwd"]:
            with pytest.raises(ValueError):
                w.fs.pipe_file(bad, b"escaped")
            with pytest.raises(ValueError):
                w.fs.open(bad, "wb")
        with pytest.raises(ValueError):
            w.open("../sentinel")
        w.write_bytes("ok", b"inside")
    assert place.files() == {"sentinel": b"outside", "ent/ok": b"inside",
                             MARKER: place.read(MARKER)}


def test_unrecorded_error_refuses_objects_written_around_the_writer(tmp_path: os.PathLike[str],
                                                                    ) -> None:
    root = os.path.realpath(tmp_path)
    e = Entry(os.path.join(root, "ent"))
    with pytest.raises(IntegrityError, match="not written through"), \
            e.writing(unrecorded="error") as w:
        w.write_bytes("a", b"1")
        with open(os.path.join(root, "ent", "plain"), "wb") as f:
            f.write(b"around")
    assert e.state() is State.ABSENT


def test_object_changed_around_the_writer_before_commit_is_refused(place: Place) -> None:
    e = Entry(place.url("ent"))
    with pytest.raises(IntegrityError, match="at commit"), e.writing() as w:
        w.write_bytes("a", b"as written")
        place.write("ent/a", b"changed by someone else, longer")
    assert place.read(MARKER) is None
    assert e.state() is not State.COMPLETE


def test_writer_is_closed_after_the_block(place: Place) -> None:
    e = Entry(place.url("ent"))
    with e.writing() as w:
        w.write_bytes("a", b"1")
    with pytest.raises(ValueError, match="ended"):
        w.write_bytes("b", b"2")
    assert sorted(on_disk(place)) == ["a"]


def test_object_rewritten_behind_the_writer_with_other_bytes_blocks_the_commit(
        place: Place) -> None:
    # Same size, other bytes: a size check alone would commit our CRC over their data.
    e = Entry(place.url("ent"))
    with pytest.raises(IntegrityError, match=r"c/0/0: replaced after this writer wrote it"), \
            e.writing() as w:
        w.write_bytes("c/0/0", b"a" * 64)
        place.write("ent/c/0/0", b"b" * 64)
    assert e.read_marker() is None


def test_object_rewritten_behind_the_writer_with_the_same_bytes_commits(place: Place) -> None:
    e = Entry(place.url("ent"))
    with e.writing() as w:
        w.write_bytes("c/0/0", b"a" * 64)
        place.write("ent/c/0/0", b"a" * 64)
    assert marker_doc(place)["manifest"] == on_disk(place)


def test_overwrite_recovers_an_entry_whose_marker_is_unreadable(place: Place) -> None:
    write_complete(place, {"a": b"1"})
    place.write(MARKER, b"{not json")
    e = Entry(place.url("ent"))
    with pytest.raises(ValueError, match="not valid JSON"), e.writing():
        pass
    with e.writing(overwrite=True) as w:
        w.write_bytes("b", b"2")
    assert e.state() is State.COMPLETE
    assert marker_doc(place)["manifest"] == on_disk(place) == {
        "b": {"size": 1, "crc32c": f"{crc32c.crc32c(b'2'):08x}"}}


@pytest.mark.parametrize("url", ["memory://dotdot/sub/../e1", "memory://dotdot/sub/./e1",
                                 "memory://dotdot/sub//e1"])
def test_dot_segments_are_refused_where_the_store_keeps_them_literally(url: str) -> None:
    """A local disk resolves 'sub/../e1' to e1; an object store (and fsspec's memory
    filesystem) keeps the literal key: one URL, two places. Refused, named."""
    with pytest.raises(ValueError, match="mean different places on an object store"):
        Entry(url)
    with pytest.raises(ValueError, match="mean different places"):
        read_verified(url)


def test_an_empty_url_is_refused(tmp_path: os.PathLike[str]) -> None:
    from durable import atomic_write

    with pytest.raises(ValueError, match="an empty URL names no object"):
        atomic_write("").__enter__()


def test_a_file_dropped_unclosed_in_the_block_refuses_the_commit(place: Place) -> None:
    """``np.save(w.fs.open(path, "wb"), array)``: the file, never closed, is dropped as the
    statement ends, and its finalizer publishes nothing (never from the garbage
    collector). The commit then went on without it: the entry was COMPLETE with the shard
    missing from its data and its manifest, and the writer was told nothing. Refused,
    naming the object; nothing of the entry is left."""
    e = Entry(place.url("ckpt"))
    with pytest.raises(IntegrityError,
                       match=r"dropped without close\(\), so never published: .*ckpt/shard-0"), \
            e.writing() as w:
        w.write_bytes("index.json", b'{"shards": 1}')
        w.fs.open(f"{w.path}/shard-0.bin", "wb").write(b"weights")  # never closed
        gc.collect()  # where reference counting did not drop it already
    assert e.state() is State.ABSENT
    assert not [k for k in place.files() if k.startswith("ckpt/")]


def test_a_writer_over_data_written_without_durable_is_told_how_to_adopt_it(
        place: Place) -> None:
    """A checkpoint folder saved before durable (no records at all): the refusal said
    "a killed writer's leftover ... Resolve it with Entry.delete() or `durable clean`",
    and `durable clean` leaves data with no durable records alone (it removed nothing).
    It says what the data is and how to adopt it or start over."""
    place.write("legacy/model.npy", b"weights")
    with pytest.raises(IncompleteExistsError) as info, \
            Entry(place.url("legacy")).writing() as w:
        w.write_bytes("more.npy", b"x")
    text = str(info.value)
    assert "no durable records" in text and "mark_complete()" in text
    assert "overwrite=True" in text and "durable clean" not in text
    assert place.files() == {"legacy/model.npy": b"weights"}


def test_a_file_dropped_then_written_again_commits_what_was_written_after(
        place: Place) -> None:
    """A download retried by hand: the failed try's file dropped unclosed, the next one
    written whole. The object is in the entry as the later file wrote it: nothing was
    lost, so the commit goes on. A rewrite dropped after an earlier write of the same
    object was lost, and still refuses it."""
    e = Entry(place.url("ckpt"))
    with e.writing() as w:
        for attempt in range(2):
            f = w.fs.open(f"{w.path}/weights.bin", "wb")
            f.write(b"partial" if attempt == 0 else b"whole weights")
            if attempt == 0:
                del f  # the try failed: its file dropped, unclosed
                gc.collect()
                continue
            f.close()
    assert e.state() is State.COMPLETE
    assert read_verified(place.url("ckpt", "weights.bin")) == b"whole weights"

    e2 = Entry(place.url("ckpt2"))
    with pytest.raises(IntegrityError, match=r"dropped without close\(\).*ckpt2/a"), \
            e2.writing() as w:
        w.write_bytes("a", b"first")
        w.fs.open(f"{w.path}/a", "wb").write(b"second, lost")
        gc.collect()
    assert e2.state() is State.ABSENT


def test_a_bucket_or_root_is_refused_as_an_entry_by_the_url_given(
        s3_bucket: Bucket) -> None:
    """A bucket has no parent to hold a commit marker. The error named the bare path
    ("'ops' cannot be an entry"), a name the user of s3://ops never wrote."""
    for url in (s3_bucket.url, f"{s3_bucket.url}/"):
        with pytest.raises(ValueError, match=rf"^{s3_bucket.url}: .*no parent"):
            Entry(url, storage_options=s3_bucket.storage_options)
    with pytest.raises(ValueError, match=r"^file:///: .*a name of its own"):
        Entry("/")


def test_deep_verification_holds_no_call_per_object(tmp_path: os.PathLike[str]) -> None:
    """A deep verify submitted one read per object at once and held every future to the
    end (about 1.6 KB each: 160 MB at 100,000 chunks, 1.6 GB at a million), and read each
    object in an 8 MiB block however small it was. Its memory beyond the manifest and the
    listing (which a size-only verify holds too) is now a window of reads, whatever the
    number of objects."""
    import tracemalloc

    e = Entry(os.path.join(os.path.realpath(tmp_path), "ent"))
    with e.writing() as w:
        for i in range(2000):
            w.write_bytes(f"c/{i}", b"x")
    peaks = []
    for deep in (False, True):
        tracemalloc.start()
        try:
            assert e.verify(deep=deep, workers=2).objects == 2000
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert peaks[1] - peaks[0] < 1024 * 1024, peaks  # 2,000 futures held: over 3 MB


@pytest.mark.parametrize("key", ["a//b", "../x", "./x", "a\\b"])
def test_a_key_an_entry_cannot_hold_is_refused_as_bad_input(place: Place, key: str) -> None:
    """Written through the writer, such a key was refused as a MarkerError (an
    IntegrityError) speaking of a "manifest key": a corrupt marker, to a caller who had
    only written a bad name. It is a ValueError naming the key."""
    e = Entry(place.url("e"))
    with pytest.raises(ValueError, match="not a name an entry can hold") as err, \
            e.writing() as w:
        w.write_bytes(key, b"x")
    assert not isinstance(err.value, MarkerError)
    assert repr(key) in str(err.value)
