"""Shared timing helpers for the benchmarks: interleaved rounds, a table, a JSON record.

These machines are shared and noisy, so absolute times mean little from one run to the
next. Every case of a benchmark runs once per round, in a random order, in the same
process and on the same file system; only ratios between cases of the same run are
reported. Timing never decides a test.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Case:
    """One way of doing the benchmark's work; ``run(target)`` writes to a fresh ``target``."""

    name: str
    about: str
    run: Callable[[str], None]
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def scratch_dir(base: str | None, name: str) -> str:
    """A fresh directory for the files a benchmark writes (same file system as ``base``)."""
    root = base or tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"durable-{name}-", dir=root)


@contextlib.contextmanager
def targets(which: list[str], scratch: str | None, name: str, *, s3_prefix: str = ""
            ) -> Iterator[list[tuple[str, str, Any]]]:
    """(name, root URL, storage options) of each target asked for ("file": a fresh
    directory under ``scratch``; "moto": a fresh bucket on a moto server started here),
    removed or stopped on exit. ``s3_prefix``: a folder inside the bucket (e.g. "/w")."""
    import urllib.request
    import uuid

    out: list[tuple[str, str, Any]] = []
    with contextlib.ExitStack() as stack:
        if "file" in which:
            workdir = scratch_dir(scratch, name)
            stack.callback(remove, workdir)
            out.append(("file", workdir, None))
        if "moto" in which:
            from durable.testing.servers import start_moto

            server = stack.enter_context(start_moto())
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            urllib.request.urlopen(urllib.request.Request(f"{server.url}/{bucket}",
                                                          method="PUT")).close()
            out.append(("moto", f"s3://{bucket}{s3_prefix}", server.storage_options()))
        yield out


def remove(target: str) -> None:
    if os.path.isdir(target):
        shutil.rmtree(target)
    elif os.path.lexists(target):
        os.unlink(target)


def run_interleaved(cases: list[Case], *, rounds: int, warmup: int, workdir: str,
                    cleanup: Callable[[str], None] = remove, quiet: bool = False,
                    seed: int = 0) -> None:
    """Run every case once per round, in a new random order each round (seeded, so a run
    can be repeated), so that no case always goes first or always follows the same case.

    Each run gets a fresh target; removing it and `os.sync()` happen outside the timing, so
    one case's write-back does not land in the next case's time. Warm-up rounds (first
    touch of the file system's free space is much slower here) are run and discarded.
    """
    rng = random.Random(seed)
    for r in range(warmup + rounds):
        order = list(cases)
        rng.shuffle(order)
        for case in order:
            target = os.path.join(workdir, f"{case.name}-{r}")
            os.sync()
            c0, t0 = time.process_time(), time.perf_counter()
            case.run(target)
            t1, c1 = time.perf_counter(), time.process_time()
            cleanup(target)
            if r >= warmup:
                case.times.append(t1 - t0)
                case.cpu.append(c1 - c0)
        if not quiet:
            label = "warm-up" if r < warmup else f"round {r - warmup + 1}/{rounds}"
            print(f"  {label}: " + "  ".join(
                f"{c.name} {c.times[-1]:.3f}s" if r >= warmup else c.name for c in order),
                flush=True)


def ratios(case: Case, base: Case) -> dict[str, float]:
    """case/base by best time, by median time, and the median of per-round ratios."""
    paired = [a / b for a, b in zip(case.times, base.times, strict=True)]
    return {
        "best": case.best / base.best,
        "median": case.median / base.median,
        "paired_median": statistics.median(paired),
    }


def print_table(title: str, cases: list[Case], bases: list[Case]) -> None:
    """One row per case: times, then its ratio to each base (best and median)."""
    print(f"\n{title}")
    head = f"{'case':<20} {'best s':>8} {'median s':>8} {'cpu s':>6}"
    for b in bases:
        head += f"  {'/' + b.name + ' best':>16} {'median':>6}"
    print(head + "  what")
    for c in cases:
        row = f"{c.name:<20} {c.best:>8.4f} {c.median:>8.4f} {statistics.median(c.cpu):>6.3f}"
        for b in bases:
            r = ratios(c, b)
            row += f"  {r['best']:>16.3f} {r['median']:>6.3f}"
        print(row + f"  {c.about}")
    print("(ratios between cases of this run; best = min over rounds, cpu = median CPU "
          "time of this process)")


def machine_info(workdir: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_gib": _mem_total_gib(),
        "filesystem": _filesystem(workdir),
        "workdir": workdir,
    }
    try:
        import durable

        info["durable"] = durable.__version__
    except ImportError:
        pass
    try:
        import crc32c

        info["crc32c"] = {"version": getattr(crc32c, "__version__", None) or _dist_version(
            "crc32c"), "hardware_based": bool(getattr(crc32c, "hardware_based", False))}
    except ImportError:
        pass
    info["git"] = _git_state()
    return info


def load_snapshot() -> dict[str, Any]:
    """How busy the machine is: load average and Linux pressure (% of time stalled)."""
    snap: dict[str, Any] = {}
    with contextlib.suppress(OSError), open("/proc/loadavg") as f:
        snap["loadavg"] = [float(x) for x in f.read().split()[:3]]
    for what in ("cpu", "io"):
        try:
            with open(f"/proc/pressure/{what}") as f:
                some = f.readline().split()
            snap[f"{what}_pressure_some_avg60"] = float(some[2].partition("=")[2])
        except (OSError, IndexError, ValueError):
            pass
    return snap


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, out)
    return out


def case_record(case: Case, bases: list[Case]) -> dict[str, Any]:
    return {"about": case.about, "times_s": case.times, "cpu_s": case.cpu,
            "best_s": case.best, "median_s": case.median,
            "ratios": {"vs_" + b.name: ratios(case, b) for b in bases}}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _filesystem(path: str) -> dict[str, str] | None:
    """The /proc/mounts entry with the longest mount point that contains ``path``."""
    path = os.path.realpath(path)
    best: dict[str, str] | None = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts, *_ = line.split()
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and (best is None or len(mnt) > len(best["mount"])):
                    best = {"device": dev, "mount": mnt, "type": fstype, "options": opts}
    except OSError:
        return None
    return best


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _git_state() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"head": head, "src_modified": bool(dirty)}
