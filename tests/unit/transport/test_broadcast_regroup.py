"""A broadcast group re-formed around a replaced engine (gloo, real processes): the replacement gets
the current version, survivors keep receiving, and the writer never waits past its deadline."""
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conveyor.launch.placement import free_port
from conveyor.transport.broadcast import BroadcastWeights, WeightSyncError

SPECS = [("a", (3, 4), torch.float32), ("b", (1000,), torch.float32), ("c", (5,), torch.float32)]


def _weights(v):
    return [("a", torch.full((3, 4), float(v))), ("b", torch.arange(1000.0) + v), ("c", torch.full((5,), -v))]


class _Engine:
    def __init__(self):
        self.w, self.version = {}, -1

    def update_weights(self, items, version):
        self.w = {name: t.clone() for name, t in items}
        self.version = version


def _whole(w, v) -> bool:
    """The weights of version ``v`` (as ``_weights(v)`` makes them), none of another."""
    return all(torch.equal(w[n], t) for n, t in _weights(v))


def _reader(bw, engine_id, out, last):
    """Reports (engine, 0, True) once started (its imports done), then applies every version it
    receives and reports (engine, version, whole) until ``last``."""
    out.put((engine_id, 0, True))
    engine = _Engine()
    deadline = time.monotonic() + 120
    while engine.version < last and time.monotonic() < deadline:
        try:
            v = bw.poll(engine, engine_id)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.put((engine_id, -1, repr(e)))
            return
        if v is not None:
            out.put((engine_id, v, _whole(engine.w, v)))
        bw.wait_news(engine, 0.05)


class _Group:
    """The writer here, reader processes as the launcher makes them, and the controller's part:
    ``replace(i)`` kills engine i's process, begins the next generation and starts a new one."""

    def __init__(self, monkeypatch, engines: int, last: int, timeout_s: float = 60):
        monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))
        self.ctx = mp.get_context("spawn")
        self.bw = BroadcastWeights(SPECS, self.ctx, engines=engines, backend="gloo", port=free_port(),
                                   bucket_mb=2 / 1024, timeout_s=timeout_s)
        self.last, self.outs = last, {}
        self.procs = [self._start(i) for i in range(engines)]
        self.got: dict[int, list] = {i: [] for i in range(engines)}

    def _start(self, i):
        # A queue per process: one killed while writing leaves its lock taken.
        self.outs[i] = self.ctx.Queue()
        p = self.ctx.Process(target=_reader, args=(self.bw, i, self.outs[i], self.last), daemon=True)
        p.start()
        return p

    def kill(self, i) -> None:
        self.procs[i].kill()
        self.procs[i].join(10)
        self.got[i] = []  # what the replacement applies, from here on

    def replace(self, i) -> None:
        self.bw.regroup()
        self.procs[i] = self._start(i)

    def wait_for(self, i, version, timeout=60.0) -> None:
        """Until engine i has applied ``version``; ``version=0``: until its process has started."""
        deadline = time.monotonic() + timeout
        while not self.got[i] or self.got[i][-1][0] < version:
            engine_id, v, whole = self.outs[i].get(timeout=max(0.1, deadline - time.monotonic()))
            assert v >= 0, f"engine {engine_id}: {whole}"
            if v == 0:  # started
                if version == 0:
                    return
                continue
            self.got[i].append((v, whole))

    def close(self) -> None:
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_a_replaced_reader_gets_the_current_version_between_publishes(monkeypatch):
    g = _Group(monkeypatch, engines=2, last=4)
    for v in (1, 2):
        g.bw.publish(_weights(v), v)
        for i in (0, 1):
            g.wait_for(i, v)
    g.kill(1)
    g.replace(1)
    # No publish is under way: the writer's watcher re-forms the group and sends version 2 again.
    g.wait_for(1, 2)
    assert g.got[1] == [(2, True)] and g.bw.generation == 1
    for v in (3, 4):
        t0 = time.monotonic()
        g.bw.publish(_weights(v), v)
        assert time.monotonic() - t0 < 30
        for i in (0, 1):  # each applied before the next comes (poll takes the newest)
            g.wait_for(i, v)
    assert [v for v, _ in g.got[0]] == [1, 2, 3, 4]  # the survivor lost nothing
    assert [v for v, _ in g.got[1]] == [2, 3, 4]
    assert all(whole for i in (0, 1) for _, whole in g.got[i])
    g.close()


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_a_reader_killed_mid_publish_is_replaced_and_the_publish_completes(monkeypatch):
    g = _Group(monkeypatch, engines=3, last=3)
    g.bw.publish(_weights(1), 1)
    for i in range(3):
        g.wait_for(i, 1)
    g.bw.begin(2)
    g.bw.put("a", _weights(2)[0][1])  # bucket 0 is on its way
    g.kill(2)
    # The controller notices the death a little later and starts a replacement.
    threading.Timer(0.5, g.replace, args=(2,)).start()
    t0 = time.monotonic()
    for name, t in _weights(2)[1:]:
        g.bw.put(name, t)
    g.bw.commit()  # returns once every engine, the replacement included, holds version 2
    # No-hang bound: the replacement's start (a few seconds idle), not the group's 60 s deadline.
    assert time.monotonic() - t0 < 50 and list(g.bw._acks) == [int(g.bw._serial.value)] * 3
    for i in range(3):
        g.wait_for(i, 2)
    g.bw.publish(_weights(3), 3)
    for i in range(3):
        g.wait_for(i, 3)
    assert [v for v, _ in g.got[0]] == [v for v, _ in g.got[1]] == [1, 2, 3]
    assert [v for v, _ in g.got[2]] == [2, 3]
    assert all(whole for i in range(3) for _, whole in g.got[i])
    g.close()


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
def test_a_replacement_that_never_joins_is_named_and_nothing_waits_past_the_deadline(monkeypatch):
    g = _Group(monkeypatch, engines=2, last=99, timeout_s=3)
    for i in (0, 1):  # the 3 s are for joining, not for starting a process on a loaded CPU
        g.wait_for(i, 0)
    g.bw.publish(_weights(1), 1)
    g.wait_for(1, 1)
    g.kill(1)
    g.bw.regroup()  # a replacement is announced but never starts
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="engine 1 did not join group generation 1 within 3s"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the watcher's failure, or this publish's own
            g.bw.publish(_weights(2), 2)
            time.sleep(0.5)
    assert time.monotonic() - t0 < 40  # no-hang bound: its 3 s deadline (named above) and a publish
    g.close()
