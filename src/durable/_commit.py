"""Starting and committing a write of an entry (`Entry.writing`), and its marker.

The start announces the writer (its attempt record) and checks and clears the entry as
``overwrite``/``resume``/``update`` say; the commit reconciles what the writer recorded
with what the store holds, makes it durable, and only then publishes the marker,
create-only.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import TYPE_CHECKING, Literal

from durable import _background as background
from durable._checks import WORKERS, LinkedRecords, Status, checksum_all, read_object_record
from durable._errors import (
    AlreadyCompleteError,
    IncompleteExistsError,
    IntegrityError,
    MarkerError,
)
from durable._fragments import MAX_FRAGMENT_BYTES, decode_fragment, fragments_dir
from durable._nesting import delete_tree, forget_clear
from durable._protocol import (
    MARKER_NAME,
    Manifest,
    Marker,
    ObjectRecord,
    State,
    attempt_record_bytes,
    written_key,
)
from durable.adapters import ObjectInfo
from durable.adapters.local import TMP_MARK

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from durable._entry import Entry
    from durable._lease import Lease
    from durable._writer import EntryWriter
    from durable.adapters.base import Staged

__all__ = ["clear_records", "commit", "dirs_of", "start", "write_marker"]

# Two attempt records close by the store's clock (`_RACE_WINDOW` in `durable._entry`) are
# two writers that started at the same moment: both refused, and each may try once more
# after a random pause.
_RACE_PAUSE = (0.05, 0.5)


class _RacedStart(IncompleteExistsError):
    """Refused at the start beside a writer that started at the same moment."""


def start(entry: Entry, writer: EntryWriter, lease: Lease | None, *, overwrite: bool,
          resume: bool, update: bool) -> bool:
    """The start of `Entry.writing` for ``writer``: announced (its attempt record), the
    entry checked and cleared as ``overwrite``/``resume``/``update`` say, and the records
    an update keeps handed to the writer; whether it starts fresh (a failed write may
    remove the whole entry)."""
    keep_lease = lease is not None
    record = entry.layout.attempt_record(writer.attempt)
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
        from durable._lease import refuse_live_lease  # (_lease imports _entry)

        # Another writer's live lease: starting over would remove its data while its
        # writes under way land in this writer's entry; resuming or updating would
        # commit its partial objects. An expired lease is removed (conditionally).
        refuse_live_lease(entry, doing)
    for again in (first, False):
        try:
            if first:
                # In the try: a PUT that landed but failed (an interrupt, a lost answer)
                # is removed too, never left to make the entry look worked on.
                _announce(entry, record, writer.attempt, _RacedStart)
            fresh, seed, versions, looked = _check_and_clear(
                entry, keep_lease, overwrite=overwrite, resume=resume, update=update,
                own_attempt=writer.attempt if first else None)
            break
        except BaseException as exc:
            if first:
                # Refused (or failed looking): this writer's record alone goes, else
                # the entry would look INCOMPLETE to the next writer for nothing.
                with contextlib.suppress(Exception):
                    entry.adapter.delete([record])
            if not isinstance(exc, _RacedStart):
                raise
            if not again:
                raise IncompleteExistsError(str(exc), url=entry.url) from None
        # Both of two writers that started at once refused (each saw the other's
        # record): each tries once more after a random pause, so the first to come
        # back usually goes on and the other then sees it at work.
        time.sleep(random.uniform(*_RACE_PAUSE))
    writer._baseline = {k: (rec, versions[k]) for k, rec in seed.items()}
    if not first:
        _announce(entry, record, writer.attempt, IncompleteExistsError)
        try:
            if not keep_lease:
                # Looked again once announced: a writer that took the lease since the
                # look above either listed the records after this record (and refuses)
                # or before it, and then its lease is here now (the clear keeps leases).
                refuse_live_lease(entry, doing)
            if update and not keep_lease:
                # Two updates that looked at once both found the entry COMPLETE: without
                # this look after the announce both went on, and the one that did not
                # commit wrote its chunks over the other's commit and removed the
                # metadata the other had hidden. As for fresh writers, at most one of
                # two sees no other record; both may refuse, the marker still there.
                _refuse_another_update(entry, writer.attempt, looked)
            if update and not fresh:
                # Invalidate before touching anything: a reader must never see the old
                # marker over data that is being changed.
                entry.adapter.delete([entry.layout.marker])
        except BaseException:
            with contextlib.suppress(Exception):
                entry.adapter.delete([record])
            raise
    return fresh


def _refuse_another_update(entry: Entry, attempt: str, looked: str | None) -> None:
    """IncompleteExistsError if another writer's attempt record is beside this one's.

    ``looked``: the attempt of the commit this update looked at; its record, and any
    older than that commit's marker (by the store's clock), are leftovers of writers done
    before it (housekeeping still to run, a process killed after its marker), not one at
    work."""
    records = entry.adapter.list(entry.layout.records)
    marker = records.get(MARKER_NAME)
    since = marker.modified if marker is not None else None
    others = sorted(
        k for k, info in records.items()
        if k.startswith("attempts/") and k not in (f"attempts/{attempt}.json",
                                                   f"attempts/{looked}.json")
        and (since is None or info.modified is None or info.modified >= since))
    if others:
        raise IncompleteExistsError(
            f"{entry.url}: not updating: another writer started on it at the same moment "
            f"({others[:3]}); nothing was changed, the entry is as it was. Try again once "
            "that writer is done (if none is at work, `durable clean` removes a killed "
            "writer's record)", url=entry.url)


def _announce(entry: Entry, record: str, attempt: str,
              refused: type[IncompleteExistsError]) -> None:
    """Write this writer's attempt record; ``refused`` if it was removed as it was
    written (on a local disk its temp file or directory, by a writer clearing the
    entry's records at that moment): a raw FileNotFoundError named only a temp file."""
    try:
        entry.adapter.put(record, attempt_record_bytes(attempt), durable=False)
    except FileNotFoundError as exc:
        if TMP_MARK not in str(exc.filename or ""):
            raise  # not the temp file (a bucket that does not exist, ...)
        raise refused(f"{entry.url}: this writer's attempt record "
                      f"{entry.adapter.url(record)} was removed as it was written "
                      "(another writer clearing the entry's records at that moment, "
                      "or a clean); nothing was written: try again",
                      url=entry.url) from None


def _check_and_clear(entry: Entry, keep_lease: bool, *, overwrite: bool, resume: bool,
                     update: bool, own_attempt: str | None
                     ) -> tuple[bool, dict[str, ObjectRecord], dict[str, str | None],
                                str | None]:
    """The state check of `writing`, and what it clears: (fresh, the records of the
    objects an update keeps, their versions). ``own_attempt``: as for `_status`."""
    try:
        st = entry._status(leased=keep_lease, expect_absent=not (update or resume),
                           own_attempt=own_attempt)
    except MarkerError as exc:
        if not overwrite or isinstance(exc, LinkedRecords):
            raise
        # A marker nobody can read describes nothing: overwriting is the way out.
        _clear(entry)
        st = Status(State.ABSENT, "cleared an unreadable marker")
    if st.state is State.COMPLETE and update and not overwrite:
        assert st.marker is not None and st.marker.manifest is not None
        if st.marker.kind != "prefix":
            raise ValueError(f"{entry.url} is a single object: rewrite it, not update it")
        # Keep each object's record with the version it has now: at commit, a record
        # is reused only for an object whose version has not changed since.
        now = entry.adapter.list(entry.path)
        seed = {k: r for k, r in st.marker.manifest.objects.items()
                if k in now and now[k].size == r.size and now[k].version is not None}
        # The marker goes in `start`, once this writer is announced and alone.
        return False, seed, {k: now[k].version for k in seed}, st.marker.attempt
    if st.state is State.COMPLETE:
        if not overwrite:
            # What to pass instead: the error alone left a user re-running a pipeline
            # step guessing at the arguments (durable.xarray: mode="w" replaces it too).
            raise AlreadyCompleteError(f"{entry.url} is already COMPLETE ({st.reason}); "
                                       "overwrite=True replaces it, update=True changes it",
                                       url=entry.url)
        _clear(entry, st.marker)
    elif st.state is State.INCOMPLETE:
        if overwrite:
            _clear(entry)
        elif resume:
            return False, {}, {}, None
        elif update:
            # Taken as a resume, a rerun of a killed append (xarray's append_dim,
            # zarr's Array.append) appended after the length the killed attempt had
            # already set, and committed the rows between as fill values (incident
            # 001). Whether a rerun is a resume is the caller's to say.
            raise IncompleteExistsError(
                f"{entry.url} is INCOMPLETE ({st.reason}), and update=True changes a "
                "COMPLETE entry: an update or write that did not commit left it, or "
                "one is still at work. Finish it with resume=True only by writes that "
                "do not depend on its current shape (an append would go after what "
                "the unfinished write added, leaving fill values between); else "
                "overwrite=True, or Entry.delete() / `durable clean` once nothing "
                "writes it", url=entry.url)
        else:
            if not keep_lease:
                from durable._lease import refuse_live_lease

                # Refused beside a lease: whose it is, live (IncompleteExistsError
                # naming the holder and when it expires) or expired (said below).
                expired = refuse_live_lease(entry, "starting", remove=False)
                if expired is not None:
                    raise IncompleteExistsError(
                        f"{entry.url} is INCOMPLETE: {expired}: a killed or stopped "
                        "writer's leftover. Pass overwrite=True or resume=True to take "
                        "it over", url=entry.url)
            mine = {f"attempts/{own_attempt}.json"}
            if not st.racing and not set(entry.adapter.list(entry.layout.records)) - mine:
                # `durable clean` leaves data with no durable records alone: sent there,
                # the user found nothing removed and no way on.
                raise IncompleteExistsError(
                    f"{entry.url} is INCOMPLETE: data with no durable records and no commit "
                    "marker, written without durable (or by a tool that leaves no records). "
                    "If it is whole, adopt it with Entry.mark_complete() (`durable "
                    "mark-complete`); else start over with overwrite=True, or finish it "
                    "with resume=True", url=entry.url)
            raise (_RacedStart if st.racing else IncompleteExistsError)(
                f"{entry.url} is INCOMPLETE ({st.reason}): a killed writer's leftover or "
                "a writer still at work. Resolve it with Entry.delete() or "
                "`durable clean` once nothing writes it, or pass overwrite=True / "
                "resume=True", url=entry.url)
    return True, {}, {}, None


def _clear(entry: Entry, marker: Marker | None = None) -> None:
    """Remove the entry's data and records for a writer starting over it. ``marker``:
    the entry's, if it was read: its manifest names the documents to remove first."""
    # Marker first: from here on nobody can take this entry for COMPLETE.
    entry.adapter.delete([entry.layout.marker])
    delete_tree(entry.adapter, entry.path, None if marker is None or marker.manifest is None
                else list(marker.manifest.objects))
    clear_records(entry)


def clear_records(entry: Entry) -> None:
    # A lease stays, whoever holds it: the writer clearing holds it, or it was taken
    # since that writer found none (an expired one it removed itself,
    # `refuse_live_lease`). Removing it would let a third writer in beside its holder,
    # and its holder's writes land in this writer's entry.
    entry.adapter.delete([i.path for k, i in entry.adapter.list(entry.layout.records).items()
                          if not entry._is_lease_key(k)])
    # Directories left empty (a disk's fragments/<attempt>/): an empty records dir
    # would read as a writer started.
    entry.adapter.prune(entry.layout.records)


def commit(entry: Entry, writer: EntryWriter, unrecorded: Literal["adopt", "error"],
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
        # Not on a local disk or in memory, where the listing costs microseconds and
        # shows a lease taken since this writer started (below).
        early_only = (not writer._fragments and entry.adapter.capabilities.create_only
                      and not entry.adapter.capabilities.in_process)
        in_records = {} if early_only else entry.adapter.list(entry.layout.records)
        listed = not early_only
    else:
        listed = True
    if MARKER_NAME in in_records:
        raise AlreadyCompleteError(
            f"{entry.url}: another writer committed this entry first", url=entry.url)
    if listed:
        if lease is None:
            _refuse_taken_lease(entry, in_records)
        writer.refuse_started_over(in_records)
    fragments = {k: i for k, i in in_records.items()
                 if k.startswith(f"fragments/{writer.attempt}/")}
    recorded = writer.records()
    if writer._from_records:
        # Every object went through this writer, each write answered by the store, and
        # the records showed this attempt alone (`EntryWriter.commit_from_records`):
        # the manifest is what was recorded, with no listing of the entry.
        records, listing = recorded, {k: ObjectInfo(f"{entry.path}/{k}", r.size)
                                      for k, r in recorded.items()}
    else:
        listing = (writer._listing if writer._listing is not None
                   else entry.adapter.list(entry.path))
        try:
            records = _reconcile(entry, writer, recorded, listing, fragments, unrecorded)
        except IntegrityError:
            if not listed:
                # Objects gone at commit: why, where the records tell (a delete or clean
                # removing the entry), rather than "gone" alone. Listed on failure only.
                now = entry.adapter.list(entry.layout.records)
                if lease is None:
                    _refuse_taken_lease(entry, now)
                writer.refuse_started_over(now)
            raise
    # The records dir was made by the attempt record without fsync: its entries in
    # the parent must be durable before the marker inside it counts.
    records_dirs = [entry.layout.records.rpartition("/")[0], entry.layout.records]
    with writer._lock:
        syncing = dict(writer._syncing)
    marker = Marker.new("prefix", writer.attempt, Manifest(records))
    # The marker's bytes are made durable (a local disk's fsync) beside the data's,
    # not after them: what the marker waits for below is then only its publish.
    staged = _stage_marker(entry, marker)
    try:
        # What is left and every directory go into the pool behind the early fsyncs
        # still running, not after the last of them: the file system commits
        # concurrent fsyncs together, and the marker waits for both either way.
        entry.adapter.sync([i.path for k, i in listing.items() if k not in syncing],
                           dirs_of(entry, listing) + records_dirs)
        for started in syncing.values():
            started.result()
    except FileNotFoundError as exc:
        # Removed by another tool since it was written (a commit from the records lists
        # nothing that would have shown it): never a marker over it.
        gone = entry.adapter.url(str(exc.filename)) if exc.filename else "an object"
        staged.discard()
        raise IntegrityError(f"{entry.url}: not committing: {gone}: written by this "
                             "writer but gone at commit", url=entry.url) from None
    except BaseException:
        staged.discard()
        raise
    _publish_marker(entry, staged, lease.fenced() if lease is not None else None)
    # From here the attempt's records only say a writer was here: their removal is
    # housekeeping the caller does not wait for (a round trip on an object store). It
    # is handed over after the marker's PUT returned: a failing racer that finds no
    # attempt record finds the marker.
    # Only what is named by this attempt: a record named by key (zarr's staged metadata
    # once) would be the next writer's by the time this runs.
    spent = ([entry.layout.attempt_record(writer.attempt)]
             + [i.path for i in fragments.values()])
    pruned = fragments_dir(entry.layout.records, writer.attempt) if fragments else None

    def tidy() -> None:
        entry.adapter.discard(spent)
        if pruned is not None:
            entry.adapter.prune(pruned)

    background.later(tidy, f"{entry.url}: removing the committed attempt's records",
                     now=entry.adapter.capabilities.in_process)
    return marker


def _refuse_taken_lease(entry: Entry, records: dict[str, ObjectInfo]) -> None:
    """IncompleteExistsError, naming the holder, if the entry's lease is among ``records``
    (a listing taken after this writer, which holds no lease, started; a fresh start
    refuses a lease, and one starting over, resuming or updating a live one): taken
    since, by `Entry.delete` or `durable clean` removing the entry, or by a writer that
    now holds it. Committed, this writer's marker vouched for objects being removed (a
    commit from its own records lists none of them) or joined the holder's writes."""
    if not any(entry._is_lease_key(k) for k in records):
        return
    from durable._lease import LeaseWatch, describe  # (_lease imports _entry)

    where = entry.adapter.url(entry.layout.lease)
    holder = LeaseWatch(entry, adapter=entry.adapter, path=entry.layout.lease).peek()
    raise IncompleteExistsError(
        f"{entry.url}: not committing: while this writer (which holds no lease) wrote, the "
        f"entry's lease {where} was taken ({describe(holder)}): a delete or `durable "
        "clean` removing the entry, or another writer that holds it now; what this "
        "writer wrote may be gone. Write it again once that is done", url=entry.url)


def _reconcile(entry: Entry, writer: EntryWriter, recorded: dict[str, ObjectRecord],
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
        entry.adapter.delete(leftovers)
        for k in [k for k, i in listing.items() if i.path in leftovers]:
            del listing[k]
    # A store whose listings lag its writes (eventually consistent listings, a gateway
    # caching them) leaves out an object just written, where a HEAD already finds it:
    # refused as gone, every commit right after its writes failed on such a store.
    for key in [k for k in recorded if k not in listing]:
        info = entry.adapter.info(f"{entry.path}/{key}")
        if info is not None:
            listing[key] = info
    problems = []
    for key, rec in recorded.items():
        found = listing.get(key)
        url = entry.adapter.url(f"{entry.path}/{key}")
        if found is None:
            problems.append(f"{url}: written by this writer but gone at commit")
        elif found.size != rec.size:
            problems.append(f"{url}: written with {rec.size} bytes, {found.size} at "
                            "commit (another writer?)")
        elif (found.version is not None and writer._versions.get(key) is not None
              and found.version != writer._versions[key]):
            # Rewritten since this writer wrote it (same size): the marker must not
            # record our CRC over someone else's bytes, so read what is there now.
            now = read_object_record(entry.adapter, found.path, found)
            if not rec.matches(now):
                problems.append(f"{url}: replaced after this writer wrote it (CRC32C "
                                f"{rec.checksum_text()} written, "
                                f"{now.checksum_text()} found)")
    extra = {k: i for k, i in listing.items() if k not in recorded}
    recorded_elsewhere, disputed = _merge_fragments(
        entry, writer.attempt, extra, fragments, listing, recorded, problems)
    if problems:
        raise IntegrityError(f"{entry.url}: not committing: " + "; ".join(problems),
                             url=entry.url)
    extra = {k: i for k, i in extra.items() if k not in recorded_elsewhere}
    for k, info in list(extra.items()):
        base = writer._baseline.get(k)
        if base is not None and base[1] == info.version and base[0].size == info.size:
            recorded_elsewhere[k] = base[0]  # untouched since the update began
            del extra[k]
    if extra and unrecorded == "error":
        raise IntegrityError(f"{entry.url}: not committing: "
                             + _unrecorded_problem(extra, disputed), url=entry.url)
    for k in extra:
        written_key(k, entry.url)
    records = dict(recorded)
    records.update(recorded_elsewhere)
    records.update(checksum_all(entry.adapter, extra, WORKERS))
    return records


def _merge_fragments(entry: Entry, attempt: str, unrecorded: dict[str, ObjectInfo],
                     fragments: dict[str, ObjectInfo], listing: dict[str, ObjectInfo],
                     own: dict[str, ObjectRecord], problems: list[str],
                     ) -> tuple[dict[str, ObjectRecord], set[str]]:
    """Records other processes flushed for ``attempt``, for the objects listed now, and
    the keys whose fragments disagree.

    A key is taken from the fragments only when every fragment that recorded it agrees
    and the size matches the listing; keys they disagree on are left to be read and
    checksummed. An object they agree a worker wrote (and none deleted) that is gone now,
    or of another size, goes into ``problems``, as one the coordinator wrote (``own``)
    would: another writer cleared or rewrote it (one started over the entry while this
    one's tasks ran), and taken in as if nobody had recorded it, it made a COMPLETE entry
    of two writers' chunks and fill values that verified clean.
    """
    if not fragments:
        return {}, set()
    candidates: dict[str, set[ObjectRecord | None]] = {}
    for _, info in sorted(fragments.items()):
        where = entry.adapter.url(info.path)
        try:
            data = entry.adapter.read(info.path, limit=MAX_FRAGMENT_BYTES)
        except ValueError as exc:
            raise MarkerError(f"{where}: {exc}", url=where) from None
        if data is None:
            continue
        for key, rec in decode_fragment(data, where, attempt).items():
            candidates.setdefault(key, set()).add(rec)
    for key, recs in sorted(candidates.items()):
        if key in own or None in recs:
            continue
        found, url = listing.get(key), entry.adapter.url(f"{entry.path}/{key}")
        if found is None:
            # Left out by a listing that lags the worker's PUT (as for `own` objects).
            found = entry.adapter.info(f"{entry.path}/{key}")
            if found is not None:
                listing[key] = unrecorded[key] = found
        if found is None:
            problems.append(f"{url}: written by a worker of this write but gone at commit "
                            "(another writer?)")
        elif len(recs) == 1 and (size := next(r for r in recs if r).size) != found.size:
            problems.append(f"{url}: written by a worker of this write with {size} bytes, "
                            f"{found.size} at commit (another writer?)")
    out = {}
    for key, info in unrecorded.items():
        recs = candidates.get(key, set())
        if len(recs) == 1:
            (rec,) = recs
            if rec is not None and rec.size == info.size:
                out[key] = rec
    return out, {k for k in unrecorded if len(candidates.get(k, ())) > 1}


def write_marker(entry: Entry, marker: Marker,
                 fence: AbstractContextManager[object] | None = None) -> Marker:
    _publish_marker(entry, _stage_marker(entry, marker), fence)
    return marker


def _stage_marker(entry: Entry, marker: Marker) -> Staged:
    """The marker made ready to publish (its external manifest, if any, put now)."""
    data, external = marker.encode()
    if external is not None:
        entry.adapter.put(entry.layout.external_manifest(external[0]), external[1])
    return entry.adapter.stage(entry.layout.marker, data, create_only=True)


def _publish_marker(entry: Entry, staged: Staged,
                    fence: AbstractContextManager[object] | None = None) -> None:
    try:
        # Create-only: of two writers finishing the same entry, exactly one commits.
        # The fence (a lease) covers this one write: a writer that lost its lease
        # raises LeaseLostError here, before the marker.
        with fence or contextlib.nullcontext():
            staged.publish()
        forget_clear(entry.path)
    except FileExistsError:
        raise AlreadyCompleteError(
            f"{entry.url}: another writer committed this entry first", url=entry.url
        ) from None
    finally:
        staged.discard()  # a no-op once published; else no temp file left behind


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


def dirs_of(entry: Entry, listing: dict[str, ObjectInfo]) -> list[str]:
    """Every directory between the entry's objects and the entry's parent, once each."""
    dirs = {entry.layout.parent, entry.path}
    for key in listing:
        parts = key.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add(entry.path + "/" + "/".join(parts[:i]))
    if len(listing) == 1 and "" in listing:
        dirs.discard(entry.path)
    return sorted(dirs)
