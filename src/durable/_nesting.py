"""Entries inside and above entries, and removing a tree of them.

Where a path lies in the tree of folders: the entry committed above it (`committed_above`,
`refuse_inside_committed`: writing there would change data that entry's marker vouches
for), the nearest marked entry at or above it (`nearest_marked`, over `levels`). Removing:
the documents readers open first before the rest (`delete_tree`), an entry's records under
its lease's lock (`remove_records`), never under a live lease (`refuse_leased`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from durable._checks import WORKERS
from durable._errors import (
    AlreadyCompleteError,
    EntryExistsError,
    IncompleteExistsError,
    IntegrityError,
    MarkerError,
    UnsupportedError,
)
from durable._protocol import MARKER_NAME, RECORDS_DIR, Layout, Marker
from durable.adapters import Adapter, ObjectInfo
from durable.adapters.base import VersionMismatchError

if TYPE_CHECKING:
    from durable._entry import Entry
    from durable._lease import Lease

__all__ = ["CLEANING", "DELETING", "OPENED_FIRST", "being_removed", "committed_above",
           "committed_meanwhile", "delete_entry", "delete_tree", "forget_clear", "levels",
           "nearest_marked", "refuse_inside_committed", "refuse_leased", "remove_records"]


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
    from durable._entry import Entry  # (_entry imports this module)

    above = [Entry(root, adapter=adapter) for root, _ in levels(path)][1:]

    def read(entry: Entry) -> Marker | MarkerError | None:
        try:
            return entry._read_sidecar()
        except MarkerError as exc:
            return exc

    found: Iterable[Marker | MarkerError | None] = map(read, above)  # lazy: nearest first
    if len(above) > 1 and not adapter.capabilities.in_process:
        with ThreadPoolExecutor(min(len(above), WORKERS)) as pool:
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
#: by this process forgets the folders it makes part of an entry (`forget_clear`), so
#: writing into one is refused at once; an entry committed by another process within
#: those seconds is seen after them (as one committed between any look and the write it
#: guards always was).
_SEEN_CLEAR: dict[tuple[int, str], tuple[object, float]] = {}
_CLEAR_FOR = 2.0
_SEEN_CLEAR_MAX = 4096


def forget_clear(entry_path: str) -> None:
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
    from durable._lease import refuse_live_lease  # (_lease imports _entry, which imports this)

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


#: The purpose the lease an `Entry.delete` holds states, to the writers it keeps out.
DELETING = "Entry.delete() removing the entry"
#: The purpose a clean's lease states, to writers it keeps out and to other cleans.
CLEANING = "durable clean removing the entry"


def being_removed(entry: Entry) -> bool:
    """Whether the entry's lease is held by a delete or a clean removing the entry (one
    read of it): a writer refused by it removes its own objects, which would outlive
    the removal (INCOMPLETE), where those of an entry another writer took the lease of
    are that writer's to resume."""
    from durable._lease import LeaseWatch  # (_lease imports _entry, which imports this)

    holder = LeaseWatch(entry, adapter=entry.adapter, path=entry.layout.lease).peek()
    return holder is not None and holder.get("purpose") in (DELETING, CLEANING)


def delete_entry(entry: Entry, force: bool) -> None:
    """`Entry.delete`: marker, data, records, under the entry's lease.

    Held for the whole removal (as `durable clean` holds it), the lease refuses every
    writer that starts meanwhile: a fresh one finds it among the records, one starting
    over, resuming or updating finds it live, and a writer without a lease that started
    before finds it at its commit and refuses (`durable._commit.commit`). With only a look
    for a live lease first, a rerun starting over the entry between the look and the
    removal had its objects removed under it, and its commit (made meanwhile) removed with
    the records: a success reported for data that was gone. What still falls between a
    writer's last look and its marker is caught after the removal
    (`committed_meanwhile`). Where the store cannot hold a lease (no conditional
    writes), one look, as before.
    """
    lease = _deleting_lease(entry, force)
    try:
        _remove_under(entry, lease)
    finally:
        if lease is not None:
            lease.release()  # and the records dir, left empty


