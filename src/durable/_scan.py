"""Scan a root: every entry under it, with its state, size, object count, age and lease.

Built for object stores, where a request costs more than the bytes it carries: ONE
recursive listing of the root, then small reads of records only (in a thread pool): the
marker of each marked entry, the attempt records of each unmarked entry a durable writer
started, and each lease file the listing shows. Sizes and ages of objects come from the
listing; no object inside an entry is stat-ed or read, so the requests grow with listing
pages and entries, never with the objects inside the entries (one exception: unmarked
directories on stores that keep records in object metadata, below).

Records in object metadata (S3, GCS, Azure: `atomic_write` in one request): a listing does
not show user metadata, so on adapters with ``object_records`` an unmarked entry that is ONE
object is stat-ed (one HEAD) and, if it carries a record, judged by it; and so is every
object of an unmarked directory with no records of its own (`split_recorded`: the README's
``atomic_write("s3://b/ckpt/model.pt")`` leaves ``ckpt/`` holding only such objects). Each
object there that carries a record is an entry of its own, judged by that record, as a
sidecar-marked file is on a local disk; the directory keeps only its other objects (unmarked
data), and is no entry at all when none is left. Unmarked directories are debris or such
folders, so those HEADs are rare; no object inside a MARKED entry (or one a durable writer
started) is stat-ed. A marker of kind "object" is read with the object's stat as well
(`Entry.read_marker`): an object carrying its own record supersedes it.

How entries are found in the listing (keys relative to the root):

- ``D/.durable/NAME/commit.json``        a commit marker: entry ``D/NAME``
- ``D/NAME``, one object, no marker      an entry if its metadata carries a record
- ``U/.../NAME`` inside unmarked data ``U`` an entry if its metadata carries a record
                                         (``object_records`` adapters: `split_recorded`)
- ``D/.durable/NAME/attempts/<id>.json`` a writer started on ``D/NAME``
- ``D/.durable/NAME/lease.json``         a writer's lease on ``D/NAME``
- any other key in ``D/.durable/NAME/``  records of ``D/NAME`` (an external manifest)
- ``D/NAME``, a symlink with records     an entry that is a link, never followed: an
  (local disk)                           ERROR row naming it, as `Entry.status` raises;
                                         a symlink without records is passed over
- unmarked data: each child of the root, and of any directory that holds a ``.durable``
  records directory, that has no records, contains no entry and is not inside one. It was
  written without `durable` (or by a writer that never started its records): INCOMPLETE,
  "no commit marker". `Entry.mark_complete` adopts such data.

If the root itself has records beside it (``PARENT/.durable/ROOTNAME/``, one more small
listing), the root is an entry and is scanned as such.

States are as `Entry.status` gives them, with one difference: the scan compares the size
of EVERY object of a manifest (it has them all from the listing), where `status` stats
only the first and last. A marker that cannot be trusted gives a row with state
"ERROR" and the MarkerError message, and the scan goes on. ABSENT entries have nothing in
the store, so no row. CRC32Cs are not checked here: `Entry.verify(deep=True)` does that.

Ages, and whose clock each one is read from (clocks of different machines are never
compared with each other, only each with this machine's "now"):

- a marked entry: since the marker's ``committed_at`` (the committing writer's clock);
- an unmarked entry a durable writer started: since the newest attempt record's
  ``started_at`` (that writer's clock);
- otherwise: since the newest object of its data, or of its records when it has no data
  (the store's modification times: the server's clock on an object store).

A lease is reported as its file says (holder, host, pid, heartbeat, stale_after) with the
age of the lease file by the store's clock; whether it is alive takes watching its version
over a ``stale_after`` window, which `durable clean` does and a scan does not.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from durable._checks import missing
from durable._entry import Entry
from durable._errors import DurableError, MarkerError
from durable._lease import stated_stale_after
from durable._protocol import (
    LEASE_NAME,
    MARKER_NAME,
    META_RECORD_FOLLOWS,
    RECORDS_DIR,
    Layout,
    Marker,
    attempt_folders,
    carries_record,
)
from durable.adapters import Adapter, ObjectInfo, resolve
from durable.adapters.local import DEL_MARK, LOCK_SUFFIX, TMP_MARK

__all__ = ["EntryFound", "LeaseSeen", "Records", "ScanRow", "ScanState", "Stat", "Survey",
           "entry_age", "holds_records", "is_lock_sidecar", "mismatch_reason",
           "read_records", "scan", "scan_survey", "size_mismatches", "split_recorded",
           "stat_objects", "survey"]

ScanState = Literal["COMPLETE", "INCOMPLETE", "ERROR"]
AgeClock = Literal["writer", "store"]
_WORKERS = 16
_SHOWN = 3


def size_mismatches(adapter: Adapter, marker: Marker, listing: dict[str, ObjectInfo],
                    keys: list[str], paths: list[str]) -> list[str]:
    """Each object of the manifest (in key order) that ``listing`` shows missing or of
    another size, as a line naming it: ``keys`` are where the listing holds them, ``paths``
    where they should be. What `scan` and `durable status` judge a commit by."""
    assert marker.manifest is not None
    bad: list[str] = []
    for (_, rec), key, path in zip(sorted(marker.manifest.objects.items()), keys, paths,
                                   strict=True):
        info = listing.get(key)
        if info is None:
            bad.append(f"{adapter.url(path)} is {missing(adapter, path)} (the marker "
                       f"recorded {rec.size} bytes)")
        elif info.size != rec.size:
            bad.append(f"{adapter.url(info.path)} is {info.size} bytes, the marker "
                       f"recorded {rec.size}")
    return bad


def mismatch_reason(bad: list[str], total: int) -> str:
    """The reason of an INCOMPLETE state for the lines of `size_mismatches`."""
    more = f"; and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
    return (f"marker present but data gone or changed: {len(bad)} of {total} objects: "
            + "; ".join(bad[:_SHOWN]) + more)
# Attempt records and leases are a few hundred bytes; anything far larger is not one and
# is not read into memory.
_MAX_RECORD_BYTES = 64 * 1024


@dataclass(frozen=True)
class ScanRow:
    """One entry found under a scan root."""

    url: str
    state: ScanState
    reason: str
    objects: int
    """Objects of the entry's data in the store now (its records not counted)."""
    size: int
    """Their total size in bytes."""
    attempt: str | None = None
    """The committed attempt, when the entry has a readable marker."""
    committed_at: str | None = None
    age: float | None = None
    """Seconds since the entry was committed, started or last written (see age_source)."""
    age_source: str | None = None
    """What the age is measured from: "committed_at", "started_at", "object mtime" or
    "records mtime"."""
    age_clock: AgeClock | None = None
    """Whose clock gave that time: the writer's or the store's."""
    lease: dict[str, Any] | None = None
    """The lease file's holder/host/pid/acquired_at/heartbeat/stale_after, and its age
    by the store's clock (``file_age``); None when the entry has no lease file."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EntryFound:
    """What the root's listing says of one entry."""

    key: str
    """Relative to the root; "" for the root itself."""
    marker: ObjectInfo | None = None
    attempts: dict[str, ObjectInfo] = field(default_factory=dict)
    lease: ObjectInfo | None = None
    records: dict[str, ObjectInfo] = field(default_factory=dict)
    """Every object of its records directory, keyed relative to it (marker included)."""
    objects: int = 0
    size: int = 0
    newest: float | None = None
    """Modification time of its newest data object (the store's clock)."""
    recorded: list[str] = field(default_factory=list)
    """Keys of objects that lay in this unmarked directory and carry their own record (or
    could not be stat-ed): entries of their own, not counted in ``objects`` (`split_recorded`)."""
    unchecked: bool = False
    """Too many objects for `split_recorded` to stat (``SPLIT_LIMIT``): not looked at."""
    linked: bool = False
    """The entry is itself a symlink (on a local disk): never followed, an ERROR row."""

    @property
    def records_newest(self) -> float | None:
        return _newest(self.records.values())


