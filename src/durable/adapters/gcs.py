"""Google Cloud Storage through gcsfs (extra ``gcs``): the JSON API, over gcsfs's session.

Why not ``GCSFile``: its ``close()`` (and so an exception leaving ``with fs.open(...)``)
finalizes whatever was written, and it sends no CRC32C for the store to check. The requests
here go through gcsfs's authenticated, retrying ``_call`` instead:

- up to `CHUNK` bytes: one multipart upload whose object resource carries our ``crc32c``;
- beyond: a resumable session, fed `CHUNK`-sized pieces as the bytes arrive and finalized
  only by the request `commit` sends (with ``X-Goog-Hash: crc32c=...``); at least one byte
  is always held back for it, so nothing else can finalize the object. `abort` cancels the
  session; an unfinalized session is never visible and expires on its own.

The CRC32C the store answers with is compared with ours as well: where a store skipped the
check (emulators do), an object that differs from what was sent is removed at once.
Create-only is ``ifGenerationMatch=0``; every ranged GET names the generation seen at open
(``generation=`` and ``ifGenerationMatch=``), so a replaced object fails the read.

Records in the object's own metadata (docs/protocol.md, "Records in object metadata"): the
single-request upload carries the record (``durable-version``, ``durable-size``, ...) in its
object resource's ``metadata``, with the bytes; `info` (the object resource) returns it.
A resumable session fixes its metadata when it starts, before size and CRC32C are known,
so a larger object keeps the sidecar marker (`_GCSAtomicFile.carries_record`). A media GET
returns no custom metadata: `open_whole` is the stat and a GET (2 requests). A
single-request upload whose reply gives the size and CRC32C sent needs no stat to verify
it (`verify_written`).

Every write names itself in the object's metadata (``durable-write``): gcsfs retries a
request whose answer was lost, and when the first attempt had landed, the store refuses the
retry (a create-only upload: 412; the finalizing request of a session already finalized:
404). The object is then read back, and if it carries this write's token the write
succeeded. Uploads left open: resumable sessions cannot be listed (the JSON API has no such
call; GCS drops a session a week after it started), so `durable clean` cannot see them; an
unfinalized session never becomes an object.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import json
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO, ClassVar
from urllib.parse import quote

import aiohttp
from fsspec.asyn import sync
from gcsfs.retry import HttpError

from durable._checksum import Checksum, crc32c, crc_from_b64, crc_to_b64, crc_to_hex
from durable._errors import IntegrityError, UnsupportedError
from durable._protocol import META_RECORD_FOLLOWS, RECORDS_DIR, record_fields
from durable.adapters._ranged import open_pinned
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

__all__ = ["CHUNK", "READ_TIMEOUT", "GCSAdapter"]

#: Resumable pieces (GCS wants multiples of 256 KiB) and the single-request upload limit.
CHUNK = 8 * 1024 * 1024
_DELETE_CONCURRENCY = 16
_CANCEL_TIMEOUT = 10.0
#: Seconds gcsfs waits for a connection, and for the next bytes of an answer, where the
#: storage options set no ``requests_timeout`` (gcsfs sets none: a stalled body was waited
#: for as long as the store stalled). As S3's and Azure's clients do by default.
READ_TIMEOUT = 60.0
#: Custom metadata naming the write that put an object there (see `GCSAdapter._ours`).
_TOKEN = "durable-write"


def _q(text: str) -> str:
    return quote(text, safe="")


def _body(data: bytes | bytearray) -> io.BytesIO:
    # A file, not bytes: aiohttp warns about (and blocks its loop on) large bytes bodies,
    # and gcsfs rewinds a file before each retry.
    return io.BytesIO(bytes(data))


def _modified(resource: dict[str, Any]) -> float | None:
    # `updated` moves with metadata changes too, so an object is never taken for older than
    # it is; emulators (and old objects) may carry only timeCreated.
    stamp = resource.get("updated") or resource.get("timeCreated")
    try:
        return datetime.datetime.fromisoformat(str(stamp)).timestamp() if stamp else None
    except ValueError:
        return None


def _said(text: object) -> str:
    """What the store said, on one bounded line: an XML error page's code and message
    (a gateway's), else its first line; an error page must not flood a message."""
    page = str(text).strip()
    found = [re.search(f"<{tag}>(.*?)</{tag}>", page, re.S) for tag in ("Code", "Message")]
    if all(found):
        return " ".join(m[1].strip() for m in found if m)[:200]
    return page.splitlines()[0][:200] if page else ""


def _failure(url: str, what: str, exc: Exception) -> Exception | None:
    """The builtin a caller catches for a request gcsfs refused, naming the object, the
    request and the status, as the S3 adapter's are; None where ``exc`` is not a refusal.

    gcsfs raises its own ``HttpError`` (no ``OSError``) for 5xx and 401 after its retries,
    a plain ``OSError("Forbidden: ...")`` for 403, and a ``JSONDecodeError`` for a 200 whose
    body is not JSON (a gateway's error page): a scan or a `durable verify` would abort on
    the first instead of listing that object as unreadable."""
    if isinstance(exc, HttpError):
        status = exc.code
        message = exc.message.decode(errors="replace") if isinstance(exc.message, bytes) \
            else exc.message
        cls = PermissionError if status in (401, 403) else OSError
        return cls(f"{url}: {what} answered HTTP {status}: {_said(message)}")
    if type(exc) is OSError and str(exc).startswith("Forbidden"):
        detail = str(exc).partition("\n")[2]
        return PermissionError(f"{url}: {what} answered HTTP 403: {_said(detail)}")
    if isinstance(exc, aiohttp.ClientPayloadError):
        # The body ended before its Content-Length on every retry gcsfs made: never short
        # data, and (a resource, a listing) no bare aiohttp error naming nothing.
        return IntegrityError(f"{url}: {what} arrived short on every attempt ({exc})",
                              url=url, expected="the whole answer", found="a short body")
    if isinstance(exc, aiohttp.ClientError) and not isinstance(
            exc, aiohttp.ClientPayloadError | OSError):
        # A connection the store closed (ServerDisconnectedError) on every retry gcsfs made.
        return OSError(f"{url}: {what} failed: {type(exc).__name__}: {_said(exc)}")
    if isinstance(exc, TimeoutError):
        # aiohttp's timeout of gcsfs's requests_timeout (as fsspec's FSTimeoutError: it
        # says nothing at all), on the last of gcsfs's attempts.
        return TimeoutError(f"{url}: {what} stalled: no whole answer within the storage "
                            f"option requests_timeout (unless set, {READ_TIMEOUT:g} s for "
                            "a connection and between reads)")
    if isinstance(exc, json.JSONDecodeError):
        return IntegrityError(f"{url}: {what} answered a body that is not JSON "
                              f"({_said(exc.doc)!r:.80}): not the store's answer (an error "
                              "page served as 200?)", url=url, expected="a JSON resource",
                              found=_said(exc.doc)[:80])
    return None


def _answer(url: str, what: str, doc: Any, kind: str, asked: str) -> dict[str, Any]:
    """``doc``, if it is the JSON answer asked for (GCS and the emulators name its
    ``kind``); else IntegrityError naming ``url``: a gateway serving GCS's JSON error
    document as 200 made a resource a bare KeyError, and a listing an empty one (verify
    then called every object missing)."""
    if isinstance(doc, dict) and doc.get("kind") == kind:
        return doc
    err = doc.get("error") if isinstance(doc, dict) else None
    found = (f"the error {err.get('code')} {str(err.get('message'))[:120]!r}"
             if isinstance(err, dict) else f"{json.dumps(doc)[:80]!r}")
    raise IntegrityError(f"{url}: {what} answered {found} with 200, not {asked} (an error "
                         "page served as 200?)", url=url, expected=kind, found=found)


def _refused_checksum(exc: Exception) -> bool:
    # GCS (and gcp-storage-emulator) answer 400 "Provided CRC32C ... doesn't match
    # calculated CRC32C ..."; gcsfs raises it as HttpError (ValueError if "invalid").
    return "crc32c" in str(exc).lower()


class _WrittenChecksum(Checksum):
    """The running size and CRC32C, and whether the store's reply proved the bytes."""

    __slots__ = ("proven",)

    def __init__(self) -> None:
        super().__init__()
        #: The upload's reply gave the size and CRC32C sent (`GCSAdapter._accept`):
        #: `GCSAdapter.verify_written` needs no stat.
        self.proven = False


class _GCSAtomicFile(AtomicFile):
    def __init__(self, adapter: GCSAdapter, path: str, *, create_only: bool) -> None:
        super().__init__(path)
        self.checksum: _WrittenChecksum = _WrittenChecksum()
        self._adapter = adapter
        self._bucket, self._key = adapter._split(path)
        self._create_only = create_only
        # Names this write in the object's metadata (see `GCSAdapter._ours`).
        self._token = uuid.uuid4().hex
        self._buf = bytearray()
        self._session: str | None = None  # resumable session URI, once one is started
        self._persisted = 0  # bytes the session has stored (the offset of _buf[0])

    def _write(self, data: memoryview) -> None:
        self._buf += data
        # Strictly more than a chunk: the last bytes always wait for the finalizing request.
        while len(self._buf) > CHUNK:
            if self._session is None:
                self._session = self._adapter._start_session(
                    self._bucket, self._key, create_only=self._create_only, token=self._token,
                    follows=self.record_follows)
            self._send(CHUNK, total=None)

    def _send(self, n: int, total: int | None) -> dict[str, Any] | None:
        """PUT the first ``n`` buffered bytes; the object resource if this finalized."""
        assert self._session is not None
        start, end = self._persisted, self._persisted + n - 1
        headers = {"Content-Range": f"bytes {start}-{end}/{'*' if total is None else total}",
                   "Content-Type": "application/octet-stream"}
        if total is not None:
            # The finalizing request: GCS checks the whole object against this CRC32C.
            headers["X-Goog-Hash"] = f"crc32c={crc_to_b64(self.checksum.crc)}"
        fs = self._adapter.fs
        try:
            status, reply, _, body = sync(fs.loop, fs._request, "PUT", self._session,
                                          headers=headers, data=_body(self._buf[:n]))
        except FileExistsError:
            # 412 on the finalizing request: the precondition of the session failed, or a
            # retry found the object its own first attempt finalized.
            if total is not None and (found := self._adapter._ours(self.path, self._token)):
                return found
            raise self._adapter._exists_error(self.path) from None
        except FileNotFoundError:
            # 404 on the finalizing request: the session is gone, finalized by a first
            # attempt whose answer was lost (the retry finds no session), or expired.
            if total is not None and (found := self._adapter._ours(self.path, self._token)):
                return found
            raise
        except (ValueError, OSError, HttpError) as exc:
            if total is not None and _refused_checksum(exc):
                raise self._adapter._refused(self.path, self.checksum.crc, exc) from exc
            failure = _failure(self._adapter.url(self.path), f"upload of bytes {start}-{end}",
                               exc)
            if failure is None:
                raise
            raise failure from exc
        if status != 308:
            if total is None:
                raise OSError(f"{self._adapter.url(self.path)}: upload session answered "
                              f"{status} to a piece that must not finalize it")
            try:
                resource = json.loads(body)
            except ValueError as exc:  # not JSON (an error page): named, not bare
                failure = _failure(self._adapter.url(self.path), "upload", exc)
                if failure is None:
                    raise
                raise failure from exc
            return _answer(self._adapter.url(self.path), "upload", resource, "storage#object",
                           "the object's resource")
        # 308: the session kept bytes 0..N. A piece stored in part is resent from there.
        got = reply.get("Range", "")
        persisted = int(got.rpartition("-")[2]) + 1 if got else 0
        if not start < persisted <= end + 1:
            # No progress, or a count we cannot place: stop rather than resend forever.
            raise OSError(f"{self._adapter.url(self.path)}: upload session reports {persisted} "
                          f"bytes stored after a piece of bytes {start}-{end}")
        del self._buf[:persisted - start]
        self._persisted = persisted
        return None

    @property
    def carries_record(self) -> bool:
        # The single-request upload sends its object resource (metadata included) with the
        # bytes; a resumable session's metadata was fixed at its start, before the size and
        # CRC32C were known.
        return self._session is None

    def _commit(self) -> ObjectInfo:
        ck = self.checksum
        resource = None
        if self._session is None:
            resource = self._adapter._upload_single(self.path, bytes(self._buf), ck.crc,
                                                    create_only=self._create_only,
                                                    token=self._token, record=self.record)
        while resource is None:
            if not self._buf:
                raise OSError(f"{self._adapter.url(self.path)}: upload session holds every "
                              "byte but did not finalize the object")
            resource = self._send(len(self._buf), total=ck.size)
        self._buf = bytearray()
        self._session = None
        info = self._adapter._accept(self.path, resource, ck.size, ck.crc, self.record)
        ck.proven = resource.get("crc32c") is not None  # _accept compared size and CRC32C
        return info

    def _abort(self) -> None:
        self._buf = bytearray()
        session, self._session = self._session, None
        if session is not None:
            # Tidiness only: without its finalizing request the session never becomes an
            # object. Best effort, and never from the event loop (garbage collection).
            with contextlib.suppress(Exception):
                sync(self._adapter.fs.loop, self._adapter._cancel, session,
                     timeout=_CANCEL_TIMEOUT)


class GCSAdapter(Adapter):
    protocols = ("gs", "gcs")
    capabilities = Capabilities(
        atomic_objects=True, create_only=True, durable=True, pinned_reads=True,
        note=("single-request upload up to 8 MiB, else a resumable session finalized only "
              "at commit; CRC32C sent for GCS to check and the stored CRC32C compared on "
              "the reply; create-only by ifGenerationMatch=0; reads pinned to the "
              "generation. Emulators enforce less: gcp-storage-emulator checks crc32c but "
              "no precondition and no generation pin; fake-gcs-server enforces "
              "ifGenerationMatch=0 on single-request uploads only (not resumable ones) and "
              "generation= on reads, and checks no checksum. Conditional writes (leases): "
              "ifGenerationMatch on a single-request upload and on DELETE, probed once per "
              "endpoint (fake-gcs-server ignores it on DELETE: an enforced upload goes "
              "first there). A single-request upload carries the durable record in its "
              "metadata; an object written by a resumable session keeps a sidecar marker"),
        conditional_writes=True, object_records=True,
    )
    # Endpoint -> whether it enforces ifGenerationMatch on uploads, and on deletes.
    _conditional_by_endpoint: ClassVar[dict[str, tuple[bool, bool]]] = {}
    _probe_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, fs: Any) -> None:
        super().__init__(fs)
        if getattr(fs, "requests_timeout", None) is None:
            # Set on the filesystem, where gcsfs reads it at every request, as the storage
            # option would have: a per-read limit, not a total one, so a large piece that
            # keeps arriving is never cut off; a stall is retried by gcsfs, then an error.
            fs.requests_timeout = aiohttp.ClientTimeout(sock_connect=READ_TIMEOUT,
                                                        sock_read=READ_TIMEOUT)

    # helpers --------------------------------------------------------------------------------
    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = self.fs._strip_protocol(path).lstrip("/").partition("/")
        return bucket, key

    @property
    def _upload_url(self) -> str:
        return f"{self.fs._location}/upload/storage/v1/b/{{}}/o"

    def _refused(self, path: str, crc: int, exc: Exception) -> IntegrityError:
        url = self.url(path)
        return IntegrityError(f"{url}: the store refused the upload, its bytes do not match "
                              f"the CRC32C {crc_to_hex(crc)} sent with them (corrupted in "
                              f"transit?): {exc}", url=url, expected=crc_to_hex(crc),
                              found=str(exc))

    def _no_bucket(self, path: str) -> FileNotFoundError:
        """The 404 of an upload, which only a missing bucket answers; gcsfs's own error
        named the upload API ("http://HOST/upload/storage/v1/b/NAME/o"), not the object."""
        return FileNotFoundError(f"{self.url(path)}: no such bucket "
                                 f"{self._split(path)[0]!r} (the upload answered 404)")

    def _exists_error(self, path: str) -> FileExistsError:
        return FileExistsError(f"{self.url(path)} exists: create-only write refused by "
                               "the store (ifGenerationMatch=0)")

    def _call_on(self, path: str, what: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.call(*args, **kwargs)`` of a request on ``path``, its refusals
        the builtins `_failure` makes (404 and 412 stay gcsfs's FileNotFoundError and
        FileExistsError, which the callers judge)."""
        try:
            return self.fs.call(*args, **kwargs)
        except (HttpError, OSError, ValueError, aiohttp.ClientError) as exc:
            failure = _failure(self.url(path), what, exc)
            if failure is None:
                raise
            raise failure from exc

    def _ours(self, path: str, token: str | None) -> dict[str, Any] | None:
        """The object resource if the write named ``token`` put the object there, else None.

        A request whose answer was lost is sent again by gcsfs; when the first attempt had
        landed, the store refuses the retry (a create-only upload: 412; a finalized
        session: 404), and a writer whose object is published would be told it failed.
        """
        if token is None:
            return None
        bucket, key = self._split(path)
        try:
            resource: dict[str, Any] = self.fs.call("GET", "b/{}/o/{}", bucket, key,
                                                    json_out=True)
        except FileNotFoundError:
            return None
        return resource if (resource.get("metadata") or {}).get(_TOKEN) == token else None

    def _start_session(self, bucket: str, key: str, *, create_only: bool, token: str,
                       follows: bool = False) -> str:
        params = {"ifGenerationMatch": "0"} if create_only else {}
        # ``follows``: published before its marker (the metadata is fixed here), so a
        # writer killed between the two leaves an object read as a durable writer's
        # (`META_RECORD_FOLLOWS`), never adopted as data written before durable.
        resource = {"name": key, "metadata": {
            _TOKEN: token, **({META_RECORD_FOLLOWS: "marker"} if follows else {})}}
        try:
            reply, _ = self._call_on(
                f"{bucket}/{key}", "start of a resumable upload",
                "POST", self._upload_url, bucket, uploadType="resumable", name=key,
                json=resource, headers={"X-Upload-Content-Type": "application/octet-stream"},
                **params)
        except FileExistsError:
            raise self._exists_error(f"{bucket}/{key}") from None
        except FileNotFoundError:
            raise self._no_bucket(f"{bucket}/{key}") from None  # gcsfs named the API only
        location = reply.get("Location")
        if not location:
            raise OSError(f"gs://{bucket}/{key}: resumable upload started without a session "
                          "URI")
        return str(location)

    async def _cancel(self, session: str) -> None:
        # Straight to the session, no retries: abort must not wait out a backoff.
        await self.fs._set_session()
        async with self.fs.session.delete(session, headers=self.fs._get_headers(None)) as r:
            await r.read()

    def _upload_single(self, path: str, data: bytes, crc: int, *, create_only: bool = False,
                       token: str | None = None, record: Mapping[str, str] | None = None,
                       generation: str | None = None) -> dict[str, Any]:
        """One multipart upload: create-only, on ``generation``, or not; ``token`` names the
        write in the object's metadata, ``record`` goes there too (its fields as given)."""
        bucket, key = self._split(path)
        # A random boundary: a fixed one can occur in the data and cut it short.
        boundary = uuid.uuid4().hex
        resource: dict[str, Any] = {"name": key, "crc32c": crc_to_b64(crc)}
        metadata = {**({_TOKEN: token} if token is not None else {}), **(record or {})}
        if metadata:
            resource["metadata"] = metadata
        meta = json.dumps(resource)
        body = b"".join([
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{meta}\r\n"
            f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
            data, f"\r\n--{boundary}--\r\n".encode()])
        params = {"ifGenerationMatch": "0"} if create_only else {}
        if generation is not None:
            params = {"ifGenerationMatch": generation}
        try:
            reply: dict[str, Any] = self.fs.call(
                "POST", self._upload_url, bucket, uploadType="multipart", json_out=True,
                headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
                data=_body(body), **params)
        except FileNotFoundError:
            if generation is not None:
                raise  # replace_if: the object is gone, which its caller says
            raise self._no_bucket(path) from None  # gcsfs named only the upload API
        except FileExistsError:
            if generation is not None:
                raise  # replace_if: another generation (a lost answer counts as lost)
            found = self._ours(path, token) if create_only else None
            if found is None:
                raise self._exists_error(path) from None
            return found
        except (ValueError, OSError, HttpError) as exc:
            if _refused_checksum(exc):
                raise self._refused(path, crc, exc) from exc
            failure = _failure(self.url(path), "upload", exc)
            if failure is None:
                raise
            raise failure from exc
        return _answer(self.url(path), "upload", reply, "storage#object",
                       "the object's resource")

    def _accept(self, path: str, resource: dict[str, Any], size: int, crc: int,
                record: Mapping[str, str] | None = None) -> ObjectInfo:
        """The written object's info, or IntegrityError (and the object removed) if the
        store holds other bytes than were sent: a store that skipped the CRC32C check.
        Its ``record`` is ``record`` only where the reply shows the store kept it: else
        None, and the caller writes a marker instead of trusting a record not stored."""
        self.fs.invalidate_cache(path)
        got_size = int(resource.get("size", -1))
        got_crc = resource.get("crc32c")
        generation = str(resource["generation"])
        found = crc_from_b64(got_crc) if isinstance(got_crc, str) else None
        if got_size == size and found in (crc, None):
            kept = record_fields(resource.get("metadata"))
            stored = dict(record) if record and all(
                kept.get(k) == v for k, v in record.items()) else None
            return ObjectInfo(path, size, generation, _modified(resource), stored)
        bucket, key = self._split(path)
        outcome = "removed it"
        try:
            # Only this generation: a newer object by another writer is not ours to remove.
            self.fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=generation)
        except (OSError, ValueError, HttpError) as exc:
            outcome = f"could not remove it ({exc})"
        url = self.url(path)
        shown = crc_to_hex(found) if found is not None else "none"
        raise IntegrityError(
            f"{url}: sent {size} bytes with CRC32C {crc_to_hex(crc)}, the store kept "
            f"{got_size} bytes with CRC32C {shown}; {outcome}", url=url,
            expected=(size, crc_to_hex(crc)), found=(got_size, shown))

    # writing --------------------------------------------------------------------------------
    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        return _GCSAtomicFile(self, path, create_only=create_only)

    # reading --------------------------------------------------------------------------------
    def info(self, path: str) -> ObjectInfo | None:
        bucket, key = self._split(path)
        if not key or key.endswith("/"):
            return None
        try:
            res = self._call_on(path, "GET of its resource", "GET", "b/{}/o/{}", bucket,
                                  key, json_out=True)
        except FileNotFoundError:
            return None
        res = _answer(self.url(path), "GET of its resource", res, "storage#object",
                      "the object's resource")
        return ObjectInfo(path, int(res["size"]), str(res["generation"]), _modified(res),
                          record_fields(res.get("metadata")))

    def verify_written(self, path: str, checksum: Checksum, level: VerifyLevel) -> None:
        """See `Adapter.verify_written`. A write whose reply gave the size and CRC32C sent
        (`_accept` compared them; GCS checked the CRC32C over the bytes it took) meets
        ``"size"`` and ``"probe"`` with no request; otherwise a stat, as everywhere."""
        if level in ("size", "probe") and isinstance(checksum, _WrittenChecksum) \
                and checksum.proven:
            return
        super().verify_written(path, checksum, level)

    def _listing(self, prefix: str, limit: int | None = None) -> dict[str, ObjectInfo]:
        bucket, key = self._split(prefix.rstrip("/") + "/")
        out: dict[str, ObjectInfo] = {}
        token = None
        tokens: set[str] = set()
        while True:
            try:
                page = self._call_on(prefix, "listing", "GET", "b/{}/o", bucket,
                                       json_out=True, prefix=key, pageToken=token,
                                       maxResults=limit or 1000)
            except FileNotFoundError:
                # gcsfs says "b/NAME/o": a listing finds no objects, it fails on no bucket
                raise FileNotFoundError(f"{self.url(prefix)}: no such bucket "
                                        f"{bucket!r}") from None
            page = _answer(self.url(prefix.rstrip("/")), "the listing", page,
                           "storage#objects", "a listing of objects")
            for item in page.get("items", []):
                name = item["name"]
                if name.endswith("/"):
                    continue  # a "directory" placeholder, not an object
                if name[len(key):] in out:
                    raise circling(self.url(prefix), self.url(f"{bucket}/{name}"))
                out[name[len(key):]] = ObjectInfo(f"{bucket}/{name}", int(item["size"]),
                                                  str(item["generation"]), _modified(item))
            token = page.get("nextPageToken")
            if not token or (limit is not None and len(out) >= limit):
                return out
            if token in tokens:  # one that never advances: the same page for ever
                raise circling(self.url(prefix), f"page token {token!r}")
            tokens.add(token)

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        return dict(sorted(self._listing(prefix).items()))

    def exists(self, path: str) -> bool:
        return self.info(path) is not None or bool(self._listing(path, limit=1))

    def published_before_record(self, info: ObjectInfo) -> bool:
        # Over one request's size: a resumable upload, published before its marker.
        return info.size > CHUNK

    def open_read(self, path: str, info: ObjectInfo) -> BinaryIO:
        return open_pinned(self.url(path), info.size, self._fetcher(path, info))

    def read_range(self, path: str, info: ObjectInfo, start: int, length: int) -> bytes:
        # One GET of exactly the range (a reader would fetch a read-ahead block).
        want = max(0, min(length, info.size - start))
        data = self._fetcher(path, info)(start, want) if want else b""
        return exact_range(self.url(path), data, start, want)

    def _fetcher(self, path: str, info: ObjectInfo) -> Callable[[int, int], bytes]:
        """``fetch(start, length)``: one GET of those bytes of the generation ``info``
        names, refused if the object is another generation now."""
        bucket, key = self._split(path)
        url = self.url(path)
        media = f"{self.fs._location}/download/storage/v1/b/{_q(bucket)}/o/{_q(key)}"
        pin = {} if info.version is None else {"generation": info.version,
                                               "ifGenerationMatch": info.version}

        def fetch(start: int, length: int) -> bytes:
            try:
                reply, body = self._call_on(
                    path, f"GET of bytes {start}-{start + length - 1}", "GET", media,
                    alt="media", **pin,
                    headers={"Range": f"bytes={start}-{start + length - 1}"})
            except (FileNotFoundError, FileExistsError) as exc:
                # 404 for a generation that is gone, 412 (gcsfs: FileExistsError) for a
                # live object that is another generation now.
                raise IntegrityError(
                    f"{url}: replaced or deleted since it was opened (generation "
                    f"{info.version} is no longer there)", url=url, expected=info.version,
                    found="another generation or none") from exc
            served = reply.get("x-goog-generation")
            if info.version is not None and served is not None and served != info.version:
                raise IntegrityError(f"{url}: asked for generation {info.version}, served "
                                     f"{served}", url=url, expected=info.version,
                                     found=served)
            # The bytes asked for, as on S3: a store (or a proxy) answering another range of
            # the same length would hand out the wrong bytes, caught by nothing where the
            # object has no record (require_record=False, durable:: on a plain object).
            # (A body of another length is the reader's error: it says how many bytes.)
            want = f"bytes {start}-{start + length - 1}/{info.size}"
            answered = reply.get("Content-Range")
            if len(body) == length and answered != want and (
                    answered is not None or start or length != info.size):
                raise IntegrityError(f"{url}: asked for {want}, the store answers "
                                     f"Content-Range {answered}", url=url, expected=want,
                                     found=answered)
            data: bytes = body
            return data

        return fetch

    def read_small(self, path: str, limit: int) -> bytes | None:
        """As `Adapter.read_small`: one GET of its first ``limit + 1`` bytes (a Range the
        store bounds), over ``limit`` a ValueError with the size its Content-Range gives.
        (tensorstore's gcs driver, which the open read markers through, downloads an
        object whole before its size is known: a marker of gigabytes, then the check.)"""
        bucket, key = self._split(path)
        if not key or key.endswith("/"):
            return None
        media = f"{self.fs._location}/download/storage/v1/b/{_q(bucket)}/o/{_q(key)}"
        try:
            reply, body = self._call_on(path, f"GET of bytes 0-{limit}", "GET", media,
                                        alt="media", headers={"Range": f"bytes=0-{limit}"})
        except FileNotFoundError:
            return None
        except OSError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, HttpError) and cause.code == 416):
                raise
            return self.read(path, limit=limit)  # no byte 0 to range over: an empty object
        if len(body) > limit:
            # The total after the "/" of "bytes 0-LIMIT/TOTAL"; a store that ignored the
            # Range (200, the whole body) says it by the body's own length.
            total = (reply.get("Content-Range") or "").rpartition("/")[2]
            size = total if total.isdigit() else len(body)
            raise ValueError(f"{self.url(path)} is {size} bytes, over the limit of {limit}")
        data: bytes = body
        return data

    # the store's clock; uploads left open --------------------------------------------------
    def now(self, path: str) -> float | None:
        """The Date of the store's answer to a one-object listing next to ``path``."""
        bucket, key = self._split(path)
        headers, _ = self._call_on(path, "listing", "GET", "b/{}/o", bucket, prefix=key,
                                     maxResults=1)
        try:
            return parsedate_to_datetime(headers.get("Date")).timestamp()
        except (TypeError, ValueError):
            return None  # no Date, or a malformed one: ages fall back to this machine's clock

    def list_uploads(self, prefix: str) -> Sequence[Upload]:
        """[]: a resumable session left open by a killed writer cannot be listed (the JSON
        API has no call for it); it holds no object, and GCS drops it a week after it
        started. (Multipart uploads of the XML API are listable, but durable never starts
        one.)"""
        return []

    # conditional writes (leases): ifGenerationMatch ------------------------------------------
    def supports_conditional(self, path: str) -> bool:
        """Probed once per endpoint, next to ``path``: emulators differ (gcp-storage-emulator
        enforces no precondition), and one that ignored it would be a silent race."""
        return self._conditional(path)[0]

    def _conditional(self, path: str) -> tuple[bool, bool]:
        endpoint = str(self.fs._location)
        known = self._conditional_by_endpoint.get(endpoint)
        if known is None:
            with self._probe_lock:
                known = self._conditional_by_endpoint.get(endpoint)
                if known is None:
                    known = self._probe_conditional(path)
                    self._conditional_by_endpoint[endpoint] = known
        return known

    def _probe_conditional(self, path: str) -> tuple[bool, bool]:
        """(uploads enforce ifGenerationMatch, deletes do)."""
        # In the bucket's own records folder, which no entry owns (as on S3): beside
        # ``path`` it went into an entry's records, a new record to a clean listing them
        # (which then kept the entry as "a writer started") and, left by a crash, a sign
        # of a writer that never was.
        bucket = self._split(path)[0]
        probe = f"{bucket}/{RECORDS_DIR}/.durable-probe-{uuid.uuid4().hex}"
        key = self._split(probe)[1]
        try:
            first = self._upload_single(probe, b"probe", crc32c(b"probe"))
            wrong = str(int(first["generation"]) + 1)
            try:
                self._upload_single(probe, b"x", crc32c(b"x"), generation=wrong)
                return False, False
            except FileExistsError:
                pass
            try:
                self.fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=wrong)
                return True, False
            except FileExistsError:
                return True, True
        finally:
            with contextlib.suppress(OSError, ValueError):
                self.delete([probe])

    def _require_conditional(self, path: str) -> None:
        if not self.supports_conditional(path):
            raise UnsupportedError(f"{self.url(path)}: this endpoint ignores "
                                   "ifGenerationMatch (probed): no conditional writes")

    def _mismatch(self, path: str, version: str) -> VersionMismatchError:
        url = self.url(path)
        return VersionMismatchError(f"{url}: not at generation {version} "
                                    "(ifGenerationMatch refused)", url=url, expected=version,
                                    found=None)

    def replace_if(self, path: str, data: bytes, version: str) -> ObjectInfo:
        self._require_conditional(path)
        crc = crc32c(data)
        try:
            resource = self._upload_single(path, data, crc, generation=version)
        except (FileExistsError, FileNotFoundError):
            raise self._mismatch(path, version) from None
        return self._accept(path, resource, len(data), crc)

    def delete_if(self, path: str, version: str) -> None:
        self._require_conditional(path)
        bucket, key = self._split(path)
        if not self._conditional(path)[1]:
            # A DELETE that ignores its precondition (fake-gcs-server): make the object
            # ours first with an enforced upload; a racing conditional write would then
            # have to be on the version we just wrote, which no one has seen.
            version = str(self.replace_if(path, b"", version).version)
        try:
            self.fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
        except (FileExistsError, FileNotFoundError):
            raise self._mismatch(path, version) from None
        self.fs.invalidate_cache(path)

    # removing -------------------------------------------------------------------------------
    def delete(self, paths: Iterable[str]) -> None:
        keys = [self._split(p) for p in paths]
        keys = [(b, k) for b, k in keys if k]  # a bare bucket is never deleted here
        if keys:
            sync(self.fs.loop, self._delete_all, keys)
            for bucket, key in keys:
                self.fs.invalidate_cache(f"{bucket}/{key}")

    async def _delete_all(self, keys: Sequence[tuple[str, str]]) -> None:
        limit = asyncio.Semaphore(_DELETE_CONCURRENCY)

        async def one(bucket: str, key: str) -> None:
            async with limit:
                try:
                    await self.fs._call("DELETE", "b/{}/o/{}", bucket, key)
                except FileNotFoundError:
                    pass  # gone already: what a delete wants
                except (HttpError, OSError, ValueError, aiohttp.ClientError) as exc:
                    # gcsfs's "Forbidden: b/NAME/o/KEY" or HttpError: as every request's.
                    failure = _failure(self.url(f"{bucket}/{key}"), "DELETE", exc)
                    if failure is None:
                        raise
                    raise failure from exc

        await asyncio.gather(*(one(b, k) for b, k in keys))

    def delete_prefix(self, prefix: str) -> None:
        paths = [info.path for info in self._listing(prefix).values()]
        self.delete([prefix.rstrip("/"), *paths])
