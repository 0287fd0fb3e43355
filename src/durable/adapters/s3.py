"""Amazon S3 and S3-compatible stores (R2, MinIO, AIStore, ...), through s3fs's own client.

Every request goes through ``fs._call_s3`` on s3fs's event loop, so credentials, endpoints,
botocore's retry configuration and every other storage option work as they do for s3fs.
s3fs's caches are never consulted: a listing or stat is always a fresh request (incident 000).

Writes: up to ``part_size`` (8 MiB) the bytes are buffered and sent as one PutObject at
commit; beyond it, a multipart upload whose parts go out as the buffer fills (up to
``max_in_flight`` at once) and which is completed only at `commit`. Anything else (an
exception, KeyboardInterrupt, close() without commit, garbage collection) aborts it: s3fs's
own file publishes what was written when an exception leaves ``with fs.open(...)``.

Checksums: the CRC32C of every part and of the whole object is sent (``x-amz-checksum-
crc32c``, and a FULL_OBJECT checksum plus ``x-amz-mp-object-size`` on completion), so a
store that validates refuses a corrupt upload. Not every store validates (moto does not), so
`verify_written` checks the stored object afterwards: ``"probe"`` reads the last byte of
every part, which catches an object short by whole parts behind a full-size HEAD (incident
002) for a few tiny requests.

Reads are pinned: every GET carries ``If-Match`` with the ETag the object was listed with,
its length, range and ETag are checked against what was asked, and a body that ends early is
re-requested from where it stopped (still pinned) and then, if it keeps ending early, an
IntegrityError; it is never returned short (incident 003).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import io
import logging
import re
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, BinaryIO, ClassVar

import aiohttp
from botocore.exceptions import FlexibleChecksumError, IncompleteReadError, ResponseStreamingError
from fsspec.asyn import sync

from durable._checksum import Checksum, crc32c, crc_to_b64, crc_to_hex
from durable._errors import IntegrityError, UnsupportedError
from durable.adapters.base import (
    Adapter,
    AtomicFile,
    Capabilities,
    ObjectInfo,
    Upload,
    VerifyLevel,
    VersionMismatchError,
)

__all__ = ["S3Adapter"]

log = logging.getLogger(__name__)

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB
MAX_PARTS = 10_000
_BODY_RETRIES = 2  # re-requests (pinned) of a body that ended early, per reader
_PROBES_IN_FLIGHT = 16
_DELETE_BATCH = 1000  # DeleteObjects' limit
_READ_BUFFER = 256 * 1024
# A body that stops mid-way surfaces as one of these, depending on where the socket died.
_BODY_BROKEN = (aiohttp.ClientError, IncompleteReadError, ResponseStreamingError,
                asyncio.TimeoutError, ConnectionError)
# An AWS-style multipart ETag: "<md5 of the part md5s>-<number of parts>".
_MULTIPART_ETAG = re.compile(r'"[0-9a-fA-F]+-(\d+)"')


def _etag(raw: object, url: str) -> str:
    """The ETag as a quoted strong tag, or IntegrityError if it cannot pin a read.

    An unquoted ETag (some gateways strip the quotes) is quoted again; a weak, empty or
    missing one is refused here, with the object named, instead of failing later as an
    opaque error in a conditional request (incident 000's "Malformed StorageGeneration").
    """
    text = raw.strip() if isinstance(raw, str) else ""
    if text.startswith("W/"):
        raise IntegrityError(f"{url}: the store answered a weak ETag {text!r}; a weak tag "
                             "does not promise identical bytes, so reads cannot be pinned to "
                             "it (a proxy transforming the object?)", url=url,
                             expected="a strong ETag", found=text)
    core = text.strip('"')
    if not core:
        raise IntegrityError(f"{url}: the store answered no usable ETag ({raw!r}); reads "
                             "cannot be pinned to a version", url=url,
                             expected="an ETag", found=raw)
    return f'"{core}"'


def _error_fields(exc: BaseException) -> tuple[int | None, str, str]:
    """(HTTP status, S3 error code, message) of a botocore error, as s3fs raised it."""
    for e in (exc, exc.__cause__):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and isinstance(resp.get("Error"), dict):
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            err = resp["Error"]
            return status, str(err.get("Code", "")), str(err.get("Message", ""))
    return None, "", ""


def _failure(exc: BaseException, url: str, what: str, *, pinned: str | None = None,
             create_only: bool = False) -> BaseException:
    """The error for a failed request, naming the object, the request and the status."""
    status, code, message = _error_fields(exc)
    if status is None:
        return OSError(f"{url}: {what} failed: {type(exc).__name__}: {exc}")
    text = f"{url}: {what} answered HTTP {status} {code}: {message}".rstrip(": ")
    if status == 412 and create_only:
        return FileExistsError(f"{url} already exists (create-only {what}: HTTP 412)")
    if status == 412 and pinned is not None:
        return IntegrityError(f"{url}: replaced since it was listed ({what} pinned to ETag "
                              f"{pinned} answered HTTP 412 {code})", url=url, expected=pinned,
                              found="another version")
    if status == 416:
        return IntegrityError(f"{url}: {what}: the store cannot serve that range (HTTP 416 "
                              f"{code}): the object is shorter than its metadata", url=url)
    if status == 404:
        return FileNotFoundError(text)
    if status == 403:
        return PermissionError(text)
    return OSError(text)


class _WrittenChecksum(Checksum):
    """The running size and CRC32C, plus what `verify_written` needs of this write."""

    __slots__ = ("etag", "part_ends")

    def __init__(self) -> None:
        super().__init__()
        self.etag: str | None = None
        self.part_ends: list[tuple[int, int]] = []  # (offset of a part's last byte, its value)


class _EndpointCapabilities:
    """``S3Adapter.capabilities``: create-only as probed on the adapter's endpoint."""

    def __get__(self, obj: S3Adapter | None, owner: type) -> Capabilities:
        enforced = None if obj is None else obj.create_only_known()
        conditional = None if obj is None else obj.conditional_known()
        if enforced is False:
            return Capabilities(
                atomic_objects=True, create_only=False, durable=True, pinned_reads=True,
                note="this endpoint ignores If-None-Match (probed): create-only is a HEAD "
                     "before the write, which two racing writers can both pass",
                conditional_writes=conditional is not False)
        note = ("PutObject or a multipart upload completed at commit; CRC32C sent per part "
                "and per object; reads pinned by If-Match")
        if enforced is None:
            note += "; If-None-Match is probed on the endpoint at the first create-only write"
        if conditional is False:
            note += "; this endpoint ignores If-Match on PUT/DELETE (probed): no leases"
        else:
            note += "; conditional writes by If-Match on PUT and DELETE"
        return Capabilities(atomic_objects=True, create_only=True, durable=True,
                            pinned_reads=True, note=note,
                            conditional_writes=conditional is not False)


class S3Adapter(Adapter):
    protocols = ("s3", "s3a")
    capabilities = _EndpointCapabilities()
    # "probe" is the cheapest level that sees incident 002's objects, short by whole parts
    # behind a full-size HEAD, at write time. Its cost is a count of tiny requests, not bytes:
    # a HEAD plus one 1-byte GET per part, sent in parallel (64 MiB: 9 requests, 8 bytes
    # back; 1 MiB: 2 requests), where "full" downloads the object again and "size" is the
    # HEAD alone. (moto reads a whole object to answer any range, so there a 64 MiB probe
    # takes 0.33 s; a real store answers a 1-byte GET in a round trip.) Writers of many small
    # objects who accept a HEAD-only check pass "size".
    default_verify: ClassVar[VerifyLevel] = "probe"

    # Endpoint URL -> whether it enforces If-None-Match; shared by every adapter.
    _create_only_by_endpoint: ClassVar[dict[str, bool]] = {}
    # Endpoint URL -> whether it enforces If-Match on PutObject and DeleteObject.
    _conditional_by_endpoint: ClassVar[dict[str, bool]] = {}
    _probe_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, fs: Any, *, part_size: int = 8 * MiB, max_in_flight: int = 4,
                 full_object_checksum: bool = True) -> None:
        super().__init__(fs)
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(f"part_size must be between 5 MiB and 5 GiB, got {part_size}")
        #: Objects up to this size are one PutObject; larger ones are uploaded in parts of
        #: this size, doubled every 1000 parts so that 10,000 parts reach S3's 5 TiB limit.
        self.part_size = part_size
        self.max_in_flight = max(1, max_in_flight)
        #: Send ChecksumType=FULL_OBJECT and MpuObjectSize; turn off for a store that
        #: rejects them.
        self.full_object_checksum = full_object_checksum

    # plumbing -----------------------------------------------------------------------------
    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return str(bucket), str(key)

    def _call(self, method: str, url: str, what: str, *, pinned: str | None = None,
              create_only: bool = False, **kwargs: Any) -> dict[str, Any]:
        try:
            result: dict[str, Any] = sync(self.fs.loop, self.fs._call_s3, method, **kwargs)
        except Exception as exc:
            raise _failure(exc, url, what, pinned=pinned, create_only=create_only) from exc
        return result

    def _endpoint(self) -> str:
        sync(self.fs.loop, self.fs.set_session)
        return str(self.fs.s3.meta.endpoint_url)

    # create-only --------------------------------------------------------------------------
    def create_only_known(self) -> bool | None:
        """Whether this endpoint enforces If-None-Match, if it was probed yet."""
        return self._create_only_by_endpoint.get(self._endpoint())

    def create_only_enforced(self, path: str) -> bool:
        """Whether this endpoint enforces If-None-Match; probed once, next to ``path``."""
        endpoint = self._endpoint()
        known = self._create_only_by_endpoint.get(endpoint)
        if known is not None:
            return known
        with self._probe_lock:
            known = self._create_only_by_endpoint.get(endpoint)
            if known is None:
                known = self._probe_create_only(path)
                self._create_only_by_endpoint[endpoint] = known
        return known

    def _probe_create_only(self, path: str) -> bool:
        # Next to the object being written: a writer allowed to write there may write this.
        bucket, key = self._split(path)
        parent = key.rpartition("/")[0]
        probe = f"{parent}/.durable-probe-{uuid.uuid4().hex}".lstrip("/")
        url = self.url(f"{bucket}/{probe}")
        try:
            for attempt in (1, 2):
                try:
                    self._call("put_object", url, "create-only probe PUT", create_only=True,
                               Bucket=bucket, Key=probe, Body=b"durable create-only probe",
                               IfNoneMatch="*")
                except FileExistsError:
                    if attempt == 2:
                        return True
                    raise
            log.warning("%s: the endpoint ignores If-None-Match: create-only writes fall back "
                        "to a racy HEAD check", self._endpoint())
            return False
        finally:
            with contextlib.suppress(OSError):
                self._call("delete_object", url, "DELETE", Bucket=bucket, Key=probe)

    # conditional writes (leases) -----------------------------------------------------------
    def conditional_known(self) -> bool | None:
        """Whether this endpoint enforces If-Match on PUT and DELETE, if it was probed yet."""
        return self._conditional_by_endpoint.get(self._endpoint())

    def supports_conditional(self, path: str) -> bool:
        """Probed once per endpoint, next to ``path``: a store that ignored If-Match would
        let two writers both replace one lease version (a silent race)."""
        endpoint = self._endpoint()
        known = self._conditional_by_endpoint.get(endpoint)
        if known is None:
            with self._probe_lock:
                known = self._conditional_by_endpoint.get(endpoint)
                if known is None:
                    known = self._probe_conditional(path)
                    self._conditional_by_endpoint[endpoint] = known
        return known

    def _probe_conditional(self, path: str) -> bool:
        bucket, key = self._split(path)
        parent = key.rpartition("/")[0]
        probe = f"{parent}/.durable-probe-{uuid.uuid4().hex}".lstrip("/")
        url = self.url(f"{bucket}/{probe}")
        wrong = '"' + "0" * 32 + '"'
        try:
            self._call("put_object", url, "conditional probe PUT", Bucket=bucket, Key=probe,
                       Body=b"durable conditional probe")
            for method, extra in (("put_object", {"Body": b"x"}), ("delete_object", {})):
                try:
                    sync(self.fs.loop, self.fs._call_s3, method, Bucket=bucket, Key=probe,
                         IfMatch=wrong, **extra)
                except Exception as exc:
                    if _error_fields(exc)[0] != 412:
                        raise _failure(exc, url, f"conditional probe {method}") from exc
                    continue
                log.warning("%s: the endpoint ignores If-Match on %s: no leases here",
                            self._endpoint(), method)
                return False
            return True
        finally:
            with contextlib.suppress(OSError):
                self._call("delete_object", url, "DELETE", Bucket=bucket, Key=probe)

    def _conditional(self, method: str, path: str, version: str, **kwargs: Any) -> Any:
        if not self.supports_conditional(path):
            raise UnsupportedError(f"{self.url(path)}: this endpoint ignores If-Match "
                                   "(probed), so conditional writes cannot be enforced")
        bucket, key = self._split(path)
        url = self.url(path)
        try:
            return sync(self.fs.loop, self.fs._call_s3, method, Bucket=bucket, Key=key,
                        IfMatch=version, **kwargs)
        except Exception as exc:
            status, code, _ = _error_fields(exc)
            # 412: another version; 404: gone; 409 ConditionalRequestConflict: a racing
            # conditional write won. A retry of our own request that had landed also
            # answers 412: a false "lost", never a false "won".
            if status in (404, 409, 412):
                raise VersionMismatchError(
                    f"{url}: {method} If-Match {version} answered HTTP {status} {code}",
                    url=url, expected=version, found=None) from exc
            raise _failure(exc, url, f"conditional {method}") from exc

    def replace_if(self, path: str, data: bytes, version: str) -> ObjectInfo:
        resp = self._conditional("put_object", path, version, Body=data,
                                 ChecksumAlgorithm="CRC32C",
                                 ChecksumCRC32C=crc_to_b64(crc32c(data)))
        self.fs.invalidate_cache(path)
        return ObjectInfo(path, len(data), _etag(resp.get("ETag"), self.url(path)))

    def delete_if(self, path: str, version: str) -> None:
        self._conditional("delete_object", path, version)
        self.fs.invalidate_cache(path)

    # writing ------------------------------------------------------------------------------
    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        # durable is moot: S3 acknowledges a write once it is stored durably.
        enforced = self.create_only_enforced(path) if create_only else True
        return _S3AtomicFile(self, path, create_only=create_only, head_check=not enforced)

    # reading ------------------------------------------------------------------------------
    def info(self, path: str) -> ObjectInfo | None:
        bucket, key = self._split(path)
        if not key:
            return None
        url = self.url(path)
        try:
            resp = self._call("head_object", url, "HEAD", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        return ObjectInfo(path, int(resp["ContentLength"]), _etag(resp.get("ETag"), url),
                          _timestamp(resp.get("LastModified")))

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        # A console "folder" (an empty object named "dir/") is not data.
        return {k: i for k, i in self._list(prefix).items()
                if not (k.endswith("/") and i.size == 0)}

    def _list(self, prefix: str) -> dict[str, ObjectInfo]:
        bucket, key = self._split(prefix)
        start = key.rstrip("/") + "/" if key else ""
        out: dict[str, ObjectInfo] = {}
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": start}
        while True:
            resp = self._call("list_objects_v2", self.url(prefix), "ListObjectsV2", **kwargs)
            for obj in resp.get("Contents", []):
                path = f"{bucket}/{obj['Key']}"
                out[obj["Key"][len(start):]] = ObjectInfo(
                    path, int(obj["Size"]), _etag(obj.get("ETag"), self.url(path)),
                    _timestamp(obj.get("LastModified")))
            if not resp.get("IsTruncated"):
                return dict(sorted(out.items()))
            token = resp.get("NextContinuationToken")
            if not token:
                # Without a token the rest of the listing is unreachable: never return a part.
                raise OSError(f"{self.url(prefix)}: truncated listing without a continuation "
                              "token")
            kwargs["ContinuationToken"] = token

    def exists(self, path: str) -> bool:
        if self.info(path) is not None:
            return True
        bucket, key = self._split(path)
        start = key.rstrip("/") + "/" if key else ""
        resp = self._call("list_objects_v2", self.url(path), "ListObjectsV2", Bucket=bucket,
                          Prefix=start, MaxKeys=1)
        return bool(resp.get("Contents"))

    def open_read(self, path: str, info: ObjectInfo) -> BinaryIO:
        return io.BufferedReader(_PinnedReader(self, path, info), buffer_size=_READ_BUFFER)

    def read(self, path: str, *, limit: int | None = None) -> bytes | None:
        """One GET instead of HEAD + GET (markers are read often)."""
        bucket, key = self._split(path)
        url = self.url(path)
        try:
            resp = self._call("get_object", url, "GET", Bucket=bucket, Key=key,
                              ChecksumMode="ENABLED")
        except FileNotFoundError:
            return None
        size = int(resp["ContentLength"])
        if limit is not None and size > limit:
            resp["Body"].close()
            raise ValueError(f"{url} is {size} bytes, over the limit of {limit}")
        try:
            info = ObjectInfo(path, size, _etag(resp.get("ETag"), url))
        except IntegrityError:
            resp["Body"].close()
            raise
        with io.BufferedReader(_PinnedReader(self, path, info, resp["Body"])) as f:
            return f.read()

    # verifying ----------------------------------------------------------------------------
    def verify_written(self, path: str, checksum: Checksum, level: VerifyLevel) -> None:
        """Check the stored object: see `Adapter.verify_written`; on S3 ``"size"`` also
        compares the CRC32C the store recorded, and ``"probe"`` reads the last byte of
        every part this writer sent (and compares it with the byte sent)."""
        if level == "none":
            return
        bucket, key = self._split(path)
        url = self.url(path)
        try:
            head = self._call("head_object", url, "HEAD after write", Bucket=bucket, Key=key,
                              ChecksumMode="ENABLED")
        except FileNotFoundError:
            raise IntegrityError(f"{url}: written but not found afterwards", url=url) from None
        etag = _etag(head.get("ETag"), url)
        info = ObjectInfo(path, int(head["ContentLength"]), etag)
        if info.size != checksum.size:
            raise IntegrityError(f"{url}: wrote {checksum.size} bytes, the store holds "
                                 f"{info.size}", url=url, expected=checksum.size,
                                 found=info.size)
        written = checksum if isinstance(checksum, _WrittenChecksum) else None
        if written is not None and written.etag is not None and written.etag != info.version:
            raise IntegrityError(f"{url}: the write returned ETag {written.etag}, the store "
                                 f"now says {info.version} (replaced by another writer?)",
                                 url=url, expected=written.etag, found=info.version)
        # Only a full-object CRC32C compares with ours; a multipart object's COMPOSITE one
        # is a checksum of part checksums (and moto leaves off its "-N" suffix).
        stored = head.get("ChecksumCRC32C")
        whole = head.get("ChecksumType") == "FULL_OBJECT" or (
            head.get("ChecksumType") is None and not _MULTIPART_ETAG.fullmatch(etag))
        if isinstance(stored, str) and "-" not in stored and whole and \
                stored != crc_to_b64(checksum.crc):
            raise IntegrityError(f"{url}: the store recorded CRC32C {stored}, the writer sent "
                                 f"{crc_to_b64(checksum.crc)}", url=url,
                                 expected=crc_to_b64(checksum.crc), found=stored)
        if level == "probe":
            if written is None:
                self.probe(path, info)
            elif len(written.part_ends) > 1:
                sync(self.fs.loop, self._probe_parts, info, written.part_ends)
            # One PutObject needs no read: HTTP framing makes it whole or refused, and the
            # store validates the CRC32C sent with it (compared again above). Only
            # multipart objects can lose whole parts behind a full-size HEAD (incident 002).
        elif level == "full":
            ck = Checksum()
            with self.open_read(path, info) as f:
                while block := f.read(8 * MiB):
                    ck.update(block)
            if (ck.size, ck.crc) != (checksum.size, checksum.crc):
                raise IntegrityError(
                    f"{url}: read back {ck.size} bytes with CRC32C {crc_to_hex(ck.crc)}, wrote "
                    f"{checksum.size} with {crc_to_hex(checksum.crc)}", url=url,
                    expected=(checksum.size, crc_to_hex(checksum.crc)),
                    found=(ck.size, crc_to_hex(ck.crc)))

    async def _probe_parts(self, info: ObjectInfo, ends: Sequence[tuple[int, int]]) -> None:
        gate = asyncio.Semaphore(_PROBES_IN_FLIGHT)

        async def one(number: int, offset: int, value: int) -> None:
            async with gate:
                got = await self._probe_byte(info, offset, f"the last byte of part {number}")
            if got != value:
                url = self.url(info.path)
                raise IntegrityError(f"{url}: byte {offset} (end of part {number}) is "
                                     f"{got:#04x}, the writer sent {value:#04x}", url=url,
                                     expected=value, found=got)

        await asyncio.gather(*(one(n, off, v) for n, (off, v) in enumerate(ends, 1)))

    async def _probe_byte(self, info: ObjectInfo, offset: int, what: str) -> int:
        """One byte of the object, by a 1-byte ranged GET pinned to its ETag."""
        bucket, key = self._split(info.path)
        url = self.url(info.path)
        assert info.version is not None
        failures = []
        for _ in range(_BODY_RETRIES + 1):
            try:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                              IfMatch=info.version,
                                              Range=f"bytes={offset}-{offset}")
            except Exception as exc:
                raise _failure(exc, url, f"GET of {what} (byte {offset})",
                               pinned=info.version) from exc
            body = resp["Body"]
            try:
                _check_response(resp, url, info, offset, 1)
                data = await body.read()
            except _BODY_BROKEN as exc:
                failures.append(f"{type(exc).__name__}")
                continue
            finally:
                body.close()
            if len(data) == 1:
                return int(data[0])
            failures.append(f"{len(data)} bytes")
        raise IntegrityError(f"{url}: {what} (byte {offset} of {info.size}) cannot be read "
                             f"({', '.join(failures)}): the object is shorter than its "
                             "metadata says (whole parts lost?)", url=url, expected=info.size,
                             found=f"nothing at byte {offset}")

    # uploads left open -------------------------------------------------------------------
    def list_uploads(self, prefix: str) -> Sequence[Upload]:
        """Multipart uploads below ``prefix`` never completed nor aborted (ListMultipartUploads):
        each holds its parts' storage until aborted."""
        bucket, key = self._split(prefix)
        start = key.rstrip("/") + "/" if key else ""
        out: list[Upload] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": start}
        while True:
            resp = self._call("list_multipart_uploads", self.url(prefix), "ListMultipartUploads",
                              **kwargs)
            for up in resp.get("Uploads", []):
                out.append(Upload(f"{bucket}/{up['Key']}", str(up["UploadId"]),
                                  _timestamp(up.get("Initiated")), up.get("ChecksumAlgorithm")))
            if not resp.get("IsTruncated"):
                return out
            # Without both markers the rest is unreachable: never return a part as the whole.
            if not resp.get("NextKeyMarker") or not resp.get("NextUploadIdMarker"):
                raise OSError(f"{self.url(prefix)}: truncated ListMultipartUploads without "
                              "its next markers")
            kwargs["KeyMarker"] = resp["NextKeyMarker"]
            kwargs["UploadIdMarker"] = resp["NextUploadIdMarker"]

    def abort_upload(self, upload: Upload) -> None:
        bucket, key = self._split(upload.path)
        # NoSuchUpload (404): completed or aborted by someone else since it was listed.
        with contextlib.suppress(FileNotFoundError):
            self._call("abort_multipart_upload", self.url(upload.path),
                       f"AbortMultipartUpload {upload.upload_id}", Bucket=bucket, Key=key,
                       UploadId=upload.upload_id)

    # removing -----------------------------------------------------------------------------
    def delete(self, paths: Iterable[str]) -> None:
        by_bucket: dict[str, list[str]] = {}
        for p in paths:
            bucket, key = self._split(p)
            if key:
                by_bucket.setdefault(bucket, []).append(key)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), _DELETE_BATCH):
                batch = keys[i:i + _DELETE_BATCH]
                resp = self._call("delete_objects", self.url(bucket), "DeleteObjects",
                                  Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch],
                                                         "Quiet": True})
                errors = resp.get("Errors") or []
                if errors:
                    shown = "; ".join(f"{self.url(bucket + '/' + e.get('Key', '?'))}: "
                                      f"{e.get('Code')} {e.get('Message')}" for e in errors[:5])
                    raise OSError(f"{len(errors)} objects could not be deleted: {shown}")
            for key in keys:
                self.fs.invalidate_cache(f"{bucket}/{key}")

    def delete_prefix(self, prefix: str) -> None:
        if not self._split(prefix)[1].strip("/"):
            raise ValueError(f"{self.url(prefix)}: refusing to delete a whole bucket")
        self.delete([prefix.rstrip("/"), *(i.path for i in self._list(prefix).values())])


