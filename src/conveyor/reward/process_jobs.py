"""The trajectories a ``processes.ProcessRewardService`` holds, and which of them form its next call.

- ``Job(traj)``: one submitted trajectory and its Future, which always resolves.
- ``JobQueue(gathering)`` is thread safe: ``put``, ``take`` (the next call's jobs, gathered as
  the thread service gathers them), ``requeue`` (a dead worker's call back at the front, in
  order) and ``drain``.

It starts nothing and knows nothing of workers, deadlines or counters.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future

from conveyor.reward.batching import Gathering
from conveyor.runtime.errors import RoleError
from conveyor.types import Trajectory


class Job:
    """``Job(traj)``: one submitted trajectory, its Future (which always resolves), whether the Future
    is marked running (it left the queue once) and how many worker processes died scoring it.
    """
    __slots__ = ("deaths", "future", "queued_at", "running", "traj")

    def __init__(self, traj: Trajectory) -> None:
        self.traj = traj
        self.future: Future[Trajectory] = Future()
        self.queued_at = time.monotonic()
        self.running = False  # its future is marked running (it left the queue once)
        self.deaths = 0       # workers that died while scoring it


class JobQueue:
    """``JobQueue(gathering)`` is thread safe (the callers' ``submit`` and the service's supervisor
    thread): ``put(job)`` queues it (or returns the error that stopped the service; raises
    ``RuntimeError`` once closed); ``take(now)`` is the next call's jobs, gathered as the thread
    service gathers them (``batching.Gathering``: up to ``max_batch``, or fewer once the oldest
    has waited ``wait_s``), cancelled ones dropped, or how long to wait before asking again;
    ``requeue(jobs)`` puts the jobs of a call whose worker died back at the front, in order;
    ``drain(close=..., broken=...)`` marks the queue closed or broken and returns what waited
    (None when it already was). ``gathering`` may be replaced before the first ``take`` (a worker
    reports its reward's ``max_batch`` once loaded).
    """
    def __init__(self, gathering: Gathering) -> None:
        self.gathering = gathering
        self._lock = threading.Lock()  # guards every field below
        self._jobs: deque[Job] = deque()
        self._closed = False
        self._broken: RoleError | None = None

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    @property
    def broken(self) -> RoleError | None:
        with self._lock:
            return self._broken

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def put(self, job: Job, name: str) -> RoleError | None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"reward service {name!r} is closed; create a new one to score more")
            if self._broken is None:
                self._jobs.append(job)
            return self._broken

    def take(self, now: float) -> tuple[list[Job], float]:
        """The next call's jobs (empty if none is due) and, when none is, the seconds until the
        oldest waiting one makes a call due (``math.inf`` when nothing waits)."""
        with self._lock:
            while self._jobs:
                wait = self.gathering.wait(len(self._jobs), self._jobs[0].queued_at, now, self._closed)
                if wait > 0:
                    return [], wait
                taken = self.gathering.take(self._jobs)
                jobs = [j for j in taken if j.running or j.future.set_running_or_notify_cancel()]  # not cancelled
                for job in jobs:
                    job.running = True
                if jobs:
                    return jobs, 0.0
        return [], math.inf

    def requeue(self, jobs: list[Job]) -> None:
        with self._lock:
            self._jobs.extendleft(reversed(jobs))

    def drain(self, close: bool = False, broken: RoleError | None = None) -> list[Job] | None:
        with self._lock:
            if (close and self._closed) or (broken is not None and self._broken is not None):
                return None
            self._closed = self._closed or close
            self._broken = self._broken or broken
            jobs = list(self._jobs)
            self._jobs.clear()
        return jobs
