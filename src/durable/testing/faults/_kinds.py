"""What a fault is: which requests it applies to (:class:`Match`), how often (``times``), the
kinds and their parameters, and one factory function per kind."""

from __future__ import annotations

import hashlib
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import ClassVar, Literal, TypedDict, Unpack
from xml.sax.saxutils import escape as _xml_escape

from durable.testing.faults._http import Headers

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
        if self.query is not None and not _query_matches(self.query, info.query):
            return False
        return self.where is None or bool(self.where(info))


def _methods(methods: str | Sequence[str]) -> frozenset[str]:
    if isinstance(methods, str):
        return frozenset({methods.upper()})
    return frozenset(m.upper() for m in methods)


def _query_matches(
    want: str | Sequence[str] | QueryPredicate, query: Mapping[str, Sequence[str]]
) -> bool:
    if callable(want):
        return bool(want(query))
    names = (want,) if isinstance(want, str) else tuple(want)
    return all(
        (name[1:] not in query) if name.startswith("!") else (name in query) for name in names
    )


# ------------------------------------------------------------------------- S3 documents

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


def default_error_document(
    status: int, info: RequestInfo, request_id: str, *, code: str | None = None,
    message: str | None = None,
) -> bytes:
    """The error document for ``status`` about the requested path; ``code`` and ``message``
    default by status (403 AccessDenied, 500 InternalError, 503 SlowDown, ...)."""
    default_code, default_message = _DEFAULT_ERRORS.get(status, ("InternalError", "Error"))
    return s3_error_document(
        code or default_code, message or default_message, request_id=request_id,
        resource=info.path,
    )


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


def kept(keep: int | float, total: int) -> int:
    """How many of ``total`` bytes a ``keep`` parameter keeps."""
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
        return body[: kept(self.keep, len(body))]


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
        return default_error_document(
            self.status, info, request_id, code=self.code, message=self.message
        )

    def _response(
        self, info: RequestInfo, request_id: str
    ) -> tuple[int, bytes, Mapping[str, str]]:
        return self.status, self.document(info, request_id), self.extra_headers


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

    def _response(
        self, info: RequestInfo, request_id: str
    ) -> tuple[int, bytes, Mapping[str, str]]:
        # The fault's own request id, not the exchange's: a cached copy never changes.
        body = s3_error_document(
            self.code, self.message, request_id=self.request_id, resource=info.path
        )
        etag = '"' + hashlib.md5(body).hexdigest() + '"'
        return 200, body, {"ETag": etag, "Last-Modified": formatdate(self.created, usegmt=True)}


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
class RewriteBody(Fault):
    """Replace a response body (at most 16 MiB; a body of another framing is left alone) by
    ``rewrite(body)``, Content-Length set to match: a store that answers a request wrongly
    but well-formed (a listing whose continuation token never advances). ``rewrite`` gets
    the whole body, dechunked. Default methods: all.
    """

    rewrite: Callable[[bytes], bytes]
    kind: ClassVar[str] = "rewrite_body"


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


# ---------------------------------------------------------------------------- factories


class Scope(TypedDict, total=False):
    """The keyword arguments every factory (and :meth:`FaultProxy.inject`) takes besides
    the kind's own: which requests the fault applies to, either as ``match`` or as the
    :class:`Match` criteria ``method`` (its ``methods``), ``key``, ``path`` and ``query``
    (not both); and ``times``, how often it may apply (``None``: without limit)."""

    match: Match | None
    method: str | Sequence[str] | None
    key: str | None
    path: str | re.Pattern[str] | None
    query: str | Sequence[str] | QueryPredicate | None
    times: int | None


class _Scoped(TypedDict):
    match: Match
    times: int | None


def _scoped(scope: Scope) -> _Scoped:
    # **scope accepts any keyword at run time: a misspelt one must not vanish silently.
    unknown = sorted(scope.keys() - Scope.__optional_keys__)
    if unknown:
        raise TypeError(
            f"unexpected keyword argument {unknown[0]!r}: a fault factory takes its kind's "
            f"parameters and {', '.join(sorted(Scope.__optional_keys__))}"
        )
    match = scope.get("match")
    criteria = [scope.get(name) for name in ("method", "key", "path", "query")]
    if match is None:
        match = Match(
            methods=scope.get("method"), key=scope.get("key"), path=scope.get("path"),
            query=scope.get("query"),
        )
    elif any(x is not None for x in criteria):
        raise ValueError("give either match= or method/key/path/query, not both")
    return {"match": match, "times": scope.get("times")}


def truncate_body(keep: int | float = 0.5, **scope: Unpack[Scope]) -> TruncateBody:
    return TruncateBody(keep=keep, **_scoped(scope))


def short_object(
    *,
    missing_bytes: int | None = None,
    part_size: int | None = None,
    parts_missing: int = 1,
    mode: Literal["cut", "consistent"] = "cut",
    **scope: Unpack[Scope],
) -> ShortObject:
    return ShortObject(
        missing_bytes=missing_bytes, part_size=part_size, parts_missing=parts_missing, mode=mode,
        **_scoped(scope),
    )


def drop_part_bytes(keep: int | float = 0.5, **scope: Unpack[Scope]) -> DropPartBytes:
    return DropPartBytes(keep=keep, **_scoped(scope))


def corrupt_part_bytes(
    *, offset: int = 0, count: int = 1, **scope: Unpack[Scope]
) -> CorruptPartBytes:
    return CorruptPartBytes(offset=offset, count=count, **_scoped(scope))


def error(
    status: int = 500,
    code: str | None = None,
    message: str | None = None,
    *,
    forward: bool = False,
    **scope: Unpack[Scope],
) -> Error:
    return Error(status=status, code=code, message=message, forward=forward, **_scoped(scope))


def error_body_with_200(
    code: str = "AccessDenied", message: str = "Access Denied", **scope: Unpack[Scope]
) -> ErrorBodyWith200:
    return ErrorBodyWith200(code=code, message=message, **_scoped(scope))


def rewrite_etag(
    style: EtagStyle = "unquoted", *, xml: bool = True, **scope: Unpack[Scope]
) -> RewriteEtag:
    return RewriteEtag(style=style, xml=xml, **_scoped(scope))


def rewrite_body(rewrite: Callable[[bytes], bytes], **scope: Unpack[Scope]) -> RewriteBody:
    return RewriteBody(rewrite=rewrite, **_scoped(scope))


def delay(
    seconds: float, *, where: Literal["request", "body"] = "request", **scope: Unpack[Scope]
) -> Delay:
    return Delay(seconds=seconds, where=where, **_scoped(scope))


def drop_connection(
    *, forward: bool = False, after_bytes: int | None = None, **scope: Unpack[Scope]
) -> DropConnection:
    return DropConnection(forward=forward, after_bytes=after_bytes, **_scoped(scope))


def strip_headers(pattern: str = r"^x-amz-checksum-", **scope: Unpack[Scope]) -> StripHeaders:
    return StripHeaders(pattern=pattern, **_scoped(scope))


FACTORIES: dict[str, Callable[..., Fault]] = {
    factory.__name__: factory
    for factory in (
        truncate_body, short_object, drop_part_bytes, corrupt_part_bytes, error,
        error_body_with_200, rewrite_etag, rewrite_body, delay, drop_connection,
        strip_headers,
    )
}
