"""Shared fixtures for the core tests. Server fixtures come from durable.testing.pytest_plugin.

`place` is a fresh root on the local disk (tmp_path) or in fsspec's memory filesystem, with
helpers that read and write *around* durable (plain os / the raw memory store), so what the
tests check is never graded by the code under test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from durable import Entry
from durable import _background as background
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket
from durable.testing.servers import set_network_guards

# Before any test module imports gcsfs or a cloud SDK (they read some of these once): the
# plugin sets them only when a server fixture starts.
set_network_guards()


class Place:
    """A test root: `url(...)` names things for durable; the rest bypasses durable."""

    def __init__(self, kind: str, root: str) -> None:
        self.kind = kind  # "file" or "memory"
        self.root = root  # a local directory, or a memory-store key prefix "/x"

    def url(self, *parts: str) -> str:
        prefix = "memory://" if self.kind == "memory" else ""
        return prefix + "/".join([self.root, *parts])

    def canonical(self, *parts: str) -> str:
        """How durable's errors and Entry.url name the place (with its protocol)."""
        return ("file://" if self.kind == "file" else "memory://") + "/".join(
            [self.root, *parts])

    def files(self) -> dict[str, bytes]:
        """Every file under the root (hidden ones and records included) -> its bytes."""
        if self.kind == "memory":
            head = self.root + "/"
            return {k[len(head):]: bytes(v.getbuffer())
                    for k, v in list(MemoryFileSystem.store.items()) if k.startswith(head)}
        out = {}
        for dirpath, _, filenames in os.walk(self.root):
            for fn in filenames:
                full = os.path.join(dirpath, fn)
                with open(full, "rb") as f:
                    out[os.path.relpath(full, self.root)] = f.read()
        return out

    def read(self, rel: str) -> bytes | None:
        return self.files().get(rel)

    def write(self, rel: str, data: bytes) -> None:
        if self.kind == "memory":
            MemoryFileSystem().pipe_file(f"{self.root}/{rel}", data)
            return
        full = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)

    def remove_tree(self, rel: str) -> None:
        """Delete a directory the way another tool would (shutil.rmtree / fs.rm)."""
        if self.kind == "memory":
            MemoryFileSystem().rm(f"{self.root}/{rel}", recursive=True)
            return
        import shutil

        shutil.rmtree(os.path.join(self.root, rel))


@pytest.fixture(params=["file", "memory"])
def place(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[Place]:
    if request.param == "file":
        yield Place("file", os.path.realpath(tmp_path))
        return
    root = f"/durable-test-{uuid.uuid4().hex[:12]}"
    yield Place("memory", root)
    for key in [k for k in MemoryFileSystem.store if k.startswith(root + "/")]:
        MemoryFileSystem.store.pop(key, None)
    MemoryFileSystem.pseudo_dirs[:] = [d for d in MemoryFileSystem.pseudo_dirs
                                       if not d.startswith(root)]


@pytest.fixture(autouse=True)
def _housekeeping_settled() -> Iterator[None]:
    """Every test ends with durable's background housekeeping done (a commit's removal of
    its attempt record on an object store): none of it lands in the next test's store."""
    yield
    background.wait()


# What the racing test children need, imported once in the fork server, not by each
# (8 children at once on two cores): durable, the S3 stack, the cached function.
FORKSERVER_PRELOAD = ["_cached_child", "durable.adapters.s3"]


def forkserver() -> Any:
    """multiprocessing's forkserver context, preloading FORKSERVER_PRELOAD (one server per
    session: the preload is the first caller's, so every caller names this one)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


class _NoSleep:
    """A client library's ``asyncio`` or ``time`` module, its sleeps made 0."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def sleep(self, delay: float, *args: Any) -> Any:
        return self._module.sleep(0)  # a coroutine for asyncio, None for time


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clients' own retries, as many as ever, without the backoff between them
    (botocore, aiobotocore, s3fs, gcsfs, azure: up to 80 s per request given up on): what a
    test of a fault that outlasts them checks is the error at the end, not the wait."""
    import asyncio
    import time

    import aiobotocore.endpoint
    import azure.storage.blob._shared.policies_async as azure_policies
    import azure.storage.blob.aio._download_async as azure_download
    import botocore.endpoint
    import gcsfs.retry
    import s3fs.core

    monkeypatch.setattr(botocore.endpoint, "time", _NoSleep(time))
    monkeypatch.setattr(aiobotocore.endpoint, "asyncio", _NoSleep(asyncio))
    monkeypatch.setattr(s3fs.core, "asyncio", _NoSleep(asyncio))
    monkeypatch.setattr(gcsfs.retry, "asyncio", _NoSleep(asyncio))
    # azure-storage-blob: 15 + 18 + 24 s between its retries; 1 s before a body retried.
    monkeypatch.setattr(azure_policies.ExponentialRetry, "get_backoff_time",
                        lambda self, settings: 0)
    monkeypatch.setattr(azure_download, "asyncio", _NoSleep(asyncio))


@pytest.fixture
def boto(s3_bucket: Bucket) -> Iterator[Any]:
    """A plain boto3 client on the moto server (never through a proxy): the view from
    outside durable."""
    import boto3  # type: ignore[import-untyped]

    client = boto3.client("s3", endpoint_url=s3_bucket.server.url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    yield client
    client.close()


@pytest.fixture
def proxied(s3_bucket: Bucket) -> Iterator[tuple[FaultProxy, dict[str, Any]]]:
    """A fault proxy in front of the moto server, and storage options that go through it;
    the endpoint's per-process create-only probe already paid (by a first commit), so
    what the proxy logs from here is what every later commit sends."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        with Entry(s3_bucket.path("warm"), storage_options=options).writing() as w:
            w.write_bytes("a", b"a")
        proxy.clear_requests()
        yield proxy, options
