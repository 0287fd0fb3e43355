"""Verified reads: bytes come back only if their length and CRC32C are what was recorded.

A short body (incident 003's download shorter than its Content-Length), an error document
served as the object, an object short by whole parts behind a full-size HEAD (incident
002), a flipped byte: each is an IntegrityError naming the object, and none of its bytes
are returned by `read_verified`.

An object with no record (no CRC32C to catch anything) is still never an error page: a
body of at most 64 KiB that is an object store's error document (`error_document`) is an
IntegrityError on every read path, before its last bytes are handed out.
"""

from __future__ import annotations

import errno
import io
import numbers
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal, NoReturn, TextIO, overload

from durable._checksum import Checksum, crc_to_hex
from durable._checksum import crc32c as crc32c_of
from durable._error_document import ERROR_DOC_LIMIT, error_document, refuse_error_document
from durable._errors import IncompleteError, IntegrityError
from durable._nesting import levels, nearest_marked
from durable._protocol import META_RECORD_FOLLOWS, Layout, Marker, ObjectRecord, State
from durable.adapters import Adapter, ObjectInfo, resolve
from durable.adapters._ranged import seek_position

__all__ = ["error_document", "find_record", "open_verified", "read_verified"]

@dataclass(frozen=True)
class Recorded:
    """The record an object is checked against, and the entry that holds it."""

    record: ObjectRecord
    entry: str


def own_record(adapter: Adapter, path: str, info: ObjectInfo | None) -> Recorded | None:
    """The record the object carries in its own metadata (as ``info`` read it), if any;
    MarkerError naming the object if that record cannot be trusted."""
    url = adapter.url(path)
    marker = Marker.from_metadata(info.record if info is not None else None, url)
    if marker is None:
        return None
    assert marker.manifest is not None
    return Recorded(marker.manifest.objects[""], url)


def find_record(adapter: Adapter, path: str, info: ObjectInfo | None = None, *,
                stat_taken: bool = False) -> Recorded | None:
    """The record of ``path``: the one in its own metadata, else its commit marker as a
    single-object entry, else its line in the manifest of the nearest enclosing entry
    (`nearest_marked`).

    ``info``: a stat (or GET) of the object just taken, its metadata included
    (``stat_taken``: that stat was taken, and None means absent); without one, adapters
    that keep records in metadata stat the object first.
    """
    path = path.rstrip("/")
    if info is None and not stat_taken and adapter.capabilities.object_records:
        info = adapter.info(path)
    own = own_record(adapter, path, info)
    if own is not None:
        # Precedence: a marker beside (or a manifest around) the object is superseded.
        return own
    found = nearest_marked(adapter, path)
    if found is None:
        return None
    entry, marker, key = found
    assert marker.manifest is not None
    if marker.kind == "object":
        return Recorded(marker.manifest.objects[""], entry.url) if not key else None
    rec = marker.manifest.objects.get(key)
    if rec is None:
        if key == "":
            return None
        if info is None and (stat_taken or adapter.info(path) is None):
            # Neither there nor committed: not found, as through durable:: and on any file
            # system. An IntegrityError (an OSError) went past `except FileNotFoundError`
            # around a probe for an optional file of a checkpoint.
            raise FileNotFoundError(errno.ENOENT, "no such object, and none in the "
                                    f"manifest of the committed entry {entry.url}",
                                    adapter.url(path))
        raise IntegrityError(
            f"{adapter.url(path)} is not in the manifest of the committed entry "
            f"{entry.url}: not part of what was committed", url=adapter.url(path),
            expected="an object listed in the manifest", found="an unlisted object")
    return Recorded(rec, entry.url)


# Who gave the size and CRC32C an object is checked against, as messages say it: with no
# record, "recorded with 12 bytes" sent the reader looking for one that is not there.
_SIZE_SAID = {"record": "recorded with", "caller": "expected_size says"}
_CRC_SAID = {"record": "the record says", "caller": "expected_crc32c says"}


