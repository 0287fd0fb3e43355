"""Where tensorstore reaches a `durable` entry: URLs to kvstore specs, and the ETag probe.

Private to `durable.tensorstore`, which re-exports `kvstore_spec`, `entry_for` and
`UnusableETagError`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import os
import shutil
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, BinaryIO

import tensorstore as ts

from durable._entry import Entry
from durable._errors import IntegrityError, UnsupportedError
from durable.adapters.base import Adapter, AtomicFile, Capabilities, ObjectInfo

__all__ = ["MALFORMED", "MAX_METADATA", "MemoryKvAdapter", "Place", "Probe",
           "UnusableETagError", "entry_for", "etag_error", "kvstore_spec", "probe"]

MALFORMED = "Malformed StorageGeneration"
MAX_METADATA = 64 * 1024 * 1024  # an array's metadata document is read whole, up to this


class UnusableETagError(UnsupportedError):
    """tensorstore cannot build conditional requests from the versions this store returns.

    ``endpoint`` names the store, ``etag`` what it answered (an S3 ETag, a GCS generation,
    or None when it sent none), ``url`` the object that answered it.
    """

    def __init__(self, message: str, *, endpoint: str, etag: str | None,
                 url: str | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.etag = etag
        self.url = url

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_etag_error, (str(self), self.endpoint, self.etag, self.url))


def _rebuild_etag_error(message: str, endpoint: str, etag: str | None,
                        url: str | None) -> UnusableETagError:
    return UnusableETagError(message, endpoint=endpoint, etag=etag, url=url)


# --------------------------------------------------------------------- URLs to kvstores
def _split(url: str | os.PathLike[str]) -> tuple[str, str]:
    import fsspec
    from fsspec.core import split_protocol

    text = os.fspath(url)
    protocol = split_protocol(text)[0] or "file"
    return protocol, str(fsspec.get_filesystem_class(protocol)._strip_protocol(text))


def kvstore_spec(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
                 ) -> dict[str, Any]:
    """The tensorstore kvstore spec (JSON) for an fsspec URL, with a trailing ``/``.

    Honoured ``storage_options``: S3 ``endpoint_url`` (also in ``client_kwargs``; else
    $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL, as botocore and so s3fs take them),
    ``client_kwargs.region_name`` (else $AWS_REGION / $AWS_DEFAULT_REGION), ``anon``,
    ``key``/``secret``/``token`` (also as ``client_kwargs`` ``aws_access_key_id``,
    ``aws_secret_access_key``, ``aws_session_token``), ``profile``; GCS ``endpoint_url``
    and ``token`` ("anon" or default credentials). ``requester_pays=True`` is refused
    (UnsupportedError): tensorstore sends no requester-pays header. tensorstore takes no
    inline AWS keys: keys that are not the ones in the environment are written to a
    private (0600) credentials file, deleted at
    exit, and named as a profile. Its GCS driver takes its endpoint from the process-wide
    $TENSORSTORE_GCS_HTTP_URL, which this sets (one GCS endpoint per process).
    """
    protocol, path = _split(url)
    opts = dict(storage_options or {})
    if protocol in ("file", "local"):
        return {"driver": "file", "path": path.rstrip("/") + "/"}
    if protocol == "memory":
        return {"driver": "memory", "path": _slashed(path)}
    bucket, _, key = path.partition("/")
    if protocol in ("s3", "s3a"):
        client = dict(opts.get("client_kwargs") or {})
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": _slashed(key)}
        endpoint = (opts.get("endpoint_url") or client.get("endpoint_url")
                    or _configured_s3_endpoint())
        if endpoint:
            spec["endpoint"] = str(endpoint)
        region = (client.get("region_name") or os.environ.get("AWS_REGION")
                  or os.environ.get("AWS_DEFAULT_REGION"))
        if region:
            spec["aws_region"] = str(region)
        if opts.get("requester_pays"):
            # tensorstore (0.1.86) takes "requester_pays" in its spec but sends no
            # x-amz-request-payer header: its requests would be refused by the bucket
            # that durable's own (s3fs) requests reached, after the marker was read.
            raise UnsupportedError(
                f"{url}: tensorstore's s3 driver sends no x-amz-request-payer header, so "
                "a requester-pays bucket refuses its requests (storage_options "
                "requester_pays=True); read such a bucket with durable.zarr")
        # s3fs hands client_kwargs to botocore, which takes keys there too: tensorstore
        # signed with the default credentials, durable's own requests with these.
        keys = {"key": client.get("aws_access_key_id"),
                "secret": client.get("aws_secret_access_key"),
                "token": client.get("aws_session_token")}
        spec["aws_credentials"] = _aws_credentials(
            {**opts, **{k: v for k, v in keys.items() if v is not None}})
        return spec
    if protocol in ("gs", "gcs"):
        token = opts.get("token")
        if token not in (None, "anon", "google_default", "cloud"):
            raise UnsupportedError(
                f"{url}: tensorstore's gcs driver cannot take token={token!r:.40}; it uses "
                "Google default credentials ($GOOGLE_APPLICATION_CREDENTIALS)")
        if opts.get("endpoint_url"):
            _set_gcs_endpoint(str(opts["endpoint_url"]))
        return {"driver": "gcs", "bucket": bucket, "path": _slashed(key)}
    raise UnsupportedError(f"{url}: tensorstore has no kvstore driver for {protocol!r} URLs "
                           "(supported: file, memory, s3, gs)")


def _configured_s3_endpoint() -> str | None:
    """The endpoint botocore (so s3fs) takes from the environment, which tensorstore ignores:
    without it the entry's records went to that endpoint and the chunks to AWS."""
    env = os.environ
    if env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None


