"""One request/response exchange of the fault proxy, and its record in the request log."""

from __future__ import annotations

import contextlib
import html
import io
import re
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import TYPE_CHECKING, Literal, TypeGuard, cast
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape as _xml_escape

from durable.testing.faults._http import (
    BUF,
    Count,
    Framing,
    Headers,
    PeerClosed,
    ProtocolError,
    aws_rechunk,
    aws_unchunk,
    content_length,
    dechunk,
    drain,
    first_bytes,
    is_chunked,
    iter_body,
    parse_content_range,
    parse_status,
    read_head,
    request_framing,
    response_framing,
    status_line,
)
from durable.testing.faults._kinds import (
    Delay,
    DropConnection,
    DropPartBytes,
    Error,
    ErrorBodyWith200,
    RequestInfo,
    RewriteBody,
    RewriteEtag,
    ShortObject,
    StripHeaders,
    TruncateBody,
    default_error_document,
    kept,
)

if TYPE_CHECKING:
    from durable.testing.faults._kinds import Fault
    from durable.testing.faults._proxy import FaultProxy

# An XML body larger than this passes through with its ETag elements as they were.
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


def _provisional_duration(rec: RequestRecord) -> None:
    """The time so far, set before the answer's last bytes go (the exchange's end sets it
    exactly): a client that has its answer never reads a duration of 0 from the log."""
    rec.duration = max(rec.duration, time.time() - rec.started, 1e-9)


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
        # Never log the credentials a request carries.
        if lname in _LOGGED_HEADERS or (
            lname.startswith("x-amz-") and lname != "x-amz-security-token"
        ):
            out[lname] = value
    return out


_Ending = Error | ErrorBodyWith200 | DropConnection


def _ends_before_upstream(f: Fault) -> TypeGuard[_Ending]:
    """An error answered in place of the store, or a connection dropped unforwarded."""
    if isinstance(f, Error):
        return not f.forward
    return isinstance(f, ErrorBodyWith200) or (isinstance(f, DropConnection) and f.before_upstream)


def _ends_after_upstream(f: Fault) -> TypeGuard[_Ending]:
    """The store applied the request; the client gets an error or a dead connection."""
    if isinstance(f, DropConnection):
        return f.forward and f.after_bytes is None
    return isinstance(f, Error) and f.forward


def _at_most(limit: int | None, n: int) -> int:
    return n if limit is None else min(limit, n)


