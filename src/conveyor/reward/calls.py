"""One reward call checked, and what a reward service counts and logs of its calls.

- ``check_result`` / ``call_reward`` / ``raised``: a ``RewardFn``'s result, call or exception as
  the ``Outcome`` to give: a wrong type, NaN/inf or a raise is the fallback, counted. None of
  these raise. ``reward_value(out)`` is the type check alone.
- ``Outcome`` and ``Problem`` are defined in ``conveyor/types.py`` and re-exported here.
- ``Ledger``: one service's counters and its log-once set; thread safe.
- ``rewarded``, ``settle`` and ``check_settings``: what both services share.

This module starts no thread or process and knows no deadline: the
services (``service.py``, ``processes.py``) own those.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from conveyor.config.reward_rules import COUNTERS
from conveyor.types import Outcome, Problem, Trajectory


class WrongType(TypeError):
    """A reward result that is not a float nor a dict with a real ``"reward"``; ``info`` holds
    the dict's other keys."""

    def __init__(self, what: str, info: dict[str, Any]) -> None:
        super().__init__(f"returned {what}; expected a float or a dict with a float 'reward'")
        self.what, self.info = what, info


def reward_value(out: Any) -> tuple[float, dict[str, Any]]:
    """The reward of a ``RewardFn`` result and its other keys; raises ``WrongType``.

    ``reward_value(out)`` is the check alone: the value and the other keys, or
    ``WrongType``; it does not look at NaN (a composite adds its parts first).
    """
    info: dict[str, Any] = {}
    value = out
    if isinstance(out, Mapping):
        info = {k: v for k, v in out.items() if k != "reward"}
        value = out.get("reward")
    if not isinstance(value, numbers.Real):
        what = f"a dict whose 'reward' is {type(value).__name__}" if isinstance(out, Mapping) \
            else f"a {type(out).__name__}"
        raise WrongType(what, info)
    return float(value), info


def check_result(out: Any, traj: Trajectory, name: str, fallback: float) -> Outcome:
    """``check_result(out, traj, name, fallback) -> Outcome``: a ``RewardFn``'s
    result (a float, or a dict with a finite real ``"reward"``, its other keys
    kept for ``reward_info``) as the reward to give; a wrong type or NaN/inf is
    ``fallback`` with ``reward_error`` "wrong type" / "nonfinite" and the
    counter it falls under (``failures`` / ``nonfinite``).
    ``call_reward(fn, traj, name, fallback)`` runs ``fn(traj)`` once and checks
    the result; anything it raises (even ``SystemExit``) is ``raised(e, ...)``:
    ``fallback`` with ``reward_error`` "raised <Type>", counted ``failures``.
    None of these raise.
    ``Outcome.problem`` is what to log once per kind of failure (``Problem``; both
    are defined in ``conveyor/types.py``, as they cross to a worker's parent, and
    re-exported here):
    a formatted message and, for a raise, the traceback as text, so that it can
    cross a process boundary (``Problem.exc``, the exception itself, stays in
    the process that caught it).
    """
    try:
        value, info = reward_value(out)
    except WrongType as e:
        return Outcome(fallback, {**e.info, "reward_error": "wrong type"}, "failures",
                       Problem(f"type:{e.what}", f"reward {name!r} {e}; using fallback {fallback}"))
    if not math.isfinite(value):
        return Outcome(fallback, {**info, "reward_error": "nonfinite"}, "nonfinite",
                       Problem("nonfinite", f"reward {name!r} returned {value} on task {traj.task.id!r}; "
                                            f"using fallback {fallback}"))
    return Outcome(value, info)


def raised(e: BaseException, traj: Trajectory, name: str, fallback: float) -> Outcome:
    """The outcome of a call that raised ``e``."""
    kind = type(e).__name__
    text = "".join(traceback.format_exception(e))
    return Outcome(fallback, {"reward_error": f"raised {kind}"}, "failures",
                   Problem(f"raise:{type(e).__qualname__}", f"reward {name!r} raised {kind} on task "
                           f"{traj.task.id!r}; using fallback {fallback} (traceback logged once per "
                           "exception type)", text, e))


