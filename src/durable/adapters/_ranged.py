"""Seekable readers of one pinned object version (object-store adapters).

Both ask only for bytes inside the size recorded at open and never hand out a body of
another length, so a short body (incident 003) is an IntegrityError here, never a short
read that a caller could take for the end of the file.

- `PinnedRangeReader`: the adapter supplies ``fetch(start, length) -> bytes``, one ranged
  GET that the store refuses if the object is no longer the version the reader was opened
  on (a GCS generation, an Azure ETag); bytes are fetched in read-ahead blocks.
- `PinnedStreamReader`: the adapter supplies ``open_body(start)``, one GET of bytes
  ``[start, size)`` pinned the same way, whose body is streamed; a body that ends early or
  breaks is requested again from where it stopped, a bounded number of times (S3).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, BinaryIO, Protocol

from durable._errors import IntegrityError

__all__ = ["Body", "BrokenBody", "PinnedRangeReader", "PinnedStreamReader", "open_pinned",
           "seek_position"]

#: One GET fetches at least this much: sequential small reads cost one request per block.
READ_AHEAD = 8 * 1024 * 1024


def seek_position(offset: int, whence: int, pos: int, size: int) -> int:
    """Where ``seek(offset, whence)`` lands from ``pos`` in an object of ``size`` bytes."""
    if whence == io.SEEK_SET:
        target = offset
    elif whence == io.SEEK_CUR:
        target = pos + offset
    elif whence == io.SEEK_END:
        target = size + offset
    else:
        raise ValueError(f"bad whence {whence}")
    if target < 0:
        raise ValueError("negative seek position")
    return target


def open_pinned(url: str, size: int, fetch: Callable[[int, int], bytes]) -> BinaryIO:
    """A buffered reader: ``read(n)`` returns n bytes unless at the end, as callers expect."""
    return io.BufferedReader(PinnedRangeReader(url, size, fetch), buffer_size=64 * 1024)


class _SizedReader(io.RawIOBase):
    """A read-only, seekable raw file of ``size`` bytes; subclasses implement readinto."""

    def __init__(self, url: str, size: int) -> None:
        super().__init__()
        self.url = url
        self.size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = seek_position(offset, whence, self._pos, self.size)
        if pos != self._pos:
            self._moved()
        self._pos = pos
        return pos

    def _moved(self) -> None:
        """The position jumped: anything read ahead from the old one is stale."""

    def readall(self) -> bytes:
        """The rest of the object, read in blocks of READ_AHEAD into one buffer of its size.

        `io.RawIOBase.readall` reads 8 KiB at a time into a growing bytearray: on S3 each is
        a hop to the client's event loop (a 300 MB `read_verified` from moto took 9.3 s,
        where 8 MiB reads of `open_verified` take 0.8 s). A short body still raises in
        `readinto`, so nothing short is returned."""
        out = bytearray(max(0, self.size - self._pos))
        with memoryview(out) as view:
            done = 0
            while done < len(out):
                n = self.readinto(view[done:done + READ_AHEAD])
                if not n:
                    break  # past the end: the object is what `readinto` handed out
                done += n
        return bytes(out[:done]) if done < len(out) else bytes(out)


class PinnedRangeReader(_SizedReader):
    """Read ``size`` bytes of ``url`` through ``fetch(start, length) -> bytes``."""

    def __init__(self, url: str, size: int, fetch: Callable[[int, int], bytes],
                 read_ahead: int = READ_AHEAD) -> None:
        super().__init__(url, size)
        self._fetch = fetch
        self._read_ahead = read_ahead
        # One block of this version's bytes, private to this reader: [_buf_start, +len).
        self._buf = b""
        self._buf_start = 0

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(view.nbytes, max(0, self.size - self._pos))
        if want == 0:
            return 0
        offset = self._pos - self._buf_start
        if not 0 <= offset < len(self._buf):
            length = min(max(want, self._read_ahead), self.size - self._pos)
            self._buf = self._checked_fetch(self._pos, length)
            self._buf_start, offset = self._pos, 0
        n = min(want, len(self._buf) - offset)
        view[:n] = self._buf[offset:offset + n]
        self._pos += n
        return n

    def _checked_fetch(self, start: int, length: int) -> bytes:
        data = self._fetch(start, length)
        if len(data) != length:
            # A body that ended early (or ran long) is never handed out as data.
            raise IntegrityError(
                f"{self.url}: asked for bytes {start}-{start + length - 1} of {self.size}, "
                f"the body had {len(data)} bytes", url=self.url, expected=length,
                found=len(data))
        return data

    def close(self) -> None:
        self._buf = b""
        super().close()


class BrokenBody(Exception):
    """Raised by `Body.read` when the transport broke mid-body (a reset connection, a
    timeout): the reader asks again from where it stopped, as for a body that ended early.
    ``stalled``: no data came within the client's read timeout."""

    def __init__(self, why: str, *, stalled: bool = False) -> None:
        super().__init__(why)
        self.stalled = stalled