def _timestamp(value: object) -> float | None:
    return value.timestamp() if isinstance(value, datetime.datetime) else None


def _check_response(resp: dict[str, Any], url: str, info: ObjectInfo, start: int,
                    length: int) -> None:
    """The response is the bytes asked for, of the version asked for, or IntegrityError."""
    got = int(resp.get("ContentLength", -1))
    if got != length:
        raise IntegrityError(f"{url}: asked for {length} bytes from byte {start}, the store "
                             f"answers Content-Length {got} (the object is {info.size} bytes "
                             "as listed)", url=url, expected=length, found=got)
    # Checked here too: a store that ignores If-Match would serve another version silently.
    etag = _etag(resp.get("ETag"), url)
    if etag != info.version:
        raise IntegrityError(f"{url}: replaced since it was listed (GET served ETag {etag}, "
                             f"listed with {info.version})", url=url, expected=info.version,
                             found=etag)
    if start or length != info.size:
        want = f"bytes {start}-{start + length - 1}/{info.size}"
        if resp.get("ContentRange") != want:
            raise IntegrityError(f"{url}: asked for {want}, the store answers Content-Range "
                                 f"{resp.get('ContentRange')}", url=url, expected=want,
                                 found=resp.get("ContentRange"))


class _PinnedReader(io.RawIOBase):
    """A seekable reader of one object version: every GET carries If-Match, and a body that
    ends early is re-requested from where it stopped (pinned), never returned short."""

    def __init__(self, adapter: S3Adapter, path: str, info: ObjectInfo,
                 body: Any = None) -> None:
        super().__init__()
        self._a = adapter
        self._url = adapter.url(path)
        self._bucket, self._key = adapter._split(path)
        if info.version is None:
            raise IntegrityError(f"{self._url}: no ETag to pin the read to", url=self._url)
        self._info = info
        self._pos = 0
        self._body = body  # the open response, streaming bytes [_pos, size)
        self._left = info.size if body is not None else 0
        # Counted over the reader's life: a store that cuts every body must not cost one
        # request per fragment of the object.
        self._failures: list[str] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._info.size}[whence]
        pos = base + offset
        if pos < 0:
            raise ValueError("negative seek position")
        if pos != self._pos:
            self._drop()
            self._pos = pos
        return pos

    def _open(self) -> None:
        size, start = self._info.size, self._pos
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key,
                                  "IfMatch": self._info.version}
        if start:
            kwargs["Range"] = f"bytes={start}-{size - 1}"
        else:
            # A whole-object GET: botocore checks the body against the store's CRC32C.
            kwargs["ChecksumMode"] = "ENABLED"
        resp = self._a._call("get_object", self._url, f"GET from byte {start}",
                             pinned=self._info.version, **kwargs)
        try:
            _check_response(resp, self._url, self._info, start, size - start)
        except BaseException:
            resp["Body"].close()
            raise
        self._body, self._left = resp["Body"], size - start

    def _drop(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            body.close()

    def _read_body(self, n: int) -> bytes:
        try:
            data: bytes = sync(self._a.fs.loop, self._body.read, n)
        except FlexibleChecksumError as exc:
            raise IntegrityError(f"{self._url}: the body does not match the CRC32C the store "
                                 f"recorded ({exc})", url=self._url) from None
        return data

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self._info.size - self._pos)
        if want <= 0:
            return 0
        failures = self._failures
        while True:
            if self._body is None:
                self._open()
            try:
                chunk, why = self._read_body(min(want, self._left)), "end of body"
            except _BODY_BROKEN as exc:
                chunk, why = b"", type(exc).__name__
            if chunk:
                break
            failures.append(why)
            self._drop()
            if len(failures) > _BODY_RETRIES:
                raise IntegrityError(
                    f"{self._url}: body ended at byte {self._pos} of {self._info.size} "
                    f"({len(failures)} times: {', '.join(failures)}); a short body is never "
                    "returned", url=self._url, expected=self._info.size, found=self._pos)
        n = len(chunk)
        memoryview(buffer).cast("B")[:n] = chunk
        self._pos += n
        self._left -= n
        if self._left == 0:
            # One more read: it must be empty, and it makes botocore check the CRC32C.
            extra = self._read_body(1)
            self._drop()
            if extra:
                raise IntegrityError(f"{self._url}: body longer than its Content-Length",
                                     url=self._url, expected=self._info.size)
        return n

    def close(self) -> None:
        if not self.closed:
            self._drop()
        super().close()


