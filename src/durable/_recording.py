"""The fsspec filesystem `Entry.writing()` hands out: writes are atomic and recorded.

Code that already writes through fsspec (``fs.open(p, "wb")``, ``fs.pipe_file``, a mapper,
pandas, zarr's FsspecStore) gets, by using ``writer.fs``, every object's size and CRC32C
recorded as it streams, so the commit needs no second read. Reads go to the real
filesystem unchanged; the source of a copy (``cp_file``) is read against its record.
Writes outside the entry are refused: they would not be covered by its marker.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsspec.callbacks import DEFAULT_CALLBACK
from fsspec.spec import AbstractFileSystem

from durable._errors import UnsupportedError
from durable.adapters.base import stripped

if TYPE_CHECKING:
    from durable._writer import EntryWriter

__all__ = ["GrowingBuffer", "RecordingFileSystem", "TextAtomicWriter", "put_local", "stay_put"]

_COPY_BLOCK = 8 * 1024 * 1024


def stay_put(here: int, offset: int, whence: int, name: str) -> int:
    """A seek on a file that only grows: where it stays (what io.TextIOWrapper asks to learn
    its position), the position; anywhere else, UnsupportedOperation naming the file."""
    if (offset, whence) in ((0, io.SEEK_CUR), (here, io.SEEK_SET)):
        return here
    raise io.UnsupportedOperation(f"{name}: an atomic write only appends; seek() can stay "
                                  f"at {here}, not move")


def put_local(lpath: str, open_target: Callable[[], Any], callback: Any) -> None:
    """Copy the local file ``lpath`` into the file ``open_target()`` opens for writing,
    read against the file's record (its marker, or the manifest of the local entry that
    holds it), as a copy's source is: a checkpoint committed on local disk and damaged
    since (a flipped byte, a file cut short) was uploaded unchecked and recorded with the
    damaged bytes' own CRC32C, to verify deep and be read as good from then on. An
    unrecorded file is checked for its length only. The source is opened first: a refused
    one opens nothing to write."""
    from fsspec.implementations.local import LocalFileSystem

    from durable._verified import expected_of, missing_error, open_verified_path
    from durable.adapters.local import LocalAdapter

    # A link is the file it names, as open() reads it: a Hugging Face snapshot's files
    # are links into its blobs/, which durable's own reads (which follow no link) refused.
    path = os.path.realpath(LocalFileSystem._strip_protocol(lpath))
    try:
        special = not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        special = False  # missing: named below, as the adapter names it
    if special:
        # A FIFO or a device holds no record: read as it comes, as before.
        with open(path, "rb") as src, open_target() as dst:
            _copy(src, dst, callback)
        return
    adapter = LocalAdapter(LocalFileSystem())
    size, crc, tail = expected_of(adapter, path)
    info = adapter.info(path)
    if info is None:
        raise missing_error(adapter, path, adapter.url(path), size)
    with open_verified_path(adapter, path, size, crc, info=info, stat_taken=True,
                            tail=tail) as src, open_target() as dst:
        callback.set_size(info.size)
        _copy(src, dst, callback)


def _copy(src: Any, dst: Any, callback: Any) -> None:
    while block := src.read(_COPY_BLOCK):
        dst.write(block)
        callback.relative_update(len(block))


class GrowingBuffer(io.BufferedWriter):
    """The buffer under text written atomically. It says it can seek, as io.TextIOWrapper
    needs to: over one that cannot, tell() raised "underlying stream is not seekable" and
    utf-16/utf-32 text was written with no BOM, unlike a plain file opened for writing.
    A seek that would move is refused (`stay_put`)."""

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return stay_put(self.tell(), offset, whence, str(getattr(self.raw, "path", "")))


class TextAtomicWriter(io.TextIOWrapper):
    """Text over an atomic file: an exception in ``with`` aborts instead of publishing."""

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            raw = self.buffer.raw if isinstance(self.buffer, io.BufferedWriter) else None
            if raw is not None and hasattr(raw, "abort"):
                raw.abort()
        self.close()


class RecordingFileSystem(AbstractFileSystem):  # type: ignore[misc]
    cachable = False  # one instance per writer: its records must not be shared
    protocol = ("durable-writing",)

    def __init__(self, writer: EntryWriter, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.writer = writer
        self.fs = writer.entry.adapter.fs
        self.sep = getattr(self.fs, "sep", "/")

    def _strip_protocol(self, path: Any) -> Any:
        if isinstance(path, list):
            return [stripped(self.fs, p) for p in path]
        return stripped(self.fs, path)

    def unstrip_protocol(self, name: str) -> str:
        return str(self.fs.unstrip_protocol(name))

    def _parent(self, path: str) -> str:
        # fsspec's _parent is a classmethod calling cls._strip_protocol, which here needs
        # the instance: without this, a mapper's __setitem__ (fs.get_mapper) raises.
        return str(self.fs._parent(self._strip_protocol(path)))

    # writes -------------------------------------------------------------------------------
    def open(self, path: str, mode: str = "rb", block_size: Any = None,
             cache_options: Any = None, compression: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "r" in mode and "+" not in mode:
            return self.fs.open(path, mode, block_size=block_size,
                                cache_options=cache_options, compression=compression,
                                **kwargs)
        if mode.replace("b", "").replace("t", "") not in ("w", "x"):
            raise UnsupportedError(f"{path}: mode {mode!r} cannot be made atomic; write "
                                   "whole objects ('wb'/'xb')")
        if compression:
            raise UnsupportedError("compression= is not supported by durable writers")
        f = self.writer.open(self.writer.key_of(path), create_only=mode.startswith("x"))
        f.commit_on_close = True  # fsspec semantics: close() publishes
        if "b" in mode:
            return f
        return TextAtomicWriter(GrowingBuffer(f), encoding=kwargs.get("encoding"),
                                newline=kwargs.get("newline"))

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite",
                  **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        with self.writer.open(self.writer.key_of(path), create_only=mode == "create") as f:
            f.write(value)

    def put_file(self, lpath: str, rpath: str, callback: Any = DEFAULT_CALLBACK,
                 mode: str = "overwrite", **kwargs: Any) -> None:
        rpath = self._strip_protocol(rpath)
        # fsspec's put(recursive=True) hands every directory of the tree to put_file too
        # (as fsspec's own put_file does, it is a makedirs): opened as a file, it was an
        # IsADirectoryError, and no local checkpoint directory could be uploaded whole.
        if os.path.isdir(lpath):
            self.makedirs(rpath, exist_ok=True)
            return
        put_local(lpath, lambda: self.writer.open(self.writer.key_of(rpath),
                                                  create_only=mode == "create"), callback)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        self._still_writing()
        if truncate or not self.exists(path):
            self.pipe_file(path, b"")
        # truncate=False on an object that is there leaves its bytes as they are (it was
        # emptied). fsspec updates the timestamp only "if the backend allows"; not here: a
        # new mtime is a new version of a recorded object, which the commit would take for
        # another writer's.

    def _still_writing(self) -> None:
        # After the commit a delete through the writer would take an object out of a
        # COMPLETE entry (it went INCOMPLETE); writes are refused by the writer itself.
        if self.writer._closed:
            raise ValueError(f"{self.writer.url}: the writing() block has ended")

    def rm_file(self, path: str) -> None:
        self._still_writing()
        path = self._strip_protocol(path)
        key = self.writer.key_of(path)
        self.fs.rm_file(path)
        self.writer.forget(key)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: Any = None) -> None:
        self._still_writing()
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        for p in reversed(paths):
            if self.fs.isfile(p):
                self.rm_file(p)
            elif hasattr(self.fs, "rmdir"):
                with contextlib.suppress(OSError, NotImplementedError):
                    self.fs.rmdir(p)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._still_writing()
        self.fs.mkdir(self._strip_protocol(path), create_parents=create_parents, **kwargs)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._still_writing()
        self.fs.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        # Read against the source's record where it has one (as durable::'s cp_file):
        # a copy of damaged bytes would be recorded with their own CRC32C, and from then
        # on read back as good. An unrecorded source is checked for its length only.
        # The tail too: a codeword chunk (zarr's crc32c codec) of another attempt, of the
        # same size, has the record's size and CRC32C (the residue) and was copied.
        from durable._verified import expected_of, open_verified_path

        adapter = self.writer.entry.adapter
        source = self._strip_protocol(path1)
        size, crc, tail = expected_of(adapter, source)
        with open_verified_path(adapter, source, size, crc, tail=tail) as src, self.open(
                path2, "wb") as dst:
            while block := src.read(_COPY_BLOCK):
                dst.write(block)

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        raise UnsupportedError("mv inside a durable writer is not atomic; write in place")

    # reads: straight to the real filesystem --------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self.fs.ls(self._strip_protocol(path), detail=detail, **kwargs)

    def info(self, path: str, **kwargs: Any) -> Any:
        return self.fs.info(self._strip_protocol(path), **kwargs)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        return self.fs.cat_file(self._strip_protocol(path), start=start, end=end, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self.fs.exists(self._strip_protocol(path), **kwargs))

    def invalidate_cache(self, path: str | None = None) -> None:
        self.fs.invalidate_cache(path)
