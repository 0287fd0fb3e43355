"""Reading committed zarr3 arrays through tensorstore: `open` (a handle) and `read`
(values all of one commit), published by `durable.tensorstore` (whose docstring gives the
design: the listing's check, revalidation tied to the commit, unusable ETags)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import tensorstore as ts

from durable._checks import Problem
from durable._checksum import crc32c
from durable._entry import Entry
from durable._errors import IncompleteError, IntegrityError, MarkerError
from durable._protocol import MAX_MARKER_BYTES, Marker, State
from durable._tensorstore_codecs import (
    full_shard_size,
    grid_counts,
    grid_keys,
    is_codeword,
    is_sharded,
    shard_layout,
)
from durable._tensorstore_kv import (
    MALFORMED,
    MAX_METADATA,
    Place,
    etag_error,
    forget_endpoint,
    probe,
)
from durable.adapters.base import ObjectInfo

# The metadata document of an array, by driver: the one `open` reads and checks itself.
_METADATA = {"zarr3": "zarr.json", "zarr": ".zarray"}


_SEEN: dict[str, tuple[str, float]] = {}
_SEEN_LOCK = threading.Lock()


def _first_seen(url: str, attempt: str) -> float:
    """When this process first saw commit ``attempt`` of ``url`` (its own clock).

    Every object tensorstore cached before then may predate the commit (the old data, or a
    rewrite in progress); nothing fetched after it can, since the marker is written after
    the data and removed before any rewrite. Taken on this process's clock, the clock
    tensorstore stamps its cache with: the writer's clock (the marker's committed_at) may
    run behind it, and a bound too early skips the revalidation it exists for.
    """
    now = time.time()
    with _SEEN_LOCK:
        seen = _SEEN.get(url)
        if seen is not None and seen[0] == attempt:
            return seen[1]
        _SEEN[url] = (attempt, now)
    return now


def _at_least(given: Any, bound: float) -> Any:
    """The stricter of a caller's recheck option and the commit bound."""
    if given is True or given == "open":
        return given
    if isinstance(given, int | float) and not isinstance(given, bool):
        return max(float(given), bound)
    return bound


def _check_listing(entry: Entry, marker: Marker, listing: dict[str, ObjectInfo]) -> None:
    assert marker.manifest is not None
    objects = marker.manifest.objects
    # Sizes first, names (URLs) only for what differs: this runs at every open.
    wrong = [k for k, rec in objects.items()
             if k not in listing or listing[k].size != rec.size]
    extra = sorted(set(listing) - set(objects)) if len(listing) != len(objects) or wrong \
        else []
    if not wrong and not extra:
        return
    problems = []
    for key in sorted(wrong):
        url, rec, found = entry.adapter.url(f"{entry.path}/{key}"), objects[key], listing.get(key)
        problems.append(Problem(key, url, "missing", expected=rec.size) if found is None
                        else Problem(key, url, "size", rec.size, found.size))
    problems += [Problem(k, entry.adapter.url(listing[k].path), "unexpected",
                         found=listing[k].size) for k in extra]
    first = problems[0]
    raise IntegrityError(
        f"{entry.url}: {len(problems)} of {len(objects)} objects do not match the manifest "
        f"of commit {marker.attempt}: " + "; ".join(str(p) for p in problems[:20]),
        url=first.url, expected=first.expected, found=first.found)


class _Seen:
    """A marker as this process last read it at one URL: its bytes, their decoding, and
    whether a listing of the entry has been checked against that manifest here."""

    __slots__ = ("data", "listed", "marker", "whole")

    def __init__(self, data: bytes, marker: Marker) -> None:
        self.data = data
        self.marker = marker
        self.listed = False
        # metadata document key -> whether the commit holds every chunk of that array
        # (`_every_chunk_committed`: a pass over the manifest, 1 ms per 100 chunks)
        self.whole: dict[str, bool] = {}


# Marker URL -> what was last read there, least recently used first.
_DECODED: OrderedDict[str, _Seen] = OrderedDict()
_DECODED_LOCK = threading.Lock()
_DECODED_MAX_BYTES = 16 * 1024 * 1024  # markers kept decoded, in marker bytes


def _last_seen(where: str) -> _Seen | None:
    with _DECODED_LOCK:
        return _DECODED.get(where)


