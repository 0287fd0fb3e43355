"""Amazon S3 and S3-compatible stores (R2, MinIO, AIStore, ...), through s3fs's own client.

Every request goes through ``fs._call_s3`` on s3fs's event loop, so credentials, endpoints,
botocore's retry configuration and every other storage option work as they do for s3fs.
s3fs's caches are never consulted: a listing or stat is always a fresh request (incident 000).
Two exceptions: `S3Adapter.put` of a small whole object (attempt records, markers) and a
listing inside a records directory (a commit lists its records twice) go through obstore
where it reaches the store exactly as s3fs does (`_s3_light`): the same PutObject and
ListObjectsV2 for a seventh of the client CPU; anything it cannot map, and any listing
obstore may not have named exactly, stays on (or goes again through) s3fs.

Writes (`_s3_upload`): up to ``part_size`` (8 MiB) one PutObject at commit; beyond it, a
multipart upload completed only at `commit` and aborted on anything else (s3fs's own file
publishes what was written when an exception leaves ``with fs.open(...)``).

Checksums: the CRC32C of every part and of the whole object is sent (``x-amz-checksum-
crc32c``, and a FULL_OBJECT checksum plus ``x-amz-mp-object-size`` on completion), so a
store that validates refuses a corrupt upload. An endpoint that refuses the CRC32C header
(B2, OVH) is sent Content-MD5 instead, which it checks as well (`checksum_refused`).
`verify_written` then judges the result: a
PutObject whose answer reports the CRC32C sent needs no further request at ``"size"`` or
``"probe"``; otherwise (a store that answers no checksum, a multipart upload) a HEAD, and
at ``"probe"`` a 1-byte GET at the end of every part, which catches an object short by
whole parts behind a full-size HEAD (incident 002) for a few tiny requests.

Reads are pinned: every GET carries ``If-Match`` with the ETag the object was listed with,
its length, range and ETag are checked against what was asked, and a body that ends early is
re-requested from where it stopped (still pinned) and then, if it keeps ending early, an
IntegrityError; it is never returned short (incident 003).

Endpoint probes (create-only, conditional writes) write one small object, named
``.durable-probe-<uuid>``, in the bucket's root records folder ``.durable/``: outside every
entry and every entry's records, so one left by a crash never makes an entry look started.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import io
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO, ClassVar

from botocore.utils import parse_timestamp
from fsspec.asyn import sync

from durable._checksum import Checksum, crc32c, crc_to_b64, crc_to_hex
from durable._errors import IntegrityError, UnsupportedError
from durable._protocol import RECORDS_DIR, record_fields
from durable.adapters._ranged import PinnedStreamReader
from durable.adapters._s3_http import (
    BODY_BROKEN,
    MULTIPART_ETAG,
    S3Body,
    check_response,
    content_size,
    error_fields,
    etag,
    failure,
    mark_200_errors,
)
from durable.adapters._s3_light import get_small, light_store, list_below
from durable.adapters._s3_light import put as light_put
from durable.adapters._s3_upload import (
    CRC32C_HEADER,
    FULL_OBJECT,
    MAX_PART_SIZE,
    MIN_PART_SIZE,
    MULTIPART_IF_NONE_MATCH,
    S3AtomicFile,
    WrittenChecksum,
    md5_args,
)
from durable.adapters.base import (
    Adapter,
    AtomicFile,
    Capabilities,
    ObjectInfo,
    Upload,
    VerifyLevel,
    VersionMismatchError,
    circling,
    exact_range,
)

__all__ = ["MIN_PART_SIZE", "S3Adapter"]

log = logging.getLogger(__name__)

MiB = 1024 * 1024
_BODY_RETRIES = 2  # re-requests (pinned) of a body that ended early, per reader
_PROBES_IN_FLIGHT = 16
_DELETE_BATCH = 1000  # DeleteObjects' limit
_READ_BUFFER = 256 * 1024
_LIGHT_PUT_MAX = 1024 * 1024  # PUTs up to this size may go through obstore (`_s3_light`)
#: The name of every endpoint-probe object (followed by a uuid): recognisable if a crash
#: leaves one behind.
PROBE_PREFIX = ".durable-probe-"
# How an endpoint refuses a condition it does not implement, where the same request
# without it succeeded a moment before: S3-compatible stores and gateways answer a header
# they lack with 501 NotImplemented, some with 400. The header is refused, not the write:
# sent again, it would fail every write (`_refusals`).
_NOT_IMPLEMENTED = frozenset({400, 501})
# How a store says the bytes it took do not match the digest sent with them: a corruption
# in transit, never a header refused (sent again without it, corrupt bytes would land).
_MISMATCH = frozenset({"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch",
                       "XAmzContentSHA256Mismatch"})
#: How `S3Adapter.refusal` names the header asking for stored checksums on GET and HEAD.
CHECKSUM_MODE = "x-amz-checksum-mode"
#: How `S3Adapter.refusal` names the multi-object delete (POST ?delete).
DELETE_OBJECTS = "DeleteObjects"
# What durable does without a header or request the endpoint refused.
_WITHOUT = {
    "If-None-Match": "create-only writes fall back to a racy HEAD check",
    "If-Match": "no conditional writes, no leases",
    FULL_OBJECT: "multipart uploads carry the CRC32C of each part only",
    CHECKSUM_MODE: "reads ask for no stored checksum: what is read is checked by durable's "
                   "records alone, and a HEAD after a write compares no stored CRC32C",
    CRC32C_HEADER: "uploads carry Content-MD5 instead: the store still checks every byte it "
                   "takes, but keeps no CRC32C, so each write is checked by a HEAD (and part "
                   "probes) and reads by durable's records alone",
    DELETE_OBJECTS: "objects are deleted one DeleteObject each",
    MULTIPART_IF_NONE_MATCH: "a create-only write of more than part_size is a HEAD before "
                             "its completion, which racing writers can both pass",
}


class _EndpointCapabilities:
    """``S3Adapter.capabilities``: create-only as probed on the adapter's endpoint."""

    def __get__(self, obj: S3Adapter | None, owner: type) -> Capabilities:
        enforced = None if obj is None else obj.create_only_known()
        conditional = None if obj is None else obj.conditional_known()
        full = obj.refusal(FULL_OBJECT) if obj is not None else None
        checksums = (f"; this endpoint refuses the FULL_OBJECT checksum type ({full}): "
                     f"{_WITHOUT[FULL_OBJECT]}" if full else "")
        for header in (CRC32C_HEADER, CHECKSUM_MODE):
            said = obj.refusal(header) if obj is not None else None
            if said:
                checksums += f"; this endpoint refuses {header} ({said}): {_WITHOUT[header]}"
        if obj is not None and obj._create_only_multipart_by_endpoint.get(
                obj._endpoint()) is False:
            refused = obj.refusal(MULTIPART_IF_NONE_MATCH)
            how = f"refuses it ({refused})" if refused else "ignores it"
            checksums += (f"; If-None-Match on CompleteMultipartUpload: this endpoint {how} "
                          f"(probed): {_WITHOUT[MULTIPART_IF_NONE_MATCH]}")
        if enforced is False:
            refused = obj.refusal("If-None-Match") if obj else None
            how = f"refuses If-None-Match ({refused})" if refused else "ignores If-None-Match"
            return Capabilities(
                atomic_objects=True, create_only=False, durable=True, pinned_reads=True,
                note=f"this endpoint {how} (probed): create-only is a HEAD "
                     f"before the write, which two racing writers can both pass{checksums}",
                conditional_writes=conditional is not False, object_records=True)
        note = ("PutObject or a multipart upload completed at commit; CRC32C sent per part "
                "and per object; reads pinned by If-Match")
        if enforced is None:
            note += "; If-None-Match is probed on the endpoint at the first create-only write"
        if conditional is False:
            refused = obj.refusal("If-Match") if obj else None
            how = f"refuses If-Match ({refused})" if refused else "ignores If-Match"
            note += f"; this endpoint {how} on PUT/DELETE (probed): no leases"
        else:
            note += "; conditional writes by If-Match on PUT and DELETE"
        note += checksums
        return Capabilities(atomic_objects=True, create_only=True, durable=True,
                            pinned_reads=True, note=note,
                            conditional_writes=conditional is not False, object_records=True)


