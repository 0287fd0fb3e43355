"""The adapter conformance suite on local disk, memory, and the generic adapter.

The generic adapter runs over fsspec's DirFileSystem (a filesystem durable has no adapter
for) wrapping local disk and memory. Every raw helper reaches the objects without the
adapter under test: plain file calls for disk, the memory store's dict for memory.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import fsspec
import pytest
from fsspec.implementations.dirfs import DirFileSystem

from durable.adapters.base import Adapter
from durable.adapters.generic import GenericAdapter
from durable.adapters.local import LocalAdapter
from durable.adapters.memory import MemoryAdapter
from durable.testing.conformance import AdapterTests


def _disk_put(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Replace as another atomic writer would: a new file renamed over the old one.
    tmp = f"{path}.raw-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _disk_get(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def _disk_list(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)


class _MemoryRaw:
    """Raw access to fsspec's memory store: the dict itself, not any filesystem method."""

    mem: fsspec.AbstractFileSystem
    prefix: str = ""

    def raw_put(self, path: str, data: bytes) -> None:
        from fsspec.implementations.memory import MemoryFile

        key = self.prefix + path
        self.mem.store[key] = MemoryFile(self.mem, key, data)

    def raw_get(self, path: str) -> bytes | None:
        obj = self.mem.store.get(self.prefix + path)
        return None if obj is None else bytes(obj.getvalue())

    def raw_list(self, prefix: str) -> list[str]:
        root = self.prefix + prefix.rstrip("/") + "/"
        return sorted(k[len(self.prefix):] for k in list(self.mem.store) if k.startswith(root))

    def _drop(self, root: str) -> None:
        for k in [k for k in self.mem.store if k.startswith(root + "/")]:
            del self.mem.store[k]
        for d in [d for d in self.mem.pseudo_dirs if d.startswith(root)]:
            self.mem.pseudo_dirs.remove(d)


class TestLocalAdapter(AdapterTests):
    @pytest.fixture
    def place(self, tmp_path: os.PathLike[str]) -> Iterator[tuple[Adapter, str]]:
        yield LocalAdapter(fsspec.filesystem("file")), os.path.join(tmp_path, "place")

    def raw_put(self, path: str, data: bytes) -> None:
        _disk_put(path, data)

    def raw_get(self, path: str) -> bytes | None:
        return _disk_get(path)

    def raw_list(self, prefix: str) -> list[str]:
        return _disk_list(prefix)


class TestMemoryAdapter(_MemoryRaw, AdapterTests):
    @pytest.fixture
    def place(self) -> Iterator[tuple[Adapter, str]]:
        self.mem = fsspec.filesystem("memory")
        base = f"/conformance-{uuid.uuid4().hex}"
        yield MemoryAdapter(self.mem), base
        self._drop(base)


class TestGenericOverLocalDir(AdapterTests):
    """GenericAdapter on DirFileSystem over local disk; raw helpers use the real paths."""

    root: str

    @pytest.fixture
    def place(self, tmp_path: os.PathLike[str]) -> Iterator[tuple[Adapter, str]]:
        self.root = os.path.join(tmp_path, "root")
        os.makedirs(self.root)
        fs = DirFileSystem(path=self.root, fs=fsspec.filesystem("file"))
        yield GenericAdapter(fs), "place"

    def raw_put(self, path: str, data: bytes) -> None:
        _disk_put(os.path.join(self.root, path), data)

    def raw_get(self, path: str) -> bytes | None:
        return _disk_get(os.path.join(self.root, path))

    def raw_list(self, prefix: str) -> list[str]:
        return [os.path.relpath(p, self.root)
                for p in _disk_list(os.path.join(self.root, prefix))]


class TestGenericOverMemoryDir(_MemoryRaw, AdapterTests):
    """GenericAdapter on DirFileSystem over memory; raw helpers use the memory store."""

    @pytest.fixture
    def place(self) -> Iterator[tuple[Adapter, str]]:
        self.mem = fsspec.filesystem("memory")
        root = f"/generic-{uuid.uuid4().hex}"
        self.prefix = root + "/"
        yield GenericAdapter(DirFileSystem(path=root, fs=self.mem)), "place"
        self._drop(root)
