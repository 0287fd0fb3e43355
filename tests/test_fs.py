"""The ``durable::`` fsspec protocol, driven by real libraries that write through fsspec.

Every test runs on each place in PLACES; what was written is checked with the inner
filesystem directly (around durable). To add a backend (S3: moto), append its name to
PLACES and add a ``<name>_place`` fixture returning a `Place` (for S3: the bucket's
s3fs options as ``inner_options``, ``{"s3": options}`` as ``storage_options``, a
``truncate`` that puts a shorter object with boto3, and ``metadata`` reading an object's user
metadata: an object published by one PutObject carries its record there, not in a marker).

On S3 (moto) a place also lists the multipart uploads left in its bucket (``uploads``,
through boto3): a write interrupted there must leave no object *and* no upload. The S3
place uses parts of 5 MiB (S3's minimum), so the larger writes of these tests really go
multipart; the tests at the end write through the fault proxy (no faults) to see from its
request log that parts went out before the failure, and that the upload was aborted.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import importlib.metadata
import io
import os
import subprocess
import sys
import textwrap
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pandas as pd
import pytest
from fsspec.implementations.memory import MemoryFile

import durable
import durable._background
from durable import IntegrityError, UnsupportedError
from durable._checksum import crc32c
from durable._protocol import Layout, Marker, carries_record
from durable.adapters import adapter_for_fs
from durable.adapters.s3 import MIN_PART_SIZE, S3Adapter
from durable.fs import DurableFileSystem
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket

PLACES = ["local", "memory", "s3"]


@dataclass
class Place:
    """A fresh, empty directory or prefix, seen through its inner filesystem."""

    root: str  # the inner filesystem's path
    inner: Any  # the inner fsspec filesystem: raw access around durable
    inner_options: dict[str, Any]  # storage_options of inner URLs (durable's own API)
    storage_options: dict[str, Any] | None  # what fsspec.open / pandas take for durable::
    # really shorten an object behind durable's back (its metadata, so its record, kept)
    truncate: Callable[[str, int], None]
    # multipart uploads in progress (only object stores have any)
    uploads: Callable[[], list[Any]] = list
    # an object's user metadata, where the store keeps it (S3); {} elsewhere
    metadata: Callable[[str], dict[str, str]] = lambda path: {}
    # put other bytes behind durable's back, the object's metadata (its record) kept
    replace: Callable[[str, bytes], None] | None = None

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def url(self, key: str) -> str:
        return f"durable::{self.inner.unstrip_protocol(self.path(key))}"

    @property
    def so(self) -> dict[str, Any]:
        return dict(self.storage_options or {})

    def objects(self) -> list[str]:
        """Everything below the root, records and temp files included."""
        self.inner.invalidate_cache()
        return sorted(self.inner.find(self.root))

    def marker(self, key: str) -> Marker | None:
        m = Layout(self.path(key)).marker
        return Marker.decode(self.inner.cat_file(m), m) if self.inner.exists(m) else None

    def record(self, key: str) -> Marker | None:
        """The object's record as every reader takes it: from its own metadata where it
        carries one (S3, one PutObject; a marker beside it is superseded), else its marker."""
        fields = self.metadata(self.path(key))
        if carries_record(fields):
            return Marker.from_metadata(fields, self.path(key))
        return self.marker(key)

    def rewrite(self, key: str, data: bytes) -> None:
        """Other bytes under the name, around durable: its record still says the old ones."""
        if self.replace is not None:
            self.replace(self.path(key), data)
        else:
            self.inner.pipe_file(self.path(key), data)


@pytest.fixture
def local_place(tmp_path: Path) -> Place:
    root = tmp_path / "data"
    root.mkdir()
    # storage_options=None: pandas' default, which first offers the URL to pyarrow.
    return Place(str(root), fsspec.filesystem("file"), {}, None, os.truncate)


@pytest.fixture
def memory_place() -> Iterator[Place]:
    mem = fsspec.filesystem("memory")
    root = f"/fs-{uuid.uuid4().hex}"

    def truncate(path: str, size: int) -> None:
        mem.store[path] = MemoryFile(mem, path, mem.store[path].getvalue()[:size])

    yield Place(root, mem, {}, {}, truncate)
    if mem.exists(root):
        mem.rm(root, recursive=True)


@pytest.fixture
def s3_boto(s3_bucket: Bucket) -> Iterator[Any]:
    """A plain boto3 client on the bucket's moto server: the view from outside durable."""
    import boto3  # type: ignore[import-untyped]

    client = boto3.client("s3", endpoint_url=s3_bucket.server.url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    yield client
    client.close()


def _s3_place(bucket: Bucket, boto: Any, options: dict[str, Any]) -> Iterator[Place]:
    inner = fsspec.filesystem("s3", **options)
    # The adapter durable:: resolves for these options (fsspec caches the filesystem): the
    # smallest part size S3 allows, so that writes of a few MiB are multipart uploads.
    adapter = adapter_for_fs(inner)
    assert isinstance(adapter, S3Adapter)
    saved, adapter.part_size = adapter.part_size, MIN_PART_SIZE

    def metadata(path: str) -> dict[str, str]:
        try:
            head = boto.head_object(Bucket=bucket.name, Key=path.split("/", 1)[1])
        except boto.exceptions.ClientError:
            return {}  # absent
        return dict(head["Metadata"])

    def replace(path: str, data: bytes) -> None:
        # A store that lost or changed bytes keeps the object's metadata: its record (a
        # plain overwrite that drops it is test_object_metadata_record's case).
        boto.put_object(Bucket=bucket.name, Key=path.split("/", 1)[1], Body=data,
                        Metadata=metadata(path))

    def truncate(path: str, size: int) -> None:
        data = boto.get_object(Bucket=bucket.name, Key=path.split("/", 1)[1])["Body"].read()
        replace(path, data[:size])

    def uploads() -> list[Any]:
        return list(boto.list_multipart_uploads(Bucket=bucket.name).get("Uploads", []))

    try:
        yield Place(f"{bucket.name}/data", inner, options, {"s3": options}, truncate, uploads,
                    metadata, replace)
    finally:
        adapter.part_size = saved


@pytest.fixture
def s3_place(s3_bucket: Bucket, s3_boto: Any) -> Iterator[Place]:
    yield from _s3_place(s3_bucket, s3_boto, s3_bucket.storage_options)


@pytest.fixture(params=PLACES)
def place(request: pytest.FixtureRequest) -> Place:
    result: Place = request.getfixturevalue(f"{request.param}_place")
    return result


class Boom(Exception):
    pass


def _frame(n: int = 2000) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame({"i": np.arange(n), "x": rng.random(n), "s": [f"r{i}" for i in range(n)]})


def _frame_failing_in_parquet(n: int = 50_000) -> pd.DataFrame:
    # The last timestamp has nanoseconds: written with coerce_timestamps="ms", pyarrow
    # writes row groups until it reaches it, then raises (a real mid-write failure).
    ns = np.arange(n, dtype="int64") * 1_000_000_000
    ns[-1] += 1
    return pd.DataFrame({"t": ns.astype("datetime64[ns]"), "x": np.arange(n, dtype="f8")})


class Unprintable:
    def __str__(self) -> str:
        raise ValueError("this cell cannot be serialized")


def _frame_failing_in_csv(n: int = 100_000) -> pd.DataFrame:
    return pd.DataFrame({"o": [*(f"row {i}" for i in range(n)), Unprintable()]})


def _failing_write(fmt: str, url: str, storage_options: dict[str, Any] | None) -> None:
    if fmt == "parquet":
        _frame_failing_in_parquet().to_parquet(url, storage_options=storage_options,
                                               coerce_timestamps="ms", row_group_size=1000)
    else:
        _frame_failing_in_csv().to_csv(url, storage_options=storage_options, chunksize=1000)


# -- the protocol itself -------------------------------------------------------------------
def test_registered_through_the_entry_point_and_on_import() -> None:
    (ep,) = [e for e in importlib.metadata.entry_points(group="fsspec.specs")
             if e.name == "durable"]
    assert ep.value == "durable.fs:DurableFileSystem"
    assert fsspec.get_filesystem_class("durable") is DurableFileSystem


def test_options_chain_to_the_inner_filesystem(tmp_path: Path) -> None:
    url = f"durable::file://{tmp_path}/x"
    fs, path = fsspec.url_to_fs(url, file={"auto_mkdir": True}, durable={"verify": "full"})
    assert isinstance(fs, DurableFileSystem) and path == f"{tmp_path}/x"
    assert fs.fs.auto_mkdir is True and fs.verify == "full"
    # Top-level options that are not durable's go to the inner filesystem, not nowhere.
    fs2, _ = fsspec.url_to_fs(url, auto_mkdir=True)
    assert fs2.fs.auto_mkdir is True
    fs3 = fsspec.filesystem("durable", target_protocol="memory")
    assert type(fs3.fs).__name__ == "MemoryFileSystem"
    with pytest.raises(ValueError, match="wraps another filesystem"):
        fsspec.filesystem("durable", skip_instance_cache=True)
    with pytest.raises(ValueError, match="verify"):
        fsspec.filesystem("durable", target_protocol="memory", verify="sometimes")


def test_a_durable_url_given_to_durables_own_api_is_refused_naming_the_url_to_give(
        place: Place) -> None:
    """A ``durable::`` URL (kept in a config for pandas) handed to `durable.atomic_write`
    or `durable.Entry` resolved to the generic adapter over the durable:: filesystem:
    atomic_write published the object, then failed writing its marker with "paths inside
    '.durable' directories hold durable's records", and Entry.writing failed the same way,
    neither saying what was wrong. Refused before anything is written, naming the URL to
    give instead (the store's own: durable's API records and verifies by itself)."""
    url = place.url("ckpt.npz")
    inner = url[len("durable::"):]
    so = place.inner_options

    def write() -> None:
        with durable.atomic_write(url, storage_options=so) as f:
            f.write(b"weights")

    calls: list[Callable[[], object]] = [
        write, lambda: durable.Entry(url, storage_options=so),
        lambda: durable.read_verified(url, storage_options=so),
        lambda: durable.Lease(url, storage_options=so),
        lambda: durable.cached(url, storage_options=so)(lambda_free)(1)]
    for call in calls:
        with pytest.raises(ValueError, match="durable::") as info:
            call()
        assert repr(inner) in str(info.value)
    assert place.objects() == []


def lambda_free(x: int) -> int:
    return x


def test_pickles_for_workers(place: Place) -> None:
    import pickle

    fs, path = fsspec.url_to_fs(place.url("p.bin"), **place.so)
    fs.pipe_file(path, b"abc")
    clone = pickle.loads(pickle.dumps(fs))
    assert isinstance(clone, DurableFileSystem) and clone.cat_file(path) == b"abc"


# -- writes are whole and recorded ------------------------------------------------------------
def test_write_is_whole_and_recorded(place: Place) -> None:
    data = os.urandom(3 * 1024 * 1024 + 5)
    with fsspec.open(place.url("sub/x.bin"), "wb", **place.so) as f:
        for i in range(0, len(data), 700_001):
            f.write(data[i:i + 700_001])
        assert not place.inner.exists(place.path("sub/x.bin")), "visible before close"
    assert place.inner.cat_file(place.path("sub/x.bin")) == data
    marker = place.record("sub/x.bin")
    assert marker is not None and marker.kind == "object" and marker.manifest is not None
    assert marker.manifest.objects[""].size == len(data)
    with fsspec.open(place.url("sub/x.bin"), "rb", **place.so) as f:
        assert f.read() == data
    # The same record durable.atomic_write leaves: the public reader accepts it.
    inner_url = place.inner.unstrip_protocol(place.path("sub/x.bin"))
    assert durable.read_verified(inner_url, storage_options=place.inner_options) == data


def test_numpy_save_and_load(place: Place) -> None:
    arr = np.random.default_rng(1).random((300, 200))
    with fsspec.open(place.url("a.npy"), "wb", **place.so) as f:
        np.save(f, arr)
    with fsspec.open(place.url("a.npy"), "rb", **place.so) as f:
        np.testing.assert_array_equal(np.load(f), arr)
    assert place.record("a.npy") is not None


def test_pandas_parquet_round_trip(place: Place) -> None:
    df = _frame()
    df.to_parquet(place.url("t.parquet"), storage_options=place.storage_options)
    assert place.record("t.parquet") is not None
    back = pd.read_parquet(place.url("t.parquet"), storage_options=place.storage_options)
    pd.testing.assert_frame_equal(back, df)


def test_text_mode_round_trip(place: Place) -> None:
    with fsspec.open(place.url("t.txt"), "w", encoding="utf-8", **place.so) as f:
        f.write("grüße\n" * 1000)
    with fsspec.open(place.url("t.txt"), "r", encoding="utf-8", **place.so) as f:
        assert f.read() == "grüße\n" * 1000


def test_text_mode_tells_and_writes_as_a_plain_file(place: Place, tmp_path: Path) -> None:
    """fs.open(..., "w") and an entry writer's text files: tell() raised "underlying stream
    is not seekable", and utf-16 went out with no BOM (other bytes than a plain file)."""
    plain = tmp_path / "plain.txt"
    plain.write_text("grüße", encoding="utf-16")
    fs, path = fsspec.url_to_fs(place.url("t.txt"), **place.so)
    with fs.open(path, "w", encoding="utf-16") as f:
        f.write("grüße")
        assert f.tell() == plain.stat().st_size
    entry = durable.Entry(place.inner.unstrip_protocol(place.path("e")),
                          storage_options=place.inner_options)
    with entry.writing() as w, w.fs.open(f"{w.path}/t.txt", "w", encoding="utf-16") as g:
        g.write("grüße")
        assert g.tell() == plain.stat().st_size
    assert place.inner.cat_file(path) == plain.read_bytes()
    assert place.inner.cat_file(place.path("e/t.txt")) == plain.read_bytes()


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-32"])
def test_fsspec_open_text_tells_and_writes_as_a_plain_file(place: Place, tmp_path: Path,
                                                           encoding: str) -> None:
    """fsspec.open(..., "w") wraps durable::'s binary file in fsspec's own TextIOWrapper:
    its tell() raised "underlying stream is not seekable" and utf-16/utf-32 went out with
    no BOM. Now as a plain local file opened the same way, position by position and byte
    for byte; and zipfile, which asks the binary file seek(tell()), still streams."""
    plain, told = tmp_path / "plain.txt", {}
    for name, url, so in (("plain", f"file://{plain}", {}), ("durable", place.url("t.txt"),
                                                              place.so)):
        with fsspec.open(url, "w", encoding=encoding, **so) as f:
            told[name] = [f.tell()]
            for text in ("grüße\n", "x" * 5000, "ß"):
                f.write(text)
                told[name].append(f.tell())
    assert told["durable"] == told["plain"]
    assert place.inner.cat_file(place.path("t.txt")) == plain.read_bytes()
    with fsspec.open(place.url("t.zip"), "wb", **place.so) as f, \
            zipfile.ZipFile(f, "w") as z:
        z.writestr("a.txt", "zipped")
    with fsspec.open(place.url("t.zip"), "rb", **place.so) as f:
        assert zipfile.ZipFile(io.BytesIO(f.read())).read("a.txt") == b"zipped"


def test_pipe_put_copy_move_touch_are_recorded(place: Place, tmp_path: Path) -> None:
    fs, root = fsspec.url_to_fs(place.url("ops"), **place.so)
    fs.pipe_file(f"{root}/piped", b"piped bytes")
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{root}/piped", b"other", mode="create")
    local = tmp_path / "upload.bin"
    local.write_bytes(os.urandom(200_000))
    fs.put_file(str(local), f"{root}/put")
    fs.cp_file(f"{root}/put", f"{root}/copied")
    fs.mv(f"{root}/piped", f"{root}/moved")
    fs.touch(f"{root}/empty")
    assert fs.cat_file(f"{root}/moved") == b"piped bytes"
    assert fs.cat_file(f"{root}/copied") == local.read_bytes()
    assert fs.cat_file(f"{root}/empty") == b""
    for key in ("ops/put", "ops/copied", "ops/moved", "ops/empty"):
        assert place.record(key) is not None, key
    assert place.marker("ops/piped") is None and not place.inner.exists(place.path("ops/piped"))


def test_an_upload_of_a_damaged_local_checkpoint_is_refused(place: Place,
                                                            tmp_path: Path) -> None:
    """``put`` reads the local source against its record, as ``cp`` reads its source: a
    checkpoint committed on local disk, then damaged there (a flipped byte; a file cut
    short), was uploaded as it was and recorded with the damaged bytes' own CRC32C, so the
    copy verified deep and every read returned the damage as data."""
    local = tmp_path / "ckpt" / "step-100"
    with durable.Entry(str(local)).writing() as w:
        w.fs.pipe_file(f"{w.path}/model.bin", os.urandom(70_000))
        w.fs.pipe_file(f"{w.path}/meta.json", b'{"step": 100}')
    single = tmp_path / "ckpt" / "model.npz"
    with durable.atomic_write(str(single)) as f:
        f.write(os.urandom(5_000))
    model = local / "model.bin"
    flipped = bytearray(model.read_bytes())
    flipped[1234] ^= 1
    model.write_bytes(bytes(flipped))
    os.truncate(single, 4_000)
    fs, root = fsspec.url_to_fs(place.url("up"), **place.so)
    with pytest.raises(IntegrityError, match=r"model\.bin.*CRC32C"):
        fs.put_file(str(model), f"{root}/model.bin")
    with pytest.raises(IntegrityError, match=r"model\.npz.*5000 bytes.*4000"):
        fs.put_file(str(single), f"{root}/model.npz")
    with pytest.raises(IntegrityError, match=r"model\.bin"):
        fs.put(str(local), f"{root}/step-100", recursive=True)
    assert not place.inner.exists(place.path("up/model.bin"))
    assert not place.inner.exists(place.path("up/model.npz"))
    assert not place.inner.exists(place.path("up/step-100/model.bin"))
    # A link is read as the file it names, against that file's record.
    (tmp_path / "link.bin").symlink_to(model)
    with pytest.raises(IntegrityError, match=r"model\.bin.*CRC32C"):
        fs.put_file(str(tmp_path / "link.bin"), f"{root}/link.bin")
    # Undamaged and unrecorded files upload as before, through links too (a Hugging Face
    # snapshot's files are links into its blobs/).
    (tmp_path / "plain.bin").write_bytes(b"no record")
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "model.bin").symlink_to(tmp_path / "plain.bin")
    (tmp_path / "snapshot" / "meta.json").symlink_to(local / "meta.json")
    fs.put_file(str(local / "meta.json"), f"{root}/meta.json")
    fs.put_file(str(tmp_path / "plain.bin"), f"{root}/plain.bin")
    fs.put(str(tmp_path / "snapshot"), f"{root}/snapshot", recursive=True)
    assert fs.cat_file(f"{root}/meta.json") == b'{"step": 100}'
    assert fs.cat_file(f"{root}/plain.bin") == b"no record"
    assert fs.cat_file(f"{root}/snapshot/model.bin") == b"no record"
    assert fs.cat_file(f"{root}/snapshot/meta.json") == b'{"step": 100}'


