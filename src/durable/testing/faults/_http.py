"""HTTP/1.x on the wire, as the fault proxy reads and re-sends it.

Messages are parsed only as far as forwarding needs (start line, headers, body framing), and
headers nobody changed are re-sent as the exact bytes received: a re-serialised header would
break the client's SigV4 signature.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

BUF = 64 * 1024
_MAX_LINE = 64 * 1024
_MAX_HEADERS = 256


class PeerClosed(Exception):
    """A peer closed its connection before a message was complete."""


class ProtocolError(Exception):
    """A peer sent something that is not HTTP/1.x as this proxy understands it."""


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
        values = self.get_all(name)
        return values[0] if values else default

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
        return token.lower() in _tokens(self, name)


def _tokens(headers: Headers, name: str) -> list[str]:
    """The comma-separated tokens of every ``name`` header, lower-case, in order."""
    return [t.strip().lower() for value in headers.get_all(name) for t in value.split(",")]


def _read_line(rfile: io.BufferedIOBase) -> bytes:
    line = rfile.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise ProtocolError("header line too long")
    return line


def read_head(rfile: io.BufferedIOBase) -> tuple[bytes, Headers] | None:
    """Read a start line and headers; ``None`` on a clean EOF before the first byte."""
    line = _read_line(rfile)
    while line in (b"\r\n", b"\n"):
        line = _read_line(rfile)
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise PeerClosed("connection closed inside the start line")
    items: list[_Header] = []
    while True:
        h = _read_line(rfile)
        if not h or not h.endswith(b"\n"):
            raise PeerClosed("connection closed inside the headers")
        if h in (b"\r\n", b"\n"):
            break
        if h[:1] in (b" ", b"\t") and items:  # obsolete line folding
            items[-1].value += " " + h.strip().decode("latin-1")
            assert items[-1].raw is not None
            items[-1].raw += h
            continue
        name, sep, value = h.partition(b":")
        if not sep or not name.strip():
            raise ProtocolError(f"malformed header line {h[:80]!r}")
        items.append(_Header(name.decode("latin-1").strip(), value.decode("latin-1").strip(), h))
        if len(items) > _MAX_HEADERS:
            raise ProtocolError("too many headers")
    return line, Headers._from_raw(items)


def parse_status(line: bytes) -> tuple[str, int]:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ProtocolError(f"bad status line {line[:80]!r}")
    try:
        return parts[0].decode("ascii"), int(parts[1])
    except ValueError:
        raise ProtocolError(f"bad status line {line[:80]!r}") from None


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


def status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n".encode("ascii")


_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    if value is None:
        return None
    m = _CONTENT_RANGE.fullmatch(value.strip())
    if m is None:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)), total


# ------------------------------------------------------------------------------ bodies


@dataclass(frozen=True)
class Framing:
    """How a message's body is delimited: not at all, by Content-Length, by chunked
    transfer coding, or by the sender closing the connection."""

    kind: Literal["none", "length", "chunked", "close"]
    length: int = 0


def content_length(headers: Headers) -> int | None:
    values = {v.strip() for v in headers.get_all("content-length")}
    if not values:
        return None
    if len(values) != 1:
        raise ProtocolError("conflicting Content-Length headers")
    value = values.pop()
    if not value.isdigit():
        raise ProtocolError(f"bad Content-Length {value!r}")
    return int(value)


def is_chunked(headers: Headers) -> bool:
    codings = _tokens(headers, "transfer-encoding")
    return bool(codings) and codings[-1] == "chunked"


def request_framing(headers: Headers) -> Framing:
    if is_chunked(headers):
        return Framing("chunked")
    n = content_length(headers)
    if n is None or n == 0:
        return Framing("none")
    return Framing("length", n)


def response_framing(method: str, status: int, headers: Headers) -> Framing:
    if method == "HEAD" or status < 200 or status in (204, 304):
        return Framing("none")
    if is_chunked(headers):
        return Framing("chunked")
    n = content_length(headers)
    if n is None:
        return Framing("close")
    return Framing("length", n)


class Count:
    """Decoded body bytes seen so far (shared with the iterator that reads them)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


def iter_body(
    rfile: io.BufferedIOBase, framing: Framing, *, raw: bool, count: Count | None = None
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


def drain(it: Iterator[bytes]) -> int:
    return sum(len(piece) for piece in it)


def first_bytes(it: Iterator[bytes], n: int) -> Iterator[bytes]:
    """The first ``n`` bytes of ``it``; the rest is left unread (the upstream is dropped)."""
    for piece in it:
        if n <= 0:
            return
        if len(piece) >= n:
            yield piece[:n]
            return
        n -= len(piece)
        yield piece


def dechunk(raw: bytes) -> bytes:
    """The data of a complete body in chunked transfer coding."""
    return b"".join(_iter_chunked(io.BytesIO(raw), raw=False))


def _iter_exact(rfile: io.BufferedIOBase, n: int) -> Iterator[bytes]:
    while n > 0:
        data = rfile.read1(min(BUF, n))
        if not data:
            raise PeerClosed(f"connection closed with {n} body bytes outstanding")
        n -= len(data)
        yield data


def _iter_until_close(rfile: io.BufferedIOBase) -> Iterator[bytes]:
    while data := rfile.read1(BUF):
        yield data


def _counted(it: Iterator[bytes], count: Count) -> Iterator[bytes]:
    for piece in it:
        count.n += len(piece)
        yield piece


def _chunk_size(line: bytes) -> int:
    if not line.endswith(b"\n"):
        raise PeerClosed("connection closed inside a chunk header")
    text = line.split(b";", 1)[0].strip()
    try:
        size = int(text, 16)
    except ValueError:
        raise ProtocolError(f"bad chunk size {line[:40]!r}") from None
    if size < 0:
        raise ProtocolError("negative chunk size")
    return size


def _iter_chunked(
    rfile: io.BufferedIOBase, *, raw: bool, count: Count | None = None
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
                    raise PeerClosed("connection closed inside the chunked trailer")
                if raw:
                    yield trailer
                if trailer in (b"\r\n", b"\n"):
                    return
        yield from _iter_exact(rfile, size)
        crlf = _read_line(rfile)
        if crlf not in (b"\r\n", b"\n"):
            raise PeerClosed("chunk data not followed by CRLF")
        if raw:
            yield crlf


# -------------------------------------------------------------------------- aws-chunked


def aws_unchunk(payload: bytes) -> tuple[bytes, bytes]:
    """Decode an ``aws-chunked`` payload into (data, final chunk line + trailers)."""
    out = bytearray()
    pos = 0
    while True:
        eol = payload.find(b"\r\n", pos)
        if eol < 0:
            raise ProtocolError("truncated aws-chunked payload")
        size = _chunk_size(payload[pos : eol + 2])
        if size == 0:
            return bytes(out), payload[pos:]
        pos = eol + 2
        out += payload[pos : pos + size]
        pos += size + 2  # data and its CRLF


def aws_rechunk(data: bytes, final: bytes) -> bytes:
    """Re-encode ``data`` as one ``aws-chunked`` chunk followed by the original final chunk
    and trailers. Chunk signatures (signed streaming) are not recomputed."""
    head = f"{len(data):x}\r\n".encode() + data + b"\r\n" if data else b""
    return head + (final or b"0\r\n\r\n")
