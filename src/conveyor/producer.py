"""The producer: admits rollouts by the staleness rule, routes them to engines, scores, buffers.

Contract: ``Producer`` runs in one controller thread. It keeps at most
``concurrency`` groups in flight, admits new ones only while
``staleness.may_admit`` allows for the published ``version`` (set by the loop
after each publish), sends each admitted chunk of tasks to the engine worker
with the fewest groups in flight, turns finished completions into groups,
has every trajectory scored by the reward service (off this thread), and puts
each complete group into the ``TrajectoryBuffer`` tagged with its admission
index. Chunks never straddle a training step and their sampling seed is
their place in the schedule, so a task's samples depend on the weights that
serve it, not on how its chunk was cut or batched.

Failures stop the run: an engine that reports an error or whose process died,
a buffer that stays full or a reward that never returns closes the buffer
with a ``RoleError`` naming the role, which the loop re-raises.

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
from conveyor.launch.procs import RoleError
from conveyor.rollout.single_turn import prepare_prompts, to_groups
from conveyor.types import Group


@dataclass
class EngineHandle:
    """The controller's view of one engine worker (a thread or a child process)."""
    engine_id: int
    inbox: object
    process: object | None = None   # RoleProcess when the engine runs in its own process
    thread: threading.Thread | None = None
    inflight: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    counters: dict = field(default_factory=dict)  # the engine's step totals (NativeEngine.counters)

    def check(self) -> None:
        if self.process is not None:
            self.process.check()
        elif self.thread is not None and not self.thread.is_alive():
            raise RoleError(f"engine {self.engine_id} thread ended unexpectedly")


@dataclass
class _Chunk:
    first_index: int
    tasks: list
    prompts: list
    engine: EngineHandle
    sent_at: float
    reported: int = 0  # prompts answered so far (a streaming engine answers each as it ends)


@dataclass
class _Pending:
    index: int
    futures: list
    task: object
    engine: EngineHandle


@dataclass
class ProducerStats:
    weight_events: list = field(default_factory=list)  # (engine, version, applied_at, pause_s, received_at)


class Producer:
    def __init__(self, c, engines: list[EngineHandle], outbox, params_for_seed, start_issued: int = 0,
                 version: int = 0):
        lc = c.cfg.loop
        self.c, self.engines, self.outbox = c, engines, outbox
        self.params_for_seed = params_for_seed
        self.batch_size, self.max_staleness = lc.batch_size, lc.max_staleness
        self.concurrency = lc.concurrency or lc.batch_size * (lc.max_staleness + 1)
        self.per_engine = max(1, math.ceil(lc.batch_size / len(engines)))
        self.seed = lc.seed
        self.timeout = c.cfg.launch.timeout_s
        self.issued = start_issued
        self.version = version
        self.inflight = 0
        self.stats = ProducerStats()
        self.error: BaseException | None = None
        self.admitting = False  # the loop turns admission on when RL starts
        self._direct: dict[int, Future] = {}  # evaluation requests, keyed by negative ids
        self._next_direct = -1
        self._chunks: dict[int, _Chunk] = {}
        self.cursor_at_step: dict[int, dict] = {}
        self._pending: list[_Pending] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for e in self.engines:
                    e.check()
                if self.admitting:
                    self._admit()
                self._collect()
                self._flush_scored()
        except BaseException as e:  # noqa: BLE001 - handed to the loop through the buffer
            self.error = e
            self.c.buffer.close(e)
            for fut in self._direct.values():
                fut.set_exception(e)

    def request(self, prompts: list[list[int]], params, engine_id: int = 0) -> Future:
        """Generate outside the schedule (evaluation); the future holds the completions."""
        if self.error is not None:
            raise RoleError(f"rollouts have stopped: {self.error}") from self.error
        fut: Future = Future()
        key, self._next_direct = self._next_direct, self._next_direct - 1
        self._direct[key] = fut
        self.engines[engine_id].inbox.put(("generate", key, prompts, params, self.version))
        return fut

    def _take(self, k: int) -> tuple[list, list]:
        """k servable tasks: prompts that are empty or too long are counted and replaced."""
        kept, prompts, tries = [], [], 0
        while len(kept) < k:
            tasks = self.c.cursor.next_batch(k - len(kept))
            ok, ids = prepare_prompts(self.c.tokenizer, tasks, self.c.max_prompt_tokens,
                                      self.c.add_special_tokens, self.c.stats)
            kept += ok
            prompts += ids
            tries += len(tasks)
            if tries > k + len(self.c.train_source):
                raise RoleError(f"producer: no prompt of the training data fits the engine context "
                                f"({self.c.max_prompt_tokens} tokens); shorten prompts or use a longer-context model")
        return kept, prompts

    def _admit(self) -> None:
        n = min(staleness.admissible(self.issued, self.batch_size, self.version, self.max_staleness),
                self.concurrency - self.inflight)
        while n > 0:
            step_end = (self.issued // self.batch_size + 1) * self.batch_size
            k = min(n, step_end - self.issued, self.per_engine)
            engine = min(self.engines, key=lambda e: e.inflight)
            if self.issued % self.batch_size == 0:
                # The data position at a step boundary is what a checkpoint of that step
                # must save; the loop may checkpoint after this thread drew further.
                self.cursor_at_step[self.issued // self.batch_size] = self.c.cursor.state_dict()
            tasks, prompts = self._take(k)
            first = self.issued
            self.issued += k
            n -= k
            # The seed is the chunk's place in the schedule: the engine gives its prompt i the
            # random streams of a call seeded seed + i, so every task draws from streams of its
            # own place, however the schedule is cut into chunks and spread over engines, in a
            # resumed or re-launched run, and in a run at another staleness (same loop.seed).
            seed = self.seed * 2**40 + first
            self._chunks[first] = _Chunk(first, tasks, prompts, engine, time.perf_counter())
            engine.inflight += k
            self.inflight += k
            # The chunk carries the version it was admitted for: the engine starts it on no older weights.
            engine.inbox.put(("generate", first, [list(p) for p in prompts], self.params_for_seed(seed),
                              self.version))

    def _collect(self) -> None:
        try:
            msg = self.outbox.get(timeout=0.005)
        except queue.Empty:
            return
        kind = msg[0]
        if kind == "error":
            raise RoleError(f"engine {msg[1]} failed:\n{msg[2]}")
        if kind == "weights":
            self.stats.weight_events.append(msg[1:])
            return
        if kind != "done":
            return
        _, engine_id, first, outs, st, offset = msg
        if first < 0:
            self._direct.pop(first).set_result(outs)
            return
        chunk = self._chunks[first]
        chunk.engine.busy_s, chunk.engine.idle_s = st["busy_s"], st["idle_s"]
        chunk.engine.counters = st.get("counters", {})
        part = slice(offset, offset + len(outs))
        groups = to_groups(self.c.tokenizer, chunk.tasks[part], chunk.prompts[part], outs,
                           time.perf_counter() - chunk.sent_at)
        for i, g in enumerate(groups):
            futures = [self.c.rewards.submit(t) for t in g.trajectories]
            self._pending.append(_Pending(first + offset + i, futures, g.task, chunk.engine))
        chunk.reported += len(outs)
        if chunk.reported >= len(chunk.tasks):
            del self._chunks[first]

    def _flush_scored(self) -> None:
        for p in [p for p in self._pending if all(f.done() for f in p.futures)]:
            self._pending.remove(p)
            group = Group(p.task, tuple(f.result() for f in p.futures))
            p.engine.inflight -= 1
            self.inflight -= 1
            self.c.buffer.put((p.index, group), timeout=self.timeout)
