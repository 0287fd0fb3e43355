"""The `durable` CLI and `scan`: states, exit codes, table and JSON output.

Entries are made through the real library (atomic_write, Entry.writing()), unmarked data
with plain writes, and corruption the way it happens: a file rewritten shorter, a byte
flipped, a marker overwritten with garbage. The CLI runs in-process (click's CliRunner)
and, once, as a real `python -m durable` subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
from click.testing import CliRunner, Result

from conftest import Place
from durable import Entry, IncompleteError, MarkerError, State, atomic_write
from durable._scan import scan
from durable.cli import ENV_OPTIONS, cli, merge_storage_options, parse_age
from durable.testing import faults
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket

GOOD = {"zarr.json": b'{"zarr_format": 3}', "c/0/0": b"a" * 3000, "c/0/1": b"b" * 1234}
OBJ = b"one object, written whole"


@pytest.fixture(autouse=True)
def _no_ambient_options(monkeypatch: pytest.MonkeyPatch) -> None:
    # Options in the developer's environment must not leak into these tests.
    monkeypatch.delenv(ENV_OPTIONS, raising=False)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=True)
    # Anything but a clean exit is a bug in the CLI, not a result.
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def as_json(result: Result) -> Any:
    assert result.stderr == "", result.stderr  # --json: no progress, no noise
    return json.loads(result.stdout)


def write_entry(url: str, objects: dict[str, bytes]) -> Entry:
    entry = Entry(url)
    with entry.writing() as w:
        for key, data in objects.items():
            if key.startswith("c/"):
                w.fs.pipe_file(f"{w.path}/{key}", data)  # the fsspec way, as zarr writes
            else:
                w.write_bytes(key, data)
    return entry


def flip_byte(place: Place, rel: str, at: int) -> None:
    data = bytearray(place.read(rel) or b"")
    data[at] ^= 0xFF
    place.write(rel, bytes(data))


def truncate(place: Place, rel: str, size: int) -> None:
    if place.kind == "file":
        os.truncate(os.path.join(place.root, rel), size)
    else:
        place.write(rel, (place.read(rel) or b"")[:size])


class Boom(Exception):
    pass


def make_mixed_root(place: Place) -> dict[str, str]:
    """One of every kind of entry; returns name -> the state `scan` must report."""
    write_entry(place.url("good.zarr"), GOOD)
    with atomic_write(place.url("obj.bin")) as f:
        f.write(OBJ)
    place.write("plain/sub/part-0", b"written without durable")
    # A resumed writer that raised mid-write: what it found and what it wrote stay,
    # with no marker.
    place.write("resumed.zarr/zarr.json", b"{}")
    with pytest.raises(Boom), Entry(place.url("resumed.zarr")).writing(resume=True) as w:
        w.write_bytes("c/0", b"half")
        raise Boom
    # A fresh writer that raised: everything removed, ABSENT, so no row at all.
    with pytest.raises(Boom), Entry(place.url("gone.zarr")).writing() as w:
        w.write_bytes("c/0", b"lost")
        raise Boom
    write_entry(place.url("bad.zarr"), {"x": b"1"})
    place.write(".durable/bad.zarr/commit.json", b'{"format": "durable.commit", ')
    write_entry(place.url("trunc.zarr"), GOOD)
    truncate(place, "trunc.zarr/c/0/0", 100)  # a middle object: status() would not see it
    write_entry(place.url("flipped.zarr"), GOOD)
    flip_byte(place, "flipped.zarr/c/0/1", 7)  # same size: only a deep verify sees it
    return {"good.zarr": "COMPLETE", "obj.bin": "COMPLETE", "plain": "INCOMPLETE",
            "resumed.zarr": "INCOMPLETE", "bad.zarr": "ERROR", "trunc.zarr": "INCOMPLETE",
            "flipped.zarr": "COMPLETE"}


def url_of(place: Place, name: str) -> str:
    return Entry(place.url(name)).url


# scan -----------------------------------------------------------------------------------
def test_scan_mixed_root(place: Place) -> None:
    expected = make_mixed_root(place)
    result = run("scan", place.url(), "--json")
    assert result.exit_code == 0
    doc = as_json(result)
    assert doc["root"] == place.url()
    by_url = {e["url"]: e for e in doc["entries"]}
    assert sorted(by_url) == [e["url"] for e in doc["entries"]]  # sorted by URL
    assert by_url.keys() == {url_of(place, n) for n in expected}  # gone.zarr: ABSENT
    for name, state in expected.items():
        assert by_url[url_of(place, name)]["state"] == state, name
    assert doc["counts"] == {"COMPLETE": 3, "INCOMPLETE": 3, "ERROR": 1}

    good = by_url[url_of(place, "good.zarr")]
    marker = Entry(place.url("good.zarr")).read_marker()
    assert marker is not None
    assert (good["objects"], good["size"]) == (3, sum(map(len, GOOD.values())))
    assert (good["attempt"], good["committed_at"]) == (marker.attempt, marker.committed_at)
    assert by_url[url_of(place, "obj.bin")]["size"] == len(OBJ)
    plain = by_url[url_of(place, "plain")]
    assert plain["reason"] == "data present but no commit marker"
    assert (plain["objects"], plain["attempt"]) == (1, None)
    assert by_url[url_of(place, "resumed.zarr")]["objects"] == 2
    trunc = by_url[url_of(place, "trunc.zarr")]
    assert "c/0/0 is 100 bytes, the marker recorded 3000" in trunc["reason"]
    bad = by_url[url_of(place, "bad.zarr")]
    assert bad["reason"].startswith("MarkerError: ")
    assert ".durable/bad.zarr/commit.json" in bad["reason"]


def test_nothing_is_an_entry_inside_a_records_dir(place: Place) -> None:
    """atomic_write, writing() and mark-complete into ROOT/.durable were accepted, and every
    scan and clean of ROOT then stopped at '.../.durable cannot be an entry'. They are
    refused; records of records put there by another tool are left out of the scan."""
    from durable import atomic_write

    with Entry(place.url("ok")).writing() as w:
        w.write_bytes("a", b"a")
    for make in (lambda: atomic_write(place.url(".durable", "notes.txt")).__enter__(),
                 lambda: Entry(place.url(".durable", "mine")).writing().__enter__()):
        with pytest.raises(ValueError, match=r"lies inside a records directory \(\.durable\)"):
            make()
    for cmd in ("mark-complete", "scan", "clean", "status"):
        extra = {"mark-complete": ["--apply"], "clean": ["--older-than", "1d"]}
        refused = run(cmd, place.url(".durable"), *extra.get(cmd, []))
        assert refused.exit_code == 2, (cmd, refused.output)
        assert ("records directory (.durable)" if cmd != "status" else "cannot be an entry") \
            in refused.output
    # Nor a path inside one (it answered INCOMPLETE, exit 3).
    for cmd in ("status", "verify"):
        assert run(cmd, place.url(".durable", "ok")).exit_code == 2
    place.write(".durable/.durable/notes.txt/commit.json", b"{}")  # another tool's
    rows = scan(place.url())
    assert [(r.url, r.state) for r in rows] == [(url_of(place, "ok"), "COMPLETE")]
    assert run("clean", place.url(), "--older-than", "1d").exit_code == 0
    assert Entry(place.url("ok")).state() is State.COMPLETE


def test_mark_complete_inside_a_committed_entry_is_refused(place: Place) -> None:
    """The survey skips what committed entries below ROOT hold, but not one above it:
    ROOT=ds/sub of a committed ds adopted each file, writing markers into ds's data."""
    with Entry(place.url("ds")).writing() as w:
        for i in range(3):
            w.write_bytes(f"sub/part-{i}.bin", b"x" * 100)
    for extra in ([], ["--apply"]):
        refused = run("mark-complete", place.url("ds", "sub"), *extra)
        assert refused.exit_code == 2
        assert f"inside the committed entry {url_of(place, 'ds')}" in refused.output
    assert Entry(place.url("ds")).verify().ok


