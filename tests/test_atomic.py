"""atomic_write: the target appears whole with its record, or nothing changes at all.

Incident 003: a file renamed into place that another reader saw as a prefix, and a record
that could not tell whole from partial. Each check reads the store around durable (plain
os / the raw memory store) and computes CRC32C with the `crc32c` package itself.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import crc32c
import fsspec
import pytest

import durable
import durable._background
import durable.adapters
from conftest import Place
from durable import IncompleteError, atomic_write, read_verified
from durable.testing.pytest_plugin import Bucket

MARKER = ".durable/{}/commit.json"
# Over atomic_write's 1 MiB buffer: the bytes have reached the temp file when we raise.
BIG = os.urandom(3 * 1024 * 1024 + 17)


def marker_doc(place: Place, name: str) -> dict[str, object]:
    raw = place.read(MARKER.format(name))
    assert raw is not None, f"no marker for {name}"
    doc: dict[str, object] = json.loads(raw)
    return doc


def recorded(place: Place, name: str) -> dict[str, object]:
    manifest = marker_doc(place, name)["manifest"]
    assert isinstance(manifest, dict) and list(manifest) == [""]
    rec: dict[str, object] = manifest[""]
    return rec


def test_clean_exit_publishes_whole_object_with_record(place: Place) -> None:
    with atomic_write(place.url("a.bin")) as f:
        f.write(BIG[:1000])
        f.write(BIG[1000:])

    assert place.read("a.bin") == BIG
    assert recorded(place, "a.bin") == {"size": len(BIG),
                                        "crc32c": f"{crc32c.crc32c(BIG):08x}"}
    assert marker_doc(place, "a.bin")["kind"] == "object"
    assert read_verified(place.url("a.bin")) == BIG
    assert durable.Entry(place.url("a.bin")).state() is durable.State.COMPLETE


@pytest.mark.parametrize("exc", [ValueError("boom"), KeyboardInterrupt()])
@pytest.mark.parametrize("mode", ["wb", "w", "xb"])
def test_exception_leaves_no_target_and_no_temp(place: Place, exc: BaseException,
                                                mode: str) -> None:
    place.write("sentinel", b"outside")
    before = place.files()
    payload: bytes | str = BIG if "b" in mode else BIG.hex()
    with pytest.raises(type(exc)), atomic_write(place.url("a.bin"), mode) as f:
        f.write(payload)
        f.flush()
        if place.kind == "file":
            # The bytes really are on disk in a temp file: the cleanup below is not vacuous.
            assert any(".durable-tmp-" in name for name in os.listdir(place.root))
        raise exc
    assert place.files() == before


@pytest.mark.parametrize("exc", [ValueError("boom"), KeyboardInterrupt()])
@pytest.mark.parametrize("mode", ["wb", "w"])
def test_exception_leaves_previous_target_and_marker_untouched(
        place: Place, exc: BaseException, mode: str) -> None:
    old = os.urandom(5000)
    with atomic_write(place.url("a.bin")) as f:
        f.write(old)
    before = place.files()
    payload: bytes | str = BIG if "b" in mode else BIG.hex()
    with pytest.raises(type(exc)), atomic_write(place.url("a.bin"), mode) as f:
        f.write(payload)
        raise exc
    # Byte for byte: the old object, its old marker, and no temp file anywhere.
    assert place.files() == before
    assert read_verified(place.url("a.bin")) == old


@pytest.mark.parametrize("mode", ["xb", "x"])
def test_create_only_refuses_existing_target_and_leaves_it(place: Place, mode: str) -> None:
    with atomic_write(place.url("a.bin")) as f:
        f.write(b"first")
    before = place.files()
    with pytest.raises(FileExistsError), atomic_write(place.url("a.bin"), mode) as f:
        f.write(b"second" if "b" in mode else "second")
    assert place.files() == before
    # The refused write did not take the record away from the object it left in place.
    assert read_verified(place.url("a.bin")) == b"first"


def test_a_file_in_the_way_of_a_directory_is_named(tmp_path: Path) -> None:
    """A regular file where the target's directory must go: the error says so and names
    it (it was a bare 'File exists'), and the half-made temp file is dropped without the
    'Exception ignored in AtomicFile.__del__' traceback of a half-initialised file."""
    import gc
    import sys

    (tmp_path / "model.pt").write_bytes(b"a file")
    seen: list[object] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(u.exc_value)
    try:
        with pytest.raises(NotADirectoryError, match="a file is where a directory is "
                           "needed") as err, atomic_write(str(tmp_path / "model.pt" / "x")):
            pass
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert err.value.filename == str(tmp_path / "model.pt")
    assert seen == []


def test_a_temp_file_cleaned_away_mid_write_is_an_error_saying_so(tmp_path: Path) -> None:
    """`durable clean --older-than` shorter than a write removes its temp file as a killed
    writer's: the write failed with a bare ENOENT of the rename, naming only the temp."""
    from click.testing import CliRunner

    from durable.cli import cli

    target = tmp_path / "m.pt"
    with pytest.raises(FileNotFoundError, match=r"m\.pt: not published: its temp file "
                       r"was removed while it was being written \(by `durable clean`"), \
            atomic_write(str(target)) as f:
        f.write(b"x" * 1000)
        done = CliRunner().invoke(cli, ["clean", str(tmp_path), "--older-than", "0s",
                                         "--apply", "--json"])
        assert [i["kind"] for i in json.loads(done.stdout)["items"]] == ["temp"]
        f.write(b"y")
    assert os.listdir(tmp_path) == []  # nothing published


