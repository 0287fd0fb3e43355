"""durable.tensorstore: arrays committed whole, refused when not, never read stale or mixed.

Incident 000: levanter read zarr3 arrays through one tensorstore Context with a large
cache_pool and revalidation off; after a rewrite, handles served stale chunks, and on R2
re-opening died with "Malformed StorageGeneration". Here the rewriters are real processes
(tests/_ts_child.py, SIGKILLed where a test needs it), the stores are real (local disk,
tensorstore's memory kvstore, moto, the GCS emulators), faults go through the S3 fault
proxy, and what is on the store is read and damaged around durable (os, s3fs/gcsfs, a raw
tensorstore KvStore). The stale-read test reads every commit both through durable and
through plain tensorstore, and shows the plain reader's stale and mixed reads.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tensorstore as ts

import durable.tensorstore as dts
from _ts_child import COLS, TsChild, rewrite
from _ts_child import write as child_write
from durable import (
    AlreadyCompleteError,
    Entry,
    IncompleteError,
    IntegrityError,
    MarkerError,
    State,
    UnsupportedError,
)
from durable._checksum import crc32c
from durable._tensorstore_kv import _MEMORY, forget_endpoint
from durable.testing import faults
from durable.testing.faults import FaultProxy, Match
from durable.testing.pytest_plugin import Bucket

RESIDUE = 0x48674BC7
LEVANTER = {"recheck_cached_data": False, "recheck_cached_metadata": "open"}


def shared_context() -> ts.Context:
    """What levanter shares process-wide: a large cache pool."""
    return ts.Context({"cache_pool": {"total_bytes_limit": 100_000_000}})


class Target:
    """A fresh place on one store; ``raw_*`` read and damage it around durable."""

    def __init__(self, kind: str, root: str, options: dict[str, Any] | None = None,
                 bucket: Bucket | None = None) -> None:
        self.kind = kind
        self.root = root
        self.options = options
        self.bucket = bucket
        self.in_process = kind == "memory"  # tensorstore's memory kvstore: one process

    def url(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _raw(self) -> Any:
        if self.kind == "memory":
            return ts.KvStore.open({"driver": "memory"}, context=_MEMORY).result()
        assert self.bucket is not None
        fs = self.bucket.filesystem()
        fs.invalidate_cache()
        return fs

    def _where(self, rel: str) -> str:
        return self.url(rel).split("://", 1)[-1].lstrip("/" if self.kind == "memory" else "")

    def raw_keys(self, rel: str) -> dict[str, int]:
        """Objects below ``rel`` -> their sizes."""
        base = self._where(rel)
        if self.kind == "file":
            return {os.path.relpath(os.path.join(d, f), base): os.path.getsize(
                os.path.join(d, f)) for d, _, fs in os.walk(base) for f in fs}
        raw = self._raw()
        if self.kind == "memory":
            keys = raw.list(ts.KvStore.KeyRange(base + "/", base + "0")).result()
            return {k.decode()[len(base) + 1:]: len(raw[k]) for k in keys}
        return {p[len(base) + 1:]: int(i["size"]) for p, i in raw.find(
            base, detail=True).items()}

    def raw_read(self, rel: str) -> bytes:
        if self.kind == "file":
            with open(self._where(rel), "rb") as f:
                return f.read()
        raw = self._raw()
        return bytes(raw[self._where(rel)] if self.kind == "memory"
                     else raw.cat_file(self._where(rel)))

    def raw_write(self, rel: str, data: bytes) -> None:
        if self.kind == "file":
            os.makedirs(os.path.dirname(self._where(rel)), exist_ok=True)
            with open(self._where(rel), "wb") as f:
                f.write(data)
        elif self.kind == "memory":
            self._raw()[self._where(rel)] = data
        else:
            self._raw().pipe_file(self._where(rel), data)

    def raw_delete(self, rel: str) -> None:
        if self.kind == "file":
            os.unlink(self._where(rel))
        elif self.kind == "memory":
            del self._raw()[self._where(rel)]
        else:
            self._raw().rm_file(self._where(rel))

    def plain_open(self, rel: str, context: ts.Context, **kwargs: Any) -> ts.TensorStore:
        """Plain tensorstore, no durable: what levanter does."""
        spec = dts.kvstore_spec(self.url(rel), self.options)
        if self.kind == "memory":
            kv = ts.KvStore.open(spec, context=_MEMORY).result()
            return ts.open({"driver": "zarr3"}, kvstore=kv, context=context, **kwargs).result()
        return ts.open({"driver": "zarr3", "kvstore": spec}, context=context,
                       **kwargs).result()

    def rewrite(self, rel: str, how: str, value: float, rows: int) -> None:
        """Another writer rewrites and recommits (a real process, except for memory)."""
        if self.in_process:
            child_write(self.url(rel), how, value, rows, self.options)
        else:
            rewrite(self.url(rel), how, value, rows, self.options)


def make_target(kind: str, request: pytest.FixtureRequest, tmp_path: Any,
                monkeypatch: pytest.MonkeyPatch) -> Target:
    if kind == "file":
        return Target("file", os.path.realpath(tmp_path))
    if kind == "memory":
        return Target("memory", f"memory://ts-{uuid.uuid4().hex[:12]}")
    fixture = {"s3": "s3_bucket", "gcs": "gcs_bucket", "fake_gcs": "fake_gcs_bucket"}[kind]
    bucket: Bucket = request.getfixturevalue(fixture)
    if kind != "s3":
        # tensorstore's gcs driver takes one endpoint per process, from the environment.
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", bucket.server.url)
    return Target(kind, bucket.path("t"), dict(bucket.storage_options), bucket)


@pytest.fixture(params=["file", "memory", "s3", "gcs"])
def target(request: pytest.FixtureRequest, tmp_path: Any,
           monkeypatch: pytest.MonkeyPatch) -> Target:
    return make_target(request.param, request, tmp_path, monkeypatch)


def values(rows: int, seed: float = 0) -> Any:
    return (np.arange(rows * COLS, dtype="float32").reshape(rows, COLS) + 1 + seed)


def cache_reads() -> int:
    """tensorstore's own count of the reads its cache sends to a kvstore (fetches and
    revalidations): the array's I/O, not durable's own reads of its records."""
    found = ts.experimental_collect_matching_metrics("/tensorstore/cache/kvs_cache_read")
    return sum(int(v.get("value", 0)) for m in found for v in m["values"])


# --------------------------------------------------------------------- the spec builder
def test_kvstore_spec_file_and_memory(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    here = os.path.realpath(tmp_path)
    assert dts.kvstore_spec("a/b") == {"driver": "file", "path": f"{here}/a/b/"}
    assert dts.kvstore_spec(f"file://{here}/a/") == {"driver": "file", "path": f"{here}/a/"}
    assert dts.kvstore_spec("memory://x/y") == {"driver": "memory", "path": "x/y/"}
    with pytest.raises(UnsupportedError, match="no kvstore driver for 'abfs'"):
        dts.kvstore_spec("abfs://c/x")


def test_kvstore_spec_s3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "envkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    r2 = "https://acct.r2.cloudflarestorage.com"
    spec = dts.kvstore_spec("s3://bkt/a/b.zarr", {"endpoint_url": r2, "key": "envkey",
                                                  "secret": "envsecret"})
    assert spec == {"driver": "s3", "bucket": "bkt", "path": "a/b.zarr/", "endpoint": r2,
                    "aws_region": "eu-west-3", "aws_credentials": {"type": "environment"}}
    spec = dts.kvstore_spec("s3://bkt/k", {"client_kwargs": {"endpoint_url": r2,
                                                             "region_name": "auto"},
                                           "anon": True})
    assert (spec["endpoint"], spec["aws_region"], spec["aws_credentials"]) == (
        r2, "auto", {"type": "anonymous"})
    assert dts.kvstore_spec("s3://bkt/k", {"profile": "p"})["aws_credentials"] == {
        "type": "profile", "profile": "p"}
    assert dts.kvstore_spec("s3://bkt/k")["aws_credentials"] == {"type": "default"}
    # Keys that are not the environment's: a private credentials file, named as a profile.
    creds = dts.kvstore_spec("s3://bkt/k", {"key": "AKIAOTHER", "secret": "s3cr3t",
                                            "token": "tok"})["aws_credentials"]
    assert creds["type"] == "profile" and creds["profile"].startswith("durable-")
    assert stat.S_IMODE(os.stat(creds["credentials_file"]).st_mode) == 0o600
    with open(creds["credentials_file"]) as f:
        text = f.read()
    assert (f"[{creds['profile']}]\naws_access_key_id = AKIAOTHER\naws_secret_access_key = "
            "s3cr3t\naws_session_token = tok\n") in text
    with pytest.raises(ValueError, match="both key and secret"):
        dts.kvstore_spec("s3://bkt/k", {"key": "only"})


def test_s3_endpoint_from_the_environment_is_the_one_s3fs_uses(
        s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    # botocore (so s3fs, so the entry's records) takes $AWS_ENDPOINT_URL; tensorstore does
    # not: the chunks went to AWS (here: a write hanging on an unreachable address).
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(name, raising=False)
    endpoint = s3_bucket.storage_options["endpoint_url"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert dts.kvstore_spec("s3://bkt/k")["endpoint"] == endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint + "/s3-only")
    assert dts.kvstore_spec("s3://bkt/k")["endpoint"] == endpoint + "/s3-only"
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert "endpoint" not in dts.kvstore_spec("s3://bkt/k")
    monkeypatch.delenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    keys = {k: v for k, v in s3_bucket.storage_options.items() if k != "endpoint_url"}
    url = s3_bucket.path("a.zarr")
    dts.write(url, values(8), chunks=[4, COLS], storage_options=keys)
    assert dts.read(url, storage_options=keys).tolist() == values(8).tolist()
    assert s3_bucket.filesystem().exists(s3_bucket.path("a.zarr", "zarr.json"))


def test_kvstore_spec_gcs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
    spec = dts.kvstore_spec("gs://bkt/a/b", {"endpoint_url": "http://127.0.0.1:9",
                                             "token": "anon"})
    assert spec == {"driver": "gcs", "bucket": "bkt", "path": "a/b/"}
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:9"
    with pytest.raises(UnsupportedError, match=r"TENSORSTORE_GCS_HTTP_URL.*127\.0\.0\.1:8"):
        dts.kvstore_spec("gcs://bkt/a", {"endpoint_url": "http://127.0.0.1:8"})
    with pytest.raises(UnsupportedError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        dts.kvstore_spec("gs://bkt/a", {"token": "/some/key.json"})


@contextlib.contextmanager
def signing_keys(bucket: Bucket) -> Iterator[tuple[FaultProxy, list[str]]]:
    """A proxy in front of the bucket's store, and the access key each request through it
    was signed with ("" for an unsigned one)."""
    keys: list[str] = []

    def look(info: faults.RequestInfo) -> bool:
        signed = info.headers.get("authorization") or ""
        keys.append(signed.split("Credential=")[1].split("/")[0] if signed else "")
        return False  # observe only, no fault

    with FaultProxy(upstream=bucket.storage_options["endpoint_url"]) as proxy:
        proxy.add(faults.delay(0, match=Match(where=look)))
        yield proxy, keys


def test_s3_keys_from_storage_options_are_the_ones_tensorstore_signs_with(
        s3_bucket: Bucket) -> None:
    with signing_keys(s3_bucket) as (proxy, keys):
        opts = {"endpoint_url": proxy.url, "key": "durable-test-key", "secret": "s"}
        kv = ts.KvStore.open(dts.kvstore_spec(s3_bucket.path("k"), opts)).result()
        kv.write("x", b"1").result()
        assert kv.read("x").result().value == b"1"
    assert {k for k in keys if k} == {"durable-test-key"}


def test_keys_in_client_kwargs_are_the_ones_every_request_is_signed_with(
        s3_bucket: Bucket) -> None:
    """s3fs hands ``client_kwargs`` to botocore, which takes keys there too: durable's own
    requests were signed with them while tensorstore's chunks went out with the default
    credentials (another identity, or a 403 after the marker was read fine)."""
    with signing_keys(s3_bucket) as (proxy, keys):
        opts = {"client_kwargs": {"endpoint_url": proxy.url,
                                  "aws_access_key_id": "durable-client-key",
                                  "aws_secret_access_key": "s"}}
        url = s3_bucket.path("arr")
        dts.write(url, values(20), chunks=[10, 10], storage_options=opts)
        assert (dts.read(url, storage_options=opts) == values(20)).all()
        assert proxy.count(method="PUT", key="/arr/c/") > 0  # tensorstore's, through it
    assert set(keys) == {"durable-client-key"}


def test_requester_pays_is_refused_before_anything_is_sent(s3_bucket: Bucket) -> None:
    """tensorstore takes "requester_pays" in its spec and sends no x-amz-request-payer
    header: a requester-pays bucket would refuse its requests after durable's own, sent
    with the header by s3fs, had read the marker."""
    url = s3_bucket.path("arr")
    opts = {**s3_bucket.storage_options, "requester_pays": True}
    for how in (lambda: dts.write(url, values(4), storage_options=opts),
                lambda: dts.read(url, storage_options=opts)):
        with pytest.raises(UnsupportedError, match=r"requester_pays=True.*durable\.zarr"):
            how()
    assert Entry(url, storage_options=s3_bucket.storage_options).state() is State.ABSENT


# ----------------------------------------------------------------- writing, committing
def test_write_commits_a_manifest_that_matches_the_bytes(target: Target) -> None:
    data = values(20)
    entry = dts.write(target.url("arr"), data, chunks=[10, 10],
                      storage_options=target.options)
    assert entry.state() is State.COMPLETE
    marker = entry.read_marker()
    assert marker is not None and marker.manifest is not None
    raw = target.raw_keys("arr")
    assert set(marker.manifest.objects) == set(raw) == {"zarr.json"} | {
        f"c/{r}/{c}" for r in range(2) for c in range(3)}
    for key, rec in marker.manifest.objects.items():
        body = target.raw_read(f"arr/{key}")
        assert (rec.size, rec.crc32c) == (len(body), crc32c(body)) == (raw[key], rec.crc32c)
        if key != "zarr.json":
            assert rec.crc32c == RESIDUE  # a crc32c codeword, recorded without a read
    meta = json.loads(target.raw_read("arr/zarr.json"))
    assert meta["codecs"][-1] == {"name": "crc32c"}
    assert entry.verify(deep=True).ok
    assert (dts.open(target.url("arr"), storage_options=target.options).read().result()
            == data).all()


def _write_in_block(url: str, data: Any, opts: dict[str, Any], codec: bool,
                    layout: dict[str, Any], **spec: Any) -> None:
    """The array written through `writing` and tensorstore's own write: the commit learns
    of the chunks from a listing."""
    with dts.writing(url, storage_options=opts) as w:
        w.write(w.open(create=True, dtype=data.dtype, shape=data.shape,
                       checksum_codec=codec, spec=spec, **layout), data)


@pytest.mark.parametrize("how", ["write", "writing"])
def test_commit_reads_no_chunk_back(s3_bucket: Bucket, how: str) -> None:
    """`write` encodes and puts the chunks itself, so it knows every chunk's bytes and
    reads nothing back and lists no chunk. Through `writing`, tensorstore writes them:
    chunks with the crc32c codec are recorded from the listing, shards from their index
    (a small ranged read each); without the codec, every chunk is fetched again."""
    sharded = {"chunk_layout": ts.ChunkLayout(write_chunk_shape=[20, 30],
                                              read_chunk_shape=[10, 10])}
    unsharded = {"chunk_layout": ts.ChunkLayout(chunk_shape=[10, 10])}
    with FaultProxy(upstream=s3_bucket.storage_options["endpoint_url"]) as proxy:
        opts = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        for name, codec, layout, gets, most in (("codec", True, unsharded, 0, 0),
                                                ("sharded", True, sharded, 1, 16 * 9 + 4),
                                                ("off", False, unsharded, 6, 10**9)):
            proxy.clear_requests()
            url = s3_bucket.path(name)
            if how == "write":
                dts.write(url, values(20), storage_options=opts, checksum_codec=codec,
                          **layout)
                gets = 0
            else:
                _write_in_block(url, values(20), opts, codec, layout)
            fetched = [r for r in proxy.requests if r.method == "GET"
                       and re.search(rf"/{name}/c/", r.path)]
            assert len(fetched) == gets and all(r.response_bytes <= most for r in fetched)
            entry_lists = [r for r in proxy.requests if "list-type" in r.query
                           and r.query.get("prefix") == [f"{name}/"]]
            assert len(entry_lists) == (0 if how == "write" else 1)
            assert Entry(url, storage_options=opts).verify(deep=True).ok


@pytest.mark.parametrize("slab", [1, 10**9])
def test_write_puts_exactly_the_bytes_tensorstore_would(
        s3_bucket: Bucket, slab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`write` across a network puts the chunks itself (encoded on a memory copy of the
    array), or has tensorstore put them and records them unlisted (fixed-size codeword
    chunks): each object must be the one tensorstore's own write puts when it stores
    every chunk, for plain, codec, sharded and partly fill-value arrays, a row of chunks
    (or shards) at a time or all at once."""
    import durable._tensorstore_writing as module

    monkeypatch.setattr(module, "_SLAB_BYTES", slab)
    monkeypatch.setattr(module, "_WRITES_AT_ONCE", min(slab, 5))
    layouts = {"plain": {"chunk_layout": ts.ChunkLayout(chunk_shape=[7, 10])},
               "sharded": {"chunk_layout": ts.ChunkLayout(write_chunk_shape=[14, 30],
                                                          read_chunk_shape=[7, 10])}}
    data = values(40)
    data[7:21, :] = 0  # whole chunks of fill value: `write` stores them too
    fs = s3_bucket.filesystem()
    for name, layout in layouts.items():
        for codec in (True, False):
            ours, theirs = s3_bucket.path(f"{name}-{codec}-d"), s3_bucket.path(f"{name}-{codec}-t")
            dts.write(ours, data, storage_options=s3_bucket.storage_options,
                      checksum_codec=codec, **layout)
            _write_in_block(theirs, data, s3_bucket.storage_options, codec, layout,
                            store_data_equal_to_fill_value=True)
            fs.invalidate_cache()
            a = {p[len(ours) - 5:]: fs.cat_file(p) for p in fs.find(ours[5:])}
            b = {p[len(theirs) - 5:]: fs.cat_file(p) for p in fs.find(theirs[5:])}
            assert a == b, (name, codec)
            # every grid position: 6 x 3 chunks, or 3 x 1 shards, and zarr.json
            assert len(a) == 1 + (18 if name == "plain" else 3), (name, codec)
            assert (dts.open(ours, storage_options=s3_bucket.storage_options).read().result()
                    == data).all()
            assert Entry(ours, storage_options=s3_bucket.storage_options).verify(deep=True).ok


