"""One adapter per store type, found by fsspec protocol.

The core only ever asks for `resolve(url, storage_options)`; it never imports a cloud
library. Adapters for stores whose client is an optional extra are named here as strings
and imported on first use.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

from durable._extras import PROTOCOL_EXTRAS, missing
from durable.adapters.base import (
    Adapter,
    AtomicFile,
    Capabilities,
    ObjectInfo,
    refuse_renamed,
)

__all__ = [
    "Adapter",
    "AtomicFile",
    "Capabilities",
    "ObjectInfo",
    "adapter_for_fs",
    "refuse_ambiguous",
    "register_adapter",
    "resolve",
]

_REGISTRY: dict[str, str] = {
    "file": "durable.adapters.local:LocalAdapter",
    "local": "durable.adapters.local:LocalAdapter",
    "memory": "durable.adapters.memory:MemoryAdapter",
    "s3": "durable.adapters.s3:S3Adapter",
    "s3a": "durable.adapters.s3:S3Adapter",
    "gs": "durable.adapters.gcs:GCSAdapter",
    "gcs": "durable.adapters.gcs:GCSAdapter",
    "abfs": "durable.adapters.azure:AzureAdapter",
    "abfss": "durable.adapters.azure:AzureAdapter",
    "az": "durable.adapters.azure:AzureAdapter",
}
_GENERIC = "durable.adapters.generic:GenericAdapter"
_CACHE: dict[tuple[int, str | None], Adapter] = {}
_LOCK = threading.Lock()


def register_adapter(protocol: str, target: str | type[Adapter]) -> None:
    """Use ``target`` (a class, or "module:Class") for filesystems of ``protocol``."""
    if isinstance(target, type):
        target = f"{target.__module__}:{target.__qualname__}"
    _REGISTRY[protocol] = target
    with _LOCK:
        _CACHE.clear()


def _load(target: str) -> type[Adapter]:
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type) and issubclass(cls, Adapter)
    return cls


def adapter_for_fs(fs: Any, scheme: str | None = None) -> Adapter:
    """The adapter for an fsspec filesystem instance (one per instance and scheme, reused).

    ``scheme``: the one the caller's URL used (``az``), which every URL the adapter shows
    then uses; ignored where it is not one of the filesystem's protocols, or is its first.
    """
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if scheme is not None:
        scheme = scheme.lower()
        if scheme not in protocols[1:]:
            scheme = None
    key = (id(fs), scheme)
    with _LOCK:
        adapter = _CACHE.get(key)
        if adapter is not None and adapter.fs is fs:
            return adapter
    target = next((_REGISTRY[p] for p in protocols if p in _REGISTRY), _GENERIC)
    adapter = _load(target)(fs)
    adapter.scheme = scheme
    with _LOCK:
        _CACHE[key] = adapter
    return adapter


def resolve(url: str | os.PathLike[str],
            storage_options: dict[str, Any] | None = None) -> tuple[Adapter, str]:
    """(adapter, path) for a URL, the way fsspec and xarray name places."""
    from fsspec.core import url_to_fs

    text = os.fspath(url)
    if not text:
        raise ValueError("an empty URL names no object (it would be the current directory)")
    if text[:9].lower() == "durable::":
        # Resolved, it was the generic adapter over durable's own fsspec layer: an
        # atomic_write published through it, then failed to write its marker ("paths
        # inside '.durable' directories hold durable's records"), saying nothing of why.
        raise ValueError(f"{text!r}: a durable:: URL is for code that writes through "
                         "fsspec (pandas, numpy, zarr); durable's own API records and "
                         f"verifies by itself: give it the store's URL, {text[9:]!r}")
    # The scheme of the innermost URL of a chain ("simplecache::az://c/k"): the user's own.
    scheme, sep, _ = text.rpartition("::")[2].partition("://")
    try:
        fs, path = url_to_fs(text, **(storage_options or {}))
    except ImportError as exc:
        # fsspec says "Install s3fs to access S3": the extra also brings what the adapter
        # needs besides the filesystem, at versions it was tested with.
        known = PROTOCOL_EXTRAS.get(scheme.lower()) if sep else None
        if known is None:
            raise
        raise missing(repr(text), *known) from exc
    adapter = adapter_for_fs(fs, scheme if sep else None)
    if "://" in text:
        refuse_ambiguous(adapter, path, text)
    return adapter, path


def refuse_ambiguous(adapter: Adapter, path: str, text: str) -> None:
    """ValueError for a path with '.', '..' or empty segments on an object store, which
    keeps "a/../b" and "a//b" as literal keys where a local disk resolves them: the same
    URL would name different objects on the two."""
    if "file" in type(adapter).protocols:
        return
    refuse_renamed(text.rpartition("::")[2], path, type(adapter.fs).__name__)
    parts = path.split("/")
    if any(p in (".", "..") for p in parts) or "" in parts[1:-1]:
        raise ValueError(f"{text!r}: '.', '..' and empty segments mean different places "
                         "on an object store and on a disk; give the path without them")
