"""fsspec's in-process memory filesystem: the adapter tests and examples lean on.

Atomic by construction (an object is one dict assignment), create-only under a lock, not
durable (it lives and dies with the process) and not shared between processes.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import threading
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from durable._errors import IntegrityError
from durable.adapters.base import (
    Adapter,
    AtomicFile,
    Capabilities,
    ObjectInfo,
    VersionMismatchError,
)

__all__ = ["MemoryAdapter"]

# One lock for all MemoryFileSystem instances: they share one class-level store. Reentrant:
# `exclusive` holds it around writes that take it again.
_LOCK = threading.RLock()
_GENERATIONS = itertools.count(1)


def _version(obj: Any) -> str:
    # A new MemoryFile object is made for every write: its identity pins the version. Ours
    # also carry a generation number: an id() can be reused once the old object is freed,
    # and a conditional write must never take a new object for the one it saw.
    gen = getattr(obj, "_durable_generation", None)
    ident = f"g{gen}" if gen is not None else f"{id(obj):x}"
    return f"{ident}:{len(obj.getbuffer())}"


def _modified(obj: Any) -> float | None:
    when = getattr(obj, "modified", None)
    return when.timestamp() if when is not None else None


class _MemoryAtomicFile(AtomicFile):
    def __init__(self, fs: Any, path: str, *, create_only: bool) -> None:
        super().__init__(path)
        self._fs = fs
        self._buf = io.BytesIO()
        self._create_only = create_only

    def _write(self, data: memoryview) -> None:
        self._buf.write(data)

    def _commit(self) -> ObjectInfo:
        from fsspec.implementations.memory import MemoryFile

        key = self._fs._strip_protocol(self.path)
        obj = MemoryFile(self._fs, key, self._buf.getvalue())
        obj._durable_generation = next(_GENERATIONS)
        with _LOCK:
            if self._create_only and key in self._fs.store:
                raise FileExistsError(f"memory://{key} exists (create-only write)")
            if key in self._fs.pseudo_dirs:
                raise IsADirectoryError(f"memory://{key} is a directory")
            self._fs.makedirs(self._fs._parent(key), exist_ok=True)
            obj.commit()
        return ObjectInfo(self.path, len(obj.getbuffer()), _version(obj))

    def _abort(self) -> None:
        self._buf = io.BytesIO()


class MemoryAdapter(Adapter):
    protocols = ("memory",)
    capabilities = Capabilities(
        atomic_objects=True, create_only=True, durable=False, pinned_reads=True,
        note="one process only; gone when the process exits",
        conditional_writes=True, in_process=True,
    )

    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        return _MemoryAtomicFile(self.fs, path, create_only=create_only)

    def _get(self, path: str) -> Any:
        return self.fs.store.get(self.fs._strip_protocol(path))

    def info(self, path: str) -> ObjectInfo | None:
        obj = self._get(path)
        if obj is None:
            return None
        return ObjectInfo(path, len(obj.getbuffer()), _version(obj), _modified(obj))

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        root = self.fs._strip_protocol(prefix).rstrip("/") + "/"
        with _LOCK:
            items = [(k, v) for k, v in self.fs.store.items() if k.startswith(root)]
        return {k[len(root):]: ObjectInfo(k, len(v.getbuffer()), _version(v), _modified(v))
                for k, v in sorted(items)}

    def exists(self, path: str) -> bool:
        key = self.fs._strip_protocol(path).rstrip("/")
        with _LOCK:
            return key in self.fs.store or any(
                k.startswith(key + "/") for k in self.fs.store)

    def open_read(self, path: str, info: ObjectInfo) -> BinaryIO:
        obj = self._get(path)
        if obj is None:
            raise FileNotFoundError(path)
        if info.version is not None and _version(obj) != info.version:
            raise IntegrityError(
                f"{self.url(path)}: replaced since it was listed", url=self.url(path),
                expected=info.version, found=_version(obj))
        # A private view of this version's bytes: a later replacement cannot leak in.
        return io.BytesIO(obj.getvalue())

    # conditional writes: under the one lock every write of this store takes -----------------
    def supports_conditional(self, path: str) -> bool:
        return True

    @contextlib.contextmanager
    def exclusive(self, path: str) -> Iterator[bool]:
        with _LOCK:
            yield True

    def _check_version(self, path: str, version: str) -> None:
        obj = self._get(path)
        found = _version(obj) if obj is not None else None
        if found != version:
            url = self.url(path)
            raise VersionMismatchError(
                f"{url}: expected version {version}, found "
                f"{found if found is not None else 'no object'}", url=url, expected=version,
                found=found)

    def replace_if(self, path: str, data: bytes, version: str) -> ObjectInfo:
        with _LOCK:
            self._check_version(path, version)
            return self.put(path, data)

    def delete_if(self, path: str, version: str) -> None:
        with _LOCK:
            self._check_version(path, version)
            self.fs.store.pop(self.fs._strip_protocol(path), None)

    def delete(self, paths: Iterable[str]) -> None:
        with _LOCK:
            for p in paths:
                self.fs.store.pop(self.fs._strip_protocol(p), None)

    def delete_prefix(self, prefix: str) -> None:
        key = self.fs._strip_protocol(prefix).rstrip("/")
        with _LOCK:
            for k in [k for k in self.fs.store if k == key or k.startswith(key + "/")]:
                del self.fs.store[k]
            for d in [d for d in self.fs.pseudo_dirs if d == key or d.startswith(key + "/")]:
                self.fs.pseudo_dirs.remove(d)
