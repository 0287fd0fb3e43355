"""The commit protocol: states, where an entry's records live, and the marker format.

Everything here is pure: no I/O, no fsspec, no cloud library. `docs/protocol.md` is the
prose version for anyone writing a reader in another language; keep the two in step.

Layout, for an entry at ``PARENT/NAME`` (a directory/prefix, or a single object)::

    PARENT/NAME                          the data, exactly as the user's format lays it out
    PARENT/.durable/NAME/commit.json     the commit marker, written last
    PARENT/.durable/NAME/manifest-<attempt>.json
                                         the manifest, when too large to inline
    PARENT/.durable/NAME/attempts/<attempt>.json
                                         "a writer started", removed after its commit
    PARENT/.durable/NAME/lease.json      the writer lease, kept alive by a heartbeat
    PARENT/.durable/NAME/fragments/<attempt>/...
                                         what other processes of one write recorded

A single object whose publishing request can set its metadata (an S3 PutObject up to the
part size, a GCS upload up to 8 MiB, any Azure blob: Put Blob or Put Block List) carries
its record in its own metadata instead (`Marker.to_metadata`): data and record land
together, and such an object is judged by that record, never by a marker beside it
(docs/protocol.md, "Records in object metadata").

The records sit beside the entry, not inside it: zarr-python warns about every object
inside a group that is not a zarr node, so a marker inside a zarr store would make every
`xarray.open_zarr` of a committed entry warn. The leading dot keeps pyarrow/dask dataset
discovery and globbing of ``*.zarr`` from picking the records up.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import json
import os
import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from durable._checksum import CRC32C_RESIDUE, crc32c, crc_from_hex, crc_to_hex
from durable._error_document import refuse_error_document
from durable._errors import MarkerError, UnsupportedError
from durable._version import __version__

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_MARKER_BYTES",
    "Layout",
    "Manifest",
    "Marker",
    "ObjectRecord",
    "State",
    "Summary",
    "attempt_folders",
    "carries_record",
    "check_key",
    "is_attempt_record",
    "key_text",
    "new_attempt_id",
    "record_fields",
    "written_key",
]

FORMAT = "durable.commit"
FORMAT_VERSION = 1
RECORDS_DIR = ".durable"
MARKER_NAME = "commit.json"
LEASE_NAME = "lease.json"
# A marker is read before anything it says is trusted, so its size is capped: a hostile or
# corrupt marker must not make a reader allocate gigabytes.
MAX_MARKER_BYTES = 4 * 1024 * 1024
MAX_MANIFEST_BYTES = 1024 * 1024 * 1024
# Up to this many objects the manifest is inlined in the marker (one small GET to read).
INLINE_MANIFEST_OBJECTS = 10_000

Kind = Literal["prefix", "object"]

# The record of a single object published by one request travels in that object's own
# metadata (S3 x-amz-meta-*): one PUT commits data and record together. Keys as S3 and GCS
# spell them; an adapter whose store forbids "-" in names maps them (Azure: "_").
META_PREFIX = "durable-"
META_VERSION = "durable-version"
META_SIZE = "durable-size"
META_CRC32C = "durable-crc32c"
META_ATTEMPT = "durable-attempt"
META_COMMITTED_AT = "durable-committed-at"
META_KEYS = (META_VERSION, META_SIZE, META_CRC32C, META_ATTEMPT, META_COMMITTED_AT)
#: Set on an object published before its record (an S3 multipart upload, whose metadata is
#: fixed at its start): `atomic_write` writes a commit marker after it. Found with no
#: marker, the writer died between the two (or is between them now): the object is a
#: durable writer's, not data written before durable, and is never adopted as such.
META_RECORD_FOLLOWS = "durable-record-follows"
# Metadata is read before anything in it is trusted: a hostile value must not make a reader
# parse megabytes or take a 40-digit size for a length.
_META_VALUE_MAX = 64
_DECIMAL = re.compile(r"[0-9]{1,19}")
_MAX_OBJECT_SIZE = 2**63 - 1


def record_fields(metadata: Mapping[str, object] | None) -> dict[str, str]:
    """The ``durable-*`` entries of an object's user metadata (keys lowercased), as an
    adapter puts them in `ObjectInfo.record`."""
    out: dict[str, str] = {}
    for key, value in (metadata or {}).items():
        low = str(key).lower()
        if low.startswith(META_PREFIX):
            out[low] = value if isinstance(value, str) else repr(value)
    return out


def carries_record(fields: Mapping[str, str] | None) -> bool:
    """Whether metadata fields hold a durable record (valid or not): such an object is
    judged by it, never by a sidecar marker, and never deleted as a leftover."""
    return fields is not None and any(k in fields for k in META_KEYS)


class State(enum.Enum):
    """The three states of an entry."""

    ABSENT = "ABSENT"
    """No marker and no object of the entry."""
    INCOMPLETE = "INCOMPLETE"
    """Objects exist, or a writer is at work, but there is no valid marker over whole data."""
    COMPLETE = "COMPLETE"
    """A valid marker exists and the entry's data is still there."""

    def __str__(self) -> str:
        return self.value


