"""The environment pool: instances, deadlines, retries, a circuit breaker and failure counters.

- ``EnvPool(factory, limits, tool_format)`` hands out ``EnvSession``s, at most
  ``limits.concurrency`` at once; an instance whose call failed or timed out is never reused.
- Every call into user code has a deadline (``reset_timeout_s``, ``step_timeout_s``,
  ``tool_timeout_s``); creation and ``reset`` are retried, ``step`` is not.
- Tool calls are parsed (``env.parsers``) and run by the pool; their failures become error
  observations the model reads, never an exception in the episode.
- A circuit breaker quarantines a failing tool or environment type; an environment that never
  worked raises ``EnvUnusable``, which stops the run.
- ``counts()``: failures by class plus ``episodes``, ``tool_calls``, ``instances_created``.

It knows nothing of tokens, engines or rewards: text in, text out.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from conveyor.env.api import EnvFailure, StepResult, Tool, ToolError, as_step_result, env_tools
from conveyor.observe import timeline
from conveyor.resilience import Breaker
from conveyor.runtime.errors import RunStop
from conveyor.types import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolLimits:
    """The pool's limits (the fields of ``config.EnvConfig`` with the same names)."""
    concurrency: int = 64
    reset_timeout_s: float = 30.0
    step_timeout_s: float = 30.0
    tool_timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.05
    breaker_failures: int = 5
    breaker_cooldown_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: Any) -> "PoolLimits":
        return cls(**{f: getattr(cfg, f) for f in cls.__dataclass_fields__})


class EnvUnusable(RunStop):
    """The environment failed ``breaker_failures`` times in a row before it ever worked: the run
    stops (not an ``EnvFailure``, which a run survives), naming it and its last failure."""