def _streaming(url: str, opts: dict[str, Any]) -> Any:
    """`write`'s own steps in a block: room to act before its commit."""
    @contextlib.contextmanager
    def block() -> Iterator[None]:
        with dts.writing(url, storage_options=opts) as w:
            data = values(20)
            array = w.open(create=True, dtype=data.dtype, shape=data.shape,
                           chunk_layout=ts.ChunkLayout(chunk_shape=[10, 10]))
            assert w._stream(array, data)
            yield
    return block()


def test_a_streamed_chunk_replaced_by_another_codeword_of_its_size_is_caught(
        s3_bucket: Bucket) -> None:
    """`_stream` recorded each codeword chunk by the residue alone, the same for every
    chunk: another attempt's chunk of the same size over a committed one passed deep
    verification. It holds the encoded bytes: their last 4 (the chunk's own CRC32C) are
    recorded too, and compared."""
    url, other = s3_bucket.path("arr"), s3_bucket.path("other")
    opts = dict(s3_bucket.storage_options)
    with _streaming(url, opts):
        pass
    with dts.writing(other, storage_options=opts) as w:
        data = values(20) + 1
        assert w._stream(w.open(create=True, dtype=data.dtype, shape=data.shape,
                                chunk_layout=ts.ChunkLayout(chunk_shape=[10, 10])), data)
    entry = Entry(url, storage_options=opts)
    marker = entry.read_marker()
    assert marker is not None and marker.manifest is not None
    fs = s3_bucket.filesystem()
    committed = fs.cat_file(f"{url[5:]}/c/0/0")
    rec = marker.manifest.objects["c/0/0"]
    assert (rec.crc32c, rec.tail) == (RESIDUE, int.from_bytes(committed[-4:], "big"))
    straggler = fs.cat_file(f"{other[5:]}/c/0/0")
    assert len(straggler) == len(committed) and straggler != committed
    fs.pipe_file(f"{url[5:]}/c/0/0", straggler)
    report = entry.verify(deep=True, raise_errors=False)
    assert [(p.key, p.issue) for p in report.problems] == [("c/0/0", "crc32c")]


def test_a_streamed_write_whose_entry_was_cleared_meanwhile_does_not_commit(
        s3_bucket: Bucket) -> None:
    url, opts = s3_bucket.path("arr"), dict(s3_bucket.storage_options)
    with pytest.raises(IntegrityError, match="gone at commit"), _streaming(url, opts):
        Entry(url, storage_options=opts).delete()  # a clean or delete, records and all
    assert Entry(url, storage_options=opts).state() is not State.COMPLETE


def test_a_streamed_write_beside_another_writers_record_checks_the_listing(
        s3_bucket: Bucket) -> None:
    url, opts = s3_bucket.path("arr"), dict(s3_bucket.storage_options)
    with contextlib.ExitStack() as first, contextlib.ExitStack() as second:
        first.enter_context(_streaming(url, opts))
        other = second.enter_context(Entry(url, storage_options=opts).writing(resume=True))
        other.write_bytes("c/1/1", b"not a chunk")
        with pytest.raises(IntegrityError, match=r"c/1/1: written with \d+ bytes, 11 at"):
            first.close()


def test_shards_are_recorded_from_their_index(target: Target) -> None:
    layout = ts.ChunkLayout(write_chunk_shape=[20, 30], read_chunk_shape=[10, 10])
    entry = dts.write(target.url("arr"), values(40), storage_options=target.options,
                      chunk_layout=layout)
    marker = entry.read_marker()
    assert marker is not None and marker.manifest is not None
    shards = {k: r for k, r in marker.manifest.objects.items() if k != "zarr.json"}
    assert set(shards) == {"c/0/0", "c/1/0"}
    for key, rec in shards.items():
        body = target.raw_read(f"arr/{key}")
        assert (rec.size, rec.crc32c) == (len(body), crc32c(body))
    got = dts.open(target.url("arr"), storage_options=target.options, deep=True)
    assert (got.read().result() == values(40)).all()


def test_a_chunk_damaged_before_the_commit_is_not_blessed(target: Target) -> None:
    """A re-read at commit would checksum the damaged bytes into the manifest; the
    residue is what an intact chunk must have, so deep verify sees the damage."""
    with dts.writing(target.url("arr"), storage_options=target.options) as w:
        array = w.open(create=True, dtype=ts.float32, shape=[20, COLS],
                       chunk_layout=ts.ChunkLayout(chunk_shape=[10, 10]))
        array[...] = values(20)
        body = bytearray(target.raw_read("arr/c/1/2"))
        body[3] ^= 0x40
        target.raw_write("arr/c/1/2", bytes(body))
    report = w.entry.verify(deep=True, raise_errors=False)
    assert [(p.key, p.issue) for p in report.problems] == [("c/1/2", "crc32c")]