def new_attempt_id() -> str:
    return uuid.uuid4().hex


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_HEX_DIGITS = "0123456789abcdef"  # a CRC32C in a record: 8 of these, lowercase


def check_key(key: object, where: str) -> str:
    """Return ``key`` if it is a safe relative key inside an entry, else raise MarkerError.

    A manifest names the objects a reader will open, stat and (on cleanup) delete, so a key
    that could leave the entry (``..``, an absolute path, a backslash, an empty segment) is
    refused here, before any path is built from it.
    """
    if (type(key) is str and "\x00" not in key and "\\" not in key and len(key) <= 4096
            and "//" not in (w := f"/{key}/") and "/./" not in w and "/../" not in w):
        # The common case in one expression (a marker of 10,000 keys checks each): a key
        # wrapped in slashes holds one of those exactly when it has an empty, "." or ".."
        # segment, or starts or ends with "/".
        return key
    if not isinstance(key, str) or not key:
        raise MarkerError(f"{where}: manifest key must be a non-empty string, got {key!r:.80}",
                          url=where)
    if "\x00" in key or "\\" in key or key.startswith("/") or len(key) > 4096:
        raise MarkerError(f"{where}: manifest key {key!r:.80} is not a relative POSIX key",
                          url=where)
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise MarkerError(
                f"{where}: manifest key {key!r:.80} has a {part or 'empty'!r} segment; "
                "keys must stay inside the entry", url=where)
    return key


@overload
def key_text(key: str | os.PathLike[str]) -> str: ...


@overload
def key_text(key: object) -> object: ...


def key_text(key: object) -> object:
    """A key given as a path object (``PurePosixPath("model") / "weights.bin"``, how loaders
    build them) as the text it spells; any other value as it is, for the checks to judge.
    As a path object, ``in`` an `EntryReader` said False for an object the commit holds."""
    return os.fspath(key) if isinstance(key, os.PathLike) else key


