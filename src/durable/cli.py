"""The ``durable`` command line: the state of entries on any store fsspec reaches.

Commands::

    durable status URL [--json]          one entry's state, its reason and its marker
    durable verify URL [--deep] [--json] every object against the manifest (sizes;
                                         CRC32C too with --deep)
    durable scan ROOT [--json] [--fail-on-incomplete]
                                         every entry under ROOT, from one listing

URL and ROOT are local paths or fsspec URLs (``file://``, ``s3://``, ``gs://``, ``az://``,
``memory://``...). Options that every command takes, before or after its name:

- ``--storage-options JSON``: fsspec ``storage_options`` (a JSON object);
- ``-o KEY=VALUE`` (repeatable): one storage option; VALUE is read as JSON when it parses
  (``-o anon=true``), else taken as a string;
- ``--debug``: show the traceback of an error.

The environment variable ``DURABLE_STORAGE_OPTIONS`` (a JSON object) gives defaults;
``--storage-options`` overrides its keys, and ``-o`` overrides both.

Exit codes:

== ===================================================================================
0  COMPLETE (status); every object matches (verify); the scan ran (scan)
1  an error: a marker that cannot be trusted, an I/O error, anything unexpected
2  usage error: a bad option or argument (click's)
3  INCOMPLETE (status, verify); scan with --fail-on-incomplete: some entry not COMPLETE
4  ABSENT (status, verify)
5  verify found objects that do not match the manifest
== ===================================================================================

Errors are one line on stderr, ``durable: error: ...`` (a traceback only with --debug).

JSON (``--json``): one document on stdout; on an error (exit 1 or 2) stdout is empty.

status::

    {"url": str, "state": "ABSENT" | "INCOMPLETE" | "COMPLETE", "reason": str,
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

scan (``state`` "ERROR": the marker could not be read or trusted; ``reason`` says why)::

    {"root": str, "counts": {"COMPLETE": int, "INCOMPLETE": int, "ERROR": int},
     "entries": [{"url": str, "state": "COMPLETE" | "INCOMPLETE" | "ERROR",
                  "reason": str, "objects": int, "size": int,
                  "attempt": str | null, "committed_at": str | null}]}
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

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

from durable._entry import Entry, Status, VerifyReport
from durable._errors import DurableError, IncompleteError
from durable._protocol import State
from durable._scan import ScanRow, scan
from durable._version import __version__

__all__ = ["cli", "main"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3
EXIT_ABSENT = 4
EXIT_MISMATCH = 5
ENV_OPTIONS = "DURABLE_STORAGE_OPTIONS"

_STATE_EXIT = {State.COMPLETE: EXIT_OK, State.INCOMPLETE: EXIT_INCOMPLETE,
               State.ABSENT: EXIT_ABSENT}
_STYLE = {"COMPLETE": "green", "INCOMPLETE": "yellow", "ABSENT": "dim", "ERROR": "bold red"}
_EPILOG = """\b
Exit codes:
  0  COMPLETE / verified / scan done
  1  error (untrustworthy marker, I/O, unexpected)
  2  usage error
  3  INCOMPLETE (scan: with --fail-on-incomplete, some entry not COMPLETE)
  4  ABSENT
  5  verify found mismatches
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
        except ValueError:
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
    except ValueError as exc:
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
        return Entry(url, storage_options=storage_options(ctx))
    except ValueError as exc:
        # An unknown protocol, or a path with no parent to hold a marker: a bad argument.
        raise click.BadParameter(str(exc), ctx, param_hint="URL") from None


# errors ---------------------------------------------------------------------------------
class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit,
                click.exceptions.Abort):
            raise
        except Exception as exc:
            if ctx.meta.get("durable.debug"):
                raise
            _fail(exc)


def _fail(exc: Exception) -> NoReturn:
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, DurableError | OSError | ImportError | ValueError):
        line = f"durable: error: {message}"
    else:
        line = (f"durable: unexpected error: {type(exc).__name__}: {message} "
                "(--debug shows the traceback)")
    click.echo(line, err=True)
    sys.exit(EXIT_ERROR)


# output ---------------------------------------------------------------------------------
def _console() -> Console:
    # Piped output is never wrapped: a URL cut in two lines is useless to grep or cut.
    tty = sys.stdout.isatty()
    return Console(file=sys.stdout, highlight=False, width=None if tty else 100_000)


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


# commands -------------------------------------------------------------------------------
@click.group(cls=_Group, epilog=_EPILOG, context_settings={"help_option_names": ["-h",
                                                                                 "--help"]})
@click.version_option(__version__, prog_name="durable")
@_common
def cli() -> None:
    """Inspect entries written with durable: their state, their data, a whole tree."""


