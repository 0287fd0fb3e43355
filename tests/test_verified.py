"""Verified reads: the recorded bytes come back, or an IntegrityError naming what differs.

Incidents 002 and 003: objects short by whole parts behind a full-size stat, downloads
shorter than declared, a checkpoint read as a prefix. Damage is done to the stored bytes
around durable: a real truncate, a byte flipped in place, an append, a rename over the
object; CRC32Cs of the damaged bytes are computed by the test with the `crc32c` package.
"""

from __future__ import annotations

import io
import os
import sys
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import crc32c
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from conftest import Place
from durable import (
    Entry,
    IncompleteError,
    IntegrityError,
    State,
    atomic_write,
    open_verified,
    read_verified,
)

N = 3 * 1024 * 1024 + 101  # over open_verified's 1 MiB buffer: reads come in several pieces
DATA = os.urandom(N)


def store_path(place: Place, rel: str) -> str:
    return f"{place.root}/{rel}"


def damage(place: Place, rel: str, how: str) -> bytes:
    """Damage the stored object in place (local) or replace it (memory); the new bytes."""
    old = place.read(rel)
    assert old is not None
    if how == "truncated":
        new = old[:-7]
    elif how == "appended":
        new = old + b"extra"
    else:
        i = len(old) // 2
        new = old[:i] + bytes([old[i] ^ 0x01]) + old[i + 1:]
    if place.kind == "memory":
        MemoryFileSystem().pipe_file(store_path(place, rel), new)
        return new
    path = store_path(place, rel)
    if how == "truncated":
        os.truncate(path, len(new))
    else:
        with open(path, "r+b") as f:  # the same inode: what a disk fault or a stray writer does
            if how == "appended":
                f.seek(0, io.SEEK_END)
                f.write(b"extra")
            else:
                f.seek(len(old) // 2)
                f.write(new[len(old) // 2:len(old) // 2 + 1])
    assert place.read(rel) == new
    return new


def expected_found(how: str, new: bytes) -> tuple[object, object]:
    if how == "flipped":
        return f"{crc32c.crc32c(DATA):08x}", f"{crc32c.crc32c(new):08x}"
    return N, len(new)


def check_error(err: IntegrityError, url: str, expected: object, found: object) -> None:
    assert err.url == url
    assert err.expected == expected
    assert err.found == found
    message = str(err)
    assert url in message and str(expected) in message and str(found) in message


# Two ways an object gets a record: alone (atomic_write) or inside an entry.
def single(place: Place) -> tuple[str, str, Entry]:
    with atomic_write(place.url("obj.bin")) as f:
        f.write(DATA)
    return "obj.bin", place.canonical("obj.bin"), Entry(place.url("obj.bin"))


def in_entry(place: Place) -> tuple[str, str, Entry]:
    e = Entry(place.url("ent"))
    with e.writing() as w:
        w.write_bytes("small", b"small")
        w.write_bytes("c/obj.bin", DATA)
    return "ent/c/obj.bin", place.canonical("ent", "c", "obj.bin"), e


WAYS: list[Callable[[Place], tuple[str, str, Entry]]] = [single, in_entry]
HOWS = ["truncated", "flipped", "appended"]


@pytest.mark.parametrize("way", WAYS)
def test_whole_object_reads_back(place: Place, way: Callable[..., tuple[str, str, Entry]]
                                 ) -> None:
    _, url, e = way(place)
    assert read_verified(url) == DATA
    with open_verified(url) as f:
        assert f.read() == DATA
    with open_verified(url) as f:
        f.seek(-10, io.SEEK_END)
        assert f.read() == DATA[-10:]
    assert e.verify(deep=True).ok


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("way", WAYS)
def test_verify(place: Place, way: Callable[..., tuple[str, str, Entry]], how: str) -> None:
    rel, url, e = way(place)
    new = damage(place, rel, how)
    expected, found = expected_found(how, new)
    if how == "flipped":
        # Same size: a stat-only check cannot see it, and does not pretend to.
        assert e.verify().ok
    else:
        with pytest.raises(IntegrityError) as info:
            e.verify()
        check_error(info.value, url, expected, found)
    with pytest.raises(IntegrityError) as info:
        e.verify(deep=True)
    check_error(info.value, url, expected, found)
    report = e.verify(deep=True, raise_errors=False)
    assert [p.url for p in report.problems] == [url]
    assert e.state() is State.COMPLETE or how != "flipped"


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("way", WAYS)
def test_read_verified(place: Place, way: Callable[..., tuple[str, str, Entry]],
                       how: str) -> None:
    rel, url, _ = way(place)
    new = damage(place, rel, how)
    with pytest.raises(IntegrityError) as info:
        read_verified(url)
    check_error(info.value, url, *expected_found(how, new))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("way", WAYS)
def test_open_verified_sequential(place: Place, way: Callable[..., tuple[str, str, Entry]],
                                  how: str) -> None:
    rel, url, _ = way(place)
    new = damage(place, rel, how)
    got = bytearray()
    with pytest.raises(IntegrityError) as info, open_verified(url) as f:
        while block := f.read(256 * 1024):
            got += block
    check_error(info.value, url, *expected_found(how, new))
    # The read that reached the bad end raised: the whole object was never handed out.
    assert len(got) < N


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("way", WAYS)
def test_open_verified_seek_first(place: Place, way: Callable[..., tuple[str, str, Entry]],
                                  how: str) -> None:
    rel, url, _ = way(place)
    new = damage(place, rel, how)
    with pytest.raises(IntegrityError) as info, open_verified(url) as f:
        f.seek(-100, io.SEEK_END)
        f.read()
    check_error(info.value, url, *expected_found(how, new))


def write_zip(place: Place) -> tuple[str, dict[str, bytes]]:
    members = {f"m{i}": os.urandom(200_000) for i in range(3)}
    with atomic_write(place.url("a.zip")) as f, zipfile.ZipFile(f, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)  # stored, not compressed: the flipped byte is raw data
    return place.canonical("a.zip"), members


@pytest.mark.parametrize("mode", ["r", "rt"])
def test_text_mode_reads_text_as_atomic_write_wrote_it(place: Place, mode: str) -> None:
    """``open_verified(url, "r")`` took "r" and handed out bytes: a vocabulary written with
    ``atomic_write(url, "w")`` and read back line by line gave ``b"hello\\n"`` where the
    writer wrote ``"hello\\n"``, and a dict built from it silently missed every ``str``
    key. Text mode reads text (``encoding``, ``errors``, ``newline`` as ``open``), still
    checked: damage is an IntegrityError at the read that reaches it."""
    words = ["hello", "wörld", "ĉu", *(f"tok{i}" for i in range(3000))]
    with atomic_write(place.url("vocab.txt"), "w", encoding="utf-8") as f:
        f.writelines(w + "\n" for w in words)
    with open_verified(place.url("vocab.txt"), mode, encoding="utf-8") as f:
        vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
    assert vocab["wörld"] == 1 and len(vocab) == len(words)
    with open_verified(place.url("vocab.txt"), mode, encoding="latin-1",
                       newline="") as f:
        assert f.readline() == "hello\n" and f.read(2) == "w\u00c3"
    damage_at = len("hello\nwörld\nĉu\n".encode()) + 2
    raw = bytearray(place.read("vocab.txt") or b"")
    raw[damage_at] ^= 1
    place.write("vocab.txt", bytes(raw))
    with pytest.raises(IntegrityError, match=r"vocab\.txt"), open_verified(
            place.url("vocab.txt"), mode, encoding="utf-8") as f:
        f.read()
    with pytest.raises(ValueError, match="'rb', 'r'"):
        open_verified(place.url("vocab.txt"), "w")


def test_zip_reads_through_open_verified(place: Place) -> None:
    url, members = write_zip(place)
    with open_verified(url) as f, zipfile.ZipFile(f) as z:
        assert {n: z.read(n) for n in z.namelist()} == members


def test_zip_with_flipped_byte_fails_before_zipfile_sees_it(place: Place) -> None:
    url, _ = write_zip(place)
    raw = place.read("a.zip")
    assert raw is not None
    i = 300_000  # inside member m1's data, far from the central directory at the end
    bad = raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1:]
    if place.kind == "file":
        with open(store_path(place, "a.zip"), "r+b") as f:
            f.seek(i)
            f.write(bad[i:i + 1])
    else:
        MemoryFileSystem().pipe_file(store_path(place, "a.zip"), bad)
    # zipfile seeks to the end first: the whole object is checked before it gets a byte,
    # so the error is durable's, at open, not zipfile's CRC error at some member read.
    # zipfile turns every OSError met while looking for its end record into BadZipFile,
    # and IntegrityError is an OSError: durable's error is the cause it chains.
    with open_verified(url) as f, pytest.raises(zipfile.BadZipFile) as info:
        zipfile.ZipFile(f)
    cause = info.value.__context__
    assert isinstance(cause, IntegrityError)
    check_error(cause, url, f"{crc32c.crc32c(raw):08x}", f"{crc32c.crc32c(bad):08x}")


def replace_object(place: Place, rel: str, data: bytes) -> None:
    """Another writer publishes a new version under the name (a rename over it)."""
    if place.kind == "memory":
        MemoryFileSystem().pipe_file(store_path(place, rel), data)
        return
    tmp = store_path(place, rel + ".other")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, store_path(place, rel))


def test_replaced_mid_read_sequential_never_mixes_versions(place: Place) -> None:
    rel, url, _ = single(place)
    with open_verified(url) as f:
        head = f.read(1000)
        replace_object(place, rel, os.urandom(N))
        rest = f.read()
    # Pinned to the version opened: all old bytes, never a splice of two versions.
    assert head + rest == DATA


def test_replaced_mid_read_random_access_is_caught(place: Place) -> None:
    rel, url, _ = single(place)
    with open_verified(url) as f:
        f.read(1000)
        replace_object(place, rel, os.urandom(N))
        with pytest.raises(IntegrityError) as info:
            # Away from sequential order (and past what is buffered): the whole object is
            # checked first, pinned to the version opened, which is gone.
            f.seek(N - 10)
    # Reported as a replacement (not as corrupt data), naming the object.
    assert "replaced" in str(info.value).replace(url, "")
    assert info.value.url is not None and url.endswith(info.value.url)
    assert info.value.expected != info.value.found


def test_appended_after_open_is_caught(tmp_path: os.PathLike[str]) -> None:
    """The stat at open said the recorded size; the body then ran past it."""
    place = Place("file", os.path.realpath(tmp_path))
    rel, url, _ = single(place)
    with pytest.raises(IntegrityError) as info, open_verified(url) as f:
        with open(store_path(place, rel), "ab") as g:
            g.write(b"more")
        f.read()
    err = info.value
    assert (err.url, err.expected, err.found) == (url, N, f"more than {N}")
    assert url in str(err) and f"longer than the {N} bytes" in str(err)


def test_changed_in_place_mid_read_is_caught(tmp_path: os.PathLike[str]) -> None:
    place = Place("file", os.path.realpath(tmp_path))
    rel, url, _ = single(place)
    with pytest.raises(IntegrityError) as info, open_verified(url) as f:
        f.read(1000)
        with open(store_path(place, rel), "r+b") as g:
            g.seek(N - 1000)
            g.write(bytes([DATA[N - 1000] ^ 0x01]))
        f.read()
    assert info.value.url == url
    assert info.value.expected == f"{crc32c.crc32c(DATA):08x}"


def test_no_record_is_refused_unless_asked(place: Place) -> None:
    place.write("plain.bin", DATA)
    url = place.canonical("plain.bin")
    with pytest.raises(IncompleteError) as info:
        read_verified(url)
    assert info.value.url == url and url in str(info.value)
    with pytest.raises(IncompleteError):
        open_verified(url)
    assert read_verified(url, require_record=False) == DATA
    assert read_verified(url, expected_size=N) == DATA
    assert read_verified(url, expected_crc32c=crc32c.crc32c(DATA)) == DATA
    with open_verified(url, expected_size=N, expected_crc32c=crc32c.crc32c(DATA)) as f:
        assert f.read() == DATA
    with pytest.raises(IntegrityError) as err:
        read_verified(url, expected_size=N + 1)
    check_error(err.value, url, N + 1, N)
    with pytest.raises(IntegrityError) as err:
        read_verified(url, expected_crc32c=crc32c.crc32c(b"other"))
    check_error(err.value, url, f"{crc32c.crc32c(b'other'):08x}", f"{crc32c.crc32c(DATA):08x}")


@pytest.mark.parametrize("recorded", [single, in_entry])
def test_expected_values_add_to_the_record_never_replace_it(
        place: Place, recorded: Any) -> None:
    """A recorded object damaged in place with its size kept: given the right size, the
    read still checks the recorded CRC32C (it used to skip it). Given values that the
    record contradicts, or that are not values at all, are errors naming the object."""
    rel, url, _ = recorded(place)
    damage(place, rel, "flipped")
    for read in (lambda **kw: read_verified(url, **kw),
                 lambda **kw: open_verified(url, **kw).read()):
        with pytest.raises(IntegrityError, match="corrupt data"):
            read(expected_size=N)
    rel2 = rel.replace("obj.bin", "other.bin")
    if recorded is single:
        with atomic_write(place.url(rel2)) as f:
            f.write(DATA)
        url2 = place.canonical(rel2)
    else:
        url2 = place.canonical("ent", "small")
    size = N if recorded is single else 5
    with pytest.raises(IntegrityError) as err:
        read_verified(url2, expected_size=size + 1)
    check_error(err.value, url2, str(size + 1), str(size))
    with pytest.raises(ValueError, match=r"expected_crc32c must be .*int\('9a71bb4c', 16\)"):
        read_verified(url2, expected_crc32c="9a71bb4c")
    with pytest.raises(ValueError, match="expected_size must be a non-negative int"):
        read_verified(url2, expected_size=-1)


def test_an_unrecorded_object_checked_against_given_values_says_who_gave_them(
        place: Place) -> None:
    """No record covers the object: a mismatch said "recorded with 12 bytes" / "the record
    says", sending the reader looking for a record that does not exist."""
    place.write("plain.bin", b"hello world")
    url = place.canonical("plain.bin")
    good = crc32c.crc32c(b"hello world")
    for read in (lambda **kw: read_verified(url, **kw),
                 lambda **kw: open_verified(url, **kw).read()):
        with pytest.raises(IntegrityError, match=r": expected_size says 12 bytes, the store "
                                                 r"says 11$"):
            read(expected_size=12)
        with pytest.raises(IntegrityError, match=r"expected_crc32c says 00000005 \(corrupt"):
            read(expected_size=11, expected_crc32c=5)
        assert read(expected_size=11, expected_crc32c=good) == b"hello world"


def test_missing_object_with_a_record_is_an_integrity_error(place: Place) -> None:
    rel, url, _ = single(place)
    if place.kind == "file":
        os.remove(store_path(place, rel))
    else:
        MemoryFileSystem().rm_file(store_path(place, rel))
    with pytest.raises(IntegrityError) as info:
        read_verified(url)
    check_error(info.value, url, N, "missing")


def test_object_not_in_the_manifest_is_refused(place: Place) -> None:
    in_entry(place)
    place.write("ent/c/stowaway", b"written after the commit")
    url = place.canonical("ent", "c", "stowaway")
    with pytest.raises(IntegrityError) as info:
        read_verified(url)
    assert info.value.url == url and "not in the manifest" in str(info.value)


def test_an_object_neither_there_nor_committed_is_not_found(place: Place) -> None:
    """A probe for an optional file of a committed checkpoint (``optimizer.pt``, never
    saved): read_verified and open_verified raised IntegrityError ("not part of what was
    committed"), an OSError that ``except FileNotFoundError`` let through, where
    ``durable::`` and any file system answer "not found". One that is there but was not
    committed stays an IntegrityError."""
    in_entry(place)
    url = place.canonical("ent", "c", "optimizer.pt")
    for read in (lambda: read_verified(url), lambda: open_verified(url).read()):
        with pytest.raises(FileNotFoundError, match=r"committed entry .*ent") as info:
            read()
        assert not isinstance(info.value, IntegrityError)
        assert url in str(info.value)
    place.write("ent/c/optimizer.pt", b"written after the commit")
    with pytest.raises(IntegrityError, match="not in the manifest"):
        read_verified(url)


def test_an_object_of_an_entry_being_written_is_refused_saying_so(place: Place) -> None:
    """A reader on another node, a checkpoint's shard while its writer is at work (or was
    killed): "no commit record covers this object ... adopt it with
    Entry.mark_complete()", advice that would call a partial checkpoint whole. It names
    the entry a durable writer started and has not committed."""
    e = Entry(place.url("step-7"))
    with e.writing() as w:
        w.write_bytes("shards/0.npy", DATA)
        for url in (place.url("step-7", "shards", "0.npy"),):
            with pytest.raises(IncompleteError) as info:
                read_verified(url)
            text = str(info.value)
            assert f"{e.url}, which a durable writer started and has not committed" in text
            assert "mark_complete" not in text
    assert read_verified(place.url("step-7", "shards", "0.npy")) == DATA


def test_an_object_deep_inside_an_entry_is_checked_against_its_manifest(
        place: Place) -> None:
    """Writers take keys of any depth; the reader's walk up to the entry's marker must
    reach it too (it stopped at 32 levels: the object read as unrecorded)."""
    key = "/".join(f"l{i}" for i in range(40)) + "/x.bin"
    with Entry(place.url("ent")).writing() as w:
        w.write_bytes(key, b"good")
    url = place.canonical("ent", *key.split("/"))
    assert read_verified(url) == b"good"
    place.write(f"ent/{key}", b"BAD!")  # the same size, other bytes
    with pytest.raises(IntegrityError, match="CRC32C"):
        read_verified(url)


def test_open_verified_refuses_write_modes(place: Place) -> None:
    _, url, _ = single(place)
    with pytest.raises(ValueError):
        open_verified(url, "wb")


def test_a_directory_is_not_an_object_and_says_so(place: Place) -> None:
    with Entry(place.url("ds")).writing() as w:
        w.write_bytes("a.bin", b"payload")
    for call in (read_verified, open_verified):
        with pytest.raises(IsADirectoryError, match=r"a directory \(or prefix\), not an "
                                                    r"object.*/ds'"):
            call(place.url("ds"))
    with pytest.raises(FileNotFoundError, match="no such object"):
        read_verified(place.url("nothing-here"))
    assert read_verified(place.url("ds", "a.bin")) == b"payload"


@pytest.mark.parametrize("what", ["a symlink", "a special file"])
def test_a_symlink_or_fifo_is_named_by_every_reader(tmp_path: os.PathLike[str],
                                                     what: str) -> None:
    """A symlink (or a FIFO) where an object is read: durable never reads through it,
    and said "not found" naming a path that is there, or called it "a directory"."""
    import fsspec

    root = os.path.realpath(tmp_path)
    target = os.path.join(root, "target")
    with open(target, "wb") as f:
        f.write(b"elsewhere")
    plain, recorded = os.path.join(root, "plain"), os.path.join(root, "recorded")
    with atomic_write(recorded) as f:
        f.write(b"recorded!")
    os.remove(recorded)
    for path in (plain, recorded):
        if what == "a symlink":
            os.symlink(target, path)
        else:
            os.mkfifo(path)
    readers: list[Callable[[str], object]] = [
        lambda p: read_verified(p, require_record=False),
        read_verified,
        lambda p: open_verified(p, require_record=False).read(),
        lambda p: fsspec.open(f"durable::file://{p}").open().read()]
    for read in readers:
        with pytest.raises(FileNotFoundError, match=f"{what}, not an object"):
            read(plain)
        with pytest.raises(IntegrityError, match=f"recorded with 9 bytes but {what} is there"):
            read(recorded)


# A writer replacing an object (and its marker) while it is read -----------------------------
# The writer's steps are run from an audit hook, at the reader's own open of a path: exactly
# between two of the reader's steps, deterministically, with durable's code untouched.
_AT_OPEN: dict[str, Callable[[], None]] = {}


def _at_open(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and args and isinstance(args[0], str):
        step = _AT_OPEN.pop(os.path.normpath(args[0]), None)
        if step is not None:
            step()


sys.addaudithook(_at_open)


@pytest.fixture
def at_open() -> Iterator[dict[str, Callable[[], None]]]:
    """path -> what another writer does just before this process next opens that path."""
    yield _AT_OPEN
    _AT_OPEN.clear()


def pointer(root: str, value: bytes) -> str:
    url = os.path.join(root, "latest")
    with atomic_write(url) as f:
        f.write(value)
    return url


def test_a_pointer_replaced_between_its_marker_and_its_bytes_is_read_again(
        tmp_path: os.PathLike[str], at_open: dict[str, Callable[[], None]]) -> None:
    """atomic_write over a "latest" pointer on a local disk: the reader had read the old
    marker when the new bytes were renamed in (and their marker written): the new bytes
    against the old record were an IntegrityError "(corrupt data)". The record changed:
    read again, the new pointer comes back."""
    root = os.path.realpath(tmp_path)
    url = pointer(root, b"model-1000.pt")
    at_open[url] = lambda: pointer(root, b"model-2000.pt")  # the same size: a CRC32C mismatch
    assert read_verified(url) == b"model-2000.pt"
    assert not at_open  # the replacement did happen between the marker and the open

    at_open[url] = lambda: pointer(root, b"model-30000.pt")  # another size
    assert read_verified(url) == b"model-30000.pt"
    assert not at_open


def test_a_pointer_whose_marker_goes_between_its_stat_and_its_open_is_incomplete(
        tmp_path: os.PathLike[str], at_open: dict[str, Callable[[], None]]) -> None:
    """The writer's first step (the old marker deleted) landed between the reader's stat of
    the marker and its open: a bare FileNotFoundError named the marker, as if the store
    had lost it. The object has no record at that moment: IncompleteError naming it."""
    root = os.path.realpath(tmp_path)
    url = pointer(root, b"model-1000.pt")
    marker = os.path.join(root, ".durable", "latest", "commit.json")
    at_open[marker] = lambda: os.remove(marker)
    with pytest.raises(IncompleteError) as info:
        read_verified(url)
    assert not at_open
    assert str(info.value).startswith(f"file://{url}: no commit record covers this object")


def test_an_object_replaced_at_every_read_is_named_as_replaced_never_corrupt(
        tmp_path: os.PathLike[str], at_open: dict[str, Callable[[], None]]) -> None:
    """Read again at most 3 times; a writer replacing it under every read is named so."""
    root = os.path.realpath(tmp_path)
    url = pointer(root, b"model-0.pt")
    versions = iter(b"model-%d.pt" % i for i in range(1, 10))

    def replace() -> None:
        pointer(root, next(versions))
        at_open[url] = replace  # and again at the next read

    at_open[url] = replace
    with pytest.raises(IntegrityError) as info:
        read_verified(url)
    assert str(info.value).startswith(f"file://{url}: replaced while it was read, 3 times")
    assert "corrupt" not in str(info.value)
    assert next(versions) == b"model-4.pt"  # three reads, three replacements


def test_bytes_damaged_under_an_unchanged_record_are_corrupt_at_once(
        tmp_path: os.PathLike[str], at_open: dict[str, Callable[[], None]]) -> None:
    """Only a record that changed is read again: a flipped byte is corrupt, first time."""
    root = os.path.realpath(tmp_path)
    url = pointer(root, b"model-1000.pt")

    def flip() -> None:
        with open(url, "r+b") as f:
            f.write(b"M")
    at_open[url] = flip
    with pytest.raises(IntegrityError, match=r"\(corrupt data\)"):
        read_verified(url)
    assert not at_open


def test_an_unrecorded_object_replaced_as_it_is_read_is_incomplete(
        tmp_path: os.PathLike[str], at_open: dict[str, Callable[[], None]]) -> None:
    """Between the old marker's removal and the new one's write, the object has no record:
    read to rule out an error page, a stat then an open raced the rename over it ("replaced
    since it was listed", for a read that listed nothing). It is unrecorded: IncompleteError."""
    root = os.path.realpath(tmp_path)
    place = Place("file", root)
    place.write("latest", b"model-1000.pt")
    url = os.path.join(root, "latest")
    at_open[url] = lambda: replace_object(place, "latest", b"model-2000.pt")
    with pytest.raises(IncompleteError, match="no commit record covers this object"):
        read_verified(url)
    assert not at_open


@pytest.mark.parametrize("how", ["open_verified", "durable::"])
def test_a_pointer_replaced_between_its_stat_and_its_open_is_opened_again(
        tmp_path: os.PathLike[str], at_open: dict[str, Callable[[], None]], how: str) -> None:
    """A stat, the record, then the open pinned to the stat's version: a writer replacing
    the object in between made the open "replaced since it was listed", for a read that
    listed nothing. Nothing was handed out yet: opened again, the new pointer is read."""
    import fsspec

    root = os.path.realpath(tmp_path)
    url = pointer(root, b"model-1000.pt")
    at_open[url] = lambda: pointer(root, b"model-2000.pt")
    if how == "open_verified":
        with open_verified(url) as f:
            assert f.read() == b"model-2000.pt"
    else:
        with fsspec.open(f"durable::{url}", "rb") as f:
            assert f.read() == b"model-2000.pt"
    assert not at_open  # the replacement did happen between the stat and the open


def test_a_whole_read_takes_large_blocks_and_no_second_copy(
        tmp_path: os.PathLike[str]) -> None:
    """``open_verified(url).read()`` read 8 KiB at a time (io.RawIOBase.readall): 1 GiB
    on a local disk took 30 s, 200 MB from moto 18 s. And a read of the whole object in
    one call (durable::'s cat_file) took it from the store as one chunk and copied it,
    twice its size in memory, as did the first. Both read in blocks, the bytes held once,
    checked as before."""
    import tracemalloc

    import fsspec

    data = os.urandom(64 * 1024 * 1024 + 3)
    url = os.path.join(os.path.realpath(tmp_path), "blob.bin")
    with atomic_write(url) as f:
        f.write(data)
    fs, path = fsspec.url_to_fs(f"durable::{url}")

    def whole() -> bytes:
        with open_verified(url) as f:
            return f.read()

    for read in (lambda: fs.cat_file(path), whole):
        tracemalloc.start()
        try:
            got = read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got == data
        assert peak < 1.5 * len(data), peak  # read, then copied: twice its size
    # Read whole in one call, bytes cut short or changed are still refused.
    with open(url, "r+b") as g:
        g.seek(5)
        g.write(b"\x00" if data[5] else b"\x01")
    with pytest.raises(IntegrityError, match="CRC32C"), open_verified(url) as f:
        f.read()
    os.truncate(url, len(data) - 1)
    with pytest.raises(IntegrityError), open_verified(url) as f:
        f.read()
