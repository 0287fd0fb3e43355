"""The reading side of `durable.zarr`: `VerifyingStore`, a read-only view of a COMPLETE entry.

Every key is checked against the entry's manifest: a listed chunk must be there with its
recorded size and CRC32C (a missing one is an IntegrityError, never fill values); a key the
manifest does not list is the fill value if absent and an IntegrityError if present (it is
not part of the commit). The check is a dict lookup and a CRC32C of bytes already fetched,
never a second request. Listings come from the manifest, so they cost nothing and show only
what was committed.

Byte-range reads (sharding) cannot be checked against a whole object's CRC32C. They are
pinned instead: at the first range read of an object, the store stats it, then reads the
entry's marker again; a marker still of the commit opened shows that the version stat'ed
is the committed one (a rewrite removes the marker before it changes any data). Every
range read of that object is then asked of that version only (a local file checked by its
inode and mtime, If-Match its ETag or generation on a store), so the index of one commit
and the chunks of another are never decoded together: an object of another commit is an
IntegrityError naming the rewrite. The bytes of a range are checked for length; their
content is vouched for by the version, not by a CRC32C (``checksum_codec=True`` or
``verify(deep=True)`` check it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Iterable,
    Iterator,
    Mapping,
)
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from durable._checksum import crc32c, crc_to_hex
from durable._entry import Entry
from durable._errors import DurableError, IntegrityError
from durable._protocol import ObjectRecord
from durable.adapters import ObjectInfo

if TYPE_CHECKING:
    from zarr.abc.buffer import Buffer
    from zarr.core.buffer import BufferPrototype

__all__ = ["VerifyingStore", "get_whole", "inner_store"]


def inner_store(url: str, storage_options: Mapping[str, Any] | None, *,
                read_only: bool) -> Store:
    """The zarr store a plain reader would use for ``url``: LocalStore or FsspecStore."""
    entry = Entry(url, storage_options=dict(storage_options or {}))
    if entry.adapter.name == "local":
        return LocalStore(entry.path, read_only=read_only)
    # No listings cache: other processes (and durable's own adapter, another filesystem
    # instance) change the staging area and the entry; a cached listing of them makes an
    # object that was moved look present, and metadata would be lost.
    options = {"use_listings_cache": False, **(storage_options or {})}
    return FsspecStore.from_url(entry.url, storage_options=options, read_only=read_only)


async def get_whole(store: Store, key: str, prototype: BufferPrototype) -> Buffer | None:
    """The whole object in one request: s3fs and its kin HEAD before every plain GET (and
    HEAD and LIST for a missing key); a GET of ``bytes=0-`` is one request either way."""
    if isinstance(store, FsspecStore):
        return await store.get(key, prototype, OffsetByteRequest(0))
    return await store.get(key, prototype)


_T = TypeVar("_T")


def read_failure(url: str, exc: Exception) -> OSError:
    """The error for a chunk read the store or its client refused, naming the chunk: the
    clients' own errors name none (s3fs's PermissionError says "Access Denied"), and
    some are no OSError (aiohttp's ClientPayloadError for a body cut short, botocore's
    FlexibleChecksumError, azure's HttpResponseError)."""
    said = " ".join(str(exc).split())[:300] or type(exc).__name__
    text = f"{url}: the read failed ({type(exc).__name__}: {said}); nothing was returned"
    # The core imports no cloud library: their refusals are told by what they carry.
    status = getattr(exc, "status_code", None) or getattr(exc, "code", None)
    if isinstance(exc, PermissionError) or status in (401, 403) \
            or str(exc).startswith("Forbidden"):
        return PermissionError(text)
    if "ChecksumError" in type(exc).__name__:  # the body against the store's own checksum
        return IntegrityError(text, url=url, expected="the store's checksum",
                              found="other bytes")
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(text)
    return OSError(text)


_MANIFESTS: dict[tuple[str, str], Mapping[str, ObjectRecord]] = {}
_MANIFESTS_KEPT = 16
_MANIFESTS_LOCK = threading.Lock()


class _Unpickled(Mapping[str, ObjectRecord]):
    """The manifest of an unpickled store, read when first looked at (once per process and
    commit), not while the store is unpickled: distributed's scheduler unpickles every
    task graph, and a marker read there failed a compute of an entry changed since its
    open as a RuntimeError about "different environments" (not the IntegrityError or
    IncompleteError a caller catches), and needed the store's credentials."""

    def __init__(self, url: str, attempt: str, storage_options: dict[str, Any]) -> None:
        self._key = (url, attempt)
        self._storage_options = storage_options
        self._objects: Mapping[str, ObjectRecord] | None = _MANIFESTS.get(self._key)

    @property
    def loaded(self) -> bool:
        return self._objects is not None

    def load(self) -> Mapping[str, ObjectRecord]:
        if self._objects is None:
            url, attempt = self._key
            opened = VerifyingStore.from_url(url, attempt=attempt,
                                             storage_options=self._storage_options)
            with _MANIFESTS_LOCK:  # loads of several tasks' stores, at once in threads
                if len(_MANIFESTS) >= _MANIFESTS_KEPT:
                    _MANIFESTS.pop(next(iter(_MANIFESTS)))
                self._objects = _MANIFESTS[self._key] = opened.manifest
        return self._objects

    def __getitem__(self, key: str) -> ObjectRecord:
        return self.load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.load())

    def __len__(self) -> int:
        return len(self.load())