class EnvPool:
    """Environment instances behind deadlines, retries and a circuit breaker.

    - ``EnvPool(factory, limits, tool_format)`` hands out ``EnvSession``s (``async
      with pool.session() as s``), at most ``limits.concurrency`` at once. An
      instance is created by ``factory()`` (in a worker thread), reset for each
      episode and reused; an instance whose call failed or timed out is closed
      and never reused.
    - Every call into user code has a deadline: ``reset_timeout_s``,
      ``step_timeout_s``, ``tool_timeout_s``. Plain methods run in the pool's
      worker threads (a hung one is abandoned at its deadline: its thread stays
      busy, the instance is discarded); ``async`` ones are cancelled.
    - Creation and ``reset`` are retried ``retries`` times with exponential
      backoff (they start an episode, so a retry is safe); ``step`` is not
      (it changes the environment's state): its failure ends the episode with
      ``EnvFailure``.
    - Tool calls: when the instance declares ``tools``, the pool parses the
      model's turn (``env.parsers``). A turn with calls runs them (each under
      its deadline and the circuit breaker) and answers with their results,
      without calling ``step``; a turn without calls goes to ``step`` (the
      final answer). A malformed call, an unknown tool, bad arguments, a tool's
      ``ToolError`` or a timeout become an error observation the model reads,
      counted by class; never an exception in the episode.
    - Circuit breaker (``resilience.Breaker``): after ``breaker_failures`` consecutive
      failures a tool (or the environment type) is quarantined for
      ``breaker_cooldown_s``; then one trial call decides. Calls to a
      quarantined tool answer an error observation; a quarantined environment
      holds new episodes back (up to ``reset_timeout_s``, then
      ``EnvFailure("quarantined")``, naming the last failure) until its trial
      call. An environment quarantined before it ever worked (no reset, step or
      play succeeded yet) is not an outage to wait out but a broken one: every
      new session raises ``EnvUnusable`` naming it and its last failure, which
      stops the run at once.
    - ``counts()``: failures by class (``env.api.FAILURE_CLASSES``) plus
      ``episodes``, ``tool_calls``, ``instances_created``; ``quarantined()``
      names what is quarantined now.
    - Each session holds the lowest free slot number (< ``limits.concurrency``);
      its episode, resets and steps are spans of that slot's row on the run's
      timeline (``observe.timeline``): one slot runs one episode at a time, so
      its spans nest.
    """
    def __init__(self, factory: Callable[[], Any], limits: PoolLimits = PoolLimits(), tool_format: str = "auto",
                 name: str = "env"):
        self.factory, self.limits, self.tool_format, self.name = factory, limits, tool_format, name
        self.breaker = Breaker(limits.breaker_failures, limits.breaker_cooldown_s, label="environment pool")
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._all: list[Any] = []
        # Threads for plain (non-async) methods: one per session, plus room for abandoned hung calls.
        self._threads = ThreadPoolExecutor(max_workers=limits.concurrency * 2 + 4, thread_name_prefix="env")
        self._slots: asyncio.Semaphore | None = None
        self._busy_slots: set[int] = set()  # timeline rows in use (sessions live on one event loop)
        self.worked = False      # a reset, step or play has succeeded
        self.last_failure = ""   # the last failure the breaker recorded, as "kind: message"

    # ----- counters --------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def quarantined(self) -> list[str]:
        return self.breaker.open_keys()

    def record(self, failure: EnvFailure | None) -> None:
        """The environment's call succeeded (None) or failed: the breaker's record, and what a
        quarantine names."""
        if failure is None:
            self.worked = True
        else:
            self.last_failure = f"{failure.kind}: {failure}"
        self.breaker.record("env", failure is None)

    # ----- calls into user code --------------------------------------------------------
    async def call(self, fn: Callable, *args: Any, timeout: float, what: str) -> Any:
        """``fn(*args)`` under a deadline; raise ``EnvFailure`` (timeout / crash) naming ``what``."""
        try:
            if asyncio.iscoroutinefunction(fn):
                return await asyncio.wait_for(fn(*args), timeout)
            loop = asyncio.get_running_loop()
            return await asyncio.wait_for(loop.run_in_executor(self._threads, fn, *args), timeout)
        except asyncio.TimeoutError:
            raise EnvFailure("timeout", f"{what} did not return within {timeout:.1f}s") from None
        except (EnvFailure, ToolError):
            raise
        except Exception as e:  # noqa: BLE001 - user code: any error is a counted crash
            raise EnvFailure("crash", f"{what} raised {type(e).__name__}: {e}") from e

    async def _retrying(self, fn: Callable, *args: Any, timeout: float, what: str) -> Any:
        delay = self.limits.backoff_s
        for attempt in range(self.limits.retries + 1):
            try:
                return await self.call(fn, *args, timeout=timeout, what=what)
            except EnvFailure as e:
                self.count(e.kind)
                if attempt == self.limits.retries:
                    raise
                log.info("environment pool: %s (attempt %d), retrying in %.2fs", e, attempt + 1, delay)
                await asyncio.sleep(delay)
                delay *= 2

    # ----- sessions --------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator["EnvSession"]:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.concurrency)
        async with self._slots:
            await self._until_allowed()
            instance = await self._instance()
            slot = min(set(range(len(self._busy_slots) + 1)) - self._busy_slots)
            self._busy_slots.add(slot)
            session = EnvSession(self, instance, f"slot {slot}")
            try:
                with timeline.measure("environment", "episode", track=session.track):
                    yield session
            finally:
                self._busy_slots.discard(slot)
                self._give_back(instance, healthy=session.healthy)

    async def _until_allowed(self) -> None:
        """Wait while the environment is quarantined, up to the reset deadline: failing at once
        would only burn the tasks of the slots the producer refills until the run stops."""
        deadline = time.monotonic() + self.limits.reset_timeout_s
        while not self.breaker.allow("env"):
            if not self.worked:
                raise EnvUnusable(f"environment {self.name} failed {self.limits.breaker_failures} times in a row "
                                  f"and never worked (last: {self.last_failure}); fix it or its env.kwargs")
            left = deadline - time.monotonic()
            if left <= 0:
                self.count("quarantined")
                raise EnvFailure("quarantined", f"environment {self.name} is quarantined after repeated failures "
                                                f"(last: {self.last_failure})")
            await asyncio.sleep(min(0.25, left))

    async def _instance(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        try:
            instance = await self._retrying(self.factory, timeout=self.limits.reset_timeout_s,
                                            what=f"creating environment {self.name}")
        except EnvFailure as e:
            self.record(e)
            raise
        self.count("instances_created")
        with self._lock:
            self._all.append(instance)
        return instance

    def _give_back(self, instance: Any, healthy: bool) -> None:
        if healthy:
            with self._lock:
                self._idle.append(instance)
            return
        with self._lock:
            if instance in self._all:
                self._all.remove(instance)
        self._threads.submit(close_quietly, instance)

    def close(self) -> None:
        with self._lock:
            instances, self._all, self._idle = self._all, [], []
        for inst in instances:
            close_quietly(inst)
        self._threads.shutdown(wait=False, cancel_futures=True)


class EnvSession:
    """One episode's use of one environment instance."""

    def __init__(self, pool: EnvPool, env: Any, track: str = "slot 0"):
        self.pool, self.env = pool, env
        self.track = track  # its row on the run's timeline
        self.tools: tuple[Tool, ...] = tuple(env_tools(env))
        self.healthy = True

    async def reset(self, task: Task) -> str:
        p = self.pool
        try:
            with timeline.measure("environment", "reset", track=self.track):
                obs = await p._retrying(self.env.reset, task, timeout=p.limits.reset_timeout_s,
                                        what=f"{type(self.env).__name__}.reset")
        except EnvFailure as e:
            self.healthy = False
            p.record(e)
            raise
        if obs is not None and not isinstance(obs, str):
            self.healthy = False
            p.count("bad_return")
            raise EnvFailure("bad_return", f"{type(self.env).__name__}.reset returned {type(obs).__name__}; "
                                           "return the first observation as a str (or None for the task's prompt)")
        p.worked = True
        p.count("episodes")
        return obs or task.prompt

    async def step(self, action: str) -> tuple[StepResult, tuple[str, ...], str]:
        """The answer to one model turn: (result, names of the tools called, failure class or "")."""
        if self.tools:
            from conveyor.env.tool_calls import run_tool_calls
            with timeline.measure("environment", "tool calls", track=self.track):
                answered = await run_tool_calls(self, action)
            if answered is not None:
                return answered
        p, where = self.pool, f"{type(self.env).__name__}.step"
        try:
            with timeline.measure("environment", "step", track=self.track):
                raw = await p.call(self.env.step, action, timeout=p.limits.step_timeout_s, what=where)
            result = as_step_result(raw, where)
        except (EnvFailure, TypeError) as e:
            kind = e.kind if isinstance(e, EnvFailure) else "bad_return"
            self.healthy = False
            p.count(kind)
            failure = EnvFailure(kind, str(e))
            p.record(failure)
            raise failure from e
        p.record(None)
        return result, (), ""

    async def play(self, fn: Callable, *args: Any, timeout: float, what: str) -> Any:
        """A whole episode in one call of user code (an external agent: ``env.agent``), under
        ``timeout``; its failure is counted, trips the breaker and drops the instance, like a step's.

        - ``EnvSession.play(fn, *args, timeout, what)``: a whole episode in one
          call of user code (an external agent, ``env.agent``) under ``timeout``;
          its failure is counted, recorded by the breaker and drops the instance,
          as a failed ``step``'s does.
        """
        p = self.pool
        try:
            with timeline.measure("environment", "agent", track=self.track):
                out = await p.call(fn, *args, timeout=timeout, what=what)
        except EnvFailure as e:
            self.healthy = False
            p.count(e.kind)
            p.record(e)
            raise
        p.count("episodes")
        p.record(None)
        return out


def close_quietly(instance: Any) -> None:
    """``instance.close()`` if it has one; what it raises is logged, not raised (closing is best effort)."""
    close = getattr(instance, "close", None)  # close() is optional in the Env protocol
    if close is None:
        return
    try:
        out = close()
        if asyncio.iscoroutine(out):
            out.close()  # an async close() cannot be awaited from here; do not leak the coroutine
    except Exception as e:  # noqa: BLE001 - closing is best effort
        log.info("environment pool: closing %s raised %s", type(instance).__name__, e)
