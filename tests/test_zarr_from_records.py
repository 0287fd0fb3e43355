"""A fresh `durable.zarr.write` / `durable.xarray.to_zarr` commits from its own records: the
commit lists the entry's records (one small LIST; on local disk a scandir), not the entry
(a LIST per 1,000 chunks; a walk of every directory), and falls back to the full listing
check whenever the records show that another writer started or cleared the entry
meanwhile.

The interfering writers here act inside the first writer's block, through durable's public
API, on the real store (moto, and fsspec's memory filesystem).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zarr

import durable
import durable.zarr as dz
from durable import Entry, IntegrityError, State
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket
from durable.zarr import _writing

# Uncompressed 8 x 8 float32 chunks: every chunk is 256 bytes, whoever writes it.
DATA = np.arange(32 * 32, dtype="f4").reshape(32, 32)
OTHER = DATA + 1000


@pytest.fixture(params=["s3", "memory", "file"])
def place(request: pytest.FixtureRequest, tmp_path: Any,
          ) -> Iterator[tuple[str, dict[str, Any] | None]]:
    if request.param == "file":
        yield str(tmp_path / "a.zarr"), None
        return
    if request.param == "memory":
        yield f"memory://from-records-{uuid.uuid4().hex}/a.zarr", None
        return
    bucket: Bucket = request.getfixturevalue("s3_bucket")
    yield bucket.path("a.zarr"), dict(bucket.storage_options)


@contextlib.contextmanager
def sole_write(url: str, options: dict[str, Any] | None) -> Iterator[Any]:
    """`durable.zarr.write`'s own block, with room to act before its commit."""
    with _writing(url, storage_options=options, overwrite=False, resume=False,
                  update=False, unrecorded="adopt", stage="on_handoff",
                  sole_writer=True) as store:
        zarr.create_array(store, data=DATA, chunks=(8, 8), compressors=None)
        yield store


def _entry_lists(proxy: FaultProxy, name: str) -> list[str]:
    """The prefixes of the LISTs of every object of the entry (``name/``, no delimiter: the
    commit's listing; zarr's and xarray's own looks list one level, with a delimiter)."""
    return [q for r in proxy.requests if "list-type" in r.query and "delimiter" not in r.query
            for q in r.query.get("prefix", []) if q.startswith(f"{name}/")]


@pytest.mark.s3
@pytest.mark.parametrize("how", ["zarr", "xarray"])
def test_the_commit_lists_the_records_not_the_entry(s3_bucket: Bucket, how: str) -> None:
    import xarray as xr

    import durable.xarray as dx

    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        url = s3_bucket.path("big.zarr")
        data = np.arange(200 * 100, dtype="f4").reshape(200, 100)
        if how == "zarr":
            dz.write(url, data, chunks=(10, 10), storage_options=options)
        else:
            # In memory: a dask-backed dataset is pickled by dask, which hands the store
            # off (its metadata staged, the commit listing the entry).
            dx.to_zarr(xr.Dataset({"v": (("y", "x"), data)}), url, storage_options=options,
                       encoding={"v": {"chunks": (10, 10)}})
        # 200 chunk objects, and not one LIST of them: the records were listed instead.
        assert _entry_lists(proxy, "big.zarr") == []
        assert any(q.startswith(".durable/big.zarr/") for r in proxy.requests
                   if "list-type" in r.query for q in r.query.get("prefix", []))
    entry = Entry(url, storage_options=s3_bucket.storage_options)
    assert entry.state() is State.COMPLETE
    assert entry.verify(deep=True).ok
    got = (dz.open(url, storage_options=s3_bucket.storage_options)[...] if how == "zarr"
           else dx.open_zarr(url, storage_options=s3_bucket.storage_options)["v"].values)
    assert got.tolist() == data.tolist()


