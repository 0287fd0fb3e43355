"""`atomic_write`: one object, whole or not at all, with its size and CRC32C on record."""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

from durable._errors import EntryExistsError, IntegrityError, MarkerError
from durable._nesting import refuse_inside_committed
from durable._protocol import (
    MAX_MARKER_BYTES,
    Layout,
    Manifest,
    Marker,
    ObjectRecord,
    new_attempt_id,
)
from durable._recording import GrowingBuffer, TextAtomicWriter
from durable.adapters import Adapter, AtomicFile, ObjectInfo, resolve
from durable.adapters.base import VerifyLevel, VersionMismatchError

__all__ = ["atomic_write", "publish"]

_BUFFER = 1024 * 1024


def atomic_write(
    url: str,
    mode: str = "wb",
    *,
    storage_options: dict[str, Any] | None = None,
    record: bool = True,
    verify: VerifyLevel | None = None,
    encoding: str | None = None,
    newline: str | None = None,
    allow_error_document: bool = False,
) -> contextlib.AbstractContextManager[IO[Any]]:
    """Write ``url`` so that it appears whole on clean exit and is untouched otherwise.

    ``mode``: ``"wb"``/``"w"`` replace the target, ``"xb"``/``"x"`` create it only if it
    does not exist (FileExistsError at exit, on stores that enforce it).

    Local disk: a temp file in the target's directory, fsync, rename, fsync of the
    directory. Object stores: a single PUT or a multipart upload completed at exit; on any
    exception (KeyboardInterrupt included) it is aborted and nothing becomes visible.

    ``record=True`` also records the object's size and CRC32C (the object becomes a
    single-object entry), so `read_verified` can check it later. Where the request that
    publishes the object can set its metadata (an S3 PutObject up to the part size, a GCS
    upload up to 8 MiB, an Azure Put Blob or Put Block List) the record travels in the
    object's own metadata, in that same request: the object is judged by it and any marker
    beside it is superseded. Elsewhere (local disk, memory, an S3 multipart upload, a GCS
    resumable upload) a commit marker is written after the object; an existing one is removed before
    the new object is published, so a crash in between leaves the object INCOMPLETE, never
    an old record over new bytes (docs/protocol.md).

    ``verify``: after publishing, check the object in the store: ``"size"`` (one stat),
    ``"probe"`` (also read the end of each part), ``"full"`` (read back, compare CRC32C),
    ``"none"``. The default is the adapter's. On S3 a single PutObject answered with the
    CRC32C it was sent meets ``"size"`` and ``"probe"`` with no request (the store checked
    that CRC over exactly the bytes it took); see docs/guarantees.md.

    Bytes that are an object store's error document (an S3 ``<Error><Code>AccessDenied``
    page, a GCS JSON error), written with ``record=True``, are refused at exit
    (IntegrityError, nothing published): a failed download handed over as the file would
    be recorded, and every verified read would return the page as data (incident 003).
    ``allow_error_document=True`` writes them where they really are the data.

    Inside a committed entry (a directory or prefix whose marker is in an ancestor's
    ``.durable/``): EntryExistsError naming both, and nothing is published (one marker
    read per folder above; on an object store all at once, while the caller writes).
    """
    # Checked here, at the call, not when the block is entered: `atomic_write(url, data)`
    # (the data where the mode goes) without `with` wrote nothing and said nothing.
    if not isinstance(mode, str):
        raise TypeError(f"atomic_write(url, mode) is a context manager: write with `with "
                        f"durable.atomic_write(url) as f: f.write(data)`; mode must be 'wb', "
                        f"'w', 'xb' or 'x', got {type(mode).__name__} {mode!r:.40}")
    if mode not in ("wb", "w", "xb", "x", "wt", "xt"):
        raise ValueError(f"atomic_write mode must be 'wb', 'w', 'xb' or 'x', got {mode!r}")
    return _atomic_write(url, mode, storage_options=storage_options, record=record,
                         verify=verify, encoding=encoding, newline=newline,
                         allow_error_document=allow_error_document)


@contextlib.contextmanager
def _atomic_write(url: str, mode: str, *, storage_options: dict[str, Any] | None,
                  record: bool, verify: VerifyLevel | None, encoding: str | None,
                  newline: str | None, allow_error_document: bool) -> Iterator[IO[Any]]:
    """`atomic_write`, its arguments checked."""
    if os.fspath(url).endswith("/"):
        # fsspec drops the slash: "newdir/" would be written as a file named newdir.
        raise IsADirectoryError(errno.EISDIR, "a directory, not a file to write",
                                os.fspath(url))
    adapter, path = resolve(url, storage_options)
    layout: Layout | None
    if record:
        layout = Layout(path)
        layout.refuse_inside_records()
    else:
        try:
            layout = Layout(path)  # only to remove an old record: see `publish`
        except ValueError:
            layout = None  # no parent to hold records: none to remove either
    # Inside a committed entry (a marker of kind "prefix" above it), the object would
    # change data that marker still vouches for: COMPLETE over other bytes, or beside an
    # object its manifest never listed. On a local disk refused before anything is written
    # (a temp file in the entry's folder would show in its listing). On a store across a
    # network the markers above are read (all at once: one round trip) while the caller
    # writes, and the answer is awaited before anything is published (a PUT, a multipart
    # Complete; parts sent meanwhile are aborted): a refusal still leaves no object, and a
    # write does not wait a round trip for it before its first byte.
    looked: Future[None] | None = None
    if adapter.capabilities.in_process:
        refuse_inside_committed(adapter, path, "writing")
    else:
        pool = ThreadPoolExecutor(1, thread_name_prefix="durable-look-above")
        looked = pool.submit(refuse_inside_committed, adapter, path, "writing")
        pool.shutdown(wait=False)
    create_only = mode.startswith("x")
    raw = adapter.open_atomic(path, create_only=create_only)
    raw.record_follows = record
    if record and not allow_error_document:
        raw.refuse_error_documents(adapter.url(path),
                                   "write them with atomic_write(url, allow_error_document=True)")
    buffered = (io.BufferedWriter if "b" in mode else GrowingBuffer)(raw, buffer_size=_BUFFER)
    handle: IO[Any]
    if "b" in mode:
        handle = buffered
    else:
        handle = TextAtomicWriter(buffered, encoding=encoding or "utf-8", newline=newline)
    try:
        yield handle
        handle.flush()
        if looked is not None:
            looked.result()  # EntryExistsError: inside a committed entry, nothing published
    except BaseException:
        raw.abort()
        raise
    finally:
        # Detach the wrappers so that their close() cannot touch the raw file again.
        with contextlib.suppress(ValueError):
            handle.detach()
    publish(adapter, raw, path, layout, create_only=create_only, record=record,
            verify=verify or adapter.default_verify, mode=mode)


