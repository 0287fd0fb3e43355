"""A fault-injecting reverse proxy for S3-compatible endpoints (for tests only).

:class:`FaultProxy` listens on ``127.0.0.1`` on a free port and forwards every request to an
upstream S3 endpoint (a moto server in this project's tests). Clients point their
``endpoint_url`` at :attr:`FaultProxy.url`. The request line, the headers (``Host`` included)
and the body are forwarded byte for byte as received, so SigV4 signatures stay valid; only a
fault that deliberately changes a request touches it. Responses are streamed back.

Faults are selected at run time with :meth:`FaultProxy.add` / :meth:`FaultProxy.inject` and
removed with :meth:`FaultProxy.clear`. Each fault has a :class:`Match` (methods, path regex,
key substring, query predicate, arbitrary predicate) and a ``times`` budget (``None`` means
unlimited). Faults apply in the order they were added; several may apply to one request
(for example a delay and an ETag rewrite), and the first *terminal* one (an error answer,
a dropped connection) ends the exchange.

Kinds (see each class for details):

=======================  ===========================================================
``truncate_body``        GET body cut short; the upstream's Content-Length is kept,
                         the connection is closed early.
``short_object``         a persistently short object: HEAD (and listings) report the
                         full size, GETs serve data as if the tail (``missing_bytes``,
                         or the last ``parts_missing`` parts of ``part_size``) was lost.
``drop_part_bytes``      UploadPart body cut to its first ``keep`` bytes before it is
                         forwarded (Content-Length adjusted); the client sees success.
``corrupt_part_bytes``   UploadPart body bytes flipped before forwarding, same length.
``error``                an S3 XML error document (403/500/503/...) instead of, or after,
                         forwarding.
``error_body_with_200``  the same XML served as a 200 object body (a gateway or CDN
                         that cached an error page as the object).
``rewrite_etag``         ETag header (and ``<ETag>`` elements in XML bodies) made
                         unquoted, weak, empty, absent, or rewritten by a callable.
``delay``                sleep before forwarding, or between response head and body.
``drop_connection``      close the socket without a response, after the upstream
                         applied the request, or after ``after_bytes`` body bytes.
``strip_headers``        remove response headers by name (default ``x-amz-checksum-*``:
                         a store without flexible checksums).
=======================  ===========================================================

Every exchange is logged in :attr:`FaultProxy.requests` (:class:`RequestRecord`).

What the clients do on their own (measured against moto 5.2.5 with botocore 1.43,
aiobotocore 3.10, s3fs/fsspec 2026.9.0, awscrt installed; pinned in tests/test_faults.py):

* A body shorter than its Content-Length (``truncate_body``, ``short_object`` "cut",
  ``drop_connection(after_bytes=)``) is always an error: botocore raises
  ``ResponseStreamingError`` (no retry); s3fs retries the GET 5 times, then lets aiohttp's
  ``ClientPayloadError`` escape (not an ``OSError``). A one-off cut is invisible to s3fs.
* A consistently short body (``short_object`` "consistent") is returned silently by every
  client unless botocore can check a full-object ``x-amz-checksum-*`` header (single PUT;
  not a multipart object's composite checksum; not a store without checksums). s3fs raises
  ``OSError(EINVAL)`` only for a read that starts past the short end.
* An error document served as 200 is returned as the data by every client, even when HEAD
  reported another size.
* 403 raises (``ClientError`` / ``PermissionError``); 500/503 and dropped connections are
  retried, so a transient one is invisible.
* fsspec caches: ``simplecache`` keeps the partial file of a failed download and serves it
  as the whole file afterwards; ``blockcache`` keeps the failed block as zeros; ``filecache``
  keeps nothing from a failed download; all three keep short or error bodies that came
  without an error.

Example::

    with FaultProxy(upstream=moto_url) as proxy:
        fs = s3fs.S3FileSystem(endpoint_url=proxy.url)
        proxy.inject("truncate_body", keep=100, key="bucket/data.bin", times=1)
        ...
        assert proxy.count(method="GET", key="data.bin") == 2
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import io
import math
import re
import socket
import socketserver
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from types import TracebackType
from typing import Any, ClassVar, Literal, Self, cast
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape as _xml_escape

__all__ = [
    "CorruptPartBytes",
    "Delay",
    "DropConnection",
    "DropPartBytes",
    "Error",
    "ErrorBodyWith200",
    "Fault",
    "FaultProxy",
    "Match",
    "RequestInfo",
    "RequestRecord",
    "RewriteEtag",
    "ShortObject",
    "StripHeaders",
    "TruncateBody",
    "corrupt_part_bytes",
    "delay",
    "drop_connection",
    "drop_part_bytes",
    "error",
    "error_body_with_200",
    "rewrite_etag",
    "s3_error_document",
    "short_object",
    "strip_headers",
    "truncate_body",
]

_BUF = 64 * 1024
_MAX_LINE = 64 * 1024
_MAX_HEADERS = 256
_MAX_XML_REWRITE = 16 * 1024 * 1024

_LOGGED_HEADERS = frozenset(
    {
        "range",
        "content-length",
        "content-type",
        "content-md5",
        "content-encoding",
        "transfer-encoding",
        "expect",
        "if-match",
        "if-none-match",
        "if-modified-since",
        "if-unmodified-since",
    }
)


class _PeerClosed(Exception):
    """A peer closed its connection before a message was complete."""


class _ProtocolError(Exception):
    """A peer sent something that is not HTTP/1.x as this proxy understands it."""


# --------------------------------------------------------------------------- HTTP helpers


class _Header:
    __slots__ = ("name", "raw", "value")

    def __init__(self, name: str, value: str, raw: bytes | None) -> None:
        self.name = name
        self.value = value
        self.raw = raw  # the line exactly as received; None once modified


class Headers:
    """An ordered, case-insensitive header list that re-serialises unmodified lines verbatim."""

    def __init__(self, items: Iterable[tuple[str, str]] = ()) -> None:
        self._items: list[_Header] = [_Header(n, v, None) for n, v in items]

    @classmethod
    def _from_raw(cls, items: list[_Header]) -> Headers:
        h = cls()
        h._items = items
        return h

    def get(self, name: str, default: str | None = None) -> str | None:
        lname = name.lower()
        for item in self._items:
            if item.name.lower() == lname:
                return item.value
        return default

    def get_all(self, name: str) -> list[str]:
        lname = name.lower()
        return [item.value for item in self._items if item.name.lower() == lname]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def items(self) -> list[tuple[str, str]]:
        return [(item.name, item.value) for item in self._items]

    def set(self, name: str, value: str) -> None:
        """Replace the first header called ``name`` (keeping its position), drop the others."""
        lname = name.lower()
        found = False
        kept: list[_Header] = []
        for item in self._items:
            if item.name.lower() == lname:
                if found:
                    continue
                found = True
                if item.value != value or item.raw is None:
                    item.value = value
                    item.raw = None
            kept.append(item)
        if not found:
            kept.append(_Header(name, value, None))
        self._items = kept

    def remove(self, name: str) -> None:
        lname = name.lower()
        self._items = [item for item in self._items if item.name.lower() != lname]

    def to_bytes(self) -> bytes:
        out = bytearray()
        for item in self._items:
            if item.raw is not None:
                out += item.raw
            else:
                out += f"{item.name}: {item.value}\r\n".encode("latin-1")
        return bytes(out)

    def has_token(self, name: str, token: str) -> bool:
        token = token.lower()
        return any(
            t.strip().lower() == token for value in self.get_all(name) for t in value.split(",")
        )


def _read_line(rfile: io.BufferedReader) -> bytes:
    line = rfile.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise _ProtocolError("header line too long")
    return line


def _read_head(rfile: io.BufferedReader) -> tuple[bytes, Headers] | None:
    """Read a start line and headers; ``None`` on a clean EOF before the first byte."""
    line = _read_line(rfile)
    while line in (b"\r\n", b"\n"):
        line = _read_line(rfile)
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise _PeerClosed("connection closed inside the start line")
    items: list[_Header] = []
    while True:
        h = _read_line(rfile)
        if not h or not h.endswith(b"\n"):
            raise _PeerClosed("connection closed inside the headers")
        if h in (b"\r\n", b"\n"):
            break
        if h[:1] in (b" ", b"\t") and items:  # obsolete line folding
            items[-1].value += " " + h.strip().decode("latin-1")
            assert items[-1].raw is not None
            items[-1].raw += h
            continue
        name, sep, value = h.partition(b":")
        if not sep or not name.strip():
            raise _ProtocolError(f"malformed header line {h[:80]!r}")
        items.append(_Header(name.decode("latin-1").strip(), value.decode("latin-1").strip(), h))
        if len(items) > _MAX_HEADERS:
            raise _ProtocolError("too many headers")
    return line, Headers._from_raw(items)


def _iter_exact(rfile: io.BufferedReader, n: int) -> Iterator[bytes]:
    while n > 0:
        data = rfile.read1(min(_BUF, n))
        if not data:
            raise _PeerClosed(f"connection closed with {n} body bytes outstanding")
        n -= len(data)
        yield data


def _iter_until_close(rfile: io.BufferedReader) -> Iterator[bytes]:
    while True:
        data = rfile.read1(_BUF)
        if not data:
            return
        yield data


def _chunk_size(line: bytes) -> int:
    if not line.endswith(b"\n"):
        raise _PeerClosed("connection closed inside a chunk header")
    text = line.split(b";", 1)[0].strip()
    try:
        size = int(text, 16)
    except ValueError:
        raise _ProtocolError(f"bad chunk size {line[:40]!r}") from None
    if size < 0:
        raise _ProtocolError("negative chunk size")
    return size


class _Count:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


def _iter_chunked(
    rfile: io.BufferedReader, *, raw: bool, count: _Count | None = None
) -> Iterator[bytes]:
    """Chunked transfer coding: yield the framed bytes as received (``raw``) or the data.
    ``count`` accumulates the decoded data bytes either way."""
    while True:
        line = _read_line(rfile)
        size = _chunk_size(line)
        if count is not None:
            count.n += size
        if raw:
            yield line
        if size == 0:
            while True:
                trailer = _read_line(rfile)
                if not trailer.endswith(b"\n"):
                    raise _PeerClosed("connection closed inside the chunked trailer")
                if raw:
                    yield trailer
                if trailer in (b"\r\n", b"\n"):
                    return
        yield from _iter_exact(rfile, size)
        crlf = _read_line(rfile)
        if crlf not in (b"\r\n", b"\n"):
            raise _PeerClosed("chunk data not followed by CRLF")
        if raw:
            yield crlf


@dataclass(frozen=True)
class _Framing:
    kind: Literal["none", "length", "chunked", "close"]
    length: int = 0


def _content_length(headers: Headers) -> int | None:
    values = {v.strip() for v in headers.get_all("content-length")}
    if not values:
        return None
    if len(values) != 1:
        raise _ProtocolError("conflicting Content-Length headers")
    value = values.pop()
    if not value.isdigit():
        raise _ProtocolError(f"bad Content-Length {value!r}")
    return int(value)


def _is_chunked(headers: Headers) -> bool:
    codings = [
        t.strip().lower() for v in headers.get_all("transfer-encoding") for t in v.split(",")
    ]
    return bool(codings) and codings[-1] == "chunked"


def _request_framing(headers: Headers) -> _Framing:
    if _is_chunked(headers):
        return _Framing("chunked")
    n = _content_length(headers)
    if n is None or n == 0:
        return _Framing("none")
    return _Framing("length", n)


def _response_framing(method: str, status: int, headers: Headers) -> _Framing:
    if method == "HEAD" or status < 200 or status in (204, 304):
        return _Framing("none")
    if _is_chunked(headers):
        return _Framing("chunked")
    n = _content_length(headers)
    if n is None:
        return _Framing("close")
    return _Framing("length", n)


def _iter_body(
    rfile: io.BufferedReader, framing: _Framing, *, raw: bool, count: _Count | None = None
) -> Iterator[bytes]:
    """The body of a message with this framing: decoded data, or (``raw``) the bytes as
    framed on the wire. ``count`` accumulates the decoded data bytes."""
    if framing.kind == "chunked":
        return _iter_chunked(rfile, raw=raw, count=count)
    if framing.kind == "length":
        it = _iter_exact(rfile, framing.length)
    elif framing.kind == "close":
        it = _iter_until_close(rfile)
    else:
        return iter(())
    return it if count is None else _counted(it, count)


def _counted(it: Iterator[bytes], count: _Count) -> Iterator[bytes]:
    for piece in it:
        count.n += len(piece)
        yield piece


def _drain(it: Iterator[bytes]) -> int:
    n = 0
    for piece in it:
        n += len(piece)
    return n


def _parse_status(line: bytes) -> tuple[str, int]:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise _ProtocolError(f"bad status line {line[:80]!r}")
    try:
        return parts[0].decode("ascii"), int(parts[1])
    except ValueError:
        raise _ProtocolError(f"bad status line {line[:80]!r}") from None


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def _parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    if value is None:
        return None
    m = _CONTENT_RANGE.fullmatch(value.strip())
    if m is None:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)), total


# ------------------------------------------------------------------------- S3 documents

_REASONS = {
    200: "OK",
    206: "Partial Content",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    409: "Conflict",
    412: "Precondition Failed",
    416: "Requested Range Not Satisfiable",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

_DEFAULT_ERRORS: dict[int, tuple[str, str]] = {
    400: ("BadRequest", "Bad Request"),
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    409: ("OperationAborted", "A conflicting conditional operation is in progress."),
    412: ("PreconditionFailed", "At least one of the pre-conditions you specified did not hold"),
    416: ("InvalidRange", "The requested range is not satisfiable"),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    502: ("BadGateway", "The proxy could not reach the upstream server."),
    503: ("SlowDown", "Please reduce your request rate."),
    504: ("GatewayTimeout", "The upstream server did not answer in time."),
}


def s3_error_document(
    code: str, message: str, *, request_id: str | None = None, resource: str | None = None
) -> bytes:
    """An S3-style XML error document, as bytes (UTF-8)."""
    rid = request_id or uuid.uuid4().hex[:16].upper()
    res = f"<Resource>{_xml_escape(resource)}</Resource>" if resource is not None else ""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{_xml_escape(code)}</Code><Message>{_xml_escape(message)}</Message>"
        f"{res}<RequestId>{_xml_escape(rid)}</RequestId></Error>"
    ).encode()


def _status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n".encode("ascii")


# ----------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class RequestInfo:
    """What a matcher sees of a request."""

    method: str
    target: str  # the raw request-target
    path: str  # percent-decoded path, e.g. "/bucket/some/key"
    raw_query: str
    # parsed, blank values kept: "?uploads" -> {"uploads": [""]}
    query: Mapping[str, Sequence[str]]
    headers: Headers

    @property
    def is_upload_part(self) -> bool:
        return self.method == "PUT" and "partNumber" in self.query and "uploadId" in self.query


QueryPredicate = Callable[[Mapping[str, Sequence[str]]], bool]


@dataclass(frozen=True, kw_only=True)
class Match:
    """Which requests a fault applies to. Every given criterion must hold.

    ``methods``: a method or methods (``None``: the fault kind's default, see each kind).
    ``path``: a regular expression searched in the percent-decoded path (``/bucket/key``).
    ``key``: a substring of the percent-decoded path.
    ``query``: a parameter name or names that must be present; a name prefixed with ``!``
    must be absent (``query=("partNumber", "uploadId")``, ``query="!uploadId"``); or a
    callable given the parsed query.
    ``where``: any callable given the :class:`RequestInfo`.
    """

    methods: str | Sequence[str] | None = None
    path: str | re.Pattern[str] | None = None
    key: str | None = None
    query: str | Sequence[str] | QueryPredicate | None = None
    where: Callable[[RequestInfo], bool] | None = None

    def matches(self, info: RequestInfo, default_methods: frozenset[str] | None = None) -> bool:
        methods = _methods(self.methods) if self.methods is not None else default_methods
        if methods is not None and info.method not in methods:
            return False
        if self.path is not None and re.search(self.path, info.path) is None:
            return False
        if self.key is not None and self.key not in info.path:
            return False
        if self.query is not None:
            if callable(self.query):
                if not self.query(info.query):
                    return False
            else:
                names = (self.query,) if isinstance(self.query, str) else tuple(self.query)
                for name in names:
                    if name.startswith("!"):
                        if name[1:] in info.query:
                            return False
                    elif name not in info.query:
                        return False
        return self.where is None or bool(self.where(info))


def _methods(methods: str | Sequence[str]) -> frozenset[str]:
    if isinstance(methods, str):
        return frozenset({methods.upper()})
    return frozenset(m.upper() for m in methods)


# ------------------------------------------------------------------------------- faults


@dataclass(eq=False, kw_only=True)
class Fault:
    """Base class. ``match`` selects requests, ``times`` bounds how often it applies."""

    match: Match = field(default_factory=Match)
    times: int | None = None
    hits: int = field(default=0, init=False)

    kind: ClassVar[str] = "fault"
    default_methods: ClassVar[frozenset[str] | None] = None

    def __post_init__(self) -> None:
        if self.times is not None and self.times < 0:
            raise ValueError("times must be >= 0 or None")

    @property
    def remaining(self) -> int | None:
        return None if self.times is None else max(0, self.times - self.hits)

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.hits >= self.times

    def matches(self, info: RequestInfo) -> bool:
        return self.match.matches(info, self.default_methods)


def _check_keep(keep: int | float, what: str) -> None:
    if isinstance(keep, bool) or keep < 0:
        raise ValueError(f"{what}: keep must be a byte count >= 0 or a fraction in [0, 1)")
    if isinstance(keep, float) and keep >= 1:
        raise ValueError(f"{what}: a fractional keep must be < 1.0")


def _kept(keep: int | float, total: int) -> int:
    if isinstance(keep, float):
        return min(total, int(total * keep))
    return min(total, keep)


@dataclass(eq=False, kw_only=True)
class TruncateBody(Fault):
    """Cut a 2xx response body after ``keep`` bytes (an int) or ``keep * Content-Length``
    (a float in [0, 1)), keeping the upstream's headers, Content-Length included, then close
    the connection. What a client sees when a download dies mid-body. Default methods: GET.
    A fractional ``keep`` needs a Content-Length; without one the body is cut at 0 bytes.
    """

    keep: int | float = 0.5
    kind: ClassVar[str] = "truncate_body"
    default_methods: ClassVar[frozenset[str] | None] = frozenset({"GET"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keep(self.keep, self.kind)


@dataclass(eq=False, kw_only=True)
class ShortObject(Fault):
    """An object whose stored data is shorter than its metadata (incident 002).

    HEAD and listings pass through unchanged, so they report the full size. GETs behave as
    if only the first ``stored`` bytes existed, where ``stored = size - missing_bytes`` or,
    with ``part_size``, the object minus its last ``parts_missing`` parts (the parts are
    counted from the object's full size: ``ceil(size / part_size)`` parts; what remains is a
    whole number of parts, as in the incident).

    ``mode="cut"`` (the default) is what incident 002's S3 GETs saw: the response headers are
    the upstream's (full Content-Length, full Content-Range), and the body stops at
    byte ``stored`` of the object, where the connection is closed. A ranged GET entirely
    below ``stored`` is served whole; one that reaches past it is cut; one that starts at or
    beyond it gets its headers and no body.

    ``mode="consistent"`` is a store that serves what it has with self-consistent framing
    (the incident's native ``ais get`` path, and the worst case for a reader): a full GET gets
    ``Content-Length: stored`` and exactly ``stored`` bytes, status 200; a ranged GET is
    clamped to ``stored`` (``Content-Range: bytes a-min(b, stored-1)/stored``), and a range
    starting at or beyond ``stored`` gets ``416 InvalidRange``. Only a reader that compares
    the bytes it got with a length or checksum recorded elsewhere (HEAD, a manifest) notices.

    The fault sees the upstream's response to the request as sent (the Range header is
    forwarded unchanged, as it may be signed), so a suffix range ``bytes=-N`` is resolved
    against the full object, not against the short one. Default methods: GET.
    """

    missing_bytes: int | None = None
    part_size: int | None = None
    parts_missing: int = 1
    mode: Literal["cut", "consistent"] = "cut"
    kind: ClassVar[str] = "short_object"
    default_methods: ClassVar[frozenset[str] | None] = frozenset({"GET"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.missing_bytes is None) == (self.part_size is None):
            raise ValueError("short_object: give exactly one of missing_bytes and part_size")
        if self.missing_bytes is not None and self.missing_bytes < 0:
            raise ValueError("short_object: missing_bytes must be >= 0")
        if self.part_size is not None and (self.part_size <= 0 or self.parts_missing < 0):
            raise ValueError("short_object: part_size must be > 0 and parts_missing >= 0")
        if self.mode not in ("cut", "consistent"):
            raise ValueError("short_object: mode is 'cut' or 'consistent'")

    def stored_size(self, size: int) -> int:
        """How many bytes of an object of ``size`` bytes are 'stored'."""
        if self.part_size is not None:
            parts = math.ceil(size / self.part_size)
            return max(0, min(size, (parts - self.parts_missing) * self.part_size))
        assert self.missing_bytes is not None
        return max(0, size - self.missing_bytes)


@dataclass(eq=False, kw_only=True)
class DropPartBytes(Fault):
    """Forward only the first ``keep`` bytes (int) or ``keep`` fraction (float in [0, 1)) of
    a request body, with Content-Length (and ``x-amz-decoded-content-length`` for an
    ``aws-chunked`` body) adjusted to match, so the store keeps a short part and answers 200.
    The client believes the upload succeeded. Checksum headers (Content-MD5,
    ``x-amz-checksum-*``, ``x-amz-content-sha256``) are left as the client computed them:
    moto does not validate them, a real store would reject the part. Default: UploadPart
    requests only (PUT with ``partNumber`` and ``uploadId``); pass ``match`` with methods and
    ``query="!uploadId"`` to hit PutObject instead.
    """

    keep: int | float = 0.5
    kind: ClassVar[str] = "drop_part_bytes"
    default_methods: ClassVar[frozenset[str] | None] = frozenset({"PUT"})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keep(self.keep, self.kind)

    def matches(self, info: RequestInfo) -> bool:
        if self.match.query is None and self.match.methods is None and not info.is_upload_part:
            return False
        return super().matches(info)

    def apply(self, body: bytes) -> bytes:
        return body[: _kept(self.keep, len(body))]


@dataclass(eq=False, kw_only=True)
class CorruptPartBytes(DropPartBytes):
    """Flip (XOR 0xFF) ``count`` bytes of a request body at ``offset`` (negative: from the
    end) before forwarding; the length is unchanged. Same default scope as DropPartBytes."""

    offset: int = 0
    count: int = 1
    kind: ClassVar[str] = "corrupt_part_bytes"

    def __post_init__(self) -> None:
        Fault.__post_init__(self)
        if self.count < 0:
            raise ValueError("corrupt_part_bytes: count must be >= 0")

    def apply(self, body: bytes) -> bytes:
        if not body:
            return body
        start = self.offset if self.offset >= 0 else max(0, len(body) + self.offset)
        end = min(len(body), start + self.count)
        data = bytearray(body)
        for i in range(start, end):
            data[i] ^= 0xFF
        return bytes(data)


@dataclass(eq=False, kw_only=True)
class Error(Fault):
    """Answer with a correctly sized S3 XML error document (``application/xml``).

    ``forward=False`` (default): the request never reaches the store. ``forward=True``: the
    request is applied upstream first and its response replaced by the error (the write
    happened, the client was told it failed). ``code``/``message`` default by status
    (403 AccessDenied, 500 InternalError, 503 SlowDown, ...). Default methods: all.
    """

    status: int = 500
    code: str | None = None
    message: str | None = None
    forward: bool = False
    extra_headers: Mapping[str, str] = field(default_factory=dict)
    kind: ClassVar[str] = "error"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 100 <= self.status <= 599:
            raise ValueError("error: status must be an HTTP status code")

    def document(self, info: RequestInfo, request_id: str) -> bytes:
        code, message = _DEFAULT_ERRORS.get(self.status, ("InternalError", "Error"))
        return s3_error_document(
            self.code or code,
            self.message or message,
            request_id=request_id,
            resource=info.path,
        )


@dataclass(eq=False, kw_only=True)
class ErrorBodyWith200(Fault):
    """Serve an S3 XML error document as a 200 object (Content-Type ``application/xml``,
    correct Content-Length, a quoted MD5 ETag), as a misbehaving gateway or CDN that cached
    an error page would. The request does not reach the store. Default methods: GET, HEAD
    (so a HEAD agrees with the GET, as a cache would)."""

    code: str = "AccessDenied"
    message: str = "Access Denied"
    #: fixed per fault, so every response carries the same bytes, as a cached copy would
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16].upper())
    created: float = field(default_factory=time.time, init=False)
    kind: ClassVar[str] = "error_body_with_200"
    default_methods: ClassVar[frozenset[str] | None] = frozenset({"GET", "HEAD"})


EtagStyle = Literal["unquoted", "weak", "empty", "missing"] | Callable[[str], str | None]


@dataclass(eq=False, kw_only=True)
class RewriteEtag(Fault):
    """Rewrite the ETag response header and, with ``xml=True``, ``<ETag>`` elements of XML
    response bodies (ListObjects, ListParts, CompleteMultipartUpload, CopyObject).

    ``style``: ``"unquoted"`` (``"abc"`` -> ``abc``), ``"weak"`` (``W/"abc"``),
    ``"empty"`` (an empty header / element), ``"missing"`` (header removed, XML element
    emptied), or a callable from the received value to a new one (``None`` removes).
    Default methods: all.
    """

    style: EtagStyle = "unquoted"
    xml: bool = True
    kind: ClassVar[str] = "rewrite_etag"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not callable(self.style) and self.style not in ("unquoted", "weak", "empty", "missing"):
            raise ValueError("rewrite_etag: unknown style")

    def rewrite(self, etag: str) -> str | None:
        if callable(self.style):
            return self.style(etag)
        if self.style == "unquoted":
            return etag.removeprefix("W/").strip('"')
        if self.style == "weak":
            core = etag.removeprefix("W/")
            return f'W/"{core.strip(chr(34))}"'
        if self.style == "empty":
            return ""
        return None


@dataclass(eq=False, kw_only=True)
class Delay(Fault):
    """Sleep ``seconds``: ``where="request"`` before forwarding the request (default),
    ``where="body"`` after sending the response headers and before the body. Default
    methods: all. The sleep is cut short when the proxy stops."""

    seconds: float = 1.0
    where: Literal["request", "body"] = "request"
    kind: ClassVar[str] = "delay"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seconds < 0 or self.where not in ("request", "body"):
            raise ValueError("delay: seconds >= 0, where is 'request' or 'body'")


@dataclass(eq=False, kw_only=True)
class DropConnection(Fault):
    """Close the client connection without a (complete) response.

    Default: after reading the request, without forwarding it. ``forward=True``: after the
    store applied the request (the write happened, the client saw a dead connection).
    ``after_bytes=N``: forward, send the response head and N body bytes, close (this is
    ``truncate_body`` for any status and method). Default methods: all.
    """

    forward: bool = False
    after_bytes: int | None = None
    kind: ClassVar[str] = "drop_connection"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.after_bytes is not None and self.after_bytes < 0:
            raise ValueError("drop_connection: after_bytes must be >= 0")

    @property
    def before_upstream(self) -> bool:
        return not self.forward and self.after_bytes is None


@dataclass(eq=False, kw_only=True)
class StripHeaders(Fault):
    """Remove response headers whose names match ``pattern`` (a regex, case-insensitive).
    The default, ``^x-amz-checksum-``, makes moto look like a store without flexible
    checksums: botocore then has nothing to check a GET body against. Default methods: all.
    """

    pattern: str = r"^x-amz-checksum-"
    kind: ClassVar[str] = "strip_headers"


def _mk_match(
    match: Match | None,
    method: str | Sequence[str] | None,
    key: str | None,
    path: str | re.Pattern[str] | None,
    query: str | Sequence[str] | QueryPredicate | None,
) -> Match:
    if match is not None:
        if any(x is not None for x in (method, key, path, query)):
            raise ValueError("give either match= or method/key/path/query, not both")
        return match
    return Match(methods=method, key=key, path=path, query=query)


def truncate_body(
    keep: int | float = 0.5,
    *,
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> TruncateBody:
    return TruncateBody(keep=keep, match=_mk_match(match, method, key, path, query), times=times)


def short_object(
    *,
    missing_bytes: int | None = None,
    part_size: int | None = None,
    parts_missing: int = 1,
    mode: Literal["cut", "consistent"] = "cut",
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> ShortObject:
    return ShortObject(
        missing_bytes=missing_bytes,
        part_size=part_size,
        parts_missing=parts_missing,
        mode=mode,
        match=_mk_match(match, method, key, path, query),
        times=times,
    )


def drop_part_bytes(
    keep: int | float = 0.5,
    *,
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> DropPartBytes:
    return DropPartBytes(keep=keep, match=_mk_match(match, method, key, path, query), times=times)


def corrupt_part_bytes(
    *,
    offset: int = 0,
    count: int = 1,
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> CorruptPartBytes:
    return CorruptPartBytes(
        offset=offset,
        count=count,
        match=_mk_match(match, method, key, path, query),
        times=times,
    )


def error(
    status: int = 500,
    code: str | None = None,
    message: str | None = None,
    *,
    forward: bool = False,
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> Error:
    return Error(
        status=status,
        code=code,
        message=message,
        forward=forward,
        match=_mk_match(match, method, key, path, query),
        times=times,
    )


def error_body_with_200(
    code: str = "AccessDenied",
    message: str = "Access Denied",
    *,
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> ErrorBodyWith200:
    return ErrorBodyWith200(
        code=code, message=message, match=_mk_match(match, method, key, path, query), times=times
    )


def rewrite_etag(
    style: EtagStyle = "unquoted",
    *,
    xml: bool = True,
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> RewriteEtag:
    return RewriteEtag(
        style=style, xml=xml, match=_mk_match(match, method, key, path, query), times=times
    )


def delay(
    seconds: float,
    *,
    where: Literal["request", "body"] = "request",
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> Delay:
    return Delay(
        seconds=seconds, where=where, match=_mk_match(match, method, key, path, query), times=times
    )


def drop_connection(
    *,
    forward: bool = False,
    after_bytes: int | None = None,
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> DropConnection:
    return DropConnection(
        forward=forward,
        after_bytes=after_bytes,
        match=_mk_match(match, method, key, path, query),
        times=times,
    )


def strip_headers(
    pattern: str = r"^x-amz-checksum-",
    *,
    match: Match | None = None,
    method: str | Sequence[str] | None = None,
    key: str | None = None,
    path: str | re.Pattern[str] | None = None,
    query: str | Sequence[str] | QueryPredicate | None = None,
    times: int | None = None,
) -> StripHeaders:
    return StripHeaders(
        pattern=pattern, match=_mk_match(match, method, key, path, query), times=times
    )


_FACTORIES: dict[str, Callable[..., Fault]] = {
    "strip_headers": strip_headers,
    "truncate_body": truncate_body,
    "short_object": short_object,
    "drop_part_bytes": drop_part_bytes,
    "corrupt_part_bytes": corrupt_part_bytes,
    "error": error,
    "error_body_with_200": error_body_with_200,
    "rewrite_etag": rewrite_etag,
    "delay": delay,
    "drop_connection": drop_connection,
}


# ----------------------------------------------------------------------------- the log


@dataclass
class RequestRecord:
    """One client request as the proxy saw and answered it."""

    method: str
    path: str
    raw_query: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # a subset: Range, Content-*, If-*, Expect, x-amz-* (lower-case)
    started: float
    status: int | None = None  # status sent to the client; None if none was sent
    upstream_status: int | None = None  # None if the request was not forwarded
    faults: list[str] = field(default_factory=list)  # kinds of the faults that applied
    request_bytes: int = 0  # request body bytes received from the client (decoded)
    response_bytes: int = 0  # response body bytes sent to the client
    truncated: bool = False  # the response ended before its framing said it would
    duration: float = 0.0
    error: str | None = None  # a proxy-side failure, if any
    connection: int = 0  # which client connection (numbered from 1) carried the request

    @property
    def key(self) -> str:
        """The path without its leading ``/bucket/`` (path-style addressing)."""
        parts = self.path.lstrip("/").split("/", 1)
        return parts[1] if len(parts) == 2 else ""


def _log_headers(headers: Headers) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers.items():
        lname = name.lower()
        if lname in _LOGGED_HEADERS or (
            lname.startswith("x-amz-") and lname != "x-amz-security-token"
        ):
            out[lname] = value
    return out


# ---------------------------------------------------------------------------- the proxy


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 128
    proxy: FaultProxy


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.server.proxy._serve_connection(self.request)


class FaultProxy:
    """A fault-injecting reverse proxy in front of an S3 endpoint (see the module docstring).

    ``upstream``: ``http://host:port`` of the real endpoint (plain HTTP only).
    ``client_timeout``: seconds a client connection may sit idle (or stall mid-request).
    ``upstream_timeout``: connect and per-read timeout towards the upstream.
    ``keep_alive``: keep client connections open between requests (default); ``False``
    answers every request with ``Connection: close``.
    """

    def __init__(
        self,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        client_timeout: float = 60.0,
        upstream_timeout: float = 60.0,
        keep_alive: bool = True,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, not {upstream!r}")
        self.upstream = upstream.rstrip("/")
        self._up_addr = (parts.hostname, parts.port or 80)
        self._bind = (host, port)
        self.client_timeout = client_timeout
        self.upstream_timeout = upstream_timeout
        self.keep_alive = keep_alive
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._log: list[RequestRecord] = []
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._connections = 0
        #: unexpected proxy-side exceptions (bugs), as "Type: message"; tests assert it is empty
        self.errors: list[str] = []
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        if self._server is not None:
            raise RuntimeError("FaultProxy already started")
        self._stopping.clear()
        server = _Server(self._bind, _Handler)
        server.proxy = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"FaultProxy:{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        server, thread = self._server, self._thread
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.server_close()
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if thread is not None:
            thread.join(timeout)
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._server = None
        self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("FaultProxy not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ----------------------------------------------------------------- faults

    def add(self, fault: Fault) -> Fault:
        """Add a fault (after the existing ones) and return it (``fault.hits`` counts uses)."""
        with self._lock:
            self._faults.append(fault)
        return fault

    def inject(
        self,
        kind: str,
        *,
        match: Match | None = None,
        method: str | Sequence[str] | None = None,
        key: str | None = None,
        path: str | re.Pattern[str] | None = None,
        query: str | Sequence[str] | QueryPredicate | None = None,
        times: int | None = None,
        **params: Any,
    ) -> Fault:
        """``inject("truncate_body", keep=10, key="b/k", times=1)``: build a fault by kind
        name (the module-level factory of that name) and add it."""
        try:
            factory = _FACTORIES[kind]
        except KeyError:
            raise ValueError(f"unknown fault kind {kind!r}; one of {sorted(_FACTORIES)}") from None
        fault = factory(
            match=match, method=method, key=key, path=path, query=query, times=times, **params
        )
        return self.add(fault)

    def remove(self, fault: Fault) -> None:
        with self._lock:
            self._faults = [f for f in self._faults if f is not fault]

    def clear(self) -> None:
        """Remove every fault (the request log is kept; see :meth:`clear_requests`)."""
        with self._lock:
            self._faults = []

    @contextlib.contextmanager
    def injected(self, fault: Fault) -> Iterator[Fault]:
        """``with proxy.injected(error(503)): ...``: a fault for the duration of a block."""
        self.add(fault)
        try:
            yield fault
        finally:
            self.remove(fault)

    @property
    def faults(self) -> list[Fault]:
        with self._lock:
            return list(self._faults)

    # ------------------------------------------------------------------ log

    @property
    def requests(self) -> list[RequestRecord]:
        """A snapshot of the request log, oldest first."""
        with self._lock:
            return list(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log = []

    def count(
        self,
        *,
        method: str | Sequence[str] | None = None,
        key: str | None = None,
        path: str | re.Pattern[str] | None = None,
        query: str | Sequence[str] | QueryPredicate | None = None,
        status: int | None = None,
    ) -> int:
        """How many logged requests match (same criteria as :class:`Match`)."""
        m = Match(methods=method, key=key, path=path, query=query)
        n = 0
        for r in self.requests:
            info = RequestInfo(r.method, "", r.path, r.raw_query, r.query, Headers())
            if m.matches(info) and (status is None or r.status == status):
                n += 1
        return n

    # ------------------------------------------------------------- internals

    def _candidates(self, info: RequestInfo) -> list[Fault]:
        with self._lock:
            faults = list(self._faults)
        return [f for f in faults if not f.exhausted and f.matches(info)]

    def _consume(self, fault: Fault, rec: RequestRecord) -> bool:
        with self._lock:
            if fault.exhausted:
                return False
            fault.hits += 1
        rec.faults.append(fault.kind)
        return True

    def _track(self, s: socket.socket, on: bool) -> None:
        with self._lock:
            if on:
                self._sockets.add(s)
            else:
                self._sockets.discard(s)

    def _serve_connection(self, client: socket.socket) -> None:
        me = threading.current_thread()
        with self._lock:
            self._threads.add(me)
            self._connections += 1
            conn_id = self._connections
        self._track(client, True)
        rfile = cast(io.BufferedReader, client.makefile("rb", buffering=_BUF))
        try:
            client.settimeout(self.client_timeout)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stopping.is_set():
                if not _Exchange(self, client, rfile, conn_id).run():
                    break
        except (OSError, _PeerClosed, _ProtocolError):
            pass
        except Exception as exc:  # a bug in the proxy: keep it visible to tests
            with self._lock:
                self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self._track(client, False)
            with contextlib.suppress(OSError):
                rfile.close()
            with contextlib.suppress(OSError):
                client.close()
            with self._lock:
                self._threads.discard(me)


class _Exchange:
    """One request/response exchange on a client connection."""

    def __init__(
        self, proxy: FaultProxy, client: socket.socket, rfile: io.BufferedReader, conn_id: int
    ) -> None:
        self.proxy = proxy
        self.conn_id = conn_id
        self.client = client
        self.rfile = rfile
        self.up: socket.socket | None = None
        self.up_rfile: io.BufferedReader | None = None
        self.request_id = uuid.uuid4().hex[:16].upper()

    # --------------------------------------------------------------- plumbing

    def _send(self, data: bytes) -> None:
        if data:
            self.client.sendall(data)

    def _sleep(self, seconds: float) -> None:
        self.proxy._stopping.wait(seconds)

    def _close_upstream(self) -> None:
        if self.up_rfile is not None:
            with contextlib.suppress(OSError):
                self.up_rfile.close()
        if self.up is not None:
            self.proxy._track(self.up, False)
            with contextlib.suppress(OSError):
                self.up.close()
        self.up = self.up_rfile = None

    def _local_response(
        self,
        status: int,
        body: bytes,
        *,
        method: str,
        content_type: str = "application/xml",
        extra: Mapping[str, str] | None = None,
        close: bool,
    ) -> None:
        lines = [
            ("Date", formatdate(usegmt=True)),
            ("Server", "durable-faultproxy"),
            ("x-amz-request-id", self.request_id),
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
        ]
        lines.extend((extra or {}).items())
        if close:
            lines.append(("Connection", "close"))
        self._send(_status_line(status) + Headers(lines).to_bytes() + b"\r\n")
        if method != "HEAD":
            self._send(body)

    # ------------------------------------------------------------------ main

    def run(self) -> bool:
        """Serve one request. Returns whether the client connection may be reused."""
        head = _read_head(self.rfile)
        if head is None:
            return False
        start_line, headers = head
        parts = start_line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _ProtocolError(f"bad request line {start_line[:80]!r}")
        method, target, version = parts
        split = urlsplit(target)
        query = parse_qs(split.query, keep_blank_values=True)
        info = RequestInfo(method, target, unquote(split.path), split.query, query, headers)
        rec = RequestRecord(
            method=method,
            path=info.path,
            raw_query=split.query,
            query=query,
            headers=_log_headers(headers),
            started=time.time(),
            connection=self.conn_id,
        )
        t0 = time.monotonic()
        with self.proxy._lock:
            self.proxy._log.append(rec)
        try:
            return self._run(info, start_line, headers, version, rec)
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            rec.duration = time.monotonic() - t0
            self._close_upstream()

    def _run(
        self,
        info: RequestInfo,
        start_line: bytes,
        headers: Headers,
        version: str,
        rec: RequestRecord,
    ) -> bool:
        method = info.method
        client_keep = (
            self.proxy.keep_alive
            and not headers.has_token("connection", "close")
            and (version == "HTTP/1.1" or headers.has_token("connection", "keep-alive"))
        )
        framing = _request_framing(headers)
        if version == "HTTP/1.1" and headers.has_token("expect", "100-continue"):
            self._send(b"HTTP/1.1 100 Continue\r\n\r\n")

        candidates = self.proxy._candidates(info)

        for f in candidates:
            if isinstance(f, Delay) and f.where == "request" and self.proxy._consume(f, rec):
                self._sleep(f.seconds)

        # Faults that answer without forwarding.
        for f in candidates:
            terminal = isinstance(f, ErrorBodyWith200 | Error) and not (
                isinstance(f, Error) and f.forward
            )
            dropping = isinstance(f, DropConnection) and f.before_upstream
            if not (terminal or dropping) or not self.proxy._consume(f, rec):
                continue
            rec.request_bytes = _drain(_iter_body(self.rfile, framing, raw=False))
            if isinstance(f, DropConnection):
                rec.truncated = True
                return False
            if isinstance(f, Error):
                body = f.document(info, self.request_id)
                rec.status = f.status
                self._local_response(
                    f.status, body, method=method, extra=f.extra_headers, close=not client_keep
                )
            else:
                assert isinstance(f, ErrorBodyWith200)
                body = s3_error_document(
                    f.code, f.message, request_id=f.request_id, resource=info.path
                )
                etag = '"' + hashlib.md5(body).hexdigest() + '"'
                rec.status = 200
                self._local_response(
                    200,
                    body,
                    method=method,
                    extra={"ETag": etag, "Last-Modified": formatdate(f.created, usegmt=True)},
                    close=not client_keep,
                )
            rec.response_bytes = 0 if method == "HEAD" else len(body)
            return client_keep

        # Forward the request.
        modifiers = [
            f for f in candidates if isinstance(f, DropPartBytes) and framing.kind != "none"
        ]
        modifiers = [f for f in modifiers if self.proxy._consume(f, rec)]
        try:
            self._connect()
        except OSError as exc:
            rec.request_bytes = _drain(_iter_body(self.rfile, framing, raw=False))
            rec.error = f"upstream connect failed: {exc}"
            rec.status = 502
            body = s3_error_document(
                "BadGateway", f"proxy: {exc}", request_id=self.request_id, resource=info.path
            )
            self._local_response(502, body, method=method, close=not client_keep)
            rec.response_bytes = 0 if method == "HEAD" else len(body)
            return client_keep
        if modifiers:
            self._forward_modified(start_line, headers, framing, modifiers, rec)
        else:
            self._forward_streaming(start_line, headers, framing, rec)

        # Read the upstream response head (skipping interim 1xx responses).
        assert self.up_rfile is not None
        try:
            while True:
                resp = _read_head(self.up_rfile)
                if resp is None:
                    raise _PeerClosed("upstream closed the connection without a response")
                status_line, resp_headers = resp
                resp_version, status = _parse_status(status_line)
                if status >= 200 or status == 101:
                    break
        except (OSError, _PeerClosed, _ProtocolError) as exc:
            code = 504 if isinstance(exc, TimeoutError) else 502
            rec.error = f"upstream response failed: {type(exc).__name__}: {exc}"
            rec.status = code
            body = s3_error_document(
                _DEFAULT_ERRORS[code][0],
                f"proxy: {exc}",
                request_id=self.request_id,
                resource=info.path,
            )
            self._local_response(code, body, method=method, close=True)
            rec.response_bytes = 0 if method == "HEAD" else len(body)
            return False
        rec.upstream_status = status
        resp_framing = _response_framing(method, status, resp_headers)
        body_iter = _iter_body(self.up_rfile, resp_framing, raw=True)

        # Faults that replace the upstream's answer.
        for f in candidates:
            if isinstance(f, Error) and f.forward and self.proxy._consume(f, rec):
                _drain(body_iter)
                body = f.document(info, self.request_id)
                rec.status = f.status
                self._local_response(
                    f.status, body, method=method, extra=f.extra_headers, close=not client_keep
                )
                rec.response_bytes = 0 if method == "HEAD" else len(body)
                return client_keep
            if (
                isinstance(f, DropConnection)
                and f.forward
                and f.after_bytes is None
                and self.proxy._consume(f, rec)
            ):
                _drain(body_iter)
                rec.truncated = True
                return False

        # Faults that change the response as it streams back.
        limit: int | None = None  # body bytes to send before closing the connection
        body_override: bytes | None = None
        for f in candidates:
            if isinstance(f, StripHeaders):
                names = [n for n, _ in resp_headers.items() if re.search(f.pattern, n, re.I)]
                if names and self.proxy._consume(f, rec):
                    for name in names:
                        resp_headers.remove(name)
            elif isinstance(f, RewriteEtag) and self._rewrite_etag(f, resp_headers, rec):
                if f.xml and resp_framing.kind in ("length", "chunked"):
                    body_override = self._rewrite_xml_etags(f, resp_headers, body_iter)
            elif isinstance(f, ShortObject) and 200 <= status < 300 and body_override is None:
                action = self._short_object(f, status, resp_headers, resp_framing, rec)
                if action is not None:
                    kind_, value = action
                    if kind_ == "416":
                        _drain(body_iter)
                        doc = s3_error_document(
                            "InvalidRange",
                            "The requested range is not satisfiable",
                            request_id=self.request_id,
                            resource=info.path,
                        )
                        rec.status = 416
                        self._local_response(
                            416,
                            doc,
                            method=method,
                            extra={"Content-Range": f"bytes */{value}"},
                            close=not client_keep,
                        )
                        rec.response_bytes = len(doc)
                        return client_keep
                    if kind_ == "cut":
                        limit = value if limit is None else min(limit, value)
                    else:  # "consistent": headers already rewritten, send `value` bytes
                        resp_framing = _Framing("length", value)
                        body_iter = _iter_exact_from(body_iter, value)
            elif isinstance(f, TruncateBody) and 200 <= status < 300:
                if resp_framing.kind == "none":
                    continue
                total = resp_framing.length if resp_framing.kind == "length" else 0
                n = _kept(f.keep, total) if isinstance(f.keep, float) else f.keep
                if resp_framing.kind == "length" and n >= total:
                    continue
                if self.proxy._consume(f, rec):
                    limit = n if limit is None else min(limit, n)
            elif (
                isinstance(f, DropConnection)
                and f.after_bytes is not None
                and self.proxy._consume(f, rec)
            ):
                limit = f.after_bytes if limit is None else min(limit, f.after_bytes)

        body_delays = [
            f
            for f in candidates
            if isinstance(f, Delay) and f.where == "body" and resp_framing.kind != "none"
        ]

        # Connection and Keep-Alive are hop-by-hop: the upstream's values concern only the
        # proxy-upstream connection (moto says "close" on every response), which is used for
        # one exchange anyway. The client connection stays open when the client and the
        # framing allow it.
        resp_headers.remove("connection")
        resp_headers.remove("keep-alive")
        keep = (
            client_keep
            and resp_framing.kind != "close"
            and limit is None
            and resp_version == "HTTP/1.1"
        )
        if not keep and limit is None:
            resp_headers.set("Connection", "close")
        rec.status = status
        self._send(status_line + resp_headers.to_bytes() + b"\r\n")

        for f in body_delays:
            if self.proxy._consume(f, rec):
                self._sleep(f.seconds)

        pieces: Iterable[bytes] = [body_override] if body_override is not None else body_iter
        sent = 0
        try:
            for piece in pieces:
                if limit is not None and sent + len(piece) >= limit:
                    self._send(piece[: limit - sent])
                    sent = limit
                    break
                self._send(piece)
                sent += len(piece)
        except (_PeerClosed, _ProtocolError) as exc:  # the upstream broke mid-body
            rec.error = f"upstream body failed: {type(exc).__name__}: {exc}"
            rec.truncated = True
            rec.response_bytes = sent
            return False
        finally:
            rec.response_bytes = sent
        if limit is not None:
            expected = resp_framing.length if resp_framing.kind == "length" else None
            rec.truncated = expected is None or sent < expected
            return False
        return keep

    # ------------------------------------------------------------- upstream

    def _connect(self) -> None:
        up = socket.create_connection(self.proxy._up_addr, timeout=self.proxy.upstream_timeout)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.up = up
        self.proxy._track(up, True)
        self.up_rfile = cast(io.BufferedReader, up.makefile("rb", buffering=_BUF))

    def _up_send(self, data: bytes) -> None:
        assert self.up is not None
        if data:
            self.up.sendall(data)

    def _forward_streaming(
        self, start_line: bytes, headers: Headers, framing: _Framing, rec: RequestRecord
    ) -> None:
        """Send the request exactly as received; stream the body (raw framing kept)."""
        broken = False
        try:
            self._up_send(start_line + headers.to_bytes() + b"\r\n")
        except OSError:
            broken = True
        count = _Count()
        for piece in _iter_body(self.rfile, framing, raw=True, count=count):
            rec.request_bytes = count.n
            if not broken:
                try:
                    self._up_send(piece)
                except OSError:
                    broken = True  # keep reading the client; the upstream may have answered
        rec.request_bytes = count.n

    def _forward_modified(
        self,
        start_line: bytes,
        headers: Headers,
        framing: _Framing,
        modifiers: list[DropPartBytes],
        rec: RequestRecord,
    ) -> None:
        body = b"".join(_iter_body(self.rfile, framing, raw=False))
        rec.request_bytes = len(body)
        aws_chunked = headers.has_token("content-encoding", "aws-chunked")
        if aws_chunked:
            data, final = _aws_unchunk(body)
        else:
            data, final = body, b""
        for f in modifiers:
            data = f.apply(data)
        if aws_chunked:
            body = _aws_rechunk(data, final)
            if "x-amz-decoded-content-length" in headers:
                headers.set("x-amz-decoded-content-length", str(len(data)))
        else:
            body = data
        if framing.kind == "chunked":
            headers.remove("transfer-encoding")
        headers.set("Content-Length", str(len(body)))
        with contextlib.suppress(OSError):
            self._up_send(start_line + headers.to_bytes() + b"\r\n" + body)

    # ------------------------------------------------------------- response faults

    def _rewrite_etag(self, f: RewriteEtag, headers: Headers, rec: RequestRecord) -> bool:
        etag = headers.get("etag")
        is_xml = "xml" in (headers.get("content-type") or "").lower()
        if etag is None and not (f.xml and is_xml):
            return False
        if not self.proxy._consume(f, rec):
            return False
        if etag is not None:
            new = f.rewrite(etag)
            if new is None:
                headers.remove("etag")
            else:
                headers.set("ETag", new)
        return f.xml and is_xml

    def _rewrite_xml_etags(
        self, f: RewriteEtag, headers: Headers, body_iter: Iterator[bytes]
    ) -> bytes | None:
        n = _content_length(headers)
        if n is not None and n > _MAX_XML_REWRITE:
            return None
        raw = bytearray()
        for piece in body_iter:
            raw += piece
        if _is_chunked(headers):
            body = _dechunk(bytes(raw))
            headers.remove("transfer-encoding")
        else:
            body = bytes(raw)

        def repl(m: re.Match[bytes]) -> bytes:
            inner = m.group(2).decode()
            entity = next((e for e in ("&quot;", "&#34;", "&#x22;") if e in inner), None)
            new = f.rewrite(html.unescape(inner))
            text = _xml_escape(new or "")
            if entity is not None:
                text = text.replace('"', entity)
            return m.group(1) + text.encode() + m.group(3)

        body = re.sub(rb"(<ETag>)(.*?)(</ETag>)", repl, body, flags=re.S)
        headers.set("Content-Length", str(len(body)))
        return body

    def _short_object(
        self,
        f: ShortObject,
        status: int,
        headers: Headers,
        framing: _Framing,
        rec: RequestRecord,
    ) -> tuple[Literal["cut", "consistent", "416"], int] | None:
        if framing.kind != "length":
            return None
        if status == 206:
            cr = _parse_content_range(headers.get("content-range"))
            if cr is None or cr[2] is None:
                return None
            first, last, total = cr
            if total is None:
                return None
            size = total
        else:
            first, last, size = 0, framing.length - 1, framing.length
        stored = f.stored_size(size)
        if last < stored:  # everything asked for is "stored"
            return None
        if not self.proxy._consume(f, rec):
            return None
        if f.mode == "cut":
            return "cut", max(0, stored - first)
        if status == 206:
            if first >= stored:
                return "416", stored
            end = stored - 1
            headers.set("Content-Range", f"bytes {first}-{end}/{stored}")
            n = end - first + 1
        else:
            n = stored
        headers.set("Content-Length", str(n))
        return "consistent", n


def _iter_exact_from(it: Iterator[bytes], n: int) -> Iterator[bytes]:
    """The first ``n`` bytes of ``it``; the rest is left unread (the upstream is dropped)."""
    for piece in it:
        if n <= 0:
            return
        if len(piece) >= n:
            yield piece[:n]
            return
        n -= len(piece)
        yield piece


def _dechunk(raw: bytes) -> bytes:
    out = bytearray()
    pos = 0
    while True:
        eol = raw.index(b"\n", pos)
        size = _chunk_size(raw[pos : eol + 1])
        pos = eol + 1
        if size == 0:
            return bytes(out)
        out += raw[pos : pos + size]
        pos += size
        pos = raw.index(b"\n", pos) + 1


def _aws_unchunk(payload: bytes) -> tuple[bytes, bytes]:
    """Decode an ``aws-chunked`` payload into (data, final chunk line + trailers)."""
    out = bytearray()
    pos = 0
    while True:
        eol = payload.find(b"\r\n", pos)
        if eol < 0:
            raise _ProtocolError("truncated aws-chunked payload")
        size = _chunk_size(payload[pos : eol + 2])
        if size == 0:
            return bytes(out), payload[pos:]
        pos = eol + 2
        out += payload[pos : pos + size]
        pos += size + 2  # data and its CRLF


def _aws_rechunk(data: bytes, final: bytes) -> bytes:
    """Re-encode ``data`` as one ``aws-chunked`` chunk followed by the original final chunk
    and trailers. Chunk signatures (signed streaming) are not recomputed."""
    head = f"{len(data):x}\r\n".encode() + data + b"\r\n" if data else b""
    return head + (final or b"0\r\n\r\n")
