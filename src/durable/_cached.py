"""`durable.cached`: a function's results kept as entries, computed once across processes.

Each call maps to one entry, ``ROOT/<module.function>/v<version>/<args>-<hash>``: the
arguments, bound to the signature with defaults applied, are normalised to canonical JSON;
the hash is of that JSON, the function's name and the version; the readable part shows the
short scalar arguments, so `durable scan ROOT` lists entries a person can tell apart
(docs/guides/cached.md tabulates how each type is keyed: equal values of a type share a
key, distinct ones never, and what has no such spelling is a TypeError asking for key=). The
entry holds ``value.<serializer>`` and ``key.json`` (the canonical arguments, for
inspection). How each state of the entry is met:

- COMPLETE: the value is read back verified and returned. A corrupt or changed result is
  an IntegrityError, never a silent recompute (joblib recomputes over load errors).
- ABSENT: take the writer lease (create-only), compute, write, commit under the lease,
  release; the value is then read back from the entry, so the first caller gets what
  every later caller gets. It is verified against the writer's own records, which are
  the committed manifest: the marker just written is not read again.
- INCOMPLETE, by ``on_incomplete``:
  ``"wait"`` (default): poll with backoff while a live writer holds the lease, until
  COMPLETE (or ``timeout``); an abandoned entry (no lease, or a stale one) raises
  IncompleteExistsError (incident 001: a leftover stops the run until resolved). Calls
  made at once from several processes (a pool's workers, a job's ranks) compute once and
  all return that result: under ``"raise"`` every caller but the first failed.
  ``"raise"``: IncompleteExistsError at once, naming the entry, the lease holder if any,
  and how to resolve it, for a live writer too.
  ``"takeover"``: as ``"wait"``, but an abandoned entry is recomputed under a lease taken
  over conditionally: never a live writer's.
- Another process commits first while this one computes: its result is returned, also
  when it took this one's lease over (this one paused past ``stale_after``).

On S3 a hit is two GETs (the marker with its manifest; the value, verified against it);
tests/test_cached.py pins what a hit and a miss send, request by request.

cachier's "in progress" flag, left set forever by a killed process, is what the lease's
staleness replaces: a dead writer's lease stops being renewed, and waiters see that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import enum
import functools
import hashlib
import inspect
import itertools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import Any, Generic, Literal, ParamSpec, TypeVar

from durable._entry import Entry
from durable._errors import (
    AlreadyCompleteError,
    IncompleteExistsError,
    LeaseLostError,
    UnsupportedError,
)
from durable._lease import (
    Lease,
    LeaseView,
    LeaseWatch,
    check_stale_after,
    describe,
    refuse_live_lease,
)
from durable._protocol import Manifest, Marker, State
from durable._serializers import BytesSerializer, choose, load_value
from durable.adapters import resolve

__all__ = ["BoundCachedFunction", "CachedFunction", "cached"]

P = ParamSpec("P")
R = TypeVar("R")
OnIncomplete = Literal["raise", "wait", "takeover"]

_FIRST_POLL = 0.05
_MAX_POLL = 2.0
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
_MAX_NAME = 96


def cached(root: str, *, version: str | int = 1, key: Callable[..., Any] | None = None,
           on_incomplete: OnIncomplete = "wait", timeout: float | None = None,
           serializer: str | None = None, pickle: bool = False,
           storage_options: dict[str, Any] | None = None,
           stale_after: float = 30.0) -> Callable[[Callable[P, R]], CachedFunction[P, R]]:
    """Cache a function's results as entries under ``root`` (a path or URL).

    ``version``: part of every key; change it when the function's results change.
    ``key``: called with the function's arguments, its return value replaces them as the
    key (for arguments that cannot be keyed, or should not be).
    ``on_incomplete``: "raise", "wait" or "takeover" (see the module docstring);
    ``timeout``: how long "wait"/"takeover" wait for a live writer (None: as long as it
    lives). ``serializer``: a serializer's name, instead of choosing by type.
    ``pickle=True`` allows pickling results no serializer takes (and loading them).
    ``stale_after``: seconds a lease may go unrenewed before waiters call its writer dead
    (it renews every fifth of that).
    """
    if on_incomplete not in ("raise", "wait", "takeover"):
        raise ValueError(f"on_incomplete must be 'raise', 'wait' or 'takeover', "
                         f"got {on_incomplete!r}")

    def decorate(func: Callable[P, R]) -> CachedFunction[P, R]:
        return CachedFunction(func, root, version=version, key=key,
                              on_incomplete=on_incomplete, timeout=timeout,
                              serializer=serializer, pickle=pickle,
                              storage_options=storage_options, stale_after=stale_after)

    return decorate


class CachedFunction(Generic[P, R]):
    """What `cached` returns: call it like the function; ``entry``, ``state``, ``clear``
    and ``recompute`` take the same arguments."""

    def __init__(self, func: Callable[P, R], root: str, *, version: str | int,
                 key: Callable[..., Any] | None, on_incomplete: OnIncomplete,
                 timeout: float | None, serializer: str | None, pickle: bool,
                 storage_options: dict[str, Any] | None, stale_after: float) -> None:
        if not isinstance(getattr(func, "__qualname__", None), str):
            # The entry's path is named after the function: without a qualified name (a
            # functools.partial, a callable object) there is nothing stable to name it by.
            raise TypeError(f"durable.cached needs a function with a name, got {func!r}: "
                            "wrap it in a def (whose arguments then make the key)")
        if func.__qualname__.rpartition(".")[2] == "<lambda>":
            # Entries are named after the function: every lambda of a module has the same
            # name, and two under one root would return each other's results.
            raise TypeError(f"durable.cached needs a function defined with def, got a "
                            f"lambda ({func.__module__}.{func.__qualname__}): lambdas "
                            "share one name, so their results would share entries")
        kind = ("an async generator function" if inspect.isasyncgenfunction(func)
                else "an async function" if inspect.iscoroutinefunction(func)
                else "a generator function" if inspect.isgeneratorfunction(func) else None)
        if kind is not None:
            # Its call returns a coroutine or a generator that has not run: nothing to
            # store, and the error came only at the first call, naming the coroutine.
            raise TypeError(f"durable.cached cannot cache {func.__qualname__}: it is {kind}, "
                            "whose call returns before it runs; cache a plain function "
                            "that returns the finished result (a list, an array, ...)")
        functools.update_wrapper(self, func)
        self.__wrapped__ = func
        self._func = func
        self._signature = inspect.signature(func)
        self._key = key
        self.on_incomplete = on_incomplete
        self.timeout = timeout
        self._serializer = serializer
        self._pickle = pickle
        self._storage_options = dict(storage_options or {})
        check_stale_after(stale_after, stale_after / 5)  # refused now, not at the first call
        self._stale_after = stale_after
        self._adapter, root_path = resolve(root, storage_options)
        # The key hashes the version as given; its folder is a hint, made safe for a path
        # (cut, punctuation replaced): hashed from that, "1,0" and "1_0", or two versions
        # alike for 96 characters, shared entries and returned each other's results.
        self._version = str(version)
        folder = _safe(self._version)
        if not folder:
            raise ValueError(f"version {version!r} has nothing that can go in a path")
        self._function = _qualified(func)
        self._name = getattr(func, "__name__", "function")
        self._prefix = f"{root_path.rstrip('/')}/{_safe(self._function)}/v{folder}"

    def __repr__(self) -> str:
        return f"<durable.cached {self._function} at {self._adapter.url(self._prefix)}>"

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        # On a method: bound as a function would be, so ``self`` is the first argument,
        # and part of the key like any other (an unkeyable instance is a TypeError naming
        # it; ``key=`` chooses what counts). The helpers are bound too: through a plain
        # bound method, ``model.predict.clear(x)`` took x for self and cleared another
        # entry (or none).
        return self if instance is None else BoundCachedFunction(self, instance)

    # the entry of a call -----------------------------------------------------------------
    def _key_doc(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._key is not None:
            return _canonical(self._key(*args, **kwargs), "the key function's result")
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return {name: _canonical(value, f"argument {name!r}")
                for name, value in bound.arguments.items()}

    def _locate(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Entry, Any, str]:
        """The call's entry, its canonical key document and that document's hash."""
        doc = self._key_doc(args, kwargs)
        digest = hashlib.sha256(_dumps([self._function, self._version, doc])).hexdigest()
        readable = _readable(doc)
        name = f"{readable}-{digest[:16]}" if readable else digest[:16]
        entry = Entry(f"{self._prefix}/{name}", adapter=self._adapter)
        entry.storage_options = dict(self._storage_options)
        return entry, doc, digest

    def _key_json(self, doc: Any, digest: str) -> bytes:
        return _dumps({"function": self._function, "version": self._version, "key": doc,
                       "sha256": digest}, indent=True)

    def entry(self, *args: P.args, **kwargs: P.kwargs) -> Entry:
        """The entry that holds (or will hold) the result for these arguments."""
        return self._locate(args, kwargs)[0]

    def state(self, *args: P.args, **kwargs: P.kwargs) -> State:
        return self.entry(*args, **kwargs).state()

    def clear(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Remove the entry for these arguments. One whose lease a writer holds live (a
        call computing it now) is refused: IncompleteExistsError naming the holder.
        ``f.entry(...).delete(force=True)`` removes it anyway (see `Entry.delete`)."""
        entry = self.entry(*args, **kwargs)
        # Refused here, not by delete(): its advice would name a force= that clear (whose
        # keywords are the function's) does not have.
        hint = (f"Wait for that writer to commit or for its lease to expire, or remove it "
                f"anyway with {self._name}.entry(...).delete(force=True) (its writer then "
                "never commits)")
        refuse_live_lease(entry, "clearing", hint=hint)
        try:
            # Not forced: a call that took the lease since the look above is refused, not
            # removed under it (forced, its lease went and its result never committed).
            entry.delete()
        except IncompleteExistsError as exc:
            raise IncompleteExistsError(f"{entry.url}: not clearing: a call took its lease "
                                        f"as it was being cleared ({exc}). {hint}",
                                        url=entry.url) from None

    def recompute(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Compute again and replace the stored result (IncompleteExistsError if another
        writer holds the entry's lease)."""
        return self._run(args, kwargs, force=True)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(args, kwargs, force=False)

    # the states --------------------------------------------------------------------------
    def _lease(self, entry: Entry) -> Lease:
        lease = Lease(entry, heartbeat=self._stale_after / 5, stale_after=self._stale_after)
        try:
            lease._require_support()
        except UnsupportedError as exc:
            # The lease's own advice (best_effort=True) names an argument cached does not
            # have: a caller could follow it nowhere. Say what works instead.
            raise UnsupportedError(
                f"{entry.url}: {self._name} cannot be cached here: a call takes the entry's "
                f"writer lease, which needs create-only and conditional writes that the "
                f"{entry.adapter.name} adapter cannot enforce on this store, so two "
                "processes could compute and write one entry at once. Cache on a store that "
                "enforces them (a local disk; S3, GCS and Azure do, some endpoints and "
                "emulators compatible with them do not), or write the entry yourself "
                "with durable.Lease(url, best_effort=True) and "
                "Entry(url).writing(lease=lease)") from exc
        return lease

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], force: bool) -> R:
        entry, doc, digest = self._locate(args, kwargs)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        watch = LeaseWatch(entry, stale_after=self._stale_after)
        known: Marker | None = None  # a marker _wait has just read: not read again
        while True:
            if not force:
                marker, known = known or entry.read_marker(), None
                if marker is not None:
                    return self._load(entry, marker.manifest)
            lease = self._lease(entry)
            if lease.try_acquire():
                return self._compute_leased(entry, self._key_json(doc, digest), lease, args,
                                            kwargs, force, force)
            if force:
                raise IncompleteExistsError(
                    f"{entry.url}: not recomputed: another writer holds its lease "
                    f"({describe(watch.peek())})", url=entry.url)
            # Another writer holds the lease: at work, or dead (stale).
            view = self._wait(entry, watch, deadline)
            if not isinstance(view, LeaseView):
                known = view  # committed (its marker), or released: look again
                continue
            taker = self._lease(entry)
            try:
                taker.take_over(view)
            except IncompleteExistsError:
                continue  # renewed, or another waiter took it: look again
            return self._compute_leased(entry, self._key_json(doc, digest), taker, args,
                                        kwargs, True, force)

    def _compute_leased(self, entry: Entry, key_json: bytes, lease: Lease,
                        args: tuple[Any, ...], kwargs: dict[str, Any], overwrite: bool,
                        force: bool) -> R:
        """`_compute` under ``lease``, released after. A writer that lost its lease
        (paused past ``stale_after``, taken over) never commits, but the writer that took
        it may have: then its result is this call's, as any later call's (it was
        LeaseLostError over a COMPLETE entry). Never for ``recompute`` (``force``): the
        entry may still hold the result it was to replace."""
        try:
            with lease:
                return self._compute(entry, key_json, lease, args, kwargs, overwrite)
        except LeaseLostError:
            marker = None if force else entry.read_marker()
            if marker is None:
                raise
            return self._load(entry, marker.manifest)

    def _wait(self, entry: Entry, watch: LeaseWatch,
              deadline: float | None) -> LeaseView | Marker | None:
        """Watch another writer's lease: None once it is gone, the marker once the entry
        is committed, the stale view for "takeover"; IncompleteExistsError for "raise",
        for an abandoned entry under "wait", and at the deadline."""
        pause = _FIRST_POLL
        for polls in itertools.count(1):
            view = watch.poll()  # one stat per poll
            if view is None:
                return None
            # Now and then, and before any verdict: a writer may have committed and still
            # hold its lease (or have died before releasing it).
            verdict = (self.on_incomplete == "raise" or view.stale
                       or (deadline is not None and time.monotonic() >= deadline))
            if verdict or polls % 8 == 0:
                marker = entry.read_marker()
                if marker is not None:
                    return marker
            if self.on_incomplete == "raise":
                raise IncompleteExistsError(self._held(entry, watch.peek(), view.stale_after),
                                            url=entry.url)
            if view.stale:
                if self.on_incomplete == "wait":
                    raise IncompleteExistsError(self._abandoned(entry, view), url=entry.url)
                return view
            if deadline is not None and time.monotonic() >= deadline:
                raise IncompleteExistsError(
                    f"{entry.url}: still INCOMPLETE after waiting {self.timeout} s; its "
                    f"writer's lease is live ({describe(watch.peek())})", url=entry.url)
            left = math.inf if deadline is None else deadline - time.monotonic()
            time.sleep(max(0.0, min(pause, left)))
            pause = min(pause * 2, _MAX_POLL, self._stale_after / 4)
        raise AssertionError("unreachable")  # pragma: no cover

    def _compute(self, entry: Entry, key_json: bytes, lease: Lease, args: tuple[Any, ...],
                 kwargs: dict[str, Any], overwrite: bool) -> R:
        """Under the held lease: compute, write and commit; the result read back."""
        try:
            return self._write(entry, key_json, lease, args, kwargs, overwrite)
        except _Leftover as left:
            # Leftovers and no lease: a killed writer's whose lease was removed, or one
            # that took none. Abandoned either way.
            if self.on_incomplete != "takeover":
                raise IncompleteExistsError(
                    f"{entry.url} is INCOMPLETE ({left.reason}) and no writer holds its "
                    "lease: a killed writer's leftover, or a writer that takes no lease. "
                    "Pass on_incomplete='takeover' to recompute it, or remove it with "
                    f"{self._name}.clear(...) (`durable clean`) once nothing writes it",
                    url=entry.url) from None
            return self._write(entry, key_json, lease, args, kwargs, True)

    def _write(self, entry: Entry, key_json: bytes, lease: Lease, args: tuple[Any, ...],
               kwargs: dict[str, Any], overwrite: bool) -> R:
        # Computed before an overwrite clears the old result: a computation that fails
        # leaves the result it was to replace, not an ABSENT entry. So is its serializer
        # chosen, and its bytes made where they are one object: a value that cannot be
        # stored (a tuple, an object array) cleared the old result, then failed.
        computed: tuple[R, ...] = (self._func(*args, **kwargs),) if overwrite else ()
        ser = None
        payload = None
        if computed:
            ser = choose(computed[0], name=self._serializer, allow_pickle=self._pickle)
            if isinstance(ser, BytesSerializer):
                payload = ser.encode(computed[0])
        with contextlib.ExitStack() as stack:
            # The state is checked before computing: a leftover stops the run first.
            try:
                # unrecorded="error": an object this writer did not write (a late write of
                # a writer that lost the lease) stops the commit instead of joining it.
                w = stack.enter_context(entry.writing(lease=lease, overwrite=overwrite,
                                                      unrecorded="error"))
            except AlreadyCompleteError:
                return self._load(entry)  # committed between our look and our lease
            except IncompleteExistsError:
                raise _Leftover(entry._status(leased=True).reason) from None
            value = computed[0] if computed else self._func(*args, **kwargs)
            # A computation longer than stale_after, or a pause, may have lost the lease:
            # find out before writing anything.
            lease.check()
            if ser is None:
                ser = choose(value, name=self._serializer, allow_pickle=self._pickle)
            if payload is not None:
                w.write_bytes(f"value.{ser.name}", payload)
            else:
                ser.dump(value, w, f"value.{ser.name}")
            w.write_bytes("key.json", key_json)
            try:
                stack.close()  # the commit
            except AlreadyCompleteError:
                return self._load(entry)  # another writer committed first: its result
        # Committed, and the marker holds what this writer recorded (unrecorded="error"
        # admits nothing else), so it is not read again: the value alone is read back,
        # verified against our records, so the first caller gets what later callers get
        # and a store that kept other bytes than were sent fails here.
        return self._load(entry, Manifest(w.records()))

    def _load(self, entry: Entry, manifest: Manifest | None = None) -> R:
        """The stored result, read verified against ``manifest`` (None: the marker's)."""
        if manifest is None:
            marker = entry.read_marker()
            if marker is None:
                raise IncompleteExistsError(f"{entry.url}: its commit marker went away while "
                                            "it was being read (cleared meanwhile?)",
                                            url=entry.url)
            manifest = marker.manifest
        assert manifest is not None  # read_marker resolves an external manifest
        value: R = load_value(entry, manifest, allow_pickle=self._pickle)
        return value

    # messages ----------------------------------------------------------------------------
    def _held(self, entry: Entry, holder: Mapping[str, Any] | None, stale_after: float) -> str:
        return (f"{entry.url} is INCOMPLETE: a writer holds its lease ({describe(holder)})"
                f"; it is at work, or dead if the lease goes unrenewed for "
                f"{stale_after:g} s. Pass on_incomplete='wait' to wait for its result, "
                "'takeover' to also recompute it if it proves abandoned, or remove it with "
                f"{self._name}.clear(...) (`durable clean`) once nothing writes it")

    def _abandoned(self, entry: Entry, view: LeaseView) -> str:
        return (f"{entry.url} is INCOMPLETE and abandoned: its writer's lease "
                f"({describe(view.holder)}) was not renewed for {view.unchanged_for:.1f} s "
                f"as watched from here (stale after {view.stale_after:g} s). Pass "
                "on_incomplete='takeover' to recompute it, or remove it with "
                f"{self._name}.clear(...) (`durable clean`)")


