"""The producer: admits rollouts by the staleness rule, routes them to engines, scores, buffers.

Contract: ``Producer`` runs in one controller thread and owns the state the
loop and it share. It keeps at most ``concurrency`` groups in flight, admits
new ones (once ``start_admitting()`` was called) only while
``staleness.admissible`` allows for the published version (``version()``,
told by the loop through ``published(v)``), sends each admitted chunk as a
``messages.Generate`` to the engine worker with the fewest groups in flight,
turns ``Done`` completions into groups, has every trajectory scored by the
reward service (off this thread) and puts each complete group into the
buffer as ``Scored``; with a ``group_filter`` (DAPO, ``controller.group_filter``)
a group it drops gives its slot a new task instead (``filter_stats()``: the
counts since the last call). Chunks never straddle a training step and their
sampling seed is their place in the schedule. A resumed producer starts at a
``schedule.ResumePoint`` (``start``): from the data position of its step boundary,
drawing but not sending the places trained before. ``snapshot()`` (engine clocks,
skipped prompts) and ``take_swaps()`` (weight swaps since the last call) are
what the loop reads of it. What the engines report of their work (the spans
in ``Done``, the ``WeightSwap`` stamps) and the groups in flight go to the
run's timeline (``observe.timeline``).

An engine process that dies, or whose weight transport failed (``Failed``
with ``weights``: a receive that broke, a version that did not arrive), is
restarted (``restart()`` of its worker) within ``restarts``, the run's
budget (``rollout.restarts.EngineRestarts``, shared with the launcher, which
spends it on engines that die while starting), and what it had in flight
(chunks, evaluation requests, episode turns) is sent to its replacement; prompts answered before the death are not taken
twice. Other failures stop the run:
an engine that reports another error, a death past the budget, a buffer that stays
full or a reward that never returns closes the buffer with a ``RoleError``
naming the role, which the loop re-raises.

It knows nothing of training, advantages or how engines are launched.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from conveyor import staleness
from conveyor.config import LoopConfig
from conveyor.controller.schedule import ResumePoint
from conveyor.controller.time_share import TimeShare
from conveyor.observe import timeline
from conveyor.rollout.api import EngineWorker, SamplingParams
from conveyor.rollout.restarts import EngineRestarts
from conveyor.rollout.single_turn import prepare_prompts, to_groups
from conveyor.runtime.errors import RoleError
from conveyor.transport.messages import Done, EngineClock, Failed, Generate, MemoryDone, Ready, Scored, WeightSwap
from conveyor.types import Group, Task


_RESENDS = " and sending it its work in flight"  # what the restart log line says comes next


@dataclass(frozen=True)
class Prompting:
    """How task prompts become token ids: the tokenizer, the longest prompt an engine serves,
    and whether the tokenizer adds its special tokens."""
    tokenizer: object
    max_prompt_tokens: int
    add_special_tokens: bool


@dataclass(frozen=True)
class RolloutSnapshot:
    """The producer's state as of one moment. ``clocks``: each engine's totals, by engine id;
    ``prompts_skipped``: prompts left out so far, by reason (``prompt_too_long``, ``prompt_empty``,
    ``groups_dropped``); ``env``: the environment pool's counters (empty without one)."""
    clocks: dict[int, EngineClock]
    prompts_skipped: dict[str, int]
    env: dict[str, int] = field(default_factory=dict)
    restarts: int = 0


@dataclass
class _Chunk:
    first_index: int
    tasks: list
    prompts: list
    engine_id: int
    sent_at: float
    message: Generate  # sent again, whole, to the engine that replaces a dead one
    reported: set[int] = field(default_factory=set)  # prompts answered (a streaming engine answers each as it ends)


@dataclass
class _Pending:
    index: int
    futures: list
    task: Task
    engine_id: int


