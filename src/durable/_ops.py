"""The jobs behind ``durable verify ROOT``, ``durable mark-complete`` and ``durable clean``.

Each starts from one `Survey` of the root (one listing, see `durable._scan`), so what it
asks of the store grows with entries and listing pages, not with objects, except where it
must read data (a deep verify, an adoption).

- `verify_root`: every entry with a marker under a root against its manifest, the objects
  of all entries checked in one thread pool.
- `mark_complete_root`: give unmarked data (written before durable) a commit marker. It
  TRUSTS what it adopts: whole or not, the bytes there now become the committed entry
  (incident 001's push plan: run it only while nothing writes the root).
- `plan_clean` / `apply_clean`: find, then remove, what dead durable writers left behind.
  An entry with a commit marker is never a candidate, nor one holding an object that carries
  its own record in its metadata (S3: a HEAD per object of each entry about to be removed,
  since listings show no metadata), and each candidate's state is checked again, marker
  first, right before anything of it is removed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from durable._checks import Problem, VerifyReport, deep_problem, missing_problem
from durable._entry import Entry
from durable._errors import (
    AlreadyCompleteError,
    DurableError,
    IncompleteError,
    IncompleteExistsError,
    IntegrityError,
    UnsupportedError,
)
from durable._lease import Lease, LeaseView, describe
from durable._nesting import CLEANING, OPENED_FIRST, committed_meanwhile, delete_tree
from durable._pool import bounded_map
from durable._protocol import (
    LEASE_NAME,
    MARKER_NAME,
    META_RECORD_FOLLOWS,
    RECORDS_DIR,
    Marker,
    ObjectRecord,
    carries_record,
)
from durable._scan import (
    AgeClock,
    EntryFound,
    LeaseSeen,
    Records,
    Stat,
    Survey,
    _read_json,
    entry_age,
    read_records,
    split_recorded,
    stat_objects,
)
from durable.adapters import ObjectInfo
from durable.adapters.base import Adapter, Upload, VersionMismatchError
from durable.adapters.local import DEL_MARK

log = logging.getLogger(__name__)

__all__ = ["TRUST", "AdoptReport", "Adoption", "CleanItem", "CleanReport", "RootVerifyReport",
           "Skipped", "Ticker", "apply_clean", "fmt_age", "mark_complete_root", "own_records",
           "plan_clean", "verify_root"]

#: (what is being done, done, total or None)
Ticker = Callable[[str, int, int | None], None]

_WORKERS = 16
_SHOWN = 3
#: Said by mark-complete in its help and its output, every time.
TRUST = ("mark-complete TRUSTS what it adopts: each entry is recorded as whole exactly as "
         "it is now, and a partial one becomes COMPLETE. Run it only while nothing writes "
         "under the root (stop every writer first), and delete any entry you doubt.")
_OWN_RECORD = ("one object carrying its commit record in its own metadata (written by "
               "atomic_write in one request): COMPLETE, never a leftover")
_RECORD_NEVER_FOLLOWED = (
    "published by a durable writer whose commit marker never followed (killed between the "
    "two, or at it now): nothing checked these bytes after their upload, so they are not "
    "adopted as data written before durable; write it again, or delete it")
#: How durable starts every multipart upload (durable.adapters.s3): recognisably ours.
DURABLE_UPLOAD_CHECKSUM = "CRC32C"


@dataclass(frozen=True)
class Skipped:
    """An entry (or file, or upload) a job looked at and left alone, and why."""

    url: str
    reason: str


def _tick(progress: Ticker | None, what: str) -> Callable[[int, int], None] | None:
    if progress is None:
        return None
    return lambda done, total: progress(what, done, total)


def _holders(sv: Survey) -> set[str]:
    """Entries that hold other entries inside their data."""
    out: set[str] = set()
    for key in sv.entries:
        parts = key.split("/") if key else []
        out.update("/".join(parts[:i]) for i in range(len(parts)))
    return out


def _kept_for(st: Stat) -> str | None:
    """Why an object stat-ed as ``st`` is never deleted nor adopted as plain data: it
    carries a durable record in its own metadata (COMPLETE, or loud if hostile), or it
    could not be stat-ed (unknown is kept); None for plain data or an object gone."""
    if isinstance(st, str):
        return f"could not be stat-ed to see whether it carries its own commit record ({st}): kept"
    if st is not None and st.record is not None and META_RECORD_FOLLOWS in st.record \
            and not carries_record(st.record):
        # Adopted, bytes nothing checked after their upload would read COMPLETE.
        return _RECORD_NEVER_FOLLOWED
    return _OWN_RECORD if st is not None and carries_record(st.record) else None


def _heads(sv: Survey, paths: list[str], workers: int) -> list[str | None]:
    """For each object of ``paths``: `_kept_for` of its stat. All None, and nothing asked,
    on adapters without ``object_records``: their listings show every record (a sidecar
    marker).

    One HEAD per object, in parallel: a listing never shows user metadata, so without this
    an object committed by `atomic_write` inside a dead writer's entry went with it.
    """
    if not sv.adapter.capabilities.object_records:
        return [None] * len(paths)
    return [_kept_for(st) for st in stat_objects(sv.adapter, paths, workers)]


def _recorded_in(sv: Survey, path: str, objects: list[str],
                 why: list[str | None]) -> str | None:
    """Why the entry at ``path`` is kept, from `_heads` of its ``objects``; None if not."""
    for obj, reason in zip(objects, why, strict=True):
        if reason is not None:
            return reason if obj == path else f"it holds {sv.adapter.url(obj)}: {reason}"
    return None


def _carries_own_record(sv: Survey, key: str) -> str | None:
    """Why the entry at ``key``, one object, is never adopted (`_kept_for`): it carries a
    durable record in its own metadata (COMPLETE, or loud if hostile), or it could not be
    stat-ed. A listing shows no metadata, so this costs a stat (unless `split_recorded`
    took it), only on adapters that keep them."""
    if key not in sv.listing or not sv.adapter.capabilities.object_records:
        return None
    if key in sv.stats:
        return _kept_for(sv.stats[key])
    return _kept_for(stat_objects(sv.adapter, [sv.entry_path(key)])[0])


def _committed_owner(sv: Survey, key: str) -> str | None:
    """A marked entry other than ``key`` whose data or records hold ``key``."""
    for owner in sv.owners(key):
        if owner != key and sv.entries[owner].marker is not None:
            return owner
    return None


# verify ---------------------------------------------------------------------------------
@dataclass
class RootVerifyReport:
    root: str
    deep: bool
    reports: list[VerifyReport]
    """One per entry with a marker, sorted by URL."""
    not_verified: list[Skipped]
    """Entries without a marker: nothing to verify them against."""
    not_verified_objects: int = 0
    """Objects of those entries."""

    @property
    def ok(self) -> bool:
        """Every entry verified matches; False when nothing was verified (a verify that
        checked nothing never says OK)."""
        return bool(self.reports) and all(r.ok for r in self.reports)


def own_records(sv: Survey, *, workers: int = _WORKERS,
                progress: Ticker | None = None) -> dict[str, Records]:
    """The records of the unmarked entries that are one object (on adapters with
    ``object_records``: one HEAD each, in parallel; its record may be in its metadata)."""
    if not sv.adapter.capabilities.object_records:
        return {}
    split_recorded(sv, workers=workers, progress=_tick(progress, "reading metadata"))
    keys = sorted(k for k, f in sv.entries.items() if f.marker is None and k in sv.listing)
    return read_records(sv, keys, workers=workers, progress=_tick(progress, "reading markers"))


def verify_root(sv: Survey, *, deep: bool, workers: int = _WORKERS,
                progress: Ticker | None = None,
                records: dict[str, Records] | None = None) -> RootVerifyReport:
    """Check every entry with a marker under the surveyed root against its manifest.

    Sizes come from the survey's listing (no request per object); with ``deep`` every
    object is read and its CRC32C compared, all entries' objects in one pool. An unreadable
    marker is a problem of its entry ("unreadable"), never a reason to stop. ``records``:
    what `own_records` read already (not read again).
    """
    # Single objects with no marker may carry their record in their own metadata, also
    # inside unmarked directories (each then an entry of its own).
    split_recorded(sv, workers=workers, progress=_tick(progress, "reading metadata"))
    own = sv.adapter.capabilities.object_records
    candidates = sorted(k for k, f in sv.entries.items()
                        if f.marker is not None or (own and k in sv.listing))
    given = records or {}
    records = {**given, **read_records(sv, [k for k in candidates if k not in given],
                                       workers=workers,
                                       progress=_tick(progress, "reading markers"))}
    marked = [k for k in candidates
              if sv.entries[k].marker is not None or records[k].marker is not None]
    reports: list[VerifyReport] = []
    to_read: list[tuple[VerifyReport, str, ObjectInfo, ObjectRecord]] = []
    for key in marked:
        report = VerifyReport(sv.url(key), deep)
        reports.append(report)
        marker = records[key].marker
        if not isinstance(marker, Marker):
            where = (sv.adapter.url(sv.layout(key).marker) if sv.entries[key].marker
                     is not None else sv.url(key))  # the object's own metadata record
            report.problems.append(Problem("", where, "unreadable",
                                           found=marker or "gone since it was listed"))
            continue
        to_read += [(report, *item) for item in _compare(sv, key, marker, report)]

    def check(item: tuple[VerifyReport, str, ObjectInfo, ObjectRecord]) -> Problem | None:
        return deep_problem(sv.adapter, *item[1:])

    if to_read:
        with ThreadPoolExecutor(max(1, min(workers, len(to_read)))) as pool:
            found = bounded_map(pool, check, to_read, ahead=4 * max(1, workers))
            for n, (item, problem) in enumerate(zip(to_read, found, strict=True), 1):
                item[0].bytes_checked += item[3].size
                if problem is not None:
                    item[0].problems.append(problem)
                if progress is not None:
                    progress("reading objects", n, len(to_read))
    for r in reports:
        # Same order as Entry.verify: the manifest's objects by key, then the unexpected.
        r.problems.sort(key=lambda p: (p.issue == "unexpected", p.key))
    verified = set(marked)
    unverified = sorted(k for k in sv.entries if k not in verified)
    not_verified = [Skipped(sv.url(k), _no_marker_reason(sv.entries[k])) for k in unverified]
    return RootVerifyReport(sv.adapter.url(sv.path), deep, reports, not_verified,
                            sum(sv.entries[k].objects for k in unverified))


def _compare(sv: Survey, key: str, marker: Marker,
             report: VerifyReport) -> list[tuple[str, ObjectInfo, ObjectRecord]]:
    """Entry.verify's size checks, from the survey's listing; the objects left to read."""
    assert marker.manifest is not None
    layout = sv.layout(key)
    if marker.kind == "object":
        single = sv.listing.get(key)
        listing = {"": single} if single is not None else {}
    else:
        listing = sv.data(key)
    to_read = []
    for k, rec in sorted(marker.manifest.objects.items()):
        url = sv.adapter.url(layout.object_path(k, marker.kind))
        report.objects += 1
        found = listing.get(k)
        if found is None:
            report.problems.append(missing_problem(sv.adapter, k,
                                                   layout.object_path(k, marker.kind),
                                                   rec.size))
        elif found.size != rec.size:
            report.problems.append(Problem(k, url, "size", rec.size, found.size))
        elif report.deep:
            to_read.append((k, found, rec))
    for k in sorted(set(listing) - set(marker.manifest.objects)):
        report.problems.append(Problem(k, sv.adapter.url(listing[k].path), "unexpected",
                                       found=listing[k].size))
    return to_read


def _no_marker_reason(f: EntryFound) -> str:
    if f.attempts:
        return (f"no commit marker: a durable writer started and has not committed "
                f"(attempt records: {len(f.attempts)})")
    if f.records:
        return "no commit marker (durable records without one)"
    return "no commit marker: data written without durable (mark-complete adopts it)"


# mark-complete --------------------------------------------------------------------------
AdoptStatus = Literal["planned", "adopted", "skipped", "failed"]


@dataclass
class Adoption:
    url: str
    status: AdoptStatus
    reason: str
    objects: int
    size: int
    key: str = field(default="", repr=False)


@dataclass
class AdoptReport:
    root: str
    apply: bool
    adoptions: list[Adoption]
    """Unmarked entries with no durable records: what was (or would be) adopted."""
    skipped: list[Skipped]
    """Unmarked entries left alone, and why."""
    marked: int
    """Entries that have a commit marker: never touched."""


def mark_complete_root(sv: Survey, *, apply: bool, workers: int = _WORKERS,
                       progress: Ticker | None = None) -> AdoptReport:
    """Adopt every unmarked entry under the surveyed root that no durable writer touched.

    Candidates come from the listing alone: entries with no marker and no records at all
    (no attempt record, no lease, nothing in ``.durable/NAME/``). Each is adopted with
    `Entry.mark_complete`, which reads every object to record its CRC32C. Dry run unless
    ``apply``. Idempotent: an adopted entry has a marker, and is no candidate the next time.
    See `TRUST`.
    """
    # Objects carrying their own records inside unmarked directories are entries of their
    # own: a directory marker over them would be broken by their next atomic_write.
    split_recorded(sv, every=True, workers=workers,
                   progress=_tick(progress, "reading metadata"))
    adoptions: list[Adoption] = []
    skipped: list[Skipped] = []
    marked = 0
    for key, f in sorted(sv.entries.items()):
        url = sv.url(key)
        if f.marker is not None:
            marked += 1
            continue
        owner = _committed_owner(sv, key)
        if owner is not None:
            skipped.append(Skipped(url, f"inside the committed entry {sv.url(owner)}: "
                                        "adopting it would change that entry's data"))
        elif f.attempts:
            skipped.append(Skipped(url, f"a durable writer started here and has not "
                                        f"committed (attempt records: {len(f.attempts)}); it "
                                        "may be at work (`durable clean` removes it once "
                                        "it is dead)"))
        elif f.lease is not None:
            skipped.append(Skipped(url, "a writer holds (or held) a lease on it"))
        elif f.records:
            odd = sv.attempt_folders(key)
            skipped.append(Skipped(url, f"has durable records but no marker "
                                        f"({', '.join(sorted(f.records)[:3])})"
                                        + (f": {odd}" if odd else "; see `durable status`")))
        elif f.recorded:
            skipped.append(Skipped(url, _holds_recorded(sv, f)))
        elif sv.adapter.capabilities.in_process and sv.adapter.exists(sv.layout(key).marker):
            # An empty directory where the marker belongs (no listing shows one): the
            # adoption's marker write failed on it; `status` calls it an error.
            skipped.append(Skipped(url, "something that is no marker (an empty directory?) "
                                        "stands where its commit marker belongs; see "
                                        "`durable status`"))
        elif not f.objects:
            skipped.append(Skipped(url, "no data"))
        elif (why := _carries_own_record(sv, key)) is not None:
            skipped.append(Skipped(url, why))
        elif links := _links_among(sv, key):
            skipped.append(Skipped(url, (
                f"holds symlinks ({', '.join(links[:3])}): durable follows no link, so "
                "its marker would leave them out; replace each with what it points to, "
                "or remove it")))
        else:
            adoptions.append(Adoption(url, "planned", "unmarked data, no durable records",
                                      f.objects, f.size, key))
    if apply and adoptions:
        outer = max(1, min(workers, len(adoptions)))
        inner = max(1, workers // outer)

        def adopt(a: Adoption) -> None:
            entry = Entry(sv.entry_path(a.key), adapter=sv.adapter)
            try:
                # Checked again now: a writer that started since the survey is not adopted.
                records = sv.adapter.list(entry.layout.records)
                if records:
                    a.status, a.reason = "skipped", (
                        f"durable records appeared since the survey "
                        f"({', '.join(sorted(records)[:3])}): a writer at work?")
                    return
                marker = entry.mark_complete(workers=inner)
            except AlreadyCompleteError:
                a.status, a.reason = "skipped", "already COMPLETE (committed since the survey)"
            except IncompleteExistsError as exc:
                a.status, a.reason = "skipped", str(exc)
            except IncompleteError:
                a.status, a.reason = "skipped", "gone since the survey (ABSENT)"
            except (DurableError, OSError, ValueError) as exc:
                a.status, a.reason = "failed", f"{type(exc).__name__}: {exc}"
            else:
                assert marker.manifest is not None
                a.status = "adopted"
                a.reason = (f"marked COMPLETE: {len(marker.manifest)} objects, "
                            f"{marker.manifest.total_size} bytes checksummed")
                a.objects, a.size = len(marker.manifest), marker.manifest.total_size

        with ThreadPoolExecutor(outer) as pool:
            for n, _ in enumerate(pool.map(adopt, adoptions), 1):
                if progress is not None:
                    progress("adopting", n, len(adoptions))
    return AdoptReport(sv.adapter.url(sv.path), apply, adoptions, skipped, marked)


def _links_among(sv: Survey, key: str) -> list[str]:
    """The symlinks (on a local disk) at any depth in the unmarked entry at ``key``:
    listings skip them, so adopting it recorded the entry without them ("1 objects" for a
    folder of two files, one a link), and it read COMPLETE, whole."""
    return [] if key in sv.listing else list(sv.adapter.links_below(sv.entry_path(key)))


def _holds_recorded(sv: Survey, f: EntryFound) -> str:
    """Why the unmarked directory ``f`` is not adopted: objects in it carry their own record
    (or could not be stat-ed), each an entry of its own (`split_recorded`)."""
    def some(keys: list[str]) -> str:
        more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
        return ", ".join(sv.url(k) for k in keys[:_SHOWN]) + more

    unknown = [k for k in f.recorded if isinstance(sv.stats.get(k), str)]
    recorded = [k for k in f.recorded if not isinstance(sv.stats.get(k), str)]
    why = []
    if recorded:
        why.append(f"holds {len(recorded)} objects carrying their own commit record in their "
                   f"metadata ({some(recorded)}), each an entry of its own: a marker over "
                   "the directory would take them in, and their next atomic_write would "
                   "break it")
    if unknown:
        why.append(f"holds {len(unknown)} objects that could not be stat-ed to see whether "
                   f"they carry their own commit record ({some(unknown)}): unknown is never "
                   "adopted")
    return "; ".join(why) + f"; its {f.objects} other objects stay unmarked"


# clean ----------------------------------------------------------------------------------
CleanKind = Literal["entry", "records", "spent", "temp", "upload"]
CleanStatus = Literal["planned", "removed", "skipped", "failed"]


@dataclass
class CleanItem:
    """One thing `clean` removes (or would): an entry, its orphan records, the records
    of spent attempts beside a marker, a temp file, an upload; ``status`` and ``detail``
    say what became of it."""

    kind: CleanKind
    url: str
    reason: str
    age: float | None
    objects: int = 0
    size: int = 0
    status: CleanStatus = "planned"
    detail: str = ""
    key: str = field(default="", repr=False)
    expect: dict[str, str | None] = field(default_factory=dict, repr=False)
    upload: Upload | None = field(default=None, repr=False)
    stale_lease: LeaseView | None = field(default=None, repr=False)
    """The entry's lease as the plan judged it stale: taken over on that version."""
    version: str | None = field(default=None, repr=False)
    """The version planned of an entry that is one object with no records (one whose
    marker never followed): removed only while it is still that version."""


