"""The adapter conformance suite on S3: the S3 adapter against a real moto server.

The raw helpers reach the bucket with a plain boto3 client, never through the adapter or
s3fs, so what the adapter published is read back by a client that is not the adapter, and
what it lists, stats and reads was put there by another writer. After every test the bucket
must also hold no multipart upload: an interrupted write that left one would pass
`raw_list` (it lists objects) while still paying for stored parts. The suite's own
interrupted writes are smaller than one part, so one test here interrupts a multipart one.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from durable.adapters import adapter_for_fs
from durable.adapters.base import Adapter
from durable.adapters.s3 import S3Adapter
from durable.testing.conformance import AdapterTests, payload
from durable.testing.pytest_plugin import Bucket

pytestmark = pytest.mark.s3

MiB = 1024 * 1024
# The part size an S3Adapter uses unless told otherwise: objects above it are multipart.
DEFAULT_PART_SIZE = 8 * MiB


def _boto(bucket: Bucket) -> Any:
    import boto3  # type: ignore[import-untyped]

    return boto3.client("s3", endpoint_url=bucket.server.url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


class TestS3Adapter(AdapterTests):
    # Two whole parts and a short third: the round trip is a real multipart upload whose
    # write() blocks never line up with its parts.
    large_object_size: ClassVar[int] = 2 * DEFAULT_PART_SIZE + MiB + 7
    race_rounds: ClassVar[int] = 10

    boto: Any
    bucket: str

    @pytest.fixture
    def place(self, s3_bucket: Bucket) -> Iterator[tuple[Adapter, str]]:
        # The adapter durable resolves for this filesystem: the same one atomic_write,
        # read_verified and Entry use through url_of / storage_options.
        adapter = adapter_for_fs(s3_bucket.filesystem())
        assert isinstance(adapter, S3Adapter)
        assert adapter.part_size < self.large_object_size
        self.boto, self.bucket = _boto(s3_bucket), s3_bucket.name
        yield adapter, f"{s3_bucket.name}/base"
        try:
            left = self.boto.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
            assert left == [], f"multipart uploads left behind: {left}"
        finally:
            self.boto.close()

    def _key(self, path: str) -> str:
        bucket, _, key = path.partition("/")
        assert bucket == self.bucket and key, path
        return key

    def raw_put(self, path: str, data: bytes) -> None:
        self.boto.put_object(Bucket=self.bucket, Key=self._key(path), Body=data)

    def raw_get(self, path: str) -> bytes | None:
        try:
            resp = self.boto.get_object(Bucket=self.bucket, Key=self._key(path))
        except self.boto.exceptions.NoSuchKey:
            return None
        return bytes(resp["Body"].read())

    def raw_list(self, prefix: str) -> list[str]:
        start = self._key(prefix).rstrip("/") + "/"
        keys: list[str] = []
        for page in self.boto.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=start):
            keys += [obj["Key"] for obj in page.get("Contents", [])]
        return sorted(f"{self.bucket}/{k}" for k in keys)

    @pytest.mark.parametrize("how", ["exception", "keyboard-interrupt", "close-without-commit",
                                     "garbage-collected"])
    def test_unfinished_multipart_write_leaves_no_object_and_no_upload(self, how: str) -> None:
        p = self.path("unfinished/large.bin")
        f = self.adapter.open_atomic(p)
        f.write(payload(self.large_object_size))
        started = self.boto.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        assert [u["Key"] for u in started] == [self._key(p)], "no part went out yet"
        if how == "exception":
            with pytest.raises(ValueError), f:
                raise ValueError("writer failed mid-upload")
        elif how == "keyboard-interrupt":
            with pytest.raises(KeyboardInterrupt), f:
                raise KeyboardInterrupt
        elif how == "close-without-commit":
            f.close()
        else:
            del f
            gc.collect()
        assert self.raw_get(p) is None
        assert self.raw_list(self.base) == []
        # ... and, checked after every test by `place`, no multipart upload left.