@dataclass
class Survey:
    """One listing of a root, with the entries it shows (no record read yet)."""

    adapter: Adapter
    path: str
    listing: dict[str, ObjectInfo]
    entries: dict[str, EntryFound]
    temps: dict[str, ObjectInfo]
    """Temp files of atomic writes (``.NAME.durable-tmp-*``) anywhere under the root."""
    stats: dict[str, Stat] = field(default_factory=dict)
    """Stats (HEADs) already taken, by key: `split_recorded`'s, reused by record reads."""
    split: bool = False
    """Whether `split_recorded` has run on this survey."""
    _keys: list[str] = field(default_factory=list, repr=False)

    def entry_path(self, key: str) -> str:
        return _join(self.path, key)

    def url(self, key: str) -> str:
        return self.adapter.url(self.entry_path(key))

    def layout(self, key: str) -> Layout:
        return Layout(self.entry_path(key))

    def data(self, key: str) -> dict[str, ObjectInfo]:
        """The listing's objects of the entry at ``key``, keyed relative to the entry.

        A single-object entry has the one key ""; found by bisection, so slicing every
        entry of a large root costs a log, not a pass over the listing, per entry.
        """
        if key in self.listing:
            return {"": self.listing[key]}
        if not key:
            return dict(self.listing)
        if not self._keys:
            self._keys = sorted(self.listing)
        prefix = key + "/"
        lo = bisect.bisect_left(self._keys, prefix)
        hi = bisect.bisect_left(self._keys, prefix + "\U0010ffff")
        return {k[len(prefix):]: self.listing[k] for k in self._keys[lo:hi]}

    def attempt_folders(self, key: str) -> str:
        """`attempt_folders` of the entry at ``key``'s records, naming them ("" if none)."""
        records = self.layout(key).records
        return attempt_folders(self.entries[key].records,
                               lambda k: self.adapter.url(f"{records}/{k}"))

    def owners(self, key: str) -> list[str]:
        """Entries that hold ``key`` as data or as records, outermost first."""
        parts = key.split("/")
        found = {a for a in _ancestors(key) if a in self.entries}
        if RECORDS_DIR in parts[:-1]:
            i = parts.index(RECORDS_DIR)
            if len(parts) >= i + 3:
                owner = "/".join([*parts[:i], parts[i + 1]])
                found |= {a for a in _ancestors(owner) if a in self.entries}
        return sorted(found, key=lambda k: (k.count("/"), k) if k else (-1, k))


