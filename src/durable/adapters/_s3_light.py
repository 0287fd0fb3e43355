"""durable's own small PUTs on S3 (attempt records, markers) and the listings of its
records directories through obstore: a seventh of the CPU of s3fs, and the same requests.

durable's objects of a commit are a few hundred bytes; each PutObject through s3fs and
aiobotocore costs 2.5-3 ms of this process's CPU (building, signing and parsing in Python),
through obstore (Rust's object_store) 0.4 ms: on moto, 5.9 against 2.9 ms of wall time per
request (`benchmarks/bench_s3_client.py`). A commit waits for two of them in a row.

Only where obstore reaches exactly what s3fs reaches, else `light_store` answers None and
s3fs is used as before:

- obstore is installed (it comes with the ``s3`` extra) and `S3Adapter.light_puts` is on;
- the filesystem's options are ones mapped here one to one: explicit or static credentials
  (``key``/``secret``/``token``, the environment, a credentials file: whatever botocore
  resolved, unless it refreshes) or ``anon``, ``endpoint_url``, the region; nothing in
  ``config_kwargs`` or ``s3_additional_kwargs`` (server-side encryption, ACLs, retries,
  proxies, addressing), ``client_kwargs`` beyond the endpoint and region, no requester pays,
  and no ``AWS_*`` setting in the environment that obstore would apply on its own
  (``_ENV_ALIKE`` lists those it may meet);
- the bucket is addressed the way botocore addresses it (read off a presigned URL: path or
  virtual-hosted style), and over TLS only with the default trust (no ``AWS_CA_BUNDLE``);
- the key parses as an object_store path unchanged (object_store refuses keys with empty or
  ``.`` segments instead of rewriting them; such keys go through s3fs).

A listing goes through obstore only inside a records directory (``.durable``), whose
keys durable names itself, and is checked before it is used: object_store refuses keys
with empty, ``.`` or ``..`` segments and drops a key's trailing ``/`` (a console folder
``d/`` would come back as ``d``), so any listing with such a key, an empty object, or a
key outside the prefix is asked again through s3fs (`list_below`).

The PUT is the same request: the payload is signed (SigV4, ``x-amz-content-sha256``: the
store checks the body against it as it checks s3fs's CRC32C header), create-only is
``If-None-Match: *``, and a create-only PUT refused because a retry of our own request had
landed is told apart by reading the object back (`put` below).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
import threading
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fsspec.asyn import sync

from durable._error_document import error_document
from durable._errors import IntegrityError
from durable.adapters._s3_http import etag
from durable.adapters.base import ObjectInfo

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

    from durable.adapters.s3 import S3Adapter

__all__ = ["get_small", "light_store", "list_below", "put"]

# obstore also reads AWS_* settings from the environment, and the explicit ones passed here
# override only their own: any other it would apply (a session token beside explicit keys,
# server-side encryption, requester pays, unsigned payloads, ...) would make its PUT
# differ from s3fs's. With one of those set, s3fs alone. These are read by botocore too,
# or overridden below, or concern only credential lookups that explicit keys skip.
_ENV_ALIKE = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_EC2_METADATA_DISABLED", "AWS_CA_BUNDLE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
    "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"})
# As persistent as s3fs on a lost answer or a 5xx (503 SlowDown): it sends a PutObject up to
# 25 times over about 45 s (botocore's 5 attempts, each of s3fs's 5 tries), where obstore's
# 5 attempts gave up within a second, so a one-second SlowDown burst failed a commit at its
# marker that s3fs rode out. Still bounded: 60 s from the first try.
_RETRIES: RetryConfig = {"max_retries": 24, "retry_timeout": datetime.timedelta(seconds=60)}
_LOCK = threading.Lock()
# object_store follows NextContinuationToken and stops at the first page without one,
# IsTruncated or not: from a store that pages without tokens (ListObjectsV2 answered as
# ListObjects, by Marker) it returned the first page as the whole listing, silently. A
# listing of a full page or more (S3 pages hold 1000 keys) may be such a cut one: asked
# again through s3fs, which reads IsTruncated. durable's records directories hold far
# fewer, so this costs nothing in the common case.
_PAGE = 1000


def light_store(adapter: S3Adapter, bucket: str) -> Any:
    """The obstore store for ``bucket`` as ``adapter``'s s3fs reaches it, or None; built
    once per adapter (one per filesystem instance) and bucket."""
    stores = adapter._light_stores
    with _LOCK:
        if bucket in stores:
            return stores[bucket]
    store = _build(adapter, bucket)
    with _LOCK:
        return stores.setdefault(bucket, store)


def _build(adapter: S3Adapter, bucket: str) -> Any:
    fs = adapter.fs
    if (fs.config_kwargs or fs.s3_additional_kwargs or fs.requester_pays
            or set(fs.client_kwargs) - {"endpoint_url", "region_name"}
            or any(k.startswith("AWS_") and k not in _ENV_ALIKE for k in os.environ)):
        return None
    try:
        from obstore.store import S3Store
    except ImportError:
        return None
    sync(fs.loop, fs.set_session)
    client = fs.s3
    options: dict[str, Any] = {"region": client.meta.region_name or "us-east-1"}
    if fs.anon:
        options["skip_signature"] = True
    else:
        creds = client._request_signer._credentials  # botocore's resolved credentials
        if creds is None or hasattr(creds, "refresh_needed"):
            return None  # refreshing credentials (STS, SSO, instance roles): s3fs alone
        frozen = sync(fs.loop, creds.get_frozen_credentials)
        env_token = os.environ.get("AWS_SESSION_TOKEN") or os.environ.get("AWS_SECURITY_TOKEN")
        if env_token and env_token != frozen.token:
            return None  # obstore would sign with the environment's token beside these keys
        options.update(access_key_id=frozen.access_key, secret_access_key=frozen.secret_key)
        if frozen.token:
            options["token"] = frozen.token
    # botocore's own choice of host and path for this bucket, read off a presigned URL
    # (made locally, no request).
    where = urlsplit(sync(fs.loop, client.generate_presigned_url, "put_object",
                          Params={"Bucket": bucket, "Key": "k"}))
    virtual = where.hostname is not None and where.hostname.startswith(f"{bucket}.")
    if not virtual and not where.path.startswith(f"/{bucket}/"):
        return None  # an addressing this module does not know
    if where.scheme == "https" and os.environ.get("AWS_CA_BUNDLE"):
        return None  # botocore trusts that bundle alone; obstore would not read it the same
    client_options: ClientConfig = {"allow_http": where.scheme == "http"}
    endpoint = f"{where.scheme}://{where.netloc}"
    try:
        return S3Store(bucket, endpoint=endpoint, virtual_hosted_style_request=virtual,
                       client_options=client_options, retry_config=_RETRIES, **options)
    except Exception:
        return None


def put(store: Any, adapter: S3Adapter, bucket: str, key: str, data: bytes,
        create_only: bool) -> str | None:
    """PUT ``data`` at ``key``; its ETag. None where obstore cannot name the key exactly
    (nothing was sent: use s3fs). Errors are those of s3fs's path: FileExistsError for a
    create-only PUT refused, PermissionError, FileNotFoundError, else OSError."""
    import obstore
    from obstore.exceptions import AlreadyExistsError, InvalidPathError, PreconditionError

    url = adapter.url(f"{bucket}/{key}")
    try:
        result = obstore.put(store, key, data, mode="create" if create_only else "overwrite")
    except (InvalidPathError, ValueError) as exc:
        if isinstance(exc, InvalidPathError) or "parse path" in str(exc):
            return None
        raise OSError(f"{url}: PutObject failed: {exc}") from exc
    except (AlreadyExistsError, PreconditionError) as exc:
        # A retry of this very request after a lost answer is refused too (the first one
        # landed): ours if the object holds exactly these bytes.
        with contextlib.suppress(Exception):
            got = obstore.get(store, key)
            if bytes(got.bytes()) == data:
                return etag(got.meta["e_tag"], url)
        raise FileExistsError(f"{url} already exists (create-only PutObject: HTTP 412)"
                              ) from exc
    except Exception as exc:
        raise _failure(exc, url, "PutObject") from exc
    version = etag(result["e_tag"], url)
    if version != f'"{hashlib.md5(data).hexdigest()}"':
        _check_landed(store, url, key, data, version)
    return version


def _check_landed(store: Any, url: str, key: str, data: bytes, version: str) -> None:
    """A PutObject answered 200 with an ETag that is not the MD5 of the bytes sent: a
    store that encrypts with KMS (its ETags are no MD5), or an answer that is not the
    store's (a gateway's error document served as 200, with the ETag of its own body).
    obstore reads no body of a PUT's answer (botocore finds the error in it), so such a
    PUT counted as written, and a marker that never landed as a commit. One HEAD tells."""
    import obstore

    try:
        meta = obstore.head(store, key)
    except Exception as exc:
        raise OSError(f"{url}: PutObject answered 200 with ETag {version}, not the MD5 of "
                      f"the bytes sent, and the object cannot be found ({_said(exc)}): not "
                      "the store's answer (an error document served as 200?)") from exc
    found = (int(meta["size"]), etag(meta["e_tag"], url))
    if found != (len(data), version):
        raise OSError(f"{url}: PutObject answered 200 with ETag {version}, not the MD5 of "
                      f"the bytes sent, and the store holds {found[0]} bytes with ETag "
                      f"{found[1]}: not the store's answer (an error document served as "
                      "200?)")


def list_below(store: Any, adapter: S3Adapter, bucket: str, start: str,
               ) -> dict[str, ObjectInfo] | None:
    """Every object whose key starts with ``start`` (ending in ``/``), keyed by the rest
    of its key, as `S3Adapter.list` gives them; None where obstore may not have named
    every key exactly (use s3fs, which lists again): a key object_store refuses, one that
    comes back outside ``start`` or twice, an empty object (a folder ``d/`` and an
    empty ``d`` look the same once its ``/`` is dropped), or a page's worth (`_PAGE`)."""
    import obstore

    out: dict[str, ObjectInfo] = {}
    try:
        for batch in obstore.list(store, start.rstrip("/")):
            for meta in batch:
                key, size = meta["path"], int(meta["size"])
                rel = key[len(start):] if key.startswith(start) else ""
                if not rel or rel in out or size == 0:
                    return None
                path = f"{bucket}/{key}"
                out[rel] = ObjectInfo(path, size, etag(meta["e_tag"], adapter.url(path)),
                                      meta["last_modified"].timestamp())
    except Exception:
        return None  # s3fs asks again and says what went wrong, as it always has
    return out if len(out) < _PAGE else None


