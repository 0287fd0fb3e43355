"""`durable.cached`: one computation per entry across processes, a policy for each state.

Real processes (tests/_cached_child.py) race, get SIGKILLed and SIGSTOPped; stores are the
local disk and S3 (moto), and fsspec's memory store for threads of one process.
Computations are counted through a file every computation appends a line to.
"""

from __future__ import annotations

import collections
import fcntl
import functools
import hashlib
import json
import os
import re
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import _cached_child
import durable
import durable._nesting
from _cached_child import Child, cached_compute, computations
from conftest import forkserver
from durable import (
    Entry,
    IncompleteExistsError,
    IntegrityError,
    LeaseLostError,
    State,
    UnsupportedError,
)
from durable._serializers import load_value
from durable.adapters.local import LOCK_SUFFIX
from durable.testing import faults
from durable.testing.faults import FaultProxy, RequestRecord
from durable.testing.pytest_plugin import Bucket

STALE = _cached_child.STALE_AFTER


@dataclass
class Store:
    kind: str
    root: str
    options: dict[str, Any] = field(default_factory=dict)

    def corrupt(self, url: str) -> None:
        """Flip the last byte of an object, around durable (same size)."""
        if self.kind == "local":
            path = url.removeprefix("file://")
            data = bytearray(Path(path).read_bytes())
            data[-1] ^= 0xFF
            Path(path).write_bytes(bytes(data))
        elif self.kind == "memory":
            fs = MemoryFileSystem()
            key = url.removeprefix("memory://")
            data = bytearray(fs.cat_file(key))
            data[-1] ^= 0xFF
            fs.pipe_file(key, bytes(data))
        else:
            import boto3

            bucket, _, key = url.removeprefix("s3://").partition("/")
            client = boto3.client("s3", endpoint_url=self.options["endpoint_url"],
                                  aws_access_key_id="testing", aws_secret_access_key="testing")
            data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
            data[-1] ^= 0xFF
            client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


@pytest.fixture
def counter(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "computations.log")
    _cached_child.COUNTER = path
    yield path
    _cached_child.COUNTER = None
    _cached_child.ON_COMPUTE = None
    _cached_child.ON_WRITE = None
    _cached_child.WRAP = False


@pytest.fixture
def local(tmp_path: Path) -> Store:
    return Store("local", os.path.realpath(tmp_path / "cache"))


@pytest.fixture
def memory() -> Iterator[Store]:
    root = f"/cached-{uuid.uuid4().hex[:12]}"
    yield Store("memory", f"memory://{root}")
    MemoryFileSystem().rm(root, recursive=True)


@pytest.fixture
def s3(s3_bucket: Bucket) -> Store:
    return Store("s3", s3_bucket.path("cache"), dict(s3_bucket.storage_options))


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def shared(request: pytest.FixtureRequest) -> Store:
    """A store several processes see: the local disk, or S3."""
    store: Store = request.getfixturevalue(request.param)
    return store


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def any_store(request: pytest.FixtureRequest) -> Store:
    store: Store = request.getfixturevalue(request.param)
    return store


def child(mode: str, store: Store, *args: str) -> Child:
    return Child(mode, store.root, json.dumps(store.options), *args)


# one computation per round --------------------------------------------------------------------
def race(store: Store, counter: str, n: int, n_rounds: int) -> list[dict[int, list[int]]]:
    """``n`` processes call ``compute(r)`` together, round after round."""
    ctx = forkserver()  # imported once in the fork server, not eight times over
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_cached_child.rounds, args=(
        store.root, store.options, counter, barrier, n_rounds, results, i)) for i in range(n)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * n
    failed = {i: g for i, g in got.items() if isinstance(g, str)}
    assert failed == {}
    return [got[i] for i in range(n)]


@pytest.mark.slow  # 8 x 30 miss-and-wait rounds; on moto 8 x 10, about 10-15 s, moto-bound
def test_processes_compute_each_entry_once(shared: Store, counter: str) -> None:
    # Each round is a race of its own (a new entry, all 8 callers released together): a
    # caller that computed without the lease, or did not wait for it, shows in any round;
    # on moto (a second a round) 10 of them, 30 on the local disk.
    n, n_rounds = 8, 30 if shared.kind == "local" else 10
    results = race(shared, counter, n, n_rounds)
    done = computations(counter)
    assert collections.Counter(x for x, _ in done) == {r: 1 for r in range(n_rounds)}
    winner = dict(done)
    assert len(set(winner.values())) > 1  # the race was real: more than one process won
    # Every caller got the one stored result (the computing process too: read back).
    for got in results:
        assert got == {r: [r, winner[r]] for r in range(n_rounds)}
    f = cached_compute(shared.root, shared.options, "raise")
    for r in range(n_rounds):
        assert f.entry(r).verify(deep=True).ok
        assert f(r).tolist() == [r, winner[r]]
    assert len(computations(counter)) == n_rounds


@pytest.mark.parametrize("policy", ["wait", None])
def test_threads_compute_each_entry_once(memory: Store, counter: str,
                                         policy: str | None) -> None:
    """Calls made at once compute once and all return that result: with "wait", and by
    default (a pool's workers calling the same function: under a "raise" default every
    caller but the first failed with IncompleteExistsError)."""
    n, rounds = 8, 30
    f = cached_compute(memory.root, {}, policy)
    barrier = threading.Barrier(n)
    results: list[list[list[int]]] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait()
                results[i].append(f(r).tolist())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert collections.Counter(x for x, _ in computations(counter)) == {
        r: 1 for r in range(rounds)}
    assert all(got == [[r, os.getpid()] for r in range(rounds)] for got in results)


# states ---------------------------------------------------------------------------------------
def test_hit_is_read_back_verified_and_never_recomputed(any_store: Store, counter: str) -> None:
    f = cached_compute(any_store.root, any_store.options, "raise")
    assert f.state(3) is State.ABSENT
    first = f(3)
    assert f.state(3) is State.COMPLETE
    assert f(3).tolist() == first.tolist() == [3, os.getpid()]
    assert len(computations(counter)) == 1
    assert f.entry(3).verify(deep=True).ok


def test_corrupt_result_is_an_integrity_error_never_a_recompute(any_store: Store,
                                                                counter: str) -> None:
    f = cached_compute(any_store.root, any_store.options, "raise")
    f(5)
    entry = f.entry(5)
    any_store.corrupt(f"{entry.url}/value.npy")
    for _ in range(2):
        with pytest.raises(IntegrityError, match=r"value\.npy.*CRC32C"):
            f(5)
    assert len(computations(counter)) == 1  # never recomputed over it
    f.clear(5)
    assert f(5).tolist() == [5, os.getpid()]


def test_killed_writer_raise_wait_takeover(shared: Store, counter: str) -> None:
    """SIGKILLed mid-write: "raise" names the entry at once, "wait" sees the lease go
    stale and calls it abandoned, "takeover" recomputes it."""
    kid = child("hold", shared, counter, "7", "write")
    kid.expect("writing")
    kid.kill()
    entry = cached_compute(shared.root, shared.options, "raise").entry(7)
    assert entry.state() is State.INCOMPLETE

    with pytest.raises(IncompleteExistsError) as raised:
        cached_compute(shared.root, shared.options, "raise")(7)
    text = str(raised.value)
    assert entry.url in text and f"pid {kid.pid}" in text
    assert "on_incomplete='wait'" in text and ".clear(" in text

    with pytest.raises(IncompleteExistsError, match="abandoned") as waited:
        cached_compute(shared.root, shared.options, "wait")(7)
    assert entry.url in str(waited.value) and "on_incomplete='takeover'" in str(waited.value)
    assert entry.state() is State.INCOMPLETE

    got = cached_compute(shared.root, shared.options, "takeover")(7)
    assert got.tolist() == [7, os.getpid()]
    assert computations(counter) == [(7, kid.pid), (7, os.getpid())]
    assert entry.verify(deep=True).ok