# Keys and common prefixes one existence check looks through before it falls back to a
# HEAD and a LIST (the S3 maximum page).
_EXISTS_PAGE = 1000

class S3Adapter(Adapter):
    protocols = ("s3", "s3a")
    capabilities = _EndpointCapabilities()
    # "probe" is the cheapest level that sees incident 002's objects, short by whole parts
    # behind a full-size HEAD, at write time. Its cost is a count of tiny requests, not bytes:
    # a HEAD plus one 1-byte GET per part of a multipart object, sent in parallel (64 MiB:
    # 9 requests, 8 bytes back), where "full" downloads the object again and "size" is the
    # HEAD alone; a PutObject answered with the CRC32C sent costs no request at either.
    # (moto reads a whole object to answer any range, so there a 64 MiB probe takes 0.33 s;
    # a real store answers a 1-byte GET in a round trip.) Writers of many multipart objects
    # who accept a HEAD-only check pass "size".
    default_verify: ClassVar[VerifyLevel] = "probe"

    # Endpoint URL -> whether it enforces If-None-Match; shared by every adapter.
    _create_only_by_endpoint: ClassVar[dict[str, bool]] = {}
    # Endpoint URL -> whether it enforces If-Match on PutObject and DeleteObject.
    _conditional_by_endpoint: ClassVar[dict[str, bool]] = {}
    # Endpoint URL -> whether it enforces If-None-Match on CompleteMultipartUpload too.
    _create_only_multipart_by_endpoint: ClassVar[dict[str, bool]] = {}
    # "<endpoint> <header>" -> how the endpoint refused that header (never sent again there).
    _refusals: ClassVar[dict[str, str]] = {}
    # Endpoints whose listings came without ETags (warned of once each).
    _untagged_listings: ClassVar[set[str]] = set()
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
        self._fast_session: Any = None
        self._light_stores: dict[str, Any] = {}  # bucket -> obstore store or None

    #: Send durable's own small whole-object PUTs (attempt records, markers) and the
    #: listings of its records directories through obstore where it reaches the store
    #: exactly as s3fs does (`_s3_light`): a round trip costs a seventh of the client CPU.
    #: Off: every request through s3fs.
    light_puts: ClassVar[bool] = True

    # plumbing -----------------------------------------------------------------------------
    def _split(self, path: str) -> tuple[str, str]:
        if "?versionId=" in path:
            # s3fs cuts the key there (a version of the object before it): a write would
            # replace that other object, and every record would name it.
            raise ValueError(f"{self.url(path)}: s3fs reads '?versionId=' in a key as a "
                             "version of another object; durable names current objects "
                             "only: rename the key")
        bucket, key, _ = self.fs.split_path(path)
        return str(bucket), str(key)

    def _call(self, method: str, url: str, what: str, *, pinned: str | None = None,
              create_only: bool = False, **kwargs: Any) -> dict[str, Any]:
        client = getattr(self.fs, "_s3", None)
        if client is None or not getattr(client.meta.events, "_durable_marks_200", False):
            sync(self.fs.loop, self.fs.set_session)
            mark_200_errors(self.fs.s3)  # a 200 with an error body said as such, not "500"
        try:
            result: dict[str, Any] = sync(self.fs.loop, self.fs._call_s3, method, **kwargs)
        except Exception as exc:
            raise failure(exc, url, what, pinned=pinned, create_only=create_only) from exc
        return result

    def _endpoint(self) -> str:
        client = getattr(self.fs, "_s3", None)
        if client is None:
            # The client is made once; its endpoint never changes (a refreshed session
            # is made from the same options). A hop to s3fs's loop for every look cost
            # 0.1-0.5 ms: `capabilities` looks four times, a commit a dozen.
            sync(self.fs.loop, self.fs.set_session)
            client = self.fs.s3
        return str(client.meta.endpoint_url)

    @classmethod
    def forget_endpoint(cls, endpoint: str) -> None:
        """Drop what was probed of ``endpoint`` (create-only, conditional writes): the next
        use probes again. For a store replaced at the same URL (a test proxy's port,
        reused by the next proxy in front of another store)."""
        with cls._probe_lock:
            for verdicts in (cls._create_only_by_endpoint, cls._conditional_by_endpoint,
                             cls._create_only_multipart_by_endpoint):
                verdicts.pop(endpoint.rstrip("/"), None)
            for header in _WITHOUT:
                cls._refusals.pop(f"{endpoint.rstrip('/')} {header}", None)

    # endpoint probes ----------------------------------------------------------------------
    def _probed(self, verdicts: dict[str, bool], path: str,
                probe: Callable[[str], bool]) -> bool:
        """``verdicts[endpoint]``, probed (once per endpoint, under a lock) if not known."""
        endpoint = self._endpoint()
        known = verdicts.get(endpoint)
        if known is None:
            with self._probe_lock:
                known = verdicts.get(endpoint)
                if known is None:
                    known = verdicts[endpoint] = probe(path)
        return known

    def _probe_places(self, path: str) -> list[tuple[str, str]]:
        """Where a probe for a write of ``path`` may go, as (bucket, key), best first.

        Never inside an entry's data or records: an object left there by a crash would
        make the entry look started (INCOMPLETE), or be adopted into its manifest. Best is
        the bucket's root records folder ``.durable/``, which no entry owns; for
        credentials limited to a prefix, the records folder ``D/.durable/`` of each
        directory D above the target's records (or above the target), from the top down:
        the highest one the writer may write to.
        """
        bucket, key = self._split(path)
        name = f"{RECORDS_DIR}/{PROBE_PREFIX}{uuid.uuid4().hex}"
        parts = key.split("/")
        above = parts[:parts.index(RECORDS_DIR)] if RECORDS_DIR in parts else parts[:-1]
        return [(bucket, "/".join([*above[:depth], name])) for depth in range(len(above) + 1)]

    @contextlib.contextmanager
    def _probe_object(self, path: str, body: bytes) -> Iterator[tuple[str, str, str]]:
        """A new probe object, as (bucket, key, url), removed when the block ends."""
        refused: PermissionError | None = None
        for bucket, key in self._probe_places(path):
            url = self.url(f"{bucket}/{key}")
            try:
                self._call("put_object", url, "probe PUT", Bucket=bucket, Key=key, Body=body)
            except PermissionError as exc:
                refused = exc  # credentials limited to a prefix: try one level down
                continue
            try:
                yield bucket, key, url
            finally:
                with contextlib.suppress(OSError):
                    self._call("delete_object", url, "DELETE", Bucket=bucket, Key=key)
            return
        assert refused is not None
        raise refused

    def create_only_known(self) -> bool | None:
        """Whether this endpoint enforces If-None-Match, if it was probed yet."""
        return self._create_only_by_endpoint.get(self._endpoint())

    def create_only_enforced(self, path: str) -> bool:
        """Whether this endpoint enforces If-None-Match; probed once, for a write of ``path``."""
        return self._probed(self._create_only_by_endpoint, path, self._probe_create_only)

    def refusal(self, header: str) -> str | None:
        """How this endpoint refused ``header`` ("If-None-Match", "If-Match") when probed,
        if it did: it is then never sent there."""
        return self._refusals.get(f"{self._endpoint()} {header}")

    def refused(self, exc: BaseException, header: str, *, note: bool = True) -> str | None:
        """How the endpoint refused ``header`` as not implemented, if ``exc`` (or an error
        it was raised from) is that refusal; noted (`refusal`) and warned of unless
        ``note`` is False (the caller notes it once the request without it succeeded)."""
        cause: BaseException | None = exc
        while cause is not None and error_fields(cause)[0] is None:
            cause = cause.__cause__
        status, code, message = error_fields(cause) if cause else (None, "", "")
        if status not in _NOT_IMPLEMENTED and code != "NotImplemented":
            return None
        said = f"HTTP {status} {code}: {message}".rstrip(": ")
        if note:
            self.note_refusal(header, said)
        return said

    def note_refusal(self, header: str, said: str) -> None:
        self._refusals[f"{self._endpoint()} {header}"] = said
        log.warning("%s: the endpoint refuses %s (%s): %s", self._endpoint(), header, said,
                    _WITHOUT[header])

    # flexible checksums refused --------------------------------------------------------------
    def _call_checked(self, method: str, url: str, what: str, *, pinned: str | None = None,
                      **kwargs: Any) -> dict[str, Any]:
        """`_call` of a GET or HEAD with ``ChecksumMode=ENABLED`` (the stored CRC32C in the
        answer, a GET's body checked against it by botocore), where the endpoint has not
        refused it. A store that answers the x-amz-checksum-* headers it lacks with 400
        "Unsupported header" (B2 does on uploads) or 501 failed every read on it. Refused,
        it is asked again without, and never sent there again: durable's records still
        check what is read. (botocore sends the header by itself unless its
        ``response_checksum_validation`` is "when_required": refused again, an OSError
        saying so.)"""
        mode: dict[str, Any] = {} if self.refusal(CHECKSUM_MODE) else {"ChecksumMode": "ENABLED"}
        try:
            return self._call(method, url, what, pinned=pinned, **kwargs, **mode)
        except OSError as exc:
            said = self.refused(exc, CHECKSUM_MODE, note=False) if mode else None
            if said is None:
                raise
            try:
                result = self._call(method, url, what, pinned=pinned, **kwargs)
            except OSError as again:
                if self.refused(again, CHECKSUM_MODE, note=False) is None:
                    raise
                raise OSError(
                    f"{url}: {what} answered {said} with the {CHECKSUM_MODE} header, and "
                    "so did the request sent again without it: this client adds the header "
                    "itself (botocore's response checksum validation). For a store that "
                    "refuses it, pass storage_options={'config_kwargs': "
                    "{'response_checksum_validation': 'when_required'}} (durable's records "
                    "still check every byte read)") from again
            self.note_refusal(CHECKSUM_MODE, said)
            return result

    def checksum_args(self, data: bytes, crc: int | None = None) -> dict[str, Any]:
        """What an upload of ``data`` (its CRC32C ``crc``, if known) carries for the store
        to check it by: its CRC32C, or where the endpoint refused that header, its MD5
        (`checksum_refused`)."""
        if self.refusal(CRC32C_HEADER) is None:
            return {"ChecksumAlgorithm": "CRC32C",
                    "ChecksumCRC32C": crc_to_b64(crc32c(data) if crc is None else crc)}
        return md5_args(data)

    def checksum_refused(self, exc: BaseException) -> str | None:
        """How the endpoint refused the CRC32C header, if ``exc`` may be that (HTTP 501, or
        400 for anything but a digest mismatch): B2 and OVH answer 400 InvalidArgument
        "Unsupported header 'x-amz-checksum-crc32c'", R2 once 501 NotImplemented. The
        request is then sent again with Content-MD5 (`without_checksum`): whatever the
        400 was, the store checks that digest too, so corrupt bytes never land."""
        cause: BaseException | None = exc
        while cause is not None and error_fields(cause)[0] is None:
            cause = cause.__cause__
        if cause is None or error_fields(cause)[1] in _MISMATCH:
            return None
        return self.refused(cause, CRC32C_HEADER, note=False)

    def without_checksum(self, url: str, what: str, said: str, call: Callable[[], Any]) -> Any:
        """``call()``, the request sent again with Content-MD5 instead of the CRC32C header
        the endpoint refused (``said``); noted once it is taken, never sent there again.
        Refused again, an OSError saying what the endpoint refuses and what to do."""
        try:
            result = call()
        except OSError as exc:
            again = self.checksum_refused(exc)
            if again is None:
                raise
            sync(self.fs.loop, self.fs.set_session)
            config = getattr(self.fs.s3.meta.config, "request_checksum_calculation", None)
            advice = (
                "this client adds a flexible checksum of its own (botocore's x-amz-checksum-"
                "crc32) to every upload: pass storage_options={'config_kwargs': "
                "{'request_checksum_calculation': 'when_required'}} so that durable's "
                "Content-MD5 goes alone (the store then still checks every byte it takes)"
                if config != "when_required" else
                "it takes no digest durable can send, so nothing would check the bytes it "
                "stores: durable does not write there")
            raise OSError(f"{url}: {what} answered {said} with the {CRC32C_HEADER} header, "
                          f"and {again} sent again with Content-MD5 instead. A store that "
                          f"refuses flexible checksums ({self._endpoint()}?) answers so: "
                          f"{advice}") from exc
        self.note_refusal(CRC32C_HEADER, said)
        return result

    def _probe_create_only(self, path: str) -> bool:
        body = b"durable create-only probe"
        with self._probe_object(path, body) as (bucket, key, url):
            try:
                sync(self.fs.loop, self.fs._call_s3, "put_object", Bucket=bucket, Key=key,
                     Body=body, IfNoneMatch="*")
            except Exception as exc:
                if error_fields(exc)[0] == 412:
                    return True
                # The same PUT without the header was taken a moment before: refusing
                # this one, the endpoint refuses the header. Sent on every create-only
                # write, it failed them all with this probe's error.
                if self.refused(exc, "If-None-Match") is not None:
                    return False
                raise failure(exc, url, "create-only probe PUT", create_only=True) from exc
        log.warning("%s: the endpoint ignores If-None-Match: create-only writes fall back "
                    "to a racy HEAD check", self._endpoint())
        return False

    def create_only_multipart_enforced(self, path: str) -> bool:
        """Whether this endpoint enforces If-None-Match on CompleteMultipartUpload as well
        as on PutObject (S3 added both in 2024; a store may have only the first); probed
        once, at the first create-only write of ``path`` in parts."""
        return self._probed(self._create_only_multipart_by_endpoint, path,
                            self._probe_create_only_multipart)

    def _probe_create_only_multipart(self, path: str) -> bool:
        """Complete a one-part upload over the probe object with If-None-Match: a 412 is
        the store enforcing it; a completed upload (it replaced the probe) is not."""
        with self._probe_object(path, b"durable create-only probe") as (bucket, key, url):
            upload = self._call("create_multipart_upload", url, "probe CreateMultipartUpload",
                                Bucket=bucket, Key=key)["UploadId"]
            done = False
            try:
                part = self._call("upload_part", url, "probe UploadPart", Bucket=bucket,
                                  Key=key, UploadId=upload, PartNumber=1, Body=b"probe")
                sync(self.fs.loop, self.fs._call_s3, "complete_multipart_upload",
                     Bucket=bucket, Key=key, UploadId=upload, IfNoneMatch="*",
                     MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
                done = True
            except Exception as exc:
                if error_fields(exc)[0] == 412:
                    return True
                if self.refused(exc, MULTIPART_IF_NONE_MATCH) is None:
                    raise failure(exc, url, "create-only probe CompleteMultipartUpload",
                                  create_only=True) from exc
            finally:
                if not done:
                    with contextlib.suppress(Exception):
                        self._call("abort_multipart_upload", url, "AbortMultipartUpload",
                                   Bucket=bucket, Key=key, UploadId=upload)
        if done:
            log.warning("%s: the endpoint ignores If-None-Match on CompleteMultipartUpload: "
                        "%s", self._endpoint(), _WITHOUT[MULTIPART_IF_NONE_MATCH])
        return False

    def conditional_known(self) -> bool | None:
        """Whether this endpoint enforces If-Match on PUT and DELETE, if it was probed yet."""
        return self._conditional_by_endpoint.get(self._endpoint())

    def supports_conditional(self, path: str) -> bool:
        """Probed once per endpoint: a store that ignored If-Match would let two writers
        both replace one lease version (a silent race)."""
        return self._probed(self._conditional_by_endpoint, path, self._probe_conditional)

    def _probe_conditional(self, path: str) -> bool:
        wrong = '"' + "0" * 32 + '"'
        with self._probe_object(path, b"durable conditional probe") as (bucket, key, url):
            for method, extra in (("put_object", {"Body": b"x"}), ("delete_object", {})):
                try:
                    sync(self.fs.loop, self.fs._call_s3, method, Bucket=bucket, Key=key,
                         IfMatch=wrong, **extra)
                except Exception as exc:
                    if error_fields(exc)[0] == 412:
                        continue
                    # Refused as not implemented: no leases (UnsupportedError), never a
                    # clean or an atomic_write failing on this probe's error.
                    if self.refused(exc, "If-Match") is not None:
                        return False
                    raise failure(exc, url, f"conditional probe {method}") from exc
                log.warning("%s: the endpoint ignores If-Match on %s: no leases here",
                            self._endpoint(), method)
                return False
        return True

    # conditional writes (leases) -----------------------------------------------------------
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
            status, code, _ = error_fields(exc)
            # 412: another version; 404: gone; 409 ConditionalRequestConflict: a racing
            # conditional write won. A retry of our own request that had landed also
            # answers 412: a false "lost", never a false "won".
            if status in (404, 409, 412):
                raise VersionMismatchError(
                    f"{url}: {method} If-Match {version} answered HTTP {status} {code}",
                    url=url, expected=version, found=None) from exc
            raise failure(exc, url, f"conditional {method}") from exc

    def replace_if(self, path: str, data: bytes, version: str) -> ObjectInfo:
        args = self.checksum_args(data)
        try:
            resp = self._conditional("put_object", path, version, Body=data, **args)
        except OSError as exc:
            said = self.checksum_refused(exc) if "ChecksumCRC32C" in args else None
            if said is None:
                raise
            resp = self.without_checksum(
                self.url(path), "conditional PutObject", said,
                lambda: self._conditional("put_object", path, version, Body=data,
                                          **md5_args(data)))
        self.fs.invalidate_cache(path)
        return ObjectInfo(path, len(data), etag(resp.get("ETag"), self.url(path)))

    def delete_if(self, path: str, version: str) -> None:
        self._conditional("delete_object", path, version)
        self.fs.invalidate_cache(path)

    # writing ------------------------------------------------------------------------------
    def put(self, path: str, data: bytes, *, create_only: bool = False,
            durable: bool = True) -> ObjectInfo:
        """As `Adapter.put`; small objects through obstore where it maps (`_s3_light`).
        There a create-only PUT refused over an object holding exactly ``data`` counts as
        this put's own (a retry after a lost answer): durable's create-only objects
        (markers, leases, fragments) all name their writer, so no two writers' bytes agree.
        """
        bucket, key = self._split(path)
        if self.light_puts and len(data) <= _LIGHT_PUT_MAX and key and (
                not create_only or self.create_only_enforced(path)):
            store = light_store(self, bucket)
            version = None if store is None else light_put(store, self, bucket, key, bytes(data),
                                                           create_only)
            if version is not None:
                self.fs.invalidate_cache(path)
                return ObjectInfo(path, len(data), version)
        return super().put(path, data, create_only=create_only, durable=durable)

    def read_small(self, path: str, limit: int) -> bytes | None:
        """As `Adapter.read_small`; through obstore where it maps (`_s3_light`): one GET,
        its size judged from its headers, for a sixth of s3fs's CPU. (No CRC32C check of
        the body, as for tensorstore's own read, which this replaces: the caller checks.)"""
        bucket, key = self._split(path)
        store = light_store(self, bucket) if self.light_puts and key else None
        got = None if store is None else get_small(store, self, bucket, key, limit)
        return got[0] if got is not None else self.read(path, limit=limit)

    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        # durable is moot: S3 acknowledges a write once it is stored durably.
        enforced = self.create_only_enforced(path) if create_only else True
        return S3AtomicFile(self, path, create_only=create_only, head_check=not enforced,
                            if_none_match=self.refusal("If-None-Match") is None)

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
        return ObjectInfo(path, content_size(resp, url, "HEAD"), etag(resp.get("ETag"), url),
                          _timestamp(resp.get("LastModified")),
                          record_fields(resp.get("Metadata")))

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        # A console "folder" (an empty object named "dir/") is not data; nor is one named
        # as the prefix itself ("ds/" below "ds"), whose key here would be "".
        return {k: i for k, i in self._list(prefix).items()
                if k and not (k.endswith("/") and i.size == 0)}

    def _list(self, prefix: str) -> dict[str, ObjectInfo]:
        self._parse_timestamps_fast()
        bucket, key = self._split(prefix)
        start = key.rstrip("/") + "/" if key else ""
        if self.light_puts and RECORDS_DIR in key.split("/"):
            # durable's own records (a commit lists them twice): through obstore, checked
            store = light_store(self, bucket)
            got = None if store is None else list_below(store, self, bucket, start)
            if got is not None:
                return dict(sorted(got.items()))
        out: dict[str, ObjectInfo] = {}
        untagged: list[str] = []  # listed without an ETag: stat-ed once the listing is done
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": start}
        call, what = "list_objects_v2", "ListObjectsV2"
        tokens: set[str] = set()
        while True:
            resp = self._call(call, self.url(prefix), what, **kwargs)
            contents = resp.get("Contents", [])
            for obj in contents:
                path = f"{bucket}/{obj['Key']}"
                rel = obj["Key"][len(start):]
                if rel in out or rel in untagged:
                    raise circling(self.url(prefix), self.url(path))
                if not str(obj.get("ETag") or "").strip().strip('"'):
                    untagged.append(rel)
                    continue
                out[rel] = ObjectInfo(
                    path, int(obj["Size"]), etag(obj.get("ETag"), self.url(path)),
                    _timestamp(obj.get("LastModified")))
            if not resp.get("IsTruncated"):
                if untagged:
                    out.update(self._stat_untagged(prefix, bucket, start, untagged, what))
                return dict(sorted(out.items()))
            token = resp.get("NextContinuationToken")
            if token and call == "list_objects_v2":
                if token in tokens:  # one that never advances: the same page for ever
                    raise circling(self.url(prefix), f"continuation token {token!r}")
                tokens.add(token)
                kwargs["ContinuationToken"] = token
                continue
            # Truncated without a token: a store that answers ListObjectsV2 as the original
            # ListObjects (pages by Marker), or leaves the token off. Go on after the last
            # key of the page, by ListObjects' Marker, which every S3 store takes (a page
            # that starts over is caught above as circling). The rest of the listing was
            # unreachable, and every commit, verify and scan of a large entry refused.
            if not contents:
                raise OSError(f"{self.url(prefix)}: {what} answered a truncated page with "
                              "no keys and no continuation token: the rest of the listing "
                              "is unreachable")
            call, what = "list_objects", "ListObjects"
            kwargs = {"Bucket": bucket, "Prefix": start, "Marker": contents[-1]["Key"]}

    def _stat_untagged(self, prefix: str, bucket: str, start: str, keys: Sequence[str],
                       what: str) -> dict[str, ObjectInfo]:
        """The objects a listing named without an ETag (some gateways leave it off), each
        as a HEAD answers: the ETag pins every read and lets a commit tell an object
        replaced behind its writer; refused outright, every commit and read of the prefix
        failed. The HEAD's size and ETag are one version's, a moment after the listing (as
        a listing taken then). An object gone since is left out, as that listing would."""
        endpoint = self._endpoint()
        if endpoint not in self._untagged_listings:
            self._untagged_listings.add(endpoint)
            log.warning("%s: %s answers without ETags; durable asks each object's with a "
                        "HEAD (one request per object listed)", endpoint, what)

        async def stat(key: str, gate: asyncio.Semaphore) -> ObjectInfo | None:
            path = f"{bucket}/{start}{key}"
            url = self.url(path)
            async with gate:
                try:
                    resp = await self.fs._call_s3("head_object", Bucket=bucket,
                                                  Key=f"{start}{key}")
                except Exception as exc:
                    err = failure(exc, url, "HEAD of an object listed without an ETag")
                    if isinstance(err, FileNotFoundError):
                        return None
                    raise err from exc
            try:
                tag = etag(resp.get("ETag"), url)
            except IntegrityError as exc:
                raise IntegrityError(
                    f"{url}: {what} on {endpoint} lists objects without an ETag, and the "
                    f"object's HEAD has none either ({resp.get('ETag')!r}): durable pins "
                    "every read and checks every commit by ETag. Have the store (or the "
                    "gateway in front of it) send ETags", url=url, expected="an ETag",
                    found=resp.get("ETag")) from exc
            return ObjectInfo(path, content_size(resp, url, "HEAD"), tag,
                              _timestamp(resp.get("LastModified")))

        async def all_of() -> list[ObjectInfo | None]:
            gate = asyncio.Semaphore(_PROBES_IN_FLIGHT)
            return await asyncio.gather(*(stat(k, gate) for k in keys))

        found: list[ObjectInfo | None] = sync(self.fs.loop, all_of)
        return {k: i for k, i in zip(keys, found, strict=True) if i is not None}

    def _parse_timestamps_fast(self) -> None:
        """botocore parses every listed object's LastModified with dateutil, 57 us each: a
        commit's listing of 2,000 chunks spent 0.19 s of CPU on it, half the client's time.
        S3 answers ISO 8601 there, which the stdlib parses in 0.1 us; anything else still
        goes to botocore's parser. Set once per client session of the filesystem."""
        if self.fs.session is not None and self._fast_session is self.fs.session:
            return
        sync(self.fs.loop, self.fs.set_session)
        self.fs.session.get_component("response_parser_factory").set_parser_defaults(
            timestamp_parser=_iso_timestamp)
        self._fast_session = self.fs.session

    def exists(self, path: str) -> bool:
        bucket, key = self._split(path)
        key = key.rstrip("/")
        url = self.url(path)
        if key:
            # One listing answers both "an object named KEY" and "objects below KEY/": KEY
            # among the keys, KEY/ among the common prefixes (a HEAD and a LIST otherwise).
            # Only siblings that start with KEY come along; a page too short for them
            # all falls back to asking each question on its own.
            resp = self._call("list_objects_v2", url, "ListObjectsV2", Bucket=bucket,
                              Prefix=key, Delimiter="/", MaxKeys=_EXISTS_PAGE)
            if any(c.get("Key") == key for c in resp.get("Contents", ())) or any(
                    p.get("Prefix") == f"{key}/" for p in resp.get("CommonPrefixes", ())):
                return True
            if not resp.get("IsTruncated"):
                return False
            if self.info(path) is not None:
                return True
        resp = self._call("list_objects_v2", url, "ListObjectsV2", Bucket=bucket,
                          Prefix=f"{key}/" if key else "", MaxKeys=1)
        return bool(resp.get("Contents"))

    def published_before_record(self, info: ObjectInfo) -> bool:
        # Completed from parts (its ETag counts them): only a multipart upload is
        # published before its marker.
        return info.version is not None and MULTIPART_ETAG.fullmatch(info.version) is not None

    def open_read(self, path: str, info: ObjectInfo) -> BinaryIO:
        return self._reader(path, info, None, _READ_BUFFER)

    def open_whole(self, path: str) -> tuple[ObjectInfo, BinaryIO] | None:
        """One GET: its headers give the info (metadata record included), its body the
        bytes, checked against the store's CRC32C as they arrive."""
        bucket, key = self._split(path)
        url = self.url(path)
        try:
            resp = self._call_checked("get_object", url, "GET", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        try:
            info = ObjectInfo(path, content_size(resp, url, "GET"), etag(resp.get("ETag"), url),
                              _timestamp(resp.get("LastModified")),
                              record_fields(resp.get("Metadata")))
        except BaseException:
            resp["Body"].close()
            raise
        body = S3Body(self.fs.loop, resp["Body"], url)
        return info, self._reader(path, info, body, io.DEFAULT_BUFFER_SIZE)

    def _reader(self, path: str, info: ObjectInfo, body: S3Body | None,
                buffer_size: int) -> BinaryIO:
        """A seekable reader of the version ``info`` names; ``body``: a GET open at byte 0."""
        url = self.url(path)
        if info.version is None:
            raise IntegrityError(f"{url}: no ETag to pin the read to", url=url)
        raw = PinnedStreamReader(url, info.size, functools.partial(self._get, path, info),
                                 retries=_BODY_RETRIES, body=body)
        return io.BufferedReader(raw, buffer_size=buffer_size)

    def read_range(self, path: str, info: ObjectInfo, start: int, length: int) -> bytes:
        """One GET of the range, If-Match the version's ETag (a body that ends early is
        asked again from where it stopped, as by every reader here)."""
        end = min(info.size, start + max(0, length))
        if start >= end:
            return b""
        url = self.url(path)
        if info.version is None:
            raise IntegrityError(f"{url}: no ETag to pin the read to", url=url)
        raw = PinnedStreamReader(url, end, functools.partial(self._get, path, info, end=end),
                                 retries=_BODY_RETRIES)
        with raw:
            raw.seek(start)
            data = bytearray()
            while len(data) < end - start and (block := raw.read(end - start - len(data))):
                data += block
        return exact_range(url, bytes(data), start, end - start)

    def _get(self, path: str, info: ObjectInfo, start: int, end: int | None = None
             ) -> S3Body:
        """Bytes [start, end) (end: the object's size if None) of the version ``info``
        names, the answer checked."""
        bucket, key = self._split(path)
        url = self.url(path)
        end = info.size if end is None else end
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "IfMatch": info.version}
        what = f"GET from byte {start}"
        if start or end != info.size:
            kwargs["Range"] = f"bytes={start}-{end - 1}"
            resp = self._call("get_object", url, what, pinned=info.version, **kwargs)
        else:
            # A whole-object GET: botocore checks the body against the store's CRC32C.
            resp = self._call_checked("get_object", url, what, pinned=info.version, **kwargs)
        try:
            check_response(resp, url, info, start, end - start)
        except BaseException:
            resp["Body"].close()
            raise
        return S3Body(self.fs.loop, resp["Body"], url)

    # verifying ----------------------------------------------------------------------------
    def check_parts(self, path: str, checksum: Checksum) -> None:
        # A multipart object of an entry: an entry committed COMPLETE over one short by a
        # part (its listing says the full size), found only by a verified read.
        if isinstance(checksum, WrittenChecksum) and len(checksum.part_ends) > 1:
            self.verify_written(path, checksum, self.default_verify)

    def verify_written(self, path: str, checksum: Checksum, level: VerifyLevel) -> None:
        """Check the stored object: see `Adapter.verify_written`. On S3, for a write made
        by this adapter (``checksum`` is its file's):

        - a PutObject whose answer reported the CRC32C sent: ``"size"`` and ``"probe"``
          make no request (the store checked that CRC32C over exactly the bytes it took,
          framed by Content-Length); an answer reporting another CRC32C is an
          IntegrityError at every level;
        - otherwise ``"size"`` is a HEAD comparing size, ETag and a stored full-object
          CRC32C, and ``"probe"`` adds a 1-byte GET at the end of every part sent;
        - ``"full"`` is one GET of the whole object (`_read_back`).

        A multipart object keeps the HEAD and the probes even when Complete's answer
        carries the FULL_OBJECT CRC32C sent: the store derives that one from the CRC32Cs
        of the parts as they arrived (it does not read the assembled object back), so it
        shows that the part list the store completed is ours, not that the store still
        holds every part. Incident 002's objects are short by parts the store had
        acknowledged.
        """
        if level == "none":
            return
        url = self.url(path)
        written = checksum if isinstance(checksum, WrittenChecksum) else None
        if written is not None and written.answered is not None:
            sent = crc_to_b64(checksum.crc)
            if written.answered != sent:
                raise IntegrityError(f"{url}: the store answered the PutObject with CRC32C "
                                     f"{written.answered}, the writer computed and sent "
                                     f"{sent}", url=url, expected=sent, found=written.answered)
            if level != "full":
                return
        if level == "full":
            self._read_back(path, checksum, written)
            return
        bucket, key = self._split(path)
        try:
            head = self._call_checked("head_object", url, "HEAD after write", Bucket=bucket,
                                      Key=key)
        except FileNotFoundError:
            raise IntegrityError(f"{url}: written but not found afterwards", url=url) from None
        tag = etag(head.get("ETag"), url)
        info = ObjectInfo(path, content_size(head, url, "HEAD after write"), tag)
        if info.size != checksum.size:
            raise IntegrityError(f"{url}: wrote {checksum.size} bytes, the store holds "
                                 f"{info.size}", url=url, expected=checksum.size,
                                 found=info.size)
        if written is not None and written.etag is not None and written.etag != info.version:
            raise IntegrityError(f"{url}: the write returned ETag {written.etag}, the store "
                                 f"now says {info.version} (replaced by another writer?)",
                                 url=url, expected=written.etag, found=info.version)
        # Only a full-object CRC32C compares with ours; a multipart object's COMPOSITE one
        # is a checksum of part checksums (and moto leaves off its "-N" suffix).
        stored = head.get("ChecksumCRC32C")
        whole = head.get("ChecksumType") == "FULL_OBJECT" or (
            head.get("ChecksumType") is None and not MULTIPART_ETAG.fullmatch(tag))
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

    def _read_back(self, path: str, checksum: Checksum,
                   written: WrittenChecksum | None) -> None:
        """``verify="full"``: one GET (no HEAD first: its headers say the size and ETag,
        and every byte is compared, which no stored checksum can add to)."""
        url = self.url(path)
        opened = self.open_whole(path)
        if opened is None:
            raise IntegrityError(f"{url}: written but not found afterwards", url=url)
        info, f = opened
        with f:
            if written is not None and written.etag is not None and \
                    written.etag != info.version:
                raise IntegrityError(f"{url}: the write returned ETag {written.etag}, the "
                                     f"store now says {info.version} (replaced by another "
                                     "writer?)", url=url, expected=written.etag,
                                     found=info.version)
            ck = Checksum()
            # One byte past the size: a body longer than the writer sent is caught too.
            while ck.size <= checksum.size and (block := f.read(8 * MiB)):
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
                raise failure(exc, url, f"GET of {what} (byte {offset})",
                               pinned=info.version) from exc
            body = resp["Body"]
            try:
                check_response(resp, url, info, offset, 1)
                data = await body.read()
            except BODY_BROKEN as exc:
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

    def now(self, path: str) -> float | None:
        """The Date of the store's answer to a one-key listing next to ``path``."""
        bucket, key = self._split(path)
        resp = self._call("list_objects_v2", self.url(path), "ListObjectsV2", Bucket=bucket,
                          Prefix=key, MaxKeys=1)
        date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            return parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return None  # no Date, or a malformed one: ages fall back to this machine's clock

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
                errors: Sequence[dict[str, str]]
                if self.refusal(DELETE_OBJECTS) is not None:
                    errors = sync(self.fs.loop, self._delete_each, bucket, batch)
                else:
                    errors = self._delete_batch(bucket, batch)
                if errors:
                    shown = "; ".join(f"{self.url(bucket + '/' + e.get('Key', '?'))}: "
                                      f"{e.get('Code')} {e.get('Message')}" for e in errors[:5])
                    raise OSError(f"{len(errors)} objects could not be deleted: {shown}")
            for key in keys:
                self.fs.invalidate_cache(f"{bucket}/{key}")

    def _delete_batch(self, bucket: str, keys: Sequence[str]) -> Sequence[dict[str, str]]:
        """One DeleteObjects; the keys it could not delete, as its Errors. An endpoint
        that refuses DeleteObjects (not implemented, or asking for the Content-MD5 botocore
        no longer sends) is noted and asked key by key from then on: every clean,
        overwrite and delete failed on such a store."""
        try:
            resp = self._call("delete_objects", self.url(bucket), "DeleteObjects",
                              Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys],
                                                     "Quiet": True})
        except OSError as exc:
            # Deleting key by key is right on every store: noted at once.
            if self.refused(exc, DELETE_OBJECTS) is None:
                raise
            errors: Sequence[dict[str, str]] = sync(self.fs.loop, self._delete_each, bucket,
                                                    keys)
            return errors
        return resp.get("Errors") or []

    async def _delete_each(self, bucket: str, keys: Sequence[str]
                           ) -> Sequence[dict[str, str]]:
        """DeleteObject of every key, some at once; the failures, as DeleteObjects' Errors."""
        gate = asyncio.Semaphore(_PROBES_IN_FLIGHT)

        async def one(key: str) -> dict[str, str] | None:
            async with gate:
                try:
                    await self.fs._call_s3("delete_object", Bucket=bucket, Key=key)
                except Exception as exc:
                    status, code, message = error_fields(exc)
                    if status == 404:  # gone already: what a delete asks for
                        return None
                    return {"Key": key, "Code": code or type(exc).__name__,
                            "Message": message or str(exc)}
            return None

        return [e for e in await asyncio.gather(*(one(k) for k in keys)) if e is not None]

    def delete_prefix(self, prefix: str) -> None:
        if not self._split(prefix)[1].strip("/"):
            raise ValueError(f"{self.url(prefix)}: refusing to delete a whole bucket")
        self.delete([prefix.rstrip("/"), *(i.path for i in self._list(prefix).values())])


def _iso_timestamp(value: str) -> datetime.datetime:
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return parse_timestamp(value)  # type: ignore[no-any-return]
    # Without a zone botocore assumes local time: leave those to it.
    return parsed if parsed.tzinfo is not None else parse_timestamp(value)


def _timestamp(value: object) -> float | None:
    return value.timestamp() if isinstance(value, datetime.datetime) else None
