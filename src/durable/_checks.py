"""What checking an entry finds: its `Status`, records behind a symlink (refused), and the
`Problem`s verifying reports against the manifest, from objects read through CRC32C."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from durable._checksum import Checksum, crc_to_hex
from durable._error_document import ERROR_DOC_LIMIT, error_document
from durable._errors import DurableError, IntegrityError, MarkerError
from durable._pool import bounded_map
from durable._protocol import Marker, ObjectRecord, State
from durable.adapters import Adapter, ObjectInfo

__all__ = ["WORKERS", "LinkedRecords", "Problem", "Status", "VerifyReport", "checksum_all",
           "deep_problem", "missing", "missing_problem", "read_object_record", "report_error"]

_READ_BLOCK = 8 * 1024 * 1024
#: Objects read (checksummed, verified) or folders looked at, at once.
WORKERS = 8


@dataclass(frozen=True)
class Status:
    """An entry's state with the reason for it and, if there is one, its marker."""

    state: State
    reason: str
    marker: Marker | None = None
    racing: bool = field(default=False, compare=False)
    """INCOMPLETE only because another writer started at the same moment as the one asking
    (their attempt records are seconds apart): a later try may go through."""


def missing(adapter: Adapter, path: str) -> str:
    """What is at ``path``, where an object of a manifest is missing from a listing:
    "missing", or what is there instead where the adapter can tell without a request (a
    symlink, a directory, a special file on a local disk; listings skip them, and
    "missing" named a path that is there)."""
    what = adapter.not_an_object(path)
    return "missing" if what is None else f"{what}, not an object"


def missing_problem(adapter: Adapter, key: str, path: str, size: int) -> Problem:
    """The `Problem` of a manifest's object a listing does not show: found is what is
    there instead (`missing`), or None."""
    what = missing(adapter, path)
    return Problem(key, adapter.url(path), "missing", expected=size,
                   found=None if what == "missing" else what)


class LinkedRecords(MarkerError):
    """Records behind a symlink, or an entry that is one: not cleared by
    ``overwrite=True`` as an unreadable marker is (the removal would reach through the
    link)."""


@dataclass(frozen=True)
class Problem:
    """One object that does not match the manifest."""

    key: str
    url: str
    issue: Literal["missing", "size", "crc32c", "unexpected", "unreadable"]
    expected: Any = None
    found: Any = None

    def __str__(self) -> str:
        if self.issue == "missing":
            return f"{self.url}: {self.found or 'missing'} (expected {self.expected} bytes)"
        if self.issue == "unexpected":
            return f"{self.url}: not in the manifest ({self.found} bytes)"
        if self.issue == "unreadable":
            return f"{self.url}: unreadable ({self.found})"
        return f"{self.url}: {self.issue} expected {self.expected}, found {self.found}"


@dataclass
class VerifyReport:
    url: str
    deep: bool
    objects: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def read_object_record(adapter: Adapter, path: str, info: ObjectInfo, *,
                       adopting: bool = False) -> ObjectRecord:
    """Stream one object through CRC32C, pinned to the version ``info`` names: its record
    (with the tail, where its CRC32C is the residue). ``adopting``: the record will make
    the object trusted, so one that is an object store's error document is refused."""
    ck = Checksum()
    small = bytearray() if adopting and info.size <= ERROR_DOC_LIMIT else None
    # Blocks no larger than the object (and one byte, to see the end): a read of 8 MiB
    # allocates 8 MiB, per object, even of a 64-byte one (a deep verify of 100,000
    # small chunks spent most of its time there).
    step = min(_READ_BLOCK, info.size + 1)
    with adapter.open_read(path, info) as f:
        while block := f.read(step):
            ck.update(block)
            if small is not None and len(small) <= ERROR_DOC_LIMIT:
                small += block
    found = None if small is None else error_document(small)
    if found is not None:
        # Incident 003: a 403's body saved as the file. Unrecorded, every read refuses
        # it; recorded, it would be read back as the data from then on.
        url = adapter.url(path)
        raise IntegrityError(
            f"{url}: the object is an object store's error document with code {found[0]} "
            f"({found[1][:200]!r}), stored in the data's place (a download that saved an "
            "error page); not adopted: fetch the object again, or remove it",
            url=url, expected="the object's bytes", found=f"an error document ({found[0]})")
    return ObjectRecord.of(ck.size, ck.crc, ck.ending)


def deep_problem(adapter: Adapter, key: str, info: ObjectInfo,
                 rec: ObjectRecord) -> Problem | None:
    """What reading the object ``info`` whole finds wrong with it against ``rec``."""
    url = adapter.url(info.path)
    try:
        found = read_object_record(adapter, info.path, info)
    except (OSError, DurableError) as exc:
        return Problem(key, url, "unreadable", found=str(exc))
    if found.size != rec.size:
        return Problem(key, url, "size", rec.size, found.size)
    if not rec.matches(found):
        # A tail differing under the residue: another codeword of the same size (a
        # straggler of another attempt), which the CRC32C alone cannot tell apart.
        return Problem(key, url, "crc32c", rec.checksum_text(),
                       found.checksum_text() if rec.tail is not None
                       else crc_to_hex(found.crc32c))
    return None


def checksum_all(adapter: Adapter, listing: dict[str, ObjectInfo],
                  workers: int) -> dict[str, ObjectRecord]:
    """Records for objects no writer recorded, read whole: what an adoption (a commit's,
    `mark_complete`'s) will vouch for from now on."""
    def one(item: tuple[str, ObjectInfo]) -> tuple[str, ObjectRecord]:
        key, info = item
        rec = read_object_record(adapter, info.path, info, adopting=True)
        if rec.size != info.size:
            raise IntegrityError(
                f"{adapter.url(info.path)}: listed with {info.size} bytes, read {rec.size}",
                url=adapter.url(info.path), expected=info.size, found=rec.size)
        return key, rec

    if not listing:
        return {}
    with ThreadPoolExecutor(max(1, min(workers, len(listing)))) as pool:
        return dict(bounded_map(pool, one, listing.items(), ahead=4 * max(1, workers)))


def report_error(report: VerifyReport) -> IntegrityError:
    shown = "; ".join(str(p) for p in report.problems[:20])
    more = len(report.problems) - 20
    tail = f"; and {more} more" if more > 0 else ""
    first = report.problems[0]
    return IntegrityError(
        f"{report.url}: {len(report.problems)} of {report.objects} objects do not match the "
        f"manifest: {shown}{tail}", url=first.url, expected=first.expected, found=first.found)