class BoundCachedFunction:
    """A cached method reached through an instance: the call and the helpers (``entry``,
    ``state``, ``clear``, ``recompute``) take that instance first, as a bound method's
    call does. Pickled as a bound method is (the instance and the method's name)."""

    def __init__(self, function: CachedFunction[..., Any], instance: object) -> None:
        self.__func__ = function
        self.__self__ = instance
        self.__doc__ = function.__doc__

    @property
    def __signature__(self) -> inspect.Signature:
        # As a bound method's: the function's, without the instance's parameter.
        sig = inspect.signature(self.__func__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def entry(self, *args: Any, **kwargs: Any) -> Entry:
        return self.__func__.entry(self.__self__, *args, **kwargs)

    def state(self, *args: Any, **kwargs: Any) -> State:
        return self.__func__.state(self.__self__, *args, **kwargs)

    def clear(self, *args: Any, **kwargs: Any) -> None:
        self.__func__.clear(self.__self__, *args, **kwargs)

    def recompute(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__.recompute(self.__self__, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("__func__", "__self__"):  # not set yet (a copy): no endless lookup
            raise AttributeError(name)
        return getattr(self.__func__, name)  # __name__, __wrapped__, on_incomplete, ...

    def __reduce__(self) -> tuple[Any, ...]:
        return getattr, (self.__self__, self.__func__._name)

    def __eq__(self, other: object) -> bool:  # as bound methods compare: the same instance
        return (isinstance(other, BoundCachedFunction) and other.__func__ is self.__func__
                and other.__self__ is self.__self__)

    def __hash__(self) -> int:
        return hash((id(self.__func__), id(self.__self__)))

    def __repr__(self) -> str:
        return f"<bound {self.__func__!r} of {self.__self__!r}>"


class _Leftover(Exception):
    """Entry.writing() found the entry INCOMPLETE although no other writer holds the lease."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# keys --------------------------------------------------------------------------------------
def _dumps(doc: Any, indent: bool = False) -> bytes:
    return json.dumps(doc, sort_keys=True, ensure_ascii=False, allow_nan=False,
                      indent=1 if indent else None,
                      separators=None if indent else (",", ":")).encode()


def _safe(text: str) -> str:
    return _UNSAFE.sub("_", text).strip(".")[:_MAX_NAME]


def _readable(doc: Any) -> str:
    """The short scalar arguments as ``a=1,b=foo``: a hint for people, the hash decides."""
    items = doc.items() if isinstance(doc, dict) else [("", doc)]
    parts = []
    for name, value in items:
        if isinstance(value, bool | int | float | str) or value is None:
            text = _safe(str(value))[:24]
            parts.append(f"{_safe(name)}={text}" if name else text)
    return ",".join(parts)[:_MAX_NAME].rstrip(",=")


# The keys `_canonical` tags non-JSON values with (and dicts that use one of them).
_TAGS = frozenset({"enum", "float", "set", "bytes", "datetime", "date", "time", "ndarray",
                   "dict", "datetime64", "timedelta64", "timedelta", "Timestamp", "Timedelta",
                   "NaTType", "dataclass"})


def _canonical(value: Any, where: str, depth: int = 0) -> Any:
    """``value`` as plain JSON that is the same for equal arguments in every process.

    Anything else raises TypeError: a key from ``repr`` could differ between processes
    (ids) or be equal for different values, and either is a wrong cache hit or a miss.
    """
    if depth > 50:
        raise TypeError(f"{where}: nested too deep to make a cache key of")
    if isinstance(value, enum.Enum):
        # Before str: a StrEnum member (a str) was keyed as its value, and a call with the
        # plain string got its result (one computed from .name, say).
        cls = type(value)
        return {"enum": _qualified(cls),
                "value": _canonical(value.value, where, depth + 1)}
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        # Every NaN is one key (float("nan"), np.nan, np.float32 and np.float64 NaNs: the
        # same argument to any function); repr() gave NumPy 2's float64 "np.float64(nan)".
        return {"float": "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"}
    if isinstance(value, list | tuple):
        return [_canonical(v, where, depth + 1) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{where}: a dict with keys other than str cannot be a cache key")
        plain = {k: _canonical(v, where, depth + 1) for k, v in value.items()}
        # A dict spelled like a tagged value ({"set": [1, 2]} and the set {1, 2}) would
        # share its entry, and one call would return the other's result: such a dict is
        # tagged itself. Any other dict keeps its plain spelling (and its existing key).
        return {"dict": plain} if _TAGS.intersection(plain) else plain
    if isinstance(value, set | frozenset):
        items = [_canonical(v, where, depth + 1) for v in value]
        return {"set": sorted(items, key=lambda v: _dumps(v))}
    if isinstance(value, bytes | bytearray):
        return {"bytes": hashlib.sha256(value).hexdigest()}
    if isinstance(value, PurePath):
        return os.fspath(value)
    if isinstance(value, _dt.date | _dt.time | _dt.timedelta):
        return _time_key(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Every field, compare=False ones too: a field the dataclass leaves out of its
        # equality may still change the result, and a miss costs less than a wrong hit.
        kind = type(value)
        return {"dataclass": _qualified(kind),
                "fields": {f.name: _canonical(getattr(value, f.name),
                                              f"{where}, field {f.name!r}", depth + 1)
                           for f in dataclasses.fields(value)}}
    ndarray = _numpy_type("ndarray")
    if (ndarray is not None and isinstance(value, ndarray) and type(value) is not ndarray
            and not isinstance(value, _numpy_type("memmap"))):
        # Keyed by its bytes, a subclass shared the plain array's entry: a masked array
        # that of its filled values, np.matrix (whose ** is a matrix power) and a unit
        # carrying array that of its numbers. A memmap is what its bytes say.
        raise TypeError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} "
                        "is an ndarray subclass, whose bytes do not say all it is (a mask, "
                        "a unit, matrix semantics): pass numpy.asarray(...) of it, or key= "
                        "to cached (a function of the same arguments returning what "
                        "identifies the result)")
    if ndarray is not None and isinstance(value, ndarray) and value.dtype.kind != "O":
        data = value.tobytes(order="C")
        # A structured dtype's str is "|V<size>" alone: arrays with other field names (or
        # types of one size) and the same bytes shared an entry. Its descr names them.
        dtype = (value.dtype.str if value.dtype.fields is None
                 else _canonical(value.dtype.descr, where, depth + 1))
        return {"ndarray": {"dtype": dtype, "shape": list(value.shape),
                            "sha256": hashlib.sha256(data).hexdigest()}}
    generic = _numpy_type("generic")
    if generic is not None and isinstance(value, generic):
        if isinstance(value, _numpy_type("timedelta64") | _numpy_type("datetime64")):
            return _numpy_time_key(value, where, depth)
        return _canonical(value.item(), where, depth + 1)
    raise TypeError(f"{where}: a {type(value).__module__}.{type(value).__qualname__} "
                    "cannot be made into a cache key; pass key= to cached (a function of "
                    "the same arguments returning what identifies the result)")


def _qualified(obj: Any) -> str:
    """``module.qualname`` of a function or class, the same in every process: a script's
    are __main__'s in the script and __mp_main__'s in the workers multiprocessing spawns
    from it (its functions' results, or the keys of its enums and dataclasses, were
    computed and stored twice). And another script's are not: named __main__'s, the
    ``tokenize`` of prep_v1.py and of prep_v2.py shared entries under one root, and one
    returned the other's results. A script is named by its file (``prep_v1.py``), one run
    with ``python -m`` by its module; __main__ stays for what has neither (a notebook)."""
    module = obj.__module__
    if module in ("__main__", "__mp_main__"):
        main = sys.modules.get(module)
        spec = getattr(main, "__spec__", None)
        file = getattr(main, "__file__", None)
        if spec is not None and spec.name not in ("__main__", "__mp_main__"):
            module = spec.name
        elif isinstance(file, str):
            module = os.path.basename(file)
        else:
            module = "__main__"
    return f"{module}.{obj.__qualname__}"


def _time_key(value: _dt.date | _dt.time | _dt.timedelta) -> dict[str, str]:
    """A date, time, datetime or timedelta (or pandas' Timestamp, NaT, Timedelta) tagged
    by its type, in a spelling that tells every value of that type apart.

    The tag is one of `_TAGS`, never a type's own name: a subclass named like nothing
    reserved ({"FakeDatetime": ...}) was a dict argument's key too. Another subclass
    (freezegun's, pendulum's) is keyed as the standard type it derives from, by that
    type's own spelling of its fields.
    """
    pandas = sys.modules.get("pandas")
    if pandas is not None:
        if isinstance(value, pandas.Timestamp):  # nanoseconds are in its isoformat
            return {"Timestamp": value.isoformat()}
        if value is pandas.NaT:
            return {"NaTType": "NaT"}
        if isinstance(value, pandas.Timedelta):  # ISO 8601, to the nanosecond
            return {"Timedelta": value.isoformat()}
    if isinstance(value, _dt.timedelta):
        return {"timedelta": _dt.timedelta.__str__(value)}  # days, seconds, microseconds
    if isinstance(value, _dt.datetime):  # before date: a datetime is a date
        return {"datetime": _dt.datetime.isoformat(value)}
    if isinstance(value, _dt.date):
        return {"date": _dt.date.isoformat(value)}
    return {"time": _dt.time.isoformat(value)}


def _numpy_time_key(value: Any, where: str, depth: int) -> Any:
    """A NumPy datetime64 or timedelta64: as the Python value it holds (a `date` in days,
    a `datetime` in minutes to microseconds), else tagged with NumPy's spelling, exact to
    its unit. So one instant in units that hold different values keys apart (a miss,
    never another value's result)."""
    numpy = sys.modules["numpy"]
    unit, steps = numpy.datetime_data(value.dtype)
    count = int(value.astype(numpy.int64))
    tag = type(value).__name__
    if not numpy.isnat(value) and abs(count * steps * (7 if unit == "W" else 1)) > 2**62:
        # NumPy's own str() and .item() overflow past here (a count of weeks or of 10 days
        # turned into days): 2**62 weeks printed as -2**62 days, and .item() of 2**63-1
        # 10-day steps was date(1969, 12, 22), another instant's key. The count and its
        # unit, in a spelling NumPy's never is.
        return {tag: f"{count} * {steps}{unit}"}
    item = value.item()
    if tag == "timedelta64" or item is None or isinstance(item, int):
        # .item() of a datetime64 in ns (or NaT) is an int (None), the key of another
        # argument; of a timedelta64 an int or a timedelta, which no key takes.
        return {tag: str(value)}
    return _canonical(item, where, depth + 1)


def _numpy_type(name: str) -> Any:
    numpy = sys.modules.get("numpy")
    return getattr(numpy, name, None) if numpy is not None else None