def written_key(key: str, url: str) -> str:
    """``key`` (to be written, or adopted from a listing) if an entry can hold it; a
    ValueError naming it otherwise. `check_key`'s MarkerError spoke of a "manifest key"
    and of keeping inside the entry, as for a corrupt marker, to a caller who had only
    written ``a//b``."""
    try:
        return check_key(key, url)
    except MarkerError:
        raise ValueError(f"{url}: {key!r:.200} is not a name an entry can hold: a relative "
                         "path of non-empty segments, none '.' or '..', no backslash"
                         ) from None


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """An object's size and CRC32C; ``tail``: its last 4 bytes (as a big-endian number),
    kept only where its CRC32C is `CRC32C_RESIDUE`.

    Such an object ends with the CRC32C of the bytes before it (a chunk zarr's crc32c codec
    encoded), so its whole CRC32C is that constant, whatever it holds: two such chunks of
    one size (the committed one and a straggler another attempt put over it) had one record.
    Their last 4 bytes are the CRC32C of their contents, and tell them apart.
    """

    size: int
    crc32c: int
    tail: int | None = None

    @classmethod
    def of(cls, size: int, crc: int, ending: bytes | memoryview) -> ObjectRecord:
        """The record of an object of ``size`` bytes and CRC32C ``crc`` that ends with
        ``ending`` (its last bytes: 4 or more, or all of it)."""
        if crc != CRC32C_RESIDUE or size < 4:
            return cls(size, crc)
        return cls(size, crc, int.from_bytes(bytes(ending[-4:]), "big"))

    def matches(self, found: ObjectRecord) -> bool:
        """Whether ``found`` (read from the object) is what this record says; a record
        without a tail says nothing of one."""
        return ((found.size, found.crc32c) == (self.size, self.crc32c)
                and (self.tail is None or found.tail == self.tail))

    def checksum_text(self) -> str:
        """The CRC32C in hex, and the tail where there is one (for messages)."""
        text = crc_to_hex(self.crc32c)
        return text if self.tail is None else f"{text}, ending {crc_to_hex(self.tail)}"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"size": self.size, "crc32c": crc_to_hex(self.crc32c)}
        if self.tail is not None:
            # Optional: a reader that does not know it ignores it (and checks what it did).
            doc["tail"] = crc_to_hex(self.tail)
        return doc

    @classmethod
    def from_json(cls, value: object, where: str, key: str | None = None) -> ObjectRecord:
        """``where [key]`` names the record in messages (formatted only for a bad record:
        a marker of 10,000 records would format 10,000 names)."""
        if (type(value) is dict and len(value) == 2 and type(size := value.get("size")) is int
                and 0 <= size <= _MAX_OBJECT_SIZE and type(crc := value.get("crc32c")) is str
                and len(crc) == 8
                and not crc.strip(_HEX_DIGITS)):
            return cls(size, int(crc, 16))  # the common record, checked in one expression
        if key is not None:
            where = f"{where} [{key}]"
        if not isinstance(value, dict):
            raise MarkerError(f"{where}: object record must be a JSON object", url=where)
        size = value.get("size")
        if (not isinstance(size, int) or isinstance(size, bool)
                or not 0 <= size <= _MAX_OBJECT_SIZE):
            # Beyond any object (as the metadata record's size is refused): a size of 10**500
            # made `durable status` fail formatting it ("unexpected error: OverflowError").
            raise MarkerError(f"{where}: size must be a non-negative integer up to "
                              f"{_MAX_OBJECT_SIZE}, got {size!r:.40}", url=where,
                              expected=f"0 to {_MAX_OBJECT_SIZE}", found=f"{size!r:.40}")
        try:
            crc = crc_from_hex(value.get("crc32c"))
        except ValueError as exc:
            raise MarkerError(f"{where}: {exc}", url=where) from None
        try:
            tail = crc_from_hex(value["tail"]) if "tail" in value else None
        except ValueError:
            raise MarkerError(f"{where}: tail must be 8 lowercase hex digits (the object's "
                              f"last 4 bytes), got {value['tail']!r:.40}", url=where) from None
        if tail is not None and (crc != CRC32C_RESIDUE or size < 4):
            # Recorded only where the CRC32C cannot tell contents apart: anywhere else it
            # is not this protocol's.
            raise MarkerError(f"{where}: a tail is recorded only for an object of 4 bytes or "
                              f"more with CRC32C {crc_to_hex(CRC32C_RESIDUE)}, not "
                              f"{crc_to_hex(crc)} ({size} bytes)", url=where)
        return cls(size, crc, tail)


@dataclass(frozen=True)
class Manifest:
    """Every object of an entry: key relative to the entry -> size and CRC32C.

    A single-object entry has exactly one key, ``""``.
    """

    objects: Mapping[str, ObjectRecord]

    @property
    def total_size(self) -> int:
        return sum(r.size for r in self.objects.values())

    def __len__(self) -> int:
        return len(self.objects)

    def __iter__(self) -> Iterator[str]:
        return iter(self.objects)

    def to_json(self) -> dict[str, Any]:
        return {k: self.objects[k].to_json() for k in sorted(self.objects)}

    @classmethod
    def from_json(cls, value: object, where: str, kind: Kind) -> Manifest:
        if not isinstance(value, dict):
            raise MarkerError(f"{where}: manifest must be a JSON object", url=where)
        objects: dict[str, ObjectRecord] = {}
        for key, rec in value.items():
            if kind == "object":
                if key != "":
                    raise MarkerError(f"{where}: a single-object entry's manifest has the one "
                                      f"key '', found {key!r:.80}", url=where)
            else:
                check_key(key, where)
            objects[key] = ObjectRecord.from_json(rec, where, key)
        if kind == "object" and len(objects) != 1:
            raise MarkerError(f"{where}: a single-object entry records exactly one object, "
                              f"found {len(objects)}", url=where)
        return cls(objects)