def _span(rec: ObjectRecord, byte_range: ByteRequest) -> tuple[int, int]:
    """(start, length) of ``byte_range`` in an object of the recorded size."""
    if isinstance(byte_range, RangeByteRequest):
        start = min(byte_range.start, rec.size)
        return start, max(0, min(byte_range.end, rec.size) - start)
    if isinstance(byte_range, OffsetByteRequest):
        start = min(byte_range.offset, rec.size)
        return start, rec.size - start
    if isinstance(byte_range, SuffixByteRequest):
        length = min(byte_range.suffix, rec.size)
        return rec.size - length, length
    raise TypeError(f"unexpected byte range {byte_range!r}")


def _expected_length(rec: ObjectRecord, byte_range: ByteRequest) -> int:
    return _span(rec, byte_range)[1]


class _MarkerLook:
    """One read of the entry's marker that every caller whose stat ended before it began
    may share (the stats of many shards, confirmed by one request)."""

    def __init__(self) -> None:
        self.started = False
        self.done = threading.Event()
        self.error: BaseException | None = None


#: Range reads of pinned versions run here: zarr asks for many at once (the inner chunks
#: of a shard), and the default executor has a thread per core and four more.
_RANGE_POOL = ThreadPoolExecutor(32, thread_name_prefix="durable-zarr-range")


