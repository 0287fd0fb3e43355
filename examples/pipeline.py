"""The main job: what `durable` does for a pipeline writing to a local disk, end to end.

    python examples/pipeline.py [--dir DIR] [--keep]

1. saves a checkpoint (numpy arrays, np.savez) with `durable.atomic_write` and reads it
   back with `durable.read_verified`;
2. writes a dataset entry of 20 shards with `Entry.writing()`: COMPLETE when the block ends;
3. starts a second writer as a real process and SIGKILLs it half-way through a shard;
4. asks `durable status` and `durable verify` (the real command line) to tell the two apart;
5. flips one byte of a committed shard: `durable verify --deep` names it, `read_verified`
   refuses it; the entry is rewritten;
6. finishes the killed entry with `writing(resume=True)`, and `durable scan` shows it all.

Every claim printed is also checked: the exit status is 0 only if all of them held. No
server, no network; a few seconds. POSIX only (SIGKILL).
"""

from __future__ import annotations

import argparse
import io
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

import durable
from durable import Entry, IncompleteError, IntegrityError, State

SHARDS = 20
SHARD_SIZE = 256 * 1024
KILL_AT = 7  # the killed writer has committed shards 0..6 and is half-way through 7
CORRUPT = 7  # the shard of dataset-a whose byte gets flipped
CLI_TIMEOUT = 120


class ExpectationFailed(Exception):
    pass


checks = 0


def expect(ok: bool, what: str) -> None:
    """A claim of the narrative that must hold (not `assert`: python -O would drop it)."""
    global checks
    if not ok:
        raise ExpectationFailed(what)
    checks += 1


def say(text: str = "") -> None:
    print(text, flush=True)


def shard_key(i: int) -> str:
    return f"part-{i:05d}.bin"


def shard_bytes(i: int) -> bytes:
    """Shard i's content: the same in every process and every run."""
    return random.Random(i).randbytes(SHARD_SIZE)


def write_shards(w: durable.EntryWriter, indices: range | list[int]) -> None:
    for i in indices:
        # writer.fs is an fsspec filesystem: code written for fsspec (zarr, pandas) works
        # unchanged, and every object is recorded (size, CRC32C) as it streams.
        w.fs.pipe_file(f"{w.path}/{shard_key(i)}", shard_bytes(i))


