"""tensorstore zarr3 arrays as entries: committed whole, never read stale (extra tensorstore).

Incident 000: levanter opened zarr3 arrays through one process-wide `tensorstore.Context`
with a large ``cache_pool`` and ``recheck_cached_data`` off. After another job rewrote an
array, cached handles served the old chunks (or new metadata over old chunks), and on
Cloudflare R2, whose ETags tensorstore cannot use, re-opening died with the opaque
``Malformed StorageGeneration``. Here:

- `kvstore_spec` turns an fsspec URL and ``storage_options`` into a tensorstore kvstore spec
  (``file``, ``memory``, ``s3`` with custom endpoints and credentials, ``gs``/``gcs``).
- `writing` yields a `TensorStoreWriter` inside `Entry.writing`: arrays are created or
  opened with `TensorStoreWriter.open`; on clean exit every tracked write is waited for,
  the manifest is built and the marker committed. A failed or killed write leaves the entry
  without a marker: INCOMPLETE (or ABSENT), never COMPLETE.
- `open` hands out a TensorStore only for a COMPLETE entry whose listing matches its
  manifest (``deep=True``: every object's CRC32C), and ties tensorstore's cache
  revalidation to the commit: ``recheck_cached_data``/``recheck_cached_metadata`` are set
  to the time this process first saw the current commit, so a shared ``cache_pool`` keeps
  serving unchanged data without a request, but nothing cached before the commit (old data,
  old metadata, or a rewrite in progress) is served without a conditional re-read.
- `read` is `open` and a read in one call, returning NumPy values only if the commit is
  still the one opened after the last chunk was read (all of one commit, which a handle
  kept across another process's rewrite cannot promise), its listing checked beside the
  chunks' reads.
- Stores whose ETags/generations tensorstore cannot revalidate with are found by a probe,
  once per endpoint and process: one byte of an object (the marker, or a probe object a
  writer puts beside the records) read through tensorstore, then read again conditionally
  on the version it came with, which is the request a revalidation sends. Such a store
  answers with `UnusableETagError`, naming the endpoint, the ETag and what to do, instead
  of tensorstore's "Malformed StorageGeneration"; where the ETag still pins a read (an
  unquoted one, a GCS emulator's generation 0), `open` reads with a cache private to the
  handle and no conditional request, and writes work while they need none.

`write` stores every chunk, all fill value or not (so a chunk lost later is an error when
read, never fill values). Across a network (S3, GCS) its commit lists no chunk
(`EntryWriter.commit_from_records`) and reads none back: chunks of a size the codecs fix
(the default ones) are put by tensorstore's own write and recorded from the metadata;
others are encoded by the writer on a memory copy of the array, a few rows of chunks at a
time, and put through tensorstore's client while the next are encoded, each recorded as it
goes. Both put the very objects tensorstore's write puts.

Checksums: new arrays get the zarr v3 ``crc32c`` codec as their last codec (inside the
shards' chunks for sharded arrays), so tensorstore and zarr-python check every chunk on
every read. Opt out with ``checksum_codec=False``. An object that ends with the CRC32C of
the bytes before it has a whole-object CRC32C that is always ``0x48674bc7`` (the CRC-32C
residue), so the manifest records such chunks from the listing's sizes alone, without
reading anything back: a chunk damaged before the commit then fails deep verification
instead of being blessed by a checksum of the damaged bytes. Chunks `write` encodes
itself (`_stream`) also keep their last 4 bytes in the record (`ObjectRecord.tail`, the
chunk's own checksum), so another chunk of the same size put over one is caught too. A
new array's zarr.json is put by the writer itself (create-only) and recorded as it is
written; other objects (metadata rewritten since, shards, chunks without the codec) are
read back once at commit.

``memory://`` URLs name tensorstore's in-memory kvstore (one per process, shared by every
call here), not fsspec's memory filesystem, which tensorstore cannot reach; use
`entry_for` for the `Entry` of such a URL.
"""
from durable._extras import require

require("durable.tensorstore", "tensorstore", "tensorstore", "numpy")

from durable._tensorstore_kv import UnusableETagError, entry_for, kvstore_spec
from durable._tensorstore_reading import open, read
from durable._tensorstore_writing import TensorStoreWriter, write, writing

__all__ = [
    "TensorStoreWriter",
    "UnusableETagError",
    "entry_for",
    "kvstore_spec",
    "open",
    "read",
    "write",
    "writing",
]