def test_scan_table_and_fail_on_incomplete(place: Place) -> None:
    expected = make_mixed_root(place)
    result = run("scan", place.url())
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    for name, state in expected.items():
        row = [ln for ln in lines if f"{url_of(place, name)} " in ln]
        assert len(row) == 1 and state in row[0], (name, row)
    assert "7 entries under" in lines[-1] and "1 ERROR" in lines[-1]
    assert run("scan", place.url(), "--fail-on-incomplete").exit_code == 3
    assert run("scan", place.url(), "--fail-on-incomplete", "--json").exit_code == 3


def test_scan_all_complete_passes_fail_on_incomplete(place: Place) -> None:
    write_entry(place.url("a.zarr"), GOOD)
    write_entry(place.url("b.zarr"), {"x": b"x"})
    result = run("scan", place.url(), "--fail-on-incomplete", "--json")
    assert result.exit_code == 0
    assert [e["state"] for e in as_json(result)["entries"]] == ["COMPLETE", "COMPLETE"]


def test_scan_sees_writers_at_work(place: Place) -> None:
    """An open writer and a half-written atomic file are INCOMPLETE / not entries."""
    live = Entry(place.url("live.zarr"))
    with live.writing() as w, atomic_write(place.url("new.bin")) as f:
        f.write(b"not yet published")
        rows = {r.url: r for r in scan(place.url())}
        # Only the writer's records exist yet; the temp file of atomic_write is no entry.
        assert list(rows) == [live.url]
        assert rows[live.url].state == "INCOMPLETE"
        assert rows[live.url].reason == ("a writer started but has not committed (attempt "
                                         "records: 1)")
        w.write_bytes("c/0", b"some")
        row = scan(place.url())[0]
        assert row.state == "INCOMPLETE"
        assert row.reason.startswith("data present but no commit marker; a writer started")
    assert [r.state for r in scan(place.url())] == ["COMPLETE", "COMPLETE"]


def test_scan_finds_unmarked_data_beside_entries_and_not_inside_them(place: Place) -> None:
    # Partitioned root: 2024/ holds entries, so its other children are entries too.
    write_entry(place.url("2024", "jan.zarr"), {"x": b"x"})
    place.write("2024/feb.zarr/zarr.json", b"{}")
    # An entry whose data holds another entry (with its records): the inner one is listed,
    # the outer entry's other objects are its data, not entries.
    write_entry(place.url("outer", "inner"), {"x": b"inner"})
    place.write("outer/other/file", b"outer's own data")
    Entry(place.url("outer")).mark_complete()
    rows = {r.url: r.state for r in scan(place.url())}
    assert rows == {url_of(place, "2024/jan.zarr"): "COMPLETE",
                    url_of(place, "2024/feb.zarr"): "INCOMPLETE",
                    url_of(place, "outer"): "COMPLETE",
                    url_of(place, "outer/inner"): "COMPLETE"}


def test_scan_of_an_entry_itself(place: Place) -> None:
    write_entry(place.url("good.zarr"), GOOD)
    with atomic_write(place.url("obj.bin")) as f:
        f.write(OBJ)
    for name, size in (("good.zarr", sum(map(len, GOOD.values()))), ("obj.bin", len(OBJ))):
        rows = scan(place.url(name))
        assert [(r.url, r.state, r.size) for r in rows] == [
            (url_of(place, name), "COMPLETE", size)]


def test_scan_missing_object_and_extra_object(place: Place) -> None:
    write_entry(place.url("a.zarr"), GOOD)
    write_entry(place.url("b.zarr"), GOOD)
    place.remove_tree("a.zarr/c")
    place.write("b.zarr/c/9/9", b"added later")
    rows = {r.url: r for r in scan(place.url())}
    a, b = rows[url_of(place, "a.zarr")], rows[url_of(place, "b.zarr")]
    assert a.state == "INCOMPLETE" and "2 of 3 objects" in a.reason and "missing" in a.reason
    assert b.state == "COMPLETE" and b.reason.endswith("; 1 objects not in the manifest")


def test_scan_progress_counts_every_marker(place: Place) -> None:
    expected = make_mixed_root(place)
    calls: list[tuple[int, int]] = []
    scan(place.url(), progress=lambda done, total: calls.append((done, total)))
    markers = sum(state in ("COMPLETE", "ERROR") for state in expected.values()) + 1  # trunc
    assert calls == [(n, markers) for n in range(1, markers + 1)]


def test_scan_of_nothing_is_an_error(place: Place) -> None:
    result = run("scan", place.url("no-such-dir"))
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("durable: error: ") and "no-such-dir" in result.stderr


# status ---------------------------------------------------------------------------------
def test_status_complete(place: Place) -> None:
    entry = write_entry(place.url("good.zarr"), GOOD)
    marker = entry.read_marker()
    assert marker is not None
    result = run("status", place.url("good.zarr"), "--json")
    assert result.exit_code == 0
    doc = as_json(result)
    assert doc["url"] == entry.url and doc["state"] == "COMPLETE"
    m = doc["marker"]
    assert m["attempt"] == marker.attempt and m["committed_at"] == marker.committed_at
    assert m["writer"]["pid"] == os.getpid()
    assert (m["objects"], m["total_size"], m["kind"]) == (3, sum(map(len, GOOD.values())),
                                                          "prefix")

    table = run("status", place.url("good.zarr"))
    assert table.exit_code == 0
    assert f"attempt       {marker.attempt}" in table.stdout.splitlines()
    assert "COMPLETE" in table.stdout and f"pid={os.getpid()}" in table.stdout


@pytest.mark.parametrize(("make", "reason"), [
    ("plain", "data present but no commit marker"),
    ("truncated", "is 10 bytes, the marker recorded 3000"),
])
def test_status_incomplete(place: Place, make: str, reason: str) -> None:
    if make == "plain":
        place.write("e/zarr.json", b"{}")
    else:
        write_entry(place.url("e"), {"a": b"x" * 3000, "b": b"y"})
        truncate(place, "e/a", 10)  # the first object: status checks first and last
    result = run("status", place.url("e"), "--json")
    assert result.exit_code == 3
    doc = as_json(result)
    assert doc["state"] == "INCOMPLETE" and reason in doc["reason"]
    assert (doc["marker"] is None) == (make == "plain")
    table = run("status", place.url("e"))
    assert table.exit_code == 3 and "INCOMPLETE" in table.stdout


