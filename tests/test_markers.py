"""A marker that cannot be trusted is a clear MarkerError, and is never followed.

A manifest names the objects a reader opens, stats and (on cleanup) deletes, so a corrupt
or hostile one must stop at decode: nothing outside the entry is read, created or deleted.
Every hostile marker below is a valid marker with one thing changed; the valid one is
accepted (test_valid_markers_are_accepted), so each refusal is for that one change.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import crc32c
import pytest

from conftest import Place
from durable import (
    DurableError,
    Entry,
    IntegrityError,
    MarkerError,
    State,
    read_verified,
)
from durable._protocol import MAX_MARKER_BYTES
from durable._scan import scan

MARKER = ".durable/ent/commit.json"
OBJECTS = {"a": b"object a", "b/c": b"object b/c"}
Doc = dict[str, Any]


def crc_hex(data: bytes) -> str:
    return f"{crc32c.crc32c(data):08x}"


@pytest.fixture
def entry(place: Place) -> Iterator[tuple[Place, Entry, Doc]]:
    """A committed entry, a sibling entry and a sentinel file outside both."""
    place.write("sentinel", b"outside the entry")
    for name in ("ent", "sibling"):
        with Entry(place.url(name)).writing() as w:
            for k, v in OBJECTS.items():
                w.write_bytes(k, v)
    raw = place.read(MARKER)
    assert raw is not None
    yield place, Entry(place.url("ent")), json.loads(raw)


def external(place: Place, doc: Doc, blob_doc: Doc | None = None) -> tuple[Doc, bytes]:
    """The same marker with its manifest moved to an external file (as for >10,000 objects)."""
    doc = copy.deepcopy(doc)
    blob_doc = blob_doc or {"format": "durable.commit.manifest", "attempt": doc["attempt"],
                            "manifest": doc.pop("manifest")}
    doc.pop("manifest", None)
    blob = json.dumps(blob_doc).encode()
    name = f"manifest-{doc['attempt']}.json"
    place.write(f".durable/ent/{name}", blob)
    doc["manifest_ref"] = {"key": name, "size": len(blob), "crc32c": crc_hex(blob)}
    return doc, blob


def with_manifest(key: str, rec: Any = None) -> Callable[[Place, Doc], Doc]:
    def change(place: Place, doc: Doc) -> Doc:
        doc["manifest"][key] = rec if rec is not None else {"size": 17,
                                                            "crc32c": crc_hex(b"x" * 17)}
        return doc
    return change


def with_record(**fields: Any) -> Callable[[Place, Doc], Doc]:
    def change(place: Place, doc: Doc) -> Doc:
        doc["manifest"]["a"].update(fields)
        return doc
    return change


def with_field(**fields: Any) -> Callable[[Place, Doc], Doc]:
    def change(place: Place, doc: Doc) -> Doc:
        doc.update(fields)
        return doc
    return change


def with_ref(**fields: Any) -> Callable[[Place, Doc], Doc]:
    def change(place: Place, doc: Doc) -> Doc:
        doc, _ = external(place, doc)
        doc["manifest_ref"].update(fields)
        return doc
    return change


def ref_moved_to(name: str) -> Callable[[Place, Doc], Doc]:
    """The external manifest, intact, under another name the marker points at."""
    def change(place: Place, doc: Doc) -> Doc:
        doc, blob = external(place, doc)
        place.write(f".durable/ent/{name}", blob)
        doc["manifest_ref"]["key"] = name
        return doc
    return change


def external_with(**fields: Any) -> Callable[[Place, Doc], Doc]:
    """An external manifest whose CRC is right but whose content is hostile."""
    def change(place: Place, doc: Doc) -> Doc:
        blob_doc = {"format": "durable.commit.manifest", "attempt": doc["attempt"],
                    "manifest": doc["manifest"]}
        blob_doc.update(fields)
        doc, _ = external(place, doc, blob_doc)
        return doc
    return change


def summarised(place: Place, doc: Doc, blob_doc: Doc | None = None) -> Doc:
    """`external`, with the summary a writer now puts beside a manifest_ref (count,
    total_size, and ``ends``: the records of the first and last keys) from ``doc``'s own
    manifest, whatever the external one (``blob_doc``) holds."""
    manifest = doc["manifest"]
    doc, _ = external(place, doc, blob_doc)
    keys = sorted(manifest)
    doc.update(count=len(manifest), total_size=sum(r["size"] for r in manifest.values()),
               ends={k: manifest[k] for k in (keys[0], keys[-1])})
    return doc


def with_summary(**fields: Any) -> Callable[[Place, Doc], Doc]:
    def change(place: Place, doc: Doc) -> Doc:
        doc = summarised(place, doc)
        doc.update(fields)
        return doc
    return change


PAD = "x" * (5 * 1024 * 1024)
HOSTILE: dict[str, Callable[[Place, Doc], Doc | bytes] | bytes] = {
    "bad json": b'{"format": "durable.commit", "version": 1,',
    "not utf-8": b"\xff\xfe\x00{}",
    "empty file": b"",
    "json array": b"[1, 2, 3]",
    "json string": b'"durable.commit"',
    "json null": b"null",
    "json number": b"42",
    "deeply nested": (b'{"format": "durable.commit", "writer": ' + b"[" * 200_000
                      + b"]" * 200_000 + b"}"),
    "deeply nested manifest": (b'{"format": "durable.commit", "version": 1, "manifest": '
                               + b'{"a":' * 200_000 + b"1" + b"}" * 200_000 + b"}"),
    "huge integer": b'{"format": "durable.commit", "version": ' + b"9" * 5000 + b"}",
    "over the size limit": with_field(writer={"pad": PAD}),
    "wrong format": with_field(format="zarr"),
    "future version": with_field(version=2),
    "version as string": with_field(version="1"),
    "version as bool": with_field(version=True),
    "unknown kind": with_field(kind="directory"),
    "attempt with a path": with_field(attempt="../../x"),
    "attempt not ascii": with_field(attempt="\u0661\u0662\u00bd"),
    "writer not an object": with_field(writer=["pid"]),
    "committed_at a number": with_field(committed_at=12345),
    "no manifest at all": lambda place, doc: {k: v for k, v in doc.items() if k != "manifest"},
    "both manifest and manifest_ref": with_field(
        manifest_ref={"key": "../../../sentinel", "size": 1, "crc32c": "00000000"}),
    "valid marker in utf-16": lambda place, doc: json.dumps(doc).encode("utf-16"),
    "valid marker in utf-32": lambda place, doc: json.dumps(doc).encode("utf-32"),
    "manifest a list": with_field(manifest=[["a", {"size": 8}]]),
    "record not an object": with_manifest("z", 17),
    "key with ..": with_manifest("../sentinel"),
    "key with .. inside": with_manifest("b/../../sentinel"),
    "key with .": with_manifest("./a"),
    "absolute key": lambda place, doc: with_manifest(place.root + "/sentinel")(place, doc),
    "backslash key": with_manifest("..\\sentinel"),
    "empty segment": with_manifest("b//c"),
    "trailing slash": with_manifest("b/"),
    "empty key": with_manifest(""),
    "NUL in key": with_manifest("a\x00b"),
    "crc not hex": with_record(crc32c="not-a-crc"),
    "crc upper case": with_record(crc32c="ABCDEF01"),
    "crc too long": with_record(crc32c="0123456789"),
    "crc as integer": with_record(crc32c=12345),
    "crc missing": lambda place, doc: with_record(crc32c=None)(place, doc),
    "negative size": with_record(size=-1),
    "size as float": with_record(size=8.0),
    "size as string": with_record(size="8"),
    "size as bool": with_record(size=True),
    "size beyond any object": with_record(size=2**63),
    "size of 500 digits": with_record(size=10**500),
    # A tail (an object's last 4 bytes) is recorded only under the CRC32C residue.
    "tail not hex": with_record(tail="not-hex!"),
    "tail as integer": with_record(tail=12345),
    "tail without the residue": with_record(tail="00000000"),
    "ref to another file name": ref_moved_to("other.json"),
    "ref out of the records": ref_moved_to("../../planted.json"),
    "ref to an absolute path": lambda place, doc: with_ref(key=place.root + "/sentinel")(
        place, doc),
    "ref with wrong crc": with_ref(crc32c="00000000"),
    "ref with wrong size": with_ref(size=3),
    "ref over the manifest limit": with_ref(size=2**40),
    "ref not an object": lambda place, doc: {**{k: v for k, v in doc.items()
                                                if k != "manifest"},
                                             "manifest_ref": "manifest.json"},
    "ref to a missing file": lambda place, doc: _rm_ext(place, with_ref()(place, doc)),
    "external of another attempt": external_with(attempt="0" * 32),
    "external with .. key": external_with(manifest={"../sentinel": {"size": 1,
                                                                    "crc32c": "00000000"}}),
    "external not an object": external_with(manifest=["a"]),
    # A key twice in one object: Python keeps the last value, other JSON readers the first.
    "manifest twice": lambda place, doc: duplicated(doc, "manifest", {"a": doc["manifest"]["a"]}),
    "key twice in the manifest": lambda place, doc: duplicated(
        doc["manifest"], "a", doc["manifest"]["a"], within=doc, at="manifest"),
    "size twice": lambda place, doc: duplicated(
        doc["manifest"]["a"], "size", doc["manifest"]["a"]["size"], within=doc,
        at="manifest.a"),
    # The summary of an external manifest is checked as a manifest is, at decode.
    "ends beside an inline manifest": with_field(ends={"a": {"size": 8, "crc32c": "00000000"}}),
    "ends with a .. key": with_summary(ends={"../sentinel": {"size": 1, "crc32c": "00000000"}}),
    "ends with a bad record": with_summary(ends={"a": {"size": -1, "crc32c": "00000000"}}),
    "ends not an object": with_summary(ends=["a", "b/c"]),
    "ends of three records": lambda place, doc: with_summary(ends={
        k: {"size": 1, "crc32c": "00000000"} for k in ("a", "b", "c")})(place, doc),
    "ends without count": lambda place, doc: {k: v for k, v in summarised(place, doc).items()
                                              if k != "count"},
    "ends with a total_size as string": with_summary(total_size="18"),
    "external with a key twice": lambda place, doc: _external_raw(
        place, doc, duplicated({"format": "durable.commit.manifest",
                                "attempt": doc["attempt"], "manifest": doc["manifest"]},
                               "attempt", doc["attempt"])),
}


def duplicated(obj: Doc, key: str, value: Any, *, within: Doc | None = None,
               at: str = "") -> bytes:
    """``obj`` as JSON with ``key: value`` added again at its end; inside ``within`` (at
    the dotted path ``at``) when given, else alone."""
    inner = json.dumps(obj)[:-1] + f", {json.dumps(key)}: {json.dumps(value)}}}"
    if within is None:
        return inner.encode()
    marker = "\x00PLACE\x00"
    doc = copy.deepcopy(within)
    *parents, last = at.split(".")
    holder = doc
    for p in parents:
        holder = holder[p]
    holder[last] = marker
    return json.dumps(doc).replace(json.dumps(marker), inner).encode()


def _external_raw(place: Place, doc: Doc, blob: bytes) -> Doc:
    """The marker pointing at ``blob`` (raw bytes) as its external manifest."""
    doc = {k: v for k, v in doc.items() if k != "manifest"}
    name = f"manifest-{doc['attempt']}.json"
    place.write(f".durable/ent/{name}", blob)
    doc["manifest_ref"] = {"key": name, "size": len(blob), "crc32c": crc_hex(blob)}
    return doc


def _rm_ext(place: Place, doc: Doc) -> Doc:
    name = f".durable/ent/manifest-{doc['attempt']}.json"
    if place.kind == "file":
        os.remove(os.path.join(place.root, name))
    else:
        from fsspec.implementations.memory import MemoryFileSystem
        MemoryFileSystem().rm_file(f"{place.root}/{name}")
    return doc


def hostile_bytes(place: Place, doc: Doc, case: str) -> bytes:
    spec = HOSTILE[case]
    if isinstance(spec, bytes):
        return spec
    made = spec(place, copy.deepcopy(doc))
    return made if isinstance(made, bytes) else json.dumps(made).encode()


# Local paths every open/listdir/remove in this process touches, when recording.
_touched: list[str] | None = None
_EVENTS = {"open", "os.listdir", "os.scandir", "os.remove", "os.rmdir", "os.rename",
           "os.mkdir", "os.link", "os.symlink", "os.truncate", "shutil.rmtree"}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _touched is not None and event in _EVENTS and args and isinstance(args[0], str):
        _touched.append(args[0])


sys.addaudithook(_audit)


def tree(root: str) -> dict[str, str]:
    """Every path under root (directories and links too) -> what it is, content hashed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = "link " + os.readlink(full)
            elif os.path.isdir(full):
                out[rel] = "dir"
            else:
                with open(full, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def refused(place: Place, call: Callable[[], object]) -> MarkerError:
    """Run call; it must raise MarkerError and touch nothing outside the entry's records."""
    global _touched
    before = place.files()
    local_before = tree(place.root) if place.kind == "file" else {}
    _touched = []
    try:
        with pytest.raises(MarkerError) as info:
            call()
    finally:
        touched, _touched = _touched, None
    assert place.files() == before
    if place.kind == "file":
        assert tree(place.root) == local_before
        records = os.path.join(place.root, ".durable", "ent")
        touched = [os.path.normpath(p) for p in touched]
        outside = [p for p in touched if p.startswith(place.root)
                   and not (p == records or p.startswith(records + os.sep))]
        assert outside == [], f"touched outside the entry's records: {outside}"
    return info.value


def test_the_outside_check_sees_a_read_outside(tmp_path: os.PathLike[str]) -> None:
    """The check itself: a call that reads the sentinel is flagged, even if it raises."""
    place = Place("file", os.path.realpath(tmp_path))
    place.write("sentinel", b"outside the entry")

    def reads_outside() -> None:
        with open(os.path.join(place.root, "sentinel"), "rb") as f:
            f.read()
        raise MarkerError("refused, but too late")

    with pytest.raises(AssertionError, match="touched outside"):
        refused(place, reads_outside)


def test_a_manifest_of_few_objects_with_long_keys_goes_external(
        place: Place, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inline manifest's size, not only its object count, sends it to an external
    manifest: 9,000 objects with 500-character keys made a marker over the limit every
    reader refuses, and the commit failed with a bare ValueError (here scaled down)."""
    import durable._protocol as protocol

    monkeypatch.setattr(protocol, "MAX_MARKER_BYTES", 4096)
    e = Entry(place.url("long"))
    keys = [f"{'k' * 100}/{i}" for i in range(40)]
    with e.writing() as w:
        for k in keys:
            w.write_bytes(k, k.encode())
    assert e.state() is State.COMPLETE
    doc = json.loads(place.read(".durable/long/commit.json") or b"{}")
    assert "manifest" not in doc and doc["manifest_ref"]["key"].startswith("manifest-")
    assert e.verify(deep=True).ok and e.verify().objects == 40
    assert read_verified(place.url("long", *keys[7].split("/"))) == keys[7].encode()


def test_valid_markers_are_accepted(entry: tuple[Place, Entry, Doc]) -> None:
    """The controls: the unchanged marker, inline and with an external manifest."""
    place, e, doc = entry
    assert e.state() is State.COMPLETE
    ext, _ = external(place, doc)
    place.write(MARKER, json.dumps(ext).encode())
    assert e.state() is State.COMPLETE
    assert e.verify(deep=True).ok
    assert read_verified(place.url("ent", "a")) == OBJECTS["a"]


def test_a_bad_committed_at_says_what_was_expected(entry: tuple[Place, Entry, Doc]) -> None:
    """'bad committed_at 12345' named what was found, not what a marker must hold."""
    place, e, doc = entry
    place.write(MARKER, json.dumps({**doc, "committed_at": 12345}).encode())
    with pytest.raises(IntegrityError, match=r"bad committed_at 12345: expected a string"):
        e.status()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_marker_is_refused(entry: tuple[Place, Entry, Doc], case: str) -> None:
    place, e, doc = entry
    data = hostile_bytes(place, doc, case)
    if case == "over the size limit":
        assert len(data) > MAX_MARKER_BYTES
    place.write(MARKER, data)
    for call in (e.state, e.status, e.verify, lambda: e.verify(deep=True),
                 lambda: read_verified(place.url("ent", "a")),
                 lambda: read_verified(place.url("ent", "b", "c"))):
        err = refused(place, call)
        assert isinstance(err, ValueError)
        assert isinstance(err, IntegrityError) and isinstance(err, DurableError)
        # It names the record it could not trust.
        assert err.url is not None and place.canonical(".durable", "ent") in err.url
        assert place.canonical(".durable", "ent") in str(err)
    assert place.read("sentinel") == b"outside the entry"


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_delete_does_not_follow_a_hostile_marker(entry: tuple[Place, Entry, Doc],
                                                 case: str) -> None:
    place, e, doc = entry
    place.write(MARKER, hostile_bytes(place, doc, case))
    keep = {k: v for k, v in place.files().items()
            if not k.startswith(("ent/", ".durable/ent/"))}
    local_keep = ({k: v for k, v in tree(place.root).items()
                   if k not in ("ent", ".durable/ent") and not k.startswith(
                       ("ent/", ".durable/ent/"))} if place.kind == "file" else {})
    e.delete()
    assert place.files() == keep
    if place.kind == "file":
        assert tree(place.root) == local_keep
    assert e.state() is State.ABSENT
    assert Entry(place.url("sibling")).state() is State.COMPLETE
    assert place.read("sentinel") == b"outside the entry"


@pytest.mark.parametrize("how", ["overwrite", "delete"])
def test_a_key_through_a_symlinked_directory_never_removes_what_it_points_to(
        tmp_path: os.PathLike[str], how: str) -> None:
    """A directory of the entry swapped for a symlink to another zarr tree, and a marker
    naming "link/zarr.json": a string check passes that key, and overwriting the entry
    unlinked the other tree's zarr.json through the link (its documents go first, by the
    manifest). Only the link goes; what it points to is untouched."""
    from durable._protocol import Layout

    root = os.path.realpath(tmp_path)
    other = os.path.join(root, "other.zarr")
    os.makedirs(os.path.join(other, "c"))
    for rel, data in (("zarr.json", b"{}"), ("c/0", b"chunk")):
        with open(os.path.join(other, rel), "wb") as f:
            f.write(data)
    before = tree(other)
    e = Entry(os.path.join(root, "ent"))
    with e.writing() as w:
        w.write_bytes("a", b"a")
        w.write_bytes("z", b"z")
    os.symlink(other, os.path.join(root, "ent", "link"))
    marker = Layout(e.path).marker
    with open(marker, "rb") as f:
        doc = json.load(f)
    doc["manifest"]["link/zarr.json"] = {"size": 2, "crc32c": crc_hex(b"{}")}
    os.remove(marker)
    with open(marker, "w") as f:
        json.dump(doc, f)
    assert e.state() is State.COMPLETE  # the first and last objects are there
    if how == "overwrite":
        with e.writing(overwrite=True) as w:
            w.write_bytes("a", b"new")
        assert e.verify(deep=True).ok
    else:
        e.delete()
        assert e.state() is State.ABSENT
    assert not os.path.lexists(os.path.join(root, "ent", "link"))
    assert tree(other) == before


def test_deleting_an_entry_that_is_a_symlink_leaves_the_tree_it_points_to(
        tmp_path: os.PathLike[str]) -> None:
    """An entry path that is a symlink to a zarr tree: the listing goes through it, and the
    delete unlinked that tree's zarr.json (its documents go first) before removing the link,
    leaving the other tree half-deleted. Only the link goes."""
    root = os.path.realpath(tmp_path)
    other = os.path.join(root, "real.zarr")
    os.makedirs(os.path.join(other, "c"))
    for rel, data in (("zarr.json", b"{}"), ("c/0", b"chunk")):
        with open(os.path.join(other, rel), "wb") as f:
            f.write(data)
    before = tree(other)
    os.symlink(other, os.path.join(root, "ent"))
    e = Entry(os.path.join(root, "ent"))
    e.delete()
    assert not os.path.lexists(os.path.join(root, "ent"))
    assert tree(other) == before


def test_a_key_longer_than_a_file_name_can_be_is_missing(tmp_path: os.PathLike[str]) -> None:
    """A manifest key whose segment is longer than the file system takes (S3 keys take
    1,024 bytes): state() raised a bare ENAMETOOLONG OSError, and so did the way out of a
    bad marker, writing(overwrite=True). Such an object is missing."""
    from durable._protocol import Layout

    e = Entry(os.path.join(os.path.realpath(tmp_path), "ent"))
    with e.writing() as w:
        w.write_bytes("a", b"a")
        w.write_bytes("z", b"z")
    marker = Layout(e.path).marker
    with open(marker, "rb") as f:
        good = json.load(f)
    for long_key, state in (("z" * 300, State.INCOMPLETE),  # the last key: state() stats it
                            ("m" * 300 + "/zarr.json", State.COMPLETE)):  # a middle one
        doc = copy.deepcopy(good)
        doc["manifest"][long_key] = {"size": 1, "crc32c": crc_hex(b"z")}
        os.remove(marker)
        with open(marker, "w") as f:
            json.dump(doc, f)
        assert e.state() is state
        report = e.verify(raise_errors=False)
        assert [(p.key, p.issue) for p in report.problems] == [(long_key, "missing")]
        with pytest.raises(IntegrityError, match="missing"):
            read_verified(os.path.join(e.path, long_key))
        with e.writing(overwrite=True) as w:  # a COMPLETE one: its manifest's documents
            w.write_bytes("a", b"a")  # are removed first, by their keys
            w.write_bytes("z", b"z")
        assert e.state() is State.COMPLETE


def test_an_external_manifest_larger_than_recorded_is_refused_unread(
        entry: tuple[Place, Entry, Doc]) -> None:
    """An external manifest file larger than the size its marker recorded was read whole
    (up to any manifest's 1 GiB) before the sizes were compared: every state() of the
    entry took that much memory. It is refused from its size, before a byte is read."""
    import tracemalloc

    place, e, doc = entry
    ext, blob = external(place, doc)
    place.write(MARKER, json.dumps(ext).encode())
    assert e.state() is State.COMPLETE
    name = f".durable/ent/{ext['manifest_ref']['key']}"
    if place.kind == "file":
        os.truncate(os.path.join(place.root, name), 64 * 1024 * 1024)  # sparse: no disk
    else:
        place.write(name, blob + b" " * (64 * 1024 * 1024))
    tracemalloc.start()
    try:
        with pytest.raises(MarkerError, match=f"recorded an external manifest of {len(blob)}"):
            e.state()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024, peak


def test_a_records_tail_is_optional_and_kept_only_under_the_residue() -> None:
    """A chunk ending in its own CRC32C (zarr's crc32c codec) has the residue as its whole
    CRC32C, so two such chunks of one size had one record; its last 4 bytes (the CRC32C of
    its contents) are kept beside it. A record without one is spelled as before, so markers
    of other objects are unchanged, and a reader that knows no tail ignores it."""
    from durable._checksum import CRC32C_RESIDUE
    from durable._protocol import ObjectRecord

    body = b"some chunk"
    word = body + crc32c.crc32c(body).to_bytes(4, "little")
    assert crc32c.crc32c(word) == CRC32C_RESIDUE
    rec = ObjectRecord.of(len(word), crc32c.crc32c(word), word)
    assert rec.tail == int.from_bytes(word[-4:], "big")
    assert rec.to_json() == {"size": 14, "crc32c": "48674bc7", "tail": word[-4:].hex()}
    assert ObjectRecord.from_json(rec.to_json(), "here") == rec
    plain = ObjectRecord.of(len(body), crc32c.crc32c(body), body)
    assert plain.tail is None and set(plain.to_json()) == {"size", "crc32c"}
    other = body[:-1] + b"!"
    straggler = other + crc32c.crc32c(other).to_bytes(4, "little")
    found = ObjectRecord.of(len(straggler), crc32c.crc32c(straggler), straggler)
    assert (found.size, found.crc32c) == (rec.size, rec.crc32c)  # the same without it
    assert not rec.matches(found) and rec.matches(rec)
    assert ObjectRecord(rec.size, rec.crc32c).matches(found)  # no tail: nothing to say


def _summarised_raw(place: Place, doc: Doc, blob: bytes) -> Doc:
    """A summarised marker (of ``doc``'s manifest) whose external manifest is ``blob``."""
    manifest = doc["manifest"]
    doc = _external_raw(place, doc, blob)
    keys = sorted(manifest)
    doc.update(count=len(manifest), total_size=sum(r["size"] for r in manifest.values()),
               ends={k: manifest[k] for k in (keys[0], keys[-1])})
    return doc


def _extra(doc: Doc, **more: Any) -> Doc:
    """``doc``'s manifest as an external manifest's document, with ``more`` records."""
    return {"format": "durable.commit.manifest", "attempt": doc["attempt"],
            "manifest": {**doc["manifest"], **more}}


_REC_17 = {"size": 17, "crc32c": "00000000"}
# A marker that decodes, with a summary that matches the data, over an external manifest
# that cannot be trusted: state() judges the data by the summary; every use of the
# manifest's content must refuse it.
LAZY_HOSTILE: dict[str, Callable[[Place, Doc], Doc]] = {
    "wrong crc": lambda place, doc: {**summarised(place, doc), "manifest_ref": {
        **summarised(place, doc)["manifest_ref"], "crc32c": "00000000"}},
    "of another attempt": lambda place, doc: summarised(
        place, doc, {**_extra(doc), "attempt": "0" * 32}),
    "with a .. key": lambda place, doc: summarised(
        place, doc, _extra(doc, **{"../sentinel": _REC_17})),
    "not an object": lambda place, doc: summarised(place, doc, {**_extra(doc),
                                                                "manifest": ["a"]}),
    "with a key twice": lambda place, doc: _summarised_raw(place, doc, duplicated(
        _extra(doc), "attempt", doc["attempt"])),
    # The summary disagreeing with the manifest it summarises, in each of its fields.
    "another count": lambda place, doc: {**summarised(place, doc), "count": 3},
    "another total_size": lambda place, doc: {**summarised(place, doc), "total_size": 1},
    "other ends": lambda place, doc: {**summarised(place, doc, _extra(doc, **{"b/d": _REC_17})),
                                      "count": 3, "total_size": 18 + 17},
}


@pytest.mark.parametrize("case", sorted(LAZY_HOSTILE))
def test_a_summarised_marker_refuses_a_hostile_external_manifest_where_it_is_used(
        entry: tuple[Place, Entry, Doc], case: str) -> None:
    """state() of a marker that summarises its external manifest looks at the summary's
    two objects and the manifest's size, not its content (a 100,000-object manifest took
    0.3-1.2 s to fetch and parse at every state()). The manifest is checked wherever its
    content is used: a hostile or corrupt one, or one its summary does not describe, is a
    MarkerError there, and nothing outside the entry is touched."""
    place, e, doc = entry
    place.write(MARKER, json.dumps(LAZY_HOSTILE[case](place, copy.deepcopy(doc))).encode())
    assert e.state() is State.COMPLETE

    def read_through_reader() -> bytes:
        with e.reading() as r:
            return r.read("a")

    def manifest_of_read_marker() -> object:
        marker = e.read_marker()
        assert marker is not None and marker.manifest is not None
        return dict(marker.manifest.objects)

    for call in (e.verify, lambda: e.verify(deep=True), read_through_reader,
                 manifest_of_read_marker, lambda: read_verified(place.url("ent", "a")),
                 lambda: read_verified(place.url("ent", "b", "c"))):
        err = refused(place, call)
        assert isinstance(err, IntegrityError) and isinstance(err, ValueError)
        assert err.url is not None and place.canonical(".durable", "ent") in err.url
    # A scan (and verify of the root) reads every manifest: this one is the entry's
    # ERROR row, and the scan goes on (a MarkerError of a manifest read lazily, outside
    # the reads that make such rows, ended the whole scan).
    rows = {r.url: r for r in scan(place.url())}
    assert rows[place.canonical("ent")].state == "ERROR"
    assert "MarkerError" in rows[place.canonical("ent")].reason
    assert rows[place.canonical("sibling")].state == "COMPLETE"
    with e.writing(overwrite=True) as w:  # the way out: nothing of the manifest followed
        w.write_bytes("a", b"new")
    assert e.verify(deep=True).ok and e.verify().objects == 1
    assert place.read("sentinel") == b"outside the entry"
    assert Entry(place.url("sibling")).verify(deep=True).ok


@pytest.mark.parametrize("case", ["missing", "of another size"])
def test_a_summarised_marker_whose_manifest_is_gone_or_resized_is_an_error(
        entry: tuple[Place, Entry, Doc], case: str) -> None:
    """state() stats the external manifest it does not read: a marker whose manifest is
    missing or not of the recorded size is a MarkerError, as when it was read whole."""
    place, e, doc = entry
    ext = summarised(place, copy.deepcopy(doc))
    place.write(MARKER, json.dumps(ext).encode())
    assert e.state() is State.COMPLETE
    name = f".durable/ent/{ext['manifest_ref']['key']}"
    if case == "missing":
        _rm_ext(place, ext)
        match = "external manifest is missing"
    else:
        place.write(name, b"{}")
        match = f"recorded (an external manifest of )?{ext['manifest_ref']['size']} bytes"
    for call in (e.state, e.status, e.verify):
        with pytest.raises(MarkerError, match=match) as info:
            call()
        assert info.value.url == place.canonical(name)


def test_state_of_a_summarised_marker_never_opens_the_external_manifest(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """What a writer commits for a large entry summarises its manifest (count, total_size,
    ends), the summary agrees with it, and state() opens the marker, not the manifest;
    verify() reads it. A marker without the summary (written before it) still reads."""
    import durable._protocol as protocol

    global _touched
    monkeypatch.setattr(protocol, "INLINE_MANIFEST_OBJECTS", 3)
    e = Entry(os.path.join(os.path.realpath(tmp_path), "ent"))
    data = {f"k/{i}": bytes([i]) * (i + 1) for i in range(6)}
    with e.writing() as w:
        for k, v in data.items():
            w.write_bytes(k, v)
    records = os.path.join(os.path.realpath(tmp_path), ".durable", "ent")
    with open(os.path.join(records, "commit.json"), "rb") as f:
        doc = json.load(f)
    manifest_path = os.path.join(records, doc["manifest_ref"]["key"])
    with open(manifest_path, "rb") as f:
        manifest = json.load(f)["manifest"]
    assert doc["ends"] == {k: manifest[k] for k in ("k/0", "k/5")}
    assert (doc["count"], doc["total_size"]) == (6, sum(map(len, data.values())))

    def opened(call: Callable[[], object]) -> list[str]:
        global _touched
        _touched = []
        try:
            call()
        finally:
            touched, _touched = _touched, None
        return [os.path.normpath(p) for p in touched]

    assert manifest_path not in opened(lambda: e.state() is State.COMPLETE or 1 / 0)
    assert manifest_path in opened(lambda: e.verify(deep=True))
    old = {k: v for k, v in doc.items() if k not in ("ends", "count", "total_size")}
    os.remove(os.path.join(records, "commit.json"))
    with open(os.path.join(records, "commit.json"), "w") as f:
        json.dump(old, f)
    assert manifest_path in opened(lambda: e.state() is State.COMPLETE or 1 / 0)
    assert e.verify(deep=True).objects == 6