@dataclass(frozen=True)
class ManifestRef:
    """Where an external manifest lives (a key in the records dir) and what it must be."""

    key: str
    size: int
    crc32c: int


@dataclass(frozen=True)
class Summary:
    """What a marker with an external manifest says of it (``count``, ``total_size`` and
    ``ends``: the records of its first and last keys in key order), so that `state()`
    stats those two objects without fetching and parsing the manifest (5 MB, 0.3 s for
    100,000 objects). Checked against the manifest whenever the manifest is read: one
    that disagrees is a MarkerError there."""

    count: int
    total_size: int
    ends: Mapping[str, ObjectRecord]

    @classmethod
    def of(cls, manifest: Manifest) -> Summary:
        objects = manifest.objects
        keys = {min(objects), max(objects)} if objects else set()
        return cls(len(objects), manifest.total_size, {k: objects[k] for k in keys})

    def check(self, manifest: Manifest, where: str) -> None:
        found = Summary.of(manifest)
        for what, said, was in (("count", self.count, found.count),
                                ("total_size", self.total_size, found.total_size),
                                ("ends", dict(self.ends), dict(found.ends))):
            if said != was:
                # A marker whose summary is not its manifest: state() judged the data by
                # objects (or sizes) the manifest does not hold where they are.
                raise MarkerError(
                    f"{where}: the marker's summary says {what} {_said(said)}, the external "
                    f"manifest has {_said(was)}: they must agree", url=where,
                    expected=_said(said), found=_said(was))


def _said(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r:.80}: {r.size} bytes, CRC32C {r.checksum_text()}"
                               for k, r in sorted(value.items())) + "}"
    return str(value)


class _ExternalObjects(Mapping[str, ObjectRecord]):
    """The objects of an external manifest, fetched, checked and parsed when first looked
    at (once: later looks share the result): a caller asking only whether the entry is
    COMPLETE never pays for them. ``load`` raises MarkerError for a manifest that cannot
    be trusted, at every look until one succeeds: its content is never used unchecked."""

    def __init__(self, load: Callable[[], Mapping[str, ObjectRecord]]) -> None:
        self._load = load
        self._objects: Mapping[str, ObjectRecord] | None = None
        self._lock = threading.Lock()  # threads of one zarr read looking at once: one GET

    @property
    def loaded(self) -> bool:
        return self._objects is not None

    def _get(self) -> Mapping[str, ObjectRecord]:
        objects = self._objects
        if objects is None:
            with self._lock:
                if self._objects is None:
                    self._objects = self._load()
                objects = self._objects
        return objects

    def __getitem__(self, key: str) -> ObjectRecord:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __contains__(self, key: object) -> bool:
        return key in self._get()

    def get(self, key: str, default: Any = None) -> Any:
        return self._get().get(key, default)

    def items(self) -> Any:
        return self._get().items()

    def keys(self) -> Any:
        return self._get().keys()

    def values(self) -> Any:
        return self._get().values()

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self._get()),)  # a lock and a closure do not pickle