def test_wait_returns_a_live_writers_result(shared: Store, counter: str) -> None:
    kid = child("hold", shared, counter, "8", "compute")
    kid.expect("computing")
    f = cached_compute(shared.root, shared.options, "wait")
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(f(8)))
    waiter.start()
    # The writer is alive and renewing: the waiter must not call it abandoned, however
    # long it waits (it would return with an error).
    waiter.join(timeout=2.5 * STALE)
    assert waiter.is_alive() and got == []
    kid.go()
    assert kid.finish() == json.dumps([8, kid.pid])
    waiter.join()
    assert got[0].tolist() == [8, kid.pid]
    assert computations(counter) == [(8, kid.pid)]


def _stop_outside_lock(kid: Child, store: Store, entry: Entry) -> None:
    """SIGSTOP the child, but not inside a conditional write's lock (local disk): a
    stopped lock holder would hold off every other writer until it continues."""
    lock = os.path.dirname(entry.layout.lease) + LOCK_SUFFIX
    while True:
        kid.signal(signal.SIGSTOP)
        if store.kind != "local":
            return
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return  # free: released when fd closes
        except OSError:
            kid.signal(signal.SIGCONT)
        finally:
            os.close(fd)


def test_paused_writer_cannot_commit_after_takeover(shared: Store, counter: str) -> None:
    kid = child("hold", shared, counter, "9", "write")
    kid.expect("writing")  # inside Entry.writing(), lease held and checked
    entry = cached_compute(shared.root, shared.options, "raise").entry(9)
    _stop_outside_lock(kid, shared, entry)

    taking, finish = threading.Event(), threading.Event()

    def hold_taker() -> None:
        taking.set()
        assert finish.wait(60)

    _cached_child.ON_COMPUTE = hold_taker
    got: list[Any] = []
    taker = threading.Thread(target=lambda: got.append(
        cached_compute(shared.root, shared.options, "takeover")(9)))
    taker.start()
    try:
        assert taking.wait(60), "the taker never took the stopped writer's lease over"
        kid.signal(signal.SIGCONT)
        last = kid.finish()
        assert last.startswith("LeaseLostError"), last
        # The paused writer wrote its objects but no marker: the taker still computes.
        assert entry.read_marker() is None
    finally:
        finish.set()
        taker.join()
    assert got[0].tolist() == [9, os.getpid()]
    marker = entry.read_marker()
    assert marker is not None and marker.writer["pid"] == os.getpid()
    assert computations(counter) == [(9, kid.pid), (9, os.getpid())]
    assert entry.verify(deep=True).ok


@pytest.mark.parametrize("where", ["compute", "write"])
def test_a_paused_writer_whose_entry_another_committed_returns_that_result(
        shared: Store, counter: str, where: str) -> None:
    """Two callers race for one entry: the first is paused (SIGSTOP) while it computes or
    writes, the second takes its lease over and commits first. The first, resumed, has
    lost its lease and must not commit; the entry is COMPLETE, so it returns the winner's
    result, as the docs promise ("another process commits first: its result is
    returned"), where it raised LeaseLostError."""
    kid = child("hold", shared, counter, "13", where)
    kid.expect("computing" if where == "compute" else "writing")
    entry = cached_compute(shared.root, shared.options, "raise").entry(13)
    _stop_outside_lock(kid, shared, entry)
    try:
        got = cached_compute(shared.root, shared.options, "takeover")(13)
        assert got.tolist() == [13, os.getpid()]
    finally:
        kid.signal(signal.SIGCONT)
    assert kid.finish() == json.dumps([13, os.getpid()])
    marker = entry.read_marker()
    assert marker is not None and marker.writer["pid"] == os.getpid()
    assert computations(counter) == [(13, kid.pid), (13, os.getpid())]
    assert entry.verify(deep=True).ok


def test_a_writer_without_the_lease_cannot_get_in_while_we_compute(local: Store,
                                                                  counter: str) -> None:
    """A writer without a lease that wants in while we compute (resume, update, overwrite)
    is refused, naming our lease: it would commit our partial objects, or clear them while
    we write. We commit our own result."""
    f = cached_compute(local.root, {}, "raise")
    entry = f.entry(4)
    refused: list[str] = []

    def other_tries() -> None:
        for how in ("resume", "update", "overwrite"):
            with pytest.raises(IncompleteExistsError) as info, \
                    entry.writing(**{how: True}) as w:
                w.write_bytes("value.json", b"[4, 1]")
            refused.append(str(info.value))

    _cached_child.ON_COMPUTE = other_tries
    assert f(4).tolist() == [4, os.getpid()]
    assert len(refused) == 3
    assert all(entry.url in r and f"pid {os.getpid()}" in r and "expires at" in r
               for r in refused), refused
    assert f(4).tolist() == [4, os.getpid()]
    assert computations(counter) == [(4, os.getpid())]


def test_leftover_without_lease(local: Store, counter: str) -> None:
    f = cached_compute(local.root, {}, "raise")
    entry = f.entry(6)
    os.makedirs(entry.path)
    Path(entry.path, "value.npy").write_bytes(b"half")  # written by no durable writer
    for policy in ("raise", "wait"):
        with pytest.raises(IncompleteExistsError, match="no writer holds its lease"):
            cached_compute(local.root, {}, policy)(6)
    assert computations(counter) == []
    assert cached_compute(local.root, {}, "takeover")(6).tolist() == [6, os.getpid()]


def test_recompute_and_clear(local: Store, counter: str) -> None:
    f = cached_compute(local.root, {}, "raise")
    f(2)
    assert f.recompute(2).tolist() == [2, os.getpid()]
    assert len(computations(counter)) == 2
    f.clear(2)
    assert f.state(2) is State.ABSENT
    assert f(2).tolist() == [2, os.getpid()]
    assert len(computations(counter)) == 3


def test_a_recompute_that_fails_keeps_the_result_it_was_to_replace(local: Store) -> None:
    fail = {"now": False}

    @durable.cached(local.root)
    def f(x: int) -> bytes:
        if fail["now"]:
            raise ConnectionError("upstream outage")
        return b"good %d" % x

    assert f(1) == b"good 1"
    fail["now"] = True
    with pytest.raises(ConnectionError, match="upstream outage"):
        f.recompute(1)
    assert f.state(1) is State.COMPLETE
    assert f(1) == b"good 1"  # read back, not computed (that would raise)
    fail["now"] = False
    assert f.recompute(1) == b"good 1"


@pytest.mark.parametrize("now", ["a tuple", "an object array", "a serializer error"])
def test_a_recompute_whose_value_cannot_be_stored_keeps_the_old_result(
        local: Store, now: str) -> None:
    """The computation succeeded, but its value could not be stored: the old result was
    cleared first (overwrite), then the write failed, and the entry was ABSENT."""
    class Refused(bytes):
        pass

    def dumps(value: bytes) -> bytes:
        raise ValueError("cannot encode it")

    durable.register_serializer(Refused, name="refused-test", dumps=dumps, loads=bytes)
    values = {"a tuple": (1, 2), "an object array": np.array([None, 1], dtype=object),
              "a serializer error": Refused(b"x")}
    mode = {"v": "good"}

    @durable.cached(local.root, version=now.replace(" ", "-"))
    def f() -> Any:
        return b"good" if mode["v"] == "good" else values[now]

    assert f() == b"good"
    mode["v"] = "bad"
    with pytest.raises((TypeError, ValueError)):
        f.recompute()
    assert f.state() is State.COMPLETE
    assert f() == b"good"


