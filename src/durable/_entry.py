"""Entries: data under one directory/prefix (or one object) with a commit marker written last.

`Entry.writing()` records every object written through it (size and CRC32C as the bytes
stream), makes them durable, and only then writes the marker, create-only. `state()`
reports ABSENT / INCOMPLETE / COMPLETE; `verify()` checks the data against the manifest.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from durable import _background as background
from durable._checksum import Checksum, crc_to_hex
from durable._error_document import ERROR_DOC_LIMIT, error_document
from durable._errors import (
    AlreadyCompleteError,
    DurableError,
    EntryExistsError,
    IncompleteError,
    IncompleteExistsError,
    IntegrityError,
    MarkerError,
)
from durable._fragments import MAX_FRAGMENT_BYTES, decode_fragment, fragments_dir
from durable._protocol import (
    MARKER_NAME,
    MAX_MARKER_BYTES,
    RECORDS_DIR,
    Layout,
    Manifest,
    Marker,
    ObjectRecord,
    State,
    attempt_record_bytes,
    carries_record,
    check_key,
    new_attempt_id,
)
from durable.adapters import Adapter, AtomicFile, ObjectInfo, resolve
from durable.adapters.base import Staged
from durable.adapters.local import DEL_MARK, TMP_MARK

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from durable._lease import Lease

__all__ = ["OPENED_FIRST", "Entry", "EntryWriter", "Problem", "Status", "VerifyReport",
           "committed_above", "delete_tree", "levels", "nearest_marked",
           "refuse_inside_committed", "refuse_leased", "remove_records"]

_READ_BLOCK = 8 * 1024 * 1024
_WORKERS = 8


# Two attempt records this close (by the store's clock) are two writers that started at
# the same moment: both refused, and each may try once more after a random pause.
_RACE_WINDOW = 5.0
_RACE_PAUSE = (0.05, 0.5)


@dataclass(frozen=True)
class Status:
    """An entry's state with the reason for it and, if there is one, its marker."""

    state: State
    reason: str
    marker: Marker | None = None
    racing: bool = field(default=False, compare=False)
    """INCOMPLETE only because another writer started at the same moment as the one asking
    (their attempt records are seconds apart): a later try may go through."""


class _LinkedRecords(MarkerError):
    """Records behind a symlink, or an entry that is one: not cleared by
    ``overwrite=True`` as an unreadable marker is (the removal would reach through the
    link)."""


class _RacedStart(IncompleteExistsError):
    """Refused at the start beside a writer that started at the same moment."""


@dataclass(frozen=True)
class Problem:
    """One object that does not match the manifest."""

    key: str
    url: str
    issue: Literal["missing", "size", "crc32c", "unexpected", "unreadable"]
    expected: Any = None
    found: Any = None

    def __str__(self) -> str:
        if self.issue == "missing":
            return f"{self.url}: missing (expected {self.expected} bytes)"
        if self.issue == "unexpected":
            return f"{self.url}: not in the manifest ({self.found} bytes)"
        if self.issue == "unreadable":
            return f"{self.url}: unreadable ({self.found})"
        return f"{self.url}: {self.issue} expected {self.expected}, found {self.found}"


@dataclass
class VerifyReport:
    url: str
    deep: bool
    objects: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def read_object_record(adapter: Adapter, path: str, info: ObjectInfo, *,
                       adopting: bool = False) -> ObjectRecord:
    """Stream one object through CRC32C, pinned to the version ``info`` names: its record
    (with the tail, where its CRC32C is the residue). ``adopting``: the record will make
    the object trusted, so one that is an object store's error document is refused."""
    ck = Checksum()
    small = bytearray() if adopting and info.size <= ERROR_DOC_LIMIT else None
    with adapter.open_read(path, info) as f:
        while block := f.read(_READ_BLOCK):
            ck.update(block)
            if small is not None and len(small) <= ERROR_DOC_LIMIT:
                small += block
    found = None if small is None else error_document(small)
    if found is not None:
        # Incident 003: a 403's body saved as the file. Unrecorded, every read refuses
        # it; recorded, it would be read back as the data from then on.
        url = adapter.url(path)
        raise IntegrityError(
            f"{url}: the object is an object store's error document with code {found[0]} "
            f"({found[1][:200]!r}), stored in the data's place (a download that saved an "
            "error page); not adopted: fetch the object again, or remove it",
            url=url, expected="the object's bytes", found=f"an error document ({found[0]})")
    return ObjectRecord.of(ck.size, ck.crc, ck.ending)


def deep_problem(adapter: Adapter, key: str, info: ObjectInfo,
                 rec: ObjectRecord) -> Problem | None:
    """What reading the object ``info`` whole finds wrong with it against ``rec``."""
    url = adapter.url(info.path)
    try:
        found = read_object_record(adapter, info.path, info)
    except (OSError, DurableError) as exc:
        return Problem(key, url, "unreadable", found=str(exc))
    if found.size != rec.size:
        return Problem(key, url, "size", rec.size, found.size)
    if not rec.matches(found):
        # A tail differing under the residue: another codeword of the same size (a
        # straggler of another attempt), which the CRC32C alone cannot tell apart.
        return Problem(key, url, "crc32c", rec.checksum_text(),
                       found.checksum_text() if rec.tail is not None
                       else crc_to_hex(found.crc32c))
    return None