def test_create_only_creates_when_absent(place: Place) -> None:
    with atomic_write(place.url("new.bin"), "xb") as f:
        f.write(b"created")
    assert place.read("new.bin") == b"created"
    assert read_verified(place.url("new.bin")) == b"created"


def test_text_mode(place: Place) -> None:
    text = "héllo\nwörld\n" * 1000
    with atomic_write(place.url("t.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    data = text.encode("utf-8")
    assert place.read("t.txt") == data
    assert recorded(place, "t.txt") == {"size": len(data),
                                        "crc32c": f"{crc32c.crc32c(data):08x}"}
    assert read_verified(place.url("t.txt")).decode("utf-8") == text


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-32"])
def test_text_mode_tells_and_writes_as_a_plain_file(place: Place, tmp_path: Path,
                                                     encoding: str) -> None:
    """Over a buffer that could not seek, io.TextIOWrapper refused tell() ("underlying
    stream is not seekable") and wrote utf-16/utf-32 with no BOM: other bytes than a plain
    file opened for writing. A seek that would move is still refused."""
    plain = tmp_path / "plain.txt"
    with open(plain, "w", encoding=encoding) as p:
        p.write("héllo")
        plain_at = p.tell()
    with atomic_write(place.url("t.txt"), "w", encoding=encoding) as f:
        assert f.tell() == 0
        f.write("héllo")
        assert f.tell() == plain_at
        with pytest.raises(io.UnsupportedOperation, match="only appends"):
            f.seek(0)
    assert place.read("t.txt") == plain.read_bytes()


def test_text_mode_latin1_newline(place: Place) -> None:
    with atomic_write(place.url("t.txt"), "w", encoding="latin-1", newline="\r\n") as f:
        f.write("é\n")
    assert place.read("t.txt") == b"\xe9\r\n"


def test_overwrite_replaces_the_record(place: Place) -> None:
    with atomic_write(place.url("a.bin")) as f:
        f.write(b"version one")
    first = marker_doc(place, "a.bin")
    new = os.urandom(70_000)
    with atomic_write(place.url("a.bin")) as f:
        f.write(new)
    second = marker_doc(place, "a.bin")
    assert second["attempt"] != first["attempt"]
    assert recorded(place, "a.bin") == {"size": len(new),
                                        "crc32c": f"{crc32c.crc32c(new):08x}"}
    assert read_verified(place.url("a.bin")) == new
    # One object and one marker: no temp files or stale records beside them.
    assert sorted(place.files()) == sorted(["a.bin", MARKER.format("a.bin")])


def test_record_false_writes_no_marker(place: Place) -> None:
    with atomic_write(place.url("a.bin"), record=False) as f:
        f.write(b"plain")
    assert place.files() == {"a.bin": b"plain"}
    with pytest.raises(IncompleteError):
        read_verified(place.url("a.bin"))


def test_record_false_over_a_recorded_object_removes_the_old_record(place: Place) -> None:
    """The old record would call the new bytes corrupt (same size: COMPLETE by its stat)."""
    with atomic_write(place.url("a.bin")) as f:
        f.write(b"version one")
    with atomic_write(place.url("a.bin"), record=False) as f:
        f.write(b"version two")
    assert place.files() == {"a.bin": b"version two"}
    assert durable.Entry(place.url("a.bin")).state() is durable.State.INCOMPLETE
    with pytest.raises(IncompleteError, match="no commit record covers"):
        read_verified(place.url("a.bin"))


def _racing(monkeypatch: pytest.MonkeyPatch, url: str, other: bytes,
            options: dict[str, object] | None = None) -> None:
    """Another writer's whole atomic_write of ``url`` runs between this writer's publish
    and its marker (the interleaving two processes writing one path can hit)."""
    adapter, _ = durable.adapters.resolve(url, options)
    cls = type(adapter)
    original = cls.verify_written
    ran: list[bool] = []

    def verify_then_race(self: object, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        if not ran:
            ran.append(True)
            with atomic_write(url, storage_options=options) as f:
                f.write(other)

    monkeypatch.setattr(cls, "verify_written", verify_then_race)


def _never_an_old_record_over_new_bytes(url: str, theirs: bytes,
                                        options: dict[str, object] | None = None) -> None:
    entry = durable.Entry(url, storage_options=options)
    try:
        got = read_verified(url, storage_options=options)
    except IncompleteError:
        assert entry.state() is durable.State.INCOMPLETE  # visible, never COMPLETE
    else:
        assert got == theirs and entry.state() is durable.State.COMPLETE


@pytest.mark.parametrize("how", ["atomic_write", "durable::"])
def test_a_writer_overtaken_between_its_publish_and_its_marker_takes_its_marker_back(
        place: Place, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    url = place.url("a.bin")
    with atomic_write(url) as f:
        f.write(b"version zero")
    _racing(monkeypatch, url, b"theirs, written last")
    with (atomic_write(url) if how == "atomic_write" else
          fsspec.open(f"durable::{durable.Entry(url).url}", "wb")) as f:
        f.write(b"mine, published first")
    assert place.read("a.bin") == b"theirs, written last"
    _never_an_old_record_over_new_bytes(url, b"theirs, written last")


def test_a_writer_overtaken_before_its_check_never_removes_the_other_writers_object(
        place: Place, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer's whole atomic_write lands between this writer's publish and its
    verify-after-write stat: the stat finds their object (another size). It used to be an
    IntegrityError ("wrote N bytes, the store holds M") and the object at the path, theirs
    and COMPLETE, was deleted."""
    url = place.url("a.bin")
    adapter, _ = durable.adapters.resolve(url)
    cls = type(adapter)
    original = cls.verify_written
    ran: list[bool] = []

    def race_then_verify(self: object, *args: object, **kwargs: object) -> None:
        if not ran:
            ran.append(True)
            with atomic_write(url) as f:
                f.write(b"theirs, written last and longer")
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cls, "verify_written", race_then_verify)
    with atomic_write(url) as f:
        f.write(b"mine, published first")
    assert ran
    assert place.read("a.bin") == b"theirs, written last and longer"
    assert read_verified(url) == b"theirs, written last and longer"
    assert durable.Entry(url).state() is durable.State.COMPLETE


def test_a_marker_removed_as_it_is_withdrawn_is_no_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An overtaken writer withdraws its marker (a conditional delete) just as a third
    writer's publish removes the marker (a plain delete, no lock): on a local disk the
    check passed and the unlink found nothing, and atomic_write raised FileNotFoundError
    naming the marker for a write that was whole. Gone is "not at that version"."""
    from durable.adapters.local import LocalAdapter

    url = str(tmp_path / "a.bin")
    _racing(monkeypatch, url, b"theirs, written last")
    original = LocalAdapter._check_version
    removed: list[str] = []

    def check_then_removed(self: LocalAdapter, path: str, version: str) -> None:
        original(self, path, version)
        if path.endswith("commit.json") and not removed:
            removed.append(path)
            os.unlink(path)  # another writer's plain delete of the marker, right now

    monkeypatch.setattr(LocalAdapter, "_check_version", check_then_removed)
    with atomic_write(url) as f:
        f.write(b"mine, published first")
    assert removed
    assert Path(url).read_bytes() == b"theirs, written last"
    _never_an_old_record_over_new_bytes(url, b"theirs, written last")


def test_a_multipart_writer_overtaken_on_s3_takes_its_marker_back(
        s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the part size the record is a marker beside the object on S3 too."""
    url = f"s3://{s3_bucket.name}/big.bin"
    opts = s3_bucket.storage_options
    theirs = os.urandom(9 * 1024 * 1024)
    _racing(monkeypatch, url, theirs, opts)
    with atomic_write(url, storage_options=opts) as f:
        f.write(os.urandom(9 * 1024 * 1024))
    _never_an_old_record_over_new_bytes(url, theirs, opts)


def test_bad_mode_is_refused_before_anything_is_written(place: Place) -> None:
    with pytest.raises(ValueError, match="mode"), atomic_write(place.url("a.bin"), "ab"):
        pass  # pragma: no cover
    assert place.files() == {}


def test_data_given_as_the_mode_is_refused_at_the_call(place: Place) -> None:
    """`atomic_write(url, data)` without `with`: it wrote nothing and said nothing (the
    arguments were looked at only when a block was entered, and none was)."""
    with pytest.raises(TypeError, match="context manager") as err:
        atomic_write(place.url("a.bin"), b"the data")  # type: ignore[arg-type]
    assert "with durable.atomic_write(url) as f" in str(err.value)
    with pytest.raises(ValueError, match="mode"):
        atomic_write(place.url("a.bin"), "rb")  # no `with`: refused all the same
    assert place.files() == {}


def test_handle_is_a_real_binary_file(place: Place) -> None:
    """Code that writes to a file object (np.save, pickle, zipfile) works on it."""
    import pickle

    obj = {"k": list(range(1000))}
    with atomic_write(place.url("o.pkl")) as f:
        assert isinstance(f, io.BufferedIOBase)
        pickle.dump(obj, f)
    assert pickle.loads(read_verified(place.url("o.pkl"))) == obj


def test_a_directory_is_not_a_file_to_write(tmp_path: Path) -> None:
    """atomic_write onto a directory named its own temp file in the error, and a URL
    ending in '/' was written as a file of that name."""
    (tmp_path / "d").mkdir()
    for target in (tmp_path / "d", f"{tmp_path}/newdir/"):
        with pytest.raises(IsADirectoryError, match="a directory, not a file") as err, \
                atomic_write(str(target)):
            pass
        assert err.value.filename == str(target)
    assert sorted(os.listdir(tmp_path)) == ["d"] and os.listdir(tmp_path / "d") == []


def _codeword(data: bytes) -> bytes:
    """``data`` ending in its CRC32C, as zarr's crc32c codec stores a chunk."""
    return data + crc32c.crc32c(data).to_bytes(4, "little")


def test_a_codeword_object_replaced_by_another_of_its_size_is_caught(place: Place) -> None:
    """Every object ending in its own CRC32C has the same CRC32C (the residue): only its
    last 4 bytes (the record's tail) tell two of one size apart. atomic_write kept none,
    so another such object put in its place read back as verified."""
    with atomic_write(place.url("chunk")) as f:
        f.write(_codeword(b"the committed chunk"))
    assert "tail" in recorded(place, "chunk")
    place.write("chunk", _codeword(b"another attempt's!!"))
    with pytest.raises(durable.IntegrityError, match="chunk"):
        read_verified(place.url("chunk"))


def _refused_inside(url: str, outer: durable.Entry, so: dict[str, object] | None = None,
                    **kw: object) -> None:
    with pytest.raises(durable.EntryExistsError) as refused, \
            atomic_write(url, storage_options=so, **kw) as f:  # type: ignore[arg-type]
        f.write("new" if kw.get("mode") == "w" else b"new")
    assert isinstance(refused.value, FileExistsError)
    assert f"inside the committed entry {outer.url}," in str(refused.value)


def test_inside_a_committed_entry_nothing_is_written(place: Place) -> None:
    """atomic_write of a path inside a COMPLETE directory entry went through: the entry
    stayed COMPLETE over bytes its marker did not describe (verify failed later), or
    beside an object its manifest never listed. Refused, naming both, before any byte
    (no temp file, no directory made, no marker touched)."""
    outer = durable.Entry(place.url("ds"))
    with outer.writing() as w:
        w.write_bytes("a", b"1")
        w.write_bytes("sub/b", b"22")
    before = place.files()
    for key, kw in (("a", {}), ("sub/b", {"record": False}), ("new", {"mode": "xb"}),
                    ("deeper/new", {}), ("sub/c.txt", {"mode": "w"})):
        _refused_inside(place.url("ds", key), outer, **kw)
        assert place.files() == before, key
    assert outer.state() is durable.State.COMPLETE and outer.verify(deep=True).ok
    with atomic_write(place.url("beside")) as f:  # beside the entry, as before
        f.write(b"ok")
    assert read_verified(place.url("beside")) == b"ok"


def test_inside_a_committed_entry_on_s3_nothing_is_written(s3_bucket: Bucket) -> None:
    so = dict(s3_bucket.storage_options)
    outer = durable.Entry(s3_bucket.path("p", "ds"), storage_options=so)
    with outer.writing() as w:
        w.write_bytes("a", b"1")
    durable._background.wait()  # the attempt record's removal, handed to a thread
    fs = fsspec.filesystem("s3", **so)
    before = sorted(fs.find(s3_bucket.name))
    for key in ("a", "sub/deep/new"):
        _refused_inside(s3_bucket.path("p", "ds", key), outer, so)
        fs.invalidate_cache()
        assert sorted(fs.find(s3_bucket.name)) == before
    assert outer.verify(deep=True).ok


def test_a_folder_committed_here_is_refused_at_once_on_s3(s3_bucket: Bucket) -> None:
    """A write into a folder found clear of committed entries skips the look for a few
    seconds on a store across a network (a round trip per small object). A commit by this
    process ends that at once: the folder it committed, seen clear a moment before, is
    refused, not written into."""
    so = dict(s3_bucket.storage_options)
    with atomic_write(s3_bucket.path("run", "ds", "a"), storage_options=so) as f:
        f.write(b"1")  # the folder run/ds is seen clear
    outer = durable.Entry(s3_bucket.path("run", "ds"), storage_options=so)
    outer.mark_complete()
    _refused_inside(s3_bucket.path("run", "ds", "b"), outer, so)
    assert outer.verify(deep=True).ok


_FULL_DISK = """
import os, resource, signal, sys
import durable

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
try:
    with durable.atomic_write(sys.argv[1]) as f:
        f.write(b"w" * (4 << 20))
except OSError as exc:
    print(type(exc).__name__, exc.errno, exc.filename, "|", exc)
"""


def test_a_disk_refusing_the_bytes_is_an_error_naming_the_object(tmp_path: Path) -> None:
    """A checkpoint written to a disk that runs out of room (here a file size limit: the
    kernel refuses the write as it refuses one to a full disk): "[Errno 27] File too
    large" or "[Errno 28] No space left on device", naming nothing, from a training loop
    writing many files. It names the object, and nothing is left behind."""
    import subprocess
    import sys

    target = tmp_path / "ckpt" / "model.npy"
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(target)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.startswith("OSError 27 ") and str(target) in out, out
    assert "not published" in out
    assert os.listdir(tmp_path / "ckpt") == []


def test_a_name_as_long_as_the_file_system_takes_is_written(tmp_path: Path) -> None:
    """A file name of 255 bytes (NAME_MAX of ext4, xfs, btrfs: a valid name, as hashed or
    descriptive shard names reach) could not be written: its temp file, `.NAME` plus
    durable's mark, was longer than the file system takes, and the open failed with a
    bare ENAMETOOLONG naming the temp (then again, ignored, from the garbage collector).
    The temp's name is shortened instead; the object lands under its own name."""
    root = os.path.realpath(tmp_path)
    for name in ("x" * 255, "\u00e9" * 127):  # 255 bytes; 254 bytes of 2-byte characters
        url = os.path.join(root, "ckpt", name)
        with atomic_write(url) as f:
            f.write(b"payload")
        with open(url, "rb") as g:
            assert g.read() == b"payload"
        assert read_verified(url) == b"payload"
        entry = durable.Entry(os.path.join(root, "shard"))
        with entry.writing(overwrite=True) as w:
            w.fs.pipe_file(f"{w.path}/{name}", b"chunk")
        assert read_verified(os.path.join(entry.path, name)) == b"chunk"
        assert sorted(os.listdir(entry.path)) == [name]  # no temp left beside it
