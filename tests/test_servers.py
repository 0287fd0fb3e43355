"""The testing kit's servers and fixtures: each store takes a write and a read, buckets are
fresh per test, and create-only writes are refused where the server is known to enforce them."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from durable.testing import servers
from durable.testing.pytest_plugin import Bucket, _serve

BUCKET_FIXTURES = ["s3_bucket", "gcs_bucket", "fake_gcs_bucket", "azure_container"]


@pytest.fixture(params=BUCKET_FIXTURES)
def bucket(request: pytest.FixtureRequest) -> Bucket:
    """Each store's fresh bucket, so one test body covers all of them."""
    result: Bucket = request.getfixturevalue(request.param)
    return result


def test_round_trip_and_list(bucket: Bucket) -> None:
    fs = bucket.filesystem()
    data = os.urandom(300_000)
    fs.pipe_file(bucket.path("dir", "a.bin"), data)
    fs.pipe_file(bucket.path("dir", "b.txt"), b"b")

    assert fs.cat_file(bucket.path("dir", "a.bin")) == data
    listed = sorted(fs.ls(bucket.path("dir"), detail=False))
    assert listed == [f"{bucket.name}/dir/a.bin", f"{bucket.name}/dir/b.txt"]


_seen: dict[str, set[str]] = {}


@pytest.mark.parametrize("round_", [1, 2])
def test_buckets_are_fresh_per_test(bucket: Bucket, round_: int) -> None:
    """Two tests in a row on one server get different, empty buckets."""
    seen = _seen.setdefault(bucket.protocol + bucket.server.name, set())
    assert bucket.name not in seen
    seen.add(bucket.name)

    fs = bucket.filesystem()
    fs.invalidate_cache()
    assert fs.ls(bucket.url, detail=False) == []
    fs.pipe_file(bucket.path("left-behind"), b"x")


def _create_only(bucket: Bucket) -> None:
    fs = bucket.filesystem()
    fs.pipe_file(bucket.path("k"), b"first")
    with pytest.raises(FileExistsError):
        fs.pipe_file(bucket.path("k"), b"second", mode="create")
    assert fs.cat_file(bucket.path("k")) == b"first"


def test_moto_refuses_create_only_put_on_existing_object(s3_bucket: Bucket) -> None:
    _create_only(s3_bucket)  # s3fs: IfNoneMatch="*"

    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client("s3", endpoint_url=s3_bucket.server.url)
    try:
        with pytest.raises(ClientError) as err:
            client.put_object(Bucket=s3_bucket.name, Key="k", Body=b"third", IfNoneMatch="*")
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    finally:
        client.close()


def test_fake_gcs_refuses_create_only_multipart_upload(fake_gcs_bucket: Bucket) -> None:
    _create_only(fake_gcs_bucket)  # gcsfs: multipart upload with ifGenerationMatch=0


def test_azurite_refuses_create_only_upload(azure_container: Bucket) -> None:
    _create_only(azure_container)  # adlfs: overwrite=False, 409


def test_gcp_storage_emulator_ignores_if_generation_match(gcs_bucket: Bucket) -> None:
    """Pins a known weakness: if this starts failing, the emulator learned preconditions."""
    fs = gcs_bucket.filesystem()
    fs.pipe_file(gcs_bucket.path("k"), b"first")
    fs.pipe_file(gcs_bucket.path("k"), b"second", mode="create")
    assert fs.cat_file(gcs_bucket.path("k")) == b"second"


def test_moto_reset_drops_buckets(moto_server: servers.MotoServer, s3_bucket: Bucket) -> None:
    fs = s3_bucket.filesystem()
    fs.pipe_file(s3_bucket.path("k"), b"x")
    moto_server.reset()
    fs.invalidate_cache()
    assert not fs.exists(s3_bucket.url)


def test_server_stops_by_pid_and_cleans_up() -> None:
    with servers.start_gcs() as server:
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server.process.poll() is None
        assert server.log_path.exists()
    assert server.process.returncode is not None
    assert not server.workdir.exists()
    server.stop()  # idempotent


