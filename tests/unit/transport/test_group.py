"""Membership.settle: how it tells a work that failed from a wait slice that ran out."""
from datetime import timedelta

import pytest

from conveyor.transport.group import Membership


class _Generation:
    value = 0


class _Work:
    """A c10d work as gloo's behaves: ``wait(timeout)`` raises "Operation timed out!" while it is
    not completed; once completed, ``wait`` returns, or raises its error if it failed.
    ``done_after`` slices time out first; ``late`` makes the work complete during the slice that
    raised (after the raise, before the caller looks): the race a loaded machine hits."""

    def __init__(self, done_after: int, late: bool = False, error: str | None = None):
        self.left, self.late, self.error, self.completed = done_after, late, error, False

    def wait(self, timeout: timedelta | None = None):
        if not self.completed and self.left > 0:
            self.left -= 1
            if self.left == 0 and self.late:
                self.completed = True
            raise RuntimeError("Operation timed out!")
        self.completed = True
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.completed


def _member(timeout_s=5.0):
    m = Membership("127.0.0.1", 0, 0, ["trainer (rank 0)", "engine 0"], "gloo", timeout_s, _Generation())
    m.gen = 0
    return m


def test_a_work_that_completes_as_its_slice_runs_out_is_settled_not_failed():
    works = [_Work(done_after=3, late=True), _Work(done_after=0)]
    assert _member().settle(works) is True


def test_a_work_that_failed_raises_its_own_error():
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        _member().settle([_Work(done_after=2, late=True, error="Connection closed by peer")])


def test_a_work_that_never_completes_is_an_error_at_the_deadline():
    with pytest.raises(RuntimeError, match="did not complete within 0.2s"):
        _member(timeout_s=0.2).settle([_Work(done_after=10**9)])


def test_a_newer_generation_abandons_the_wait():
    m = _member()
    m._generation.value = 1
    assert m.settle([_Work(done_after=10**9)]) is False
