"""The ``durable`` command line: the state of entries on any store fsspec reaches.

Commands::

    durable status URL [--json]          one entry's state, its reason and its marker
    durable verify URL|ROOT [--deep] [--json]
                                         every object against the manifest (sizes;
                                         CRC32C too with --deep): one entry, or every
                                         entry with a marker under ROOT, in parallel
    durable scan ROOT [--json] [--fail-on-incomplete]
                                         every entry under ROOT, from one listing: state,
                                         size, objects, age, the writer holding its lease
    durable mark-complete ROOT [--apply] [--json]
                                         adopt data written before durable (TRUSTS it)
    durable clean ROOT --older-than AGE [--apply] [--lease-wait SECONDS] [--all-uploads]
                                         remove what dead durable writers left behind

URL and ROOT are local paths or fsspec URLs (``file://``, ``s3://``, ``gs://``, ``az://``,
``memory://``...). Options that every command takes, before or after its name:

- ``--storage-options JSON``: fsspec ``storage_options`` (a JSON object);
- ``-o KEY=VALUE`` (repeatable): one storage option; VALUE is read as JSON when it parses
  (``-o anon=true``), else taken as a string;
- ``--debug``: show the traceback of an error.

The environment variable ``DURABLE_STORAGE_OPTIONS`` (a JSON object) gives defaults;
``--storage-options`` overrides its keys, and ``-o`` overrides both.

Progress bars go to stderr, only when it is a terminal and never with ``--json``.

Exit codes:

=== ===================================================================================
0   COMPLETE (status); every object matches (verify: of one entry, or of at least one
    entry under a ROOT); the command ran (scan, mark-complete, clean; a dry run included)
1   an error: a marker that cannot be trusted, an I/O error, anything unexpected
2   usage error: a bad option or argument (click's)
3   INCOMPLETE (status, verify of one entry); verify of a ROOT that verified nothing:
    none of its entries has a commit record; scan with --fail-on-incomplete: some entry
    not COMPLETE
4   ABSENT (status, verify of one entry); verify of a ROOT with no entry under it
5   verify found objects that do not match the manifest
6   mark-complete --apply / clean --apply: some items failed (each listed with its
    error); the others were done
130 interrupted (Ctrl-C): what an --apply had done stays done; a rerun does the rest
=== ===================================================================================

Errors are one line on stderr, ``durable: error: ...`` (a traceback only with --debug).

JSON (``--json``): one document on stdout; on an error (exit 1 or 2) stdout is empty.

status::

    {"url": str, "entry": str, "state": "ABSENT" | "INCOMPLETE" | "COMPLETE", "reason": str,
     "marker": null | {"kind": "prefix" | "object", "attempt": str, "committed_at": str,
                       "writer": {...}, "objects": int, "total_size": int,
                       "format_version": int}}

verify (``state`` is null when a marker was read and the objects were checked; else the
entry's state, and nothing was verified)::

    {"url": str, "deep": bool, "ok": bool, "state": null | "ABSENT" | "INCOMPLETE",
     "reason": str, "objects": int, "bytes_checked": int,
     "problems": [{"key": str, "url": str,
                   "issue": "missing" | "size" | "crc32c" | "unexpected" | "unreadable",
                   "expected": ..., "found": ...}]}

verify of a ROOT (every entry with a marker under it; ``results`` as above, one per
entry; an unreadable marker is a problem with issue "unreadable"; ``state`` is null when
some entry was verified, "INCOMPLETE" when none has a commit record, "ABSENT" when there
is no entry at all, and then ``ok`` is false)::

    {"root": str, "deep": bool, "ok": bool, "state": null | "INCOMPLETE" | "ABSENT",
     "entries": int, "failed": int, "objects": int, "bytes_checked": int,
     "results": [...], "not_verified": [{"url": str, "reason": str}],
     "not_verified_objects": int}

scan (``state`` "ERROR": the marker could not be read or trusted; ``reason`` says why;
``age`` in seconds, measured from ``age_source`` by ``age_clock``'s clock: the writer's
for "committed_at"/"started_at", the store's for "object mtime"/"records mtime")::

    {"root": str, "counts": {"COMPLETE": int, "INCOMPLETE": int, "ERROR": int},
     "entries": [{"url": str, "state": "COMPLETE" | "INCOMPLETE" | "ERROR",
                  "reason": str, "objects": int, "size": int,
                  "attempt": str | null, "committed_at": str | null,
                  "age": float | null, "age_source": str | null,
                  "age_clock": "writer" | "store" | null,
                  "lease": null | {"holder", "host", "pid", "acquired_at", "heartbeat",
                                   "stale_after", "file_age": float | null,
                                   "error": str (only for a lease that cannot be read)}}]}

mark-complete (``status`` "planned" in a dry run)::

    {"root": str, "apply": bool, "trust": str, "marked": int,
     "counts": {"planned" | "adopted" | "skipped" | "failed": int},
     "entries": [{"url": str, "status": "planned" | "adopted" | "skipped" | "failed",
                  "reason": str, "objects": int, "size": int}],
     "skipped": [{"url": str, "reason": str}]}

clean (``items``: what is removed, or would be in a dry run; ``kept``: leftovers of
durable writers left alone, and why)::

    {"root": str, "apply": bool, "older_than": float, "lease_wait": float, "waited": float,
     "counts": {"planned" | "removed" | "skipped" | "failed": int},
     "items": [{"kind": "entry" | "records" | "spent" | "temp" | "upload", "url": str,
                "status": "planned" | "removed" | "skipped" | "failed", "reason": str,
                "detail": str, "age": float | null, "objects": int, "size": int}],
     "kept": [{"url": str, "reason": str}]}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Literal, NoReturn, TypeVar

import click
from rich.console import Console
from rich.filesize import decimal
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from durable._checks import Status, VerifyReport
from durable._entry import Entry
from durable._errors import DurableError, IncompleteError
from durable._nesting import nearest_marked
from durable._ops import (
    TRUST,
    AdoptReport,
    CleanReport,
    RootVerifyReport,
    Ticker,
    apply_clean,
    fmt_age,
    mark_complete_root,
    own_records,
    plan_clean,
    verify_root,
)
from durable._protocol import RECORDS_DIR, Layout, State, carries_record
from durable._scan import (
    Records,
    ScanRow,
    Survey,
    holds_records,
    is_lock_sidecar,
    mismatch_reason,
    scan_survey,
    size_mismatches,
    survey,
)
from durable._version import __version__
from durable.adapters import Adapter, resolve
from durable.adapters.base import ObjectInfo

__all__ = ["cli", "main"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
EXIT_ABSENT = 4
EXIT_MISMATCH = 5
EXIT_PARTIAL = 6
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C
ENV_OPTIONS = "DURABLE_STORAGE_OPTIONS"

_STATE_EXIT = {State.COMPLETE: EXIT_OK, State.INCOMPLETE: EXIT_INCOMPLETE,
               State.ABSENT: EXIT_ABSENT}
_STYLE = {"COMPLETE": "green", "INCOMPLETE": "yellow", "ABSENT": "dim", "ERROR": "bold red"}
_EPILOG = """\b
Exit codes:
  0  COMPLETE / verified / scan, mark-complete, clean done (dry runs too)
  1  error (untrustworthy marker, I/O, unexpected)
  2  usage error
  3  INCOMPLETE (scan: with --fail-on-incomplete, some entry not COMPLETE;
     verify ROOT: no entry under it has a commit record, nothing verified)
  4  ABSENT (verify ROOT: no entry under it)
  5  verify found mismatches
  6  mark-complete/clean --apply: some items failed (listed); the rest done
