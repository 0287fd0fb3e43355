"""Local disks: temp file in the same directory, fsync, rename, fsync the directory.

The order is the whole point (incident 003): a rename that reaches the disk before the
data lets another node, or this one after a crash, open the new name and read a prefix.

Conditional writes (`replace_if`, `delete_if`, `exclusive`; what leases are fenced with)
take a lock: a thread lock for the threads of this process, then a POSIX record lock
(``lockf``) on a sidecar file, ``DIR.durable-lock`` beside the object's directory ``DIR``
(outside it, so that an emptied directory can still be removed). Under the lock the object
is opened and fstat-ed (on NFS, an open revalidates the attributes: close-to-open
consistency), its version compared, and the new bytes renamed into place; a conditional
delete renames the object aside and compares the version of what it took (plain deletes
and writes take no lock: one landing after the check is never removed). The lock dies
with its process (a SIGKILLed holder frees it).

The sidecar goes with what it guards: a holder releasing it while ``DIR`` holds no file
(gone, or emptied: the entry cleaned or deleted, its last writer gone) unlinks it first,
so no ``NAME.durable-lock`` outlives its entry. Unlinked only while held, and every taker,
once it holds the file it opened, checks that the path still names that file, and starts
over if not: a process that waited on the unlinked file would otherwise go on holding it
beside another that created and locked a new one (the classic lock-file race). On NFS
that check may be answered from a cached name (as it is never made by durables before
this rule). Even then no two act on one object: a taker opening the path after the unlink
finds the new file (an NFS open revalidates the name), and one that opened it before
compares versions read before ``DIR`` was found empty, of objects gone since, or of a
lease created in the microseconds before the unlink, which no one judges stale (and
takes over) that fast.

The window of a conditional replace: between its check and its rename, only a writer that
takes no lock can act. Every removal of a lease durable makes takes the lock
(`durable._nesting.remove_records`, clean), and leases are created only create-only (link(2)
fails while one is there), so no writer of durable's falls in it. A writer that takes no
lock does: a lease removed by another tool (``rm``) in it is put back by the rename, its
holder going on as if nothing happened; one put there by a plain write is overwritten.
POSIX has no rename that compares what it replaces (Linux's RENAME_EXCHANGE swaps, but not
on NFS), so this stays open to other tools, for the tens of microseconds of each renewal.

Limits: ``lockf`` reaches other machines only where the file system forwards it (local
disks: one machine; NFSv3 with NLM and NFSv4: yes). NFS mounted with ``nolock`` or
``local_lock=all|posix`` and FUSE mounts (gcsfuse, s3fs-fuse, ...) keep locks on one
machine: `supports_conditional` says False there, so leases refuse them. An NFS client cut
off from its server for longer than the server's lease time (NFSv4: typically 90 s) can
lose its lock without noticing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat as _stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from durable._errors import IntegrityError
from durable._pool import bounded_map
from durable.adapters.base import (
    Adapter,
    AtomicFile,
    Capabilities,
    ObjectInfo,
    Staged,
    VersionMismatchError,
)

__all__ = ["DEL_MARK", "TMP_MARK", "LocalAdapter", "fsync_dir"]

TMP_MARK = ".durable-tmp-"
#: What `delete_if` renames an object to before removing it (``.NAME.durable-tmp-del-*``,
#: a lease or a marker, in a records directory). One left by a process killed between the
#: rename and the unlink is debris of a removal, never a sign of a writer at work: status
#: and scan pass over it, and a clean (or an entry starting over) removes it.
DEL_MARK = f"{TMP_MARK}del-"
_NAME_MAX = 255  # bytes in one file name: ext4, xfs, btrfs, tmpfs, zfs
# fsync releases the GIL: a small pool overlaps the disk's flushes at commit.
_SYNC_WORKERS = 8
# CRC32C is computed in the writing thread, before each write(2): ~55 ms per GiB here. A
# helper thread running it beside write(2) was tried and removed: with early writeback the
# disk, not the CPU, sets the pace, and on 2 shared cores the hand-off cost more CPU and
# made times erratic (bench_atomic.py, 2026-11-29: best 0.72 vs 0.68, median 1.59 vs 0.73).


# Early writeback (what RocksDB's bytes_per_sync and PostgreSQL's *_flush_after do): every
# _WRITEBACK_EVERY bytes, ask the kernel to start writing the range just written
# (sync_file_range, SYNC_FILE_RANGE_WRITE: starts I/O, waits for nothing). The disk then
# works while Python writes the next blocks, and the final fsync, still the only thing that
# makes the data durable, finds little left to do: a 1 GiB write takes ~0.6x as long as
# write + one fsync at the end (benchmarks/bench_atomic.py, case "atomic-no-writeback").
_WRITEBACK_EVERY = 8 * 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2


def _find_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # Linux (glibc, musl)
    except (AttributeError, OSError):
        return None  # macOS, Windows: fsync alone, as before
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _find_sync_file_range()


# The commit's fsync pool, kept across commits (starting 8 threads costs ~0.5 ms, a
# tenth of a small entry's commit).
_sync_pool: ThreadPoolExecutor | None = None
_sync_pool_lock = threading.Lock()


def _fsync_pool() -> ThreadPoolExecutor:
    global _sync_pool
    with _sync_pool_lock:
        if _sync_pool is None:
            _sync_pool = ThreadPoolExecutor(_SYNC_WORKERS, thread_name_prefix="durable-fsync")
        return _sync_pool


def _forget_locks_after_fork() -> None:
    # Thread locks held by threads that did not survive the fork would never be released,
    # and the child holds none of the parent's record locks. Nor has it the pool's
    # threads: a pool inherited without them would take work and never run it.
    global _cas_locks, _cas_registry, _sync_pool, _sync_pool_lock
    _cas_locks = {}
    _cas_registry = threading.Lock()
    _sync_pool = None
    _sync_pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_locks_after_fork)


def _walk(directory: str, rel: str, out: dict[str, ObjectInfo]) -> None:
    """Regular files below ``directory`` into ``out`` by key; subdirectories in name order.
    A directory gone meanwhile lists nothing (a concurrent delete, not an error)."""
    subdirs: list[tuple[str, str]] = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                key = f"{rel}/{e.name}" if rel else e.name
                try:
                    # follow_symlinks=False: symlinks are never followed out of an entry,
                    # neither into a directory nor to a file.
                    if e.is_dir(follow_symlinks=False):
                        subdirs.append((e.path, key))
                        continue
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if _stat.S_ISREG(st.st_mode):
                    out[key] = ObjectInfo(e.path, st.st_size, _version(st), st.st_mtime)
    except (FileNotFoundError, NotADirectoryError):
        return
    for path, key in sorted(subdirs):
        _walk(path, key, out)


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
                # "File exists" naming the directory reads as if the directory were fine.
                raise NotADirectoryError(
                    errno.ENOTDIR, "a file is where a directory is needed (to hold "
                    f"{path})", d) from None
    return created


# Names no file can have here (a segment over the file system's limit, a symlink loop on
# the way): no object, as for a missing one. A manifest key from an object store (S3 takes
# segments of 1,024 bytes) made state() raise ENAMETOOLONG, and overwrite=True with it.
_NO_SUCH_NAME = frozenset({errno.ENAMETOOLONG, errno.ELOOP})


def _version(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


LOCK_SUFFIX = ".durable-lock"
#: How long a conditional write waits for the lock before giving up (TimeoutError): a
#: holder stopped (SIGSTOP) inside its few-millisecond critical section must not hang
#: every other process for good.
CAS_TIMEOUT = 10.0


class _CasLock:
    """One lock file: an RLock for this process's threads, lockf for other processes."""

    def __init__(self) -> None:
        self.thread_lock = threading.RLock()
        self.depth = 0
        self.fd: int | None = None


