"""The records ``durable::`` reads objects against, with each entry's marker read once.

Under zarr (``zarr.open_group("durable::s3://b/x.zarr")``) every object opened looked for
its record from scratch: a marker read at each folder from the object up to its entry (a
chunk four folders down: five reads, four of them for markers that are not there), and
the entry's marker, manifest and all, read and parsed again for every chunk.

Here the markers of the entries found are kept, each with the version the store gave it
(its ETag or generation, a file's inode, size and mtime), and revalidated by one stat
before each use: a marker rewritten since (an overwrite or update committed again) has
another version and is read again, so a read is never checked against an older commit's
record. The stat is taken before the read it is kept with, so a rewrite between the two
leaves a version older than the bytes kept, which the next stat finds changed.

An object inside a cached entry needs no look at the folders between it and the entry:
a marker there would lie inside the entry's data, and is in its manifest if it was there
at the commit (then the walk is taken, nearest marker first, as `find_record` does).
One written there since the commit changed a committed entry: the object is then checked
against the entry's manifest, and fails loudly if its bytes are not what that recorded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from durable._entry import Entry
from durable._errors import IntegrityError
from durable._nesting import levels
from durable._protocol import MARKER_NAME, RECORDS_DIR, Marker
from durable._verified import Recorded, own_record
from durable.adapters import Adapter, ObjectInfo

__all__ = ["RecordCache"]

#: Entries whose markers are kept (a manifest of 10,000 objects is about 1 MiB).
_KEPT = 64


class RecordCache:
    """The records of objects on one adapter; thread-safe (zarr reads from threads)."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self._kept: OrderedDict[str, tuple[str, Marker]] = OrderedDict()
        self._lock = threading.Lock()

    def find(self, path: str, info: ObjectInfo | None) -> Recorded | None:
        """The record of ``path`` (``info``: its stat, just taken; None: absent), as
        `find_record` gives it; None for an object no record covers, and for an absent
        one no manifest lists. IntegrityError for an object inside a committed entry
        that its manifest does not list; MarkerError for a marker that cannot be trusted.
        """
        path = path.rstrip("/")
        own = own_record(self.adapter, path, info)
        if own is not None:
            return own  # in the object's own metadata: it supersedes any marker
        for root, key in levels(path):
            kept = self._current(root)
            if kept is None:
                continue
            if key == "" or (kept.kind == "prefix" and not _nested_marker(kept, key)):
                return self._recorded(root, kept, key, path, info)
            break  # a marker nearer the object may count: the walk reads them all
        # The walk, nearest first, each found marker kept with its version.
        for root, key in levels(path):
            marker = self._read(root)
            if marker is not None:
                return self._recorded(root, marker, key, path, info)
        return None

    def _current(self, root: str) -> Marker | None:
        """The kept marker of the entry at ``root`` if it is still the one there."""
        with self._lock:
            kept = self._kept.get(root)
        if kept is None:
            return None
        now = self.adapter.info(Entry(root, adapter=self.adapter).layout.marker)
        if now is None or now.version != kept[0]:
            with self._lock:
                self._kept.pop(root, None)
            return None
        with self._lock:
            if root in self._kept:
                self._kept.move_to_end(root)
        return kept[1]

    def _read(self, root: str) -> Marker | None:
        entry = Entry(root, adapter=self.adapter)
        # The version first: the bytes read after it are at least that new (module doc).
        stat = self.adapter.info(entry.layout.marker)
        marker = entry._read_sidecar()
        if marker is not None and stat is not None and stat.version is not None:
            with self._lock:
                self._kept[root] = (stat.version, marker)
                self._kept.move_to_end(root)
                while len(self._kept) > _KEPT:
                    self._kept.popitem(last=False)
        return marker

    def _recorded(self, root: str, marker: Marker, key: str, path: str,
                  info: ObjectInfo | None) -> Recorded | None:
        assert marker.manifest is not None
        url = self.adapter.url(root)
        if marker.kind == "object":
            return Recorded(marker.manifest.objects[""], url) if not key else None
        rec = marker.manifest.objects.get(key)
        if rec is not None:
            return Recorded(rec, url)
        if key == "" or info is None:
            # The entry itself (a folder), or an object that is not there and that the
            # manifest does not list: not found, as on any filesystem (zarr reads a
            # chunk never written, one of fill values, from FileNotFoundError).
            return None
        where = self.adapter.url(path)
        raise IntegrityError(
            f"{where} is not in the manifest of the committed entry {url}: not part of "
            "what was committed", url=where, expected="an object listed in the manifest",
            found="an unlisted object")


def _nested_marker(marker: Marker, key: str) -> bool:
    """Whether the manifest lists a marker between the entry and its object ``key``: an
    entry nested in this one, committed before it, which then records the object."""
    assert marker.manifest is not None
    objects = marker.manifest.objects
    parts = key.split("/")
    for i in range(len(parts)):
        folder = "/".join([*parts[:i], RECORDS_DIR, parts[i], MARKER_NAME])
        if folder in objects:
            return True
    return False