130  interrupted (Ctrl-C)
\b
Storage options: DURABLE_STORAGE_OPTIONS (JSON), then --storage-options JSON,
then -o KEY=VALUE, each overriding the keys of the one before.
"""

F = TypeVar("F", bound=Callable[..., Any])


# options every command takes ------------------------------------------------------------
# They are accepted on the group and on each command; ctx.meta is shared by both contexts.
def _keep_json(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.meta.setdefault("durable.json", []).append(
            _options_json(value, f"--{param.name}".replace("_", "-")))


def _keep_pairs(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> None:
    for pair in value:
        key, eq, raw = pair.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", ctx, param)
        try:
            parsed: Any = json.loads(raw)
        except (ValueError, RecursionError):  # nested too deeply: not JSON to take
            parsed = raw
        ctx.meta.setdefault("durable.pairs", []).append((key, parsed))


def _keep_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta["durable.debug"] = True


def _common(f: F) -> F:
    f = click.option("--storage-options", "storage_options", metavar="JSON",
                     expose_value=False, callback=_keep_json,
                     help="fsspec storage_options as a JSON object.")(f)
    f = click.option("-o", "option", metavar="KEY=VALUE", multiple=True, expose_value=False,
                     callback=_keep_pairs, help="One storage option (repeatable).")(f)
    f = click.option("--debug", is_flag=True, expose_value=False, callback=_keep_debug,
                     help="Show tracebacks of errors.")(f)
    return f


def _options_json(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        # RecursionError: nested too deeply. Raised while click parses options, outside
        # the command's error handling: it was a bare traceback.
        raise click.UsageError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise click.UsageError(f"{where}: must be a JSON object, got {type(value).__name__}")
    return value


def merge_storage_options(env: str | None, documents: Sequence[dict[str, Any]],
                          pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The environment's options, then each --storage-options, then each -o, merged."""
    merged: dict[str, Any] = {}
    if env:
        merged.update(_options_json(env, ENV_OPTIONS))
    for doc in documents:
        merged.update(doc)
    merged.update(pairs)
    return merged


def storage_options(ctx: click.Context) -> dict[str, Any]:
    return merge_storage_options(os.environ.get(ENV_OPTIONS), ctx.meta.get("durable.json", []),
                                 ctx.meta.get("durable.pairs", []))


def _entry(ctx: click.Context, url: str) -> Entry:
    try:
        entry = Entry(url, storage_options=storage_options(ctx))
    except ValueError as exc:
        # An unknown protocol, or a path with no parent to hold a marker: a bad argument.
        raise click.BadParameter(str(exc), ctx, param_hint="URL") from None
    _refuse_records(ctx, entry.adapter, entry.path, "URL")
    return entry


def _committed_ancestor(adapter: Adapter, path: str) -> str | None:
    """The URL of a committed entry that holds ``path`` (one stat per level above it)."""
    parent = path.rstrip("/").rpartition("/")[0]
    while parent.strip("/") and "/" in parent.strip("/"):
        try:
            marker = Layout(parent).marker
        except ValueError:
            return None
        if adapter.info(marker) is not None:
            return adapter.url(parent)
        parent = parent.rpartition("/")[0]
    return None


