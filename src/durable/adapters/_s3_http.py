"""What an S3 endpoint answers, judged: ETags, error responses, GET answers and bodies.

Shared by the S3 adapter (`durable.adapters.s3`) and its writer (`_s3_upload`). Every
error names the object, the request and what the store said.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
from botocore.exceptions import FlexibleChecksumError, IncompleteReadError, ResponseStreamingError
from fsspec.asyn import sync

from durable._errors import IntegrityError
from durable.adapters._ranged import BrokenBody
from durable.adapters.base import ObjectInfo, caused_by, strong_etag

__all__ = ["BODY_BROKEN", "MULTIPART_ETAG", "S3Body", "check_response", "content_size",
           "error_fields", "etag", "failure", "mark_200_errors"]

# A body that stops mid-way surfaces as one of these, depending on where the socket died.
BODY_BROKEN = (aiohttp.ClientError, IncompleteReadError, ResponseStreamingError,
               asyncio.TimeoutError, ConnectionError)
# An AWS-style multipart ETag: "<md5 of the part md5s>-<number of parts>".
MULTIPART_ETAG = re.compile(r'"[0-9a-fA-F]+-(\d+)"')


def etag(raw: object, url: str) -> str:
    """The ETag as a quoted strong tag, or IntegrityError if it cannot pin a read
    (`durable.adapters.base.strong_etag`, shared with the Azure adapter)."""
    return strong_etag(raw, url)


def content_size(resp: dict[str, Any], url: str, what: str) -> int:
    """The object's size from the Content-Length of a HEAD or whole GET, or IntegrityError
    naming the object: an answer without one (a gateway that streams it chunked) has no
    size to check a read or a manifest against, and was a KeyError from deep inside."""
    length = resp.get("ContentLength")
    if not isinstance(length, int) or length < 0:
        raise IntegrityError(f"{url}: {what} answered without a Content-Length (got "
                             f"{length!r}): the object's size is unknown, so nothing read "
                             "of it can be checked; the store or a proxy in front of it "
                             "leaves the header off", url=url, expected="Content-Length",
                             found=length)
    return length


def _error_response(exc: BaseException) -> dict[str, Any] | None:
    """botocore's parsed error response of ``exc``, as s3fs raised it (its cause)."""
    for e in (exc, exc.__cause__):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and isinstance(resp.get("Error"), dict):
            return resp
    return None


def error_fields(exc: BaseException) -> tuple[int | None, str, str]:
    """(HTTP status, S3 error code, message) of a botocore error, as s3fs raised it."""
    resp = _error_response(exc)
    if resp is None:
        return None, "", ""
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    err = resp["Error"]
    return status, str(err.get("Code", "")), str(err.get("Message", ""))


def mark_200_errors(client: Any) -> None:
    """Have ``client`` (s3fs's botocore client) mark the errors the store answered with
    a 200: S3 answers some failures of CompleteMultipartUpload and CopyObject (and a
    gateway any request) with a 200 whose body is an error document. botocore's own
    handler turns its status into 500, to retry it, and leaves no trace of the 200: the
    error said "HTTP 500", which the store never answered. Wrapped here, in its place.
    Once per client; a botocore without that handler is left as it is."""
    events = client.meta.events
    if getattr(events, "_durable_marks_200", False):
        return
    events._durable_marks_200 = True
    from botocore import handlers

    original = getattr(handlers, "_handle_200_error", None)
    if original is None:
        return

    def marked(response_dict: Any = None, customized_response_dict: Any = None,
               **kwargs: Any) -> None:
        was = response_dict.get("status_code") if response_dict else None
        original(response_dict=response_dict,
                 customized_response_dict=customized_response_dict, **kwargs)
        if was == 200 and response_dict["status_code"] != 200 and \
                customized_response_dict is not None:
            customized_response_dict[_SERVED_200] = True  # kept in the parsed response

    try:
        events.unregister("before-parse.s3.*", original)
    except ValueError:
        return  # not registered on this client: nothing turns a 200 into a 500 here
    events.register_first("before-parse.s3.*", marked)


_SERVED_200 = "DurableServed200"


def failure(exc: BaseException, url: str, what: str, *, pinned: str | None = None,
            create_only: bool = False) -> BaseException:
    """The error for a failed request, naming the object, the request and the status."""
    status, code, message = error_fields(exc)
    if status is None:
        return OSError(f"{url}: {what} failed: {type(exc).__name__}: {exc}")
    if (_error_response(exc) or {}).get(_SERVED_200):
        # Not a 500 (botocore's relabelling, `mark_200_errors`): what the store did.
        return OSError(f"{url}: {what} answered HTTP 200 with an error document in its "
                       f"body: {code}: {message} (the request failed; retried as a 500)")
    # A HEAD's error has no body: botocore then gives the status as the code ("403").
    label = f"HTTP {status} {code}" if code and code != str(status) else f"HTTP {status}"
    text = f"{url}: {what} answered {label}: {message}".rstrip(": ")
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


def check_response(resp: dict[str, Any], url: str, info: ObjectInfo, start: int,
                   length: int) -> None:
    """The response is the bytes asked for, of the version asked for, or IntegrityError."""
    # Without one, named as such: "the store answers Content-Length -1" said nothing.
    got = content_size(resp, url, f"GET of {length} bytes from byte {start}")
    if got != length:
        raise IntegrityError(f"{url}: asked for {length} bytes from byte {start}, the store "
                             f"answers Content-Length {got} (the object is {info.size} bytes "
                             "as listed)", url=url, expected=length, found=got)
    # Checked here too: a store that ignores If-Match would serve another version silently.
    served = etag(resp.get("ETag"), url)
    if served != info.version:
        raise IntegrityError(f"{url}: replaced since it was listed (GET served ETag {served}, "
                             f"listed with {info.version})", url=url, expected=info.version,
                             found=served)
    if start or length != info.size:
        want = f"bytes {start}-{start + length - 1}/{info.size}"
        if resp.get("ContentRange") != want:
            raise IntegrityError(f"{url}: asked for {want}, the store answers Content-Range "
                                 f"{resp.get('ContentRange')}", url=url, expected=want,
                                 found=resp.get("ContentRange"))


class S3Body:
    """A GET's streaming body as `PinnedStreamReader` reads it: read on s3fs's event loop;
    a transport failure is a `BrokenBody` (asked again), a CRC32C mismatch final."""

    def __init__(self, loop: asyncio.AbstractEventLoop, body: Any, url: str) -> None:
        self._loop = loop
        self._body = body
        self._url = url

    def read(self, n: int) -> bytes:
        try:
            data: bytes = sync(self._loop, self._body.read, n)
        except FlexibleChecksumError as exc:
            raise IntegrityError(f"{self._url}: the body does not match the CRC32C the store "
                                 f"recorded ({exc})", url=self._url) from None
        except BODY_BROKEN as exc:
            raise BrokenBody(type(exc).__name__, stalled=_timed_out(exc)) from exc
        return data

    def close(self) -> None:
        self._body.close()


def _timed_out(exc: BaseException) -> bool:
    # aiohttp's read timeout surfaces as asyncio's TimeoutError (fsspec's FSTimeoutError
    # once through its sync), botocore's as ReadTimeoutError (no builtin TimeoutError).
    return caused_by(exc, lambda e: isinstance(e, TimeoutError)
                     or "Timeout" in type(e).__name__)
