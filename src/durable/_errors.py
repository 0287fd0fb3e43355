"""The one error tree of `durable`.

Every error is a `DurableError` and also the builtin a caller already catches::

    DurableError(Exception)
    ├── IntegrityError(OSError)            data is not what was recorded: short, corrupt,
    │   │                                   an error body, a stale version
    │   └── MarkerError(ValueError)        a commit marker or manifest that cannot be
    │                                       trusted: bad JSON, too large, future format,
    │                                       a key that escapes the entry
    ├── IncompleteError(FileNotFoundError) a reader asked for an entry that is not COMPLETE
    ├── EntryExistsError(FileExistsError)  a writer found the entry already there
    │   ├── AlreadyCompleteError           ... COMPLETE (another writer finished first)
    │   └── IncompleteExistsError          ... INCOMPLETE (a leftover, or a live writer)
    ├── LeaseLostError(RuntimeError)       a writer lost its lease and must not commit
    └── UnsupportedError(NotImplementedError)
                                           the store cannot give a guarantee asked for

Errors name the object, what was expected and what was found, so that the first line of a
traceback is enough to act on.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AlreadyCompleteError",
    "DurableError",
    "EntryExistsError",
    "IncompleteError",
    "IncompleteExistsError",
    "IntegrityError",
    "LeaseLostError",
    "MarkerError",
    "UnsupportedError",
]


class DurableError(Exception):
    """Root of every error raised by `durable`."""


class IntegrityError(DurableError, OSError):
    """Bytes that do not match what was recorded, or a body that is not the data.

    ``url`` names the object; ``expected`` and ``found`` say what differs (a size, a CRC32C,
    a generation). Nothing that raised this was returned or cached as data.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        expected: Any = None,
        found: Any = None,
    ) -> None:
        # OSError.__init__ with one argument keeps str(err) == message.
        super().__init__(message)
        self.url = url
        self.expected = expected
        self.found = found

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries (dask workers): keep the fields.
        return (
            _rebuild,
            (type(self), str(self), {"url": self.url, "expected": self.expected,
                                     "found": self.found}),
        )


class MarkerError(IntegrityError, ValueError):
    """A commit marker or manifest that cannot be trusted; never followed outside the entry."""


class IncompleteError(DurableError, FileNotFoundError):
    """The entry is not COMPLETE (``state`` says whether it is ABSENT or INCOMPLETE)."""

    def __init__(self, message: str, *, url: str | None = None, state: Any = None) -> None:
        super().__init__(message)
        self.url = url
        self.state = state

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), {"url": self.url, "state": self.state}))


class EntryExistsError(DurableError, FileExistsError):
    """A writer found the entry already present."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), {"url": self.url}))


class AlreadyCompleteError(EntryExistsError):
    """A COMPLETE entry already exists: another writer finished first, or nothing to do."""


def rewrite_hint(exc: AlreadyCompleteError, how: str) -> AlreadyCompleteError:
    """``exc`` saying ``how`` the caller changes the entry, where the generic "update=True
    changes it" names an argument the caller's function does not take."""
    said = str(exc).replace("overwrite=True replaces it, update=True changes it", how)
    return AlreadyCompleteError(said, url=exc.url)


class IncompleteExistsError(EntryExistsError):
    """An INCOMPLETE entry exists: a leftover of a killed writer, or a writer still at work."""


class LeaseLostError(DurableError, RuntimeError):
    """The writer's lease was taken over or expired; it must stop and never commit."""


class UnsupportedError(DurableError, NotImplementedError):
    """The store cannot give the guarantee that was asked for (said, never pretended)."""


def _rebuild(cls: type[Exception], message: str, fields: dict[str, Any]) -> Exception:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    for name, value in fields.items():
        setattr(err, name, value)
    return err