def _resolve(ctx: click.Context, url: str, hint: str = "ROOT") -> tuple[Adapter, str]:
    try:
        adapter, path = resolve(url, storage_options(ctx))
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param_hint=hint) from None
    _refuse_records(ctx, adapter, path, hint)
    return adapter, path


def _refuse_records(ctx: click.Context, adapter: Adapter, path: str, hint: str) -> None:
    if RECORDS_DIR in path.rstrip("/").split("/"):
        # Markers, attempt records and leases: durable's own, never data or an entry to
        # scan, adopt, clean or ask the state of (give the directory that holds the
        # records dir).
        raise click.BadParameter(
            f"{adapter.url(path)} is in a records directory ({RECORDS_DIR}), durable's "
            "own: give the directory that holds it, or the entry itself", ctx,
            param_hint=hint)


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> float:
    """``90s``, ``30m``, ``2h``, ``3d``, ``1w`` (or ``0``) -> seconds; ValueError if not."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smhdw]?)\s*", text)
    # A bare number is refused (is "3" minutes or days?), except 0, which is 0 in any unit.
    if m is None or (not m[2] and float(m[1]) != 0):
        raise ValueError(f"{text!r} is not an age like 90s, 30m, 2h, 3d or 1w")
    return float(m[1]) * _AGE_UNITS[m[2] or "s"]


def _age_option(ctx: click.Context, param: click.Parameter, value: str) -> float:
    try:
        return parse_age(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


# errors ---------------------------------------------------------------------------------
#: Client libraries that log an error's traceback themselves (gcsfs: "_request out of
#: retries") before raising it: shown only with --debug, else the error is one line.
_CHATTY = ("gcsfs", "s3fs", "aiobotocore", "botocore", "adlfs", "azure", "urllib3", "fsspec")


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        # Judged as each record comes: --debug is parsed after this point.
        def shown(record: logging.LogRecord) -> bool:
            return bool(ctx.meta.get("durable.debug"))

        loggers = [logging.getLogger(name) for name in _CHATTY]
        for logger in loggers:
            logger.addFilter(shown)
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit,
                click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            # click's own answer is "Aborted!" and 1, the code of an error: a script
            # could not tell an operator's Ctrl-C from a store that failed.
            click.echo("durable: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except Exception as exc:
            if ctx.meta.get("durable.debug"):
                raise
            _fail(exc)
        finally:
            for logger in loggers:
                logger.removeFilter(shown)


def _fail(exc: Exception) -> NoReturn:
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, DurableError | OSError | ImportError | ValueError):
        line = f"durable: error: {message}"
    else:
        line = (f"durable: unexpected error: {type(exc).__name__}: {message} "
                "(--debug shows the traceback)")
    click.echo(_printable(line), err=True)
    sys.exit(EXIT_ERROR)


# output ---------------------------------------------------------------------------------
def _entries(n: int) -> str:
    """ "1 entry", "2 entries": the summaries read "1 entries under ..." otherwise."""
    return f"{n} entry" if n == 1 else f"{n} entries"


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # The reader went away (`durable scan ROOT | head`): the rest goes nowhere and the
        # exit code stays the command's, as with --json. rich's own exits 1 ("an error"),
        # silently: under `set -o pipefail` an OK verify or scan read as a failure.
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _console() -> Console:
    # Piped output is never wrapped: a URL cut in two lines is useless to grep or cut.
    tty = sys.stdout.isatty()
    return _Console(file=sys.stdout, highlight=False, width=None if tty else 100_000)


# C0 and C1 controls (ESC starts a terminal escape sequence) and the bidi overrides that
# reorder what a terminal shows: spelt out, never sent to the terminal.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _printable(value: str) -> str:
    """``value`` with control characters written as escapes (``\\x1b``): names, reasons
    and marker fields come from the store (an object's name, a hostile or corrupt record)
    and must not clear, recolour or rewrite the screen of whoever runs the command."""
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], value)


def _text(value: str, style: str = "") -> Text:
    return Text(_printable(value), style=style)


def _emit_json(doc: dict[str, Any]) -> None:
    click.echo(json.dumps(doc, indent=2))


def _state_text(state: str) -> Text:
    return Text(state, style=_STYLE.get(state, ""))


def _size(n: int) -> str:
    return f"{n} B" if n < 1000 else f"{n} B ({decimal(n)})"


@contextlib.contextmanager
def _progress(enabled: bool, description: str, *, bar: bool) -> Iterator[Progress]:
    """A progress display on stderr: off when stderr is not a terminal, or with --json."""
    show = enabled and sys.stderr.isatty()
    counted = (BarColumn(), MofNCompleteColumn()) if bar else ()
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), *counted,
                        TimeElapsedColumn(), console=Console(file=sys.stderr),
                        transient=True, disable=not show)
    with progress:
        progress.add_task(description, total=None)
        yield progress


@contextlib.contextmanager
def _ticking(enabled: bool, description: str) -> Iterator[Ticker]:
    """A progress bar (see _progress) driven by ``tick(what, done, total)``."""
    with _progress(enabled, description, bar=True) as progress:
        task = progress.tasks[0].id

        def tick(what: str, done: int, total: int | None) -> None:
            progress.update(task, description=what, completed=done, total=total)

        yield tick


def _counts(statuses: Sequence[str], order: Sequence[str]) -> dict[str, int]:
    return {s: sum(x == s for x in statuses) for s in order}


def _age_text(age: float | None) -> str:
    return "-" if age is None else fmt_age(age)


# commands -------------------------------------------------------------------------------
@click.group(cls=_Group, epilog=_EPILOG, context_settings={"help_option_names": ["-h",
                                                                                 "--help"]})
@click.version_option(__version__, prog_name="durable")
@_common
def cli() -> None:
    """Inspect entries written with durable: their state, their data, a whole tree."""


def status_doc(entry: Entry, st: Status, holder: Entry | None = None) -> dict[str, Any]:
    """``holder``: the entry whose state ``st`` is, where that is not ``entry`` itself."""
    marker = None
    if st.marker is not None:
        m = st.marker
        assert m.manifest is not None
        marker = {"kind": m.kind, "attempt": m.attempt, "committed_at": m.committed_at,
                  "writer": dict(m.writer), "objects": len(m.manifest),
                  "total_size": m.manifest.total_size, "format_version": m.version}
    return {"url": entry.url, "entry": (holder or entry).url, "state": st.state.value,
            "reason": st.reason, "marker": marker}


def _listed(entry: Entry, st: Status) -> Status:
    """A COMPLETE entry's state checked against one listing of it, as `scan` judges it.

    `Entry.status()` stats the manifest's first and last objects only: an object between
    them truncated or deleted after the commit was COMPLETE here (exit 0) and INCOMPLETE
    in `scan` of the same entry."""
    marker = st.marker
    if st.state is not State.COMPLETE or marker is None or marker.kind != "prefix":
        return st
    assert marker.manifest is not None
    keys = sorted(marker.manifest.objects)
    bad = size_mismatches(entry.adapter, marker, entry._listing(marker), keys,
                          [entry._object_path(k, marker) for k in keys])
    if not bad:
        return st
    return Status(State.INCOMPLETE, mismatch_reason(bad, len(marker.manifest)), marker)


def _part_of(entry: Entry, st: Status) -> tuple[Entry, Status] | None:
    """For a path with no records of its own (an object or folder inside an entry, or one
    that should be): the entry above it that holds it, and the state to report. An object
    its manifest lists is stat-ed (one request): missing or of another size, INCOMPLETE;
    else, as a folder the manifest lists, the entry's own state. None if no entry above
    it has a marker, or the path is absent and not in the manifest."""
    if st.state is State.COMPLETE or st.marker is not None:
        return None
    parent = entry.path.rstrip("/").rpartition("/")[0]
    found = nearest_marked(entry.adapter, parent) if parent else None
    if found is None or found[1].kind != "prefix":
        return None
    holder, marker, _ = found
    key = entry.path.rstrip("/")[len(holder.path.rstrip("/")) + 1:]
    assert marker.manifest is not None
    objects = marker.manifest.objects
    if key in objects:
        want = objects[key].size
        info = entry.adapter.info(entry.path)
        if info is None:
            return holder, Status(State.INCOMPLETE, f"{entry.url} is recorded in the entry "
                                                    f"{holder.url} with {want} bytes, and "
                                                    "missing", marker)
        if info.size != want:
            return holder, Status(State.INCOMPLETE, f"{entry.url} is {info.size} bytes, the "
                                                    f"entry {holder.url} recorded {want}",
                                  marker)
    elif not any(k.startswith(f"{key}/") for k in objects):
        if st.state is State.ABSENT:
            return None
        return holder, Status(State.INCOMPLETE, f"inside the entry {holder.url} but not in "
                                                "its manifest: not part of what it "
                                                "committed", marker)
    held = _listed(holder, holder.status())
    return holder, Status(held.state, f"part of the entry {holder.url}, which is "
                                      f"{held.state}: {held.reason}", held.marker)


@cli.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@_common
@click.pass_context
def status(ctx: click.Context, url: str, as_json: bool) -> None:
    """The state of the entry at URL: ABSENT, INCOMPLETE or COMPLETE, and why.

    A committed entry is listed once and every object of its manifest compared by size,
    as scan does: one truncated or deleted after the commit makes it INCOMPLETE.

    URL inside an entry (one of its objects or folders): the state of that entry if URL is
    in its manifest (an object of it also stat-ed: INCOMPLETE if missing or of another
    size), INCOMPLETE if it is not."""
    entry = _entry(ctx, url)
    st = _listed(entry, entry.status())
    holder, st = _part_of(entry, st) or (None, st)
    if (holder is None and st.state is State.INCOMPLETE and st.marker is None
            and holds_records(entry.adapter, entry.path)):
        # A folder of entries (`status ROOT`) read as one entry written without durable:
        # "data present but no commit marker" alone sent operators to mark-complete it.
        st = Status(State.INCOMPLETE, f"{st.reason}; entries with records of their own "
                                      f"are inside it: a root? (`durable scan {url}` lists "
                                      "them)", None)
    elif (holder is None and st.state is State.INCOMPLETE and st.marker is None
          and _carries_records_below(entry)):
        # A folder uploaded object by object (durable::'s put): their records are in their
        # metadata, which no listing shows; `verify` of it said OK, `status` only "no
        # commit marker", as for data written without durable.
        st = Status(State.INCOMPLETE, f"{st.reason}; objects carrying records of their "
                                      f"own are inside it: a root? (`durable scan {url}` "
                                      "lists them)", None)
    doc = status_doc(entry, st, holder)
    if as_json:
        _emit_json(doc)
    else:
        lines = [("url", _text(doc["url"]))]
        if holder is not None:
            lines.append(("entry", _text(doc["entry"])))
        lines += [("state", _state_text(doc["state"])), ("reason", _text(doc["reason"]))]
        if (m := doc["marker"]) is not None:
            # A record kept in an object's own metadata names no writer: an empty line
            # read as a writer that left no trace.
            writer = (" ".join(f"{k}={v}" for k, v in m["writer"].items())
                      or "not recorded")
            lines += [(label, _text(value)) for label, value in (
                ("attempt", m["attempt"]), ("committed_at", m["committed_at"]),
                ("writer", writer), ("kind", m["kind"]), ("objects", str(m["objects"])),
                ("total_size", _size(m["total_size"])))]
        console = _console()
        for label, value in lines:
            console.print(Text.assemble((f"{label:<14}", "bold"), value))
    ctx.exit(_STATE_EXIT[st.state])


def verify_doc(report: VerifyReport) -> dict[str, Any]:
    checked = "sizes and CRC32C" if report.deep else "sizes"
    if report.ok:
        reason = f"all {report.objects} objects match the manifest ({checked})"
    else:
        n = len(report.problems)
        reason = (f"{n} problem{'' if n == 1 else 's'} with the {report.objects} objects of "
                  f"the manifest ({checked} checked)")
    return {"url": report.url, "deep": report.deep, "ok": report.ok, "state": None,
            "reason": reason, "objects": report.objects, "bytes_checked": report.bytes_checked,
            "problems": [{"key": p.key, "url": p.url, "issue": p.issue,
                          "expected": p.expected, "found": p.found}
                         for p in report.problems]}


def _carries_records_below(entry: Entry) -> bool:
    """Whether objects under the unmarked ``entry`` carry records in their own metadata
    (S3, GCS, Azure), which no listing shows: a HEAD of each of its first
    `_RECORDS_LOOK` objects, enough for a folder uploaded object by object, where every
    one does, and a bounded cost for a legacy folder, where none does."""
    adapter = entry.adapter
    if not adapter.capabilities.object_records:
        return False
    first = sorted(info.path for info in adapter.list(entry.path).values())[:_RECORDS_LOOK]
    with ThreadPoolExecutor(max(1, len(first))) as pool:
        return any(info is not None and carries_record(info.record)
                   for info in pool.map(adapter.info, first))


_RECORDS_LOOK = 4


_WORKERS = click.option("--workers", type=click.IntRange(1, 256), default=16,
                        show_default=True, help="Requests in flight at once.")


def _root_or_entry(ctx: click.Context, url: str) -> tuple[Survey, dict[str, Records]] | None:
    """A survey of URL if it is a root (durable records below it, no marker of its own),
    with the records already read; or None if URL is to be verified as one entry (with a
    marker, or none anywhere)."""
    adapter, path = _resolve(ctx, url, "URL")
    try:
        layout: Layout | None = Layout(path)
    except ValueError:
        layout = None  # a bucket or file-system root: never an entry
    if layout is not None and adapter.info(layout.marker) is not None:
        return None
    listing = adapter.list(path)
    if layout is None or any(RECORDS_DIR in k.split("/")[:-1] and not is_lock_sidecar(k)
                             for k in listing):
        return survey(adapter, path, listing=listing), {}
    if not listing or not adapter.capabilities.object_records:
        return None  # no entry below: URL is an entry that is INCOMPLETE or ABSENT
    # No sidecar records below, but objects under URL may carry their own record in their
    # metadata (atomic_write on S3, GCS, Azure), which a listing does not show: then URL is
    # a root of such entries, not one INCOMPLETE entry (one HEAD per object, reused).
    sv = survey(adapter, path, listing=listing)
    records = own_records(sv)
    if not any(r.marker is not None for r in records.values()):
        return None
    return sv, records


@cli.command()
@click.argument("url")
@click.option("--deep", is_flag=True,
              help="Read every object and compare its CRC32C (not only its size).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@_WORKERS
@_common
@click.pass_context
def verify(ctx: click.Context, url: str, deep: bool, as_json: bool, workers: int) -> None:
    """Check the entry at URL, or every entry under URL, against its manifest.

    URL is one entry when it has a commit marker, or when no durable records lie below
    it (then it is INCOMPLETE or ABSENT: exit 3 or 4). Otherwise it is a ROOT, and every
    entry under it with a marker is verified, in parallel; entries without one are listed
    as not verified. On S3, GCS and Azure, an object may carry its record in its own
    metadata (atomic_write), which no listing shows: with no records below URL, each
    object under it in a folder without records is stat-ed (one HEAD each), and one
    carrying a record makes URL a ROOT, that object an entry of its own. Every mismatch is
    listed by object, with what the manifest expected and what was found; any mismatch
    exits 5. A ROOT where nothing could be verified exits 3 (entries, none with a commit
    record) or 4 (no entry at all), never 0.
    """
    root = _root_or_entry(ctx, url)
    if root is not None:
        _verify_root(ctx, *root, deep, as_json, workers)
    entry = _entry(ctx, url)
    try:
        with _progress(not as_json, f"verifying {entry.url}", bar=False):
            report = entry.verify(deep, raise_errors=False)
    except IncompleteError as exc:
        state = exc.state if isinstance(exc.state, State) else State.INCOMPLETE
        reason = str(exc)
        part = _part_of(entry, entry.status())
        if part is not None:
            # An object or folder of an entry: `status` answers for it, `verify` does not.
            reason += (f"; it lies inside the entry {part[0].url}: verify that entry, or "
                       "read the object with durable.read_verified")
        doc = {"url": entry.url, "deep": deep, "ok": False, "state": state.value,
               "reason": reason, "objects": 0, "bytes_checked": 0, "problems": []}
        if as_json:
            _emit_json(doc)
        else:
            _console().print(_state_text(state.value), _text(f"not verified: {reason}"))
        ctx.exit(_STATE_EXIT[state])
    doc = verify_doc(report)
    if as_json:
        _emit_json(doc)
    else:
        console = _console()
        console.print(_text(f"{report.url}: {doc['reason']}"),
                      _text("OK", style="green") if report.ok else _text("FAILED", style="red"))
        if report.problems:
            table = Table("object", "issue", "expected", "found")
            for p in report.problems:
                table.add_row(_text(p.key or p.url), _text(p.issue), _text(_show(p.expected)),
                              _text(_show(p.found)))
            console.print(table)
    ctx.exit(EXIT_OK if report.ok else EXIT_MISMATCH)


def _show(value: Any) -> str:
    return "-" if value is None else str(value)


def _root_state(report: RootVerifyReport) -> State | None:
    """None if some entry was verified; else what the root is, to a verify: nothing under
    it has a commit record (INCOMPLETE) or there is nothing (ABSENT)."""
    if report.reports:
        return None
    return State.INCOMPLETE if report.not_verified else State.ABSENT


def root_verify_doc(report: RootVerifyReport) -> dict[str, Any]:
    state = _root_state(report)
    return {"root": report.root, "deep": report.deep, "ok": report.ok,
            "state": None if state is None else state.value,
            "entries": len(report.reports), "failed": sum(not r.ok for r in report.reports),
            "objects": sum(r.objects for r in report.reports),
            "bytes_checked": sum(r.bytes_checked for r in report.reports),
            "results": [verify_doc(r) for r in report.reports],
            "not_verified": [asdict(n) for n in report.not_verified],
            "not_verified_objects": report.not_verified_objects}


def _verify_root(ctx: click.Context, sv: Survey, records: dict[str, Records], deep: bool,
                 as_json: bool, workers: int) -> NoReturn:
    with _ticking(not as_json, f"verifying {sv.adapter.url(sv.path)}") as tick:
        report = verify_root(sv, deep=deep, workers=workers, progress=tick, records=records)
    doc = root_verify_doc(report)
    state = _root_state(report)
    if as_json:
        _emit_json(doc)
    elif state is not None:
        # Nothing was checked: say what is there, never "OK".
        found = (f"no entry under it has a commit record; {len(report.not_verified)} "
                 f"entries without one ({report.not_verified_objects} objects), not verified"
                 if report.not_verified else "no entries under it")
        _console().print(_state_text(state.value),
                         _text(f"nothing verified under {doc['root']}: {found}"))
    else:
        console = _console()
        failed = [r for r in report.reports if not r.ok]
        if failed:
            table = Table("entry", "object", "issue", "expected", "found")
            for r in failed:
                for p in r.problems:
                    table.add_row(_text(r.url), _text(p.key or p.url), _text(p.issue),
                                  _text(_show(p.expected)), _text(_show(p.found)))
            console.print(table)
        checked = "sizes and CRC32C" if deep else "sizes"
        summary = (f"{_entries(doc['entries'])} under {doc['root']} verified ({checked}): "
                   f"{doc['entries'] - doc['failed']} matching, {doc['failed']} with "
                   "mismatches")
        if report.not_verified:
            summary += (f"; {len(report.not_verified)} without a marker "
                        f"({report.not_verified_objects} objects), not verified")
        console.print(_text(summary), _text("OK", style="green") if report.ok
                      else _text("FAILED", style="red"))
    if state is not None:
        ctx.exit(_STATE_EXIT[state])
    ctx.exit(EXIT_OK if report.ok else EXIT_MISMATCH)


def scan_doc(root: str, rows: Sequence[ScanRow],
             temps: dict[str, ObjectInfo] | None = None) -> dict[str, Any]:
    counts = {"COMPLETE": 0, "INCOMPLETE": 0, "ERROR": 0}
    for row in rows:
        counts[row.state] += 1
    found = list((temps or {}).values())
    return {"root": root, "counts": counts, "entries": [r.to_json() for r in rows],
            "temp_files": {"count": len(found), "bytes": sum(i.size for i in found)}}


@cli.command("scan")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option("--fail-on-incomplete", is_flag=True,
              help="Exit 3 if any entry is not COMPLETE (INCOMPLETE or ERROR).")
@_WORKERS
@_common
@click.pass_context
def scan_cmd(ctx: click.Context, root: str, as_json: bool, fail_on_incomplete: bool,
             workers: int) -> None:
    """Every entry under ROOT: state, size, objects, age, and the writer holding its lease.

    One listing of ROOT, then one small read per marker, per attempt record of an
    unmarked entry and per lease file: never a request per object, except on S3, GCS
    and Azure one HEAD per object of an unmarked folder (objects written by atomic_write
    carry their commit record in their metadata, which no listing shows: each such
    object is an entry of its own, as a file with its marker is on a disk). Ages are
    measured from the marker's committed_at (COMPLETE), the newest attempt's started_at
    (a writer's clock), or else the newest object's modification time (the store's
    clock).
    """
    adapter, path = _resolve(ctx, root)
    with _ticking(not as_json, f"listing {root}") as tick:
        sv = survey(adapter, path)
        rows = scan_survey(sv, workers=workers,
                           progress=lambda done, total: tick("reading records", done, total))
    doc = scan_doc(root, rows, sv.temps)
    if as_json:
        _emit_json(doc)
    else:
        console = _console()
        if rows:
            table = Table("state", "objects", "size", "age", "lease", "url", "reason")
            for r in rows:
                table.add_row(_state_text(r.state), str(r.objects), _size(r.size),
                              _age_text(r.age), _text(_holder(r.lease)), _text(r.url),
                              _text(r.reason))
            console.print(table)
        summary = ", ".join(f"{n} {s}" for s, n in doc["counts"].items() if n)
        console.print(_text(f"{_entries(len(rows))} under {root}" +
                           (f": {summary}" if summary else "")))
        temps = doc["temp_files"]
        if temps["count"]:
            # No entry's: left by a write that never finished (a killed atomic_write or
            # writer), which no row shows, and which can hold gigabytes.
            console.print(_text(
                f"{temps['count']} temp files ({_size(temps['bytes'])}) left by writes that "
                f"never finished: `durable clean {root}` removes them once old enough"))
    if fail_on_incomplete and any(r.state != "COMPLETE" for r in rows):
        ctx.exit(EXIT_INCOMPLETE)
    ctx.exit(EXIT_OK)


def _holder(lease: dict[str, Any] | None) -> str:
    if lease is None:
        return "-"
    # A lease that cannot be read (garbage, not JSON) has no holder to name: "None:None"
    # read as a holder called None; its error is in --json.
    who = "unreadable" if lease.get("error") else f"{lease.get('host')}:{lease.get('pid')}"
    seen = lease.get("file_age")
    return who if seen is None else f"{who} ({fmt_age(seen)} ago)"


# adopting ---------------------------------------------------------------------------------
_MARK_HELP = f"""Adopt data written before durable: give each unmarked entry under ROOT a
commit marker.

{TRUST}

\b
Without --apply it is a dry run: it lists what it would mark. Candidates are
the unmarked entries `durable scan` finds with no durable records at all.
Skipped: entries already COMPLETE (it is idempotent: run it again to catch
what was written since), entries where a durable writer started (attempt
records) or that hold a lease, entries inside a committed entry, objects that
carry their own commit record in their metadata (S3, GCS, Azure: atomic_write)
and any folder holding one (one HEAD per object of each unmarked folder).

Every object is read to record its size and CRC32C, which the manifest
requires: there is no size-only adoption, so there is no --deep (reading
everything also proves every object readable to its end). An object that is
an object store's error document (a 403's body saved as the file) is never
adopted: its entry fails, naming it.

\b
Push plan (incident 001): with no writer running, list, then --apply; deploy
the code that reads markers; once no job started before the deploy is still
running, and before new ones start, --apply again.
"""


def adopt_doc(report: AdoptReport) -> dict[str, Any]:
    return {"root": report.root, "apply": report.apply, "trust": TRUST,
            "marked": report.marked,
            "counts": _counts([a.status for a in report.adoptions],
                              ("planned", "adopted", "skipped", "failed")),
            "entries": [{"url": a.url, "status": a.status, "reason": a.reason,
                         "objects": a.objects, "size": a.size} for a in report.adoptions],
            "skipped": [asdict(s) for s in report.skipped]}


@cli.command("mark-complete", help=_MARK_HELP)
@click.argument("root")
@click.option("--apply", "do_apply", is_flag=True,
              help="Write the markers (without it: only list what would be marked).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@_WORKERS
@_common
@click.pass_context
def mark_complete_cmd(ctx: click.Context, root: str, do_apply: bool, as_json: bool,
                      workers: int) -> None:
    adapter, path = _resolve(ctx, root)
    holder = _committed_ancestor(adapter, path)
    if holder is not None:
        # Below ROOT the survey skips what committed entries hold, but it cannot see one
        # above ROOT: markers written here would sit inside that entry's data, which then
        # fails its own verification (unexpected objects).
        raise click.BadParameter(f"{adapter.url(path)} is inside the committed entry "
                                 f"{holder}: nothing in it is to be adopted", ctx,
                                 param_hint="ROOT")
    with _ticking(not as_json, f"listing {root}") as tick:
        report = mark_complete_root(survey(adapter, path), apply=do_apply, workers=workers,
                                    progress=tick)
    doc = adopt_doc(report)
    if as_json:
        _emit_json(doc)
    else:
        console = _console()
        console.print(_text(TRUST, style="bold yellow"))
        if report.adoptions or report.skipped:
            table = Table("status", "objects", "size", "url", "reason")
            for a in report.adoptions:
                table.add_row(_text(a.status), str(a.objects), _size(a.size), _text(a.url),
                              _text(a.reason))
            for sk in report.skipped:
                table.add_row(_text("skipped"), "-", "-", _text(sk.url), _text(sk.reason))
            console.print(table)
        c = doc["counts"]
        if do_apply:
            line = (f"{_entries(c['adopted'])} marked COMPLETE, {c['skipped']} skipped, "
                    f"{c['failed']} failed")
        else:
            line = (f"dry run: {_entries(c['planned'])} would be marked COMPLETE "
                    "(--apply to write)")
        had = "already has" if report.marked == 1 else "already have"
        unmarked = _entries(len(report.skipped)).replace(" ", " unmarked ", 1)
        console.print(_text(f"{line}; {unmarked} skipped; "
                           f"{_entries(report.marked)} {had} a marker"))
    ctx.exit(EXIT_PARTIAL if doc["counts"]["failed"] else EXIT_OK)


# cleaning ---------------------------------------------------------------------------------
def clean_doc(report: CleanReport) -> dict[str, Any]:
    return {"root": report.root, "apply": report.apply, "older_than": report.older_than,
            "lease_wait": report.lease_wait, "waited": report.waited,
            "counts": _counts([i.status for i in report.items],
                              ("planned", "removed", "skipped", "failed")),
            "items": [{"kind": i.kind, "url": i.url, "status": i.status, "reason": i.reason,
                       "detail": i.detail, "age": i.age, "objects": i.objects,
                       "size": i.size} for i in report.items],
            "kept": [asdict(k) for k in report.kept]}


def _sleeper(tick: Ticker) -> Callable[[float], None]:
    def sleep(seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            tick(f"watching leases, {left:.0f} s left", int(seconds - left), int(seconds))
            time.sleep(min(0.25, left))
    return sleep


@cli.command()
@click.argument("root")
@click.option("--older-than", "older_than", callback=_age_option, required=True, metavar="AGE",
              help="Only what is older than this: 90s, 30m, 2h, 3d, 1w. Pick more than "
                   "your longest write: a writer without a lease is judged by age alone.")
@click.option("--apply", "do_apply", is_flag=True,
              help="Remove (without it: only list what would be removed).")
@click.option("--lease-wait", type=click.FloatRange(min=0), default=120.0, show_default=True,
              metavar="SECONDS",
              help="Longest wait to tell live leases from stale ones; a lease whose "
                   "stale_after is longer is taken for alive.")
@click.option("--all-uploads", is_flag=True,
              help="Abort old unfinished uploads under ROOT even when not started the way "
                   "durable starts them (S3: CRC32C checksum; Azure: durable's block IDs).")
@click.option("--clock", type=click.Choice(["store", "local"]), default="store",
              show_default=True,
              help="Whose clock ages are measured by: the store's (the Date it answers "
                   "with, against its modification times; where it has none, this "
                   "machine's), or this machine's against the writers' started_at (for a "
                   "bucket copied from another: copies get new modification times).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@_WORKERS
@_common
@click.pass_context
def clean(ctx: click.Context, root: str, older_than: float, do_apply: bool,
          lease_wait: float, all_uploads: bool, clock: Literal["store", "local"],
          as_json: bool, workers: int) -> None:
    """Remove what dead durable writers left under ROOT, older than AGE.

    \b
    - INCOMPLETE entries a durable writer started (attempt records, a lease, other
      records) and never committed, with no live lease: data and records;
    - records whose entry's data is gone, with no marker;
    - attempt records (and their fragments) left beside a marker: only those records;
    - temp files of atomic writes (.NAME.durable-tmp-*), inside committed entries too
      (no manifest lists one);
    - S3 and GCS objects an atomic_write in parts published before its marker, which
      never followed (metadata durable-record-follows; one HEAD per unmarked object
      completed from parts, on GCS per one over 8 MiB);
    - uploads never completed: S3 multipart uploads, Azure blobs of uncommitted blocks
      only (GCS resumable sessions cannot be listed; GCS drops them after a week).

    It never touches an entry with a commit marker, nor anything else inside one, nor data with
    no durable records (data written before durable: see mark-complete), nor an entry
    holding an object that carries its own commit record in its metadata (S3: one HEAD per
    object of each entry about to be removed, at the plan and again before removal, since
    listings show no metadata). Each entry is checked again right before it is removed: a
    marker, or records changed since the plan (a writer at work), and it is left alone.
    Leases are judged by watching them: list, wait their stale_after (at most
    --lease-wait), list again; a lease whose version did not change is stale. Without
    --apply it is a dry run.
    """
    adapter, path = _resolve(ctx, root)
    with _ticking(not as_json, f"listing {root}") as tick:
        sv = survey(adapter, path)
        report = plan_clean(sv, older_than=older_than, lease_wait=lease_wait,
                            all_uploads=all_uploads, workers=workers, progress=tick, clock=clock,
                            sleep=_sleeper(tick) if not as_json else time.sleep)
        if do_apply:
            apply_clean(sv, report, workers=workers, progress=tick)
    doc = clean_doc(report)
    if as_json:
        _emit_json(doc)
    else:
        console = _console()
        if report.items or report.kept:
            table = Table("status", "kind", "age", "url", "reason")
            for i in report.items:
                reason = f"{i.reason}; {i.detail}" if i.detail else i.reason
                table.add_row(_text(i.status), _text(i.kind), _age_text(i.age), _text(i.url),
                              _text(reason))
            for k in report.kept:
                table.add_row(_text("kept"), "-", "-", _text(k.url), _text(k.reason))
            console.print(table)
        c = doc["counts"]
        line = (f"{c['removed']} removed, {c['skipped']} skipped, {c['failed']} failed"
                if do_apply else f"dry run: {c['planned']} would be removed (--apply to "
                                 "remove)")
        console.print(_text(f"{line}; {len(report.kept)} kept"))
    ctx.exit(EXIT_PARTIAL if doc["counts"]["failed"] else EXIT_OK)


def main(argv: Sequence[str] | None = None) -> None:
    """The console script ``durable``."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="durable")