# keys and serializers -------------------------------------------------------------------------
def test_key_is_canonical_inspectable_and_versioned(local: Store) -> None:
    calls: list[tuple[Any, ...]] = []

    @durable.cached(local.root)
    def g(a: int, b: str = "x y", *rest: int, **kw: Any) -> dict[str, Any]:
        calls.append((a, b, rest, kw))
        return {"a": a}

    assert g.entry(1).url == g.entry(1, "x y").url == g.entry(a=1, b="x y").url
    name = g.entry(1).url.rsplit("/", 1)[1]
    assert name.startswith("a=1,b=x_y-") and len(name.rsplit("-", 1)[1]) == 16
    assert "/test_cached.test_key_is_canonical_inspectable_and_versioned._locals_.g/v1/" \
        in g.entry(1).url
    assert g.entry(1).url != g.entry(1, "x_y").url  # the readable part is a hint only
    assert g.entry(1, "b", 2, k=[1, 2]).url != g.entry(1, "b", 2, k=[1, 3]).url
    g(1)
    doc = json.loads(Path(g.entry(1).path, "key.json").read_bytes())
    assert doc["key"] == {"a": 1, "b": "x y", "rest": [], "kw": {}}
    assert doc["version"] == "1"
    assert doc["function"] == (f"{__name__}.test_key_is_canonical_inspectable_and_versioned."
                               "<locals>.g")

    v2 = durable.cached(local.root, version="2")(g.__wrapped__)
    assert "/v2/" in v2.entry(1).url and v2.state(1) is State.ABSENT

    with pytest.raises(TypeError, match=r"argument 'a'.*pass key="):
        g(object())
    keyed = durable.cached(local.root, key=lambda a, *r, **k: {"id": id(a) * 0 + 1})(
        g.__wrapped__)
    assert keyed.entry(object()).url == keyed.entry(object()).url


_SCRIPT = """
import multiprocessing as mp, os, sys
import durable

@durable.cached(sys.argv[1])
def tokenize(shard):
    with open(os.path.join(sys.argv[1], "computed.log"), "a") as f:
        f.write(f"{shard}\\n")
    return b"tokens-%d" % shard

def work(shard):
    return tokenize(shard)

if __name__ == "__main__":
    tokenize(1)
    with mp.get_context("spawn").Pool(1) as pool:
        print(pool.map(work, [1]))
"""


def _run_script(tmp_path: Path, source: str) -> tuple[Path, str]:
    """Run ``source`` as a script (a real __main__) with a cache root; (root, stdout)."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(source)
    root = tmp_path / "cache"
    root.mkdir()
    out = subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return root, out


def test_a_script_and_its_spawned_workers_share_one_entry(tmp_path: Path) -> None:
    """In the workers multiprocessing spawns, a script's module is __mp_main__: its
    results were filed a second time under that name, and computed again."""
    root, out = _run_script(tmp_path, _SCRIPT)
    assert "b'tokens-1'" in out
    assert (root / "computed.log").read_text().split() == ["1"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != ".durable") \
        == ["job.py.tokenize"]


def test_two_scripts_functions_of_one_name_never_share_entries(tmp_path: Path) -> None:
    """Every script's module is __main__: prep_v1.py's and prep_v2.py's ``tokenize``, both
    cached under one root, were both ``__main__.tokenize``, and the second script got the
    first one's results. A script's functions are named after its file (``prep_v1.py``);
    one run with ``python -m`` after its module's name, as when imported."""
    import subprocess
    import sys

    root = tmp_path / "cache"
    root.mkdir()
    outs = []
    for version in ("v1", "v2"):
        script = tmp_path / f"prep_{version}.py"
        script.write_text(_SCRIPT.replace('b"tokens-%d"', f'b"{version}-tokens-%d"'))
        outs.append(subprocess.run([sys.executable, str(script), str(root)],
                                   capture_output=True, text=True, timeout=120,
                                   check=True).stdout)
    assert "b'v1-tokens-1'" in outs[0] and "b'v2-tokens-1'" in outs[1]
    assert (root / "computed.log").read_text().split() == ["1", "1"]
    module = subprocess.run([sys.executable, "-m", "prep_v2", str(root)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=True).stdout
    assert "b'v2-tokens-1'" in module
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != ".durable") \
        == ["prep_v1.py.tokenize", "prep_v2.py.tokenize", "prep_v2.tokenize"]


_SCRIPT_TYPES = """
import dataclasses, enum, multiprocessing as mp, os, sys
import durable

class Kind(enum.Enum):
    A = 1

@dataclasses.dataclass(frozen=True)
class Cfg:
    n: int

@durable.cached(sys.argv[1])
def run(kind, cfg):
    with open(os.path.join(sys.argv[1], "computed.log"), "a") as f:
        f.write(f"{kind.name}-{cfg.n}\\n")
    return cfg.n

def work(n):
    return run(Kind.A, Cfg(n))

if __name__ == "__main__":
    run(Kind.A, Cfg(1))
    with mp.get_context("spawn").Pool(1) as pool:
        print(pool.map(work, [1]))
"""


def test_a_scripts_enum_and_dataclass_arguments_key_alike_in_its_spawned_workers(
        tmp_path: Path) -> None:
    """An enum or dataclass defined in a script is __main__'s there and __mp_main__'s in
    the workers multiprocessing spawns: its tag named the module, so a worker's call had
    another key, and the result was computed and stored twice."""
    root, out = _run_script(tmp_path, _SCRIPT_TYPES)
    assert "[1]" in out
    assert (root / "computed.log").read_text().split() == ["A-1"]


def test_a_dict_spelled_like_a_tagged_value_has_a_key_of_its_own(local: Store) -> None:
    """Values JSON cannot hold are tagged ({"set": [...]}); a dict argument spelled the same
    way shared their entry, and one call returned the other's result."""
    import datetime as dt

    def f_result(x: Any) -> Any:
        return repr(x)

    f = durable.cached(local.root)(f_result)
    for value, lookalike in (({1, 2}, {"set": [1, 2]}),
                             (float("nan"), {"float": "nan"}),
                             (dt.datetime(2020, 1, 1), {"datetime": "2020-01-01T00:00:00"}),
                             ({"set": [1]}, {"dict": {"set": [1]}})):
        assert f.entry(value).url != f.entry(lookalike).url
        assert f(value) == repr(value) and f(lookalike) == repr(lookalike)
    # NumPy times whose .item() is an int, None or a timedelta: keys of their own.
    ns = np.datetime64("2020-01-01T00:00:00", "ns")
    for value, lookalike in ((ns, int(ns.astype(np.int64))),
                             (np.datetime64("NaT"), None),
                             (np.timedelta64(5, "ns"), 5),
                             (np.timedelta64(5, "s"), "5 seconds")):
        assert f.entry(value).url != f.entry(lookalike).url
        assert f(value) == repr(value) and f(lookalike) == repr(lookalike)
    # A dict with no tag's name keeps its plain key (entries cached before stay found).
    f({"a": 1})
    assert json.loads(Path(f.entry({"a": 1}).path, "key.json").read_bytes())["key"] == \
        {"x": {"a": 1}}


