"""Requests durable.tensorstore makes on S3 besides the array's own, pinned.

Counted through the fault proxy (no fault injected) in front of the moto server, as in
tests/test_request_counts.py. On an object store every request is a round trip; the
comments say what each is for, and a count going down is good news: update it.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

import durable
import durable.tensorstore as dts
from durable.testing import faults
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket
from test_request_counts import _kind  # LIST and DeleteObjects told apart

pytestmark = pytest.mark.s3

CHUNK = re.compile(r"/c/\d+/\d+$")
DATA = np.arange(40 * 60, dtype="float32").reshape(40, 60)  # 4 x 6 chunks of 10 x 10


def _counts(proxy: FaultProxy) -> tuple[dict[str, int], dict[str, int]]:
    """(requests for chunks, every other request), by kind; then forgets them."""
    chunks = collections.Counter(_kind(r) for r in proxy.requests if CHUNK.search(r.path))
    rest = collections.Counter(_kind(r) for r in proxy.requests if not CHUNK.search(r.path))
    proxy.clear_requests()
    return dict(chunks), dict(rest)


@pytest.fixture
def proxied(s3_bucket: Bucket) -> Iterator[tuple[FaultProxy, dict[str, Any]]]:
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        # The per-endpoint probes (tensorstore's ETags, create-only) run once per process
        # and endpoint: paid before counting, as by every later write.
        dts.write(s3_bucket.path("warm"), DATA[:10, :10], storage_options=options)
        proxy.clear_requests()
        yield proxy, options


def test_plain_tensorstore_create_for_comparison(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = proxied
    spec = {"driver": "zarr3", "kvstore": dts.kvstore_spec(s3_bucket.path("plain"), options)}
    array = ts.open(spec, create=True, dtype=ts.float32, shape=DATA.shape,
                    chunk_layout=ts.ChunkLayout(chunk_shape=[10, 10])).result()
    array.write(DATA).result()
    # tensorstore's create: a GET and a HEAD of zarr.json that find nothing, its PUT.
    assert _counts(proxy) == ({"PUT": 24}, {"GET": 1, "HEAD": 1, "PUT": 1})


def test_a_write_adds_a_fixed_number_of_requests(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = proxied
    url = s3_bucket.path("arr")
    dts.write(url, DATA, chunks=[10, 10], storage_options=options)
    # Start (Entry.writing): LIST of the records, LIST of the entry's name (nothing there),
    # PUT of the attempt record. zarr.json: one create-only PUT by the writer, which keeps
    # its bytes (no GET and HEAD by tensorstore's create, no GET back at commit). The
    # chunks are encoded on a memory copy of the array and put by the writer, which
    # records each: the commit lists no chunk, only the records (this attempt's alone:
    # nobody started or cleared the entry meanwhile), then the marker PUT (create-only)
    # and one DeleteObjects of the attempt record. 7 in all, plain tensorstore's create
    # makes 3.
    assert not [r for r in proxy.requests if "list-type" in r.query
                and r.query.get("prefix") == ["arr/"]]
    assert _counts(proxy) == ({"PUT": 24}, {"LIST": 3, "PUT": 3, "DELETE": 1})
    got = dts.open(url, storage_options=options).read().result()
    assert (got == DATA).all()
    # Open: the marker, the listing (against the manifest), durable's GET of zarr.json
    # (checked against the manifest's CRC32C and handed to tensorstore, which reads no
    # metadata); then the chunks. Was 3 GETs: tensorstore's own zarr.json GET, then the
    # marker again to prove no rewrite began meanwhile, which the verified document makes
    # needless (test_a_rewrite_that_starts_while_opening_is_refused).
    assert _counts(proxy) == ({"GET": 24}, {"GET": 2, "LIST": 1})
    # Opened again, the same commit: no listing. It was checked against one by the first
    # open of this process, and every read of this array is checked on its own (each
    # chunk ends in its crc32c codec, and the commit holds every chunk, so a missing one
    # is an error); the marker and zarr.json are still read and checked.
    got = dts.open(url, storage_options=options).read().result()
    assert (got == DATA).all()
    assert _counts(proxy) == ({"GET": 24}, {"GET": 2})
    # `read`: the same, and the marker once more after the last chunk (the commit still
    # the one read: no rewrite began meanwhile, so the values are all of one commit).
    assert (dts.read(url, storage_options=options) == DATA).all()
    assert _counts(proxy) == ({"GET": 24}, {"GET": 3})
    # Without the codec, a read does not check its chunk: every open lists.
    bare = s3_bucket.path("bare")
    dts.write(bare, DATA, chunks=[10, 10], storage_options=options, checksum_codec=False)
    proxy.clear_requests()
    for _ in range(2):
        assert (dts.open(bare, storage_options=options).read().result() == DATA).all()
        assert _counts(proxy) == ({"GET": 24}, {"GET": 2, "LIST": 1})


def test_a_writes_zarr_json_goes_beside_its_first_chunks(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    """The create-only PUT of zarr.json is not a round trip of its own before the chunks:
    held 1 s by the proxy, chunks are put meanwhile, and the commit still waits for it."""
    proxy, options = proxied
    proxy.add(faults.delay(1.0, method="PUT", path=re.compile(r"/held/zarr\.json$")))
    url = s3_bucket.path("held")
    dts.write(url, DATA, chunks=[10, 10], storage_options=options)
    (meta,) = [r for r in proxy.requests if r.path.endswith("/held/zarr.json")]
    chunks = [r for r in proxy.requests if CHUNK.search(r.path)]
    assert meta.status == 200 and len(chunks) == 24
    assert min(r.started for r in chunks) < meta.started + meta.duration
    marker = [r for r in proxy.requests if r.path.endswith("/.durable/held/commit.json")]
    assert marker[0].started >= meta.started + meta.duration  # the commit waited for it
    assert dts.entry_for(url, options).verify(deep=True).ok


def test_a_refused_zarr_json_fails_the_write_and_leaves_nothing(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    """A zarr.json refused as already there (a writer that raced past the start) fails the
    write as tensorstore's create does; chunks already put beside it are all removed."""
    proxy, options = proxied
    proxy.add(faults.error(412, "PreconditionFailed", method="PUT",
                           path=re.compile(r"/lost/zarr\.json$")))
    url = s3_bucket.path("lost")
    with pytest.raises(ValueError, match=r"ALREADY_EXISTS.*lost/zarr\.json"):
        dts.write(url, DATA, chunks=[10, 10], storage_options=options)
    plain = s3_bucket.filesystem()
    plain.invalidate_cache()
    assert plain.find(f"{s3_bucket.name}/lost") == []
    assert plain.find(f"{s3_bucket.name}/.durable/lost") == []
    assert dts.entry_for(url, s3_bucket.storage_options).state() is durable.State.ABSENT
