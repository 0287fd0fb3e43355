"""durable.zarr's deferred staging (`write`, `to_zarr`, `writing(stage="on_handoff")`):
documents held in memory must never come back after a delete, nor land over another
writer's committed metadata.

Found by a review with running code: a hand-off that failed part-way left a copy in
staging that a later delete of the node did not remove (the node came back, read as fill
values, in a COMPLETE entry); and a writer that lost the race to one that started after
it with ``overwrite=True`` published its metadata over the winner's (the winner's entry
went INCOMPLETE, and plain zarr read the winner's chunks with the loser's dtype).
"""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path

import numpy as np
import pytest
import zarr

import durable.zarr as dz
from durable import AlreadyCompleteError, Entry, State
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket


def test_a_node_deleted_after_a_failed_hand_off_stays_deleted(s3_bucket: Bucket) -> None:
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        url = s3_bucket.path("g.zarr")
        with dz.writing(url, storage_options=options, stage="on_handoff") as store:
            root = zarr.open_group(store, mode="w-")
            root.create_array("a", shape=(4,), chunks=(2,), dtype="int8")[:] = 7
            root.create_array("b", shape=(4,), chunks=(2,), dtype="int8")[:] = 1
            # The hand-off's PUT of the root document fails: a/zarr.json may have landed
            # in staging, and the store is still deferred.
            proxy.inject("error", status=403, forward=False, method="PUT",
                         key="g.zarr/staged/zarr.json", times=1)
            with pytest.raises(PermissionError):
                pickle.dumps(store)
            del root["a"]
            pickle.dumps(store)  # the hand-off succeeds now
        assert Entry(url, storage_options=options).state() is State.COMPLETE
        plain = zarr.open_group(url, mode="r", storage_options=options)
        assert sorted(plain.array_keys()) == ["b"]
        assert sorted(dz.open(url, storage_options=options).array_keys()) == ["b"]
        fs = s3_bucket.filesystem()
        fs.invalidate_cache()
        staged = fs.find(s3_bucket.path(".durable/g.zarr/staged"))
        assert staged == []


def _target(kind: str, tmp_path: Path, bucket: Bucket | None) -> tuple[str, dict | None]:
    if kind == "file":
        return str(tmp_path / "race.zarr"), None
    if kind == "memory":
        return f"memory://staging-{uuid.uuid4().hex}/race.zarr", None
    assert bucket is not None
    return bucket.path("race.zarr"), dict(bucket.storage_options)


@pytest.mark.parametrize("stage", ["on_handoff", "eager"])
@pytest.mark.parametrize("kind", ["file", "memory", "s3"])
def test_a_loser_never_publishes_over_the_winners_metadata(
        kind: str, stage: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    bucket = request.getfixturevalue("s3_bucket") if kind == "s3" else None
    url, options = _target(kind, tmp_path, bucket)
    data = np.array([-1, -2, 3, 4], dtype="int8")
    # The loser started first; the winner came in with overwrite=True and committed.
    with pytest.raises(AlreadyCompleteError, match="first"), \
            dz.writing(url, storage_options=options, stage=stage) as loser:
        with dz.writing(url, storage_options=options, stage=stage, overwrite=True) as winner:
            zarr.create_array(winner, shape=(4,), chunks=(2,), dtype="int8",
                              compressors=None)[:] = data
        # The same chunk bytes under another dtype: only the metadata tells them apart.
        zarr.create_array(loser, shape=(4,), chunks=(2,), dtype="uint8",
                          compressors=None)[:] = data.view("uint8")
    assert Entry(url, storage_options=options).state() is State.COMPLETE
    plain = zarr.open_array(url, mode="r", storage_options=options)
    assert plain.dtype == np.dtype("int8")
    np.testing.assert_array_equal(plain[:], data)
    np.testing.assert_array_equal(dz.open(url, storage_options=options)[:], data)
    Entry(url, storage_options=options).verify(deep=True)