def _expected(adapter: Adapter, path: str, size: int | None, crc32c: int | None,
              require_record: bool, info: ObjectInfo | None = None, *,
              stat_taken: bool = False,
              body: BinaryIO | None = None
              ) -> tuple[int | None, int | None, str, int | None]:
    """What the object is checked against, and who says so ("record" or "caller", for
    messages): its record (``info``, ``stat_taken``: as
    `find_record` takes them; ``body``: a reader of ``info``'s version, if one is open),
    and the size and CRC32C the caller gives, which add to the record's checks and never
    stand in for them (a recorded CRC32C skipped for a given size let a same-size
    corruption through). Given values the record contradicts: IntegrityError."""
    url = adapter.url(path)
    given_values: tuple[tuple[str, object], ...] = (("expected_size", size),
                                                    ("expected_crc32c", crc32c))
    for name, value in given_values:  # typed int, but callers pass what they have
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, numbers.Integral)
                                  or not 0 <= int(value) < (2**63 if name == "expected_size"
                                                            else 2**32)):
            raise ValueError(f"{url}: {name} must be a non-negative int"
                             + (" below 2**32 (the CRC32C as a number, e.g. "
                                "int('9a71bb4c', 16))" if name == "expected_crc32c" else "")
                             + f", got {value!r:.40}")
    given = size is not None or crc32c is not None
    found = find_record(adapter, path, info, stat_taken=stat_taken)
    if found is None:
        if require_record and not given:
            if stat_taken:
                _unrecorded(adapter, path, info, body)
            # The stat and a reader of that version together: a stat, then an open, raced
            # a writer replacing the object ("replaced since it was listed").
            opened = adapter.open_whole(path)
            try:
                _unrecorded(adapter, path, *(opened or (None, None)))
            finally:
                if opened is not None:
                    opened[1].close()
        # No record: "recorded with N bytes" would send the reader looking for one.
        return size, crc32c, "caller", None
    rec = found.record
    for what, want, have in (("size", size, rec.size), ("CRC32C", crc32c, rec.crc32c)):
        if want is not None and want != have:
            shown = crc_to_hex if what == "CRC32C" else str
            raise IntegrityError(
                f"{url}: the caller expected {what} {shown(want)}, the object's record "
                f"(in {found.entry}) says {shown(have)}", url=url, expected=shown(want),
                found=shown(have))
    return rec.size, rec.crc32c, "record", rec.tail


def expected_of(adapter: Adapter, path: str) -> tuple[int | None, int | None, int | None]:
    """(size, CRC32C, tail) the object's record gives (`ObjectRecord`; the tail where it
    keeps one), (None, None, None) where it has none."""
    size, crc, _, tail = _expected(adapter, path, None, None, False)
    return size, crc, tail


def _check_tail(url: str, tail: int | None, ending: bytes | bytearray) -> None:
    """IntegrityError where the record keeps a tail (`ObjectRecord.tail`: the object's
    CRC32C is the residue) and the object ends otherwise: another chunk of its size, which
    the CRC32C and the codec's own check both take for the recorded one."""
    if tail is not None and bytes(ending[-4:]) != tail.to_bytes(4, "big"):
        raise IntegrityError(
            f"{url}: ends with {bytes(ending[-4:]).hex()}, the record says "
            f"{crc_to_hex(tail)} (its CRC32C is the codec's residue either way: another "
            "chunk of the same size, not the committed one)", url=url,
            expected=crc_to_hex(tail), found=bytes(ending[-4:]).hex())


def missing_error(adapter: Adapter, path: str, url: str, size: int | None,
                  said: str = "record") -> OSError:
    """The error for an object `info` did not find, saying what is there instead where
    the adapter can tell: a symlink (never followed: it could point anywhere) was "not
    found", or "a directory", while the name was there."""
    what = adapter.not_an_object(path)
    if size is not None:
        found = "missing" if what is None else f"{what} is there, not an object"
        return IntegrityError(f"{url}: {_SIZE_SAID[said]} {size} bytes but {found}",
                              url=url, expected=size, found=what or "missing")
    if what is None:
        return FileNotFoundError(errno.ENOENT, "no such object", url)
    if what == "a directory":
        return IsADirectoryError(errno.EISDIR, "a directory, not an object", url)
    return FileNotFoundError(errno.ENOENT, f"{what}, not an object: durable never reads "
                             "through a symlink or from a special file (it could be "
                             "anything, anywhere); read its target", url)


