"""How `durable.cached` stores a result, chosen by its type, and reads it back verified.

A result is stored in its entry under ``value.<name>``, where ``name`` is the serializer's
(``value.npy``, ``value.parquet``, ``value.zarr/...``): the manifest says which serializer
reads it back, so a hit costs no extra request to find out. The built-in ones:

=================  ==================================  ==================================
name               values                              stored as
=================  ==================================  ==================================
``bin``            ``bytes``, ``bytearray``            the bytes
``npy``            NumPy arrays (not of objects)       ``numpy.save``, no pickle
``parquet``        pandas ``DataFrame``                ``DataFrame.to_parquet``
``zarr``           xarray ``Dataset``                  zarr, through `durable.xarray`
``dataarray.zarr`` xarray ``DataArray``                the same, as a one-variable dataset
``json``           JSON values (dict with str keys,    canonical JSON
                   list, str, int, float, bool, None)
``pkl``            anything, with ``pickle=True`` only pickle
=================  ==================================  ==================================

`register_serializer` adds one (checked before the built-ins). Every read is verified:
the bytes must have the size and CRC32C the manifest recorded (IntegrityError otherwise,
never a silent recompute); a zarr result is opened through `durable.xarray`, which checks
every chunk it reads.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import pickle
import re
import sys
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, cast

from durable._checksum import crc32c, crc_to_hex
from durable._entry import Entry
from durable._errors import IntegrityError, MarkerError, UnsupportedError
from durable._protocol import Manifest, ObjectRecord
from durable._writer import EntryWriter
from durable.adapters import Adapter

__all__ = ["Serializer", "choose", "load_value", "register_serializer"]

_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")
_DATAARRAY_VAR = "__xarray_dataarray_variable__"  # xarray's own name for it in files
_DATAARRAY_NAME = "__xarray_dataarray_name__"  # xarray's: the name it had, in the attrs


class Serializer(ABC):
    """Writes a value into an entry under ``value.<name>`` and reads it back verified."""

    name: str

    @abstractmethod
    def accepts(self, value: Any) -> bool: ...

    @abstractmethod
    def dump(self, value: Any, writer: EntryWriter, key: str) -> None: ...

    @abstractmethod
    def load(self, entry: Entry, key: str, manifest: Manifest) -> Any:
        """The value under ``key``, read verified against ``manifest`` (the committed
        one, or on a miss the writer's own records of what it just wrote)."""


def _read(adapter: Adapter, path: str) -> bytes | bytearray | None:
    # The info and a reader of that version (S3: one GET; a local file: opened, then
    # fstat-ed), read into a buffer of ours: the bytes land once, where a NumPy array can
    # use them as they are (read() + copy costs 5x on 1 MiB).
    opened = adapter.open_whole(path)
    if opened is None:
        return None
    info, f = opened
    buf = bytearray(info.size + 1)
    got = 0
    with f, memoryview(buf) as view:
        while got < len(buf):
            n = cast(Any, f).readinto(view[got:])  # BinaryIO's stub lacks readinto
            if not n:
                break
            got += n
    del buf[got:]  # one byte past the stat: a longer object shows as longer
    return buf


def read_recorded(entry: Entry, key: str, record: ObjectRecord) -> bytes | bytearray:
    """The object's bytes, only if they are the size and CRC32C the manifest recorded."""
    path = f"{entry.path}/{key}"
    url = entry.adapter.url(path)
    data = _read(entry.adapter, path)
    if data is None:
        raise IntegrityError(f"{url}: recorded in the commit marker ({record.size} bytes) but "
                             "missing: the entry was changed after its commit", url=url,
                             expected=record.size, found="missing")
    found = crc32c(data)
    if len(data) != record.size or found != record.crc32c:
        raise IntegrityError(
            f"{url}: {len(data)} bytes with CRC32C {crc_to_hex(found)}, the commit marker "
            f"recorded {record.size} bytes with CRC32C {crc_to_hex(record.crc32c)} (corrupt "
            "or changed after commit; it is not recomputed over: clear the entry to do so)",
            url=url, expected=(record.size, crc_to_hex(record.crc32c)),
            found=(len(data), crc_to_hex(found)))
    return data


class BytesSerializer(Serializer):
    """One object: ``dumps(value) -> bytes`` and ``loads(bytes) -> value``; the bytes are
    verified before ``loads`` sees them."""

    def __init__(self, name: str, accepts: Callable[[Any], bool],
                 dumps: Callable[[Any], bytes], loads: Callable[[Any], Any], *,
                 buffers: bool = False) -> None:
        self.name = name
        self._accepts = accepts
        self._dumps = dumps
        self._loads = loads
        self._buffers = buffers  # loads takes a bytearray too (else it is given bytes)

    def accepts(self, value: Any) -> bool:
        return self._accepts(value)

    def encode(self, value: Any) -> bytes:
        """The bytes ``dump`` writes: a value that cannot be stored fails here, before
        anything is written (or cleared)."""
        data = self._dumps(value)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"serializer {self.name!r} returned {type(data).__name__}, "
                            "not bytes")
        return bytes(data)

    def dump(self, value: Any, writer: EntryWriter, key: str) -> None:
        writer.write_bytes(key, self.encode(value))

    def load(self, entry: Entry, key: str, manifest: Manifest) -> Any:
        data = read_recorded(entry, key, manifest.objects[key])
        return self._loads(data if self._buffers or isinstance(data, bytes) else bytes(data))


