"""RewardService with a BatchReward: gathering, one deadline per call, per-result checks, fallbacks."""
import math
import threading
import time

import pytest

from conveyor.reward.api import BatchReward
from conveyor.reward.batching import Gathering
from conveyor.reward.service import RewardService
from conveyor.types import Task, Trajectory


def traj(i: int, text: str = "abc") -> Trajectory:
    return Trajectory(Task(f"t{i}", "q", "42"), (1,), (5,), (-0.5,), (0,), (1,), text=text)


class Recorder:
    """A batched reward that scores ``len(text) + index`` and records the batches it was given."""

    def __init__(self, max_batch: int = 4, result=None, delay_s: float = 0.0) -> None:
        self.name, self.max_batch = "recorder", max_batch
        self.batches: list[list[str]] = []
        self.result = result  # (traj) -> one result; default a dict with the length
        self.delay_s = delay_s
        self.closed = 0
        self.threads: set[int] = set()

    def score_batch(self, trajs):
        self.batches.append([t.task.id for t in trajs])
        self.threads.add(threading.get_ident())
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.result is not None:
            return [self.result(t) for t in trajs]
        return [{"reward": float(len(t.text)), "batch": float(len(trajs))} for t in trajs]

    def close(self):
        self.closed += 1


def test_the_protocol_is_what_the_service_recognises():
    assert isinstance(Recorder(), BatchReward)
    assert not isinstance(lambda t: 1.0, BatchReward)


def test_submitted_trajectories_are_gathered_into_batches_of_max_batch():
    rec = Recorder(max_batch=4)
    with RewardService(rec, timeout_s=2.0, workers=1, batch_wait_s=0.3) as svc:
        start = time.monotonic()
        out = svc.score([traj(i, "x" * i) for i in range(10)])
        elapsed = time.monotonic() - start
        stats = svc.stats()
    # Two full batches at once, then the last two after the wait (not before: the batch might fill).
    assert rec.batches == [[f"t{i}" for i in range(4)], [f"t{i}" for i in range(4, 8)], ["t8", "t9"]]
    assert 0.3 <= elapsed < 10.0  # the wait happened; no-hang bound: ~0.3 s idle
    assert [t.task.id for t in out] == [f"t{i}" for i in range(10)]
    assert [t.reward for t in out] == [float(i) for i in range(10)]
    assert [t.reward_info["batch"] for t in out] == [4.0] * 8 + [2.0] * 2
    assert all(t.timings["reward_s"] >= 0.0 for t in out)
    assert stats == {"scored": 10, "failures": 0, "timeouts": 0, "nonfinite": 0, "batches": 3, "stuck": 0}
    assert rec.closed == 1  # the service closes the reward it ran
    assert threading.get_ident() not in rec.threads


def test_a_lone_trajectory_waits_at_most_the_batch_wait():
    rec = Recorder(max_batch=64)
    with RewardService(rec, timeout_s=2.0, workers=1, batch_wait_s=0.05) as svc:
        start = time.monotonic()
        fut = svc.submit(traj(0))
        assert fut.result(timeout=2.0).reward == 3.0
        assert 0.05 <= time.monotonic() - start < 1.0
    assert rec.batches == [["t0"]]


def test_batches_fill_while_the_reward_is_busy():
    """Trajectories that arrive while a call runs form the next batch, without waiting."""
    submitted = threading.Event()

    def held(t):  # the first call runs until the rest are submitted
        assert submitted.wait(30.0)
        return float(len(t.text))

    rec = Recorder(max_batch=8, result=held)
    with RewardService(rec, timeout_s=60.0, workers=1, batch_wait_s=0.0) as svc:
        first = svc.submit(traj(0))
        deadline = time.monotonic() + 30.0
        while not rec.batches:  # until the first call (of one) runs
            assert time.monotonic() < deadline, "the first call never started"
            time.sleep(0.005)
        rest = [svc.submit(traj(i)) for i in range(1, 6)]
        submitted.set()
        assert [f.result(timeout=5.0).reward for f in [first, *rest]] == [3.0] * 6
    assert rec.batches == [["t0"], [f"t{i}" for i in range(1, 6)]]


def test_a_raising_batch_gives_every_trajectory_the_fallback():
    def boom(t):
        raise RuntimeError("model crashed")

    rec = Recorder(max_batch=3, result=boom)
    with RewardService(rec, timeout_s=2.0, fallback=-1.0, workers=1, batch_wait_s=0.01) as svc:
        out = svc.score([traj(i) for i in range(3)])
        stats = svc.stats()
    assert [t.reward for t in out] == [-1.0] * 3
    assert all(t.reward_info == {"reward_error": "raised RuntimeError"} for t in out)
    assert stats == {"scored": 3, "failures": 3, "timeouts": 0, "nonfinite": 0, "batches": 1, "stuck": 0}


