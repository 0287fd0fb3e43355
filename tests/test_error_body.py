"""An object store's error document served as the object is never returned as data.

Incident 003: a 403 error document was cached as the file. Here the real fault proxy in
front of moto answers GET and HEAD of one key with an S3 XML error document, status 200, a
correct Content-Length and an MD5 ETag (`error_body_with_200`), as a gateway or CDN that
cached an error page would. Such an answer carries none of the object's metadata, so none
of the record an object keeps there: every read path must still refuse it, by the sniff
where nothing recorded is left to catch it, by size or CRC32C where a record is found.
Objects are written straight to moto and read through the proxy.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from durable import (
    Entry,
    IncompleteError,
    IntegrityError,
    State,
    atomic_write,
    open_verified,
    read_verified,
)
from durable._verified import ERROR_DOC_LIMIT, error_document
from durable.testing import faults
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket

DATA = os.urandom(5000)
S3_DOC = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
          b"<Message>Access Denied</Message><RequestId>A1</RequestId><HostId>h</HostId>"
          b"</Error>")
AZURE_DOC = ("\ufeff<?xml version=\"1.0\" encoding=\"utf-8\"?><Error><Code>BlobNotFound"
             "</Code><Message>The specified blob does not exist.\nRequestId:1</Message>"
             "</Error>").encode()
GCS_XML_DOC = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchKey</Code>"
               b"<Message>The specified key does not exist.</Message><Details>b/k</Details>"
               b"</Error>")
GCS_JSON_DOC = (b'{"error": {"code": 403, "message": "anonymous caller does not have '
                b'storage.objects.get access", "errors": [{"reason": "forbidden"}]}}')
# Legitimate small objects that must still read: XML that is not an error document.
NOT_ERRORS = {
    "root.xml": b'<?xml version="1.0" encoding="UTF-8"?><root/>',
    "report.xml": (b'<?xml version="1.0"?><Report><Error><Code>E1</Code><Message>m</Message>'
                   b"</Error><Status>Error: none</Status></Report>"),
    "nocode.xml": b"<Error><Message>no code in here</Message></Error>",
    "other.json": b'{"error": {"code": 403, "message": "m"}, "id": 7}',
}


def _only(key: str) -> str:
    return rf"^/[^/]+/{re.escape(key)}$"


@pytest.fixture
def proxied(s3_bucket: Bucket) -> Iterator[tuple[FaultProxy, dict[str, Any]]]:
    """The fault proxy in front of moto, and storage options that reach the bucket by it."""
    with FaultProxy(upstream=s3_bucket.server.url) as p:
        yield p, dict(s3_bucket.storage_options, endpoint_url=p.url)


def _write_all(b: Bucket) -> None:
    """Four ways an object comes to be: each record kind, and none."""
    opts = b.storage_options
    with atomic_write(b.path("aw.bin"), storage_options=opts) as f:
        f.write(DATA)  # record in its own metadata
    with fsspec.open(f"durable::{b.path('dw.bin')}", "wb", s3=opts) as f:
        f.write(DATA)  # record in its own metadata
    b.filesystem().pipe_file(f"{b.name}/plain.bin", DATA)  # no record at all
    b.filesystem().pipe_file(f"{b.name}/adopted.bin", DATA)
    Entry(b.path("adopted.bin"), storage_options=opts).mark_complete()  # a marker beside it


Read = Callable[[str, dict[str, Any], Path], bytes]


def _open_read(url: str, opts: dict[str, Any], **kw: Any) -> bytes:
    with open_verified(url, storage_options=opts, **kw) as f:
        return f.read()


def _chained(url: str, opts: dict[str, Any], cache: Path, chain: str) -> bytes:
    more = {"simplecache": {"cache_storage": str(cache)}} if "simplecache" in chain else {}
    with fsspec.open(f"{chain}{url}", "rb", s3=opts, **more) as f:
        return bytes(f.read())


READS: dict[str, Read] = {
    "read_verified": lambda u, o, _: read_verified(u, storage_options=o),
    "read_verified unrecorded ok": lambda u, o, _: read_verified(
        u, storage_options=o, require_record=False),
    "open_verified": lambda u, o, _: _open_read(u, o),
    "open_verified unrecorded ok": lambda u, o, _: _open_read(u, o, require_record=False),
    "durable:: open": lambda u, o, c: _chained(u, o, c, "durable::"),
    "durable:: cat_file": lambda u, o, _: fsspec.filesystem(
        "durable", target_protocol="s3", target_options=o).cat_file(u),
    "simplecache::durable::": lambda u, o, c: _chained(u, o, c, "simplecache::durable::"),
    "durable::simplecache::": lambda u, o, c: _chained(u, o, c, "durable::simplecache::"),
}


def _cached_bytes(cache: Path) -> list[bytes]:
    return [p.read_bytes() for p in cache.rglob("*") if p.is_file()]


@pytest.mark.s3
@pytest.mark.parametrize("read", list(READS))
def test_error_page_is_refused_naming_object_and_code(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]], tmp_path: Path,
        read: str) -> None:
    proxy, via = proxied
    _write_all(s3_bucket)
    for key in ("aw.bin", "dw.bin", "plain.bin"):
        url = s3_bucket.path(key)
        cache = tmp_path / key
        page = faults.error_body_with_200(code="AccessDenied", path=_only(key))
        with proxy.injected(page), pytest.raises(IntegrityError) as info:
            READS[read](url, via, cache)
        err = info.value
        assert err.url == url and err.found == "an error document (AccessDenied)"
        assert url in str(err) and "error document with code AccessDenied" in str(err)
        if read.startswith("simplecache"):
            # The refused body left nothing behind for the cache to serve later.
            assert _cached_bytes(cache) == []
            assert READS[read](url, via, cache) == DATA
            assert DATA in _cached_bytes(cache)


@pytest.mark.s3
@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("methods", [("GET", "HEAD"), ("GET",)])
def test_recorded_object_behind_an_error_page_is_refused_by_its_size(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]], tmp_path: Path,
        read: str, methods: tuple[str, ...]) -> None:
    """Where the record is found (a marker beside the object; or the object's own metadata
    from a HEAD that was not faulted) the error page is caught by the recorded size, with
    no sniff needed."""
    proxy, via = proxied
    _write_all(s3_bucket)
    keys = ["adopted.bin"] if "HEAD" in methods else ["adopted.bin", "aw.bin", "dw.bin"]
    for key in keys:
        url = s3_bucket.path(key)
        if key != "adopted.bin" and read.startswith("read_verified"):
            continue  # one GET, no HEAD: the record is hidden, as in the test above
        page = faults.error_body_with_200(path=_only(key), method=methods)
        with proxy.injected(page), pytest.raises(IntegrityError) as info:
            READS[read](url, via, tmp_path / key)
        assert url in str(info.value.url) and url in str(info.value)  # durable::s3://... too
        assert info.value.expected == len(DATA) or "5000" in str(info.value)


@pytest.mark.s3
def test_small_xml_that_is_no_error_document_still_reads(s3_bucket: Bucket,
                                                        tmp_path: Path) -> None:
    fs = s3_bucket.filesystem()
    opts = s3_bucket.storage_options
    for name, body in NOT_ERRORS.items():
        fs.pipe_file(f"{s3_bucket.name}/{name}", body)
        url = s3_bucket.path(name)
        for read, fn in READS.items():
            if read in ("read_verified", "open_verified"):
                with pytest.raises(IncompleteError):  # unrecorded, and says so
                    fn(url, opts, tmp_path / name / read)
                continue
            assert fn(url, opts, tmp_path / name / read) == body, (name, read)


@pytest.mark.parametrize("doc", [S3_DOC, AZURE_DOC, GCS_XML_DOC, GCS_JSON_DOC],
                         ids=["s3", "azure", "gcs-xml", "gcs-json"])
def test_unrecorded_local_file_holding_an_error_document(tmp_path: Path, doc: bytes) -> None:
    """Every store's shape, from a real file; a random-access reader sees no byte of it."""
    path = tmp_path / "page.bin"
    path.write_bytes(doc)
    assert error_document(b" \r\n\t" + doc.removeprefix(b"\xef\xbb\xbf")) is not None
    found = error_document(path.read_bytes())
    assert found is not None
    code = found[0]
    url = f"file://{path}"
    for fn in (lambda: read_verified(url), lambda: read_verified(url, require_record=False),
               lambda: _open_read(str(path), {}, require_record=False),
               lambda: fsspec.filesystem("durable", target_protocol="file").cat_file(url)):
        with pytest.raises(IntegrityError, match=f"error document with code {code}"):
            fn()
    with open_verified(url, require_record=False) as f, pytest.raises(IntegrityError):
        f.seek(-5, os.SEEK_END)  # a zip reader's first move: the whole object is judged
        f.read()
    with open_verified(url, expected_size=len(doc)) as f, pytest.raises(IntegrityError):
        f.read()  # a size to check, but no CRC32C to catch the page: still sniffed