def _loaded(module: str, name: str) -> Any:
    # Only a module already imported can have made the value: no import just to look.
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _is_ndarray(value: Any) -> bool:
    # Exactly ndarray: a subclass (a masked array, np.matrix, a recarray) would come back
    # as a plain ndarray, its mask or its semantics gone without a word. Not holding
    # objects anywhere: a structured dtype with an object field is not of kind "O", and
    # numpy.save refused it after the computation, even with pickle=True.
    # A memmap (np.load(..., mmap_mode="r") sliced) is an array whose bytes say all it is:
    # stored, it comes back as the plain array it holds.
    cls = _loaded("numpy", "ndarray")
    return (cls is not None and type(value) in (cls, _loaded("numpy", "memmap"))
            and not value.dtype.hasobject)


def _npy_dumps(value: Any) -> bytes:
    import numpy as np

    buf = io.BytesIO()
    with warnings.catch_warnings():
        # Field names beyond latin-1 take .npy format 3.0, which NumPy warns about at
        # every save; durable's reader reads it (`_npy_loads`).
        warnings.filterwarnings("ignore", "Stored array in format 3.0", UserWarning)
        np.save(buf, value, allow_pickle=False)
    return buf.getvalue()


def _npy_loads(data: bytes | bytearray) -> Any:
    import numpy as np

    # Only the header through a file object: BytesIO would copy a bytearray whole.
    head = bytes(data[:12])
    size = int.from_bytes(head[8:10] if head[6:7] == b"\x01" else head[8:12], "little")
    f = io.BytesIO(bytes(data[:12 + size]))
    major, _ = np.lib.format.read_magic(f)
    if major not in (1, 2):
        # Format 3 (names beyond latin-1, UTF-8 headers): read_array_header_2_0 would
        # decode its header as latin-1 and mangle the field names. np.load reads it right.
        return np.load(io.BytesIO(data), allow_pickle=False)
    read_header = (np.lib.format.read_array_header_1_0 if major == 1
                   else np.lib.format.read_array_header_2_0)
    shape, fortran, dtype = read_header(f)
    if dtype.hasobject:
        raise ValueError("a .npy of Python objects is a pickle: not loaded")
    count = math.prod(shape)
    if f.tell() + count * dtype.itemsize != len(data):
        raise ValueError(f".npy header says {shape} of {dtype}, the bytes hold "
                         f"{len(data) - f.tell()}")
    # Straight on the verified bytes (np.load on a BytesIO copies them several times);
    # writable like np.load's array: a bytearray is, bytes are copied once.
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=f.tell())
    if isinstance(data, bytes):
        flat = flat.copy()
    return flat.reshape(shape, order="F" if fortran else "C")


def _is_frame(value: Any) -> bool:
    cls = _loaded("pandas", "DataFrame")  # exactly: a subclass would come back as a frame
    return cls is not None and type(value) is cls and _parquet_changes(value) is None


def _parquet_changes(frame: Any) -> str | None:
    """What of ``frame`` parquet would bring back as something else, naming the column;
    None if nothing. Cells that are lists or tuples come back as NumPy arrays: a column of
    token lists then took ``tokens + [eos]`` for an elementwise sum, without a word."""
    for name, column in frame.items():
        if column.dtype != object:
            continue
        for cell in column:
            if type(cell) in (list, tuple):
                return (f"its column {name!r} holds Python {type(cell).__name__}s, which "
                        "parquet brings back as NumPy arrays")
    return None


