"""Object stores' error documents, told apart from data: an error page a gateway or cache
serves with 200 (or a 403's body stored as the object) is never data, nor a record."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

from durable._errors import IntegrityError

__all__ = ["ERROR_DOC_LIMIT", "error_document", "refuse_error_document",
           "refuse_written_error_document"]

#: S3, GCS and Azure error documents are a few hundred bytes (well under 4 KiB); a larger
#: body is never taken for one, so no object of a real size can be refused by the sniff.
ERROR_DOC_LIMIT = 64 * 1024
_BOM = b"\xef\xbb\xbf"
_DTD = re.compile(rb"<!DOCTYPE|<!ENTITY", re.IGNORECASE)


def error_document(data: bytes | bytearray) -> tuple[str, str] | None:
    """(code, message) if ``data`` is an object store's error document, else None.

    XML (S3, GCS XML API, Azure): after an optional BOM and whitespace, an XML declaration
    or ``<Error>``, and an ``<Error>`` root with ``<Code>`` and ``<Message>`` children.
    JSON (GCS JSON API): ``{"error": {"code": 4xx/5xx, "message": "..."}}`` and nothing
    else at the top. At most `ERROR_DOC_LIMIT` bytes.
    """
    if len(data) > ERROR_DOC_LIMIT:
        return None
    body = bytes(data).removeprefix(_BOM).lstrip()
    if body.startswith((b"<?xml", b"<Error>")):
        if b"<Error>" not in body:
            return None  # no parse of every small XML document read (a config, a zarr v2)
        if _DTD.search(body):
            return None  # error documents have no DTD; one could expand entities
        try:
            root = ET.fromstring(body)
        except ET.ParseError:
            return None
        code = (root.findtext("Code") or "").strip()
        if root.tag != "Error" or not code or root.find("Message") is None:
            return None
        return code, (root.findtext("Message") or "").strip()
    if body.startswith(b"{") and b'"error"' in body:
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deep
            return None
        err = doc.get("error") if isinstance(doc, dict) and doc.keys() == {"error"} else None
        if not isinstance(err, dict):
            return None
        status, text = err.get("code"), err.get("message")
        # bool is an int: {"code": true} is not a status
        if type(status) is int and 400 <= status <= 599 and isinstance(text, str):
            return str(status), text
    return None


def refuse_error_document(url: str, data: bytes | bytearray, *,
                          error: type[IntegrityError] = IntegrityError,
                          served_as: str = "the object") -> None:
    """``error`` (an IntegrityError) if ``data``, the whole unrecorded object (or a record
    of durable's: ``served_as`` says which), is an error document."""
    found = error_document(data)
    if found is None:
        return
    code, message = found
    raise error(
        f"{url}: the body is an object store's error document with code {code} "
        f"({message[:200]!r}) served as {served_as} (a gateway or cache answering with an "
        "error page); it is not returned as data", url=url, expected="the object's bytes",
        found=f"an error document ({code})")


def refuse_written_error_document(url: str, data: bytes | bytearray, how_to_allow: str,
                                  ) -> None:
    """IntegrityError if ``data``, about to be written at ``url`` and recorded, is an error
    document: a 403 page a failed download handed over as the file (incident 003) would be
    recorded with its own CRC32C, and every verified read would return it as data."""
    found = error_document(data)
    if found is None:
        return
    raise IntegrityError(
        f"{url}: not written: the bytes are an object store's error document "
        f"(code {found[0]}: {found[1][:200]!r}), not data; a failed download or "
        f"request handed over as the file? Nothing was published. If these "
        f"bytes really are the data, {how_to_allow}", url=url,
        expected="the object's bytes", found=f"an error document ({found[0]})")