@dataclass
class CleanReport:
    root: str
    apply: bool
    older_than: float
    lease_wait: float
    waited: float
    """Seconds waited to tell live leases from stale ones (0: no lease seen)."""
    items: list[CleanItem]
    kept: list[Skipped]
    """Leftovers of durable writers that are not removed, and why (COMPLETE entries and
    data without records are never candidates and are not listed)."""


LeaseState = tuple[Literal["live", "stale", "unknown"], str]


def _lease_key(key: str) -> str:
    parent, _, name = key.rpartition("/")
    return "/".join([p for p in (parent, RECORDS_DIR, name, LEASE_NAME) if p])


def _record_temps(sv: Survey, key: str) -> dict[str, ObjectInfo]:
    """Temp files in the records dir of the entry ``key`` (a marker a killed writer staged
    and never published), keyed as a listing of that dir names them. No records of the
    entry (`survey`), but removed with them, and a new one is a writer at work: left
    out of what a removal expects, every entry a writer was killed in the middle of
    committing was skipped by every clean, "its records changed"."""
    prefix = _lease_key(key)[: -len(LEASE_NAME)]
    return {k[len(prefix):]: i for k, i in sv.temps.items() if k.startswith(prefix)}


def _watch_leases(sv: Survey, leases: dict[str, LeaseSeen], lease_wait: float,
                  sleep: Callable[[float], None]) -> tuple[dict[str, LeaseState], float]:
    """Which leases are alive: list, wait their stale_after (capped), list again.

    A lease whose version did not change for a whole ``stale_after`` window, as seen from
    here, is stale; no clock of another machine is read. One more listing, whatever the
    number of leases.
    """
    if not leases:
        return {}, 0.0
    windows = [lease.stale_after for lease in leases.values() if lease.stale_after]
    wait = min(max(windows, default=0.0), lease_wait)
    again: dict[str, ObjectInfo] = {}
    if wait > 0:
        sleep(wait)
        again = sv.adapter.list(sv.path) if any(leases) else {}

    def current(key: str) -> ObjectInfo | None:
        if wait <= 0:
            # Nothing was watched: every lease stays as first listed, so none is judged.
            return sv.entries[key].lease
        # The root's own lease lies beside the root, outside its listing.
        return again.get(_lease_key(key)) if key else sv.adapter.info(sv.layout("").lease)

    states: dict[str, LeaseState] = {}
    for key, lease in leases.items():
        body = lease.body or {}
        holder = f"{body.get('host', '?')}:{body.get('pid', '?')}"
        now_info = current(key)
        if lease.body is None:
            states[key] = ("unknown", f"its lease file cannot be read ({lease.error}): "
                                      "taken for alive")
        elif lease.stale_after is None or lease.version is None:
            states[key] = ("unknown", "its lease has no usable stale_after or version: "
                                      "taken for alive")
        elif now_info is None:
            states[key] = ("unknown", "its lease was released during the check (the writer "
                                      "finished or gave up): looked at again next time")
        elif now_info.version != lease.version:
            states[key] = ("live", f"live lease held by {holder} (renewed within "
                                   f"{wait:g} s)")
        elif wait < lease.stale_after:
            states[key] = ("unknown", f"lease of {holder} not renewed in {wait:g} s, less "
                                      f"than its stale_after of {lease.stale_after:g} s: "
                                      f"pass --lease-wait {math.ceil(lease.stale_after)} "
                                      "to decide; taken for alive")
        else:
            states[key] = ("stale", f"stale lease of {holder} (not renewed in {wait:g} s, "
                                    f"stale_after {lease.stale_after:g} s)")
    return states, wait


