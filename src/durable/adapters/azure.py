"""Azure Blob Storage through adlfs (extra ``azure``), with the azure-storage-blob clients it holds.

Why not adlfs's file objects: leaving ``with fs.open(...)`` by an exception still commits
what was written. The adapter drives the async clients of ``fs.service_client`` itself:

- up to `SINGLE_PUT` bytes: one Put Blob with ``Content-MD5``;
- beyond: Put Block per `BLOCK` bytes as they arrive (each with ``Content-MD5``), and one
  Put Block List at commit. Until that list is committed the blocks are invisible; on abort
  there is nothing to remove (Azure discards uncommitted blocks after a week, or when the
  blob is next written).

Azure checks a request's ``Content-MD5`` and refuses a body that does not match (400
Md5Mismatch), so every byte is checked by the store on arrival. It does not check a
whole-blob MD5 given with a block list, so none is computed; our CRC32C goes into the
manifest as for every store. Create-only is ``If-None-Match: *``; reads send ``If-Match``
with the ETag seen at open, so a replaced blob fails the read (412).

Records in the blob's own metadata (docs/protocol.md, "Records in object metadata"): Put
Blob and Put Block List both set a blob's metadata with its bytes, so every write given a
record at commit publishes it in that same request (`_AzureAtomicFile.carries_record` is
always true) and no marker is written beside it. Azure metadata names are C# identifiers,
so the core's ``durable-size`` travels as ``durable_size`` and is read back as
``durable-size`` (`_to_azure`, `_record`); values pass through untouched, so the core judges
a hostile record. `info` (Get Blob Properties) and `open_whole` (one ranged GET, whose
headers carry the metadata) return the record. A single Put Blob answered with the MD5 of
the bytes sent needs no stat to verify it (`verify_written`).

A create-only write also names itself in the blob's metadata (``durable_write``): the SDK
retries a request whose answer was lost, and when the first attempt had landed, the store
refuses the retry (409). The blob is then read back, and if it carries this write's token
the write succeeded.

Names: adlfs reads a path as a URL (a trailing '#' or '?' dropped, "a?b#c" made "a#c?b"),
so a name it would change is a ValueError (`stripped`), never another blob.

Uploads left open: a writer killed after staging blocks leaves a blob of uncommitted blocks
only. It is invisible to reads and listings, but a listing that includes uncommitted blobs
shows it, and `list_uploads` returns it (as durable's when every block ID is one durable
names). Extra uncommitted blocks beside a committed blob (a killed overwrite) are not
listed: finding them takes a request per blob; Azure discards them a week after the last
block was staged, or when the blob is next written.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import io
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO

from azure.core import MatchConditions
from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    IncompleteReadError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestTimeoutError,
    ServiceResponseTimeoutError,
)
from azure.storage.blob import BlobBlock
from fsspec.asyn import sync

from durable._checksum import Checksum
from durable._errors import IntegrityError
from durable._protocol import META_PREFIX, record_fields
from durable.adapters._ranged import READ_AHEAD, open_pinned
from durable.adapters.base import (
    Adapter,
    AtomicFile,
    Capabilities,
    ObjectInfo,
    Upload,
    VerifyLevel,
    VersionMismatchError,
    caused_by,
    circling,
    exact_range,
    stripped,
    strong_etag,
)

__all__ = ["BLOCK", "SINGLE_PUT", "AzureAdapter"]

#: Size of a staged block.
BLOCK = 8 * 1024 * 1024
#: The largest blob written by one Put Blob. The SDK hands a Put Blob body to aiohttp as
#: bytes, which aiohttp warns about above 1 MiB; staged blocks go out as files.
SINGLE_PUT = 1024 * 1024
_MAX_BLOCKS = 50_000  # Azure's limit per blob: 50,000 x 8 MiB = 390 GiB
_IN_FLIGHT = 16  # requests at once, deleting or looking at uploads
#: Metadata naming the create-only write that put a blob there (a C# identifier, as Azure
#: wants metadata names).
_TOKEN = "durable_write"
#: A block ID as `_AzureAtomicFile` names them: the writer's random prefix, the block number.
_BLOCK_ID = re.compile(r"[0-9a-f]{16}-\d{6}")
#: The requests that write a blob: a 404 to one of them can only be a missing container.
_UPLOADS = frozenset({"upload_blob", "stage_block", "commit_block_list"})
_RANGE_TOTAL = re.compile(r"bytes \d+-\d+/(\d+)")
#: azure-storage-blob's wait for the next bytes of an answer, where the storage options set
#: no read_timeout (said in the error of a stalled request).
_READ_TIMEOUT = 60


def _error_code(exc: HttpResponseError) -> str | None:
    # Set by azure-storage-blob on the errors it raises; not declared on the class.
    code = getattr(exc, "error_code", None)
    # A StorageErrorCode (a str enum, whose str() is "StorageErrorCode.X") for the codes
    # the SDK knows: its value is the code Azure sent ("Md5Mismatch").
    return str(getattr(code, "value", code)) if code is not None else None


def _md5_refused(exc: HttpResponseError) -> bool:
    # Azure answers 400 Md5Mismatch; azurite 400 InvalidOperation "Provided contentMD5
    # doesn't match."
    return _error_code(exc) == "Md5Mismatch" or (
        exc.status_code == 400 and "md5" in str(exc.message).lower())


def _failure(url: str, what: str, exc: HttpResponseError) -> OSError:
    """The builtin a caller catches for a request Azure refused, naming the object, the
    request and the status, as the S3 adapter's are: the SDK's HttpResponseError is no
    OSError, so a scan or a `durable verify` aborted on the first 403 or 503 instead of
    listing that object as unreadable."""
    status = exc.status_code
    if status is None:
        # No status to judge: the SDK wraps a body that broke off (a stall past its read
        # timeout) in an HttpResponseError, which was said as "answered HTTP None".
        return _unanswered(url, what, exc)
    code = _error_code(exc)
    label = f"HTTP {status} {code}" if code else f"HTTP {status}"
    said = str(exc.message or exc.reason or "").strip().splitlines()
    text = f"{url}: {what} answered {label}: {said[0][:200] if said else ''}".rstrip(": ")
    if status in (401, 403):
        return PermissionError(text)
    if status == 404:
        return FileNotFoundError(text)
    return OSError(text)


def _unanswered(url: str, what: str, exc: AzureError) -> OSError:
    """The OSError for a request that got no (whole) answer on any of the SDK's retries (a
    dropped connection: ServiceRequestError / ServiceResponseError, no OSError), naming the
    blob; a TimeoutError where the store stalled past the read timeout."""
    said = " ".join(str(exc.message or exc).split())[:200]
    if _caused_by(exc, ServiceRequestTimeoutError, ServiceResponseTimeoutError, TimeoutError):
        return TimeoutError(f"{url}: {what} stalled: no data within the read timeout on "
                            f"any attempt (storage option read_timeout, {_READ_TIMEOUT} s "
                            f"unless set; {said})")
    return OSError(f"{url}: {what} failed: {type(exc).__name__}: {said}")


def _caused_by(exc: BaseException, *kinds: type[BaseException]) -> bool:
    # The SDK re-raises a transport failure inside its own errors: a body that ended early
    # as a plain HttpResponseError whose cause is the IncompleteReadError it made of
    # aiohttp's ClientPayloadError, a stall as one caused by a ServiceResponseTimeoutError.
    return caused_by(exc, lambda e: isinstance(e, kinds))


def _cut_short(exc: BaseException) -> bool:
    return _caused_by(exc, IncompleteReadError)


def _etag(value: object, url: str) -> str:
    """`strong_etag`, as on S3: a weak, empty or missing ETag (a proxy's rewrite) was quoted
    as it came ('"W/"0x.."', '"None"'), and the pinned read it made was refused by the
    store as if the blob had been replaced since it was opened."""
    return strong_etag(value, url)


def _timestamp(value: object) -> float | None:
    return value.timestamp() if isinstance(value, datetime.datetime) else None


def _is_folder(metadata: dict[str, str] | None) -> bool:
    # adlfs and ADLS Gen2 mark "directories" with an empty blob: not an object.
    return (metadata or {}).get("hdi_isfolder") == "true"


#: How the core's record names (``durable-size``) are spelt in Azure metadata, whose names
#: must be C# identifiers (a "-" is refused): ``durable_size``.
_AZURE_PREFIX = META_PREFIX.replace("-", "_")


def _to_azure(fields: Mapping[str, str]) -> dict[str, str]:
    """The core's record fields as Azure metadata names; values untouched."""
    return {key.replace("-", "_"): value for key, value in fields.items()}


def _record(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """A blob's ``durable_*`` metadata under the core's names (``durable-*``), values as
    stored: the exact inverse of `_to_azure`, since an Azure name never holds a "-"."""
    return record_fields({key.replace("_", "-") if key.lower().startswith(_AZURE_PREFIX)
                          else key: value for key, value in (metadata or {}).items()})


class _WrittenChecksum(Checksum):
    """The running size and CRC32C, and whether the store's answer proved the bytes."""

    __slots__ = ("proven",)

    def __init__(self) -> None:
        super().__init__()
        #: A single Put Blob answered with the MD5 of exactly the bytes sent (the store
        #: checked the Content-MD5 sent with them): `AzureAdapter.verify_written` needs no
        #: stat. False for a block list (its answer names no whole-blob digest) and for a
        #: retried create that found its own blob.
        self.proven = False


class _AzureAtomicFile(AtomicFile):
    def __init__(self, adapter: AzureAdapter, path: str, *, create_only: bool) -> None:
        super().__init__(path)
        self.checksum: _WrittenChecksum = _WrittenChecksum()
        self._adapter = adapter
        self._create_only = create_only
        # Names this write in the blob's metadata: a create-only request refused by a blob
        # carrying it was refused by this very write, landed by an earlier attempt whose
        # answer was lost (see `_landed`).
        self._token = {_TOKEN: uuid.uuid4().hex} if create_only else None
        self._buf = bytearray()
        self._blocks: list[str] = []
        # Block IDs are per blob, not per writer: a random prefix keeps two writers of one
        # name from overwriting each other's staged blocks. All IDs have the same length,
        # as Azure requires.
        self._prefix = uuid.uuid4().hex[:16]

    def _write(self, data: memoryview) -> None:
        self._buf += data
        # Strictly more than a block: the rest waits for commit, which then knows whether
        # one Put Blob can carry the whole blob.
        while len(self._buf) > BLOCK:
            self._stage(BLOCK)

    def _stage(self, n: int) -> None:
        if len(self._blocks) >= _MAX_BLOCKS:
            raise OSError(f"{self._adapter.url(self.path)}: over {_MAX_BLOCKS} blocks of "
                          f"{BLOCK} bytes, the most one Azure blob can hold")
        block_id = f"{self._prefix}-{len(self._blocks):06d}"  # the SDK base64-encodes it
        self._adapter._call(self.path, "stage_block", block_id, io.BytesIO(self._buf[:n]),
                            length=n, validate_content="md5")
        del self._buf[:n]
        self._blocks.append(block_id)

    @property
    def carries_record(self) -> bool:
        # Put Blob and Put Block List both set the blob's metadata with its bytes, and the
        # record is asked for only at commit, when size and CRC32C are known.
        return True

    def _commit(self) -> ObjectInfo:
        size = self.checksum.size
        # The record and the create-only token land with the bytes, in the same request.
        metadata = {**(self._token or {}), **_to_azure(self.record or {})}
        cond: dict[str, Any] = {"metadata": metadata} if metadata else {}
        if self._token is not None:
            cond["match_condition"] = MatchConditions.IfMissing  # If-None-Match: *
        try:
            if not self._blocks and len(self._buf) <= SINGLE_PUT:
                data = bytes(self._buf)
                reply = self._adapter._call(self.path, "upload_blob", data, length=len(data),
                                            blob_type="BlockBlob", overwrite=True,
                                            validate_content="md5", **cond)
                # The MD5 the store answers is of the bytes it stored: equal to ours, no
                # stat is needed to know it holds exactly what was sent.
                answered = reply.get("content_md5")
                self.checksum.proven = (answered is not None and
                                        bytes(answered) == hashlib.md5(data).digest())
            else:
                if self._buf:
                    self._stage(len(self._buf))
                reply = self._commit_blocks(cond)
        except FileExistsError as exc:
            reply = self._landed(exc)
        self._buf = bytearray()
        self._adapter.fs.invalidate_cache(self.path)
        return ObjectInfo(self.path, size, _etag(reply["etag"], self._adapter.url(self.path)),
                          _timestamp(reply.get("last_modified")),
                          dict(self.record) if self.record is not None else None)

    def _commit_blocks(self, cond: dict[str, Any]) -> Any:
        try:
            return self._adapter._call(self.path, "commit_block_list",
                                       [BlobBlock(block_id=b) for b in self._blocks], **cond)
        except OSError as exc:
            # `_call` made the SDK's HttpResponseError an OSError; the code is on its cause.
            refused = exc.__cause__
            if not (isinstance(refused, HttpResponseError)
                    and _error_code(refused) == "InvalidBlockList"):
                raise
            if self._create_only and self._adapter.info(self.path) is not None:
                raise self._adapter._exists_error(self.path) from None
            raise OSError(
                f"{self._adapter.url(self.path)}: the staged blocks were discarded before "
                "commit (another writer wrote this blob meanwhile); nothing was published"
            ) from exc

    def _landed(self, refused: FileExistsError) -> dict[str, Any]:
        """The blob's ETag if this write put it there, else ``refused`` is raised.

        A request whose answer was lost (a dropped connection) is sent again by the SDK; if
        the first attempt landed, the store refuses the retry (409: the blob exists), and a
        writer that committed would be told it lost.
        """
        try:
            props = self._adapter._call(self.path, "get_blob_properties")
        except ResourceNotFoundError:
            raise refused from None
        if self._token is None or (props.metadata or {}).get(_TOKEN) != self._token[_TOKEN]:
            raise refused
        return {"etag": props.etag, "last_modified": props.last_modified}

    def _abort(self) -> None:
        # Staged blocks are invisible until a block list names them: nothing to undo.
        self._buf = bytearray()
        self._blocks = []


class AzureAdapter(Adapter):
    protocols = ("abfs", "abfss", "az")
    capabilities = Capabilities(
        atomic_objects=True, create_only=True, durable=True, pinned_reads=True,
        note=("one Put Blob up to 1 MiB, else blocks staged as written and one Put Block "
              "List at commit; Content-MD5 on every upload request, checked by Azure "
              "(no whole-blob check of a block list); create-only by If-None-Match: *; "
              "reads pinned by If-Match on the ETag. Another writer's Put Blob to the same "
              "name discards our staged blocks: our commit then fails, publishing nothing; "
              "conditional writes (leases) by If-Match on Put Blob and Delete Blob; blobs "
              "of uncommitted blocks only are listed for `durable clean`; a blob's durable "
              "record travels in its metadata (durable_*), set by the Put Blob or Put Block "
              "List that publishes it"),
        conditional_writes=True, object_records=True,
    )

    # helpers --------------------------------------------------------------------------------
    def _split(self, path: str) -> tuple[str, str]:
        container, _, key = stripped(self.fs, path).lstrip("/").partition("/")
        return container, key

    @property
    def _timeouts(self) -> dict[str, Any]:
        # adlfs's storage options timeout, connection_timeout and read_timeout, which it
        # applies to its own requests only: a stalled read of ours waited the SDK's default
        # whatever the user set. Unset, the SDK's (read_timeout: 60 s between reads).
        return dict(getattr(self.fs, "_timeout_kwargs", None) or {})

    def _exists_error(self, path: str) -> FileExistsError:
        return FileExistsError(f"{self.url(path)} exists: create-only write refused by "
                               "the store (If-None-Match: *)")

    def _call(self, path: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``BlobClient.<method>`` on ``path``, with Azure's refusals as our errors."""
        container, key = self._split(path)

        async def run() -> Any:
            async with self.fs.service_client.get_blob_client(container, key) as client:
                return await getattr(client, method)(*args, **self._timeouts, **kwargs)

        try:
            return sync(self.fs.loop, run)
        except (ResourceExistsError, ResourceModifiedError):
            # 409 BlobAlreadyExists / 412 ConditionNotMet on an If-None-Match: * write.
            if "match_condition" in kwargs:
                raise self._exists_error(path) from None
            raise
        except HttpResponseError as exc:
            if _md5_refused(exc):
                url = self.url(path)
                raise IntegrityError(
                    f"{url}: the store refused the upload, its bytes do not match the "
                    f"Content-MD5 sent with them (corrupted in transit?): {exc.message}",
                    url=url, expected="the Content-MD5 sent", found="other bytes") from exc
            if isinstance(exc, ResourceNotFoundError):
                if _error_code(exc) == "ContainerNotFound" and method in _UPLOADS:
                    # The SDK's error (no OSError) named neither the blob nor the container:
                    # an entry's first write into a mistyped container.
                    raise FileNotFoundError(
                        f"{self.url(path)}: no such container {self._split(path)[0]!r} "
                        f"({method} answered 404 ContainerNotFound)") from None
                raise  # gone: each caller judges what that means
            raise _failure(self.url(path), method, exc) from exc
        except AzureError as exc:
            raise _unanswered(self.url(path), method, exc) from exc

    # writing --------------------------------------------------------------------------------
    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        self._split(path)  # a name adlfs would change: refused before any byte is taken
        return _AzureAtomicFile(self, path, create_only=create_only)

    # reading --------------------------------------------------------------------------------
    def info(self, path: str) -> ObjectInfo | None:
        if not self._split(path)[1] or path.endswith("/"):
            return None
        try:
            props = self._call(path, "get_blob_properties")
        except ResourceNotFoundError:
            return None
        if _is_folder(props.metadata):
            return None
        return ObjectInfo(path, int(props.size), _etag(props.etag, self.url(path)),
                          _timestamp(props.last_modified), _record(props.metadata))

    def _listing(self, prefix: str, limit: int | None = None) -> dict[str, ObjectInfo]:
        container, key = self._split(prefix.rstrip("/") + "/")

        async def run() -> dict[str, ObjectInfo]:
            out: dict[str, ObjectInfo] = {}
            async with self.fs.service_client.get_container_client(container) as client:
                async for blob in client.list_blobs(name_starts_with=key,
                                                    include=["metadata"], **self._timeouts):
                    if _is_folder(blob.metadata) or blob.name.endswith("/"):
                        continue
                    if blob.name[len(key):] in out:  # the SDK's pager would go on for ever
                        raise circling(self.url(prefix), self.url(f"{container}/{blob.name}"))
                    out[blob.name[len(key):]] = ObjectInfo(
                        f"{container}/{blob.name}", int(blob.size),
                        _etag(blob.etag, self.url(f"{container}/{blob.name}")),
                        _timestamp(blob.last_modified))
                    if limit is not None and len(out) >= limit:
                        break
            return out

        result: dict[str, ObjectInfo] = self._list_run(prefix, run)
        return result

    def _list_run(self, prefix: str, run: Callable[[], Awaitable[Any]]) -> Any:
        """``run()`` (a listing below ``prefix``) on the filesystem's loop, with Azure's
        refusals as our errors: the SDK's own (no OSError) named nothing, and stopped a
        `durable clean` (the store's clock, uploads left open) on the first 403 or 503."""
        container = self._split(prefix.rstrip("/") + "/")[0]
        try:
            return sync(self.fs.loop, run)
        except ResourceNotFoundError as exc:
            # A missing container is a configuration error, not an empty listing (which
            # would make every entry in it look ABSENT).
            raise FileNotFoundError(f"{self.url(container)}: no such container") from exc
        except HttpResponseError as exc:
            raise _failure(self.url(prefix), "listing", exc) from exc
        except AzureError as exc:
            raise _unanswered(self.url(prefix), "listing", exc) from exc
        except AttributeError as exc:
            # The SDK's pager on an answer that is no blob listing (an error page a gateway
            # serves as 200 parses to no segment): "'NoneType' object has no attribute
            # 'blob_items'", naming nothing.
            url = self.url(prefix)
            raise IntegrityError(f"{url}: the listing's answer is not a blob listing ({exc}; "
                                 "an error page served as 200?)", url=url,
                                 expected="EnumerationResults", found=str(exc)) from exc

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        return dict(sorted(self._listing(prefix).items()))

    def exists(self, path: str) -> bool:
        return self.info(path) is not None or bool(self._listing(path, limit=1))

    def _download(self, path: str, start: int, length: int,
                  **pin: Any) -> tuple[Any, bytes]:
        """One ranged GET (``pin``: its If-Match): the blob's properties as its headers
        gave them, and the body read whole. A body that ended early on every attempt is
        an IntegrityError, never short data."""
        url = self.url(path)

        async def run() -> tuple[Any, bytes]:
            container, key = self._split(path)
            answered: list[Any] = []  # each attempt's response, the SDK's retries' too
            try:
                async with self.fs.service_client.get_blob_client(container, key) as client:
                    stream = await client.download_blob(
                        offset=start, length=length, **pin, **self._timeouts,
                        raw_response_hook=answered.append)
                    data: bytes = await stream.readall()
                    return stream.properties, data
            finally:
                # azure-core closes a response whose body failed, but not one whose body
                # stalled past the read timeout, and the SDK tries again: each stalled
                # attempt held its connection open until exit ("Unclosed response").
                # (Closing a response read to its end is a no-op.)
                for response in answered:
                    response.http_response.internal_response.close()

        what = f"GET of bytes {start}-{start + length - 1}"
        try:
            result: tuple[Any, bytes] = sync(self.fs.loop, run)
        except HttpResponseError as exc:
            if not _cut_short(exc):
                if isinstance(exc, ResourceNotFoundError | ResourceModifiedError) \
                        or exc.status_code == 416:
                    raise  # gone, replaced, or an empty blob: each caller judges these
                raise _failure(url, what, exc) from exc
            # The body ended before its Content-Length on every retry the SDK made.
            raise IntegrityError(
                f"{url}: bytes {start}-{start + length - 1} arrived short on every "
                f"attempt ({exc.message})", url=url, expected=length,
                found="a short body") from exc
        except AzureError as exc:
            raise _unanswered(url, what, exc) from exc
        except ValueError as exc:
            if "Content-Range" not in str(exc):
                raise
            # The SDK's check of a ranged answer: a 200 with the whole object, or an error
            # page a gateway serves as 200, is not the range asked for.
            raise IntegrityError(
                f"{url}: the {what} was answered without a usable Content-Range ({exc}): "
                "not the range asked for (an error page, or the whole object, served as "
                "200?)", url=url, expected=f"bytes {start}-{start + length - 1}",
                found="no Content-Range") from exc
        return result

    def open_read(self, path: str, info: ObjectInfo) -> BinaryIO:
        return self._reader(path, info, b"")

    def read_range(self, path: str, info: ObjectInfo, start: int, length: int) -> bytes:
        # One GET of exactly the range (a reader would fetch a read-ahead block).
        want = max(0, min(length, info.size - start))
        data = self._fetcher(path, info, b"")(start, want) if want else b""
        return exact_range(self.url(path), data, start, want)

    def _reader(self, path: str, info: ObjectInfo, first: bytes) -> BinaryIO:
        """A reader of the version ``info`` names; ``first``: its bytes from 0, already
        fetched (by `open_whole`), handed out before any further (pinned) GET."""
        return open_pinned(self.url(path), info.size, self._fetcher(path, info, first))

    def _fetcher(self, path: str, info: ObjectInfo, first: bytes
                 ) -> Callable[[int, int], bytes]:
        """``fetch(start, length)``: one GET of those bytes of the version ``info`` names
        (If-Match its ETag); ``first``, bytes from 0 already fetched, served once."""
        url = self.url(path)
        pin: dict[str, Any] = {}
        if info.version is not None:
            pin = {"etag": info.version, "match_condition": MatchConditions.IfNotModified}
        held = [first]

        def fetch(start: int, length: int) -> bytes:
            if start == 0 and held[0]:
                # Dropped once used: a later seek back asks the store again, pinned.
                head, held[0] = held[0][:length], b""
                if len(head) == length:
                    return head
                return head + fetch(len(head), length - len(head))
            try:
                props, data = self._download(path, start, length, **pin)
            except (ResourceModifiedError, ResourceNotFoundError) as exc:
                # 412 on If-Match: the blob is another version now; 404: it is gone.
                raise IntegrityError(
                    f"{url}: replaced or deleted since it was opened (ETag {info.version} "
                    "no longer matches)", url=url, expected=info.version,
                    found="another ETag or none") from exc
            # Checked here too, as on S3: an endpoint that ignores If-Match would serve
            # another version's bytes after the first read-ahead silently.
            served = _etag(props.etag, url)
            if info.version is not None and served != info.version:
                raise IntegrityError(f"{url}: replaced since it was opened (the GET of "
                                     f"bytes {start}-{start + length - 1} served ETag "
                                     f"{served}, opened at {info.version})", url=url,
                                     expected=info.version, found=served)
            return data

        return fetch

    def open_whole(self, path: str) -> tuple[ObjectInfo, BinaryIO] | None:
        """One GET of the first `READ_AHEAD` bytes: its headers give the info (the
        metadata record included), its body the start of the reader; the rest (a blob
        over 8 MiB) is read on, pinned to that ETag. An empty blob refuses any range
        (416): a stat answers it instead."""
        if not self._split(path)[1] or path.endswith("/"):
            return None
        try:
            props, first = self._download(path, 0, READ_AHEAD)
        except ResourceNotFoundError:
            return None
        except HttpResponseError as exc:
            if exc.status_code != 416:  # InvalidRange (the SDK sets no error_code here)
                raise
            return super().open_whole(path)
        if _is_folder(props.metadata):
            return None
        # The blob's size is the total of the Content-Range (``props.size`` is the range's).
        total = _RANGE_TOTAL.fullmatch(str(props.content_range or ""))
        if total is None:
            url = self.url(path)
            raise IntegrityError(f"{url}: a ranged GET answered Content-Range "
                                 f"{props.content_range!r:.80}, not bytes A-B/SIZE", url=url,
                                 expected="bytes A-B/SIZE", found=props.content_range)
        info = ObjectInfo(path, int(total[1]), _etag(props.etag, self.url(path)),
                          _timestamp(props.last_modified), _record(props.metadata))
        return info, self._reader(path, info, first)

    # verifying -------------------------------------------------------------------------------
    def verify_written(self, path: str, checksum: Checksum, level: VerifyLevel) -> None:
        """See `Adapter.verify_written`. A single Put Blob whose answer carried the MD5 of
        the bytes sent meets ``"size"`` and ``"probe"`` with no request: the store checked
        the Content-MD5 sent with them and reports the digest of what it stored. A block
        list (no whole-blob digest in its answer) keeps the stat."""
        if level in ("size", "probe") and isinstance(checksum, _WrittenChecksum) \
                and checksum.proven:
            return
        super().verify_written(path, checksum, level)

    # the store's clock; uploads left open -------------------------------------------------
    def now(self, path: str) -> float | None:
        """The Date of the store's answer to a one-blob listing next to ``path``."""
        container, key = self._split(path)
        seen: list[str] = []

        def note(response: Any) -> None:
            seen.append(str(response.http_response.headers.get("Date", "")))

        async def run() -> None:
            async with self.fs.service_client.get_container_client(container) as client:
                pages = client.list_blobs(name_starts_with=key, results_per_page=1,
                                          raw_response_hook=note).by_page()
                async for _ in pages:
                    break

        self._list_run(path, run)
        try:
            return parsedate_to_datetime(seen[0]).timestamp() if seen else None
        except (TypeError, ValueError):
            return None  # no Date, or a malformed one: ages fall back to this machine's clock

    def list_uploads(self, prefix: str) -> Sequence[Upload]:
        """Blobs below ``prefix`` that have staged blocks and were never committed.

        One listing that includes uncommitted blobs; each empty blob in it is looked at
        (a stat, and its uncommitted block list): an uncommitted blob lists as empty.
        """
        container, key = self._split(prefix.rstrip("/") + "/")

        async def one(client: Any, name: str, listed: float | None) -> Upload | None:
            blob = client.get_blob_client(name)
            try:
                await blob.get_blob_properties()
                return None  # a committed (empty) blob: not an upload
            except ResourceNotFoundError:
                pass
            try:
                _, uncommitted = await blob.get_block_list("uncommitted")
            except ResourceNotFoundError:
                return None  # gone since the listing
            ids = [str(b.id) for b in uncommitted]
            if not ids:
                return None
            ours = all(_BLOCK_ID.fullmatch(i) for i in ids)
            writers = sorted({i.partition("-")[0] for i in ids}) if ours else []
            label = ",".join(writers) if ours else f"{len(ids)} uncommitted blocks"
            return Upload(f"{container}/{name}", label, listed, ours=ours)

        async def run() -> list[Upload]:
            limit = asyncio.Semaphore(_IN_FLIGHT)
            async with self.fs.service_client.get_container_client(container) as client:
                empty = [(b.name, _timestamp(b.last_modified)) async for b in client.list_blobs(
                    name_starts_with=key, include=["uncommittedblobs", "metadata"])
                    if int(b.size) == 0 and not _is_folder(b.metadata)]

                async def gated(name: str, listed: float | None) -> Upload | None:
                    async with limit:
                        return await one(client, name, listed)

                found = await asyncio.gather(*(gated(n, t) for n, t in empty))
            return [u for u in found if u is not None]

        uploads: list[Upload] = self._list_run(prefix, run)
        return uploads

    def abort_upload(self, upload: Upload) -> None:
        """Delete the uncommitted blob, and its blocks with it; a blob committed since it was
        listed (its writer was alive after all) is left as it is."""
        if upload.initiated is None:
            raise ValueError(f"{self.url(upload.path)}: an upload without its listed time "
                             "cannot be aborted safely")
        listed = datetime.datetime.fromtimestamp(upload.initiated, datetime.UTC)
        # If-Unmodified-Since the listed time: a commit since then moved Last-Modified on
        # (412), and a committed blob is never deleted here. Gone (404) is fine too. (Times
        # are whole seconds: only a commit within the listed second would pass, and clean
        # lists nothing that young unless told --older-than below a second.)
        with contextlib.suppress(ResourceNotFoundError, ResourceModifiedError):
            self._call(upload.path, "delete_blob", if_unmodified_since=listed)
        self.fs.invalidate_cache(upload.path)

    # conditional writes (leases): If-Match, enforced by Azure and azurite (412) ------------
    def supports_conditional(self, path: str) -> bool:
        return True

    def _mismatch(self, path: str, version: str) -> VersionMismatchError:
        url = self.url(path)
        return VersionMismatchError(f"{url}: not at ETag {version} (If-Match refused)",
                                    url=url, expected=version, found=None)

    def replace_if(self, path: str, data: bytes, version: str) -> ObjectInfo:
        if len(data) > SINGLE_PUT:
            raise ValueError(f"{self.url(path)}: conditional writes are single Put Blobs, "
                             f"up to {SINGLE_PUT} bytes")
        try:
            reply = self._call(path, "upload_blob", data, length=len(data),
                               blob_type="BlockBlob", overwrite=True, validate_content="md5",
                               etag=version, match_condition=MatchConditions.IfNotModified)
        except (FileExistsError, ResourceNotFoundError):
            raise self._mismatch(path, version) from None
        self.fs.invalidate_cache(path)
        return ObjectInfo(path, len(data), _etag(reply["etag"], self.url(path)))

    def delete_if(self, path: str, version: str) -> None:
        try:
            self._call(path, "delete_blob", etag=version,
                       match_condition=MatchConditions.IfNotModified)
        except (FileExistsError, ResourceNotFoundError):
            raise self._mismatch(path, version) from None
        self.fs.invalidate_cache(path)

    # removing -------------------------------------------------------------------------------
    def delete(self, paths: Iterable[str]) -> None:
        keys = [self._split(p) for p in paths]
        keys = [(c, k) for c, k in keys if k]  # a bare container is never deleted here
        if keys:
            sync(self.fs.loop, self._delete_all, keys)
            for container, key in keys:
                self.fs.invalidate_cache(f"{container}/{key}")

    async def _delete_all(self, keys: Sequence[tuple[str, str]]) -> None:
        limit = asyncio.Semaphore(_IN_FLIGHT)

        async def one(container: str, key: str) -> None:
            async with limit, self.fs.service_client.get_blob_client(container, key) as c:
                try:
                    await c.delete_blob(delete_snapshots="include", **self._timeouts)
                except ResourceNotFoundError:
                    pass  # gone already: what a delete wants
                except HttpResponseError as exc:
                    # The SDK's error (no OSError) named no blob: a cleanup's 403 was opaque.
                    raise _failure(self.url(f"{container}/{key}"), "delete_blob", exc
                                   ) from exc
                except AzureError as exc:
                    raise _unanswered(self.url(f"{container}/{key}"), "delete_blob", exc
                                      ) from exc

        await asyncio.gather(*(one(c, k) for c, k in keys))

    def delete_prefix(self, prefix: str) -> None:
        paths = [info.path for info in self._listing(prefix).values()]
        self.delete([prefix.rstrip("/"), *paths])
