"""The zarr v3 crc32c codec: put into new arrays, and what it tells a manifest unread.

A chunk whose last codec is crc32c ends with the CRC32C of the bytes before it, so its
whole-object CRC32C is a constant, `CRC32C_RESIDUE`, whatever its contents: the manifest can
record it from a listing's size alone. A shard (``sharding_indexed``) whose inner chunks and
index end with crc32c is a concatenation of such codewords, so its CRC32C follows from its
index alone (one small ranged read) by combining the parts' residues. Private to
`durable.tensorstore`.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from typing import Any

import tensorstore as ts

from durable._checksum import CRC32C_RESIDUE, crc32c, crc_to_hex
from durable._errors import IntegrityError
from durable.adapters.base import Adapter, ObjectInfo

__all__ = ["CRC32C_RESIDUE", "array_metadata", "checksummed", "chunk_pattern", "every_chunk",
           "full_shard_size", "grid_counts", "grid_keys", "is_codeword", "is_sharded",
           "shard_crc", "shard_layout"]

CRC32C_CODEC = {"name": "crc32c"}


def _codec_name(codec: Any) -> Any:
    """A codec's name, in the long form ({"name": ...}) or the short one (a string)."""
    if isinstance(codec, dict):
        return codec.get("name")
    return codec if isinstance(codec, str) else None


def _with_crc32c(codecs: list[Any]) -> list[Any]:
    """The chain with crc32c last, or last in the chunks of the shards of a sharded chain."""
    if codecs and _codec_name(codecs[-1]) == "crc32c":
        return codecs
    if codecs and _codec_name(codecs[-1]) == "sharding_indexed" and isinstance(
            codecs[-1], dict):
        conf = dict(codecs[-1].get("configuration") or {})
        conf["codecs"] = _with_crc32c(list(conf.get("codecs") or [{"name": "bytes"}]))
        return [*codecs[:-1], {**codecs[-1], "configuration": conf}]
    return [*codecs, CRC32C_CODEC]


def checksummed(spec: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Put crc32c in the codecs of a new array: in its metadata, its codec or its schema."""
    meta = spec.get("metadata")
    if isinstance(meta, dict) and meta.get("codecs") is not None:
        spec["metadata"] = {**meta, "codecs": _with_crc32c(list(meta["codecs"]))}
        return
    for name in ("codec", "schema"):
        given = kwargs.get(name)
        if given is None:
            continue
        doc = dict(given if isinstance(given, dict) else given.to_json())
        codec = doc if name == "codec" else doc.get("codec")
        if codec is None:
            continue
        codec = {**codec, "codecs": _with_crc32c(list(codec.get("codecs") or []))}
        kwargs[name] = ts.CodecSpec(codec) if name == "codec" else ts.Schema(
            {**doc, "codec": codec})
        return
    # A constraint, not a chain: tensorstore puts it after the compressor it picks, and in
    # the chunks of the shards when the chunk layout asks for sharding.
    kwargs["codec"] = ts.CodecSpec({"driver": "zarr3", "codecs": [CRC32C_CODEC]})


def array_metadata(data: bytes) -> dict[str, Any] | None:
    """A zarr v3 array's metadata document, or None for anything else."""
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply
        return None
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get(
            "node_type") != "array" or not isinstance(meta.get("codecs"), list):
        return None
    return meta


def is_sharded(meta: dict[str, Any]) -> bool:
    """Whether the array's chunks are shards (a ``sharding_indexed`` codec), any layout."""
    codecs = meta.get("codecs")
    return isinstance(codecs, list) and any(_codec_name(c) == "sharding_indexed"
                                            for c in codecs)


def is_codeword(meta: dict[str, Any]) -> bool:
    """Whether every chunk of the array ends with its own CRC32C (crc32c is its last codec)."""
    return bool(meta["codecs"]) and _codec_name(meta["codecs"][-1]) == "crc32c"


def _key_encoding(meta: dict[str, Any]) -> tuple[str, str] | None:
    """(``default`` or ``v2``, its separator) of an array's chunk keys; None if unknown."""
    encoding = meta.get("chunk_key_encoding") or {"name": "default"}
    sep = (encoding.get("configuration") or {}).get("separator") if isinstance(
        encoding, dict) else None
    kind = _codec_name(encoding)
    if kind == "default":
        return kind, sep or "/"
    if kind == "v2":
        return kind, sep or "."
    return None


def chunk_pattern(prefix: str, meta: dict[str, Any]) -> re.Pattern[str] | None:
    """The keys of the chunks (shards, for a sharded array) of the array at ``prefix``."""
    rank = len(meta.get("shape") or [])
    known = _key_encoding(meta)
    if known is None:
        return None
    kind, sep = known
    if kind == "default":
        body = "c" + (re.escape(sep) + r"\d+") * rank
    else:
        body = re.escape(sep).join([r"\d+"] * rank) if rank else "0"
    return re.compile(re.escape(prefix) + body)


# Data types whose every value takes the same bytes, and how many: under the ``bytes`` codec
# a chunk of them is exactly (values per chunk) x this, whatever the values.
_ITEM_BYTES = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2,
               "bfloat16": 2, "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8,
               "float64": 8, "complex64": 8, "complex128": 16}


