"""The conformance suite every adapter runs, in the spirit of zarr-python's ``StoreTests``.

Its helpers write and read *around* the adapter under test (plain file calls, the raw
fsspec filesystem, or boto3 for S3), so an adapter cannot grade its own homework: what
`open_atomic` published is checked by a reader that is not the adapter, and what the
adapter lists, stats and reads was put there by a writer that is not the adapter.

Importing this module needs pytest and durable's core only, no cloud library.

How to run it on an adapter: subclass `AdapterTests` in a test module (the class name
must start with ``Test`` for pytest to collect it), and provide one fixture and three
helpers::

    import pytest
    from durable.testing.conformance import AdapterTests

    class TestMyAdapter(AdapterTests):
        large_object_size = 40 * 1024 * 1024  # optional: above your multipart threshold

        @pytest.fixture
        def place(self, my_bucket):
            # A fresh, empty place: (the adapter under test, a base path under which
            # every test writes). Paths are as the adapter's filesystem spells them
            # ("bucket/prefix", "/tmp/dir"), without a protocol.
            yield MyAdapter(my_bucket.filesystem()), f"{my_bucket.name}/base"

        def raw_put(self, path: str, data: bytes) -> None:
            ...  # write the object NOT through the adapter (it replaces an existing one)

        def raw_get(self, path: str) -> bytes | None:
            ...  # read it NOT through the adapter; None if there is no such object

        def raw_list(self, prefix: str) -> list[str]:
            ...  # every object below prefix (full paths, sorted), temp files included

The raw helpers may use ``self.adapter`` and ``self.base`` (bound before every test).
`url_of` and `storage_options` say how durable's public API (`atomic_write`,
`read_verified`, `Entry`) reaches the same place; the defaults take them from the
adapter's fsspec filesystem. Tests of guarantees an adapter does not declare in its
`Capabilities` (``create_only``, ``pinned_reads``) are skipped, with the reason shown.
"""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import pytest

from durable import Entry, IncompleteError, IntegrityError, State, atomic_write, read_verified
from durable._checksum import Checksum
from durable._protocol import Layout, ObjectRecord
from durable.adapters.base import Adapter, AtomicFile, Capabilities

__all__ = ["AdapterTests"]


class _Boom(Exception):
    """The failure a test raises mid-write."""


def payload(size: int, seed: int = 0) -> bytes:
    """Reproducible pseudo-random bytes (random enough that no codec shortcut helps)."""
    return random.Random(seed).randbytes(size)


def _same(a: bytes | None, b: bytes) -> bool:
    # Compare without letting pytest render a diff of megabytes.
    return a is not None and len(a) == len(b) and a == b


def _write(f: AtomicFile, data: bytes, block: int) -> None:
    for i in range(0, len(data), block):
        f.write(data[i:i + block])


