"""Score trajectories in worker processes; a call past its deadline is killed with its process.

Contract
- ``ProcessRewardService(spec, timeout_s, fallback, workers, max_restarts)``
  is an ``api.RewardHandle`` like ``service.RewardService``: ``submit(traj)``
  returns at once a Future that always resolves (a trajectory, or the error
  that stopped the service, below); ``score(trajs)`` is the blocking form in
  order; ``stats()``; ``close()``; a context manager. Results, failure kinds,
  ``reward_error`` values, counters, log-once lines and timeline spans (one
  row per worker) are those of the thread service (``calls.py`` is shared).
- Each of ``workers`` processes (multiprocessing "spawn": nothing inherited
  from a parent that runs torch and threads) loads the reward itself from
  ``spec`` (``factory.RewardSpec``: only its strings and numbers cross) and
  calls it on its MAIN thread, so a verifier's own ``signal.alarm`` timeouts
  (math-verify's) work there. Trajectories wait in this process and go to a
  worker when it is free, one at a time, so several score in parallel while
  the caller goes on. The constructor returns once every worker has loaded
  the reward, or raises ``PluginError`` with a worker's one-line reason.
- A call past ``timeout_s`` (from when its worker got it): the worker is
  killed (SIGKILL, with the process group it leads), a replacement started;
  the trajectory gets ``fallback``, ``reward_error`` "timeout", counted
  ``timeouts``.
- A worker that dies otherwise (a crash, ``os._exit``, the OOM killer) is
  replaced; its trajectory is scored once more, by the next free worker, and
  gets ``fallback`` with ``reward_error`` "worker died" (counted
  ``failures``) if that worker dies as well. ``stats()`` also counts
  ``worker_deaths`` and ``restarts`` (every replacement, timeouts included).
- The restart rule: sporadic deaths are survived and counted; more than
  ``max_restarts`` deaths IN A ROW (no call answered in between) mean the
  reward cannot run: the service stops and every pending and later Future
  resolves with a ``RoleError`` naming the reward, which stops the run.
- Workers die with this process, even by SIGKILL (``worker.py``: the
  kernel's parent-death signal, and a thread watching the parent's pid).
- ``close()`` cancels queued trajectories, lets running calls end or time
  out, then asks the workers to exit and kills those that do not.

It knows nothing of what a reward computes.
"""
from __future__ import annotations

import itertools
import logging
import math
import multiprocessing
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import wait as wait_any
from typing import TYPE_CHECKING

from conveyor.launch.procs import RoleError
from conveyor.observe import timeline
from conveyor.plugins import PluginError
from conveyor.reward.calls import COUNTERS, Ledger, check_settings, rewarded, settle
from conveyor.reward.worker import WorkerProcess, exit_text
from conveyor.transport.messages import RewardLoaded, ScoreReply, ScoreRequest
from conveyor.types import Trajectory

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.reward.factory import RewardSpec

logger = logging.getLogger(__name__)

_POLL_S = 0.5          # the supervisor re-checks close() and deadlines at least this often
_STOP_GRACE_S = 2.0    # a worker asked to exit gets this long before it is killed


class _Job:
    __slots__ = ("deaths", "future", "running", "seq", "traj")

    def __init__(self, seq: int, traj: Trajectory) -> None:
        self.seq, self.traj = seq, traj
        self.future: Future[Trajectory] = Future()
        self.running = False  # its future is marked running (it left the queue once)
        self.deaths = 0       # workers that died while scoring it


class _Slot:
    """A worker's place in the pool and the process now in it (the supervisor thread's only)."""

    def __init__(self, track: str) -> None:
        self.track = track  # its row on the timeline
        self.proc: WorkerProcess | None = None
        self.gen = 0              # bumped per process, so stale handles are told apart
        self.loaded = False
        self.job: _Job | None = None
        self.deadline = math.inf  # of loading, or of the call it runs
        self.sent_at = 0.0        # wall clock of the call it runs (timeline)


