"""Score trajectories in worker processes; a call past its deadline is killed with its process.

Contract: ``ProcessRewardService(spec, timeout_s, fallback, workers,
max_restarts, batch_wait_s)`` is an ``api.RewardHandle`` like
``service.RewardService``, with the same results, failure kinds, counters and
log-once lines (``calls.py``), over ``workers`` spawned processes that each
load the reward from ``spec`` and call it on their main thread. A call past
``timeout_s`` is killed with its worker, which is replaced; a worker that dies
otherwise is replaced and its trajectories scored once more; more than
``max_restarts`` deaths in a row stop the run with a ``RoleError``. A
``BatchReward`` is scored in batches gathered as on threads. Workers die with
this process. The class docstring has the details.

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
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import wait as wait_any
from typing import TYPE_CHECKING

from conveyor.observe import timeline
from conveyor.plugins import PluginError
from conveyor.reward.batching import Gathering
from conveyor.reward.calls import COUNTERS, Ledger, check_settings, rewarded, settle
from conveyor.reward.process_jobs import Job, JobQueue
from conveyor.reward.worker import WorkerProcess, exit_text
from conveyor.runtime.errors import RoleError
from conveyor.transport.messages import RewardLoaded, ScoreReply, ScoreRequest
from conveyor.types import Trajectory

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.reward.factory import RewardSpec

logger = logging.getLogger(__name__)

_POLL_S = 0.5          # the supervisor re-checks close() and deadlines at least this often
_STOP_GRACE_S = 2.0    # a worker asked to exit gets this long before it is killed


class _Slot:
    """A worker's place in the pool and the process now in it (the supervisor thread's only)."""

    def __init__(self, track: str) -> None:
        self.track = track  # its row on the timeline
        self.proc: WorkerProcess | None = None
        self.gen = 0              # bumped per process, so stale handles are told apart
        self.loaded = False
        self.jobs: list[Job] = []  # the call it runs
        self.seq = -1             # that call's, to match its answer
        self.deadline = math.inf  # of loading, or of the call it runs
        self.sent_at = 0.0        # wall clock of the call it runs (timeline)


class ProcessRewardService:
    """Reward calls in worker processes: the module docstring's contract in full.

    - ``ProcessRewardService(spec, timeout_s, fallback, workers, max_restarts, batch_wait_s)``
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
    - A reward the workers load as an ``api.BatchReward`` (a reward model, each
      worker with its own copy on its device) scores batches: trajectories are
      gathered here exactly as the thread service gathers them (``batching.py``,
      ``process_jobs.py``: up to its ``max_batch``, or fewer once the oldest has
      waited ``batch_wait_s``) and a batch goes to a free worker as one call;
      what follows of "a call" holds for the whole batch (one deadline, every
      trajectory of it rescored or given the fallback, each counted), and
      ``stats()`` counts ``batches`` too.
    - A call past ``timeout_s`` (from when its worker got it): the worker is
      killed (SIGKILL, with the process group it leads), a replacement started;
      each trajectory of it gets ``fallback``, ``reward_error`` "timeout", counted
      ``timeouts``.
    - A worker that dies otherwise (a crash, ``os._exit``, the OOM killer) is
      replaced; its trajectories are scored once more, by the next free worker,
      and get ``fallback`` with ``reward_error`` "worker died" (counted
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
    - A worker is made by ``_worker(index, track)``: a ``worker.WorkerProcess``
      here, a Ray actor behind the same face in ``launch.ray_rewards.RayRewardService``
      (whose ``end()`` says in words how it ended, where a process gives its
      exit code).
    """

    def __init__(self, spec: RewardSpec, timeout_s: float = 5.0, fallback: float = 0.0, workers: int = 2,
                 max_restarts: int = 16, name: str | None = None, load_timeout_s: float = 120.0,
                 batch_wait_s: float = 0.02) -> None:
        check_settings("ProcessRewardService", timeout_s, fallback, workers)
        if not (isinstance(max_restarts, int) and max_restarts >= 0):
            raise ValueError(f"ProcessRewardService max_restarts={max_restarts!r} must be an integer >= 0 "
                             "(reward.max_restarts)")
        self.spec, self.name, self._named = spec, name or spec.name, name is not None
        self.timeout_s, self.fallback, self.workers = float(timeout_s), float(fallback), workers
        self.max_restarts, self.load_timeout_s = max_restarts, load_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self.batch_wait_s = Gathering(1, batch_wait_s).wait_s  # checked now; max_batch comes from the workers
        self._ledger = Ledger(logger, (*COUNTERS, "worker_deaths", "restarts", "batches"))
        self._queue = JobQueue(Gathering())  # a batched reward's gathering once its workers report it
        self.batched = False                 # whether they load a BatchReward (set when they report it)
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
        job = Job(traj)
        broken = self._queue.put(job, self.name)
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
            calls = math.ceil(len(trajs) / self._queue.gathering.max_batch)
            timeout_s = ((self.timeout_s + self._load_s) * (math.ceil(calls / self.workers) + 1)
                         + self._queue.gathering.wait_s + 5.0)
        return settle(futures, timeout_s, self.name)

    def stats(self) -> dict[str, int]:
        counts = self._ledger.snapshot()
        if not self.batched:  # as the thread service, which counts batches of batched rewards only
            del counts["batches"]
        return counts

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking work: cancel queued trajectories, let running ones finish or time out."""
        queued = self._queue.drain(close=True)
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
        if self._queue.broken is not None or (self._start_error and not self._started.is_set()):
            return False
        if self._queue.closed and not len(self._queue) and not any(s.jobs for s in self._slots):
            return False
        gather_s = self._dispatch()
        handles: dict[object, tuple[_Slot, int, bool]] = {}
        for s in self._slots:
            if s.proc is not None:
                handles[s.proc.conn] = (s, s.gen, True)
                handles[s.proc.sentinel] = (s, s.gen, False)
        nxt = min(s.deadline for s in self._slots) - time.monotonic()
        ready = wait_any([self._wake_r, *handles], timeout=max(0.0, min(nxt, gather_s, _POLL_S)))
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

    def _dispatch(self) -> float:
        """Send each free worker its next call; the seconds until a gathering batch is due."""
        for slot in self._slots:
            if slot.proc is None or not slot.loaded or slot.jobs:
                continue
            jobs, gather_s = self._queue.take(time.monotonic())
            if not jobs:
                return gather_s
            slot.jobs, slot.seq, slot.sent_at = jobs, next(self._seq), time.time()
            slot.deadline = time.monotonic() + self.timeout_s
            try:
                slot.proc.conn.send(ScoreRequest(slot.seq, tuple(j.traj for j in jobs)))
            except OSError:  # the worker is gone before it got the call: its jobs go back unharmed
                slot.jobs = []
                self._queue.requeue(jobs)
                self._died(slot)
        return math.inf

    def _receive(self, slot: _Slot) -> None:
        try:
            msg = slot.proc.conn.recv()
        except (EOFError, OSError):
            self._died(slot)
            return
        except Exception as e:  # noqa: BLE001 - a reply that does not unpickle here
            msg = None
            if slot.jobs:
                jobs, slot.jobs, slot.deadline = slot.jobs, [], math.inf
                self._ledger.count("failures", len(jobs))
                self._ledger.add("batches")
                self._ledger.log_once("unreadable", "reward %r: a result could not be read here (%s: %s); "
                                      "using fallback %s", self.name, type(e).__name__, e, self.fallback)
                for job in jobs:
                    self._resolve(job, self.fallback, {"reward_error": "unreadable result"},
                                  time.time() - slot.sent_at)
        if isinstance(msg, RewardLoaded):
            if msg.error:
                self._died(slot, msg.error)
                return
            slot.loaded, slot.deadline = True, math.inf
            if not self._named and msg.name:
                self.name = msg.name  # the loaded reward's own name, as the thread service logs it
            if msg.max_batch and not self.batched:  # a BatchReward: gather its calls (before any is taken)
                self.batched = True
                self._queue.gathering = Gathering(msg.max_batch, self.batch_wait_s)
            if all(s.loaded for s in self._slots):
                self._started.set()
        elif isinstance(msg, ScoreReply) and slot.jobs and msg.seq == slot.seq:
            jobs, slot.jobs, slot.deadline = slot.jobs, [], math.inf
            self._deaths_in_row = 0
            self._ledger.add("batches")
            for out in msg.outcomes:
                self._ledger.count(out.failure)
                self._ledger.report(out.problem)
            kinds = sorted({out.failure for out in msg.outcomes if out.failure})
            args = {"task": jobs[0].traj.task.id, **({"batch": len(jobs)} if self.batched else {}),
                    **({"failed": ",".join(kinds)} if kinds else {})}
            timeline.record("reward", slot.track, "score", msg.started_at, msg.ended_at, args)
            for job, out in zip(jobs, msg.outcomes):
                self._resolve(job, out.reward, out.info, msg.ended_at - msg.started_at)

    def _expire(self, now: float) -> None:
        for slot in self._slots:
            if slot.proc is None or slot.deadline > now:
                continue
            jobs = slot.jobs
            if not jobs:  # still loading
                self._died(slot, f"did not load the reward within {self.load_timeout_s:g}s")
                continue
            self._stop(slot)
            self._start(slot)  # before the caller hears of it, so stats() already count the restart
            self._ledger.count("timeouts", len(jobs))
            self._ledger.add("batches")
            self._ledger.log_once("timeout", "reward %r exceeded %.2fs on task %r%s; its worker process was "
                                  "killed and replaced, fallback %s used", self.name, self.timeout_s,
                                  jobs[0].traj.task.id, f" (a batch of {len(jobs)})" if self.batched else "",
                                  self.fallback)
            self._record(slot, jobs, "timeouts")
            for job in jobs:
                self._resolve(job, self.fallback, {"reward_error": "timeout"}, self.timeout_s)

    def _died(self, slot: _Slot, why: str = "") -> None:
        """The process in ``slot`` is gone (or could not load the reward): count, rescore, replace."""
        jobs = slot.jobs
        code = self._stop(slot)
        why = why or (code if isinstance(code, str) else f"exited with {exit_text(code)}")  # str: a Ray actor's
        if not self._started.is_set():
            self._start_error = f"reward {self.spec.fn!r} cannot be loaded in a reward worker process: {why}"
            return
        self._ledger.add("worker_deaths")
        self._deaths_in_row += 1
        task = f" while scoring task {jobs[0].traj.task.id!r}" if jobs else ""
        self._ledger.log_once("death", "reward %r: a worker process %s%s; replaced (a trajectory is scored once "
                              "more on another worker, then gets fallback %s)", self.name, why, task, self.fallback)
        if jobs:
            self._record(slot, jobs, "worker died")
        for job in jobs:
            job.deaths += 1
        breaking = self._deaths_in_row > self.max_restarts
        self._queue.requeue([j for j in jobs if j.deaths < 2 or breaking])  # _break resolves them
        if breaking:
            self._break(RoleError(
                f"reward {self.name!r}: {self._deaths_in_row} worker processes died in a row without scoring "
                f"anything (reward.max_restarts={self.max_restarts}); the last {why}. The reward crashes its "
                "process (a segfault, os._exit, out of memory): fix it, or use reward.executor=thread"))
            return
        self._start(slot)
        for job in [j for j in jobs if j.deaths >= 2]:  # its second worker died too
            self._ledger.count("failures")
            self._resolve(job, self.fallback, {"reward_error": "worker died"}, time.time() - slot.sent_at)

    def _record(self, slot: _Slot, jobs: list[Job], failed: str) -> None:
        """A call that ended without an answer, on its worker's timeline row."""
        args = {"task": jobs[0].traj.task.id, **({"batch": len(jobs)} if self.batched else {}), "failed": failed}
        timeline.record("reward", slot.track, "score", slot.sent_at, time.time(), args)

    def _break(self, err: RoleError) -> None:
        jobs = self._queue.drain(broken=err)
        if jobs is None:
            return
        for s in self._slots:
            jobs, s.jobs = jobs + s.jobs, []
        logger.error("%s", err)
        for job in jobs:
            try:
                job.future.set_exception(err)
            except InvalidStateError:  # the caller cancelled it while queued
                pass

    def _start(self, slot: _Slot) -> None:
        if slot.gen:  # not the first process of this slot
            self._ledger.add("restarts")
        slot.proc = self._worker(self._slots.index(slot), slot.track)
        slot.gen, slot.loaded, slot.jobs = slot.gen + 1, False, []
        slot.deadline = time.monotonic() + self.load_timeout_s

    def _worker(self, index: int, track: str) -> WorkerProcess:
        """A new worker for slot ``index`` (``launch.ray_rewards.RayRewardService``: a Ray actor instead)."""
        return WorkerProcess(self._ctx, self.spec, self.fallback, track)

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
        slot.proc, slot.loaded, slot.jobs, slot.deadline = None, False, [], math.inf
        return proc.end() if proc is not None else None

    def _resolve(self, job: Job, reward: float, info: dict, elapsed: float) -> None:
        job.future.set_result(rewarded(job.traj, reward, info, elapsed))