def test_status_of_a_killed_writers_entry_says_a_writer_started_as_scan_does(
        place: Place) -> None:
    """`durable status` of what a killed `durable` writer left said only "data present but
    no commit marker", as for data written without durable (which `mark-complete` is
    for), where `scan` of the same root said a writer started on it."""
    writing = Entry(place.url("e.zarr")).writing()
    writer = writing.__enter__()  # never exits: a writer killed here leaves the same
    writer.write_bytes("c/0", b"chunk")
    started = "a writer started but has not committed (attempt records: 1)"
    doc = as_json(run("status", place.url("e.zarr"), "--json"))
    assert doc["state"] == "INCOMPLETE"
    assert doc["reason"] == f"data present but no commit marker; {started}"
    scan = as_json(run("scan", place.url(), "--json"))
    assert [e["reason"] for e in scan["entries"]] == [doc["reason"]]
    with pytest.raises(IncompleteError, match=re.escape(started)):
        Entry(place.url("e.zarr")).require_complete()
    writing.__exit__(None, None, None)
    assert Entry(place.url("e.zarr")).state() is State.COMPLETE


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_status_of_an_entry_with_a_middle_object_damaged_agrees_with_scan(
        place: Place, damage: str) -> None:
    """`Entry.status()` stats the first and last objects of the manifest only: an entry
    whose middle object was truncated or deleted said COMPLETE (exit 0) to `status` and
    INCOMPLETE to `scan` of the same root."""
    write_entry(place.url("e"), {"a": b"x" * 30, "b": b"y" * 3000, "c": b"z"})
    if damage == "truncated":
        truncate(place, "e/b", 10)
    elif place.kind == "file":
        os.remove(os.path.join(place.root, "e", "b"))
    else:
        place.remove_tree("e/b")
    scanned = as_json(run("scan", place.url(), "--json"))
    assert [(r["url"], r["state"]) for r in scanned["entries"]] == [(url_of(place, "e"),
                                                                     "INCOMPLETE")]
    result = run("status", place.url("e"), "--json")
    assert result.exit_code == 3
    doc = as_json(result)
    found = "is 10 bytes, the marker recorded 3000" if damage == "truncated" else (
        "is missing (the marker recorded 3000 bytes)")
    assert doc["state"] == "INCOMPLETE" and doc["marker"] is not None
    assert doc["reason"] == ("marker present but data gone or changed: 1 of 3 objects: "
                             f"{url_of(place, 'e/b')} {found}")
    inside = as_json(run("status", place.url("e", "a"), "--json"))  # an intact object of it
    assert (inside["entry"], inside["state"]) == (url_of(place, "e"), "INCOMPLETE")


def test_status_of_a_folder_of_entries_says_entries_are_inside_it(place: Place) -> None:
    """`durable status ROOT` said only "data present but no commit marker", as for data
    written without durable, which sends an operator to mark-complete a whole root."""
    write_entry(place.url("root", "a"), {"x": b"1"})
    write_entry(place.url("root", "b"), {"x": b"2"})
    result = run("status", place.url("root"), "--json")
    assert result.exit_code == 3
    doc = as_json(result)
    assert doc["state"] == "INCOMPLETE" and doc["reason"] == (
        "data present but no commit marker; entries with records of their own are inside "
        f"it: a root? (`durable scan {place.url('root')}` lists them)")
    place.write("legacy/zarr.json", b"{}")  # no durable records inside: as it was
    plain = as_json(run("status", place.url("legacy"), "--json"))
    assert plain["reason"] == "data present but no commit marker"


@pytest.mark.parametrize("store", ["s3_bucket", "gcs_bucket"])
def test_status_of_a_folder_of_objects_carrying_records_says_so(
        store: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A checkpoint folder uploaded with ``durable::``'s ``put`` (each file an object
    carrying its record in its own metadata, no records folder): `status` said only "data
    present but no commit marker", as for data written without durable, where `verify`
    of the same URL found 2 entries and said OK."""
    bucket: Bucket = request.getfixturevalue(store)
    local = tmp_path / "step-100"
    local.mkdir()
    (local / "model.bin").write_bytes(b"weights")
    (local / "meta.json").write_bytes(b"{}")
    fs = fsspec.filesystem("durable", target_protocol=bucket.protocol,
                           **bucket.storage_options)
    url = bucket.path("ckpt", "step-100")
    fs.put(str(local), url, recursive=True)
    opts = ["--storage-options", json.dumps(bucket.storage_options)]
    doc = as_json(run("status", url, "--json", *opts))
    assert doc["state"] == "INCOMPLETE" and doc["reason"] == (
        "data present but no commit marker; objects carrying records of their own are "
        f"inside it: a root? (`durable scan {url}` lists them)")
    assert run("verify", url, *opts).exit_code == 0
    bucket.filesystem().pipe_file(f"{bucket.name}/plain/part-0", b"written without durable")
    plain = as_json(run("status", bucket.path("plain"), "--json", *opts))
    assert plain["reason"] == "data present but no commit marker"


@pytest.mark.parametrize("member", ["good.zarr/c/0/1", "good.zarr/c", "good.zarr/zarr.json"])
def test_status_of_a_path_inside_an_entry_is_that_entrys(place: Place, member: str) -> None:
    """An object or folder of a committed entry has no records of its own: its status is
    the entry's (not "data present but no commit marker"), and so is its exit code."""
    entry = write_entry(place.url("good.zarr"), GOOD)
    result = run("status", place.url(*member.split("/")), "--json")
    assert result.exit_code == 0
    doc = as_json(result)
    assert (doc["url"], doc["entry"], doc["state"]) == (url_of(place, member), entry.url,
                                                        "COMPLETE")
    assert doc["reason"].startswith(f"part of the entry {entry.url}, which is COMPLETE")
    assert doc["marker"]["objects"] == len(GOOD)
    table = run("status", place.url(*member.split("/")))
    assert table.exit_code == 0 and f"entry         {entry.url}" in table.stdout
    # verify checks entries, not parts of them: it says which entry to verify.
    checked = run("verify", place.url(*member.split("/")), "--json")
    assert checked.exit_code == 3
    assert f"it lies inside the entry {entry.url}: verify that entry" in as_json(
        checked)["reason"]
    # Once the entry has lost data, so has the path inside it.
    place.remove_tree("good.zarr/c")
    lost = run("status", place.url("good.zarr", "zarr.json"), "--json")
    assert lost.exit_code == 3 and "data gone" in as_json(lost)["reason"]


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_status_of_a_damaged_object_inside_an_entry_is_incomplete(
        place: Place, damage: str) -> None:
    """The object asked about is checked, not only the entry's first and last objects: a
    script doing `durable status ENTRY/OBJECT && use it` must not go on with it."""
    entry = write_entry(place.url("good.zarr"), GOOD)
    if damage == "truncated":
        truncate(place, "good.zarr/c/0/0", 100)  # a middle object: status() of the entry
    elif place.kind == "file":                   # checks the first and the last
        os.remove(os.path.join(place.root, "good.zarr", "c", "0", "0"))
    else:
        place.remove_tree("good.zarr/c/0/0")
    result = run("status", place.url("good.zarr", "c", "0", "0"), "--json")
    assert result.exit_code == 3
    doc = as_json(result)
    assert (doc["entry"], doc["state"]) == (entry.url, "INCOMPLETE")
    assert doc["reason"] == (
        f"{url_of(place, 'good.zarr/c/0/0')} is 100 bytes, the entry {entry.url} recorded "
        "3000" if damage == "truncated" else
        f"{url_of(place, 'good.zarr/c/0/0')} is recorded in the entry {entry.url} with 3000 "
        "bytes, and missing")
    # A path neither there nor in the manifest is simply ABSENT.
    assert run("status", place.url("good.zarr", "c", "9")).exit_code == 4


