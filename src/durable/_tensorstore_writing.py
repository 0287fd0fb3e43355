"""Writing zarr3 arrays into entries through tensorstore: `writing`, `write` and
`TensorStoreWriter`, published by `durable.tensorstore` (whose docstring gives the design:
what is recorded how, and why a commit lists no chunk)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tensorstore as ts

from durable._checksum import crc32c
from durable._entry import Entry
from durable._errors import AlreadyCompleteError, IntegrityError, rewrite_hint
from durable._lease import Lease
from durable._protocol import ObjectRecord
from durable._tensorstore_codecs import (
    CRC32C_RESIDUE,
    array_metadata,
    checksummed,
    chunk_pattern,
    every_chunk,
    is_codeword,
    shard_crc,
    shard_layout,
)
from durable._tensorstore_kv import (
    MALFORMED,
    MAX_METADATA,
    Place,
    etag_error,
    probe,
)
from durable._writer import EntryWriter
from durable.adapters.base import ObjectInfo

log = logging.getLogger("durable.tensorstore")  # the public module's name, as before

_SHARD_READERS = 8  # shard indexes read at once at commit (small ranged reads)
_SLAB_BYTES = 4 * 1024 * 1024  # values encoded at a time by `write` across a network
_WRITES_AT_ONCE = 1024  # chunk writes `write` has started and not yet waited for
_LOCK_SUFFIX = ".__lock"  # tensorstore's file driver writes KEY.__lock, then renames it
# Options that change what a create means (an existing array replaced or opened, metadata
# not to be written, writes held in a transaction until the block ends): given at all, even
# False, tensorstore's own create runs, so the writer's open never receives them twice.
_CREATE_ELSEWHERE = ("open", "delete_existing", "assume_metadata", "assume_cached_metadata",
                     "transaction")
_WARNED: set[str] = set()  # endpoints whose unusable ETags a writer was warned about


class TensorStoreWriter:
    """What `writing` yields: open arrays in the entry, and the writes to wait for."""

    def __init__(self, place: Place, writer: EntryWriter, context: ts.Context) -> None:
        self.entry = place.entry
        self.url = place.entry.url
        self.attempt = writer.attempt
        self.context = context
        self._place = place
        self._writer = writer
        self._pending: list[Any] = []
        self._transactions: list[ts.Transaction] = []
        # zarr.json keys this writer created -> (the bytes, their version as written)
        self._created: dict[str, tuple[bytes, str | None]] = {}
        # ... and the same array on a memory kvstore, which encodes chunks for `_stream`
        self._drafts: dict[str, ts.TensorStore] = {}
        self._streamed = False  # every object of the entry went through `_stream`
        # `write` across a network: the new root array's zarr.json, not put by `_create`
        # but by `_stream` beside the first chunks (one round trip fewer), or by
        # `_put_held` where the stream cannot run. Its key -> its bytes.
        self._hold_metadata = False
        self._held: dict[str, bytes] = {}
        self._sent: set[str] = set()  # the chunks `_stream` put and recorded

    def open(self, path: str = "", *, checksum_codec: bool = True,
             spec: dict[str, Any] | None = None, **kwargs: Any) -> ts.TensorStore:
        """Create or open the zarr3 array at ``path`` inside the entry ("" is the entry).

        ``kwargs`` go to `tensorstore.open` (``create=True``, ``dtype``, ``shape``,
        ``chunk_layout``, ``codec``, ``fill_value``, ``transaction``, ...); ``spec`` adds
        members to the TensorStore spec (``{"metadata": {...}}``). A new array gets the
        crc32c codec unless ``checksum_codec=False``. A ``transaction`` passed here is
        committed, if still open, when the block ends.
        """
        full: dict[str, Any] = {"driver": "zarr3", **(spec or {})}
        if "kvstore" in full or "kvstore" in kwargs:
            raise ValueError(f"{self.url}: the kvstore is the entry's; do not pass one")
        # The crc32c codec is zarr v3's: a zarr v2 array (tensorstore's "zarr" driver) has
        # no such codec, and merging it failed the create with tensorstore's own error.
        if checksum_codec and full["driver"] == "zarr3" and self._creates(path, kwargs):
            checksummed(full, kwargs)
        # The file driver's fsync per file and directory is left to durable: `write`
        # starts each chunk's as it lands, and the commit fsyncs what is left and every
        # directory once, from a thread pool, before the marker.
        extra = {"file_io_sync": False} if self._place.spec["driver"] == "file" else {}
        kv = self._place.kvstore(path, **extra)
        if isinstance(kv, dict):
            full["kvstore"] = kv
        else:
            kwargs["kvstore"] = kv
        if kwargs.get("transaction") is not None:
            self._transactions.append(kwargs["transaction"])
        # Only zarr3 writes zarr.json (zarr v2 writes .zarray: the document read back would
        # be empty); the spec's JSON takes the open modes too ("create", "open", ...).
        if (kwargs.get("create") and full["driver"] == "zarr3"
                and not any(k in kwargs for k in _CREATE_ELSEWHERE)
                and not any(k in full for k in ("create", *_CREATE_ELSEWHERE))):
            return self._create(path, full, kwargs)
        return ts.open(full, context=self.context, **kwargs).result()

    def _create(self, path: str, full: dict[str, Any], kwargs: dict[str, Any],
                ) -> ts.TensorStore:
        """A new array whose zarr.json this writer puts itself, create-only.

        tensorstore's own create costs three requests on S3 (a GET and a HEAD that find
        nothing, the conditional PUT) and the commit a fourth to read the document back
        for its CRC32C. Here tensorstore encodes the document on a memory kvstore (the
        exact bytes its create would write), the writer puts it (one create-only PUT,
        recorded as it streams) and tensorstore opens the array assuming that metadata,
        reading it only where an operation needs it fresh (a resize).
        """
        rest = {k: v for k, v in kwargs.items() if k not in ("create", "kvstore")}
        draft = ts.open({**full, "kvstore": {"driver": "memory"}}, context=ts.Context(),
                        create=True, **rest).result()
        assert draft.kvstore is not None  # a zarr3 array always has one
        data = bytes(draft.kvstore.read("zarr.json").result().value)
        key = f"{path.strip('/')}/zarr.json".lstrip("/")
        exists = self._exists(key)
        if key in self._writer.records() or key in self._held:
            raise exists  # created in this block: known without asking the store
        if self._hold_metadata and key == "zarr.json":
            self._held[key] = data  # put by `_stream` (or `_put_held`), create-only too
            self._created[key] = (data, None)
        else:
            try:
                with self._writer.open(key, create_only=True) as f:
                    f.write(data)
            except FileExistsError:
                raise exists from None
            self._created[key] = (data, f.info.version if f.info is not None else None)
        self._drafts[key] = draft
        if "kvstore" in kwargs:
            rest["kvstore"] = kwargs["kvstore"]
        return ts.open({**full, "metadata": json.loads(data)}, context=self.context,
                       open=True, assume_cached_metadata=True, **rest).result()

    def _exists(self, key: str) -> ValueError:
        """The error of a create over an array at ``key``, as tensorstore's create says it."""
        url = self.entry.adapter.url(f"{self.entry.path}/{key}")
        return ValueError(f"ALREADY_EXISTS: {url}: an array exists there; pass open=True "
                          "to open it")

    def _creates(self, path: str, kwargs: dict[str, Any]) -> bool:
        if kwargs.get("delete_existing") or (kwargs.get("create") and not kwargs.get("open")):
            return True  # a new array, or an error from tensorstore: nothing to look up
        if not kwargs.get("create"):
            return False
        # Open or create: a codec constraint on an existing array without it fails the open.
        where = f"{self.entry.path}/{path.strip('/')}".rstrip("/") + "/zarr.json"
        return self.entry.adapter.info(where) is None

    def track(self, future: Any) -> Any:
        """Wait for ``future`` (a `WriteFutures`, any tensorstore Future) before committing."""
        self._pending.append(future)
        return future

    def write(self, target: Any, value: Any) -> Any:
        """``target.write(value)``, waited for before the commit; returns its WriteFutures."""
        self._check_lease()
        return self.track(target.write(value))

    def _check_lease(self) -> None:
        """LeaseLostError if the writer's lease was lost (taken over): a writer that lost
        it stops writing, as `EntryWriter.open` does, else its chunks land in the entry
        of the writer that took it over."""
        lease = self._writer._lease
        if lease is not None:
            lease.check()

    def _stream(self, array: ts.TensorStore, values: Any) -> bool:
        """Write ``values`` into ``array`` (created here, at the entry's root) by encoding
        them on its memory draft, a slab of whole chunks at a time, and putting each
        encoded chunk through tensorstore's kvstore client: the same bytes tensorstore's
        own write would put, each recorded as it goes (size; CRC32C, or the codec's
        residue), so the commit lists no chunk. Whether it could (False: the caller writes
        the usual way). The next slab is encoded while this one's chunks are uploaded; at
        most two slabs are held encoded.
        """
        draft = self._drafts.get("zarr.json")
        if draft is None or array.kvstore is None or draft.kvstore is None or not values.ndim:
            return False
        meta = array_metadata(self._created["zarr.json"][0])
        if meta is None:
            return False
        residue = is_codeword(meta)
        shape = draft.chunk_layout.write_chunk.shape
        if not shape or not shape[0]:
            return False
        rows = int(shape[0])
        row_bytes = max(1, values.nbytes // max(1, values.shape[0]))
        step = rows * max(1, _SLAB_BYTES // max(1, rows * row_bytes))
        mem, store = draft.kvstore, array.kvstore
        in_flight: list[tuple[str, Any]] = []  # (chunk key, its put's future)
        sent: list[tuple[str, Any]] = []
        with self._beside_metadata(lambda: [f for _, f in (*in_flight, *sent)]):
            for start in range(0, values.shape[0], step):
                self._check_lease()
                stop = min(start + step, values.shape[0])  # tensorstore does not clip
                draft[start:stop].write(values[start:stop]).result()
                sent = []
                for key in mem.list().result():
                    if key == b"zarr.json":
                        continue
                    body = mem.read(key).result().value
                    name = key.decode()
                    # The codec's residue, unread; the chunk's own checksum (its last 4
                    # bytes) tells it from another chunk of its size at deep verify.
                    rec = ObjectRecord.of(len(body), CRC32C_RESIDUE if residue and
                                          len(body) >= 4 else crc32c(body), body)
                    self._writer.record(name, rec.size, rec.crc32c, tail=rec.tail)
                    self._sent.add(name)
                    sent.append((name, store.write(key, body)))
                    mem.write(key, None).result()
                for name, future in in_flight:
                    self._answer(name, future)  # the slab before: at most two held at once
                in_flight, sent = sent, []
            for name, future in in_flight:
                self._answer(name, future)
        self._streamed = True
        return True

    def _answer(self, key: str, future: Any) -> None:
        """Wait for the put of chunk ``key``; its failure names the chunk (tensorstore's
        error for a compressed chunk's put named no object: "AccessDenied: ...")."""
        try:
            future.result()
        except ValueError as exc:
            url = self.entry.adapter.url(f"{self.entry.path}/{key}")
            raise ValueError(f"{url}: writing this chunk of {self.url} failed: {exc}") from exc

    def _direct(self, array: ts.TensorStore, values: Any) -> bool:
        """Write ``values`` into ``array`` (created here, at the entry's root) through
        tensorstore's own write, and record every chunk without reading or listing it, if
        the array's chunks are all known in advance: every grid position stored (no chunk
        left out as fill value) and each chunk of a size its codecs fix, ending with its
        own CRC32C (`every_chunk`). Whether it could (False: `_stream` or the usual write).

        tensorstore puts the very objects it would put without durable, encoding and
        uploading at once; the commit lists the records, not the chunks. On a local disk
        each chunk's fsync starts as its write lands (`EntryWriter.sync_soon`), beside the
        writes still running: at 8000^2 that took the write from 1.26 of plain's time
        to 0.95 (medians). One write per chunk, so that each put is waited for: a failed
        write's future resolves at its first error, and the puts still on their way would
        land after the cleanup. A chunk the prediction got wrong cannot pass for data:
        its listed size differs from the manifest (open and verify fail), and its codec
        fails on read.
        """
        data = self._created.get("zarr.json")
        known = None if data is None else array_metadata(data[0])
        fixed = None if known is None else every_chunk("", known)
        if fixed is None or not array.spec().to_json().get("store_data_equal_to_fill_value"):
            return False  # a chunk all fill value would be left out: keys not known
        chunks, shape, size = fixed
        started: deque[tuple[str, Any]] = deque()  # the chunk writes not yet waited for

        def landed() -> None:
            key, future = started[0]
            future.result()  # WriteFutures: once the chunk's PUT has answered
            started.popleft()  # still in `started` if the wait above is interrupted
            # On a local disk its fsync starts now, beside the writes still running, not
            # after the last one (the commit waits for it; nothing to do on a network).
            self._writer.sync_soon([key])

        with self._beside_metadata(lambda: (future for _, future in started)):
            for key, at in chunks:
                self._check_lease()
                # tensorstore does not clip a region to the domain: the edge's is cut here
                where = tuple(slice(i * n, min((i + 1) * n, end)) for i, n, end in
                              zip(at, shape, values.shape, strict=True))
                started.append((key, array[where].write(values[where]) if where else
                                array.write(values)))
                if len(started) >= _WRITES_AT_ONCE:  # a bounded number of futures held
                    landed()
            while started:
                landed()
        for key, _ in chunks:
            self._writer.record(key, size, CRC32C_RESIDUE)
            self._sent.add(key)
        self._streamed = True
        return True

    @contextlib.contextmanager
    def _beside_metadata(self, pending: Callable[[], Iterable[Any]]) -> Iterator[None]:
        """Put the held zarr.json beside the chunks the block puts, not before them (the
        entry was found empty, or cleared, at the start: only a writer that raced past
        the start can be there to collide with), and wait for its answer at the end.
        On any failure, every put started (``pending()``, zarr.json's) has landed or
        failed before this raises: one landing after the block's cleanup would be left in
        the entry, outside any attempt."""
        metadata = ThreadPoolExecutor(1) if self._held else None
        created = metadata.submit(self._put_held) if metadata is not None else None
        try:
            yield
            if created is not None:
                created.result()  # the commit waits for zarr.json's answer too
        except BaseException:
            for future in [*pending(), *([created] if created else [])]:
                with contextlib.suppress(Exception):
                    future.result()
            raise
        finally:
            if metadata is not None:
                metadata.shutdown()

    def _put_held(self) -> None:
        """Put the held zarr.json, create-only and recorded: from `_stream` beside its
        first chunks, or before the usual write where the stream cannot run."""
        for key, data in list(self._held.items()):
            try:
                info = self._writer.write_bytes(key, data, create_only=True)
            except FileExistsError:
                raise self._exists(key) from None
            del self._held[key]
            self._created[key] = (data, info.version if info is not None else None)

    def _finish(self) -> None:
        for future in self._pending:
            # WriteFutures.commit resolves once the bytes are in the kvstore.
            getattr(future, "commit", future).result()
        for txn in self._transactions:
            if txn.open:
                txn.commit_sync()
        if self._streamed and self._writer.commit_from_records(
                self.entry.adapter.list(self.entry.layout.records)):
            # Every object was put by this writer and recorded, and the records show this
            # attempt alone: nobody started or cleared the entry meanwhile (a listing of
            # the entry would cost a round trip per 1,000 chunks).
            return
        self._record_codewords()

    def _settle(self) -> None:
        """After a failure, before the entry's cleanup: every tracked write has landed or
        failed, and every open transaction is aborted. A write still in flight while the
        cleanup removes the entry would land after it, left in the entry outside any
        attempt (and a transaction committed later would write into a cleared entry)."""
        for txn in self._transactions:
            if txn.open:
                with contextlib.suppress(Exception):
                    txn.abort()
        for future in self._pending:
            with contextlib.suppress(Exception):
                getattr(future, "commit", future).result()

    def _record_codewords(self) -> None:
        """Record every object the manifest can be sure of without reading it back."""
        adapter, writer = self.entry.adapter, self._writer
        listing = adapter.list(self.entry.path)
        # Temp files of a killed tensorstore file writer are never part of an entry.
        locks = [i.path for k, i in listing.items() if k.endswith(_LOCK_SUFFIX)]
        if locks:
            adapter.delete(locks)
            listing = {k: i for k, i in listing.items() if not k.endswith(_LOCK_SUFFIX)}
        # Taken after every write finished: the commit checks against it, not a new one.
        # No fragments: the attempt is never handed to another process here.
        writer.use_listing(listing, fragments=False)
        codewords: list[re.Pattern[str]] = []  # chunks of arrays whose last codec is crc32c
        sharded: list[tuple[re.Pattern[str], tuple[int, bool]]] = []  # shards, their layout
        for key, info in listing.items():
            if key.rpartition("/")[2] != "zarr.json":
                continue
            data, version = self._created.get(key, (None, None))
            if data is None or version is None or version != info.version:
                # Not written here, or rewritten since (a resize keeps its size): read
                # through tensorstore's client (cheap); if it changed since the listing,
                # the commit sees another version there and checks the record against it.
                data = self._place.read(info.path, MAX_METADATA)
            if data is None or len(data) != info.size:
                raise IntegrityError(
                    f"{adapter.url(info.path)}: listed with {info.size} bytes, read "
                    f"{'nothing' if data is None else len(data)}", url=adapter.url(info.path),
                    expected=info.size, found=None if data is None else len(data))
            writer.record(key, len(data), crc32c(data), version=info.version)
            meta = array_metadata(data)
            pattern = None if meta is None else chunk_pattern(key[:-len("zarr.json")], meta)
            if meta is None or pattern is None:
                continue
            if is_codeword(meta):
                codewords.append(pattern)
            elif (layout := shard_layout(meta)) is not None:
                sharded.append((pattern, layout))
        shards = []
        for key, info in listing.items():
            if key in self._sent:
                continue  # put and recorded by `_stream`: the commit checks it as it is
            if info.size >= 4 and any(p.fullmatch(key) for p in codewords):
                writer.record(key, info.size, CRC32C_RESIDUE, version=info.version)
            else:
                shards += [(key, info, layout) for p, layout in sharded if p.fullmatch(key)]

        def one(item: tuple[str, ObjectInfo, tuple[int, bool]]) -> None:
            key, info, (chunks, at_end) = item
            crc = shard_crc(adapter, info, chunks, at_end)
            if crc is not None:  # else left to the commit, which reads it whole
                writer.record(key, info.size, crc, version=info.version)

        if shards:
            with ThreadPoolExecutor(min(_SHARD_READERS, len(shards))) as pool:
                list(pool.map(one, shards))


@contextlib.contextmanager
def writing(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
            context: ts.Context | None = None, overwrite: bool = False, update: bool = False,
            resume: bool = False, lease: Lease | None = None) -> Iterator[TensorStoreWriter]:
    """Write arrays into the entry at ``url``; commit when the block ends cleanly.

    ``overwrite``, ``update``, ``resume`` and ``lease`` are those of `Entry.writing`: a rewrite
    (``overwrite=True``, or ``update=True`` to change a COMPLETE array in place) removes
    the marker before anything changes, so no reader opens the entry mid-rewrite. At the
    end of the block, every write passed to `TensorStoreWriter.track`/``write`` and every
    transaction passed to `TensorStoreWriter.open` must succeed, then the marker is
    written. A write started with ``array.write()`` and neither tracked nor waited for (or
    made in a transaction not passed to `TensorStoreWriter.open` and not committed) is not
    waited for: what of it has not landed when the manifest is built is not in the commit.
    If it lands later, the entry fails `open` and verification; if it never lands (the
    process exits first), the entry is COMPLETE, verifies, and reads fill values there,
    which nothing can tell from data. Any exception (a
    failed write, KeyboardInterrupt) leaves no marker; the cleanup that follows it runs
    only once every tracked write has landed or failed and every open transaction passed
    to `TensorStoreWriter.open` is aborted.
    """
    place = Place.of(url, storage_options)
    ctx = context if context is not None else ts.Context()
    # Before anything is written: a store whose ETags nothing can use fails here, with the
    # endpoint and the ETag named, not at the commit in the adapter or in tensorstore.
    found = probe(place, ctx)
    if not found.readable:
        raise etag_error(place, found, "nothing was written")
    if update and not found.usable:
        # Refused before `Entry.writing` removes the marker: an update there (a chunk
        # written in part, a resize) sends tensorstore's conditional requests, fails, and
        # left a COMPLETE entry INCOMPLETE over its unchanged data.
        raise etag_error(place, found, "update=True was refused and the entry is as it "
                         "was: an update rewrites chunks and metadata on the condition "
                         "that they are still the version read. Write a new version with "
                         "overwrite=True (or to a new entry) instead")
    if not found.usable and place.endpoint not in _WARNED:
        _WARNED.add(str(place.endpoint))
        log.warning("%s", etag_error(place, found, "only writes that need no conditional "
                                     "request can succeed"))
    try:
        with place.entry.writing(overwrite=overwrite, update=update, resume=resume,
                                 lease=lease) as ew:
            writer = TensorStoreWriter(place, ew, ctx)
            try:
                yield writer
                writer._finish()
            except BaseException:
                writer._settle()
                raise
    except ValueError as exc:
        if MALFORMED not in str(exc):
            raise
        raise etag_error(place, found, "this write failed and nothing was committed") from exc


def write(url: str | os.PathLike[str], data: Any, *, chunks: Iterable[int] | None = None,
          storage_options: dict[str, Any] | None = None, context: ts.Context | None = None,
          overwrite: bool = False, checksum_codec: bool = True, lease: Lease | None = None,
          **kwargs: Any) -> Entry:
    """Create the array ``data`` (NumPy-like) at ``url`` and commit it; returns the Entry.

    Every chunk is stored, those all fill value too (tensorstore leaves them out unless
    told otherwise), so the commit holds every grid position and `open` reads the array
    with ``fill_missing_data_reads`` off: a chunk lost later is an error, never fill
    values. ``spec={"store_data_equal_to_fill_value": False}`` restores tensorstore's
    default. ``lease``: a `durable.Lease` held on the entry (`Entry.writing`). ``kwargs``
    go to `TensorStoreWriter.open`.
    """
    import numpy as np

    for name in ("resume", "update"):
        # Else passed on to tensorstore.open, whose TypeError lists its whole signature;
        # an INCOMPLETE entry's error suggests resume=True, which `writing` takes.
        if name in kwargs:
            raise TypeError(f"{os.fspath(url)}: durable.tensorstore.write takes no {name}=: "
                            "it writes the whole array; pass overwrite=True to write it "
                            f"again, or use durable.tensorstore.writing(url, {name}=True)")
    values = np.asarray(data)
    if chunks is not None:
        kwargs["chunk_layout"] = ts.ChunkLayout(chunk_shape=list(chunks))
    # Every chunk is stored, all fill value or not: the commit then holds every grid
    # position, so a chunk missing later reads as an error, never as fill values
    # (incident 001), and on a network the chunks' keys are known without a listing.
    kwargs["spec"] = {"store_data_equal_to_fill_value": True, **(kwargs.get("spec") or {})}
    try:
        return _write(url, values, storage_options, context, overwrite, checksum_codec,
                      lease, kwargs)
    except AlreadyCompleteError as exc:
        # write() takes no update=True: the way to change the array in place is named.
        raise rewrite_hint(exc, "write(..., overwrite=True) replaces it, "
                                "durable.tensorstore.writing(url, update=True) changes it"
                           ) from None


def _write(url: str | os.PathLike[str], values: Any,
           storage_options: dict[str, Any] | None, context: Any, overwrite: bool,
           checksum_codec: bool, lease: Lease | None, kwargs: dict[str, Any]) -> Entry:
    with writing(url, storage_options=storage_options, context=context,
                 overwrite=overwrite, lease=lease) as w:
        remote = w._place.endpoint is not None
        w._hold_metadata = remote
        array = w.open(create=True, dtype=values.dtype, shape=values.shape,
                       checksum_codec=checksum_codec, **kwargs)
        # Every chunk is recorded as it is put, by tensorstore where the codecs fix each
        # chunk's size (on a local disk too: each chunk's fsync starts as it lands), else,
        # across a network, encoded and put here: the commit lists no chunk (and reads none
        # back without the codec).
        local = w._place.spec["driver"] == "file"
        if not (((remote or local) and w._direct(array, values))
                or (remote and w._stream(array, values))):
            w._put_held()
            w.write(array, values)
    return w.entry
