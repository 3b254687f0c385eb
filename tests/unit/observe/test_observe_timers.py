"""PhaseTimer: per-phase seconds, lap totals and reset, nesting rules."""
import time

import pytest

from conveyor.observe.timers import PhaseTimer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_accumulate_and_lap_resets():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    with timer.phase("generate"):
        clock.now += 2.0
    with timer.phase("train"):
        clock.now += 0.5
    with timer.phase("generate"):  # a second visit adds to the same phase
        clock.now += 1.0
    clock.now += 0.25  # time outside any phase still counts toward the step
    assert timer.lap() == {"time/generate": 3.0, "time/train": 0.5, "time/step": 3.75}

    with timer.phase("train"):
        clock.now += 0.125
    assert timer.lap() == {"time/train": 0.125, "time/step": 0.125}


def test_nested_phases_both_record_and_self_nesting_counts_once():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    with timer.phase("train"):
        clock.now += 1.0
        with timer.phase("train/forward"):
            clock.now += 2.0
            with timer.phase("train"):  # re-entering an open phase adds nothing
                clock.now += 4.0
    assert timer.lap() == {"time/train": 7.0, "time/train/forward": 6.0, "time/step": 7.0}


def test_phase_records_when_block_raises_and_add_credits_outside_time():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    with pytest.raises(RuntimeError):
        with timer.phase("reward"):
            clock.now += 1.5
            raise RuntimeError("verifier crashed")
    timer.add("generate", 0.75)
    assert timer.lap() == {"time/reward": 1.5, "time/generate": 0.75, "time/step": 1.5}


def test_reserved_name_rejected():
    timer = PhaseTimer()
    with pytest.raises(ValueError, match="reserved"):
        with timer.phase("step"):
            pass
    with pytest.raises(ValueError):
        timer.add("", 1.0)


def test_real_clock_with_sleeps():
    timer = PhaseTimer()
    with timer.phase("a"):
        time.sleep(0.02)
    with timer.phase("b"):
        time.sleep(0.01)
    out = timer.lap()
    assert set(out) == {"time/a", "time/b", "time/step"}
    assert 0.02 <= out["time/a"] < 1.0
    assert 0.01 <= out["time/b"] < 1.0
    assert out["time/step"] >= out["time/a"] + out["time/b"]
    assert timer.lap()["time/step"] < 0.5


def test_outside_leaves_a_block_out_of_the_step():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    with timer.phase("train"):
        clock.now += 1.0
    with timer.outside():  # an evaluation between steps
        clock.now += 30.0
    clock.now += 0.5
    assert timer.lap() == {"time/train": 1.0, "time/step": 1.5}
    with timer.outside():  # also right after a lap: the next step starts when the block ends
        clock.now += 7.0
    clock.now += 2.0
    assert timer.lap() == {"time/step": 2.0}
    assert timer.outside_s == 37.0