class Entry:
    """A directory/prefix or a single object whose completeness is recorded by a marker.

    ``url`` and ``storage_options`` are what fsspec and xarray take.
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
                 adapter: Adapter | None = None) -> None:
        if adapter is None:
            adapter, path = resolve(url, storage_options)
        else:
            path = adapter.fs._strip_protocol(url)
        self.adapter = adapter
        self.layout = Layout(path)
        self.path = self.layout.root
        self.url = adapter.url(self.path)
        self.storage_options = dict(storage_options or {})

    def __repr__(self) -> str:
        return f"Entry({self.url!r})"

    def __fspath__(self) -> str:
        if self.adapter.name != "local":
            raise TypeError(f"{self.url} is not on the local file system")
        return self.path

    # reading the records -----------------------------------------------------------------
    def read_marker(self) -> Marker | None:
        """The commit marker with its manifest, None if there is none; MarkerError if it
        cannot be trusted.

        Beside a marker of kind "object" (or one that cannot be read), the object is
        stat-ed: if it carries a durable record in its own metadata (`atomic_write` in one
        request), that record is returned instead (a Marker of kind "object"), since it
        supersedes the marker. With no marker at all the object is not stat-ed (a cache
        miss must not pay for it): `status().marker` gives such an object's record.
        """
        return self._read_record(look=False)[0]

    def _read_record(self, *, look: bool = True) -> tuple[Marker | None, ObjectInfo | None,
                                                           bool]:
        """(record, the object's stat, whether the object was stat-ed) of the entry.

        The object is stat-ed (on adapters with ``object_records``) when its own metadata
        could decide: beside a marker of kind "object", beside a marker that cannot be
        read, and (``look``) where there is no marker at all. A marker of kind "prefix"
        decides alone.
        """
        error: MarkerError | None = None
        try:
            marker = self._read_sidecar()
        except MarkerError as exc:
            marker, error = None, exc
        if self.adapter.capabilities.object_records and (
                error is not None or (marker.kind == "object" if marker else look)):
            info = self.adapter.info(self.path)
            own = Marker.from_metadata(info.record if info else None, self.url)
            if own is not None:
                return own, info, True
            if error is None:
                return marker, info, True
        if error is not None:
            raise error
        return marker, None, False

    def _read_sidecar(self) -> Marker | None:
        """The commit marker beside the entry with its manifest, None if there is none."""
        where = self.adapter.url(self.layout.marker)
        try:
            data = self.adapter.read(self.layout.marker, limit=MAX_MARKER_BYTES)
        except ValueError as exc:
            raise MarkerError(str(exc) if where in str(exc) else f"{where}: {exc}",
                              url=where) from None
        if data is None:
            return None
        linked = self.linked_records()
        if linked is not None:
            raise linked
        marker = Marker.decode(data, where)
        if marker.manifest_ref is not None:
            mpath = self.layout.external_manifest(marker.manifest_ref.key)
            murl = self.adapter.url(mpath)
            try:
                # Limited to the size the marker recorded, not to any manifest's 1 GiB: a
                # larger file is refused from its stat, before a byte of it is read.
                blob = self.adapter.read(mpath, limit=marker.manifest_ref.size)
            except ValueError as exc:
                raise MarkerError(
                    f"{murl}: the marker recorded an external manifest of "
                    f"{marker.manifest_ref.size} bytes; "
                    + (str(exc).replace(murl, "this one") if murl in str(exc) else str(exc)),
                    url=murl, expected=marker.manifest_ref.size) from None
            if blob is None:
                raise MarkerError(f"{murl}: the marker's external manifest is missing",
                                  url=murl)
            marker = marker.with_external_manifest(blob, murl)
        return marker

    def linked_records(self) -> MarkerError | None:
        """The error for records reached through a symlink (the records directory, or this
        entry's folder in it, on a local disk), if they are. Never followed: they could
        point anywhere, and a listing (`scan`) never follows one, so a marker behind a link
        made `status` say COMPLETE where `scan` saw no marker at all. None otherwise (no
        request on stores that have no links)."""
        records_dir = self.layout.records.rpartition("/")[0]
        if not self.adapter.through_link(records_dir, f"{self.layout.name}/{MARKER_NAME}"):
            return None
        where = self.adapter.url(self.layout.records)
        return _LinkedRecords(
            f"{where}: the records of {self.url} are reached through a symlink (at "
            f"{self.adapter.url(records_dir)} or below), which durable never follows (it "
            "could point anywhere); put the directory itself in its place", url=where)

    def linked_entry(self) -> MarkerError | None:
        """The error for an entry that is itself a symlink (on a local disk), if it is.
        Never followed, by `status` as by `scan`, whose listing never follows one: status
        judged the data behind the link (COMPLETE) where scan found the marker's objects
        missing, and a writer wrote through it, wherever it points. None otherwise (no
        request on stores that have no links)."""
        if not self.adapter.through_link(self.path, ""):
            return None
        return _LinkedRecords(
            f"{self.url} is a symlink, which durable never follows (it could point "
            "anywhere); put the directory or file itself in its place", url=self.url)

    def _object_path(self, key: str, marker: Marker) -> str:
        return self.layout.object_path(key, marker.kind)

    def _data_missing(self, marker: Marker) -> str | None:
        """Why the committed data is no longer there, or None if it is.

        Checks the first and last objects of the manifest (two stats, whatever the size of
        the entry): enough to see data deleted by another tool. `verify` checks them all.
        """
        assert marker.manifest is not None
        keys = sorted(marker.manifest.objects)
        for key in {keys[0], keys[-1]} if keys else ():
            path = self._object_path(key, marker)
            head, sep, rest = key.partition("/")
            # Through a symlinked folder of the entry it is missing, as every listing of
            # the entry (`verify`, `scan`, `durable status`) finds it: never followed.
            linked = sep and self.adapter.through_link(f"{self.path}/{head}", rest)
            info = None if linked else self.adapter.info(path)
            want = marker.manifest.objects[key].size
            if info is None:
                return f"{self.adapter.url(path)} is listed in the marker but missing"
            if info.size != want:
                return (f"{self.adapter.url(path)} is {info.size} bytes, the marker recorded "
                        f"{want}")
        return None

    def status(self) -> Status:
        return self._status()

    def _status(self, leased: bool = False, *, expect_absent: bool = False,
                own_attempt: str | None = None) -> Status:
        """``own_attempt``: the attempt id of the writer asking, whose attempt record is already
        written (`writing`): that one record is no sign of another writer."""
        linked = self.linked_entry()  # one lstat on a local disk
        if linked is not None:
            raise linked
        if expect_absent:
            # A writer about to start expects nothing here: one listing of the records
            # answers "no marker, no writer" (on S3, 1 LIST instead of a GET of the marker
            # and a HEAD + LIST of the records). Readers, who expect COMPLETE, read the
            # marker first instead.
            # On a store across a network the entry's data is asked for at the same time:
            # one round trip, not two (a request wasted only where a marker is found,
            # which a writer does not expect). Local disk and memory answer in
            # microseconds: a thread would cost more than it saves.
            data: bool | None = None
            if self.adapter.capabilities.in_process:
                records = self.adapter.list(self.layout.records)
            else:
                with ThreadPoolExecutor(1) as pool:
                    present = pool.submit(self.adapter.exists, self.path)
                    records = self.adapter.list(self.layout.records)
                    data = present.result()
            if MARKER_NAME not in records:
                return self._status_unmarked(leased, records, present=data,
                                             own_attempt=own_attempt)
        marker, info, looked = self._read_record()
        if marker is not None:
            if looked and marker.kind == "object":
                return self._object_status(marker, info)
            missing = self._data_missing(marker)
            if missing is None:
                return Status(State.COMPLETE, f"committed at {marker.committed_at} by attempt "
                                              f"{marker.attempt}", marker)
            return Status(State.INCOMPLETE, f"marker present but data gone: {missing}", marker)
        if looked and info is not None:
            self._refuse_marker_prefix()
            return Status(State.INCOMPLETE, "data present but no commit marker")
        return self._status_unmarked(leased, stat_taken=looked, own_attempt=own_attempt)

    def _refuse_marker_prefix(self, records: dict[str, ObjectInfo] | None = None) -> None:
        """MarkerError if objects are stored below the marker's name (``commit.json/x``)
        where no marker is: the marker made a "directory" of, a hostile or corrupt layout.
        Read as "no marker", the entry looked INCOMPLETE, which a cleanup may remove; on
        a local disk the marker's read refuses such a directory already. ``records``: the
        records dir, if listed (it answers for free); else one listing below the name,
        made only where the entry would be found unmarked."""
        below = [k for k in records if k.startswith(f"{MARKER_NAME}/")] if records is not None \
            else list(self.adapter.list(self.layout.marker))
        if below:
            where = self.adapter.url(self.layout.marker)
            raise MarkerError(f"{where}: no commit marker, but objects stored below its name "
                              f"(as {where}/{below[0].removeprefix(f'{MARKER_NAME}/')}): "
                              "the marker made a directory, a hostile or corrupt layout, "
                              "not an unfinished write", url=where, expected="a marker object",
                              found="objects below its name")

    def _object_status(self, marker: Marker, info: ObjectInfo | None) -> Status:
        """A single object's state from its record and the stat taken with it."""
        assert marker.manifest is not None
        want = marker.manifest.objects[""].size
        where = ("in the object's own metadata" if info is not None
                 and carries_record(info.record) else "by its marker")
        if info is None:
            return Status(State.INCOMPLETE, f"marker present but data gone: {self.url} is "
                                            "recorded but missing", marker)
        if info.size != want:
            return Status(State.INCOMPLETE, f"{self.url} is {info.size} bytes, the record "
                                            f"{where} says {want}", marker)
        return Status(State.COMPLETE, f"committed at {marker.committed_at} by attempt "
                                      f"{marker.attempt} (recorded {where})", marker)

    def _status_unmarked(self, leased: bool, records: dict[str, ObjectInfo] | None = None,
                         *, stat_taken: bool = False, present: bool | None = None,
                         own_attempt: str | None = None) -> Status:
        """The state of an entry with no marker; ``records``: its records dir, if listed;
        ``stat_taken``: the object was stat-ed already (and is not there); ``present``:
        whether the entry has data, if asked already; ``own_attempt``: as for `_status`."""
        if present if present is not None else self.adapter.exists(self.path):
            if self.adapter.capabilities.object_records and not stat_taken:
                # A listing shows no metadata: an object carrying its own record is COMPLETE.
                info = self.adapter.info(self.path)
                own = Marker.from_metadata(info.record if info else None, self.url)
                if own is not None:
                    return self._object_status(own, info)
            if records is None:
                # One listing, as the look below the marker's name would take: the records
                # dir answers that look and names the writers that started here.
                records = self.adapter.list(self.layout.records)
            self._refuse_marker_prefix(records)
            return Status(State.INCOMPLETE, "data present but no commit marker"
                          + _started(records, own_attempt))
        # A writer holding the lease asks with leased=True: its own lease is no leftover.
        if records is None:
            # A listing, not exists(): the records dir is never an object (no HEAD needed).
            records = self.adapter.list(self.layout.records)
        self._refuse_marker_prefix(records)
        mine = (self.layout.attempt_record(own_attempt)[len(self.layout.records) + 1:]
                if own_attempt is not None else None)
        # Exactly this writer's own record is ignored: any other (another writer's attempt
        # record, or the temp file of one being written) is a writer at work or a leftover.
        # Not a lease or marker a killed conditional delete left renamed aside: nothing
        # started (it made an entry with nothing else INCOMPLETE, refusing every writer).
        others = [k for k in records if k != mine and DEL_MARK not in k
                  and not (leased and self._is_lease_key(k))]
        if mine is not None and mine not in records:
            # Put before the look, and gone: something removing the records (a clean, a
            # delete, another writer's cleanup) took it. Going on unannounced would let a
            # third writer in beside this one: refuse, as in a race (one more try).
            return Status(State.INCOMPLETE, "this writer's own attempt record was removed "
                                            "as it started (a clean or delete of the "
                                            "records at the same moment)", racing=True)
        if others and own_attempt is not None:
            where = self.adapter.url(records[others[0]].path)
            ours = records[mine].modified if mine in records else None
            racing = ours is not None and all(
                records[k].modified is not None
                and abs(records[k].modified - ours) <= _RACE_WINDOW  # type: ignore[operator]
                for k in others)
            return Status(State.INCOMPLETE, "another writer started and has not committed: "
                                            f"it may be at work right now ({where})",
                          racing=racing)
        if others:
            return Status(State.INCOMPLETE, "a writer started but has not committed")
        return Status(State.ABSENT, "no marker and no data")

    def state(self) -> State:
        """ABSENT, INCOMPLETE or COMPLETE; a corrupt marker raises MarkerError."""
        return self.status().state

    def require_complete(self) -> Marker:
        """The marker of a COMPLETE entry; IncompleteError naming the state otherwise."""
        st = self.status()
        if st.state is not State.COMPLETE:
            raise IncompleteError(f"{self.url} is {st.state}: {st.reason}"
                                  f"{self._inside_hint(st)}", url=self.url, state=st.state)
        assert st.marker is not None
        return st.marker

    def _inside_hint(self, st: Status) -> str:
        """Where the path lies inside a committed entry (an array of a committed zarr
        group, opened by its own URL): that entry, to open instead. An "INCOMPLETE" alone
        told users to rewrite or delete data that is committed."""
        parent = self.path.rstrip("/").rpartition("/")[0]
        if st.state is not State.INCOMPLETE or st.marker is not None or not parent:
            return ""
        try:
            found = nearest_marked(self.adapter, parent)
        except (OSError, DurableError):
            return ""  # only a hint: the state stands as it was found
        if found is None or found[1].kind != "prefix":
            return ""
        holder = found[0]
        key = self.path.rstrip("/")[len(holder.path.rstrip("/")) + 1:]
        return (f"; it lies inside the entry {holder.url}, which has a commit marker: open "
                f"that entry and {key!r} inside it")

    # verifying ---------------------------------------------------------------------------
    def _listing(self, marker: Marker) -> dict[str, ObjectInfo]:
        if marker.kind == "object":
            info = self.adapter.info(self.path)
            return {"": info} if info is not None else {}
        return self.adapter.list(self.path)

    def verify(self, deep: bool = False, *, raise_errors: bool = True,
               workers: int = _WORKERS) -> VerifyReport:
        """Check every object against the manifest: sizes, and CRC32C with ``deep=True``.

        Raises IntegrityError listing every mismatch (object, expected, found) unless
        ``raise_errors=False``; IncompleteError if there is no marker at all.
        """
        linked = self.linked_entry()  # its listing would follow the link: as `status`
        if linked is not None:
            raise linked
        marker, info, looked = self._read_record()
        if marker is None:
            st = self.status()
            raise IncompleteError(f"{self.url} is {st.state}: {st.reason}; nothing to verify",
                                  url=self.url, state=st.state)
        assert marker.manifest is not None
        report = VerifyReport(self.url, deep)
        if looked and marker.kind == "object":
            # The stat that carried (or was checked for) the record: the version verified.
            listing = {"": info} if info is not None else {}
        else:
            listing = self._listing(marker)
        to_read: list[tuple[str, ObjectInfo, ObjectRecord]] = []
        for key, rec in sorted(marker.manifest.objects.items()):
            path = self._object_path(key, marker)
            url = self.adapter.url(path)
            report.objects += 1
            found = listing.get(key)
            if found is None:
                report.problems.append(Problem(key, url, "missing", expected=rec.size))
            elif found.size != rec.size:
                report.problems.append(Problem(key, url, "size", rec.size, found.size))
            elif deep:
                to_read.append((key, found, rec))
        for key in sorted(set(listing) - set(marker.manifest.objects)):
            report.problems.append(Problem(key, self.adapter.url(listing[key].path),
                                           "unexpected", found=listing[key].size))

        def check(item: tuple[str, ObjectInfo, ObjectRecord]) -> Problem | None:
            return deep_problem(self.adapter, *item)

        if to_read:
            with ThreadPoolExecutor(max(1, workers)) as pool:
                for item, problem in zip(to_read, pool.map(check, to_read), strict=True):
                    report.bytes_checked += item[2].size
                    if problem is not None:
                        report.problems.append(problem)
        if raise_errors and report.problems:
            raise _report_error(report)
        return report

    # adopting, deleting ------------------------------------------------------------------
    def mark_complete(self, *, workers: int = _WORKERS, force: bool = False) -> Marker:
        """Adopt data written without `durable`: checksum what is there, write the marker.

        It trusts what it adopts: run it only when nothing is writing the entry. A started
        but uncommitted `durable` writer is refused unless ``force=True``.
        """
        self.layout.refuse_inside_records()
        # Its marker would be a new object in the data of the committed entry around it.
        refuse_inside_committed(self.adapter, self.path, "adopting this entry")
        st = self.status()
        if st.state is State.COMPLETE:
            raise AlreadyCompleteError(f"{self.url} is already COMPLETE", url=self.url)
        if st.state is State.ABSENT:
            raise IncompleteError(f"{self.url}: nothing to adopt (ABSENT)", url=self.url,
                                  state=st.state)
        if not force and self.adapter.list(self.layout.attempts):
            raise IncompleteExistsError(
                f"{self.url}: a durable writer started here and has not committed; it may "
                "still be at work (pass force=True if you know it is dead)", url=self.url)
        if st.marker is not None:
            # A marker whose data is gone: it describes nothing; replace it.
            self.adapter.delete([self.layout.marker])
        single = self.adapter.info(self.path)
        if single is not None:
            kind: Literal["prefix", "object"] = "object"
            listing = {"": single}
        else:
            kind = "prefix"
            listing = {k: v for k, v in self.adapter.list(self.path).items()
                       if TMP_MARK not in k.rpartition("/")[2]}
            for k in listing:
                check_key(k, self.url)
        records = _checksum_all(self.adapter, listing, workers)
        self.adapter.sync([i.path for i in listing.values()], _dirs_of(self, listing))
        return self._write_marker(Marker.new(kind, new_attempt_id(), Manifest(records)))

    def delete(self, *, force: bool = False) -> None:
        """Remove the entry: marker first, so a half-deleted entry is never COMPLETE; then
        the documents readers open first (`OPENED_FIRST`), so a plain reader never opens
        a half-deleted tree; then the rest.

        An entry whose lease another writer holds live is refused (IncompleteExistsError
        naming the entry, the holder and when its lease expires): removed under it, its
        writes under way would land in a deleted entry, or in the next writer's. An
        expired lease is removed with the rest (`durable._lease.refuse_live_lease`).
        ``force=True`` removes it anyway, the live lease too: its holder finds the lease
        lost at its next renewal or commit and never commits, but objects it writes
        before that remain, leaving the entry INCOMPLETE.
        """
        if not force:
            # A writer that takes the lease after this look loses it below (its lease is
            # removed with the records) and never commits: the window is one look wide.
            refuse_leased(self, "deleting", "pass force=True")
        self.adapter.delete([self.layout.marker])
        if self.adapter.info(self.path) is not None:
            self.adapter.delete([self.path])
        else:
            delete_tree(self.adapter, self.path)
        remove_records(self.adapter, self.layout)

    # writing -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self, *, overwrite: bool = False, resume: bool = False,
                update: bool = False,
                unrecorded: Literal["adopt", "error"] = "adopt",
                lease: Lease | None = None) -> Iterator[EntryWriter]:
        """Write the entry; the marker is committed on clean exit only.

        Yields an `EntryWriter` whose ``fs``/``path`` are an fsspec filesystem and the
        entry's path on it: every object written through them is recorded as it streams.

        - COMPLETE entry: AlreadyCompleteError, or with ``overwrite=True`` the marker is
          removed first (so no reader sees old marker over new data), then the data.
        - INCOMPLETE entry: IncompleteExistsError, unless ``overwrite=True`` (start over)
          or ``resume=True`` (keep what is there; objects not written by this writer are
          adopted at commit).
        - ``update=True``: change a COMPLETE entry in place (append, resize): its marker is
          removed first, the old manifest seeds the new one (untouched objects are not
          re-read), and the entry is INCOMPLETE until the new commit. An ABSENT entry is
          written as usual; an INCOMPLETE one is IncompleteExistsError (a rerun of a
          killed append, taken as a resume, would append after what it had added).
        - Inside a committed entry (a path under a directory or prefix with a commit
          marker): EntryExistsError naming both; this entry would change that one's data.
        - ``unrecorded``: objects that appear in the entry without passing through the
          writer (written with another tool into ``writer.path``) are read and
          checksummed at commit ("adopt"), or refused ("error"). Such an object may also
          be a late write of a writer without a lease that was at work when this one
          started over (a lease keeps out only writers that look for it): "error" refuses
          it too.

        On an exception (KeyboardInterrupt included) the marker is not written; a fresh
        entry's objects are removed, a resumed one is left INCOMPLETE.

        ``lease``: a `durable.Lease` held on this entry. It must be held at the start, the
        marker is written only while it still is (`Lease.fenced`: LeaseLostError
        otherwise), overwriting keeps it, and a writer that lost it removes nothing.
        Without ``lease``, overwriting, resuming and updating refuse an entry whose lease
        another writer holds live (IncompleteExistsError naming the holder and when it
        expires); an expired lease is removed (`durable._lease.refuse_live_lease`).
        """
        self.layout.refuse_inside_records()
        # Nested in a committed entry, this one's objects and records would land in that
        # entry's data, which its marker (still there) says is whole and unchanged.
        refuse_inside_committed(self.adapter, self.path, "writing this entry")
        chosen = [n for n, v in (("overwrite", overwrite), ("resume", resume),
                                 ("update", update)) if v]
        if len(chosen) > 1:
            # Each means something else for what is there (delete it, finish it, change
            # it): two at once would do one of them silently.
            raise ValueError(f"{self.url}: pass at most one of overwrite, resume and update "
                             f"(got {' and '.join(chosen)})")
        keep_lease = lease is not None
        if lease is not None:
            if lease.url != self.adapter.url(self.layout.lease):
                raise ValueError(f"{lease!r} is not the lease of {self.url}")
            lease.check()
        writer = EntryWriter(self, new_attempt_id())
        writer._lease = lease
        record = self.layout.attempt_record(writer.attempt)
        # A writer that expects nothing here and clears nothing announces itself BEFORE it
        # looks, so two fresh writers starting at once cannot both go on (incident 001's
        # racing writer: both looked, saw nothing, wrote; the loser's chunks landed over
        # the winner's commit). Each PUTs its record, then LISTs the records: if A's LIST
        # did not show B's record, B's PUT came after A's LIST, so after A's PUT, and B's
        # LIST shows A's. At most one of two racing writers proceeds; in a tight race both
        # may refuse (safe: nothing was written, and a retry works). This needs a listing
        # that shows every PUT that returned before it (local, memory, S3 since 2020, GCS,
        # Azure). Under a lease it is not needed (the lease is a record PUT before the
        # LIST, and leases exclude each other) but costs nothing: one order for all.
        # Overwriting, resuming and updating keep look-then-announce: `_clear` removes the
        # records dir, which would remove a record put first.
        first = not (overwrite or resume or update)
        doing = ("starting over" if overwrite else "resuming" if resume
                 else "updating" if update else "")
        if not first and not keep_lease:
            from durable._lease import refuse_live_lease  # (_lease imports this module)

            # Another writer's live lease: starting over would remove its data while its
            # writes under way land in this writer's entry; resuming or updating would
            # commit its partial objects. An expired lease is removed (conditionally).
            refuse_live_lease(self, doing)
        for again in (first, False):
            try:
                if first:
                    # In the try: a PUT that landed but failed (an interrupt, a lost answer)
                    # is removed too, never left to make the entry look worked on.
                    self._announce(record, writer.attempt, _RacedStart)
                fresh, seed, versions = self._start(
                    keep_lease, overwrite=overwrite, resume=resume, update=update,
                    own_attempt=writer.attempt if first else None)
                break
            except BaseException as exc:
                if first:
                    # Refused (or failed looking): this writer's record alone goes, else
                    # the entry would look INCOMPLETE to the next writer for nothing.
                    with contextlib.suppress(Exception):
                        self.adapter.delete([record])
                if not isinstance(exc, _RacedStart):
                    raise
                if not again:
                    raise IncompleteExistsError(str(exc), url=self.url) from None
            # Both of two writers that started at once refused (each saw the other's
            # record): each tries once more after a random pause, so the first to come
            # back usually goes on and the other then sees it at work.
            time.sleep(random.uniform(*_RACE_PAUSE))
        writer._baseline = {k: (rec, versions[k]) for k, rec in seed.items()}
        if not first:
            self._announce(record, writer.attempt, IncompleteExistsError)
            if not keep_lease:
                # Looked again once announced: a writer that took the lease since the look
                # above either listed the records after this record (and refuses) or
                # before it, and then its lease is here now (the clear keeps leases).
                try:
                    refuse_live_lease(self, doing)
                except BaseException:
                    with contextlib.suppress(Exception):
                        self.adapter.delete([record])
                    raise
        try:
            yield writer
            writer._closed = True
            writer._refuse_unfinished()
            self._commit(writer, unrecorded, lease)
        except BaseException:
            writer._closed = True
            # Under the lease only while it is still held: a writer that lost it would
            # remove the data of the writer that took it over (LeaseLostError, suppressed).
            guard = lease.fenced() if lease is not None else contextlib.nullcontext()
            with contextlib.suppress(Exception), guard:
                # A marker now is another writer's commit (this one lost the race), and
                # another attempt record is a writer still at work: neither entry is this
                # writer's to remove.
                # Attempts first, marker second: a winner removes its attempt record only
                # after its marker is written, so this order cannot miss both.
                if (fresh and set(self.adapter.list(self.layout.attempts))
                        <= {f"{writer.attempt}.json"}
                        and self.adapter.info(self.layout.marker) is None):
                    self.adapter.delete_prefix(self.path)
                    self._clear_records()
                else:
                    self.adapter.delete([self.layout.attempt_record(writer.attempt),
                                         *writer._spent])
            raise

    def _announce(self, record: str, attempt: str,
                  refused: type[IncompleteExistsError]) -> None:
        """Write this writer's attempt record; ``refused`` if it was removed as it was
        written (on a local disk its temp file or directory, by a writer clearing the
        entry's records at that moment): a raw FileNotFoundError named only a temp file."""
        try:
            self.adapter.put(record, attempt_record_bytes(attempt), durable=False)
        except FileNotFoundError as exc:
            if TMP_MARK not in str(exc.filename or ""):
                raise  # not the temp file (a bucket that does not exist, ...)
            raise refused(f"{self.url}: this writer's attempt record "
                          f"{self.adapter.url(record)} was removed as it was written "
                          "(another writer clearing the entry's records at that moment, "
                          "or a clean); nothing was written: try again",
                          url=self.url) from None

    def _start(self, keep_lease: bool, *, overwrite: bool, resume: bool, update: bool,
               own_attempt: str | None
               ) -> tuple[bool, dict[str, ObjectRecord], dict[str, str | None]]:
        """The state check of `writing`, and what it clears: (fresh, the records of the
        objects an update keeps, their versions). ``own_attempt``: as for `_status`."""
        try:
            st = self._status(leased=keep_lease, expect_absent=not (update or resume),
                              own_attempt=own_attempt)
        except MarkerError as exc:
            if not overwrite or isinstance(exc, _LinkedRecords):
                raise
            # A marker nobody can read describes nothing: overwriting is the way out.
            self._clear()
            st = Status(State.ABSENT, "cleared an unreadable marker")
        if st.state is State.COMPLETE and update and not overwrite:
            assert st.marker is not None and st.marker.manifest is not None
            if st.marker.kind != "prefix":
                raise ValueError(f"{self.url} is a single object: rewrite it, not update it")
            # Keep each object's record with the version it has now: at commit, a record
            # is reused only for an object whose version has not changed since.
            now = self.adapter.list(self.path)
            seed = {k: r for k, r in st.marker.manifest.objects.items()
                    if k in now and now[k].size == r.size and now[k].version is not None}
            # Invalidate before touching anything: a reader must never see the old marker
            # over data that is being changed.
            self.adapter.delete([self.layout.marker])
            return False, seed, {k: now[k].version for k in seed}
        if st.state is State.COMPLETE:
            if not overwrite:
                raise AlreadyCompleteError(f"{self.url} is already COMPLETE ({st.reason})",
                                           url=self.url)
            self._clear(st.marker)
        elif st.state is State.INCOMPLETE:
            if overwrite:
                self._clear()
            elif resume:
                return False, {}, {}
            elif update:
                # Taken as a resume, a rerun of a killed append (xarray's append_dim,
                # zarr's Array.append) appended after the length the killed attempt had
                # already set, and committed the rows between as fill values (incident
                # 001). Whether a rerun is a resume is the caller's to say.
                raise IncompleteExistsError(
                    f"{self.url} is INCOMPLETE ({st.reason}), and update=True changes a "
                    "COMPLETE entry: an update or write that did not commit left it, or "
                    "one is still at work. Finish it with resume=True only by writes that "
                    "do not depend on its current shape (an append would go after what "
                    "the unfinished write added, leaving fill values between); else "
                    "overwrite=True, or Entry.delete() / `durable clean` once nothing "
                    "writes it", url=self.url)
            else:
                if not keep_lease:
                    from durable._lease import refuse_live_lease

                    # Refused beside a lease: whose it is, live (IncompleteExistsError
                    # naming the holder and when it expires) or expired (said below).
                    expired = refuse_live_lease(self, "starting", remove=False)
                    if expired is not None:
                        raise IncompleteExistsError(
                            f"{self.url} is INCOMPLETE: {expired}: a killed or stopped "
                            "writer's leftover. Pass overwrite=True or resume=True to take "
                            "it over", url=self.url)
                mine = {f"attempts/{own_attempt}.json"}
                if not st.racing and not set(self.adapter.list(self.layout.records)) - mine:
                    # `durable clean` leaves data with no durable records alone: sent
                    # there, the user found nothing removed and no way on.
                    raise IncompleteExistsError(
                        f"{self.url} is INCOMPLETE: data with no durable records and no "
                        "commit marker, written without durable (or by a tool that leaves no "
                        "records). If it is whole, adopt it with Entry.mark_complete() "
                        "(`durable mark-complete`); else start over with overwrite=True, "
                        "or finish it with resume=True", url=self.url)
                raise (_RacedStart if st.racing else IncompleteExistsError)(
                    f"{self.url} is INCOMPLETE ({st.reason}): a killed writer's leftover or "
                    "a writer still at work. Resolve it with Entry.delete() or "
                    "`durable clean` once nothing writes it, or pass overwrite=True / "
                    "resume=True", url=self.url)
        return True, {}, {}

    def _clear(self, marker: Marker | None = None) -> None:
        """Remove the entry's data and records for a writer starting over it. ``marker``:
        the entry's, if it was read: its manifest names the documents to remove first."""
        # Marker first: from here on nobody can take this entry for COMPLETE.
        self.adapter.delete([self.layout.marker])
        delete_tree(self.adapter, self.path, None if marker is None or marker.manifest is None
                    else list(marker.manifest.objects))
        self._clear_records()

    def _is_lease_key(self, key: str) -> bool:
        """The lease, or a temp file of a write of it (keys relative to the records); not
        one a killed conditional delete left renamed aside (kept, it stayed for good)."""
        name = self.layout.lease.rpartition("/")[2]
        return key == name or (key.startswith(f".{name}") and TMP_MARK in key
                               and DEL_MARK not in key)

    def _clear_records(self) -> None:
        # A lease stays, whoever holds it: the writer clearing holds it, or it was taken
        # since that writer found none (an expired one it removed itself,
        # `refuse_live_lease`). Removing it would let a third writer in beside its holder,
        # and its holder's writes land in this writer's entry.
        self.adapter.delete([i.path for k, i in self.adapter.list(self.layout.records).items()
                             if not self._is_lease_key(k)])
        # Directories left empty (a disk's fragments/<attempt>/): an empty records dir
        # would read as a writer started.
        self.adapter.prune(self.layout.records)

    def _commit(self, writer: EntryWriter, unrecorded: Literal["adopt", "error"],
                lease: Lease | None = None) -> Marker:
        if lease is not None:
            # Proven held (a conditional rewrite), not just believed: a lease removed or
            # taken over during the write stops the commit here, before any of its work.
            lease.renew()
        # One listing of the records: another writer's marker (fail before any work; the
        # create-only marker write below is what decides a race) and this attempt's
        # fragments, merged and then removed with the attempt record.
        in_records = writer._records_listing
        if in_records is None:
            # A writer with no fragments lists only to fail early: where the store enforces
            # create-only, the marker write decides the race alone (AlreadyCompleteError,
            # and the loser removes nothing: the marker is there), one request less.
            early_only = not writer._fragments and self.adapter.capabilities.create_only
            in_records = {} if early_only else self.adapter.list(self.layout.records)
        if MARKER_NAME in in_records:
            raise AlreadyCompleteError(
                f"{self.url}: another writer committed this entry first", url=self.url)
        fragments = {k: i for k, i in in_records.items()
                     if k.startswith(f"fragments/{writer.attempt}/")}
        recorded = writer.records()
        if writer._from_records:
            # Every object went through this writer, each write answered by the store, and
            # the records showed this attempt alone (`EntryWriter.commit_from_records`):
            # the manifest is what was recorded, with no listing of the entry.
            records, listing = recorded, {k: ObjectInfo(f"{self.path}/{k}", r.size)
                                          for k, r in recorded.items()}
        else:
            listing = (writer._listing if writer._listing is not None
                       else self.adapter.list(self.path))
            records = self._reconcile(writer, recorded, listing, fragments, unrecorded)
        # The records dir was made by the attempt record without fsync: its entries in
        # the parent must be durable before the marker inside it counts.
        records_dirs = [self.layout.records.rpartition("/")[0], self.layout.records]
        with writer._lock:
            syncing = dict(writer._syncing)
        marker = Marker.new("prefix", writer.attempt, Manifest(records))
        # The marker's bytes are made durable (a local disk's fsync) beside the data's,
        # not after them: what the marker waits for below is then only its publish.
        staged = self._stage_marker(marker)
        try:
            # What is left and every directory go into the pool behind the early fsyncs
            # still running, not after the last of them: the file system commits
            # concurrent fsyncs together, and the marker waits for both either way.
            self.adapter.sync([i.path for k, i in listing.items() if k not in syncing],
                              _dirs_of(self, listing) + records_dirs)
            for started in syncing.values():
                started.result()
        except FileNotFoundError as exc:
            # Removed by another tool since it was written (a commit from the records lists
            # nothing that would have shown it): never a marker over it.
            gone = self.adapter.url(str(exc.filename)) if exc.filename else "an object"
            staged.discard()
            raise IntegrityError(f"{self.url}: not committing: {gone}: written by this "
                                 "writer but gone at commit", url=self.url) from None
        except BaseException:
            staged.discard()
            raise
        self._publish_marker(staged, lease.fenced() if lease is not None else None)
        # From here the attempt's records only say a writer was here: their removal is
        # housekeeping the caller does not wait for (a round trip on an object store). It
        # is handed over after the marker's PUT returned: a failing racer that finds no
        # attempt record finds the marker.
        spent = ([self.layout.attempt_record(writer.attempt), *writer._spent]
                 + [i.path for i in fragments.values()])
        pruned = fragments_dir(self.layout.records, writer.attempt) if fragments else None

        def tidy() -> None:
            self.adapter.discard(spent)
            if pruned is not None:
                self.adapter.prune(pruned)

        background.later(tidy, f"{self.url}: removing the committed attempt's records",
                         now=self.adapter.capabilities.in_process)
        return marker

    def _reconcile(self, writer: EntryWriter, recorded: dict[str, ObjectRecord],
                   listing: dict[str, ObjectInfo], fragments: dict[str, ObjectInfo],
                   unrecorded: Literal["adopt", "error"]) -> dict[str, ObjectRecord]:
        """The manifest of a commit from the entry's ``listing``: every recorded object
        checked against it (gone, resized or replaced by another writer: IntegrityError),
        every other object taken from this attempt's fragments, the update's baseline or
        read and checksummed (``unrecorded="adopt"``). Temp files are removed from the
        store and from ``listing``."""
        # Temp files of writers killed mid-object never become part of an entry.
        leftovers = [i.path for k, i in listing.items() if TMP_MARK in k.rpartition("/")[2]]
        if leftovers:
            self.adapter.delete(leftovers)
            for k in [k for k, i in listing.items() if i.path in leftovers]:
                del listing[k]
        problems = []
        for key, rec in recorded.items():
            found = listing.get(key)
            url = self.adapter.url(f"{self.path}/{key}")
            if found is None:
                problems.append(f"{url}: written by this writer but gone at commit")
            elif found.size != rec.size:
                problems.append(f"{url}: written with {rec.size} bytes, {found.size} at "
                                "commit (another writer?)")
            elif (found.version is not None and writer._versions.get(key) is not None
                  and found.version != writer._versions[key]):
                # Rewritten since this writer wrote it (same size): the marker must not
                # record our CRC over someone else's bytes, so read what is there now.
                now = read_object_record(self.adapter, found.path, found)
                if not rec.matches(now):
                    problems.append(f"{url}: replaced after this writer wrote it (CRC32C "
                                    f"{rec.checksum_text()} written, "
                                    f"{now.checksum_text()} found)")
        if problems:
            raise IntegrityError(f"{self.url}: not committing: " + "; ".join(problems),
                                 url=self.url)
        extra = {k: i for k, i in listing.items() if k not in recorded}
        recorded_elsewhere, disputed = self._merge_fragments(writer.attempt, extra, fragments)
        extra = {k: i for k, i in extra.items() if k not in recorded_elsewhere}
        for k, info in list(extra.items()):
            base = writer._baseline.get(k)
            if base is not None and base[1] == info.version and base[0].size == info.size:
                recorded_elsewhere[k] = base[0]  # untouched since the update began
                del extra[k]
        if extra and unrecorded == "error":
            raise IntegrityError(f"{self.url}: not committing: "
                                 + _unrecorded_problem(extra, disputed), url=self.url)
        for k in extra:
            check_key(k, self.url)
        records = dict(recorded)
        records.update(recorded_elsewhere)
        records.update(_checksum_all(self.adapter, extra, _WORKERS))
        return records

    def _merge_fragments(self, attempt: str, unrecorded: dict[str, ObjectInfo],
                         fragments: dict[str, ObjectInfo],
                         ) -> tuple[dict[str, ObjectRecord], set[str]]:
        """Records other processes flushed for ``attempt``, for the objects listed now, and
        the keys whose fragments disagree.

        A key is taken from the fragments only when every fragment that recorded it agrees
        and the size matches the listing; anything else is left to be read and checksummed.
        """
        if not unrecorded:
            return {}, set()
        candidates: dict[str, set[ObjectRecord | None]] = {}
        for _, info in sorted(fragments.items()):
            where = self.adapter.url(info.path)
            try:
                data = self.adapter.read(info.path, limit=MAX_FRAGMENT_BYTES)
            except ValueError as exc:
                raise MarkerError(f"{where}: {exc}", url=where) from None
            if data is None:
                continue
            for key, rec in decode_fragment(data, where, attempt).items():
                candidates.setdefault(key, set()).add(rec)
        out = {}
        for key, info in unrecorded.items():
            recs = candidates.get(key, set())
            if len(recs) == 1:
                (rec,) = recs
                if rec is not None and rec.size == info.size:
                    out[key] = rec
        return out, {k for k in unrecorded if len(candidates.get(k, ())) > 1}

    def _write_marker(self, marker: Marker,
                      fence: AbstractContextManager[object] | None = None) -> Marker:
        self._publish_marker(self._stage_marker(marker), fence)
        return marker

    def _stage_marker(self, marker: Marker) -> Staged:
        """The marker made ready to publish (its external manifest, if any, put now)."""
        data, external = marker.encode()
        if external is not None:
            self.adapter.put(self.layout.external_manifest(external[0]), external[1])
        return self.adapter.stage(self.layout.marker, data, create_only=True)

    def _publish_marker(self, staged: Staged,
                        fence: AbstractContextManager[object] | None = None) -> None:
        try:
            # Create-only: of two writers finishing the same entry, exactly one commits.
            # The fence (a lease) covers this one write: a writer that lost its lease
            # raises LeaseLostError here, before the marker.
            with fence or contextlib.nullcontext():
                staged.publish()
            _forget_clear(self.path)
        except FileExistsError:
            raise AlreadyCompleteError(
                f"{self.url}: another writer committed this entry first", url=self.url
            ) from None
        finally:
            staged.discard()  # a no-op once published; else no temp file left behind


class EntryWriter:
    """What `Entry.writing()` yields: where to write, and the record of what was written."""

    def __init__(self, entry: Entry, attempt: str) -> None:
        from durable._recording import RecordingFileSystem

        self.entry = entry
        self.attempt = attempt
        self.path = entry.path
        self.url = entry.url
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
        self._spent: list[str] = []
        self.fs = RecordingFileSystem(self)

    def key_of(self, path: str) -> str:
        """The manifest key of a path inside the entry; ValueError for one outside it."""
        path = self.entry.adapter.fs._strip_protocol(path).rstrip("/")
        prefix = self.path + "/"
        if not path.startswith(prefix):
            raise ValueError(f"{path!r} is outside the entry {self.url}")
        return check_key(path[len(prefix):], self.url)

    def open(self, key: str, *, create_only: bool = False) -> AtomicFile:
        """An atomic file for ``key`` (relative to the entry), recorded when committed."""
        if self._closed:
            raise ValueError(f"{self.url}: the writing() block has ended")
        if self._lease is not None:
            # A writer that lost its lease stops writing: its objects would land in the
            # entry of the writer that took the lease over.
            self._lease.check()
        check_key(key, self.url)
        if TMP_MARK in key.rpartition("/")[2]:
            # The commit removes such names as a killed writer's temp files, and then
            # refused this write for an object "gone at commit".
            raise ValueError(f"{self.entry.adapter.url(f'{self.path}/{key}')}: a name "
                             f"with {TMP_MARK!r} is one of durable's temp files, which the "
                             "commit removes as a killed writer's leftovers; rename it")
        if self.entry.adapter.through_link(self.path, key):
            # The entry's folder swapped for a symlink since the start (which refused one),
            # or a directory of the entry that is one (left there before a resume), would
            # take the object outside the entry; the commit, whose listing never follows a
            # link, then refused it as "gone at commit", and the bytes stayed out there.
            where = self.entry.adapter.url(f"{self.path}/{key}")
            linked = self.entry.linked_entry()
            if linked is not None:  # the error `status` raises for it, naming the object
                raise _LinkedRecords(f"{where}: not written: {linked}", url=self.url)
            raise ValueError(f"{where}: a directory on its way is a symlink; durable writes "
                             "nothing through a link (it could point outside the entry)")
        self._listing = None  # taken before this write: no longer the whole entry
        with self._lock:
            # Written again: an fsync started before covers the old bytes, not these.
            self._syncing.pop(key, None)
        f = self.entry.adapter.open_atomic(f"{self.path}/{key}", create_only=create_only,
                                           durable=False)
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

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.open(key) as f:
            f.write(data)

    def record(self, key: str, size: int, crc32c: int, *, version: str | None = None,
               tail: int | None = None) -> None:
        """Record an object written by other means whose size and CRC32C are known.

        ``version`` (as the adapter's ObjectInfo spells it), when known, lets the commit
        see an object replaced by someone else after this writer wrote it. ``tail``: its
        last 4 bytes where its CRC32C is the residue (`ObjectRecord`), when known.
        """
        check_key(key, self.url)
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
        mine = self.entry.layout.attempt_record(self.attempt)[
            len(self.entry.layout.records) + 1:]
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

    def remove_when_done(self, paths: list[str]) -> None:
        """Records of this attempt (paths in the records dir) that have served their
        purpose: removed with the attempt record when the block ends (one request)."""
        self._spent.extend(paths)

    def forget(self, key: str) -> None:
        with self._lock:
            self._records.pop(key, None)
            self._versions.pop(key, None)

    def records(self) -> dict[str, ObjectRecord]:
        with self._lock:
            return dict(self._records)


def _started(records: dict[str, ObjectInfo] | None, own_attempt: str | None) -> str:
    """What the reason of an unmarked entry with data adds for writers that started on it
    (their attempt records; ``own_attempt``'s aside), as `durable scan` says it: "data
    present but no commit marker" alone read like data written without durable, and sent
    operators to `mark-complete` a killed writer's leftover (``records``: None if not
    listed)."""
    mine = f"attempts/{own_attempt}.json"
    n = sum(1 for k in records or () if k.startswith("attempts/") and k.endswith(".json")
            and k != mine)
    return f"; a writer started but has not committed (attempt records: {n})" if n else ""


def _unrecorded_problem(extra: dict[str, ObjectInfo], disputed: set[str]) -> str:
    """Why ``unrecorded="error"`` refuses ``extra``. Objects whose fragments disagree were
    written through the writer, more than once: "not written through the writer" sent
    the user looking for a write around durable, when the usual cause is dask tasks each
    writing part of one chunk or shard (each reads, changes and rewrites it: the last
    write drops the others' parts, in plain zarr too)."""
    parts = []
    disputed = disputed & set(extra)
    if disputed:
        parts.append(
            f"{len(disputed)} objects were recorded with different contents by several "
            f"fragments of this write, e.g. {sorted(disputed)[:3]}: written more than once, "
            "as when tasks of other processes write parts of one chunk or shard (each "
            "rewrites it whole, and the last drops what the others wrote); give the "
            "tasks' pieces the chunks' (or shards') boundaries")
    others = sorted(k for k in extra if k not in disputed)
    if others:
        parts.append(f"{len(others)} objects were not written through the writer, "
                     f"e.g. {others[:3]}")
    return "; ".join(parts)


def _checksum_all(adapter: Adapter, listing: dict[str, ObjectInfo],
                  workers: int) -> dict[str, ObjectRecord]:
    """Records for objects no writer recorded, read whole: what an adoption (a commit's,
    `mark_complete`'s) will vouch for from now on."""
    def one(item: tuple[str, ObjectInfo]) -> tuple[str, ObjectRecord]:
        key, info = item
        rec = read_object_record(adapter, info.path, info, adopting=True)
        if rec.size != info.size:
            raise IntegrityError(
                f"{adapter.url(info.path)}: listed with {info.size} bytes, read {rec.size}",
                url=adapter.url(info.path), expected=info.size, found=rec.size)
        return key, rec

    if not listing:
        return {}
    with ThreadPoolExecutor(max(1, min(workers, len(listing)))) as pool:
        return dict(pool.map(one, listing.items()))


def _dirs_of(entry: Entry, listing: dict[str, ObjectInfo]) -> list[str]:
    """Every directory between the entry's objects and the entry's parent, once each."""
    dirs = {entry.layout.parent, entry.path}
    for key in listing:
        parts = key.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add(entry.path + "/" + "/".join(parts[:i]))
    if len(listing) == 1 and "" in listing:
        dirs.discard(entry.path)
    return sorted(dirs)


def _report_error(report: VerifyReport) -> IntegrityError:
    shown = "; ".join(str(p) for p in report.problems[:20])
    more = len(report.problems) - 20
    tail = f"; and {more} more" if more > 0 else ""
    first = report.problems[0]
    return IntegrityError(
        f"{report.url}: {len(report.problems)} of {report.objects} objects do not match the "
        f"manifest: {shown}{tail}", url=first.url, expected=first.expected, found=first.found)


#: Documents a reader opens before any other object of a tree: zarr v3's and v2's (which
#: tensorstore and xarray read too). A removal takes them first, so one killed part-way
#: leaves a tree no plain reader opens, never an array whose missing chunks read as fill
#: values (incident 001).
OPENED_FIRST = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})


