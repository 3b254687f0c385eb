"""Score trajectories off the caller's thread, with a deadline on every call.

Contract: ``RewardService(fn, timeout_s, fallback, workers)`` runs the reward
``fn`` (``api.RewardFn``, or an ``api.BatchReward`` scored in batches of up to
``fn.max_batch`` gathered within ``batch_wait_s``, ``batching.py``) on worker
threads. ``submit(traj)`` returns a Future that ALWAYS resolves to
``traj.with_reward(reward, info)``, at the latest ``timeout_s`` after a worker
picked it up; ``score(trajs)`` is the blocking form, in order. A verifier that
raises, returns a wrong type, NaN/inf or runs past ``timeout_s`` yields
``fallback`` with ``reward_info["reward_error"]`` saying why; nothing is
re-raised. A call past its deadline is abandoned (a thread cannot be killed)
and a replacement worker started, up to ``max_stuck``. Results are checked,
counted and logged once as ``calls.py`` says (shared with ``processes.py``);
every call is a span on the run's timeline, one row per worker thread.

This module knows nothing of what a reward computes or which reward a task
wants; it only runs callables under a deadline and counts what went wrong.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from conveyor.observe import timeline
from conveyor.reward.api import BatchReward, reward_name
from conveyor.reward.batching import Gathering, call_checked
from conveyor.reward.calls import COUNTERS, Ledger, Outcome, call_reward, check_settings, rewarded, settle
from conveyor.types import Trajectory

logger = logging.getLogger(__name__)

# Idle threads re-check for close() this often, so no wait is unbounded.
_POLL_S = 0.5


class _Job:
    __slots__ = ("traj", "future", "queued_at")

    def __init__(self, traj: Trajectory) -> None:
        self.traj = traj
        self.future: Future[Trajectory] = Future()
        self.queued_at = time.monotonic()


class _Call:
    """One call of the reward: one trajectory, or a batch of them for a ``BatchReward``."""
    __slots__ = ("jobs", "deadline", "abandoned")

    def __init__(self, jobs: list[_Job], deadline: float) -> None:
        self.jobs = jobs
        self.deadline = deadline
        self.abandoned = False


class RewardService:
    """Reward calls on worker threads, each under a deadline, never re-raising.

    - ``submit`` resolves to ``traj.with_reward(reward, info)`` plus ``timings["reward_s"]``.
      A verifier that raises (anything, even ``SystemExit``), returns a wrong type or a dict
      without ``"reward"``, NaN/inf, or runs past ``timeout_s`` gives ``fallback``.
      ``stats()``: ``scored`` (fallbacks included), ``failures`` (raised / wrong type),
      ``timeouts``, ``nonfinite``, the gauge ``stuck``, and ``batches`` for a ``BatchReward``.
      Each distinct failure kind's first traceback or message is logged once with the name.
    - A call past its deadline is ABANDONED: its caller gets the fallback at once, the thread
      runs on until the verifier returns (the result discarded) and a replacement worker starts.
      Past ``max_stuck`` abandoned threads no replacement starts; with no usable worker left,
      queued and new trajectories get the fallback at once (counted as timeouts,
      ``reward_error`` "no free worker"). A stuck thread that returns rejoins a short pool.
      Threads are daemons. A verifier that can hang for good belongs in ``reward.executor:
      process``.
    - A ``BatchReward`` call that raises, times out or returns another count of results gives
      the whole batch the fallback, each trajectory counted; results are otherwise checked one
      by one. The per-trajectory path is the same machinery with batches of one taken at once.
    """

    def __init__(self, fn: Callable[[Trajectory], Any], timeout_s: float = 5.0, fallback: float = 0.0,
                 workers: int = 2, name: str | None = None, max_stuck: int | None = None,
                 batch_wait_s: float = 0.02) -> None:
        check_settings("RewardService", timeout_s, fallback, workers)
        self.fn = fn
        self.batched = isinstance(fn, BatchReward)
        # The per-trajectory path is a "batch" of one, taken at once.
        self.gathering = Gathering(fn.max_batch, batch_wait_s) if self.batched else Gathering()
        self.name = name or (fn.name if self.batched else reward_name(fn))
        self.timeout_s = float(timeout_s)
        self.fallback = float(fallback)
        self.workers = workers
        self.max_stuck = max(8, 4 * workers) if max_stuck is None else max_stuck
        # One RLock-backed condition guards every field below; futures are
        # resolved outside it so callbacks never run under the lock.
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: set[_Call] = set()
        self._live = 0   # workers able to take jobs (idle, or running within their deadline)
        self._stuck = 0  # threads inside an abandoned call
        self._closed = False
        self._ledger = Ledger(logger, (*COUNTERS, "batches") if self.batched else COUNTERS)
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

        The default deadline covers every call (one per trajectory, or per
        batch) running its full ``timeout_s`` on ``workers`` threads, plus
        slack; it only expires if the service is broken, and then raises
        ``TimeoutError`` naming how many are missing.
        """
        futures = [self.submit(t) for t in trajs]
        if timeout_s is None:
            calls = math.ceil(len(trajs) / self.gathering.max_batch)
            timeout_s = self.timeout_s * (math.ceil(calls / self.workers) + 1) + self.gathering.wait_s + 5.0
        return settle(futures, timeout_s, self.name)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {**self._ledger.snapshot(), "stuck": self._stuck}

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
        if self.batched:  # the service owns what a batched reward holds (a model, a process)
            try:
                self.fn.close()
            except Exception:  # noqa: BLE001 - closing must not hide the run's own outcome
                logger.exception("reward %r: close() raised", self.name)

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
                jobs = self._take()
                if jobs is None:  # closed and nothing left
                    self._live -= 1
                    return
                if not jobs:
                    continue  # every one was cancelled while queued
                call = _Call(jobs, time.monotonic() + self.timeout_s)
                self._running.add(call)
                self._cond.notify_all()  # the watchdog must learn the new deadline
            start, wall = time.monotonic(), time.time()
            results = self._call([j.traj for j in jobs])
            elapsed = time.monotonic() - start
            # One row per worker thread: a thread runs one call at a time.
            kinds = sorted({out.failure for out in results if out.failure})
            args = {"task": jobs[0].traj.task.id, **({"batch": len(jobs)} if self.batched else {}),
                    **({"failed": ",".join(kinds)} if kinds else {})}
            timeline.record("reward", threading.current_thread().name, "score", wall, wall + elapsed, args)
            with self._cond:
                self._running.discard(call)
                if call.abandoned:
                    # The callers already got the fallback; this thread was replaced.
                    self._stuck -= 1
                    if self._closed or self._live >= self.workers:
                        return
                    self._live += 1
                    continue
                if self.batched:
                    self._ledger.add("batches")
                for out in results:
                    self._ledger.count(out.failure)
            for job, out in zip(jobs, results):
                self._resolve(job, out.reward, out.info, elapsed)

    def _take(self) -> list[_Job] | None:
        """The next call's jobs (caller holds the lock): one, or a batch gathered per
        ``self.gathering``; None once closed with nothing queued."""
        while True:
            if not self._queue:
                if self._closed:
                    return None
                self._cond.wait(_POLL_S)
                continue
            wait = self.gathering.wait(len(self._queue), self._queue[0].queued_at, time.monotonic(), self._closed)
            if wait <= 0:
                break
            self._cond.wait(min(wait, _POLL_S))
        taken = self.gathering.take(self._queue)
        return [j for j in taken if j.future.set_running_or_notify_cancel()]  # drop what callers cancelled

    def _call(self, trajs: list[Trajectory]) -> list[Outcome]:
        """Run the reward once on ``trajs`` (one, or a batch); what each trajectory gets, its
        problems logged once (``calls.Ledger.report``)."""
        if self.batched:
            outs = call_checked(self.fn, trajs, self.name, self.fallback)
        else:
            outs = [call_reward(self.fn, trajs[0], self.name, self.fallback)]
        for out in outs:
            self._ledger.report(out.problem)
        return outs

    def _resolve(self, job: _Job, reward: float, info: dict[str, Any], elapsed: float) -> None:
        job.future.set_result(rewarded(job.traj, reward, info, elapsed))

    # ---- deadlines ----------------------------------------------------------

    def _watch(self) -> None:
        while True:
            expired: list[_Call] = []
            starved: list[_Job] = []
            with self._cond:
                if self._closed and not self._running and not self._queue:
                    return
                now = time.monotonic()
                for call in [c for c in self._running if c.deadline <= now]:
                    self._abandon(call)
                    expired.append(call)
                if self._live == 0 and self._queue:
                    starved = list(self._queue)
                    self._queue.clear()
                if not expired and not starved:
                    nxt = min((c.deadline for c in self._running), default=now + _POLL_S)
                    self._cond.wait(min(max(nxt - now, 0.0), _POLL_S))
            for call in expired:
                for job in call.jobs:
                    self._resolve(job, self.fallback, {"reward_error": "timeout"}, self.timeout_s)
            self._fail_starved([j for j in starved if j.future.set_running_or_notify_cancel()])

    def _abandon(self, call: _Call) -> None:
        # Caller holds the lock.
        self._running.discard(call)
        call.abandoned = True
        self._live -= 1
        self._stuck += 1
        self._ledger.count("timeouts", len(call.jobs))
        if self.batched:
            self._ledger.add("batches")
        self._ledger.log_once("timeout", "reward %r exceeded %.2fs on task %r%s; the call is abandoned (a thread "
                              "cannot be killed), its worker replaced, fallback %s used", self.name,
                              self.timeout_s, call.jobs[0].traj.task.id,
                              f" (a batch of {len(call.jobs)})" if self.batched else "", self.fallback)
        if self._closed:
            return
        if self._stuck <= self.max_stuck:
            self._spawn_worker()
        else:
            self._ledger.log_once("max_stuck", "reward %r: %d calls are stuck (max_stuck=%d); no replacement "
                                  "worker started, the pool shrinks until they return", self.name, self._stuck,
                                  self.max_stuck, level=logging.ERROR)

    def _fail_starved(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        self._ledger.count("timeouts", len(jobs))
        self._ledger.log_once("starved", "reward %r: every worker is stuck; %d trajectories get fallback %s "
                              "without being scored", self.name, len(jobs), self.fallback, level=logging.ERROR)
        for job in jobs:
            self._resolve(job, self.fallback, {"reward_error": "no free worker"}, 0.0)