def _read_marker(place: Place) -> tuple[Marker | None, _Seen | None]:
    """The entry's marker (read bounded, `Place.read`), and what this process knows of
    those very bytes (None for an external manifest, which is not kept).

    Read at every open; decoded again only when its bytes differ from the last ones read
    there: decoding and checking the manifest costs more than reading it (2 ms for 1,024
    chunks, 0.1 ms for W1's 64). The same bytes are the same commit and manifest, so the
    cache cannot serve another commit's manifest, whatever happened in between.
    """
    where = place.marker_url
    try:
        data = place.read(place.entry.layout.marker, MAX_MARKER_BYTES)
    except ValueError as exc:
        # The adapter's message names the marker already ("... is a symlink"): once.
        raise MarkerError(str(exc) if where in str(exc) else f"{where}: {exc}",
                          url=where) from None
    if data is None:
        return None, None
    with _DECODED_LOCK:
        known = _DECODED.get(where)
        if known is not None and known.data == data:
            _DECODED.move_to_end(where)
            return known.marker, known
    marker = Marker.decode(data, where)
    if marker.manifest_ref is not None:
        # An external manifest (over 10,000 objects): the adapter fetches and checks it.
        return place.entry.read_marker(), None
    seen = _Seen(data, marker)
    with _DECODED_LOCK:
        _DECODED[where] = seen
        _DECODED.move_to_end(where)
        kept = sum(len(d.data) for d in _DECODED.values())
        while kept > _DECODED_MAX_BYTES and len(_DECODED) > 1:
            kept -= len(_DECODED.popitem(last=False)[1].data)
    return marker, seen


def _attempt_now(place: Place) -> str | None:
    """The attempt of the marker there now (None: none), without decoding its manifest."""
    try:
        data = place.read(place.entry.layout.marker, MAX_MARKER_BYTES)
        attempt = None if data is None else json.loads(data)["attempt"]
    except (ValueError, KeyError, TypeError, RecursionError):  # (nested too deeply)
        return "(an unreadable marker)"
    return attempt if attempt is None or isinstance(attempt, str) else "(a bad marker)"


def _metadata(place: Place, marker: Marker, key: str,
              wanted: Any, fetched: Future[bytes | None] | None = None) -> dict[str, Any]:
    """The array's metadata document ``key`` as commit ``marker`` recorded it.

    Read once here and checked against the manifest (size and CRC32C): a document
    rewritten after the commit with the same size (a fill_value changed by another tool)
    passes the listing's size check, and tensorstore would read the array through it.
    ``wanted``: the caller's spec "metadata", each member of which must be the document's.
    ``fetched``: the document, read meanwhile (before or after the marker: either way it
    must be what the marker recorded).
    """
    entry = place.entry
    assert marker.manifest is not None
    where = f"{entry.path.rstrip('/')}/{key}"
    url = entry.adapter.url(where)
    rec = marker.manifest.objects.get(key)
    if rec is None:
        # The array of the other zarr version, there: a zarr v2 array (durable's write
        # with spec={"driver": "zarr"}, zarr-python's default before 3) opened as zarr3.
        prefix = key[:-len(key.rpartition("/")[2])]
        other = next(((doc, driver) for driver, doc in _METADATA.items()
                      if prefix + doc in marker.manifest.objects), None)
        hint = "" if other is None else (
            f"; a zarr v{2 if other[1] == 'zarr' else 3} array is there ({other[0]}); pass "
            f"spec={{'driver': {other[1]!r}}}")
        if other is None:
            # A mistyped path= (or none given for a checkpoint of many arrays): the arrays
            # the commit holds, named as path= takes them.
            arrays = sorted(k.rpartition("/")[0] or "''" for k in marker.manifest.objects
                            if k.rpartition("/")[2] in _METADATA.values())
            hint = "; its arrays (path=): " + (", ".join(arrays[:20]) or "none") + (
                f" and {len(arrays) - 20} more" if len(arrays) > 20 else "")
        raise ValueError(f"NOT_FOUND: {url}: commit {marker.attempt} of {entry.url} has no "
                         f"array there{hint}")
    data = fetched.result() if fetched is not None else place.read(where, MAX_METADATA)
    found = None if data is None else (len(data), crc32c(data))
    if found != (rec.size, rec.crc32c) and fetched is not None:
        # Fetched beside the marker, so perhaps before it: a commit landing in between
        # makes it the previous commit's document, not a damaged one. Read it again.
        data = place.read(where, MAX_METADATA)
        found = None if data is None else (len(data), crc32c(data))
    if found != (rec.size, rec.crc32c):
        after = _attempt_now(place)
        if after != marker.attempt:  # a rewrite began after the marker was read
            raise _rewritten(entry, marker, after)
        raise IntegrityError(
            f"{url}: expected {rec.size} bytes with crc32c {rec.crc32c:08x} (commit "
            f"{marker.attempt}), found " + ("nothing" if found is None else
                                           f"{found[0]} bytes with crc32c {found[1]:08x}"),
            url=url, expected=(rec.size, rec.crc32c), found=found)
    assert data is not None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ValueError(f"{url}: not a JSON metadata document: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{url}: not a JSON metadata document: {type(doc).__name__}")
    if doc.get("node_type") == "group":
        # tensorstore's own error named no object ('Expected "array", but received:
        # "group"'): a group entry (durable.zarr, xarray) opened without path= is common.
        arrays = sorted(k[:-len("/zarr.json")] for k in marker.manifest.objects
                        if k.endswith("/zarr.json") and k != key
                        and k.startswith(key[:-len("zarr.json")]))
        raise ValueError(f"{url}: a zarr group, not an array; pass path= (from the entry's "
                         f"root) naming an array inside it: {', '.join(arrays[:20]) or 'none'}")
    for name, value in (wanted or {}).items():
        if doc.get(name) != value:
            raise ValueError(f"{url}: metadata {name!r} is {doc.get(name)!r}, the spec asks "
                             f"for {value!r}")
    return doc