def delete_tree(adapter: Adapter, path: str, keys: list[str] | None = None) -> None:
    """Remove every object below ``path``: first those named in `OPENED_FIRST`, found
    among ``keys`` (relative to ``path``: a manifest's, where one was read) or by a
    listing, in one request where the store deletes in batches; then the rest."""
    if keys is None:
        keys = list(adapter.list(path))
    # Never through a link (a symlink, on a local disk): a manifest's keys were checked as
    # strings only, so a directory of the entry swapped for a symlink would take
    # "link/zarr.json" to a file outside the entry, and an entry that is itself a symlink
    # lists (and would lose) the documents of the tree it points to. Those are left to
    # `delete_prefix`, which removes the link and never what lies behind it.
    first = [f"{path}/{k}" for k in keys if k.rpartition("/")[2] in OPENED_FIRST
             and not adapter.through_link(path, k)]
    if first:
        adapter.delete(first)
    adapter.delete_prefix(path)


def committed_above(adapter: Adapter, path: str) -> Entry | None:
    """The nearest entry strictly above ``path`` committed as a directory or prefix (a
    marker of kind "prefix"), whose data ``path`` is part of; None if there is none up to
    the root. Single-object entries on the way (a recorded object of such an entry) are
    passed over. MarkerError for a marker on the way, before any such entry, that cannot
    be trusted. On a store across a network every level is asked at once: one round trip
    (a write pays it before its first byte), not one per level."""
    above = [Entry(root, adapter=adapter) for root, _ in levels(path)][1:]

    def read(entry: Entry) -> Marker | MarkerError | None:
        try:
            return entry._read_sidecar()
        except MarkerError as exc:
            return exc

    found: Iterable[Marker | MarkerError | None] = map(read, above)  # lazy: nearest first
    if len(above) > 1 and not adapter.capabilities.in_process:
        with ThreadPoolExecutor(min(len(above), _WORKERS)) as pool:
            found = list(pool.map(read, above))
    for entry, marker in zip(above, found, strict=True):
        if isinstance(marker, MarkerError):
            raise marker
        if marker is not None and marker.kind == "prefix":
            return entry
    return None


