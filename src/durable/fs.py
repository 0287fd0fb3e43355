"""``durable::`` - an fsspec protocol that gives any other one whole objects and verified reads.

Code that already writes through fsspec changes only its URL::

    df.to_parquet("durable::s3://bucket/t.parquet", storage_options={"s3": {...}})
    with fsspec.open("durable::file:///data/x.npy", "wb") as f:
        np.save(f, array)
    pd.read_parquet("durable::s3://bucket/t.parquet", storage_options={"s3": {...}})

Options reach the inner filesystem the fsspec way: under its protocol name (``s3={...}``),
or as ``target_protocol``/``target_options`` (``fs=`` takes an instance). Options given at
the top level that are not durable's own (``verify``) go to the inner filesystem as well,
so ``storage_options={"endpoint_url": ...}`` is not silently dropped. Chained URLs need
fsspec >= 2025.10 (`ChainedFileSystem`, which hands the inner path to the outer layer).

What it guarantees, per object:

- **Whole or nothing.** Every file opened for writing (``"wb"``, ``"xb"``, ``"w"``,
  ``"x"``), and every ``pipe_file``, ``put_file``, ``touch`` and copy, is one atomic write
  through the inner filesystem's adapter (what "atomic" means per store is the adapter's
  `Capabilities`). ``close()`` publishes, as fsspec's files do, **except** when it runs
  while an exception raised after the open is being handled - which is how
  ``with fsspec.open(...)``, pandas and pyarrow close a file on failure - or after a
  write to the file failed: then nothing is published (s3fs alone would commit the
  partial object there). Leaving ``with fs.open(...)`` by an exception, ``discard()``,
  and garbage collection of an unclosed file publish nothing; ``commit()`` publishes
  explicitly. StopIteration in flight does not count as a failure.
- **Recorded.** Each object's size and CRC32C, computed as the bytes stream past, are
  recorded exactly as `durable.atomic_write` records them: where one request publishes
  the object (an S3 PutObject, up to the adapter's part size) in the object's own metadata,
  in that same request (no marker request at all); elsewhere (local disk, memory, a
  multipart upload) in a single-object commit marker (``PARENT/.durable/NAME/commit.json``)
  written after the object, the old marker removed before new bytes are published, so a
  crash in between leaves no record over the wrong bytes (docs/protocol.md, "Records in
  object metadata").
- **Verified reads.** ``open(..., "rb")``, ``cat_file`` and everything built on them
  check the bytes against the record when there is one (a whole-object CRC32C check
  before the first byte of a random-access read, as `durable.open_verified` does), and
  against the size the store declares otherwise: a short or corrupt body is an
  IntegrityError, never data, and so is an object store's error document (at most 64 KiB,
  `durable._verified.error_document`) served as an unrecorded object, or as a recorded one
  whose record it hides. An entry's marker is read once per commit (`RecordCache`:
  kept, revalidated by one stat of its version before each use). ``get_file`` (what
  ``simplecache::durable::`` copies with) puts the copy in place only once every byte
  passed: a refused body leaves no local file. ``put_file`` reads its local source
  against the source's record (`durable._recording.put_local`).
- **Out of sight, out of the way.** Listings (``ls``, ``find``, ``glob``, ``walk``) hide
  the ``.durable`` record directories and local temp files; ``rm`` removes an object's
  record with it (the marker first). It never takes a lease another writer holds live
  (removing an entry, its records, or a folder holding them): IncompleteExistsError
  naming the entry and the holder, as `Entry.delete` refuses (whose ``force=True`` is
  the way to remove it anyway).
- **Committed entries are read-only.** Writing, touching, removing or moving anything inside
  a committed entry (a directory or prefix with a commit marker) is an EntryExistsError
  naming both: its marker would vouch for data it no longer describes. ``cp``/``mv`` with
  ``recursive=True`` of a committed entry copy it as an entry: the objects its manifest
  lists, read against it, committed by a marker of its own (or removed on any failure).

Not supported (UnsupportedError rather than a weaker write): append and update modes,
``compression=`` on write (compress before writing), fsspec transactions (they commit
file by file; an `Entry` is the multi-object commit).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
import threading
from typing import Any, cast

import fsspec
from fsspec.callbacks import DEFAULT_CALLBACK
from fsspec.implementations.chained import ChainedFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import isfilelike, stringify_path

from durable._atomic import publish
from durable._entry import Entry
from durable._errors import IntegrityError, UnsupportedError
from durable._nesting import refuse_inside_committed, refuse_leased, remove_records
from durable._protocol import LEASE_NAME, RECORDS_DIR, Layout, Marker
from durable._record_cache import RecordCache
from durable._recording import TextAtomicWriter, put_local, stay_put
from durable._verified import (
    READ_ATTEMPTS,
    VerifiedReader,
    missing_error,
    open_verified_path,
    replaced_since,
)
from durable.adapters import adapter_for_fs, refuse_ambiguous
from durable.adapters.base import AtomicFile, ObjectInfo, VerifyLevel, stripped
from durable.adapters.local import TMP_MARK, LocalAdapter

__all__ = ["DurableFileSystem", "DurableReadFile", "DurableWriteFile"]

PROTOCOL = "durable"
_BUFFER = 1024 * 1024
_COPY_BLOCK = 8 * 1024 * 1024
_LEVELS = (None, "none", "size", "probe", "full")
# Control flow, not failure: a close() while one of these is handled still publishes.
_NOT_FAILURES = (StopIteration, StopAsyncIteration)


def _hidden(name: str) -> bool:
    base = name.rstrip("/").rpartition("/")[2]
    return base == RECORDS_DIR or (base.startswith(".") and TMP_MARK in base)


class DurableWriteFile(io.BufferedIOBase):
    """A file whose bytes become one object, whole and recorded, when it is committed."""

    def __init__(self, fs: DurableFileSystem, path: str, *, create_only: bool) -> None:
        super().__init__()
        if any(part == RECORDS_DIR for part in path.split("/")):
            raise ValueError(f"{fs.adapter.url(path)}: paths inside {RECORDS_DIR!r} "
                             "directories hold durable's records, not data")
        # As atomic_write refuses them: written, "a/../b" would be a literal key that
        # read_verified (and a copy to a disk) takes for another object.
        refuse_ambiguous(fs.adapter, path, fs.unstrip_protocol(path))
        # A COMPLETE entry is read-only here: an object written into it left its marker
        # vouching for other bytes (or for a manifest that does not list the new one).
        refuse_inside_committed(fs.adapter, path, "writing")
        if create_only and fs.adapter.info(path) is not None:
            # At the open, as a plain file's "xb" refuses: refused only at close (as the
            # commit still checks, for a racing writer), it let the caller write every
            # byte first, and a `with` block ran to its end for nothing.
            raise FileExistsError(errno.EEXIST, "exists (mode 'xb' only creates)",
                                  fs.unstrip_protocol(path))
        self.fs = fs
        self.path = path
        self.mode = "xb" if create_only else "wb"
        self.info: ObjectInfo | None = None
        self._layout = Layout(path)
        self._create_only = create_only
        # An exception already being handled at open (a write in an `except` block) is
        # not a failure of this write; one raised later is.
        self._exc_at_open = sys.exc_info()[1]
        self._failed = False
        self._buf = bytearray()
        # Under durable's own text wrapper: seeks in place allowed (`GrowingBuffer`'s reason).
        self.under_text = False
        self._raw: AtomicFile = fs.adapter.open_atomic(path, create_only=create_only)
        self._raw.record_follows = True  # `_publish` records it (a marker, if need be)
        # Recorded, a failed download's error page would be returned as data ever after.
        self._raw.refuse_error_documents(
            fs.adapter.url(path), "write them with durable.atomic_write(url, "
            "allow_error_document=True)")

    @property
    def name(self) -> str:
        return self.path

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._raw.tell() + len(self._buf)

    def seekable(self) -> bool:
        # True for the text wrapper fsspec.open(..., "w") puts over this binary file (it
        # asks once, at its start): over one that said False its tell() raised "underlying
        # stream is not seekable" and utf-16/utf-32 went out with no BOM, unlike a plain
        # file. A seek still never moves (below).
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if not self.under_text:
            # Not even in place: zipfile (np.savez, openpyxl) asks seek(tell()) to learn
            # whether it may rewrite its headers later; refused, it streams instead.
            return super().seek(offset, whence)
        return stay_put(self.tell(), offset, whence, self.fs.unstrip_protocol(self.path))

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError(f"{self.path}: write to a closed file")
        view = memoryview(data).cast("B")
        n = view.nbytes
        if len(self._buf) + n >= _BUFFER:
            self._push()
        if n >= _BUFFER:
            self._raw_write(view)
        else:
            self._buf += view
        return n

    def _push(self) -> None:
        if self._buf:
            buf, self._buf = self._buf, bytearray()
            self._raw_write(buf)

    def _raw_write(self, data: Any) -> None:
        try:
            self._raw.write(data)
        except BaseException:
            # A write that failed half-way must never be published by a later close().
            self._failed = True
            raise

    def flush(self) -> None:
        if not self.closed:
            self._push()

    def commit(self) -> ObjectInfo:
        """Publish the object, verify it, record it; afterwards the file is closed."""
        if self.closed:
            if self.info is None:
                raise ValueError(f"{self.path}: discarded, nothing to commit")
            return self.info
        try:
            if self._failed:
                raise ValueError(f"{self.fs.unstrip_protocol(self.path)}: a write to this "
                                 "file failed; publishing it would publish a partial object")
            self._push()
            self.info = self.fs._publish(self._raw, self._layout, self._create_only)
        except BaseException:
            self._raw.abort()
            raise
        finally:
            super().close()
        return self.info

    def discard(self) -> None:
        """Drop everything written; the target is left as it was."""
        if not self.closed:
            try:
                self._raw.abort()
            finally:
                super().close()

    abort = discard

    def close(self) -> None:
        if self.closed:
            return
        exc = sys.exc_info()[1]
        failing = exc is not None and exc is not self._exc_at_open and not isinstance(
            exc, _NOT_FAILURES)
        if self._failed or failing:
            self.discard()
        else:
            self.commit()

    def __enter__(self) -> DurableWriteFile:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self.closed:
            return
        if exc_type is None:
            self.commit()
        else:
            self.discard()

    def __del__(self) -> None:
        # Never publish from the garbage collector: an unclosed file is a writer that
        # stopped part-way (fsspec's own files commit here; these do not).
        if not getattr(self, "closed", True):
            with contextlib.suppress(Exception):
                self._raw.abort()


class _TextWriter(TextAtomicWriter):
    """Text over a DurableWriteFile, with the same exit and garbage-collection rules."""

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None and not self.closed:
            self._binary().discard()
        self.close()

    def __del__(self) -> None:
        # io.TextIOWrapper's own finalizer would close(), and so publish, the buffer.
        with contextlib.suppress(Exception):
            if not self.closed:
                self._binary().discard()

    def _binary(self) -> DurableWriteFile:
        return cast(DurableWriteFile, self.buffer)


class DurableReadFile(io.BufferedReader):
    """A verified reader of one object, with the ``size``/``path`` fsspec files have."""

    def __init__(self, raw: VerifiedReader, *, fs: DurableFileSystem, path: str,
                 size: int) -> None:
        super().__init__(raw, buffer_size=_BUFFER)
        self.fs = fs
        self.path = path
        self.size = size


class DurableFileSystem(ChainedFileSystem):  # type: ignore[misc]
    """fsspec filesystem ``durable``: wraps another one; see the module docstring."""

    protocol = PROTOCOL
    root_marker = ""
    # The inner path does not make another instance: one per inner filesystem.
    _strip_tokenize_options = ("fo",)

    def __init__(self, fo: str | None = None, *, target_protocol: str | None = None,
                 target_options: dict[str, Any] | None = None, fs: Any = None,
                 verify: VerifyLevel | None = None, asynchronous: bool = False,
                 **inner_options: Any) -> None:
        # ``asynchronous``: zarr's FsspecStore asks every filesystem for it, and wraps a
        # synchronous one (as this is). Handed on, it made the inner filesystem async,
        # whose calls from here then failed ("Loop is not running": durable:: under zarr
        # on S3). Not the inner filesystem's option, and nothing this one does differently.
        del asynchronous
        super().__init__()
        if verify not in _LEVELS:
            raise ValueError(f"verify must be one of {_LEVELS[1:]}, got {verify!r}")
        if fs is None:
            if target_protocol is None:
                raise ValueError("durable:: wraps another filesystem: use a chained URL "
                                 "('durable::s3://bucket/key'), target_protocol= or fs=")
            fs = fsspec.filesystem(target_protocol, **{**inner_options,
                                                       **(target_options or {})})
        elif target_protocol is not None or target_options or inner_options:
            raise ValueError("give either fs= or target_protocol=/options, not both")
        self.fs = fs
        self.verify: VerifyLevel | None = verify
        self.adapter = adapter_for_fs(fs, target_protocol)
        # Each entry's marker read once per commit, not once per object (`RecordCache`).
        self.records = RecordCache(self.adapter)
        # Paths are the inner filesystem's own. fsspec calls these on instances, so the
        # instance attributes shadow the class-level ones (as CachingFileSystem does).
        self._strip_protocol = self._strip_inner
        self._parent = fs._parent
        self.root_marker = fs.root_marker
        self.sep = getattr(fs, "sep", "/")
        # The (source, destination) pairs of a copy being planned, per thread (`copy`).
        self._planned = threading.local()

    def _strip_inner(self, path: Any) -> Any:
        if isinstance(path, list | tuple):
            return [self._strip_inner(p) for p in path]
        path = stringify_path(path)
        if path.startswith(PROTOCOL + "::"):
            path = path[len(PROTOCOL) + 2:]
        return stripped(self.fs, path)

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}::{self.adapter.url(name)}"

    # writing ------------------------------------------------------------------------------
    def open(self, path: Any, mode: str = "rb", block_size: Any = None,
             cache_options: Any = None, compression: Any = None, **kwargs: Any) -> Any:
        if compression is not None and "r" not in mode:
            raise UnsupportedError("compression= on write is not supported by durable:: "
                                   "(a compressor closed by the garbage collector would "
                                   "publish); compress the bytes before writing them")
        if "b" in mode or "r" in mode:
            return super().open(path, mode, block_size=block_size,
                                cache_options=cache_options, compression=compression,
                                **kwargs)
        text = {k: kwargs.pop(k) for k in ("encoding", "errors", "newline") if k in kwargs}
        binary = self.open(path, mode.replace("t", "") + "b", compression=compression,
                           **kwargs)
        binary.under_text = True
        return _TextWriter(binary, **text)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None,
              autocommit: bool = True, cache_options: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if mode == "rb":
            return self._open_read(path)
        if mode not in ("wb", "xb"):
            raise UnsupportedError(f"{self.unstrip_protocol(path)}: mode {mode!r} cannot be "
                                   "made atomic; durable:: writes whole objects ('wb'/'xb')")
        if not autocommit:
            raise UnsupportedError("fsspec transactions commit file by file; durable:: "
                                   "writes are atomic per object, and durable.Entry commits "
                                   "many objects at once")
        return DurableWriteFile(self, path, create_only=mode == "xb")

    def _publish(self, raw: AtomicFile, layout: Layout, create_only: bool) -> ObjectInfo:
        return publish(self.adapter, raw, layout.path, layout, create_only=create_only,
                       record=True, verify=self.verify or self.adapter.default_verify,
                       mode="xb" if create_only else "wb")

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite",
                  **kwargs: Any) -> None:
        with self.open(path, "xb" if mode == "create" else "wb") as f:
            f.write(value)

    def put_file(self, lpath: str, rpath: str, callback: Any = DEFAULT_CALLBACK,
                 mode: str = "overwrite", **kwargs: Any) -> None:
        if os.path.isdir(lpath):
            self.makedirs(rpath, exist_ok=True)
            return
        # Read against its record: a damaged local checkpoint is refused, not recorded.
        put_local(lpath, lambda: self.open(rpath, "xb" if mode == "create" else "wb"),
                  callback)

    def copy(self, path1: Any, path2: Any, recursive: bool = False,
             maxdepth: int | None = None, on_error: str | None = None,
             **kwargs: Any) -> None:
        # fsspec's copy decides which path goes where (trailing slashes, globs, existing
        # destinations); here its pairs are only collected, then copied entry-aware.
        pairs: list[tuple[str, str]] = []
        self._planned.pairs = pairs
        try:
            super().copy(path1, path2, recursive=recursive, maxdepth=maxdepth,
                         on_error="raise", **kwargs)
        finally:
            self._planned.pairs = None
        ignore = on_error == "ignore" or (on_error is None and recursive)
        for src, dst in self._copy_entries(pairs):
            try:
                self.cp_file(src, dst)
            except FileNotFoundError:
                if not ignore:
                    raise

    def _copy_entries(self, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Copy each committed entry among the sources whole, as an entry: the pairs left.

        Object by object, its marker stayed behind: the copy was INCOMPLETE, its objects
        each a single-object entry; the records an entry holds (a nested entry's marker)
        are hidden from listings and were not copied at all. Its manifest says what to
        copy, each object is read against it, and the copy is committed by a marker of
        its own, or removed if any object fails (AlreadyCompleteError or
        IncompleteExistsError if something is at the destination already)."""
        sources = {p for p, _ in pairs}
        dirs = {p.rstrip("/").rpartition("/")[0] for p in sources} & sources
        copied: list[str] = []
        left = []
        for src, dst in sorted(pairs):
            if any(src.startswith(f"{c}/") for c in copied):
                continue  # copied with its entry, by the manifest
            marker = self._prefix_marker(src) if src in dirs else None
            if marker is None:
                left.append((src, dst))
                continue
            self._copy_entry(Entry(src, adapter=self.adapter), marker, dst)
            copied.append(src.rstrip("/"))
        return left

    def _prefix_marker(self, path: str) -> Marker | None:
        try:
            marker = Entry(path, adapter=self.adapter).read_marker()
        except ValueError:
            return None  # a root: no entry
        return marker if marker is not None and marker.kind == "prefix" else None

    def _copy_entry(self, source: Entry, marker: Marker, dst: str) -> None:
        assert marker.manifest is not None
        with Entry(dst, adapter=self.adapter).writing(unrecorded="error") as w:
            for key, rec in sorted(marker.manifest.objects.items()):
                # With its tail: a codeword chunk of another attempt put over one of the
                # same size has its size and CRC32C (the residue), and was copied as good.
                with open_verified_path(self.adapter, source.layout.object_path(
                        key, "prefix"), rec.size, rec.crc32c, tail=rec.tail) as src, \
                        w.open(key, records=True) as out:
                    while block := src.read(_COPY_BLOCK):
                        out.write(block)

    def mv(self, path1: Any, path2: Any, recursive: bool = False,
           maxdepth: int | None = None, **kwargs: Any) -> None:
        if path1 != path2:
            # Refused before the copy: refused after it, the move left two copies.
            moved = self.expand_path(path1, recursive=recursive, maxdepth=maxdepth)
            self._refuse_removing(moved)
            self._refuse_leased(moved, recursive)
        super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        if getattr(self._planned, "pairs", None) is not None:
            self._planned.pairs.append((self._strip_protocol(path1),
                                        self._strip_protocol(path2)))
            return
        # Read verified, written atomically: a copy is never of bytes that were wrong.
        try:
            src = self.open(path1, "rb")
        except (FileNotFoundError, IsADirectoryError):
            # A directory, as a recursive copy or move lists them (fsspec's mv stops at
            # the first FileNotFoundError: `mv -r` of any directory failed): made, as the
            # local and memory filesystems' cp_file do; nothing to do on object stores.
            if not self.fs.isdir(self._strip_protocol(path1)):
                raise
            self.fs.makedirs(self._strip_protocol(path2), exist_ok=True)
            return
        with src, self.open(path2, "wb") as dst:
            while block := src.read(_COPY_BLOCK):
                dst.write(block)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        if truncate or not self.exists(path):
            self.pipe_file(path, b"")
        else:
            refuse_inside_committed(self.adapter, self._strip_protocol(path), "touching")
            self.fs.touch(self._strip_protocol(path), truncate=False, **kwargs)

    # reading ------------------------------------------------------------------------------
    def _open_read(self, path: str) -> DurableReadFile:
        for attempt in range(1, READ_ATTEMPTS + 1):
            info = self.adapter.info(path)
            try:
                return self._open_read_once(path, info)
            except IntegrityError:
                # Replaced between the stat and the open (`open_verified`'s reason).
                if attempt == READ_ATTEMPTS or not replaced_since(self.adapter, path, info):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _open_read_once(self, path: str, info: ObjectInfo | None) -> DurableReadFile:
        adapter = self.adapter
        url = self.unstrip_protocol(path)
        found = self.records.find(path, info)
        size = crc = tail = None
        if found is not None:
            size, crc, tail = found.record.size, found.record.crc32c, found.record.tail
        if info is None:
            raise missing_error(adapter, path, url, size)
        if size is not None and info.size != size:
            raise IntegrityError(f"{url}: recorded with {size} bytes, the store says "
                                 f"{info.size}", url=url, expected=size, found=info.size)
        raw = VerifiedReader(adapter, path, info, crc, tail=tail)
        return DurableReadFile(raw, fs=self, path=path, size=info.size)

    def get_file(self, rpath: str, lpath: Any, callback: Any = DEFAULT_CALLBACK,
                 outfile: Any = None, **kwargs: Any) -> None:
        if outfile is not None or isfilelike(lpath) or self.isdir(rpath):
            super().get_file(rpath, lpath, callback=callback, outfile=outfile, **kwargs)
            return
        # A temp file renamed into place once every byte passed: a refused body (short,
        # corrupt, an error page) must leave no local file, which a cache in front
        # (simplecache::durable::) would otherwise serve as the object from then on.
        local = LocalAdapter(LocalFileSystem())
        with self.open(rpath, "rb") as src, local.open_atomic(
                LocalFileSystem._strip_protocol(stringify_path(lpath))) as dst:
            callback.set_size(getattr(src, "size", None))
            while block := src.read(_COPY_BLOCK):
                dst.write(block)
                callback.relative_update(len(block))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        with self._open_read(self._strip_protocol(path)) as f:
            size = f.size
            first = 0 if start is None else (start if start >= 0 else max(0, size + start))
            stop = size if end is None else (end if end >= 0 else size + end)
            stop = min(stop, size)
            if first >= stop:
                return b""
            if stop - first < size:
                # A part of the object: checked whole first, as a seek does. From byte 0
                # it would otherwise be the start of a sequential read, whose CRC32C is
                # checked only at the end, which the range never reaches.
                cast(VerifiedReader, f.raw).check_whole()
            if first:
                f.seek(first)
            return bytes(f.read(stop - first))

    # listing: the inner filesystem's, without durable's records ---------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        entries = self.fs.ls(self._strip_protocol(path), detail=detail, **kwargs)
        return [e for e in entries if not _hidden(e["name"] if detail else e)]

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False,
             detail: bool = False, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        found = self.fs.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail,
                             **kwargs)
        root = path.rstrip("/") + "/"

        def keep(name: str) -> bool:
            below = name[len(root):] if name.startswith(root) else name
            return not any(_hidden(part) for part in below.split("/"))

        if detail:
            return {k: v for k, v in found.items() if keep(k)}
        return [p for p in found if keep(p)]

    def info(self, path: str, **kwargs: Any) -> Any:
        return self.fs.info(self._strip_protocol(path), **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self.fs.exists(self._strip_protocol(path), **kwargs))

    def modified(self, path: str) -> Any:
        return self.fs.modified(self._strip_protocol(path))

    def created(self, path: str) -> Any:
        return self.fs.created(self._strip_protocol(path))

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.fs.mkdir(self._strip_protocol(path), create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.fs.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def rmdir(self, path: str) -> None:
        self.fs.rmdir(self._strip_protocol(path))

    def invalidate_cache(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(None if path is None else self._strip_protocol(path))

    # removing: data and its record ---------------------------------------------------------
    def _layout(self, path: str) -> Layout | None:
        try:
            return Layout(path)
        except ValueError:
            return None  # a root has no records

    def _drop_records(self, layouts: list[Layout]) -> None:
        for layout in layouts:
            if self.adapter.exists(layout.records):
                remove_records(self.adapter, layout)  # a lease: as a renewal's lock says
            # An empty records dir left on disk or in memory; object stores have none.
            with contextlib.suppress(OSError, NotImplementedError, ValueError):
                self.fs.rmdir(layout.records.rpartition("/")[0])

    def _a_directory(self, path: str) -> bool:
        """Something is at ``path`` but no object: a directory or prefix (or a symlink)."""
        return self.adapter.info(path) is None and self.adapter.exists(path)

    def _refuse_removing(self, paths: list[str]) -> None:
        """EntryExistsError if any of ``paths`` lies inside a committed entry that is not
        removed with it: removed, its objects left the entry COMPLETE over data gone
        (removing an entry whole takes its marker first)."""
        chosen = {p.rstrip("/") for p in paths}
        checked: set[str] = set()
        for p in sorted(chosen):
            parent = p.rpartition("/")[0]
            if parent in chosen or parent in checked:
                continue  # removed with its parent, or that parent was looked at
            checked.add(parent)
            refuse_inside_committed(self.adapter, p, "removing")

    def _refuse_leased(self, removed: list[str], recursive: bool) -> None:
        """IncompleteExistsError, as `Entry.delete` refuses, naming the entry, the holder and
        how to force, if removing ``removed`` (``recursive``: with everything below) takes
        a lease another writer holds live: removed under it, the holder wrote on into an
        entry removed (or the next writer's), and learnt only at its commit."""
        for entry in self._leased({p.rstrip("/") for p in removed}, recursive):
            refuse_leased(entry, "removing it", "delete the entry with durable.Entry("
                          f"{entry.url!r}).delete(force=True)")

    def _leased(self, chosen: set[str], recursive: bool) -> list[Entry]:
        """The entries with a lease that removing ``chosen`` takes: each path's own (its
        records go with it), those a path inside a records directory names (or all of
        that directory's), and with ``recursive`` every entry below a path (their records
        are inside it, hidden from the listing that expanded the paths). One listing per
        records directory, and per top path removed recursively."""
        names: dict[str, set[str]] = {}  # records dir's parent -> entry names removed
        whole: set[str] = set()  # records dirs' parents whose records dir is removed
        found: set[str] = set()
        for p in sorted(chosen):
            parts = p.split("/")
            if RECORDS_DIR in parts:
                at = len(parts) - 1 - parts[::-1].index(RECORDS_DIR)
                parent = "/".join(parts[:at])
                if at + 1 < len(parts):
                    names.setdefault(parent, set()).add(parts[at + 1])
                else:
                    whole.add(parent)
                continue
            parent, _, name = p.rpartition("/")
            if parent:
                names.setdefault(parent, set()).add(name)
            if recursive and parent not in chosen:
                for key in self.adapter.list(p):
                    below = key.split("/")
                    # PATH/[DIR/...].durable/NAME/lease.json: the entry PATH/[DIR/...]NAME
                    if len(below) >= 3 and below[-3] == RECORDS_DIR and below[-1] == LEASE_NAME:
                        found.add("/".join([p, *below[:-3], below[-2]]))
        for parent in names.keys() | whole:
            for key in self.adapter.list(f"{parent}/{RECORDS_DIR}"):
                entry, _, last = key.partition("/")
                if last == LEASE_NAME and (parent in whole or entry in names[parent]):
                    found.add(f"{parent}/{entry}")
        return [Entry(e, adapter=self.adapter) for e in sorted(found)]

    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        self._refuse_removing([path])
        layout = self._layout(path)
        if layout is not None and self._a_directory(path):
            # A directory (a prefix entry): rm_file does not remove it (an error on a
            # local disk, nothing on an object store), so its commit stays with it.
            layout = None
        if layout is not None:
            self._refuse_leased([path], recursive=False)
            # Marker first: from here on the object is never taken for a recorded one.
            self.adapter.delete([layout.marker])
        self.fs.rm_file(path)
        self._drop_records([layout] if layout is not None else [])

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        # Not recursive: a directory (a prefix entry) is not removed (an error on a local
        # disk, nothing on an object store), so its marker and records stay; only objects
        # lose theirs. A refused rm took a COMPLETE entry's marker and left its data.
        removed = paths if recursive else [p for p in paths if not self._a_directory(p)]
        self._refuse_removing(paths)
        self._refuse_leased(removed, recursive)
        layouts = [lo for lo in map(self._layout, removed) if lo is not None]
        self.adapter.delete([lo.marker for lo in layouts])
        # The expanded list, children first: the inner filesystem never sees a pattern that
        # could match the hidden records dirs, and never removes a parent before a child.
        self.fs.rm(paths[::-1], recursive=recursive, maxdepth=maxdepth)
        self._drop_records(layouts)


# The entry point (pyproject: fsspec.specs) registers this when durable-io is installed;
# importing the module makes it work from a source tree too.
fsspec.register_implementation(PROTOCOL, DurableFileSystem, clobber=True)
