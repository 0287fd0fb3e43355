"""durable.xarray: datasets written as commit-marked zarr entries, in one process or many.

The many-process tests run a real `distributed.LocalCluster` (two worker processes) against
moto; a worker is killed for real (SIGKILL from inside its own task, once enough chunks are
on the store), and what is on the store is read around durable.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dask.array as da
import numpy as np
import pytest
import xarray as xr
import zarr

import durable.xarray as dx
import durable.zarr as dz
from durable import (
    AlreadyCompleteError,
    Entry,
    IncompleteError,
    IncompleteExistsError,
    IntegrityError,
    State,
)
from durable.testing.pytest_plugin import Bucket
from test_zarr import KINDS, NOT_FOUND, Target, forget_memory, make_target, manifest_matches_store


@pytest.fixture(params=KINDS)
def target(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Target]:
    t = make_target(request.param, request, tmp_path)
    yield t
    forget_memory(t)


def dataset(start: int = 0, n: int = 16) -> xr.Dataset:
    """Both kinds xarray writes differently: ``temp`` backed by dask (written by tasks),
    ``count`` and the coordinates in memory (written by xarray itself)."""
    t = np.arange(start, start + n)
    temp = np.sin(t[:, None] + np.arange(10)[None, :]).astype("float32")
    return xr.Dataset({"temp": (("t", "y"), da.from_array(temp, chunks=(4, 10))),
                       "count": (("t",), t * 3)},
                      coords={"t": t, "y": np.arange(10) * 0.5}, attrs={"title": "test"})


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("consolidated", [True, False])
def test_round_trip_without_a_warning(target: Target, zarr_format: int,
                                      consolidated: bool) -> None:
    url = target.url("ds.zarr")
    ds = dataset()
    entry = dx.to_zarr(ds, url, storage_options=target.options, zarr_format=zarr_format,
                       consolidated=consolidated)
    assert entry.state() is State.COMPLETE
    assert entry.verify(deep=True).ok
    manifest_matches_store(target, "ds.zarr")
    # Warnings are errors here (pyproject): neither durable's reader nor a plain one warns.
    xr.testing.assert_identical(dx.open_zarr(url, storage_options=target.options).load(),
                                ds.load())
    if consolidated:
        xr.testing.assert_identical(xr.open_zarr(url, **target.plain_options()).load(),
                                    ds.load())
    group = zarr.open_group(url, mode="r", **target.plain_options())
    assert sorted(group.array_keys()) == ["count", "t", "temp", "y"]


def test_append_and_region_writes_update_the_entry(target: Target) -> None:
    url = target.url("ap.zarr")
    first, second = dataset(), dataset(start=16)
    dx.to_zarr(first, url, storage_options=target.options)
    dx.to_zarr(second, url, storage_options=target.options, mode="a", append_dim="t")
    both = xr.concat([first, second], "t")
    entry = Entry(url, storage_options=target.options)
    assert entry.verify(deep=True).ok
    manifest_matches_store(target, "ap.zarr")
    xr.testing.assert_identical(dx.open_zarr(url, storage_options=target.options).load(),
                                both.load())
    patch = (both.isel(t=slice(4, 8)) * 0 + 7).drop_vars(["y"])
    dx.to_zarr(patch[["temp"]], url, storage_options=target.options, mode="r+",
               region={"t": slice(4, 8)})
    assert entry.verify(deep=True).ok
    got = dx.open_zarr(url, storage_options=target.options).load()
    assert (got.temp.isel(t=slice(4, 8)) == 7).all()
    xr.testing.assert_identical(got.isel(t=slice(8, None)), both.isel(t=slice(8, None)).load())


def test_an_unconsolidated_append_to_a_consolidated_dataset_is_read_whole(
        target: Target) -> None:
    """consolidated=False on an append: xarray left a format 2 root's .zmetadata as it
    was, and every reader saw the dataset without the appended rows. (Format 3: zarr drops
    the root's consolidated metadata itself.)"""
    zarr_format = 2
    url = target.url("c.zarr")
    first, second = dataset(0, 8), dataset(8, 8)
    dx.to_zarr(first, url, storage_options=target.options, zarr_format=zarr_format)
    dx.to_zarr(second, url, storage_options=target.options, mode="a", append_dim="t",
               consolidated=False)
    both = xr.concat([first, second], "t").load()
    xr.testing.assert_identical(dx.open_zarr(url, storage_options=target.options).load(),
                                both)
    xr.testing.assert_identical(xr.open_zarr(url, **target.plain_options()).load(), both)


class Boom(Exception):
    pass


def failed_append(target: Target, url: str) -> tuple[xr.Dataset, xr.Dataset]:
    """A committed dataset (the first), then an append of the second failing after its
    first chunk was written: the entry INCOMPLETE, its metadata held back."""
    first, second = dataset(0, 8), dataset(8, 8)
    dx.to_zarr(first, url, storage_options=target.options)

    def fail_on_the_second_chunk(block: np.ndarray, block_info: Any = None) -> np.ndarray:
        if block_info[0]["chunk-location"][0] == 1:
            raise Boom("killed part-way")
        return block

    failing = second.assign(temp=second.temp.copy(data=second.temp.data.map_blocks(
        fail_on_the_second_chunk, dtype="float32")))
    with pytest.raises(Boom):
        dx.to_zarr(failing, url, storage_options=target.options, mode="a", append_dim="t")
    return first, second


def test_a_rerun_of_a_failed_append_is_refused_never_committed_with_a_gap(
        target: Target) -> None:
    """An append that failed part-way left its metadata at the appended length; rerun as
    it was (mode="a", append_dim), it was taken as a resume, appended after that length and
    committed the rows between as fill values: COMPLETE, verify OK, NaN where data was."""
    url = target.url("gap.zarr")
    first, second = failed_append(target, url)
    entry = Entry(url, storage_options=target.options)
    assert entry.state() is State.INCOMPLETE
    with pytest.raises(IncompleteExistsError, match="update=True changes a COMPLETE entry"):
        dx.to_zarr(second, url, storage_options=target.options, mode="a", append_dim="t")
    with pytest.raises(ValueError, match="append_dim with resume=True"):
        dx.to_zarr(second, url, storage_options=target.options, mode="a", append_dim="t",
                   resume=True)
    assert entry.state() is State.INCOMPLETE
    # The way out the errors name: the appended rows written again, as a region.
    dx.to_zarr(second.drop_vars("y"), url, storage_options=target.options, mode="r+",
               region={"t": slice(8, 16)}, resume=True)
    assert entry.verify(deep=True).ok
    xr.testing.assert_identical(dx.open_zarr(url, storage_options=target.options).load(),
                                xr.concat([first, second], "t").load())


def test_a_failed_append_is_not_offered_for_adoption(target: Target) -> None:
    """A failed append holds the entry's metadata back among its records. The error of a
    read said "written without durable? ... mark_complete() commits it as it is", and
    mark_complete did: the entry read COMPLETE without its zarr.json."""
    url = target.url("adopt.zarr")
    first, second = failed_append(target, url)
    entry = Entry(url, storage_options=target.options)
    with pytest.raises(IncompleteError) as read:
        dx.open_zarr(url, storage_options=target.options)
    assert "mark_complete" not in str(read.value)
    assert "resume=True" in str(read.value)
    with pytest.raises(IncompleteExistsError, match="has durable records but no marker"):
        entry.mark_complete()
    assert entry.state() is State.INCOMPLETE
    # The way out the error names still works.
    dx.to_zarr(second.drop_vars("y"), url, storage_options=target.options, mode="r+",
               region={"t": slice(8, 16)}, resume=True)
    xr.testing.assert_identical(dx.open_zarr(url, storage_options=target.options).load(),
                                xr.concat([first, second], "t").load())


def test_an_append_xarray_refuses_before_a_chunk_leaves_the_last_commit_complete(
        target: Target) -> None:
    """xarray refused the append (a variable of another shape, another dtype, a dimension
    the dataset lacks) after the update had removed the marker and hidden the metadata:
    INCOMPLETE, and only overwrite=True got out of it. No chunk was written: the last
    commit is made again, and the entry reads as before."""
    url = target.url("refused.zarr")
    first = dataset(0, 8)
    dx.to_zarr(first, url, storage_options=target.options)
    entry = Entry(url, storage_options=target.options)
    committed = entry.read_marker()
    assert committed is not None
    wider = dataset(8, 8).isel(y=slice(0, 6))  # y: 6 where the entry has 10
    as_text = dataset(8, 8).assign(count=lambda d: d["count"].astype(str))
    for refused, match, kwargs in (
            (wider, "different dimension sizes", {"append_dim": "t"}),
            (as_text, "Mismatched dtypes", {"append_dim": "t"}),
            (dataset(8, 8), "nope", {"append_dim": "nope"})):
        with pytest.raises(ValueError, match=match) as caught:
            dx.to_zarr(refused, url, storage_options=target.options, mode="a", **kwargs)
        assert "COMPLETE as last committed" in "".join(caught.value.__notes__)
        assert entry.state() is State.COMPLETE
        marker = entry.read_marker()
        assert marker is not None and marker.manifest == committed.manifest
        assert entry.verify(deep=True).ok
        xr.testing.assert_identical(dx.open_zarr(url, storage_options=target.options).load(),
                                    first.load())
        # Nothing the refused update staged is left to be published by a later one.
        assert not entry.adapter.list(f"{entry.layout.records}/staged")
    dx.to_zarr(dataset(8, 8), url, storage_options=target.options, mode="a", append_dim="t")
    xr.testing.assert_identical(dx.open_zarr(url, storage_options=target.options).load(),
                                xr.concat([first, dataset(8, 8)], "t").load())


def test_an_append_that_would_leave_variables_at_two_lengths_is_refused(
        target: Target) -> None:
    """xarray appends the variables it is given and creates new ones at the appended
    length alone: a dataset missing one of the entry's variables along append_dim, or with
    one the entry lacks, was committed, and then opened nowhere ("conflicting sizes for
    dimension 't'"), durable's reader or xarray's. Refused before a chunk is written."""
    url = target.url("uneven.zarr")
    first = dataset(0, 8)
    dx.to_zarr(first, url, storage_options=target.options)
    entry = Entry(url, storage_options=target.options)
    more = dataset(8, 8)
    for uneven, named in ((more.drop_vars("count"), r"\['count'\] not in the appended"),
                          (more.assign(extra=more["count"] * 2), r"\['extra'\] not in the entry")):
        with pytest.raises(ValueError, match=named):
            dx.to_zarr(uneven, url, storage_options=target.options, mode="a", append_dim="t")
        assert entry.state() is State.COMPLETE
        xr.testing.assert_identical(dx.open_zarr(url, storage_options=target.options).load(),
                                    first.load())
    # Variables without the dimension need not come along (xarray leaves them as they are).
    dx.to_zarr(more.drop_vars("y"), url, storage_options=target.options, mode="a",
               append_dim="t")
    xr.testing.assert_identical(xr.open_zarr(url, **target.plain_options()).load(),
                                xr.concat([first, more], "t").load())


def test_refusals(target: Target) -> None:
    url = target.url("r.zarr")
    with pytest.raises(IncompleteError, match="ABSENT"):
        dx.open_zarr(url, storage_options=target.options)
    with pytest.raises(ValueError, match="compute=False"):
        dx.to_zarr(dataset(), url, storage_options=target.options, compute=False)
    # xarray writes "a/b" as array b of a group a: committed, then read back without it.
    with pytest.raises(ValueError, match=r"names with '/'.*\['temp/max'\]"):
        dx.to_zarr(dataset().rename(temp="temp/max"), url, storage_options=target.options)
    assert Entry(url, storage_options=target.options).state() is State.ABSENT


def test_mode_w_replaces_a_committed_dataset_as_in_xarray(target: Target) -> None:
    url = target.url("w.zarr")
    dx.to_zarr(dataset(0, 16), url, storage_options=target.options)
    with pytest.raises(AlreadyCompleteError):  # the default mode "w-" refuses
        dx.to_zarr(dataset(100, 8), url, storage_options=target.options)
    dx.to_zarr(dataset(100, 8), url, storage_options=target.options, mode="w")
    got = dx.open_zarr(url, storage_options=target.options).load()
    xr.testing.assert_identical(got, dataset(100, 8))
    Entry(url, storage_options=target.options).verify(deep=True)
    with pytest.raises(AlreadyCompleteError):  # overwrite=False still means no
        dx.to_zarr(dataset(0, 4), url, storage_options=target.options, mode="w",
                   overwrite=False)


# many processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def killer(prefix: str, options: dict[str, Any], flag: str, after: int) -> Callable[..., Any]:
    """A map_blocks function whose block 2 kills its own worker process, once ``after``
    chunk objects are on the store (polled), and only the first time (``flag``)."""

    def block(x: Any, block_info: Any = None) -> Any:
        import os
        import signal
        import time

        import fsspec

        if block_info[None]["chunk-location"][0] != 2:
            return x
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        if fs.exists(flag):
            return x
        deadline = time.monotonic() + 60
        while len([p for p in fs.find(prefix) if "/c/" in p]) < after:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {after} chunks under {prefix}")
            time.sleep(0.05)  # a poll of the store, not a guess at timing
            fs.invalidate_cache()
        fs.pipe(flag, b"killed once")
        os.kill(os.getpid(), signal.SIGKILL)
        return x

    return block


def doomed(bucket: Bucket, url: str, after: int) -> xr.Dataset:
    ds = dataset()
    flag = bucket.path(f"flag-{uuid.uuid4().hex}")
    temp = da.map_blocks(killer(url, bucket.storage_options, flag, after), ds.temp.data,
                         dtype=ds.temp.dtype)
    return ds.assign(temp=(("t", "y"), temp))


@pytest.mark.s3
@pytest.mark.slow
def test_cluster_write_commits_from_the_workers_fragments(client: Any,
                                                          s3_bucket: Bucket) -> None:
    url = s3_bucket.path("cluster.zarr")
    ds = dataset()
    # unrecorded="error": the commit refuses any chunk no process recorded, so passing
    # means every chunk a worker wrote came to the coordinator in a fragment.
    entry = dx.to_zarr(ds, url, storage_options=s3_bucket.storage_options,
                       unrecorded="error")
    assert entry.verify(deep=True).ok
    xr.testing.assert_identical(
        dx.open_zarr(url, storage_options=s3_bucket.storage_options).load(), ds.load())
    # Reading from the cluster too: the verifying store travels to the workers.
    lazy = dx.open_zarr(url, storage_options=s3_bucket.storage_options)
    assert float(lazy.temp.sum().compute()) == pytest.approx(float(ds.temp.sum()))


@pytest.mark.s3
@pytest.mark.slow
def test_killed_worker_leaves_the_entry_unfinished_and_a_retry_finishes_it(
        client: Any, s3_bucket: Bucket) -> None:
    url = s3_bucket.path("killed.zarr")
    options = s3_bucket.storage_options
    ds = doomed(s3_bucket, url, after=2)
    before = client.run_on_scheduler(_allowed_failures, 0)
    try:
        from distributed import KilledWorker

        with pytest.raises(KilledWorker):
            dx.to_zarr(ds, url, storage_options=options)
    finally:
        client.run_on_scheduler(_allowed_failures, before)
        client.wait_for_workers(2)
    assert Entry(url, storage_options=options).state() is not State.COMPLETE
    with pytest.raises(IncompleteError):
        dx.open_zarr(url, storage_options=options)
    with pytest.raises(NOT_FOUND):
        xr.open_zarr(url, storage_options=options)
    # The retry (the flag keeps block 2 from killing again).
    entry = dx.to_zarr(ds, url, storage_options=options, overwrite=True)
    assert entry.verify(deep=True).ok
    xr.testing.assert_identical(dx.open_zarr(url, storage_options=options).load(),
                                dataset().load())


@pytest.mark.s3
@pytest.mark.slow
def test_worker_killed_and_its_task_retried_still_commits_whole(client: Any,
                                                                s3_bucket: Bucket) -> None:
    url = s3_bucket.path("retried.zarr")
    options = s3_bucket.storage_options
    # The dead worker's unflushed records are lost: the commit reads what no fragment
    # covers, and the entry is still exactly what was written.
    entry = dx.to_zarr(doomed(s3_bucket, url, after=2), url, storage_options=options)
    client.wait_for_workers(2)
    assert entry.verify(deep=True).ok
    xr.testing.assert_identical(dx.open_zarr(url, storage_options=options).load(),
                                dataset().load())


def _fail_first_block_late_blocks(x: Any, block_info: Any = None) -> Any:
    """Block 0 fails at once; the others are still running when the write has failed."""
    import time

    if block_info[0]["chunk-location"][0] == 0:
        raise RuntimeError("block 0 failed")
    time.sleep(1.5)
    return x


@pytest.mark.slow
def test_a_failed_cluster_write_stops_its_running_tasks_before_the_retry(
        client: Any, tmp_path: Any) -> None:
    """dask cancels the tasks of a failed compute that have not started, not those that
    run. They used to write their chunks after the block's cleanup, over the chunks of the
    retry the guide advises, after its commit: COMPLETE, with another attempt's chunks in
    it (a plain reader saw them, durable's reads failed their CRC32C). The failed block now
    refuses every later write of its attempt on every worker before it cleans up."""
    url = os.path.join(os.path.realpath(tmp_path), "retried.zarr")
    old = da.full((40, 10), 1.0, chunks=(10, 10)).map_blocks(_fail_first_block_late_blocks,
                                                             dtype="float64")
    with pytest.raises(RuntimeError, match="block 0 failed"), \
            dz.writing(url) as store:
        array = zarr.create_array(store, shape=(40, 10), chunks=(10, 10), dtype="float64")
        da.store(old, array, lock=False)
    with dz.writing(url, overwrite=True) as store:
        array = zarr.create_array(store, shape=(40, 10), chunks=(10, 10), dtype="float64")
        da.store(da.full((40, 10), 2.0, chunks=(10, 10)), array, lock=False)
    time.sleep(2.5)  # the failed attempt's tasks have all finished by now
    assert (zarr.open_array(url, mode="r")[...] == 2.0).all()  # a plain reader
    assert Entry(url).verify(deep=True).ok
    assert (dz.open(url)[...] == 2.0).all()


def _allowed_failures(value: int, dask_scheduler: Any = None) -> int:
    before: int = dask_scheduler.allowed_failures
    dask_scheduler.allowed_failures = value
    return before


@pytest.mark.slow
def test_workers_flush_what_they_recorded(client: Any, tmp_path: Any) -> None:
    url = os.path.join(os.path.realpath(tmp_path), "local.zarr")
    with dz.writing(url, unrecorded="error") as store:
        array = zarr.create_array(store, shape=(40, 30), chunks=(10, 10), dtype="float32")
        data = da.ones((40, 30), chunks=(10, 10), dtype="float32")
        da.store(data, array, lock=False)
    assert Entry(url).verify(deep=True).ok



def _store_rows(store: Any, data: Any, rows: slice) -> None:
    """``data[rows]`` written by the cluster's tasks through ``store`` (a WritingStore)."""
    array = zarr.open_array(store, mode="r+")
    da.store(data[rows], array, regions=(rows, slice(None)), lock=False)


# Two coordinators on one entry, the second started with overwrite=True while the first's
# workers were at work (a pipeline launched twice, without a lease): random rows and a
# constant compress to chunks of different sizes.
_FIRST = da.random.RandomState(0).random_sample((40, 10), chunks=(10, 10))
_SECOND = da.full((40, 10), 2.0, chunks=(10, 10))


def _create(store: Any) -> None:
    zarr.create_array(store, shape=(40, 10), chunks=(10, 10), dtype="float64")


@pytest.mark.slow
def test_a_writer_whose_entry_another_started_over_publishes_nothing(
        client: Any, tmp_path: Any) -> None:
    """The second's clear removed the first's records and staged metadata, and staged its
    own. The first then published the second's metadata into the entry (and removed the
    second's staging): plain readers found an array while nothing was committed, its rows
    the second had not written yet read as fill values (incident 001's shape). A writer
    whose attempt record is gone publishes nothing and does not commit."""
    url = os.path.join(os.path.realpath(tmp_path), "two.zarr")
    with contextlib.ExitStack() as stack:
        with pytest.raises(IntegrityError, match=r"attempt record .* is gone at commit"), \
                dz.writing(url) as first:
            _create(first)
            _store_rows(first, _FIRST, slice(0, 40))
            second = stack.enter_context(dz.writing(url, overwrite=True))
            _create(second)
            _store_rows(second, _SECOND, slice(0, 20))
        with pytest.raises(NOT_FOUND):
            zarr.open_array(url, mode="r")  # a plain reader finds no array yet
        _store_rows(second, _SECOND, slice(20, 40))
    assert Entry(url).verify(deep=True).ok
    assert (dz.open(url)[...] == 2.0).all()
    assert (zarr.open_array(url, mode="r")[...] == 2.0).all()


@pytest.mark.slow
def test_chunks_replaced_or_removed_after_the_workers_recorded_them_stop_the_commit(
        client: Any, tmp_path: Any) -> None:
    """The first writer's tasks still running land over the second's chunks: one
    rewritten (another size), one deleted (zarr deletes a chunk equal to the fill value,
    0.0). The second's commit took its workers' fragments that disagreed with the store for
    objects no process recorded and read them back: COMPLETE, `verify(deep=True)` clean,
    read through durable as the first writer's rows and fill values. A chunk a fragment of
    this attempt names, gone or of another size, stops the commit as one the coordinator
    wrote itself does."""
    url = os.path.join(os.path.realpath(tmp_path), "two.zarr")
    stale = da.concatenate([_FIRST[:10], da.zeros((10, 10), chunks=(10, 10))])  # fill value
    with pytest.raises(IntegrityError, match="attempt record"), \
            contextlib.ExitStack() as stack:
        first = stack.enter_context(dz.writing(url))
        _create(first)
        with pytest.raises(IntegrityError) as refused, \
                dz.writing(url, overwrite=True) as second:
            _create(second)
            _store_rows(second, _SECOND, slice(0, 40))
            _store_rows(first, stale, slice(0, 20))  # the first's late tasks
        assert "c/0/0" in str(refused.value)  # replaced
        assert "c/1/0" in str(refused.value)  # removed
        assert Entry(url).state() is not State.COMPLETE


@pytest.mark.slow
def test_a_cluster_read_of_an_entry_changed_since_the_open_fails_as_durable_says(
        client: Any, tmp_path: Any) -> None:
    """A dataset opened lazily, its entry rewritten or removed before the compute.
    distributed's scheduler unpickles the task graph, and the verifying store read the
    entry's marker while it was unpickled: the compute failed with a RuntimeError, "Error
    during deserialization of the task graph ... the Scheduler and Client have different
    environments", which no caller of durable catches (and the scheduler needed the
    store's credentials). The store reads the marker in the task that first reads a
    chunk: the error is durable's own."""
    url = os.path.join(os.path.realpath(tmp_path), "changed.zarr")
    dx.to_zarr(dataset(), url)
    opened = dx.open_zarr(url)
    dx.to_zarr(dataset(100), url, mode="w")
    with pytest.raises(IntegrityError, match=r"committed again .* since it was opened"):
        opened.temp.sum().compute()
    opened = dx.open_zarr(url)
    Entry(url).delete()
    with pytest.raises(IncompleteError):
        opened.temp.sum().compute()