def get_small(store: Any, adapter: S3Adapter, bucket: str, key: str, limit: int,
              ) -> tuple[bytes | None] | None:
    """(the object's bytes, or None if there is none), at most ``limit`` bytes: over it,
    ValueError naming it, from the GET's headers before its body is taken in. None where
    obstore cannot name the key exactly (nothing was sent: use s3fs). Errors as s3fs's."""
    import obstore
    from obstore.exceptions import InvalidPathError, NotFoundError

    url = adapter.url(f"{bucket}/{key}")
    try:
        result = obstore.get(store, key)
    except (InvalidPathError, ValueError) as exc:
        if isinstance(exc, InvalidPathError) or "parse path" in str(exc):
            return None
        raise OSError(f"{url}: GET failed: {_said(exc)}") from exc
    except (NotFoundError, FileNotFoundError):  # obstore raises the builtin for a GET
        return (None,)
    except Exception as exc:
        raise _failure(exc, url, "GET") from exc
    size = int(result.meta["size"])
    if size > limit:
        # The body is a stream not read yet: dropped here, it is never downloaded.
        raise ValueError(f"{url} is {size} bytes, over the limit of {limit}")
    try:
        data = bytes(result.bytes())
    except Exception as exc:
        raise OSError(f"{url}: GET failed in its body: {type(exc).__name__}: {_said(exc)}"
                      ) from exc
    if len(data) != size:
        raise IntegrityError(f"{url}: GET answered {len(data)} bytes, its headers said "
                             f"{size}", url=url, expected=size, found=len(data))
    return (data,)