class VerifyingStore(WrapperStore[Store]):
    """A read-only view of a COMPLETE entry that checks every key against its manifest."""

    supports_writes = False
    supports_deletes = False
    supports_listing = True

    def __init__(self, store: Store, *, url: str, attempt: str,
                 manifest: Mapping[str, ObjectRecord],
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(store)
        self._url = url
        self._attempt = attempt
        self._manifest = manifest
        self._storage_options = dict(storage_options or {})
        # Range reads: the version of each object read by ranges, confirmed committed.
        self._entry: Entry | None = None
        self._pins: dict[str, ObjectInfo] = {}
        self._look: _MarkerLook | None = None
        self._look_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None = None,
                 attempt: str | None = None) -> VerifyingStore:
        """The verifying store of the COMPLETE entry at ``url`` (IncompleteError if not).

        ``attempt``: the commit the caller opened before; a different one is an
        IntegrityError (the entry was rewritten since).
        """
        entry = Entry(url, storage_options=storage_options)
        marker = entry.require_complete()
        if attempt is not None and marker.attempt != attempt:
            raise IntegrityError(
                f"{entry.url} was committed again (attempt {marker.attempt}) since it was "
                f"opened (attempt {attempt})", url=entry.url, expected=attempt,
                found=marker.attempt)
        assert marker.manifest is not None
        return cls(inner_store(entry.url, storage_options, read_only=True), url=entry.url,
                   attempt=marker.attempt, manifest=marker.manifest.objects,
                   storage_options=storage_options)

    @property
    def manifest(self) -> Mapping[str, ObjectRecord]:
        return self._manifest

    def __getstate__(self) -> dict[str, Any]:
        # The manifest is not pickled (100,000 chunks make megabytes per task): a worker
        # reads the marker once per process and holds it to the same commit.
        return {"url": self._url, "attempt": self._attempt,
                "storage_options": self._storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        url, attempt, options = state["url"], state["attempt"], state["storage_options"]
        self.__init__(inner_store(url, options, read_only=True),  # type: ignore[misc]
                      url=url, attempt=attempt, manifest=_Unpickled(url, attempt, options),
                      storage_options=options)

    async def _loaded(self) -> None:
        """The manifest read, off the event loop, if this store was unpickled."""
        if isinstance(self._manifest, _Unpickled) and not self._manifest.loaded:
            await asyncio.to_thread(self._manifest.load)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, VerifyingStore) and self._url == other._url
                and self._attempt == other._attempt)

    def __hash__(self) -> int:
        return hash((self._url, self._attempt))

    def __dask_tokenize__(self) -> tuple[str, str, str]:
        return ("durable.zarr.VerifyingStore", self._url, self._attempt)

    def __repr__(self) -> str:
        return f"VerifyingStore({self._url!r}, attempt={self._attempt!r})"

    __str__ = __repr__

    def _with_store(self, store: Store) -> VerifyingStore:
        return type(self)(store, url=self._url, attempt=self._attempt,
                          manifest=self._manifest, storage_options=self._storage_options)

    def with_read_only(self, read_only: bool = False) -> VerifyingStore:
        if not read_only:
            raise ValueError(f"{self._url}: a verifying store is read-only; change the entry "
                             "with durable.zarr.writing(url, update=True)")
        return self

    @property
    def read_only(self) -> bool:
        return True

    def _check_writable(self) -> None:
        raise ValueError(f"{self._url}: store is read-only (a COMPLETE entry; change it with "
                         "durable.zarr.writing(url, update=True))")

    # reads ---------------------------------------------------------------------------------
    def _chunk_url(self, key: str) -> str:
        return f"{self._url}/{key}"

    def _check(self, key: str, buf: Buffer | None,
               byte_range: ByteRequest | None) -> Buffer | None:
        rec = self._manifest.get(key)
        if rec is None:
            if buf is None:
                return None  # never written, or deleted as all fill value: zarr's meaning
            raise IntegrityError(
                f"{self._chunk_url(key)}: present but not in the manifest of commit "
                f"{self._attempt}: not part of what was committed",
                url=self._chunk_url(key), expected="absent (fill value)",
                found="an object not in the manifest")
        if buf is None:
            raise IntegrityError(
                f"{self._chunk_url(key)}: missing; the manifest of commit {self._attempt} "
                f"recorded {rec.size} bytes (a missing chunk is never read as fill values)",
                url=self._chunk_url(key), expected=rec.size, found="missing")
        view = memoryview(buf.as_buffer_like()).cast("B")
        if byte_range is not None:
            want = _expected_length(rec, byte_range)
            if view.nbytes != want:
                raise IntegrityError(
                    f"{self._chunk_url(key)}: {byte_range} returned {view.nbytes} bytes, "
                    f"expected {want} of the recorded {rec.size}",
                    url=self._chunk_url(key), expected=want, found=view.nbytes)
            return buf
        if view.nbytes != rec.size:
            raise IntegrityError(
                f"{self._chunk_url(key)}: {view.nbytes} bytes, the manifest recorded "
                f"{rec.size}", url=self._chunk_url(key), expected=rec.size,
                found=view.nbytes)
        found = ObjectRecord.of(view.nbytes, crc32c(view), view)
        if not rec.matches(found):
            # Under the residue, the tail: another chunk of this size (a straggler of
            # another attempt) passes the CRC32C and the codec's own check.
            shown = found.checksum_text() if rec.tail is not None else crc_to_hex(found.crc32c)
            raise IntegrityError(
                f"{self._chunk_url(key)}: CRC32C {shown}, the manifest recorded "
                f"{rec.checksum_text()} ({rec.size} bytes)", url=self._chunk_url(key),
                expected=rec.checksum_text(), found=shown)
        return buf

    async def _fetched(self, what: str, read: Awaitable[_T]) -> _T:
        try:
            return await read
        except DurableError:
            raise
        except Exception as exc:
            raise read_failure(self._chunk_url(what), exc) from exc

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        await self._loaded()
        if byte_range is None:
            buf = await self._fetched(key, get_whole(self._store, key, prototype))
            try:
                return self._check(key, buf, None)
            except IntegrityError as exc:
                if key not in self._manifest:
                    raise
                # A chunk of another commit: said as the rewrite it is, where it is one.
                rewritten = await asyncio.get_running_loop().run_in_executor(
                    _RANGE_POOL, self._rewritten, key)
                if rewritten is None:
                    raise
                raise rewritten from exc
        if key in self._manifest:
            return self._check(key, await self._fetched(
                key, self._pinned_range(key, prototype, byte_range)), byte_range)
        return self._check(key, await self._fetched(
            key, self._store.get(key, prototype, byte_range)), byte_range)

    # range reads, pinned to the committed version (module doc) ---------------------------
    def _entry_of(self) -> Entry:
        if self._entry is None:
            self._entry = Entry(self._url, storage_options=self._storage_options)
        return self._entry

    async def _pinned_range(self, key: str, prototype: BufferPrototype,
                            byte_range: ByteRequest) -> Buffer:
        start, length = _span(self._manifest[key], byte_range)
        loop = asyncio.get_running_loop()
        entry = self._entry_of()
        path = f"{entry.path}/{key}"
        info = self._pins.get(key)
        try:
            if info is not None:
                data = await loop.run_in_executor(_RANGE_POOL, entry.adapter.read_range,
                                                  path, info, start, length)
            else:
                # The first range of this object: stat'ed, then read while the marker is
                # read again (after the stat, as the range is): the bytes go out only once
                # the marker shows the version stat'ed is the committed one.
                info = await loop.run_in_executor(_RANGE_POOL, self._stat, key)
                data, problem = await asyncio.gather(
                    loop.run_in_executor(_RANGE_POOL, entry.adapter.read_range, path, info,
                                         start, length),
                    loop.run_in_executor(_RANGE_POOL, self._confirm_commit, key))
                if problem is not None:
                    raise problem
                self._pins.setdefault(key, info)
        except IntegrityError as exc:
            # "replaced since it was listed": the version pinned is gone; a rewrite's
            # doing where the marker changed, else the error as it is.
            raise self._rewritten(key) or exc from exc
        return prototype.buffer.from_bytes(data)

    def _stat(self, key: str) -> ObjectInfo:
        """The version of ``key`` now, if it has the size the manifest records."""
        entry = self._entry_of()
        rec = self._manifest[key]
        info = entry.adapter.info(f"{entry.path}/{key}")
        if info is None or info.size != rec.size:
            # Not the committed object: a rewrite (said as such), else damage.
            raise self._rewritten(key) or IntegrityError(
                f"{self._chunk_url(key)}: the manifest of commit {self._attempt} recorded "
                f"{rec.size} bytes, the store has "
                f"{'none' if info is None else info.size}", url=self._chunk_url(key),
                expected=rec.size, found="missing" if info is None else info.size)
        return info

    def _confirm_commit(self, key: str) -> IntegrityError | None:
        """The rewrite error unless the marker, read after the caller's stat, is still
        the commit opened (one read shared by every caller waiting when it starts)."""
        with self._look_lock:
            look = self._look
            mine = look is None or look.started
            if mine:
                look = self._look = _MarkerLook()
        assert look is not None
        if not mine:
            look.done.wait()
            return self._rewritten(key) if look.error is not None else None
        with self._look_lock:
            look.started = True
        try:
            look.error = self._rewritten(key)
        except BaseException as exc:
            look.error = exc
            raise
        finally:
            look.done.set()
        return look.error if isinstance(look.error, IntegrityError) else None

    def _rewritten(self, key: str) -> IntegrityError | None:
        """The error for a read of ``key`` after the entry was committed again (or while it
        is being rewritten: no marker); None while the marker is the commit opened."""
        # Its attempt alone: an external manifest is not fetched (and parsed) for it.
        marker = self._entry_of()._read_record(look=False, lazy=True)[0]
        if marker is not None and marker.attempt == self._attempt:
            return None
        now = "no commit (being rewritten)" if marker is None else f"commit {marker.attempt}"
        return IntegrityError(
            f"{self._chunk_url(key)}: the entry was rewritten since it was opened (commit "
            f"{self._attempt} at the open, {now} now): its bytes are not those of the "
            "commit opened; open it again", url=self._chunk_url(key), expected=self._attempt,
            found=None if marker is None else marker.attempt)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]
                                 ) -> list[Buffer | None]:
        await self._loaded()
        key_ranges = list(key_ranges)
        if any(r is not None and k in self._manifest for k, r in key_ranges):
            # Ranges of committed objects: each pinned, as `get` reads them.
            return list(await asyncio.gather(*(self.get(k, prototype, r)
                                               for k, r in key_ranges)))
        keys = sorted({k for k, _ in key_ranges})
        bufs = await self._fetched(keys[0] if len(keys) == 1 else "{" + ",".join(keys) + "}",
                                   self._store.get_partial_values(prototype, key_ranges))
        return [self._check(k, b, r) for (k, r), b in zip(key_ranges, bufs, strict=True)]

    async def _get_many(self, requests: Iterable[tuple[str, BufferPrototype,
                                                         ByteRequest | None]]
                        ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        for key, prototype, byte_range in requests:
            yield key, await self.get(key, prototype, byte_range)

    async def getsize(self, key: str) -> int:
        await self._loaded()
        rec = self._manifest.get(key)
        if rec is None:
            raise FileNotFoundError(self._chunk_url(key))
        return rec.size

    # listings: from the manifest, so they cost nothing and show only what was committed ---
    async def exists(self, key: str) -> bool:
        await self._loaded()
        return key in self._manifest

    async def is_empty(self, prefix: str) -> bool:
        async for _ in self.list_prefix(prefix):
            return False
        return True

    async def list(self) -> AsyncIterator[str]:
        await self._loaded()
        for key in self._manifest:
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        await self._loaded()
        for key in self._manifest:
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        head = prefix + "/" if prefix else ""
        seen: set[str] = set()
        await self._loaded()
        for key in self._manifest:
            if key.startswith(head) and key != prefix:
                child = key[len(head):].split("/", 1)[0]
                if child not in seen:
                    seen.add(child)
                    yield child

    # writes: refused -------------------------------------------------------------------------
    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        self._check_writable()

    async def delete(self, key: str) -> None:
        self._check_writable()

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()

    async def clear(self) -> None:
        self._check_writable()