def _whole(seen: _Seen | None, marker: Marker, key: str, meta: dict[str, Any]) -> bool:
    """`_every_chunk_committed`, once per commit (the same marker bytes) and array in this
    process: ``meta`` is the document the manifest's CRC32C pinned, the same every time."""
    if seen is None:
        return _every_chunk_committed(marker, key, meta)
    known = seen.whole.get(key)
    if known is None:
        known = seen.whole[key] = _every_chunk_committed(marker, key, meta)
    return known


def _every_chunk_committed(marker: Marker, key: str, meta: dict[str, Any]) -> bool:
    """Whether the commit holds every chunk of the zarr3 array whose document is ``key``
    (none was left out as all fill value, none outside what was written): for a sharded
    array, every shard, each of the size of one that holds all its inner chunks."""
    assert marker.manifest is not None
    objects = marker.manifest.objects
    codecs = meta.get("codecs")
    if meta.get("node_type") != "array" or not isinstance(codecs, list):
        return False
    sharded = is_sharded(meta)
    found = grid_counts(meta)
    if found is None or math.prod(found[1]) > len(objects):
        return False  # more grid positions than objects in the manifest: one is missing
    # Grid positions inside the bounds, not keys: a chunk left beyond the bounds by a
    # metadata-only shrink must not stand in for one inside them left out as fill value
    # (its read would then be NOT_FOUND instead of fill values).
    keys = grid_keys(key[:-len("zarr.json")], meta)
    if keys is None or not all(k in objects for k, _ in keys):
        return False
    # In a shard, an inner chunk left out (all fill value) is so by its index, which the
    # manifest does not hold: only a shard of the size of a full one is known to hold every
    # inner chunk (a fixed size per inner chunk, a crc32c index).
    return not sharded or all(objects[k].size == full_shard_size(meta, at) for k, at in keys)


def _sharded_reads_work(place: Place, found: Any, store: ts.TensorStore, marker: Marker,
                        key: str | None, meta: Any) -> None:
    """On a store whose versions tensorstore cannot use: UnusableETagError now, naming the
    store, if the array is sharded and its reads fail there. tensorstore reads a shard's
    chunk on the condition that the shard is still the version its index was read at (a
    GCS-like store without generations fails that with 'Malformed StorageGeneration' at
    the first read of a shard): one element of the first stored shard is read here, so
    the handle is never handed over to fail with tensorstore's opaque error later."""
    if key is None or not isinstance(meta, dict) or not is_sharded(meta):
        return  # any sharded array, not only crc32c-checked ones: tensorstore's
        # 'Malformed StorageGeneration' reached the caller for one without the codec
    assert marker.manifest is not None
    keys = grid_keys(key[:-len(_METADATA["zarr3"])], meta)
    found_at = next((at for k, at in keys or [] if k in marker.manifest.objects), None)
    if found_at is None:
        return  # no shard stored: every read is fill values, and none is conditional
    outer = meta["chunk_grid"]["configuration"]["chunk_shape"]
    try:
        store[tuple(i * n for i, n in zip(found_at, outer, strict=True))].read().result()
    except ValueError as exc:
        if MALFORMED not in str(exc):
            return  # another failure of this read (a store ignoring suffix ranges, say) is
            # the caller's to meet on a read of their own: a read of whole shards may work
        raise etag_error(
            place, found, "a sharded array cannot be read there: tensorstore reads each "
            "chunk of a shard on the condition that the shard is still the version its "
            "index was read at",
            "Unsharded arrays read there, with a cache private to each handle") from None