def call_reward(fn: Callable[[Trajectory], Any], traj: Trajectory, name: str, fallback: float) -> Outcome:
    try:
        out = fn(traj)
    except BaseException as e:  # noqa: BLE001 - a verifier must never take down its worker
        return raised(e, traj, name, fallback)
    return check_result(out, traj, name, fallback)


class Ledger:
    """A service's counters and the kinds of failure it has logged already.

    ``Ledger(logger, counters)``: one service's counters (``COUNTERS``, defined
    in ``config/reward_rules.py`` beside the names a composite's parts may not
    take, plus
    whatever the service adds) and its log-once set; ``count`` adds a
    trajectory returned (``scored``) and the counter of its failure,
    ``report``/``log_once`` log the first of each kind. Thread safe.
    """

    def __init__(self, logger: logging.Logger, counters: Sequence[str] = COUNTERS) -> None:
        self.logger = logger
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(counters, 0)
        self._logged: set[str] = set()

    def count(self, failure: str | None, n: int = 1) -> None:
        """``n`` trajectories returned, each a ``failure`` (a counter name) or not (None)."""
        with self._lock:
            self._counts["scored"] += n
            if failure is not None:
                self._counts[failure] += n

    def add(self, counter: str, n: int = 1) -> None:
        with self._lock:
            self._counts[counter] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def report(self, problem: Problem | None) -> None:
        if problem is None:
            return
        if problem.exc is not None:
            self.log_once(problem.key, "%s", problem.message, exc_info=problem.exc)
        elif problem.traceback:  # from another process: the traceback travels as text
            self.log_once(problem.key, "%s\n%s", problem.message, problem.traceback.rstrip(), level=logging.ERROR)
        else:
            self.log_once(problem.key, "%s", problem.message)

    def log_once(self, key: str, msg: str, *args: Any, exc_info: BaseException | None = None,
                 level: int = logging.WARNING) -> None:
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        self.logger.log(logging.ERROR if exc_info is not None else level, msg, *args, exc_info=exc_info)


def rewarded(traj: Trajectory, reward: float, info: Mapping[str, Any], elapsed: float) -> Trajectory:
    """``traj`` with its reward, ``reward_info`` and ``timings["reward_s"]``.

    ``rewarded(traj, reward, info, elapsed)``: the trajectory a Future resolves
    to; ``settle(futures, timeout_s, name)``: their results in order under one
    deadline; ``check_settings``: the arguments both services validate.
    """
    out = traj.with_reward(reward, info)
    return dataclasses.replace(out, timings={**out.timings, "reward_s": elapsed})


def settle(futures: Sequence[Future], timeout_s: float, name: str) -> list[Trajectory]:
    """The futures' results in order; ``TimeoutError`` naming how many are missing once
    ``timeout_s`` has passed (a broken service: every call has its own, shorter deadline)."""
    deadline = time.monotonic() + timeout_s
    out: list[Trajectory] = []
    for i, fut in enumerate(futures):
        try:
            out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
        except FutureTimeout:
            raise TimeoutError(f"reward service {name!r}: {len(futures) - i} of {len(futures)} "
                               f"trajectories still unscored after {timeout_s:.1f}s") from None
    return out


def check_settings(service: str, timeout_s: float, fallback: float, workers: int) -> None:
    """Raise ``ValueError`` naming the config field of a bad argument."""
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"{service} timeout_s={timeout_s!r} must be a finite number > 0 (reward.timeout_s)")
    if not (isinstance(fallback, (int, float)) and math.isfinite(fallback)):
        raise ValueError(f"{service} fallback={fallback!r} must be a finite number (reward.fallback)")
    if not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1):
        raise ValueError(f"{service} workers={workers!r} must be an integer >= 1 (reward.workers)")