def test_what_is_not_an_error_document(tmp_path: Path) -> None:
    bomb = (b'<?xml version="1.0"?><!DOCTYPE Error [<!ENTITY a "aaaaaaaaaa">]>'
            b"<Error><Code>&a;</Code><Message>m</Message></Error>")
    big = S3_DOC.replace(b"Access Denied", b"x" * ERROR_DOC_LIMIT)
    for body in [*NOT_ERRORS.values(), bomb, big, b"", b"\x00" * 100, b"{not json",
                 b'{"error": {"code": 200, "message": "ok"}}',
                 b'{"error": {"code": true, "message": "m"}}', b"<Error><Code>X</Code>"]:
        assert error_document(body) is None, body
        path = tmp_path / "ok.bin"
        path.write_bytes(body)
        assert read_verified(str(path), require_record=False) == body


@pytest.mark.s3
def test_missing_object_is_not_found_naming_the_url(s3_bucket: Bucket, tmp_path: Path) -> None:
    for url, opts in ((s3_bucket.path("nope.bin"), s3_bucket.storage_options),
                      (f"file://{tmp_path}/nope.bin", {})):
        for fn in (read_verified, open_verified):
            with pytest.raises(FileNotFoundError) as info:
                fn(url, storage_options=opts)
            assert not isinstance(info.value, IncompleteError)
            assert url in str(info.value)