def _rewritten(entry: Entry, marker: Marker, after: str | None,
               doing: str = "opened") -> IncompleteError:
    again = "open" if doing == "opened" else doing
    return IncompleteError(
        f"{entry.url} was rewritten while it was being {doing} (commit {marker.attempt} "
        f"verified, {'no commit' if after is None else 'commit ' + after} after the "
        f"{again}); {again} it again", url=entry.url, state=State.INCOMPLETE)


def _unchanged(place: Place, marker: Marker, seen: _Seen | None, doing: str) -> None:
    """IncompleteError unless the entry's marker is still commit ``marker`` (the very
    bytes ``seen`` holds, where known: compared, not decoded)."""
    if seen is not None:
        with contextlib.suppress(ValueError):  # unreadable now: told by the attempt below
            if place.read(place.entry.layout.marker, MAX_MARKER_BYTES) == seen.data:
                return
    after = _attempt_now(place)
    if after != marker.attempt:
        raise _rewritten(place.entry, marker, after, doing)


def _private(context: ts.Context) -> ts.Context:
    """A child of ``context`` with a cache pool of its own (same size as the shared one)."""
    pool: Any = {}
    ctx: ts.Context | None = context
    while ctx is not None and not pool:
        spec = ctx.spec.to_json() if ctx.spec is not None else {}
        pool = spec.get("cache_pool") if isinstance(spec.get("cache_pool"), dict) else {}
        ctx = ctx.parent
    return ts.Context(ts.Context.Spec({"cache_pool": pool}), parent=context)


def open(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
         context: ts.Context | None = None, path: str = "", deep: bool = False,
         read: bool = True, write: bool = False, spec: dict[str, Any] | None = None,
         on_unusable_etags: Literal["private_cache", "error"] = "private_cache",
         **kwargs: Any) -> ts.TensorStore:
    """Open the zarr3 array at ``path`` in the COMPLETE entry ``url``, read-only.

    IncompleteError unless the entry is COMPLETE; IntegrityError if its listing does not
    match the manifest (``deep=True``: also if any object's CRC32C differs). An array
    whose commit holds every one of its chunks, each ending in the crc32c codec (what
    `write` makes of data with no all-fill-value chunk), is opened with
    ``fill_missing_data_reads`` off, so every read of it is checked on its own: a chunk
    deleted later is an error naming it, never fill values, and a changed one fails its
    codec; for such an array the listing is checked at the first open of each commit in
    this process, not at every open (on a large array a listing is many round trips).
    Pass a shared
    ``context`` with a ``cache_pool`` for speed: the handle revalidates everything that
    context cached before this process first saw the entry's current commit, once, and
    serves the rest from the cache. A handle reads the entry as committed when it was
    opened: open again after the next commit. ``kwargs`` go to `tensorstore.open`; a
    ``recheck_cached_*`` given there is used where it is stricter.

    The array's metadata document (zarr.json, or .zarray for ``spec={"driver": "zarr"}``)
    is read here and checked against the manifest's size and CRC32C (IntegrityError naming
    it otherwise), then handed to tensorstore, which reads no metadata itself; a
    ``metadata`` in ``spec`` must agree with it member by member.

    On a store whose versions tensorstore cannot revalidate with (see
    `UnusableETagError`), the handle gets a cache of its own and no revalidation, or
    with ``on_unusable_etags="error"`` the error.
    """
    if write or not read:
        raise ValueError(f"{url}: durable.tensorstore.open reads only; change an entry "
                         "with durable.tensorstore.writing(url, update=True)")
    store: ts.TensorStore = _open(url, storage_options, context, path, deep, spec,
                                  on_unusable_etags, kwargs, _HANDLE)
    return store