def test_a_directory_moves_and_copies_recursively(place: Place) -> None:
    """fsspec's mv copies every path a recursive listing gives, directories included, and
    stops at the first FileNotFoundError: cp_file of a directory raised one, so
    ``mv(..., recursive=True)`` of any directory failed (plain local fsspec moves it)."""
    fs, root = fsspec.url_to_fs(place.url("tree"), **place.so)
    fs.pipe_file(f"{root}/src/x", b"x")
    fs.pipe_file(f"{root}/src/sub/y", b"yy")
    fs.cp(f"{root}/src", f"{root}/copy", recursive=True)
    fs.mv(f"{root}/src", f"{root}/moved", recursive=True)
    for top in ("copy", "moved"):
        assert fs.cat_file(f"{root}/{top}/x") == b"x"
        assert fs.cat_file(f"{root}/{top}/sub/y") == b"yy"
        for key in (f"tree/{top}/x", f"tree/{top}/sub/y"):
            assert place.record(key) is not None, key
    assert not any(p.startswith(place.path("tree/src")) for p in place.objects())
    with pytest.raises(FileNotFoundError):
        fs.cp_file(f"{root}/nothing", f"{root}/else")


@pytest.mark.parametrize("odd", ["a//c", "a/./c", "a/../c"])
def test_ambiguous_keys_are_refused_on_object_stores(place: Place, odd: str) -> None:
    """durable:: wrote "a/../c" and "a//c" as literal keys on an object store, which
    atomic_write and read_verified refuse (a disk resolves them to other places). A local
    disk resolves them as plain fsspec does."""
    if "file" in adapter_for_fs(place.inner).protocols:
        pytest.skip("a local disk resolves them: fsspec's own paths")
    fs, root = fsspec.url_to_fs(place.url("amb"), **place.so)
    with pytest.raises(ValueError, match="empty segments"):
        fs.pipe_file(f"{root}/{odd}", b"x")
    with pytest.raises(ValueError, match="empty segments"), fs.open(f"{root}/{odd}", "wb"):
        pass
    assert not any("/amb/" in p for p in place.objects())