@dataclass(frozen=True)
class Marker:
    """The commit record. Valid only as a whole: any field out of place is a MarkerError."""

    kind: Kind
    attempt: str
    committed_at: str
    manifest: Manifest | None
    manifest_ref: ManifestRef | None = None
    writer: Mapping[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    summary: Summary | None = None

    @classmethod
    def new(cls, kind: Kind, attempt: str, manifest: Manifest) -> Marker:
        return cls(kind=kind, attempt=attempt, committed_at=utc_now(), manifest=manifest,
                   writer=writer_info())

    def encode(self) -> tuple[bytes, tuple[str, bytes] | None]:
        """Marker bytes, and (key, bytes) of the external manifest when one is needed."""
        assert self.manifest is not None
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": self.version,
            "kind": self.kind,
            "attempt": self.attempt,
            "committed_at": self.committed_at,
            "writer": dict(self.writer),
            "count": len(self.manifest),
            "total_size": self.manifest.total_size,
        }
        if len(self.manifest) <= INLINE_MANIFEST_OBJECTS:
            data = _dumps({**doc, "manifest": self.manifest.to_json()})
            if len(data) <= MAX_MARKER_BYTES:
                return data, None
            # Fewer objects than the external threshold, but long keys: inline, the marker
            # would be over the limit every reader refuses. External, as a large entry.
        blob = _dumps({"format": FORMAT + ".manifest", "attempt": self.attempt,
                       "manifest": self.manifest.to_json()})
        if len(blob) > MAX_MANIFEST_BYTES:
            raise UnsupportedError(
                f"a manifest of {len(self.manifest)} objects is {len(blob)} bytes, over the "
                f"limit of {MAX_MANIFEST_BYTES} every reader refuses: split the entry")
        key = f"manifest-{self.attempt}.json"
        doc["manifest_ref"] = {"key": key, "size": len(blob),
                               "crc32c": crc_to_hex(crc32c(blob))}
        # Optional (a reader that does not know it fetches the manifest, as before).
        doc["ends"] = {k: r.to_json() for k, r in sorted(Summary.of(self.manifest).ends.items())}
        return _dumps(doc), (key, blob)

    @classmethod
    def decode(cls, data: bytes, where: str) -> Marker:
        if len(data) > MAX_MARKER_BYTES:
            raise MarkerError(f"{where}: marker is {len(data)} bytes, over the limit of "
                              f"{MAX_MARKER_BYTES}", url=where, expected=MAX_MARKER_BYTES,
                              found=len(data))
        doc = _loads(data, where)
        if doc.get("format") != FORMAT:
            raise MarkerError(f"{where}: not a durable commit marker (format "
                              f"{doc.get('format')!r:.60}, expected {FORMAT!r})", url=where)
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise MarkerError(f"{where}: bad format version {version!r:.40}", url=where)
        if version > FORMAT_VERSION:
            raise MarkerError(
                f"{where}: marker format version {version} is newer than this durable "
                f"({__version__}) reads (up to {FORMAT_VERSION}); upgrade durable-io",
                url=where, expected=FORMAT_VERSION, found=version)
        kind = doc.get("kind")
        if kind not in ("prefix", "object"):
            raise MarkerError(f"{where}: kind must be 'prefix' or 'object', got {kind!r:.40}",
                              url=where)
        attempt = doc.get("attempt")
        committed_at = doc.get("committed_at")
        # ASCII: str.isalnum() also takes "١٢" or "½", which a reader in another language
        # (and `from_metadata`) refuses; the id names files (manifest-<attempt>.json).
        if (not isinstance(attempt, str) or not attempt.isascii() or not attempt.isalnum()
                or len(attempt) > 64):
            raise MarkerError(f"{where}: bad attempt id {attempt!r:.80}", url=where)
        if not isinstance(committed_at, str) or len(committed_at) > 64:
            raise MarkerError(f"{where}: bad committed_at {committed_at!r:.80}: expected a "
                              "string of at most 64 characters (an ISO 8601 UTC time)",
                              url=where)
        writer = doc.get("writer", {})
        if not isinstance(writer, dict):
            raise MarkerError(f"{where}: writer must be a JSON object", url=where)
        manifest = ref = None
        if "manifest" in doc and "manifest_ref" in doc:
            # Two manifests: which one a reader trusts must never be a choice.
            raise MarkerError(f"{where}: marker has both 'manifest' and 'manifest_ref'",
                              url=where)
        if "manifest" in doc:
            manifest = Manifest.from_json(doc["manifest"], where, kind)
        elif isinstance(doc.get("manifest_ref"), dict):
            r = doc["manifest_ref"]
            key = r.get("key")
            # The external manifest lives in the records dir: a plain file name, no path.
            if (not isinstance(key, str) or "/" in key or key != f"manifest-{attempt}.json"):
                raise MarkerError(f"{where}: manifest_ref key {key!r:.80} is not "
                                  f"'manifest-{attempt}.json'", url=where)
            rec = ObjectRecord.from_json(r, f"{where} manifest_ref")
            if rec.size > MAX_MANIFEST_BYTES:
                raise MarkerError(f"{where}: external manifest of {rec.size} bytes is over "
                                  f"the limit of {MAX_MANIFEST_BYTES}", url=where)
            ref = ManifestRef(key, rec.size, rec.crc32c)
        else:
            raise MarkerError(f"{where}: marker has neither 'manifest' nor 'manifest_ref'",
                              url=where)
        summary = None
        if "ends" in doc:
            summary = _summary(doc, where, kind, external=ref is not None)
        return cls(kind=kind, attempt=attempt, committed_at=committed_at, manifest=manifest,
                   manifest_ref=ref, writer=writer, version=version, summary=summary)

    def to_metadata(self) -> dict[str, str]:
        """The record of a single-object entry as object metadata (see `from_metadata`)."""
        assert self.kind == "object" and self.manifest is not None
        rec = self.manifest.objects[""]
        return {META_VERSION: str(self.version), META_SIZE: str(rec.size),
                META_CRC32C: crc_to_hex(rec.crc32c), META_ATTEMPT: self.attempt,
                META_COMMITTED_AT: self.committed_at}

    @classmethod
    def from_metadata(cls, fields: Mapping[str, str] | None, where: str) -> Marker | None:
        """The record an object carries in its own metadata; None if it carries none.

        Valid only as a whole, like a marker: a field missing, too long, not a number, a
        CRC32C that is not 8 hex digits, a size beyond any object, a format version this
        durable does not read: MarkerError naming the object. Never partly trusted.
        """
        if not carries_record(fields):
            return None
        assert fields is not None
        for key in META_KEYS:
            value = fields.get(key)
            if not isinstance(value, str) or not value or len(value) > _META_VALUE_MAX:
                raise MarkerError(f"{where}: metadata record field {key} is "
                                  f"{'missing' if value is None else repr(value)[:80]}; "
                                  "expected all of " + ", ".join(META_KEYS), url=where,
                                  expected=key, found=value)
        version_text = fields[META_VERSION]
        if not _DECIMAL.fullmatch(version_text) or int(version_text) < 1:
            raise MarkerError(f"{where}: metadata record format version {version_text!r:.40} "
                              "is not a positive integer", url=where, found=version_text)
        version = int(version_text)
        if version > FORMAT_VERSION:
            raise MarkerError(
                f"{where}: metadata record format version {version} is newer than this "
                f"durable ({__version__}) reads (up to {FORMAT_VERSION}); upgrade durable-io",
                url=where, expected=FORMAT_VERSION, found=version)
        size_text = fields[META_SIZE]
        if not _DECIMAL.fullmatch(size_text) or int(size_text) > _MAX_OBJECT_SIZE:
            raise MarkerError(f"{where}: metadata record size {size_text!r:.40} is not a "
                              f"decimal byte count up to {_MAX_OBJECT_SIZE}", url=where,
                              found=size_text)
        try:
            crc = crc_from_hex(fields[META_CRC32C])
        except ValueError as exc:
            raise MarkerError(f"{where}: metadata record: {exc}", url=where,
                              found=fields[META_CRC32C]) from None
        attempt = fields[META_ATTEMPT]
        if not attempt.isascii() or not attempt.isalnum():
            raise MarkerError(f"{where}: metadata record attempt id {attempt!r:.80} is not "
                              "alphanumeric", url=where, found=attempt)
        return cls(kind="object", attempt=attempt, committed_at=fields[META_COMMITTED_AT],
                   manifest=Manifest({"": ObjectRecord(int(size_text), crc)}),
                   version=version)

    def with_manifest_from(self, fetch: Callable[[], bytes], where: str) -> Marker:
        """This marker with its external manifest fetched (``fetch``: its bytes, bounded;
        ``where``: its URL), checked and parsed when its objects are first looked at, not
        now (`_ExternalObjects`)."""
        def load() -> Mapping[str, ObjectRecord]:
            manifest = self.with_external_manifest(fetch(), where).manifest
            assert manifest is not None
            return manifest.objects
        return dataclasses.replace(self, manifest=Manifest(_ExternalObjects(load)))

    def manifest_loaded(self) -> bool:
        """Whether the manifest is at hand (inline, or external and fetched already)."""
        objects = self.manifest.objects if self.manifest is not None else None
        return objects is not None and not (isinstance(objects, _ExternalObjects)
                                            and not objects.loaded)

    def ends(self) -> Mapping[str, ObjectRecord]:
        """The records of the manifest's first and last keys (in key order): the summary's
        while the external manifest is not fetched, else the manifest's own."""
        if self.summary is not None and not self.manifest_loaded():
            return self.summary.ends
        assert self.manifest is not None
        return Summary.of(self.manifest).ends

    def with_external_manifest(self, data: bytes, where: str) -> Marker:
        """Attach the external manifest after checking it is the one the marker names."""
        ref = self.manifest_ref
        assert ref is not None
        found = crc32c(data)
        if len(data) != ref.size or found != ref.crc32c:
            raise MarkerError(
                f"{where}: external manifest is {len(data)} bytes with CRC32C "
                f"{crc_to_hex(found)}; the marker recorded {ref.size} bytes with CRC32C "
                f"{crc_to_hex(ref.crc32c)}", url=where,
                expected=(ref.size, crc_to_hex(ref.crc32c)),
                found=(len(data), crc_to_hex(found)))
        doc = _loads(data, where)
        if doc.get("attempt") != self.attempt:
            raise MarkerError(f"{where}: external manifest belongs to attempt "
                              f"{doc.get('attempt')!r:.40}, not {self.attempt}", url=where)
        manifest = Manifest.from_json(doc.get("manifest"), where, self.kind)
        if self.summary is not None:
            self.summary.check(manifest, where)
        return dataclasses.replace(self, manifest=manifest)