@pytest.mark.s3
def test_a_plain_writing_block_still_lists_the_entry(s3_bucket: Bucket) -> None:
    """`writing(stage="on_handoff")` hands the store to the caller, who may write objects
    by other means (adopted at commit): only `write` and `to_zarr` vouch for every one."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        url = s3_bucket.path("b.zarr")
        with dz.writing(url, storage_options=options, stage="on_handoff") as store:
            zarr.create_array(store, data=DATA, chunks=(8, 8))
            s3_bucket.filesystem().pipe(f"{url}/notes.txt", b"written with another tool")
        assert _entry_lists(proxy, "b.zarr") == ["b.zarr/"]
    marker = Entry(url, storage_options=s3_bucket.storage_options).read_marker()
    assert marker is not None and marker.manifest is not None
    assert "notes.txt" in marker.manifest.objects


def test_a_write_whose_entry_was_cleared_meanwhile_does_not_commit(
        place: tuple[str, dict[str, Any] | None]) -> None:
    url, options = place
    with pytest.raises(IntegrityError, match="gone at commit"), sole_write(url, options):
        # A `durable clean` or `Entry.delete()` of the entry, records and all, while the
        # writer is at work: its attempt record is gone with its chunks.
        Entry(url, storage_options=options).delete()
    assert Entry(url, storage_options=options).state() is not State.COMPLETE


def test_a_write_overtaken_by_an_overwriting_writer_does_not_commit_over_its_chunks(
        place: tuple[str, dict[str, Any] | None]) -> None:
    url, options = place
    with contextlib.ExitStack() as first, contextlib.ExitStack() as second:
        first.enter_context(sole_write(url, options))
        # Another writer starts with overwrite=True: it clears the entry (this writer's
        # attempt record with it) and writes its own array, in larger chunks.
        theirs = second.enter_context(dz.writing(url, storage_options=options,
                                                 overwrite=True))
        zarr.create_array(theirs, data=OTHER, chunks=(16, 16), compressors=None)
        with pytest.raises(IntegrityError, match=r"not committing.*at commit"):
            first.close()
        # The other writer commits its own data, whole.
        second.close()
    assert zarr.open_array(url, mode="r", storage_options=options)[...].tolist() == \
        OTHER.tolist()
    assert dz.open(url, storage_options=options)[...].tolist() == OTHER.tolist()


def test_a_write_beside_another_writers_record_checks_every_object(
        place: tuple[str, dict[str, Any] | None]) -> None:
    """A writer that resumes the entry mid-write puts its attempt record and clears
    nothing: the records show it, so the commit lists the entry and finds the chunk it
    rewrote instead of recording this writer's size and CRC32C over it."""
    url, options = place
    with contextlib.ExitStack() as first, contextlib.ExitStack() as second:
        first.enter_context(sole_write(url, options))
        w = second.enter_context(Entry(url, storage_options=options).writing(resume=True))
        w.write_bytes("c/1/1", OTHER[8:12, 8:16].tobytes())  # half a chunk
        with pytest.raises(IntegrityError, match="written with 256 bytes, 128 at commit"):
            first.close()
    # The resumer committed what it found (it adopts what it did not write).
    assert Entry(url, storage_options=options).verify(deep=True).ok


def test_a_chunk_another_tool_removed_mid_write(
        place: tuple[str, dict[str, Any] | None]) -> None:
    """A chunk removed by a tool that is not durable (`rm`, `aws s3 rm`) before the commit.
    On local disk the commit's fsync of it finds it gone: IntegrityError naming it, no
    marker. On an object store a commit from the records lists no chunk and does not see
    it (docs/guarantees.md): the entry commits, and the verified read of that chunk is an
    IntegrityError naming it, never fill values."""
    import fsspec

    url, options = place
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    if url.startswith("/"):
        with pytest.raises(IntegrityError, match=r"c/1/1: written by this writer but gone"), \
                sole_write(url, options):
            fs.rm(f"{root}/c/1/1")
        assert Entry(url, storage_options=options).state() is not State.COMPLETE
        return
    with sole_write(url, options):
        fs.rm(f"{root}/c/1/1")
    array = dz.open(url, storage_options=options)
    assert array[0:8, 0:8].tolist() == DATA[0:8, 0:8].tolist()
    with pytest.raises(IntegrityError, match=r"c/1/1"):
        array[8:16, 8:16]
    assert not Entry(url, storage_options=options).verify(raise_errors=False).ok


def test_without_other_writers_the_entry_verifies_deep(
        place: tuple[str, dict[str, Any] | None]) -> None:
    url, options = place
    with sole_write(url, options):
        pass
    entry = Entry(url, storage_options=options)
    assert entry.state() is State.COMPLETE
    report = entry.verify(deep=True)
    assert report.ok and report.objects == 16 + 1  # the chunks and zarr.json
    assert dz.open(url, storage_options=options)[...].tolist() == DATA.tolist()
    assert durable.Entry(url, storage_options=options).read_marker() is not None
