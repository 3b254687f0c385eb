"""The loop's weight-sync metrics: each step reports the versions up to the one published before it."""
import pytest

from conveyor.controller.step_stats import sync_stats
from conveyor.transport.messages import WeightSwap


def event(version: int, applied: float, pause: float = 0.001, held: float | None = None, announced=None):
    return WeightSwap(0, version, applied, pause, held, announced)


def test_each_step_reports_the_previous_version_whatever_has_already_swapped():
    published = {1: 10.0, 2: 20.0}
    pending: list = []
    # logged after the step that published version 2: version 1 swapped at 10.004, and version 2
    # happened to swap already too (the race the per-version report removes)
    new = [event(1, 10.004, held=10.001, announced=9.99), event(2, 20.006, pause=0.003)]
    out = sync_stats(new, published, pending, upto=1)
    assert out["weight_sync_ms"] == pytest.approx(4.0)
    assert out["weight_transfer_ms"] == pytest.approx(1.0) and out["weight_announce_ms"] == pytest.approx(-10.0)
    assert out["weight_pause_ms"] == pytest.approx(1.0)
    assert [e.version for e in pending] == [2]
    # the next step reports version 2 from what waited, nothing new arrived
    out = sync_stats([], published, pending, upto=2)
    assert out["weight_sync_ms"] == pytest.approx(6.0) and out["weight_pause_ms"] == pytest.approx(3.0)
    assert pending == [] and "weight_transfer_ms" not in out
    # a version this loop did not publish (before a resume) gives a pause but no sync time
    assert sync_stats([event(0, 5.0)], published, pending, upto=3) == {"weight_pause_ms": pytest.approx(1.0)}
    assert sync_stats([], published, pending, upto=4) == {}
