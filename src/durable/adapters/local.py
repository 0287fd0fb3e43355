"""Local disks: temp file in the same directory, fsync, rename, fsync the directory.

The order is the whole point (incident 003): a rename that reaches the disk before the
data lets another node, or this one after a crash, open the new name and read a prefix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as _stat
import threading
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from durable._errors import IntegrityError
from durable.adapters.base import Adapter, AtomicFile, Capabilities, ObjectInfo

__all__ = ["LocalAdapter", "fsync_dir"]

TMP_MARK = ".durable-tmp-"
# fsync releases the GIL: a small pool overlaps the disk's flushes at commit.
_SYNC_WORKERS = 8
# CRC32C and write(2) both release the GIL: from this block size up, the checksum runs in
# a helper thread while the kernel copies the block, so it no longer adds ~5% to a large
# write (benchmarks/bench_atomic.py). Below it, the hand-off costs more than it saves.
_OVERLAP_MIN = 2 * 1024 * 1024
_CRC_WORKERS = 4
_crc_pool: ThreadPoolExecutor | None = None
_crc_lock = threading.Lock()


def _checksum_pool() -> ThreadPoolExecutor:
    global _crc_pool
    with _crc_lock:
        if _crc_pool is None:
            _crc_pool = ThreadPoolExecutor(_CRC_WORKERS, thread_name_prefix="durable-crc")
        return _crc_pool


def _forget_pool_after_fork() -> None:
    # A pool inherited through fork() has no threads: work submitted to it would wait
    # forever. The child starts its own on first use.
    global _crc_pool, _crc_lock
    _crc_pool = None
    _crc_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename or create inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: str) -> list[str]:
    """mkdir -p; returns the directories it created, outermost first."""
    created: list[str] = []
    missing = path
    todo: list[str] = []
    while missing and not os.path.isdir(missing):
        todo.append(missing)
        missing = os.path.dirname(missing)
    for d in reversed(todo):
        try:
            os.mkdir(d)
            created.append(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
    return created


def _version(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


class _LocalAtomicFile(AtomicFile):
    def __init__(self, path: str, *, create_only: bool, durable: bool) -> None:
        super().__init__(path)
        self._create_only = create_only
        self._durable = durable
        directory, name = os.path.split(path)
        self._created_dirs = _makedirs(directory)
        self._dir = directory
        # Same directory as the target: rename(2) is atomic only within one file system,
        # and a temp in /tmp (fsspec's LocalFileSystem does that) may be another one.
        self._tmp = os.path.join(directory, f".{name}{TMP_MARK}{uuid.uuid4().hex[:12]}")
        self._fd: int | None = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._done or view.nbytes < _OVERLAP_MIN:
            return super().write(view)
        try:
            crc = _checksum_pool().submit(self.checksum.update, view)
        except RuntimeError:
            # No new threads once the interpreter is shutting down (a checkpoint saved
            # from an atexit handler): checksum, then write, one after the other.
            return super().write(view)
        # Same effect as AtomicFile.write (checksum, then the bytes), run side by side.
        try:
            self._write(view)
        finally:
            crc.result()
        return view.nbytes

    def _write(self, data: memoryview) -> None:
        assert self._fd is not None
        while data:
            n = os.write(self._fd, data)
            data = data[n:]

    def _commit(self) -> ObjectInfo:
        fd = self._fd
        assert fd is not None
        if self._durable:
            # An fsync error is final for this write: the kernel may already have dropped
            # the dirty pages, so a retried fsync on the same fd can "succeed" over lost
            # data. Raise (and _abort removes the temp file); never retry.
            os.fsync(fd)
        st = os.fstat(fd)
        self._fd = None
        os.close(fd)
        if self._create_only:
            # link(2) fails if the target exists: a create-only publish with no window.
            os.link(self._tmp, self.path)
            os.unlink(self._tmp)
        else:
            os.replace(self._tmp, self.path)
        if self._durable:
            fsync_dir(self._dir)
            # New directories are entries in their parents: make those durable too.
            for d in reversed(self._created_dirs):
                fsync_dir(os.path.dirname(d))
        return ObjectInfo(self.path, st.st_size, _version(st))

    def _abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


class LocalAdapter(Adapter):
    protocols = ("file", "local")
    capabilities = Capabilities(
        atomic_objects=True, create_only=True, durable=True, pinned_reads=True,
        note="temp file in the same directory, fsync, rename/link, directory fsync",
    )

    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        return _LocalAtomicFile(path, create_only=create_only, durable=durable)

    def sync(self, paths: Iterable[str], dirs: Iterable[str] = ()) -> None:
        """fsync every file, then each directory once (not once per file)."""
        paths = list(paths)
        all_dirs = set(dirs) | {os.path.dirname(p) for p in paths}
        with ThreadPoolExecutor(_SYNC_WORKERS) as pool:
            list(pool.map(_fsync_file, paths))
            list(pool.map(fsync_dir, sorted(all_dirs)))

    def info(self, path: str) -> ObjectInfo | None:
        try:
            # lstat: a symlink is not an object. A symlinked marker or data file would let
            # an entry's records point outside it; listings skip symlinks for the same reason.
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not _stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(path, st.st_size, _version(st))

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        out: dict[str, ObjectInfo] = {}
        root = prefix.rstrip("/")
        if not os.path.isdir(root):
            return out
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel = os.path.relpath(dirpath, root)
            for fn in filenames:
                full = os.path.join(dirpath, fn)
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    continue
                if not _stat.S_ISREG(st.st_mode):
                    continue  # symlinks are never followed out of an entry
                key = fn if rel == "." else f"{rel}/{fn}".replace(os.sep, "/")
                out[key] = ObjectInfo(full, st.st_size, _version(st))
        return out

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def open_read(self, path: str, info: ObjectInfo) -> BinaryIO:
        # Opened by inode: a later rename over the path cannot mix two versions, and a
        # replacement between listing and open is caught by comparing the version.
        # O_NOFOLLOW: a symlink swapped in after the stat is refused, not followed.
        f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")
        found = _version(os.fstat(f.fileno()))
        if info.version is not None and found != info.version:
            f.close()
            raise IntegrityError(
                f"{self.url(path)}: replaced since it was listed (expected version "
                f"{info.version}, found {found})", url=self.url(path), expected=info.version,
                found=found)
        return f

    def delete(self, paths: Iterable[str]) -> None:
        dirs = set()
        for p in paths:
            try:
                os.unlink(p)
                dirs.add(os.path.dirname(p))
            except FileNotFoundError:
                pass
        for d in dirs:
            fsync_dir(d)

    def delete_prefix(self, prefix: str) -> None:
        root = prefix.rstrip("/")
        if os.path.isdir(root) and not os.path.islink(root):
            # Bottom-up, never following symlinks out of the tree.
            for dirpath, dirnames, filenames in os.walk(root, topdown=False):
                for fn in filenames:
                    _unlink_quiet(os.path.join(dirpath, fn))
                for dn in dirnames:
                    full = os.path.join(dirpath, dn)
                    if os.path.islink(full):
                        _unlink_quiet(full)
                    else:
                        _rmdir_quiet(full)
            _rmdir_quiet(root)
        else:
            _unlink_quiet(root)
        parent = os.path.dirname(root)
        if os.path.isdir(parent):
            fsync_dir(parent)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _rmdir_quiet(path: str) -> None:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