def status_doc(entry: Entry, st: Status) -> dict[str, Any]:
    marker = None
    if st.marker is not None:
        m = st.marker
        assert m.manifest is not None
        marker = {"kind": m.kind, "attempt": m.attempt, "committed_at": m.committed_at,
                  "writer": dict(m.writer), "objects": len(m.manifest),
                  "total_size": m.manifest.total_size, "format_version": m.version}
    return {"url": entry.url, "state": st.state.value, "reason": st.reason, "marker": marker}


@cli.command()
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@_common
@click.pass_context
def status(ctx: click.Context, url: str, as_json: bool) -> None:
    """The state of the entry at URL: ABSENT, INCOMPLETE or COMPLETE, and why."""
    entry = _entry(ctx, url)
    st = entry.status()
    doc = status_doc(entry, st)
    if as_json:
        _emit_json(doc)
    else:
        lines = [("url", Text(doc["url"])), ("state", _state_text(doc["state"])),
                 ("reason", Text(doc["reason"]))]
        if (m := doc["marker"]) is not None:
            writer = " ".join(f"{k}={v}" for k, v in m["writer"].items())
            lines += [(label, Text(value)) for label, value in (
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


@cli.command()
@click.argument("url")
@click.option("--deep", is_flag=True,
              help="Read every object and compare its CRC32C (not only its size).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@_common
@click.pass_context
def verify(ctx: click.Context, url: str, deep: bool, as_json: bool) -> None:
    """Check every object of the entry at URL against its manifest."""
    entry = _entry(ctx, url)
    try:
        with _progress(not as_json, f"verifying {entry.url}", bar=False):
            report = entry.verify(deep, raise_errors=False)
    except IncompleteError as exc:
        state = exc.state if isinstance(exc.state, State) else State.INCOMPLETE
        doc = {"url": entry.url, "deep": deep, "ok": False, "state": state.value,
               "reason": str(exc), "objects": 0, "bytes_checked": 0, "problems": []}
        if as_json:
            _emit_json(doc)
        else:
            _console().print(_state_text(state.value), Text(f"not verified: {exc}"))
        ctx.exit(_STATE_EXIT[state])
    doc = verify_doc(report)
    if as_json:
        _emit_json(doc)
    else:
        console = _console()
        console.print(Text(f"{report.url}: {doc['reason']}"),
                      Text("OK", style="green") if report.ok else Text("FAILED", style="red"))
        if report.problems:
            table = Table("object", "issue", "expected", "found")
            for p in report.problems:
                table.add_row(Text(p.key or p.url), Text(p.issue), Text(_show(p.expected)),
                              Text(_show(p.found)))
            console.print(table)
    ctx.exit(EXIT_OK if report.ok else EXIT_MISMATCH)


def _show(value: Any) -> str:
    return "-" if value is None else str(value)


def scan_doc(root: str, rows: Sequence[ScanRow]) -> dict[str, Any]:
    counts = {"COMPLETE": 0, "INCOMPLETE": 0, "ERROR": 0}
    for row in rows:
        counts[row.state] += 1
    return {"root": root, "counts": counts, "entries": [r.to_json() for r in rows]}


@cli.command("scan")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option("--fail-on-incomplete", is_flag=True,
              help="Exit 3 if any entry is not COMPLETE (INCOMPLETE or ERROR).")
@_common
@click.pass_context
def scan_cmd(ctx: click.Context, root: str, as_json: bool, fail_on_incomplete: bool) -> None:
    """Every entry under ROOT with its state, size and object count (one listing)."""
    with _progress(not as_json, f"listing {root}", bar=True) as progress:
        task = progress.tasks[0].id

        def tick(done: int, total: int) -> None:
            progress.update(task, description="reading markers", completed=done, total=total)

        rows = scan(root, storage_options(ctx), progress=tick)
    doc = scan_doc(root, rows)
    if as_json:
        _emit_json(doc)
    else:
        console = _console()
        if rows:
            table = Table("state", "objects", "size", "url", "reason")
            for r in rows:
                table.add_row(_state_text(r.state), str(r.objects), _size(r.size),
                              Text(r.url), Text(r.reason))
            console.print(table)
        summary = ", ".join(f"{n} {s}" for s, n in doc["counts"].items() if n)
        console.print(Text(f"{len(rows)} entries under {root}" +
                           (f": {summary}" if summary else "")))
    if fail_on_incomplete and any(r.state != "COMPLETE" for r in rows):
        ctx.exit(EXIT_INCOMPLETE)
    ctx.exit(EXIT_OK)


def main(argv: Sequence[str] | None = None) -> None:
    """The console script ``durable``."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="durable")
