"""Early writeback of large local writes: started as bytes arrive, never instead of fsync.

adapters/local.py asks the kernel to start writing each 8 MiB already written
(sync_file_range, SYNC_FILE_RANGE_WRITE), so the disk works while Python writes on and the
final fsync finds little left. sync_file_range makes nothing durable (no metadata, no disk
cache flush): the fsync before the rename must stay, and a writeback error must end the
write like an fsync error does.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import durable
import durable.adapters.local as local_adapter

pytestmark = pytest.mark.skipif(local_adapter._sync_file_range is None,
                                reason="no sync_file_range on this platform")

MiB = 1024 * 1024


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
def test_writeback_is_started_per_range_and_the_fsync_still_comes_before_the_rename(
        tmp_path: Path) -> None:
    target = tmp_path / "ckpt.bin"
    script = textwrap.dedent(f"""
        import durable
        with durable.atomic_write({str(target)!r}, record=False) as f:
            for _ in range(5):
                f.write(b"x" * (4 * 1024 * 1024 + 1))
    """)
    log = tmp_path / "strace.log"
    subprocess.run(["strace", "-f", "-o", str(log), "-e",
                    "trace=sync_file_range,fsync,rename,renameat,renameat2",
                    sys.executable, "-c", script], check=True, timeout=120)
    lines = log.read_text().splitlines()
    ranges = [(int(m[1]), int(m[2])) for line in lines
              if (m := re.search(r"sync_file_range\(\d+, (\d+), (\d+), "
                                 r"SYNC_FILE_RANGE_WRITE\) = 0", line))]
    # 20 MiB + 5 bytes written in blocks of 4 MiB + 1: a range is started each time 8 MiB
    # or more are pending, contiguous from offset 0; the tail is left to the fsync.
    assert ranges == [(0, 2 * (4 * MiB + 1)), (2 * (4 * MiB + 1), 2 * (4 * MiB + 1))], lines
    last_range = max(i for i, line in enumerate(lines) if "sync_file_range(" in line)
    fsyncs = [i for i, line in enumerate(lines) if re.search(r"\bfsync\(", line)]
    renames = [i for i, line in enumerate(lines) if "rename" in line and "ckpt.bin" in line]
    assert len(renames) == 1, lines
    assert any(last_range < i < renames[0] for i in fsyncs), (
        f"no fsync between the last writeback and the rename: {lines}")
    assert target.read_bytes() == b"x" * (5 * (4 * MiB + 1))


def _failing(err: int) -> Any:
    calls: list[tuple[int, int]] = []

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes))
        ctypes.set_errno(err)  # what the C call leaves for ctypes.get_errno()
        return -1

    sync_file_range.calls = calls  # type: ignore[attr-defined]
    return sync_file_range


def test_a_writeback_io_error_ends_the_write_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"old")
    fake = _failing(errno.EIO)
    monkeypatch.setattr(local_adapter, "_sync_file_range", fake)
    with pytest.raises(OSError) as caught, durable.atomic_write(str(target)) as f:
        for _ in range(3):
            f.write(os.urandom(4 * MiB))
    assert caught.value.errno == errno.EIO
    assert "writeback" in str(caught.value) and "durable-tmp" in str(caught.value)
    assert fake.calls == [(0, 8 * MiB)]  # raised at the first failure, never retried
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]  # no temp, no marker


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP])
def test_a_file_system_without_writeback_falls_back_to_fsync_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    fake = _failing(err)
    monkeypatch.setattr(local_adapter, "_sync_file_range", fake)
    data = os.urandom(20 * MiB)
    target = tmp_path / "ckpt.bin"
    with durable.atomic_write(str(target)) as f:
        for i in range(0, len(data), 2 * MiB):
            f.write(data[i:i + 2 * MiB])
    assert fake.calls == [(0, 8 * MiB)]  # asked once, then not again for this file
    assert durable.read_verified(str(target)) == data


def test_small_writes_start_no_writeback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _failing(errno.EIO)
    monkeypatch.setattr(local_adapter, "_sync_file_range", fake)
    with durable.atomic_write(str(tmp_path / "small.bin")) as f:
        for _ in range(100):
            f.write(b"y" * 65536)  # 6.25 MiB: under one writeback range
    assert fake.calls == []
    assert (tmp_path / "small.bin").stat().st_size == 100 * 65536
