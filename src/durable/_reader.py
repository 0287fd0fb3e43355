"""Reading one commit of an entry: `Entry.reading()` and the `EntryReader` it yields.

A checkpoint is read file by file (the model, then the optimizer state, then the step
counter). Read through `read_verified` one at a time, each file is checked against the
marker *as it is at that read*: a rewrite of the entry between two reads passes both
checks, and the step counter of one commit is restored with the weights of another.

An `EntryReader` reads the marker once, when reading begins, and checks every object it
hands out against that commit's manifest: its size before the body is taken in, its
CRC32C (and tail) before the last bytes go out. An object of any other commit fails that
check (unless it holds the very same bytes, which is no mix), so everything one reader
returns is of one commit, or an error. Where the check fails because the entry was
rewritten meanwhile (its marker is another one now, or gone), the error is an
IncompleteError saying so, to read it again; where the marker is unchanged, the object
was damaged: IntegrityError. It also costs less: one marker read for every object of
the entry, not one per object.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from durable._checksum import crc32c as crc32c_of
from durable._checksum import crc_to_hex
from durable._errors import DurableError, IncompleteError, IntegrityError
from durable._protocol import Marker, ObjectRecord, State, check_key, key_text
from durable._verified import VerifiedReader, missing_error
from durable.adapters import ObjectInfo

if TYPE_CHECKING:
    from durable._entry import Entry

__all__ = ["EntryReader", "reading"]


class EntryReader:
    """Reads of the commit ``marker`` of ``entry``: each object checked against its
    manifest (`read`, `open`), so that all of them are of that one commit.

    Keys are as in the manifest (``"model/weights.bin"``, or a path object spelling it,
    ``PurePosixPath("model") / "weights.bin"``); a single-object entry has the one key
    ``""``.
    """

    def __init__(self, entry: Entry, marker: Marker) -> None:
        assert marker.manifest is not None  # a marker read back carries its manifest
        self.entry = entry
        self.marker = marker
        self.manifest = marker.manifest

    def __repr__(self) -> str:
        return f"EntryReader({self.entry.url!r}, commit {self.marker.attempt})"

    def keys(self) -> list[str]:
        """The objects of this commit, sorted."""
        return sorted(self.manifest.objects)

    def __contains__(self, key: object) -> bool:
        key = key_text(key)  # a path object is the key it spells
        return isinstance(key, str) and key in self.manifest.objects

    def url(self, key: str | os.PathLike[str] = "") -> str:
        """The URL of the object ``key`` of the entry."""
        return self.entry.adapter.url(self._path(key_text(key)))

    def record(self, key: str | os.PathLike[str] = "") -> ObjectRecord:
        """The manifest's record (size, CRC32C) of ``key``; FileNotFoundError naming it
        if this commit has no such object."""
        key = key_text(key)
        self._path(key)  # a hostile key is refused before anything is looked up
        rec = self.manifest.objects.get(key)
        if rec is None:
            n = len(self.manifest.objects)
            raise FileNotFoundError(
                f"{self.url(key)}: not in commit {self.marker.attempt} of {self.entry.url} "
                f"(its manifest lists {n} object{'s' if n != 1 else ''})")
        return rec

    def read(self, key: str | os.PathLike[str] = "") -> bytes:
        """The whole object ``key``, only if it is this commit's: its size and CRC32C."""
        key = key_text(key)
        rec = self.record(key)
        adapter, path = self.entry.adapter, self._path(key)
        url = adapter.url(path)
        try:
            opened = adapter.open_whole(path)
            with opened[1] if opened is not None else contextlib.nullcontext():
                # Refused before the body is taken in: no short, long or error body.
                self._check_size(path, rec, opened[0] if opened is not None else None)
                assert opened is not None
                data = opened[1].read()  # exactly the size said, or an error (short body)
            got = crc32c_of(data)
            if len(data) != rec.size or got != rec.crc32c or (
                    rec.tail is not None and int.from_bytes(data[-4:], "big") != rec.tail):
                raise IntegrityError(
                    f"{url}: {len(data)} bytes of CRC32C {crc_to_hex(got)}, {self._said} "
                    f"{rec.size} bytes of {rec.checksum_text()} (corrupt data)", url=url,
                    expected=(rec.size, rec.checksum_text()),
                    found=(len(data), crc_to_hex(got)))
        except (IntegrityError, FileNotFoundError) as exc:
            raise self._explained(exc) from exc
        return data

    def open(self, key: str | os.PathLike[str] = "") -> BinaryIO:
        """A read-only file of the object ``key`` that raises instead of handing out bytes
        of another commit: its size checked at the open, its CRC32C before the last bytes
        go out (read in order) or, at the first seek away from order, over the whole object
        before any byte (as `durable.open_verified`)."""
        key = key_text(key)
        rec = self.record(key)
        adapter, path = self.entry.adapter, self._path(key)
        try:
            info = self._check_size(path, rec, adapter.info(path))
            raw = _CommitReader(self, adapter, path, info, rec.crc32c, tail=rec.tail)
        except (IntegrityError, FileNotFoundError) as exc:
            raise self._explained(exc) from exc
        return io.BufferedReader(raw, buffer_size=1024 * 1024)

    def check_unchanged(self) -> None:
        """IncompleteError unless the entry's marker is still this commit's: for a caller
        that read the entry by other means too (a library given `url`s) and wants to know
        that no rewrite landed meanwhile."""
        problem = self._rewritten()
        if problem is not None:
            raise problem

    # ---------------------------------------------------------------------------------
    @property
    def _said(self) -> str:
        return f"commit {self.marker.attempt} recorded"

    def _path(self, key: str) -> str:
        if self.marker.kind == "object":
            if key != "":
                raise ValueError(f"{self.entry.url} is a single-object entry: its one key "
                                 f"is '', not {key!r}")
        else:
            try:
                check_key(key, self.entry.url)
            except ValueError:
                # A key such as "../other" would read outside the entry: refused, never built.
                raise ValueError(f"{self.entry.url}: {key!r:.200} is not a key inside the "
                                 "entry (a relative path with no '..', '.' or empty "
                                 "segment, as the manifest lists them)") from None
        return self.entry.layout.object_path(key, self.marker.kind)

    def _check_size(self, path: str, rec: ObjectRecord, info: ObjectInfo | None
                    ) -> ObjectInfo:
        """``info``, if the object is there with the size ``rec`` records."""
        url = self.entry.adapter.url(path)
        if info is None:
            raise missing_error(self.entry.adapter, path, url, rec.size)
        if info.size != rec.size:
            raise IntegrityError(
                f"{url}: {self._said} {rec.size} bytes, the store says {info.size}",
                url=url, expected=rec.size, found=info.size)
        return info

    def _rewritten(self) -> IncompleteError | None:
        """The error for a rewrite since this reader's marker was read; None if the entry
        still holds that commit (or its marker cannot be read: no rewrite shown)."""
        try:
            now = self.entry.read_marker()
        except (OSError, DurableError):
            return None
        if now is not None and now.attempt == self.marker.attempt:
            return None
        found = "no commit" if now is None else f"commit {now.attempt}"
        return IncompleteError(
            f"{self.entry.url} was rewritten while it was read (commit "
            f"{self.marker.attempt} when reading began, {found} now): reads of both would "
            "mix two commits; read it again from the start", url=self.entry.url,
            state=State.INCOMPLETE if now is None else State.COMPLETE)

    def _explained(self, exc: OSError) -> OSError:
        """``exc`` (an object unlike its record, or missing), or the rewrite behind it."""
        rewritten = self._rewritten()
        if rewritten is None:
            return exc
        rewritten.__cause__ = exc
        return rewritten


class _CommitReader(VerifiedReader):
    """`VerifiedReader` whose mismatch names a rewrite of the entry where there was one."""

    def __init__(self, reader: EntryReader, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reader = reader

    def _check(self, ck: Any, head: bytearray, ending: bytes) -> None:
        try:
            super()._check(ck, head, ending)
        except IntegrityError as exc:
            raise self._reader._explained(exc) from exc


@contextlib.contextmanager
def reading(entry: Entry) -> Iterator[EntryReader]:
    """`Entry.reading`: the COMPLETE entry's reader (IncompleteError otherwise)."""
    yield EntryReader(entry, entry.require_complete())
