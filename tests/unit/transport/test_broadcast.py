"""The broadcast weight transport over gloo: versions arrive whole and in order, and nothing hangs."""
import functools
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conveyor.launch.placement import free_port
from conveyor.transport.broadcast import BroadcastWeights, WeightSyncError, _layout
from conveyor.transport.weights import WeightSyncTimeout, publish_all

SPECS = [("a", (3, 4), torch.float32), ("b", (1000,), torch.float32), ("c", (5,), torch.float32)]


class _Engine:
    def __init__(self):
        self.w, self.version = {}, -1

    def update_weights(self, items, version):
        for name, t in items:
            self.w[name] = t.clone()
        self.version = version


def _reader(bw, engine_id, versions, out, last=None, applied=None):
    """Applies ``versions`` versions, or (with ``last``) until it applies version ``last``; each
    version applied goes to ``applied[engine_id]`` (a shared array) too, if given."""
    engine, got = _Engine(), []
    deadline = time.monotonic() + 60
    while len(got) < versions and not (got and got[-1][0] == last) and time.monotonic() < deadline:
        v = bw.poll(engine, engine_id)
        if v is not None:
            got.append((v, {k: t.tolist() for k, t in engine.w.items()}))
            if applied is not None:
                applied[engine_id] = v
        time.sleep(0.001)
    out.put((engine_id, got))


def _announced_reader(bw, engine_id, versions, out):
    """Says it is up (its imports are done) and then reads like ``_reader``."""
    out.put("up")
    _reader(bw, engine_id, versions, out)


def _waiting_reader(bw, engine_id, versions, out, applied=None):
    """Sleeps in wait_news (no polling loop) and applies each version it is woken for (and
    says so in ``applied[engine_id]``, if given)."""
    engine, got = _Engine(), []
    bw.poll(engine, engine_id)  # starts the receiver
    while len(got) < versions:
        woke = bw.wait_news(engine, 30.0)
        v = bw.poll(engine, engine_id)
        got.append((woke, v, bw.announced_at, bw.received_at, {k: t.tolist() for k, t in engine.w.items()}))
        if applied is not None and v is not None:
            applied[engine_id] = v
    got.append(bw.wait_news(engine, 0.2))  # nothing more comes: times out
    out.put((engine_id, got))


def _serve(monkeypatch, engines: int, versions: int, reader=_reader, bucket_mb: float = 2 / 1024):
    """A gloo writer and ``engines`` reader processes, each waiting for ``versions`` versions."""
    # Spawned children import this module to find _reader.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))
    ctx = mp.get_context("spawn")
    bw = BroadcastWeights(SPECS, ctx, engines=engines, backend="gloo", port=free_port(), bucket_mb=bucket_mb,
                          timeout_s=60)
    out = ctx.Queue()
    procs = [ctx.Process(target=reader, args=(bw, i, versions, out), daemon=True) for i in range(engines)]
    for p in procs:
        p.start()
    return bw, out, procs


def _applied_by(engines: int):
    """Per engine, the last version its reader applied (-1: none yet), shared with the readers."""
    return mp.get_context("spawn").Array("q", [-1] * engines, lock=False)


def _wait_applied(applied, version, timeout: float = 60.0) -> None:
    """Until every reader has applied ``version`` (poll takes the newest: the next must wait)."""
    deadline = time.monotonic() + timeout
    while any(v < version for v in applied):
        assert time.monotonic() < deadline, f"the engines applied {list(applied)}, not version {version}"
        time.sleep(0.01)


def _weights(v):
    return [("a", torch.full((3, 4), float(v))), ("b", torch.arange(1000.0) + v), ("c", torch.full((5,), -v))]


def _applied(out, procs) -> dict:
    """engine id -> [(version, weights)] as each reader applied them."""
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    return results


def _assert_whole(w, v):
    """The weights of version ``v`` (as ``_weights(v)`` makes them), none of another."""
    assert w["a"] == [[float(v)] * 4] * 3 and w["c"] == [float(-v)] * 5
    assert w["b"] == [float(x + v) for x in range(1000)]


def test_layout_packs_buckets_up_to_the_cap():
    # 2 KiB of float32 = 512 elements per bucket; "b" is larger and gets its own.
    lay = _layout(SPECS, torch.float32, 2 / 1024)
    assert [(n, b, off) for n, _, b, off in lay] == [("a", 0, 0), ("b", 1, 0), ("c", 2, 0)]
    lay = _layout(SPECS, torch.float32, 1.0)
    assert [(n, b, off) for n, _, b, off in lay] == [("a", 0, 0), ("b", 0, 12), ("c", 0, 1012)]