def test_status_of_an_object_added_inside_an_entry_is_not_the_entrys(place: Place) -> None:
    entry = write_entry(place.url("good.zarr"), GOOD)
    place.write("good.zarr/c/9/9", b"added later")
    result = run("status", place.url("good.zarr", "c", "9", "9"), "--json")
    assert result.exit_code == 3
    doc = as_json(result)
    assert (doc["entry"], doc["state"]) == (entry.url, "INCOMPLETE")
    assert doc["reason"] == (f"inside the entry {entry.url} but not in its manifest: not "
                             "part of what it committed")


def test_status_absent(place: Place) -> None:
    result = run("status", place.url("nothing"), "--json")
    assert result.exit_code == 4
    assert as_json(result) == {"url": url_of(place, "nothing"),
                               "entry": url_of(place, "nothing"), "state": "ABSENT",
                               "reason": "no marker and no data", "marker": None}
    assert run("status", place.url("nothing")).exit_code == 4


def test_corrupt_marker_is_one_line_error_and_debug_shows_it(place: Place) -> None:
    write_entry(place.url("e"), {"x": b"x"})
    place.write(".durable/e/commit.json", b"\x00garbage")
    for command in ("status", "verify"):
        result = run(command, place.url("e"), "--json")
        assert result.exit_code == 1
        assert result.stdout == ""
        assert result.stderr.startswith("durable: error: ")
        assert result.stderr.count("\n") == 1 and "not valid JSON" in result.stderr
        assert "Traceback" not in result.output
    debug = CliRunner().invoke(cli, ["--debug", "status", place.url("e")])
    assert isinstance(debug.exception, MarkerError)


@pytest.mark.parametrize("empty", [False, True], ids=["holding a file", "empty"])
def test_a_directory_at_the_markers_path_is_an_error_row_never_cleaned(
        tmp_path: os.PathLike[str], empty: bool) -> None:
    """An empty one too, which no listing shows: it read as "no commit marker", and
    mark-complete planned to adopt the data that `status` calls an error."""
    place = Place("file", os.path.realpath(tmp_path))
    entry = write_entry(place.url("e"), GOOD)
    marker = os.path.join(place.root, ".durable", "e", "commit.json")
    os.remove(marker)
    if empty:
        shutil.rmtree(os.path.join(place.root, ".durable", "e"))
        os.makedirs(marker)
    else:
        place.write(".durable/e/commit.json/x", b"what a tool left")
    rows = {r.url: r for r in scan(place.url())}
    row = rows[entry.url]
    assert row.state == "ERROR" and "commit.json is a directory, not a file" in row.reason
    cleaned = as_json(run("clean", place.url(), "--older-than", "0s", "--apply", "--json"))
    assert cleaned["items"] == []
    planned = as_json(run("mark-complete", place.url(), "--json"))
    assert planned["entries"] == []  # nothing adopted over it
    if empty:
        assert [s["url"] for s in planned["skipped"]] == [entry.url]
    assert all(place.read(f"e/{k}") == v for k, v in GOOD.items())


def _committed_behind_a_link(tmp_path: os.PathLike[str], name: str,
                             behind: str) -> tuple[str, Place, Entry]:
    """(base, place ``base/root``, entry ``root/e`` committed), with ``root/name`` moved to
    ``base/behind`` and a symlink to it left in its place."""
    base = os.path.realpath(tmp_path)
    place = Place("file", os.path.join(base, "root"))
    os.makedirs(place.root)
    entry = write_entry(place.url("e"), GOOD)
    os.rename(os.path.join(place.root, name), os.path.join(base, behind))
    os.symlink(os.path.join(base, behind), os.path.join(place.root, name))
    return base, place, entry


def test_records_behind_a_symlink_are_one_error_in_status_and_scan(
        tmp_path: os.PathLike[str]) -> None:
    """A symlinked ``.durable``: `status` read the marker through it (COMPLETE, exit 0),
    `scan`, whose listing never follows a link, saw none ("data present but no commit
    marker", which `clean` removes). Both now report the link, and nothing is cleaned or
    cleared through it; a symlinked folder of the entry's data is missing for
    `Entry.state()` too, as for every listing (it was stat-ed through the link)."""
    base, place, entry = _committed_behind_a_link(tmp_path, ".durable", "elsewhere")
    before = place.files()
    behind = Place("file", os.path.join(base, "elsewhere"))
    records = behind.files()
    assert list(records) == ["e/commit.json"]

    status = run("status", place.url("e"), "--json")
    assert status.exit_code == 1 and "reached through a symlink" in status.stderr
    (row,) = scan(place.url())
    assert row.state == "ERROR" and row.reason == "MarkerError: " + status.stderr.removeprefix(
        "durable: error: ").strip()
    with pytest.raises(MarkerError, match="symlink"):
        entry.state()
    with pytest.raises(MarkerError, match="symlink"), entry.writing(overwrite=True):
        pass  # pragma: no cover
    cleaned = as_json(run("clean", place.url(), "--older-than", "0s", "--apply", "--json"))
    assert cleaned["items"] == []
    assert place.files() == before and behind.files() == records

    other = Place("file", os.path.join(base, "other"))
    os.makedirs(other.root)
    linked = write_entry(other.url("e"), GOOD)
    os.rename(os.path.join(other.root, "e", "c"), os.path.join(base, "c"))
    os.symlink(os.path.join(base, "c"), os.path.join(other.root, "e", "c"))
    (row,) = scan(other.url())
    assert row.state == "INCOMPLETE" == linked.state().value
    assert run("status", other.url("e")).exit_code == 3  # INCOMPLETE


def test_an_entry_that_is_a_symlink_is_one_error_in_status_and_scan(
        tmp_path: os.PathLike[str]) -> None:
    """An entry directory that is itself a symlink: `status` judged the data behind it
    (COMPLETE, exit 0) where `scan`, whose listing never follows a link, found every
    object of the manifest missing (INCOMPLETE, which `clean` removes); unmarked, status
    said "data present". Both now report an entry that is a link, naming it; status of an
    unmarked link (a `latest -> ckpt-5` pointer) is the same error, and scan passes over
    such a link (no data, no entry: not an ERROR row in every scan of a checkpoint
    folder). Nothing is cleaned, verified or written through either."""
    base, place, entry = _committed_behind_a_link(tmp_path, "e", "behind")
    os.symlink(os.path.join(base, "behind"), os.path.join(place.root, "u"))  # unmarked
    before, behind = place.files(), Place("file", os.path.join(base, "behind")).files()
    assert sorted(behind) == sorted(GOOD)

    rows = {r.url: r for r in scan(place.url())}
    assert sorted(rows) == [entry.url]
    for name in ("e", "u"):
        status = run("status", place.url(name), "--json")
        said = status.stderr.removeprefix("durable: error: ").strip()
        assert status.exit_code == 1 and f"{place.canonical(name)} is a symlink" in said
        if name == "e":
            row = rows[place.canonical(name)]
            assert row.state == "ERROR" and row.reason == f"MarkerError: {said}"
        linked = Entry(place.url(name))
        for call in (linked.state, linked.verify, linked.mark_complete):
            with pytest.raises(MarkerError, match="is a symlink"):
                call()
        with pytest.raises(MarkerError, match="is a symlink"), \
                linked.writing(overwrite=True):
            pass  # pragma: no cover
    cleaned = as_json(run("clean", place.url(), "--older-than", "0s", "--apply", "--json"))
    assert cleaned["items"] == []
    assert place.files() == before
    assert Place("file", os.path.join(base, "behind")).files() == behind