@pytest.mark.parametrize("returned", [[1.0], [1.0, 2.0, 3.0, 4.0], {"reward": 1.0}, "1.0", None])
def test_a_wrong_count_of_results_fails_the_whole_batch(returned):
    class Wrong(Recorder):
        def score_batch(self, trajs):
            return returned

    with RewardService(Wrong(max_batch=3), timeout_s=2.0, fallback=0.5, workers=1, batch_wait_s=0.01) as svc:
        out = svc.score([traj(i) for i in range(3)])
        stats = svc.stats()
    assert [t.reward_info["reward_error"] for t in out] == ["wrong count"] * 3
    assert [t.reward for t in out] == [0.5] * 3
    assert stats["failures"] == 3 and stats["scored"] == 3


def test_each_result_is_checked_on_its_own():
    results = {"t0": 0.25, "t1": math.nan, "t2": "high", "t3": {"score": 1.0}, "t4": {"reward": 2, "k": 1.5}}
    rec = Recorder(max_batch=5, result=lambda t: results[t.task.id])
    with RewardService(rec, timeout_s=2.0, fallback=-2.0, workers=1, batch_wait_s=0.01) as svc:
        out = svc.score([traj(i) for i in range(5)])
        stats = svc.stats()
    assert [t.reward for t in out] == [0.25, -2.0, -2.0, -2.0, 2.0]
    assert [t.reward_info.get("reward_error") for t in out] == [None, "nonfinite", "wrong type", "wrong type", None]
    assert out[4].reward_info == {"k": 1.5}
    assert stats == {"scored": 5, "failures": 2, "timeouts": 0, "nonfinite": 1, "batches": 1, "stuck": 0}


def test_the_deadline_covers_the_whole_call_and_a_stuck_call_is_replaced():
    release = threading.Event()

    class Stuck(Recorder):
        def score_batch(self, trajs):
            if trajs[0].task.id == "t0":
                release.wait(60.0)  # far past the 0.3 s deadline, until released below
            return super().score_batch(trajs)

    rec = Stuck(max_batch=4)
    svc = RewardService(rec, timeout_s=0.3, fallback=-0.5, workers=1, batch_wait_s=0.01)
    try:
        start = time.monotonic()
        out = svc.score([traj(i) for i in range(4)])
        assert time.monotonic() - start < 20.0  # no-hang bound: the 0.3 s deadline idle; counted below
        assert [t.reward for t in out] == [-0.5] * 4
        assert all(t.reward_info == {"reward_error": "timeout"} for t in out)
        assert svc.stats() == {"scored": 4, "failures": 0, "timeouts": 4, "nonfinite": 0, "batches": 1, "stuck": 1}
        # The stuck call did not take the pool down: the replacement scores the next batch.
        assert [t.reward for t in svc.score([traj(5), traj(6)])] == [3.0, 3.0]
        release.set()
        deadline = time.monotonic() + 3.0
        while svc.stats()["stuck"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert svc.stats()["stuck"] == 0
    finally:
        release.set()
        svc.close()
    assert rec.closed == 1


def test_several_workers_run_batches_at_once():
    barrier = threading.Barrier(2, timeout=3.0)

    class Together(Recorder):
        def score_batch(self, trajs):
            barrier.wait()  # passes only if two calls run at the same time
            return super().score_batch(trajs)

    rec = Together(max_batch=2)
    with RewardService(rec, timeout_s=5.0, workers=2, batch_wait_s=0.01) as svc:
        out = svc.score([traj(i) for i in range(4)])
    assert [t.reward for t in out] == [3.0] * 4
    assert sorted(len(b) for b in rec.batches) == [2, 2] and len(rec.threads) == 2


def test_close_cancels_waiting_trajectories_and_closes_the_reward_once():
    rec = Recorder(max_batch=8, delay_s=0.2)
    svc = RewardService(rec, timeout_s=2.0, workers=1, batch_wait_s=10.0)
    fut = svc.submit(traj(0))  # waits for a batch that never fills
    svc.close()
    svc.close()
    assert fut.cancelled() and rec.closed == 1 and rec.batches == []


def test_gathering_rule_and_bad_settings():
    g = Gathering(max_batch=4, wait_s=0.5)
    assert g.wait(4, oldest_since=10.0, now=10.0, closing=False) == 0.0
    assert g.wait(1, oldest_since=10.0, now=10.2, closing=False) == pytest.approx(0.3)
    assert g.wait(1, oldest_since=10.0, now=10.6, closing=False) == 0.0
    assert g.wait(1, oldest_since=10.0, now=10.0, closing=True) == 0.0
    with pytest.raises(ValueError, match="reward.max_batch"):
        Gathering(max_batch=0)
    with pytest.raises(ValueError, match="reward.batch_wait_ms"):
        Gathering(max_batch=2, wait_s=-1.0)
    with pytest.raises(ValueError, match="reward.max_batch"):
        RewardService(Recorder(max_batch=0), timeout_s=1.0)
