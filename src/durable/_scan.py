"""Scan a root: every entry under it, with its state, size and object count.

Built for object stores, where a request costs more than the bytes it carries: ONE
recursive listing of the root, then one marker read per marked entry (in a thread pool).
Sizes are compared from that listing; no object is stat-ed or read on its own.

How entries are found in the listing (keys relative to the root):

- ``D/.durable/NAME/commit.json``        a commit marker: entry ``D/NAME``
- ``D/.durable/NAME/attempts/<id>.json`` a writer started on ``D/NAME``
- any other key in ``D/.durable/NAME/``  records of ``D/NAME`` (an external manifest)
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
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Literal

from durable._entry import Entry
from durable._errors import DurableError
from durable._protocol import MARKER_NAME, RECORDS_DIR, Layout, Marker
from durable.adapters import Adapter, ObjectInfo, resolve
from durable.adapters.local import TMP_MARK

__all__ = ["ScanRow", "ScanState", "scan"]

ScanState = Literal["COMPLETE", "INCOMPLETE", "ERROR"]
_WORKERS = 16
_SHOWN = 3


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Found:
    marker: bool = False
    attempts: int = 0
    objects: int = 0
    size: int = 0


def scan(root: str, storage_options: dict[str, Any] | None = None, *,
         workers: int = _WORKERS,
         progress: Callable[[int, int], None] | None = None) -> list[ScanRow]:
    """Every entry under ``root`` (a path or URL), sorted by URL.

    ``progress(done, total)`` is called after each marker read. FileNotFoundError if
    nothing exists at ``root``.
    """
    adapter, path = resolve(root, storage_options)
    path = path.rstrip("/") or path
    listing = adapter.list(path)
    found: dict[str, _Found] = {}
    root_records = _root_records(adapter, path)
    if root_records:
        found[""] = _records_of(root_records)
        if not listing:
            # The root is a single-object entry: its one object is the root itself.
            info = adapter.info(path)
            listing = {"": info} if info is not None else {}
    elif not listing and not adapter.exists(path):
        raise FileNotFoundError(f"{adapter.url(path)}: no such directory or prefix")

    for key in listing:
        parts = key.split("/")
        if RECORDS_DIR in parts[:-1]:
            i = parts.index(RECORDS_DIR)
            if len(parts) >= i + 3:
                rec = found.setdefault("/".join([*parts[:i], parts[i + 1]]), _Found())
                rest = parts[i + 2:]
                rec.marker |= rest == [MARKER_NAME]
                rec.attempts += rest[0] == "attempts"
    _count_data(listing, found)

    marked = sorted(k for k, f in found.items() if f.marker)
    markers: dict[str, Marker | str | None] = {}

    def read(key: str) -> Marker | str | None:
        try:
            return Entry(_join(path, key), adapter=adapter).read_marker()
        except (DurableError, OSError) as exc:
            # One unreadable or corrupt marker must not hide every other entry.
            return f"{type(exc).__name__}: {exc}"

    if marked:
        with ThreadPoolExecutor(max(1, min(workers, len(marked)))) as pool:
            for n, (key, result) in enumerate(zip(marked, pool.map(read, marked),
                                                  strict=True), 1):
                markers[key] = result
                if progress is not None:
                    progress(n, len(marked))
    rows = [_row(adapter, path, key, f, markers.get(key), listing)
            for key, f in found.items()]
    return sorted(rows, key=lambda r: r.url)


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if key else path


def _root_records(adapter: Adapter, path: str) -> dict[str, ObjectInfo]:
    try:
        layout = Layout(path)
    except ValueError:
        return {}  # a bucket or file-system root cannot be an entry
    return adapter.list(layout.records)


def _records_of(records: dict[str, ObjectInfo]) -> _Found:
    return _Found(marker=MARKER_NAME in records,
                  attempts=sum(k.startswith("attempts/") for k in records))


def _count_data(listing: dict[str, ObjectInfo], found: dict[str, _Found]) -> None:
    """Add unmarked children to ``found`` and count every entry's data objects."""
    entries = set(found)
    # Directories whose children are taken for entries: the root, and any directory that
    # holds records, unless it lies in an entry (an entry's subdirectories are its data).
    def in_entry(key: str) -> bool:
        return any(a in entries for a in _ancestors(key))

    parents = {""} | {k.rpartition("/")[0] for k in entries if k}
    parents = {p for p in parents if not in_entry(p)}
    holds_entry = {a for k in entries for a in _ancestors(k)[:-1]}
    for key, info in listing.items():
        chain = _ancestors(key)
        for depth, a in enumerate(chain):
            f = found.get(a)
            if f is None and depth > 0 and chain[depth - 1] in parents:
                name = a.rpartition("/")[2]
                # A temp file of a writer at work is not data; records are not entries.
                if (name != RECORDS_DIR and TMP_MARK not in name
                        and a not in holds_entry):
                    f = found[a] = _Found()
            if f is not None:
                f.objects += 1
                f.size += info.size


def _ancestors(key: str) -> list[str]:
    """``"a/b/c"`` -> ``["", "a", "a/b", "a/b/c"]``; ``""`` -> ``[""]``."""
    out = [""]
    if key:
        parts = key.split("/")
        out += ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return out


def _row(adapter: Adapter, path: str, key: str, f: _Found, marker: Marker | str | None,
         listing: dict[str, ObjectInfo]) -> ScanRow:
    url = adapter.url(_join(path, key))
    incomplete: ScanState = "INCOMPLETE"
    if isinstance(marker, str):
        return ScanRow(url, "ERROR", marker, f.objects, f.size)
    if marker is None:
        reasons = []
        if f.objects:
            reasons.append("data present but no commit marker")
        if f.attempts:
            reasons.append(f"a writer started but has not committed (attempt records: "
                           f"{f.attempts})")
        if not reasons:
            reasons.append("records but no commit marker and no data")
        return ScanRow(url, incomplete, "; ".join(reasons), f.objects, f.size)

    assert marker.manifest is not None
    prefix = f"{key}/" if key else ""
    bad: list[str] = []
    for k, rec in sorted(marker.manifest.objects.items()):
        lk = key if marker.kind == "object" else prefix + k
        info = listing.get(lk)
        if info is None:
            bad.append(f"{adapter.url(_join(path, lk))} is missing (the marker recorded "
                       f"{rec.size} bytes)")
        elif info.size != rec.size:
            bad.append(f"{adapter.url(info.path)} is {info.size} bytes, the marker "
                       f"recorded {rec.size}")
    total = len(marker.manifest)
    if bad:
        more = f"; and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        reason = (f"marker present but data gone or changed: {len(bad)} of {total} objects: "
                  + "; ".join(bad[:_SHOWN]) + more)
        return ScanRow(url, incomplete, reason, f.objects, f.size, marker.attempt,
                       marker.committed_at)
    reason = f"committed at {marker.committed_at} by attempt {marker.attempt}"
    extra = f.objects - total
    if extra > 0:
        reason += f"; {extra} objects not in the manifest"
    return ScanRow(url, "COMPLETE", reason, f.objects, f.size, marker.attempt,
                   marker.committed_at)
