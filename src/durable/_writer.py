"""The writer of an entry: where to write, and the record of what was written.

Every object written through an `EntryWriter` (or its ``fs``) is recorded (size and CRC32C
as the bytes stream); objects written by other means are recorded by the integrations
that wrote them. The commit (`durable._commit`) turns those records into the manifest.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING

from durable._checks import LinkedRecords
from durable._checksum import crc32c
from durable._error_document import refuse_written_error_document
from durable._errors import IntegrityError
from durable._protocol import RECORDS_DIR, ObjectRecord, key_text, written_key
from durable.adapters import AtomicFile, ObjectInfo
from durable.adapters.local import TMP_MARK

if TYPE_CHECKING:
    from durable._entry import Entry
    from durable._lease import Lease

__all__ = ["EntryWriter"]

# Objects `write_bytes` sends as one put: one request on every store, never in parts.
_PUT_WHOLE_MAX = 1024 * 1024
_ALLOW_ERROR_DOCUMENTS = "set `writer.allow_error_documents = True` in the writing() block"



class EntryWriter:
    """What `Entry.writing()` yields: where to write, and the record of what was written."""

    def __init__(self, entry: Entry, attempt: str) -> None:
        from durable._recording import RecordingFileSystem

        self.entry = entry
        self.attempt = attempt
        self.path = entry.path
        self.url = entry.url
        #: False: an object whose bytes are an object store's error document (a failed
        #: download's 403 page) is refused as it is closed, not recorded as data.
        self.allow_error_documents = False
        self._records: dict[str, ObjectRecord] = {}
        self._baseline: dict[str, tuple[ObjectRecord, str | None]] = {}
        self._versions: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        # The files handed out, to see any still open when the block ends (weak: one that
        # was dropped unclosed is aborted by its own finalizer).
        self._writing: weakref.WeakSet[AtomicFile] = weakref.WeakSet()
        # ... and those dropped unclosed, key -> the order it was opened in: `np.save(
        # w.fs.open(p, "wb"), a)` published nothing, and the entry was committed without
        # that object. Not lost if a file of that key opened later was committed (a retry).
        self._opened = itertools.count()
        self._dropped: dict[str, int] = {}
        self._committed: dict[str, int] = {}
        self._lease: Lease | None = None
        self._listing: dict[str, ObjectInfo] | None = None
        self._records_listing: dict[str, ObjectInfo] | None = None
        self._fragments = True
        self._from_records = False
        # Objects whose bytes are being made durable already (`sync_soon`): key -> futures
        self._syncing: dict[str, Future[None]] = {}
        self.fs = RecordingFileSystem(self)

    def key_of(self, path: str) -> str:
        """The manifest key of a path inside the entry; ValueError for one outside it."""
        path = self.entry.adapter.fs._strip_protocol(path).rstrip("/")
        prefix = self.path + "/"
        if not path.startswith(prefix):
            raise ValueError(f"{path!r} is outside the entry {self.url}")
        return written_key(path[len(prefix):], self.url)

    def open(self, key: str | os.PathLike[str], *, create_only: bool = False,
             records: bool = False) -> AtomicFile:
        """An atomic file for ``key`` (relative to the entry), recorded when committed.

        ``records``: the key may lie in a records folder (a copy of a committed entry
        carries the records of the entries nested in it); other writes may not."""
        key = key_text(key)  # a path object is the key it spells
        url = self._admit(key, records)
        f = self.entry.adapter.open_atomic(f"{self.path}/{key}", create_only=create_only,
                                           durable=False)
        if not self.allow_error_documents:
            f.refuse_error_documents(url, _ALLOW_ERROR_DOCUMENTS)
        order = next(self._opened)

        def dropped(af: AtomicFile) -> None:
            self._dropped[key] = max(order, self._dropped.get(key, -1))

        def committed(af: AtomicFile) -> None:
            # Written in parts: probed as atomic_write probes (incident 002), else the
            # commit's listing took an object short by a part for whole.
            self.entry.adapter.check_parts(af.path, af.checksum)
            # With its tail where it is a codeword chunk (its CRC32C the residue): without
            # one, another attempt's chunk of its size passes every check of its record.
            self.record(
                key, af.checksum.size, af.checksum.crc,
                version=af.info.version if af.info else None,
                tail=ObjectRecord.of(af.checksum.size, af.checksum.crc, af.checksum.ending).tail)
            self._committed[key] = max(order, self._committed.get(key, -1))

        f.on_commit = committed
        f.on_drop = dropped
        self._writing.add(f)
        return f

    def _admit(self, key: str, records: bool) -> str:
        """The checks of a write of ``key`` (as `open` says), before anything is sent;
        the object's URL."""
        if self._closed:
            raise ValueError(f"{self.url}: the writing() block has ended")
        if self._lease is not None:
            # A writer that lost its lease stops writing: its objects would land in the
            # entry of the writer that took the lease over.
            self._lease.check()
        written_key(key, self.url)
        if TMP_MARK in key.rpartition("/")[2]:
            # The commit removes such names as a killed writer's temp files, and then
            # refused this write for an object "gone at commit".
            raise ValueError(f"{self.entry.adapter.url(f'{self.path}/{key}')}: a name "
                             f"with {TMP_MARK!r} is one of durable's temp files, which the "
                             "commit removes as a killed writer's leftovers; rename it")
        if not records and RECORDS_DIR in key.split("/"):
            # Committed, it could not be read back: a verified read looks no record up
            # under a folder of that name, which holds durable's own (as `durable::` says).
            raise ValueError(f"{self.entry.adapter.url(f'{self.path}/{key}')}: a "
                             f"{RECORDS_DIR!r} folder holds durable's records, not data; "
                             "rename it")
        if self.entry.adapter.through_link(self.path, key):
            # The entry's folder swapped for a symlink since the start (which refused one),
            # or a directory of the entry that is one (left there before a resume), would
            # take the object outside the entry; the commit, whose listing never follows a
            # link, then refused it as "gone at commit", and the bytes stayed out there.
            where = self.entry.adapter.url(f"{self.path}/{key}")
            linked = self.entry.linked_entry()
            if linked is not None:  # the error `status` raises for it, naming the object
                raise LinkedRecords(f"{where}: not written: {linked}", url=self.url)
            raise ValueError(f"{where}: a directory on its way is a symlink; durable writes "
                             "nothing through a link (it could point outside the entry)")
        self._listing = None  # taken before this write: no longer the whole entry
        with self._lock:
            # Written again: an fsync started before covers the old bytes, not these.
            self._syncing.pop(key, None)
        return self.entry.adapter.url(f"{self.path}/{key}")

    def _refuse_unfinished(self) -> None:
        """At the end of the block, before the commit: an object opened through the writer
        and neither closed nor aborted is still being written (a file left open, a thread
        still at work). The commit would take its temp file for a killed writer's leftover
        and commit the entry without it; it is aborted here, and the commit refused. So is
        one dropped unclosed, which its finalizer aborted: the entry would lack it too."""
        unfinished = [f for f in list(self._writing) if not f.done]
        lost = [k for k, n in sorted(self._dropped.items())
                if self._committed.get(k, -1) < n]
        if not unfinished and not lost:
            return
        for f in unfinished:
            with contextlib.suppress(Exception):
                f.abort()
        problems = []
        if unfinished:
            names = ", ".join(self.entry.adapter.url(f.path) for f in unfinished[:5])
            problems.append(f"{len(unfinished)} object(s) opened in the writing() block "
                            f"still open when it ended: {names}")
        if lost:
            names = ", ".join(self.entry.adapter.url(f"{self.path}/{k}") for k in lost[:5])
            problems.append(f"{len(lost)} object(s) opened in the writing() block "
                            f"dropped without close(), so never published: {names}")
        raise IntegrityError(
            f"{self.url}: not committing: {'; '.join(problems)} (close each file, best in "
            "a `with` block, and let every thread writing finish, inside the block)",
            url=self.url, expected="every object closed",
            found=f"{len(unfinished)} open, {len(lost)} dropped")

    def write_bytes(self, key: str | os.PathLike[str], data: bytes, *,
                    create_only: bool = False) -> ObjectInfo | None:
        """Write ``data`` whole at ``key`` (relative to the entry), recorded; its info.

        A small object on a store across a network goes as the adapter's one `put` (on S3
        its light PUT: a 600-byte zarr.json cost 2.5 ms of this process's CPU through
        s3fs's file machinery, 0.6 ms so). Same checks, same record as through `open`."""
        key = key_text(key)  # a path object is the key it spells
        adapter = self.entry.adapter
        if adapter.capabilities.in_process or len(data) > _PUT_WHOLE_MAX:
            with self.open(key, create_only=create_only) as f:
                f.write(data)
            return f.info
        url = self._admit(key, records=False)
        if not self.allow_error_documents:
            refuse_written_error_document(url, data, _ALLOW_ERROR_DOCUMENTS)
        info = adapter.put(f"{self.path}/{key}", bytes(data), create_only=create_only,
                           durable=False)
        rec = ObjectRecord.of(len(data), crc32c(data), data)
        self.record(key, rec.size, rec.crc32c, version=info.version, tail=rec.tail)
        with self._lock:
            # Written whole: a file of this key opened earlier and dropped is not lost.
            self._committed[key] = next(self._opened)
        return info

    def record(self, key: str, size: int, crc32c: int, *, version: str | None = None,
               tail: int | None = None) -> None:
        """Record an object written by other means whose size and CRC32C are known.

        ``version`` (as the adapter's ObjectInfo spells it), when known, lets the commit
        see an object replaced by someone else after this writer wrote it. ``tail``: its
        last 4 bytes where its CRC32C is the residue (`ObjectRecord`), when known.
        """
        written_key(key, self.url)
        with self._lock:
            self._records[key] = ObjectRecord(size, crc32c, tail)
            if version is None:
                self._versions.pop(key, None)
            else:
                self._versions[key] = version

    def use_listing(self, listing: dict[str, ObjectInfo] | None = None, *,
                    records: dict[str, ObjectInfo] | None = None,
                    fragments: bool = True) -> None:
        """Hand the commit listings taken after the last write finished, so it need not
        list again: ``listing`` of the entry, ``records`` of its records dir (relative
        keys, as `Adapter.list` gives them).

        For integrations that list anyway once their writes are done (to record objects
        from their sizes, to publish staged metadata). A write through the writer
        afterwards discards the entry's listing. The records listing serves to fail early
        on another writer's marker (the create-only marker write decides) and to find the
        fragments of this attempt, all flushed before it was taken.

        ``fragments=False``: the caller vouches that no process records fragments for
        this attempt (it never hands the attempt out). On a store that enforces
        create-only, the commit then does not list the records at all.
        """
        if listing is not None:
            self._listing = dict(listing)
        if records is not None:
            self._records_listing = dict(records)
        if not fragments:
            self._fragments = False

    @property
    def record_key(self) -> str:
        """This writer's attempt record, as a listing of the records dir names it."""
        return self.entry.layout.attempt_record(self.attempt)[
            len(self.entry.layout.records) + 1:]

    def refuse_started_over(self, records: Mapping[str, object]) -> None:
        """IntegrityError if ``records`` (a listing of the records dir taken after this
        writer started) lacks its attempt record: another writer started over the entry
        (``overwrite=True`` clears the records, then the data) or a clean removed them, so
        objects this one wrote may be gone or another writer's. Published or committed,
        they made an entry of two writers' chunks and fill values."""
        if self.record_key not in records:
            where = self.entry.adapter.url(self.entry.layout.attempt_record(self.attempt))
            raise IntegrityError(
                f"{self.entry.url}: not committing: this writer's attempt record {where} is "
                "gone at commit: another writer started over the entry (overwrite=True) or "
                "`durable clean` or Entry.delete() removed its records while this one wrote, "
                "and what it wrote may be gone or replaced. Write it again once nothing "
                "else writes it (a durable.Lease keeps a second writer out)",
                url=self.entry.url)

    def commit_from_records(self, records: dict[str, ObjectInfo]) -> bool:
        """Commit the manifest as recorded, without listing the entry, if ``records`` (a
        listing of the records dir taken after the last write finished) shows this
        attempt's record alone; whether it did. Otherwise the commit lists as usual.

        For an integration that drives every write of the entry itself, in this process,
        each one answered by the store (`durable.zarr.write` on an object store): a
        listing would find nothing the records do not say, and costs a round trip per
        1,000 objects. What it would also find, another writer at work in the entry, the
        records show: a writer that starts puts its attempt record there, and one that
        clears the entry (``overwrite=True``) removes this one's.
        """
        mine = self.record_key
        self._records_listing = dict(records)
        self._fragments = False
        # A lease in the listing, even this writer's own, sends the commit to the full
        # listing: a waiter's takeover or a clean racing the write may have removed
        # objects, which only a listing of the entry shows.
        self._from_records = set(records) == {mine}
        return self._from_records

    def sync_soon(self, keys: Iterable[str]) -> None:
        """Objects written by other means with durable=False (tensorstore's file driver with
        ``file_io_sync`` off), finished and not to be written again in this block: start
        making their bytes durable now, beside the writes still to come, rather than all
        after the last one. The commit waits for that work (its errors are the commit's)
        and makes durable only what is left, and every directory, before the marker."""
        keys = list(keys)
        started = self.entry.adapter.sync_soon([f"{self.path}/{k}" for k in keys])
        with self._lock:
            self._syncing.update(zip(keys, started, strict=False))

    def forget(self, key: str) -> None:
        with self._lock:
            self._records.pop(key, None)
            self._versions.pop(key, None)

    def records(self) -> dict[str, ObjectRecord]:
        with self._lock:
            return dict(self._records)
