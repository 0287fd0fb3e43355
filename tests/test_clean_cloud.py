"""`durable clean` on the cloud stores: ages by the store's own clock, uploads left open.

Each store is a real server on 127.0.0.1 (moto, gcp-storage-emulator, fake-gcs-server,
azurite); each leftover is made the way it happens: a child process inside
`Entry.writing()`, or inside an `atomic_write` past its first staged block, SIGKILLed.

Ages are never made by setting clocks or sleeping a fixed time: an entry is fresh right
after its writer died, and old once the store's clock (the Date it answers with, read
around durable) has passed its attempt record's modification time by more than
``--older-than``. Clock skew is made where it lives: a writer whose clock ran days behind
(its attempt record says it started three days ago) and a cleaning machine whose clock runs
days ahead (`plan_clean`'s ``now``). The store is read and written *around* durable (boto3,
plain JSON API requests, the synchronous Azure SDK). The killed writers are test_ops.py's.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import urllib.request
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import quote

import pytest

from test_ops import (
    apply_as_another_cleans,
    check_attempt_record_made_a_directory,
    kill_writers,
)

DAYS = 3 * 86400


def kill_entry_writer(store: Store, name: str) -> None:
    """A child inside `Entry.writing()` (zarr.json and c/0 written), SIGKILLed."""
    kill_writers(store.url(), store.options, [name], strays=False)


def kill_uploader(store: Store, name: str) -> None:
    """A child inside `atomic_write` past 9 MiB (a block staged, a piece sent), SIGKILLed."""
    kill_writers(store.url(name), store.options, [], strays=False, mode="upload")


# the stores, seen from outside durable -----------------------------------------------------
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Store:
    """A root in a fresh bucket, read and written without durable."""

    root = "root"

    def __init__(self, bucket: Any) -> None:
        self.bucket = bucket
        self.options: dict[str, Any] = dict(bucket.storage_options)

    def url(self, *parts: str) -> str:
        return "/".join([self.bucket.url, self.root, *parts])

    def canonical(self, *parts: str) -> str:
        """How durable names the place: as the URL given (az://, not adlfs's abfs://)."""
        return self.url(*parts)

    def key(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def snapshot(self) -> dict[str, bytes]:
        return {k: self.read(k) for k in self.names()}

    def names(self) -> list[str]:
        raise NotImplementedError

    def read(self, rel: str) -> bytes:
        raise NotImplementedError

    def write(self, rel: str, data: bytes) -> None:
        raise NotImplementedError

    def modified(self, rel: str) -> float:
        """The object's modification time as the store records it."""
        raise NotImplementedError

    def clock(self) -> float:
        """The store's time now: the Date of its answer to a request."""
        raise NotImplementedError


class S3Store(Store):
    def __init__(self, bucket: Any) -> None:
        super().__init__(bucket)
        import boto3

        self.client = boto3.client("s3", endpoint_url=bucket.server.url, region_name="us-east-1",
                                   aws_access_key_id="testing", aws_secret_access_key="testing")

    def names(self) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.bucket.name, Prefix=f"{self.root}/")
        return sorted(o["Key"][len(self.root) + 1:] for o in listed.get("Contents", []))

    def read(self, rel: str) -> bytes:
        body: bytes = self.client.get_object(Bucket=self.bucket.name,
                                             Key=self.key(rel))["Body"].read()
        return body

    def write(self, rel: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket.name, Key=self.key(rel), Body=data)

    def modified(self, rel: str) -> float:
        head = self.client.head_object(Bucket=self.bucket.name, Key=self.key(rel))
        return float(head["LastModified"].timestamp())

    def clock(self) -> float:
        reply = self.client.list_objects_v2(Bucket=self.bucket.name, MaxKeys=1)
        return parsedate_to_datetime(reply["ResponseMetadata"]["HTTPHeaders"]["date"]).timestamp()


class GCSStore(Store):
    def _get(self, path: str, query: str = "") -> tuple[dict[str, str], bytes]:
        url = f"{self.bucket.server.url}{path}?{query}"
        with _opener.open(urllib.request.Request(url), timeout=30) as r:
            return dict(r.headers), r.read()

    def _object(self, rel: str) -> str:
        return f"/storage/v1/b/{self.bucket.name}/o/{quote(self.key(rel), safe='')}"

    def names(self) -> list[str]:
        _, body = self._get(f"/storage/v1/b/{self.bucket.name}/o", f"prefix={self.root}/")
        return sorted(i["name"][len(self.root) + 1:] for i in json.loads(body).get("items", []))

    def read(self, rel: str) -> bytes:
        return self._get(f"/download{self._object(rel)}", "alt=media")[1]

    def write(self, rel: str, data: bytes) -> None:
        url = (f"{self.bucket.server.url}/upload/storage/v1/b/{self.bucket.name}/o"
               f"?uploadType=media&name={quote(self.key(rel), safe='')}")
        request = urllib.request.Request(url, data=data, method="POST",
                                         headers={"Content-Type": "application/octet-stream"})
        with _opener.open(request, timeout=30) as r:
            r.read()

    def modified(self, rel: str) -> float:
        resource = json.loads(self._get(self._object(rel))[1])
        return dt.datetime.fromisoformat(resource["updated"]).timestamp()

    def clock(self) -> float:
        headers, _ = self._get(f"/storage/v1/b/{self.bucket.name}/o", "maxResults=1")
        return parsedate_to_datetime(headers["Date"]).timestamp()


class AzureStore(Store):
    def __init__(self, bucket: Any) -> None:
        super().__init__(bucket)
        from azure.storage.blob import ContainerClient

        self.client = ContainerClient.from_connection_string(bucket.server.connection_string,
                                                             bucket.name)

    def names(self, uncommitted: bool = False) -> list[str]:
        include = ["uncommittedblobs"] if uncommitted else None
        return sorted(b.name[len(self.root) + 1:] for b in self.client.list_blobs(
            name_starts_with=f"{self.root}/", include=include))

    def uncommitted(self) -> list[str]:
        """Blobs of staged blocks only: listed with uncommitted blobs, and only then."""
        return sorted(set(self.names(uncommitted=True)) - set(self.names()))

    def read(self, rel: str) -> bytes:
        data: bytes = self.client.download_blob(self.key(rel)).readall()
        return data

    def write(self, rel: str, data: bytes) -> None:
        self.client.upload_blob(self.key(rel), data, overwrite=True)

    def modified(self, rel: str) -> float:
        props = self.client.get_blob_client(self.key(rel)).get_blob_properties()
        return float(props.last_modified.timestamp())

    def clock(self) -> float:
        seen: list[str] = []
        self.client.get_container_properties(
            raw_response_hook=lambda r: seen.append(r.http_response.headers["Date"]))
        return parsedate_to_datetime(seen[0]).timestamp()


_KINDS = {"s3_bucket": S3Store, "gcs_bucket": GCSStore, "fake_gcs_bucket": GCSStore,
          "azure_container": AzureStore}


@pytest.fixture(params=list(_KINDS))
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    from durable.cli import ENV_OPTIONS

    monkeypatch.delenv(ENV_OPTIONS, raising=False)
    bucket = request.getfixturevalue(request.param)
    yield _KINDS[request.param](bucket)


@pytest.fixture
def azure(azure_container: Any, monkeypatch: pytest.MonkeyPatch) -> AzureStore:
    from durable.cli import ENV_OPTIONS

    monkeypatch.delenv(ENV_OPTIONS, raising=False)
    return AzureStore(azure_container)


def run(store: Store, *args: str) -> tuple[int, Any]:
    """The CLI, in-process, on ``store``; (exit code, JSON document)."""
    from click.testing import CliRunner

    from durable.cli import cli

    result = CliRunner().invoke(cli, [*args, "--json", "--storage-options",
                                      json.dumps(store.options)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, json.loads(result.stdout)


def wait_for_store_clock(store: Store, when: float, timeout: float = 30.0) -> None:
    """Poll the store until its clock reads ``when`` or later."""
    deadline = time.monotonic() + timeout
    while store.clock() < when:
        assert time.monotonic() < deadline, f"the store's clock never reached {when}"
        time.sleep(0.1)


def attempt_record(store: Store, name: str) -> str:
    (rel,) = [k for k in store.names() if k.startswith(f".durable/{name}/attempts/")]
    return rel


def complete_entry(store: Store, name: str) -> None:
    from durable import Entry

    with Entry(store.url(name), storage_options=store.options).writing() as w:
        w.write_bytes("c/0", b"committed data")


def mark(items: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(kind, name, status) of clean's items; an upload's URL ends " (upload ID)"."""
    return [(i["kind"], i["url"].partition(" ")[0].rpartition("/")[2], i["status"])
            for i in items]


# entries of killed writers ---------------------------------------------------------------
def test_clean_removes_a_killed_writers_entry_once_old_by_the_stores_clock(
        store: Store) -> None:
    """Fresh: kept, with its age. Old by the store's clock: removed, data and records; the
    COMPLETE entry beside it is untouched byte for byte."""
    complete_entry(store, "done.zarr")
    kill_entry_writer(store, "dead.zarr")
    record = attempt_record(store, "dead.zarr")
    before = store.snapshot()
    assert {k.partition("/")[0] for k in before} == {"done.zarr", "dead.zarr", ".durable"}

    code, doc = run(store, "clean", store.url(), "--older-than", "1h", "--apply")
    assert (code, doc["items"]) == (0, [])
    (kept,) = doc["kept"]
    assert kept["url"] == store.canonical("dead.zarr")
    assert "younger than --older-than" in kept["reason"]
    assert store.snapshot() == before

    # Two seconds on: a store's times are whole seconds, so one could be nearly one short.
    wait_for_store_clock(store, store.modified(record) + 2)
    code, doc = run(store, "clean", store.url(), "--older-than", "1s", "--apply")
    assert code == 0, doc
    assert mark(doc["items"]) == [("entry", "dead.zarr", "removed")]
    assert doc["kept"] == []
    dead = {"dead.zarr/zarr.json", "dead.zarr/c/0", record}
    assert store.snapshot() == {k: v for k, v in before.items() if k not in dead}


def test_two_cleans_at_once_report_a_removal_once(store: Store,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cleans of one root, the second removing the entry while the first is between
    its checks and the removal of the records (no lock on these stores): both said
    "removed". A clean now holds the entry's lease (create-only) while it removes it, and
    the other leaves it to that one; gcp-storage-emulator enforces no conditional
    delete (nor a lease's conditional renewal), so it can still tell no one from the
    other."""
    from durable._ops import plan_clean
    from durable._scan import survey
    from durable.adapters import resolve

    kill_entry_writer(store, "dead.zarr")
    wait_for_store_clock(store, store.modified(attempt_record(store, "dead.zarr")) + 2)
    first, second = (survey(*resolve(store.url(), store.options)) for _ in range(2))
    if not first.adapter.supports_conditional(first.path + "/.durable/dead.zarr"):
        assert store.bucket.server.name == "gcp-storage-emulator"
        pytest.skip("this emulator enforces no conditional delete")
    plans = [plan_clean(sv, older_than=1, lease_wait=1) for sv in (first, second)]
    assert [mark([vars(i)]) for i in plans[0].items] == [[("entry", "dead.zarr", "planned")]]
    apply_as_another_cleans(first, second, plans, monkeypatch)
    (a,), (b,) = plans[0].items, plans[1].items
    # The first, interrupted as it removes the records, holds the entry's lease: the
    # second leaves the entry to it.
    assert (a.status, a.detail) == ("removed", "")
    assert b.status == "skipped"
    assert b.detail.startswith("another clean is removing it (held by "), b.detail
    assert not [k for k in store.names() if "dead.zarr" in k]


def test_neither_this_machines_clock_nor_the_writers_ages_an_entry(store: Store) -> None:
    """A writer whose clock ran three days behind, cleaned from a machine whose clock runs
    three days ahead: by the store's clock the entry is seconds old, and it is kept."""
    from durable._ops import plan_clean
    from durable._scan import survey
    from durable.adapters import resolve

    kill_entry_writer(store, "dead.zarr")
    record = attempt_record(store, "dead.zarr")
    doc = json.loads(store.read(record))
    behind = dt.datetime.fromtimestamp(time.time() - DAYS, dt.UTC)
    doc["started_at"] = behind.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    store.write(record, json.dumps(doc).encode())

    adapter, path = resolve(store.url(), store.options)
    report = plan_clean(survey(adapter, path), older_than=3600, lease_wait=0,
                        now=lambda: time.time() + DAYS)
    assert report.items == []
    (kept,) = report.kept
    assert kept.url == store.canonical("dead.zarr")
    assert kept.reason.startswith("last attempt record mtime (store's clock) ")
    assert kept.reason.endswith(" ago: younger than --older-than")


@pytest.mark.s3
def test_a_store_without_a_date_is_said_to_be_aged_by_this_machines_clock(
        s3_bucket: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An S3-compatible endpoint whose answers carry no Date: clean fell back to this
    machine's clock without a word, and a clock three days ahead planned a writer's
    seconds-old entry for removal as if by the store's clock. Now it says so."""
    from durable import Entry
    from durable._ops import plan_clean
    from durable._scan import survey
    from durable.adapters import resolve
    from durable.testing.faults import FaultProxy, strip_headers

    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        proxy.add(strip_headers("^date$"))
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        writing = Entry(s3_bucket.path("r", "young"), storage_options=options).writing()
        writing.__enter__().write_bytes("a", b"a writer at work")
        adapter, path = resolve(s3_bucket.path("r"), options)
        with caplog.at_level("WARNING", logger="durable"):
            report = plan_clean(survey(adapter, path), older_than=3600, lease_wait=0,
                                now=lambda: time.time() + DAYS)
        writing.__exit__(None, None, None)
    assert [i.url for i in report.items] == [s3_bucket.path("r", "young")]  # as documented
    assert any("sends no Date" in r.getMessage() and "this machine's clock" in r.getMessage()
               and s3_bucket.path("r") in r.getMessage() for r in caplog.records), caplog.text


# uploads left open -----------------------------------------------------------------------
def test_clean_aborts_the_staged_blocks_of_a_killed_azure_writer(azure: AzureStore) -> None:
    """A writer killed after staging a block leaves a blob of uncommitted blocks: invisible
    to reads and listings, holding storage for a week. clean finds it (a listing with
    uncommitted blobs), keeps it while young and aborts it once old; blocks staged by
    another tool are kept unless --all-uploads."""
    azure.write("done.bin", b"committed")
    kill_uploader(azure, "big.bin")
    azure.client.get_blob_client(azure.key("other.bin")).stage_block("foreign-block-0001",
                                                                     b"not durable's")
    committed = azure.snapshot()
    assert list(committed) == ["done.bin"]
    assert azure.uncommitted() == ["big.bin", "other.bin"]

    code, doc = run(azure, "clean", azure.url(), "--older-than", "1h")
    assert (code, doc["items"]) == (0, [])
    kept = {k["url"].partition(" ")[0]: k["reason"] for k in doc["kept"]}
    assert "younger than --older-than" in kept[azure.canonical("big.bin")]

    # --older-than 0s: whatever its age by the store's clock, it is old enough.
    code, doc = run(azure, "clean", azure.url(), "--older-than", "0s")
    assert mark(doc["items"]) == [("upload", "big.bin", "planned")]
    (foreign,) = doc["kept"]
    assert foreign["url"].startswith(azure.canonical("other.bin"))
    assert "not named the way durable names them" in foreign["reason"]
    assert "--all-uploads" in foreign["reason"]
    assert azure.uncommitted() == ["big.bin", "other.bin"]  # a dry run

    code, doc = run(azure, "clean", azure.url(), "--older-than", "0s", "--apply")
    assert (code, [i["status"] for i in doc["items"]]) == (0, ["removed"])
    assert azure.uncommitted() == ["other.bin"]
    code, doc = run(azure, "clean", azure.url(), "--older-than", "0s", "--apply",
                    "--all-uploads")
    assert [i["status"] for i in doc["items"]] == ["removed"]
    assert azure.uncommitted() == []
    assert azure.snapshot() == committed


def test_an_azure_upload_committed_after_the_plan_is_not_removed(azure: AzureStore) -> None:
    """Between plan and apply the writer turns out alive and commits its blocks: the abort
    (If-Unmodified-Since the listed time) leaves the committed blob as it is."""
    from azure.storage.blob import BlobBlock

    from durable._ops import apply_clean, plan_clean
    from durable._scan import survey
    from durable.adapters import resolve

    azure.write("done.bin", b"a root needs an object")
    blob = azure.client.get_blob_client(azure.key("late.bin"))
    block = "0123456789abcdef-000000"  # as durable names its blocks
    blob.stage_block(block, b"a writer slower than --older-than")
    adapter, path = resolve(azure.url(), azure.options)
    sv = survey(adapter, path)
    report = plan_clean(sv, older_than=0, lease_wait=0)
    (item,) = report.items
    assert (item.kind, item.url.partition(" ")[0]) == ("upload", azure.canonical("late.bin"))
    assert item.upload is not None and item.upload.initiated is not None

    # A commit in a later second than the listing showed: its Last-Modified moves on.
    wait_for_store_clock(azure, item.upload.initiated + 1)
    blob.commit_block_list([BlobBlock(block_id=block)])
    apply_clean(sv, report)
    assert azure.read("late.bin") == b"a writer slower than --older-than"
    assert azure.uncommitted() == []


def test_a_gcs_writer_killed_mid_upload_leaves_nothing_clean_could_see(
        gcs_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its resumable session holds a piece, never finalized: no object appears, and the
    session cannot be listed (GCS drops it after a week), so clean has nothing to do."""
    from durable.cli import ENV_OPTIONS

    monkeypatch.delenv(ENV_OPTIONS, raising=False)
    gcs = GCSStore(gcs_bucket)
    gcs.write("done.bin", b"committed")
    kill_uploader(gcs, "big.bin")
    assert gcs.names() == ["done.bin"]
    code, doc = run(gcs, "clean", gcs.url(), "--older-than", "0s", "--apply")
    assert (code, doc["items"], doc["kept"]) == (0, [], [])
    assert gcs.snapshot() == {"done.bin": b"committed"}



@pytest.mark.parametrize("with_data", [True, False], ids=["data", "no-data"])
def test_objects_below_the_markers_name_are_an_error_never_unfinished(
        store: Store, with_data: bool) -> None:
    """Objects stored below ``commit.json/`` (the marker made a "directory"), where no
    marker is: a MarkerError naming the marker, as a directory there is on a local disk.
    Read as "no marker", the entry was INCOMPLETE (in `durable scan` too), a leftover for
    `durable clean`."""
    import durable

    if with_data:
        store.write("e/c/0", b"data")
    store.write(".durable/e/commit.json/x", b"{}")
    before = store.snapshot()
    where = store.canonical(".durable", "e", "commit.json")
    entry = durable.Entry(store.url("e"), storage_options=store.options)
    with pytest.raises(durable.MarkerError, match=f"{where}: no commit marker, but objects "
                                                  f"stored below its name"):
        entry.status()
    with pytest.raises(durable.MarkerError, match=where), entry.writing():
        pass
    _, doc = run(store, "scan", store.url())
    (row,) = [r for r in doc["entries"] if r["url"] == store.canonical("e")]
    assert row["state"] == "ERROR" and f"{where}: no commit marker" in row["reason"], row
    run(store, "clean", store.url(), "--older-than", "0", "--apply")
    assert store.snapshot() == before


@pytest.mark.parametrize("with_data", [True, False], ids=["data", "no-data"])
def test_an_attempt_record_made_a_directory_is_named_alike_everywhere(
        store: Store, with_data: bool) -> None:
    check_attempt_record_made_a_directory(store, with_data)


@pytest.mark.parametrize("bucket", ["s3_bucket", "azure_container"])
def test_an_upload_alone_under_the_root_is_found_and_aborted(
        bucket: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first checkpoint of a run, its writer killed mid-upload: nothing under the root
    but the upload's parts (invisible to listings, billed until aborted). scan and clean
    answered "no such directory or prefix" (exit 1) before they looked for uploads, so
    the parts stayed for good."""
    from durable.cli import ENV_OPTIONS

    monkeypatch.delenv(ENV_OPTIONS, raising=False)
    store = _KINDS[bucket](request.getfixturevalue(bucket))
    kill_uploader(store, "model.bin")
    assert store.names() == []

    def uploads() -> list[str]:
        if isinstance(store, AzureStore):
            return store.uncommitted()
        listed = store.client.list_multipart_uploads(Bucket=store.bucket.name, Prefix="root/")
        return [u["Key"] for u in listed.get("Uploads", [])]

    assert uploads() in (["root/model.bin"], ["model.bin"])
    code, doc = run(store, "scan", store.url())
    assert code == 0 and doc["entries"] == []
    code, doc = run(store, "clean", store.url(), "--older-than", "0s", "--apply")
    assert (code, mark(doc["items"])) == (0, [("upload", "model.bin", "removed")])
    assert uploads() == []


# a clean racing a writer that starts over the entry it removes -----------------------------
@pytest.mark.s3
@pytest.mark.parametrize("how", ["overwrite", "resume", "zarr.write"])
def test_a_writer_starting_over_an_entry_a_clean_is_removing_is_refused(
        s3_bucket: Any, how: str) -> None:
    """A killed writer's entry; `durable clean` past its checks, about to list and delete
    the data; a rerun starts over it (``overwrite=True``) or resumes it right then. The
    clean removed the rerun's objects under it, and `durable.zarr.write`, whose commit
    trusts its own records when they show it alone, published a marker over chunks that
    were gone. The clean now holds the entry's lease while it removes the data: the rerun
    is refused (IncompleteExistsError, a writer's lease), its retry once the clean is done
    commits whole data."""
    import threading

    import numpy as np

    import durable.zarr as dz
    from durable import Entry, IncompleteExistsError, State
    from durable._ops import apply_clean, plan_clean
    from durable._scan import survey
    from durable.adapters import resolve
    from durable.testing.faults import FaultProxy, Match

    direct = dict(s3_bucket.storage_options)
    url = s3_bucket.path("root", "dead.zarr")
    kill_writers(s3_bucket.path("root"), direct, ["dead.zarr"], strays=False)
    data = np.arange(16 * 16, dtype="f4").reshape(16, 16) + 1

    def rerun() -> None:
        if how == "zarr.write":
            dz.write(url, data, chunks=(4, 4), overwrite=True, storage_options=direct)
            return
        with Entry(url, storage_options=direct).writing(
                overwrite=how == "overwrite", resume=how == "resume") as w:
            for i in range(4):
                w.write_bytes(f"o/{i}", bytes([i]) * 100)

    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        sv = survey(*resolve(s3_bucket.path("root"), {**direct, "endpoint_url": proxy.url}))
        report = plan_clean(sv, older_than=0, lease_wait=0)
        assert [(i.kind, i.url) for i in report.items] == [("entry", url)]
        at_data, go_on = threading.Event(), threading.Event()

        def clean_lists_the_data(info: Any) -> bool:
            # Held here (the proxy's thread), past every check of the records.
            if (not at_data.is_set() and "list-type" in info.query
                    and info.query.get("prefix") == ["root/dead.zarr/"]):
                at_data.set()
                assert go_on.wait(30)
            return False

        proxy.inject("delay", seconds=0, match=Match(where=clean_lists_the_data))
        cleaning = threading.Thread(target=apply_clean, args=(sv, report))
        cleaning.start()
        try:
            assert at_data.wait(30)
            with pytest.raises(IncompleteExistsError, match="lease"):
                rerun()
        finally:
            go_on.set()
            cleaning.join()
    (item,) = report.items
    assert (item.status, item.detail) == ("removed", "")
    entry = Entry(url, storage_options=direct)
    assert entry.state() is State.ABSENT
    rerun()
    assert entry.state() is State.COMPLETE
    assert entry.verify(deep=True).ok
    if how == "zarr.write":
        np.testing.assert_array_equal(dz.open(url, storage_options=direct)[...], data)
