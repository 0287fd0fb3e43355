"""durable.tensorstore written from many processes: the coordinator's `writing()` block
creates the array and commits; dask workers (a real two-process `distributed.LocalCluster`)
open it from its spec and write their regions with plain tensorstore. What the workers put
is found by the commit's listing, on a local disk and on moto; what lands after the commit
fails the next open, never passes for the commit's data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

import durable.tensorstore as dts
from durable import Entry, IntegrityError, State
from durable.testing.pytest_plugin import Bucket

pytestmark = pytest.mark.slow

ROWS, COLS, BAND = 120, 80, 30  # four bands of rows, each a row of chunks


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1",
                      dashboard_address=":0") as cluster, Client(cluster) as c:
        yield c


def band(spec: dict[str, Any], i: int) -> str:
    """A worker's task: open the array the coordinator created, write band ``i``."""
    import numpy as np
    import tensorstore as ts

    array = ts.open(spec, open=True).result()
    array[i * BAND:(i + 1) * BAND].write(np.full((BAND, COLS), i + 1, "int32")).result()
    return f"band {i}"


def expected() -> np.ndarray:
    return np.repeat(np.arange(1, ROWS // BAND + 1, dtype="int32"), BAND)[:, None] \
        * np.ones((1, COLS), "int32")


@pytest.fixture(params=["file", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
    if request.param == "file":
        return str(tmp_path / "bands"), {}
    bucket: Bucket = request.getfixturevalue("s3_bucket")
    return bucket.path("bands"), bucket.storage_options


def test_workers_write_and_the_coordinator_commits_every_chunk(
        client: Any, where: tuple[str, dict[str, Any]]) -> None:
    url, options = where
    with dts.writing(url, storage_options=options) as w:
        array = w.open(create=True, dtype=ts.int32, shape=[ROWS, COLS],
                       chunk_layout=ts.ChunkLayout(chunk_shape=[BAND, COLS // 2]))
        spec = array.spec().to_json()
        # Every task waited for before the block ends: the commit lists what they put.
        assert client.gather(client.map(band, [spec] * (ROWS // BAND),
                                         range(ROWS // BAND))) == [
            f"band {i}" for i in range(ROWS // BAND)]
    entry = Entry(url, storage_options=options)
    marker = entry.require_complete()
    assert marker.manifest is not None
    chunks = {f"c/{i}/{j}" for i in range(ROWS // BAND) for j in range(2)}
    # Every chunk a worker put is in the manifest (none of them went through this
    # process), with the size and CRC32C found on the store.
    assert set(marker.manifest.objects) == chunks | {"zarr.json"}
    assert entry.verify(deep=True).problems == []
    np.testing.assert_array_equal(
        dts.open(url, storage_options=options).read().result(), expected())
    # A plain tensorstore reader reads the same array, without durable.
    plain = ts.open({"driver": "zarr3", "kvstore": dts.kvstore_spec(url, options)}).result()
    np.testing.assert_array_equal(plain.read().result(), expected())


def test_a_worker_write_landing_after_the_commit_fails_the_next_open(
        client: Any, tmp_path: Any) -> None:
    url = str(tmp_path / "late")
    with dts.writing(url) as w:
        array = w.open(create=True, dtype=ts.int32, shape=[ROWS, COLS],
                       chunk_layout=ts.ChunkLayout(chunk_shape=[BAND, COLS // 2]))
        spec = array.spec().to_json()
        client.gather(client.map(band, [spec] * 3, range(3)))  # the last band not yet
    assert Entry(url).status().state is State.COMPLETE
    # A straggler (a task not waited for) writes after the commit: a chunk the commit does
    # not hold. The next open names it; it never reads as the commit's data.
    client.submit(band, spec, 3).result()
    with pytest.raises(IntegrityError, match=r"late/c/3/0: not in the manifest"):
        dts.open(url, context=ts.Context())
    assert [p.issue for p in Entry(url).verify(raise_errors=False).problems] == [
        "unexpected", "unexpected"]