def test_a_client_librarys_own_traceback_is_shown_only_with_debug(
        place: Place, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """gcsfs logs an error with its traceback ("_request out of retries") before raising
    it: 50 lines on stderr before durable's one-line error. Kept only with --debug."""
    import logging

    def unreachable(self: Entry) -> Any:
        try:
            raise ConnectionError("Cannot connect to host 127.0.0.1:9")
        except ConnectionError:
            logging.getLogger("gcsfs").exception("_request out of retries on exception")
            raise

    monkeypatch.setattr(Entry, "status", unreachable)
    result = run("status", place.url("e"))
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "Cannot connect" in result.stderr and not caplog.records
    CliRunner().invoke(cli, ["--debug", "status", place.url("e")])
    assert [r.getMessage() for r in caplog.records] == ["_request out of retries on exception"]


def test_usage_errors_exit_2(place: Place) -> None:
    assert run("status").exit_code == 2
    assert run("-o", "novalue", "status", place.url("e")).exit_code == 2
    assert run("status", "--storage-options", "[1]", place.url("e")).exit_code == 2
    bad_env = run("status", place.url("e"), env={ENV_OPTIONS: "{not json"})
    assert bad_env.exit_code == 2 and ENV_OPTIONS in bad_env.stderr
    root = run("status", "/")  # no parent to hold a marker
    assert root.exit_code == 2 and "cannot be an entry" in root.stderr


def test_storage_options_merge_in_documented_order() -> None:
    merged = merge_storage_options('{"a": 1, "b": 1, "c": 1}', [{"b": 2, "c": 2}, {"c": 3}],
                                   [("c", 4), ("d", True)])
    assert merged == {"a": 1, "b": 2, "c": 4, "d": True}
    # -o values are JSON when they parse, strings otherwise; on the group or the command.
    assert run("-o", "anon=true", "status", "--storage-options", "{}",
               "-o", "endpoint_url=http://127.0.0.1:9", "memory://x/y").exit_code == 4


# verify ---------------------------------------------------------------------------------
def test_verify_ok_shallow_and_deep(place: Place) -> None:
    write_entry(place.url("good.zarr"), GOOD)
    for deep in ([], ["--deep"]):
        result = run("verify", place.url("good.zarr"), "--json", *deep)
        assert result.exit_code == 0
        doc = as_json(result)
        assert (doc["ok"], doc["state"], doc["objects"], doc["problems"]) == (
            True, None, 3, [])
        assert doc["bytes_checked"] == (sum(map(len, GOOD.values())) if deep else 0)
        table = run("verify", place.url("good.zarr"), *deep)
        assert table.exit_code == 0 and "all 3 objects match" in table.stdout


def test_verify_flipped_byte_needs_deep(place: Place) -> None:
    entry = write_entry(place.url("e"), GOOD)
    flip_byte(place, "e/c/0/1", 7)
    assert run("verify", place.url("e"), "--json").exit_code == 0  # same size
    result = run("verify", place.url("e"), "--deep", "--json")
    assert result.exit_code == 5
    problems = as_json(result)["problems"]
    assert [(p["key"], p["issue"], p["url"]) for p in problems] == [
        ("c/0/1", "crc32c", f"{entry.url}/c/0/1")]
    assert problems[0]["expected"] != problems[0]["found"]
    table = run("verify", place.url("e"), "--deep")
    assert table.exit_code == 5
    assert [ln for ln in table.stdout.splitlines() if "c/0/1" in ln and "crc32c" in ln]


def test_verify_lists_every_mismatch(place: Place) -> None:
    write_entry(place.url("e"), GOOD)
    truncate(place, "e/c/0/0", 100)
    if place.kind == "file":
        os.remove(os.path.join(place.root, "e/zarr.json"))
    else:
        place.remove_tree("e/zarr.json")
    place.write("e/stray", b"12345")
    result = run("verify", place.url("e"), "--json")
    assert result.exit_code == 5
    doc = as_json(result)
    assert not doc["ok"]
    assert [(p["key"], p["issue"], p["expected"], p["found"]) for p in doc["problems"]] == [
        ("c/0/0", "size", 3000, 100), ("zarr.json", "missing", 18, None),
        ("stray", "unexpected", None, 5)]
    table = run("verify", place.url("e")).stdout
    assert "3 problems" in table and "FAILED" in table
    for key in ("c/0/0", "zarr.json", "stray"):
        assert any(ln.split()[1:2] == [key] for ln in table.splitlines()), key


@pytest.mark.parametrize(("state", "code"), [("ABSENT", 4), ("INCOMPLETE", 3)])
def test_verify_without_marker(place: Place, state: str, code: int) -> None:
    if state == "INCOMPLETE":
        place.write("e/zarr.json", b"{}")
    result = run("verify", place.url("e"), "--json")
    assert result.exit_code == code
    doc = as_json(result)
    assert (doc["ok"], doc["state"], doc["problems"]) == (False, state, [])
    assert "nothing to verify" in doc["reason"]
    table = run("verify", place.url("e"))
    assert table.exit_code == code and state in table.stdout


# verify ROOT ----------------------------------------------------------------------------
def test_verify_root_lists_every_mismatch_of_every_entry(place: Place) -> None:
    make_mixed_root(place)
    result = run("verify", place.url(), "--deep", "--json")
    assert result.exit_code == 5
    doc = as_json(result)
    assert (doc["root"], doc["ok"], doc["entries"], doc["failed"]) == (
        place.canonical(), False, 5, 3)
    failed = {r["url"]: [(p["key"], p["issue"]) for p in r["problems"]]
              for r in doc["results"] if not r["ok"]}
    assert failed == {url_of(place, "trunc.zarr"): [("c/0/0", "size")],
                      url_of(place, "flipped.zarr"): [("c/0/1", "crc32c")],
                      url_of(place, "bad.zarr"): [("", "unreadable")]}
    problems = {r["url"]: r["problems"][0] for r in doc["results"] if not r["ok"]}
    trunc, flipped = problems[url_of(place, "trunc.zarr")], problems[url_of(place, "flipped.zarr")]
    assert (trunc["expected"], trunc["found"]) == (3000, 100)
    assert flipped["expected"] != flipped["found"]
    bad = problems[url_of(place, "bad.zarr")]
    assert bad["url"].endswith(".durable/bad.zarr/commit.json")
    assert bad["found"].startswith("MarkerError: ")
    assert {r["url"] for r in doc["results"] if r["ok"]} == {
        url_of(place, "good.zarr"), url_of(place, "obj.bin")}
    assert {n["url"] for n in doc["not_verified"]} == {
        url_of(place, "plain"), url_of(place, "resumed.zarr")}
    shallow = as_json(run("verify", place.url(), "--json"))
    assert {r["url"] for r in shallow["results"] if not r["ok"]} == {
        url_of(place, "trunc.zarr"), url_of(place, "bad.zarr")}  # a flipped byte needs --deep
    table = run("verify", place.url(), "--deep")
    assert table.exit_code == 5
    lines = table.stdout.splitlines()
    assert [ln for ln in lines if "trunc.zarr" in ln and "c/0/0" in ln and "3000" in ln]
    assert "5 entries under" in lines[-1] and "3 with mismatches" in lines[-1]


def test_verify_of_an_entry_with_a_marker_is_not_a_root(place: Place) -> None:
    write_entry(place.url("outer"), GOOD)
    # Records below outer, too: an entry put in it since its commit, around durable (which
    # refuses to write one there).
    write_entry(place.url("inner"), {"x": b"x"})
    place.write("outer/inner/x", b"x")
    place.write("outer/.durable/inner/commit.json", place.read(".durable/inner/commit.json")
                or b"")
    doc = as_json(run("verify", place.url("outer"), "--json"))
    assert doc["url"] == url_of(place, "outer") and "root" not in doc
    assert [p["issue"] for p in doc["problems"]] == ["unexpected"] * 2  # inner's, in outer


# scan: ages and leases ------------------------------------------------------------------
def test_scan_shows_ages_and_lease_holders(place: Place) -> None:
    write_entry(place.url("good.zarr"), GOOD)
    place.write("plain/part-0", b"written without durable")
    place.write("leased/part-0", b"a writer at work")
    place.write(".durable/leased/lease.json", json.dumps(
        {"holder": "h", "host": "box", "pid": 7, "acquired_at": "2026-01-01T00:00:00Z",
         "heartbeat": 10, "stale_after": 60}).encode())
    rows = {e["url"]: e for e in as_json(run("scan", place.url(), "--json"))["entries"]}
    good, plain, leased = (rows[url_of(place, n)] for n in ("good.zarr", "plain", "leased"))
    assert (good["age_source"], good["age_clock"], good["lease"]) == (
        "committed_at", "writer", None)
    assert (plain["age_source"], plain["age_clock"]) == ("object mtime", "store")
    assert all(0 <= r["age"] < 600 for r in (good, plain, leased))
    lease = leased["lease"]
    assert (lease["host"], lease["pid"], lease["stale_after"]) == ("box", 7, 60)
    assert 0 <= lease["file_age"] < 600
    table = run("scan", place.url()).stdout.splitlines()
    assert "age" in table[1] and "lease" in table[1]
    assert [ln for ln in table if url_of(place, "leased") in ln and "box:7" in ln]


def test_scan_names_a_lease_it_cannot_read_as_unreadable(place: Place) -> None:
    """Garbage in lease.json: the table said "None:None", a holder called None."""
    place.write("leased/part-0", b"a writer at work")
    place.write(".durable/leased/lease.json", b"\x00\xffgarbage")
    row, = as_json(run("scan", place.url(), "--json"))["entries"]
    assert "lease.json" in row["lease"]["error"] and row["lease"]["host"] is None
    line, = [ln for ln in run("scan", place.url()).stdout.splitlines()
             if url_of(place, "leased") in ln]
    assert "unreadable" in line and "None" not in line


# mark-complete --------------------------------------------------------------------------
def test_mark_complete_never_adopts_a_folder_holding_symlinks(tmp_path: Path) -> None:
    """Legacy data with a symlinked chunk and a symlinked folder: listings skip links, so
    the folder was adopted without them ("1 objects" for three) and read COMPLETE."""
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "f").write_bytes(b"shared chunk")
    (outside / "d" / "g").write_bytes(b"x")
    root = tmp_path / "root"
    (root / "legacy" / "c").mkdir(parents=True)
    (root / "legacy" / "c" / "0").write_bytes(b"data")
    (root / "legacy" / "c" / "1").symlink_to(outside / "f")
    (root / "legacy" / "more").symlink_to(outside / "d")
    (root / "legacy" / "only").mkdir()  # a folder holding nothing but a link
    (root / "legacy" / "only" / "link").symlink_to(outside / "f")
    (root / "plain").mkdir()
    (root / "plain" / "x").write_bytes(b"ok")
    doc = as_json(run("mark-complete", str(root), "--apply", "--json"))
    assert [(e["url"], e["status"]) for e in doc["entries"]] == [
        (f"file://{root}/plain", "adopted")]
    (skip,) = doc["skipped"]
    assert skip["url"] == f"file://{root}/legacy"
    assert "holds symlinks (c/1, more, only/link)" in skip["reason"]
    assert not (root / ".durable" / "legacy").exists()
    assert (outside / "f").read_bytes() == b"shared chunk"


