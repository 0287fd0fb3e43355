"""The public surface: exactly `__all__`, one error tree, errors that cross processes."""

from __future__ import annotations

import builtins
import pickle
import re
import subprocess
import sys
import types

import pytest

import durable
from durable import _errors


def test_all_is_exactly_what_the_package_exports() -> None:
    public = {name for name, value in vars(durable).items()
              if (not name.startswith("_") or name == "__version__")
              and not isinstance(value, types.ModuleType)}  # subpackages are not exports
    assert len(durable.__all__) == len(set(durable.__all__))
    assert set(durable.__all__) == public
    assert durable.__all__ == sorted(durable.__all__)


def test_every_export_is_defined_in_a_private_module() -> None:
    for name in durable.__all__:
        value = getattr(durable, name)
        module = getattr(value, "__module__", None)
        if module is not None and isinstance(value, type):
            assert module.startswith("durable._"), f"{name} comes from {module}"


# The tree as drawn in the docstring of durable/_errors.py: "Name(Base)" lines.
TREE = dict(re.findall(r"(\w+Error)\((\w+)\)", _errors.__doc__ or ""))
ERRORS = [name for name in durable.__all__ if name.endswith("Error")]


def test_docstring_tree_covers_every_error() -> None:
    drawn = set(TREE) | {n for n in ERRORS if n in (_errors.__doc__ or "")}
    assert set(ERRORS) <= drawn
    assert set(TREE) <= set(ERRORS)


@pytest.mark.parametrize("name", sorted(TREE))
def test_error_is_the_builtin_the_docstring_says(name: str) -> None:
    cls = getattr(durable, name)
    base = TREE[name]
    base_cls = getattr(builtins, base, None) or getattr(durable, base)
    assert issubclass(cls, base_cls)
    assert issubclass(cls, durable.DurableError)


@pytest.mark.parametrize(("name", "builtin"), [
    ("IntegrityError", OSError),
    ("MarkerError", ValueError),
    ("MarkerError", OSError),
    ("IncompleteError", FileNotFoundError),
    ("EntryExistsError", FileExistsError),
    ("AlreadyCompleteError", FileExistsError),
    ("IncompleteExistsError", FileExistsError),
    ("LeaseLostError", RuntimeError),
    ("UnsupportedError", NotImplementedError),
])
def test_error_builtins(name: str, builtin: type[BaseException]) -> None:
    cls = getattr(durable, name)
    assert issubclass(cls, builtin) and issubclass(cls, durable.DurableError)


def test_subclasses() -> None:
    assert issubclass(durable.MarkerError, durable.IntegrityError)
    assert issubclass(durable.AlreadyCompleteError, durable.EntryExistsError)
    assert issubclass(durable.IncompleteExistsError, durable.EntryExistsError)
    assert not issubclass(durable.AlreadyCompleteError, durable.IncompleteExistsError)


def examples() -> list[tuple[BaseException, dict[str, object]]]:
    url = "s3://bucket/ent/c/0"
    return [
        (durable.IntegrityError(f"{url}: 5 bytes arrived, 9 expected", url=url, expected=9,
                                found=5), {"url": url, "expected": 9, "found": 5}),
        (durable.MarkerError(f"{url}: bad", url=url, expected=1, found=2),
         {"url": url, "expected": 1, "found": 2}),
        (durable.IncompleteError(f"{url} is INCOMPLETE", url=url,
                                 state=durable.State.INCOMPLETE),
         {"url": url, "state": durable.State.INCOMPLETE}),
        (durable.EntryExistsError(f"{url} exists", url=url), {"url": url}),
        (durable.AlreadyCompleteError(f"{url} is COMPLETE", url=url), {"url": url}),
        (durable.IncompleteExistsError(f"{url} is INCOMPLETE", url=url), {"url": url}),
        (durable.LeaseLostError(f"{url}: lease lost"), {}),
        (durable.UnsupportedError(f"{url}: cannot"), {}),
    ]


def test_examples_cover_every_error() -> None:
    assert {type(e).__name__ for e, _ in examples()} == set(ERRORS) - {"DurableError"}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_errors_survive_pickling(protocol: int) -> None:
    for err, fields in examples():
        back = pickle.loads(pickle.dumps(err, protocol=protocol))
        assert type(back) is type(err)
        assert str(back) == str(err)
        for name, value in fields.items():
            assert getattr(back, name) == value


def test_message_is_the_first_line() -> None:
    err = durable.IntegrityError("file:///x: 1 bytes arrived, 2 expected", url="file:///x",
                                 expected=2, found=1)
    assert str(err) == "file:///x: 1 bytes arrived, 2 expected"
    with pytest.raises(OSError, match="1 bytes arrived"):
        raise err


# A user who installed only the core and imports an integration, or names a cloud URL, is
# told which extra to install, not the bare "No module named 'zarr'" or fsspec's "Install
# s3fs". The missing package is made unimportable in a child process (sys.modules[x] = None,
# what Python does for a module known to be absent), as in a venv without the extra.
MISSING = [
    ("zarr", "import durable.zarr", "durable.zarr needs zarr", "durable-io[zarr]"),
    ("xarray", "import durable.xarray", "durable.xarray needs xarray", "durable-io[xarray]"),
    ("tensorstore", "import durable.tensorstore", "durable.tensorstore needs tensorstore",
     "durable-io[tensorstore]"),
    ("s3fs", "durable.Entry('s3://b/k').state()", "'s3://b/k' needs s3fs", "durable-io[s3]"),
    ("gcsfs", "durable.Entry('gs://b/k').state()", "'gs://b/k' needs gcsfs", "durable-io[gcs]"),
    ("adlfs", "durable.Entry('az://c/k').state()", "'az://c/k' needs adlfs",
     "durable-io[azure]"),
]


@pytest.mark.parametrize(("module", "code", "what", "extra"), MISSING,
                         ids=[m[0] for m in MISSING])
def test_a_missing_extra_is_named(module: str, code: str, what: str, extra: str) -> None:
    script = (f"import sys; sys.modules[{module!r}] = None\nimport durable\n"
              f"try:\n    {code}\nexcept ModuleNotFoundError as e:\n"
              "    print(type(e).__name__, e)\nelse:\n    print('no error')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith(f"ModuleNotFoundError {what}, which is not installed"), out
    assert f"pip install '{extra}'" in out