def _slashed(key: str) -> str:
    key = key.strip("/")
    return key + "/" if key else ""


def _aws_credentials(opts: dict[str, Any]) -> dict[str, Any]:
    if opts.get("anon"):
        return {"type": "anonymous"}
    key, secret, token = opts.get("key"), opts.get("secret"), opts.get("token")
    if key or secret:
        if not (key and secret):
            raise ValueError("storage_options: give both key and secret, or neither")
        env = os.environ
        if (key, secret, token) == (env.get("AWS_ACCESS_KEY_ID"),
                                    env.get("AWS_SECRET_ACCESS_KEY"),
                                    env.get("AWS_SESSION_TOKEN")):
            return {"type": "environment"}
        return _credentials_profile(str(key), str(secret), token)
    if opts.get("profile"):
        return {"type": "profile", "profile": str(opts["profile"])}
    return {"type": "default"}


_CREDS_LOCK = threading.Lock()
_CREDS: dict[str, tuple[str, str, str | None]] = {}
_CREDS_DIR: str | None = None


def _credentials_profile(key: str, secret: str, token: Any) -> dict[str, Any]:
    global _CREDS_DIR
    name = "durable-" + hashlib.sha256(f"{key}\0{secret}\0{token}".encode()).hexdigest()[:16]
    with _CREDS_LOCK:
        if _CREDS_DIR is None:
            _CREDS_DIR = tempfile.mkdtemp(prefix="durable-aws-")  # mode 0700
            atexit.register(shutil.rmtree, _CREDS_DIR, True)
            os.close(os.open(os.path.join(_CREDS_DIR, "config"), os.O_WRONLY | os.O_CREAT, 0o600))
        if name not in _CREDS:
            _CREDS[name] = (key, secret, None if token is None else str(token))
            text = "".join(
                f"[{n}]\naws_access_key_id = {k}\naws_secret_access_key = {s}\n"
                + (f"aws_session_token = {t}\n" if t else "") for n, (k, s, t) in _CREDS.items())
            tmp = os.path.join(_CREDS_DIR, "credentials.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(_CREDS_DIR, "credentials"))
        return {"type": "profile", "profile": name,
                "credentials_file": os.path.join(_CREDS_DIR, "credentials"),
                "config_file": os.path.join(_CREDS_DIR, "config")}


def _set_gcs_endpoint(endpoint: str) -> None:
    current = os.environ.get("TENSORSTORE_GCS_HTTP_URL")
    if current is None:
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = endpoint
    elif current.rstrip("/") != endpoint.rstrip("/"):
        # Handles already open would silently follow a changed variable to another store.
        raise UnsupportedError(
            f"tensorstore's gcs driver reads its endpoint from $TENSORSTORE_GCS_HTTP_URL, "
            f"which is {current!r} in this process; cannot also reach {endpoint!r}")


# ------------------------------------------------------- tensorstore's in-process memory
_MEMORY = ts.Context()  # the one memory kvstore of this process, like fsspec's memory://


class _MemoryPaths:
    """Path spelling for `MemoryKvAdapter` (fsspec's memory:// URLs, leading ``/``)."""

    protocol = ("memory",)
    sep = "/"

    def _strip_protocol(self, path: Any) -> str:
        return "/" + str(os.fspath(path)).removeprefix("memory://").strip("/")

    def unstrip_protocol(self, path: str) -> str:
        return "memory://" + path

    def _parent(self, path: str) -> str:
        return self._strip_protocol(path).rpartition("/")[0] or "/"


class _MemoryFile(AtomicFile):
    def __init__(self, adapter: MemoryKvAdapter, path: str, create_only: bool) -> None:
        super().__init__(path)
        self._a, self._create_only, self._buf = adapter, create_only, io.BytesIO()

    def _write(self, data: memoryview) -> None:
        self._buf.write(data)

    def _commit(self) -> ObjectInfo:
        data = self._buf.getvalue()
        # b"\x02" is tensorstore's "no value" generation (what a read of a missing key
        # answers): the write happens only if the key is absent, else the answer is empty.
        stamp = self._a.kv.write(self._a.key(self.path), data,
                                 if_equal=b"\x02" if self._create_only else None).result()
        if self._create_only and not stamp.generation:
            raise FileExistsError(f"memory://{self.path} exists (create-only write)")
        return ObjectInfo(self.path, len(data), stamp.generation.hex())

    def _abort(self) -> None:
        self._buf = io.BytesIO()


class MemoryKvAdapter(Adapter):
    """The adapter for ``memory://`` entries: tensorstore's memory kvstore of this process."""

    protocols = ("memory",)
    capabilities = Capabilities(
        atomic_objects=True, create_only=True, durable=False, pinned_reads=True,
        note="tensorstore's in-process memory kvstore: one process, gone at exit",
        in_process=True)

    def __init__(self) -> None:
        super().__init__(_MemoryPaths())
        self.kv = ts.KvStore.open({"driver": "memory"}, context=_MEMORY).result()

    def key(self, path: str) -> str:
        return path.strip("/")

    def open_atomic(self, path: str, *, create_only: bool = False,
                    durable: bool = True) -> AtomicFile:
        return _MemoryFile(self, path, create_only)

    def _read(self, path: str) -> Any:
        return self.kv.read(self.key(path)).result()

    def info(self, path: str) -> ObjectInfo | None:
        r = self._read(path)
        return None if r.state != "value" else ObjectInfo(path, len(r.value),
                                                          r.stamp.generation.hex())

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        start = self.key(prefix) + "/"
        keys = self.kv.list(ts.KvStore.KeyRange(start, start[:-1] + "0")).result()
        found = {k.decode()[len(start):]: self.info("/" + k.decode()) for k in keys}
        return {k: v for k, v in sorted(found.items()) if v is not None}

    def exists(self, path: str) -> bool:
        return self.info(path) is not None or bool(self.list(path))

    def open_read(self, path: str, info: ObjectInfo) -> BinaryIO:
        r = self._read(path)
        found = r.stamp.generation.hex() if r.state == "value" else None
        if found is None or (info.version is not None and found != info.version):
            raise IntegrityError(f"memory://{path}: replaced or deleted since it was listed",
                                 url=f"memory://{path}", expected=info.version, found=found)
        return io.BytesIO(r.value)

    def delete(self, paths: Iterable[str]) -> None:
        for p in paths:
            self.kv.write(self.key(p), None).result()

    def delete_prefix(self, prefix: str) -> None:
        start = self.key(prefix)
        self.kv.write(start, None).result()
        self.kv.delete_range(ts.KvStore.KeyRange(start + "/", start + "0")).result()


_MEMORY_ADAPTER: MemoryKvAdapter | None = None
_PLACES: OrderedDict[str, Place] = OrderedDict()  # absolute local URL -> its Place
_PLACES_LOCK = threading.Lock()
_PLACES_MAX = 256


def entry_for(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
              ) -> Entry:
    """The `Entry` of an array at ``url``, as this module reads and writes it."""
    global _MEMORY_ADAPTER
    if _split(url)[0] == "memory":
        if _MEMORY_ADAPTER is None:
            _MEMORY_ADAPTER = MemoryKvAdapter()
        return Entry(os.fspath(url), adapter=_MEMORY_ADAPTER)
    return Entry(os.fspath(url), storage_options=storage_options)


@dataclass(frozen=True)
class Place:
    """One entry, and how tensorstore reaches it."""

    entry: Entry
    spec: dict[str, Any]  # kvstore spec of the entry root
    endpoint: str | None  # what the ETag probe is cached by; None: no probe needed

    @classmethod
    def of(cls, url: str | os.PathLike[str], storage_options: dict[str, Any] | None,
           ) -> Place:
        text = os.fspath(url)
        # An absolute local path names the same place whatever happens next (no cwd, no
        # credentials, no process-wide endpoint): kept, it spares each open of a W1 array
        # on file a fifth of durable's own time there (fsspec's path handling).
        local = not storage_options and (text.startswith(("/", "file:///"))
                                         and "::" not in text)
        if local:
            with _PLACES_LOCK:
                known = _PLACES.get(text)
                if known is not None:
                    _PLACES.move_to_end(text)
                    return known
        place = cls._of(text, storage_options)
        if local and place.spec["driver"] == "file":
            with _PLACES_LOCK:
                _PLACES[text] = place
                if len(_PLACES) > _PLACES_MAX:
                    _PLACES.popitem(last=False)
        return place

    @cached_property
    def marker_url(self) -> str:
        """The marker's URL: what errors name, and what `_DECODED` is keyed by."""
        return self.entry.adapter.url(self.entry.layout.marker)

    @classmethod
    def _of(cls, url: str, storage_options: dict[str, Any] | None) -> Place:
        spec = kvstore_spec(url, storage_options)
        endpoint = None
        if spec["driver"] == "s3":
            region = spec.get("aws_region")
            endpoint = spec.get("endpoint") or (
                f"https://s3.{region}.amazonaws.com" if region else "https://s3.amazonaws.com")
        elif spec["driver"] == "gcs":
            endpoint = os.environ.get("TENSORSTORE_GCS_HTTP_URL",
                                      "https://storage.googleapis.com")
        return cls(entry_for(url, storage_options), spec, endpoint)

    def kvstore(self, path: str = "", **extra: Any) -> Any:
        """The kvstore of ``path`` inside the entry: a spec, or a bound KvStore for memory."""
        spec = {**self.spec, **extra, "path": self.spec["path"] + _slashed(path)}
        if spec["driver"] == "memory":
            return ts.KvStore.open(spec, context=_MEMORY).result()
        return spec

    def read(self, path: str, limit: int) -> bytes | None:
        """A small object of the entry (its marker, a zarr.json), whole; None if absent.
        ValueError if over ``limit`` bytes.

        A local one through the adapter: 9 us, where opening a tensorstore kvstore to read
        it took 120 us (an open reads two: a quarter of a W1 open on file). An S3 or GCS
        one through the adapter's `read_small` (on S3 obstore where it maps: the CPU of
        tensorstore's request, a tenth of s3fs's), bounded before the body is read:
        tensorstore's own read downloads the object whole before its size is known (a
        marker of gigabytes, then the check). A memory one through tensorstore, whose
        kvstore is this process's memory: nothing to download."""
        if self.spec["driver"] != "memory":
            return self.entry.adapter.read_small(path, limit)
        got = ts.KvStore.open({"driver": "memory", "path": path.strip("/")},
                              context=_MEMORY).result().read("").result()
        if got.state != "value":
            return None
        if len(got.value) > limit:
            raise ValueError(f"{self.entry.adapter.url(path)} is {len(got.value)} bytes, "
                             f"over the limit of {limit}")
        return bytes(got.value)

    def bucket_key(self, path: str) -> str:
        """The key inside its bucket of an object path of an s3/gcs entry."""
        return path.partition("/")[2]


# ------------------------------------------------------------------------- the ETag probe
@dataclass(frozen=True)
class Probe:
    usable: bool
    etag: str | None = None  # what the store answered, as text (None: nothing at all)
    url: str | None = None  # the object that answered it
    why: str = ""
    driver: str = ""

    @property
    def readable(self) -> bool:
        """Whether reads still work: tensorstore reads unconditionally with any version it
        got, and durable's own adapters accept it (its S3 adapter re-quotes an unquoted
        ETag, and refuses a weak or empty one, which cannot pin a read)."""
        if self.usable or self.driver == "gcs":
            return True
        tag = (self.etag or "").strip()
        return bool(tag.strip('"')) and not tag.startswith("W/")


_PROBES: dict[tuple[str, str], Probe] = {}
_PROBE_LOCK = threading.Lock()


def forget_endpoint(endpoint: str) -> None:
    """Drop the ETag verdict of ``endpoint``: the next use probes again (a store replaced at
    the same URL, as a test proxy's port reused by the next proxy)."""
    with _PROBE_LOCK:
        for key in [k for k in _PROBES if k[1].rstrip("/") == endpoint.rstrip("/")]:
            del _PROBES[key]


def _version_text(driver: str, generation: bytes) -> str:
    body = generation[1:]  # tensorstore prefixes a flags byte
    if driver == "gcs" and len(body) == 8:
        return str(int.from_bytes(body, "little"))
    return body.decode("utf-8", "replace")


def probe(place: Place, context: ts.Context, path: str | None = None) -> Probe:
    """Whether tensorstore can revalidate what this endpoint serves; probed once per endpoint.

    One byte of ``path`` (an object of the entry's records; without one, a probe object
    written beside them and removed after) is read through tensorstore, then read again on
    the condition that its version changed: exactly the request a cache revalidation
    sends, and the one that fails with "Malformed StorageGeneration".
    """
    if place.endpoint is None:
        return Probe(True)
    driver = place.spec["driver"]
    key = (driver, place.endpoint)
    with _PROBE_LOCK:
        known = _PROBES.get(key)
    if known is not None:
        return known
    own = path is None
    if path is None:
        path = f"{place.entry.layout.records}/tensorstore-probe-{uuid.uuid4().hex}"
    url = place.entry.adapter.url(path)
    kv = ts.KvStore.open({**place.spec, "path": ""}, context=context).result()
    name = place.bucket_key(path)
    generation = b""
    try:
        if own:
            try:
                kv.write(name, b"durable: can tensorstore revalidate here?").result()
            except ValueError as exc:
                named = _refused(place, url, exc)
                if named is None:
                    raise
                raise named from exc
        first = _first_byte(kv, name)
        if first.state != "value":
            return Probe(True)  # nothing to judge by: probe again at the next use
        generation = first.stamp.generation
        _first_byte(kv, name, if_not_equal=generation)
        found = Probe(True, _version_text(driver, generation), url, driver=driver)
    except Exception as exc:
        text = str(exc)
        if MALFORMED in text:
            found = Probe(False, _version_text(driver, generation), url, MALFORMED, driver)
        elif "etag not found" in text.lower():
            found = Probe(False, None, url, "no ETag header in the response", driver)
        else:
            raise
    finally:
        if own:
            with contextlib.suppress(Exception):
                kv.write(name, None).result()
    with _PROBE_LOCK:
        return _PROBES.setdefault(key, found)


def _refused(place: Place, url: str, exc: ValueError) -> OSError | None:
    """The error naming the entry and the bucket of a store that refused the probe's PUT
    (the writer's first request): tensorstore's own text named neither ("NOT_FOUND: Not
    Found [http_response_code='404']" for a mistyped GCS bucket). None: not such a refusal
    (an ETag problem is the probe's verdict, anything else stays tensorstore's)."""
    text = str(exc)
    status = text.split(":", 1)[0]
    if status not in ("NOT_FOUND", "PERMISSION_DENIED"):
        return None
    said = text.split(" [", 1)[0]  # tensorstore's payload (the response body) follows
    bucket = place.spec.get("bucket")
    if status == "NOT_FOUND":
        return FileNotFoundError(f"{place.entry.url}: no such bucket {bucket!r} (a PUT of "
                                 f"{url} answered {said})")
    return PermissionError(f"{place.entry.url}: writing into bucket {bucket!r} is not "
                           f"allowed with these credentials (a PUT of {url} answered {said})")


def _first_byte(kv: ts.KvStore, name: str, **condition: Any) -> Any:
    """One byte of ``name`` (a read of the whole object where the store ignores Range).

    A store or gateway that ignores Range answers 200 with the whole object, which
    tensorstore refuses for a ranged read ("Requested byte range [0, 1) was ignored by
    server", naming neither object nor store): the probe failed every open and write there,
    where plain tensorstore reads and writes unsharded arrays (whole chunks) fine."""
    try:
        return kv.read(name, byte_range=slice(0, 1), **condition).result()
    except ValueError as exc:
        if "was ignored by server" not in str(exc):
            raise
    return kv.read(name, **condition).result()  # what that store sent anyway: all of it


def etag_error(place: Place, probe: Probe | None, doing: str,
               after: str | None = None) -> UnusableETagError:
    driver = place.spec["driver"]
    what = "generation" if driver == "gcs" else "ETag"
    if probe is None or probe.url is None:
        seen = f"versions tensorstore cannot use ({MALFORMED})"
    elif probe.etag is None:
        seen = f"no {what} for {probe.url} ({probe.why})"
    else:
        seen = f"{what} {probe.etag!r} for {probe.url}"
    need = ("a non-zero generation in x-goog-generation" if driver == "gcs" else
            'strong ETags, a double-quoted string like "abc" (not unquoted, weak W/"abc" or '
            "empty)")
    if after is None and probe is not None and not probe.readable:
        after = ("durable cannot pin its own reads to it either: nothing can be read or "
                 "committed on this store as it answers")
    elif after is None:
        after = ("Meanwhile durable.tensorstore.open reads it with a cache private to each "
                 "handle, and a write works as long as it needs no conditional request "
                 "(each chunk written once; no resize, no update=True)")
    return UnusableETagError(
        f"{place.endpoint}: the store answered {seen}; tensorstore keeps it as the "
        f"object's version and cannot send a conditional request with it, so {doing} "
        "(what tensorstore reports as 'Malformed StorageGeneration', incident 000). "
        f"tensorstore needs {need}: fix the store or the gateway in front of it. {after}",
        endpoint=str(place.endpoint), etag=None if probe is None else probe.etag,
        url=None if probe is None else probe.url)
