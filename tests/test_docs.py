"""The documentation's code runs as written.

Every ```python block of the pages in `PAGES` is run, so that an example that no longer
works (a renamed argument, a missing import, a claim the code stopped keeping) fails here
instead of in a reader's hands. The conventions:

- The blocks of one page run in order, in one namespace, as a reader pasting them one after
  the other into one session would: a later block may use what an earlier one defined.
- Names a page leaves to the reader (the dataset ``ds``, the storage options ``opts``, the
  demo's ``root``) are defined before its first block, in `PLACEHOLDERS`. Nothing else of a
  block is changed but the places it names: ``s3://bucket/`` becomes a new bucket on the
  session's moto server, reached through ``$AWS_ENDPOINT_URL`` as a user would point every
  client at another endpoint, and the absolute local folders ``/cache`` and ``/data`` move
  under the test's own temporary folder.
- A block that must not run here is preceded, on the line just before its opening fence,
  by the comment ``<!-- docs-test: skip: REASON -->`` (invisible in the rendered page),
  REASON saying why and what runs it instead (a cluster, a failed write set up first).
  ```console``, ```bash`` and unlabelled blocks are not run.
- A reader without torch installed still runs the README's checkpoint example: ``torch`` is
  then a stand-in whose ``save`` pickles, since what is checked is durable's part.
"""

from __future__ import annotations

import pickle
import re
import types
from pathlib import Path
from typing import Any

import pytest