def _unrecorded(adapter: Adapter, path: str, info: ObjectInfo | None,
                body: BinaryIO | None) -> NoReturn:
    """Why an object no record covers cannot be read: it is not there (FileNotFoundError),
    it is an error page served in its place (IntegrityError), or it is unrecorded
    (IncompleteError). Only this failure path costs the stat or read it takes."""
    url = adapter.url(path)
    if info is None:
        what = adapter.not_an_object(path)
        if what is not None and what != "a directory":
            raise missing_error(adapter, path, url, None)
        if adapter.exists(path):
            # Objects below it: an entry or a folder, which has no bytes of its own.
            raise IsADirectoryError(errno.EISDIR, "a directory (or prefix), not an object: "
                                    "read one of its objects, or check it whole with "
                                    "durable.Entry(url).verify()", url)
        raise FileNotFoundError(errno.ENOENT, "no such object", url)
    if 0 < info.size <= ERROR_DOC_LIMIT:
        f = body if body is not None else adapter.open_read(path, info)
        try:
            refuse_error_document(url, f.read(ERROR_DOC_LIMIT + 1))
        finally:
            if body is None:
                f.close()
    if info.record is not None and META_RECORD_FOLLOWS in info.record:
        # Published before its record by a durable writer: "adopt it" was advice to call
        # bytes nothing checked after their upload (a kill between the two) whole.
        raise IncompleteError(
            f"{url}: published by a durable writer whose commit record never followed (it "
            "was killed between publishing the object and writing its marker, or is between "
            "the two right now): nothing vouches for these bytes. Write it again, or delete "
            "it; adopt it with Entry.mark_complete() only if you know its writer checked it",
            url=url, state=State.INCOMPLETE)
    started = _started_above(adapter, path)
    if started is not None:
        # A reader while the writer works (or after it was killed): "adopt it with
        # Entry.mark_complete()" was advice to call a partial checkpoint whole.
        raise IncompleteError(
            f"{url}: it is in {started}, which a durable writer started and has not "
            "committed (INCOMPLETE: at work, or killed): nothing vouches for it yet; read "
            "it once that entry is COMPLETE (durable.Entry(url).state())", url=url,
            state=State.INCOMPLETE)
    raise IncompleteError(
        f"{url}: no commit record covers this object, so there is nothing to verify it "
        "against (write it with durable.atomic_write or Entry.writing(), adopt it with "
        "Entry.mark_complete(), or pass expected_size=/expected_crc32c=)", url=url,
        state=State.INCOMPLETE)


def _started_above(adapter: Adapter, path: str) -> str | None:
    """The URL of the nearest folder above ``path`` that a durable writer started on and
    has not committed (its attempt records are there); None if none. A listing per
    folder, on this failure path only."""
    for folder, key in levels(path):
        if key and adapter.list(Layout(folder).attempts):
            return adapter.url(folder)
    return None


def read_verified(url: str, *, storage_options: dict[str, Any] | None = None,
                  expected_size: int | None = None, expected_crc32c: int | None = None,
                  require_record: bool = True) -> bytes:
    """The whole object, only if its length and CRC32C match the record.

    The record is the one in the object's own metadata, else its commit marker (or its
    entry's manifest); ``expected_size``/``expected_crc32c`` are checked too (against the
    record where there is one: IntegrityError if it says otherwise), and stand for the
    record where there is none. Without either: IncompleteError, unless
    ``require_record=False``, in which case only the length
    the store declares is checked against the bytes that arrive. Without a CRC32C to check,
    an object store's error document served as the object (`error_document`) is an
    IntegrityError, never data. No object at all: FileNotFoundError naming the URL.

    A record kept beside the object (a marker) is read before the object: bytes that do
    not match it are read again while a writer is found to have replaced both meanwhile
    (the record changed), up to 3 times, and only bytes matching an unchanged record are
    called corrupt.
    """
    adapter, path = resolve(url, storage_options)
    for attempt in range(1, READ_ATTEMPTS + 1):
        beside: list[tuple[int | None, int | None, int | None]] = []
        try:
            return _read_verified(adapter, path, expected_size, expected_crc32c,
                                  require_record, beside)
        except IntegrityError as exc:
            # atomic_write over a "latest" pointer on a local disk: the old marker read, the
            # new bytes opened, reported as "(corrupt data)". A record that changed since
            # is that replacement; one that did not, the damage the error names.
            now = _record_now(adapter, path) if beside else None
            if now is None or now == beside[0]:
                raise
            if attempt == READ_ATTEMPTS:
                where = adapter.url(path)
                raise IntegrityError(
                    f"{where}: replaced while it was read, {READ_ATTEMPTS} times (its record "
                    "changed each time: a writer is replacing it); read it again", url=where,
                    expected="one version of the object and its record",
                    found="a new version at every read") from exc
    raise AssertionError("unreachable")  # pragma: no cover