@dataclass(frozen=True)
class Layout:
    """Where the records of the entry at ``path`` live (paths as the filesystem spells them)."""

    path: str

    def __post_init__(self) -> None:
        parent, _, name = self.path.rstrip("/").rpartition("/")
        if name == RECORDS_DIR:
            # "needs a name of its own" sent users looking for a missing name, not this one.
            raise ValueError(f"{self.path!r} cannot be an entry: {RECORDS_DIR!r} is the name "
                             "of durable's records directories; rename it")
        if not name or name in (".", ".."):
            raise ValueError(f"{self.path!r} cannot be an entry: it needs a name of its own")
        if not parent:
            # A bucket or a file-system root has no parent to hold its records.
            raise ValueError(f"{self.path!r} cannot be an entry: it has no parent directory "
                             "or prefix to hold its commit marker")

    def refuse_inside_records(self) -> None:
        """ValueError for an entry to be written inside a records directory: its marker
        would sit in a records dir of a records dir, which scan and clean read as neither
        data nor an entry (durable's own staging lives there, and is no entry)."""
        if RECORDS_DIR in self.parent.split("/"):
            raise ValueError(f"{self.path!r} cannot be an entry: it lies inside a records "
                             f"directory ({RECORDS_DIR}), which is durable's own")

    @property
    def root(self) -> str:
        return self.path.rstrip("/")

    @property
    def parent(self) -> str:
        return self.root.rpartition("/")[0]

    @property
    def name(self) -> str:
        return self.root.rpartition("/")[2]

    @property
    def records(self) -> str:
        return f"{self.parent}/{RECORDS_DIR}/{self.name}"

    @property
    def marker(self) -> str:
        return f"{self.records}/{MARKER_NAME}"

    @property
    def lease(self) -> str:
        """The writer lease: rewritten by its holder's heartbeat, so its version changes."""
        return f"{self.records}/{LEASE_NAME}"

    @property
    def attempts(self) -> str:
        return f"{self.records}/attempts"

    def attempt_record(self, attempt: str) -> str:
        return f"{self.attempts}/{attempt}.json"

    def external_manifest(self, key: str) -> str:
        return f"{self.records}/{key}"

    def object_path(self, key: str, kind: Kind) -> str:
        """The path of a manifest key; the key was checked by `check_key` on decode."""
        return self.root if kind == "object" else f"{self.root}/{key}"