def test_mark_complete_dry_run_then_apply_then_nothing(place: Place) -> None:
    make_mixed_root(place)
    before = place.files()
    adoptable = {url_of(place, "plain"), url_of(place, "resumed.zarr")}
    dry = run("mark-complete", place.url(), "--json")
    assert dry.exit_code == 0
    doc = as_json(dry)
    assert "TRUSTS" in doc["trust"] and not doc["apply"]
    assert {e["url"]: e["status"] for e in doc["entries"]} == dict.fromkeys(adoptable,
                                                                            "planned")
    assert doc["marked"] == 5 and doc["skipped"] == []
    table = run("mark-complete", place.url()).stdout.splitlines()
    assert table[0].startswith("mark-complete TRUSTS what it adopts")
    assert table[-1].startswith("dry run: 2 entries would be marked COMPLETE")
    assert place.files() == before

    doc = as_json(run("mark-complete", place.url(), "--apply", "--json"))
    assert {e["url"]: e["status"] for e in doc["entries"]} == dict.fromkeys(adoptable,
                                                                            "adopted")
    states = {r.url: r.state for r in scan(place.url())}
    assert all(states[u] == "COMPLETE" for u in adoptable)
    assert states[url_of(place, "trunc.zarr")] == "INCOMPLETE"  # a marker: never re-adopted
    after = place.files()
    assert {k: after[k] for k in before} == before
    again = run("mark-complete", place.url(), "--apply", "--json")
    assert again.exit_code == 0 and as_json(again)["entries"] == []
    assert place.files() == after


def test_mark_complete_lists_what_it_could_not_adopt_and_exits_6(place: Place) -> None:
    place.write("fine/part-0", b"data")
    place.write("odd/a\\b", b"a key a manifest cannot hold")
    result = run("mark-complete", place.url(), "--apply", "--json")
    assert result.exit_code == 6
    status = {e["url"]: (e["status"], e["reason"]) for e in as_json(result)["entries"]}
    assert status[url_of(place, "fine")][0] == "adopted"
    assert status[url_of(place, "odd")][0] == "failed"
    assert "'a\\\\b' is not a name an entry can hold" in status[url_of(place, "odd")][1]


