"""A commit on an object store does not wait for the removal of its attempt record.

The marker makes the entry COMPLETE; the attempt record only said a writer was at work.
Its removal is a round trip the caller no longer pays (`durable._background`): these tests
hold that request in the fault proxy and look at the store around durable.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from typing import Any

import fsspec
import pytest

from durable import Entry, State
from durable import _background as background
from durable.testing import faults
from durable.testing.faults import FaultProxy
from durable.testing.pytest_plugin import Bucket

HELD = 5.0  # how long the proxy holds the DeleteObjects before passing it on


def _records(bucket: Bucket, name: str) -> set[str]:
    """The records of entry ``name``, listed by a client that shares nothing with durable."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **bucket.storage_options)
    root = f"{bucket.name}/.durable/{name}"
    return {p[len(root) + 1:] for p in fs.find(root)}



@pytest.mark.s3
def test_the_commit_returns_before_its_attempt_record_is_removed(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]]) -> None:
    proxy, options = proxied
    proxy.add(faults.delay(HELD, method="POST", query="delete", times=1))
    entry = Entry(s3_bucket.path("e"), storage_options=options)
    started = time.monotonic()
    with entry.writing() as w:
        w.write_bytes("a", b"1" * 100)
    # Returned while the proxy holds the removal: the record is still there, and the entry
    # is COMPLETE all the same (seen without the proxy).
    assert time.monotonic() - started < HELD
    assert {k.partition("/")[0] for k in _records(s3_bucket, "e")} == {"commit.json",
                                                                        "attempts"}
    assert Entry(s3_bucket.path("e"), storage_options=s3_bucket.storage_options
                 ).state() is State.COMPLETE
    background.wait(60)  # the held request goes through: the record is gone
    assert _records(s3_bucket, "e") == {"commit.json"}


def test_pending_work_is_done_before_the_process_exits(tmp_path: Any) -> None:
    done = tmp_path / "done"
    script = textwrap.dedent(f"""
        import pathlib, time
        from durable import _background as background
        def slow():
            time.sleep(1.0)  # still running when the main thread reaches the end
            pathlib.Path({str(done)!r}).write_text("removed")
        background.later(slow, "a slow removal")
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert done.read_text() == "removed"


@pytest.mark.s3
def test_a_failed_removal_is_logged_and_the_entry_stays_complete(
        s3_bucket: Bucket, proxied: tuple[FaultProxy, dict[str, Any]],
        caplog: pytest.LogCaptureFixture) -> None:
    proxy, options = proxied
    proxy.add(faults.error(403, "AccessDenied", method="POST", query="delete"))
    entry = Entry(s3_bucket.path("kept"), storage_options=options)
    with caplog.at_level(logging.WARNING, logger="durable"), entry.writing() as w:
        w.write_bytes("a", b"1")
    with caplog.at_level(logging.WARNING, logger="durable"):
        background.wait(60)
    assert entry.state() is State.COMPLETE
    assert {k.partition("/")[0] for k in _records(s3_bucket, "kept")} == {"commit.json",
                                                                           "attempts"}
    assert any(entry.url in r.getMessage() and "attempt's records" in r.getMessage()
               and "403" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.s3
def test_a_process_exiting_right_after_a_commit_still_removes_its_attempt_record(
        s3_bucket: Bucket) -> None:
    """Through s3fs's event loop at interpreter exit: the removal, slowed by a second,
    still reaches the store before the process ends."""
    script = textwrap.dedent(f"""
        import time
        from durable import Entry
        from durable.adapters.s3 import S3Adapter
        real = S3Adapter.delete
        def slow(self, paths):
            time.sleep(1.0)
            real(self, paths)
        S3Adapter.delete = slow
        with Entry({s3_bucket.path('quits')!r},
                   storage_options={dict(s3_bucket.storage_options)!r}).writing() as w:
            w.write_bytes("a", b"1")
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert _records(s3_bucket, "quits") == {"commit.json"}


@pytest.mark.parametrize("store", ["s3_bucket", "gcs_bucket", "azure_container"])
def test_a_script_ending_in_a_commit_removes_its_attempt_record_cleanly(
        store: str, request: pytest.FixtureRequest) -> None:
    """A script whose last step is a commit: the removal runs at interpreter exit, while
    the clients can still connect. On Azure it failed there ("cannot schedule new futures
    after interpreter shutdown": a new connection's DNS lookup goes to the default
    executor, closed by then), logged a warning, and left the record for `durable clean`."""
    bucket: Bucket = request.getfixturevalue(store)
    script = textwrap.dedent(f"""
        from durable import Entry
        with Entry({bucket.path('quits')!r},
                   storage_options={dict(bucket.storage_options)!r}).writing() as w:
            w.write_bytes("a", b"1")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    assert "failed" not in done.stderr, done.stderr
    fs = fsspec.filesystem(bucket.protocol, skip_instance_cache=True,
                           **bucket.storage_options)
    root = f"{bucket.name}/.durable/quits"
    assert {p[len(root) + 1:] for p in fs.find(root)} == {"commit.json"}


@pytest.mark.s3
def test_a_store_that_stalls_the_removal_does_not_keep_the_process_from_ending(
        s3_bucket: Bucket) -> None:
    """The DeleteObjects never answered: the commit had returned, but the process could not
    end for as long as the client retried it (over 6 minutes on S3). Past EXIT_PATIENCE
    without progress the removal is left, said so, and the entry is COMPLETE."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        proxy.add(faults.delay(3600, method="POST", query="delete"))
        options = {**s3_bucket.storage_options, "endpoint_url": proxy.url}
        script = textwrap.dedent(f"""
            from durable import Entry
            from durable import _background as background
            background.EXIT_PATIENCE = 1.0
            with Entry({s3_bucket.path('stalls')!r}, storage_options={options!r}).writing() as w:
                w.write_bytes("a", b"1")
        """)
        try:
            done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                  text=True, timeout=100, check=True)
        except subprocess.TimeoutExpired:
            pytest.fail("the process did not end: it waited for the stalled removal")
        assert proxy.count(method="POST") >= 1  # the removal was sent, and held
        # (seen while the proxy holds it: a proxy that stops passes held requests on)
        assert {k.partition("/")[0] for k in _records(s3_bucket, "stalls")} == {
            "commit.json", "attempts"}
        assert Entry(s3_bucket.path("stalls"), storage_options=s3_bucket.storage_options
                     ).state() is State.COMPLETE
    assert "leaving 1 pieces of housekeeping" in done.stderr, done.stderr
    assert "stalls: removing the committed attempt's records" in done.stderr
