"""pytest fixtures that start real storage servers on 127.0.0.1 (see durable.testing.servers).

Installed as a pytest plugin (entry point `pytest11`), so any project that installs
durable-io gets the fixtures without a conftest:

- `moto_server`, `gcs_server`, `fake_gcs_server`, `azurite_server` (session scope): the
  server, started on first use and stopped when the session ends.
- `s3_bucket`, `gcs_bucket`, `fake_gcs_bucket`, `azure_container` (function scope): a
  `Bucket` made fresh for the test, so tests never see each other's objects and no reset is
  needed between them.

A server whose program is missing fails the test with an install hint: a green run must not
hide a store that was never tested. Set DURABLE_SKIP_MISSING_SERVERS=1 to skip instead.

The plugin is loaded in every pytest session of an environment that has durable-io, so it
changes nothing by being loaded: the cloud clients' guards (`set_network_guards`: dummy AWS
keys where none are set, AWS_DEFAULT_REGION=us-east-1, dead metadata addresses) are set
when a server fixture first starts, for the rest of that session. Set at import, they made
an unrelated project's suite see us-east-1 and the key "testing". A suite that imports
gcsfs or creates cloud clients before its first server fixture calls
`durable.testing.servers.set_network_guards()` at the top of its conftest (durable's own
does).
"""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from durable.testing.servers import (
    AzuriteServer,
    GCSServer,
    MotoServer,
    Server,
    ServerNotFoundError,
    set_network_guards,
    start_azurite,
    start_fake_gcs,
    start_gcs,
    start_moto,
)

__all__ = ["Bucket"]

@dataclass(frozen=True)
class Bucket:
    """A fresh bucket (or Azure container) on a test server, and how to reach it with fsspec."""

    name: str
    protocol: str  # "s3", "gs" or "az"
    storage_options: dict[str, Any] = field(repr=False, compare=False)
    server: Server = field(repr=False, compare=False)

    @property
    def url(self) -> str:
        """`s3://name`, `gs://name` or `az://name`."""
        return f"{self.protocol}://{self.name}"

    def path(self, *parts: str) -> str:
        """A URL inside the bucket: `bucket.path("a", "b.zarr")` -> `s3://name/a/b.zarr`."""
        return "/".join([self.url, *parts])

    def filesystem(self) -> Any:
        """The fsspec filesystem for this bucket (cached by fsspec like any other)."""
        import fsspec

        return fsspec.filesystem(self.protocol, **self.storage_options)


_S = TypeVar("_S", bound=Server)


def _serve(start: Callable[[], _S]) -> Iterator[_S]:
    # A session that starts a local server is pointed away from the cloud's metadata
    # servers from here on; one that never does keeps its environment (module doc).
    set_network_guards()
    try:
        server = start()
    except ServerNotFoundError as err:
        if os.environ.get("DURABLE_SKIP_MISSING_SERVERS") == "1":
            pytest.skip(f"{err} (skipped: DURABLE_SKIP_MISSING_SERVERS=1)")
        pytest.fail(f"{err}\n(set DURABLE_SKIP_MISSING_SERVERS=1 to skip instead)", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """moto's S3 server for the whole session."""
    yield from _serve(start_moto)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    """gcp-storage-emulator for the whole session (enforces no ifGenerationMatch)."""
    yield from _serve(start_gcs)


@pytest.fixture(scope="session")
def fake_gcs_server() -> Iterator[GCSServer]:
    """fake-gcs-server for the whole session (enforces ifGenerationMatch on multipart uploads)."""
    yield from _serve(start_fake_gcs)


@pytest.fixture(scope="session")
def azurite_server() -> Iterator[AzuriteServer]:
    """azurite's Blob service for the whole session."""
    yield from _serve(start_azurite)


def _new_name() -> str:
    # Valid as an S3 bucket, a GCS bucket and an Azure container name alike.
    return f"test-{uuid.uuid4().hex[:16]}"


# Bucket creation goes over plain HTTP (the emulators take unsigned requests): no client
# library instance is created, so none of its caches or sessions leak into the test.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _request(url: str, method: str, body: bytes | None = None) -> None:
    headers = {"Content-Type": "application/json"} if body else {}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    with _opener.open(request, timeout=10):
        pass  # urllib raises HTTPError on a status >= 400


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> Bucket:
    """A new, empty S3 bucket on the session's moto server."""
    name = _new_name()
    _request(f"{moto_server.url}/{name}", "PUT")
    return Bucket(name, "s3", moto_server.storage_options(), moto_server)


def _gcs_bucket(server: GCSServer) -> Bucket:
    name = _new_name()
    body = json.dumps({"name": name}).encode()
    _request(f"{server.url}/storage/v1/b?project=test-project", "POST", body)
    return Bucket(name, "gs", server.storage_options(), server)


@pytest.fixture
def gcs_bucket(gcs_server: GCSServer) -> Bucket:
    """A new, empty bucket on the session's gcp-storage-emulator."""
    return _gcs_bucket(gcs_server)


@pytest.fixture
def fake_gcs_bucket(fake_gcs_server: GCSServer) -> Bucket:
    """A new, empty bucket on the session's fake-gcs-server."""
    return _gcs_bucket(fake_gcs_server)


@pytest.fixture
def azure_container(azurite_server: AzuriteServer) -> Bucket:
    """A new, empty container on the session's azurite (requests must be signed: SDK)."""
    from azure.storage.blob import ContainerClient

    name = _new_name()
    conn = azurite_server.connection_string
    with ContainerClient.from_connection_string(conn, name) as client:
        client.create_container()
    return Bucket(name, "az", azurite_server.storage_options(), azurite_server)