def read(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
         context: ts.Context | None = None, path: str = "", index: Any = None,
         deep: bool = False, spec: dict[str, Any] | None = None,
         on_unusable_etags: Literal["private_cache", "error"] = "private_cache",
         **kwargs: Any) -> Any:
    """The values of the zarr3 array at ``path`` in the COMPLETE entry ``url`` (``index``:
    of ``array[index]``, any tensorstore index expression) as a NumPy array, all of one
    commit.

    What `open` then ``.read().result()`` returns, with the same checks, and two more
    things a handle cannot give: the values are returned only if the entry's commit is
    still the one opened once they are all read (IncompleteError otherwise: a rewrite
    began meanwhile and the values could mix two commits), and the listing `open` checks
    before handing over a handle (at the first open of a commit in this process) is
    checked here while tensorstore reads the chunks, not before. Nothing is returned
    unless every check passed. Arguments as for `open`.
    """
    args = (url, storage_options, context, path, deep, spec, on_unusable_etags)
    try:
        return _open(*args, dict(kwargs), index)
    except ValueError as exc:
        if MALFORMED not in str(exc):
            raise
        place = Place.of(url, storage_options)
        found = _probe_failed(place, context, str(exc))
        if found is None or found.usable:
            raise
        if on_unusable_etags == "error" or not found.readable:
            raise etag_error(place, found, "its cache cannot be revalidated") from exc
    # The endpoint is now known for what it is: read again, with a cache of its own.
    return _open(*args, kwargs, index)


def _probe_failed(place: Place, context: ts.Context | None, message: str) -> Any:
    """The probe's verdict on the object a read failed on with 'Malformed
    StorageGeneration' (tensorstore's 'Error reading "KEY"'), replacing the endpoint's:
    the probe judged it by the marker, whose ETag a gateway may leave alone while it
    mangles the chunks'. None if the message names no object."""
    named = re.search(r'Error reading "([^"]+)"', message)
    if named is None or place.endpoint is None:
        return None
    forget_endpoint(place.endpoint)
    where = f"{place.spec['bucket']}/{named.group(1)}"
    return probe(place, context if context is not None else ts.Context(), where)


#: `_open`'s ``index`` for a handle (`open`), not values (`read`).
_HANDLE: Any = object()