def test_create_mode_keeps_the_existing_object_and_its_record(place: Place) -> None:
    fs, path = fsspec.url_to_fs(place.url("once"), **place.so)
    fs.pipe_file(path, b"first")
    written = []
    # Refused at the open, as a plain file's "xb" is: it was refused only at the close,
    # after the block had written every byte.
    with pytest.raises(FileExistsError, match="only creates"), fs.open(path, "xb") as f:
        written.append(f.write(b"second"))  # pragma: no cover
    assert written == []
    assert fs.cat_file(path) == b"first"
    assert place.record("once") is not None


# -- whole or nothing ----------------------------------------------------------------------
WRITERS = ["fsspec.open", "fs.open", "text", "np.save"]


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("existing", [False, True])
def test_exception_inside_with_publishes_nothing(place: Place, writer: str,
                                                 existing: bool) -> None:
    url = place.url("w.bin")
    fs, path = fsspec.url_to_fs(url, **place.so)
    if existing:
        fs.pipe_file(path, b"previous version")
    before = place.objects()
    with pytest.raises(Boom):
        if writer == "fsspec.open":
            with fsspec.open(url, "wb", **place.so) as f:
                f.write(os.urandom(3 * 1024 * 1024))
                raise Boom
        elif writer == "fs.open":
            with fs.open(path, "wb") as f:
                f.write(os.urandom(3 * 1024 * 1024))
                raise Boom
        elif writer == "text":
            with fsspec.open(url, "w", **place.so) as f:
                f.write("x" * 3_000_000)
                raise Boom
        else:
            with fsspec.open(url, "wb", **place.so) as f:
                np.save(f, np.zeros(1_000_000))
                raise Boom
    assert place.objects() == before
    assert place.uploads() == []
    if existing:
        assert fs.cat_file(path) == b"previous version"  # still verified against its record


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_pandas_write_failing_midway_publishes_nothing(place: Place, fmt: str) -> None:
    # The control: written plainly, the same frame leaves a partial object behind, so the
    # failure really happens after bytes went out.
    control = f"memory://control-{uuid.uuid4().hex}/bad.{fmt}"
    with pytest.raises((ValueError, OSError)):
        _failing_write(fmt, control, None)
    mem, cpath = fsspec.url_to_fs(control)
    assert mem.info(cpath)["size"] > 100_000
    mem.rm(cpath)

    with pytest.raises((ValueError, OSError)):
        _failing_write(fmt, place.url(f"bad.{fmt}"), place.storage_options)
    assert place.objects() == []
    assert place.uploads() == []