def _said(exc: BaseException) -> str:
    # object_store's message runs on with a multi-line "Debug source" dump: its first line.
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""


# How object_store says the store refused a request, before the body the store sent.
_REFUSED = re.compile(r"Server returned non-2xx status code: (\d{3})[^:]*(?::(.*))?", re.S)


def _failure(exc: Exception, url: str, what: str) -> OSError:
    """The builtin a caller catches for ``what`` refused (as s3fs's path raises it: 403
    PermissionError, 404 FileNotFoundError, else OSError), its message as short as s3fs's:
    the object, the status, and the S3 error code and message. obstore's own message holds
    its whole request and a multi-line debug dump of its Rust error (40 lines for a 403)."""
    from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

    text = str(exc).split("\n\nDebug source:", 1)[0]
    refused = _REFUSED.search(text)
    if refused is None:
        # Not an answer (a connection refused, a timeout): what failed, on one line.
        return OSError(f"{url}: {what} failed: {type(exc).__name__}: {_said(exc)}")
    status, body = int(refused[1]), (refused[2] or "").strip()
    doc = error_document(body.encode())
    said = f"{doc[0]}: {doc[1]}" if doc else body.splitlines()[0][:200] if body else ""
    message = f"{url}: {what} answered HTTP {status} {said}".rstrip()
    if status in (401, 403) or isinstance(exc, PermissionDeniedError | UnauthenticatedError
                                          | PermissionError):
        return PermissionError(message)
    if status == 404 or isinstance(exc, NotFoundError | FileNotFoundError):
        return FileNotFoundError(message)
    return OSError(message)