def _deleting_lease(entry: Entry, force: bool) -> Lease | None:
    """The entry's lease for its removal (renewed every 2 s, stale after 10, as a
    clean's: a delete killed while holding it keeps writers out that long), or None where
    the store cannot hold one. Another holder's live lease: IncompleteExistsError, or with
    ``force`` it is removed (its holder never commits); an expired one is removed."""
    from durable._lease import Lease  # (_lease imports _entry, which imports this)

    lease = Lease(entry, heartbeat=2.0, stale_after=10.0)
    lease._purpose = DELETING
    for _ in range(2):
        try:
            if lease.try_acquire():
                return lease
        except UnsupportedError:
            if not force:
                refuse_leased(entry, "deleting", "pass force=True")
            return None
        if force:
            # Under the lock every renewal takes (`remove_records`'s reason): removed
            # between a renewal's check and its rename, the lease was put back.
            with entry.adapter.exclusive(entry.layout.lease):
                entry.adapter.delete([entry.layout.lease])
        else:
            refuse_leased(entry, "deleting", "pass force=True")  # expired: removed
    raise IncompleteExistsError(
        f"{entry.url}: not deleting: its lease {entry.adapter.url(entry.layout.lease)} was "
        "taken again by another writer as soon as it was freed; nothing was removed",
        url=entry.url)


def _remove_under(entry: Entry, lease: Lease | None) -> None:
    a, layout = entry.adapter, entry.layout
    # Marker first, so a half-deleted entry is never COMPLETE; then what readers open
    # first (`OPENED_FIRST`), so a plain reader never opens a half-deleted tree.
    a.delete([layout.marker])
    if a.info(entry.path) is not None:
        a.delete([entry.path])
    else:
        delete_tree(a, entry.path)
    if lease is not None:
        # Lost (this process paused past its stale_after, and a waiter took it over): a
        # writer may be at work now, and its records are not this delete's to remove.
        lease.check()
    # Under the lease's lock (`remove_records`'s reason). Every record but this delete's
    # own lease and a marker: one written meanwhile is judged below, never removed
    # unseen (its writer was told it committed).
    with a.exclusive(layout.lease):
        a.delete([i.path for k, i in a.list(layout.records).items() if k != MARKER_NAME
                  and not (lease is not None and entry._is_lease_key(k))])
    found = a.info(layout.marker)
    if found is not None:
        committed_meanwhile(entry, found, "this delete")
    if lease is None:
        remove_records(a, layout)


def committed_meanwhile(entry: Entry, found: ObjectInfo, by: str) -> None:
    """A marker (``found``) written while the entry was being removed (``by``: this
    delete, this clean): a writer without a lease that started before the removal took
    the lease and committed from a look taken before the removal. Over
    objects the removal took, it vouched for data that is gone (and, with the records
    removed after it, a success its writer reported was gone with no error to anyone):
    removed with what is left of that writer's data, and IntegrityError. Over data all
    there (written after the removal) it is that writer's clean win: kept, and
    AlreadyCompleteError."""
    a, url = entry.adapter, entry.url
    try:
        marker = entry._read_sidecar()
        gone = [] if marker is None else _missing_from(entry, marker)
        what = f"objects it lists are gone ({', '.join(gone[:3])})"
    except MarkerError as exc:
        marker, gone, what = None, ["?"], f"it cannot be read ({exc})"
    if marker is not None and not gone:
        raise AlreadyCompleteError(
            f"{url}: another writer committed it while it was being removed by {by}, with "
            "all of its data written after the removal: its commit is kept (the entry is "
            "COMPLETE); remove it again if it must go", url=url)
    try:
        if found.version is not None and a.supports_conditional(entry.layout.marker):
            a.delete_if(entry.layout.marker, found.version)  # never a later writer's
        else:
            a.delete([entry.layout.marker])
    except VersionMismatchError:
        pass  # its writer removed it itself
    delete_tree(a, entry.path)
    raise IntegrityError(
        f"{url}: a writer without a lease committed it while it was being removed by {by}, "
        f"and its marker {a.url(entry.layout.marker)} vouched for data {by} removed: "
        f"{what}. The marker and that writer's data were removed (the entry is ABSENT): "
        "that writer's commit is undone; write it again if it was wanted", url=url)


def _missing_from(entry: Entry, marker: Marker) -> list[str]:
    """The URLs of the objects ``marker`` lists that are gone or of another size."""
    assert marker.manifest is not None
    listing = entry._listing(marker)
    return [entry.adapter.url(entry.layout.object_path(k, marker.kind))
            for k, rec in sorted(marker.manifest.objects.items())
            if k not in listing or listing[k].size != rec.size]


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
    from durable._entry import Entry  # (_entry imports this module)

    for root, key in levels(path):
        entry = Entry(root, adapter=adapter)
        marker = entry._read_sidecar()
        if marker is not None:
            return entry, marker, key
    return None
