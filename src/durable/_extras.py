"""Missing optional dependencies named by the extra that installs them.

Without this, ``import durable.zarr`` without zarr fails with "No module named 'zarr'", and
``Entry("s3://b/k")`` without s3fs with fsspec's "Install s3fs to access S3": neither says
that ``pip install 'durable-io[s3]'`` is the fix (and a bare ``pip install s3fs`` misses
obstore and the versions the extra pins).
"""

from __future__ import annotations

import importlib.util

# The extra of pyproject.toml, and the fsspec filesystem in it, for each protocol that has
# an adapter of its own.
PROTOCOL_EXTRAS = {
    "s3": ("s3", "s3fs"), "s3a": ("s3", "s3fs"),
    "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"),
    "abfs": ("azure", "adlfs"), "abfss": ("azure", "adlfs"), "az": ("azure", "adlfs"),
}


def missing(what: str, extra: str, module: str) -> ModuleNotFoundError:
    """The error for `what` needing `module`, which ``durable-io[extra]`` installs."""
    return ModuleNotFoundError(
        f"{what} needs {module}, which is not installed: "
        f"pip install 'durable-io[{extra}]'", name=module)


def require(what: str, extra: str, *modules: str) -> None:
    """Raise `missing` for the first of `modules` that cannot be imported.

    Checked with find_spec before the real imports, so that an integration module fails
    on import with the extra's name instead of the bare "No module named ..."."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise missing(what, extra, module)
