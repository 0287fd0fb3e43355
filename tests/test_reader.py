"""`Entry.reading()`: a checkpoint read file by file is all of one commit, or an error.

The hazard: a reader takes the weights of one commit and the step counter of the next,
because a rewrite of the entry landed between its two reads and each read was checked
against the marker as it was at that read (`read_verified`). Shown here, then refused by
the reader pinned to the marker read when reading began. Rewrites and damage are real:
another writer's commit, a byte flipped in place with plain file I/O.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

import pytest

from conftest import Place
from durable import (
    Entry,
    EntryReader,
    IncompleteError,
    IntegrityError,
    State,
    atomic_write,
    read_verified,
)
from durable.testing.pytest_plugin import Bucket

WEIGHTS_A, WEIGHTS_B = os.urandom(3 * 1024 * 1024 + 7), os.urandom(3 * 1024 * 1024 + 7)


def write_ckpt(url: str, weights: bytes, step: int, *, overwrite: bool = False,
               storage_options: dict[str, Any] | None = None) -> None:
    entry = Entry(url, storage_options=storage_options)
    with entry.writing(overwrite=overwrite) as w:
        w.fs.pipe_file(f"{w.path}/model/weights.bin", weights)
        w.fs.pipe_file(f"{w.path}/meta.json", b'{"step": %d}' % step)


@pytest.fixture(params=["file", "memory", "s3"])
def where(request: pytest.FixtureRequest, place: Place
          ) -> tuple[str, dict[str, Any] | None]:
    """(the entry's URL, storage options) on the local disk, in memory and on moto."""
    if request.param == "s3":
        if place.kind != "file":
            pytest.skip("one s3 run is enough")
        bucket: Bucket = request.getfixturevalue("s3_bucket")
        return bucket.path("ckpt"), bucket.storage_options
    if request.param != place.kind:
        pytest.skip("place is parametrized apart")
    return place.url("ckpt"), None


def test_reads_are_of_the_commit_read_when_reading_began(
        where: tuple[str, dict[str, Any] | None]) -> None:
    url, opts = where
    write_ckpt(url, WEIGHTS_A, 1, storage_options=opts)
    entry = Entry(url, storage_options=opts)
    with entry.reading() as r:
        assert isinstance(r, EntryReader)
        assert r.keys() == ["meta.json", "model/weights.bin"]
        assert "meta.json" in r and "nope" not in r
        assert r.record("model/weights.bin").size == len(WEIGHTS_A)
        assert r.read("meta.json") == b'{"step": 1}'
        with r.open("model/weights.bin") as f:
            assert f.read() == WEIGHTS_A
        with r.open("model/weights.bin") as f:  # a seek first: checked whole, then served
            f.seek(-7, os.SEEK_END)
            assert f.read() == WEIGHTS_A[-7:]
        r.check_unchanged()


@pytest.mark.parametrize("how", ["read", "open"])
@pytest.mark.parametrize("same_size", [True, False], ids=["same-size", "other-size"])
def test_a_rewrite_between_two_reads_is_refused_never_a_mix(
        where: tuple[str, dict[str, Any] | None], how: str, same_size: bool) -> None:
    url, opts = where
    write_ckpt(url, WEIGHTS_A, 1, storage_options=opts)
    entry = Entry(url, storage_options=opts)
    with entry.reading() as r:
        step = r.read("meta.json")
        assert step == b'{"step": 1}'
        # Another node commits the next checkpoint over this one, between the two reads.
        new = WEIGHTS_B if same_size else WEIGHTS_B + b"more"
        write_ckpt(url, new, 2, overwrite=True, storage_options=opts)
        # What per-file verified reads give: each checked against the marker of its own
        # moment, so the weights of commit 2 pass, beside the step of commit 1.
        assert read_verified(f"{url}/model/weights.bin", storage_options=opts) == new
        with pytest.raises(IncompleteError, match="rewritten while it was read") as err:
            if how == "read":
                r.read("model/weights.bin")
            else:
                with r.open("model/weights.bin") as f:
                    f.read()
        assert r.marker.attempt in str(err.value)
        assert err.value.url == entry.url
        with pytest.raises(IncompleteError, match="rewritten"):
            r.check_unchanged()
    with entry.reading() as r2:  # read again from the start: all of commit 2
        assert r2.read("meta.json") == b'{"step": 2}'
        assert r2.read("model/weights.bin") == new


def _flip(place: Place, rel: str, offset: int) -> None:
    """One byte changed in place, by plain file I/O (or the raw memory store)."""
    data = bytearray(place.read(rel) or b"")
    data[offset] ^= 0x5A
    if place.kind == "file":
        with open(os.path.join(place.root, rel), "r+b") as f:
            f.seek(offset)
            f.write(bytes([data[offset]]))
    else:
        place.write(rel, bytes(data))


@pytest.mark.parametrize("how", ["read", "open"])
def test_damage_with_the_marker_unchanged_is_an_integrity_error(
        place: Place, how: str) -> None:
    url = place.url("ckpt")
    write_ckpt(url, WEIGHTS_A, 1)
    with Entry(url).reading() as r:
        _flip(place, "ckpt/model/weights.bin", len(WEIGHTS_A) // 2)
        with pytest.raises(IntegrityError, match="CRC32C") as err:
            if how == "read":
                r.read("model/weights.bin")
            else:
                with r.open("model/weights.bin") as f:
                    f.read()
        assert not isinstance(err.value, IncompleteError)
        assert "ckpt/model/weights.bin" in str(err.value)


def test_a_missing_object_and_a_key_not_in_the_commit(place: Place) -> None:
    url = place.url("ckpt")
    write_ckpt(url, WEIGHTS_A, 1)
    with Entry(url).reading() as r:
        with pytest.raises(FileNotFoundError, match="not in commit") as err:
            r.read("optimizer.pt")
        assert r.marker.attempt in str(err.value)
        place.remove_tree("ckpt/model")  # deleted by another tool, the marker kept
        with pytest.raises(IntegrityError, match="missing") as err2:
            r.read("model/weights.bin")
        assert "ckpt/model/weights.bin" in str(err2.value)
        with pytest.raises(IntegrityError, match="missing"):
            r.open("model/weights.bin")


@pytest.mark.parametrize("key", ["../other/meta.json", "/etc/passwd", "model//weights.bin",
                                 "./meta.json"])
def test_a_key_outside_the_entry_is_refused_before_any_read(place: Place, key: str) -> None:
    url = place.url("ckpt")
    write_ckpt(url, WEIGHTS_A, 1)
    place.write("other/meta.json", b"not this entry's")
    with Entry(url).reading() as r:
        for call in (r.read, r.open, r.record):
            with pytest.raises(ValueError, match="not a key inside the entry"):
                call(key)


def test_keys_built_with_pathlib_are_the_keys_they_spell(
        where: tuple[str, dict[str, Any] | None]) -> None:
    """``PurePosixPath("model") / "weights.bin"``, how a loader builds its keys: ``in``
    said False for an object the commit holds (a resume that checks for its optimizer
    state that way went on without it, silently), and reads and writes refused it as
    "not a key inside the entry". A path object is the key its text spells, on both
    sides; one that is not a key inside the entry is still refused."""
    url, options = where
    entry = Entry(url, storage_options=options)
    model = PurePosixPath("model")
    with entry.writing() as w:
        w.write_bytes(model / "weights.bin", WEIGHTS_A)
        with w.open(PurePosixPath("optimizer.pt")) as f:
            f.write(b"adam state")
    with entry.reading() as r:
        assert r.keys() == ["model/weights.bin", "optimizer.pt"]
        assert PurePosixPath("optimizer.pt") in r and model / "weights.bin" in r
        assert PurePosixPath("scheduler.pt") not in r
        assert r.read(model / "weights.bin") == WEIGHTS_A
        with r.open(PurePosixPath("optimizer.pt")) as f:
            assert f.read() == b"adam state"
        assert r.record(model / "weights.bin").size == len(WEIGHTS_A)
        assert r.url(model / "weights.bin") == r.url("model/weights.bin")
        with pytest.raises(ValueError, match="not a key inside the entry"):
            r.read(PurePosixPath("/etc/passwd"))


def test_only_a_complete_entry_is_read(place: Place) -> None:
    url = place.url("ckpt")
    with pytest.raises(IncompleteError, match="ABSENT") as err, Entry(url).reading():
        pass
    assert err.value.state is State.ABSENT
    place.write("ckpt/meta.json", b"{}")  # data, and no commit
    with pytest.raises(IncompleteError, match="INCOMPLETE"), Entry(url).reading():
        pass


def test_a_single_object_entry_has_the_one_key_empty(place: Place) -> None:
    url = place.url("latest.json")
    with atomic_write(url) as f:
        f.write(b'{"step": 7}')
    read: Callable[..., bytes]
    with Entry(url).reading() as r:
        assert r.keys() == [""]
        read = r.read
        assert read() == b'{"step": 7}'
        assert r.open().read() == b'{"step": 7}'
        with pytest.raises(ValueError, match="single-object"):
            r.read("x")
