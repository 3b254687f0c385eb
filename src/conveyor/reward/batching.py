"""Batched rewards in the reward service: which waiting trajectories form one call, and what
one call must return.

- ``Gathering``: a batch starts as soon as ``max_batch`` trajectories wait, or the oldest has
  waited ``batch_wait_s``, or the service closes; ``take(queue)`` gives the next call's items.
- ``call_checked(reward, trajs, name, fallback)``: one ``score_batch`` call and each
  trajectory's checked ``calls.Outcome``; never raises. A bad result gets the fallback for
  its trajectory only; a call that raises, miscounts or runs past its deadline, for all.
- Both services use them: threads (``service.py``) and worker processes (``processes.py``).
  What an author of an ``api.BatchReward`` relies on is ``call_checked``'s contract.

This module knows nothing of threads, processes or counters (the services own them) and nothing
of what a reward computes.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from conveyor.reward.api import BatchReward
from conveyor.reward.calls import Outcome, Problem, check_result, raised
from conveyor.types import Trajectory

T = TypeVar("T")


class BatchResultError(ValueError):
    """A batched reward returned something other than one result per trajectory."""


@dataclass(frozen=True)
class Gathering:
    """When waiting trajectories become one call: ``max_batch`` of them, or the oldest has waited
    ``wait_s``. ``max_batch`` 1 and ``wait_s`` 0 is the per-trajectory service."""
    max_batch: int = 1
    wait_s: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.max_batch, int) and not isinstance(self.max_batch, bool) and self.max_batch >= 1):
            raise ValueError(f"a batched reward's max_batch={self.max_batch!r} must be an integer >= 1 "
                             "(reward.max_batch)")
        if not (isinstance(self.wait_s, (int, float)) and math.isfinite(self.wait_s) and self.wait_s >= 0):
            raise ValueError(f"batch wait {self.wait_s!r} s must be a finite number >= 0 (reward.batch_wait_ms)")

    def wait(self, waiting: int, oldest_since: float, now: float, closing: bool) -> float:
        """Seconds until a call should start with ``min(waiting, max_batch)`` trajectories;
        0 means now. ``oldest_since`` is when the oldest waiting trajectory was submitted."""
        if waiting >= self.max_batch or closing:
            return 0.0
        return max(0.0, oldest_since + self.wait_s - now)

    def take(self, queue: deque[T]) -> list[T]:
        """The next call's items, oldest first: up to ``max_batch`` of ``queue``, taken from it."""
        return [queue.popleft() for _ in range(min(len(queue), self.max_batch))]


def call_batch(reward: BatchReward, trajs: Sequence[Trajectory]) -> list[Any]:
    """``reward.score_batch(trajs)`` as a list of one raw result per trajectory; raises
    ``BatchResultError`` for anything else (the results are checked one by one by the caller)."""
    out = reward.score_batch(list(trajs))
    if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Sequence):
        raise BatchResultError(f"score_batch returned a {type(out).__name__}, not a list of one result per "
                               "trajectory")
    if len(out) != len(trajs):
        raise BatchResultError(f"score_batch returned {len(out)} results for {len(trajs)} trajectories")
    return list(out)


def call_checked(reward: BatchReward, trajs: Sequence[Trajectory], name: str, fallback: float) -> list[Outcome]:
    """One ``score_batch`` call on ``trajs``: each trajectory's checked outcome (the contract below);
    a raise or a wrong count gives every trajectory the fallback. Never raises.

    Contract (what an author of a ``api.BatchReward`` relies on)
    - ``RewardService(reward, ...)`` with a ``BatchReward`` (a reward model, a generative judge, a
      remote reward server) gathers submitted trajectories into batches and calls
      ``reward.score_batch(trajs)`` once per batch, on one of the service's ``workers`` threads
      (so at most ``workers`` calls run at once; a reward that holds one model on one device may
      want ``workers=1``). A reward sees batches of 1 to ``reward.max_batch`` trajectories, in
      the order they were submitted; it must not rely on their grouping (a task's samples may be
      split over two calls, or share one with other tasks).
    - Gathering (``Gathering.wait_s``): a batch starts as soon as ``max_batch`` trajectories wait,
      or when the oldest waiting one has waited ``batch_wait_s`` (``reward.batch_wait_ms``), or at
      once when the service closes. While every worker is busy, trajectories keep arriving and the
      next free worker takes up to ``max_batch`` of them at once: under load the batches fill up
      by themselves, and a short wait only matters when the reward is idle.
    - ``score_batch`` returns a sequence with exactly one result per trajectory, in order; each
      result is checked like a ``RewardFn``'s (a float, or a dict with a finite real ``"reward"``;
      its other keys go to ``Trajectory.reward_info``): a bad result gets the fallback for that
      trajectory only (counted ``failures`` or ``nonfinite``). A call that raises, returns another
      count (``BatchResultError``) or runs past ``reward.timeout_s`` — the deadline applies to the
      whole call, not to each trajectory — gives every trajectory of the batch the fallback, each
      one counted (``failures`` / ``timeouts``) with its ``reward_error``. Nothing is re-raised.
    - A call past its deadline is abandoned like a single call: its thread runs on (a Python
      thread cannot be killed), a replacement worker starts, and the result is discarded.
    - ``stats()`` of a batched service also counts ``batches`` (calls made); ``scored / batches``
      is the mean batch size. ``RewardService.close()`` calls ``reward.close()`` once no call of
      the service runs in it any more (or, for an abandoned call, after its deadline).

    - ``call_checked(reward, trajs, name, fallback)``: one such call and each trajectory's checked
      ``calls.Outcome`` (never raises); ``Gathering.take(queue)``: the next call's trajectories. Both
      services use them: threads (``service.py``) and worker processes (``processes.py``, where the
      same gathering happens in the controller and the call in a worker).
    """
    try:
        outs = call_batch(reward, trajs)
    except BatchResultError as e:
        problem = Problem("count", f"reward {name!r}: {e}; using fallback {fallback} for the whole batch")
        return [Outcome(fallback, {"reward_error": "wrong count"}, "failures", problem)] * len(trajs)
    except BaseException as e:  # noqa: BLE001 - a reward must never take down its worker
        return [raised(e, trajs[0], name, fallback)] * len(trajs)
    return [check_result(out, traj, name, fallback) for out, traj in zip(outs, trajs)]