@pytest.mark.s3
def test_head_error_names_the_status_once(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, via = proxied
    s3_bucket.filesystem().pipe_file(f"{s3_bucket.name}/x.bin", DATA)
    url = s3_bucket.path("x.bin")
    with proxy.injected(faults.error(403, path=_only("x.bin"), method=["GET", "HEAD"])), \
            pytest.raises(PermissionError) as info:
        _chained(url, via, Path(), "durable::")
    assert "HEAD answered HTTP 403: Forbidden" in str(info.value)


@pytest.mark.s3
@pytest.mark.parametrize(("size", "request_name", "method"), [
    (2 * 1024 * 1024, "PutObject", "PUT"),  # over obstore's small PUTs: through s3fs
    (12 * 1024 * 1024, "CompleteMultipartUpload", "POST"),  # (with ?uploadId=)
])
def test_a_write_answered_200_with_an_error_document_says_so(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]], size: int,
        request_name: str, method: str) -> None:
    """S3 answers some failures of CompleteMultipartUpload and CopyObject with a 200 whose
    body is an error document; botocore counts it a 500 (and retries it). The error must
    say what the store did, with its code and message, naming the object: it said "HTTP
    500", which the store never answered."""
    proxy, via = proxied
    url = s3_bucket.path("answered.bin")
    page = faults.error_body_with_200(
        code="InternalError", message="We encountered an internal error. Please try again.",
        method=[method], path=_only("answered.bin"),
        query="uploadId" if method == "POST" else "!uploadId")
    with proxy.injected(page), pytest.raises(OSError) as info, \
            atomic_write(url, storage_options=via) as f:
        f.write(os.urandom(size))
    text = str(info.value)
    assert url in text and request_name in text, text
    assert "answered HTTP 200 with an error document" in text, text
    assert "InternalError: We encountered an internal error." in text, text
    assert "HTTP 500" not in text, text