def _open(url: str | os.PathLike[str], storage_options: dict[str, Any] | None,
          context: ts.Context | None, path: str, deep: bool, spec: dict[str, Any] | None,
          on_unusable_etags: str, kwargs: dict[str, Any], index: Any) -> Any:
    """`open` (``index`` `_HANDLE`: the handle) or `read` (the values of ``array[index]``,
    read beside the listing's check and returned once the commit is seen unchanged)."""
    place = Place.of(url, storage_options)
    entry = place.entry
    ctx = context if context is not None else ts.Context()
    # Before durable reads anything: a store whose ETags nothing can use fails here, with
    # the endpoint and the ETag named, not in the adapter or in tensorstore.
    found = probe(place, ctx, entry.layout.marker)
    if not found.usable and (on_unusable_etags == "error" or not found.readable):
        raise etag_error(place, found, "its cache cannot be revalidated")
    full: dict[str, Any] = {"driver": "zarr3", **(spec or {})}
    doc = _METADATA.get(full["driver"])
    key = f"{path.strip('/')}/{doc}".lstrip("/") if doc is not None else None
    remote = place.endpoint is not None
    with ThreadPoolExecutor(2) as pool:
        # On a remote store each read is a round trip: the metadata document is fetched
        # while the marker is, and the listing (an open's slowest request: it names every
        # object) too, unless the marker last seen here was checked against one already
        # (see below). A local one is CPU, not waiting: a thread would only add a hand-off.
        seen_before = _last_seen(place.marker_url)
        listing = (pool.submit(entry.adapter.list, entry.path)
                   if remote and not deep and not (seen_before and seen_before.listed)
                   else None)
        fetched = (pool.submit(place.read, f"{entry.path.rstrip('/')}/{key}",
                               MAX_METADATA) if remote and key is not None else None)
        marker, seen = _read_marker(place)
        if marker is None:
            st = entry.status()
            if st.state is State.COMPLETE:
                # Committed between the marker read and this status (a rewrite landing).
                raise IncompleteError(f"{entry.url} was rewritten while it was being "
                                      "opened (no commit at the open, one now); open it "
                                      "again", url=entry.url, state=State.INCOMPLETE)
            raise IncompleteError(f"{entry.url} is {st.state}: {st.reason}; only a "
                                  f"COMPLETE entry opens{entry._inside_hint(st)}",
                                  url=entry.url, state=st.state)
        if marker.kind != "prefix":
            raise ValueError(f"{entry.url} is a single-object entry, not an array")
        bound = _first_seen(entry.url, marker.attempt)
        both = kwargs.pop("recheck_cached", None)
        recheck = {name: _at_least(kwargs.pop(name, both), bound)
                   for name in ("recheck_cached_data", "recheck_cached_metadata")}
        if not found.usable:
            # No conditional request is ever sent: nothing is revalidated, and a cache
            # that starts empty with this handle holds nothing from before the commit.
            ctx = _private(ctx)
            recheck = dict.fromkeys(recheck, False)
        kv = place.kvstore(path)
        if isinstance(kv, dict):
            full["kvstore"] = kv
        else:
            kwargs["kvstore"] = kv
        every_read_checked = False
        if key is not None:
            # tensorstore reads no metadata: it is handed the document checked against
            # the manifest, so the handle is of this commit's metadata, whatever a rewrite
            # begun meanwhile has put there (no stale or foreign metadata, no extra GET).
            meta = _metadata(place, marker, key, full.get("metadata"), fetched)
            full["metadata"] = meta
            kwargs.pop("assume_cached_metadata", None)
            kwargs.update(open=True, assume_metadata=True)
            if ("fill_missing_data_reads" not in full and full["driver"] == "zarr3"
                    and _whole(seen, marker, key, meta)):
                # A chunk deleted after this open is then an error naming it when read,
                # never fill values (incident 001's failure, after the listing's check).
                full["fill_missing_data_reads"] = False
                # Each chunk ends in its crc32c codec, or each shard's inner chunks and
                # index do: every read of the array fails on a damaged one.
                every_read_checked = is_codeword(meta) or shard_layout(meta) is not None
        opening = ts.open(full, context=ctx, read=True, write=False, **recheck, **kwargs)
        reading = None
        try:
            if index is not _HANDLE:
                # `read`: the chunks are read while the checks below run (on a store's
                # round trips and tensorstore's threads); their values are returned only
                # once the checks passed and the commit is seen unchanged after them.
                store = opening.result()
                if not found.usable and doc is not None:
                    _sharded_reads_work(place, found, store, marker, key,
                                        full.get("metadata"))
                reading = (store if index is None else store[index]).read()
            # The handle (or the values) is handed over only once both are done.
            if deep:
                entry.verify(deep=True)
            elif not (every_read_checked and seen is not None and seen.listed):
                try:
                    _check_listing(entry, marker, entry.adapter.list(entry.path)
                                   if listing is None else listing.result())
                except IntegrityError:
                    if listing is None:
                        raise
                    # Listed beside the marker, so perhaps before a commit that landed
                    # just before the marker's read: list again, after it.
                    _check_listing(entry, marker, entry.adapter.list(entry.path))
            # Else this very commit (the same marker bytes) was checked against a listing
            # by an earlier open in this process, and every read of this array is checked
            # on its own: a chunk missing since is NOT_FOUND (fill_missing_data_reads off,
            # the commit holding every chunk), a changed one fails its crc32c codec. What
            # a listing would add is only the failure at the open instead of at the read,
            # and on a large array it is many round trips per open.
        except BaseException:
            opening.cancel()
            if reading is not None:
                reading.cancel()
            raise
        if seen is not None:
            seen.listed = True
        store = opening.result()
    if reading is not None:
        values = reading.result()
        # Every value read: if the marker is still this commit's, no rewrite began before
        # the last of them was read (a rewrite removes the marker before it changes
        # anything, and a marker never comes back), so they are all of this commit. A
        # handle cannot say so: its reads after a rewrite began can mix two commits.
        _unchanged(place, marker, seen, "read")
        return values
    if not found.usable and doc is not None:
        _sharded_reads_work(place, found, store, marker, key, full.get("metadata"))
    if doc is not None:
        return store
    # Another driver: tensorstore read its metadata. A rewrite removes the marker before
    # it changes anything, and a marker never comes back: the same commit's marker after
    # the open means no rewrite started before it, so that metadata is this commit's (the
    # listing, taken beside the first read, cannot say so: one GET more per such open).
    _unchanged(place, marker, None, "opened")
    return store
