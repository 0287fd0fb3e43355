"""The fault proxy: a threaded TCP server on 127.0.0.1, its faults and its request log."""

from __future__ import annotations

import contextlib
import io
import re
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Self, cast
from urllib.parse import urlsplit

from durable import _background as background
from durable.testing.faults._exchange import Exchange, RequestRecord
from durable.testing.faults._http import BUF, Headers, PeerClosed, ProtocolError
from durable.testing.faults._kinds import FACTORIES, Fault, Match, QueryPredicate, RequestInfo


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 128
    proxy: FaultProxy


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.server.proxy._serve_connection(self.request)


class FaultProxy:
    """A fault-injecting reverse proxy in front of an S3 endpoint (see the module docstring).

    ``upstream``: ``http://host:port`` of the real endpoint (plain HTTP only).
    ``client_timeout``: seconds a client connection may sit idle (or stall mid-request).
    ``upstream_timeout``: connect and per-read timeout towards the upstream.
    ``keep_alive``: keep client connections open between requests (default); ``False``
    answers every request with ``Connection: close``.
    """

    def __init__(
        self,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        client_timeout: float = 60.0,
        upstream_timeout: float = 60.0,
        keep_alive: bool = True,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, not {upstream!r}")
        self.upstream = upstream.rstrip("/")
        self._up_addr = (parts.hostname, parts.port or 80)
        self._bind = (host, port)
        self.client_timeout = client_timeout
        self.upstream_timeout = upstream_timeout
        self.keep_alive = keep_alive
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._log: list[RequestRecord] = []
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._connections = 0
        #: unexpected proxy-side exceptions (bugs), as "Type: message"; tests assert it is empty
        self.errors: list[str] = []
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        if self._server is not None:
            raise RuntimeError("FaultProxy already started")
        self._stopping.clear()
        server = _Server(self._bind, _Handler)
        server.proxy = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"FaultProxy:{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving, once durable's background work through this proxy is done; and
        forget what durable probed of this proxy's URL (create-only, conditional writes,
        tensorstore's ETags), which it keeps per endpoint for the process: the next proxy
        given this port stands in front of another store."""
        server, thread = self._server, self._thread
        if server is None:
            return
        url = self.url
        # durable's housekeeping still under way through this proxy (a commit's removal of
        # its attempt record) reaches the store, not a closed port.
        with contextlib.suppress(TimeoutError):
            background.wait(timeout)
        self._stopping.set()
        server.shutdown()
        server.server_close()
        # Idle keep-alive connections would otherwise hold their threads (and stop()) up.
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if thread is not None:
            thread.join(timeout)
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._server = None
        self._thread = None
        _forget_verdicts(url)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("FaultProxy not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ----------------------------------------------------------------- faults

    def add(self, fault: Fault) -> Fault:
        """Add a fault (after the existing ones) and return it (``fault.hits`` counts uses)."""
        with self._lock:
            self._faults.append(fault)
        return fault

    def inject(self, kind: str, **params: Any) -> Fault:
        """``inject("truncate_body", keep=10, key="b/k", times=1)``: build a fault by kind
        name (the module-level factory of that name, given ``params``: the kind's own and
        those of :class:`Scope`) and add it."""
        try:
            factory = FACTORIES[kind]
        except KeyError:
            raise ValueError(f"unknown fault kind {kind!r}; one of {sorted(FACTORIES)}") from None
        return self.add(factory(**params))

    def remove(self, fault: Fault) -> None:
        with self._lock:
            self._faults = [f for f in self._faults if f is not fault]

    def clear(self) -> None:
        """Remove every fault (the request log is kept; see :meth:`clear_requests`)."""
        with self._lock:
            self._faults = []

    @contextlib.contextmanager
    def injected(self, fault: Fault) -> Iterator[Fault]:
        """``with proxy.injected(error(503)): ...``: a fault for the duration of a block."""
        self.add(fault)
        try:
            yield fault
        finally:
            self.remove(fault)

    @property
    def faults(self) -> list[Fault]:
        with self._lock:
            return list(self._faults)

    # ------------------------------------------------------------------ log

    @property
    def requests(self) -> list[RequestRecord]:
        """A snapshot of the request log, oldest first, once durable's housekeeping handed
        to the background so far (a commit's removal of its attempt record) has run: the
        log then holds every request of what the caller did, and nothing lands later."""
        background.wait()
        with self._lock:
            return list(self._log)

    def clear_requests(self) -> None:
        """Forget the log, after durable's pending housekeeping (as `requests`)."""
        background.wait()
        with self._lock:
            self._log = []

    def count(
        self,
        *,
        method: str | Sequence[str] | None = None,
        key: str | None = None,
        path: str | re.Pattern[str] | None = None,
        query: str | Sequence[str] | QueryPredicate | None = None,
        status: int | None = None,
    ) -> int:
        """How many logged requests match (same criteria as :class:`Match`)."""
        m = Match(methods=method, key=key, path=path, query=query)
        n = 0
        for r in self.requests:
            info = RequestInfo(r.method, "", r.path, r.raw_query, r.query, Headers())
            if m.matches(info) and (status is None or r.status == status):
                n += 1
        return n

    # ------------------------------------------------------------- internals

    def _candidates(self, info: RequestInfo) -> list[Fault]:
        with self._lock:
            faults = list(self._faults)
        return [f for f in faults if not f.exhausted and f.matches(info)]

    def _consume(self, fault: Fault, rec: RequestRecord) -> bool:
        # Under the lock: two connections must not both spend a fault's last use.
        with self._lock:
            if fault.exhausted:
                return False
            fault.hits += 1
        rec.faults.append(fault.kind)
        return True

    def _track(self, s: socket.socket, on: bool) -> None:
        with self._lock:
            if on:
                self._sockets.add(s)
            else:
                self._sockets.discard(s)

    def _serve_connection(self, client: socket.socket) -> None:
        me = threading.current_thread()
        with self._lock:
            self._threads.add(me)
            self._connections += 1
            conn_id = self._connections
        self._track(client, True)
        rfile = cast(io.BufferedReader, client.makefile("rb", buffering=BUF))
        try:
            client.settimeout(self.client_timeout)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stopping.is_set():
                if not Exchange(self, client, rfile, conn_id).run():
                    break
        except (OSError, PeerClosed, ProtocolError):
            pass
        except Exception as exc:  # a bug in the proxy: keep it visible to tests
            with self._lock:
                self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self._track(client, False)
            with contextlib.suppress(OSError):
                rfile.close()
            with contextlib.suppress(OSError):
                client.close()
            with self._lock:
                self._threads.discard(me)


def _forget_verdicts(url: str) -> None:
    """What durable probed of the store behind ``url`` and keeps per endpoint for the process
    (create-only and conditional writes on S3, tensorstore's ETags): the next proxy given
    this port stands in front of another store, with its own faults. Only modules already
    imported are asked (the proxy needs none of the extras)."""
    s3 = sys.modules.get("durable.adapters.s3")
    if s3 is not None:
        s3.S3Adapter.forget_endpoint(url)
    kv = sys.modules.get("durable._tensorstore_kv")
    if kv is not None:
        kv.forget_endpoint(url)
