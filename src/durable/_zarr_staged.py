"""What a `durable.zarr` write staged: the metadata documents held back from plain readers.

`Staged` holds the documents one write staged (with the ETag each PUT was answered with),
or, deferred, holds them in memory only until the store is handed to another process.
`WritingStore` (`_zarr_writing`) owns one and consults it for every metadata read, write,
delete and at publish.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from zarr.abc.store import Store
from zarr.storage import FsspecStore

from durable.adapters import Adapter

__all__ = ["Staged", "put", "tag"]


class Staged:
    """The metadata documents a write staged through one store and its clones.

    ``docs``: key -> (bytes, the ETag the store answered the PUT with, if any); a staged
    object listed with that ETag holds exactly these bytes, so publishing needs no GET of
    it. ``complete``: these are all the metadata documents of the write, so metadata reads
    are answered from here with no request. True only for the coordinator's store of a
    fresh write (`coordinating`: the entry and its staging area held no metadata when the
    block started) and only until a copy of the store is pickled: another process may
    stage documents of its own. A staging request that fails ends it too (whether it
    landed is unknown).

    ``deferred`` (a fresh write that offers no resume, `coordinating`): documents are held
    here only, not PUT into staging, until the store is pickled (`hand_off`): nobody else
    can need them before. While deferred, what is held is the whole truth (reads, listings
    and the publish take it from here); ``touched``: a hand-off was tried and failed, so
    staging may hold copies, which are removed at publish and never published.

    ``hidden`` (an update): the documents `WritingStore.hide_metadata` took out of the
    entry, as they were committed, less those deleted through the store since (each must
    be in staging at publish); ``wrote_data``: a chunk write or delete into the entry
    was tried (or the store went to another process, which may have). While it is False
    the entry's chunks are the last commit's, and an update given up puts ``hidden`` back
    (`WritingStore.restore`).
    """

    __slots__ = ("complete", "deferred", "docs", "hidden", "lock", "published", "touched",
                 "unhidden", "wrote_data")

    def __init__(self, complete: bool, *, deferred: bool = False) -> None:
        self.docs: dict[str, tuple[bytes, str | None]] = {}
        self.complete = complete
        self.deferred = deferred and complete
        self.touched = False
        self.published: set[str] = set()  # put create-only into the entry by this write
        self.hidden: dict[str, bytes] = {}
        # Hidden documents an earlier publish of this write put back into the entry: no
        # longer due in staging (a second publish, the commit's, finds them gone there).
        self.unhidden: set[str] = set()
        self.wrote_data = False
        # A pickling thread flushing the held documents must not miss one zarr's event
        # loop holds meanwhile (it would be in no process's staging).
        self.lock = threading.Lock()

    def hold(self, key: str, data: bytes) -> bool:
        """Keep ``data`` at ``key`` in memory only, if deferred; whether it was kept."""
        with self.lock:
            if self.deferred:
                self.docs[key] = (data, None)
            return self.deferred

    def hand_off(self, staging_base: str, adapter: Adapter) -> None:
        """PUT every held document into staging (at ``staging_base``) whole, then end
        `deferred` and `complete`: another process is about to need them, and may stage
        documents of its own. Synchronous through the adapter (not zarr's ``sync``, which
        cannot run on zarr's own event-loop thread, where pickling may happen). A failed
        PUT raises (the pickling fails): the documents stay held and deferred, never lost.
        """
        with self.lock:
            if self.deferred:
                self.touched = True
                held = list(self.docs.items())
                with ThreadPoolExecutor(max(1, min(8, len(held)))) as pool:
                    infos = list(pool.map(
                        lambda item: adapter.put(f"{staging_base}/{item[0]}", item[1][0],
                                                 durable=False), held))
                for (key, (data, _)), info in zip(held, infos, strict=True):
                    self.docs[key] = (data, tag(info.version))
                self.deferred = False
            self.complete = False

    def held_keys(self, prefix: str) -> list[str]:
        """Keys held below the directory ``prefix`` ("" for all)."""
        head = prefix.rstrip("/")
        return [k for k in list(self.docs) if not head or k.startswith(f"{head}/")]

    def forget(self, prefix: str, *, deleted: bool = False) -> bool:
        """Drop the documents at or below ``prefix`` ("" for all); whether staging may hold
        copies of them, to be removed there too: always unless deferred, and while deferred
        after a failed hand-off (which may have put some). Decided under the lock: a
        hand-off on another thread either staged a document before (then this says so) or
        never sees it, so a deleted node is never published from a staged copy.
        ``deleted``: zarr deleted them, so those ``hidden`` are no longer due at publish."""
        head = prefix.rstrip("/")
        with self.lock:
            for held in (self.docs, self.hidden) if deleted else (self.docs,):
                for key in [k for k in held
                            if not head or k == head or k.startswith(f"{head}/")]:
                    del held[key]
            return not self.deferred or self.touched


async def put(store: Store, key: str, data: bytes) -> str | None:
    """Write ``data`` at ``key`` of ``store``; the ETag the store answered, if it gave one."""
    if isinstance(store, FsspecStore):
        store._check_writable()
        root = store.path.rstrip("/")
        # fsspec's own call rather than FsspecStore.set, which drops the store's answer.
        answer = await store.fs._pipe_file(f"{root}/{key}" if root else key, data)
        return tag(answer.get("ETag") if isinstance(answer, dict) else None)
    from zarr.core.buffer import default_buffer_prototype

    await store.set(key, default_buffer_prototype().buffer.from_bytes(data))
    return None


def tag(raw: object) -> str | None:
    """An ETag without its quotes (listings and PUT answers may quote it differently)."""
    text = raw.strip().strip('"') if isinstance(raw, str) else ""
    return text or None
