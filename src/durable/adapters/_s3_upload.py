"""The S3 writer: one PutObject, or a multipart upload completed only at commit.

Up to the adapter's ``part_size`` the bytes are buffered and sent as one PutObject at
commit; beyond it, a multipart upload whose parts go out as the buffer fills (up to
``max_in_flight`` at once). Anything but `commit` (an exception, KeyboardInterrupt, close()
without commit, garbage collection) aborts it. The CRC32C of every part and of the whole
object is sent, and what the store answered is kept for `S3Adapter.verify_written`.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from durable._checksum import Checksum, crc_to_b64
from durable._errors import IntegrityError
from durable._protocol import META_RECORD_FOLLOWS
from durable.adapters._s3_http import MULTIPART_ETAG, etag, failure
from durable.adapters.base import AtomicFile, ObjectInfo

if TYPE_CHECKING:
    from durable.adapters.s3 import S3Adapter

__all__ = ["CRC32C_HEADER", "FULL_OBJECT", "MAX_PARTS", "MAX_PART_SIZE", "MIN_PART_SIZE",
           "MULTIPART_IF_NONE_MATCH", "S3AtomicFile", "WrittenChecksum", "md5_args"]

log = logging.getLogger("durable.adapters.s3")

MiB = 1024 * 1024
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * 1024 * MiB
MAX_PARTS = 10_000
#: How `S3Adapter.refusal` names the multipart checksum type FULL_OBJECT.
FULL_OBJECT = "x-amz-checksum-type: FULL_OBJECT"
#: How `S3Adapter.refusal` names the flexible checksum header durable sends.
CRC32C_HEADER = "x-amz-checksum-crc32c"
#: How `S3Adapter.refusal` names If-None-Match on CompleteMultipartUpload.
MULTIPART_IF_NONE_MATCH = "If-None-Match on CompleteMultipartUpload"


def md5_args(data: bytes) -> dict[str, Any]:
    """Content-MD5 of ``data``, as botocore takes it: the digest every S3 store checks,
    sent where the endpoint refused the CRC32C header (`S3Adapter.checksum_args`)."""
    return {"ContentMD5": base64.b64encode(hashlib.md5(data).digest()).decode()}


class WrittenChecksum(Checksum):
    """The running size and CRC32C, plus what `verify_written` needs of this write."""

    __slots__ = ("answered", "etag", "part_ends")

    def __init__(self) -> None:
        super().__init__()
        self.etag: str | None = None
        self.part_ends: list[tuple[int, int]] = []  # (offset of a part's last byte, its value)
        #: The CRC32C (base64) the store's answer to a PutObject reported; None if it
        #: reported none, and for a multipart upload (see `S3Adapter.verify_written`).
        self.answered: str | None = None


class S3AtomicFile(AtomicFile):
    def __init__(self, adapter: S3Adapter, path: str, *, create_only: bool,
                 head_check: bool, if_none_match: bool = True) -> None:
        bucket, key = adapter._split(path)  # a path it refuses: before anything to abort
        super().__init__(path)
        self.checksum: WrittenChecksum = WrittenChecksum()
        self._a = adapter
        self._url = adapter.url(path)
        self._bucket, self._key = bucket, key
        self._create_only = create_only
        self._head_check = create_only and head_check
        # Off where the endpoint refuses the header (HTTP 501): it would fail the write.
        self._if_none_match = if_none_match
        # Names this write in the object's metadata: a create-only request refused (412)
        # by an object carrying it was refused by this very write, landed by an earlier
        # attempt whose answer was lost (see `_landed`).
        self._token = {"durable-write": uuid.uuid4().hex} if create_only else None
        self._buf = bytearray()
        self._sent = 0  # bytes handed to parts
        self._upload_id: str | None = None
        # (part number, its bytes, the arguments it went with, its request)
        self._inflight: list[tuple[int, bytes, dict[str, Any],
                                   concurrent.futures.Future[Any]]] = []
        self._parts: list[dict[str, Any]] = []
        self._full = False  # this upload's checksum type is FULL_OBJECT (`_create`)
        self._crc = True  # this upload's parts carry their CRC32C (`_create`, `_collect`)

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
        return {"IfNoneMatch": "*"} if self._if_none_match else {}

    def _complete_conditions(self) -> dict[str, Any]:
        """`_conditions` for CompleteMultipartUpload. On an endpoint that enforces
        If-None-Match on PutObject only, the HEAD check (declared, racy) before it too:
        without it, a create-only upload replaced an object another writer put meanwhile."""
        if not self._create_only:
            return {}
        if (not self._head_check and not self._a.create_only_multipart_enforced(self.path)
                and self._a.info(self.path) is not None):
            raise FileExistsError(f"{self._url} already exists (create-only write)")
        conditions = self._conditions()
        return {} if self._a.refusal(MULTIPART_IF_NONE_MATCH) else conditions

    def _send_part(self, size: int) -> None:
        with memoryview(self._buf) as view:
            data = view[:size].tobytes()
        del self._buf[:size]
        if self._upload_id is None:
            self._upload_id = self._create()
        number = len(self.checksum.part_ends) + 1
        if number > MAX_PARTS:
            raise ValueError(f"{self._url}: over {MAX_PARTS} parts; raise part_size")
        self._sent += size
        self.checksum.part_ends.append((self._sent - 1, data[-1]))
        # Bounded memory: wait for the oldest part before putting another in the air.
        while len(self._inflight) >= self._a.max_in_flight:
            self._collect(*self._inflight.pop(0))
        args = self._a.checksum_args(data) if self._crc else md5_args(data)
        self._inflight.append((number, data, args, asyncio.run_coroutine_threadsafe(
            self._a.fs._call_s3("upload_part", **self._part(number, data, args)),
            self._a.fs.loop)))

    def _part(self, number: int, data: bytes, args: dict[str, Any]) -> dict[str, Any]:
        return {"Bucket": self._bucket, "Key": self._key, "UploadId": self._upload_id,
                "PartNumber": number, "Body": data, **args}

    def _create(self) -> str:
        """CreateMultipartUpload; its UploadId. FULL_OBJECT (a checksum type S3 added in
        2024) where the endpoint has not refused it: one that refuses it as not
        implemented is asked again without it, and never sent it again (`_full`). One
        that refuses flexible checksums altogether is asked without ChecksumAlgorithm,
        and the parts go with Content-MD5 (`_crc`)."""
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._key}
        # Published before its marker: killed in between, the object must not read as
        # data written before durable (adopted by `durable mark-complete`, unchecked).
        metadata = {**(self._token or {}),
                    **({META_RECORD_FOLLOWS: "marker"} if self.record_follows else {})}
        if metadata:
            kwargs["Metadata"] = metadata
        self._crc = self._a.refusal(CRC32C_HEADER) is None
        self._full = (self._crc and self._a.full_object_checksum
                      and self._a.refusal(FULL_OBJECT) is None)

        def create(crc: bool, **extra: Any) -> dict[str, Any]:
            algorithm: dict[str, Any] = {"ChecksumAlgorithm": "CRC32C"} if crc else {}
            return self._a._call("create_multipart_upload", self._url,
                                 "CreateMultipartUpload", **kwargs, **extra, **algorithm)

        try:
            resp = create(self._crc, **({"ChecksumType": "FULL_OBJECT"} if self._full else {}))
        except OSError as exc:
            # Refused, every object over part_size failed to write on such a store. (No
            # bytes go with this request: a 400 here is never a checksum mismatch.)
            said = self._a.refused(exc, FULL_OBJECT, note=False) if self._full else None
            if said is None:
                resp = self._without_crc(exc, create)
            else:
                self._full = False
                try:
                    resp = create(True)
                except OSError as again:
                    resp = self._without_crc(again, create)
                else:
                    self._a.note_refusal(FULL_OBJECT, said)  # refused for FULL_OBJECT alone
        return str(resp["UploadId"])

    def _without_crc(self, exc: OSError, create: Callable[[bool], dict[str, Any]]
                     ) -> dict[str, Any]:
        """``create(False)``: the upload created without ChecksumAlgorithm, if ``exc`` may
        be the endpoint refusing flexible checksums (`S3Adapter.checksum_refused`); else
        ``exc`` raised. Its parts then go with Content-MD5."""
        said = self._a.checksum_refused(exc) if self._crc else None
        if said is None:
            raise exc
        self._crc = self._full = False
        resp: dict[str, Any] = self._a.without_checksum(
            self._url, "CreateMultipartUpload", said, lambda: create(False))
        return resp

    def _collect(self, number: int, data: bytes, args: dict[str, Any],
                 future: concurrent.futures.Future[Any]) -> None:
        try:
            resp = future.result()
        except Exception as exc:
            err = failure(exc, self._url, f"UploadPart {number}")
            said = self._a.checksum_refused(exc) if "ChecksumCRC32C" in args else None
            if said is None:
                raise err from exc
            # The upload was created with ChecksumAlgorithm, its parts refused with the
            # header: this one and every later one go with Content-MD5.
            self._crc = self._full = False
            args = md5_args(data)
            resp = self._a.without_checksum(
                self._url, f"UploadPart {number}", said,
                lambda: self._a._call("upload_part", self._url, f"UploadPart {number}",
                                      **self._part(number, data, args)))
        if not resp.get("ETag"):
            # Nothing to name the part by in the Complete: a KeyError from deep inside.
            raise IntegrityError(f"{self._url}: UploadPart {number} answered without an ETag "
                                 f"({resp.get('ETag')!r}): the part cannot be named to "
                                 "complete the upload", url=self._url, expected="an ETag",
                                 found=resp.get("ETag"))
        self._parts.append({"PartNumber": number, "ETag": resp["ETag"],
                            **({"ChecksumCRC32C": args["ChecksumCRC32C"]}
                               if "ChecksumCRC32C" in args else {})})

    @property
    def carries_record(self) -> bool:
        # One PutObject publishes bytes and metadata at once; a multipart upload's metadata
        # is fixed at its start, before the size and CRC32C are known.
        return self._upload_id is None

    def _commit(self) -> ObjectInfo:
        record = None
        if self._upload_id is None:
            resp = self._put_object()
            record = dict(self.record) if self.record is not None else None
            crc = resp.get("ChecksumCRC32C")
            self.checksum.answered = crc if isinstance(crc, str) else None
        else:
            resp = self._complete()
        self._a.fs.invalidate_cache(self.path)
        # A bad ETag in this answer is not fatal here: the object is already published, and
        # verify_written's HEAD judges the ETag the store keeps.
        with contextlib.suppress(IntegrityError):
            self.checksum.etag = etag(resp.get("ETag"), self._url)
        return ObjectInfo(self.path, self.checksum.size, self.checksum.etag, record=record)

    def _put_object(self) -> dict[str, Any]:
        data, self._buf = bytes(self._buf), bytearray()
        metadata = {**(self._token or {}), **(self.record or {})}
        meta: dict[str, Any] = {"Metadata": metadata} if metadata else {}

        def put(args: dict[str, Any]) -> dict[str, Any]:
            return self._a._call("put_object", self._url, "PutObject",
                                 create_only=self._create_only, Bucket=self._bucket,
                                 Key=self._key, Body=data, **args, **meta,
                                 **self._conditions())

        args = self._a.checksum_args(data, self.checksum.crc)
        try:
            resp = put(args)
        except FileExistsError as exc:
            resp = self._landed(exc)
        except OSError as exc:
            said = self._a.checksum_refused(exc) if "ChecksumCRC32C" in args else None
            if said is None:
                raise
            try:
                resp = self._a.without_checksum(self._url, "PutObject", said,
                                                lambda: put(md5_args(data)))
            except FileExistsError as again:
                resp = self._landed(again)
        if data:
            self.checksum.part_ends = [(len(data) - 1, data[-1])]
        return resp

    def _complete(self) -> dict[str, Any]:
        if self._buf:
            self._send_part(len(self._buf))
        while self._inflight:
            self._collect(*self._inflight.pop(0))
        parts = sorted(self._parts, key=lambda p: int(p["PartNumber"]))
        extra: dict[str, Any] = {}
        if self._full and all("ChecksumCRC32C" in p for p in parts):
            extra = {"ChecksumType": "FULL_OBJECT", "MpuObjectSize": self.checksum.size,
                     "ChecksumCRC32C": crc_to_b64(self.checksum.crc)}
        try:
            resp = self._a._call("complete_multipart_upload", self._url,
                                 "CompleteMultipartUpload", create_only=self._create_only,
                                 Bucket=self._bucket, Key=self._key,
                                 UploadId=self._upload_id, MultipartUpload={"Parts": parts},
                                 **extra, **self._complete_conditions())
        except (FileExistsError, FileNotFoundError) as exc:
            # A retried Complete whose first attempt landed: 412, or NoSuchUpload.
            resp = self._landed(exc)
        self._upload_id = None
        m = MULTIPART_ETAG.fullmatch(str(resp.get("ETag", "")))
        if m and int(m[1]) != len(parts):
            # The store assembled other parts than were sent (incident 002's shape): take
            # the object away rather than leave it under the name.
            with contextlib.suppress(OSError):
                self._a.delete([self.path])
            raise IntegrityError(f"{self._url}: completed from {len(parts)} parts, the "
                                 f"store's ETag {resp.get('ETag')} counts {m[1]}",
                                 url=self._url, expected=len(parts), found=int(m[1]))
        return resp

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
            concurrent.futures.wait([f for *_, f in inflight])
            self._a._call("abort_multipart_upload", self._url, "AbortMultipartUpload",
                          **kwargs)
        except FileNotFoundError:
            pass  # NoSuchUpload: nothing left to abort
        except Exception as exc:
            # Never mask the error that made us abort; a bucket lifecycle rule
            # (AbortIncompleteMultipartUpload) is the backstop for this one.
            log.warning("%s: could not abort multipart upload %s: %s", self._url, upload, exc)