#: What one stat of an object found: its info (None: gone), or why it could not be stat-ed.
Stat = ObjectInfo | None | str


def stat_objects(adapter: Adapter, paths: list[str], workers: int = _WORKERS,
                 progress: Callable[[int, int], None] | None = None) -> list[Stat]:
    """One stat (HEAD) per path, in parallel: a listing never shows user metadata, so this
    is how an object carrying its own commit record is told from plain data. An error is
    returned as its text, never raised: one object that cannot be stat-ed must not hide
    the others, and each caller decides what unknown means (kept, ERROR)."""
    def head(path: str) -> Stat:
        try:
            return adapter.info(path)
        except (DurableError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"

    out: list[Stat] = []
    if paths:
        with ThreadPoolExecutor(max(1, min(workers, len(paths)))) as pool:
            for n, st in enumerate(pool.map(head, paths), 1):
                out.append(st)
                if progress is not None:
                    progress(n, len(paths))
    return out


#: An unmarked directory with more objects than this is not stat-ed object by object by
#: scan and verify (a legacy zarr of a million chunks would cost a million HEADs): its row
#: says so. mark-complete, which reads every object anyway, stats them all.
SPLIT_LIMIT = 1000


def split_recorded(sv: Survey, *, every: bool = False, workers: int = _WORKERS,
                   progress: Callable[[int, int], None] | None = None) -> None:
    """Make each object of an unmarked directory entry that carries its own commit record
    an entry of its own (see the module doc); on adapters with ``object_records`` only, once
    per survey. One stat per object of each unmarked directory with no records.

    Without it, ``ckpt/`` holding ``atomic_write``'s objects was one INCOMPLETE entry that
    `verify` skipped and `mark-complete` adopted under a directory marker, which the next
    ``atomic_write`` of one of them broke. An object that cannot be stat-ed is split off
    too: unknown is never adopted as plain data, and its row says why (ERROR).
    ``every``: also directories over `SPLIT_LIMIT` objects (mark-complete); otherwise those
    are left unchecked, and their rows say so.
    """
    if not sv.adapter.capabilities.object_records:
        return
    # Again on a survey split before: only the directories the limit left unchecked.
    dirs = sorted(k for k, f in sv.entries.items()
                  if k and k not in sv.listing and f.marker is None and not f.records
                  and (not sv.split or f.unchecked))
    sv.split = True
    for d in dirs:
        sv.entries[d].unchecked = not every and len(sv.data(d)) > SPLIT_LIMIT
    dirs = [d for d in dirs if not sv.entries[d].unchecked]
    owned = [(d, f"{d}/{rel}") for d in dirs for rel in sv.data(d)]
    stats = stat_objects(sv.adapter, [sv.entry_path(k) for _, k in owned], workers, progress)
    for (d, key), st in zip(owned, stats, strict=True):
        sv.stats[key] = st
        if isinstance(st, str) or (st is not None and carries_record(st.record)):
            sv.entries[d].recorded.append(key)
    for d in dirs:
        f = sv.entries[d]
        if not f.recorded:
            continue
        for key in f.recorded:
            info = sv.listing[key]
            sv.entries[key] = EntryFound(key, objects=1, size=info.size, newest=info.modified)
        split = set(f.recorded)
        rest = [i for k, i in sv.data(d).items() if f"{d}/{k}" not in split]
        f.objects, f.size, f.newest = len(rest), sum(i.size for i in rest), _newest(rest)
        if not rest:
            del sv.entries[d]  # only recorded objects: no unmarked data left to report


@dataclass(frozen=True)
class LeaseSeen:
    """A lease file as one listing and one read saw it."""

    path: str
    version: str | None
    modified: float | None
    body: dict[str, Any] | None
    error: str | None = None

    @property
    def stale_after(self) -> float | None:
        return stated_stale_after(self.body)  # garbage never breaks nor stalls a clean

    def to_json(self, now: float) -> dict[str, Any]:
        body = self.body or {}
        doc = {k: body.get(k) for k in ("holder", "host", "pid", "acquired_at", "heartbeat",
                                         "stale_after")}
        doc["file_age"] = None if self.modified is None else now - self.modified
        if self.error is not None:
            doc["error"] = self.error
        return doc


@dataclass
class Records:
    """What the records of one entry say, once read."""

    marker: Marker | str | None = None
    """The marker; a str says why it cannot be trusted; None if not read or absent."""
    started: float | None = None
    """The newest attempt record's started_at (POSIX seconds, the writer's clock)."""
    lease: LeaseSeen | None = None
    record_follows: bool = False
    """One object, no marker, published by a durable writer before its record
    (`META_RECORD_FOLLOWS`): the writer died before its marker, or is writing it now."""


def is_lock_sidecar(key: str) -> bool:
    """A lock sidecar of local conditional writes (``.durable/NAME.durable-lock``):
    durable's, never anyone's data nor an entry's records. One stays beside a committed
    entry's records as long as they are there (one left by an earlier durable, which never
    removed them, outlives them)."""
    return key.endswith(LOCK_SUFFIX) and f"{RECORDS_DIR}/" in f"/{key}"


def holds_records(adapter: Adapter, folder: str) -> bool:
    """Whether ``folder``'s records directory holds records of some entry: neither an
    emptied one (a disk's, after its last entry was cleaned or deleted) nor one holding
    lock sidecars alone counts."""
    records = f"{folder.rstrip('/')}/{RECORDS_DIR}"
    if not adapter.exists(records):
        return False
    if adapter.not_an_object(records) != "a directory":
        return True  # a prefix of a store is there only while objects are: no request more
    return any(not is_lock_sidecar(f"{RECORDS_DIR}/{k}") for k in adapter.list(records))


def survey(adapter: Adapter, path: str, *,
           listing: dict[str, ObjectInfo] | None = None) -> Survey:
    """One listing of the root ``path`` (and of the root's own records): the entries in it.

    ``listing``: ``adapter.list(path)`` if the caller has just made it. FileNotFoundError
    if nothing exists at ``path`` (no object, no folder, no unfinished upload).
    """
    path = path.rstrip("/") or path
    if listing is None:
        listing = adapter.list(path)
    listing = {k: i for k, i in listing.items() if not is_lock_sidecar(k)}
    entries: dict[str, EntryFound] = {}
    root_records = _root_records(adapter, path)
    if root_records:
        root = entries[""] = EntryFound("")
        for rest, info in root_records.items():
            _add_record(root, rest.split("/"), info)
        if not listing:
            # The root is a single-object entry: its one object is the root itself.
            single = adapter.info(path)
            listing = {"": single} if single is not None else {}
    elif not listing and not adapter.exists(path) and not adapter.list_uploads(path):
        # Uploads are looked for first: a writer killed mid-upload, alone under the root
        # (a run's first checkpoint), left parts no listing shows, billed until aborted.
        raise FileNotFoundError(f"{adapter.url(path)}: no such directory or prefix")

    temps = {}
    for key, info in listing.items():
        parts = key.split("/")
        if TMP_MARK in parts[-1]:
            temps[key] = info
        if RECORDS_DIR in parts[:-1] and DEL_MARK not in parts[-1] and (
                TMP_MARK not in parts[-1]):
            # (A lease or marker a killed conditional delete left renamed aside is a temp
            # file only: counted as records, it made a plain object, or nothing, an entry
            # a writer started, which a clean then removed whole. So is a record a killed
            # process staged and never published: `mark-complete` killed before linking
            # a folder's marker into place made data never written by durable an entry
            # a writer started, and a clean deleted it.)
            i = parts.index(RECORDS_DIR)
            # Records of an entry named like a records dir belong to no entry durable
            # makes (Layout and writing() refuse it): left alone, never an entry that
            # stops the scan of everything else.
            if len(parts) >= i + 3 and parts[i + 1] != RECORDS_DIR:
                found = entries.setdefault(k := "/".join([*parts[:i], parts[i + 1]]),
                                           EntryFound(k))
                _add_record(found, parts[i + 2:], info)
    # Symlinks where entries are taken from (the root, directories holding records): the
    # listing never follows one, so the scan saw no data where `Entry.status` judged what
    # lies behind it. One with records is an entry that is a link: an ERROR row
    # (`read_records`), as status raises for it. One without (a `latest -> ckpt-5`
    # pointer) is no entry and no data: passed over, as before, not an error in every
    # scan of a checkpoint folder. One scandir per such directory on a local disk; no
    # request elsewhere.
    for parent in _entry_dirs(set(entries)):
        for name in adapter.links_in(_join(path, parent)):
            key = f"{parent}/{name}" if parent else name
            if key in entries:
                entries[key].linked = True
    _count_data(listing, entries)
    return Survey(adapter, path, listing, entries, temps)


def _add_record(found: EntryFound, rest: list[str], info: ObjectInfo) -> None:
    found.records["/".join(rest)] = info
    if rest == [MARKER_NAME] or (rest[0] == MARKER_NAME and found.marker is None):
        # Objects below the marker's path (a directory named commit.json holding files)
        # count as a marker too: read, it is an error naming what is there (an ERROR row),
        # and nothing with one is cleaned or adopted.
        found.marker = info
    elif rest == [LEASE_NAME]:
        found.lease = info
    elif rest[0] == "attempts" and len(rest) == 2 and rest[1].endswith(".json"):
        found.attempts[rest[1]] = info


def read_records(sv: Survey, keys: Iterable[str], *, markers: bool = True,
                 workers: int = _WORKERS,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Records]:
    """Read what the records of the entries ``keys`` say: the marker (if ``markers``), or
    for an unmarked entry its attempt records, and its lease file. One small GET each."""
    jobs: list[tuple[str, str, str]] = []  # (entry key, what, path)
    own = sv.adapter.capabilities.object_records
    for key in keys:
        f = sv.entries[key]
        layout = sv.layout(key)
        if f.marker is not None:
            if markers:
                jobs.append((key, "marker", layout.marker))
        else:
            if markers and own and key in sv.listing:
                # One object, no marker: its record may be in its own metadata, which a
                # listing does not show (one stat per such entry, never per object).
                jobs.append((key, "own", sv.entry_path(key)))
            jobs += [(key, "attempt", layout.attempt_record(n.removesuffix(".json")))
                     for n in sorted(f.attempts)]
        if f.lease is not None:
            jobs.append((key, "lease", layout.lease))
    out = {key: Records() for key in keys}
    for key in keys:
        if sv.entries[key].linked:
            linked = Entry(sv.entry_path(key), adapter=sv.adapter).linked_entry()
            if linked is not None:  # (else replaced by a directory since the survey)
                out[key].marker = f"{MarkerError.__name__}: {linked}"
                jobs = [j for j in jobs if j[0] != key or j[1] == "lease"]
                continue
        if sv.entries[key].marker is None:
            # A marker the listing did not show may be behind a symlinked records dir,
            # which listings never follow: `status` calls that an error, and so does the
            # scan (an ERROR row, which nothing cleans or adopts), not "no commit marker"
            # over data that `clean` would then remove. An lstat on a disk; no request
            # elsewhere.
            linked = Entry(sv.entry_path(key), adapter=sv.adapter).linked_records()
            if linked is not None and sv.adapter.exists(sv.layout(key).marker):
                out[key].marker = f"{MarkerError.__name__}: {linked}"
            elif (linked is None and sv.adapter.capabilities.in_process
                  and sv.adapter.exists(sv.layout(key).marker)):
                # An empty directory where the marker belongs, which no listing shows:
                # read as "no commit marker", mark-complete planned to adopt the data
                # that `status` calls an error. A stat on a disk or in memory.
                try:
                    Entry(sv.entry_path(key), adapter=sv.adapter).read_marker()
                except MarkerError as exc:
                    out[key].marker = f"{MarkerError.__name__}: {exc}"
    if not jobs:
        return out

    def read(job: tuple[str, str, str]) -> Any:
        key, what, path = job
        try:
            if what == "marker":
                entry = Entry(sv.entry_path(key), adapter=sv.adapter)
                marker = entry.read_marker()
                if marker is None:
                    # Listed at or below the marker's name, read as none: objects below it
                    # (on an object store; a local disk's read says so itself) are an error
                    # naming it, or the entry was INCOMPLETE, a leftover to clean.
                    entry._refuse_marker_prefix()
                return marker
            if what == "own":
                # A stat `split_recorded` took already is not taken again.
                info = sv.stats[key] if key in sv.stats else sv.adapter.info(path)
                if isinstance(info, str):
                    return (f"{sv.url(key)}: could not be stat-ed to read the commit record "
                            f"in its metadata ({info})")
                own = Marker.from_metadata(info.record if info else None, sv.url(key))
                if own is None and info is not None and info.record is not None \
                        and META_RECORD_FOLLOWS in info.record:
                    return META_RECORD_FOLLOWS
                return own
        except (DurableError, OSError) as exc:
            # One unreadable or corrupt record must not hide every other entry.
            return f"{type(exc).__name__}: {exc}"
        return _read_json(sv.adapter, path)

    with ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:
        for n, (job, result) in enumerate(zip(jobs, pool.map(read, jobs), strict=True), 1):
            key, what, path = job
            rec = out[key]
            if what == "own":
                # None: a plain object (data written before durable), no record to keep.
                if result == META_RECORD_FOLLOWS:
                    rec.record_follows = True
                elif result is not None:
                    rec.marker = result
            elif what == "marker":
                rec.marker = result
            elif what == "attempt":
                started = _epoch(result[0].get("started_at")) if result[0] else None
                if started is not None and (rec.started is None or started > rec.started):
                    rec.started = started
            else:
                info = sv.entries[key].lease
                assert info is not None
                rec.lease = LeaseSeen(path, info.version, info.modified, result[0], result[1])
            if progress is not None:
                progress(n, len(jobs))
    return out


def scan(root: str, storage_options: dict[str, Any] | None = None, *,
         workers: int = _WORKERS, progress: Callable[[int, int], None] | None = None,
         now: float | None = None) -> list[ScanRow]:
    """Every entry under ``root`` (a path or URL), sorted by URL.

    ``progress(done, total)`` is called after each record read. FileNotFoundError if
    nothing exists at ``root``.
    """
    adapter, path = resolve(root, storage_options)
    return scan_survey(survey(adapter, path), workers=workers, progress=progress, now=now)


def scan_survey(sv: Survey, *, workers: int = _WORKERS,
                progress: Callable[[int, int], None] | None = None,
                now: float | None = None) -> list[ScanRow]:
    """The rows of `scan` for a survey already made."""
    split_recorded(sv, workers=workers, progress=progress)
    records = read_records(sv, sorted(sv.entries), workers=workers, progress=progress)
    at = time.time() if now is None else now
    rows = [_row(sv, key, f, records[key], at) for key, f in sv.entries.items()]
    return sorted(rows, key=lambda r: r.url)


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if key else path


def _root_records(adapter: Adapter, path: str) -> dict[str, ObjectInfo]:
    try:
        layout = Layout(path)
    except ValueError:
        return {}  # a bucket or file-system root cannot be an entry
    return adapter.list(layout.records)


def _count_data(listing: dict[str, ObjectInfo], found: dict[str, EntryFound]) -> None:
    """Add unmarked children to ``found`` and count every entry's data objects."""
    entries = set(found)
    parents = _entry_dirs(entries)
    holds_entry = {a for k in entries for a in _ancestors(k)[:-1]}
    for key, info in listing.items():
        if TMP_MARK in key.rpartition("/")[2]:
            # A temp file (a writer at work, or one killed: `clean` removes it) is no
            # entry's data: counted, it made its folder an entry that mark-complete
            # adopted with nothing in it.
            continue
        chain = _ancestors(key)
        for depth, a in enumerate(chain):
            f = found.get(a)
            if f is None and depth > 0 and chain[depth - 1] in parents:
                name = a.rpartition("/")[2]
                # Records are not entries.
                if name != RECORDS_DIR and a not in holds_entry:
                    f = found[a] = EntryFound(a)
            if f is not None:
                f.objects += 1
                f.size += info.size
                if info.modified is not None and (f.newest is None
                                                  or info.modified > f.newest):
                    f.newest = info.modified


def _entry_dirs(entries: set[str]) -> set[str]:
    """Directories whose children are taken for entries: the root, and any directory that
    holds records, unless it lies in an entry (an entry's subdirectories are its data)."""
    parents = {""} | {k.rpartition("/")[0] for k in entries if k}
    return {p for p in parents if not any(a in entries for a in _ancestors(p))}


def _ancestors(key: str) -> list[str]:
    """``"a/b/c"`` -> ``["", "a", "a/b", "a/b/c"]``; ``""`` -> ``[""]``."""
    out = [""]
    if key:
        parts = key.split("/")
        out += ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return out


def _newest(infos: Iterable[ObjectInfo]) -> float | None:
    times = [i.modified for i in infos if i.modified is not None]
    return max(times) if times else None


def _epoch(stamp: object) -> float | None:
    """POSIX seconds of a protocol timestamp (``2026-01-02T03:04:05.678901Z``), or None."""
    if not isinstance(stamp, str) or len(stamp) > 64:
        return None
    try:
        when = _dt.datetime.fromisoformat(stamp)
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.UTC)
    return when.timestamp()


