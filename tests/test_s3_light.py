"""durable's small PUTs on S3 through obstore (`durable.adapters._s3_light`): the same
request as through s3fs, or s3fs itself.

Each test looks at what reached the store through the fault proxy, or at the bucket with a
client that shares nothing with durable.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import fsspec
import pytest

from durable import AlreadyCompleteError, Entry, IntegrityError, State
from durable._checksum import crc32c
from durable._protocol import ObjectRecord
from durable.adapters import _s3_light as light
from durable.adapters import adapter_for_fs
from durable.adapters.s3 import S3Adapter
from durable.testing import faults
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket

pytestmark = pytest.mark.s3



def _adapter(options: dict[str, Any]) -> S3Adapter:
    adapter = adapter_for_fs(fsspec.filesystem("s3", skip_instance_cache=True, **options))
    assert isinstance(adapter, S3Adapter)
    return adapter


def _stored(bucket: Bucket, key: str) -> bytes:
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **bucket.storage_options)
    return bytes(fs.cat_file(f"{bucket.name}/{key}"))


def test_a_commits_small_puts_go_through_obstore_as_the_same_requests(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    proxy, options = proxied
    sent: list[str] = []
    real = light.put

    def spy(store: Any, adapter: Any, bucket: str, key: str, data: bytes,
            create_only: bool) -> str | None:
        sent.append(key)
        return real(store, adapter, bucket, key, data, create_only)

    monkeypatch.setattr("durable.adapters.s3.light_put", spy)
    entry = Entry(s3_bucket.path("e"), storage_options=options)
    with entry.writing() as w:
        w.write_bytes("a", b"1" * 100)
        with w.open("b") as f:
            f.write(b"2" * 100)
    assert [k.rpartition("/")[2] for k in sent][1:] == ["a", "commit.json"]
    assert re.fullmatch(r"\.durable/e/attempts/[0-9a-f]+\.json", sent[0])
    puts = {r.key: r for r in proxy.requests if r.method == "PUT"}
    # The marker: create-only, signed over its payload (the store checks the body).
    marker = puts[".durable/e/commit.json"]
    assert marker.headers.get("if-none-match") == "*" and marker.status == 200
    assert re.fullmatch(r"[0-9a-f]{64}", marker.headers.get("x-amz-content-sha256", ""))
    # A small object written whole: one PUT signed over its payload too.
    assert re.fullmatch(r"[0-9a-f]{64}", puts["e/a"].headers.get("x-amz-content-sha256", ""))
    # A file written through the writer went through s3fs, with its CRC32C as before.
    assert "x-amz-checksum-crc32c" in puts["e/b"].headers
    assert Entry(s3_bucket.path("e"), storage_options=s3_bucket.storage_options
                 ).verify(deep=True).ok


def test_a_create_only_put_refused_is_file_exists(s3_bucket: Bucket) -> None:
    adapter = _adapter(dict(s3_bucket.storage_options))
    path = f"{s3_bucket.name}/once.json"
    adapter.put(path, b"first", create_only=True)
    assert adapter._light_stores[s3_bucket.name] is not None  # it went through obstore
    with pytest.raises(FileExistsError, match=r"once\.json already exists"):
        adapter.put(path, b"second", create_only=True)
    assert _stored(s3_bucket, "once.json") == b"first"


def test_a_marker_put_whose_answer_was_lost_is_still_a_commit(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    """The store applied the marker's PUT, the answer never came: obstore sends it again,
    the store refuses the retry (create-only), and the bytes there are this writer's."""
    proxy, options = proxied
    proxy.add(faults.drop_connection(forward=True, method="PUT",
                                     path=re.compile(r"/lost/commit\.json$"), times=1))
    entry = Entry(s3_bucket.path("lost"), storage_options=options)
    with entry.writing() as w:
        w.write_bytes("a", b"1")
    marker = [(r.method, r.status) for r in proxy.requests
              if r.key == ".durable/lost/commit.json"]
    # Dropped after the store applied it; the retry refused (ours is there); read back.
    assert marker == [("PUT", None), ("PUT", 412), ("GET", 200)]
    assert entry.state() is State.COMPLETE