def flip(path: str, offset: int) -> None:
    """Flip one bit of a file in place (offset < 0 counts from the end)."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_SET if offset >= 0 else os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_shard_damaged_before_the_commit_is_caught(tmp_path: Any) -> None:
    """Inner chunk damaged: recorded from the index, caught by deep verify. Index damaged:
    every reader would refuse the shard, so the commit does."""
    layout = ts.ChunkLayout(write_chunk_shape=[20, 30], read_chunk_shape=[10, 10])
    for where, offset in (("chunk", 5), ("index", -7)):
        url = os.path.join(tmp_path, where)
        path = os.path.join(url, "c", "0", "0")

        if where == "chunk":
            with dts.writing(url) as w:
                w.open(create=True, dtype=ts.float32, shape=[20, COLS],
                       chunk_layout=layout)[...] = values(20)
                flip(path, offset)
            problems = w.entry.verify(deep=True, raise_errors=False).problems
            assert [(p.key, p.issue) for p in problems] == [("c/0/0", "crc32c")]
        else:
            with pytest.raises(IntegrityError, match=r"c/0/0: the shard index .* fails"), \
                    dts.writing(url) as w:
                w.open(create=True, dtype=ts.float32, shape=[20, COLS],
                       chunk_layout=layout)[...] = values(20)
                flip(path, offset)
            assert dts.entry_for(url).state() is not State.COMPLETE


def test_crc32c_codec_placement_and_opt_out(tmp_path: Any) -> None:
    import zarr

    def codecs(name: str, **kwargs: Any) -> Any:
        url = os.path.join(tmp_path, name)
        with dts.writing(url) as w:
            array = w.open(create=True, dtype=ts.float32, shape=[20, 20], **kwargs)
            array[...] = values(20, 0)[:, :20]
        assert (zarr.open_array(url, mode="r")[...] == values(20)[:, :20]).all()
        with open(os.path.join(url, "zarr.json")) as f:
            return json.load(f)["codecs"]

    crc = {"name": "crc32c"}
    assert codecs("default") == [{"name": "bytes", "configuration": {"endian": "little"}},
                                 crc]
    assert [c["name"] for c in codecs(
        "zstd", spec={"metadata": {"codecs": [{"name": "bytes"}, {"name": "zstd"}]}})] == [
        "bytes", "zstd", "crc32c"]
    assert [c["name"] for c in codecs(
        "codec", codec=ts.CodecSpec({"driver": "zarr3", "codecs": [{"name": "zstd"}]}))] == [
        "bytes", "zstd", "crc32c"]
    sharded = codecs("sharded", chunk_layout=ts.ChunkLayout(write_chunk_shape=[20, 20],
                                                            read_chunk_shape=[10, 10]))
    assert sharded[-1]["name"] == "sharding_indexed"
    assert sharded[-1]["configuration"]["codecs"][-1] == crc
    assert "crc32c" not in json.dumps(codecs("off", checksum_codec=False))
    # A shard is not a codeword as a whole: read back once at commit, and still right.
    assert Entry(os.path.join(tmp_path, "sharded")).verify(deep=True).ok


_BYTES_LE = {"name": "bytes", "configuration": {"endian": "little"}}
_FIXED = [  # (data type, shape, chunk shape, codecs before crc32c, chunk key encoding)
    ("float32", [20, 30], [7, 10], [_BYTES_LE], {"name": "default"}),
    ("bool", [13], [4], [{"name": "bytes"}], {"name": "default"}),
    ("uint16", [5, 6, 7], [2, 3, 4], [_BYTES_LE], {"name": "v2"}),
    ("complex128", [9, 4], [4, 4], [{"name": "bytes", "configuration": {"endian": "big"}}],
     {"name": "default", "configuration": {"separator": "."}}),
    ("int64", [11, 3], [4, 2], [{"name": "transpose", "configuration": {"order": [1, 0]}},
                                _BYTES_LE], {"name": "v2", "configuration": {"separator": "/"}}),
    ("bfloat16", [6, 6], [6, 6], [_BYTES_LE], {"name": "default"}),
    ("float64", [], [], [_BYTES_LE], {"name": "default"}),
    ("int32", [], [], [_BYTES_LE], {"name": "v2"}),
]


@pytest.mark.parametrize("dtype, shape, chunk, codecs, encoding", _FIXED)
def test_every_chunk_names_the_objects_tensorstore_stores(
        dtype: str, shape: list[int], chunk: list[int], codecs: list[Any],
        encoding: dict[str, Any]) -> None:
    """`write` records fixed-size chunks without listing them: the keys and the size
    `every_chunk` predicts must be the objects tensorstore stores when it stores every
    chunk, edge chunks included (zarr v3 stores them whole)."""
    from durable._tensorstore_codecs import every_chunk

    meta = {"zarr_format": 3, "node_type": "array", "shape": shape, "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "chunk_key_encoding": encoding,
            "fill_value": {"bool": False, "complex128": [0, 0]}.get(dtype, 0),
            "codecs": [*codecs, {"name": "crc32c"}]}
    array = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": meta,
                     "store_data_equal_to_fill_value": True}, create=True,
                    context=ts.Context()).result()
    array.write(np.zeros(shape, dtype=array.dtype.numpy_dtype)).result()
    assert array.kvstore is not None
    stored = {k.decode(): len(array.kvstore.read(k).result().value)
              for k in array.kvstore.list().result() if k != b"zarr.json"}
    found = every_chunk("", json.loads(array.kvstore.read("zarr.json").result().value))
    assert found is not None
    keys, _, size = found
    assert {k: size for k, _ in keys} == stored and len(keys) == len(stored) >= 1


@pytest.mark.parametrize("case", [1, 3, 4])
def test_write_commits_unlisted_chunks_of_every_fixed_layout(
        s3_bucket: Bucket, case: int) -> None:
    """The same layouts written by `write` to S3: recorded, not listed, and the manifest
    matches the bytes stored (deep verification reads every one)."""
    dtype, shape, chunk, codecs, encoding = _FIXED[case]
    data = (np.arange(math.prod(shape)) % 3).reshape(shape).astype(
        ts.dtype(dtype).numpy_dtype)
    meta = {"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "chunk_key_encoding": encoding, "codecs": codecs}
    url = s3_bucket.path("arr")
    with FaultProxy(upstream=s3_bucket.storage_options["endpoint_url"]) as proxy:
        opts = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        entry = dts.write(url, data, storage_options=opts, spec={"metadata": meta})
        assert not [r for r in proxy.requests if r.query.get("prefix") == ["arr/"]]
        assert len(proxy.requests) > 3  # the write went through the proxy
    assert dts.entry_for(url, s3_bucket.storage_options).verify(deep=True).ok
    assert entry.url == url
    got = dts.open(url, storage_options=s3_bucket.storage_options).read().result()
    assert (got == data).all()


@pytest.mark.parametrize("codecs", [
    [_BYTES_LE, {"name": "zstd"}, {"name": "crc32c"}],  # compressed: sizes vary
    [_BYTES_LE],  # no codeword: its CRC32C must be computed
    [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [2], "codecs": [_BYTES_LE, {"name": "crc32c"}],
        "index_codecs": [_BYTES_LE, {"name": "crc32c"}]}}],
])
def test_every_chunk_refuses_chunks_of_varying_size(codecs: list[Any]) -> None:
    from durable._tensorstore_codecs import every_chunk

    meta = {"zarr_format": 3, "node_type": "array", "shape": [8], "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
            "codecs": codecs}
    assert every_chunk("", meta) is None
    assert every_chunk("", {**meta, "codecs": [_BYTES_LE, {"name": "crc32c"}]}) is not None


def test_tracked_writes_and_transactions_land_before_the_commit(target: Target) -> None:
    with dts.writing(target.url("e"), storage_options=target.options) as w:
        shape = {"dtype": ts.float32, "shape": [20, COLS],
                 "chunk_layout": ts.ChunkLayout(chunk_shape=[10, 10])}
        w.write(w.open("a", create=True, **shape), values(20, 1))  # not awaited here
        txn = ts.Transaction()
        b = w.open("b", create=True, transaction=txn, **shape)
        b[...] = values(20, 2)  # held in the transaction until the writer commits it
    assert w.entry.verify(deep=True).ok
    for name, seed in (("a", 1), ("b", 2)):
        got = dts.open(target.url("e"), path=name, storage_options=target.options)
        assert (got.read().result() == values(20, seed)).all()


def test_write_on_a_local_disk_makes_every_chunk_durable_before_the_marker(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Incident 003 for arrays: tensorstore's file driver renames each chunk into place
    unsynced here (``file_io_sync`` off). Each chunk's fsync starts as its write lands,
    beside the writes still running; the commit waits for every one, then fsyncs zarr.json
    and each directory once, and only then writes the marker."""
    import durable.adapters.local as local_adapter
    from test_fsync import RecordingOS, check_commit_order

    rec = RecordingOS()
    monkeypatch.setattr(local_adapter, "os", rec)
    root = os.path.realpath(tmp_path)
    dts.write(f"{root}/ent", values(20), chunks=[10, 10])
    marker = Entry(f"{root}/ent").read_marker()
    assert marker is not None and marker.manifest is not None
    keys = sorted(marker.manifest.objects)
    assert len(keys) == 1 + 2 * math.ceil(COLS / 10)  # zarr.json and every chunk
    check_commit_order(rec, root, [f"{root}/ent/{k}" for k in keys])
    chunks = [i for k in keys if k != "zarr.json" for i in rec.fsyncs(f"{root}/ent/{k}")]
    batch = [i for i, ev in enumerate(rec.events) if ev[0] == "fsync"
             and (ev[1] == f"{root}/ent/zarr.json" or os.path.isdir(ev[1]))]
    # The chunks' fsyncs start as they land, before the commit's batch (whose directory
    # fsyncs queue in the same pool, so under load the last chunks' may interleave with
    # them; every one precedes the marker: check_commit_order above).
    assert min(chunks) < min(batch), "the chunks' fsyncs were left to the commit's batch"
    assert (dts.open(f"{root}/ent").read().result() == values(20)).all()


def test_file_writer_leftovers_are_removed_not_committed(tmp_path: Any) -> None:
    url = os.path.join(tmp_path, "arr")
    with dts.writing(url) as w:
        w.open(create=True, dtype=ts.float32, shape=[10, 10])[...] = 1
        with open(os.path.join(url, "c", "0", "0.__lock"), "wb") as f:
            f.write(b"a killed tensorstore writer's temp file")
    marker = w.entry.read_marker()
    assert marker is not None and marker.manifest is not None
    assert set(marker.manifest.objects) == {"zarr.json", "c/0/0"}
    assert not os.path.exists(os.path.join(url, "c", "0", "0.__lock"))