def _parquet_dumps(value: Any) -> bytes:
    buf = io.BytesIO()
    value.to_parquet(buf)
    return buf.getvalue()


def _parquet_loads(data: bytes | bytearray) -> Any:
    pd = importlib.import_module("pandas")  # an optional extra, without type stubs
    return pd.read_parquet(io.BytesIO(data))


def _is_json(value: Any) -> bool:
    return _not_json(value) is None


def _not_json(value: Any, where: str = "the value", depth: int = 0) -> str | None:
    """What keeps ``value`` from being stored as JSON, naming the element; None if nothing.
    Only what comes back as it went in is JSON here: a tuple would come back a list, a
    NumPy scalar a float, so neither is."""
    if depth > 100:
        return f"{where} is nested more than 100 deep"
    if type(value) in (type(None), bool, int, float, str):
        return None
    if type(value) is list:
        items: Any = enumerate(value)
    elif type(value) is dict:
        items = value.items()
        for k in value:
            if type(k) is not str:
                return f"{where} has the key {k!r:.60}, a {_type_name(k)} (JSON keys are str)"
    else:
        return f"{where} is a {_type_name(value)}"
    for k, v in items:
        found = _not_json(v, f"{where}[{k!r:.60}]", depth + 1)
        if found is not None:
            return found
    return None


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _json_dumps(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()


class _Zarr(Serializer):
    """xarray results, written as their own zarr entry inside ours (`durable.xarray`)."""

    def __init__(self, name: str, cls: str) -> None:
        self.name = name
        self._cls = cls

    def accepts(self, value: Any) -> bool:
        cls = _loaded("xarray", self._cls)
        return cls is not None and isinstance(value, cls)

    def dump(self, value: Any, writer: EntryWriter, key: str) -> None:
        from durable.xarray import to_zarr

        ds = value
        if self._cls == "DataArray":
            if value.name is None:
                ds = value.to_dataset(name=_DATAARRAY_VAR)
            elif value.name in value.coords or value.name in value.dims:
                # A coordinate (ds["time"], ds.lat): a dataset cannot hold a variable of
                # its coordinate's name, and to_dataset refused it after the computation.
                # Stored as xarray's DataArray.to_zarr stores it: its name in the attrs.
                ds = value.to_dataset(name=_DATAARRAY_VAR)
                ds.attrs[_DATAARRAY_NAME] = value.name
            else:
                ds = value.to_dataset(name=value.name)
        url = f"{writer.url}/{key}"
        options = writer.entry.storage_options
        inner = to_zarr(ds, url, storage_options=options, **_align_chunks())
        # Its chunks are recorded in its own marker: take the records from there rather
        # than read every chunk again at our commit.
        marker = inner.read_marker()
        if marker is None or marker.manifest is None:
            raise IntegrityError(f"{url}: written, but its commit marker is missing", url=url)
        for k, rec in marker.manifest.objects.items():
            writer.record(f"{key}/{k}", rec.size, rec.crc32c, tail=rec.tail)
        # Its own records (its marker) sit in our entry too: record them, read once (the
        # cached entry commits nothing it did not record).
        adapter = writer.entry.adapter
        for k, info in adapter.list(f"{writer.path}/.durable").items():
            data = adapter.read(info.path)
            if data is not None:
                writer.record(f".durable/{k}", len(data), crc32c(data), version=info.version)

    def load(self, entry: Entry, key: str, manifest: Manifest) -> Any:
        from durable.xarray import open_zarr

        ds = open_zarr(f"{entry.url}/{key}", storage_options=entry.storage_options)
        if self._cls == "Dataset":
            return ds
        (name,) = ds.data_vars
        da = ds[name]
        return da.rename(ds.attrs.get(_DATAARRAY_NAME)) if name == _DATAARRAY_VAR else da


def _align_chunks() -> dict[str, Any]:
    """``align_chunks=True`` where xarray has it (2025.06+): a result sliced from a dataset
    opened from zarr keeps that store's ``encoding["chunks"]``, which its dask chunks no
    longer line up with, and xarray refused to write it ("would overlap multiple Dask
    chunks") after the computation. Aligning rechunks the dask data to those chunks."""
    import inspect

    import xarray

    params = inspect.signature(xarray.Dataset.to_zarr).parameters
    return {"align_chunks": True} if "align_chunks" in params else {}


PICKLE = BytesSerializer("pkl", lambda v: True,
                         lambda v: pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL),
                         pickle.loads, buffers=True)