@dataclass
class _Shared:
    """What the loop's thread reads: guarded by ``lock``."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    clocks: dict[int, EngineClock] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    swaps: list[WeightSwap] = field(default_factory=list)


class Producer:
    def __init__(self, workers: list[EngineWorker], outbox, *, loop: LoopConfig, timeout_s: float,
                 prompting: Prompting, cursor, train_size: int, rewards, buffer, start: ResumePoint | None = None,
                 version: int = 0, sampling=None, episodes=None, max_failed_groups: int = 64,
                 restarts: EngineRestarts | None = None, start_timeout_s: float | None = None,
                 group_filter=None):
        self.workers, self.outbox = tuple(workers), outbox
        self.prompting, self.cursor, self.train_size = prompting, cursor, train_size
        self.rewards, self.buffer = rewards, buffer
        self.sampling = sampling  # seed -> SamplingParams of training rollouts
        # Multi-turn episodes (episodes.runner.EpisodeRunner), or None for single-turn chunks.
        self.episodes = episodes
        self.max_failed_groups = max_failed_groups
        # DAPO's shaping and dynamic sampling (controller.group_filter.GroupFilter), or None.
        self.group_filter = group_filter
        self._next_refill = 2**48  # chunk ids of refilled slots: above every place in the schedule
        self._failed_in_a_row = 0
        self._redraws = 0
        self.batch_size, self.max_staleness, self.seed = loop.batch_size, loop.max_staleness, loop.seed
        self.concurrency = loop.concurrency or staleness.capacity(loop.batch_size, loop.max_staleness)
        self.per_engine = max(1, math.ceil(loop.batch_size / len(workers)))
        self.timeout = timeout_s
        self._restarts = restarts if restarts is not None else EngineRestarts(0)  # None: no restarts
        self.start_timeout = start_timeout_s or timeout_s
        self._starting: dict[int, float] = {}  # restarted engine -> deadline of its Ready
        start = start or ResumePoint(0, loop.batch_size)
        self.issued = start.start  # the next place in the schedule
        self._skip = set(start.done)  # places trained before a resume: their tasks are drawn, not sent
        self._version = version
        self._admitting = False  # the loop turns admission on when RL starts
        self.inflight = 0
        self._inflight = {w.engine_id: 0 for w in self.workers}
        self._shared = _Shared(clocks={w.engine_id: EngineClock() for w in self.workers})
        self.error: BaseException | None = None
        self._direct: dict[int, tuple[Future, Generate, int]] = {}  # evaluations by negative id: (future, request, engine)
        self._next_direct = -1
        self._chunks: dict[int, _Chunk] = {}
        self._cursor_at_step: dict[int, dict] = {}
        self._pending: list[_Pending] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer", daemon=True)
        # The engines' KV pools, released while a synchronous step trains (launch.time_share).
        self.time_share = TimeShare(self.workers, timeout_s, lambda: self.error)

    # ----- what the loop calls ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def start_admitting(self) -> None:
        self._admitting = True

    def stop_admitting(self) -> None:
        self._admitting = False

    def published(self, version: int) -> None:
        """The engines may now be asked for ``version``: admission moves on by the staleness rule."""
        self._version = version
        timeline.count("controller", "policy version", {"version": version})

    def version(self) -> int:
        """The newest published policy version (what new chunks are admitted for)."""
        return self._version

    def cursor_at(self, step: int, now: dict) -> dict:
        """The data position a checkpoint of ``step`` saves: as of that step's boundary if this
        thread has drawn past it, else ``now`` (read by the caller before this call)."""
        return self._cursor_at_step.get(step, now)

    def snapshot(self) -> RolloutSnapshot:
        with self._shared.lock:
            clocks, skipped = dict(self._shared.clocks), dict(self._shared.skipped)
        env = self.episodes.pool.counts() if self.episodes is not None else {}
        return RolloutSnapshot(clocks, skipped, env, self.restarts)

    @property
    def restarts(self) -> int:
        """Engine restarts in the run so far (those while the engines started included)."""
        return self._restarts.used

    def take_swaps(self) -> list[WeightSwap]:
        """The engines' weight swaps reported since the last call."""
        with self._shared.lock:
            swaps, self._shared.swaps = self._shared.swaps, []
        return swaps

    def filter_stats(self) -> dict[str, float]:
        """Dynamic sampling's groups kept and dropped since the last call (empty without it)."""
        g = self.group_filter
        return g.take_stats().metrics() if g is not None and g.dynamic_sampling else {}

    def request(self, prompts: list[list[int]], params: SamplingParams, engine_id: int = 0) -> Future:
        """Generate outside the schedule (evaluation); the future holds the completions."""
        if self.error is not None:
            raise RoleError(f"rollouts have stopped: {self.error}") from self.error
        fut: Future = Future()
        key, self._next_direct = self._next_direct, self._next_direct - 1
        msg = Generate(key, prompts, params, self._version)
        self._direct[key] = (fut, msg, engine_id)
        self.workers[engine_id].send(msg)
        return fut

    # ----- the producer's thread ----------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._check_engines()
                if self._admitting:
                    self._admit()
                self._collect()
                if self.episodes is not None:
                    self._collect_episodes()
                self._flush_scored()
        except BaseException as e:  # noqa: BLE001 - handed to the loop through the buffer
            self.error = e
            self.buffer.close(e)
            for fut, _, _ in self._direct.values():
                if not fut.done():
                    fut.set_exception(e)
        finally:
            if self.episodes is not None:
                self.episodes.close()

    def _take(self, k: int) -> tuple[list, list]:
        """k servable tasks: prompts that are empty or too long are counted and replaced."""
        p = self.prompting
        kept, prompts, tries = [], [], 0
        while len(kept) < k:
            tasks = self.cursor.next_batch(k - len(kept))
            skipped: dict[str, int] = {}
            ok, ids = prepare_prompts(p.tokenizer, tasks, p.max_prompt_tokens, p.add_special_tokens, skipped)
            with self._shared.lock:
                for key, n in skipped.items():
                    self._shared.skipped[key] = self._shared.skipped.get(key, 0) + n
            kept += ok
            prompts += ids
            tries += len(tasks)
            if tries > k + self.train_size:
                raise RoleError(f"producer: no prompt of the training data fits the engine context "
                                f"({p.max_prompt_tokens} tokens); shorten prompts or use a longer-context model")
        return kept, prompts

    def _admit(self) -> None:
        n = min(staleness.admissible(self.issued, self.batch_size, self._version, self.max_staleness),
                self.concurrency - self.inflight)
        while n > 0:
            if self.issued % self.batch_size == 0:
                # The data position at a step boundary is what a checkpoint of that step
                # must save; the loop may checkpoint after this thread drew further.
                self._cursor_at_step[self.issued // self.batch_size] = self.cursor.state_dict()
            if self.issued in self._skip:  # trained before the resume: the data moves on past it
                self._skip.discard(self.issued)
                if self.episodes is not None:
                    self.cursor.next_batch(1)
                else:
                    self._take(1)  # the same draws as when it was sent: skipped prompts are passed over
                self.issued += 1
                n -= 1
                continue
            step_end = (self.issued // self.batch_size + 1) * self.batch_size
            k = min(n, step_end - self.issued, self.per_engine,
                    min((i for i in self._skip if i > self.issued), default=step_end) - self.issued)
            worker = min(self.workers, key=lambda w: self._inflight[w.engine_id])
            if self.episodes is not None:  # multi-turn: the episode runner drives the engines
                for i, task in enumerate(self.cursor.next_batch(k)):
                    self.episodes.start_group(self.issued + i, task, self._group_seed(self.issued + i))
                self.issued += k
                self.inflight += k
                n -= k
                continue
            tasks, prompts = self._take(k)
            first = self.issued
            self.issued += k
            n -= k
            # The seed is the chunk's place in the schedule: the engine gives its prompt i the
            # random streams of a call seeded seed + i, so every task draws from streams of its
            # own place, however the schedule is cut into chunks and spread over engines, in a
            # resumed or re-launched run, and in a run at another staleness (same loop.seed).
            seed = self.seed * 2**40 + first
            # The chunk carries the version it was admitted for: the engine starts it on no older weights.
            msg = Generate(first, [list(p) for p in prompts], self.sampling(seed), self._version)
            self._chunks[first] = _Chunk(first, tasks, prompts, worker.engine_id, time.perf_counter(), msg)
            self._inflight[worker.engine_id] += k
            self.inflight += k
            worker.send(msg)
            self._count_groups()

    def _collect(self) -> None:
        try:
            msg = self.outbox.get(timeout=0.005)
        except queue.Empty:
            return
        if isinstance(msg, Failed):
            if msg.weights and msg.engine_id in self._starting:
                return  # the replaced engine's other thread reporting the same failure
            worker = self.workers[msg.engine_id]
            if msg.weights and self._restarts.can_restart(worker):
                last = msg.traceback.strip().splitlines()[-1][:300]
                self._restarts.restart(worker, f"engine {msg.engine_id}: its weights stopped arriving ({last})",
                                       _RESENDS)
                self._resend(worker)
                return
            raise RoleError(f"engine {msg.engine_id} failed:\n{msg.traceback}")
        if isinstance(msg, Ready):  # a restarted engine is serving
            self._starting.pop(msg.engine_id, None)
            return
        if isinstance(msg, MemoryDone):
            self.time_share.acknowledge(msg)
            return
        if isinstance(msg, WeightSwap):
            with self._shared.lock:
                self._shared.swaps.append(msg)
            _record_swap(msg)
            return
        if not isinstance(msg, Done):
            return
        timeline.record_spans("rollout", msg.spans)
        if msg.chunk_id < 0:
            entry = self._direct.pop(msg.chunk_id, None)  # None: answered before its engine was replaced
            if entry is not None:
                entry[0].set_result(msg.completions)
            return
        if self.episodes is not None:  # a turn of an episode
            with self._shared.lock:
                self._shared.clocks[msg.engine_id] = msg.clock
            self.episodes.answer(msg)
            return
        with self._shared.lock:
            self._shared.clocks[msg.engine_id] = msg.clock
        chunk = self._chunks.get(msg.chunk_id)
        if chunk is None:  # answered already, before its engine died and the chunk was sent again
            return
        # A chunk sent again to a restarted engine comes back whole: prompts answered before are dropped.
        fresh = [j for j in range(len(msg.completions)) if msg.offset + j not in chunk.reported]
        if fresh:
            at = [msg.offset + j for j in fresh]
            groups = to_groups(self.prompting.tokenizer, [chunk.tasks[a] for a in at], [chunk.prompts[a] for a in at],
                               [msg.completions[j] for j in fresh], time.perf_counter() - chunk.sent_at)
            for a, g in zip(at, groups):
                futures = [self.rewards.submit(t) for t in g.trajectories]
                self._pending.append(_Pending(chunk.first_index + a, futures, g.task, chunk.engine_id))
            chunk.reported.update(at)
        if len(chunk.reported) >= len(chunk.tasks):
            del self._chunks[msg.chunk_id]

    def _check_engines(self) -> None:
        """A dead engine process is replaced (``launch.max_restarts`` in the run) and its work in
        flight sent to the new one; past the budget, or for an engine that cannot restart, the
        death stops the run naming the engine."""
        for w in self.workers:
            try:
                w.check()
            except RoleError as dead:
                self._restarts.replace(w, dead, _RESENDS)
                self._resend(w)
        now = time.monotonic()
        for engine_id, deadline in list(self._starting.items()):
            if now > deadline:
                raise RoleError(f"engine {engine_id} was restarted but did not start within "
                                f"{self.start_timeout:g}s (launch.timeout_s); see logs/engine{engine_id}.log")

    def _resend(self, worker) -> None:
        """``worker`` was just restarted: it gets what the dead one had in flight."""
        self._starting[worker.engine_id] = time.monotonic() + self.start_timeout
        for chunk in self._chunks.values():
            if chunk.engine_id == worker.engine_id:
                worker.send(chunk.message)
        for _, msg, engine_id in self._direct.values():
            if engine_id == worker.engine_id:
                worker.send(msg)
        if self.episodes is not None:
            self.episodes.requeue(worker.engine_id)

    def _group_seed(self, index: int) -> int:
        # A group's place in the schedule keys its episodes' streams (sample j: + 64 j, attempt
        # a: + 2**16 a, turn t: + t); a slot refilled after a dropped group draws anew.
        return self.seed * 2**44 + index * 2**22 + (self._redraws % 8) * 2**19

    def _collect_episodes(self) -> None:
        for out in self.episodes.finished():
            if out.fatal:
                raise RoleError(f"episode runner: group {out.index} failed: {out.error}")
            if out.group is None:
                self._failed_in_a_row += 1
                with self._shared.lock:
                    self._shared.skipped["groups_dropped"] = self._shared.skipped.get("groups_dropped", 0) + 1
                if self._failed_in_a_row >= self.max_failed_groups:
                    raise RoleError(f"environment pool: {self._failed_in_a_row} groups in a row failed; "
                                    f"last error: {out.error}")
                # The slot is refilled with a new task: a group is trained whole or not at all.
                self._redraws += 1
                self.episodes.start_group(out.index, self.cursor.next_batch(1)[0], self._group_seed(out.index))
                continue
            self._failed_in_a_row = 0
            futures = [self.rewards.submit(t) for t in out.group.trajectories]
            self._pending.append(_Pending(out.index, futures, out.task, -1))

    def _flush_scored(self) -> None:
        for p in [p for p in self._pending if all(f.done() for f in p.futures)]:
            self._pending.remove(p)
            group = Group(p.task, tuple(f.result() for f in p.futures))
            if self.group_filter is not None:
                group = self.group_filter.review(p.index, group)
                if group is None:  # no learning signal: the slot is drawn again, still in flight
                    self._refill(p)
                    continue
            if p.engine_id in self._inflight:  # -1: an episode group, routed turn by turn
                self._inflight[p.engine_id] -= 1
            self.inflight -= 1
            self.buffer.put(Scored(p.index, group), timeout=self.timeout)
            self._count_groups()

    def _refill(self, p: _Pending) -> None:
        """A new task for the slot of a dropped group (dynamic sampling): the slot keeps its place
        in the schedule, so admission and staleness go on as if the group had been kept."""
        self._redraws += 1
        if self.episodes is not None:
            self.episodes.start_group(p.index, self.cursor.next_batch(1)[0], self._group_seed(p.index))
            return
        tasks, prompts = self._take(1)
        worker = min(self.workers, key=lambda w: self._inflight[w.engine_id])
        self._inflight[p.engine_id] -= 1
        self._inflight[worker.engine_id] += 1
        # A stream of its own for each redraw; above 2**32 no first draw's seed can reach it.
        seed = self.seed * 2**40 + p.index + (1 + self._redraws % 255) * 2**32
        chunk_id, self._next_refill = self._next_refill, self._next_refill + 1
        msg = Generate(chunk_id, [list(prompts[0])], self.sampling(seed), self._version)
        self._chunks[chunk_id] = _Chunk(p.index, tasks, prompts, worker.engine_id, time.perf_counter(), msg)
        worker.send(msg)

    def _count_groups(self) -> None:
        timeline.count("controller", "groups", {"in flight": self.inflight, "buffered": len(self.buffer)})


def _record_swap(swap: WeightSwap) -> None:
    """A swap on the engine's weights track: the transfer (writer's announce -> the engine's
    transport holds the version) where the transport says, and the swap's pause, which ends
    when the copy has run."""
    # Two tracks: a transfer may still run when the previous version's swap starts.
    track = f"engine {swap.engine_id} weights"
    if swap.announced_at is not None and swap.received_at is not None:
        timeline.record("rollout", track + " transfer", "weights: transfer", swap.announced_at, swap.received_at,
                        {"version": swap.version})
    timeline.record("rollout", track, "weights: swap", swap.applied_at - swap.pause_s, swap.applied_at,
                    {"version": swap.version})
