"""zarr-python 3 entries that no reader can take for complete before they are, read verified.

Writing (`writing`, `write`): every chunk goes through a `WritingStore`, which records its
size and CRC32C from the bytes zarr hands over (no second read), and for a chunk ending in
the crc32c codec's checksum that checksum too (`ObjectRecord.tail`: every such chunk has
the same whole CRC32C). The metadata documents
(``zarr.json``; ``.zarray``, ``.zgroup``, ``.zattrs``, ``.zmetadata``) are *held back* in a
staging area beside the entry (``PARENT/.durable/NAME/staged``), or (`write`,
``stage="on_handoff"``) in the writer's memory until the store goes to another process,
and published into the entry only at commit, after every chunk, deepest first and the
root last; the marker follows. A writer killed at any point before that leaves chunks
without metadata: plain ``zarr.open``/``xarray.open_zarr`` find no array, and `durable`
says INCOMPLETE (incident 001); staged, the metadata lets ``writing(url, resume=True)``
finish the write, held in memory it is gone and ``overwrite=True`` starts over. A writer
killed *during* the publish leaves only arrays whose chunks are all written (a plain
reader sees whole arrays or none) and still no marker.

Reading (`open`, `VerifyingStore`): only a COMPLETE entry opens, and every key is checked
against the manifest: a listed chunk must be there with its recorded size and CRC32C (a
missing one is an IntegrityError, never fill values); a key the manifest does not list is
the fill value if absent and an IntegrityError if present (it is not part of the commit).
Listings come from the manifest, so they cost no request. Byte-range reads (sharding) are
pinned to the committed version of each shard (a shard of a later commit is refused, never
decoded under this one's metadata) and checked for length; their content is checked by
``checksum_codec=True`` (zarr's ``crc32c`` codec) or ``Entry.verify(deep=True)``.

Many processes: a pickled `WritingStore` (dask workers) records into a manifest fragment
of its process instead, merged by the coordinator at commit; `flush_fragments` runs on the
workers before the commit (done for you for a `distributed` client).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from durable._extras import require

require("durable.zarr", "zarr", "zarr", "numpy")

import zarr

from durable._entry import Entry
from durable._errors import AlreadyCompleteError, rewrite_hint
from durable._lease import Lease
from durable._zarr_reading import VerifyingStore
from durable._zarr_writing import WritingStore, coordinating, flush_fragments

__all__ = ["VerifyingStore", "WritingStore", "flush_fragments", "open", "write", "writing"]


@contextlib.contextmanager
def writing(url: str, *, storage_options: dict[str, Any] | None = None,
            overwrite: bool = False, resume: bool = False, update: bool = False,
            unrecorded: Literal["adopt", "error"] = "adopt",
            stage: Literal["eager", "on_handoff"] = "eager",
            lease: Lease | None = None) -> Iterator[WritingStore]:
    """Write a zarr hierarchy or array at ``url`` as one entry; commit on clean exit.

    Yields the `WritingStore` to pass to zarr (``zarr.create_array(store, ...)``,
    ``zarr.open_array(store, mode="r+")``, ``ds.to_zarr(store)``). ``overwrite``,
    ``resume``, ``update`` and ``lease`` (a `durable.Lease` held on the entry, which keeps
    every other writer out) are those of `Entry.writing`: ``update=True`` changes a
    COMPLETE entry in place (append, resize), its metadata hidden from plain readers
    until the new commit; an update whose block raises before any chunk is written or
    deleted is given up and the last commit made again (the entry stays COMPLETE as it
    was). ``unrecorded="error"`` refuses to commit chunks that no
    process recorded (instead of reading them back).

    ``stage``: when the held-back metadata goes to the staging area beside the entry.
    ``"eager"``: as zarr writes it, so a killed writer can be resumed
    (``writing(url, resume=True)`` and ``zarr.open_array(store, mode="r+")`` find it).
    ``"on_handoff"`` (a fresh write only): kept in this process's memory until the store
    is pickled for another process (a dask worker), and published from memory otherwise:
    3 requests fewer on an object store, but a writer killed before a hand-off leaves
    chunks and no metadata anywhere (still no array for plain readers, INCOMPLETE for
    durable), so the only retry is ``overwrite=True``. `write` uses it.
    """
    with _writing(url, storage_options=storage_options, overwrite=overwrite, resume=resume,
                  update=update, unrecorded=unrecorded, stage=stage, lease=lease) as store:
        yield store
        if update or resume:
            _reconsolidate(store)


_V3_CONSOLIDATED_WARNING = r"Consolidated metadata is currently not part in the Zarr format 3"


def _reconsolidate(store: WritingStore) -> None:
    """Consolidate the root group again if it was consolidated: an append or resize in an
    update changed the arrays' documents, and every reader (``zarr.open``,
    ``xarray.open_zarr``, durable's own) read the old shapes from the stale consolidated
    metadata: the appended data committed, and invisible, silently."""
    import json
    import warnings

    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    proto = default_buffer_prototype()
    if sync(store.exists(".zmetadata")):
        consolidated = True
    else:
        root = sync(store.get("zarr.json", proto))
        doc = json.loads(root.to_bytes()) if root is not None else None
        consolidated = (isinstance(doc, dict) and doc.get("node_type") == "group"
                        and doc.get("consolidated_metadata") is not None)
    if consolidated:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_V3_CONSOLIDATED_WARNING)
            zarr.consolidate_metadata(store)


@contextlib.contextmanager
def _writing(url: str, *, storage_options: dict[str, Any] | None, overwrite: bool,
             resume: bool, update: bool, unrecorded: Literal["adopt", "error"],
             stage: Literal["eager", "on_handoff"], sole_writer: bool = False,
             lease: Lease | None = None) -> Iterator[WritingStore]:
    """`writing`; ``sole_writer``: the caller drives every write of the entry through the
    store it yields (`write`, `durable.xarray.to_zarr`), so a fresh write on an object
    store that was never handed to another process commits from its records, without a
    listing of the entry (`coordinating`)."""
    if stage not in ("eager", "on_handoff"):
        raise ValueError(f"stage must be 'eager' or 'on_handoff', got {stage!r}")
    if stage == "on_handoff" and (resume or update):
        raise ValueError("stage='on_handoff' is for fresh writes: a resumed or updated "
                         "write reads the metadata staged or published before it")
    entry = Entry(url, storage_options=storage_options)
    given_up: Exception | None = None
    try:
        with entry.writing(overwrite=overwrite, resume=resume, update=update,
                           unrecorded=unrecorded, lease=lease) as writer:
            stores: list[WritingStore] = []
            try:
                with coordinating(entry, writer, storage_options=storage_options,
                                  hide=resume or update, fresh=not (resume or update),
                                  deferred=stage == "on_handoff",
                                  sole_writer=sole_writer) as store:
                    stores.append(store)
                    yield store
            except Exception as exc:
                # An update refused before it wrote a chunk (xarray's append of a
                # variable of another shape, zarr's append along a missing axis): the
                # entry's chunks are the last commit's, so that commit is made again
                # rather than left INCOMPLETE for overwrite=True alone to get out of.
                if not (update and stores and stores[0].restore(writer, exc)):
                    raise
                given_up = exc
    except Exception as failed:
        if given_up is None:
            raise
        given_up.add_note(f"{url}: the update wrote no chunk, but committing the entry "
                          f"as it was failed too ({failed!r}): it is INCOMPLETE")
        raise given_up from failed
    if given_up is not None:
        given_up.add_note(f"{url}: the update wrote no chunk and was given up: the entry "
                          "is COMPLETE as last committed")
        raise given_up


def write(url: str, data: Any, *, chunks: tuple[int, ...] | Literal["auto"] = "auto",
          storage_options: dict[str, Any] | None = None, overwrite: bool = False,
          zarr_format: Literal[2, 3] = 3, checksum_codec: bool = False,
          lease: Lease | None = None, **create_kwargs: Any) -> Entry:
    """Create the array ``data`` (NumPy-like) at ``url`` and commit it; returns the Entry.

    ``create_kwargs`` go to `zarr.create_array`. ``checksum_codec=True`` (zarr format 3)
    appends zarr's ``crc32c`` codec to the compressors: 4 bytes and one CRC per chunk,
    checked by any zarr reader, and the only check byte-range (sharded) reads get.

    The metadata is held in memory until the commit (``stage="on_handoff"`` of
    `writing`): a write killed part-way leaves chunks and no metadata (INCOMPLETE);
    retry it with ``overwrite=True``, which starts over. ``lease``: a `durable.Lease`
    held on the entry (`Entry.writing`).
    """
    if checksum_codec:
        if zarr_format != 3:
            raise ValueError("checksum_codec needs zarr_format=3 (format 2 has no crc32c "
                             "codec in its spec)")
        from zarr.codecs import Crc32cCodec, ZstdCodec

        compressors = create_kwargs.pop("compressors", "auto")
        if compressors == "auto":
            compressors = (ZstdCodec(),)
        elif compressors is None:
            compressors = ()
        elif not isinstance(compressors, list | tuple):
            compressors = (compressors,)
        create_kwargs["compressors"] = (*compressors, Crc32cCodec())
    entry = Entry(url, storage_options=storage_options)
    try:
        with _writing(url, storage_options=storage_options, overwrite=overwrite,
                      resume=False, update=False, unrecorded="adopt", stage="on_handoff",
                      sole_writer=True, lease=lease) as store:
            zarr.create_array(store, data=data, chunks=chunks, zarr_format=zarr_format,
                              **create_kwargs)
    except AlreadyCompleteError as exc:
        # write() takes no update=True: the way to change the array in place is named.
        raise rewrite_hint(exc, "write(..., overwrite=True) replaces it, "
                                "durable.zarr.writing(url, update=True) changes it") from None
    return entry


def open(url: str, *, storage_options: dict[str, Any] | None = None,
         mode: Literal["r"] = "r", **kwargs: Any) -> Any:
    """Open a COMPLETE entry with zarr, every read checked against its manifest.

    IncompleteError for an ABSENT or INCOMPLETE entry. ``kwargs`` go to `zarr.open`.
    To change an entry, use ``writing(url, update=True)``.
    """
    if mode != "r":
        raise ValueError(f"durable.zarr.open reads only (mode 'r', got {mode!r}); change an "
                         "entry with durable.zarr.writing(url, update=True)")
    store = VerifyingStore.from_url(url, storage_options=storage_options)
    return zarr.open(store=store, mode="r", **kwargs)