def is_attempt_record(key: str) -> bool:
    """Whether ``key`` (relative to an entry's records directory) names an attempt record:
    ``attempts/<id>.json``, directly in ``attempts/``."""
    parts = key.split("/")
    return len(parts) == 2 and parts[0] == "attempts" and parts[1].endswith(".json")


def attempt_folders(keys: Iterable[str], url: Callable[[str], str]) -> str:
    """What the reason of an unmarked entry adds for objects stored below a name in its
    ``attempts/`` (``attempts/<id>.json/x``: an attempt record made a directory, a hostile or
    corrupt layout), naming the first; "" if there are none. ``keys``: its records
    directory's, relative to it; ``url``: a key's URL.

    `durable status` said "data present but no commit marker" (or "a writer started")
    where `durable clean` planned "records but no marker", and mark-complete sent the user
    to `durable status` to see records it never named: every command says this instead.
    """
    below = sorted(k for k in keys if k.startswith("attempts/") and k.count("/") > 1)
    if not below:
        return ""
    folder = "/".join(below[0].split("/")[:2])
    more = len({"/".join(k.split("/")[:2]) for k in below}) - 1
    return (f"{url(folder)} is a directory (holding {url(below[0])}), not an attempt record "
            "file: no durable writer made it (a hostile or corrupt layout)"
            + (f", and {more} more" if more else ""))


