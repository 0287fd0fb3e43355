"""Writer leases: at most one writer of an entry at a time, across processes and machines.

A lease is one small object beside the entry's marker (``PARENT/.durable/NAME/lease.json``)
naming its holder. Its life, like marin's executor lease (STYLE.md):

- **acquire**: a create-only write; of writers racing for a free entry, exactly one wins.
- **heartbeat**: a thread rewrites it every ``heartbeat`` seconds, each time as a
  conditional write on the version the holder last wrote (``replace_if``). The body carries
  a counter, so every rewrite is a new version (an ETag is a hash of the bytes).
- **stale**: a waiter (`LeaseWatch`) calls a lease stale when its version has not changed
  for ``stale_after`` seconds *as the waiter saw it*, by the waiter's own monotonic clock.
  No clocks of two machines are ever compared. The holder's ``stale_after``, written in the
  body, counts where it is longer than the waiter's, up to `MAX_STALE_AFTER` (an hour).
- **takeover**: a conditional write on the stale version, so of two waiters taking over
  the same dead writer's lease, exactly one wins.
- **lost is fatal**: a holder whose conditional write fails (someone took over, or the
  lease was removed), or who could not renew for ``stale_after`` seconds, is lost for good:
  `Lease.check` raises `LeaseLostError`, and `Entry.writing(lease=...)` never commits.
  A renewal that fails only after the client's own retries counts from its start: with
  s3fs and botocore's default retries a store answering 503 takes about a minute to give
  up on, so the holder learns it is lost that late (it can never commit meanwhile: a
  commit needs a renewal that succeeds).

Fencing the commit (`Lease.fenced`, used for the marker write): the lease is rewritten
conditionally once more, then the marker is written. Where the store can lock out
conditional writes while the marker is written (`Adapter.exclusive`: local disks, memory),
no takeover can fall between the two: the window is zero. Elsewhere (S3) the rewrite
restarts every waiter's staleness clock, so a takeover needs the version unchanged for
``stale_after`` after it; the marker PUT, sent right after the rewrite, must therefore be
delayed by more than ``stale_after`` (a process pause or a network stall inside that one
small request) for a taken-over writer to commit. With the default 30 s that is the
remaining window; the commit is then still create-only, and the taker's commit fails
rather than mixing two writers' data silently.

Stores without conditional writes: `UnsupportedError`, unless ``best_effort=True``, where a
conditional write is a stat then a write, which two writers can both pass at the same
moment (said here, never pretended).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from durable._entry import Entry
from durable._errors import DurableError, IncompleteExistsError, LeaseLostError, UnsupportedError
from durable._protocol import utc_now
from durable.adapters import ObjectInfo
from durable.adapters.base import VersionMismatchError

__all__ = ["MAX_STALE_AFTER", "Lease", "LeaseView", "LeaseWatch", "refuse_live_lease"]

log = logging.getLogger(__name__)

FORMAT = "durable.lease"
_MAX_BODY = 64 * 1024
_ACQUIRE_TRIES = 3
# `Lease`'s default stale_after: a lease whose body cannot be read is judged by it.
_DEFAULT_STALE_AFTER = 30.0
#: The longest ``stale_after`` a lease may have: a `Lease` refuses more, and waiters take a
#: body that states more (a hostile or mistaken one: 1e12, Infinity) as this, so a dead
#: holder's lease never keeps waiters out for longer.
MAX_STALE_AFTER = 3600.0
# Modification times and HTTP dates are given to the second: a lease renewed a moment ago
# can look up to this much older than it is.
_CLOCK_STEP = 1.0


def _entry_of(url: str | Entry, storage_options: dict[str, Any] | None) -> Entry:
    return url if isinstance(url, Entry) else Entry(url, storage_options=storage_options)


def describe(holder: Mapping[str, Any] | None) -> str:
    """A lease holder as a person reads it: host, pid, since when."""
    if not holder:
        return "holder unreadable"
    purpose = holder.get("purpose")
    return (f"held by {holder.get('host', '?')} pid {holder.get('pid', '?')} since "
            f"{holder.get('acquired_at', '?')}"
            + (f", {purpose}" if isinstance(purpose, str) and purpose.isprintable() else ""))


def check_stale_after(stale_after: float, heartbeat: float) -> None:
    """ValueError unless ``stale_after`` fits a lease renewed every ``heartbeat``."""
    if not stale_after <= MAX_STALE_AFTER:
        raise ValueError(f"stale_after ({stale_after}) must be at most {MAX_STALE_AFTER:g} s: "
                         "waiters judge a lease by no longer limit than that")
    if not heartbeat > 0 or not stale_after > 2 * heartbeat:
        raise ValueError(f"stale_after ({stale_after}) must be more than twice the "
                         f"heartbeat ({heartbeat}), which must be positive: else a "
                         "live holder looks stale between two renewals")


def stated_stale_after(holder: Mapping[str, Any] | None) -> float | None:
    """The ``stale_after`` a lease's body states, as waiters take it: None unless it is a
    positive number (a string, NaN, a negative: the waiter's own limit applies instead),
    and at most `MAX_STALE_AFTER` (more, Infinity or an integer too large for a float, is
    taken as that): a body never makes a waiter wait forever, nor crash."""
    value = holder.get("stale_after") if holder else None
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except OverflowError:
        return MAX_STALE_AFTER
    return min(value, MAX_STALE_AFTER) if value > 0 else None


def refuse_live_lease(entry: Entry, doing: str, *, remove: bool = True,
                      hint: str | None = None) -> str | None:
    """For a writer WITHOUT the lease about to start over, resume or update ``entry``
    (``doing``: which, for the message): IncompleteExistsError naming the entry, the holder
    and when the lease expires if another writer's lease is live. Starting over would
    remove the data it is writing, and its writes still under way (it learns that it lost
    the lease only at its next renewal) would land in this writer's entry; resuming or
    updating would commit its partial objects as this writer's.

    A lease not renewed for its holder's ``stale_after`` (its age by the store's clock:
    the Date of the store's answer against the lease's modification time; on a local disk
    this machine's clock against the file's mtime) is expired: it is removed, on the
    version judged (one renewed meanwhile is live after all), so its holder, if only
    paused, finds it lost at its next renewal or write. A lease whose store gives no
    modification time is watched instead, by this machine's clock from the first look: its
    version unchanged for the holder's ``stale_after`` (this call waits that long, at most
    `MAX_STALE_AFTER`), it is expired; changed, it is live. With ``remove=False`` it is
    not watched, and counts as live.

    Returns None if there was no lease, else what the expired lease was (removed only
    with ``remove``: a writer refused for other reasons only names it). ``hint``: what
    the refused caller can do, instead of the writer's.
    """
    adapter, path = entry.adapter, entry.layout.lease
    info = adapter.info(path)
    if info is None:
        return None
    watch = LeaseWatch(entry, adapter=adapter, path=path)
    holder = watch._read(info)
    if holder is None and (again := adapter.info(path)) is not None and (
            again.version != info.version):
        # Renewed between the stat and the read (pinned to the stat's version): the
        # holder is read from the lease as it is now, not called "unreadable".
        info, holder = again, watch._read(again)
    limit = stated_stale_after(holder) or _DEFAULT_STALE_AFTER
    lease_url = adapter.url(path)

    def held(when: str) -> IncompleteExistsError:
        return IncompleteExistsError(
            f"{entry.url}: not {doing}: another writer holds its lease {lease_url} "
            f"({describe(holder)}); {when}. " + (hint or (
                "Wait for that writer to commit or for its lease to expire, or write under "
                "the lease (durable.Lease) once it is free")), url=entry.url)

    # A store across a network that sends no Date (some S3-compatible endpoints): its
    # modification times are by its clock, not this machine's, which may be ahead by more
    # than stale_after and make a live holder's lease look expired. Watched instead.
    store_now = None if info.modified is None or adapter.capabilities.in_process else (
        adapter.now(path))
    if info.modified is None or (store_now is None and not adapter.capabilities.in_process):
        # No time to age it by (the generic adapter: no modification time; no Date):
        # judged as a waiter judges, by this machine's clock from this first look. Counted
        # live for good, a dead holder's lease kept every writer out forever.
        lacks = ("no modification time" if info.modified is None else
                 "no Date to age its modification time by")
        if info.version is None:
            raise held(f"the store gives {lacks} and no version, so its age cannot be told")
        if not remove:
            raise held(f"the store gives {lacks}: a writer starting over or resuming "
                       f"watches it for up to {limit:g} s to tell")
        t0 = time.monotonic()
        log.warning("%s: the store gives the lease %s (%s) %s: watching it for up to %g s "
                    "to tell whether its writer is alive", entry.url, lease_url,
                    describe(holder), lacks, limit)
        seen, age = _watch_unchanged(adapter, path, info.version, t0, limit)
        if seen == "gone":
            return None  # released meanwhile
        if seen == "renewed":
            raise held(f"renewed {age:.1f} s after this writer first saw it")
        clock = "this machine's (watched from its first look)"
    else:
        assert info.modified is not None
        clock = "this machine's" if store_now is None else "the store's"
        age = max(0.0, (time.time() if store_now is None else store_now) - info.modified)
        if age <= limit + _CLOCK_STEP:
            expires = datetime.datetime.fromtimestamp(info.modified + limit + _CLOCK_STEP,
                                                      datetime.UTC)
            raise held(f"renewed {age:.1f} s ago by {clock} clock, it expires at "
                       f"{expires:%Y-%m-%dT%H:%M:%SZ} ({limit + _CLOCK_STEP - age:.0f} s "
                       "from now) unless renewed")
    expired = (f"its lease {lease_url} ({describe(holder)}) expired: not renewed for "
               f"{age:.1f} s by {clock} clock (stale_after {limit:g} s)")
    if not remove:
        return expired
    # The store's conditional-write probe (once per endpoint) beside the records directory,
    # not in it, as for `Lease`: a probe in it would read as another writer's record.
    conditional = adapter.supports_conditional(
        f"{entry.layout.records.rpartition('/')[0]}/lease-probe")
    try:
        if conditional:
            adapter.delete_if(path, info.version or "")
        else:
            adapter.delete([path])  # a best_effort lease: no conditional delete to use
    except VersionMismatchError:
        if adapter.info(path) is not None:
            raise IncompleteExistsError(
                f"{entry.url}: not {doing}: its lease {lease_url} ({describe(holder)}) was "
                "renewed just as it was judged expired: its writer is at work",
                url=entry.url) from None
        # Released meanwhile: nothing left to remove.
    log.warning("%s: removed %s", entry.url, expired)
    return expired


def _watch_unchanged(adapter: Any, path: str, version: str, since: float,
                     limit: float) -> tuple[Literal["gone", "renewed", "unchanged"], float]:
    """Poll the lease at ``path`` until it is gone, has another version than ``version``
    (renewed), or has kept it for ``limit`` seconds since ``since`` (monotonic); with the
    seconds watched."""
    pause = 0.05
    while True:
        info = adapter.info(path)
        watched = time.monotonic() - since
        if info is None:
            return "gone", watched
        if info.version != version:
            return "renewed", watched
        if watched >= limit:
            return "unchanged", watched
        time.sleep(min(pause, limit - watched))
        pause = min(pause * 2, 1.0)


class Lease:
    """The writer lease of the entry at ``url`` (or of an `Entry`).

    ``with Lease(url) as lease, Entry(url).writing(lease=lease) as w: ...`` writes the
    entry as its only writer: the ``with`` acquires (IncompleteExistsError if another
    writer holds it), a heartbeat thread renews it every ``heartbeat`` seconds, and exit
    releases it (a conditional delete: a lease taken over meanwhile is left alone).
    ``stale_after`` is what waiters wait before they may take it over; it must exceed
    twice the heartbeat. ``best_effort=True``: see the module docstring.
    """

    def __init__(self, url: str | Entry, *, storage_options: dict[str, Any] | None = None,
                 heartbeat: float = 5.0, stale_after: float = 30.0,
                 best_effort: bool = False) -> None:
        check_stale_after(stale_after, heartbeat)
        entry = _entry_of(url, storage_options)
        self.entry_url = entry.url
        self.adapter = entry.adapter
        self.path = entry.layout.lease
        self.url = self.adapter.url(self.path)
        self.heartbeat = heartbeat
        self.stale_after = stale_after
        self.best_effort = best_effort
        self.holder = uuid.uuid4().hex
        self._records = entry.layout.records
        self._enforced: bool | None = None
        self._version: str | None = None
        self._acquired_at = ""
        self._counter = 0
        self._last_ok = 0.0  # monotonic time the last successful write was sent
        self._lost: str | None = None
        #: What the holder does, said to writers it keeps out (`durable clean`'s).
        self._purpose: str | None = None
        self._lock = threading.Lock()  # one conditional write of ours at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        state = "lost" if self._lost else "held" if self._version else "not held"
        return f"Lease({self.entry_url!r}, {state})"

    # state -------------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self._version is not None and self._lost is None

    @property
    def lost(self) -> str | None:
        """Why the lease was lost, or None."""
        return self._lost

    @property
    def version(self) -> str | None:
        """The version this holder last wrote."""
        return self._version

    def check(self) -> None:
        """LeaseLostError unless the lease is held. Cheap, except after ``stale_after``
        without a renewal (a pause, an outage): then it renews first, to prove it."""
        if self._lost is not None:
            raise LeaseLostError(f"{self.entry_url}: lease lost: {self._lost}")
        if self._version is None:
            raise LeaseLostError(f"{self.entry_url}: the lease is not held")
        if time.monotonic() - self._last_ok > self.stale_after:
            self.renew()

    # acquiring ---------------------------------------------------------------------------
    def acquire(self) -> Lease:
        """Create the lease (create-only); IncompleteExistsError if a writer holds it."""
        if not self.try_acquire():
            holder = LeaseWatch(self.entry_url, adapter=self.adapter, path=self.path).peek()
            raise IncompleteExistsError(
                f"{self.entry_url}: another writer holds its lease ({describe(holder)})",
                url=self.entry_url)
        return self

    def try_acquire(self) -> bool:
        """Create the lease (create-only); False if a writer holds it."""
        if self._version is not None or self._lost is not None:
            raise RuntimeError(f"{self!r}: a Lease is acquired once; make a new one")
        self._require_support()
        self._acquired_at = utc_now()
        for attempt in range(1, _ACQUIRE_TRIES + 1):
            try:
                t0 = time.monotonic()
                info = self.adapter.put(self.path, self._body(), create_only=True,
                                        durable=False)
                break
            except FileExistsError:
                return False
            except FileNotFoundError:
                # A releasing holder removed the empty records directory between our
                # mkdir and our create: go again.
                if attempt == _ACQUIRE_TRIES:
                    raise
        self._start(info, t0)
        return True

    def take_over(self, stale: LeaseView) -> Lease:
        """Replace a lease a `LeaseWatch` saw stale, on the version it saw (conditional):
        IncompleteExistsError if it changed since (renewed, or taken by another)."""
        if not stale.stale:
            raise ValueError(f"{self.entry_url}: the lease is not stale ({stale})")
        if self._version is not None or self._lost is not None:
            raise RuntimeError(f"{self!r}: a Lease is acquired once; make a new one")
        self._require_support()
        self._acquired_at = utc_now()
        try:
            t0 = time.monotonic()
            info = self._replace(stale.version)
        except VersionMismatchError:
            raise IncompleteExistsError(
                f"{self.entry_url}: its lease changed since it was seen stale (its writer "
                "renewed it, or another waiter took it over)", url=self.entry_url) from None
        log.warning("%s: took over a stale lease (%s, unchanged for %.1f s)",
                    self.entry_url, describe(stale.holder), stale.unchanged_for)
        self._start(info, t0)
        return self

    def _require_support(self) -> None:
        if self._enforced is None:
            # Probes (once per endpoint) may write an object next to the path they are
            # given (GCS; S3 probes under the bucket's own .durable/ instead): beside the
            # records directory, not in it, where a writer that just acquired the lease
            # would take the probe for another writer's record.
            beside = f"{self._records.rpartition('/')[0]}/lease-probe"
            # S3-compatible endpoints are probed for If-None-Match: one that ignores it
            # would turn the create-only acquire into a stat and a write.
            probe = getattr(self.adapter, "create_only_enforced", None)
            create_only = (probe(beside) if callable(probe)
                           else self.adapter.capabilities.create_only)
            self._enforced = bool(create_only) and self.adapter.supports_conditional(beside)
        if not self._enforced and not self.best_effort:
            raise UnsupportedError(
                f"{self.url}: leases need create-only and conditional writes, which the "
                f"{self.adapter.name} adapter cannot enforce here "
                f"({self.adapter.capabilities.note}). Pass best_effort=True to accept that "
                "two writers starting at the same moment can both hold it")

    def _versioned(self, info: ObjectInfo) -> ObjectInfo:
        # Some adapters (the generic one) learn an object's version only from a stat.
        return info if info.version is not None else self.adapter.info(self.path) or info

    def _start(self, info: ObjectInfo, t0: float) -> None:
        info = self._versioned(info)
        if info.version is None:
            raise UnsupportedError(f"{self.url}: the store reports no object versions, so "
                                   "waiters cannot tell a live lease from a stale one")
        self._version, self._last_ok = info.version, t0
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name=f"durable-lease {self.entry_url}")
        self._thread.start()

    # renewing ----------------------------------------------------------------------------
    def _body(self) -> bytes:
        self._counter += 1
        return json.dumps({
            "format": FORMAT, "holder": self.holder, "host": socket.gethostname(),
            "pid": os.getpid(), "acquired_at": self._acquired_at, "renewal": self._counter,
            "heartbeat": self.heartbeat, "stale_after": self.stale_after,
            **({"purpose": self._purpose} if self._purpose else {}),
        }, separators=(",", ":")).encode()

    def _replace(self, version: str) -> ObjectInfo:
        if self._enforced:
            return self.adapter.replace_if(self.path, self._body(), version)
        # best_effort: a stat, then a write; two writers can both pass between them.
        found = self.adapter.info(self.path)
        if found is None or found.version != version:
            raise VersionMismatchError(
                f"{self.url}: expected version {version}, found "
                f"{found.version if found else 'no object'}", url=self.url, expected=version,
                found=found.version if found else None)
        return self._versioned(self.adapter.put(self.path, self._body(), durable=False))

    def renew(self) -> None:
        """Rewrite the lease now (conditional); LeaseLostError if it was taken over."""
        with self._lock:
            self._renew_locked()

    def _renew_locked(self) -> None:
        if self._lost is not None:
            raise LeaseLostError(f"{self.entry_url}: lease lost: {self._lost}")
        if self._version is None:
            raise LeaseLostError(f"{self.entry_url}: the lease is not held")
        t0 = time.monotonic()
        try:
            info = self._replace(self._version)
        except VersionMismatchError as exc:
            self._lose(f"taken over or removed by someone else ({exc})")
            raise LeaseLostError(f"{self.entry_url}: lease lost: {self._lost}") from None
        except (OSError, DurableError) as exc:
            # Unreachable for longer than a waiter waits: someone may hold it by now.
            since = time.monotonic() - self._last_ok
            if since > self.stale_after:
                self._lose(f"not renewed for {since:.1f} s (stale_after "
                           f"{self.stale_after} s): {type(exc).__name__}: {exc}")
                raise LeaseLostError(f"{self.entry_url}: lease lost: {self._lost}") from exc
            raise
        self._version, self._last_ok = info.version, t0

    def _lose(self, why: str) -> None:
        if self._lost is None:
            self._lost = why
            log.warning("%s: lease lost: %s", self.entry_url, why)

    def _beat(self) -> None:
        wait = self.heartbeat
        while not self._stop.wait(wait):
            try:
                self.renew()
                wait = self.heartbeat
            except LeaseLostError:
                return
            except Exception as exc:
                # Transient (a 503, a dropped connection): try again sooner.
                log.info("%s: lease renewal failed, retrying: %s", self.entry_url, exc)
                wait = self.heartbeat / 4

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """Run the block (a commit) only while the lease is held; see the module docstring.

        LeaseLostError if it is not. The lease is renewed first; where the store has
        `Adapter.exclusive`, no conditional write by anyone (a takeover) can land until
        the block ends.
        """
        with self._lock, self.adapter.exclusive(self.path):
            self._renew_locked()
            yield

    # releasing ---------------------------------------------------------------------------
    def release(self) -> None:
        """Stop the heartbeat and remove the lease, if it is still this holder's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            version, self._version = self._version, None
            if version is None or self._lost is not None:
                return
            self._lost = "released"
            try:
                if self._enforced:
                    self.adapter.delete_if(self.path, version)
                else:
                    found = self.adapter.info(self.path)
                    if found is not None and found.version == version:
                        self.adapter.delete([self.path])
            except VersionMismatchError:
                return  # taken over meanwhile: it is the new holder's now
        # The records directory must not outlive its last writer: an empty one left on a
        # disk would read as "a writer started" (INCOMPLETE) for good.
        self.adapter.prune(self._records)

    def __enter__(self) -> Lease:
        if self._version is None and self._lost is None:
            self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