_BUILTIN: list[Serializer] = [
    BytesSerializer("bin", lambda v: isinstance(v, bytes | bytearray), bytes, bytes),
    BytesSerializer("npy", _is_ndarray, _npy_dumps, _npy_loads, buffers=True),
    BytesSerializer("parquet", _is_frame, _parquet_dumps, _parquet_loads, buffers=True),
    _Zarr("zarr", "Dataset"),
    _Zarr("dataarray.zarr", "DataArray"),
    BytesSerializer("json", _is_json, _json_dumps, json.loads, buffers=True),
]
_registered: list[Serializer] = []
_lock = threading.Lock()


def register_serializer(types: type | tuple[type, ...], *, name: str,
                        dumps: Callable[[Any], bytes], loads: Callable[[bytes], Any]) -> None:
    """Store values of ``types`` as ``dumps(value)`` under ``value.<name>``.

    Checked before the built-in serializers, the latest registration first; registering a
    name again replaces it. Every process that reads such an entry must register the same
    name (a hit names the serializer it needs).
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"serializer name {name!r} must match {_NAME.pattern}")
    if any(s.name == name for s in (*_BUILTIN, PICKLE)):
        raise ValueError(f"{name!r} is a built-in serializer's name")
    checked = types if isinstance(types, tuple) else (types,)
    ser = BytesSerializer(name, lambda v: isinstance(v, checked), dumps, loads)
    with _lock:
        _registered[:] = [ser, *(s for s in _registered if s.name != name)]


def _all() -> list[Serializer]:
    with _lock:
        return [*_registered, *_BUILTIN, PICKLE]


def choose(value: Any, *, name: str | None, allow_pickle: bool) -> Serializer:
    """The serializer for ``value``: the one named, else the first that accepts it."""
    if name is not None:
        ser = by_name(name, allow_pickle=allow_pickle)
        if not ser.accepts(value):
            raise TypeError(f"serializer {name!r} does not take a {type(value).__qualname__}")
        return ser
    for ser in _all():
        if ser is PICKLE and not allow_pickle:
            break
        if ser.accepts(value):
            return ser
    # A list or dict that is almost JSON: the element in the way, not only the container.
    inside = f" ({_not_json(value)})" if type(value) in (list, dict) else ""
    if _loaded("pandas", "DataFrame") is type(value):
        inside = f" ({_parquet_changes(value)})"
    if _loaded("numpy", "ndarray") is type(value) and value.dtype.hasobject:
        # "return ... a NumPy array" alone reads as a contradiction for one.
        inside = f" (its dtype {value.dtype} holds Python objects, which only pickle stores)"
    raise TypeError(
        f"no serializer stores a {_type_name(value)}{inside}: return bytes, a NumPy array, "
        "a pandas DataFrame, an xarray Dataset/DataArray or a JSON value (tuples are not: "
        "they would come back as lists), register one with durable.register_serializer, "
        "or pass pickle=True")


def by_name(name: str, *, allow_pickle: bool) -> Serializer:
    if name == PICKLE.name and not allow_pickle:
        raise UnsupportedError("this entry holds a pickle; loading one runs code from the "
                               "store, so it needs pickle=True")
    for ser in _all():
        if ser.name == name:
            return ser
    raise UnsupportedError(f"no serializer named {name!r} is registered in this process "
                           "(register it with durable.register_serializer)")


def load_value(entry: Entry, manifest: Manifest, *, allow_pickle: bool) -> Any:
    """The result stored in an entry with this manifest, read verified by its serializer."""
    heads = {k.split("/", 1)[0] for k in manifest.objects}
    values = sorted(h for h in heads if h.startswith("value."))
    if len(values) != 1:
        raise MarkerError(f"{entry.url}: not a durable.cached entry (its manifest holds "
                          f"{len(values)} 'value.*' results, expected 1)", url=entry.url)
    key = values[0]
    try:
        ser = by_name(key[len("value."):], allow_pickle=allow_pickle)
    except UnsupportedError as exc:
        # Which entry: a job reading thousands was told only "this entry holds a pickle".
        raise UnsupportedError(f"{entry.url}: {exc}") from None
    return ser.load(entry, key, manifest)