def test_methods_are_bound_and_nameless_callables_refused(local: Store) -> None:
    class Model:
        def __init__(self, scale: int) -> None:
            self.scale = scale

        @durable.cached(local.root, key=lambda self, x: {"scale": self.scale, "x": x})
        def predict(self, x: int) -> list[int]:
            return [self.scale * x]

        @durable.cached(local.root)
        def unkeyed(self, x: int) -> int:
            return x

    assert Model(3).predict(2) == [6]
    assert Model(3).predict(2) == [6]  # a hit: the key is the scale and x, not identity
    assert Model(4).predict(2) == [8]
    assert Model.predict.state(Model(3), 2) is State.COMPLETE
    with pytest.raises(TypeError, match=r"argument 'self'.*pass key="):
        Model(1).unkeyed(1)
    with pytest.raises(TypeError, match="needs a function with a name"):
        durable.cached(local.root)(functools.partial(max, 1))
    # Lambdas all have one name: two under one root shared entries (one returned the
    # other's results).
    with pytest.raises(TypeError, match=r"defined with def, got a lambda \(test_cached\."):
        durable.cached(local.root)(lambda x: x + 1)


def _value_keys(entry: Entry) -> list[str]:
    marker = entry.read_marker()
    assert marker is not None and marker.manifest is not None
    return sorted(marker.manifest.objects)


@pytest.mark.parametrize(("value", "stored"), [
    (b"\x00\x01raw", "value.bin"),
    ({"a": [1, 2.5, None, True, "s"]}, "value.json"),
    (np.arange(12, dtype=np.float32).reshape(3, 4), "value.npy"),
    (np.asfortranarray(np.arange(12, dtype=">i2").reshape(3, 4)), "value.npy"),
    (np.array(2.5), "value.npy"),
    (np.zeros(3, dtype=[("a", "<i4"), ("b", "?")]), "value.npy"),
    (np.ones(2, dtype=[("名前", "<i4"), ("b", "?")]), "value.npy"),  # .npy format 3.0
    (np.array([], dtype=np.uint8), "value.npy"),
])
def test_serializers_by_type(local: Store, value: Any, stored: str) -> None:
    def f_result() -> Any:
        return value

    f = durable.cached(local.root)(f_result)
    got = f()
    assert _value_keys(f.entry()) == ["key.json", stored]
    if isinstance(value, np.ndarray):
        assert got.dtype == value.dtype and got.shape == value.shape
        assert (got == value).all() and got.flags.writeable
        assert got.flags.f_contiguous == value.flags.f_contiguous
    else:
        assert got == value


def test_dataframe_as_parquet(local: Store) -> None:
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"a": [1, 2], "b": ["x", "y"]})
    def f_result() -> Any:
        return frame

    f = durable.cached(local.root)(f_result)
    pd.testing.assert_frame_equal(f(), frame)
    assert "value.parquet" in _value_keys(f.entry())


def test_xarray_as_zarr(local: Store) -> None:
    xr = pytest.importorskip("xarray")
    ds = xr.Dataset({"t": (("x",), np.arange(6.0))}, coords={"x": np.arange(6)})
    def f_result() -> Any:
        return ds

    f = durable.cached(local.root)(f_result)
    xr.testing.assert_identical(f().load(), ds)
    def da_result() -> Any:
        return ds["t"].rename(None)

    da = durable.cached(local.root, version=2)(da_result)
    xr.testing.assert_identical(da().load(), ds["t"].rename(None))
    keys = _value_keys(f.entry())
    assert "value.zarr/zarr.json" in keys and "key.json" in keys


def test_a_dataset_sliced_from_a_zarr_store_is_stored(local: Store) -> None:
    """A step returning part of a dataset opened from zarr (an upstream cached result):
    its variables keep the store's encoding["chunks"], the slice's dask chunks no longer
    line up with them, and xarray refused the write after the computation."""
    xr = pytest.importorskip("xarray")
    source = xr.Dataset({"v": (("t", "x"), np.arange(40.0).reshape(10, 4))}).chunk({"t": 3})

    @durable.cached(local.root)
    def upstream() -> Any:
        return source

    @durable.cached(local.root)
    def tail(start: int) -> Any:
        return upstream().isel(t=slice(start, None))

    got = tail(1)
    assert tail.state(1) is State.COMPLETE
    xr.testing.assert_identical(got.load(), source.isel(t=slice(1, None)).load())
    xr.testing.assert_identical(tail(1).load(), got)


@pytest.mark.parametrize("which", ["time", "lat", "v"])
def test_a_coordinate_dataarray_is_stored_under_its_name(local: Store, which: str) -> None:
    """ds["time"] or ds.lat (a DataArray named like one of its own coordinates): to_dataset
    refused it after the computation ("same name as one of its coordinates")."""
    xr = pytest.importorskip("xarray")
    pd = pytest.importorskip("pandas")
    ds = xr.Dataset({"v": (("time",), np.arange(4.0))},
                    coords={"time": pd.date_range("2020-01-01", periods=4),
                            "lat": ("time", np.arange(4.0) * 2)})

    @durable.cached(local.root, version=which)
    def pick() -> Any:
        return ds[which]

    xr.testing.assert_identical(pick().load(), ds[which])
    xr.testing.assert_identical(pick().load(), ds[which])  # the hit
    assert "value.dataarray.zarr/zarr.json" in _value_keys(pick.entry())


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("make", ["masked", "matrix", "recarray"])
def test_array_subclasses_are_refused_not_stored_as_plain_arrays(
        local: Store, make: str) -> None:
    """A masked array came back as a plain ndarray without its mask (its mean changed),
    np.matrix without its `*`: they are refused like tuples, not silently changed."""
    import numpy as np

    makers = {"masked": lambda: np.ma.masked_array([1.0, -9999.0, 3.0],
                                                   mask=[False, True, False]),
              "matrix": lambda: np.matrix([[1, 2], [3, 4]]),
              "recarray": lambda: np.rec.fromrecords([(1, 2.0)], names="a,b")}

    def values() -> Any:
        return makers[make]()

    f = durable.cached(local.root, version=make)(values)
    with pytest.raises(TypeError, match=r"no serializer stores a numpy\..*pickle=True"):
        f()
    assert f.state() is State.ABSENT
    p = durable.cached(local.root, pickle=True, version=make)(values)
    got = p()
    assert type(got) is type(values())
    if make == "masked":
        assert got.mean() == 2.0


@pytest.mark.parametrize(("value", "named"), [
    ({"m": 1.5, "n": np.float64(2.5)}, "the value['n'] is a numpy.float64"),
    ([1, {"a": (1, 2)}], "the value[1]['a'] is a builtins.tuple"),
    ({"x": {3: "three"}}, "the value['x'] has the key 3, a builtins.int"),
])
def test_a_value_that_is_almost_json_names_the_element_in_the_way(
        local: Store, value: Any, named: str) -> None:
    """A metrics dict with one NumPy scalar in it: the error names that element, not only
    the dict around it."""
    def f_result() -> Any:
        return value

    f = durable.cached(local.root, version=named[:12])(f_result)
    with pytest.raises(TypeError, match=re.escape(named)):
        f()
    assert f.state() is State.ABSENT


def test_pickle_only_when_asked(local: Store) -> None:
    def f_result() -> Any:
        return (1, "tuple")

    f = durable.cached(local.root)(f_result)
    with pytest.raises(TypeError, match=r"tuple.*pickle=True"):
        f()
    assert f.state() is State.ABSENT
    p = durable.cached(local.root, pickle=True)(f.__wrapped__)
    assert p() == (1, "tuple")
    with pytest.raises(UnsupportedError, match="pickle=True"):
        durable.cached(local.root)(f.__wrapped__)()