@pytest.mark.parametrize("mode", ["wb", "w"])
def test_garbage_collected_unclosed_file_publishes_nothing(place: Place, mode: str) -> None:
    fs, path = fsspec.url_to_fs(place.url("dropped"), **place.so)
    f = fs.open(path, mode)
    f.write(b"x" * 2_000_000 if "b" in mode else "x" * 2_000_000)
    del f
    gc.collect()
    assert place.objects() == []


def test_close_in_an_except_block_opened_there_publishes(place: Place) -> None:
    """Only an exception raised after the open means the writer failed."""
    fs, path = fsspec.url_to_fs(place.url("fallback"), **place.so)
    try:
        raise KeyError("a cache miss")
    except KeyError:
        f = fs.open(path, "wb")
        f.write(b"written while handling an error")
        f.close()
    it = iter(())
    g = fs.open(f"{path}-2", "wb")
    try:
        next(it)
    except StopIteration:
        g.write(b"end of input")
        g.close()
    assert fs.cat_file(path) == b"written while handling an error"
    assert fs.cat_file(f"{path}-2") == b"end of input"


def test_close_after_a_failed_write_publishes_nothing(tmp_path: Path) -> None:
    """A write refused by the kernel (RLIMIT_FSIZE), then a plain close() or an explicit
    commit(): nothing is published."""
    target = tmp_path / "big.bin"
    script = textwrap.dedent(f"""
        import resource, fsspec
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 1024 * 1024, resource.RLIM_INFINITY))
        f = fsspec.open("durable::file://{target}", "wb").open()
        try:
            for _ in range(8):
                f.write(b"x" * 1024 * 1024)
        except OSError as exc:
            print("write failed:", exc.errno)
        f.close()
        g = fsspec.open("durable::file://{target}", "wb").open()
        try:
            g.write(b"y" * 3 * 1024 * 1024)
        except OSError:
            pass
        try:
            g.commit()
        except ValueError as exc:
            print("commit refused:", exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "write failed: 27" in out.stdout  # EFBIG
    assert "a write to this file failed" in out.stdout
    assert sorted(p.name for p in tmp_path.rglob("*")) == []


@pytest.mark.parametrize("mode", ["ab", "r+b", "a"])
def test_modes_that_cannot_be_atomic_are_refused(place: Place, mode: str) -> None:
    fs, path = fsspec.url_to_fs(place.url("m"), **place.so)
    fs.pipe_file(path, b"x")
    with pytest.raises(UnsupportedError):
        fs.open(path, mode)


def test_compression_and_transactions_are_refused(place: Place) -> None:
    fs, path = fsspec.url_to_fs(place.url("c.gz"), **place.so)
    with pytest.raises(UnsupportedError, match="compression"):
        fs.open(path, "wb", compression="gzip")
    with pytest.raises(UnsupportedError, match="transactions"), fs.transaction:
        fs.open(path, "wb")
    assert place.objects() == []


def test_writes_into_records_dirs_are_refused(place: Place) -> None:
    fs, path = fsspec.url_to_fs(place.url(".durable/x/commit.json"), **place.so)
    with pytest.raises(ValueError, match="records"):
        fs.open(path, "wb")


# -- verified reads ---------------------------------------------------------------------------
def test_truncated_object_is_an_error_on_every_read(place: Place) -> None:
    df = _frame(20_000)
    df.to_parquet(place.url("t.parquet"), storage_options=place.storage_options)
    size = place.inner.info(place.path("t.parquet"))["size"]
    place.truncate(place.path("t.parquet"), size - 1000)
    fs, path = fsspec.url_to_fs(place.url("t.parquet"), **place.so)
    with pytest.raises(IntegrityError, match=f"recorded with {size} bytes"):
        fs.cat_file(path)
    with pytest.raises(IntegrityError), fsspec.open(place.url("t.parquet"), "rb",
                                                    **place.so) as f:
        f.read()
    with pytest.raises(IntegrityError):
        pd.read_parquet(place.url("t.parquet"), storage_options=place.storage_options)


@pytest.mark.parametrize("how", ["read", "cat_range", "cat_range_from_0", "cat_ranges",
                                 "seek-first"])
def test_corrupt_object_of_the_right_size_is_an_error(place: Place, how: str) -> None:
    """Every read, a range from byte 0 included: that one was served as the first bytes
    of a sequential read, whose check comes only at the end, which a range never reaches
    (zarr reads a shard's first inner chunk with such a range)."""
    fs, path = fsspec.url_to_fs(place.url("c.bin"), **place.so)
    data = os.urandom(3_000_000)
    fs.pipe_file(path, data)
    bad = bytearray(data)
    bad[2_000_000] ^= 0x40
    place.rewrite("c.bin", bytes(bad))  # around durable: its record still says `data`
    with pytest.raises(IntegrityError, match="CRC32C"):
        if how == "read":
            with fs.open(path, "rb") as f:
                f.read()
        elif how == "cat_range":
            fs.cat_file(path, start=10, end=20)
        elif how == "cat_range_from_0":
            fs.cat_file(path, start=0, end=20)
        elif how == "cat_ranges":
            # on_error="raise": fsspec's default hands errors back in the list
            fs.cat_ranges([path], [0], [20], on_error="raise")
        else:
            with fs.open(path, "rb") as f:
                f.seek(-100, os.SEEK_END)
                f.read()


def test_unrecorded_objects_are_read_length_checked(place: Place) -> None:
    data = os.urandom(100_000)
    place.inner.pipe_file(place.path("plain.bin"), data)
    fs, path = fsspec.url_to_fs(place.url("plain.bin"), **place.so)
    assert fs.cat_file(path) == data
    assert fs.cat_file(path, start=-10) == data[-10:]
    with pytest.raises(FileNotFoundError):
        fs.cat_file(path + "-missing")


def _count_marker_calls(monkeypatch: pytest.MonkeyPatch, adapter: Any) -> collections.Counter[str]:
    """Calls of the adapter on commit markers, by kind: "stat" (info) or "read" (anything
    that reads a marker's bytes). Counted around the real methods, which still run."""
    counts: collections.Counter[str] = collections.Counter()
    for name in ("info", "read", "open_whole", "open_read"):
        real = getattr(type(adapter), name)

        def counting(self: Any, path: str, *args: Any, _real: Any = real,
                     _kind: str = "stat" if name == "info" else "read", **kw: Any) -> Any:
            if path.endswith("/commit.json"):
                counts[_kind] += 1
            return _real(self, path, *args, **kw)

        monkeypatch.setattr(type(adapter), name, counting)
    return counts


def test_zarr_through_durable_reads_each_marker_once_per_commit(
        place: Place, monkeypatch: pytest.MonkeyPatch) -> None:
    """zarr.open_array("durable::...") of a committed array failed at once (zarr's look for
    a .zarray, absent and not in the manifest, was an IntegrityError, not "not found"),
    and every object read its record from scratch: a marker read per folder from the
    chunk up to the entry (4 per chunk here: 64 for 16 chunks). Now the entry's marker
    is read once and revalidated by one stat per object; a rewrite is read again."""
    import zarr

    import durable.zarr as dz

    data = np.arange(64 * 64, dtype="f4").reshape(64, 64)
    data[:16, :16] = 0  # a chunk of fill values: never written, read as "not found"
    url = place.inner.unstrip_protocol(place.path("x.zarr"))
    dz.write(url, data, chunks=(16, 16), storage_options=place.inner_options)
    fs, _ = fsspec.url_to_fs(place.url("x.zarr"), **place.so)
    counts = _count_marker_calls(monkeypatch, fs.adapter)
    arr = zarr.open_array(place.url("x.zarr"), mode="r", storage_options=place.so)
    np.testing.assert_array_equal(arr[:], data)
    counts.clear()
    np.testing.assert_array_equal(arr[:], data)  # 15 chunks written, 1 not
    assert counts["read"] == 0, counts
    assert counts["stat"] <= 16, counts  # one per object at most: the revalidation

    # Committed again with other data: read again, never checked against the old record.
    dz.write(url, data + 1, chunks=(16, 16), storage_options=place.inner_options,
             overwrite=True)
    again = zarr.open_array(place.url("x.zarr"), mode="r", storage_options=place.so)
    np.testing.assert_array_equal(again[:], data + 1)


# -- listings and removal ----------------------------------------------------------------------
def test_listings_hide_records(place: Place) -> None:
    fs, root = fsspec.url_to_fs(place.url("d"), **place.so)
    fs.pipe_file(f"{root}/x", b"1")
    # Over S3's part size: a multipart upload, whose record is a marker (records dir) there.
    fs.pipe_file(f"{root}/sub/y", b"2" * (MIN_PART_SIZE + 1))
    assert any("/.durable/" in p for p in place.objects())  # the records are there...
    assert sorted(fs.ls(root, detail=False)) == [f"{root}/sub", f"{root}/x"]  # ...unseen
    assert [e["name"] for e in fs.ls(root, detail=True)].count(f"{root}/.durable") == 0
    assert fs.find(root) == [f"{root}/sub/y", f"{root}/x"]
    assert sorted(fs.find(root, detail=True)) == [f"{root}/sub/y", f"{root}/x"]
    globbed = fs.glob(f"{root}/**")
    assert {f"{root}/sub/y", f"{root}/x"} <= set(globbed)
    assert not [p for p in globbed if ".durable" in p]
    assert all(".durable" not in d for d, _, _ in fs.walk(root))


def test_rm_removes_the_record_too(place: Place) -> None:
    fs, root = fsspec.url_to_fs(place.url("r"), **place.so)
    for key in ("x", "dir/y", "dir/deeper/z", "keep"):
        fs.pipe_file(f"{root}/{key}", key.encode())
    fs.rm(f"{root}/x")
    assert place.marker("r/x") is None and not place.inner.exists(place.path("r/x"))
    fs.rm(f"{root}/dir", recursive=True)
    in_metadata = carries_record(place.metadata(place.path("r/keep")))
    marker = [] if in_metadata else [place.path("r/.durable/keep/commit.json")]
    assert place.objects() == [*marker, place.path("r/keep")]
    fs.rm_file(f"{root}/keep")
    assert place.objects() == []


def test_rm_that_does_not_remove_an_entry_leaves_it_complete(place: Place) -> None:
    """``rm`` without recursive=True, and ``rm_file``, of a prefix entry remove nothing
    (an error on a local disk, nothing on an object store), but took the entry's marker
    (and records) first: a COMPLETE entry became INCOMPLETE over all its data."""
    fs, root = fsspec.url_to_fs(place.url("tree"), **place.so)
    e = durable.Entry(f"{place.inner.unstrip_protocol(place.path('tree'))}/x.zarr",
                      storage_options=place.inner_options)
    with e.writing() as w:
        w.write_bytes("a", b"1")
        w.write_bytes("sub/b", b"2")
    fs.pipe_file(f"{root}/single", b"single")
    for call in (lambda: fs.rm(f"{root}/x.zarr"), lambda: fs.rm(f"{root}/x.zarr/sub"),
                 lambda: fs.rm_file(f"{root}/x.zarr")):
        with contextlib.suppress(OSError, ValueError):
            call()
        assert e.state() is durable.State.COMPLETE
    fs.rm([f"{root}/single"])  # an object still loses its record with it
    assert place.marker("tree/single") is None and not fs.exists(f"{root}/single")
    fs.rm(f"{root}/x.zarr", recursive=True)
    assert e.state() is durable.State.ABSENT


def _committed(place: Place, name: str, objects: dict[str, bytes]) -> durable.Entry:
    e = durable.Entry(place.inner.unstrip_protocol(place.path(name)),
                      storage_options=place.inner_options)
    with e.writing() as w:
        for key, data in objects.items():
            w.write_bytes(key, data)
    # The committed attempt's record is removed by a background thread: a listing taken
    # before it went would differ from one taken after (tests compare listings).
    durable._background.wait()
    return e


def test_a_committed_entry_is_read_only_through_durable_fs(place: Place,
                                                           tmp_path: Path) -> None:
    """Writes and removals of objects inside a COMPLETE entry went through and left its
    marker in place: COMPLETE over other bytes, over objects gone, or beside objects it
    never listed (served, each with a single-object record of its own)."""
    e = _committed(place, "e", {"a": b"1", "sub/b": b"22"})
    fs, root = fsspec.url_to_fs(place.url(""), **place.so)
    root = root.rstrip("/")
    local = tmp_path / "up.bin"
    local.write_bytes(b"3")
    fs.pipe_file(f"{root}/outside", b"4")
    before = place.objects()
    for call in (lambda: fs.pipe_file(f"{root}/e/a", b"9"),
                 lambda: fs.pipe_file(f"{root}/e/new", b"new"),
                 lambda: fs.open(f"{root}/e/sub/c", "wb"),
                 lambda: fs.open(f"{root}/e/sub/c", "w"),
                 lambda: fs.put_file(str(local), f"{root}/e/up"),
                 lambda: fs.cp_file(f"{root}/outside", f"{root}/e/copied"),
                 lambda: fs.touch(f"{root}/e/a", truncate=False),
                 lambda: fs.rm(f"{root}/e/a"),
                 lambda: fs.rm_file(f"{root}/e/sub/b"),
                 lambda: fs.rm(f"{root}/e/sub", recursive=True),
                 lambda: fs.mv(f"{root}/e/a", f"{root}/moved")):
        with pytest.raises(durable.EntryExistsError) as info:
            call()
        assert f"inside the committed entry {e.url}" in str(info.value)
        assert place.objects() == before
    with contextlib.suppress(OSError):
        # The entry's own path: on a disk a directory is in the way; elsewhere the write
        # took the entry's marker first.
        fs.pipe_file(f"{root}/e", b"object")
    assert e.state() is durable.State.COMPLETE and e.verify(deep=True).ok
    fs.rm(f"{root}/e", recursive=True)  # whole, it goes (its marker first)
    assert e.state() is durable.State.ABSENT


def test_a_committed_entry_copies_and_moves_as_a_committed_entry(place: Place) -> None:
    """cp/mv -r of a COMPLETE entry copied object by object: the copy had no marker
    (INCOMPLETE, each object a single-object entry), the records inside it (a nested
    entry's marker) were hidden from the listing and not copied, and a folder inside it
    stopped the copy ("not in the manifest")."""
    e = durable.Entry(place.inner.unstrip_protocol(place.path("e")),
                      storage_options=place.inner_options)
    with e.writing() as w:
        w.write_bytes("a", b"1")
        w.write_bytes("sub/b", b"22")
        _committed(place, "e/inner", {"x": b"333"})
    fs, root = fsspec.url_to_fs(place.url(""), **place.so)
    root = root.rstrip("/")
    marker = e.read_marker()
    assert marker is not None and marker.manifest is not None
    fs.cp(f"{root}/e", f"{root}/copy", recursive=True)
    fs.mv(f"{root}/e", f"{root}/moved", recursive=True)
    assert e.state() is durable.State.ABSENT
    for name in ("copy", "moved"):
        twin = durable.Entry(place.inner.unstrip_protocol(place.path(name)),
                             storage_options=place.inner_options)
        assert twin.state() is durable.State.COMPLETE and twin.verify(deep=True).ok
        copied = twin.read_marker()
        assert copied is not None and copied.manifest == marker.manifest
        inner = durable.Entry(f"{twin.url}/inner", storage_options=place.inner_options)
        assert inner.state() is durable.State.COMPLETE

    # A source whose bytes are not what its manifest says: no copy at all.
    bad = bytearray(place.inner.cat_file(place.path("copy/sub/b")))
    bad[0] ^= 1
    place.rewrite("copy/sub/b", bytes(bad))
    with pytest.raises(IntegrityError, match="CRC32C"):
        fs.cp(f"{root}/copy", f"{root}/from-bad", recursive=True)
    assert not any("from-bad" in p for p in place.objects())
    # Nor over an entry already there (cp into an existing folder copies into it: the
    # copy would be inside a committed entry).
    with pytest.raises(durable.EntryExistsError):
        fs.cp(f"{root}/moved", f"{root}/copy", recursive=True)


def _codeword(body: bytes) -> bytes:
    """A chunk as zarr's crc32c codec encodes it: its CRC32C is the residue, whatever the
    body, so two of one size differ only in their last 4 bytes (the record's tail)."""
    return body + crc32c(body).to_bytes(4, "little")


def test_a_committed_entry_is_copied_only_with_its_recorded_codeword_chunks(
        place: Place) -> None:
    """cp -r of a COMPLETE entry one of whose codeword chunks was replaced by another of
    its size (another attempt's straggler): the manifest's size and CRC32C (the residue)
    matched, the tail was not checked, and the straggler was committed in the copy."""
    e = durable.Entry(place.inner.unstrip_protocol(place.path("e")),
                      storage_options=place.inner_options)
    with e.writing() as w:
        w.write_bytes("c/0", _codeword(b"the committed chunk"))
    place.rewrite("e/c/0", _codeword(b"a straggler's chunk"))
    fs, root = fsspec.url_to_fs(place.url(""), **place.so)
    root = root.rstrip("/")
    with pytest.raises(IntegrityError, match=r"e/c/0"):
        fs.cp(f"{root}/e", f"{root}/copy", recursive=True)
    assert not any("copy" in p for p in place.objects())


def test_rm_of_an_entry_removes_all_its_records(place: Place) -> None:
    entry = durable.Entry(place.inner.unstrip_protocol(place.path("e")),
                          storage_options=place.inner_options)
    with entry.writing() as w:
        w.write_bytes("a", b"1")
        w.write_bytes("b/c", b"2")
    # What a killed writer of a later attempt leaves in the records dir.
    place.inner.pipe_file(entry.layout.attempt_record("deadbeef"), b"{}")
    fs, path = fsspec.url_to_fs(place.url("e"), **place.so)
    fs.rm(path, recursive=True)
    assert place.objects() == []
    assert entry.state() is durable.State.ABSENT


def test_rm_never_takes_a_live_writers_lease(place: Place) -> None:
    """``rm`` of an entry, of its records or of a folder holding it removed the lease its
    writer holds live: the writer wrote on, unprotected, and learnt only at its commit.
    Refused as `Entry.delete` refuses (IncompleteExistsError, a FileExistsError), naming
    the entry, the holder and how to force; once the writer committed, rm removes it."""
    url = place.inner.unstrip_protocol(place.path("top/ent"))
    entry = durable.Entry(url, storage_options=place.inner_options)
    fs, root = fsspec.url_to_fs(place.url(""), **place.so)
    root = root.rstrip("/")
    with durable.Lease(url, storage_options=place.inner_options, heartbeat=0.2,
                       stale_after=30) as lease, entry.writing(lease=lease) as w:
        w.write_bytes("a", b"1")
        before = place.objects()
        for call in (lambda: fs.rm(f"{root}/top/ent", recursive=True),
                     lambda: fs.rm(f"{root}/top/.durable/ent", recursive=True),
                     lambda: fs.rm(f"{root}/top/.durable", recursive=True),
                     lambda: fs.rm(f"{root}/top/.durable/ent/lease.json"),
                     lambda: fs.rm_file(f"{root}/top/.durable/ent/lease.json"),
                     lambda: fs.rm(f"{root}/top", recursive=True),
                     lambda: fs.mv(f"{root}/top", f"{root}/moved", recursive=True)):
            with pytest.raises(durable.IncompleteExistsError) as refused:
                call()
            assert isinstance(refused.value, FileExistsError)
            message = str(refused.value)
            assert entry.url in message and lease.url in message
            assert f"pid {os.getpid()}" in message and "delete(force=True)" in message
            assert place.objects() == before and lease.held
        w.write_bytes("b", b"2")
    assert entry.state() is durable.State.COMPLETE
    fs.rm(f"{root}/top", recursive=True)
    assert place.objects() == []


# -- S3: multipart uploads, interrupted and finished ------------------------------------------
@pytest.fixture
def s3_proxied_place(s3_bucket: Bucket, s3_boto: Any) -> Iterator[tuple[Place, FaultProxy]]:
    """The S3 place reached through the fault proxy, with no fault: its log shows every
    request durable sent (parts, completion, abort)."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = dict(s3_bucket.storage_options, endpoint_url=proxy.url)
        yield from ((p, proxy) for p in _s3_place(s3_bucket, s3_boto, options))
        assert proxy.errors == []


def _multipart_requests(proxy: FaultProxy, key: str) -> dict[str, int]:
    """How many of each multipart request (and plain PUTs) went out for ``key``."""
    counts = {"create": 0, "part": 0, "complete": 0, "abort": 0, "put": 0}
    for r in proxy.requests:
        if r.key != key:
            continue
        if r.method == "POST" and "uploads" in r.query:
            counts["create"] += 1
        elif r.method == "PUT" and "partNumber" in r.query:
            counts["part"] += 1
        elif r.method == "POST" and "uploadId" in r.query:
            counts["complete"] += 1
        elif r.method == "DELETE" and "uploadId" in r.query:
            counts["abort"] += 1
        elif r.method == "PUT":
            counts["put"] += 1
    return counts


BIG = 12 * 1024 * 1024  # two whole 5 MiB parts and a short third


@pytest.mark.parametrize("how", ["np.save", "fs.open", "parquet-failing-midway"])
def test_s3_interrupted_multipart_write_leaves_no_object_and_no_upload(
        s3_proxied_place: tuple[Place, FaultProxy], how: str) -> None:
    place, proxy = s3_proxied_place
    url = place.url("big.bin")
    with pytest.raises((Boom, ValueError)):
        if how == "np.save":
            with fsspec.open(url, "wb", **place.so) as f:
                np.save(f, np.random.default_rng(2).random(BIG // 8))
                raise Boom
        elif how == "fs.open":
            fs, path = fsspec.url_to_fs(url, **place.so)
            with fs.open(path, "wb") as f:
                f.write(os.urandom(BIG))
                raise Boom
        else:
            # About 7 MiB of row groups go out before pyarrow reaches the bad timestamp.
            _frame_failing_in_parquet(600_000).to_parquet(
                url, storage_options=place.storage_options, coerce_timestamps="ms",
                row_group_size=10_000)
    sent = _multipart_requests(proxy, "data/big.bin")
    # Parts really went out before the failure; the upload was aborted, never completed.
    assert sent["create"] == 1 and sent["part"] >= 1, sent
    assert sent["abort"] == 1 and sent["complete"] == 0 and sent["put"] == 0, sent
    assert place.objects() == []
    assert place.uploads() == []


@pytest.mark.parametrize("how", ["np.save", "parquet"])
def test_s3_finished_multipart_write_reads_back_verified(
        s3_proxied_place: tuple[Place, FaultProxy], s3_bucket: Bucket, s3_boto: Any,
        how: str) -> None:
    place, proxy = s3_proxied_place
    url = place.url("big.bin")
    rng = np.random.default_rng(3)
    if how == "np.save":
        arr = rng.random(BIG // 8)
        with fsspec.open(url, "wb", **place.so) as f:
            np.save(f, arr)
    else:
        df = pd.DataFrame({"x": rng.random(BIG // 16), "y": rng.random(BIG // 16)})
        df.to_parquet(url, storage_options=place.storage_options)
    sent = _multipart_requests(proxy, "data/big.bin")
    assert sent["create"] == 1 and sent["part"] >= 2, sent
    assert sent["complete"] == 1 and sent["abort"] == 0 and sent["put"] == 0, sent
    assert place.uploads() == []

    # Around durable: the stored bytes, and what the store says of them.
    stored = s3_boto.get_object(Bucket=s3_bucket.name, Key="data/big.bin")["Body"].read()
    head = s3_boto.head_object(Bucket=s3_bucket.name, Key="data/big.bin",
                               ChecksumMode="ENABLED")
    assert head["ETag"].endswith(f'-{sent["part"]}"') and head["ChecksumType"] == "FULL_OBJECT"
    marker = place.marker("big.bin")
    assert marker is not None and marker.manifest is not None
    record = marker.manifest.objects[""]
    assert (record.size, record.crc32c) == (len(stored), crc32c(stored))

    # Read back through durable::, verified against that record.
    if how == "np.save":
        with fsspec.open(url, "rb", **place.so) as f:
            np.testing.assert_array_equal(np.load(f), arr)
    else:
        back = pd.read_parquet(url, storage_options=place.storage_options)
        pd.testing.assert_frame_equal(back, df)
    inner_url = place.inner.unstrip_protocol(place.path("big.bin"))
    assert durable.read_verified(inner_url, storage_options=place.inner_options) == stored


@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_names_with_hash_and_question_mark_round_trip_on_local_and_memory(
        protocol: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative paths with '#' and '?' (made absolute by the filesystem, never parsed as a
    URL) are written and read as given: the check that refuses a name adlfs would change
    must not refuse them."""
    monkeypatch.chdir(tmp_path)
    root = f"rel-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("durable", target_protocol=protocol)
    for name in ("a#b", "p#", "q?", "x?y#z"):
        fs.pipe_file(f"{root}/{name}", name.encode())
    for name in ("a#b", "p#", "q?", "x?y#z"):
        assert fs.cat_file(f"{root}/{name}") == name.encode()
    if protocol == "file":
        names = sorted(n for n in os.listdir(tmp_path / root) if n != ".durable")
        assert names == ["a#b", "p#", "q?", "x?y#z"]
    else:
        fs.fs.rm(f"/{root}", recursive=True)
