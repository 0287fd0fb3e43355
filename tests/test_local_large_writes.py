"""Large local writes: the record is the CRC32C of the bytes, in a forked child and at exit.

Large blocks once took another path (CRC32C in a helper thread beside write(2), removed:
see adapters/local.py); these pin what any such path must keep: the recorded CRC32C is
that of the bytes written, a forked child can write, and so can an atexit handler, when
no new thread may start.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import crc32c
import pytest

import durable


def _recorded_crc(path: Path) -> str:
    marker = path.parent / ".durable" / path.name / "commit.json"
    return str(json.loads(marker.read_bytes())["manifest"][""]["crc32c"])


@pytest.mark.parametrize("blocks", [[5 << 20], [2 << 20, 3 << 20 | 17, 1 << 20]])
def test_large_blocks_record_the_crc32c_of_the_bytes(tmp_path: Path, blocks: list[int]) -> None:
    data = [os.urandom(n) for n in blocks]
    target = tmp_path / "big.bin"
    with durable.atomic_write(str(target), record=True) as f:
        for block in data:
            f.write(block)
    whole = b"".join(data)
    assert target.read_bytes() == whole
    assert _recorded_crc(target) == f"{crc32c.crc32c(whole):08x}"
    assert durable.read_verified(str(target)) == whole


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_does_not_inherit_a_dead_pool(tmp_path: Path) -> None:
    big = os.urandom(3 << 20)
    with durable.atomic_write(str(tmp_path / "parent.bin")) as f:
        f.write(big)  # the parent's pool now has threads
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        os.close(r)
        try:
            with durable.atomic_write(str(tmp_path / "child.bin")) as f:
                f.write(big)
            os.write(w, b"ok")
        finally:
            os._exit(0)
    os.close(w)
    import select

    ready, _, _ = select.select([r], [], [], 60)
    assert ready, "the forked child hung writing a large block"
    assert os.read(r, 2) == b"ok"
    os.waitpid(pid, 0)
    assert (tmp_path / "child.bin").read_bytes() == big


def test_a_checkpoint_saved_from_an_atexit_handler_is_whole_and_recorded(
        tmp_path: Path) -> None:
    """At interpreter exit no new thread may start (ThreadPoolExecutor.submit raises
    RuntimeError): large blocks then take the serial path, same bytes, same record."""
    import subprocess
    import textwrap

    target = tmp_path / "final.ckpt"
    script = textwrap.dedent(f"""
        import atexit, os, durable
        data = bytes(range(256)) * (12 * 1024 * 16 + 3)  # ~12 MiB: blocks over the overlap size

        def save():
            with durable.atomic_write({str(target)!r}) as f:
                f.write(data[:5 << 20])
                f.write(data[5 << 20:])

        atexit.register(save)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    whole = bytes(range(256)) * (12 * 1024 * 16 + 3)
    assert target.read_bytes() == whole
    assert _recorded_crc(target) == f"{crc32c.crc32c(whole):08x}"