#: On a store across a network: folders found with no committed entry above them ->
#: (their filesystem, when, monotonic). A write into a folder seen clear within
#: `_CLEAR_FOR` seconds asks the store nothing (a loop writing many small objects into one
#: folder paid a round trip before each: 1.5 times a 1 MiB PutObject on moto). A commit
#: by this process forgets the folders it makes part of an entry (`_forget_clear`), so
#: writing into one is refused at once; an entry committed by another process within
#: those seconds is seen after them (as one committed between any look and the write it
#: guards always was).
_SEEN_CLEAR: dict[tuple[int, str], tuple[object, float]] = {}
_CLEAR_FOR = 2.0
_SEEN_CLEAR_MAX = 4096


def _forget_clear(entry_path: str) -> None:
    """Folders seen clear that the entry at ``entry_path``, just committed, holds."""
    inside = entry_path.rstrip("/") + "/"
    for key in [k for k in list(_SEEN_CLEAR) if f"{k[1]}/".startswith(inside)]:
        _SEEN_CLEAR.pop(key, None)


def refuse_inside_committed(adapter: Adapter, path: str, doing: str) -> None:
    """EntryExistsError, naming both, if ``path`` lies inside a committed entry: ``doing``
    (writing, removing) there would change data its marker still vouches for, and the
    entry would say COMPLETE over other bytes, or over objects gone."""
    remote = not adapter.capabilities.in_process
    folder = (id(adapter.fs), path.rstrip("/").rpartition("/")[0])
    seen = _SEEN_CLEAR.get(folder) if remote else None
    if seen is not None and seen[0] is adapter.fs and time.monotonic() - seen[1] < _CLEAR_FOR:
        return
    holder = committed_above(adapter, path)
    if holder is None:
        if remote:
            if len(_SEEN_CLEAR) >= _SEEN_CLEAR_MAX:
                _SEEN_CLEAR.clear()
            _SEEN_CLEAR[folder] = (adapter.fs, time.monotonic())
        return
    url = adapter.url(path.rstrip("/"))
    raise EntryExistsError(
        f"{url}: {doing} refused: it lies inside the committed entry {holder.url}, whose "
        "marker still vouches for what it holds (it would stay COMPLETE over other data). "
        f"Change that entry with durable.Entry({holder.url!r}).writing(update=True), "
        "rewrite it with overwrite=True, or delete it first", url=url)