def _never_followed(sv: Survey, workers: int, age_since: Callable[[float | None], float | None],
                    why_kept: Callable[[str, float | None], str | None],
                    kept: list[Skipped]) -> list[CleanItem]:
    """Objects a durable writer published before its marker, which never followed (an S3
    multipart `atomic_write` killed after its completion): no records lie beside them,
    so they are found by their metadata, one HEAD each of the unmarked objects with no
    records that the adapter says may be such (on S3, those completed from parts).
    Nothing recorded them, and the old version is gone: removed once old, as any dead
    writer's leftovers (``why_kept``: why one is not, from its key and age)."""
    keys = [k for k, f in sorted(sv.entries.items())
            if f.marker is None and not f.records and k in sv.listing
            and sv.adapter.published_before_record(sv.listing[k])]
    items = []
    stats = stat_objects(sv.adapter, [sv.entry_path(k) for k in keys], workers)
    for key, st in zip(keys, stats, strict=True):
        if isinstance(st, str) or st is None or st.record is None \
                or META_RECORD_FOLLOWS not in st.record or carries_record(st.record):
            continue
        url = sv.url(key)
        age = age_since(st.modified)
        why = why_kept(key, age)
        if why is not None:
            kept.append(Skipped(url, why))
            continue
        assert age is not None
        items.append(CleanItem("entry", url, "published by a durable writer whose marker "
                               f"never followed (killed between the two), {fmt_age(age)} "
                               "ago", age, 1, st.size, key=key, version=st.version))
    return items