#: How many times read_verified reads an object whose record changed under the read.
READ_ATTEMPTS = 3
#: The most a VerifiedReader takes from the store in one read.
_BLOCK = 8 * 1024 * 1024


def _record_now(adapter: Adapter, path: str
                ) -> tuple[int | None, int | None, int | None] | None:
    """(size, CRC32C, tail) of the object's record as it is now (all None: no record);
    None where it cannot be read, which shows no replacement: the original error stands."""
    try:
        return expected_of(adapter, path)
    except (OSError, ValueError):
        return None


def _read_verified(adapter: Adapter, path: str, expected_size: int | None,
                   expected_crc32c: int | None, require_record: bool,
                   beside: list[tuple[int | None, int | None, int | None]]) -> bytes:
    """One read of `read_verified`; ``beside`` gets the record it checked against, if that
    record was read apart from the object (a marker or a manifest)."""
    where = adapter.url(path)
    # One GET first where the store keeps records in metadata (S3): its headers carry the
    # object's size and record; only an object without one costs the marker reads. Other
    # stores: the record first, so that nothing is opened on a marker's word unchecked.
    first = adapter.capabilities.object_records
    opened = adapter.open_whole(path) if first else None
    try:
        size, crc, said, tail = _expected(adapter, path, expected_size, expected_crc32c,
                                          require_record,
                              opened[0] if opened is not None else None, stat_taken=first,
                              body=opened[1] if opened is not None else None)
        if not first:
            if said == "record":
                beside.append((size, crc, tail))
            opened = adapter.open_whole(path)
        if opened is None:
            raise missing_error(adapter, path, where, size, said)
        info, f = opened
        if size is not None and info.size != size:
            # Refused before the body is taken in: no short, long or error body is read.
            raise IntegrityError(f"{where}: {_SIZE_SAID[said]} {size} bytes, the store says "
                                 f"{info.size}", url=where, expected=size, found=info.size)
        # The reader hands out exactly info.size bytes or raises (a short body).
        data = f.read()
    finally:
        if opened is not None:
            opened[1].close()
    if size is not None and len(data) != size:
        raise IntegrityError(f"{where}: {_SIZE_SAID[said]} {size} bytes, the store has "
                             f"{len(data)}", url=where, expected=size, found=len(data))
    got = crc32c_of(data)
    if crc is not None and got != crc:
        raise IntegrityError(f"{where}: CRC32C {crc_to_hex(got)}, "
                             f"{_CRC_SAID[said]} {crc_to_hex(crc)} (corrupt data)", url=where,
                             expected=crc_to_hex(crc), found=crc_to_hex(got))
    _check_tail(where, tail, data)
    if crc is None:
        # Nothing recorded to catch an error page served as the object (no CRC32C).
        refuse_error_document(where, data)
    return data


@overload
def open_verified(url: str, mode: Literal["rb"] = "rb", *,
                  storage_options: dict[str, Any] | None = None,
                  expected_size: int | None = None, expected_crc32c: int | None = None,
                  require_record: bool = True, encoding: None = None,
                  errors: None = None, newline: None = None) -> BinaryIO: ...


@overload
def open_verified(url: str, mode: Literal["r", "rt"], *,
                  storage_options: dict[str, Any] | None = None,
                  expected_size: int | None = None, expected_crc32c: int | None = None,
                  require_record: bool = True, encoding: str | None = None,
                  errors: str | None = None, newline: str | None = None) -> TextIO: ...


