"""The `durable` CLI and `scan`: states, exit codes, table and JSON output.

Entries are made through the real library (atomic_write, Entry.writing()), unmarked data
with plain writes, and corruption the way it happens: a file rewritten shorter, a byte
flipped, a marker overwritten with garbage. The CLI runs in-process (click's CliRunner)
and, once, as a real `python -m durable` subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner, Result

from conftest import Place
from durable import Entry, MarkerError, State, atomic_write
from durable._scan import scan
from durable.cli import ENV_OPTIONS, cli, merge_storage_options
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


def test_status_absent(place: Place) -> None:
    result = run("status", place.url("nothing"), "--json")
    assert result.exit_code == 4
    assert as_json(result) == {"url": url_of(place, "nothing"), "state": "ABSENT",
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
                                                           "obj.bin", "short.zarr")]
    # One listing of the root, one of the root's own records dir (is the root an entry?),
    # one GET per marker; nothing per object.
    assert calls == sorted([("GET", "", True), ("GET", "", True)]
                           + [("GET", m, False) for m in markers]), calls