class _S3AtomicFile(AtomicFile):
    def __init__(self, adapter: S3Adapter, path: str, *, create_only: bool,
                 head_check: bool) -> None:
        super().__init__(path)
        self.checksum: _WrittenChecksum = _WrittenChecksum()
        self._a = adapter
        self._url = adapter.url(path)
        self._bucket, self._key = adapter._split(path)
        self._create_only = create_only
        self._head_check = create_only and head_check
        # Names this write in the object's metadata: a create-only request refused (412)
        # by an object carrying it was refused by this very write, landed by an earlier
        # attempt whose answer was lost (see `_landed`).
        self._token = {"durable-write": uuid.uuid4().hex} if create_only else None
        self._buf = bytearray()
        self._sent = 0  # bytes handed to parts
        self._upload_id: str | None = None
        self._inflight: list[tuple[int, int, concurrent.futures.Future[Any]]] = []
        self._parts: list[dict[str, Any]] = []

    def _part_size(self) -> int:
        grow = len(self.checksum.part_ends) // 1000
        return min(MAX_PART_SIZE, self._a.part_size << grow)

    def _write(self, data: memoryview) -> None:
        self._buf += data
        # Strictly greater: an object of exactly part_size stays one PutObject, and a
        # multipart upload never ends on an empty part.
        while len(self._buf) > self._part_size():
            self._send_part(self._part_size())

    def _conditions(self) -> dict[str, Any]:
        if not self._create_only:
            return {}
        if self._head_check and self._a.info(self.path) is not None:
            raise FileExistsError(f"{self._url} already exists (create-only write)")
        return {"IfNoneMatch": "*"}

    def _send_part(self, size: int) -> None:
        with memoryview(self._buf) as view:
            data = view[:size].tobytes()
        del self._buf[:size]
        if self._upload_id is None:
            full = self._a.full_object_checksum
            extra: dict[str, Any] = {"ChecksumType": "FULL_OBJECT"} if full else {}
            if self._token is not None:
                extra["Metadata"] = self._token
            resp = self._a._call("create_multipart_upload", self._url, "CreateMultipartUpload",
                                 Bucket=self._bucket, Key=self._key, ChecksumAlgorithm="CRC32C",
                                 **extra)
            self._upload_id = str(resp["UploadId"])
        number = len(self.checksum.part_ends) + 1
        if number > MAX_PARTS:
            raise ValueError(f"{self._url}: over {MAX_PARTS} parts; raise part_size")
        self._sent += size
        self.checksum.part_ends.append((self._sent - 1, data[-1]))
        crc = crc32c(data)
        # Bounded memory: wait for the oldest part before putting another in the air.
        while len(self._inflight) >= self._a.max_in_flight:
            self._collect(*self._inflight.pop(0))
        coro = self._a.fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key,
                                   UploadId=self._upload_id, PartNumber=number, Body=data,
                                   ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc_to_b64(crc))
        self._inflight.append((number, crc, asyncio.run_coroutine_threadsafe(coro,
                                                                            self._a.fs.loop)))

    def _collect(self, number: int, crc: int, future: concurrent.futures.Future[Any]) -> None:
        try:
            resp = future.result()
        except Exception as exc:
            raise _failure(exc, self._url, f"UploadPart {number}") from exc
        self._parts.append({"PartNumber": number, "ETag": resp["ETag"],
                            "ChecksumCRC32C": crc_to_b64(crc)})

    def _commit(self) -> ObjectInfo:
        if self._upload_id is None:
            data, self._buf = bytes(self._buf), bytearray()
            meta: dict[str, Any] = {} if self._token is None else {"Metadata": self._token}
            try:
                resp = self._a._call("put_object", self._url, "PutObject",
                                     create_only=self._create_only, Bucket=self._bucket,
                                     Key=self._key, Body=data, ChecksumAlgorithm="CRC32C",
                                     ChecksumCRC32C=crc_to_b64(self.checksum.crc),
                                     **meta, **self._conditions())
            except FileExistsError as exc:
                resp = self._landed(exc)
            if data:
                self.checksum.part_ends = [(len(data) - 1, data[-1])]
        else:
            if self._buf:
                self._send_part(len(self._buf))
            while self._inflight:
                self._collect(*self._inflight.pop(0))
            parts = sorted(self._parts, key=lambda p: int(p["PartNumber"]))
            extra: dict[str, Any] = {}
            if self._a.full_object_checksum:
                extra = {"ChecksumType": "FULL_OBJECT", "MpuObjectSize": self.checksum.size,
                         "ChecksumCRC32C": crc_to_b64(self.checksum.crc)}
            try:
                resp = self._a._call("complete_multipart_upload", self._url,
                                     "CompleteMultipartUpload", create_only=self._create_only,
                                     Bucket=self._bucket, Key=self._key,
                                     UploadId=self._upload_id, MultipartUpload={"Parts": parts},
                                     **extra, **self._conditions())
            except (FileExistsError, FileNotFoundError) as exc:
                # A retried Complete whose first attempt landed: 412, or NoSuchUpload.
                resp = self._landed(exc)
            self._upload_id = None
            m = _MULTIPART_ETAG.fullmatch(str(resp.get("ETag", "")))
            if m and int(m[1]) != len(parts):
                # The store assembled other parts than were sent (incident 002's shape): take
                # the object away rather than leave it under the name.
                with contextlib.suppress(OSError):
                    self._a.delete([self.path])
                raise IntegrityError(f"{self._url}: completed from {len(parts)} parts, the "
                                     f"store's ETag {resp.get('ETag')} counts {m[1]}",
                                     url=self._url, expected=len(parts), found=int(m[1]))
        self._a.fs.invalidate_cache(self.path)
        # A bad ETag in this answer is not fatal here: the object is already published, and
        # verify_written's HEAD judges the ETag the store keeps.
        with contextlib.suppress(IntegrityError):
            self.checksum.etag = _etag(resp.get("ETag"), self._url)
        return ObjectInfo(self.path, self.checksum.size, self.checksum.etag)

    def _landed(self, refused: BaseException) -> dict[str, Any]:
        """The HEAD of the target if this write put it there, else ``refused`` is raised.

        A request whose answer was lost (a dropped connection) is sent again by the client;
        if the first attempt landed, the store refuses the retry (412: the object exists;
        NoSuchUpload: completed), and a writer that committed would be told it lost.
        """
        if self._token is None:
            raise refused
        try:
            head = self._a._call("head_object", self._url, "HEAD after a refused create",
                                 Bucket=self._bucket, Key=self._key)
        except FileNotFoundError:
            raise refused from None
        if (head.get("Metadata") or {}).get("durable-write") != self._token["durable-write"]:
            raise refused
        return head

    def _abort(self) -> None:
        self._buf = bytearray()
        upload, self._upload_id = self._upload_id, None
        inflight, self._inflight = self._inflight, []
        if upload is None:
            return
        loop = self._a.fs.loop
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key,
                                  "UploadId": upload}
        try:
            with contextlib.suppress(RuntimeError):
                if asyncio.get_running_loop() is loop:
                    # Garbage-collected on s3fs's own loop thread, which must not block.
                    loop.create_task(self._a.fs._call_s3("abort_multipart_upload", **kwargs))
                    return
            # A part still in the air could land after the abort and keep its storage.
            concurrent.futures.wait([f for _, _, f in inflight])
            self._a._call("abort_multipart_upload", self._url, "AbortMultipartUpload",
                          **kwargs)
        except FileNotFoundError:
            pass  # NoSuchUpload: nothing left to abort
        except Exception as exc:
            # Never mask the error that made us abort; a bucket lifecycle rule
            # (AbortIncompleteMultipartUpload) is the backstop for this one.
            log.warning("%s: could not abort multipart upload %s: %s", self._url, upload, exc)