def open_verified(url: str, mode: str = "rb", *,
                  storage_options: dict[str, Any] | None = None,
                  expected_size: int | None = None, expected_crc32c: int | None = None,
                  require_record: bool = True, encoding: str | None = None,
                  errors: str | None = None, newline: str | None = None
                  ) -> BinaryIO | TextIO:
    """A read-only file that raises IntegrityError instead of returning wrong bytes.

    ``mode``: ``"rb"`` (bytes), or ``"r"``/``"rt"`` (text, decoded with ``encoding``,
    ``errors`` and ``newline`` as `open` takes them, as `atomic_write` writes it with
    ``"w"``), checked the same way underneath.

    Every read is checked against the recorded length (a short body raises, it is never
    taken for end of file). Read front to back, the CRC32C is checked as the bytes pass
    and a mismatch raises on the read that reaches the end, withholding that read's bytes.
    On the first seek away from sequential order (torch.load and zip readers jump to the
    end first), the whole object is checked once before any byte is returned. Without a
    CRC32C, an object of at most 64 KiB is checked the same way for being an error document
    (`error_document`): at its last byte when read in order, whole at the first seek away.
    """
    if mode not in ("rb", "r", "rt"):
        raise ValueError(f"open_verified reads: mode must be 'rb', 'r' or 'rt', got {mode!r}")
    if mode == "rb":
        if encoding is not None or errors is not None or newline is not None:
            raise ValueError("open_verified: encoding, errors and newline are for text "
                             "mode ('r'), not 'rb'")
        return _open_verified(url, storage_options, expected_size, expected_crc32c,
                              require_record)
    # Text, as open(url, "r") gives it: "r" handed out bytes, and a vocabulary written
    # with atomic_write(url, "w") came back as b"word\n" lines that no str key matched.
    return io.TextIOWrapper(_open_verified(url, storage_options, expected_size,
                                           expected_crc32c, require_record),
                            encoding=encoding, errors=errors, newline=newline)


def _open_verified(url: str, storage_options: dict[str, Any] | None,
                   expected_size: int | None, expected_crc32c: int | None,
                   require_record: bool) -> BinaryIO:
    """`open_verified` in binary mode."""
    adapter, path = resolve(url, storage_options)
    for attempt in range(1, READ_ATTEMPTS + 1):
        info = adapter.info(path)  # carries the object's own record, where it has one
        try:
            size, crc, said, tail = _expected(adapter, path, expected_size, expected_crc32c,
                                              require_record, info, stat_taken=True)
            return open_verified_path(adapter, path, size, crc, info=info, stat_taken=True,
                                      said=said, tail=tail)
        except IntegrityError:
            # Nothing handed out yet. A writer replaced the object (atomic_write over a
            # "latest" pointer) between its stat and its open, or its record read between:
            # "replaced since it was listed" for a read that listed nothing. Again, anew.
            if attempt == READ_ATTEMPTS or not replaced_since(adapter, path, info):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def replaced_since(adapter: Adapter, path: str, info: ObjectInfo | None) -> bool:
    """Whether the object at ``path`` is now another version than the stat ``info``: a
    writer replaced it since (which a read may try again), not damage."""
    if info is None or info.version is None:
        return False
    try:
        now = adapter.info(path)
    except (OSError, ValueError):
        return False  # cannot tell: no replacement shown, the original error stands
    return now is not None and now.version != info.version


def open_verified_path(adapter: Adapter, path: str, size: int | None,
                       crc32c: int | None, *, info: ObjectInfo | None = None,
                       stat_taken: bool = False, said: str = "record",
                       tail: int | None = None) -> BinaryIO:
    url = adapter.url(path)
    if not stat_taken:
        info = adapter.info(path)
    if info is None:
        raise missing_error(adapter, path, url, size, said)
    if size is not None and info.size != size:
        raise IntegrityError(f"{url}: {_SIZE_SAID[said]} {size} bytes, the store says {info.size}",
                             url=url, expected=size, found=info.size)
    raw = VerifiedReader(adapter, path, info, crc32c, said=said, tail=tail)
    return io.BufferedReader(raw, buffer_size=1024 * 1024)


