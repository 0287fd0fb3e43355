"""A seekable reader over ranged GETs of one pinned object version (object-store adapters).

Each adapter supplies ``fetch(start, length)``: one ranged GET that the store refuses if the
object is no longer the version the reader was opened on (a GCS generation, an Azure ETag).
This class asks only for bytes inside the size recorded at open and refuses a body of any
other length, so a short body (incident 003) is an IntegrityError here, never a short
read that a caller could take for the end of the file.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, BinaryIO

from durable._errors import IntegrityError

__all__ = ["PinnedRangeReader", "open_pinned"]

#: One GET fetches at least this much: sequential small reads cost one request per block.
READ_AHEAD = 8 * 1024 * 1024


def open_pinned(url: str, size: int, fetch: Callable[[int, int], bytes]) -> BinaryIO:
    """A buffered reader: ``read(n)`` returns n bytes unless at the end, as callers expect."""
    return io.BufferedReader(PinnedRangeReader(url, size, fetch), buffer_size=64 * 1024)


class PinnedRangeReader(io.RawIOBase):
    """Read ``size`` bytes of ``url`` through ``fetch(start, length) -> bytes``."""

    def __init__(self, url: str, size: int, fetch: Callable[[int, int], bytes],
                 read_ahead: int = READ_AHEAD) -> None:
        super().__init__()
        self.url = url
        self.size = size
        self._fetch = fetch
        self._read_ahead = read_ahead
        self._pos = 0
        # One block of this version's bytes, private to this reader: [_buf_start, +len).
        self._buf = b""
        self._buf_start = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self.size + offset
        else:
            raise ValueError(f"bad whence {whence}")
        if pos < 0:
            raise ValueError("negative seek position")
        self._pos = pos
        return pos

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