def publish(adapter: Adapter, raw: AtomicFile, path: str, layout: Layout | None, *,
            create_only: bool, record: bool, verify: VerifyLevel,
            mode: str = "wb") -> ObjectInfo:
    """Publish the finished ``raw`` at ``path``, verify it, record it (``record``): the
    steps and their order for `atomic_write` and for ``durable::`` writes. Any failure
    before the object is published aborts ``raw``.

    An old record never stands over new bytes: where the new object cannot carry its own
    record in its metadata (local disk, memory, a multipart upload; any write without a
    record), a marker beside it is removed before the new bytes are published (a crash in
    between leaves the object unrecorded: INCOMPLETE) and the new one written after them.
    """
    try:
        if create_only and adapter.info(path) is not None:
            # Refused before the marker is touched: a refused create must leave the
            # existing object COMPLETE, not strip its record.
            raise FileExistsError(f"{adapter.url(path)} exists (mode {mode!r} only "
                                  "creates)")
        marker = own = None
        if record:
            marker = Marker.new("object", new_attempt_id(), Manifest(
                {"": ObjectRecord.of(raw.checksum.size, raw.checksum.crc,
                                     raw.checksum.ending)}))
            if raw.carries_record:
                # Data and record in one request: no marker to remove first, since an
                # object carrying its own record is never judged by a marker beside it.
                own = marker.to_metadata()
        if (own is None and not create_only and layout is not None
                and _old_marker(adapter, path, layout)):
            # Without a record, too: the old one would call the new bytes corrupt.
            # (A create-only write keeps it: the object it records is there, or the
            # commit would not have got this far on a store that checks.)
            adapter.delete([layout.marker])
        info = raw.commit(record=own)
    except BaseException:
        raw.abort()
        raise
    try:
        adapter.verify_written(path, raw.checksum, verify)
    except IntegrityError:
        now = adapter.info(path)
        if info.version is not None and now is not None and now.version != info.version:
            # Not what this writer published: another writer of the same path published
            # over it in between, and what the check found is theirs, maybe COMPLETE by
            # now. It is neither removed (their data) nor judged by this writer's record
            # (no marker): this write was whole, and was then replaced.
            return info
        # The store holds something other than what was sent: take it away rather than
        # leave a wrong object under the name (no marker is written for it; a record in
        # its metadata names the bytes sent, which it does not hold: reads fail loudly).
        with contextlib.suppress(OSError):
            adapter.delete([path])
        raise
    if layout is not None and marker is not None and info.record is None:
        # Not carried by the object (local disk, a multipart upload): the marker, last.
        written = adapter.put(layout.marker, marker.encode()[0])
        _withdraw_if_replaced(adapter, path, info, layout.marker, written)
    return info


def _old_marker(adapter: Adapter, path: str, layout: Layout) -> bool:
    """Whether a marker is beside ``path`` for the write to remove; EntryExistsError if it
    is a committed directory's or prefix's: removed, that entry lost its marker for an
    object write that then failed (a directory is in the way) or took its name."""
    try:
        data = adapter.read(layout.marker, limit=MAX_MARKER_BYTES)
    except ValueError:
        return True  # not a marker anyone can read: replaced, as before
    if data is None:
        return False
    try:
        kind = Marker.decode(data, adapter.url(layout.marker)).kind
    except MarkerError:
        return True
    if kind == "prefix":
        url = adapter.url(path)
        raise EntryExistsError(
            f"{url} is a committed entry (a directory or prefix with a commit marker): "
            "writing an object at its path would take its marker. Rewrite it with "
            f"durable.Entry({url!r}).writing(overwrite=True), or delete it first", url=url)
    return True


def _withdraw_if_replaced(adapter: Adapter, path: str, info: ObjectInfo, marker: str,
                          written: ObjectInfo) -> None:
    """Two writers of one object each remove the marker, publish and write their own;
    interleaved, one's marker can land over the other's bytes, and would call them
    corrupt. Checked once the marker is written: if the object is no longer the one this
    writer published, its marker is taken back (only it: conditionally where the store
    can), leaving the other's bytes INCOMPLETE or recorded by their own writer's marker."""
    now = adapter.info(path)
    if info.version is None or (now is not None and now.version == info.version):
        return
    if written.version is not None and adapter.supports_conditional(marker):
        with contextlib.suppress(VersionMismatchError):
            adapter.delete_if(marker, written.version)
        return
    adapter.delete([marker])