@dataclass(frozen=True)
class LeaseView:
    """A lease as one waiter sees it."""

    version: str
    holder: Mapping[str, Any] | None
    """The lease's body (host, pid, acquired_at, ...), None if it could not be read."""
    unchanged_for: float
    """Seconds this waiter has seen this version, by its own monotonic clock."""
    stale_after: float
    stale: bool


class LeaseWatch:
    """Watches one entry's lease from a waiter's side: `poll` says whether it is stale.

    The staleness limit is the larger of the waiter's ``stale_after`` and the one the
    holder wrote into the lease, so a waiter never judges a holder by a shorter limit than
    the holder renews for; a body stating more than `MAX_STALE_AFTER` counts as that, and
    one stating no positive number (garbage) counts as stating nothing.
    """

    def __init__(self, url: str | Entry, *, storage_options: dict[str, Any] | None = None,
                 stale_after: float = 30.0, adapter: Any = None,
                 path: str | None = None) -> None:
        if adapter is not None and path is not None:
            self.adapter, self.path = adapter, path
        else:
            entry = _entry_of(url, storage_options)
            self.adapter, self.path = entry.adapter, entry.layout.lease
        self.stale_after = stale_after
        self._seen: tuple[str, float, Mapping[str, Any] | None] | None = None
        self._body_read = False

    def _read(self, info: ObjectInfo) -> Mapping[str, Any] | None:
        try:
            if info.size > _MAX_BODY:
                return None
            with self.adapter.open_read(self.path, info) as f:
                doc = json.loads(f.read(_MAX_BODY + 1))
        # RecursionError: nested too deeply (a few KiB do it), not a lease either.
        except (OSError, DurableError, ValueError, RecursionError):
            return None  # replaced or removed meanwhile, or not a lease: the next poll sees
        return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None

    def peek(self) -> Mapping[str, Any] | None:
        """The lease's body now (one look, no judgement of staleness)."""
        info = self.adapter.info(self.path)
        return self._read(info) if info is not None else None

    def poll(self) -> LeaseView | None:
        """The lease now, or None if there is none. One stat; the body is read only
        when this waiter's own limit has passed (to learn the holder's) or when asked
        for (``holder=True``)."""
        info = self.adapter.info(self.path)
        now = time.monotonic()
        if info is None:
            self._seen = None
            return None
        if info.version is None:
            raise UnsupportedError(f"{self.adapter.url(self.path)}: the store reports no "
                                   "object versions, so a stale lease cannot be told apart")
        if self._seen is None or self._seen[0] != info.version:
            self._seen = (info.version, now, None)
            self._body_read = False
        version, since, holder = self._seen
        age = now - since
        if age >= self.stale_after and not self._body_read:
            holder, self._body_read = self._read(info), True
            self._seen = (version, since, holder)
        # The holder's own limit, if longer (at most MAX_STALE_AFTER): a body that states
        # more, or garbage, never makes this waiter wait forever.
        limit = max(self.stale_after, stated_stale_after(holder) or 0.0)
        return LeaseView(version, holder, age, limit, age >= limit)