class AdapterTests:
    """Contract tests of one adapter; subclass it (see the module docstring)."""

    #: Size of the large-object round trip: above every multipart / block threshold.
    large_object_size: ClassVar[int] = 24 * 1024 * 1024 + 7
    #: Rounds of the 8-writer create-only race.
    race_rounds: ClassVar[int] = 3

    adapter: Adapter
    base: str

    # -- what a subclass provides ----------------------------------------------------------
    @pytest.fixture
    def place(self) -> Iterator[tuple[Adapter, str]]:
        """(adapter under test, base path of a fresh empty place)."""
        raise NotImplementedError(f"{type(self).__name__} must provide a `place` fixture")

    def raw_put(self, path: str, data: bytes) -> None:
        """Write (or replace) an object without the adapter."""
        raise NotImplementedError(f"{type(self).__name__} must implement raw_put")

    def raw_get(self, path: str) -> bytes | None:
        """Read an object without the adapter; None if absent."""
        raise NotImplementedError(f"{type(self).__name__} must implement raw_get")

    def raw_list(self, prefix: str) -> list[str]:
        """Every object below ``prefix`` without the adapter: full paths, sorted."""
        raise NotImplementedError(f"{type(self).__name__} must implement raw_list")

    def url_of(self, path: str) -> str:
        """The URL durable's public API takes for ``path``."""
        return self.adapter.url(path)

    def storage_options(self) -> dict[str, Any]:
        """The storage_options that make `url_of` resolve to the same filesystem."""
        return dict(getattr(self.adapter.fs, "storage_options", {}) or {})

    # -- plumbing ----------------------------------------------------------------------------
    @pytest.fixture(autouse=True)
    def _bind_place(self, place: tuple[Adapter, str]) -> None:
        self.adapter, base = place
        self.base = base.rstrip("/")

    def path(self, key: str) -> str:
        return f"{self.base}/{key}"

    def _require(self, capability: str) -> None:
        if not getattr(self.adapter.capabilities, capability):
            pytest.skip(f"{type(self.adapter).__name__} does not declare {capability}")

    # -- declared guarantees -----------------------------------------------------------------
    def test_capabilities_are_declared(self) -> None:
        caps = self.adapter.capabilities
        assert isinstance(caps, Capabilities)
        if not (caps.atomic_objects and caps.create_only and caps.durable
                and caps.pinned_reads):
            # A weaker guarantee must be said, not only implied by a False.
            assert caps.note.strip(), "an adapter missing a guarantee must say why in note"

    def test_in_process_is_declared_consistently(self) -> None:
        # `in_process` makes durable skip the thread that overlaps a look with work, and
        # ask again rather than keep an answer: declared by an adapter whose calls cross
        # a network, every write would wait a round trip it need not. An adapter served
        # in this process has no endpoint: no network client's event loop under it, and
        # no store clock of its own to read.
        caps = self.adapter.capabilities
        assert isinstance(caps.in_process, bool)
        networked = bool(getattr(self.adapter.fs, "async_impl", False))
        assert not (caps.in_process and networked), (
            f"{type(self.adapter).__name__} declares in_process over an asynchronous "
            f"(network) filesystem, {type(self.adapter.fs).__name__}")
        if caps.in_process:
            assert self.adapter.now(self.path("clock")) is None, (
                f"{type(self.adapter).__name__} declares in_process but reads a store's "
                "clock (an endpoint's answer)")

    # -- open_atomic: whole at commit ----------------------------------------------------------
    @pytest.mark.parametrize("key", ["obj", "nested/deeper/obj.bin"])
    @pytest.mark.parametrize("size", [0, 1, 1_500_001])
    def test_commit_publishes_exactly_the_bytes(self, key: str, size: int) -> None:
        p, data = self.path(key), payload(size, seed=size)
        with self.adapter.open_atomic(p) as f:
            _write(f, data, 256 * 1024 + 1)
            assert self.raw_get(p) is None, "visible before commit"
        assert f.info is not None and f.info.size == size
        assert _same(self.raw_get(p), data)
        assert self.raw_list(self.base) == [p], "commit left something beside the object"

    def test_put_replaces_an_existing_object(self) -> None:
        p = self.path("replaced")
        self.raw_put(p, b"the old version, longer")
        info = self.adapter.put(p, b"new")
        assert info.size == 3
        assert self.raw_get(p) == b"new"
        assert self.raw_list(self.base) == [p]

    def test_deferred_durability_then_sync(self) -> None:
        p = self.path("batch/a")
        with self.adapter.open_atomic(p, durable=False) as f:
            f.write(b"batched")
        self.adapter.sync([p], [self.path("batch")])
        assert self.raw_get(p) == b"batched"

    @pytest.mark.parametrize("how", ["abort", "exception", "keyboard-interrupt",
                                     "close-without-commit", "garbage-collected"])
    @pytest.mark.parametrize("existing", [None, b"old version"])
    def test_unfinished_write_leaves_the_target_as_it_was(self, how: str,
                                                          existing: bytes | None) -> None:
        p = self.path("unfinished/obj")
        if existing is not None:
            self.raw_put(p, existing)
        f = self.adapter.open_atomic(p)
        f.write(payload(300_000))
        if how == "abort":
            f.abort()
        elif how == "exception":
            with pytest.raises(_Boom), f:
                f.write(b"more")
                raise _Boom
        elif how == "keyboard-interrupt":
            with pytest.raises(KeyboardInterrupt), f:
                raise KeyboardInterrupt
        elif how == "close-without-commit":
            f.close()
        else:
            del f
            gc.collect()
        assert self.raw_get(p) == existing
        assert self.raw_list(self.base) == ([] if existing is None else [p])

    # -- create-only ------------------------------------------------------------------------
    def test_create_only_creates_an_absent_object(self) -> None:
        p = self.path("fresh")
        self.adapter.put(p, b"first", create_only=True)
        assert self.raw_get(p) == b"first"

    def test_create_only_refuses_an_existing_object(self) -> None:
        self._require("create_only")
        p = self.path("taken")
        self.raw_put(p, b"first")
        f = self.adapter.open_atomic(p, create_only=True)
        f.write(b"second")
        with pytest.raises(FileExistsError):
            f.commit()
        assert self.raw_get(p) == b"first"
        assert self.raw_list(self.base) == [p]

    def test_a_staged_put_publishes_at_publish_and_discards_cleanly(self) -> None:
        """`stage` (a commit marker made ready while the data is made durable): nothing at
        the target before `publish`; a discarded one leaves nothing, temp files included;
        a create-only one over an object that appeared meanwhile is FileExistsError."""
        p, gone, taken = self.path("staged"), self.path("dropped"), self.path("taken")
        staged = self.adapter.stage(p, b"marker bytes", create_only=True)
        assert self.raw_get(p) is None
        staged.publish()
        staged.discard()  # a no-op once published
        assert self.raw_get(p) == b"marker bytes"
        self.adapter.stage(gone, b"never published").discard()
        assert self.raw_get(gone) is None
        if self.adapter.capabilities.create_only:
            staged = self.adapter.stage(taken, b"second", create_only=True)
            self.raw_put(taken, b"first")
            with pytest.raises(FileExistsError):
                staged.publish()
            staged.discard()
            assert self.raw_get(taken) == b"first"
        else:
            self.raw_put(taken, b"first")
        assert self.raw_list(self.base) == sorted([p, taken])

    def test_discard_removes_what_it_names(self) -> None:
        for key in ("a", "b/c", "kept"):
            self.raw_put(self.path(key), key.encode())
        self.adapter.discard([self.path("a"), self.path("b/c"), self.path("missing")])
        assert self.raw_list(self.base) == [self.path("kept")]

    def test_racing_create_only_writers_have_exactly_one_winner(self) -> None:
        self._require("create_only")
        writers = 8
        for round_ in range(self.race_rounds):
            p = self.path(f"race-{round_}")
            barrier = threading.Barrier(writers, timeout=60)

            def write(i: int, p: str = p, barrier: threading.Barrier = barrier) -> int | None:
                f = self.adapter.open_atomic(p, create_only=True)
                f.write(payload(1000 + i, seed=i))
                barrier.wait()  # every writer is ready to commit: they race from here
                try:
                    f.commit()
                except FileExistsError:
                    return None
                return i

            with ThreadPoolExecutor(writers) as pool:
                winners = [i for i in pool.map(write, range(writers)) if i is not None]
            assert len(winners) == 1, f"round {round_}: winners {winners}"
            assert self.raw_get(p) == payload(1000 + winners[0], seed=winners[0])
        assert self.raw_list(self.base) == [self.path(f"race-{r}")
                                            for r in range(self.race_rounds)]

    # -- stat, list, exists, read -----------------------------------------------------------
    def test_info_list_exists_agree_with_raw_writes(self) -> None:
        objects = {"top": b"1", "d/b": b"22", "d/e/c": b"333", "d/empty": b"",
                   "d-sibling/x": b"4444"}
        for key, data in objects.items():
            self.raw_put(self.path(key), data)
        a = self.adapter
        for key, data in objects.items():
            info = a.info(self.path(key))
            assert info is not None and info.size == len(data), key
            assert info.path == self.path(key)
        for not_an_object in ("d", "d/e", "missing", "d/em", "d/e/c/below"):
            assert a.info(self.path(not_an_object)) is None, not_an_object

        listed = a.list(self.path("d"))
        assert {k: i.size for k, i in listed.items()} == {"b": 2, "e/c": 3, "empty": 0}
        assert listed["e/c"].path == self.path("d/e/c")
        assert a.list(self.path("d") + "/").keys() == listed.keys()
        assert set(a.list(self.base)) == set(objects)
        assert a.list(self.path("missing")) == {}
        assert a.list(self.path("top")) == {}, "an object has nothing below it"

        for present in ("top", "d", "d/e", "d/e/c", "d/empty", "d-sibling"):
            assert a.exists(self.path(present)), present
        for absent in ("missing", "d/em", "d-", "to"):
            assert not a.exists(self.path(absent)), absent

    def test_read_and_open_read_return_the_raw_bytes(self) -> None:
        p, data = self.path("r/obj"), payload(300_001)
        self.raw_put(p, data)
        self.raw_put(self.path("r/empty"), b"")
        a = self.adapter
        assert _same(a.read(p), data)
        assert a.read(self.path("r/empty")) == b""
        assert a.read(self.path("r/missing")) is None
        with pytest.raises(ValueError, match="over the limit"):
            a.read(p, limit=100)
        info = a.info(p)
        assert info is not None
        with a.open_read(p, info) as f:
            f.seek(1000)
            assert f.read(10) == data[1000:1010]
            f.seek(0)
            assert _same(f.read(), data)

    @pytest.mark.parametrize("replacement", [b"version two, longer", b"version 2!!"])
    def test_open_read_is_pinned_to_the_version_seen(self, replacement: bytes) -> None:
        self._require("pinned_reads")
        p = self.path("pinned")
        self.raw_put(p, b"version one")
        info = self.adapter.info(p)
        assert info is not None
        self.raw_put(p, replacement)  # same size or not: another object now
        with pytest.raises(IntegrityError), self.adapter.open_read(p, info) as f:
            f.read()

    def test_read_range_returns_exactly_the_bytes_asked_for(self) -> None:
        p, data = self.path("range/obj"), payload(300_001)
        self.raw_put(p, data)
        info = self.adapter.info(p)
        assert info is not None
        for start, length in ((0, 10), (1000, 4096), (299_990, 11), (299_990, 100),
                              (0, 300_001), (300_001, 5), (5, 0)):
            got = self.adapter.read_range(p, info, start, length)
            assert _same(got, data[start:start + length]), (start, length)

    @pytest.mark.parametrize("replacement", [b"version two, longer", b"version 2!!"])
    def test_read_range_is_pinned_to_the_version_seen(self, replacement: bytes) -> None:
        # A shard read by ranges (zarr's sharding): an index of one version and chunks of
        # the next would decode another commit's bytes under the first one's metadata.
        self._require("pinned_reads")
        p = self.path("range-pinned")
        self.raw_put(p, b"version one")
        info = self.adapter.info(p)
        assert info is not None
        assert self.adapter.read_range(p, info, 8, 3) == b"one"
        self.raw_put(p, replacement)  # same size or not: another object now
        with pytest.raises(IntegrityError):
            self.adapter.read_range(p, info, 8, 3)

    # -- delete -----------------------------------------------------------------------------
    def test_delete_and_delete_prefix_remove_exactly_what_they_name(self) -> None:
        keys = ["foo/a", "foo/b/c", "foo-bar/x", "foobar", "other/y", "single"]
        for key in keys:
            self.raw_put(self.path(key), key.encode())

        def left() -> list[str]:
            return [p[len(self.base) + 1:] for p in self.raw_list(self.base)]

        self.adapter.delete([self.path("foo/a"), self.path("missing")])
        self.adapter.delete([])
        assert left() == sorted(set(keys) - {"foo/a"})
        self.adapter.delete_prefix(self.path("foo"))
        assert left() == ["foo-bar/x", "foobar", "other/y", "single"]
        assert not self.adapter.exists(self.path("foo"))
        self.adapter.delete_prefix(self.path("single"))  # a prefix that is one object
        self.adapter.delete_prefix(self.path("missing"))
        assert left() == ["foo-bar/x", "foobar", "other/y"]

    # -- large objects, verify after write ------------------------------------------------------
    def test_large_object_round_trip(self) -> None:
        p, data = self.path("large.bin"), payload(self.large_object_size, seed=7)
        with self.adapter.open_atomic(p) as f:
            _write(f, data, 1024 * 1024 + 3)  # blocks that never line up with parts
        assert f.info is not None and f.info.size == len(data)
        assert _same(self.raw_get(p), data)
        self.adapter.verify_written(p, f.checksum, "full")

    @pytest.mark.parametrize("level", ["size", "probe", "full"])
    @pytest.mark.parametrize("size", [0, 1, 3_000_001])
    def test_verify_written_passes_on_good_objects(self, level: Any, size: int) -> None:
        p = self.path(f"v-{size}")
        with self.adapter.open_atomic(p) as f:
            _write(f, payload(size), 1024 * 1024)
        self.adapter.verify_written(p, f.checksum, level)

    @pytest.mark.parametrize("level", ["size", "probe", "full"])
    def test_verify_written_catches_a_short_object(self, level: Any) -> None:
        p, data = self.path("short"), payload(100_000)
        sent = Checksum()
        sent.update(data)
        self.raw_put(p, data[:-4096])
        with pytest.raises(IntegrityError, match="bytes"):
            self.adapter.verify_written(p, sent, level)

    def test_verify_full_catches_a_corrupt_object(self) -> None:
        p, data = self.path("corrupt"), payload(100_000)
        sent = Checksum()
        sent.update(data)
        self.raw_put(p, _flip(data))
        with pytest.raises(IntegrityError, match="CRC32C"):
            self.adapter.verify_written(p, sent, "full")

    # -- durable's public API through this adapter ----------------------------------------------
    def test_atomic_write_then_read_verified(self) -> None:
        p, data = self.path("api/blob.bin"), payload(2_500_000, seed=3)
        url, so = self.url_of(p), self.storage_options()
        with atomic_write(url, storage_options=so) as f:
            f.write(data[:1000])
            f.write(data[1000:])
        assert _same(self.raw_get(p), data)
        # The record: in the object's own metadata (object_records), else a marker beside it.
        own = self.adapter.capabilities.object_records
        assert own or self.raw_get(Layout(p).marker) is not None, "no record"
        marker = Entry(url, storage_options=so).status().marker
        assert marker is not None and marker.manifest is not None
        sent = Checksum()
        sent.update(data)
        assert marker.manifest.objects[""] == ObjectRecord(sent.size, sent.crc)
        assert _same(read_verified(url, storage_options=so), data)
        self.raw_put(p, _flip(data))  # same size, one bit: only the CRC32C can tell
        # A plain overwrite drops a record kept in metadata: refused as unrecorded.
        with pytest.raises(IncompleteError if own else IntegrityError,
                           match="no commit record" if own else "CRC32C"):
            read_verified(url, storage_options=so)

    def test_atomic_write_interrupted_publishes_nothing(self) -> None:
        url = self.url_of(self.path("api/never.bin"))
        with pytest.raises(_Boom), atomic_write(url, storage_options=self.storage_options()) as f:
            f.write(payload(2_000_000))
            raise _Boom
        assert self.raw_list(self.base) == []

    def test_entry_writing_commits_and_verifies_deeply(self) -> None:
        root = self.path("entry")
        entry = Entry(self.url_of(root), storage_options=self.storage_options())
        assert entry.state() is State.ABSENT
        a, b = payload(700_000, seed=1), payload(1_300_000, seed=2)
        with entry.writing() as w:
            w.fs.pipe_file(f"{w.path}/a.bin", a)
            with w.fs.open(f"{w.path}/sub/b.bin", "wb") as f:
                f.write(b)
            assert entry.state() is State.INCOMPLETE
        assert entry.state() is State.COMPLETE
        assert _same(self.raw_get(f"{root}/a.bin"), a)
        report = entry.verify(deep=True)
        assert report.ok and report.objects == 2 and report.bytes_checked == len(a) + len(b)
        self.raw_put(f"{root}/sub/b.bin", _flip(b))
        with pytest.raises(IntegrityError, match="crc32c"):
            entry.verify(deep=True)

    def test_entry_writing_interrupted_leaves_it_absent(self) -> None:
        entry = Entry(self.url_of(self.path("entry")), storage_options=self.storage_options())
        with pytest.raises(_Boom), entry.writing() as w:
            w.write_bytes("a.bin", payload(10_000))
            raise _Boom
        assert entry.state() is State.ABSENT
        assert self.raw_list(self.base) == []


def _flip(data: bytes) -> bytes:
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x01
    return bytes(bad)