from durable.testing.pytest_plugin import Bucket

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/quickstart.md", "docs/migration.md", "docs/guides/cached.md",
         "docs/guides/fsspec.md", "docs/guides/zarr.md", "docs/guides/xarray.md",
         "docs/guides/tensorstore.md", "docs/guides/dask.md"]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip:\s*(?P<reason>.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*$")


def blocks(page: str) -> list[tuple[int, str, str | None]]:
    """(line of the opening fence, code, skip reason) of each ```python block of `page`."""
    lines = (ROOT / page).read_text().splitlines()
    found: list[tuple[int, str, str | None]] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, end = m["indent"], i + 1
        while not re.match(rf"^{indent}```\s*$", lines[end]):
            end += 1
        if m["lang"] == "python":
            skip = SKIP.search(lines[i - 1]) if i else None
            code = "\n".join(line[len(indent):] for line in lines[i + 1:end])
            found.append((i + 1, code, skip["reason"] if skip else None))
        i = end + 1
    return found


def _dataset(days: int) -> Any:
    import numpy as np
    import xarray as xr

    def day(d: int) -> Any:
        return xr.Dataset({"temp": (("time", "x"), np.full((24, 10), float(d)))},
                          coords={"time": np.arange(24 * d, 24 * (d + 1)), "x": np.arange(10)})
    return xr.concat([day(d) for d in range(days)], "time"), day


def _readme(ns: dict[str, Any], bucket: Bucket, tmp: Path) -> None:
    import numpy as np
    import pandas as pd

    try:
        import torch
    except ImportError:
        torch = types.SimpleNamespace(save=lambda obj, f: pickle.dump(obj, f))
    ns.update(torch=torch, state={"weights": [1.0, 2.0]}, blocks=[b"a" * 1000, b"b" * 10],
              np=np, df=pd.DataFrame({"a": [1, 2, 3]}),
              array=np.arange(250_000, dtype="float32").reshape(500, 500),
              ds=_dataset(2)[0])


def _quickstart(ns: dict[str, Any], bucket: Bucket, tmp: Path) -> None:
    import numpy as np

    def write_shards(w: Any, indices: Any) -> None:
        for i in indices:
            w.fs.pipe_file(f"{w.path}/part-{i:05d}.bin", bytes([i]) * 1000)

    ns.update(root=str(tmp / "demo-data"), weights=np.ones((10, 4)), bias=np.zeros(4),
              shard=lambda i: bytes([i]) * 1000, write_shards=write_shards,
              missing=range(7, 20))


def _migration(ns: dict[str, Any], bucket: Bucket, tmp: Path) -> None:
    import os
    import uuid

    import fsspec

    ns.update(os=os, uuid=uuid, opts=bucket.storage_options,
              fs=fsspec.filesystem("s3", **bucket.storage_options),
              url=bucket.path("cache", "era5.zarr"), ds=_dataset(2)[0],
              path=str(tmp / "model.pt"), data=b"weights" * 100)


def _cached(ns: dict[str, Any], bucket: Bucket, tmp: Path) -> None:
    ns.update(opts=bucket.storage_options)


def _fsspec(ns: dict[str, Any], bucket: Bucket, tmp: Path) -> None:
    import numpy as np
    import pandas as pd

    ns.update(df=pd.DataFrame({"a": [1, 2, 3]}), array=np.arange(10))


def _zarr(ns: dict[str, Any], bucket: Bucket, tmp: Path) -> None:
    import numpy as np

    ns.update(features=np.ones((4000, 300), dtype="float32"),
              url=f"s3://{bucket.name}/cache/x.zarr", more=np.ones((1000, 1000), dtype="int64"))


def _xarray(ns: dict[str, Any], bucket: Bucket, tmp: Path) -> None:
    ds, day = _dataset(2)
    ns.update(opts=bucket.storage_options, ds=ds, next_day=day(2),
              patch=ds.isel(time=slice(4, 8)).drop_vars("x") * 0 - 1,
              url=bucket.path("era5", "2020.zarr"))


def _tensorstore(ns: dict[str, Any], bucket: Bucket, tmp: Path) -> None:
    import numpy as np

    def rows() -> Any:  # two bands of the 20,000 rows: enough to show the writes land
        for i in range(2):
            yield i * 1000, np.full((1000, 1024), i, dtype="float32")

    ns.update(opts=bucket.storage_options, url=bucket.path("tokens", "shard-8"), blocks=rows)


def _dask(ns: dict[str, Any], bucket: Bucket, tmp: Path) -> None:
    import dask.array as da

    ns.update(opts=bucket.storage_options, url=bucket.path("out.zarr"), ds=_dataset(2)[0],
              x=da.ones((1500, 1000), chunks=(700, 900)))


PLACEHOLDERS = {"README.md": _readme, "docs/quickstart.md": _quickstart,
                "docs/migration.md": _migration, "docs/guides/cached.md": _cached,
                "docs/guides/fsspec.md": _fsspec, "docs/guides/zarr.md": _zarr,
                "docs/guides/xarray.md": _xarray, "docs/guides/tensorstore.md": _tensorstore,
                "docs/guides/dask.md": _dask}


def test_every_page_is_run_and_every_skip_says_why() -> None:
    assert set(PLACEHOLDERS) == set(PAGES)
    for page in PAGES:
        assert blocks(page), f"{page} has no python block: take it out of PAGES"
        for line, _, reason in blocks(page):
            assert reason is None or len(reason) > 10, f"{page}:{line}: skip without a reason"


# The migration page's "before" code writes with plain xarray, which warns (durable's own
# writes silence exactly this warning).
PLAIN_ZARR_WARNING = pytest.mark.filterwarnings(
    "ignore:Consolidated metadata is currently not part")


# The README imports every integration (zarr, xarray, tensorstore): several seconds.
MARKS = {"docs/migration.md": [PLAIN_ZARR_WARNING], "README.md": [pytest.mark.slow]}


@pytest.mark.s3
@pytest.mark.parametrize("page", [pytest.param(p, marks=MARKS.get(p, [])) for p in PAGES])
def test_page_runs_as_written(page: str, s3_bucket: Bucket, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The endpoint as a user sets it for every client at once (botocore, s3fs, tensorstore).
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_bucket.storage_options["endpoint_url"])
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.chdir(tmp_path)
    ns: dict[str, Any] = {"__name__": f"docs:{page}"}
    PLACEHOLDERS[page](ns, s3_bucket, tmp_path)
    ran = 0
    for line, code, reason in blocks(page):
        if reason is not None:
            continue
        code = (code.replace("s3://bucket/", f"s3://{s3_bucket.name}/")
                .replace('"/cache/', f'"{tmp_path}/cache/')
                # "/data/..." too: a block naming it so wrote to the machine's own /data.
                .replace('"/data/', f'"{tmp_path}/data/')
                .replace("file:///data/", f"file://{tmp_path}/data/"))
        try:
            # dont_inherit: not this file's `from __future__ import annotations`, which
            # left a block's annotations unevaluated (a missing import passed unseen).
            exec(compile(code, f"{ROOT / page}:{line}", "exec", dont_inherit=True), ns)
        except Exception as exc:
            exc.add_note(f"in the block at {page}:{line}")
            raise
        ran += 1
    assert ran, f"{page}: every block is skipped"
