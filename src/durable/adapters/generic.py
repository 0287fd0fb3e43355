"""Any other fsspec filesystem (sftp, http, a DirFileSystem, ...): works, and says what it lacks.

`durable` knows nothing about such a filesystem beyond what fsspec promises, so this
adapter promises only what it can build from that, and declares the rest in
`GenericAdapter.capabilities` (which `durable status` shows):

- **Whole or nothing before commit, not during it.** Bytes are spooled locally (memory,
  then a temp file) and published at commit by one ``fs.open(path, "wb")`` stream. An
  exception, an abort or a dropped file before commit never touches the target. The
  publish itself is only as atomic as the filesystem's own writes: a crash during it can
  leave a partial object (or none, where an overwrite truncated the old one), and a reader
  during it may see a prefix. A failed publish removes what it left, best effort.
- **Create-only is check-then-write.** ``create_only=True`` refuses a target that exists
  at commit (FileExistsError), but two writers committing at the same moment can both
  succeed; the last one's bytes win. Refusing create-only outright would make every
  `Entry` unusable here (an entry commits its marker create-only), and what a lost race
  leaves behind - a marker whose manifest does not match the bytes - is caught by the
  size and CRC32C checks of every verified read and of ``Entry.verify``: wrong data is
  still never returned silently.
- **No durability step.** fsspec has no fsync; data is as durable as the filesystem makes
  a closed file.
- **Reads are not pinned.** A replacement between `info` and `open_read` is caught when
  the filesystem reports a version-like field (ETag, generation, mtime); one during a read
  is not. Recorded checksums catch a mix of two versions at the end of a verified read.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterable
from typing import Any, BinaryIO

from durable._errors import IntegrityError, UnsupportedError
from durable.adapters.base import Adapter, AtomicFile, Capabilities, ObjectInfo

__all__ = ["GenericAdapter"]

# Small objects stay in memory; larger ones spill to a local temp file.
_SPOOL_IN_MEMORY = 8 * 1024 * 1024
_COPY_BLOCK = 8 * 1024 * 1024
# Fields that change when an object is replaced, most specific first.
_VERSION_FIELDS = ("ETag", "etag", "generation", "version_id", "mtime", "LastModified",
                   "last_modified", "modified", "created")


def _version(details: dict[str, Any]) -> str | None:
    for key in _VERSION_FIELDS:
        value = details.get(key)
        if value is not None and value != "":
            return f"{key}={value}:{details.get('size')}"
    return None


class _GenericAtomicFile(AtomicFile):
    def __init__(self, adapter: GenericAdapter, path: str, *, create_only: bool) -> None:
        super().__init__(path)
        self._adapter = adapter
        self._create_only = create_only
        # Spooled, not streamed to the target: on most filesystems fs.open(path, "wb")
        # truncates or creates the target at once, so an exception mid-write would leave
        # a partial object (and an fsspec file closed by `with` publishes what it has).
        self._spool: Any = tempfile.SpooledTemporaryFile(  # noqa: SIM115 (closed at commit/abort)
            max_size=_SPOOL_IN_MEMORY)

    def _write(self, data: memoryview) -> None:
        self._spool.write(data)

    def _commit(self) -> ObjectInfo:
        fs = self._adapter.fs
        url = self._adapter.url(self.path)
        try:
            if self._create_only and self._adapter.exists(self.path):
                # Check-then-write: see the module docstring for the race this leaves.
                raise FileExistsError(f"{url} exists (create-only write; on this generic "
                                      "filesystem the check is not atomic with the write)")
            with contextlib.suppress(PermissionError, NotImplementedError):
                # Local-like filesystems need the parent; object stores ignore this.
                fs.makedirs(fs._parent(self.path), exist_ok=True)
            self._spool.seek(0)
            out = fs.open(self.path, "wb")
            try:
                shutil.copyfileobj(self._spool, out, _COPY_BLOCK)
            except BaseException:
                # The filesystem may already show a prefix: close it and take it away,
                # so a failed publish leaves no object rather than a partial one.
                with contextlib.suppress(Exception):
                    out.close()
                with contextlib.suppress(Exception):
                    fs.rm_file(self.path)
                raise
            out.close()
        finally:
            self._spool.close()
        return ObjectInfo(self.path, self.checksum.size, None)

    def _abort(self) -> None:
        self._spool.close()


class GenericAdapter(Adapter):
    """Any fsspec filesystem without an adapter of its own; see the module docstring."""

    protocols = ()
    capabilities = Capabilities(
        atomic_objects=False, create_only=False, durable=False, pinned_reads=False,
        note="generic fsspec filesystem: spooled locally and published at commit by one "
             "fs.open(path, 'wb') stream, so nothing is visible before commit, but a crash "
             "during the publish can leave a partial object and readers may see a prefix; "
             "create-only is check-then-write (two racing writers can both succeed); no "
             "fsync; reads are not pinned to a version. Recorded sizes and CRC32Cs still "
             "make every verified read catch what these allow.",
    )

    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        return _GenericAtomicFile(self, path, create_only=create_only)

    def _details(self, path: str) -> dict[str, Any] | None:
        # Listings may be cached by the filesystem: a stale one is how a reader misses a
        # commit (incident 000). Dropping the cache of one path costs nothing.
        self.fs.invalidate_cache(path)
        try:
            details: dict[str, Any] = self.fs.info(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return details

    def _object_info(self, path: str, details: dict[str, Any],
                     version: str | None) -> ObjectInfo:
        size = details.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            url = self.url(path)
            raise UnsupportedError(f"{url}: the filesystem reports size {size!r} for it; "
                                   "durable cannot check lengths without a size")
        return ObjectInfo(path, size, version)

    def info(self, path: str) -> ObjectInfo | None:
        details = self._details(path)
        if details is None or details.get("type") != "file":
            return None
        return self._object_info(path, details, _version(details))

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        root = self.fs._strip_protocol(prefix).rstrip("/")
        self.fs.invalidate_cache(root)
        try:
            found: dict[str, dict[str, Any]] = self.fs.find(root, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, ObjectInfo] = {}
        for name, details in sorted(found.items()):
            name = self.fs._strip_protocol(name)
            # A sibling such as "foo-bar" is not below "foo"; the prefix itself is not
            # below itself either.
            if details.get("type") != "file" or not name.startswith(root + "/"):
                continue
            # No version from listings: their fields can differ from info()'s, and a
            # version that disagrees with itself would fail good reads.
            out[name[len(root) + 1:]] = self._object_info(name, details, None)
        return out

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def open_read(self, path: str, info: ObjectInfo) -> BinaryIO:
        f: BinaryIO = self.fs.open(path, "rb")
        if info.version is not None:
            now = self.info(path)
            found = now.version if now is not None else "missing"
            if found != info.version:
                f.close()
                url = self.url(path)
                raise IntegrityError(f"{url}: replaced since it was listed (expected version "
                                     f"{info.version}, found {found})", url=url,
                                     expected=info.version, found=found)
        return f

    def delete(self, paths: Iterable[str]) -> None:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(p)
            self.fs.invalidate_cache(p)

    def delete_prefix(self, prefix: str) -> None:
        root = self.fs._strip_protocol(prefix).rstrip("/")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(root, recursive=True)
        self.fs.invalidate_cache(root)