class Exchange:
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

    def _delay(self, candidates: list[Fault], where: str, rec: RequestRecord) -> None:
        for f in candidates:
            if isinstance(f, Delay) and f.where == where and self.proxy._consume(f, rec):
                # Cut short when the proxy stops, so stop() is not held up.
                self.proxy._stopping.wait(f.seconds)

    def _close_upstream(self) -> None:
        if self.up_rfile is not None:
            with contextlib.suppress(OSError):
                self.up_rfile.close()
        if self.up is not None:
            self.proxy._track(self.up, False)
            with contextlib.suppress(OSError):
                self.up.close()
        self.up = self.up_rfile = None

    def _reply(
        self,
        rec: RequestRecord,
        status: int,
        body: bytes,
        extra: Mapping[str, str] | None = None,
        *,
        close: bool,
    ) -> None:
        """Answer the client from the proxy itself, with an XML body."""
        lines = [
            ("Date", formatdate(usegmt=True)),
            ("Server", "durable-faultproxy"),
            ("x-amz-request-id", self.request_id),
            ("Content-Type", "application/xml"),
            ("Content-Length", str(len(body))),
        ]
        lines.extend((extra or {}).items())
        if close:
            lines.append(("Connection", "close"))
        rec.status = status
        rec.response_bytes = 0 if rec.method == "HEAD" else len(body)
        _provisional_duration(rec)
        self._send(status_line(status) + Headers(lines).to_bytes() + b"\r\n")
        if rec.method != "HEAD":
            self._send(body)

    def _reply_error(
        self,
        rec: RequestRecord,
        info: RequestInfo,
        status: int,
        message: str | None = None,
        extra: Mapping[str, str] | None = None,
        *,
        close: bool,
    ) -> None:
        body = default_error_document(status, info, self.request_id, message=message)
        self._reply(rec, status, body, extra, close=close)

    def _end(self, f: _Ending, info: RequestInfo, rec: RequestRecord, client_keep: bool) -> bool:
        """End the exchange as ``f`` says; whether the client connection may be reused."""
        if isinstance(f, DropConnection):
            rec.truncated = True
            return False
        self._reply(rec, *f._response(info, self.request_id), close=not client_keep)
        return client_keep

    # ------------------------------------------------------------------ main

    def run(self) -> bool:
        """Serve one request. Returns whether the client connection may be reused."""
        head = read_head(self.rfile)
        if head is None:
            return False
        start_line, headers = head
        parts = start_line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise ProtocolError(f"bad request line {start_line[:80]!r}")
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
        client_keep = (
            self.proxy.keep_alive
            and not headers.has_token("connection", "close")
            and (version == "HTTP/1.1" or headers.has_token("connection", "keep-alive"))
        )
        framing = request_framing(headers)
        if version == "HTTP/1.1" and headers.has_token("expect", "100-continue"):
            self._send(b"HTTP/1.1 100 Continue\r\n\r\n")

        candidates = self.proxy._candidates(info)
        self._delay(candidates, "request", rec)
        for f in candidates:
            if _ends_before_upstream(f) and self.proxy._consume(f, rec):
                rec.request_bytes = drain(iter_body(self.rfile, framing, raw=False))
                return self._end(f, info, rec, client_keep)

        modifiers = [
            f for f in candidates if isinstance(f, DropPartBytes) and framing.kind != "none"
        ]
        modifiers = [f for f in modifiers if self.proxy._consume(f, rec)]
        try:
            self._connect()
        except OSError as exc:
            rec.request_bytes = drain(iter_body(self.rfile, framing, raw=False))
            rec.error = f"upstream connect failed: {exc}"
            self._reply_error(rec, info, 502, f"proxy: {exc}", close=not client_keep)
            return client_keep
        if modifiers:
            self._forward_modified(start_line, headers, framing, modifiers, rec)
        else:
            self._forward_streaming(start_line, headers, framing, rec)

        try:
            resp_line, resp_headers = self._response_head()
            resp_version, status = parse_status(resp_line)
        except (OSError, PeerClosed, ProtocolError) as exc:
            rec.error = f"upstream response failed: {type(exc).__name__}: {exc}"
            code = 504 if isinstance(exc, TimeoutError) else 502
            self._reply_error(rec, info, code, f"proxy: {exc}", close=True)
            return False
        rec.upstream_status = status
        assert self.up_rfile is not None
        resp_framing = response_framing(info.method, status, resp_headers)
        body_iter = iter_body(self.up_rfile, resp_framing, raw=True)

        for f in candidates:
            if _ends_after_upstream(f) and self.proxy._consume(f, rec):
                drain(body_iter)
                return self._end(f, info, rec, client_keep)

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
            elif (isinstance(f, RewriteBody) and resp_framing.kind in ("length", "chunked")
                  and self.proxy._consume(f, rec)):
                body_override = self._rewrite_body(f, resp_headers, body_iter, body_override)
            elif isinstance(f, ShortObject) and 200 <= status < 300 and body_override is None:
                action = self._short_object(f, status, resp_headers, resp_framing, rec)
                if action is None:
                    continue
                what, n = action
                if what == "416":
                    drain(body_iter)
                    range_ = {"Content-Range": f"bytes */{n}"}
                    self._reply_error(rec, info, 416, extra=range_, close=not client_keep)
                    return client_keep
                if what == "cut":
                    limit = _at_most(limit, n)
                else:  # "consistent": headers already rewritten, send `n` bytes
                    resp_framing = Framing("length", n)
                    body_iter = first_bytes(body_iter, n)
            elif isinstance(f, TruncateBody) and 200 <= status < 300:
                cut = self._truncate_at(f, resp_framing, rec)
                if cut is not None:
                    limit = _at_most(limit, cut)
            elif (
                isinstance(f, DropConnection)
                and f.after_bytes is not None
                and self.proxy._consume(f, rec)
            ):
                limit = _at_most(limit, f.after_bytes)

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
        self._send(resp_line + resp_headers.to_bytes() + b"\r\n")
        if resp_framing.kind != "none":
            self._delay(candidates, "body", rec)

        pieces: Iterable[bytes] = [body_override] if body_override is not None else body_iter
        if not self._send_body(pieces, limit, rec):
            return False
        if limit is not None:
            expected = resp_framing.length if resp_framing.kind == "length" else None
            rec.truncated = expected is None or rec.response_bytes < expected
            return False
        return keep

    def _send_body(self, pieces: Iterable[bytes], limit: int | None, rec: RequestRecord) -> bool:
        """Pass the body on, up to ``limit`` bytes; ``False`` if the upstream broke."""
        sent = 0
        try:
            for piece in pieces:
                last = limit is not None and sent + len(piece) >= limit
                if last:
                    assert limit is not None
                    piece = piece[: limit - sent]
                # Counted before it goes: a client holding every byte may read the log
                # before this thread runs again (it read 0 bytes and no duration).
                rec.response_bytes = sent + len(piece)
                _provisional_duration(rec)
                self._send(piece)
                sent += len(piece)
                if last:
                    break
        except (PeerClosed, ProtocolError) as exc:  # the upstream broke mid-body
            rec.error = f"upstream body failed: {type(exc).__name__}: {exc}"
            rec.truncated = True
            return False
        finally:
            rec.response_bytes = sent
        return True

    # ------------------------------------------------------------- upstream

    def _connect(self) -> None:
        up = socket.create_connection(self.proxy._up_addr, timeout=self.proxy.upstream_timeout)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.up = up
        self.proxy._track(up, True)
        self.up_rfile = cast(io.BufferedReader, up.makefile("rb", buffering=BUF))

    def _up_send(self, data: bytes) -> None:
        assert self.up is not None
        if data:
            self.up.sendall(data)

    def _response_head(self) -> tuple[bytes, Headers]:
        """The upstream's final response head (interim 1xx responses skipped)."""
        assert self.up_rfile is not None
        while True:
            resp = read_head(self.up_rfile)
            if resp is None:
                raise PeerClosed("upstream closed the connection without a response")
            _, status = parse_status(resp[0])
            if status >= 200 or status == 101:
                return resp

    def _forward_streaming(
        self, start_line: bytes, headers: Headers, framing: Framing, rec: RequestRecord
    ) -> None:
        """Send the request exactly as received; stream the body (raw framing kept)."""
        broken = False
        try:
            self._up_send(start_line + headers.to_bytes() + b"\r\n")
        except OSError:
            broken = True
        count = Count()
        for piece in iter_body(self.rfile, framing, raw=True, count=count):
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
        framing: Framing,
        modifiers: list[DropPartBytes],
        rec: RequestRecord,
    ) -> None:
        body = b"".join(iter_body(self.rfile, framing, raw=False))
        rec.request_bytes = len(body)
        aws_chunked = headers.has_token("content-encoding", "aws-chunked")
        if aws_chunked:
            data, final = aws_unchunk(body)
        else:
            data, final = body, b""
        for f in modifiers:
            data = f.apply(data)
        if aws_chunked:
            body = aws_rechunk(data, final)
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

    @staticmethod
    def _whole_body(headers: Headers, body_iter: Iterator[bytes]) -> bytes | None:
        """The response body, dechunked, to rewrite; None if too large to hold."""
        n = content_length(headers)
        if n is not None and n > _MAX_XML_REWRITE:
            return None
        body = b"".join(body_iter)
        if is_chunked(headers):
            body = dechunk(body)
            headers.remove("transfer-encoding")
        return body

    def _rewrite_xml_etags(
        self, f: RewriteEtag, headers: Headers, body_iter: Iterator[bytes]
    ) -> bytes | None:
        body = self._whole_body(headers, body_iter)
        if body is None:
            return None

        def repl(m: re.Match[bytes]) -> bytes:
            inner = m.group(2).decode()
            # Keep the document's own spelling of the quotes a client may compare.
            entity = next((e for e in ("&quot;", "&#34;", "&#x22;") if e in inner), None)
            new = f.rewrite(html.unescape(inner))
            text = _xml_escape(new or "")
            if entity is not None:
                text = text.replace('"', entity)
            return m.group(1) + text.encode() + m.group(3)

        body = re.sub(rb"(<ETag>)(.*?)(</ETag>)", repl, body, flags=re.S)
        headers.set("Content-Length", str(len(body)))
        return body

    def _rewrite_body(self, f: RewriteBody, headers: Headers, body_iter: Iterator[bytes],
                      body: bytes | None) -> bytes | None:
        if body is None:
            body = self._whole_body(headers, body_iter)
            if body is None:
                return None
        body = f.rewrite(body)
        headers.set("Content-Length", str(len(body)))
        return body

    def _truncate_at(self, f: TruncateBody, framing: Framing, rec: RequestRecord) -> int | None:
        """Where ``f`` cuts this body, or ``None`` if it does not apply."""
        if framing.kind == "none":
            return None
        total = framing.length if framing.kind == "length" else 0
        n = kept(f.keep, total) if isinstance(f.keep, float) else f.keep
        if framing.kind == "length" and n >= total:
            return None
        return n if self.proxy._consume(f, rec) else None

    def _short_object(
        self,
        f: ShortObject,
        status: int,
        headers: Headers,
        framing: Framing,
        rec: RequestRecord,
    ) -> tuple[Literal["cut", "consistent", "416"], int] | None:
        if framing.kind != "length":
            return None
        if status == 206:
            cr = parse_content_range(headers.get("content-range"))
            if cr is None:
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