def test_another_writers_marker_is_still_refused(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    _, options = proxied
    first = Entry(s3_bucket.path("two"), storage_options=options).writing(resume=True)
    second = Entry(s3_bucket.path("two"), storage_options=options).writing(resume=True)
    first.__enter__().write_bytes("a", b"1")
    second.__enter__().write_bytes("a", b"1")
    first.__exit__(None, None, None)
    with pytest.raises(AlreadyCompleteError, match="another writer committed"):
        second.__exit__(None, None, None)


def test_a_refusal_names_the_object_and_the_status(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = proxied
    proxy.add(faults.error(403, "AccessDenied", method="PUT", path=re.compile(r"/denied$")))
    adapter = _adapter(options)
    with pytest.raises(PermissionError, match=rf"s3://{s3_bucket.name}/denied: PutObject "
                                              r"answered HTTP 403"):
        adapter.put(f"{s3_bucket.name}/denied", b"x")


def test_keys_obstore_would_not_name_exactly_go_through_s3fs(s3_bucket: Bucket) -> None:
    adapter = _adapter(dict(s3_bucket.storage_options))
    for key in ("a/./b", "c//d"):
        info = adapter.put(f"{s3_bucket.name}/{key}", b"exact")
        assert _stored(s3_bucket, key) == b"exact" and info.size == 5


def test_options_it_does_not_map_leave_every_request_to_s3fs(s3_bucket: Bucket) -> None:
    """Retries, proxies, encryption, ACLs: s3fs's options that obstore would not apply."""
    for extra in ({"config_kwargs": {"retries": {"max_attempts": 1}}},
                  {"s3_additional_kwargs": {"ACL": "private"}},
                  {"requester_pays": True}):
        adapter = _adapter({**s3_bucket.storage_options, **extra})
        adapter.put(f"{s3_bucket.name}/plain-{len(extra)}", b"x")
        assert adapter._light_stores == {s3_bucket.name: None}, extra


def test_a_ca_bundle_botocore_trusts_leaves_tls_endpoints_to_s3fs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is sent here: the store is only built (a presigned URL is made locally)."""
    options = {"endpoint_url": "https://127.0.0.1:9", "key": "k", "secret": "s"}
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    assert light.light_store(_adapter(options), "b") is not None
    monkeypatch.setenv("AWS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    assert light.light_store(_adapter(options), "b") is None


def test_aws_settings_in_the_environment_obstore_would_apply_leave_it_to_s3fs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """obstore reads AWS_* from the environment too: a setting s3fs would not apply the
    same way (a session token beside explicit keys, server-side encryption) means s3fs."""
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    assert light.light_store(_adapter(options), "b") is not None
    for name, value in (("AWS_SESSION_TOKEN", "someone-elses"),
                        ("AWS_SERVER_SIDE_ENCRYPTION", "aws:kms")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert light.light_store(_adapter(options), "b") is None, name


def _through_s3fs(adapter: S3Adapter, prefix: str, monkeypatch: pytest.MonkeyPatch,
                  ) -> dict[str, Any]:
    with monkeypatch.context() as m:
        m.setattr(S3Adapter, "light_puts", False)
        return adapter.list(prefix)


def test_a_commits_records_listings_go_through_obstore_and_say_what_s3fs_says(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The records dir is listed twice per commit on S3 (as the writer starts, and before
    its marker): through obstore, each object as s3fs lists it (key, size, ETag, time)."""
    proxy, options = proxied
    answered: list[str] = []
    real = light.list_below

    def spy(store: Any, adapter: Any, bucket: str, start: str) -> Any:
        got = real(store, adapter, bucket, start)
        answered.append(start if got is not None else f"refused {start}")
        return got

    monkeypatch.setattr("durable.adapters.s3.list_below", spy)
    entry = Entry(s3_bucket.path("e"), storage_options=options)
    with entry.writing() as w:
        w.write_bytes("a", b"1" * 100)
    assert answered == [".durable/e/", ".durable/e/"]  # as it starts, before the marker
    # every records listing of the commit was obstore's (no encoding-type: botocore's asks it)
    lists = [r for r in proxy.requests if r.query.get("prefix") == [".durable/e/"]]
    assert lists and not [r for r in lists if "encoding-type" in r.query]
    adapter = _adapter(dict(s3_bucket.storage_options))
    records = f"{s3_bucket.name}/.durable/e"
    for key, body in (("attempts/0123abcd.json", b"{}"), ("fragments/x/y", b"12345")):
        adapter.put(f"{records}/{key}", body)
    ours = adapter.list(records)
    theirs = _through_s3fs(adapter, records, monkeypatch)
    assert set(ours) == set(theirs) == {"commit.json", "attempts/0123abcd.json",
                                        "fragments/x/y"}
    for key, info in ours.items():
        other = theirs[key]
        assert (info.path, info.size, info.version) == (other.path, other.size, other.version)
        assert info.modified is not None and other.modified is not None
        assert abs(info.modified - other.modified) < 1.0


@pytest.mark.parametrize("odd", ["folder/", "a//b", "x/./y", "empty"])
def test_a_records_listing_obstore_would_change_is_asked_of_s3fs(
        s3_bucket: Bucket, odd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """object_store drops a key's trailing '/' (a console folder `folder/` would list as
    `folder`), refuses empty and '.' segments, and an empty object is ambiguous once a
    '/' may have been dropped: each such listing is the one s3fs gives."""
    import boto3

    options = s3_bucket.storage_options
    client = boto3.client("s3", endpoint_url=options["endpoint_url"],
                          aws_access_key_id=options["key"],
                          aws_secret_access_key=options["secret"], region_name="us-east-1")
    records = f"{s3_bucket.name}/.durable/e"
    adapter = _adapter(dict(options))
    adapter.put(f"{records}/commit.json", b"{}")
    client.put_object(Bucket=s3_bucket.name, Key=f".durable/e/{odd}",
                      Body=b"" if odd in ("folder/", "empty") else b"odd")
    store = light.light_store(adapter, s3_bucket.name)
    assert store is not None
    assert light.list_below(store, adapter, s3_bucket.name, ".durable/e/") is None
    assert adapter.list(records) == _through_s3fs(adapter, records, monkeypatch)


@pytest.mark.parametrize(("status", "code", "message", "builtin"), [
    (403, "AccessDenied", "Access Denied", PermissionError),
    (404, "NoSuchBucket", "The specified bucket does not exist", FileNotFoundError),
    (400, "InvalidArgument", "Bad Request", OSError),
    (500, "InternalError", "We encountered an internal error.", OSError),  # after retries
])
def test_a_refusal_is_short_and_clear(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]], status: int, code: str,
        message: str, builtin: type[OSError]) -> None:
    """The object, the status, the store's code and message, as s3fs's path says them:
    obstore's message went on with its whole request and a 40-line debug dump of its Rust
    error (and a 404 was a bare OSError, no FileNotFoundError)."""
    proxy, options = proxied
    proxy.add(faults.error(status, code, message, method=["PUT", "GET"],
                           path=re.compile(r"/refused$")))
    adapter = _adapter(options)
    url = f"s3://{s3_bucket.name}/refused"
    for request, call in (("PutObject", lambda: adapter.put(f"{s3_bucket.name}/refused", b"x")),
                          ("GET", lambda: adapter.read_small(f"{s3_bucket.name}/refused", 9))):
        if request == "GET" and status == 404:
            assert call() is None  # no object: nothing to read
            continue
        with pytest.raises(builtin) as info:
            call()
        assert type(info.value) is builtin
        assert str(info.value) == f"{url}: {request} answered HTTP {status} {code}: {message}"


def test_a_put_answered_200_with_an_error_document_is_no_write(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    """A gateway answering a PutObject with its error document as a 200 (the PUT never
    reached the store): obstore reads no body of a PUT's answer, and the put counted as
    written (a marker that never landed, a commit). Its ETag is not the MD5 of the bytes
    sent: one HEAD finds the object is not there, and the put fails naming it."""
    proxy, options = proxied
    proxy.add(faults.error_body_with_200(method="PUT", path=re.compile(r"/small$")))
    adapter = _adapter(options)
    with pytest.raises(OSError, match=rf"s3://{s3_bucket.name}/small: PutObject answered "
                                      r"200 with ETag .*not the store's answer"):
        adapter.put(f"{s3_bucket.name}/small", b"x")
    assert not s3_bucket.filesystem().exists(f"{s3_bucket.name}/small")
    proxy.clear()
    proxy.clear_requests()
    adapter.put(f"{s3_bucket.name}/small", b"x")  # a store's own answer: one request
    assert [r.method for r in proxy.requests] == ["PUT"]


def test_a_slowdown_burst_s3fs_rides_out_fails_no_commit(
        s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """503 SlowDown ten times in a row on the marker's PUT: s3fs sends a PutObject up to 25
    times, so obstore must not give up sooner (it did after 5, within a second, failing a
    commit whose data s3fs had put through the same burst). Backoff made short here only."""
    monkeypatch.setattr(light, "_RETRIES", {**light._RETRIES, "backoff": {
        "init_backoff": datetime.timedelta(milliseconds=1),
        "max_backoff": datetime.timedelta(milliseconds=2), "base": 1.01}})
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        adapter = _adapter(options)
        proxy.add(faults.error(503, "SlowDown", method="PUT", times=10,
                               path=re.compile(r"/commit\.json$")))
        adapter.put(f"{s3_bucket.name}/.durable/e/commit.json", b"{}", create_only=True)
        assert adapter._light_stores[s3_bucket.name] is not None  # through obstore
        assert [r.status for r in proxy.requests if r.method == "PUT"
                and r.key == ".durable/e/commit.json"] == [503] * 10 + [200]
    assert _stored(s3_bucket, ".durable/e/commit.json") == b"{}"


def test_a_small_object_written_whole_is_checked_and_recorded_as_a_file_is(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    """`EntryWriter.write_bytes` sends a small object as one light PUT: the checks of a
    file written through the writer hold on it (an error document refused with nothing
    sent, create-only kept), and the manifest records it as a file's would be."""
    proxy, options = proxied
    doc = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
           b"<Message>Access Denied</Message></Error>")
    entry = Entry(s3_bucket.path("e"), storage_options=options)
    proxy.clear_requests()
    with pytest.raises(IntegrityError, match=r"e/page\.xml: not written: .*error document"
                       ), entry.writing() as w:
        w.write_bytes("page.xml", doc)
    assert not [r for r in proxy.requests if r.key == "e/page.xml"]  # nothing was sent
    assert entry.state() is State.ABSENT
    with entry.writing() as w:
        w.write_bytes("zarr.json", b'{"zarr_format": 3}', create_only=True)
        with pytest.raises(FileExistsError):
            w.write_bytes("zarr.json", b'{"zarr_format": 2}', create_only=True)
        w.allow_error_documents = True
        w.write_bytes("page.xml", doc)
    marker = entry.status().marker
    assert marker is not None and marker.manifest is not None
    assert marker.manifest.objects["zarr.json"] == ObjectRecord(18, crc32c(b'{"zarr_format": 3}'))
    assert Entry(s3_bucket.path("e"), storage_options=s3_bucket.storage_options
                 ).verify(deep=True).ok