class Body(Protocol):
    """An open response body: ``read(n)`` returns at most n bytes, b"" at its end."""

    def read(self, n: int) -> bytes: ...

    def close(self) -> None: ...


class PinnedStreamReader(_SizedReader):
    """Stream ``size`` bytes of ``url`` from bodies ``open_body(start)`` hands out.

    ``open_body(start)`` sends one GET of bytes ``[start, size)``, pinned to the version
    the reader was opened on, and checks its answer (status, length, version) before
    returning the body. ``body``: a body already open at byte 0 (one GET instead of a stat
    and a GET). At most ``retries`` bodies may end early over the reader's life.
    """

    def __init__(self, url: str, size: int, open_body: Callable[[int], Body], *,
                 retries: int = 2, body: Body | None = None) -> None:
        super().__init__(url, size)
        self._open_body = open_body
        self._retries = retries
        self._body = body  # streaming bytes [_pos, _pos + _left)
        self._left = size if body is not None else 0
        # Counted over the reader's life: a store that cuts every body must not cost one
        # request per fragment of the object.
        self._failures: list[str] = []
        self._stalls = 0  # of them, bodies that stalled past the read timeout

    def _moved(self) -> None:
        self._drop()

    def _drop(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            body.close()

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = min(view.nbytes, self.size - self._pos)
        if want <= 0:
            return 0
        while True:
            if self._body is None:
                self._body, self._left = self._open_body(self._pos), self.size - self._pos
            try:
                # At most READ_AHEAD: a body asked for all it has answers with one
                # chunk that size, copied into the buffer: the object held twice.
                chunk, why = self._body.read(min(want, self._left, READ_AHEAD)), "end of body"
            except BrokenBody as exc:
                chunk, why = b"", str(exc)
                self._stalls += exc.stalled
            if chunk:
                break
            self._failures.append(why)
            self._drop()
            if len(self._failures) > self._retries and self._stalls == len(self._failures):
                # A store that sends nothing more is no short body: said as what it is,
                # the builtin a caller of a network read catches.
                raise TimeoutError(
                    f"{self.url}: the body stalled at byte {self._pos} of {self.size}: no "
                    f"data within the client's read timeout, {len(self._failures)} times; "
                    "nothing short is returned")
            if len(self._failures) > self._retries:
                raise IntegrityError(
                    f"{self.url}: body ended at byte {self._pos} of {self.size} "
                    f"({len(self._failures)} times: {', '.join(self._failures)}); a short "
                    "body is never returned", url=self.url, expected=self.size,
                    found=self._pos)
        n = len(chunk)
        view[:n] = chunk
        self._pos += n
        self._left -= n
        if self._left == 0:
            self._end_of_body()
        return n

    def _end_of_body(self) -> None:
        # One more read: it must be empty (bytes past the Content-Length are not this
        # object's), and it lets the client check the body against the store's checksum.
        assert self._body is not None
        try:
            extra = self._body.read(1)
        except BrokenBody:
            extra = b""  # every byte asked for arrived; the connection died after them
        finally:
            self._drop()
        if extra:
            raise IntegrityError(f"{self.url}: body longer than its Content-Length",
                                 url=self.url, expected=self.size)

    def close(self) -> None:
        if not self.closed:
            self._drop()
        super().close()