def plan_clean(sv: Survey, *, older_than: float, lease_wait: float = 120.0,
               all_uploads: bool = False, workers: int = _WORKERS,
               progress: Ticker | None = None, sleep: Callable[[float], None] = time.sleep,
               now: Callable[[], float] = time.time,
               clock: Literal["store", "local"] = "store") -> CleanReport:
    """What `apply_clean` would remove under the surveyed root, and what it keeps and why.

    Candidates: unmarked entries with durable records (a writer started: attempt records,
    a lease, other records) older than ``older_than`` seconds with no live lease (their
    data and records, or only the records when the data is gone); temp files of atomic
    writes older than that; objects published before a marker that never followed
    (`_never_followed`) older than that; uploads left open longer than that (S3
    multipart uploads, Azure blobs of uncommitted blocks; only those started the way
    durable starts them unless ``all_uploads``). Never a candidate: an
    entry with a marker or anything inside one, data with no durable records (data written
    before durable: `mark_complete_root` adopts it), anything of an entry whose lease is
    live or cannot be judged, an entry holding an object that carries its own commit record
    (on adapters with ``object_records``, S3: one HEAD per object of each entry about to be
    planned, in parallel, and again right before it is removed; a listing shows no
    metadata).

    Ages are read from the store's clock where the adapter can read it (`Adapter.now`):
    an entry's from its attempt records' modification times. Elsewhere, or with
    ``clock="local"``, they are ``now()`` against the writer's ``started_at`` and the
    store's modification times: for a bucket copied from another (copies get new
    modification times, the attempt records keep their ``started_at``), or an endpoint
    whose Date is wrong.
    """
    leased = {k for k, f in sv.entries.items() if f.lease is not None}
    started = {k for k, f in sv.entries.items() if f.marker is None and f.records}
    records = read_records(sv, sorted(leased | started), markers=False, workers=workers,
                           progress=_tick(progress, "reading records"))
    leases = {k: lease for k in leased if (lease := records[k].lease) is not None}
    if progress is not None and leases:
        progress(f"watching {len(leases)} leases", 0, None)
    states, waited = _watch_leases(sv, leases, lease_wait, sleep)
    # The store's own clock where it has one: every age is then the difference of two times
    # the store gave, and neither this machine's clock nor a writer's, however far off, can
    # make a live writer's leftovers look old.
    store_now = sv.adapter.now(sv.path) if clock == "store" else None
    at = now() if store_now is None else store_now
    if clock == "store" and store_now is None and not sv.adapter.capabilities.in_process:
        # Said, not silent: the plan's reasons name whose timestamps, not whose "now", and
        # a clock here ahead of the writers' makes a live writer's leftovers look old.
        log.warning("durable clean: %s sends no Date, so ages are measured by this "
                    "machine's clock (as --clock local): it must agree with the writers' "
                    "and the store's to well within --older-than", sv.url(""))

    def age_since(when: float | None) -> float | None:
        if when is None:
            return None
        # One clock read to the second (an HTTP Date): below zero is only that rounding.
        return at - when if store_now is None else max(0.0, at - when)

    def age_of(f: EntryFound, rec: Records) -> tuple[float | None, str | None,
                                                    AgeClock | None]:
        if store_now is None:
            return entry_age(f, rec, at)
        # The attempt records' own mtimes stand for the started_at they hold (stamped by
        # the writer's clock); without any, the data's or records' mtimes (the store's).
        stamps = [i.modified for i in f.attempts.values() if i.modified is not None]
        if stamps:
            return age_since(max(stamps)), "attempt record mtime", "store"
        age, source, whose = entry_age(f, Records(), at)
        return (None if age is None else max(0.0, age)), source, whose

    items: list[CleanItem] = []
    kept: list[Skipped] = []
    holders = _holders(sv)

    def blocked(keys: list[str]) -> str | None:
        """Why something of these entries must be kept (a marker, a live lease), or None."""
        for k in keys:
            if sv.entries[k].marker is not None:
                return f"inside the committed entry {sv.url(k)}"
            state = states.get(k)
            if state is not None and state[0] != "stale":
                return state[1] if k == keys[-1] else f"inside {sv.url(k)}: {state[1]}"
        return None

    def old(age: float | None, what: str) -> str | None:
        if age is None:
            return f"{what}: its age is unknown (the store gives no modification time)"
        if age < older_than:
            return f"{what} {fmt_age(age)} ago: younger than --older-than"
        return None

    candidates: list[tuple[str, float | None, str | None, AgeClock | None]] = []
    for key in sorted(started):
        f, url = sv.entries[key], sv.url(key)
        age, source, whose = age_of(f, records[key])
        why = (blocked(sv.owners(key))
               or ("it holds other entries" if key in holders else None)
               or old(age, f"last {source} ({whose}'s clock)" if source else "written"))
        if why is not None:
            kept.append(Skipped(url, why))
            continue
        candidates.append((key, age, source, whose))
    # Stale records beside (or around) objects committed in one request: never their data.
    # (One pool over the objects of every candidate: an entry of 10,000 objects is not
    # stat-ed one at a time.)
    objects = {key: [i.path for i in sv.data(key).values()] for key, *_ in candidates}
    paths = [p for ps in objects.values() for p in ps]
    found = dict(zip(paths, _heads(sv, paths, workers), strict=True))
    for key, age, source, whose in candidates:
        f, url = sv.entries[key], sv.url(key)
        why = _recorded_in(sv, sv.entry_path(key), objects[key],
                           [found[p] for p in objects[key]])
        if why is not None:
            kept.append(Skipped(url, why))
            continue
        assert age is not None
        since = f"{source} {fmt_age(age)} ago ({whose}'s clock)"
        # A temp file alone (a writer killed in its first object) is data to remove with
        # the records: planned as records only, it was "data appeared since the plan" at
        # every removal, and the entry stayed INCOMPLETE for good.
        if f.objects or (key and any(k.startswith(f"{key}/") for k in sv.temps)):
            kind: CleanKind = "entry"
            reason = (f"never committed: {len(f.attempts)} attempt records, {since}"
                      if f.attempts else f"records but no marker, {since}")
        else:
            kind = "records"
            reason = f"records of an entry whose data is gone, no marker, {since}"
        if f.lease is not None:
            reason += f"; {states[key][1]}"
        if odd := sv.attempt_folders(key):
            reason += f"; {odd}"
        seen = leases.get(key)
        # Its holder and the time watched, for the take-over's warning: it said "holder
        # unreadable, unchanged for 10.0 s" of a lease whose holder the plan named.
        view = (LeaseView(seen.version, seen.body, waited, seen.stale_after or waited, True)
                if seen is not None and seen.version and states[key][0] == "stale" else None)
        items.append(CleanItem(kind, url, reason, age, f.objects, f.size, key=key,
                               expect={k: i.version for k, i in
                                       {**f.records, **_record_temps(sv, key)}.items()},
                               stale_lease=view))
    items += _never_followed(sv, workers, age_since, lambda key, age: (
        blocked(sv.owners(key)) or old(age, "published (store's clock)")), kept)

    for key, f in sorted(sv.entries.items()):
        # Attempt records (and their fragments) left beside a marker: the committing
        # writer's, whose removal after the marker (housekeeping, on a thread) a kill cut
        # short, or a loser's killed before it removed its own. The marker decides the
        # entry's state; these only clutter it. Nothing else of the entry is touched.
        # So does a stale lease: its holder killed between its commit and its release (a
        # cached function's caller; kill sweep: 4 of 35 local @cached kills), which every
        # later Lease and recompute() waited out.
        state = states.get(key)
        stale = f.lease is not None and state is not None and state[0] == "stale"
        if f.marker is None or not (f.attempts or stale):
            continue
        ids = [name.removesuffix(".json") for name in f.attempts]
        spent = {k: i for k, i in f.records.items() if k.startswith("attempts/")
                 or any(k.startswith(f"fragments/{a}/") for a in ids)}
        if stale and f.lease is not None:
            spent[LEASE_NAME] = f.lease
        url = sv.url(key)
        times = [i.modified for i in spent.values() if i.modified is not None]
        age = age_since(max(times)) if len(times) == len(spent) else None
        owner = _committed_owner(sv, key)
        # Inside a committed entry its records are that entry's data (a manifest lists
        # them when they were there at its commit): removed, that entry lost objects it
        # committed, and read INCOMPLETE.
        why = ((f"inside the committed entry {sv.url(owner)}, whose data they are"
                if owner is not None else None)
               or (state[1] if state is not None and state[0] != "stale" else None)
               or old(age, "last written (store's clock)"))
        if why is not None:
            kept.append(Skipped(f"{url} (records beside its marker)", why))
            continue
        assert age is not None
        what = " and ".join(([f"{len(f.attempts)} attempt records"] if f.attempts else [])
                            + (["a stale lease"] if stale else []))
        items.append(CleanItem("spent", url, f"{what} left beside its marker, last written "
                                             f"{fmt_age(age)} ago",
                               age, len(spent), sum(i.size for i in spent.values()), key=key,
                               expect={k: i.version for k, i in spent.items()}))

    for tkey, info in sorted(sv.temps.items()):
        owners = sv.owners(tkey)
        if started & set(owners):
            continue  # part of a writer's entry: removed, or kept, with it
        url = sv.adapter.url(info.path)
        age = age_since(info.modified)
        # Inside a committed entry too: no manifest lists a temp file (commits and
        # mark-complete leave them out), so one left by a writer killed there, or by a
        # folder adopted around it, is debris that nothing else would ever remove.
        committed = [k for k in owners if sv.entries[k].marker is not None]
        why = (blocked([k for k in owners if k not in committed])
               or _committed_data(sv, committed, tkey) or old(age, "written (store's clock)"))
        if why is not None:
            kept.append(Skipped(url, why))
            continue
        assert age is not None
        what = ("a lease or marker a conditional delete killed part-way left renamed aside"
                if DEL_MARK in tkey.rpartition("/")[2]
                else "temp file of an atomic write never published")
        items.append(CleanItem("temp", url, f"{what}, written {fmt_age(age)} ago", age, 1,
                               info.size, key=tkey, expect={tkey: info.version}))

    for up in sv.adapter.list_uploads(sv.path):
        rel = up.path[len(sv.path):].lstrip("/")
        url = f"{sv.adapter.url(up.path)} (upload {up.upload_id})"
        age = age_since(up.initiated)
        ours = (up.checksum or "").upper() == DURABLE_UPLOAD_CHECKSUM
        how = f"checksum {up.checksum}, not {DURABLE_UPLOAD_CHECKSUM}"
        if up.ours is not None:  # the adapter can tell (Azure: by the staged blocks' IDs)
            ours, how = up.ours, "its staged blocks are not named the way durable names them"
        why = (None if ours or all_uploads else
               f"not started the way durable starts uploads ({how}): pass --all-uploads to "
               "include it")
        # Aborting an upload never changes a committed object, so only a live lease keeps it.
        owners = [k for k in sv.owners(rel) if k in states and states[k][0] != "stale"]
        why = (why or (states[owners[-1]][1] if owners else None)
               or old(age, "initiated (store's clock)"))
        if why is not None:
            kept.append(Skipped(url, why))
            continue
        assert age is not None
        items.append(CleanItem("upload", url, f"upload never completed, initiated "
                                              f"{fmt_age(age)} ago", age, key=rel, upload=up))
    return CleanReport(sv.adapter.url(sv.path), False, older_than, lease_wait, waited, items,
                       kept)