# the second writer: `pipeline.py _writer ENTRY` ---------------------------------------------
def writer_child(path: str) -> int:
    """Write shards one by one, each on the parent's word, so the kill lands exactly.

    Reads "shard" (write the next shard whole) or "half" (write half of it, report, and
    wait: the parent kills us there) from stdin; prints what it did after each step.
    """
    with Entry(path).writing() as w:
        for i in range(SHARDS):
            command = sys.stdin.readline().strip()
            if command not in ("shard", "half"):
                raise SystemExit(f"writer: parent gone or bad command {command!r}")
            data = shard_bytes(i)
            with w.open(shard_key(i)) as f:
                f.write(data[: len(data) // 2])
                if command == "half":
                    print(f"half-written {shard_key(i)}", flush=True)
                    sys.stdin.readline()
                f.write(data[len(data) // 2:])
            print(f"wrote {shard_key(i)}", flush=True)
    return 0


class Child:
    """The parent's side of the writer process: send a command, wait for its line."""

    def __init__(self, path: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "_writer", path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put("")  # EOF: the writer exited

    def ask(self, command: str, reply: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        # A generous cap only so that a broken writer cannot hang the demo; the kill
        # itself waits for the writer's own report, never for a guessed delay.
        line = self._lines.get(timeout=60)
        expect(line == reply, f"writer process said {line!r}, expected {reply!r}")

    def kill(self) -> int:
        os.kill(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()


# the command line ---------------------------------------------------------------------
def durable_cli(*args: str, show: str) -> tuple[int, str]:
    """Run `durable ARGS` as its own process; print it as typed, with its output indented."""
    proc = subprocess.run([sys.executable, "-m", "durable", *args], capture_output=True,
                          text=True, timeout=CLI_TIMEOUT)
    say(f"  $ durable {show}    (exit {proc.returncode})")
    for line in (proc.stdout + proc.stderr).rstrip().splitlines():
        say(f"      {line}")
    return proc.returncode, proc.stdout + proc.stderr


def word(state: str, text: str) -> bool:
    """`state` as a whole word: COMPLETE is not found inside INCOMPLETE."""
    return re.search(rf"\b{state}\b", text) is not None


# the job ------------------------------------------------------------------------------
def save_checkpoint(url: str) -> Any:
    try:
        import numpy as np
    except ImportError:
        weights: Any = random.Random(0).randbytes(6 * 1024 * 1024)
        with durable.atomic_write(url) as f:
            f.write(weights)
        return weights
    rng = np.random.default_rng(0)
    weights = {
        "layer1.weight": rng.standard_normal((512, 1024), dtype=np.float32),
        "layer1.bias": rng.standard_normal(1024, dtype=np.float32),
        "layer2.weight": rng.standard_normal((1024, 1024), dtype=np.float32),
        "step": np.array(1200),
    }
    with durable.atomic_write(url) as f:
        np.savez(f, **weights)
    return weights


def same_checkpoint(data: bytes, weights: Any) -> bool:
    if isinstance(weights, bytes):
        return data == weights
    import numpy as np

    with np.load(io.BytesIO(data)) as loaded:
        return sorted(loaded.files) == sorted(weights) and all(
            np.array_equal(loaded[k], v) for k, v in weights.items())


def run(root: str) -> None:
    ckpt = os.path.join(root, "checkpoint.npz")
    a_path = os.path.join(root, "dataset-a")
    b_path = os.path.join(root, "dataset-b")
    for leftover in (ckpt, a_path, b_path):  # a re-run with the same --dir starts clean
        Entry(leftover).delete()
    a, b = Entry(a_path), Entry(b_path)

    say(f"durable {durable.__version__} example pipeline, in {root}\n")
    say("1. A checkpoint, written atomically (temp file, fsync, rename, directory fsync)")
    weights = save_checkpoint(ckpt)
    st = Entry(ckpt).status()
    expect(st.state is State.COMPLETE, f"{ckpt} should be COMPLETE, is {st.state}")
    assert st.marker is not None and st.marker.manifest is not None
    rec = st.marker.manifest.objects[""]
    say(f"  checkpoint.npz: {rec.size:,} bytes, CRC32C {rec.crc32c:08x} on record")
    data = durable.read_verified(ckpt)
    expect(len(data) == rec.size, "read_verified returned a different length")
    expect(same_checkpoint(data, weights), "the checkpoint read back differs from the one saved")
    say(f"  read_verified: {len(data):,} bytes, length and CRC32C match, arrays equal\n")

    say(f"2. A dataset entry of {SHARDS} shards, committed by a marker written last")
    with a.writing() as w:
        write_shards(w, range(SHARDS // 2))
        inside = a.state()
        say(f"  half-way through the writing() block, dataset-a is {inside}")
        expect(inside is State.INCOMPLETE, f"dataset-a mid-write is {inside}, not INCOMPLETE")
        write_shards(w, range(SHARDS // 2, SHARDS))
    st = a.status()
    expect(st.state is State.COMPLETE, f"dataset-a after writing() is {st.state}")
    say(f"  after the block: dataset-a is {st.state} ({SHARDS} objects)\n")

    say("3. A second writer in its own process, SIGKILLed half-way through a shard")
    child = Child(b_path)
    try:
        for i in range(KILL_AT):
            child.ask("shard", f"wrote {shard_key(i)}")
        child.ask("half", f"half-written {shard_key(KILL_AT)}")
        say(f"  writer pid {child.proc.pid} reported {KILL_AT} shards written and "
            f"{shard_key(KILL_AT)} half-written; SIGKILL")
        rc = child.kill()
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
    expect(rc == -signal.SIGKILL, f"the writer exited with {rc}, not by SIGKILL")
    torn = [n for n in os.listdir(b_path) if ".durable-tmp-" in n]
    say(f"  it left {len(os.listdir(b_path)) - len(torn)} shards and {len(torn)} torn temp "
        "file, and no marker\n")
    expect(len(torn) == 1, f"expected the killed writer's one temp file, found {torn}")

    say("4. What the command line says of the two")
    code, out = durable_cli("status", a_path, show="status dataset-a")
    expect(code == 0 and word("COMPLETE", out), "`durable status` should say COMPLETE, exit 0")
    code, out = durable_cli("status", b_path, show="status dataset-b")
    expect(code == 3 and word("INCOMPLETE", out) and not word("COMPLETE", out),
           "`durable status` of the killed entry should say INCOMPLETE, exit 3")
    code, out = durable_cli("verify", "--deep", a_path, show="verify --deep dataset-a")
    expect(code == 0 and f"all {SHARDS} objects match" in out,
           "`durable verify --deep` of dataset-a should pass")
    code, out = durable_cli("verify", b_path, show="verify dataset-b")
    expect(code == 3 and word("INCOMPLETE", out),
           "`durable verify` of the killed entry should refuse it as INCOMPLETE, exit 3")
    try:
        durable.read_verified(os.path.join(b_path, shard_key(0)))
        expect(False, "read_verified returned a shard of an INCOMPLETE entry")
    except IncompleteError as exc:
        say(f"  read_verified(dataset-b/{shard_key(0)}) -> IncompleteError: {exc}")
    say()

    say("5. One flipped byte in a committed shard")
    bad = os.path.join(a_path, shard_key(CORRUPT))
    with open(bad, "r+b") as f:
        f.seek(SHARD_SIZE // 2)
        byte = f.read(1)
        f.seek(SHARD_SIZE // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    say(f"  flipped byte {SHARD_SIZE // 2} of dataset-a/{shard_key(CORRUPT)} (size unchanged)")
    code, out = durable_cli("verify", a_path, show="verify dataset-a")
    expect(code == 0, "`durable verify` (sizes only) cannot see a flipped byte: it should pass")
    code, out = durable_cli("verify", "--deep", a_path, show="verify --deep dataset-a")
    expect(code == 5 and shard_key(CORRUPT) in out and "crc32c" in out,
           f"`durable verify --deep` should fail (exit 5) naming {shard_key(CORRUPT)}")
    try:
        durable.read_verified(bad)
        expect(False, "read_verified returned the corrupt shard")
    except IntegrityError as exc:
        expect(shard_key(CORRUPT) in str(exc), "the IntegrityError should name the shard")
        say(f"  read_verified(dataset-a/{shard_key(CORRUPT)}) -> IntegrityError: {exc}")
    with a.writing(overwrite=True) as w:
        write_shards(w, range(SHARDS))
    report = a.verify(deep=True)
    expect(report.ok and report.objects == SHARDS, "the rewritten dataset-a should verify")
    say(f"  rewrote dataset-a (writing(overwrite=True)): verify(deep=True) checks "
        f"{report.objects} objects, {report.bytes_checked:,} bytes, OK\n")

    say("6. Finishing the killed entry: writing(resume=True) keeps its whole shards")
    with b.writing(resume=True) as w:
        have = {k for k in os.listdir(b_path) if k.startswith("part-")}
        write_shards(w, [i for i in range(SHARDS) if shard_key(i) not in have])
    left = [n for n in os.listdir(b_path) if ".durable-tmp-" in n]
    say(f"  kept {len(have)} shards of the killed writer, wrote {SHARDS - len(have)}, "
        f"dropped its temp file")
    expect(len(have) == KILL_AT, f"expected {KILL_AT} whole shards from the killed writer")
    expect(not left, f"the killed writer's temp file should be gone at commit: {left}")
    report = b.verify(deep=True)
    expect(report.ok and report.objects == SHARDS, "dataset-b should verify after resume")
    expect(all(durable.read_verified(os.path.join(b_path, shard_key(i))) == shard_bytes(i)
               for i in range(SHARDS)), "dataset-b's shards should hold the expected bytes")
    code, out = durable_cli("scan", root, show=f"scan {root}")
    # One table row per entry; other entries a --dir may hold are not ours to judge.
    rows = {name: [line for line in out.splitlines() if f"/{name} " in line]
            for name in ("checkpoint.npz", "dataset-a", "dataset-b")}
    expect(code == 0 and all(len(r) == 1 and word("COMPLETE", r[0]) and not
                             word("INCOMPLETE", r[0]) for r in rows.values()),
           f"`durable scan` should list the three entries COMPLETE, got {rows}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_writer"]:
        return writer_child(argv[1])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", help="work here (created if needed; default: a fresh temp dir, "
                                 "removed afterwards unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir to look at")
    args = p.parse_args(argv)
    root = os.path.abspath(args.dir) if args.dir else tempfile.mkdtemp(prefix="durable-demo-")
    os.makedirs(root, exist_ok=True)
    try:
        run(root)
    except ExpectationFailed as exc:
        say(f"\nFAILED after {checks} expectations held: {exc}")
        say(f"(files left in {root})")
        return 1
    say(f"\nAll {checks} expectations held.")
    if not args.dir and not args.keep:
        shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
