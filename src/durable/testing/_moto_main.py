"""moto's server, with its conditional writes made atomic.

moto checks a precondition (``If-None-Match: *``, ``If-Match``) and then stores the object
in two separate steps, on a threaded server: two racing create-only PUTs can both pass the
check (seen: 2 winners in a process race under load). Real S3 decides each conditional
write atomically, and durable's tests of "exactly one commit" test durable, not moto, so
this launcher serialises every request that changes state (reads stay concurrent).

    python -m durable.testing._moto_main -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import threading
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication
from moto.server import main

_WRITE_LOCK = threading.Lock()
_dispatch = DomainDispatcherApplication.__call__


def _serialised(self: Any, environ: dict[str, Any], start_response: Any) -> Any:
    if environ.get("REQUEST_METHOD") in ("GET", "HEAD", "OPTIONS"):
        return _dispatch(self, environ, start_response)
    with _WRITE_LOCK:
        # The response body is produced inside the lock: moto's handler does its work
        # when called, and the body it returns is already computed.
        result = _dispatch(self, environ, start_response)
        return list(result) if not isinstance(result, list | tuple) else result


DomainDispatcherApplication.__call__ = _serialised  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