def grid_counts(meta: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """(chunk shape, chunks along each dimension) of an array on a regular grid; else None."""
    grid = meta.get("chunk_grid")
    if not isinstance(grid, dict) or grid.get("name", "regular") != "regular":
        return None
    try:
        chunk = [int(c) for c in grid["configuration"]["chunk_shape"]]
        return chunk, [-(-int(n) // c) for n, c in zip(meta["shape"], chunk, strict=True)]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def grid_keys(prefix: str, meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]] | None:
    """The key and grid index of every chunk position inside the bounds of the array at
    ``prefix`` (a regular grid, a chunk key encoding known here); else None."""
    found, known = grid_counts(meta), _key_encoding(meta)
    if found is None or known is None:
        return None
    counts, (kind, sep) = found[1], known
    if kind == "v2" and not counts:
        return [(prefix + "0", ())]  # a rank-0 array's one chunk
    head = ["c"] if kind == "default" else []
    return [(prefix + sep.join([*head, *map(str, at)]), at)
            for at in itertools.product(*(range(n) for n in counts))]


def every_chunk(prefix: str, meta: dict[str, Any],
                ) -> tuple[list[tuple[str, tuple[int, ...]]], list[int], int] | None:
    """Every chunk position of the array at ``prefix`` (its key and grid index), the chunk
    shape, and the size every chunk has once encoded, where the codecs make that size
    fixed: a regular grid, a fixed-size data type, the ``bytes`` codec (after at most a
    ``transpose``) and then ``crc32c`` alone. zarr v3 stores an edge chunk whole, so every
    chunk is that size. None for any other array (compressed or sharded chunks vary)."""
    names = [_codec_name(c) for c in meta.get("codecs") or []]
    if names and names[0] == "transpose":
        names = names[1:]
    item = _ITEM_BYTES.get(meta.get("data_type"))  # type: ignore[arg-type]
    found = grid_counts(meta)
    keys = grid_keys(prefix, meta)
    if names != ["bytes", "crc32c"] or item is None or found is None or keys is None:
        return None
    return keys, found[0], math.prod(found[0]) * item + 4


def full_shard_size(meta: dict[str, Any], at: tuple[int, ...]) -> int | None:
    """The size of the shard at grid index ``at`` of the sharded array ``meta`` when it holds
    every inner chunk inside the array's bounds (tensorstore writes none outside them), where
    the codecs fix it: inner chunks of a fixed size (a fixed-size data type, ``bytes`` after
    at most a ``transpose``, then ``crc32c``) and a crc32c index with an entry for every
    inner position. A shard holding fewer (those left out as fill value) is smaller, so one
    of this size holds them all. None for any other array."""
    layout = shard_layout(meta)
    if layout is None or len(meta["codecs"]) != 1:
        return None
    conf = meta["codecs"][-1].get("configuration") or {}
    names = [_codec_name(c) for c in conf.get("codecs") or []]
    if names and names[0] == "transpose":
        names = names[1:]
    item = _ITEM_BYTES.get(meta.get("data_type"))  # type: ignore[arg-type]
    if names != ["bytes", "crc32c"] or item is None:
        return None
    try:
        inner = [int(n) for n in conf["chunk_shape"]]
        outer = [int(n) for n in meta["chunk_grid"]["configuration"]["chunk_shape"]]
        shape = [int(n) for n in meta["shape"]]
        # Inner chunks of this shard that reach inside the bounds, along each dimension
        inside = [-(-min(o, n - i * o) // c) for i, o, n, c in zip(at, outer, shape, inner,
                                                                     strict=True)]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return math.prod(inside) * (math.prod(inner) * item + 4) + 16 * layout[0] + 4


_EMPTY = 2**64 - 1  # an absent inner chunk's offset and length in a shard index
_ZEROS = bytes(1 << 20)


def _extend(crc: int, n: int) -> int:
    """The CRC32C of bytes whose CRC32C is ``crc``, followed by ``n`` zero bytes."""
    view = memoryview(_ZEROS)
    while n > 0:
        crc = crc32c(view[:min(n, len(_ZEROS))], crc)
        n -= len(_ZEROS)
    return crc


def shard_layout(meta: dict[str, Any]) -> tuple[int, bool] | None:
    """(inner chunks per shard, index at the end) of an array whose shards are made of
    crc32c codewords with a plain little-endian index that is one too; None otherwise."""
    codecs = meta.get("codecs") or []
    if not codecs or not isinstance(codecs[-1], dict) or _codec_name(
            codecs[-1]) != "sharding_indexed":
        return None
    conf = dict(codecs[-1].get("configuration") or {})
    inner = conf.get("codecs") or []
    index = [_codec_name(c) for c in conf.get("index_codecs") or []]
    endian = [(c.get("configuration") or {}).get("endian", "little") if isinstance(c, dict)
              else "little" for c in conf.get("index_codecs") or []
              if _codec_name(c) == "bytes"]
    try:
        outer = meta["chunk_grid"]["configuration"]["chunk_shape"]
        per = [o // i for o, i in zip(outer, conf["chunk_shape"], strict=True)]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if (not inner or _codec_name(inner[-1]) != "crc32c" or index != ["bytes", "crc32c"]
            or endian != ["little"]):
        return None
    return math.prod(per), conf.get("index_location", "end") == "end"


def shard_crc(adapter: Adapter, info: ObjectInfo, chunks: int, at_end: bool) -> int | None:
    """The CRC32C of a shard from its index alone, or None if the index does not show a
    shard made of exactly its inner chunks and itself, back to back (then it is read).
    IntegrityError if the index fails its own CRC32C."""
    size = 16 * chunks + 4
    if info.size < size:
        return None
    with adapter.open_read(info.path, info) as f:
        f.seek(info.size - size if at_end else 0)
        index = f.read(size)
    if len(index) != size or crc32c(index) != CRC32C_RESIDUE:
        # Its index fails its own checksum: every reader would refuse this shard, so the
        # commit must not record it (reading it back would checksum the damage in).
        url = adapter.url(info.path)
        raise IntegrityError(f"{url}: the shard index ({size} bytes at the "
                             f"{'end' if at_end else 'start'}) fails its CRC32C: the shard "
                             "is damaged; not committing", url=url,
                             expected=crc_to_hex(CRC32C_RESIDUE),
                             found=crc_to_hex(crc32c(index)))
    fields = struct.unpack(f"<{2 * chunks}Q", index[:-4])
    parts = sorted((o, n) for o, n in zip(fields[::2], fields[1::2], strict=True)
                   if (o, n) != (_EMPTY, _EMPTY))
    start = 0 if at_end else size
    crc = 0 if at_end else CRC32C_RESIDUE  # the CRC32C of what precedes the first chunk
    for offset, length in parts:
        if offset != start or length < 4:
            return None  # a gap, an overlap or a stray byte: nothing to combine
        # crc(A || B) = crc(A) extended by |B| zeros ^ crc(B) ^ crc(|B| zeros)
        crc = _extend(crc, length) ^ CRC32C_RESIDUE ^ _extend(0, length)
        start += length
    if at_end:
        if start != info.size - size:
            return None
        crc = _extend(crc, size) ^ CRC32C_RESIDUE ^ _extend(0, size)
    elif start != info.size:
        return None
    return crc