def test_registered_serializer(local: Store) -> None:
    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

    durable.register_serializer(Point, name="point-test", dumps=lambda p: str(p.x).encode(),
                                loads=lambda b: Point(int(b)))
    def f_result() -> Any:
        return Point(3)

    f = durable.cached(local.root)(f_result)
    assert f().x == 3
    assert "value.point-test" in _value_keys(f.entry())
    with pytest.raises(ValueError, match="built-in"):
        durable.register_serializer(Point, name="npy", dumps=bytes, loads=bytes)


def test_lease_lost_mid_computation_never_commits(local: Store, counter: str) -> None:
    """The lease is removed under a computing writer (Entry.delete(force=True) by hand):
    it must not commit over what it no longer owns."""
    f = cached_compute(local.root, {}, "raise")
    entry = f.entry(11)
    _cached_child.ON_COMPUTE = functools.partial(entry.delete, force=True)
    with pytest.raises(LeaseLostError):
        f(11)
    assert entry.read_marker() is None


def test_clear_refuses_an_entry_being_computed(local: Store, counter: str) -> None:
    """clear() while a call computes the entry would leave the computing call writing
    into a deleted entry: refused, naming the entry and the holder; the call commits."""
    f = cached_compute(local.root, {}, "raise")
    entry = f.entry(12)
    refused: list[str] = []

    def clear_meanwhile() -> None:
        with pytest.raises(IncompleteExistsError) as info:
            f.clear(12)
        refused.append(str(info.value))

    _cached_child.ON_COMPUTE = clear_meanwhile
    assert f(12).tolist() == [12, os.getpid()]
    assert len(refused) == 1 and entry.url in refused[0]
    assert f"pid {os.getpid()}" in refused[0] and ".entry(...).delete(force=True)" in refused[0]
    assert entry.state() is State.COMPLETE
    _cached_child.ON_COMPUTE = None
    f.clear(12)  # no writer at work: removed
    assert entry.state() is State.ABSENT


def test_clear_racing_a_call_that_takes_the_lease_never_removes_it(
        local: Store, counter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call takes the entry's lease just after clear() looked for one: clear() then
    deleted with force=True, removing the call's live lease and entry under it (the call
    never committed, its work lost). Now the delete holds the lease itself, so it is
    refused, naming the entry, and the call's lease stays held."""
    import durable._cached

    f = cached_compute(local.root, {}, "raise")
    f(13)
    entry = f.entry(13)
    taken: list[durable.Lease] = []
    look = durable._cached.refuse_live_lease

    def then_a_call_takes_it(*args: Any, **kwargs: Any) -> Any:
        found = look(*args, **kwargs)
        taken.append(durable.Lease(entry).acquire())
        return found

    monkeypatch.setattr(durable._cached, "refuse_live_lease", then_a_call_takes_it)
    try:
        with pytest.raises(IncompleteExistsError, match="not clearing") as refused:
            f.clear(13)
        assert entry.url in str(refused.value)
        assert taken[0].held and entry.state() is State.COMPLETE
    finally:
        for lease in taken:
            lease.release()


def test_a_store_without_conditional_writes_is_refused_with_advice_cached_can_follow(
        tmp_path: Path, counter: str) -> None:
    """On a store that cannot enforce conditional writes (a generic fsspec filesystem; an
    S3-compatible endpoint ignoring If-None-Match) the call failed with the lease's advice,
    "Pass best_effort=True", an argument cached does not take. The refusal names the
    function, the entry and the store's adapter, and what works; nothing is computed."""
    import fsspec
    from fsspec.implementations.dirfs import DirFileSystem

    fs = DirFileSystem(path=str(tmp_path), fs=fsspec.filesystem("file"))
    f = cached_compute("dir://cache", dict(fs.storage_options), "raise")
    with pytest.raises(UnsupportedError) as info:
        f(3)
    message = str(info.value)
    assert message.startswith(f"{f.entry(3).url}: compute cannot be cached here")
    assert "generic adapter" in message and "durable.Lease(url, best_effort=True)" in message
    assert "Pass best_effort=True" not in message
    assert computations(counter) == []
    assert f.state(3) is State.ABSENT



# requests per call on S3 ----------------------------------------------------------------------
@pytest.fixture
def proxied(s3_bucket: Bucket) -> Iterator[tuple[Store, FaultProxy]]:
    """The S3 store reached through the fault proxy, which logs every request."""
    with FaultProxy(upstream=s3_bucket.server.url) as proxy:
        options = dict(s3_bucket.storage_options, endpoint_url=proxy.url)
        yield Store("s3", s3_bucket.path("cache"), options), proxy


def _request_kinds(requests: list[RequestRecord], entry: Entry) -> collections.Counter[str]:
    """Requests by what they touch, relative to ``entry``: "GET marker 404", "LIST data",
    "PUT lease If-Match 200", ... (keys are path-style: the bucket is the first segment)."""
    data = entry.path.split("/", 1)[1]
    records = entry.layout.records.split("/", 1)[1]
    kinds: collections.Counter[str] = collections.Counter()
    for r in requests:
        cond = (" If-None-Match" if "if-none-match" in r.headers
                else " If-Match" if "if-match" in r.headers else "")
        if "list-type" in r.query:
            prefix = r.query["prefix"][0].rstrip("/")
            what = {data: "data", records: "records"}.get(prefix, prefix)
            name = (f"LIST {what}" + (" delimiter" if "delimiter" in r.query
                                      else " max-keys=1" if "max-keys" in r.query else ""))
        elif r.method == "POST" and "delete" in r.query:
            name = "DeleteObjects"
        else:
            if r.key.startswith(records + "/"):
                rel = r.key[len(records) + 1:]
                what = ("attempt record" if rel.startswith("attempts/")
                        else {"commit.json": "marker", "lease.json": "lease"}.get(rel, rel))
            elif r.key.startswith(data + "/"):
                rel = r.key[len(data) + 1:]
                what = "value" if rel.startswith("value.") else rel
            elif r.key.endswith("/commit.json"):
                what = "marker above"  # of a folder above the entry
            else:
                what = "entry" if r.key == data else r.key
            name = f"{r.method} {what}{cond}"
        kinds[f"{name} {r.status}"] += 1
    return kinds


@pytest.mark.s3
@pytest.mark.parametrize("value", [np.arange(16.0), {"a": [1, 2.5], "b": "text"}],
                         ids=["ndarray", "dict"])
