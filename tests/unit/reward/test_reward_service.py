"""RewardService: off-thread scoring, fallbacks, counts and deadlines."""
import logging
import math
import re
import threading
import time

import pytest

from conveyor.reward.service import RewardService
from conveyor.reward.verifiers import math_reward
from conveyor.types import Task, Trajectory


def traj(i: int, text: str = "\\boxed{42}") -> Trajectory:
    return Trajectory(Task(f"t{i}", "q", "42"), (1,), (5,), (-0.5,), (0,), (1,), text=text)


def test_scores_off_the_caller_thread_and_keeps_extra_keys():
    def reward(t):
        return {"reward": 0.75, "thread": threading.get_ident(), "length": len(t.text)}

    with RewardService(reward, timeout_s=2.0, fallback=0.0, workers=2) as svc:
        out = svc.score([traj(0), traj(1, "abc")])
        assert [t.reward for t in out] == [0.75, 0.75]
        assert [t.reward_info["length"] for t in out] == [10, 3]
        assert all(t.reward_info["thread"] != threading.get_ident() for t in out)
        assert "reward" not in out[0].reward_info
        assert out[1].task.id == "t1" and out[1].completion_ids == (5,)
        assert out[0].timings["reward_s"] >= 0.0
        assert svc.stats() == {"scored": 2, "failures": 0, "timeouts": 0, "nonfinite": 0, "stuck": 0}


def test_math_reward_through_the_service():
    with RewardService(math_reward, timeout_s=20.0, workers=1) as svc:
        out = svc.score([traj(0, "\\boxed{42}"), traj(1, "it is 41")])
    assert [(t.reward, t.reward_info["parsed"]) for t in out] == [(1.0, 1.0), (0.0, 1.0)]


def test_raising_reward_gets_fallback_counted_and_logged_once(caplog):
    def reward(t):
        raise KeyError("boom")

    with caplog.at_level(logging.WARNING, logger="conveyor.reward.service"):
        with RewardService(reward, timeout_s=2.0, fallback=-1.0, workers=2) as svc:
            out = svc.score([traj(i) for i in range(3)])
            stats = svc.stats()
    assert [t.reward for t in out] == [-1.0, -1.0, -1.0]
    assert out[0].reward_info == {"reward_error": "raised KeyError"}
    assert stats == {"scored": 3, "failures": 3, "timeouts": 0, "nonfinite": 0, "stuck": 0}
    records = [r for r in caplog.records if "raised KeyError" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None
    # Two workers: whichever task fails first is the one logged.
    assert re.match(r"reward 'reward' raised KeyError on task 't[012]'; using fallback -1.0", records[0].getMessage())


@pytest.mark.parametrize("value, counter, error", [
    (math.nan, "nonfinite", "nonfinite"),
    (math.inf, "nonfinite", "nonfinite"),
    ({"reward": math.nan, "k": 1.0}, "nonfinite", "nonfinite"),
    ("1.0", "failures", "wrong type"),
    ({"score": 1.0}, "failures", "wrong type"),
    (None, "failures", "wrong type"),
])
def test_bad_values_get_fallback(value, counter, error):
    with RewardService(lambda t: value, timeout_s=2.0, fallback=0.25, workers=1) as svc:
        [out] = svc.score([traj(0)])
        stats = svc.stats()
    assert out.reward == 0.25 and out.reward_info["reward_error"] == error
    assert stats[counter] == 1 and stats["scored"] == 1


def test_bool_reward_is_accepted():
    with RewardService(lambda t: True, timeout_s=2.0, workers=1) as svc:
        assert svc.score([traj(0)])[0].reward == 1.0


def test_sleeping_reward_times_out_and_pool_is_replaced():
    release = threading.Event()

    def reward(t):
        if t.task.id.startswith("t"):
            release.wait(60.0)  # stuck well beyond the 0.2 s timeout, until released below
        return 1.0

    svc = RewardService(reward, timeout_s=0.2, fallback=-0.5, workers=1)
    try:
        start = time.monotonic()
        out = svc.score([traj(0), traj(1)])
        assert time.monotonic() - start < 20.0  # no-hang bound: two 0.2 s deadlines idle; counted below
        assert [t.reward for t in out] == [-0.5, -0.5]
        assert out[0].reward_info == {"reward_error": "timeout"}
        assert svc.stats() == {"scored": 2, "failures": 0, "timeouts": 2, "nonfinite": 0, "stuck": 2}
        # Stuck calls did not starve the pool: a fast task is still scored.
        fast = Trajectory(Task("fast", "q", "42"), (1,), (), (), (), ())
        assert svc.score([fast])[0].reward == 1.0
        release.set()
        deadline = time.monotonic() + 3.0
        while svc.stats()["stuck"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert svc.stats()["stuck"] == 0
    finally:
        release.set()
        svc.close()


def test_no_usable_worker_gives_fallback_instead_of_waiting():
    release = threading.Event()
    svc = RewardService(lambda t: release.wait(5.0) and 1.0, timeout_s=0.2, fallback=0.0, workers=1,
                        max_stuck=0)
    try:
        out = svc.score([traj(0), traj(1), traj(2)], timeout_s=3.0)
        assert [t.reward_info["reward_error"] for t in out] == ["timeout", "no free worker", "no free worker"]
        assert svc.stats()["timeouts"] == 3
    finally:
        release.set()
        svc.close()


def test_closed_service_rejects_and_bad_arguments_fail_fast():
    svc = RewardService(lambda t: 1.0, timeout_s=1.0)
    svc.close()
    with pytest.raises(RuntimeError, match="is closed"):
        svc.submit(traj(0))
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardService(lambda t: 1.0, timeout_s=0)
    with pytest.raises(ValueError, match="reward.workers"):
        RewardService(lambda t: 1.0, workers=0)
