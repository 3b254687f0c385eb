"""StagedWeights: a publish copies its tensors in groups, whole versions only; a reader process killed
while it holds the weight lock does not hold it forever."""
import threading
import time

import pytest
import torch

from conveyor.transport import weights as W
from conveyor.transport.weights import Fanin, StagedWeights, publish_all

SPECS = [("a", (10,), torch.float32), ("b", (4, 5), torch.float32), ("c", (3,), torch.float32)]


class _Engine:
    def __init__(self):
        self.w, self.version = {}, 0

    def update_weights(self, items, version):
        self.w = {name: t.clone() for name, t in items}
        self.version = version


def _tensors(v: float):
    # Mixed source dtypes, as a trainer hands them (bf16 copies beside float32 masters).
    return [("a", torch.full((10,), v)), ("b", torch.full((4, 5), v, dtype=torch.bfloat16)),
            ("c", torch.full((3,), v, dtype=torch.float64))]


def test_a_publish_copies_in_groups_and_readers_see_whole_versions_only(monkeypatch):
    monkeypatch.setattr(W, "FLUSH_BYTES", 40)  # tensor "a" alone fills a group
    staged, engine = StagedWeights(SPECS), _Engine()
    staged.begin(1)
    staged.put("a", torch.full((10,), 1.0))
    assert staged.tensors[0].tolist() == [1.0] * 10  # flushed before commit
    staged.put("b", torch.full((4, 5), 1.0, dtype=torch.bfloat16))
    assert staged.poll(engine) is None  # nothing announced yet
    staged.put("c", torch.full((3,), 1.0, dtype=torch.float64))
    staged.commit()
    assert staged.poll(engine) == 1 and engine.version == 1
    assert {k: t.flatten().unique().tolist() for k, t in engine.w.items()} == {"a": [1.0], "b": [1.0], "c": [1.0]}
    assert all(t.dtype == torch.float32 for t in engine.w.values())


def test_a_failed_publish_leaves_the_last_version_and_its_queued_copies_are_dropped():
    staged, engine = StagedWeights(SPECS), _Engine()
    staged.publish(_tensors(1.0), 1)
    assert staged.poll(engine) == 1
    with pytest.raises(KeyError, match="missing tensors"):
        staged.publish(_tensors(2.0)[:2], 2)  # "c" is missing
    assert staged.poll(engine) is None and staged.version == 1

    def broken():
        yield "a", torch.full((10,), 3.0)
        raise RuntimeError("the trainer failed mid-publish")
    with pytest.raises(RuntimeError, match="mid-publish"):
        publish_all([staged], broken(), 3)
    assert staged._queued == [] and staged.poll(engine) is None
    staged.publish(_tensors(4.0), 4)  # the lock was released: the next publish works
    assert staged.poll(engine) == 4 and engine.w["a"].tolist() == [4.0] * 10


def test_wait_news_wakes_on_a_publish_and_times_out_without_one():
    staged, engine = StagedWeights(SPECS), _Engine()
    t0 = time.monotonic()
    assert staged.wait_news(engine, 0.1) is False and time.monotonic() - t0 >= 0.09
    threading.Timer(0.05, staged.publish, args=(_tensors(1.0), 1)).start()
    assert staged.wait_news(engine, 10.0) is True
    fan = Fanin([StagedWeights(SPECS), staged])
    assert fan.wait_news(engine, 0.0) is True and fan.poll(engine) == 1
    assert fan.received_at is None  # staging does not say when it was received
    assert fan.wait_news(engine, 0.05) is False


class _Stuck:
    """An engine whose weight update never returns: its process is killed mid-copy."""
    version = 0

    def update_weights(self, named, version):
        time.sleep(600)


def _poll_forever(staged):
    staged.poll(_Stuck(), timeout=5)


def test_a_reader_killed_while_it_copies_does_not_hold_the_lock_forever():
    import multiprocessing as mp
    import os
    import signal
    ctx = mp.get_context("spawn")
    staged = StagedWeights([("w", (4,), torch.float32)], ctx)
    publish_all([staged], [("w", torch.zeros(4))], 1)
    reader = ctx.Process(target=_poll_forever, args=(staged,))
    reader.start()
    deadline = time.monotonic() + 60
    while staged._holder.value != reader.pid:  # the reader holds the lock, copying
        assert time.monotonic() < deadline and reader.is_alive(), "the reader never took the lock"
        time.sleep(0.01)
    os.kill(reader.pid, signal.SIGKILL)
    reader.join(10)
    t0 = time.monotonic()
    publish_all([staged], [("w", torch.ones(4))], 2)  # taken back from the dead reader, not waited for
    assert time.monotonic() - t0 < 5 and staged.version == 2
    # A live holder is still waited for, and the wait still has its deadline.
    staged.begin(3)
    with pytest.raises(W.WeightSyncTimeout, match="waited 1s for the weight lock"):
        staged.begin(4, timeout=1.0)
    staged.abort()
