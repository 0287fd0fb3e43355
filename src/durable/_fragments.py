"""Manifest fragments: what other processes of one write recorded.

A write spread over many processes or machines (dask.distributed workers) has one
coordinator that holds `Entry.writing()` and many workers that write objects. Each worker
records what it wrote and flushes it as a fragment, a small JSON object at
``PARENT/.durable/NAME/fragments/<attempt>/<time>-<id>.json``; the coordinator merges the
fragments at commit. A fragment that never got flushed (a worker killed after writing) costs
only speed: the coordinator reads and checksums any object no record covers.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import threading
import time
import uuid
import weakref
from typing import Any

from durable._errors import MarkerError
from durable._protocol import FORMAT, ObjectRecord, check_key

__all__ = ["FragmentRecorder", "decode_fragment", "fragments_dir"]

FRAGMENT_FORMAT = FORMAT + ".fragment"
MAX_FRAGMENT_BYTES = 64 * 1024 * 1024
_LIVE: weakref.WeakSet[FragmentRecorder] = weakref.WeakSet()


def fragments_dir(records: str, attempt: str) -> str:
    return f"{records}/fragments/{attempt}"


class FragmentRecorder:
    """Records objects written in this process for the attempt ``attempt`` of an entry.

    Flushed every ``flush_every`` records, on `flush()`/`close()`, and at interpreter exit.
    ``None`` as a record means "deleted".
    """

    def __init__(self, entry_url: str, storage_options: dict[str, Any] | None,
                 attempt: str, *, flush_every: int = 1000) -> None:
        self.entry_url = entry_url
        self.storage_options = dict(storage_options or {})
        self.attempt = attempt
        self.flush_every = flush_every
        self._pending: dict[str, ObjectRecord | None] = {}
        self._lock = threading.Lock()
        _LIVE.add(self)

    def record(self, key: str, size: int, crc32c: int, *, tail: int | None = None) -> None:
        with self._lock:
            self._pending[key] = ObjectRecord(size, crc32c, tail)
            full = len(self._pending) >= self.flush_every
        if full:
            self.flush()

    def forget(self, key: str) -> None:
        with self._lock:
            self._pending[key] = None

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        from durable._entry import Entry

        entry = Entry(self.entry_url, storage_options=self.storage_options)
        doc = {
            "format": FRAGMENT_FORMAT,
            "attempt": self.attempt,
            "records": {k: (r.to_json() if r is not None else None)
                        for k, r in pending.items()},
        }
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.json"
        path = f"{fragments_dir(entry.layout.records, self.attempt)}/{name}"
        entry.adapter.put(path, json.dumps(doc, separators=(",", ":")).encode(),
                          durable=False)

    close = flush

    def __del__(self) -> None:
        # At teardown; what is not flushed the coordinator reads and checksums itself.
        with contextlib.suppress(Exception):
            self.flush()


@atexit.register
def _flush_all() -> None:
    for rec in list(_LIVE):
        with contextlib.suppress(Exception):  # as above
            rec.flush()


def decode_fragment(data: bytes, where: str, attempt: str) -> dict[str, ObjectRecord | None]:
    """A fragment's records; MarkerError for anything malformed or from another attempt."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MarkerError(f"{where}: fragment is not valid JSON ({exc})", url=where) from None
    if (not isinstance(doc, dict) or doc.get("format") != FRAGMENT_FORMAT
            or doc.get("attempt") != attempt or not isinstance(doc.get("records"), dict)):
        raise MarkerError(f"{where}: not a fragment of attempt {attempt}", url=where)
    out: dict[str, ObjectRecord | None] = {}
    for key, rec in doc["records"].items():
        check_key(key, where)
        if rec is None:
            out[key] = None
            continue
        out[key] = ObjectRecord.from_json(rec, where, key)
    return out