@pytest.mark.parametrize("kind", ["file", "memory", "s3", "fake_gcs"])
def test_metadata_rewritten_in_the_block_is_recorded_as_it_ends(
        kind: str, request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer keeps the zarr.json it created instead of reading it back; a resize in
    the same block rewrites it with the same size (20 -> 40 rows), and the manifest must
    record the bytes that are there at the commit, not the ones first written. (Not on
    gcp-storage-emulator: a resize is conditional, and its generations are unusable.)"""
    target = make_target(kind, request, tmp_path, monkeypatch)
    with dts.writing(target.url("arr"), storage_options=target.options) as w:
        array = w.open(create=True, dtype=ts.float32, shape=[20, COLS],
                       chunk_layout=ts.ChunkLayout(chunk_shape=[10, 10]))
        first = target.raw_read("arr/zarr.json")
        array = array.resize(exclusive_max=[40, COLS]).result()
        w.write(array, values(40))
    body = target.raw_read("arr/zarr.json")
    assert len(body) == len(first) and body != first
    marker = w.entry.read_marker()
    assert marker is not None and marker.manifest is not None
    assert marker.manifest.objects["zarr.json"].crc32c == crc32c(body)
    assert w.entry.verify(deep=True).ok
    got = dts.open(target.url("arr"), storage_options=target.options).read().result()
    assert (got == values(40)).all()


@pytest.mark.parametrize("kind", ["file", "memory", "s3", "fake_gcs"])
def test_create_never_opens_an_existing_array(
        kind: str, request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """create=True writes zarr.json create-only, as tensorstore's own create does: an
    array written before (here by plain tensorstore) is not opened. (Not on
    gcp-storage-emulator, which does not enforce ifGenerationMatch on every upload.)"""
    target = make_target(kind, request, tmp_path, monkeypatch)
    url = target.url("arr")
    shape = {"dtype": ts.float32, "shape": [10, 10]}
    target.plain_open("arr", ts.Context(), create=True, **shape)[...] = 2
    with pytest.raises(ValueError, match=r"ALREADY_EXISTS: .*arr/zarr\.json"), dts.writing(
            url, storage_options=target.options, resume=True) as w:
        w.open(create=True, **shape)
    assert target.raw_read("arr/zarr.json") == bytes(
        target.plain_open("arr", ts.Context()).kvstore.read("zarr.json").result().value)
    assert dts.entry_for(url, target.options).state() is not State.COMPLETE


def test_create_twice_in_one_block_fails_without_asking_the_store(target: Target) -> None:
    """Known from the writer's own records: also where the store does not enforce
    create-only (gcp-storage-emulator)."""
    shape = {"dtype": ts.float32, "shape": [10, 10]}
    with pytest.raises(ValueError, match=r"ALREADY_EXISTS: .*arr/a/zarr\.json"), dts.writing(
            target.url("arr"), storage_options=target.options) as w:
        w.open("a", create=True, **shape)[...] = 1
        w.open("a", create=True, **shape)
    assert dts.entry_for(target.url("arr"), target.options).state() is not State.COMPLETE


@pytest.mark.parametrize("kind", ["file", "s3"])
@pytest.mark.parametrize("given", [{"open": False}, {"assume_cached_metadata": False},
                                   {"delete_existing": False, "assume_metadata": False}])
def test_create_with_open_modes_given_as_false_is_a_create(
        kind: str, given: dict[str, bool], request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain tensorstore accepts create=True with these spelled out as False; the writer
    must not pass them on next to its own open mode (a TypeError)."""
    t = make_target(kind, request, tmp_path, monkeypatch)
    with dts.writing(t.url("arr"), storage_options=t.options) as w:
        array = w.open(create=True, dtype=ts.float32, shape=[20, COLS],
                       chunk_layout=ts.ChunkLayout(chunk_shape=[10, 10]), **given)
        w.write(array, values(20))
    assert w.entry.verify(deep=True).ok
    marker = w.entry.read_marker()
    assert marker is not None and marker.manifest is not None
    assert marker.manifest.objects["zarr.json"].crc32c == crc32c(t.raw_read("arr/zarr.json"))
    assert (dts.open(t.url("arr"), storage_options=t.options).read().result()
            == values(20)).all()


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_zarr_v2_arrays_are_created_by_tensorstore(
        kind: str, request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only zarr3 writes zarr.json: a zarr v2 array's .zarray is tensorstore's to write."""
    t = make_target(kind, request, tmp_path, monkeypatch)
    v2 = {"driver": "zarr"}
    with dts.writing(t.url("arr"), storage_options=t.options) as w:
        # With the default checksum_codec: the crc32c codec is zarr v3's, not added here
        # (merged, it failed the create with tensorstore's "Cannot merge codec spec").
        array = w.open(create=True, spec=v2, dtype=ts.float32,
                       shape=[20, COLS], chunk_layout=ts.ChunkLayout(chunk_shape=[10, 10]))
        w.write(array, values(20))
    assert set(t.raw_keys("arr")) == {".zarray"} | {f"{r}.{c}" for r in range(2)
                                                    for c in range(3)}
    assert json.loads(t.raw_read("arr/.zarray"))["zarr_format"] == 2
    assert w.entry.verify(deep=True).ok
    assert (dts.open(t.url("arr"), storage_options=t.options, spec=v2).read().result()
            == values(20)).all()
    # Opened as zarr3 (the default): the error says which driver the array needs, where
    # it said only that the commit had no array there.
    with pytest.raises(ValueError, match=r"arr/zarr\.json: .*a zarr v2 array is there "
                                         r"\(\.zarray\); pass spec=\{'driver': 'zarr'\}"):
        dts.read(t.url("arr"), storage_options=t.options)


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_writer_that_loses_the_race_commits_nothing_and_removes_nothing(
        kind: str, request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit does not list the records first (no fragments): the create-only marker
    write alone decides between two writers of one entry."""
    t = make_target(kind, request, tmp_path, monkeypatch)
    url = t.url("arr")
    with pytest.raises(AlreadyCompleteError, match="another writer committed"), \
            dts.writing(url, storage_options=t.options) as w:
        w.open(create=True, dtype=ts.float32, shape=[20, COLS],
               chunk_layout=ts.ChunkLayout(chunk_shape=[10, 10]))[...] = values(20)
        rewrite(url, "resume", 5, 20, t.options)  # another process finishes and commits
    entry = dts.entry_for(url, t.options)
    marker = entry.read_marker()
    assert marker is not None and marker.attempt != w.attempt
    assert entry.verify(deep=True).ok
    assert (dts.open(url, storage_options=t.options).read().result() == 5).all()


# ------------------------------------------------------------------------------ refusing
def test_a_commit_landing_between_the_marker_read_and_the_state_is_an_open_again(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """open read no marker, asked the state to say why, and a writer's commit had landed
    in between: "X is COMPLETE: ...; only a COMPLETE entry opens" contradicted itself."""
    url = os.path.join(tmp_path, "arr")
    original = Entry.status

    def state_after_a_commit(self: Entry) -> Any:
        monkeypatch.setattr(Entry, "status", original)
        dts.write(url, values(10), chunks=[10, 10])  # another writer commits just now
        return original(self)

    monkeypatch.setattr(Entry, "status", state_after_a_commit)
    with pytest.raises(IncompleteError, match="was rewritten while it was being opened"):
        dts.open(url)
    assert (dts.open(url).read().result() == values(10)).all()


def test_write_under_a_lease_commits_and_keeps_a_second_writer_out(tmp_path: Any) -> None:
    """Under its own lease, write refused the entry (IncompleteExistsError naming the
    lease) and writing(overwrite=True) removed the lease: neither took one."""
    from durable import IncompleteExistsError, Lease

    url = os.path.join(tmp_path, "arr")
    with Lease(url) as lease:
        dts.write(url, values(20), chunks=[10, 10], lease=lease)
        with pytest.raises(IncompleteExistsError):  # another writer, a lease of its own
            Lease(url).acquire()
        with dts.writing(url, overwrite=True, lease=lease) as w:
            w.write(w.open(create=True, dtype=ts.float32, shape=[20, COLS]), values(20, 5))
        assert lease.held
    assert (dts.open(url).read().result() == values(20, 5)).all()
    assert dts.entry_for(url).verify(deep=True).ok


def test_a_writer_that_lost_its_lease_writes_no_more(tmp_path: Any) -> None:
    """Taken over, the holder's next write is LeaseLostError (as `EntryWriter.open`);
    it used to land in the entry of the writer that took the lease over."""
    import time

    from durable import Entry, LeaseLostError
    from durable._lease import Lease, LeaseView, LeaseWatch

    url = os.path.join(tmp_path, "arr")
    holder = Lease(url, heartbeat=0.1, stale_after=1.0).acquire()
    with pytest.raises(LeaseLostError), dts.writing(url, lease=holder) as w:
        array = w.open(create=True, dtype=ts.float32, shape=[20, COLS],
                       chunk_layout=ts.ChunkLayout(write_chunk_shape=[10, COLS]))
        w.write(array[:10], values(10)).result()
        view = LeaseWatch(url).poll()
        assert view is not None
        with holder._lock:  # a waiter's takeover, between two of the holder's renewals
            taker = Lease(url, heartbeat=0.1, stale_after=1.0).take_over(
                LeaseView(view.version, view.holder, 1.0, 1.0, True))
        deadline = time.monotonic() + 30
        while holder.lost is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with Entry(url).writing(lease=taker, overwrite=True) as other:
            other.write_bytes("zarr.json", b"{}")
        w.write(array[10:], values(10, 3))
    holder.release()
    taker.release()
    entry = Entry(url)
    assert entry.verify(deep=True).ok  # nothing of the holder's landed in it
    assert sorted(entry.read_marker().manifest.objects) == ["zarr.json"]  # type: ignore[union-attr]


def test_open_refuses_anything_but_complete(target: Target) -> None:
    url = target.url("arr")
    with pytest.raises(IncompleteError, match="ABSENT") as err:
        dts.open(url, storage_options=target.options)
    assert err.value.state is State.ABSENT
    with pytest.raises(RuntimeError, match="job died"), dts.writing(
            url, storage_options=target.options) as w:
        w.open(create=True, dtype=ts.float32, shape=[10, 10])[...] = 1
        raise RuntimeError("job died")
    assert dts.entry_for(url, target.options).state() is not State.COMPLETE
    # Written without durable: data, no marker.
    target.plain_open("arr", ts.Context(), create=True, dtype=ts.float32,
                      shape=[10, 10])[...] = 1
    with pytest.raises(IncompleteError, match="INCOMPLETE"):
        dts.open(url, storage_options=target.options)
    with pytest.raises(ValueError, match="reads only"):
        dts.open(url, storage_options=target.options, write=True)


@pytest.mark.parametrize("kind", ["file", "s3", "gcs"])
def test_a_killed_writer_leaves_an_entry_open_refuses(
        kind: str, request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_target(kind, request, tmp_path, monkeypatch)
    child = TsChild(t.url("arr"), "fresh", 7, 30, t.options)
    child.run_until("chunk 2")
    child.kill()
    entry = dts.entry_for(t.url("arr"), t.options)
    assert entry.state() is State.INCOMPLETE
    with pytest.raises(IncompleteError, match="INCOMPLETE"):
        dts.open(t.url("arr"), storage_options=t.options)
    # What plain tensorstore makes of it: an array that reads as zeros where chunks are not.
    seen = np.unique(t.plain_open("arr", ts.Context()).read().result())
    assert set(seen) == {0.0, 7.0}
    child_write(t.url("arr"), "resume", 7, 30, t.options)  # the next attempt finishes it
    assert (dts.open(t.url("arr"), storage_options=t.options).read().result() == 7).all()


def test_write_after_a_killed_writer_names_what_to_pass(tmp_path: Any) -> None:
    """The INCOMPLETE entry's error suggests resume=True; `write` passed it on to
    tensorstore.open, whose TypeError listed its whole signature and named nothing."""
    url = os.path.join(tmp_path, "arr")
    child = TsChild(url, "fresh", 7, 30, None)
    child.run_until("chunk 2")
    child.kill()
    for name in ("resume", "update"):
        with pytest.raises(TypeError, match=rf"arr: durable.tensorstore.write takes no "
                           rf"{name}=: .*overwrite=True.*writing\(url, {name}=True\)"):
            dts.write(url, values(30), chunks=[10, 10], **{name: True})
    assert Entry(url).state() is State.INCOMPLETE  # nothing changed: the leftover is there
    dts.write(url, values(30), chunks=[10, 10], overwrite=True)
    assert dts.read(url).tolist() == values(30).tolist()


_STREAM_CHILD = """
import json, os, sys
import numpy as np
import durable._tensorstore_writing as writing
import durable.tensorstore as dts
writing._SLAB_BYTES = 1  # a row of chunks at a time
opts = json.loads(os.environ["DURABLE_TEST_STORAGE_OPTIONS"])
data = np.full((200, 30), 7, dtype="float32")
dts.write(sys.argv[1], data, chunks=[10, 10], storage_options=opts)
"""


def test_a_writer_killed_mid_stream_leaves_an_entry_open_refuses(s3_bucket: Bucket) -> None:
    """`write` across a network puts the chunks itself: SIGKILLed after some of them, it
    leaves chunks and zarr.json but no marker. Plain tensorstore reads zeros where the
    rest would be; durable says INCOMPLETE and refuses to open it."""
    import signal
    import subprocess
    import sys

    url = s3_bucket.path("arr")
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        chunk = r"/arr/c/\d+/\d+$"
        proxy.inject("delay", seconds=0.2, method="PUT", path=chunk)
        opts = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        child = subprocess.Popen([sys.executable, "-c", _STREAM_CHILD, url],
                                 env={**os.environ,
                                      "DURABLE_TEST_STORAGE_OPTIONS": json.dumps(opts)},
                                 stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while proxy.count(method="PUT", path=chunk, status=200) < 6:
            assert child.poll() is None, child.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.communicate()
    fs = s3_bucket.filesystem()
    fs.invalidate_cache()
    written = [p for p in fs.find(url[5:]) if re.search(r"/c/\d+/\d+$", p)]
    assert 6 <= len(written) < 60
    entry = dts.entry_for(url, s3_bucket.storage_options)
    assert entry.state() is State.INCOMPLETE
    with pytest.raises(IncompleteError, match="INCOMPLETE"):
        dts.open(url, storage_options=s3_bucket.storage_options)
    plain = ts.open({"driver": "zarr3",
                     "kvstore": dts.kvstore_spec(url, s3_bucket.storage_options)},
                    read=True).result()
    assert set(np.unique(plain.read().result())) == {0.0, 7.0}


@pytest.mark.parametrize("codec", [True, False])  # tensorstore's puts; `_stream`'s puts
def test_a_streamed_write_that_fails_leaves_no_chunk_behind(
        s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, codec: bool) -> None:
    """One chunk's PUT is refused while others are still on their way: the write fails,
    and every put it started has landed or failed before the fresh entry is removed, so
    none lands after the cleanup as an object outside any attempt. (tensorstore's write
    future fails at the first error, its other puts still on their way: `write` waits for
    each chunk's own.)"""
    import durable._tensorstore_writing as module

    monkeypatch.setattr(module, "_SLAB_BYTES", 1)  # a row of chunks at a time
    monkeypatch.setattr(module, "_WRITES_AT_ONCE", 3)  # tensorstore's: 3 chunks at a time
    url = s3_bucket.path("arr")
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        proxy.inject("error", status=403, forward=False, method="PUT",
                     path=r"/arr/c/0/0$", times=1)
        proxy.inject("delay", seconds=0.5, method="PUT", path=r"/arr/c/(0/[12]|[1-9]/\d)$")
        opts = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        with pytest.raises(ValueError, match=r"PERMISSION_DENIED") as failed:
            dts.write(url, values(40), chunks=[10, 10], storage_options=opts,
                      checksum_codec=codec)
        assert "arr/c/0/0" in str(failed.value)  # the error names the chunk refused
        assert proxy.count(method="PUT", path=r"/arr/c/\d+/\d+$") >= 3
    fs = s3_bucket.filesystem()
    fs.invalidate_cache()
    assert fs.find(url[5:]) == []
    assert dts.entry_for(url, s3_bucket.storage_options).state() is State.ABSENT


def test_a_chunk_put_refused_in_a_streamed_write_is_named(s3_bucket: Bucket) -> None:
    """AWS's 403 document names no key (no <Resource>): tensorstore's error for a chunk
    `_stream` puts (a compressed array) said only "AccessDenied: Access Denied"."""
    from durable.testing.faults._kinds import Error, RequestInfo, s3_error_document

    class AwsDenied(Error):
        def document(self, info: RequestInfo, request_id: str) -> bytes:
            return s3_error_document("AccessDenied", "Access Denied", request_id=request_id)

    zstd = {"metadata": {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                    {"name": "zstd", "configuration": {"level": 1}}]}}
    url = s3_bucket.path("z")
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        proxy.add(AwsDenied(status=403, match=Match(methods="PUT", path=r"/z/c/1/1$"),
                            times=1))
        opts = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        with pytest.raises(ValueError, match=r"z/c/1/1: writing this chunk of s3://"):
            dts.write(url, values(20), chunks=[10, 10], storage_options=opts, spec=zstd)
    assert dts.entry_for(url, s3_bucket.storage_options).state() is State.ABSENT


def test_a_failed_block_waits_for_its_tracked_writes_before_the_cleanup(
        s3_bucket: Bucket) -> None:
    """The block raises while a tracked write's PUTs are still on their way: each has
    landed or failed before the fresh entry is removed, so no chunk lands after the
    cleanup, left in the bucket outside any attempt."""
    url = s3_bucket.path("arr")
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        proxy.inject("delay", seconds=0.5, method="PUT", path=r"/arr/c/\d+/\d+$")
        opts = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        with pytest.raises(RuntimeError, match="job died"), \
                dts.writing(url, storage_options=opts) as w:
            array = w.open(create=True, dtype=ts.float32, shape=[40, COLS],
                           chunk_layout=ts.ChunkLayout(chunk_shape=[10, 10]))
            w.write(array, values(40))
            raise RuntimeError("job died")
        # Every chunk's PUT answered (already, with the wait; half a second later without)
        deadline = time.monotonic() + 30
        while proxy.count(method="PUT", path=r"/arr/c/\d+/\d+$", status=200) < 12:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        fs = s3_bucket.filesystem()
        fs.invalidate_cache()
        assert fs.find(url[5:]) == []
    assert dts.entry_for(url, s3_bucket.storage_options).state() is State.ABSENT


def test_a_commit_landing_during_the_open_is_opened_not_called_damaged(
        s3_bucket: Bucket) -> None:
    """zarr.json and the listing are fetched beside the marker, so perhaps before it: here
    both are of commit 1, and the marker read after them is commit 2's (a rewrite, larger,
    committed while the marker's GET was held). The open takes a second look after the
    marker instead of calling a healthy entry damaged."""
    import threading

    url, direct = s3_bucket.path("arr"), s3_bucket.storage_options
    dts.write(url, np.full((8, 8), 1.0), chunks=(4, 4), storage_options=direct)
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        via = {**direct, "endpoint_url": proxy.url}
        # The endpoint's probe (a read of the marker) is paid first, by another entry.
        dts.write(s3_bucket.path("warm"), np.ones((4, 4)), chunks=(4, 4),
                  storage_options=direct)
        dts.open(s3_bucket.path("warm"), storage_options=via)
        marker = dts.entry_for(url, direct).layout.marker
        proxy.inject("delay", seconds=6.0, method="GET", key=marker, times=1)
        rewritten = threading.Event()

        def rewrite() -> None:
            deadline = time.monotonic() + 30
            while not (proxy.count(method="GET", path=r"/arr/zarr\.json$", status=200)
                       and proxy.count(query="list-type", status=200)):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            dts.write(url, np.full((12, 12), 2.0), chunks=(4, 4), storage_options=direct,
                      overwrite=True)
            rewritten.set()

        other = threading.Thread(target=rewrite)
        other.start()
        try:
            got = dts.open(url, storage_options=via)
        finally:
            other.join()
        assert rewritten.is_set()
        assert got.shape == (12, 12)
        assert (got.read().result() == 2.0).all()


def test_open_checks_the_listing_and_deep_checks_the_bytes(target: Target) -> None:
    url = target.url("arr")

    def committed() -> bytes:
        """A new commit of the array (its first open in this process lists it)."""
        dts.write(url, values(20), chunks=[10, 10], storage_options=target.options,
                  overwrite=True)
        return target.raw_read("arr/c/0/1")

    good = committed()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    target.raw_write("arr/c/0/1", bytes(flipped))
    # Same size: the listing matches; the crc32c codec catches it at read, deep at open.
    array = dts.open(url, storage_options=target.options)
    with pytest.raises(ValueError, match=r"[Dd]igest mismatch"):
        array.read().result()
    with pytest.raises(IntegrityError, match=r"c/0/1: crc32c expected 48674bc7"):
        dts.open(url, storage_options=target.options, deep=True)
    target.raw_write("arr/c/0/1", committed()[:-3])
    with pytest.raises(IntegrityError, match=r"c/0/1: size expected \d+, found"):
        dts.open(url, storage_options=target.options)
    committed()
    target.raw_delete("arr/c/0/1")
    with pytest.raises(IntegrityError, match=r"c/0/1: missing"):
        dts.open(url, storage_options=target.options)
    target.raw_write("arr/c/9/9", committed())
    with pytest.raises(IntegrityError, match=r"c/9/9: not in the manifest"):
        dts.open(url, storage_options=target.options)


def test_a_chunk_deleted_after_the_open_is_an_error_never_fill_values(target: Target) -> None:
    """The listing is checked at the open; a handle lives on. A chunk deleted after it
    reads as the fill value through plain tensorstore, and as an error naming the chunk
    through durable, for an array whose commit holds every chunk."""
    url = target.url("arr")
    dts.write(url, values(20), chunks=[10, 10], storage_options=target.options)
    array = dts.open(url, storage_options=target.options)
    plain = target.plain_open("arr", ts.Context(), read=True)
    target.raw_delete("arr/c/0/1")
    assert (plain[0:10, 10:20].read().result() == 0).all()  # incident 001's fill values
    with pytest.raises(ValueError, match=r"NOT_FOUND: chunk \{0, 1\}.*is missing"):
        array[0:10, 10:20].read().result()
    assert array[10:20, 0:10].read().result().tolist() == values(20)[10:20, 0:10].tolist()


def shards(target: Target) -> dict[str, Any]:
    """Shards of 20 x 20 of inner chunks of 10 x 10. The index goes first on the GCS
    emulator, which ignores the suffix range tensorstore reads an index at the end by."""
    index = {"index_location": "start"} if target.kind == "gcs" else {}
    return {"spec": {"metadata": {
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [20, 20]}},
        "codecs": [{"name": "sharding_indexed",
                    "configuration": {"chunk_shape": [10, 10], **index}}]}}}


def test_a_shard_deleted_after_the_open_is_an_error_never_fill_values(target: Target) -> None:
    """The same for a sharded array: a shard holding every inner chunk in the bounds (what
    `write` makes, edge shards included) is of a size the codecs fix, so the commit is
    known to hold every chunk, and a shard lost after the open is an error naming it, never
    its chunks as fill values."""
    url = target.url("arr")
    data = values(30)[:, :25]  # 2 x 2 shards, the last row and column of them at the edge
    data[0:10, 0:10] = 0  # an inner chunk all fill value: stored all the same
    dts.write(url, data, storage_options=target.options, **shards(target))
    if target.kind == "gcs":
        # gcp-storage-emulator answers no generation: tensorstore reads a shard's chunk on
        # the condition of the index's generation, and failed the read with 'Malformed
        # StorageGeneration' (incident 000's opaque error). durable says so at the open.
        with pytest.raises(dts.UnusableETagError, match="a sharded array cannot be read"):
            dts.open(url, storage_options=target.options)
        return
    array = dts.open(url, storage_options=target.options)
    assert array.spec().to_json()["fill_missing_data_reads"] is False
    assert array.read().result().tolist() == data.tolist()
    plain = target.plain_open("arr", ts.Context(), read=True)
    for shard, region in (("c/0/0", np.s_[0:10, 0:10]), ("c/1/1", np.s_[20:30, 20:25])):
        target.raw_delete(f"arr/{shard}")
        assert (plain[region].read().result() == 0).all()  # incident 001's fill values
        with pytest.raises(ValueError, match=r"NOT_FOUND: .*is missing"):
            array[region].read().result()


def test_a_sharded_array_with_chunks_left_out_reads_them_as_fill_values(
        target: Target) -> None:
    """A shard holding fewer inner chunks (left out as fill value, or never written) is
    smaller than a full one: the handle keeps fill_missing_data_reads on and reads them as
    the fill value, as zarr means it; every open checks the listing, so a shard lost
    before an open is an error there."""
    url = target.url("arr")
    with dts.writing(url, storage_options=target.options) as w:
        array = w.open(create=True, dtype=ts.int32, shape=[40, 40], **shards(target))
        # Every shard stored, each with half its inner chunks
        w.write(array[0:10, 0:40], np.ones((10, 40), "int32"))
        w.write(array[20:30, 0:40], np.full((10, 40), 2, "int32"))
    if target.kind == "gcs":  # see above
        with pytest.raises(dts.UnusableETagError, match="a sharded array cannot be read"):
            dts.open(url, storage_options=target.options)
        return
    got = dts.open(url, storage_options=target.options)
    assert "fill_missing_data_reads" not in got.spec().to_json()
    assert sorted(target.raw_keys("arr")) == ["c/0/0", "c/0/1", "c/1/0", "c/1/1", "zarr.json"]
    assert int(got.read().result().sum()) == 10 * 40 + 2 * 10 * 40
    target.raw_delete("arr/c/1/1")
    with pytest.raises(IntegrityError, match=r"c/1/1: missing"):
        dts.open(url, storage_options=target.options)


def test_write_stores_a_chunk_of_fill_values_so_its_loss_is_never_fill_values(
        target: Target) -> None:
    """tensorstore leaves a chunk that is all fill value out, and a reader cannot tell it
    from one lost (incident 001). `write` stores every chunk: the commit holds every grid
    position, so the read of a chunk of zeros deleted later is an error naming it."""
    url = target.url("arr")
    data = values(20)
    data[0:10, 0:10] = 0
    dts.write(url, data, chunks=[10, 10], storage_options=target.options)
    assert "c/0/0" in target.raw_keys("arr")
    array = dts.open(url, storage_options=target.options)
    assert array.read().result().tolist() == data.tolist()
    target.raw_delete("arr/c/0/0")
    with pytest.raises(ValueError, match=r"NOT_FOUND: chunk \{0, 0\}.*is missing"):
        array[0:10, 0:10].read().result()


def test_chunks_left_out_as_fill_values_still_read_as_fill_values(target: Target) -> None:
    """tensorstore stores no chunk that is all fill value (`write` does, unless told not
    to): such an array's missing chunks are the fill value, as zarr means it. A caller's
    own fill_missing_data_reads is kept."""
    url = target.url("arr")
    data = values(20)
    data[0:10, 0:10] = 0
    dts.write(url, data, chunks=[10, 10], storage_options=target.options,
              spec={"store_data_equal_to_fill_value": False})
    assert "c/0/0" not in target.raw_keys("arr")
    assert dts.open(url, storage_options=target.options).read().result().tolist() == \
        data.tolist()
    whole = target.url("whole")
    dts.write(whole, values(20), chunks=[10, 10], storage_options=target.options)
    asked = dts.open(whole, storage_options=target.options,
                     spec={"fill_missing_data_reads": True})
    target.raw_delete("whole/c/1/1")
    assert (asked[10:20, 10:20].read().result() == 0).all()


def test_whether_every_chunk_is_committed_is_known_per_commit(target: Target) -> None:
    """Whether the commit holds every chunk (reads then fail on a missing one) is worked
    out once per commit in a process: the next commit of the same URL, with a chunk left
    out as fill value, reads that chunk as fill values, not as an error."""
    url = target.url("arr")
    dts.write(url, values(20), chunks=[10, 10], storage_options=target.options)
    assert (dts.open(url, storage_options=target.options).read().result()
            == values(20)).all()
    data = values(20)
    data[0:10, 0:10] = 0
    dts.write(url, data, chunks=[10, 10], storage_options=target.options, overwrite=True,
              spec={"store_data_equal_to_fill_value": False})
    assert "c/0/0" not in target.raw_keys("arr")
    assert (dts.open(url, storage_options=target.options).read().result() == data).all()


@pytest.mark.parametrize("kind", ["file", "memory", "s3"])  # a resize is conditional: not
def test_a_chunk_beyond_the_bounds_does_not_stand_in_for_one_left_out(  # on generation 0
        kind: str, request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A metadata-only shrink keeps a chunk beyond the new bounds; the chunk left out as
    fill value inside them still reads as fill values (the commit holds as many chunk keys
    as the grid has positions, but not every position)."""
    target = make_target(kind, request, tmp_path, monkeypatch)
    url = target.url("arr")
    data = np.arange(12.0) + 1
    data[4:8] = 0  # c/1: all fill value, not stored
    with dts.writing(url, storage_options=target.options) as w:
        array = w.open(create=True, dtype=ts.float64, shape=[12],
                       chunk_layout=ts.ChunkLayout(chunk_shape=[4]))
        w.write(array, data)
        w.track(array.resize(exclusive_max=[8], resize_metadata_only=True))
    marker = dts.entry_for(url, target.options).read_marker()
    assert marker is not None and marker.manifest is not None
    assert {"c/0", "c/2"} <= set(marker.manifest.objects) and "c/1" not in \
        marker.manifest.objects
    got = dts.open(url, storage_options=target.options).read().result()
    assert got.tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0]


def test_metadata_changed_after_the_commit_with_its_size_is_refused(target: Target) -> None:
    """Another tool rewrites zarr.json after the commit, same size (fill_value 0 -> 7): the
    listing matches the manifest, and plain tensorstore reads the zeros written as 7s
    (the zeros are left out as fill value, which `write` stores unless told not to)."""
    url = target.url("arr")
    dts.write(url, np.zeros(4, dtype="int32"), chunks=[2], storage_options=target.options,
              spec={"store_data_equal_to_fill_value": False})
    assert set(target.raw_keys("arr")) == {"zarr.json"}
    body = target.raw_read("arr/zarr.json")
    changed = body.replace(b'"fill_value":0', b'"fill_value":7')
    assert len(changed) == len(body) and changed != body
    target.raw_write("arr/zarr.json", changed)
    assert (target.plain_open("arr", ts.Context()).read().result() == 7).all()
    for deep in (False, True):
        with pytest.raises(IntegrityError, match=rf"arr/zarr\.json: .*crc32c {crc32c(body):08x}"):
            dts.open(url, storage_options=target.options, deep=deep)
    target.raw_write("arr/zarr.json", body)
    assert (dts.open(url, storage_options=target.options).read().result() == 0).all()


def test_an_unchanged_marker_is_decoded_once_and_a_new_one_again(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opens keep the last marker of each entry decoded: the same bytes are not decoded
    again, but they are still read at every open; a recommit (other bytes) is decoded
    afresh, never served the old manifest, and checked against a listing again."""
    from durable._protocol import Marker

    decoded: list[str] = []
    real = Marker.decode

    def counting(data: bytes, where: str) -> Marker:
        decoded.append(where)
        return real(data, where)

    def decodes_in_open(**kwargs: Any) -> int:
        decoded.clear()
        assert (dts.open(url).read().result() == values(**kwargs)).all()
        return len(decoded)

    monkeypatch.setattr(Marker, "decode", staticmethod(counting))
    url = os.path.join(tmp_path, "arr")
    dts.write(url, values(20), chunks=[10, 10])
    assert [decodes_in_open(rows=20) for _ in range(3)] == [1, 0, 0]
    # Rewritten with another shape: a stale manifest would fail the listing check.
    dts.write(url, values(30, seed=5), chunks=[10, 10], overwrite=True)
    assert [decodes_in_open(rows=30, seed=5) for _ in range(2)] == [1, 0]
    # A chunk gone since this commit was checked against a listing: refused at its read
    # (the open lists no more: every read of this array is checked on its own).
    os.unlink(os.path.join(url, "c", "2", "0"))
    array = dts.open(url)
    with pytest.raises(ValueError, match=r"NOT_FOUND: chunk \{2, 0\}.*is missing"):
        array.read().result()
    # Recommitted: the new marker is checked against a listing at its first open.
    dts.write(url, values(30, seed=6), chunks=[10, 10], overwrite=True)
    assert decodes_in_open(rows=30, seed=6) == 1
    os.unlink(os.path.join(url, "c", "2", "0"))
    dts.write(os.path.join(tmp_path, "other"), values(20), chunks=[10, 10])
    dts.open(os.path.join(tmp_path, "other"))  # another entry's marker, kept beside it
    array = dts.open(url)  # the same commit again: checked once, reads checked
    with pytest.raises(ValueError, match="NOT_FOUND"):
        array.read().result()


def test_every_open_lists_where_reads_are_not_all_checked(tmp_path: Any) -> None:
    """No codec, or chunks left out as fill values: a read cannot tell a chunk deleted
    since the commit from one never written, so every open checks the listing."""
    bare = os.path.join(tmp_path, "bare")
    dts.write(bare, values(20), chunks=[10, 10], checksum_codec=False)
    sparse = os.path.join(tmp_path, "sparse")
    data = values(20)
    data[:10, :10] = 0
    dts.write(sparse, data, chunks=[10, 10], spec={"store_data_equal_to_fill_value": False})
    assert not os.path.exists(os.path.join(sparse, "c", "0", "0"))  # left out
    for url, chunk in ((bare, "c/1/1"), (sparse, "c/1/1")):
        dts.open(url).read().result()
        os.unlink(os.path.join(url, *chunk.split("/")))
        with pytest.raises(IntegrityError, match=rf"{chunk}: missing"):
            dts.open(url)


def test_zarr_python_checks_the_codec_too(tmp_path: Any) -> None:
    import zarr

    url = os.path.join(tmp_path, "arr")
    dts.write(url, values(20), chunks=[10, 10])
    flip(os.path.join(url, "c", "1", "1"), 7)
    with pytest.raises(ValueError, match="checksum do not match"):
        zarr.open_array(url, mode="r")[...]


# ------------------------------------------------------------ no stale reads (levanter)
@pytest.mark.parametrize("kind", ["file", "memory", "s3", "fake_gcs"])
def test_levanter_pattern_stale_without_durable_and_never_through_it(
        kind: str, request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Process A reads through a shared cache; process B rewrites and recommits (same shape,
    then larger). Plain tensorstore (its own shared context) serves the old chunks, then new
    metadata over old chunks; durable (another shared context) serves each commit whole."""
    t = make_target(kind, request, tmp_path, monkeypatch)
    child_write(t.url("arr"), "fresh", 1, 20, t.options)
    plain_ctx, durable_ctx = shared_context(), shared_context()

    def plain() -> Any:
        return t.plain_open("arr", plain_ctx, **LEVANTER).read().result()

    def through_durable() -> Any:
        return dts.open(t.url("arr"), storage_options=t.options, context=durable_ctx,
                        **LEVANTER).read().result()

    assert (plain() == 1).all() and (through_durable() == 1).all()  # caches warm
    t.rewrite("arr", "overwrite", 2, 20)
    assert (plain() == 1).all()  # stale: commit 2 wrote 2 everywhere
    assert (through_durable() == 2).all()
    t.rewrite("arr", "update", 3, 40)  # resized in place, every chunk rewritten
    mixed, whole = plain(), through_durable()
    assert mixed.shape == whole.shape == (40, COLS)
    assert set(np.unique(mixed)) == {1.0, 3.0}  # two commits in one read
    assert set(np.unique(whole)) == {3.0}


@pytest.mark.parametrize("kind", ["file", "memory", "s3", "fake_gcs"])
def test_an_unchanged_commit_is_served_from_the_shared_cache(
        kind: str, request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = make_target(kind, request, tmp_path, monkeypatch)
    child_write(t.url("arr"), "fresh", 1, 20, t.options)  # its own context: not the reader's
    ctx = shared_context()

    def read() -> tuple[Any, int]:
        before = cache_reads()
        got = dts.open(t.url("arr"), storage_options=t.options, context=ctx,
                       recheck_cached=False).read().result()
        return got, cache_reads() - before

    first, fetched = read()
    assert (first == 1).all() and fetched >= 6
    again, fetched = read()
    assert (again == 1).all() and fetched == 0  # same commit: not one request
    child_write(t.url("arr"), "overwrite", 2, 20, t.options)
    after, fetched = read()
    assert (after == 2).all() and fetched >= 6


def test_a_rewrite_that_starts_while_opening_is_refused(s3_bucket: Bucket) -> None:
    """The rewriter removes the marker and writes new metadata while tensorstore fetches
    zarr.json: the handle would be of a commit that does not exist yet."""
    url = s3_bucket.path("arr")
    child_write(url, "fresh", 1, 20, s3_bucket.storage_options)
    child = TsChild(url, "overwrite", 2, 40, s3_bucket.storage_options)
    hooked: list[bool] = []

    def rewrite_now(info: faults.RequestInfo) -> bool:
        if info.method == "GET" and info.path.endswith("/arr/zarr.json") and not hooked:
            hooked.append(True)
            child.run_until("created")  # marker gone, new zarr.json written, no chunk
        return False

    with FaultProxy(upstream=s3_bucket.storage_options["endpoint_url"]) as proxy:
        proxy.add(faults.delay(0, match=Match(where=rewrite_now)))
        via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        # Refused either way: the marker read before the rewriter removed it (rewritten
        # while opening), or after (INCOMPLETE): the two requests go at once.
        with pytest.raises(IncompleteError,
                           match=r"rewritten while it was being opened|is INCOMPLETE"):
            dts.open(url, storage_options=via, context=shared_context())
        assert hooked
        child.finish()
        got = dts.open(url, storage_options=via).read().result()
    assert got.shape == (40, COLS) and (got == 2).all()


def test_read_returns_the_committed_values_or_refuses(target: Target) -> None:
    url = target.url("arr")
    with pytest.raises(IncompleteError, match="ABSENT"):
        dts.read(url, storage_options=target.options)
    data = values(20)
    dts.write(url, data, chunks=[10, 10], storage_options=target.options)
    assert dts.read(url, storage_options=target.options).tolist() == data.tolist()
    got = dts.read(url, storage_options=target.options, index=np.s_[3:15, 7])
    assert got.tolist() == data[3:15, 7].tolist()
    with pytest.raises(RuntimeError, match="job died"), dts.writing(
            url, storage_options=target.options, overwrite=True) as w:
        w.open(create=True, dtype=ts.float32, shape=[20, 20])[...] = 1
        raise RuntimeError("job died")
    with pytest.raises(IncompleteError, match="only a COMPLETE entry opens") as err:
        dts.read(url, storage_options=target.options)
    assert err.value.state is not State.COMPLETE


def test_read_returns_nothing_where_the_listing_differs(target: Target) -> None:
    """`read` checks the listing while tensorstore reads the chunks, and returns the values
    only if it matched: a chunk lost from an array with chunks left out as fill value
    (whose reads cannot tell a lost chunk from one left out) is never fill values."""
    url = target.url("arr")
    data = values(20)
    data[0:10, 0:10] = 0
    dts.write(url, data, chunks=[10, 10], storage_options=target.options,
              spec={"store_data_equal_to_fill_value": False})
    target.raw_delete("arr/c/1/1")
    # What plain tensorstore makes of it: the lost chunk is fill values.
    assert (target.plain_open("arr", ts.Context()).read().result()[10:20, 10:20] == 0).all()
    for _ in range(2):  # the first read of this commit in this process, and a later one
        with pytest.raises(IntegrityError, match=r"c/1/1: missing"):
            dts.read(url, storage_options=target.options)


def test_a_rewrite_during_a_read_is_refused_never_a_mix(s3_bucket: Bucket) -> None:
    """Another process rewrites the array while its chunks are being read: a handle's read
    returns chunks of the new commit under the old one's open (a mix: tensorstore cannot
    pin an array to one version of every chunk); `read` checks the commit after the last
    chunk and refuses."""
    url = s3_bucket.path("arr")
    child_write(url, "fresh", 1, 20, s3_bucket.storage_options)

    def rewritten_at_the_first_chunk(how: Any) -> Any:
        hooked: list[bool] = []

        def rewrite_now(info: faults.RequestInfo) -> bool:
            if info.method == "GET" and "/arr/c/" in info.path and not hooked:
                hooked.append(True)
                # Started here, not before the open: a rewriter starts by removing the
                # marker, and one started earlier could do so before the open.
                rewrite(url, "overwrite", 2, 20, s3_bucket.storage_options)
            return False

        with FaultProxy(upstream=s3_bucket.storage_options["endpoint_url"]) as proxy:
            proxy.add(faults.delay(0, match=Match(where=rewrite_now)))
            try:
                return how({**s3_bucket.storage_options, "endpoint_url": proxy.url})
            finally:
                assert hooked

    handle = rewritten_at_the_first_chunk(
        lambda via: dts.open(url, storage_options=via).read().result())
    assert 2.0 in set(np.unique(handle))  # the commit opened held only 1
    with pytest.raises(IncompleteError, match="rewritten while it was being read"):
        rewritten_at_the_first_chunk(lambda via: dts.read(url, storage_options=via))
    assert (dts.read(url, storage_options=s3_bucket.storage_options) == 2).all()


# ------------------------------------------------------------------ ETags tensorstore can't use
@pytest.fixture
def proxy(s3_bucket: Bucket) -> Iterator[FaultProxy]:
    with FaultProxy(upstream=s3_bucket.storage_options["endpoint_url"]) as p:
        yield p


ETAG_SHOWN = {"unquoted": r"'[0-9a-f]{32}'", "weak": r"""'W/"[0-9a-f]{32}"'""",
              "empty": "''"}


@pytest.mark.parametrize("style", ["unquoted", "weak", "empty"])
def test_unusable_etags_give_durables_error_never_the_opaque_one(
        style: str, s3_bucket: Bucket, proxy: FaultProxy) -> None:
    url = s3_bucket.path("arr")
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    child_write(url, "fresh", 1, 20, s3_bucket.storage_options)  # straight to moto
    proxy.add(faults.rewrite_etag(style))  # type: ignore[arg-type]
    ctx = shared_context()
    # Incident 000, reproduced: the second open revalidates cached metadata and dies.
    spec = {"driver": "zarr3", "kvstore": dts.kvstore_spec(url, via)}
    assert (ts.open(spec, context=ctx, **LEVANTER).result().read().result() == 1).all()
    with pytest.raises(ValueError, match="Malformed StorageGeneration"):
        ts.open(spec, context=ctx, **LEVANTER).result()
    for mode in ("error", "private_cache"):
        if style == "unquoted" and mode == "private_cache":
            continue  # readable: see the test below
        with pytest.raises(dts.UnusableETagError) as err:
            dts.open(url, storage_options=via, context=ctx, on_unusable_etags=mode)
        message = str(err.value)
        assert message.startswith(f"{proxy.url}: the store answered ETag ")
        assert err.value.endpoint == proxy.url
        assert re.fullmatch(ETAG_SHOWN[style], repr(err.value.etag))
        assert err.value.url is not None and err.value.url.endswith("/.durable/arr/commit.json")
        assert "fix the store or the gateway" in message
        assert ("nothing can be read" in message) == (style != "unquoted")


def test_a_stopped_proxy_takes_its_etag_verdict_along(s3_bucket: Bucket) -> None:
    """The ETag verdict is kept per endpoint for the process: the next proxy given the same
    port, in front of a store with usable ETags, is probed afresh, not refused."""
    url = s3_bucket.path("arr")
    child_write(url, "fresh", 1, 20, s3_bucket.storage_options)  # straight to moto
    with FaultProxy(upstream=s3_bucket.server.url) as first:
        first.add(faults.rewrite_etag("weak"))
        port = first.port
        with pytest.raises(dts.UnusableETagError):
            dts.open(url, storage_options={**s3_bucket.storage_options,
                                           "endpoint_url": first.url})
    with FaultProxy(upstream=s3_bucket.server.url, port=port) as second:
        got = dts.open(url, storage_options={**s3_bucket.storage_options,
                                             "endpoint_url": second.url},
                       on_unusable_etags="error")
        assert (got.read().result() == 1).all()


def test_unquoted_etags_read_through_durable_with_a_private_cache(
        s3_bucket: Bucket, proxy: FaultProxy) -> None:
    """Some gateways strip the quotes: durable's S3 adapter re-quotes, and tensorstore reads
    fine as long as it never revalidates, so each handle gets a cache of its own."""
    url = s3_bucket.path("arr")
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    child_write(url, "fresh", 1, 20, s3_bucket.storage_options)  # straight to moto
    proxy.add(faults.rewrite_etag("unquoted"))
    ctx = shared_context()
    for value in (1, 2):
        if value == 2:
            child_write(url, "overwrite", 2, 20, s3_bucket.storage_options)
        for _ in range(2):
            got = dts.open(url, storage_options=via, context=ctx, **LEVANTER)
            assert (got.read().result() == value).all()
            assert (got.read().result() == value).all()


@pytest.mark.parametrize("checksum_codec", [True, False])
def test_a_sharded_array_behind_unquoted_etags_is_durables_error(
        checksum_codec: bool, s3_bucket: Bucket, proxy: FaultProxy) -> None:
    """tensorstore reads a shard's chunks on the condition of the index's version, which an
    unquoted ETag cannot express: plain tensorstore fails every read with 'Malformed
    StorageGeneration'. durable says so at the open, for a sharded array of any codecs
    (one without the crc32c codec got tensorstore's error)."""
    url = s3_bucket.path("arr")
    with dts.writing(url, storage_options=s3_bucket.storage_options) as w:
        array = w.open(create=True, dtype=ts.int32, shape=[40, 40],
                       checksum_codec=checksum_codec, **shards(Target("s3", url)))
        w.write(array, np.ones((40, 40), "int32"))
    proxy.add(faults.rewrite_etag("unquoted"))
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    plain = ts.open({"driver": "zarr3", "kvstore": dts.kvstore_spec(url, via)}).result()
    with pytest.raises(ValueError, match="Malformed StorageGeneration"):
        plain[0:10, 0:10].read().result()  # one inner chunk: its shard's index, then it
    for how in (lambda: dts.read(url, storage_options=via),
                lambda: dts.open(url, storage_options=via).read().result()):
        with pytest.raises(dts.UnusableETagError, match="a sharded array cannot be read"):
            how()


def test_no_etag_at_all_is_a_clear_error(s3_bucket: Bucket, proxy: FaultProxy) -> None:
    url = s3_bucket.path("arr")
    child_write(url, "fresh", 1, 20, s3_bucket.storage_options)
    proxy.add(faults.rewrite_etag("missing"))
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    with pytest.raises(dts.UnusableETagError, match="answered no ETag") as err:
        dts.open(url, storage_options=via)
    assert err.value.endpoint == proxy.url and err.value.etag is None


def test_unusable_etags_writes_work_until_they_need_a_condition(
        s3_bucket: Bucket, proxy: FaultProxy) -> None:
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    proxy.add(faults.rewrite_etag("unquoted"))
    # Each chunk written once: no conditional request, and it commits.
    entry = dts.write(s3_bucket.path("once"), values(20), chunks=[10, 10],
                      storage_options=via)
    assert entry.verify(deep=True).ok
    # A chunk written twice: tensorstore's second write is conditional on the first's ETag.
    url = s3_bucket.path("twice")
    with pytest.raises(dts.UnusableETagError, match=r"ETag '.*so this write failed") as err, \
            dts.writing(url, storage_options=via) as w:
        array = w.open(create=True, dtype=ts.float32, shape=[10, 10])
        array[0:5, :] = 1
        array[5:10, :] = 2
    assert err.value.endpoint == proxy.url
    assert isinstance(err.value.__cause__, ValueError)
    assert dts.entry_for(url, via).state() is not State.COMPLETE


def test_etags_nothing_can_use_stop_a_writer_before_it_writes(
        s3_bucket: Bucket, proxy: FaultProxy) -> None:
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    proxy.add(faults.rewrite_etag("weak"))
    url = s3_bucket.path("arr")
    with pytest.raises(dts.UnusableETagError, match=r"W/.*so nothing was written"), \
            dts.writing(url, storage_options=via):
        pytest.fail("the block must not run")
    assert Entry(url, storage_options=s3_bucket.storage_options).state() is State.ABSENT


def test_unusable_etag_error_is_durables_and_crosses_processes() -> None:
    import pickle

    err = dts.UnusableETagError("http://e: the store answered ETag 'x'", endpoint="http://e",
                                etag="x", url="s3://b/.durable/a/commit.json")
    assert isinstance(err, UnsupportedError) and isinstance(err, NotImplementedError)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.endpoint, back.etag, back.url) == (
        dts.UnusableETagError, str(err), "http://e", "x", "s3://b/.durable/a/commit.json")


def test_gcs_emulator_generations_are_found_unusable(
        request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """gcp-storage-emulator serves media without x-goog-generation: tensorstore keeps
    generation 0 and fails on revalidation exactly like incident 000 on R2."""
    t = make_target("gcs", request, tmp_path, monkeypatch)
    child_write(t.url("arr"), "fresh", 1, 20, t.options)
    ctx = shared_context()
    assert (t.plain_open("arr", ctx, **LEVANTER).read().result() == 1).all()
    with pytest.raises(ValueError, match="Malformed StorageGeneration"):
        t.plain_open("arr", ctx, **LEVANTER)
    # Through durable, the same shared context: each commit, from a cache of the handle's.
    for value in (1, 2):
        if value == 2:
            t.rewrite("arr", "overwrite", 2, 20)  # a resize would need a condition
        got = dts.open(t.url("arr"), storage_options=t.options, context=ctx, **LEVANTER)
        assert (got.read().result() == value).all()
    with pytest.raises(dts.UnusableETagError, match="answered generation '0'"):
        dts.open(t.url("arr"), storage_options=t.options, on_unusable_etags="error")


def test_an_update_where_etags_are_unusable_is_refused_before_the_marker_goes(
        s3_bucket: Bucket, proxy: FaultProxy) -> None:
    """An update on such a store fails at its first conditional request, after
    `Entry.writing` removed the marker: a COMPLETE entry was left INCOMPLETE over its
    unchanged data. Refused before, naming the store."""
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    proxy.add(faults.rewrite_etag("unquoted"))
    url = s3_bucket.path("arr")
    dts.write(url, values(20), chunks=[10, 10], storage_options=via)
    with pytest.raises(dts.UnusableETagError, match="update=True was refused"), \
            dts.writing(url, storage_options=via, update=True) as w:
        w.write(w.open(open=True)[0:5, 0:5], 9)
    assert dts.entry_for(url, via).state() is State.COMPLETE
    assert dts.read(url, storage_options=via).tolist() == values(20).tolist()


def test_a_store_that_ignores_range_reads_and_writes_as_plain_tensorstore_does(
        s3_bucket: Bucket, proxy: FaultProxy) -> None:
    """A gateway that ignores Range answers the whole object: plain tensorstore reads and
    writes unsharded arrays there (whole chunks), but durable's ETag probe, a 1-byte ranged
    read, failed every open, read and write with tensorstore's "Requested byte range [0, 1)
    was ignored by server", naming neither the object nor the store."""
    url = s3_bucket.path("arr")
    dts.write(url, values(20), chunks=[10, 10], storage_options=s3_bucket.storage_options)

    def ignore_range(info: faults.RequestInfo) -> bool:
        info.headers.remove("range")  # forwarded without it: moto answers 200, whole
        return False

    proxy.add(faults.delay(0, match=Match(methods="GET", where=ignore_range)))
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    plain = ts.open({"driver": "zarr3", "kvstore": dts.kvstore_spec(url, via)}).result()
    assert plain.read().result().tolist() == values(20).tolist()
    assert dts.read(url, storage_options=via).tolist() == values(20).tolist()
    assert dts.open(url, storage_options=via).read().result().tolist() == values(20).tolist()
    entry = dts.write(s3_bucket.path("new"), values(20, 1), chunks=[10, 10],
                      storage_options=via)
    assert entry.verify(deep=True).ok
    assert dts.read(entry.url, storage_options=via).tolist() == values(20, 1).tolist()
    # The probe asked for a range, and the store answered it whole
    assert any("range" in r.headers for r in proxy.requests if r.method == "GET")


def test_a_relative_path_is_the_one_under_the_current_directory(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Places of absolute local paths are kept between opens: a relative one must not be,
    # or after a chdir it would name the array under the old directory.
    for name, value in (("a", 1), ("b", 2)):
        dts.write(str(tmp_path / name / "x"), np.full((4,), value, "int32"))
    monkeypatch.chdir(tmp_path / "a")
    assert dts.open("x").read().result().tolist() == [1] * 4
    monkeypatch.chdir(tmp_path / "b")
    assert dts.open("x").read().result().tolist() == [2] * 4
    # The same absolute path after the entry is rewritten: the new commit, not the Place's
    where = str(tmp_path / "a" / "x")
    assert dts.open(where).read().result().tolist() == [1] * 4
    dts.write(where, np.full((4,), 3, "int32"), overwrite=True)
    assert dts.open(where).read().result().tolist() == [3] * 4


def test_a_marker_that_is_a_symlink_is_named_once(tmp_path: Any) -> None:
    """durable.tensorstore.open of an entry whose marker is a symlink: a MarkerError that
    named the marker twice ("commit.json: file:///.../commit.json is a symlink")."""
    url = os.path.join(os.path.realpath(tmp_path), "arr")
    entry = dts.write(url, np.arange(16, dtype="i4").reshape(4, 4))
    marker = entry.layout.marker
    os.rename(marker, marker + ".real")
    os.symlink(marker + ".real", marker)
    with pytest.raises(MarkerError, match="is a symlink") as info:
        dts.open(url)
    assert str(info.value).count(entry.adapter.url(marker)) == 1, str(info.value)


def test_metadata_nested_too_deeply_is_named_not_a_recursion_error(tmp_path: Any) -> None:
    """A zarr.json nested deeper than json parses (a few KiB do it), committed by another
    tool: the open names it as not a metadata document; it raised a bare RecursionError."""
    url = os.path.join(tmp_path, "deep")
    with Entry(url).writing() as w:
        w.write_bytes("zarr.json", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ValueError, match=r"deep/zarr\.json: not a JSON metadata document"):
        dts.open(url)


def test_a_group_opened_as_an_array_is_named_with_its_arrays(tmp_path: Any) -> None:
    """A group entry (durable.zarr, durable.xarray) opened without path=: tensorstore's
    error named no object ('Expected "array", but received: "group"')."""
    import zarr

    import durable.zarr as dz

    url = os.path.join(tmp_path, "g")
    with dz.writing(url) as store:
        root = zarr.group(store)
        root.create_array("a", shape=(10,), chunks=(3,), dtype="int16")[:] = np.arange(10)
        root.create_group("sub").create_array("b", shape=(2,), chunks=(1,), dtype="bool")[:] = 1
    with pytest.raises(ValueError, match=r"g/zarr\.json: a zarr group, not an array; pass "
                       r"path= .*: a, sub, sub/b$"):
        dts.open(url)
    with pytest.raises(ValueError, match=r"g/sub/zarr\.json: a zarr group, .*: sub/b$"):
        dts.read(url, path="sub")
    assert dts.read(url, path="sub/b").tolist() == [True, True]


def test_a_huge_marker_on_s3_is_refused_without_downloading_it(
        s3_bucket: Bucket, proxy: FaultProxy) -> None:
    """A commit.json of 48 MiB (hostile or corrupt) on S3: the open refuses it by the size
    its GET's headers give, before its body is read; tensorstore's own read (which the
    open used) downloaded all of it, then checked the 4 MiB limit."""
    url = s3_bucket.path("arr")
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    dts.write(url, np.arange(16, dtype="i4").reshape(4, 4),
              storage_options=s3_bucket.storage_options)
    size = 48 * 1024 * 1024
    s3_bucket.filesystem().pipe_file(f"{s3_bucket.name}/.durable/arr/commit.json",
                                     b"{" + b" " * (size - 2) + b"}")
    with pytest.raises(MarkerError, match=rf"arr/commit\.json is {size} bytes, over the "
                                          "limit of"):
        dts.open(url, storage_options=via)
    gets = [r.response_bytes for r in proxy.requests
            if r.method == "GET" and r.path.endswith("/arr/commit.json")]
    assert gets and sum(gets) < size // 4, gets  # what the sockets' buffers took, at most


def test_a_huge_marker_on_gcs_is_refused_without_downloading_it(
        gcs_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on S3: a commit.json of 48 MiB on GCS is refused before its body is taken in
    (the open read it through tensorstore's gcs driver, which downloads it whole and only
    then checked the 4 MiB limit)."""
    from urllib.parse import unquote

    with FaultProxy(gcs_bucket.server.url) as proxy:
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy.url)
        via = {**gcs_bucket.storage_options, "endpoint_url": proxy.url}
        url = gcs_bucket.path("arr")
        dts.write(url, np.arange(16, dtype="i4").reshape(4, 4), storage_options=via)
        size = 48 * 1024 * 1024
        with warnings.catch_warnings():  # aiohttp on gcsfs's one-request upload of it
            warnings.simplefilter("ignore", ResourceWarning)
            gcs_bucket.filesystem().pipe_file(f"{gcs_bucket.name}/.durable/arr/commit.json",
                                              b"{" + b" " * (size - 2) + b"}")
        proxy.clear_requests()
        with pytest.raises(MarkerError, match=rf"arr/commit\.json is {size} bytes, over "
                                              "the limit of"):
            dts.open(url, storage_options=via)
        taken = [r.response_bytes for r in proxy.requests
                 if unquote(r.path).endswith("/arr/commit.json")]
        assert taken and sum(taken) < size // 4, taken


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_write_into_a_missing_bucket_names_it(
        kind: str, request: pytest.FixtureRequest, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistyped bucket: the writer's ETag probe, its first request, failed with
    tensorstore's own text ('NOT_FOUND: Not Found [http_response_code='404']' on GCS),
    naming neither the bucket nor the URL, where a read of the same URL said 'no such
    bucket'."""
    t = make_target(kind, request, tmp_path, monkeypatch)
    assert t.bucket is not None
    url = t.url("arr").replace(t.bucket.name, t.bucket.name + "-typo", 1)
    for how in (lambda: dts.write(url, values(4), storage_options=t.options),
                lambda: dts.writing(url, storage_options=t.options).__enter__()):
        # A job's first write in its process: the endpoint's ETags not yet probed.
        forget_endpoint(t.bucket.server.url)
        with pytest.raises(FileNotFoundError) as err:
            how()
        assert str(err.value).startswith(f"{url}: ")
        assert f"no such bucket '{t.bucket.name}-typo'" in str(err.value)


def test_a_write_the_store_forbids_says_so_naming_the_entry(
        s3_bucket: Bucket, proxy: FaultProxy) -> None:
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    proxy.add(faults.error(403, method="PUT"))
    url = s3_bucket.path("arr")
    with pytest.raises(PermissionError) as err:
        dts.write(url, values(4), storage_options=via)
    assert str(err.value).startswith(f"{url}: writing into bucket '{s3_bucket.name}' is "
                                     "not allowed")
    assert "AccessDenied" in str(err.value)


def test_chunks_whose_etags_alone_are_unusable_read_through_durable(
        s3_bucket: Bucket, proxy: FaultProxy) -> None:
    """The probe judges an endpoint by the marker's ETag; a gateway that mangles the ETags
    of some objects only (here the chunks) passes it, the shared cache is revalidated after
    the next commit, and the revalidation of a chunk failed `read` with tensorstore's
    'Malformed StorageGeneration' (incident 000's error, through durable). `read` now
    probes that chunk, and reads with a cache of its own where the ETag still pins a read,
    as it does where the marker's ETag is unusable."""
    url = s3_bucket.path("arr")
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    child_write(url, "fresh", 1, 20, s3_bucket.storage_options)  # straight to moto
    proxy.add(faults.rewrite_etag("unquoted", key="/arr/c/"))
    ctx = shared_context()
    assert (dts.read(url, storage_options=via, context=ctx) == 1).all()  # cached
    child_write(url, "overwrite", 2, 20, s3_bucket.storage_options)
    assert (dts.read(url, storage_options=via, context=ctx) == 2).all()  # revalidated
    assert (dts.open(url, storage_options=via, context=ctx).read().result() == 2).all()
    with pytest.raises(dts.UnusableETagError) as err:
        dts.read(url, storage_options=via, context=ctx, on_unusable_etags="error")
    assert err.value.url is not None and "/arr/c/" in err.value.url
    assert err.value.endpoint == proxy.url


def test_a_commit_landing_during_a_readers_look_is_never_called_data_without_durable(
        s3_bucket: Bucket, proxy: FaultProxy) -> None:
    """A reader finds no marker, then lists the records after the rewrite committed and
    removed its attempt record: the listing shows the new marker and no writer. That read
    "data present but no commit marker; written without durable? ... mark_complete()
    commits it as it is", advice that commits whatever is there as COMPLETE (seen 18 times
    in 500 reads of a checkpoint rewritten ten times by another process)."""
    from durable import _background as background

    url = s3_bucket.path("arr")
    via = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
    child_write(url, "fresh", 1, 20, s3_bucket.storage_options)  # straight to moto
    reached, committed = threading.Event(), threading.Event()

    def hold_records_listing(info: faults.RequestInfo) -> bool:
        if "list-type" in info.query and info.query.get("prefix", [""])[0].endswith(
                ".durable/arr/"):
            reached.set()
            committed.wait(30)  # the reader's listing goes out once the rewrite committed
        return False  # observe only, no fault

    writing = dts.writing(url, storage_options=s3_bucket.storage_options, overwrite=True)
    w = writing.__enter__()
    w.write(w.open(create=True, dtype=ts.float32, shape=[20, COLS]), values(20, 1))
    proxy.add(faults.delay(0, match=Match(where=hold_records_listing)))
    with ThreadPoolExecutor(1) as pool:
        status = pool.submit(Entry(url, storage_options=via).status)
        assert reached.wait(30)
        writing.__exit__(None, None, None)
        background.wait()  # the committed attempt's record removed
        committed.set()
        st = status.result()
    assert st.state is State.INCOMPLETE and "a commit landed" in st.reason, st.reason
    assert "mark_complete" not in Entry(url, storage_options=via)._inside_hint(st)
    assert (dts.read(url, storage_options=via) == values(20, 1)).all()  # as it says


def test_a_path_with_no_array_names_the_arrays_of_the_commit(tmp_path: Any) -> None:
    """A checkpoint of many arrays read with a mistyped path= (or none): the error said only
    that the commit had no array there, leaving the user to list the store."""
    url = os.path.join(os.path.realpath(tmp_path), "ckpt")
    with dts.writing(url) as w:
        for name in ("params/w", "params/b", "opt/mu"):
            array = w.open(name, create=True, dtype=ts.float32, shape=[4])
            w.write(array, np.zeros(4, "float32"))
    for path in ("params/W", ""):
        with pytest.raises(ValueError, match=r"has no array there; its arrays \(path=\): "
                                             r"opt/mu, params/b, params/w$"):
            dts.read(url, path=path)


def test_write_onto_a_complete_entry_names_what_changes_it(tmp_path: Any) -> None:
    """write() takes no update=True (a TypeError): its error names writing(update=True)."""
    url = str(tmp_path / "a.zarr")
    data = np.arange(16, dtype="int32").reshape(4, 4)
    dts.write(url, data, chunks=[2, 2])
    with pytest.raises(AlreadyCompleteError, match=r"durable\.tensorstore\.writing\(url, "
                                                   r"update=True\) changes it") as err:
        dts.write(url, data, chunks=[2, 2])
    assert "write(..., overwrite=True) replaces it" in str(err.value)
