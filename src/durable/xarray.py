"""xarray datasets as commit-marked zarr entries: `to_zarr` and `open_zarr`.

The same guarantees as `durable.zarr` (metadata held back until every chunk is written,
a marker last, every chunk read checked against the manifest), for datasets in memory or
backed by dask, local or on a `distributed` cluster; xarray's own arguments pass through.

Consolidated metadata: zarr format 2 has it in its spec (``.zmetadata``); for format 3,
zarr-python writes it inline in the root ``zarr.json`` and warns on every write that it
is not in the spec yet. Without it, a plain ``xarray.open_zarr(url)`` (``consolidated=None``)
warns on every read of a format 3 store. `to_zarr` therefore consolidates by default and
silences exactly that one zarr warning, on the write only, so that both `open_zarr` and a
plain ``xarray.open_zarr`` of a committed entry read without a warning. Pass
``consolidated=False`` to write without it; `open_zarr` then opens unconsolidated.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Literal

from durable._extras import require

require("durable.xarray", "xarray", "xarray", "zarr")

import xarray as xr
import zarr

from durable._entry import Entry
from durable._lease import Lease
from durable.zarr import _V3_CONSOLIDATED_WARNING, VerifyingStore, _reconsolidate, _writing

__all__ = ["open_zarr", "to_zarr"]


def to_zarr(ds: xr.Dataset, url: str, *, storage_options: dict[str, Any] | None = None,
            mode: Literal["w", "w-", "a", "a-", "r+"] | None = None,
            overwrite: bool | None = None, resume: bool = False,
            update: bool | None = None,
            consolidated: bool = True,
            unrecorded: Literal["adopt", "error"] = "adopt", lease: Lease | None = None,
            **xarray_kwargs: Any) -> Entry:
    """Write ``ds`` to ``url`` as one entry (``Dataset.to_zarr`` inside `durable.zarr.writing`).

    ``mode`` is xarray's; by default ``"w-"`` for a new entry, ``"w"`` with
    ``resume=True`` (the killed attempt's chunks are rewritten), ``"a"`` with
    ``update=True``. ``update`` defaults to True for the modes that change an existing
    dataset (``"a"``, ``"a-"``, ``"r+"``: append_dim, region), unless ``resume``: an
    update refuses an INCOMPLETE entry, and ``resume=True`` finishes one (not with
    ``append_dim``: the rows the unfinished write added would stay fill values).
    ``mode="w"`` means what it means to xarray, replace what is there: ``overwrite``
    defaults to True with it (unless ``resume``), False otherwise. ``overwrite``, ``resume``,
    ``update``, ``unrecorded`` and ``lease`` are those of `durable.zarr.writing`. Other keyword
    arguments go to ``Dataset.to_zarr``; ``compute=False`` is refused (the commit must
    follow the writes). Returns the Entry.

    A fresh write (neither ``resume`` nor ``update``) holds the metadata in memory until
    the store goes to another process (``stage="on_handoff"`` of `durable.zarr.writing`,
    as dask.distributed pickles it): killed before, it leaves chunks and no metadata
    (INCOMPLETE); ``resume=True`` (mode ``"w"``) or ``overwrite=True`` rewrites it all.
    """
    if xarray_kwargs.get("compute", True) is False:
        raise ValueError("durable.xarray.to_zarr commits when the data is written, so it "
                         "cannot return a delayed write (compute=False); use "
                         "durable.zarr.writing() and call to_zarr(store, compute=False) "
                         "and compute inside it")
    nested = sorted(str(n) for n in ds.variables if "/" in str(n))
    if nested:
        # zarr reads "/" as a path: xarray wrote "a/b" as array b of a group a, which no
        # open_zarr of the dataset shows: committed, and read back without it, silently.
        raise ValueError(f"{url}: variable names with '/' would be written as arrays of "
                         f"nested groups and read back missing: {nested}; rename them")
    if update is None:
        # resume=True finishes an unfinished write in any mode (update=True refuses one).
        update = mode in ("a", "a-", "r+") and not resume
    if resume and xarray_kwargs.get("append_dim") is not None:
        # The unfinished write's metadata may already hold the appended length: appended
        # again, the data would go after it, and the rows between commit as fill values.
        raise ValueError(f"{url}: append_dim with resume=True would append after what the "
                         "unfinished write already added; finish it by writing those rows "
                         "again with mode='r+', region={...} and resume=True, or start "
                         "over with overwrite=True")
    if mode is None:
        mode = "w" if resume else "a" if update else "w-"
    if overwrite is None:
        overwrite = mode == "w" and not resume
    entry = Entry(url, storage_options=storage_options)
    # xarray writes every object of the entry through the store: a fresh write kept in
    # this process commits from its records, without listing the entry.
    with _writing(url, storage_options=storage_options, overwrite=overwrite, resume=resume,
                  update=update, unrecorded=unrecorded,
                  stage="eager" if resume or update else "on_handoff", sole_writer=True,
                  lease=lease) as store, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_V3_CONSOLIDATED_WARNING)
        if update and xarray_kwargs.get("append_dim") is not None:
            _refuse_uneven_append(store, ds, str(xarray_kwargs["append_dim"]), url,
                                  xarray_kwargs.get("group"))
        ds.to_zarr(store, mode=mode, consolidated=consolidated, **xarray_kwargs)
        if (update or resume) and not consolidated:
            # xarray leaves a format 2 root's .zmetadata as it was: stale shapes for
            # every reader of an entry consolidated before.
            _reconsolidate(store)
    return entry


def _refuse_uneven_append(store: Any, ds: xr.Dataset, dim: str, url: str,
                          group: str | None) -> None:
    """ValueError, before anything is written, for an append along ``dim`` that leaves
    the dataset's variables along it at two lengths: xarray appends to the variables it
    is given and creates new ones at the appended length alone, and the result, committed,
    opens nowhere ("conflicting sizes for dimension"). Refused inside the update, which
    is then given up with the last commit as it was."""
    try:
        node = zarr.open_group(store, mode="r", path=group or "")
    except FileNotFoundError:
        return  # nothing there yet: xarray writes the dataset whole
    stored = set()
    for name, array in node.arrays():
        dims = (array.metadata.dimension_names if array.metadata.zarr_format == 3
                else array.attrs.get("_ARRAY_DIMENSIONS"))
        if isinstance(dims, list | tuple) and dim in dims:
            stored.add(name)
    given = {str(name) for name, var in ds.variables.items() if dim in var.dims}
    if not stored or stored == given:
        return  # a dimension the entry lacks: xarray's own error names it
    missing, new = sorted(stored - given), sorted(given - stored)
    raise ValueError(
        f"{url}: appending along {dim!r} would leave its variables at two lengths, and "
        "the committed dataset would not open (conflicting sizes for dimension "
        f"{dim!r}): " + "; ".join(
            part for part in (missing and f"{missing} not in the appended dataset",
                              new and f"{new} not in the entry") if part)
        + ". Append every variable along it, and add new ones with mode='a' and no "
        "append_dim first")


def open_zarr(url: str, *, storage_options: dict[str, Any] | None = None,
              **xarray_kwargs: Any) -> xr.Dataset:
    """Open a COMPLETE entry with ``xarray.open_zarr``, every chunk read verified.

    IncompleteError for an ABSENT or INCOMPLETE entry. ``consolidated`` defaults to what
    the entry was written with, so no warning is raised either way.
    """
    store = VerifyingStore.from_url(url, storage_options=storage_options)
    if "consolidated" not in xarray_kwargs:
        xarray_kwargs["consolidated"] = _is_consolidated(store)
    ds: xr.Dataset = xr.open_zarr(store, **xarray_kwargs)
    return ds


def _is_consolidated(store: VerifyingStore) -> bool:
    if ".zmetadata" in store.manifest:
        return True
    if "zarr.json" not in store.manifest:
        return False
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    group = sync(store.get("zarr.json", default_buffer_prototype()))
    assert group is not None  # listed in the manifest: a missing one raised already
    doc = json.loads(group.to_bytes())
    return isinstance(doc, dict) and doc.get("consolidated_metadata") is not None