def _read_json(adapter: Adapter, path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(document, None), or (None, why it could not be read) for a small JSON record."""
    try:
        data = adapter.read(path, limit=_MAX_RECORD_BYTES)
    except (DurableError, OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if data is None:
        return None, f"{adapter.url(path)} is gone"
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"{adapter.url(path)}: not valid JSON ({exc})"
    if not isinstance(doc, dict):
        return None, f"{adapter.url(path)}: not a JSON object"
    return doc, None


def entry_age(f: EntryFound, rec: Records, now: float) -> tuple[float | None, str | None,
                                                                  AgeClock | None]:
    """(seconds, what it is measured from, whose clock) for an entry (see the module doc)."""
    if isinstance(rec.marker, Marker):
        committed = _epoch(rec.marker.committed_at)
        if committed is not None:
            return now - committed, "committed_at", "writer"
    if rec.started is not None:
        return now - rec.started, "started_at", "writer"
    if f.newest is not None:
        return now - f.newest, "object mtime", "store"
    newest = f.records_newest
    if newest is not None:
        return now - newest, "records mtime", "store"
    return None, None, None


def _row(sv: Survey, key: str, f: EntryFound, rec: Records, now: float) -> ScanRow:
    url = sv.url(key)
    age, source, clock = entry_age(f, rec, now)
    extra: dict[str, Any] = {"age": age, "age_source": source, "age_clock": clock,
                             "lease": rec.lease.to_json(now) if rec.lease else None}
    marker = rec.marker
    incomplete: ScanState = "INCOMPLETE"
    if isinstance(marker, str):
        return ScanRow(url, "ERROR", marker, f.objects, f.size, **extra)
    if marker is None:
        reasons = []
        if f.objects:
            reasons.append("data present but no commit marker")
        if rec.record_follows:
            reasons.append("published by a durable writer whose marker never followed "
                           "(killed between the two, or at it now): not data written "
                           "before durable; write it again, or delete it")
        if f.attempts:
            reasons.append(f"a writer started but has not committed (attempt records: "
                           f"{len(f.attempts)})")
        if not reasons:
            reasons.append("records but no commit marker and no data")
        if odd := sv.attempt_folders(key):
            reasons.append(odd)
        if f.recorded:
            reasons.append(f"{len(f.recorded)} objects in it carry their own commit "
                           "records: entries of their own")
        if f.unchecked:
            reasons.append(f"not checked for objects carrying their own records (over "
                           f"{SPLIT_LIMIT:,} objects: one HEAD each; `durable verify URL` "
                           "of one of them checks it)")
        return ScanRow(url, incomplete, "; ".join(reasons), f.objects, f.size, **extra)

    assert marker.manifest is not None
    prefix = f"{key}/" if key else ""
    listed = [key if marker.kind == "object" else prefix + k
              for k in sorted(marker.manifest.objects)]
    bad = size_mismatches(sv.adapter, marker, sv.listing, listed,
                          [_join(sv.path, lk) for lk in listed])
    total = len(marker.manifest)
    if bad:
        reason = mismatch_reason(bad, total)
        return ScanRow(url, incomplete, reason, f.objects, f.size, marker.attempt,
                       marker.committed_at, **extra)
    reason = f"committed at {marker.committed_at} by attempt {marker.attempt}"
    if f.marker is None:
        reason += " (recorded in the object's own metadata)"
    surplus = f.objects - total
    if surplus > 0:
        reason += f"; {surplus} objects not in the manifest"
    return ScanRow(url, "COMPLETE", reason, f.objects, f.size, marker.attempt,
                   marker.committed_at, **extra)
