"""durable: writes that are whole or visibly unfinished, reads that are right or loud.

The public namespace is flat and explicit (``__all__``); everything else is private.
"""

from durable._atomic import atomic_write
from durable._cached import cached
from durable._checks import Problem, Status, VerifyReport
from durable._entry import Entry
from durable._errors import (
    AlreadyCompleteError,
    DurableError,
    EntryExistsError,
    IncompleteError,
    IncompleteExistsError,
    IntegrityError,
    LeaseLostError,
    MarkerError,
    UnsupportedError,
)
from durable._lease import Lease
from durable._protocol import Manifest, Marker, ObjectRecord, State
from durable._reader import EntryReader
from durable._serializers import register_serializer
from durable._verified import open_verified, read_verified
from durable._version import __version__
from durable._writer import EntryWriter

__all__ = [
    "AlreadyCompleteError",
    "DurableError",
    "Entry",
    "EntryExistsError",
    "EntryReader",
    "EntryWriter",
    "IncompleteError",
    "IncompleteExistsError",
    "IntegrityError",
    "Lease",
    "LeaseLostError",
    "Manifest",
    "Marker",
    "MarkerError",
    "ObjectRecord",
    "Problem",
    "State",
    "Status",
    "UnsupportedError",
    "VerifyReport",
    "__version__",
    "atomic_write",
    "cached",
    "open_verified",
    "read_verified",
    "register_serializer",
]