def test_every_engine_receives_every_version_exactly(monkeypatch):
    applied = _applied_by(2)
    bw, out, procs = _serve(monkeypatch, engines=2, versions=3, reader=functools.partial(_reader, applied=applied))
    for v in range(3):
        bw.publish([("a", torch.full((3, 4), float(v))), ("b", torch.arange(1000.0) + v),
                    ("c", torch.full((5,), -v, dtype=torch.float64)), ("ignored", torch.zeros(1))], v)
        assert list(bw._acks) == [v + 1] * 2  # publish returns once every engine holds the version
        _wait_applied(applied, v)  # let the engines apply each version before the next
    results = _applied(out, procs)
    for i in range(2):
        assert [v for v, _ in results[i]] == [0, 1, 2]
        for v, w in results[i]:
            _assert_whole(w, v)
    assert bw.version == 2


def test_a_reader_sleeping_in_wait_news_is_woken_for_each_version_of_mixed_dtype_tensors(monkeypatch):
    # One bucket whose tensors come in three dtypes: each dtype is copied by a call of its own.
    applied = _applied_by(1)
    bw, out, procs = _serve(monkeypatch, engines=1, versions=2, reader=functools.partial(_waiting_reader, applied=applied),
                            bucket_mb=1.0)
    t0 = time.time()
    for v in (1, 2):
        bw.publish([("a", torch.full((3, 4), float(v), dtype=torch.bfloat16)), ("b", torch.arange(1000.0) + v),
                    ("c", torch.full((5,), -v, dtype=torch.float64))], v)
        while bw._acks[0] < v:
            time.sleep(0.01)
        _wait_applied(applied, v)  # the reader applies it before the next publish
    got = _applied(out, procs)[0]
    assert got[-1] is False
    for (woke, v, announced_at, received_at, w), want in zip(got[:-1], (1, 2)):
        assert woke is True and v == want and t0 - 5 < announced_at <= received_at <= time.time()
        _assert_whole(w, v)


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_a_missing_tensor_is_named_and_the_engines_keep_the_last_whole_version(monkeypatch):
    bw, out, (proc,) = _serve(monkeypatch, engines=1, versions=2, reader=functools.partial(_reader, last=2))
    bw.publish(_weights(1), 1)
    # Bucket 0 ("a") is already on its way when the publish turns out to be incomplete.
    with pytest.raises(KeyError, match="version 7: missing tensors .'c'.; the engines keep the previous"):
        bw.publish(_weights(7)[:2], 7)

    def failing():
        yield "a", torch.full((3, 4), 8.0)
        raise RuntimeError("gather failed")
    with pytest.raises(RuntimeError, match="gather failed"):
        bw.publish(failing(), 8)
    bw.publish(_weights(2), 2)
    engine_id, got = out.get(timeout=60)
    proc.join(10)
    # Version 1 may or may not have been applied before the aborted publishes dropped it;
    # what was applied is whole, and nothing of versions 7 and 8 ever was.
    assert [v for v, _ in got][-1] == 2 and {v for v, _ in got} <= {1, 2}
    for v, w in got:
        _assert_whole(w, v)


def test_an_engine_that_never_joins_stops_the_writer_with_a_named_error():
    bw = BroadcastWeights(SPECS, mp.get_context("spawn"), engines=1, backend="gloo", port=free_port(),
                          timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="trainer .rank 0. could not join the group"):
        bw.publish([(n, torch.zeros(s)) for n, s, _ in SPECS], 0)
    assert time.monotonic() - t0 < 30


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_a_publish_that_does_not_wait_sends_the_values_it_was_given(monkeypatch):
    applied = _applied_by(2)
    bw, out, procs = _serve(monkeypatch, engines=2, versions=3, reader=functools.partial(_reader, applied=applied))
    for v in range(3):
        named = _weights(v)
        publish_all([bw], named, v, wait=False)
        for _, t in named:  # the caller trains on at once: its tensors change under the transfer
            t.fill_(-99.0)
        _wait_applied(applied, v)  # each engine applies each version before the next
    bw.close()  # the writer waits for the last transfer
    assert not bw._works
    results = _applied(out, procs)
    for i in range(2):
        assert [v for v, _ in results[i]] == [0, 1, 2]
        for v, w in results[i]:
            _assert_whole(w, v)


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_an_engine_that_dies_fails_the_next_publish_with_a_named_error(monkeypatch):
    bw, out, (proc,) = _serve(monkeypatch, engines=1, versions=99, reader=_announced_reader)
    assert out.get(timeout=120) == "up"  # a busy machine may take long to start a process: not timed
    bw.timeout_s = 5.0
    publish_all([bw], _weights(1), 1, wait=False)
    deadline = time.monotonic() + 30
    while bw._acks[0] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.kill()
    proc.join(10)
    t0 = time.monotonic()
    with pytest.raises((WeightSyncError, WeightSyncTimeout), match="engine|version 2"):
        publish_all([bw], _weights(2), 2, wait=False)
        publish_all([bw], _weights(3), 3, wait=False)  # the failed transfer of 2 is found here
    assert time.monotonic() - t0 < 50  # no-hang bound: its 5 s wait for a re-formed group, not the group's 60 s