def writer_info() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "durable": __version__}


def attempt_record_bytes(attempt: str) -> bytes:
    return _dumps({"format": FORMAT + ".attempt", "attempt": attempt, "started_at": utc_now(),
                   "writer": writer_info()})


def _summary(doc: dict[str, Any], where: str, kind: Kind, *, external: bool) -> Summary:
    """The marker's summary of its external manifest (`Summary`), checked as a manifest."""
    if not external:
        # Beside an inline manifest it would be a second account of the objects: which
        # one a reader trusts must never be a choice.
        raise MarkerError(f"{where}: 'ends' belongs only beside 'manifest_ref'", url=where)
    counts: list[int] = []
    for name in ("count", "total_size"):
        value = doc.get(name)
        if type(value) is not int or value < 0 or value.bit_length() > 96:
            raise MarkerError(f"{where}: a marker with 'ends' needs '{name}', a non-negative "
                              f"integer, got {value!r:.40}", url=where, expected=name,
                              found=f"{value!r:.40}")
        counts.append(value)
    ends = doc["ends"]
    if not isinstance(ends, dict) or len(ends) > 2:
        raise MarkerError(f"{where}: 'ends' must be a JSON object of at most 2 records (the "
                          "manifest's first and last keys)", url=where)
    where_ends = f"{where} ends"
    objects = Manifest.from_json(ends, where_ends, kind).objects if ends else {}
    return Summary(counts[0], counts[1], objects)


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=False).encode()


class _DuplicateKeyError(ValueError):
    pass


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return doc


def _loads(data: bytes, where: str) -> dict[str, Any]:
    try:
        # UTF-8 only, as the protocol says (json.loads of bytes would also take UTF-16
        # and UTF-32): a record is read the same way by every reader. A key twice in one
        # object is refused: Python keeps the last value, other readers the first, so two
        # readers of one marker would trust two manifests (or two sizes of one object).
        doc = json.loads(data.decode("utf-8") if isinstance(data, bytes | bytearray)
                         else data, object_pairs_hook=_unique)
    except _DuplicateKeyError as exc:
        raise MarkerError(f"{where}: the key {exc.args[0]!r:.80} appears twice in one JSON "
                          "object; which value to trust would be a guess",
                          url=where) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # An S3 or Azure error page (XML) stored or served as the record: said as such,
        # with its code, not as a JSON syntax error at line 1 that names nothing found.
        refuse_error_document(where, data, error=MarkerError, served_as="a durable record")
        raise MarkerError(f"{where}: not valid JSON ({exc})", url=where) from None
    if not isinstance(doc, dict):
        raise MarkerError(f"{where}: must be a JSON object, got {type(doc).__name__}",
                          url=where)
    if doc.keys() == {"error"}:
        # GCS's JSON error document parses: "not a durable commit marker" would not say so.
        refuse_error_document(where, data, error=MarkerError, served_as="a durable record")
    return doc