def test_requests_of_a_miss_and_a_hit_are_pinned(proxied: tuple[Store, FaultProxy],
                                                 value: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request of one miss and one hit of a small result, by kind: a change in what a
    call costs on an object store shows up here (update the counts on purpose only)."""
    store, proxy = proxied
    # The look for a committed entry above is skipped in a folder seen clear in the last
    # seconds: long enough here that the second miss below never depends on the clock.
    monkeypatch.setattr(durable._nesting, "_CLEAR_FOR", 600.0)
    calls: list[int] = []

    def small(x: int) -> Any:
        calls.append(x)
        return value

    # stale_after=600: no heartbeat (every 120 s) can add a renewal to the count.
    f = durable.cached(store.root, storage_options=store.options, stale_after=600)(small)
    f(0)  # the first miss of a process probes the endpoint (create-only, If-Match): apart
    entry = f.entry(1)

    durable._nesting._SEEN_CLEAR.clear()  # a folder not written in the last seconds
    proxy.clear_requests()
    f(1)
    miss = _request_kinds(proxy.requests, entry)
    assert miss == {
        "GET marker 404": 1,               # the look for a hit
        "PUT lease If-None-Match 200": 1,  # the writer lease, create-only: one writer
        "GET marker above 404": 3,         # writing(): no committed entry around this one
                                           # (one per folder above it, asked at once)
        "LIST records 200": 2,             # writing(): no marker nor other writer since the
                                           # look; commit: no other writer's marker
        "LIST data delimiter 200": 1,      # writing(): no object at the path nor below it
                                           # (data left by a writer without the lease)
        "PUT attempt record 200": 1,       # this attempt, seen by scan / clean
        "PUT value 200": 1,                # the result
        "PUT key.json 200": 1,             # the canonical arguments, for inspection
        "PUT lease If-Match 200": 2,       # commit: the lease proven held; the fence
        "LIST data 200": 1,                # commit: the data is what the writer recorded
        "PUT marker If-None-Match 200": 1,  # the commit, create-only
        "DeleteObjects 200": 1,            # the attempt record, once committed
        "GET value 200": 1,                # read back, verified against the writer's records
        "DELETE lease If-Match 204": 1,    # release, if still ours
    }

    proxy.clear_requests()
    got = f(1)
    assert _request_kinds(proxy.requests, entry) == {
        "GET marker 200": 1,  # the marker, with the manifest
        "GET value 200": 1,   # the value, verified against the manifest's size and CRC32C
    }
    np.testing.assert_equal(got, value)
    # Another miss in the same folder at once: no look above (it was seen clear).
    proxy.clear_requests()
    f(2)
    del miss["GET marker above 404"]
    assert _request_kinds(proxy.requests, f.entry(2)) == miss
    assert calls == [0, 1, 2]
    assert not proxy.errors


@pytest.mark.s3
def test_a_miss_returns_only_what_the_store_kept(proxied: tuple[Store, FaultProxy],
                                                counter: str) -> None:
    """The miss does not read its marker back, but still reads its value back, verified
    against what it wrote: bytes the store kept wrong are an error, never the result."""
    store, proxy = proxied
    # The last byte of the value's PutObject is flipped on the way, and moto keeps it
    # despite the CRC32C sent with it; GETs come without the store's checksum (a store
    # without flexible checksums), so only durable's own check stands between.
    proxy.add(faults.corrupt_part_bytes(offset=-1, method="PUT", key="/value.npy",
                                        query="!uploadId"))
    proxy.add(faults.strip_headers(method="GET"))
    f = cached_compute(store.root, store.options, "raise")
    for _ in range(2):  # the miss, then a hit of what it committed
        with pytest.raises(IntegrityError, match=r"value\.npy: \d+ bytes with CRC32C"):
            f(12)
    assert computations(counter) == [(12, os.getpid())]  # never recomputed over it
    assert proxy.count(method="PUT", key="/value.npy") == 1


@pytest.mark.s3
def test_a_loser_of_the_lease_race_reads_the_winners_marker_once(
        s3_bucket: Bucket, proxied: tuple[Store, FaultProxy], counter: str) -> None:
    """Another writer takes the lease and commits between our look and our lease: the
    marker the wait finds is the one the result is loaded from (not read again), and it is
    the winner's result, never computed here."""
    store, proxy = proxied
    f = cached_compute(store.root, store.options, "raise")
    f(0)  # the endpoint probes, apart
    direct = Entry(f.entry(13).url, storage_options=s3_bucket.storage_options)
    winner: list[durable.Lease] = []

    def commit_first(_: faults.RequestInfo) -> bool:
        # In the proxy, before our create-only lease PUT goes on: the winner, straight to
        # moto, takes the lease and commits, and holds the lease on.
        if not winner:
            winner.append(durable.Lease(direct).acquire())
            with direct.writing(lease=winner[0]) as w:
                w.write_bytes("value.json", b"[13, 1]")
                w.write_bytes("key.json", b"{}")
        return True

    proxy.add(faults.delay(0, match=faults.Match(methods="PUT", key="/lease.json",
                                                 where=commit_first)))
    proxy.clear_requests()
    try:
        assert f(13) == [13, 1]
    finally:
        for lease in winner:
            lease.release()
    assert _request_kinds(proxy.requests, f.entry(13)) == {
        "GET marker 404": 1,               # the look for a hit
        "PUT lease If-None-Match 412": 1,  # the winner holds the lease
        "GET lease 200": 1,                # the refused PUT: not our own retry landed?
                                           # (its bytes against ours: `_s3_light`)
        "HEAD lease 200": 1,               # the wait: one look at the lease,
        "GET marker 200": 1,               # ... and at the marker before a verdict: committed
        "GET value 200": 1,                # the winner's value, verified
    }
    assert computations(counter) == [(0, os.getpid())]
    assert not proxy.errors


@pytest.mark.parametrize("dtype", [object, [("n", "<i4"), ("name", object)]])
def test_an_array_holding_objects_is_pickled_when_allowed_else_refused_saying_why(
        local: Store, dtype: Any) -> None:
    """A structured array with an object field is not of kind "O": the npy serializer took
    it, and numpy.save refused it after the computation, even with pickle=True."""
    value = np.zeros(2, dtype=dtype)

    def objects() -> Any:
        return value

    f = durable.cached(local.root, version="plain")(objects)
    with pytest.raises(TypeError, match=r"numpy\.ndarray \(its dtype .* holds Python objects"):
        f()
    assert f.state() is State.ABSENT
    p = durable.cached(local.root, version="pickled", pickle=True)(objects)
    assert p().dtype == value.dtype and p().tolist() == value.tolist()
    assert _value_keys(p.entry()) == ["key.json", "value.pkl"]


def test_structured_array_arguments_with_other_fields_have_keys_of_their_own(
        local: Store) -> None:
    """A structured dtype's str is "|V8" alone: a table with fields (a, b) and one with
    (x, y) of the same bytes shared an entry, and one call returned the other's result."""
    @durable.cached(local.root)
    def names(table: np.ndarray) -> list[str]:
        return list(table.dtype.names)

    ab = np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f4")])
    xy = ab.astype([("x", "<i4"), ("y", "<f4")])
    ints = ab.astype([("a", "<i4"), ("b", "<i4")])  # same size, another type
    assert ab.tobytes() == xy.tobytes() and ab.dtype.str == ints.dtype.str
    assert names(ab) == ["a", "b"]
    assert names(xy) == ["x", "y"]
    assert len({names.entry(t).url for t in (ab, xy, ints)}) == 3
    plain = np.arange(3, dtype="<i4")  # keys of plain arrays are what they were
    doc = durable._cached._canonical(plain, "x")
    assert doc["ndarray"]["dtype"] == "<i4"


def test_pandas_times_and_datetime_subclasses_never_share_a_dicts_key(local: Store) -> None:
    """A datetime subclass was tagged by its own type's name ({"Timestamp": ...}), which no
    dict argument spelled the same way was kept from: one call returned the other's. So was
    a str enum's member keyed as its plain string."""
    import datetime as dt
    import enum

    import pandas as pd

    class Stamp(dt.datetime):
        pass

    @durable.cached(local.root)
    def show(x: Any) -> str:
        return repr(x)

    class Color(enum.StrEnum):
        RED = "red"

    ts = pd.Timestamp("2024-01-01T00:00:00.000000001")
    for value, lookalike in ((ts, {"Timestamp": ts.isoformat()}),
                             (Color.RED, "red"),
                             (pd.NaT, {"NaTType": "NaT"}),
                             (pd.Timedelta(1), {"Timedelta": pd.Timedelta(1).isoformat()}),
                             (dt.timedelta(1), {"timedelta": str(dt.timedelta(1))}),
                             (Stamp(2024, 1, 1), {"Stamp": "2024-01-01T00:00:00"})):
        # The hash, not the URL: the readable part of it is a hint that may differ anyway.
        assert show._locate((value,), {})[2] != show._locate((lookalike,), {})[2]
        assert show(value) == repr(value) and show(lookalike) == repr(lookalike)
    # Another datetime subclass (freezegun's, pendulum's) is keyed as the datetime it is.
    assert show.entry(Stamp(2024, 1, 1)).url == show.entry(dt.datetime(2024, 1, 1)).url


def test_timedelta_and_dataclass_arguments_are_keys_equal_for_equal_values(
        local: Store) -> None:
    """datetime.timedelta and dataclass arguments were refused (a TypeError asking for
    key=), though each has a spelling that tells its values apart."""
    import dataclasses
    import datetime as dt
    import threading

    import pandas as pd

    @dataclasses.dataclass(frozen=True)
    class Config:
        lr: float
        steps: int = 10
        tags: tuple[str, ...] = ()

    @dataclasses.dataclass(frozen=True)
    class Other:
        lr: float
        steps: int = 10
        tags: tuple[str, ...] = ()

    calls: list[Any] = []

    @durable.cached(local.root)
    def run(x: Any) -> str:
        calls.append(x)
        return repr(x)

    assert run(Config(0.1, tags=("a",))) == run(Config(0.1, 10, ("a",)))
    assert run(dt.timedelta(hours=1)) == run(dt.timedelta(seconds=3600))
    assert len(calls) == 2  # equal values: one entry each
    distinct = [Config(0.1), Config(0.2), Other(0.1), dt.timedelta(0),
                dt.timedelta(microseconds=1), dt.timedelta(days=-1), pd.Timedelta(0),
                pd.Timedelta(1)]
    assert len({run.entry(v).url for v in distinct}) == len(distinct)
    doc = json.loads(Path(run.entry(Config(0.1, tags=("a",))).path, "key.json").read_bytes())
    assert doc["key"]["x"] == {"dataclass": f"{__name__}.{Config.__qualname__}",
                               "fields": {"lr": 0.1, "steps": 10, "tags": ["a"]}}

    @dataclasses.dataclass
    class Holder:
        n: int
        lock: Any = dataclasses.field(default_factory=threading.Lock, compare=False)

    with pytest.raises(TypeError, match=r"argument 'x', field 'lock': a _thread\.lock .*key="):
        run.entry(Holder(1))
    with pytest.raises(TypeError, match=r"argument 'x'.*type.*key="):
        run.entry(Config)  # the class, not an instance


def test_every_nan_is_one_key_and_each_infinity_its_own(local: Store) -> None:
    """NaN was keyed by repr: NumPy 2's float64 NaN ("np.float64(nan)") had an entry apart
    from float("nan"), np.nan and np.float32's, though no function tells them apart."""
    calls: list[Any] = []

    @durable.cached(local.root)
    def f(x: float) -> str:
        calls.append(x)
        return "computed"

    nans = [float("nan"), np.nan, np.float32("nan"), np.float64("nan"), -float("nan")]
    assert len({f.entry(v).url for v in nans}) == 1
    for v in nans:
        f(v)
    assert len(calls) == 1
    infs = [float("inf"), np.float64("inf"), np.float32("inf")]
    assert len({f.entry(v).url for v in infs}) == 1
    assert len({f.entry(v).url for v in (np.nan, np.inf, -np.inf, 0.0)}) == 4


# The length of one step of each NumPy time unit, in attoseconds (years and months: by
# way of days, whose count NumPy gives exactly for a date in either).
_ATTO = {"W": 7 * 86_400 * 10**18, "D": 86_400 * 10**18, "h": 3_600 * 10**18,
         "m": 60 * 10**18, "s": 10**18, "ms": 10**15, "us": 10**12, "ns": 10**9,
         "ps": 10**6, "fs": 10**3, "as": 1}


def _instant(x: Any) -> Any:
    """What a NumPy datetime64 or timedelta64 (or an array of them) stands for, exactly:
    its kind and its counts of attoseconds (Python ints: no overflow); NaT as None."""
    unit, steps = np.datetime_data(x.dtype)
    kind = x.dtype.kind

    def exact(count: int) -> int | tuple[str, int]:
        if unit not in ("Y", "M"):
            return count * steps * _ATTO[unit]
        months = count * steps * (12 if unit == "Y" else 1)
        if kind == "m":
            return ("months", months)  # a span of months is no count of seconds
        return _days_from_civil(1970 + months // 12, months % 12 + 1) * _ATTO["D"]

    counts, nat = x.astype(np.int64).tolist(), np.isnat(x).tolist()
    if x.ndim == 0:
        return (kind, None if nat else exact(counts))
    return (kind, [None if n else exact(c) for c, n in zip(counts, nat, strict=True)])


def _days_from_civil(year: int, month: int) -> int:
    """Days from 1970-01-01 to the first of ``month`` of ``year`` (proleptic Gregorian,
    any year: H. Hinnant's algorithm, in Python ints)."""
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def test_numpy_times_in_any_unit_never_share_a_key_with_another_instant(local: Store) -> None:
    """datetime64 and timedelta64 scalars and arrays, in every unit (multiples too), near
    zero and at the ends of their range: a key is never another instant's (nor another
    span's), and none is an error. Decided: the unit is part of the key wherever it
    changes the value held, so equal instants may key apart (a scalar in days is a
    `date`, in minutes a `datetime`; an array's dtype names its unit): a miss, recomputed,
    never another value's result."""
    def keyed(x: Any) -> None:
        return None

    f = durable.cached(local.root)(keyed)
    units = ["Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as", "2h",
             "15m", "10D", "3M", "250ms", "100ns"]
    counts = [0, 1, -1, 7, 12, 59, 60, 1000, 18262, 10**6, 2**40, -2**40, 2**62, -2**62,
              2**63 - 1]
    seen: dict[str, Any] = {}
    for kind in (np.datetime64, np.timedelta64):
        for unit in units:
            values = [kind(n, unit) for n in counts] + [kind("NaT", unit)]
            values.append(np.array([v for v in values[:4]]))
            values.append(np.array(values[:4][::-1]))
            for x in values:
                key = f.entry(x).url  # never an error
                assert seen.setdefault(key, _instant(x)) == _instant(x), (key, repr(x))
    # The brief's case: one instant in days and in minutes keys apart (a date and a
    # datetime), and a scalar never as an array.
    day, minute = np.datetime64("2020-01-01", "D"), np.datetime64("2020-01-01T00:00", "m")
    assert day == minute and f.entry(day).url != f.entry(minute).url
    assert f.entry(day).url != f.entry(np.array(day)).url


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_array_subclass_arguments_never_share_a_plain_arrays_entry(local: Store) -> None:
    """An argument that is an ndarray subclass was keyed by its dtype, shape and bytes
    alone: a masked array shared the entry of the plain array of its filled values (their
    sums differ), np.matrix that of the array (``a ** 2`` differs), and each call returned
    the other's result. Such an argument is a TypeError asking for key=; a memory-mapped
    array (np.load(..., mmap_mode="r")) is what its bytes say, and keys as the array."""
    @durable.cached(local.root)
    def total(a: np.ndarray) -> float:
        return float(a.sum())

    plain = np.array([1, 999999, 3])
    masked = np.ma.masked_array([1, 2, 3], mask=[False, True, False])
    assert masked.tobytes() == plain.tobytes()  # the mask was all that set them apart
    assert total(plain) == 1000003.0
    with pytest.raises(TypeError, match=r"argument 'a'.*numpy\.ma.*MaskedArray.*key="):
        total(masked)
    with pytest.raises(TypeError, match=r"argument 'a'.*numpy.*matrix.*key="):
        total(np.matrix([[1, 2], [3, 4]]))
    assert total.state(np.arange(2)) is State.ABSENT  # nothing was computed for them

    path = Path(local.root).parent / "plain.npy"
    np.save(path, plain)
    mapped = np.load(path, mmap_mode="r")
    assert type(mapped) is np.memmap
    assert total.entry(mapped).url == total.entry(plain).url
    assert total(mapped) == 1000003.0


def test_versions_that_share_a_folder_name_never_share_a_key(local: Store) -> None:
    """The folder of a version is its text made safe for a path (cut at 96 characters,
    punctuation as "_", dots stripped from its ends), and the key was hashed from that
    folder name: a version naming a model and its config past 96 characters, "1,0" and
    "1_0", "1." and "1" shared entries, and a bumped version returned the old results."""
    def make(version: str) -> Any:
        @durable.cached(local.root, version=version)
        def tag(x: int) -> str:
            return version

        return tag

    pairs = [("resnet50-" + "a" * 90 + "-lr=0.1", "resnet50-" + "a" * 90 + "-lr=0.2"),
             ("1,0", "1_0"), ("1.", "1"), ("v/2", "v_2")]
    for old, new in pairs:
        assert make(old)(1) == old
        assert make(new)(1) == new, (old, new)
    dotted = make("1.")
    assert json.loads(Path(dotted.entry(1).path, "key.json").read_bytes())["version"] == "1."
    # A version that is its own folder name keys as it always did (the hash of the
    # function's name, the version and the arguments): existing entries still hit.
    plain = make("7")
    function = f"{__name__}.{test_versions_that_share_a_folder_name_never_share_a_key.__name__}"
    recipe = json.dumps([f"{function}.<locals>.make.<locals>.tag", "7", {"x": 1}],
                        sort_keys=True, separators=(",", ":")).encode()
    assert plain.entry(1).url.endswith(f"/v7/x=1-{hashlib.sha256(recipe).hexdigest()[:16]}")


def test_the_helpers_of_a_method_reached_through_an_instance_take_its_instance(
        local: Store) -> None:
    """``model.predict.clear(x)``: a bound method hands attribute lookups to the function
    under it, so the helpers ran without the instance and took ``x`` for ``self``. With a
    default for the other arguments that was another entry's: clear removed nothing the
    user meant (the next call returned the result they had cleared), state answered for
    another call; without one, a TypeError about a lambda's arguments."""
    computed: list[tuple[str, int, int]] = []

    @dataclass
    class Model:
        name: str

        @durable.cached(local.root)
        def predict(self, x: int, scale: int = 1) -> list[Any]:
            computed.append((self.name, x, scale))
            return [self.name, x * scale, len(computed)]

    m = Model("m1")
    first = m.predict(3)
    assert m.predict.state(3) is State.COMPLETE
    assert m.predict.entry(3).url == Model.predict.entry(m, 3).url
    m.predict.clear(3)
    assert Model.predict.state(m, 3) is State.ABSENT
    again = m.predict(3)
    assert again != first and len(computed) == 2  # computed again, not the cleared result
    assert m.predict.recompute(3) == ["m1", 3, 3]
    assert m.predict(3) == ["m1", 3, 3]
    assert Model("m2").predict.state(3) is State.ABSENT
    # Still what a bound method is to tools that look: its signature without self, equal
    # to itself, pickled as the instance and the method's name (a pool's map of it).
    import inspect

    assert list(inspect.signature(m.predict).parameters) == ["x", "scale"]
    assert m.predict == m.predict and m.predict != Model("m1").predict
    assert m.predict.__reduce__() == (getattr, (m, "predict"))


def test_async_and_generator_functions_are_refused_when_decorated(local: Store) -> None:
    """An async function's call returns a coroutine, a generator function's a generator:
    neither had run when cached tried to store it, and the error came at the first call,
    as "no serializer stores a builtins.coroutine" (with Python's "never awaited"
    warning). Refused at decoration, saying what to cache instead."""
    async def fetch(x: int) -> int:
        return x

    def shards(n: int) -> Iterator[int]:
        yield from range(n)

    async def stream(n: int) -> Any:
        yield n

    for func, what in ((fetch, "an async function"), (shards, "a generator function"),
                       (stream, "an async generator function")):
        with pytest.raises(TypeError, match=rf"{func.__name__}.* is {what}"):
            durable.cached(local.root)(func)
    assert not Path(local.root).exists()


def test_a_hit_this_process_cannot_load_names_its_entry(local: Store) -> None:
    """A pickled result read by a process without pickle=True, or one whose serializer is
    not registered there: the error said "this entry holds a pickle" and "no serializer
    named ... is registered in this process" without saying which entry, in a job that
    reads thousands."""
    def f_result() -> Any:
        return {"ids": (1, 2)}

    durable.cached(local.root, pickle=True)(f_result)()
    plain = durable.cached(local.root)(f_result)
    with pytest.raises(UnsupportedError, match="pickle=True") as info:
        plain()
    assert plain.entry().url in str(info.value)

    def g_result() -> Any:
        return b"x"

    writer = durable.cached(local.root)(g_result)
    writer()
    entry = writer.entry()
    marker = entry.read_marker()
    assert marker is not None and marker.manifest is not None
    renamed = {("value.elsewhere" if k == "value.bin" else k): r
               for k, r in marker.manifest.objects.items()}
    with pytest.raises(UnsupportedError, match=r"no serializer named 'elsewhere'") as info:
        load_value(entry, durable.Manifest(renamed), allow_pickle=False)
    assert entry.url in str(info.value)


def test_a_memory_mapped_result_is_stored_as_the_array_it_is(local: Store,
                                                              tmp_path: Path) -> None:
    """``np.load(path, mmap_mode="r")[:n]`` is an np.memmap, which the npy serializer
    refused ("no serializer stores a numpy.memmap: return ... a NumPy array"): an array
    is what it is, and comes back as one."""
    data = np.arange(1000, dtype=np.float32)
    np.save(tmp_path / "tokens.npy", data)

    @durable.cached(local.root)
    def head(n: int) -> np.ndarray:
        return np.load(tmp_path / "tokens.npy", mmap_mode="r")[:n]

    assert type(head.__wrapped__(10)) is np.memmap
    got = head(10)
    assert type(got) is np.ndarray and np.array_equal(got, data[:10])
    assert np.array_equal(head(10), data[:10])  # the hit
    assert "value.npy" in _value_keys(head.entry(10))


@pytest.mark.parametrize("cells", [[[1, 2], [3]], [(1, 2), (3, 4)]], ids=["lists", "tuples"])
def test_a_frame_whose_cells_parquet_would_change_is_refused(local: Store,
                                                            cells: list[Any]) -> None:
    """A tokenizer's frame with a column of token lists came back, on the first call and
    every hit, with NumPy arrays in their place (tuples too): ``tokens + [eos]`` then
    added elementwise instead of appending, without a word. Refused like a tuple result,
    naming the column; with pickle=True it is pickled and comes back as it went in."""
    pd = pytest.importorskip("pandas")

    def frame() -> Any:
        return pd.DataFrame({"id": [1, 2], "tokens": cells})

    f = durable.cached(local.root)(frame)
    with pytest.raises(TypeError, match=r"column 'tokens' holds Python (lists|tuples).*"
                                        r"NumPy arrays.*pickle=True"):
        f()
    assert f.state() is State.ABSENT
    p = durable.cached(local.root, pickle=True)(frame)
    got = p()
    assert got["tokens"].tolist() == cells
    assert "value.pkl" in _value_keys(p.entry())
