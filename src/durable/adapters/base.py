"""The one small base every store adapter implements.

An adapter turns a store's primitives into the few operations the protocol needs: write a
whole object or nothing (optionally create-only), make what was written durable, stat, list,
read pinned to a version, delete. Everything else (markers, manifests, states, verified
reads) is built once, in the core, on top of these.
"""

from __future__ import annotations

import contextlib
import functools
import io
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, BinaryIO, ClassVar, Literal

from durable._checksum import Checksum, crc32c, crc_to_hex
from durable._error_document import ERROR_DOC_LIMIT, refuse_written_error_document
from durable._errors import IntegrityError, UnsupportedError

__all__ = ["Adapter", "AtomicFile", "Capabilities", "ObjectInfo", "Upload", "VerifyLevel",
           "VersionMismatchError", "strong_etag"]

VerifyLevel = Literal["none", "size", "probe", "full"]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a stat or a listing says of one object.

    ``version`` is whatever pins a read to this exact object (an ETag, a generation, a
    local inode and mtime); None where the store has nothing usable.
    """

    path: str
    size: int
    version: str | None = None
    modified: float | None = field(default=None, compare=False)
    """When the store last wrote the object (POSIX seconds by the store's clock); None if
    the adapter does not say. Used for ages (`durable scan`, `durable clean`), never to
    pin a read."""
    record: Mapping[str, str] | None = field(default=None, compare=False)
    """The ``durable-*`` fields of the object's own metadata (`durable._protocol.
    record_fields`), where the adapter read them (a stat or a GET of an adapter with
    ``Capabilities.object_records``); None where it did not (a listing, other adapters).
    Raw: the core parses them (`Marker.from_metadata`), so a hostile record is refused
    there, naming the object, and never breaks a stat."""


@dataclass(frozen=True, slots=True)
class Upload:
    """An upload the store keeps open until it is completed or aborted (an S3 multipart
    upload): a writer killed mid-upload leaves one, holding storage but no object."""

    path: str
    upload_id: str
    initiated: float | None
    """POSIX seconds by the store's clock; None if the store does not say."""
    checksum: str | None = None
    """The checksum algorithm the upload was started with, as the store lists it."""
    ours: bool | None = None
    """Whether a durable writer started it, where the adapter can tell (Azure: by its block
    IDs); None: `durable clean` judges by ``checksum`` (S3)."""


@dataclass(frozen=True)
class Capabilities:
    """What an adapter guarantees; `docs/guarantees.md` has the table, per backend."""

    atomic_objects: bool
    """An object written through `open_atomic` appears whole or not at all."""
    create_only: bool
    """`create_only=True` is enforced by the store (exactly one of racing writers wins)."""
    durable: bool
    """Committed data survives a crash of the machine (fsync, or a store's own durability)."""
    pinned_reads: bool
    """Reads can be pinned to the version seen at open (a replaced object is an error)."""
    note: str = ""
    conditional_writes: bool = False
    """`replace_if`/`delete_if` are enforced by the store: of writers racing on one
    version, exactly one succeeds (what leases are fenced with)."""
    object_records: bool = False
    """A single object published by one request can carry its durable record in its own
    metadata (`AtomicFile.carries_record`), and stats return it (`ObjectInfo.record`)."""
    in_process: bool = False
    """Every call is served in this process with no network round trip (a local disk,
    memory): a look that overlaps work with a thread only adds a hand-off, and an answer
    seen a moment ago is no cheaper to keep than to ask for again."""


class VersionMismatchError(OSError):
    """A conditional write or delete found the object at another version (or gone)."""

    def __init__(self, message: str, *, url: str, expected: str, found: str | None) -> None:
        super().__init__(message)
        self.url = url
        self.expected = expected
        self.found = found

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class AtomicFile(io.RawIOBase):
    """A write-only file whose bytes become the target only at `commit`.

    Subclasses implement `_write`, `_commit` and `_abort`; this class counts size and CRC32C
    as bytes pass, and makes leaving a ``with`` block by any exception (KeyboardInterrupt
    included) abort rather than publish.
    """

    #: fsspec semantics (close() publishes) for files handed to code that expects them;
    #: otherwise close() without commit() aborts. Either way, leaving a ``with`` block by an
    #: exception aborts, and so does garbage collection of a file never closed.
    commit_on_close: bool = False

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.checksum = Checksum()
        self.info: ObjectInfo | None = None
        self.on_commit: Callable[[AtomicFile], None] | None = None
        #: Called once the garbage collector aborted the file (dropped without close()).
        self.on_drop: Callable[[AtomicFile], None] | None = None
        #: Durable record fields for the object's own metadata, given to `commit`.
        self.record: Mapping[str, str] | None = None
        #: Set (before the first write) by a writer that records the object with a marker
        #: after it when it cannot carry its record: an adapter that publishes it without
        #: one (an S3 multipart upload) marks it so (`durable._protocol.META_RECORD_FOLLOWS`).
        self.record_follows = False
        #: (the object's URL, how to allow it): `commit` refuses bytes that are an object
        #: store's error document (`refuse_error_documents`); None: no such check.
        self.error_document_check: tuple[str, str] | None = None
        self._head = bytearray()  # the first bytes, kept while the check may need them
        self._done = False

    # io.RawIOBase plumbing ---------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._done:
            if self.info is None:
                # Aborted: a wrapper flushing its buffer on the way out publishes nothing.
                return view.nbytes
            raise ValueError(f"{self.path}: write to an atomic file already committed")
        if self.error_document_check is not None and self.checksum.size <= ERROR_DOC_LIMIT:
            self._head += view[:ERROR_DOC_LIMIT + 1 - self.checksum.size]
        self.checksum.update(view)
        self._write(view)
        return view.nbytes

    def refuse_error_documents(self, url: str, how_to_allow: str) -> None:
        """Have `commit` refuse (IntegrityError, nothing published) bytes that are an object
        store's error document: a 403 page a failed download handed over as the file
        (incident 003) would otherwise be recorded, and every verified read of it would
        return the page as data. Called before the first write."""
        self.error_document_check = (url, how_to_allow)

    @property
    def done(self) -> bool:
        """Committed or aborted: nothing more goes into the store through this file."""
        return self._done

    @property
    def carries_record(self) -> bool:
        """Whether `commit` will publish ``record`` in the object's own metadata, in the
        same request as its bytes (asked once every byte is written). False here: the
        caller writes a sidecar marker after the commit instead."""
        return False

    def commit(self, *, record: Mapping[str, str] | None = None) -> ObjectInfo:
        """Publish the object whole; after this it is visible and (per adapter) durable.

        ``record``: durable record fields (`Marker.to_metadata`) to publish with the bytes
        where `carries_record`; the returned info's ``record`` is then what was stored,
        and None where nothing was (the caller's cue to write a sidecar marker).
        """
        if self._done:
            if self.info is None:
                raise ValueError(f"{self.path}: atomic file was aborted")
            return self.info
        if self.error_document_check is not None and self.checksum.size <= ERROR_DOC_LIMIT:
            try:
                url, how_to_allow = self.error_document_check
                refuse_written_error_document(url, self._head, how_to_allow)
            except IntegrityError:
                self.abort()
                raise
        self._done = True
        self.record = record if self.carries_record else None
        try:
            self.info = self._commit()
        except BaseException:
            self._abort()
            raise
        finally:
            super().close()
        if self.on_commit is not None:
            self.on_commit(self)
        return self.info

    def abort(self) -> None:
        """Drop everything written; the target is left as it was."""
        if self._done:
            return
        self._done = True
        try:
            self._abort()
        finally:
            super().close()

    def prepare(self) -> None:
        """Make the bytes written so far durable now, ahead of `commit` (which then only
        publishes them); nothing is written after. A no-op where the store makes an object
        durable as it publishes it."""

    def tell(self) -> int:
        return self.checksum.size

    def close(self) -> None:
        if not self._done:
            if self.commit_on_close:
                self.commit()
            else:
                self.abort()

    def __del__(self) -> None:
        # Never publish from the garbage collector: a file dropped without close() is a
        # writer that died part-way (s3fs commits in that case; we do not).
        if not getattr(self, "_done", True):
            self.abort()
            if self.on_drop is not None:
                self.on_drop(self)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    @abstractmethod
    def _write(self, data: memoryview) -> None: ...

    @abstractmethod
    def _commit(self) -> ObjectInfo: ...

    @abstractmethod
    def _abort(self) -> None: ...


class Staged:
    """A put made ready by `Adapter.stage`: `publish` it, or `discard` it (a no-op once
    published; a staged temp file is removed, the target left as it was)."""

    def __init__(self, publish: Callable[[], ObjectInfo],
                 discard: Callable[[], None] | None = None) -> None:
        self.publish = publish
        self.discard = discard if discard is not None else (lambda: None)


class Adapter(ABC):
    """Base of the adapters: one instance per fsspec filesystem object.

    Paths are as the filesystem spells them (no protocol), as `fsspec.core.url_to_fs`
    returns them.
    """

    protocols: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[Capabilities]
    #: The scheme the caller's URLs use where the filesystem names itself otherwise
    #: (``az://`` for adlfs, whose own is ``abfs``); None: the filesystem's own.
    #: Set by `durable.adapters.adapter_for_fs`.
    scheme: str | None = None

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    @property
    def name(self) -> str:
        return type(self).__name__.removesuffix("Adapter").lower()

    def url(self, path: str) -> str:
        """A URL for messages and for reopening: the path with the caller's scheme (the
        filesystem's first protocol where the caller named none other)."""
        url = str(self.fs.unstrip_protocol(path))
        if self.scheme is None:
            return url
        # adlfs spells every URL abfs://: a user of az:// was shown names they never wrote.
        return f"{self.scheme}://{url.partition('://')[2]}"

    # writing ------------------------------------------------------------------------------
    @abstractmethod
    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        """A file that publishes ``path`` whole at commit, or leaves it untouched.

        ``create_only``: fail with FileExistsError if ``path`` exists at commit.
        ``durable=False``: skip per-object durability; the caller makes a batch durable
        later with `sync` (an entry commit does, once for all its objects).
        """

    def put(self, path: str, data: bytes, *, create_only: bool = False,
            durable: bool = True) -> ObjectInfo:
        with self.open_atomic(path, create_only=create_only, durable=durable) as f:
            f.write(data)
        assert f.info is not None
        return f.info

    def stage(self, path: str, data: bytes, *, create_only: bool = False) -> Staged:
        """A `put` made ready now and published later (a commit marker, prepared while the
        entry's data is still being made durable). Where making bytes durable is a step of
        its own (a local disk's fsync) it is taken here, so the publish is only the rename
        and the directory's fsync; elsewhere the publish is the whole `put`."""
        return Staged(functools.partial(self.put, path, data, create_only=create_only))

    def sync(self, paths: Iterable[str], dirs: Iterable[str] = ()) -> None:  # noqa: B027
        """Make objects written with ``durable=False`` durable; a no-op where puts are."""

    def sync_soon(self, paths: Iterable[str]) -> list[Future[None]]:
        """Start making the bytes of finished objects written with ``durable=False``
        durable, in the background, beside the writes still to come: the futures of that
        work ([] where puts are durable). Their names are not: `sync` of their directories
        does that, once every name is in place."""
        return []

    # reading ------------------------------------------------------------------------------
    @abstractmethod
    def info(self, path: str) -> ObjectInfo | None:
        """Stat one object; None if it does not exist (a prefix is not an object)."""

    @abstractmethod
    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every object below ``prefix``, keyed by path relative to it; {} if none."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """An object at ``path`` or any object below it."""

    @abstractmethod
    def open_read(self, path: str, info: ObjectInfo) -> BinaryIO:
        """A seekable reader of the object `info` describes; raise if it was replaced."""

    def read_range(self, path: str, info: ObjectInfo, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of the version ``info`` names (fewer only where
        the object ends first): one ranged request where the store serves one, refused
        (IntegrityError) if the object is another version now, never its bytes; a body of
        another length is an IntegrityError too (a short body is never a short read)."""
        want = max(0, min(length, info.size - start))
        with self.open_read(path, info) as f:
            f.seek(start)
            data = f.read(want)
        return exact_range(self.url(path), data, start, want)

    def open_whole(self, path: str) -> tuple[ObjectInfo, BinaryIO] | None:
        """The object's info (``record`` included where the adapter reads it) and a reader
        of that version from byte 0; None if absent. S3 answers both with one GET."""
        info = self.info(path)
        if info is None:
            return None
        return info, self.open_read(path, info)

    def read(self, path: str, *, limit: int | None = None) -> bytes | None:
        """The whole object, or None if absent; over ``limit`` bytes raises ValueError.
        Through `open_whole`: one GET where the store answers info and body together
        (markers are read often)."""
        opened = self.open_whole(path)
        if opened is None:
            return None
        info, f = opened
        with f:
            # Refused before the body is taken in: a hostile size costs no memory.
            if limit is not None and info.size > limit:
                raise ValueError(f"{self.url(path)} is {info.size} bytes, over the limit "
                                 f"of {limit}")
            # Read one byte past the size: a body longer than its stat is caught too.
            return f.read(info.size + 1)

    def read_small(self, path: str, limit: int) -> bytes | None:
        """`read` of a small object whose bytes the caller checks itself (tensorstore's
        open: a marker, a zarr.json): through the adapter's cheapest client, bounded as
        `read` is (over ``limit`` bytes: ValueError, before the body is taken in)."""
        return self.read(path, limit=limit)

    # verifying what was just written -------------------------------------------------------
    #: What `atomic_write` checks after a write when not told: see `verify_written`.
    default_verify: ClassVar[VerifyLevel] = "size"

    def check_parts(self, path: str, checksum: Checksum) -> None:
        """An object an entry's writer just wrote, checked where it was written in parts as
        `atomic_write` checks one by default (incident 002: whole parts lost behind a
        full-size HEAD, which the commit's listing cannot see either). Nothing here: only
        stores that assemble an object from parts can lose one (`S3Adapter`)."""
        return

    def verify_written(self, path: str, checksum: Checksum, level: VerifyLevel) -> None:
        """Check a just-written object against what the writer sent.

        ``"size"``: one stat. ``"probe"``: also read the last byte, and on stores with parts
        the last byte of every part (a whole lost part with a full-size HEAD, incident 002).
        ``"full"``: read everything back and compare the CRC32C.

        An adapter may meet ``"size"`` and ``"probe"`` with what the write's own answer
        proved: on S3, a single PutObject answered with the CRC32C it was sent (the store
        checked it over exactly the bytes it took) needs no request; an answer with another
        CRC32C is an IntegrityError (`S3Adapter.verify_written`).
        """
        if level == "none":
            return
        url = self.url(path)
        info = self.info(path)
        if info is None:
            raise IntegrityError(f"{url}: written but not found afterwards", url=url)
        if info.size != checksum.size:
            raise IntegrityError(f"{url}: wrote {checksum.size} bytes, the store holds "
                                 f"{info.size}", url=url, expected=checksum.size,
                                 found=info.size)
        if level == "probe":
            self.probe(path, info)
        elif level == "full":
            crc, size = 0, 0
            with self.open_read(path, info) as f:
                while block := f.read(8 * 1024 * 1024):
                    crc, size = crc32c(block, crc), size + len(block)
            if (size, crc) != (checksum.size, checksum.crc):
                raise IntegrityError(
                    f"{url}: read back {size} bytes with CRC32C {crc_to_hex(crc)}, wrote "
                    f"{checksum.size} with {crc_to_hex(checksum.crc)}", url=url,
                    expected=(checksum.size, crc_to_hex(checksum.crc)),
                    found=(size, crc_to_hex(crc)))

    def probe(self, path: str, info: ObjectInfo) -> None:
        """Read the object's last byte: an object shorter than its stat fails here."""
        if info.size == 0:
            return
        with self.open_read(path, info) as f:
            f.seek(info.size - 1)
            got = f.read(2)
        if len(got) != 1:
            url = self.url(path)
            raise IntegrityError(f"{url}: stat says {info.size} bytes but byte "
                                 f"{info.size - 1} cannot be read", url=url,
                                 expected=info.size, found=f"{len(got)} bytes at the end")

    def now(self, path: str) -> float | None:
        """The store's own time (POSIX seconds) as it answers a request about ``path``;
        None where the store's clock is this machine's (a local disk) or cannot be read.
        Ages of what the store lists are measured against it, so a client whose clock is
        off cannot make a live writer's leftovers look old."""
        return None

    # uploads left open -------------------------------------------------------------------
    def list_uploads(self, prefix: str) -> Sequence[Upload]:
        """Uploads started below ``prefix`` and neither completed nor aborted; [] on a store
        with no such thing (or where it cannot be listed)."""
        return []

    def abort_upload(self, upload: Upload) -> None:
        """Abort an upload `list_uploads` returned; one already gone is fine."""
        raise UnsupportedError(f"{self.url(upload.path)}: {self.name} lists no uploads to "
                               "abort")

    # conditional writes (leases) -------------------------------------------------------
    def supports_conditional(self, path: str) -> bool:
        """Whether `replace_if`/`delete_if` are enforced where ``path`` lives."""
        return False

    def replace_if(self, path: str, data: bytes, version: str) -> ObjectInfo:
        """Replace ``path`` with ``data`` only if it is still at ``version``.

        VersionMismatchError if it is at another version or gone; of writers racing on one
        version, exactly one succeeds. Not durable on its own (leases need no fsync).
        """
        raise UnsupportedError(f"{self.url(path)}: the {self.name} adapter has no "
                               "conditional writes (compare-and-swap on a version)")

    def delete_if(self, path: str, version: str) -> None:
        """Delete ``path`` only if it is still at ``version``; VersionMismatchError if not."""
        raise UnsupportedError(f"{self.url(path)}: the {self.name} adapter has no "
                               "conditional deletes")

    @contextlib.contextmanager
    def exclusive(self, path: str) -> Iterator[bool]:
        """Hold off every `replace_if`/`delete_if` of ``path`` while the block runs.

        Yields True where the store can promise it (a lock every conditional write takes),
        False where it cannot: the block then races conditional writes of other processes.
        """
        yield False

    def prune(self, prefix: str) -> None:  # noqa: B027
        """Remove directories left empty at and below ``prefix``; a no-op on stores that
        have no directories. Never removes an object."""

    def published_before_record(self, info: ObjectInfo) -> bool:
        """Whether the object, as listed, may have been published before its record
        (`durable._protocol.META_RECORD_FOLLOWS`): `durable clean` stats only those of the
        unmarked objects with no records, to find a writer's killed between the two."""
        return False

    def not_an_object(self, path: str) -> str | None:
        """What is at ``path`` where `info` finds no object, if the adapter can tell
        without a request ("a symlink", "a directory", "a special file" on a local disk),
        for errors that say what was found; None otherwise."""
        return None

    def through_link(self, root: str, key: str) -> bool:
        """Whether ``root/key`` is reached through a link at ``root`` or in a directory of
        ``key`` (a symlink, on a local disk), so that it may name something outside
        ``root``. False on stores that have no links."""
        return False

    def links_in(self, directory: str) -> Sequence[str]:
        """Names of the links directly in ``directory`` (symlinks, on a local disk), which
        listings never show; [] on stores that have no links (no request)."""
        return []

    def links_below(self, directory: str) -> Sequence[str]:
        """Paths, relative to ``directory``, of the links at any depth below it (symlinks,
        on a local disk; none followed), which listings never show; [] on stores that have
        no links (no request)."""
        return []

    # removing -----------------------------------------------------------------------------
    @abstractmethod
    def delete(self, paths: Iterable[str]) -> None:
        """Remove objects; missing ones are ignored."""

    def discard(self, paths: Iterable[str]) -> None:
        """Remove objects whose removal need not survive a crash: a committed attempt's
        records, which a crash can only leave beside the marker for `durable clean`.
        `delete`, except where making a removal durable is a step of its own (a local
        disk's directory fsync), which this skips."""
        self.delete(paths)

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove ``prefix`` and everything below it; missing is fine."""


def exact_range(url: str, data: bytes, start: int, want: int) -> bytes:
    """``data``, if it is the ``want`` bytes asked for from ``start``; else IntegrityError
    (a body that ended early taken for the object's end would shift every value after)."""
    if len(data) != want:
        raise IntegrityError(f"{url}: asked for {want} bytes from byte {start}, {len(data)} "
                             "arrived (a short body)", url=url, expected=want, found=len(data))
    return data


def strong_etag(raw: object, url: str) -> str:
    """An ETag as a quoted strong tag, or IntegrityError naming ``url`` if it cannot pin a
    read (S3 and Azure: properties and upload replies quote it, listings may not).

    An unquoted ETag (some gateways strip the quotes) is quoted again; a weak, empty or
    missing one (a proxy's rewrite) is refused here, with the object named, instead of
    failing later as an opaque error in a conditional request (incident 000's "Malformed
    StorageGeneration") or as a pinned read refused as if the object had been replaced.
    """
    text = raw.strip() if isinstance(raw, str) else ""
    if text.startswith("W/"):
        raise IntegrityError(f"{url}: the store answered a weak ETag {text!r}; a weak tag "
                             "does not promise identical bytes, so reads cannot be pinned to "
                             "it (a proxy transforming the object?)", url=url,
                             expected="a strong ETag", found=text)
    core = text.strip('"')
    if not core:
        raise IntegrityError(f"{url}: the store answered no usable ETag ({raw!r}); reads "
                             "cannot be pinned to a version", url=url,
                             expected="an ETag", found=raw)
    return f'"{core}"'


def caused_by(exc: BaseException, found: Callable[[BaseException], bool]) -> bool:
    """Whether ``exc`` or an exception it was raised from (``__cause__``/``__context__``,
    all the way down) is one ``found`` recognises: cloud SDKs re-raise a transport failure
    (a body cut short, a read timeout) inside errors of their own."""
    seen: BaseException | None = exc
    while seen is not None:
        if found(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def circling(listing: str, twice: str) -> OSError:
    """A listing that named ``twice`` (an object's URL, or a page token) a second time: a
    store whose pages go back or never advance (a continuation token that restarts or
    sticks), which a client following it would list for ever (scan, verify, every
    commit). Never a part of a listing either: an error naming the listing."""
    return OSError(f"{listing}: the listing named {twice} twice: the store's pages go round "
                   "in circles")



def stripped(fs: Any, text: str) -> str:
    """``fs._strip_protocol(text)``, refused (`refuse_renamed`) where that changed the name."""
    path: str = fs._strip_protocol(text)
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if "file" not in protocols:  # a local path is made absolute, never parsed as a URL
        refuse_renamed(text, path, type(fs).__name__)
    return path


def refuse_renamed(text: str, path: str, by: str) -> None:
    """ValueError naming ``text`` where the filesystem ``by`` made ``path`` of it by
    dropping or moving a '?' or '#' of the name: adlfs parses a path as a URL, so "p#"
    became "p" (a write of "p#" replaced the blob "p", a read of it returned "p") and
    "a?b#c" became "a#c?b"."""
    if "?" not in text and "#" not in text:
        return
    # A protocol, a bucket or an account the filesystem spells otherwise may come before
    # the key; the key itself must end the text as given.
    tail = path.rstrip("/")
    key = tail.partition("/")[2]
    given = text.rstrip("/")
    if not (given.endswith("/" + key) or given == key) if key else not given.endswith(tail):
        raise ValueError(f"{text!r}: {by} would take this for the object {path!r} (it "
                         "reads '?' and '#' in a path as a URL's query and fragment); give "
                         "a name without them")