def refuse_leased(entry: Entry, doing: str, force_with: str) -> None:
    """IncompleteExistsError naming ``entry``, the holder of its lease and when it expires,
    if another writer holds that lease live: ``doing`` (deleting, removing) would take the
    lease from under it, and its writes under way would land in a removed entry, or in the
    next writer's. ``force_with``: how the caller removes it anyway. An expired lease is
    removed (`durable._lease.refuse_live_lease`)."""
    from durable._lease import refuse_live_lease  # (_lease imports this module)

    refuse_live_lease(entry, doing, hint=(
        f"Wait for that writer to commit or for its lease to expire, or {force_with} to "
        "remove it anyway (its writer then never commits)"))


def remove_records(adapter: Adapter, layout: Layout) -> None:
    """Remove an entry's records directory under the lock every renewal of its lease
    takes (`Adapter.exclusive`: on a local disk, for its version check and its rename).
    Taken between the two, the removal was lost: the rename put the lease back and its
    holder went on, held, into a removed entry (or the renewal failed on its vanished temp
    file, an OSError, not "lease lost"). Taken even with no lease there: on a local disk
    its release removes the lock's sidecar with the records (a committed entry's, left
    by its commit, outlived the entry)."""
    with adapter.exclusive(layout.lease):
        adapter.delete_prefix(layout.records)


def levels(path: str) -> Iterator[tuple[str, str]]:
    """(entry path, ``path``'s key in it) for ``path`` and each folder above it, nearest
    first: where a marker could make an entry of it. Not the bucket (or file system root)
    itself, and never a records directory."""
    root, key = path.rstrip("/"), ""
    while "/" in root.strip("/") and root.rpartition("/")[2] != RECORDS_DIR:
        yield root, key
        root, _, name = root.rpartition("/")
        key = f"{name}/{key}" if key else name


def nearest_marked(adapter: Adapter, path: str) -> tuple[Entry, Marker, str] | None:
    """The nearest entry at or above ``path`` with a commit marker beside it, that marker,
    and ``path``'s key inside the entry ("" for the entry itself); None if there is none
    up to the bucket or the file system's root (one marker read per level: no limit, since
    writers take keys of any depth). MarkerError for a marker that cannot be trusted."""
    for root, key in levels(path):
        entry = Entry(root, adapter=adapter)
        marker = entry._read_sidecar()
        if marker is not None:
            return entry, marker, key
    return None