@pytest.mark.s3
def test_an_error_document_stored_as_a_legacy_object_is_never_adopted(
        s3_bucket: Bucket, tmp_path: Path) -> None:
    """Incident 003: a 403's body saved as the checkpoint (``curl -o`` without ``-f``, a
    client that wrote whatever came back). Unrecorded, every read refuses it; adopted by
    `Entry.mark_complete` (or `durable mark-complete --apply`) it got a record of its own
    bytes, and every read then returned the XML as the checkpoint. Nor does a writer's
    commit adopt one that another tool put in the entry. Refused, naming the object."""
    from click.testing import CliRunner

    from durable.cli import cli

    opts = s3_bucket.storage_options
    fs = s3_bucket.filesystem()  # around durable: straight to moto
    fs.pipe_file(f"{s3_bucket.name}/legacy/run-1/config.json", b'{"lr": 0.1}')
    fs.pipe_file(f"{s3_bucket.name}/legacy/run-1/model.pt", S3_DOC)
    fs.pipe_file(f"{s3_bucket.name}/legacy/model.pt", S3_DOC)
    for url in (s3_bucket.path("legacy", "run-1"), s3_bucket.path("legacy", "model.pt")):
        entry = Entry(url, storage_options=opts)
        with pytest.raises(IntegrityError, match=r"model\.pt: .*error document with code "
                                                 r"AccessDenied.*not adopted") as info:
            entry.mark_complete()
        model = url if url.endswith(".pt") else f"{url}/model.pt"
        assert info.value.url == model
        assert entry.read_marker() is None
        with pytest.raises(IntegrityError, match="error document"):
            read_verified(model, storage_options=opts, require_record=False)
    result = CliRunner().invoke(cli, ["mark-complete", s3_bucket.path("legacy"), "--apply",
                                       "--storage-options", json.dumps(opts)])
    assert "error document" in result.output
    assert Entry(s3_bucket.path("legacy", "run-1"), storage_options=opts).read_marker() is None

    # A local writer whose entry another tool put a saved error page into.
    entry = Entry(str(tmp_path / "ckpt"))
    with pytest.raises(IntegrityError, match=r"ckpt/weights\.bin: .*error document"), \
            entry.writing() as w:
        w.write_bytes("index.json", b'{"shards": ["weights.bin"]}')
        (tmp_path / "ckpt" / "weights.bin").write_bytes(S3_DOC)  # e.g. curl -o
    assert entry.read_marker() is None


@pytest.mark.parametrize("doc", [S3_DOC, AZURE_DOC, GCS_XML_DOC, GCS_JSON_DOC],
                         ids=["s3", "azure", "gcs-xml", "gcs-json"])
def test_an_error_document_written_as_the_data_is_never_recorded(
        s3_bucket: Bucket, tmp_path: Path, doc: bytes) -> None:
    """Incident 003 at the writer: ``requests.get(url).content`` of a 403 handed to
    atomic_write, an entry writer or ``durable::``. Recorded, its CRC32C was the page's,
    and every verified read returned the page as the checkpoint. Refused as it is closed,
    nothing published, naming the object and the code; allowed where it is the data."""
    opts = s3_bucket.storage_options
    local = str(tmp_path / "model.pt")
    remote = s3_bucket.path("ckpt", "model.pt")
    for url, so in ((local, None), (remote, opts)):
        with pytest.raises(IntegrityError, match="error document") as info, \
                atomic_write(url, storage_options=so) as f:
            f.write(doc)
        assert info.value.url.endswith("model.pt")
        assert "allow_error_document=True" in str(info.value)
        with pytest.raises(FileNotFoundError):
            read_verified(url, storage_options=so)  # nothing was published
        with atomic_write(url, storage_options=so, allow_error_document=True) as f:
            f.write(doc)
        assert read_verified(url, storage_options=so) == doc
    assert not os.path.exists(local + ".tmp")

    # An entry writer: the object refused at its close; the entry never COMPLETE.
    entry = Entry(str(tmp_path / "shards"))
    with pytest.raises(IntegrityError, match=r"shards/model\.pt: not written: .*error "
                                             r"document") as info2, entry.writing() as w:
        w.fs.pipe_file(f"{w.path}/config.json", b'{"lr": 0.1}')
        w.fs.pipe_file(f"{w.path}/model.pt", doc)
    assert "allow_error_documents = True" in str(info2.value)
    assert entry.state() is not State.COMPLETE
    with entry.writing(overwrite=True) as w:
        w.allow_error_documents = True
        w.fs.pipe_file(f"{w.path}/model.pt", doc)
    assert entry.state() is State.COMPLETE

    # durable:: (fsspec): the same refusal.
    with pytest.raises(IntegrityError, match="error document"):
        fsspec.filesystem("durable", target_protocol="s3", target_options=opts).pipe_file(
            f"{s3_bucket.name}/fs/model.pt", doc)
    assert not s3_bucket.filesystem().exists(f"{s3_bucket.name}/fs/model.pt")


def test_small_data_that_is_no_error_document_is_written(tmp_path: Path) -> None:
    for name, data in NOT_ERRORS.items():
        with atomic_write(str(tmp_path / name)) as f:
            f.write(data)
        assert read_verified(str(tmp_path / name)) == data