def apply_clean(sv: Survey, report: CleanReport, *, workers: int = _WORKERS,
                progress: Ticker | None = None) -> CleanReport:
    """Remove what ``report`` planned, checking each item again first (marker first)."""
    report.apply = True
    planned = [i for i in report.items if i.status == "planned"]

    inner = max(1, workers // max(1, min(workers, len(planned))))

    def one(item: CleanItem) -> None:
        try:
            _remove(sv, item, inner)
        except (DurableError, OSError, ValueError) as exc:
            item.status, item.detail = "failed", f"{type(exc).__name__}: {exc}"

    if planned:
        with ThreadPoolExecutor(max(1, min(workers, len(planned)))) as pool:
            for n, _ in enumerate(pool.map(one, planned), 1):
                if progress is not None:
                    progress("removing", n, len(planned))
    return report


def _committed_data(sv: Survey, entries: list[str], key: str) -> str | None:
    """Why the temp-named ``key`` inside these committed entries must stay: a manifest
    lists it after all (data, whatever its name), or a marker cannot be read."""
    for k in entries:
        try:
            marker = Entry(sv.entry_path(k), adapter=sv.adapter).read_marker()
        except DurableError as exc:
            return f"inside {sv.url(k)}, whose marker cannot be read: {exc}"
        rel = key[len(k) + 1:] if k else key
        if marker is not None and marker.manifest is not None and (
                rel in marker.manifest.objects):
            return f"listed in the manifest of the committed entry {sv.url(k)}"
    return None


def _remove(sv: Survey, item: CleanItem, workers: int) -> None:
    a = sv.adapter
    if item.kind == "upload":
        assert item.upload is not None
        a.abort_upload(item.upload)
        item.status = "removed"
        return
    if item.kind == "temp":
        info = a.info(sv.entry_path(item.key))
        if info is None or info.version != item.expect[item.key]:
            item.status, item.detail = "skipped", "gone or rewritten since the plan"
            return
        a.delete([info.path])
        item.status = "removed"
        return
    layout = sv.layout(item.key)
    if item.kind == "spent":
        # Only the records planned, only while the marker they sit beside is still there
        # (gone: a writer is rewriting the entry) and each is as it was listed.
        # Under the lease's lock, as an entry's records below: two cleans removing the
        # same records each reported "removed".
        with a.exclusive(layout.lease) as locked:
            listed = a.list(layout.records)
            if MARKER_NAME not in listed:
                item.status, item.detail = "skipped", "its marker is gone since the plan"
                return
            if not set(item.expect) & set(listed):
                item.status, item.detail = "skipped", _GONE
                return
            if any(k not in listed or listed[k].version != v
                   for k, v in item.expect.items()):
                item.status, item.detail = "skipped", "its records changed since the plan"
                return
            ours = _claim(a, {k: listed[k] for k in item.expect}, locked)
        item.status, item.detail = ("removed", "") if ours else (
            "skipped", _GONE if ours is False else "its records changed since the plan")
        return
    # Marker first: an entry committed since the plan is never touched. `exists`, not
    # `info`: anything at the marker's path (on a local disk a symlink or a directory,
    # which `info` calls no object and a listing skips) keeps the entry too.
    if a.exists(layout.marker):
        item.status, item.detail = "skipped", ("committed since the plan (something is at "
                                               "its marker's path now)")
        return
    # A changed record (a new attempt, a renewed lease) is a writer at work.
    now = {k: i.version for k, i in a.list(layout.records).items()}
    if not now and item.expect:
        item.status, item.detail = "skipped", _GONE
        return
    if now != item.expect:
        item.status, item.detail = "skipped", _changed(sv, item)
        return
    if item.kind == "records":
        _remove_entry(sv, item, workers, None)
        return
    lease, why = _take_lease(sv, item)
    if why is not None:
        item.status, item.detail = "skipped", why
        return
    try:
        _remove_entry(sv, item, workers, lease)
    finally:
        if lease is not None:
            lease.release()


def _holds_data(a: Adapter, path: str) -> bool:
    """Whether anything but empty folders is at ``path``: an object, a link, or a folder
    holding either. Empty folders are what a writer killed before its first object (a
    zarr or tensorstore writer on a local disk makes them first) leaves: taken for data,
    its records were skipped by every clean, and the entry stayed INCOMPLETE."""
    if not a.exists(path):
        return False
    if a.not_an_object(path) != "a directory" or a.links_in(path):
        return True
    return bool(a.list(path)) or bool(a.links_below(path))


def _take_lease(sv: Survey, item: CleanItem) -> tuple[Lease | None, str | None]:
    """The entry's lease, held while its data is removed, or why it cannot be had.

    A writer starting over or resuming the entry (``overwrite=True``, ``resume=True``)
    announces itself, then looks for a live lease and refuses one: it announced itself
    before this lease was taken (and the listing after it shows its attempt record), or
    it refuses. Without the lease, such a writer could clear the entry and write between
    the check of the records and the removal of the data: its objects were removed under
    it, and a commit from its own records (`durable.zarr.write`) published a marker over
    them. A lease the plan judged stale is taken over on the version it saw. None (no
    lease, as before) where the store cannot hold one."""
    # Not best effort: where the store enforces no create-only and conditional writes
    # (the generic adapter, gcp-storage-emulator) nothing is put, and the removal goes on
    # as before, checked by the listings alone.
    # Renewed every 2 s, stale after 10: a clean killed while it held it keeps writers
    # and the next clean out that long, not a writer's default 30 s.
    lease = Lease(Entry(sv.entry_path(item.key), adapter=sv.adapter), heartbeat=2.0,
                  stale_after=10.0)
    lease._purpose = CLEANING
    stale = item.expect.get(LEASE_NAME, "")
    try:
        if not stale:
            taken = lease.try_acquire()
        else:
            lease.take_over(item.stale_lease if item.stale_lease is not None
                            and item.stale_lease.version == stale else
                            LeaseView(stale, None, lease.stale_after, lease.stale_after, True))
            taken = True
    except UnsupportedError:
        return None, None
    except IncompleteExistsError:
        taken = False
    if not taken:
        return None, _changed(sv, item)
    now = {k: i.version for k, i in sv.adapter.list(sv.layout(item.key).records).items()}
    if now.pop(LEASE_NAME, None) != lease.version or now != {
            k: v for k, v in item.expect.items() if k != LEASE_NAME}:
        lease.release()
        return None, _changed(sv, item)
    return lease, None


def _changed(sv: Survey, item: CleanItem) -> str:
    """Why an item whose records changed since the plan is skipped: another clean holds
    its lease (removing it), or a writer is at work."""
    lease = sv.layout(item.key).lease
    body, _ = _read_json(sv.adapter, lease)
    if body is not None and body.get("purpose") == CLEANING:
        return (f"another clean is removing it ({describe(body)}; its lease "
                f"{sv.adapter.url(lease)})")
    return "its records changed since the plan (a writer at work?)"


def _remove_entry(sv: Survey, item: CleanItem, workers: int, lease: Lease | None) -> None:
    """The data (an ``entry`` item) and the records planned of an entry checked again,
    under ``lease`` (this clean's, released by the caller)."""
    a = sv.adapter
    layout = sv.layout(item.key)
    path = sv.entry_path(item.key)
    if item.kind == "records":
        if _holds_data(a, path):
            item.status, item.detail = "skipped", "data appeared since the plan"
            return
    elif (single := a.info(path)) is not None:
        if carries_record(single.record):
            # Committed since the plan by a write that carries its record in its metadata.
            item.status, item.detail = "skipped", _OWN_RECORD
            return
        if item.version is not None:
            _remove_never_followed(a, item, single, layout.marker)
            return
        a.delete([path])
    elif a.capabilities.object_records:
        # Checked again, each object as it is now: one committed (in one request) inside
        # the entry since the plan keeps the whole entry. Only the objects checked are
        # deleted, never a prefix: one written after this check is left alone.
        paths = [i.path for i in a.list(path).values()]
        why = _recorded_in(sv, path, paths, _heads(sv, paths, workers))
        if why is not None:
            item.status, item.detail = "skipped", f"checked again: {why}"
            return
        if paths:
            # What readers open first, first (in the first batch): see OPENED_FIRST.
            paths.sort(key=lambda p: p.rpartition("/")[2] not in OPENED_FIRST)
            a.delete(paths)
    else:
        delete_tree(a, path)  # what readers open first, first
    undone = None
    if (found := a.info(layout.marker)) is not None:
        # A writer committed while its data was being removed. Its marker, kept, vouched
        # for objects this clean removed (read COMPLETE where its first and last object
        # were written after the removal): removed, with what is left of its data, and
        # said; kept only over data all written after the removal (its clean win).
        try:
            committed_meanwhile(Entry(path, adapter=a), found, "durable clean")
        except AlreadyCompleteError as exc:
            item.status, item.detail = "failed", str(exc)
            return
        except IntegrityError as exc:
            undone = str(exc)
    # Only the records planned, each still as planned: a writer that started while the
    # data was being removed (a waiter taking the stale lease over, a new attempt record)
    # keeps its records. Removing its lease would leave it writing unaware, its writes
    # landing in whatever entry the next writer starts. (Checked by this listing, one
    # round trip before the delete, where the data's removal took many.)
    # Under the lease's lock (`remove_records`'s reason): a renewal of a lease judged
    # stale, between its check and its rename, would put it back after the delete. (With
    # no lease too: on a local disk the lock's sidecar goes with the records it guarded.)
    if lease is not None:
        lease.check()  # lost (taken over by a waiter): a writer may be at work
    with a.exclusive(layout.lease) as locked:
        listed = a.list(layout.records)
        planned = {k: i for k, i in listed.items() if item.expect.get(k, "") == i.version}
        ours = _claim(a, planned, locked)
    # This clean's own lease goes with its release, after.
    if item.kind == "records":
        # The empty folders a killed writer made before its first object (rmdir only:
        # one a writer fills meanwhile stays).
        a.prune(path)
    kept = sorted(set(listed) - set(planned) - (
        {LEASE_NAME} if lease is not None and listed.get(LEASE_NAME) is not None
        and listed[LEASE_NAME].version == lease.version else set()))
    a.prune(layout.records)
    if not ours and not kept and not undone:
        # Another clean of the same root removed them first (both passed the checks
        # above): one removal, reported once, not by both.
        item.status, item.detail = "skipped", _GONE
        return
    if kept or ours is None:
        kept = kept or [k for k in planned if a.info(planned[k].path) is not None][:1]
        item.status, item.detail = "failed", (
            "a writer started while its data was being removed; its records are kept ("
            + ", ".join(a.url(f"{layout.records}/{k}") for k in kept[:3]) + ")")
        return
    item.status, item.detail = ("failed", undone) if undone else ("removed", "")


def _remove_never_followed(a: Adapter, item: CleanItem, now: ObjectInfo, marker: str) -> None:
    """Delete the object whose marker never followed, only as the version planned (one
    written again since, or committed, is another writer's): conditionally where the
    store can, so a rewrite between this check and the delete is never taken."""
    path = now.path
    if now.version != item.version:
        item.status, item.detail = "skipped", "written again since the plan"
        return
    assert item.version is not None
    if a.supports_conditional(path):
        try:
            a.delete_if(path, item.version)
        except VersionMismatchError:
            item.status, item.detail = "skipped", "written again since the plan"
            return
    else:
        a.delete([path])
    if a.info(marker) is not None:
        item.status, item.detail = "failed", ("its writer wrote its marker while the object "
                                              "was being removed; the marker is kept")
        return
    item.status = "removed"


#: Why an item found gone at its removal is skipped.
_GONE = "already removed since the plan (by another clean of this root, or a delete)"


def _claim(a: Adapter, planned: dict[str, ObjectInfo], locked: bool) -> bool | None:
    """Delete the records ``planned``: True if this run removed them, False if another
    run had (nothing planned was left), None if one was rewritten meanwhile (a writer's:
    nothing more is deleted).

    Two cleans of one root both pass every check before this point: each reported
    "removed" for one removal. Under a lock (``locked``: a local disk, memory) the
    listing just taken decides. Elsewhere one record is deleted conditionally first, on
    its planned version: of racing cleans exactly one succeeds and deletes the rest;
    where the store enforces no conditional delete (gcp-storage-emulator) both may still
    say so.
    """
    if not planned:
        return False
    # A lease first: deleted on the version judged stale, never one a waiter took over
    # (conditionally rewritten) since.
    first, *rest = sorted(planned, key=lambda k: (k != LEASE_NAME, k))
    version = planned[first].version
    if not locked and version is not None and a.supports_conditional(planned[first].path):
        try:
            a.delete_if(planned[first].path, version)
        except VersionMismatchError:
            return None if a.info(planned[first].path) is not None else False
        a.delete([planned[k].path for k in rest])
        return True
    a.delete([i.path for i in planned.values()])
    return True


def fmt_age(seconds: float) -> str:
    """``3d 4h``, ``2h 5m``, ``12m``, ``45s``; a negative age (clocks apart) says so."""
    if seconds < 0:
        return f"in {fmt_age(-seconds)} (clocks apart)"
    s = int(seconds)
    for unit, size, sub, subsize in (("d", 86400, "h", 3600), ("h", 3600, "m", 60),
                                     ("m", 60, "s", 1)):
        if s >= size:
            rest = (s % size) // subsize
            return f"{s // size}{unit}" + (f" {rest}{sub}" if rest else "")
    return f"{seconds:.0f}s" if seconds >= 1 else f"{seconds:.1f}s"