# clean ----------------------------------------------------------------------------------
def test_clean_removes_a_killed_writer_and_nothing_else(tmp_path: os.PathLike[str]) -> None:
    from _writer_child import Child

    place = Place("file", os.path.realpath(tmp_path))
    write_entry(place.url("good.zarr"), GOOD)
    place.write("plain/part-0", b"written without durable")
    child = Child("entry", place.url("dead.zarr"), "4")
    child.run_until("partial")  # objects, an attempt record, a half-written temp file
    child.kill()
    before = place.files()
    assert any(".durable-tmp-" in k for k in before if k.startswith("dead.zarr/"))

    young = as_json(run("clean", place.url(), "--older-than", "1h", "--json"))
    assert young["items"] == []
    assert [k["url"] for k in young["kept"]] == [url_of(place, "dead.zarr")]
    dry = as_json(run("clean", place.url(), "--older-than", "0s", "--json"))
    assert [(i["kind"], i["status"], i["url"]) for i in dry["items"]] == [
        ("entry", "planned", url_of(place, "dead.zarr"))]
    assert dry["waited"] == 0 and place.files() == before
    table = run("clean", place.url(), "--older-than", "0s").stdout.splitlines()
    assert table[-1].startswith("dry run: 1 would be removed")

    done = run("clean", place.url(), "--older-than", "0s", "--apply", "--json")
    assert done.exit_code == 0
    assert [i["status"] for i in as_json(done)["items"]] == ["removed"]
    assert place.files() == {k: v for k, v in before.items()
                             if not k.startswith(("dead.zarr/", ".durable/dead.zarr/"))}
    assert Entry(place.url("dead.zarr")).state() is State.ABSENT


def test_a_killed_atomic_writes_temp_file_is_for_clean_not_an_entry(place: Place) -> None:
    """It made its folder an entry: scan counted it as data and mark-complete adopted the
    folder, empty, as COMPLETE (and clean then kept the temp file inside it for ever)."""
    place.write("ckpt/.model.pt.durable-tmp-0123456789ab", b"x" * 1000)
    place.write("legacy/part-0", b"written without durable")
    place.write("legacy/.part-1.durable-tmp-0123456789ab", b"half")
    rows = {r.url: r for r in scan(place.url())}
    assert url_of(place, "ckpt") not in rows
    # Not an entry, yet shown: a killed writer's temp files can hold gigabytes.
    assert as_json(run("scan", place.url(), "--json"))["temp_files"] == {
        "count": 2, "bytes": 1000 + len(b"half")}
    assert "2 temp files (1004 B (1.0 kB)) left by writes that never finished" in \
        " ".join(run("scan", place.url()).stdout.split())
    assert (rows[url_of(place, "legacy")].objects, rows[url_of(place, "legacy")].size) == (
        1, len(b"written without durable"))
    adopted = as_json(run("mark-complete", place.url(), "--apply", "--json"))
    assert [e["url"] for e in adopted["entries"]] == [url_of(place, "legacy")]
    assert Entry(place.url("ckpt")).state() is not State.COMPLETE
    cleaned = as_json(run("clean", place.url(), "--older-than", "0s", "--apply", "--json"))
    assert {(i["kind"], i["status"]) for i in cleaned["items"]} == {("temp", "removed")}
    # The one inside the adopted entry too: no manifest lists a temp file. Its data stays.
    assert not any(".durable-tmp-" in k for k in place.files())
    legacy = Entry(place.url("legacy"))
    assert legacy.state() is State.COMPLETE and legacy.verify(deep=True).ok


@pytest.mark.parametrize("age", ["3", "2x", "-1h", "", "h"])
def test_clean_needs_an_age_with_a_unit(place: Place, age: str) -> None:
    result = run("clean", place.url(), "--older-than", age)
    assert result.exit_code == 2 and "--older-than" in result.stderr
    assert run("clean", place.url()).exit_code == 2


def test_ages() -> None:
    assert [parse_age(a) for a in ("90s", "30m", "2h", "3d", "1w", "0", "1.5h", " 2 h ")] == [
        90, 1800, 7200, 259200, 604800, 0, 5400, 7200]


def test_help_of_the_operating_commands() -> None:
    assert "6  mark-complete/clean --apply" in run("--help").stdout
    mark = " ".join(run("mark-complete", "--help").stdout.split())
    for words in ("TRUSTS what it adopts", "Run it only while nothing writes", "no --deep",
                  "Push plan", "--apply"):
        assert words in mark, words
    clean = " ".join(run("clean", "--help").stdout.split())
    for words in ("never touches an entry with a commit marker", "--older-than AGE",
                  "--lease-wait SECONDS", "--all-uploads", "multipart uploads"):
        assert words in clean, words


# the program itself ---------------------------------------------------------------------
def test_help_documents_exit_codes() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for line in ("0  COMPLETE", "1  error", "2  usage error", "3  INCOMPLETE", "4  ABSENT",
                 "5  verify found mismatches"):
        assert line in result.stdout
    for command in ("status", "verify", "scan"):
        assert command in result.stdout


