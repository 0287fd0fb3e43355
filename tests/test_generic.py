"""The generic adapter beyond the conformance suite: what it declares, and that it holds.

It runs over fsspec's DirFileSystem (no adapter of its own) wrapping local disk and
memory; raw checks go to the real directory or the memory store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.dirfs import DirFileSystem

import durable
from durable import Entry, IntegrityError, State
from durable.adapters import adapter_for_fs, resolve
from durable.adapters.generic import GenericAdapter
from durable.fs import DurableFileSystem


@pytest.fixture
def disk(tmp_path: Path) -> DirFileSystem:
    return DirFileSystem(path=str(tmp_path), fs=fsspec.filesystem("file"))


@pytest.fixture
def memdir() -> Iterator[DirFileSystem]:
    mem = fsspec.filesystem("memory")
    root = f"/generic-{uuid.uuid4().hex}"
    yield DirFileSystem(path=root, fs=mem)
    if mem.exists(root):
        mem.rm(root, recursive=True)


@pytest.fixture(params=["disk", "memdir"])
def dirfs(request: pytest.FixtureRequest) -> DirFileSystem:
    fs: DirFileSystem = request.getfixturevalue(request.param)
    return fs


def test_weaker_guarantees_are_declared() -> None:
    caps = GenericAdapter.capabilities
    assert not (caps.atomic_objects or caps.create_only or caps.durable or caps.pinned_reads)
    for said in ("partial object", "check-then-write", "no fsync", "not pinned"):
        assert said in caps.note


def test_any_filesystem_without_an_adapter_gets_it(dirfs: DirFileSystem) -> None:
    assert type(adapter_for_fs(dirfs)) is GenericAdapter
    adapter, path = resolve("dir://a/b", dict(dirfs.storage_options))
    assert type(adapter) is GenericAdapter and path == "a/b"


def test_create_only_refuses_an_object_that_exists_at_commit(dirfs: DirFileSystem) -> None:
    adapter = GenericAdapter(dirfs)
    dirfs.pipe_file("k", b"first")
    f = adapter.open_atomic("k", create_only=True)
    f.write(b"second")
    with pytest.raises(FileExistsError, match="not atomic"):
        f.commit()
    assert dirfs.cat_file("k") == b"first"


def test_replacement_between_info_and_open_is_caught(dirfs: DirFileSystem) -> None:
    adapter = GenericAdapter(dirfs)
    dirfs.pipe_file("v", b"version one")
    info = adapter.info("v")
    assert info is not None and info.version is not None
    dirfs.pipe_file("v", b"version two, longer")
    with pytest.raises(IntegrityError, match="replaced"):
        adapter.open_read("v", info)


def test_a_lost_create_race_is_caught_by_verified_reads(dirfs: DirFileSystem) -> None:
    """What the declared race can leave - a record of one writer over another's bytes -
    is an IntegrityError on read, never the wrong bytes."""
    url, so = "dir://race/obj", dict(dirfs.storage_options)
    with durable.atomic_write(url, storage_options=so) as f:
        f.write(b"writer A's bytes")
    dirfs.pipe_file("race/obj", b"writer B's bytes")  # B landed after A's record
    with pytest.raises(IntegrityError, match="CRC32C"):
        durable.read_verified(url, storage_options=so)


def test_entry_round_trip_over_a_generic_filesystem(dirfs: DirFileSystem) -> None:
    entry = Entry("dir://e/table", storage_options=dict(dirfs.storage_options))
    with entry.writing() as w:
        for i in range(5):
            w.fs.pipe_file(f"{w.path}/part-{i}", os.urandom(10_000 + i))
    assert entry.state() is State.COMPLETE
    assert entry.verify(deep=True).objects == 5


def test_durable_protocol_over_a_generic_filesystem(dirfs: DirFileSystem) -> None:
    fs = DurableFileSystem(fs=dirfs)
    assert type(fs.adapter) is GenericAdapter
    with fs.open("p/x.bin", "wb") as f:
        f.write(b"payload" * 1000)
    with pytest.raises(RuntimeError), fs.open("p/y.bin", "wb") as f:
        f.write(b"half")
        raise RuntimeError
    assert fs.ls("p", detail=False) == ["p/x.bin"]
    assert fs.cat_file("p/x.bin") == b"payload" * 1000
    dirfs.pipe_file("p/x.bin", b"payload" * 999)
    with pytest.raises(IntegrityError):
        fs.cat_file("p/x.bin")


def test_failed_publish_leaves_no_partial_object(tmp_path: Path) -> None:
    """The filesystem refuses the publish half-way (RLIMIT_FSIZE: the kernel's EFBIG): the
    partial object it left is removed, not left to look whole."""
    script = textwrap.dedent(f"""
        import resource, fsspec
        from fsspec.implementations.dirfs import DirFileSystem
        from durable.adapters.generic import GenericAdapter
        adapter = GenericAdapter(DirFileSystem(path="{tmp_path}", fs=fsspec.filesystem("file")))
        f = adapter.open_atomic("big.bin")
        f.write(b"x" * 6 * 1024 * 1024)  # spooled in memory, below the spool's limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 1024 * 1024, resource.RLIM_INFINITY))
        try:
            f.commit()
        except OSError as exc:
            print("publish failed:", exc.errno)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "publish failed: 27" in out.stdout, out.stderr  # EFBIG
    assert list(tmp_path.iterdir()) == []
