"""The writing side of `durable.zarr`: `WritingStore`, chunks recorded, metadata held back.

Every chunk zarr sets is written to the entry and its size and CRC32C recorded from the
bytes zarr handed over (no second read); deletes (fill-value chunks, resizes) are
forgotten. Metadata documents go to a staging area beside the entry and are read from it
first, so the writer and the other processes of the same write see them and plain readers
do not; `WritingStore.publish` copies them into the entry at commit. A fresh write that
offers no resume (`durable.zarr.write`, a fresh `durable.xarray.to_zarr`) defers even
that: the documents stay in the coordinator's memory until the store is pickled for
another process (then they are staged, whole, before the pickle exists), and are
published from memory otherwise. A writer killed before then leaves chunks and no
metadata anywhere: no array for plain readers, INCOMPLETE for durable, and nothing to
resume on (a retry with ``overwrite=True`` starts over).

Requests on an object store, besides one PUT per chunk: three to start (`Entry.writing`),
a PUT of each metadata document into the entry, a LIST of the entry at publish (the
commit reuses it), the marker and one DeleteObjects (the attempt record); for one array 7,
against plain zarr's 3 (a HEAD and a LIST looking for an existing node, the PUT). Where
the caller drives every write (`durable.zarr.write`, a fresh `durable.xarray.to_zarr`) and
the store never left this process, the LIST at publish is of the records, not the entry
(`EntryWriter.commit_from_records`): one small request instead of one per 1,000 chunks. Staged
eagerly (`writing()` by default, or once handed to another process), each document is
also PUT into staging, and the publish lists the records (another writer's marker, what
is staged; the commit reuses the listing), and the staged copies are removed before
the marker: 10. Deferred, that LIST is skipped only where
the store enforces create-only: the marker then decides a race, as in the commit; where
it does not, the LIST is what stops a writer publishing over another's committed chunks.
The looks cost nothing here: the coordinator of a fresh write keeps what it staged and
answers metadata reads from it until it hands the store to another process; and
publishing skips the GET of a staged document still listed with the ETag its own PUT got.

Records go to the `EntryWriter` in the coordinating process; a store unpickled in another
process (a dask worker) records into that process's manifest fragment instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from zarr.abc.store import ByteRequest, Store
from zarr.core.sync import sync
from zarr.storage import LocalStore, WrapperStore

from durable._checksum import crc32c
from durable._entry import Entry
from durable._errors import AlreadyCompleteError, IntegrityError
from durable._fragments import FragmentRecorder
from durable._protocol import MARKER_NAME, ObjectRecord
from durable._writer import EntryWriter
from durable._zarr_reading import get_whole, inner_store
from durable._zarr_staged import Staged, put, tag
from durable.adapters import ObjectInfo

if TYPE_CHECKING:
    from zarr.abc.buffer import Buffer
    from zarr.core.buffer import BufferPrototype

__all__ = ["WritingStore", "coordinating", "flush_fragments", "flush_workers", "is_metadata"]

METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})
STAGING = "staged"
# zarr's LocalStore writes `<key>.<32 hex>.partial` and renames it; a writer killed in
# between leaves the temp file, which must never be adopted as part of an entry.
_PARTIAL = re.compile(r"\.[0-9a-f]{32}\.partial$")
# Above this, CRC32C runs off the event loop so other chunks keep flowing meanwhile.
_CRC_INLINE = 1024 * 1024


def is_metadata(key: str) -> bool:
    return key.rpartition("/")[2] in METADATA_NAMES


def _publish_tier(key: str) -> tuple[int, int]:
    """Publish order: deepest nodes first, a node's attributes before its node document,
    consolidated metadata (which describes everything) last of all."""
    name = key.rpartition("/")[2]
    rank = {".zattrs": 0, ".zmetadata": 2}.get(name, 1)
    return (-key.count("/") if rank < 2 else 1, rank)


class Recorder(Protocol):
    def record(self, key: str, size: int, crc32c: int, *, tail: int | None = None) -> None: ...

    def forget(self, key: str) -> None: ...


# Coordinators of this process by attempt: a store unpickled here records straight into
# its writer, not into a fragment. Fragment recorders are shared by every store of one
# attempt in a process, so a worker flushes one fragment, not one per task.
_WRITERS: weakref.WeakValueDictionary[str, EntryWriter] = weakref.WeakValueDictionary()
_FRAGMENTS: dict[tuple[str, str], FragmentRecorder] = {}
_FRAGMENTS_LOCK = threading.Lock()


def _recorder_for(url: str, storage_options: dict[str, Any], attempt: str) -> Recorder:
    writer = _WRITERS.get(attempt)
    if writer is not None:
        return writer
    with _FRAGMENTS_LOCK:
        rec = _FRAGMENTS.get((url, attempt))
        if rec is None:
            rec = _FRAGMENTS[(url, attempt)] = FragmentRecorder(url, storage_options, attempt)
        return rec


# Attempts declared over in this process, and the store writes of each still under way:
# a failed block stops its own tasks still running elsewhere (`end_attempt`) before its
# cleanup, so that none of their chunks lands after it (into nothing, or into the entry of
# the retry that follows, over that retry's commit).
_ENDED: set[str] = set()
_UNDER_WAY: dict[str, int] = {}
_UNDER_WAY_LOCK = threading.Lock()
_END_WAIT = 120.0  # longest wait for one store write of an ended attempt to finish


@contextlib.contextmanager
def _writing_for(attempt: str, url: str) -> Iterator[None]:
    """One store write of ``attempt``: refused once the attempt is over, counted while it
    runs (checked and counted under one lock: no write slips between the two)."""
    with _UNDER_WAY_LOCK:
        if attempt in _ENDED:
            raise ValueError(f"{url}: attempt {attempt} is over (its writing() block "
                             "failed): this task's write is refused, not left to land "
                             "after the cleanup")
        _UNDER_WAY[attempt] = _UNDER_WAY.get(attempt, 0) + 1
    try:
        yield
    finally:
        with _UNDER_WAY_LOCK:
            left = _UNDER_WAY[attempt] - 1
            if left:
                _UNDER_WAY[attempt] = left
            else:
                del _UNDER_WAY[attempt]


def end_attempt(attempt: str, timeout: float = _END_WAIT) -> int:
    """Refuse every later store write of ``attempt`` in this process, and wait (at most
    ``timeout`` seconds) for those under way; returns how many were still under way."""
    with _UNDER_WAY_LOCK:
        _ENDED.add(attempt)
    deadline = time.monotonic() + timeout
    while True:
        with _UNDER_WAY_LOCK:
            left = _UNDER_WAY.get(attempt, 0)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.005)


async def _end_attempt_on_worker(attempt: str, timeout: float) -> int:
    # On the worker's event loop (`Client.run`): the wait runs in a thread, not on it.
    return await asyncio.to_thread(end_attempt, attempt, timeout)


def end_attempt_everywhere(attempt: str) -> None:
    """`end_attempt` here (threads of this process) and on every worker of the current
    `distributed` client: after a failure, tasks of the attempt still running (dask
    cancels those not started, not those running) write nothing more, and the writes they
    had under way have landed, so the cleanup that follows removes them."""
    end_attempt(attempt)
    client = _running_client()
    if client is not None:
        with contextlib.suppress(Exception):  # a worker lost: it writes nothing more anyway
            client.run(_end_attempt_on_worker, attempt, _END_WAIT)


def _running_client() -> Any:
    """The current `distributed` client if one is running; None: nothing ran elsewhere."""
    if "distributed" not in sys.modules:
        return None
    from distributed import default_client

    try:
        client = default_client()  # type: ignore[no-untyped-call]
    except ValueError:
        return None
    return client if client.status == "running" else None


def flush_fragments() -> int:
    """Flush every fragment recorder of this process; returns how many there were.

    Run it on each worker before the coordinator commits (``client.run(flush_fragments)``;
    `writing` does so for the current `distributed` client): records never flushed cost the
    coordinator a re-read of those chunks, nothing worse.
    """
    with _FRAGMENTS_LOCK:
        recorders = list(_FRAGMENTS.values())
        _FRAGMENTS.clear()
    for rec in recorders:
        rec.flush()
    return len(recorders)


def flush_workers() -> None:
    """`flush_fragments` on every worker of the current `distributed` client, if any."""
    client = _running_client()
    if client is None:
        return
    try:
        client.run(flush_fragments)
    except Exception:  # a worker lost now: its chunks are re-read at the commit
        return


async def _record_of(value: Buffer) -> ObjectRecord:
    """The bytes' record, from the bytes zarr hands over (a chunk the crc32c codec ended
    with its checksum keeps that checksum: its whole CRC32C is the same for every chunk)."""
    view = memoryview(value.as_buffer_like()).cast("B")
    if view.nbytes > _CRC_INLINE:
        return ObjectRecord.of(view.nbytes, await asyncio.to_thread(crc32c, view), view)
    return ObjectRecord.of(view.nbytes, crc32c(view), view)


async def _keys(keys: Iterable[str]) -> AsyncIterator[str]:
    for key in keys:
        yield key


async def _union(*iterators: AsyncIterator[str]) -> AsyncIterator[str]:
    seen: set[str] = set()
    for it in iterators:
        async for key in it:
            if key not in seen:
                seen.add(key)
                yield key


class WritingStore(WrapperStore[Store]):
    """The zarr store of an entry being written: chunks recorded, metadata held back.

    Made by `writing`; picklable (for dask workers) and comparable. Metadata keys are
    written to the staging store and read from it first, so this writer and the other
    processes of the same write see the metadata while plain readers do not.
    """

    def __init__(self, url: str, *, attempt: str, storage_options: Mapping[str, Any] | None,
                 recorder: Recorder | None = None, read_only: bool = False,
                 _stores: tuple[Store, Store] | None = None,
                 _staged: Staged | None = None) -> None:
        self._url = url
        self._attempt = attempt
        self._storage_options = dict(storage_options or {})
        if _stores is None:
            entry = Entry(url, storage_options=self._storage_options)
            staging = entry.adapter.url(f"{entry.layout.records}/{STAGING}")
            _stores = (inner_store(entry.url, self._storage_options, read_only=read_only),
                       inner_store(staging, self._storage_options, read_only=read_only))
        super().__init__(_stores[0])
        self._staging = _stores[1]
        self._recorder = recorder or _recorder_for(url, self._storage_options, attempt)
        self._staged = _staged or Staged(complete=False)

    # identity, pickling ------------------------------------------------------------------
    def _clone(self, data: Store, staging: Store) -> WritingStore:
        return type(self)(self._url, attempt=self._attempt,
                          storage_options=self._storage_options, recorder=self._recorder,
                          _stores=(data, staging), _staged=self._staged)

    def _with_store(self, store: Store) -> WritingStore:
        return self._clone(store, self._staging)

    def with_read_only(self, read_only: bool = False) -> WritingStore:
        # Staging stays as it is (a read-only LocalStore refuses to open a directory that
        # does not exist yet); writes through a read-only copy are refused by
        # _check_open all the same.
        return self._clone(self._store.with_read_only(read_only), self._staging)

    def __getstate__(self) -> dict[str, Any]:
        # Handed to another process, which needs the documents held only here (they go
        # to staging first) and may stage metadata this one must then read.
        if self._staged.deferred:  # no Entry built per pickle (dask pickles per task)
            entry = Entry(self._url, storage_options=self._storage_options)
            self._staged.hand_off(f"{entry.layout.records}/{STAGING}", entry.adapter)
        self._staged.complete = False
        self._staged.wrote_data = True  # the other process may write chunks: no restore
        return {"url": self._url, "attempt": self._attempt, "read_only": self.read_only,
                "storage_options": self._storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], attempt=state["attempt"],  # type: ignore[misc]
                      storage_options=state["storage_options"], read_only=state["read_only"])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, WritingStore) and self._url == other._url
                and self._attempt == other._attempt and self.read_only == other.read_only)

    def __hash__(self) -> int:
        return hash((self._url, self._attempt, self.read_only))

    def __dask_tokenize__(self) -> tuple[str, str, str, bool]:
        return ("durable.zarr.WritingStore", self._url, self._attempt, self.read_only)

    def __repr__(self) -> str:
        return f"WritingStore({self._url!r}, attempt={self._attempt!r})"

    __str__ = __repr__

    # open / close ------------------------------------------------------------------------
    async def _open(self) -> None:
        await self._store._ensure_open()
        await self._staging._ensure_open()

    async def _ensure_open(self) -> None:
        await self._open()

    def close(self) -> None:
        if isinstance(self._recorder, FragmentRecorder):
            self._recorder.flush()
        self._store.close()
        self._staging.close()

    # writes -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        self._check_writable()
        # A write after the commit would be in no manifest: refused here rather than
        # found later as an object the commit does not list.
        if getattr(self._recorder, "_closed", False):
            raise ValueError(f"{self._url}: the durable.zarr.writing() block has ended; "
                             "write again with writing(url, update=True)")
        lease = getattr(self._recorder, "_lease", None)
        if lease is not None:
            # A writer that lost its lease stops writing, as `EntryWriter.open` does: its
            # chunks would land in the entry of the writer that took the lease over.
            lease.check()

    async def set(self, key: str, value: Buffer) -> None:
        self._check_open()
        if is_metadata(key):
            with _writing_for(self._attempt, self._url):
                await self._stage(key, value.to_bytes())
            return
        rec = await _record_of(value)
        with _writing_for(self._attempt, self._url):
            self._staged.wrote_data = True  # before: a failed set may have landed
            await self._store.set(key, value)
        # Recorded only once the store accepted the bytes: a failed set records nothing.
        self._recorder.record(key, rec.size, rec.crc32c, tail=rec.tail)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not await self.exists(key):
            await self.set(key, value)

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        # Not delegated: the inner store's _set_many would bypass the records.
        await asyncio.gather(*(self.set(k, v) for k, v in values))

    async def delete(self, key: str) -> None:
        # zarr deletes chunks equal to the fill value and chunks a resize cut off.
        self._check_open()
        with _writing_for(self._attempt, self._url):
            if is_metadata(key) and self._staged.forget(key, deleted=True):
                with self._staging_changes(key):
                    await self._staging.delete(key)
            self._staged.wrote_data = True
            await self._store.delete(key)
        self._recorder.forget(key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_open()
        keys = [k async for k in self._store.list_prefix(prefix)]
        self._staged.wrote_data = True
        await self._store.delete_dir(prefix)
        if self._staged.forget(prefix, deleted=True):
            with self._staging_changes(prefix):
                await self._staging.delete_dir(prefix)
        for key in keys:
            self._recorder.forget(key)

    async def _stage(self, key: str, data: bytes) -> None:
        if self._staged.hold(key, data):
            return
        with self._staging_changes(key):
            tag = await put(self._staging, key, data)
        self._staged.docs[key] = (data, tag)

    @contextlib.contextmanager
    def _staging_changes(self, prefix: str) -> Iterator[None]:
        """Around a change of the staged documents at or below ``prefix``: if it fails, it
        may or may not have landed, so what is held of them is dropped and metadata reads
        go back to asking staging (`Staged.complete` ends)."""
        try:
            yield
        except BaseException:
            self._staged.complete = False
            self._staged.forget(prefix)
            raise

    async def clear(self) -> None:
        await self.delete_dir("")

    # reads: staged metadata first ----------------------------------------------------------
    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if is_metadata(key) and byte_range is None and self._staged.complete:
            # Every metadata document of this write is held here (see Staged): what is
            # not held is in neither staging nor the entry.
            held = self._staged.docs.get(key)
            return None if held is None else prototype.buffer.from_bytes(held[0])
        if is_metadata(key) and byte_range is None:
            staged = await get_whole(self._staging, key, prototype)
            return staged if staged is not None else await get_whole(self._store, key,
                                                                     prototype)
        if is_metadata(key):
            staged = await self._staging.get(key, prototype, byte_range)
            if staged is not None:
                return staged
        return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]
                                 ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def _get_many(self, requests: Iterable[tuple[str, BufferPrototype,
                                                         ByteRequest | None]]
                        ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        for key, prototype, byte_range in requests:
            yield key, await self.get(key, prototype, byte_range)

    async def exists(self, key: str) -> bool:
        if not is_metadata(key):
            return await self._store.exists(key)
        if self._staged.complete:
            return key in self._staged.docs
        # Both places at once, and by GET: a metadata document is small, and an object
        # store's "exists" of a missing key is a HEAD and a LIST.
        from zarr.core.buffer import default_buffer_prototype

        proto = default_buffer_prototype()
        found = await asyncio.gather(get_whole(self._staging, key, proto),
                                     get_whole(self._store, key, proto))
        return any(buf is not None for buf in found)

    async def is_empty(self, prefix: str) -> bool:
        if self._staged.deferred:
            return not self._staged.held_keys(prefix) and await self._store.is_empty(prefix)
        return await self._store.is_empty(prefix) and await self._staging.is_empty(prefix)

    # Listings: what is staged (held, while deferred) and what is in the entry.
    def list(self) -> AsyncIterator[str]:
        if self._staged.deferred:
            return _union(_keys(self._staged.held_keys("")), self._store.list())
        return _union(self._staging.list(), self._store.list())

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        if self._staged.deferred:
            return _union(_keys(self._staged.held_keys(prefix)),
                          self._store.list_prefix(prefix))
        return _union(self._staging.list_prefix(prefix), self._store.list_prefix(prefix))

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        if self._staged.deferred:
            cut = len(prefix.rstrip("/")) + 1 if prefix.rstrip("/") else 0
            names = [k[cut:].partition("/")[0] for k in self._staged.held_keys(prefix)]
            return _union(_keys(names), self._store.list_dir(prefix))
        return _union(self._staging.list_dir(prefix), self._store.list_dir(prefix))

    # commit --------------------------------------------------------------------------------
    def publish(self, writer: EntryWriter | None = None, *, sole_writer: bool = False) -> None:
        """Copy every staged metadata document into the entry (recorded), then drop staging.

        Called by `writing` after the last chunk and before the marker; idempotent. The
        staged copies are removed before it returns (staging holds the next update's
        documents under the same names once the marker is written). ``sole_writer``:
        every object of the entry was written through this store (`coordinating`).
        """
        entry = Entry(self._url, storage_options=self._storage_options)
        local = isinstance(self._store, LocalStore)
        staged, from_records = sync(self._publish(entry, writer, sole_writer))
        staging = f"{entry.layout.records}/{STAGING}"
        if local:
            if not from_records:
                # Names only (no stat per file): the commit walks the entry next. A commit
                # from its records takes in no object it did not write: nothing to look for.
                leftovers = [os.path.join(d, f) for d, _, files in os.walk(entry.path)
                             for f in files if _PARTIAL.search(f)]
                entry.adapter.delete(leftovers)
            if not self._staged.deferred or self._staged.touched:
                # The whole dir: also any temp file a killed writer left in it. A write
                # that staged nothing leaves it alone: what is there is another writer's
                # (one that started after this one with overwrite=True).
                entry.adapter.delete_prefix(staging)
        elif staged:
            # Now, before the marker: not as housekeeping after it, where it removed by name
            # the documents an update begun meanwhile had staged under the same names
            # (the next step of a script, another process), and that update committed
            # COMPLETE without them. A crash before the marker leaves the published copies.
            entry.adapter.delete([f"{staging}/{key}" for key in staged])
        if isinstance(self._recorder, FragmentRecorder):
            self._recorder.flush()

    async def _publish(self, entry: Entry, writer: EntryWriter | None,
                       sole_writer: bool) -> tuple[tuple[str, ...], bool]:
        """(the keys staged, whether the commit takes its manifest from the records)."""
        # On an object store the entry is listed meanwhile, for the commit: every chunk is
        # written by now, and what publishing adds is known from its own PUTs. The commit
        # then makes no request before the marker; its listing is older by the publish
        # (a PUT or two), a window of the same kind as the one between a commit's own
        # listing and its marker.
        hand_over = writer is not None and not isinstance(self._store, LocalStore)
        held = self._staged
        # Never handed out, every object written through this store: what the commit needs
        # to know is whether another writer started or cleared the entry meanwhile, which
        # one small LIST of the records tells (`EntryWriter.commit_from_records`), where a
        # LIST of the entry costs a round trip per 1,000 chunks (and on moto 0.2 ms of the
        # server's CPU per object). Only where create-only is enforced: the marker decides
        # a race with a writer that commits after this LIST.
        from_records = (sole_writer and writer is not None and held.deferred
                        and not held.touched and entry.adapter.capabilities.create_only)
        # Across a network at once with the publish; on local disk after it (a scandir).
        side = (entry.layout.records if from_records else entry.path) if hand_over else None
        listing = (asyncio.ensure_future(asyncio.to_thread(entry.adapter.list, side))
                   if side is not None else None)
        try:
            records = None
            if not held.deferred or held.touched or not entry.adapter.capabilities.create_only:
                # One listing of the records: another writer's marker (without create-only
                # the only thing that stops this writer publishing over its chunks), and
                # what is staged. The commit reuses it (the workers' fragments were all
                # flushed before it was taken).
                records = await asyncio.to_thread(entry.adapter.list, entry.layout.records)
                if writer is not None:
                    writer.use_listing(records=records)
            elif writer is not None and not from_records:
                # Never handed out: every document is held here, nothing was staged, and
                # no other process records fragments of this attempt. The create-only
                # marker decides a race with another writer, as the commit's does.
                writer.use_listing(fragments=False)
            keys, published = await self._copy_staged(entry, records)
            if writer is not None and from_records and listing is None:
                from_records = writer.commit_from_records(entry.adapter.list(
                    entry.layout.records))
            elif writer is not None and listing is not None:
                if not from_records:
                    # Listed before or after they landed, the documents are what their
                    # PUTs say.
                    writer.use_listing({**await listing, **published})
                elif not writer.commit_from_records(await listing):
                    # Another writer's record (or none of this one's): the commit lists
                    # the entry and checks every object, as without ``sole_writer``.
                    from_records = False
                    writer.use_listing({**await asyncio.to_thread(entry.adapter.list,
                                                                  entry.path), **published})
        except BaseException:
            if listing is not None:
                await asyncio.gather(listing, return_exceptions=True)  # not left running
            raise
        return keys, from_records

    async def _copy_staged(self, entry: Entry, records: dict[str, ObjectInfo] | None
                           ) -> tuple[tuple[str, ...], dict[str, ObjectInfo]]:
        """Publish the documents ``records`` lists as staged, or (deferred) those held:
        (the keys staged, to remove; what was put). ``records`` None: not listed."""
        from zarr.core.buffer import default_buffer_prototype

        proto = default_buffer_prototype()
        listed, records = records is not None, records or {}
        keys = [k[len(STAGING) + 1:] for k in records
                if k.startswith(f"{STAGING}/") and is_metadata(k)]
        if MARKER_NAME in records:
            # Another writer committed meanwhile: publishing now would put this writer's
            # metadata over that writer's committed chunks. What is staged is nobody's now
            # (no writer commits over a marker), and a later update must not take it for
            # newer than the committed metadata.
            await asyncio.to_thread(entry.adapter.delete,
                                    [f"{entry.layout.records}/{STAGING}/{k}" for k in keys])
            raise AlreadyCompleteError(f"{entry.url}: another writer committed this entry "
                                       "first", url=entry.url)
        if listed and isinstance(self._recorder, EntryWriter):
            # Another writer started over the entry: what is staged is its metadata now,
            # and published, plain readers would find its array before it committed.
            self._recorder.refuse_started_over(records)

        async def staged(key: str) -> bytes | None:
            held = self._staged.docs.get(key)
            listed = tag(records[f"{STAGING}/{key}"].version)
            if held is not None and held[1] is not None and held[1] == listed:
                # Listed with the ETag our own PUT was answered with: these very bytes.
                return held[0]
            # Staged by another process, or rewritten since: what is there now counts.
            buf = await get_whole(self._staging, key, proto)
            return None if buf is None else buf.to_bytes()

        docs: dict[str, bytes | None]
        if self._staged.deferred:
            # Held here is the whole truth: a copy staged by a failed hand-off may be older.
            docs = {k: data for k, (data, _) in list(self._staged.docs.items())}
        else:
            docs = dict(zip(keys, await asyncio.gather(*(staged(k) for k in keys)),
                            strict=True))
            lost = sorted(k for k in self._staged.hidden
                          if docs.get(k) is None and k not in self._staged.unhidden)
            if lost:
                # Removed by someone else (a tool clearing `.durable`, an older version's
                # housekeeping): committed without it, the node is gone for every reader.
                raise IntegrityError(
                    f"{entry.url}: {', '.join(lost)}, hidden from readers by this update, "
                    "gone from staging before the commit: not committing without it",
                    url=entry.url, expected=f"{len(lost)} staged documents",
                    found="gone")
        tiers: dict[tuple[int, int], list[str]] = {}
        for key in docs:
            tiers.setdefault(_publish_tier(key), []).append(key)
        published: dict[str, ObjectInfo] = {}

        # Deferred, the write is fresh: the entry held no metadata when it started (or was
        # cleared), so a document already at a key is another writer's, published after
        # this one began (one that went on with overwrite=True, and may have committed).
        # Create-only, that publish fails here instead of landing over the other's
        # committed metadata; the LIST of the records this path skips would only have
        # narrowed that window.
        exclusive = (self._staged.deferred and not self._staged.touched
                     and entry.adapter.capabilities.create_only)

        async def copy(key: str) -> None:
            data = docs[key]
            if data is None or key in self._staged.published:
                return  # gone since it was listed (a racing writer published it), or
                # published by an earlier call of publish
            rec = await _record_of(proto.buffer.from_bytes(data))
            if exclusive:
                try:
                    await asyncio.to_thread(entry.adapter.put, f"{entry.path}/{key}", data,
                                            create_only=True, durable=False)
                except FileExistsError as exc:
                    raise AlreadyCompleteError(
                        f"{entry.url}: another writer published {key} first (it started "
                        "after this one, with overwrite=True, and may have committed): "
                        "not publishing over it", url=entry.url) from exc
                self._staged.published.add(key)
            else:
                await put(self._store, key, data)
                self._staged.unhidden.add(key)
            self._recorder.record(key, rec.size, rec.crc32c, tail=rec.tail)
            published[key] = ObjectInfo(f"{entry.path}/{key}", rec.size)

        for tier in sorted(tiers):
            # One tier at a time: a node's document appears only after its children's.
            await asyncio.gather(*(copy(k) for k in tiers[tier]))
        return tuple(keys), published

    def hide_metadata(self) -> None:
        """Move metadata already in the entry (an update, a resume) back into staging.

        Until the commit, plain readers then see no array rather than an array whose
        chunks are being changed under them.
        """
        sync(self._hide())

    async def _hide(self) -> None:
        from zarr.core.buffer import default_buffer_prototype

        keys = [k async for k in self._store.list() if is_metadata(k)]
        proto = default_buffer_prototype()
        for key in keys:
            # A staged document is newer (a killed publish); otherwise stage the published
            # one before it is removed, or the array would be lost.
            if await get_whole(self._staging, key, proto) is None:
                buf = await get_whole(self._store, key, proto)
                if buf is not None:
                    self._staged.hidden[key] = buf.to_bytes()
                    await self._stage(key, buf.to_bytes())
        # Root first: the whole hierarchy disappears for plain readers at the first delete.
        for key in sorted(keys, key=_publish_tier, reverse=True):
            await self._store.delete(key)
            self._recorder.forget(key)

    def restore(self, writer: EntryWriter, refused: Exception) -> bool:
        """Give up an update that wrote no chunk (it failed with ``refused``): the
        documents it hid go back into the entry (recorded), its staged ones are dropped,
        and the writer's commit then makes the last commit again. Whether it did: False
        (nothing done) once a chunk write or delete was tried or the store left this
        process, or if a hidden document is not the bytes the last commit recorded; False
        too if putting them back fails, said in a note on ``refused``."""
        try:
            return self._restore(writer)
        except Exception as failed:
            refused.add_note(f"{self._url}: the update wrote no chunk, but putting its "
                             f"metadata back failed ({failed!r}): the entry is INCOMPLETE")
            return False

    def _restore(self, writer: EntryWriter) -> bool:
        held = self._staged
        if held.wrote_data or not held.hidden:
            return False
        base = writer._baseline
        if any(key not in base
               or not base[key][0].matches(ObjectRecord.of(len(data), crc32c(data), data))
               for key, data in held.hidden.items()):
            return False
        entry = Entry(self._url, storage_options=self._storage_options)
        # Staging first: a document staged by the given-up update is never published.
        entry.adapter.delete_prefix(f"{entry.layout.records}/{STAGING}")
        for key in sorted(held.hidden, key=_publish_tier):  # the root last, as published
            data = held.hidden[key]
            sync(put(self._store, key, data))
            self._recorder.record(key, len(data), crc32c(data))
        return True


@contextlib.contextmanager
def coordinating(entry: Entry, writer: EntryWriter, *,
                 storage_options: dict[str, Any] | None, hide: bool,
                 fresh: bool = False, deferred: bool = False,
                 sole_writer: bool = False) -> Iterator[WritingStore]:
    """The coordinator's store for ``writer``; on clean exit, workers flushed and published.

    ``hide``: move metadata already in the entry (an update, a resume) back to staging.
    ``fresh``: the writer started on an entry with no data and no records (neither a
    resume nor an update: `Entry.writing` refuses anything else, or clears it for
    ``overwrite=True``), so the store answers metadata reads from what it staged itself
    until it is pickled (see `Staged`): zarr's and xarray's looks for existing nodes cost
    no request.
    ``deferred`` (only with ``fresh``): the documents are not staged at all until the store
    is pickled (`Staged`): a writer killed before leaves chunks and no metadata anywhere,
    so it cannot be resumed on them; nothing is staged, listed or removed for them.
    ``sole_writer``: the caller drives every write of the entry through this store
    (`durable.zarr.write`, `durable.xarray.to_zarr`), so on an object store a deferred
    write never handed out commits from its records (`EntryWriter.commit_from_records`).
    """
    _WRITERS[writer.attempt] = writer
    try:
        store = WritingStore(entry.url, attempt=writer.attempt,
                             storage_options=storage_options, recorder=writer,
                             _staged=Staged(complete=fresh, deferred=deferred))
        if writer._baseline:
            # Updating a COMPLETE entry: anything staged is a leftover of a writer that
            # lost a race (or was killed after another committed), older than the
            # committed metadata, and must not be published over it.
            entry.adapter.delete_prefix(f"{entry.layout.records}/{STAGING}")
        if hide:
            store.hide_metadata()
        try:
            yield store
        except BaseException:
            # Before the cleanup: tasks of this attempt still running write nothing more.
            end_attempt_everywhere(writer.attempt)
            raise
        flush_workers()
        store.publish(writer, sole_writer=sole_writer)
    finally:
        _WRITERS.pop(writer.attempt, None)