_cas_locks: dict[str, _CasLock] = {}
_cas_registry = threading.Lock()


def _lock_path(path: str) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.dirname(directory) == directory:
        raise ValueError(f"{path}: no conditional writes directly under a file-system root")
    return directory + LOCK_SUFFIX


@contextlib.contextmanager
def _cas_lock(path: str, timeout: float = CAS_TIMEOUT) -> Iterator[None]:
    lock_path = _lock_path(path)
    with _cas_registry:
        lock = _cas_locks.setdefault(lock_path, _CasLock())
    deadline = time.monotonic() + timeout
    # POSIX record locks belong to the process, not the thread: without this lock, two
    # threads would both "hold" it, and one closing its fd would release the other's.
    if not lock.thread_lock.acquire(timeout=timeout):
        raise TimeoutError(f"{lock_path}: lock held by another thread for over {timeout} s")
    try:
        if lock.depth == 0:
            lock.fd = _lockf(lock_path, deadline)
        lock.depth += 1
        try:
            yield
        finally:
            lock.depth -= 1
            if lock.depth == 0 and lock.fd is not None:
                fd, lock.fd = lock.fd, None
                _unlock(fd, lock_path)
    finally:
        lock.thread_lock.release()


def _lockf(lock_path: str, deadline: float) -> int:
    pause = 0.001
    while True:
        _makedirs(os.path.dirname(lock_path))
        try:
            # O_NOFOLLOW: a symlink planted at the lock's path would make O_CREAT create
            # (and lock) a file wherever it points.
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o666)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise OSError(errno.ELOOP, "the lock file is a symlink (never followed: it "
                          "could point anywhere); remove it", lock_path) from None
        try:
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lock_path}: locked by another process for over "
                                       f"{CAS_TIMEOUT} s (stopped inside a conditional "
                                       "write?)")
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
            if _names(lock_path, fd):
                return fd
        except BaseException:
            os.close(fd)
            raise
        # Its holder unlinked it while this process waited (`_unlock`): held, it locks
        # out no one who opens the path now. The file there now, or a new one, instead.
        os.close(fd)


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` names the file open as ``fd``."""
    # lstat, never a second open: closing any descriptor of a file drops this process's
    # lockf locks on it.
    try:
        at = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino)


def _unlock(fd: int, lock_path: str) -> None:
    """Release the lock held as ``fd``; unlink its file first if the directory it guards
    holds no file (module doc): a sidecar left beside every entry ever cleaned, deleted or
    given up by its writer kept the records folder from ever emptying."""
    try:
        # Tidying only: a sidecar it cannot remove (a folder not writable here) stays, as
        # it always did, and never fails the conditional write that just succeeded.
        with contextlib.suppress(OSError):
            if _holds_no_file(lock_path.removesuffix(LOCK_SUFFIX)) and _names(lock_path, fd):
                os.unlink(lock_path)
    finally:
        os.close(fd)  # releases the record lock


def _holds_no_file(directory: str) -> bool:
    """True if ``directory`` is gone or holds only directories holding no file."""
    try:
        with os.scandir(directory) as it:
            for e in it:
                if not e.is_dir(follow_symlinks=False) or not _holds_no_file(e.path):
                    return False
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False  # cannot tell: kept, as before
    return True


def _current_version(path: str) -> str | None:
    # open + fstat, not stat: on NFS an open revalidates the attributes (close-to-open),
    # where a stat may answer from a cache seconds old.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return _version(os.fstat(fd))
    finally:
        os.close(fd)


def _lock_problem(path: str) -> str | None:
    """Why record locks on ``path`` would not reach other machines, or None."""
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fstype, opts, *_ = line.split()
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and (best is None or len(mnt) > len(best[0])):
                    best = (mnt, fstype, opts)
    except OSError:
        return None  # not Linux: nothing to go by
    if best is None:
        return None
    mnt, fstype, opts = best
    options = opts.split(",")
    if fstype.startswith("fuse"):
        return f"{mnt} is a FUSE mount ({fstype}): its locks do not reach other machines"
    if fstype.startswith("nfs") and ("nolock" in options or "local_lock=all" in options
                                     or "local_lock=posix" in options):
        return f"{mnt} is NFS mounted with {opts}: its locks stay on this machine"
    return None


def _aside_name(name: str, mark: str) -> str:
    """``.NAME<mark><12 hex>``, a temp (or removal) name beside ``name``, kept within
    NAME_MAX: a name of 255 bytes (valid on ext4, xfs, btrfs) made its temp's name too long
    to create, and the object could not be written at all. What is recognised is the
    leading dot and the mark, never the name, so cutting the name is safe."""
    tag = f"{mark}{uuid.uuid4().hex[:12]}"
    head = os.fsencode(name)[:_NAME_MAX - 1 - len(tag)]
    return f".{head.decode('utf-8', 'ignore')}{tag}"


class _LocalAtomicFile(AtomicFile):
    def __init__(self, path: str, *, create_only: bool, durable: bool) -> None:
        super().__init__(path)
        self._fd: int | None = None  # set first: a failure below is aborted cleanly
        self._tmp = ""
        self._create_only = create_only
        self._durable = durable
        directory, name = os.path.split(path)
        if not name or os.path.isdir(path):
            # Else the error would name the temp file, or "dir/" would become a file.
            raise IsADirectoryError(errno.EISDIR, "a directory, not a file to write", path)
        self._created_dirs = _makedirs(directory)
        self._dir = directory
        # Same directory as the target: rename(2) is atomic only within one file system,
        # and a temp in /tmp (fsspec's LocalFileSystem does that) may be another one.
        tmp = os.path.join(directory, _aside_name(name, TMP_MARK))
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._tmp = tmp  # only once created: an abort never unlinks a name it never made
        self._written = 0
        self._started = 0  # bytes whose writeback is already started
        self._prepared = False  # bytes fsynced by `prepare`, none written since
        self._writeback: Callable[[int, int, int, int], int] | None = (
            _sync_file_range if durable else None)

    def prepare(self) -> None:
        if self._durable and self._fd is not None and not self._done:
            os.fsync(self._fd)  # an error here is final, as in `_commit`: abort, no retry
            self._prepared = True

    def _write(self, data: memoryview) -> None:
        assert self._fd is not None
        self._prepared = False  # bytes after the fsync: `_commit` fsyncs again
        while data:
            try:
                n = os.write(self._fd, data)
            except OSError as exc:
                # ENOSPC, EFBIG, EIO: "[Errno 28] No space left on device" named nothing,
                # in a loop writing many files. Final for this write (aborted by the caller).
                raise OSError(exc.errno, f"{exc.strerror} (after {self._written} bytes "
                              "written; not published)", self.path) from exc
            data = data[n:]
            self._written += n
        if self._writeback is not None and self._written - self._started >= _WRITEBACK_EVERY:
            self._start_writeback()

    def _start_writeback(self) -> None:
        assert self._fd is not None and self._writeback is not None
        start, length = self._started, self._written - self._started
        if self._writeback(self._fd, start, length, _SYNC_FILE_RANGE_WRITE) == 0:
            self._started = self._written
            return
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
            self._writeback = None  # a file system without it: fsync alone, as before
            return
        # EIO and friends: the disk refused the data. Final for this write, like an fsync
        # error (see _commit); the caller's exception aborts and removes the temp file.
        raise OSError(err, f"{self._tmp}: starting writeback failed: {os.strerror(err)}")

    def _commit(self) -> ObjectInfo:
        fd = self._fd
        assert fd is not None
        if self._durable and not self._prepared:
            # An fsync error is final for this write: the kernel may already have dropped
            # the dirty pages, so a retried fsync on the same fd can "succeed" over lost
            # data. Raise (and _abort removes the temp file); never retry.
            os.fsync(fd)
        st = os.fstat(fd)
        self._fd = None
        os.close(fd)
        if st.st_nlink == 0:
            # Removed while open (`durable clean` takes a temp file older than its
            # --older-than for a killed writer's): the rename would fail with a bare
            # ENOENT naming only the temp file.
            raise FileNotFoundError(
                errno.ENOENT, f"{self.path}: not published: its temp file was removed while "
                "it was being written (by `durable clean` with an --older-than shorter than "
                "this write, or another tool); nothing was written", self._tmp)
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
        note="temp file in the same directory, fsync, rename/link, directory fsync; "
             "conditional writes under a lockf lock on a sidecar file",
        conditional_writes=True, in_process=True,
    )

    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        return _LocalAtomicFile(path, create_only=create_only, durable=durable)

    def sync(self, paths: Iterable[str], dirs: Iterable[str] = ()) -> None:
        """fsync every file, then each directory once (not once per file)."""
        paths = list(paths)
        all_dirs = sorted(set(dirs) | {os.path.dirname(p) for p in paths})
        if len(paths) + len(all_dirs) <= 2:
            # A small commit (a marker and its directory): no thread hand-offs.
            for p in paths:
                _fsync_file(p)
            for d in all_dirs:
                _fsync_any((d, True))
            return
        # Files and directories at once: neither needs the other durable first (a
        # directory's fsync makes its names durable, a file's its bytes), and both are done
        # before this returns, which is all the marker after it needs. One batch, not two
        # one after the other: the file system commits concurrent fsyncs together.
        pool = _fsync_pool()
        for _ in bounded_map(pool, _fsync_any, [*((p, False) for p in paths),
                                                *((d, True) for d in all_dirs)],
                             ahead=4 * _SYNC_WORKERS):
            pass

    def sync_soon(self, paths: Iterable[str]) -> list[Future[None]]:
        # The same pool as `sync`'s: the disk flushes one object while the writer (or
        # tensorstore's threads) write the next, instead of every flush after the last
        # write (an 8000^2 tensorstore array: 0.95 of plain's write time, median, not 1.26).
        pool = _fsync_pool()
        return [pool.submit(_fsync_file, p) for p in paths]

    def info(self, path: str) -> ObjectInfo | None:
        try:
            # lstat: a symlink is not an object. A symlinked marker or data file would let
            # an entry's records point outside it; listings skip symlinks for the same reason.
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno in _NO_SUCH_NAME:
                return None
            raise
        if not _stat.S_ISREG(st.st_mode):
            return None
        return ObjectInfo(path, st.st_size, _version(st), st.st_mtime)

    def open_whole(self, path: str) -> tuple[ObjectInfo, BinaryIO] | None:
        # The info is the fstat of the very file opened. The base's stat then open raced a
        # rename over the path (atomic_write replacing an object and its marker): a reader
        # of a "latest" pointer got "replaced since it was listed" for a read that listed
        # nothing, or FileNotFoundError naming a marker the stat had just found.
        if self.info(path) is None:
            return None  # absent, a symlink or a special file: nothing is opened
        try:
            # O_NOFOLLOW: a symlink swapped in since is no object (ELOOP). O_NONBLOCK: nor
            # is a FIFO, which is not waited on; fstat then says it is no regular file.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None  # removed since the stat: absent now
        except OSError as exc:
            if exc.errno in _NO_SUCH_NAME:
                return None
            raise
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return ObjectInfo(path, st.st_size, _version(st), st.st_mtime), os.fdopen(fd, "rb")

    def read(self, path: str, *, limit: int | None = None) -> bytes | None:
        data = super().read(path, limit=limit)
        if data is None:
            # What `info` calls "not an object" but is there all the same: a marker, record
            # or manifest swapped for a symlink (which could point anywhere) or a directory
            # is an error naming it, never "no marker" (which a cleanup reads as unfinished).
            kind = _not_a_file(path)
            if kind is not None:
                raise ValueError(f"{self.url(path)} is {kind}, not a file")
        return data

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        out: dict[str, ObjectInfo] = {}
        _walk(prefix.rstrip("/"), "", out)
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

    # conditional writes --------------------------------------------------------------------
    def supports_conditional(self, path: str) -> bool:
        return _lock_problem(os.path.dirname(path) or ".") is None

    @contextlib.contextmanager
    def exclusive(self, path: str) -> Iterator[bool]:
        with _cas_lock(path):
            yield True

    def _check_version(self, path: str, version: str) -> None:
        found = _current_version(path)
        if found != version:
            url = self.url(path)
            raise VersionMismatchError(
                f"{url}: expected version {version}, found "
                f"{found if found is not None else 'no object'}", url=url, expected=version,
                found=found)

    def replace_if(self, path: str, data: bytes, version: str) -> ObjectInfo:
        # Check, then rename, under the lock: no conditional write and no removal durable
        # makes of a lease falls between; a tool that takes no lock can (module doc).
        with _cas_lock(path):
            self._check_version(path, version)
            return self.put(path, data, durable=False)

    def delete_if(self, path: str, version: str) -> None:
        with _cas_lock(path):
            self._check_version(path, version)
            # Plain deletes and writes take no lock: one that removed the object checked and
            # put another in its place since the check (another atomic_write's marker, a new
            # holder's lease) would be unlinked in its stead, a commit lost. So what is
            # there is renamed aside (atomic) and judged again, by its own inode.
            directory, name = os.path.split(path)
            aside = os.path.join(directory, _aside_name(name, DEL_MARK))
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                found = None  # removed by a plain delete since the check
            else:
                found = _current_version(aside)
                if found != version:
                    # Not the one checked: put back, create-only; if yet another object
                    # took the name meanwhile, that one is newer than what was taken.
                    with contextlib.suppress(FileExistsError):
                        os.link(aside, path)
                os.unlink(aside)
            if found != version:
                # No longer at that version, as GCS and Azure answer (a marker withdrawn by
                # one atomic_write as another removes it raised FileNotFoundError).
                url = self.url(path)
                raise VersionMismatchError(
                    f"{url}: expected version {version}, found "
                    f"{found if found is not None else 'no object'}", url=url,
                    expected=version, found=found)

    def prune(self, prefix: str) -> None:
        root = prefix.rstrip("/")
        if not os.path.isdir(root) or os.path.islink(root):
            return
        # rmdir only: it fails on a directory that holds anything, so a file another
        # process creates meanwhile is never removed with it.
        for dirpath, _, _ in os.walk(root, topdown=False):
            try:
                os.rmdir(dirpath)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.ENOENT, errno.EEXIST):
                    raise

    def not_an_object(self, path: str) -> str | None:
        return _not_a_file(path)

    def through_link(self, root: str, key: str) -> bool:
        where = root.rstrip("/")
        for part in ["", *key.split("/")[:-1]]:
            where = f"{where}/{part}" if part else where
            try:
                if _stat.S_ISLNK(os.lstat(where).st_mode):
                    return True
            except (FileNotFoundError, NotADirectoryError):
                return False  # nothing there to reach
            except OSError as exc:
                if exc.errno in _NO_SUCH_NAME:
                    return False
                raise
        return False

    def stage(self, path: str, data: bytes, *, create_only: bool = False) -> Staged:
        f = self.open_atomic(path, create_only=create_only)
        try:
            f.write(data)
            f.prepare()  # the bytes' fsync now: the publish is the link and the dir's fsync
        except BaseException:
            f.abort()
            raise
        return Staged(f.commit, f.abort)

    def discard(self, paths: Iterable[str]) -> None:
        # No directory fsync: a removal a crash undoes leaves what `durable clean` removes.
        for p in paths:
            try:
                os.unlink(p)
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError as exc:
                if exc.errno not in _NO_SUCH_NAME:
                    raise

    def links_in(self, directory: str) -> Sequence[str]:
        try:
            with os.scandir(directory) as it:
                return sorted(e.name for e in it if e.is_symlink())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def links_below(self, directory: str) -> Sequence[str]:
        found = []
        # os.walk follows no link (followlinks=False) and lists one to a directory among
        # the directories: a folder holding nothing but a link is looked into too.
        for dirpath, dirnames, filenames in os.walk(directory):
            rel = os.path.relpath(dirpath, directory)
            found += [name if rel == "." else f"{rel}/{name}"
                      for name in dirnames + filenames
                      if os.path.islink(os.path.join(dirpath, name))]
        return sorted(found)

    def delete(self, paths: Iterable[str]) -> None:
        dirs = set()
        for p in paths:
            try:
                os.unlink(p)
                dirs.add(os.path.dirname(p))
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError as exc:
                if exc.errno not in _NO_SUCH_NAME:
                    raise
        for d in dirs:
            # Removed since the unlink (another clean or delete of the same tree): no name
            # is left in it to make durable. Raised, it failed a clean racing another ("No
            # such file or directory"), the entry removed all the same.
            with contextlib.suppress(FileNotFoundError):
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
        elif not os.path.lexists(root):
            return  # nothing there: no directory changed, none to fsync (every commit asks)
        else:
            _unlink_quiet(root)
        parent = os.path.dirname(root)
        if os.path.isdir(parent):
            fsync_dir(parent)


def _fsync_any(item: tuple[str, bool]) -> None:
    path, is_dir = item
    if not is_dir:
        _fsync_file(path)  # a file gone is the caller's to judge: it raises
        return
    try:
        fsync_dir(path)
    except FileNotFoundError:
        # A directory that is not there holds nothing to make durable (an entry that
        # wrote no object has none); a file gone from it fails its own fsync.
        return


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _not_a_file(path: str) -> str | None:
    """What is at ``path`` if something other than a regular file is; None otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in _NO_SUCH_NAME:
            return None
        raise
    if _stat.S_ISLNK(mode):
        return "a symlink"
    if _stat.S_ISDIR(mode):
        return "a directory"
    return None if _stat.S_ISREG(mode) else "a special file"


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