class VerifiedReader(io.RawIOBase):
    """Reads one pinned object version and refuses short, long or corrupt bytes."""

    def __init__(self, adapter: Adapter, path: str, info: ObjectInfo,
                 crc32c: int | None, *, said: str = "record",
                 tail: int | None = None) -> None:
        super().__init__()
        self._said = said
        self._tail = tail  # the record's, where the CRC32C is the residue
        self._ending = b""  # the last 4 bytes of [0, _seq.size)
        self._adapter = adapter
        self._path = path
        self._url = adapter.url(path)
        self._info = info
        self._size = info.size
        self._crc = crc32c
        self._f = adapter.open_read(path, info)
        self._pos = 0
        self._seq = Checksum()  # CRC of bytes [0, _seq.size) read in order
        # No CRC32C to catch an error page served as the object: a small object's bytes
        # are kept as they are read in order and looked at before the last ones go out.
        self._sniff = crc32c is None and 0 < self._size <= ERROR_DOC_LIMIT
        self._head = bytearray()
        self._verified = crc32c is None and not self._sniff

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = seek_position(offset, whence, self._pos, self._size)
        if pos != self._pos and not self._verified and pos != self._seq.size:
            self._verify_whole()
        self._f.seek(pos)
        self._pos = pos
        return pos

    def check_whole(self) -> None:
        """Check the whole object now, before any more bytes are handed out (once)."""
        if not self._verified:
            self._verify_whole()

    def _verify_whole(self) -> None:
        ck = Checksum()
        head = bytearray()
        ending = b""
        with self._adapter.open_read(self._path, self._info) as f:
            while block := f.read(8 * 1024 * 1024):
                ck.update(block)
                ending = (ending + block[-4:])[-4:]
                if self._sniff:
                    head += block
        self._check(ck, head, ending)
        self._verified = True

    def _check(self, ck: Checksum, head: bytearray, ending: bytes) -> None:
        if ck.size != self._size:
            raise IntegrityError(
                f"{self._url}: {ck.size} bytes arrived, {self._size} expected (a short or "
                "truncated body)", url=self._url, expected=self._size, found=ck.size)
        if self._crc is not None and ck.crc != self._crc:
            raise IntegrityError(
                f"{self._url}: CRC32C {crc_to_hex(ck.crc)}, {_CRC_SAID[self._said]} "
                f"{crc_to_hex(self._crc)} (corrupt data)", url=self._url,
                expected=crc_to_hex(self._crc), found=crc_to_hex(ck.crc))
        _check_tail(self._url, self._tail, ending)
        if self._sniff:
            refuse_error_document(self._url, head)

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), max(0, self._size - self._pos))
        if want == 0:
            # At the recorded end: a store with more bytes than recorded is not whole.
            if self._pos == self._size and self._f.read(1):
                raise IntegrityError(f"{self._url}: longer than the {self._size} bytes "
                                     "recorded", url=self._url, expected=self._size,
                                     found=f"more than {self._size}")
            return 0
        view = memoryview(buffer).cast("B")[:want]
        got = 0
        while got < want:
            # In blocks: a read of the whole object (durable::'s cat_file, a caller's
            # f.read(n) of 1 GiB) took it in as one chunk and copied it here, twice its size.
            chunk = self._f.read(min(want - got, _BLOCK))
            if not chunk:
                raise IntegrityError(
                    f"{self._url}: body ended at byte {self._pos + got} of {self._size} "
                    "(short read: shorter than its declared length)", url=self._url,
                    expected=self._size, found=self._pos + got)
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
        self._passed(view, got)
        return got

    def _passed(self, view: memoryview, got: int) -> None:
        """``view[:got]``, the next bytes from ``_pos``, checked before they go out."""
        if not self._verified and self._pos == self._seq.size:
            self._seq.update(view[:got])
            self._ending = (self._ending + bytes(view[max(0, got - 4):got]))[-4:]
            if self._sniff:
                self._head += view[:got]
            if self._seq.size == self._size:
                # Raises before these go out.
                self._check(self._seq, self._head, self._ending)
                self._verified = True
        self._pos += got

    def readall(self) -> bytes:
        """The rest of the object in one read of the store's file, checked as `readinto`
        checks it and handed out as read: `io.RawIOBase.readall` read 8 KiB at a time into
        a growing bytearray, then copied it (``open_verified(url).read()`` of 1 GiB on a
        local disk: 30 s and 2.1 GB; now 1.1 GB, the bytes once)."""
        want = max(0, self._size - self._pos)
        data = self._f.read(want) if want else b""
        if len(data) != want:
            raise IntegrityError(
                f"{self._url}: body ended at byte {self._pos + len(data)} of {self._size} "
                "(short read: shorter than its declared length)", url=self._url,
                expected=self._size, found=self._pos + len(data))
        with memoryview(data) as view:
            self._passed(view, want)  # raises before the bytes go out
        self.readinto(bytearray())  # at the end: bytes past the recorded size are refused
        return data

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()