def test_python_m_durable_subprocess(tmp_path: os.PathLike[str]) -> None:
    place = Place("file", os.path.realpath(tmp_path))
    expected = make_mixed_root(place)
    def durable(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "durable", *args], capture_output=True,
                              text=True, timeout=60, check=False)

    proc = durable("scan", place.root, "--json", "--fail-on-incomplete")
    assert proc.returncode == 3, proc.stderr
    states = {e["url"]: e["state"] for e in json.loads(proc.stdout)["entries"]}
    assert states == {url_of(place, n): s for n, s in expected.items()}
    proc = durable("status", place.url("bad.zarr"))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("durable: error: ") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_a_reader_that_goes_away_keeps_the_exit_code(tmp_path: Path, as_json: bool) -> None:
    """`durable scan ROOT --fail-on-incomplete | head`: the table's reader leaves early. The
    exit code stays the command's (3 here), as with --json; rich's default turned it into
    1, an error, with nothing said: under `set -o pipefail` an OK run read as a failure."""
    objects = {"zarr.json": b"{}", "c/0": b"x"}
    first = write_entry(str(tmp_path / "e000.zarr"), objects)
    for i in range(1, 400):  # a table far larger than a pipe's buffer
        shutil.copytree(first.path, tmp_path / f"e{i:03d}.zarr")
        shutil.copytree(tmp_path / ".durable" / "e000.zarr",
                        tmp_path / ".durable" / f"e{i:03d}.zarr")
    (tmp_path / "plain" / "part-0").parent.mkdir()
    (tmp_path / "plain" / "part-0").write_bytes(b"written without durable")
    args = ["scan", str(tmp_path), "--fail-on-incomplete", *(["--json"] if as_json else [])]
    with subprocess.Popen([sys.executable, "-m", "durable", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.read(100)  # then the reader goes away, as head does
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 3, err
    assert "Traceback" not in err


@pytest.mark.s3
def test_ctrl_c_exits_130_saying_so(s3_bucket: Bucket) -> None:
    """An operator's Ctrl-C in the middle of a command (here `scan`, its listing stalled at
    the store) is exit 130, as shells report a command stopped by SIGINT, with one line
    on stderr: click's "Aborted!" and 1 read as an error of the store to a script."""
    with Entry(s3_bucket.path("root", "a.zarr"),
               storage_options=s3_bucket.storage_options).writing() as w:
        w.write_bytes("zarr.json", b"{}")
    with FaultProxy(upstream=s3_bucket.storage_options["endpoint_url"]) as proxy:
        proxy.add(faults.delay(60, method="GET", query="list-type"))
        options = json.dumps({**s3_bucket.storage_options, "endpoint_url": proxy.url})
        with subprocess.Popen([sys.executable, "-m", "durable", "scan",
                               s3_bucket.path("root"), "--storage-options", options],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            deadline = time.monotonic() + 60
            while not proxy.requests and time.monotonic() < deadline:
                time.sleep(0.05)  # until the listing is held at the store
            assert proxy.requests, "the scan never reached the store"
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.decode().strip().splitlines()[-1] == "durable: interrupted"
    assert b"Traceback" not in err and b"Aborted" not in err


def test_marker_read_by_scan_matches_status(place: Place) -> None:
    """scan and status agree on every marked entry whose data is whole."""
    make_mixed_root(place)
    for row in scan(place.url()):
        if row.state == "COMPLETE":
            st = Entry(row.url).status()
            assert st.state is State.COMPLETE and st.reason == row.reason.split(";")[0]


# S3 -------------------------------------------------------------------------------------
@pytest.mark.s3
def test_scan_on_s3_is_one_listing_and_one_get_per_marker(s3_bucket: Bucket) -> None:
    """Against moto, through the fault proxy that logs every request the scan makes."""
    so = s3_bucket.storage_options
    fs = s3_bucket.filesystem()
    root = s3_bucket.path("root")
    with Entry(f"{root}/good.zarr", storage_options=so).writing() as w:
        for key, data in GOOD.items():
            w.fs.pipe_file(f"{w.path}/{key}", data)
    with atomic_write(f"{root}/obj.bin", storage_options=so) as f:
        f.write(OBJ)
    fs.pipe_file(f"{s3_bucket.name}/root/plain/part-0", b"written without durable")
    bad = Entry(f"{root}/bad.zarr", storage_options=so)
    with bad.writing() as w:
        w.write_bytes("x", b"1")
    fs.pipe_file(f"{s3_bucket.name}/root/.durable/bad.zarr/commit.json", b"[")
    short = Entry(f"{root}/short.zarr", storage_options=so)
    with short.writing() as w:
        for key, data in GOOD.items():
            w.write_bytes(key, data)
    fs.pipe_file(f"{s3_bucket.name}/root/short.zarr/c/0/0", b"a" * 10)  # replaced, shorter
    expected = {"good.zarr": "COMPLETE", "obj.bin": "COMPLETE", "plain": "INCOMPLETE",
                "bad.zarr": "ERROR", "short.zarr": "INCOMPLETE"}

    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**so, "endpoint_url": proxy.url, "skip_instance_cache": True}
        result = run("scan", root, "--json", env={ENV_OPTIONS: json.dumps(options)})
        requests = proxy.requests
    assert result.exit_code == 0, result.stderr
    states = {e["url"]: e["state"] for e in as_json(result)["entries"]}
    assert states == {f"{root}/{name}": state for name, state in expected.items()}
    calls = sorted((r.method, r.key, "list-type" in r.query) for r in requests)
    markers = [f"root/.durable/{n}/commit.json" for n in ("bad.zarr", "good.zarr",
                                                           "short.zarr")]
    # One listing of the root, one of the root's own records dir (is the root an entry?),
    # one GET per marker, one HEAD per entry that is one object without a marker (its
    # record is in its own metadata) and beside a marker that cannot be read (would an
    # object's own record supersede it?), and per object of an unmarked folder (one
    # written by atomic_write is an entry of its own); nothing per object inside an entry.
    heads = [("HEAD", "root/obj.bin", False), ("HEAD", "root/bad.zarr", False),
             ("HEAD", "root/plain/part-0", False)]
    assert calls == sorted([("GET", "", True), ("GET", "", True), *heads]
                           + [("GET", m, False) for m in markers]), calls


def test_control_characters_from_the_store_never_reach_the_terminal(
        tmp_path: os.PathLike[str]) -> None:
    """Object names and marker fields come from the store: an escape sequence in a file
    name or in a (hostile) marker's committed_at or writer was printed raw by status,
    verify, scan and clean, and could clear or rewrite the screen of whoever ran them.
    They are shown escaped; JSON output escapes them by itself."""
    root = os.path.realpath(tmp_path)
    esc, rlo = "\x1b[2J\x1b[31m", "\u202e"
    entry = write_entry(os.path.join(root, "e"), GOOD)
    marker = os.path.join(root, ".durable", "e", "commit.json")
    with open(marker, "rb") as f:
        doc = json.load(f)
    doc["committed_at"] = f"{esc}2026{rlo}"
    doc["writer"] = {"host": f"{esc}node", "pid": 1}
    os.remove(marker)
    with open(marker, "w") as f:
        json.dump(doc, f)
    with open(os.path.join(root, "e", f"stray{esc}"), "wb") as f:
        f.write(b"x")
    os.makedirs(os.path.join(root, f"left{esc}over"))
    with open(os.path.join(root, f"left{esc}over", "part"), "wb") as f:
        f.write(b"y")
    assert entry.state() is State.COMPLETE
    results = [run("status", entry.path), run("verify", entry.path), run("scan", root),
               run("verify", root), run("clean", root, "--older-than", "0"),
               run("mark-complete", root), run("status", os.path.join(root, f"no{esc}"))]
    assert [r.exit_code for r in results] == [0, 5, 0, 5, 0, 0, 4]
    for result in results:
        shown = result.stdout + result.stderr
        assert "\x1b" not in shown and rlo not in shown, shown
    assert "\\x1b[2J" in results[0].stdout and "\\u202e" in results[0].stdout
    assert "stray\\x1b[2J" in results[1].stdout


def test_options_nested_too_deeply_are_a_usage_error(tmp_path: os.PathLike[str]) -> None:
    """--storage-options, -o and DURABLE_STORAGE_OPTIONS nested deeper than json parses
    were a bare RecursionError traceback (raised while click parses the options)."""
    deep = "[" * 100_000 + "]" * 100_000
    url = os.path.join(os.path.realpath(tmp_path), "e")
    for args, env in ((["--storage-options", deep, "status", url], None),
                      (["status", url], {ENV_OPTIONS: deep})):
        result = CliRunner().invoke(cli, args, env=env)
        assert result.exit_code == 2, result.output
        assert "not valid JSON" in result.output
    # -o takes a value that is not JSON as a string: an unknown option of the filesystem
    result = CliRunner().invoke(cli, ["-o", f"a={deep}", "status", url])
    assert not isinstance(result.exception, RecursionError)


def test_summaries_count_one_entry_in_the_singular(tmp_path: Path) -> None:
    # "1 entries under ...", "1 entries already have a marker": seen by every user whose
    # root holds one entry.
    entry = Entry(str(tmp_path / "a"))
    with entry.writing() as w:
        w.fs.pipe_file(f"{w.path}/x.bin", b"x")
    for args, expected in ((["scan"], "1 entry under"), (["verify"], "1 entry under"),
                           (["mark-complete"], "1 entry already has a marker")):
        result = CliRunner().invoke(cli, [*args, str(tmp_path)])
        assert expected in result.output, result.output
        assert "1 entries" not in result.output