class ProcessRewardService:
    def __init__(self, spec: RewardSpec, timeout_s: float = 5.0, fallback: float = 0.0, workers: int = 2,
                 max_restarts: int = 16, name: str | None = None, load_timeout_s: float = 120.0) -> None:
        check_settings("ProcessRewardService", timeout_s, fallback, workers)
        if not (isinstance(max_restarts, int) and max_restarts >= 0):
            raise ValueError(f"ProcessRewardService max_restarts={max_restarts!r} must be an integer >= 0 "
                             "(reward.max_restarts)")
        self.spec, self.name, self._named = spec, name or spec.name, name is not None
        self.timeout_s, self.fallback, self.workers = float(timeout_s), float(fallback), workers
        self.max_restarts, self.load_timeout_s = max_restarts, load_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._ledger = Ledger(logger, (*COUNTERS, "worker_deaths", "restarts"))
        self._lock = threading.Lock()  # guards _queue, _closed, _broken
        self._queue: deque[_Job] = deque()
        self._closed = False
        self._broken: RoleError | None = None
        self._seq = itertools.count()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._slots = [_Slot(f"reward-{self.name}-process{i}") for i in range(workers)]
        self._started = threading.Event()
        self._start_error = ""
        self._deaths_in_row = 0
        t0 = time.monotonic()
        # Every worker is started from this thread: the kernel's parent-death signal follows the
        # thread that started a process, and this one lives as long as its workers.
        self._thread = threading.Thread(target=self._supervise, name=f"reward-{self.name}-pool", daemon=True)
        self._thread.start()
        if not self._started.wait(load_timeout_s + 10.0) or self._start_error:
            self.close(timeout_s=_STOP_GRACE_S * 3)
            raise PluginError(self._start_error or f"reward {spec.fn!r}: the worker pool did not start within "
                              f"{load_timeout_s + 10.0:.0f}s")
        self._load_s = time.monotonic() - t0

    # ---- public API -------------------------------------------------------

    def submit(self, traj: Trajectory) -> Future[Trajectory]:
        job = _Job(next(self._seq), traj)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"reward service {self.name!r} is closed; create a new one to score more")
            broken = self._broken
            if broken is None:
                self._queue.append(job)
        if broken is not None:
            job.future.set_exception(broken)
        else:
            self._wake()
        return job.future

    def score(self, trajs: list[Trajectory], timeout_s: float | None = None) -> list[Trajectory]:
        """Score ``trajs`` and return new trajectories in the same order; the default deadline
        covers every call running its full ``timeout_s`` and its worker restarted, plus slack."""
        futures = [self.submit(t) for t in trajs]
        if timeout_s is None:
            timeout_s = (self.timeout_s + self._load_s) * (math.ceil(len(trajs) / self.workers) + 1) + 5.0
        return settle(futures, timeout_s, self.name)

    def stats(self) -> dict[str, int]:
        return self._ledger.snapshot()

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking work: cancel queued trajectories, let running ones finish or time out."""
        queued = self._empty_queue(close=True)
        if queued is None:  # closed already
            return
        for job in queued:
            if job.running:  # back in the queue after its worker died: it must still resolve
                self._ledger.count("failures")
                self._resolve(job, self.fallback, {"reward_error": "closed"}, 0.0)
            else:
                job.future.cancel()
                job.future.set_running_or_notify_cancel()
        self._wake()
        if threading.current_thread() is self._thread:  # from a Future's callback: the pool stops by itself
            return
        self._thread.join(self.timeout_s + _POLL_S + 2 * _STOP_GRACE_S if timeout_s is None else timeout_s)
        if self._thread.is_alive():
            logger.warning("reward service %r: worker pool still stopping after close; its workers are "
                           "daemons and die with this process", self.name)
            return
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def __enter__(self) -> ProcessRewardService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the supervisor thread --------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # full: a wake-up is pending anyway; closed: nothing to wake
            pass

    def _supervise(self) -> None:
        try:
            for slot in self._slots:
                self._start(slot)
            while self._turn():
                pass
        except BaseException as e:  # a pool bug must not leave a Future unresolved
            if not self._started.is_set():  # the constructor raises it
                self._start_error = f"reward {self.spec.fn!r}: its worker processes could not start: {e!r}"
                return
            logger.exception("reward %r: the worker pool failed", self.name)
            self._break(RoleError(f"reward {self.name!r}: the worker pool failed: {e!r}"))
        finally:
            self._stop_all()
            self._started.set()

    def _turn(self) -> bool:
        """One round: hand out work, wait for an answer, a death, a wake-up or a deadline."""
        with self._lock:
            if self._broken is not None or (self._start_error and not self._started.is_set()):
                return False
            if self._closed and not self._queue and not any(s.job for s in self._slots):
                return False
        self._dispatch()
        handles: dict[object, tuple[_Slot, int, bool]] = {}
        for s in self._slots:
            if s.proc is not None:
                handles[s.proc.conn] = (s, s.gen, True)
                handles[s.proc.sentinel] = (s, s.gen, False)
        nxt = min(s.deadline for s in self._slots)
        ready = wait_any([self._wake_r, *handles], timeout=max(0.0, min(nxt - time.monotonic(), _POLL_S)))
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        # Messages first: a worker may answer and then exit.
        for messages in (True, False):
            for h in ready:
                slot, gen, is_conn = handles.get(h, (None, -1, False))
                if slot is None or is_conn != messages or slot.gen != gen or slot.proc is None:
                    continue  # the wake-up pipe, or a process replaced earlier in this round
                if is_conn:
                    self._receive(slot)
                else:
                    self._died(slot)
        self._expire(time.monotonic())
        return True

    def _dispatch(self) -> None:
        for slot in self._slots:
            if slot.proc is None or not slot.loaded or slot.job is not None:
                continue
            job = self._next_job()
            if job is None:
                return
            slot.job, slot.sent_at = job, time.time()
            slot.deadline = time.monotonic() + self.timeout_s
            try:
                slot.proc.conn.send(ScoreRequest(job.seq, job.traj))
            except OSError:  # the worker is gone before it got the job: the job goes back unharmed
                slot.job = None
                with self._lock:
                    self._queue.appendleft(job)
                self._died(slot)

    def _next_job(self) -> _Job | None:
        with self._lock:
            while self._queue:
                job = self._queue.popleft()
                if job.running or job.future.set_running_or_notify_cancel():
                    job.running = True
                    return job
        return None

    def _receive(self, slot: _Slot) -> None:
        try:
            msg = slot.proc.conn.recv()
        except (EOFError, OSError):
            self._died(slot)
            return
        except Exception as e:  # noqa: BLE001 - a reply that does not unpickle here
            msg = None
            if slot.job is not None:
                job, slot.job, slot.deadline = slot.job, None, math.inf
                self._ledger.count("failures")
                self._ledger.log_once("unreadable", "reward %r: a result could not be read here (%s: %s); "
                                      "using fallback %s", self.name, type(e).__name__, e, self.fallback)
                self._resolve(job, self.fallback, {"reward_error": "unreadable result"}, time.time() - slot.sent_at)
        if isinstance(msg, RewardLoaded):
            if msg.error:
                self._died(slot, msg.error)
                return
            slot.loaded, slot.deadline = True, math.inf
            if not self._named and msg.name:
                self.name = msg.name  # the loaded reward's own name, as the thread service logs it
            if all(s.loaded for s in self._slots):
                self._started.set()
        elif isinstance(msg, ScoreReply) and slot.job is not None and msg.seq == slot.job.seq:
            job, slot.job, slot.deadline = slot.job, None, math.inf
            self._deaths_in_row = 0
            out = msg.outcome
            self._ledger.count(out.failure)
            self._ledger.report(out.problem)
            args = {"task": job.traj.task.id, **({"failed": out.failure} if out.failure else {})}
            timeline.record("reward", slot.track, "score", msg.started_at, msg.ended_at, args)
            self._resolve(job, out.reward, out.info, msg.ended_at - msg.started_at)

    def _expire(self, now: float) -> None:
        for slot in self._slots:
            if slot.proc is None or slot.deadline > now:
                continue
            job = slot.job
            if job is None:  # still loading
                self._died(slot, f"did not load the reward within {self.load_timeout_s:.0f}s")
                continue
            self._stop(slot)
            self._start(slot)  # before the caller hears of it, so stats() already count the restart
            self._ledger.count("timeouts")
            self._ledger.log_once("timeout", "reward %r exceeded %.2fs on task %r; its worker process was "
                                  "killed and replaced, fallback %s used", self.name, self.timeout_s,
                                  job.traj.task.id, self.fallback)
            self._record(slot, job, "timeouts")
            self._resolve(job, self.fallback, {"reward_error": "timeout"}, self.timeout_s)

    def _died(self, slot: _Slot, why: str = "") -> None:
        """The process in ``slot`` is gone (or could not load the reward): count, rescore, replace."""
        job = slot.job
        code = self._stop(slot)
        why = why or f"exited with {exit_text(code)}"
        if not self._started.is_set():
            self._start_error = f"reward {self.spec.fn!r} cannot be loaded in a reward worker process: {why}"
            return
        self._ledger.add("worker_deaths")
        self._deaths_in_row += 1
        task = f" while scoring task {job.traj.task.id!r}" if job else ""
        self._ledger.log_once("death", "reward %r: a worker process %s%s; replaced (a trajectory is scored once "
                              "more on another worker, then gets fallback %s)", self.name, why, task, self.fallback)
        if job is not None:
            job.deaths += 1
            self._record(slot, job, "worker died")
            if job.deaths < 2 or self._deaths_in_row > self.max_restarts:
                with self._lock:
                    self._queue.appendleft(job)
                job = None
        if self._deaths_in_row > self.max_restarts:
            self._break(RoleError(
                f"reward {self.name!r}: {self._deaths_in_row} worker processes died in a row without scoring "
                f"anything (reward.max_restarts={self.max_restarts}); the last {why}. The reward crashes its "
                "process (a segfault, os._exit, out of memory): fix it, or use reward.executor=thread"))
            return
        self._start(slot)
        if job is not None:  # its second worker died too
            self._ledger.count("failures")
            self._resolve(job, self.fallback, {"reward_error": "worker died"}, time.time() - slot.sent_at)

    def _record(self, slot: _Slot, job: _Job, failed: str) -> None:
        """A call that ended without an answer, on its worker's timeline row."""
        timeline.record("reward", slot.track, "score", slot.sent_at, time.time(),
                        {"task": job.traj.task.id, "failed": failed})

    def _empty_queue(self, close: bool = False, broken: RoleError | None = None) -> list[_Job] | None:
        """Mark the service closed or broken and take what waits; None if it already was."""
        with self._lock:
            if (close and self._closed) or (broken is not None and self._broken is not None):
                return None
            self._closed = self._closed or close
            self._broken = self._broken or broken
            queued = list(self._queue)
            self._queue.clear()
        return queued

    def _break(self, err: RoleError) -> None:
        jobs = self._empty_queue(broken=err)
        if jobs is None:
            return
        jobs += [s.job for s in self._slots if s.job is not None]
        for s in self._slots:
            s.job = None
        logger.error("%s", err)
        for job in jobs:
            try:
                job.future.set_exception(err)
            except InvalidStateError:  # the caller cancelled it while queued
                pass

    def _start(self, slot: _Slot) -> None:
        if slot.gen:  # not the first process of this slot
            self._ledger.add("restarts")
        slot.proc = WorkerProcess(self._ctx, self.spec, self.fallback, slot.track)
        slot.gen, slot.loaded, slot.job = slot.gen + 1, False, None
        slot.deadline = time.monotonic() + self.load_timeout_s

    def _stop_all(self) -> None:
        """Ask every worker to exit, give them ``_STOP_GRACE_S`` together, kill the rest."""
        live = [s for s in self._slots if s.proc is not None]
        for slot in live:
            slot.proc.ask_to_exit()
        deadline = time.monotonic() + _STOP_GRACE_S
        for slot in live:
            slot.proc.join(deadline - time.monotonic())
            self._stop(slot)

    def _stop(self, slot: _Slot) -> int | None:
        """End the process in ``slot`` (killed if it still runs); its exit code."""
        proc = slot.proc
        slot.proc, slot.loaded, slot.job, slot.deadline = None, False, None, math.inf
        return proc.end() if proc is not None else None

    def _resolve(self, job: _Job, reward: float, info: dict, elapsed: float) -> None:
        job.future.set_result(rewarded(job.traj, reward, info, elapsed))

