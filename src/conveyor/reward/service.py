"""Score trajectories off the caller's thread, with a deadline on every call.

Contract
- ``RewardService(fn, timeout_s, fallback, workers)`` runs the reward ``fn``
  (``api.RewardFn``) on worker threads. ``submit(traj)`` returns a Future
  that ALWAYS resolves to ``traj.with_reward(reward, info)``, at the latest
  ``timeout_s`` after a worker picked it up; ``score(trajs)`` is the blocking
  form, in order.
- A verifier that raises, returns a wrong type, NaN/inf or runs past
  ``timeout_s`` yields ``fallback`` with ``reward_info["reward_error"]``
  saying why; nothing is re-raised. ``stats()`` counts scored, failures,
  timeouts, nonfinite and stuck threads.
- A call past its deadline is abandoned (a thread cannot be killed) and a
  replacement worker started, up to ``max_stuck``; beyond that trajectories
  get the fallback at once. Details: docs/architecture.md ("Module contracts
  in detail").
- Every call is a span on the run's timeline (``observe.timeline``), one row
  per worker thread.

This module knows nothing of what a reward computes or which reward a task
wants; it only runs callables under a deadline and counts what went wrong.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import numbers
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Mapping

from conveyor.observe import timeline
from conveyor.reward.api import reward_name
from conveyor.types import Trajectory

logger = logging.getLogger(__name__)

# Idle threads re-check for close() this often, so no wait is unbounded.
_POLL_S = 0.5


class _Job:
    __slots__ = ("traj", "future", "deadline", "abandoned")

    def __init__(self, traj: Trajectory) -> None:
        self.traj = traj
        self.future: Future[Trajectory] = Future()
        self.deadline = math.inf
        self.abandoned = False


class RewardService:
    def __init__(self, fn: Callable[[Trajectory], Any], timeout_s: float = 5.0, fallback: float = 0.0,
                 workers: int = 2, name: str | None = None, max_stuck: int | None = None) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"RewardService timeout_s={timeout_s!r} must be a finite number > 0 (reward.timeout_s)")
        if not (isinstance(fallback, (int, float)) and math.isfinite(fallback)):
            raise ValueError(f"RewardService fallback={fallback!r} must be a finite number (reward.fallback)")
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"RewardService workers={workers!r} must be an integer >= 1 (reward.workers)")
        self.fn = fn
        self.name = name or reward_name(fn)
        self.timeout_s = float(timeout_s)
        self.fallback = float(fallback)
        self.workers = workers
        self.max_stuck = max(8, 4 * workers) if max_stuck is None else max_stuck
        # One RLock-backed condition guards every field below; futures are
        # resolved outside it so callbacks never run under the lock.
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: set[_Job] = set()
        self._live = 0   # workers able to take jobs (idle, or running within their deadline)
        self._stuck = 0  # threads inside an abandoned call
        self._closed = False
        self._counts = {"scored": 0, "failures": 0, "timeouts": 0, "nonfinite": 0}
        self._logged: set[str] = set()
        self._ids = itertools.count()
        with self._cond:
            for _ in range(workers):
                self._spawn_worker()
        self._watchdog = threading.Thread(target=self._watch, name=f"reward-{self.name}-watchdog", daemon=True)
        self._watchdog.start()

    # ---- public API -------------------------------------------------------

    def submit(self, traj: Trajectory) -> "Future[Trajectory]":
        job = _Job(traj)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"RewardService {self.name!r} is closed; create a new one to score more")
            starved = self._live == 0
            if not starved:
                self._queue.append(job)
                self._cond.notify_all()
        if starved:
            job.future.set_running_or_notify_cancel()
            self._fail_starved([job])
        return job.future

    def score(self, trajs: list[Trajectory], timeout_s: float | None = None) -> list[Trajectory]:
        """Score ``trajs`` and return new trajectories in the same order.

        The default deadline covers every call running its full ``timeout_s``
        on ``workers`` threads, plus slack; it only expires if the service is
        broken, and then raises ``TimeoutError`` naming how many are missing.
        """
        futures = [self.submit(t) for t in trajs]
        if timeout_s is None:
            timeout_s = self.timeout_s * (math.ceil(len(trajs) / self.workers) + 1) + 5.0
        deadline = time.monotonic() + timeout_s
        out: list[Trajectory] = []
        for i, fut in enumerate(futures):
            try:
                out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                raise TimeoutError(f"reward service {self.name!r}: {len(trajs) - i} of {len(trajs)} "
                                   f"trajectories still unscored after {timeout_s:.1f}s") from None
        return out

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {**self._counts, "stuck": self._stuck}

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking work: cancel queued trajectories, let running ones finish or time out."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in queued:
            job.future.cancel()
            job.future.set_running_or_notify_cancel()
        # Running calls end or are abandoned within timeout_s; the watchdog exits after that.
        self._watchdog.join(self.timeout_s + 2 * _POLL_S if timeout_s is None else timeout_s)
        if self._watchdog.is_alive():
            logger.warning("reward service %r: watchdog still running after close; threads are daemons "
                           "and will not block exit", self.name)

    def __enter__(self) -> "RewardService":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- worker threads ---------------------------------------------------

    def _spawn_worker(self) -> None:
        # Caller holds the lock.
        self._live += 1
        t = threading.Thread(target=self._work, name=f"reward-{self.name}-{next(self._ids)}", daemon=True)
        t.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait(_POLL_S)
                if not self._queue:  # closed and nothing left
                    self._live -= 1
                    return
                job = self._queue.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue  # the caller cancelled it while queued
                job.deadline = time.monotonic() + self.timeout_s
                self._running.add(job)
                self._cond.notify_all()  # the watchdog must learn the new deadline
            start, wall = time.monotonic(), time.time()
            reward, info, kind = self._call(job.traj)
            elapsed = time.monotonic() - start
            # One row per worker thread: a thread scores one trajectory at a time.
            args = {"task": job.traj.task.id, **({"failed": kind} if kind else {})}
            timeline.record("reward", threading.current_thread().name, "score", wall, wall + elapsed, args)
            with self._cond:
                self._running.discard(job)
                if job.abandoned:
                    # The caller already got the fallback; this thread was replaced.
                    self._stuck -= 1
                    if self._closed or self._live >= self.workers:
                        return
                    self._live += 1
                    continue
                self._counts["scored"] += 1
                if kind is not None:
                    self._counts[kind] += 1
            self._resolve(job, reward, info, elapsed)

    def _call(self, traj: Trajectory) -> tuple[float, dict[str, Any], str | None]:
        """Run the verifier once; returns (reward, info, failure counter name or None)."""
        try:
            out = self.fn(traj)
        except BaseException as e:  # noqa: BLE001 - a verifier must never take down a worker
            self._log_once(f"raise:{type(e).__qualname__}", "reward %r raised %s on task %r; using fallback "
                           "%s (traceback logged once per exception type)", self.name, type(e).__name__,
                           traj.task.id, self.fallback, exc_info=e)
            return self.fallback, {"reward_error": f"raised {type(e).__name__}"}, "failures"
        info: dict[str, Any] = {}
        value = out
        if isinstance(out, Mapping):
            info = {k: v for k, v in out.items() if k != "reward"}
            value = out.get("reward")
        if not isinstance(value, numbers.Real):
            what = f"a dict whose 'reward' is {type(value).__name__}" if isinstance(out, Mapping) \
                else f"a {type(out).__name__}"
            self._log_once(f"type:{what}", "reward %r returned %s; expected a float or a dict with a float "
                           "'reward'; using fallback %s", self.name, what, self.fallback)
            return self.fallback, {**info, "reward_error": "wrong type"}, "failures"
        value = float(value)
        if not math.isfinite(value):
            self._log_once("nonfinite", "reward %r returned %s on task %r; using fallback %s",
                           self.name, value, traj.task.id, self.fallback)
            return self.fallback, {**info, "reward_error": "nonfinite"}, "nonfinite"
        return value, info, None

    def _resolve(self, job: _Job, reward: float, info: dict[str, Any], elapsed: float) -> None:
        traj = job.traj.with_reward(reward, info)
        traj = dataclasses.replace(traj, timings={**traj.timings, "reward_s": elapsed})
        job.future.set_result(traj)

    # ---- deadlines ----------------------------------------------------------

    def _watch(self) -> None:
        while True:
            expired: list[_Job] = []
            starved: list[_Job] = []
            with self._cond:
                if self._closed and not self._running and not self._queue:
                    return
                now = time.monotonic()
                for job in [j for j in self._running if j.deadline <= now]:
                    self._abandon(job)
                    expired.append(job)
                if self._live == 0 and self._queue:
                    starved = list(self._queue)
                    self._queue.clear()
                if not expired and not starved:
                    nxt = min((j.deadline for j in self._running), default=now + _POLL_S)
                    self._cond.wait(min(max(nxt - now, 0.0), _POLL_S))
            for job in expired:
                self._resolve(job, self.fallback, {"reward_error": "timeout"}, self.timeout_s)
            self._fail_starved([j for j in starved if j.future.set_running_or_notify_cancel()])

    def _abandon(self, job: _Job) -> None:
        # Caller holds the lock.
        self._running.discard(job)
        job.abandoned = True
        self._live -= 1
        self._stuck += 1
        self._counts["scored"] += 1
        self._counts["timeouts"] += 1
        self._log_once("timeout", "reward %r exceeded %.2fs on task %r; the call is abandoned (a thread "
                       "cannot be killed), its worker replaced, fallback %s used", self.name,
                       self.timeout_s, job.traj.task.id, self.fallback)
        if self._closed:
            return
        if self._stuck <= self.max_stuck:
            self._spawn_worker()
        else:
            self._log_once("max_stuck", "reward %r: %d calls are stuck (max_stuck=%d); no replacement "
                           "worker started, the pool shrinks until they return", self.name, self._stuck,
                           self.max_stuck, level=logging.ERROR)

    def _fail_starved(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        with self._cond:
            self._counts["scored"] += len(jobs)
            self._counts["timeouts"] += len(jobs)
        self._log_once("starved", "reward %r: every worker is stuck; %d trajectories get fallback %s "
                       "without being scored", self.name, len(jobs), self.fallback, level=logging.ERROR)
        for job in jobs:
            self._resolve(job, self.fallback, {"reward_error": "no free worker"}, 0.0)

    def _log_once(self, key: str, msg: str, *args: Any, exc_info: BaseException | None = None,
                  level: int = logging.WARNING) -> None:
        with self._cond:
            if key in self._logged:
                return
            self._logged.add(key)
        logger.log(logging.ERROR if exc_info is not None else level, msg, *args, exc_info=exc_info)
