"""Entries: data under one directory/prefix (or one object) with a commit marker written last.

`Entry.writing()` records every object written through it (size and CRC32C as the bytes
stream), makes them durable, and only then writes the marker, create-only. `state()`
reports ABSENT / INCOMPLETE / COMPLETE; `verify()` checks the data against the manifest.

Here: `Entry`, reading its records and judging its state, and its public methods. Beside
it: `_writer` (the `EntryWriter` a write yields), `_commit` (starting and committing a
write, the marker), `_checks` (`Status`, `Problem`, `VerifyReport`, reading objects
through CRC32C) and `_nesting` (entries inside and above entries, removing a tree).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from durable._checks import (
    WORKERS,
    LinkedRecords,
    Problem,
    Status,
    VerifyReport,
    checksum_all,
    deep_problem,
    missing,
    missing_problem,
    report_error,
)
from durable._commit import clear_records, commit, dirs_of, start, write_marker
from durable._errors import (
    AlreadyCompleteError,
    DurableError,
    IncompleteError,
    IncompleteExistsError,
    MarkerError,
    UnsupportedError,
)
from durable._nesting import (
    being_removed,
    delete_entry,
    nearest_marked,
    refuse_inside_committed,
)
from durable._pool import bounded_map
from durable._protocol import (
    MARKER_NAME,
    MAX_MARKER_BYTES,
    META_RECORD_FOLLOWS,
    Layout,
    Manifest,
    Marker,
    ObjectRecord,
    State,
    attempt_folders,
    carries_record,
    is_attempt_record,
    new_attempt_id,
    written_key,
)
from durable._reader import EntryReader
from durable._reader import reading as _reading
from durable._writer import EntryWriter
from durable.adapters import Adapter, ObjectInfo, resolve
from durable.adapters.local import DEL_MARK, TMP_MARK

if TYPE_CHECKING:
    from durable._lease import Lease

__all__ = ["Entry"]


# Two attempt records this close (by the store's clock) are two writers that started at
# the same moment: both refused, and each may try once more after a random pause
# (`durable._commit.start`).
_RACE_WINDOW = 5.0


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
        try:
            self.layout = Layout(path)
        except ValueError as exc:
            # Named as the caller wrote it: "'ops' cannot be an entry" left a user of
            # s3://ops (a bucket) reading a name they never gave.
            raise ValueError(f"{adapter.url(path)}: {exc}") from None
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

    def _read_record(self, *, look: bool = True, lazy: bool = False
                     ) -> tuple[Marker | None, ObjectInfo | None, bool]:
        """(record, the object's stat, whether the object was stat-ed) of the entry.

        The object is stat-ed (on adapters with ``object_records``) when its own metadata
        could decide: beside a marker of kind "object", beside a marker that cannot be
        read, and (``look``) where there is no marker at all. A marker of kind "prefix"
        decides alone. ``lazy``: as for `_read_sidecar`.
        """
        error: MarkerError | None = None
        try:
            marker = self._read_sidecar(lazy=lazy)
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

    def _read_sidecar(self, *, lazy: bool = False) -> Marker | None:
        """The commit marker beside the entry with its manifest, None if there is none.

        ``lazy``: an external manifest is fetched, checked and parsed when its objects are
        first looked at (MarkerError there if it cannot be trusted), not now: for callers
        that may not look (`status`: the marker's summary answers it), and that look at
        once or handle a MarkerError where they do.
        """
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
            ref = marker.manifest_ref
            mpath = self.layout.external_manifest(ref.key)
            murl = self.adapter.url(mpath)

            def fetch() -> bytes:
                try:
                    # Limited to the size the marker recorded, not to any manifest's 1 GiB:
                    # a larger file is refused from its stat, before a byte of it is read.
                    blob = self.adapter.read(mpath, limit=ref.size)
                except ValueError as exc:
                    raise MarkerError(
                        f"{murl}: the marker recorded an external manifest of {ref.size} "
                        "bytes; " + (str(exc).replace(murl, "this one") if murl in str(exc)
                                     else str(exc)), url=murl, expected=ref.size) from None
                if blob is None:
                    raise MarkerError(f"{murl}: the marker's external manifest is missing "
                                      "(removed since the marker was read? a rewrite of the "
                                      "entry removes it)", url=murl)
                return blob

            if not lazy:
                return marker.with_external_manifest(fetch(), murl)
            # A state() of a marker that summarises its manifest (`Summary`) never pays
            # for 100,000 records.
            marker = marker.with_manifest_from(fetch, murl)
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
        return LinkedRecords(
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
        return LinkedRecords(
            f"{self.url} is a symlink, which durable never follows (it could point "
            "anywhere); put the directory or file itself in its place", url=self.url)

    def _object_path(self, key: str, marker: Marker) -> str:
        return self.layout.object_path(key, marker.kind)

    def _data_missing(self, marker: Marker) -> str | None:
        """Why the committed data is no longer there, or None if it is.

        Checks the first and last objects of the manifest (two stats, whatever the size of
        the entry): enough to see data deleted by another tool. `verify` checks them all.
        Where the marker summarises an external manifest not fetched yet, the summary
        names them, and the manifest is only stat-ed (MarkerError if it is missing or of
        another size than recorded): its content is checked where it is used.
        """
        ends = sorted(marker.ends().items())
        paths: list[str | None] = []
        for key, _ in ends:
            head, sep, rest = key.partition("/")
            # Through a symlinked folder of the entry it is missing, as every listing of
            # the entry (`verify`, `scan`, `durable status`) finds it: never followed.
            linked = sep and self.adapter.through_link(f"{self.path}/{head}", rest)
            paths.append(None if linked else self._object_path(key, marker))
        ref = marker.manifest_ref if not marker.manifest_loaded() else None
        if ref is not None:
            paths.append(self.layout.external_manifest(ref.key))
        infos = self._stats(paths)
        if ref is not None:
            self._check_manifest_stat(ref.key, ref.size, infos.pop())
        for (key, rec), info in zip(ends, infos, strict=True):
            path = self._object_path(key, marker)
            want = rec.size
            if info is None:
                found = missing(self.adapter, path)
                return (f"{self.adapter.url(path)} is listed in the marker but "
                        + ("missing" if found == "missing" else f"is {found}"))
            if info.size != want:
                return (f"{self.adapter.url(path)} is {info.size} bytes, the marker recorded "
                        f"{want}")
        return None

    def _stats(self, paths: list[str | None]) -> list[ObjectInfo | None]:
        """The stat of each path (None: not asked, taken as missing); on a store across a
        network all at once, one round trip instead of one each."""
        asked = [p for p in paths if p is not None]
        if len(asked) > 1 and not self.adapter.capabilities.in_process:
            with ThreadPoolExecutor(len(asked)) as pool:
                found = iter(list(pool.map(self.adapter.info, asked)))
        else:
            found = iter([self.adapter.info(p) for p in asked])
        return [None if p is None else next(found) for p in paths]

    def _check_manifest_stat(self, key: str, size: int, info: ObjectInfo | None) -> None:
        """MarkerError for an external manifest missing, or not of the recorded size (as
        its read would find it), from its stat."""
        murl = self.adapter.url(self.layout.external_manifest(key))
        if info is None:
            raise MarkerError(f"{murl}: the marker's external manifest is missing", url=murl)
        if info.size != size:
            raise MarkerError(f"{murl}: the marker recorded an external manifest of {size} "
                              f"bytes; this one is {info.size} bytes", url=murl,
                              expected=size, found=info.size)

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
        marker, info, looked = self._read_record(lazy=True)
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
            return Status(State.INCOMPLETE, _NEVER_FOLLOWED if _record_follows(info)
                          else "data present but no commit marker")
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
            follows = False
            if self.adapter.capabilities.object_records and not stat_taken:
                # A listing shows no metadata: an object carrying its own record is COMPLETE.
                info = self.adapter.info(self.path)
                own = Marker.from_metadata(info.record if info else None, self.url)
                if own is not None:
                    return self._object_status(own, info)
                follows = _record_follows(info)
            if records is None:
                # One listing, as the look below the marker's name would take: the records
                # dir answers that look and names the writers that started here.
                records = self.adapter.list(self.layout.records)
            self._refuse_marker_prefix(records)
            if MARKER_NAME in records:
                # A commit landed after the marker was read (a rewrite finishing, its
                # attempt record already removed): not data written without durable,
                # which the bare reason says, with advice to mark it complete as it is.
                return Status(State.INCOMPLETE, "data present and no commit marker when "
                              "read, but one since: a commit landed while the entry was "
                              "being looked at; look again")
            if follows:
                return Status(State.INCOMPLETE, _NEVER_FOLLOWED)
            return Status(State.INCOMPLETE, "data present but no commit marker"
                          + _started(records, own_attempt) + self._attempt_folders(records))
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
            odd = self._attempt_folders(records)
            if odd and all(k.startswith("attempts/") and k.count("/") > 1 for k in others):
                return Status(State.INCOMPLETE, "records but no commit marker and no data"
                                                + odd)
            return Status(State.INCOMPLETE, "a writer started but has not committed" + odd)
        return Status(State.ABSENT, "no marker and no data")

    def _attempt_folders(self, records: dict[str, ObjectInfo]) -> str:
        """`attempt_folders` of the records listed, as a reason's last part."""
        odd = attempt_folders(records, lambda k: self.adapter.url(f"{self.layout.records}/{k}"))
        return f"; {odd}" if odd else ""

    def state(self) -> State:
        """ABSENT, INCOMPLETE or COMPLETE; a corrupt marker raises MarkerError."""
        return self.status().state

    def require_complete(self) -> Marker:
        """The marker of a COMPLETE entry; IncompleteError naming the state otherwise.

        An external manifest (over 10,000 objects) is fetched, checked and parsed at the
        first look at its objects: a MarkerError there if it cannot be trusted."""
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
            if st.reason != "data present but no commit marker":
                return ""
            left = self._records_left()
            if left:
                # A failed update (an append that failed part-way): its metadata is held
                # back among these records, and mark_complete would adopt the entry without it.
                return (f"; a durable write that did not commit left records "
                        f"({', '.join(left[:3])}): finish it with resume=True, or start "
                        "over with overwrite=True")
            # No durable writer ever started here (else the reason names it): data
            # written before durable, which "INCOMPLETE" alone left users to rewrite.
            # (Not `durable mark-complete URL`: that marks the entries found below a
            # root, this path's own folders, not the path as one entry.)
            return (f"; written without durable? Once you know it is whole, "
                    f"durable.Entry({self.url!r}).mark_complete() commits it as it is")
        holder = found[0]
        key = self.path.rstrip("/")[len(holder.path.rstrip("/")) + 1:]
        return (f"; it lies inside the entry {holder.url}, which has a commit marker: open "
                f"that entry and {key!r} inside it")

    def _records_left(self) -> list[str]:
        """The keys of the entry's records other than its marker (metadata a failed update
        held back, fragments, a lease): a durable writer was here."""
        keys = self.adapter.list(self.layout.records)
        return sorted(k for k in keys if k != MARKER_NAME)

    # verifying ---------------------------------------------------------------------------
    def _listing(self, marker: Marker) -> dict[str, ObjectInfo]:
        if marker.kind == "object":
            info = self.adapter.info(self.path)
            return {"": info} if info is not None else {}
        return self.adapter.list(self.path)

    def verify(self, deep: bool = False, *, raise_errors: bool = True,
               workers: int = WORKERS) -> VerifyReport:
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
                report.problems.append(missing_problem(self.adapter, key, path, rec.size))
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
                problems = bounded_map(pool, check, to_read, ahead=4 * max(1, workers))
                for item, problem in zip(to_read, problems, strict=True):
                    report.bytes_checked += item[2].size
                    if problem is not None:
                        report.problems.append(problem)
        if raise_errors and report.problems:
            raise report_error(report)
        return report

    # adopting, deleting ------------------------------------------------------------------
    def mark_complete(self, *, workers: int = WORKERS, force: bool = False) -> Marker:
        """Adopt data written without `durable`: checksum what is there, write the marker.

        It trusts what it adopts: run it only when nothing is writing the entry. A started
        but uncommitted `durable` writer is refused unless ``force=True``; a folder holding
        symlinks, always (UnsupportedError naming one: durable follows no link).
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
        left = self._records_left()
        if not force and left:
            # A failed update or resume (an xarray append that failed part-way) keeps the
            # entry's metadata held back among its records: adopted, the entry read
            # COMPLETE with no zarr.json, and its staged metadata was never published.
            raise IncompleteExistsError(
                f"{self.url}: has durable records but no marker ({', '.join(left[:3])}): a "
                "durable write that did not commit left them; finish it with resume=True, "
                "or start over with overwrite=True (force=True adopts the data as it is)",
                url=self.url)
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
                written_key(k, self.url)
            # Listings skip links: the entry was adopted without them and read COMPLETE,
            # whole (`durable mark-complete ROOT` skips such folders; this is its Python
            # way in). One walk on a local disk; no request elsewhere.
            links = self.adapter.links_below(self.path)
            if links:
                more = f" ({len(links) - 1} more: {', '.join(links[1:4])})" if links[1:] else ""
                raise UnsupportedError(
                    f"{self.adapter.url(f'{self.path}/{links[0]}')} is a symlink: durable "
                    f"follows no link, so a marker over {self.url} would leave it out, and "
                    f"the entry would read COMPLETE without it{more}; replace each link with "
                    "what it points to, or remove it")
        records = checksum_all(self.adapter, listing, workers)
        self.adapter.sync([i.path for i in listing.values()], dirs_of(self, listing))
        return write_marker(self, Marker.new(kind, new_attempt_id(), Manifest(records)))

    def delete(self, *, force: bool = False) -> None:
        """Remove the entry: marker first, so a half-deleted entry is never COMPLETE; then
        the documents readers open first (`OPENED_FIRST`), so a plain reader never opens
        a half-deleted tree; then the rest.

        It holds the entry's lease while it removes (as `durable clean` does): a writer
        that starts meanwhile is refused, and one without a lease that started before
        refuses at its commit. Run it only when nothing writes the entry: such a
        writer's attempt record and objects are removed like a killed writer's, and it
        fails at its commit. A writer that committed while the entry was being deleted
        is an error either way: its marker over data the delete removed is removed too
        (IntegrityError), one over data all written after the removal is kept
        (AlreadyCompleteError). Where the store cannot hold a lease (no conditional
        writes) it looks for a live one first, as before.

        An entry whose lease another writer holds live is refused (IncompleteExistsError
        naming the entry, the holder and when its lease expires): removed under it, its
        writes under way would land in a deleted entry, or in the next writer's. An
        expired lease is removed with the rest (`durable._lease.refuse_live_lease`).
        ``force=True`` removes it anyway, the live lease too: its holder finds the lease
        lost at its next renewal or commit and never commits, but objects it writes
        before that remain, leaving the entry INCOMPLETE.
        """
        delete_entry(self, force)

    # reading -----------------------------------------------------------------------------
    def reading(self) -> contextlib.AbstractContextManager[EntryReader]:
        """Read the COMPLETE entry's current commit, and only it (IncompleteError if it is
        not COMPLETE).

        Yields an `EntryReader` pinned to the marker read here: ``read(key)`` and
        ``open(key)`` check each object against that commit's manifest (size, CRC32C), so a
        checkpoint read file by file is all of one commit, or an error; a rewrite landing
        between two reads is an IncompleteError saying so, never a mix::

            with durable.Entry("s3://ckpt/run1/latest").reading() as r:
                state = torch.load(r.open("model.pt"))
                step = json.loads(r.read("meta.json"))["step"]
        """
        return _reading(self)

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
          killed append, taken as a resume, would append after what it had added), and
          so is one another update started on at the same moment.
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
        if lease is not None:
            if lease.url != self.adapter.url(self.layout.lease):
                raise ValueError(f"{lease!r} is not the lease of {self.url}")
            lease.check()
        writer = EntryWriter(self, new_attempt_id())
        writer._lease = lease
        fresh = start(self, writer, lease, overwrite=overwrite, resume=resume, update=update)
        try:
            yield writer
            writer._closed = True
            writer._refuse_unfinished()
            commit(self, writer, unrecorded, lease)
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
                # Nor is an entry whose lease a writer took since this one (without a
                # lease) started: the objects it resumes would be taken from under it.
                # A delete's or clean's lease is no such writer: what this writer wrote
                # after their removal would outlive it, INCOMPLETE.
                if (fresh and set(self.adapter.list(self.layout.attempts))
                        <= {f"{writer.attempt}.json"}
                        and self.adapter.info(self.layout.marker) is None
                        and (lease is not None
                             or self.adapter.info(self.layout.lease) is None
                             or being_removed(self))):
                    self.adapter.delete_prefix(self.path)
                    clear_records(self)
                else:
                    self.adapter.delete([self.layout.attempt_record(writer.attempt)])
            raise

    def _is_lease_key(self, key: str) -> bool:
        """The lease, or a temp file of a write of it (keys relative to the records); not
        one a killed conditional delete left renamed aside (kept, it stayed for good)."""
        name = self.layout.lease.rpartition("/")[2]
        return key == name or (key.startswith(f".{name}") and TMP_MARK in key
                               and DEL_MARK not in key)


_NEVER_FOLLOWED = ("data present but no commit marker: published by a durable writer whose "
                   "marker never followed (killed between the two, or at it now)")


def _record_follows(info: ObjectInfo | None) -> bool:
    """Whether the object was published by a durable writer before its record, which is
    a marker beside it (`META_RECORD_FOLLOWS`)."""
    return info is not None and info.record is not None and META_RECORD_FOLLOWS in info.record


def _started(records: dict[str, ObjectInfo] | None, own_attempt: str | None) -> str:
    """What the reason of an unmarked entry with data adds for writers that started on it
    (their attempt records; ``own_attempt``'s aside), as `durable scan` says it: "data
    present but no commit marker" alone read like data written without durable, and sent
    operators to `mark-complete` a killed writer's leftover (``records``: None if not
    listed)."""
    mine = f"attempts/{own_attempt}.json"
    n = sum(1 for k in records or () if is_attempt_record(k) and k != mine)
    return f"; a writer started but has not committed (attempt records: {n})" if n else ""
