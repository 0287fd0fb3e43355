"""durable: whole-or-nothing writes and verified reads."""
from durable._version import __version__
__all__ = ["__version__"]