def test_stop_ends_a_server_behind_a_wrapper_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper that does not `exec` (npx, a shell shim) must not leave azurite running."""
    real = servers._azurite_binary()
    wrapper = tmp_path / "azurite-wrapper"
    wrapper.write_text(f'#!/bin/sh\n"{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("DURABLE_AZURITE", str(wrapper))

    server = servers.start_azurite()
    group = os.getpgid(server.process.pid)
    server.stop()
    # The whole process group is gone, the real server behind the shim included. (Probing
    # the port instead would be fooled by any other server that reuses it.)
    deadline = time.monotonic() + 10
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"process group {group} still alive after stop()"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    """Dead or a zombie nobody has reaped yet (a container's PID 1 may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_session_takes_its_server_with_it() -> None:
    """SIGKILL runs no atexit handler: the server must still not outlive the process that
    started it (it holds a port and a temp dir)."""
    script = ("import os, signal\n"
              "from durable.testing.servers import start_moto\n"
              "s = start_moto()\n"
              "print(s.process.pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == -signal.SIGKILL, run.stderr
    pid = int(run.stdout.split()[0])
    deadline = time.monotonic() + 30
    while not _gone(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the moto server (pid {pid}) outlived the killed process that "
                        "started it")
        time.sleep(0.05)


_OTHER_PROJECT = """
import os

def test_env_is_the_users(pytestconfig):
    assert pytestconfig.pluginmanager.has_plugin("durable")  # loaded, by its entry point
    assert os.environ["AWS_DEFAULT_REGION"] == "eu-west-1"
    assert "AWS_ACCESS_KEY_ID" not in os.environ
    assert "GCE_METADATA_HOST" not in os.environ

def test_a_server_fixture_sets_the_guards(moto_server):
    assert os.environ["AWS_DEFAULT_REGION"] == "us-east-1"
    assert os.environ["AWS_EC2_METADATA_DISABLED"] == "true"
"""


def test_the_plugin_leaves_another_projects_environment_alone(tmp_path: Path) -> None:
    """durable-io's plugin is loaded in every pytest session of the environment: set at
    its import, the guards made an unrelated suite see us-east-1 and the key "testing"
    (its real region and profile overridden). Now only a server fixture sets them."""
    (tmp_path / "test_other.py").write_text(_OTHER_PROJECT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "GCE_", "GCSFS_", "NO_GCE", "PYTEST_"))}
    env["AWS_DEFAULT_REGION"] = "eu-west-1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_other.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


def test_network_guards_are_set_by_the_plugin() -> None:
    assert os.environ["AWS_EC2_METADATA_DISABLED"] == "true"
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    assert os.environ["GCE_METADATA_HOST"].startswith("127.0.0.1:")
    assert "127.0.0.1" in os.environ["NO_PROXY"].split(",")


def test_missing_server_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_AZURITE", "/nonexistent/azurite-blob")
    with pytest.raises(servers.ServerNotFoundError, match="DURABLE_AZURITE"):
        servers.start_azurite()


def _missing() -> Any:
    raise servers.ServerNotFoundError("no such server; install it with: x")


def test_missing_server_fails_the_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DURABLE_SKIP_MISSING_SERVERS", raising=False)
    with pytest.raises(pytest.fail.Exception, match="install it with"):
        next(_serve(_missing))


def test_missing_server_skips_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_SKIP_MISSING_SERVERS", "1")
    with pytest.raises(pytest.skip.Exception):
        next(_serve(_missing))


def test_start_failure_shows_the_server_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "azurite-blob"
    broken.write_text("#!/bin/sh\necho 'boom: cannot start' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("DURABLE_AZURITE", str(broken))
    with pytest.raises(servers.ServerStartError, match=r"(?s)code 3.*boom: cannot start"):
        servers.start_azurite(timeout=5)
