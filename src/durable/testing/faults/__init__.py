"""A fault-injecting reverse proxy for S3-compatible endpoints (for tests only).

:class:`FaultProxy` listens on ``127.0.0.1`` on a free port and forwards every request to an
upstream S3 endpoint (a moto server in this project's tests). Clients point their
``endpoint_url`` at :attr:`FaultProxy.url`. The request line, the headers (``Host`` included)
and the body are forwarded byte for byte as received, so SigV4 signatures stay valid; only a
fault that deliberately changes a request touches it. Responses are streamed back.

Faults are selected at run time with :meth:`FaultProxy.add` / :meth:`FaultProxy.inject` and
removed with :meth:`FaultProxy.clear`. Each fault has a :class:`Match` (methods, path regex,
key substring, query predicate, arbitrary predicate) and a ``times`` budget (``None`` means
unlimited). Faults apply in the order they were added; several may apply to one request
(for example a delay and an ETag rewrite), and the first *terminal* one (an error answer,
a dropped connection) ends the exchange.

Each kind has a class and a factory function of the kind's name (``truncate_body(100,
key="b/k", times=1)``); every factory, like :meth:`FaultProxy.inject`, takes the keywords
of :class:`Scope` besides the kind's own.

Kinds (see each class for details):

=======================  ===========================================================
``truncate_body``        GET body cut short; the upstream's Content-Length is kept,
                         the connection is closed early.
``short_object``         a persistently short object: HEAD (and listings) report the
                         full size, GETs serve data as if the tail (``missing_bytes``,
                         or the last ``parts_missing`` parts of ``part_size``) was lost.
``drop_part_bytes``      UploadPart body cut to its first ``keep`` bytes before it is
                         forwarded (Content-Length adjusted); the client sees success.
``corrupt_part_bytes``   UploadPart body bytes flipped before forwarding, same length.
``error``                an S3 XML error document (403/500/503/...) instead of, or after,
                         forwarding.
``error_body_with_200``  the same XML served as a 200 object body (a gateway or CDN
                         that cached an error page as the object).
``rewrite_etag``         ETag header (and ``<ETag>`` elements in XML bodies) made
                         unquoted, weak, empty, absent, or rewritten by a callable.
``rewrite_body``         a response body replaced by a function of it (a store that
                         answers wrongly but well-formed: a listing going in circles).
``delay``                sleep before forwarding, or between response head and body.
``drop_connection``      close the socket without a response, after the upstream
                         applied the request, or after ``after_bytes`` body bytes.
``strip_headers``        remove response headers by name (default ``x-amz-checksum-*``:
                         a store without flexible checksums).
=======================  ===========================================================

Every exchange is logged in :attr:`FaultProxy.requests` (:class:`RequestRecord`).

It works in front of the GCS emulators and azurite as well (tests/test_gcs.py,
tests/test_azure.py): gcp-storage-emulator and fake-gcs-server build a resumable session's
URI from the Host the request named, so every piece passes the proxy; azurite's SharedKey
signature does not cover the host. ``error`` answers S3's XML document on every store
(gcsfs and the Azure SDK raise it as the status it carries); a GCS JSON error document
served as 200 is ``rewrite_body``. (Measured against gcp-storage-emulator 2026.7.19,
fake-gcs-server from its Python wrapper wheel, azurite 3.35.)

What the clients do on their own (measured against moto 5.2.5 with botocore 1.43,
aiobotocore 3.10, s3fs/fsspec 2026.9.0, awscrt installed; pinned in tests/test_faults.py):

* A body shorter than its Content-Length (``truncate_body``, ``short_object`` "cut",
  ``drop_connection(after_bytes=)``) is always an error: botocore raises
  ``ResponseStreamingError`` (no retry); s3fs retries the GET 5 times, then lets aiohttp's
  ``ClientPayloadError`` escape (not an ``OSError``). A one-off cut is invisible to s3fs.
* A consistently short body (``short_object`` "consistent") is returned silently by every
  client unless botocore can check a full-object ``x-amz-checksum-*`` header (single PUT;
  not a multipart object's composite checksum; not a store without checksums). s3fs raises
  ``OSError(EINVAL)`` only for a read that starts past the short end.
* An error document served as 200 is returned as the data by every client, even when HEAD
  reported another size.
* 403 raises (``ClientError`` / ``PermissionError``); 500/503 and dropped connections are
  retried, so a transient one is invisible.
* fsspec caches: ``simplecache`` keeps the partial file of a failed download and serves it
  as the whole file afterwards; ``blockcache`` keeps the failed block as zeros; ``filecache``
  keeps nothing from a failed download; all three keep short or error bodies that came
  without an error.

Example::

    with FaultProxy(upstream=moto_url) as proxy:
        fs = s3fs.S3FileSystem(endpoint_url=proxy.url)
        proxy.inject("truncate_body", keep=100, key="bucket/data.bin", times=1)
        ...
        assert proxy.count(method="GET", key="data.bin") == 2
"""

from durable.testing.faults._exchange import RequestRecord
from durable.testing.faults._http import Headers as Headers
from durable.testing.faults._kinds import (
    CorruptPartBytes,
    Delay,
    DropConnection,
    DropPartBytes,
    Error,
    ErrorBodyWith200,
    Fault,
    Match,
    RequestInfo,
    RewriteBody,
    RewriteEtag,
    Scope,
    ShortObject,
    StripHeaders,
    TruncateBody,
    corrupt_part_bytes,
    delay,
    drop_connection,
    drop_part_bytes,
    error,
    error_body_with_200,
    rewrite_body,
    rewrite_etag,
    s3_error_document,
    short_object,
    strip_headers,
    truncate_body,
)
from durable.testing.faults._kinds import EtagStyle as EtagStyle
from durable.testing.faults._kinds import QueryPredicate as QueryPredicate
from durable.testing.faults._proxy import FaultProxy

# In the order of the reference page (docs/reference/testing.md sorts by __all__): what a
# fault matches, the fault kinds, the proxy and its log, then the factories. Headers,
# EtagStyle and QueryPredicate (imported "as" themselves above) are named in public
# signatures and importable from here, as they were from the single module; never in __all__.
__all__ = [
    "RequestInfo",
    "Match",
    "Fault",
    "TruncateBody",
    "ShortObject",
    "DropPartBytes",
    "CorruptPartBytes",
    "Error",
    "ErrorBodyWith200",
    "RewriteEtag",
    "RewriteBody",
    "Delay",
    "DropConnection",
    "StripHeaders",
    "RequestRecord",
    "FaultProxy",
    "s3_error_document",
    "Scope",
    "truncate_body",
    "short_object",
    "drop_part_bytes",
    "corrupt_part_bytes",
    "error",
    "error_body_with_200",
    "rewrite_etag",
    "rewrite_body",
    "delay",
    "drop_connection",
    "strip_headers",
]
