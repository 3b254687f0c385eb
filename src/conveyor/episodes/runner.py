"""The episode runner: multi-turn groups driven on one event loop, turns routed to engine workers.

- ``EpisodeRunner`` runs an asyncio loop in a thread of its own: ``start_group`` runs a group's
  episodes concurrently, each turn sent to the least loaded engine worker; ``finished()``
  returns ended groups whole, or failed under the failure policy (``retry`` / ``drop``).
- A turn that no engine answers within ``timeout_s`` fails its episode.
- ``run_tasks`` / ``play_tasks``: one episode per task outside the schedule.
- How an episode is played (engine turns or the user's agent) is the environment's declaration
  (``env.api.played_by``), never its name; ``episode_runner(cfg, ...)`` builds the runner.

It knows nothing of rewards, admission or training.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import random
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from conveyor.env.api import EnvFailure, PlayedBy
from conveyor.env.pool import EnvPool, EnvUnusable
from conveyor.episodes.multi_turn import EpisodeLimits, TurnFormat, run_episode
from conveyor.rollout.api import EngineWorker
from conveyor.runtime import watchdog
from conveyor.transport.messages import Done, Generate
from conveyor.types import Completion, Group, SamplingParams, Task, Trajectory

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.episodes.agents import AgentEpisodes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupOutcome:
    """A group's end: ``group`` (whole) or None with ``error``, the last episode failure."""
    index: int
    task: Task
    group: Group | None
    error: str = ""
    fatal: bool = False  # not an environment failure: a bug that must stop the run


class EpisodeRunner:
    """Contract: ``EpisodeRunner(workers, pool, fmt, limits, ...)`` runs an asyncio
    loop in a thread of its own. ``start_group(index, task, seed)`` runs the
    group's n episodes concurrently (``episodes.multi_turn.run_episode``, each
    in a session of the ``EnvPool``); each turn is a ``messages.Generate`` of
    one prompt sent to the engine worker with the fewest turns in flight,
    tagged with a turn id (>= 0, so a streaming engine merges concurrent
    turns into its running batch) and the newest published version (so a
    weight swap may land between turns; inside a turn the engine's partial
    rollouts apply). The producer hands every ``Done`` of a turn id to
    ``answer``. ``finished()`` returns the groups that ended since the last
    call as ``GroupOutcome``s, whole: every episode succeeded, or the group
    failed (``group is None``) under the failure policy: ``retry`` re-runs a
    failed episode on a fresh instance with a fresh seed up to ``attempts``
    times, ``drop`` fails the group at its first failed episode. A turn that
    no engine answers within ``timeout_s`` fails its episode (``timeout``).
    ``run_tasks(tasks, params)`` runs one episode per task outside the
    schedule (evaluation) and returns the trajectories (None for failures);
    ``play_tasks`` returns each failure's ``EnvFailure`` instead (``conveyor generate``).
    With ``agents`` (``episodes.agents``) an episode is the user's agent
    calling the OpenAI-compatible endpoint, served on this loop with this
    runner as its engine, instead of ``run_episode``. ``episode_runner(cfg,
    ...)`` builds the runner a config asks for; which of the two ways an
    episode is played is the environment's declaration (``env.api.played_by``),
    never its name.
    """
    def __init__(self, workers: list[EngineWorker], pool: EnvPool, fmt: TurnFormat, limits: EpisodeLimits, *,
                 sampling: Callable[[int], SamplingParams], n: int, version: Callable[[], int],
                 on_failure: str = "retry", attempts: int = 2, timeout_s: float = 600.0,
                 agents: "AgentEpisodes | None" = None):
        self.workers, self.pool, self.fmt, self.limits = tuple(workers), pool, fmt, limits
        self.sampling, self.n, self.version = sampling, n, version
        self.on_failure, self.attempts, self.timeout_s = on_failure, attempts, timeout_s
        self._ids = itertools.count()
        self._turns: dict[int, tuple[asyncio.Future, int, Generate]] = {}  # turn id -> (future, engine id, request)
        self._load = {w.engine_id: 0 for w in self.workers}
        self._finished: queue.Queue[GroupOutcome] = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="episodes", daemon=True)
        self._thread.start()
        self.agents = agents
        if agents is not None:  # the endpoint's calls are turns of this loop, like run_episode's
            try:
                watchdog.result(asyncio.run_coroutine_threadsafe(agents.start(self), self._loop), 60,
                                "the agents' endpoint's start")
            except BaseException:
                self.close()
                raise

    # ----- what the producer calls (its thread) ------------------------------------------
    def start_group(self, index: int, task: Task, seed: int) -> None:
        asyncio.run_coroutine_threadsafe(self._group(index, task, seed), self._loop)

    def finished(self) -> list[GroupOutcome]:
        out = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    def requeue(self, engine_id: int) -> None:
        """The engine ``engine_id`` was replaced: its turns in flight are sent to the new one."""
        def resend() -> None:
            worker = next(w for w in self.workers if w.engine_id == engine_id)
            for _, owner, msg in list(self._turns.values()):
                if owner == engine_id:
                    worker.send(msg)
        self._loop.call_soon_threadsafe(resend)

    def answer(self, done: Done) -> None:
        """A turn's completion arrived (``done.chunk_id`` is a turn id)."""
        self._loop.call_soon_threadsafe(self._resolve, done.chunk_id, done.completions[0][0])

    def run_tasks(self, tasks: list[Task], params: SamplingParams, timeout_s: float) -> list[Trajectory | None]:
        # a failure is counted; the caller scores it at the reward's fallback
        return [t if isinstance(t, Trajectory) else None for t in self.play_tasks(tasks, params, timeout_s)]

    def play_tasks(self, tasks: list[Task], params: SamplingParams,
                   timeout_s: float) -> list[Trajectory | EnvFailure]:
        """``run_tasks`` with each failed episode's ``EnvFailure`` (its class and message) in its place."""
        def seeded(i: int) -> SamplingParams:  # task i draws from streams of its own
            return params if params.seed is None else dataclasses.replace(params, seed=params.seed + 64 * i)

        async def one(task: Task, params: SamplingParams) -> Trajectory | EnvFailure:
            try:
                return await self._attempts(task, params)
            except EnvFailure as e:
                return e

        async def all_of():
            return await asyncio.gather(*(one(t, seeded(i)) for i, t in enumerate(tasks)))
        fut = asyncio.run_coroutine_threadsafe(all_of(), self._loop)
        return watchdog.result(fut, timeout_s, f"{len(tasks)} episodes")

    def demonstrate(self, tasks: list[Task], teacher: Callable, rng, timeout_s: float) -> list[Trajectory]:
        """Episodes played by a scripted ``teacher(task, transcript, rng) -> action`` instead of
        the engine (the multi-turn warm start's demonstrations); failed episodes are left out."""
        async def one(task: Task) -> Trajectory | None:
            # Episodes take turns in the order their environments answer (and an agent's calls in
            # the order HTTP decides): each teacher gets a stream of its own, drawn before anything
            # is awaited (tasks start in order), so the demonstrations do not depend on that order.
            own = random.Random(rng.random())
            try:
                async with self.pool.session() as session:
                    engine = _Teacher(task, teacher, self.fmt, own)
                    if self.agents is not None:
                        return await self.agents.play(session, task, SamplingParams(n=1), engine=engine)
                    return await run_episode(engine, session, task, self.fmt, SamplingParams(n=1), self.limits)
            except EnvFailure as e:
                log.info("demonstration of task %s failed: %s", task.id, e)
                return None

        async def all_of():
            return await asyncio.gather(*(one(t) for t in tasks))
        out = watchdog.result(asyncio.run_coroutine_threadsafe(all_of(), self._loop), timeout_s,
                              f"the warm start's {len(tasks)} demonstrated episodes")
        return [t for t in out if t is not None]

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # let them unwind (sessions close)

        if self._loop.is_running():
            try:
                if self.agents is not None:  # refuse later calls, then stop serving, before episodes unwind
                    asyncio.run_coroutine_threadsafe(self.agents.stop(), self._loop).result(timeout=15)
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=10)
            except Exception as e:  # noqa: BLE001 - closing is best effort; the loop stops below anyway
                log.info("episode runner: tasks did not unwind: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self.pool.close()

    # ----- the event loop's side -----------------------------------------------------------
    def _resolve(self, turn_id: int, completion: Completion) -> None:
        entry = self._turns.pop(turn_id, None)
        if entry is None:  # its episode gave up waiting
            return
        fut, engine_id, _ = entry
        self._load[engine_id] -= 1
        if not fut.done():
            fut.set_result(completion)

    async def generate(self, ids: list[int], params: SamplingParams) -> Completion:
        """``TurnEngine``: one continuation, from the least loaded engine worker."""
        turn_id = next(self._ids)
        worker = min(self.workers, key=lambda w: self._load[w.engine_id])
        fut = self._loop.create_future()
        msg = Generate(turn_id, [ids], params, self.version())
        self._turns[turn_id] = (fut, worker.engine_id, msg)
        self._load[worker.engine_id] += 1
        worker.send(msg)
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except asyncio.TimeoutError:
            if self._turns.pop(turn_id, None) is not None:
                self._load[worker.engine_id] -= 1
            raise EnvFailure("timeout", f"engine {worker.engine_id} did not answer a turn within "
                                        f"{self.timeout_s:g}s") from None

    async def _episode(self, task: Task, params: SamplingParams) -> Trajectory:
        async with self.pool.session() as session:
            if self.agents is not None:
                return await self.agents.play(session, task, params)
            return await run_episode(self, session, task, self.fmt, params, self.limits)

    async def _attempts(self, task: Task, params: SamplingParams, fail_fast: bool = False) -> Trajectory:
        """The episode, retried under the failure policy; the last ``EnvFailure`` when it keeps failing."""
        tries = 1 if fail_fast else self.attempts
        for attempt in range(tries):
            try:
                seed = None if params.seed is None else params.seed + attempt * 2**16
                return await self._episode(task, dataclasses.replace(params, seed=seed))
            except EnvFailure as e:
                self.pool.count("episodes_failed")
                log.info("episode of task %s failed (%s): %s", task.id, e.kind, e)
                if attempt + 1 == tries:
                    raise

    async def _group(self, index: int, task: Task, seed: int) -> None:
        base = self.sampling(seed)
        # Each episode's turns draw from streams of its own (sample j, turn t).
        jobs = [self._attempts(task, dataclasses.replace(base, seed=base.seed + 64 * j),
                               fail_fast=self.on_failure == "drop") for j in range(self.n)]
        outs = await asyncio.gather(*jobs, return_exceptions=True)
        bug = next((o for o in outs if isinstance(o, Exception) and not isinstance(o, EnvFailure)), None)
        failed = next((o for o in outs if isinstance(o, EnvFailure)), None)
        if bug is not None:  # not an environment failure: it must reach the producer, not vanish here
            if not isinstance(bug, EnvUnusable):  # that one's message says all (env/pool.py)
                log.error("episode group %d failed", index, exc_info=bug)
            self._finished.put(GroupOutcome(index, task, None, f"{type(bug).__name__}: {bug}", fatal=True))
        elif failed is not None:
            self._finished.put(GroupOutcome(index, task, None, f"{failed.kind}: {failed}"))
        else:
            self._finished.put(GroupOutcome(index, task, Group(task, tuple(outs))))


def episode_runner(cfg, workers: list[EngineWorker], tokenizer, context_limit: int, version: Callable[[], int],
                   add_special_tokens: bool) -> EpisodeRunner:
    """The runner a ``RunConfig`` with ``env.name`` asks for (``cfg.env``: the pool and the budgets)."""
    from conveyor.env.api import load_env, played_by
    from conveyor.env.pool import PoolLimits

    e = cfg.env
    factory = load_env(e.name)
    way = played_by(factory, e.name)
    kwargs = dict(e.kwargs)
    if way.model_kwarg is not None:  # an agent is told the model name the endpoint serves (a program: OPENAI_MODEL)
        kwargs[way.model_kwarg] = e.endpoint.model
    _check_builds(lambda: factory(**kwargs), e, way)
    pool = EnvPool(lambda: factory(**kwargs), PoolLimits.from_config(e), e.tool_format, name=e.name)
    fmt = TurnFormat(tokenizer, chat=cfg.data.chat_template, role=e.observation_role,
                     template=e.observation_template, system_prompt=cfg.data.system_prompt,
                     add_special_tokens=add_special_tokens)
    limits = EpisodeLimits(e.max_turns, e.max_tokens or context_limit, e.max_observation_tokens, context_limit)
    agents = None
    if way.kind == "agent":
        from conveyor.episodes.agents import agent_episodes
        agents = agent_episodes(cfg, tokenizer, limits, add_special_tokens, pool.count)
    return EpisodeRunner(workers, pool, fmt, limits, n=cfg.rollout.n, version=version,
                         sampling=lambda seed: SamplingParams.from_config(cfg.rollout, seed=seed, n=1),
                         on_failure=e.on_failure, attempts=e.episode_attempts, timeout_s=cfg.launch.timeout_s,
                         agents=agents)


class _Teacher:
    """A ``TurnEngine`` whose turns are a scripted teacher's actions (logprob 0, version 0)."""

    def __init__(self, task: Task, teacher: Callable, fmt: TurnFormat, rng):
        self.task, self.teacher, self.fmt, self.rng = task, teacher, fmt, rng
        self.prompt_len: int | None = None

    async def generate(self, ids: list[int], params: SamplingParams) -> Completion:
        action = self.teacher(self.task, self.fmt.decode(ids), self.rng)
        toks = list(self.fmt.tok(action, add_special_tokens=False)["input_ids"]) + [self.fmt.tok.eos_token_id]
        return Completion(toks, [0.0] * len(toks), [0] * len(toks), "stop", action)


def _check_builds(build: Callable, e, way: PlayedBy) -> None:
    """Build one instance before the run starts, so a bad ``env.kwargs`` (or an agent-played
    environment that cannot be played so) is one line now rather than a stream of failed episodes later."""
    from conveyor.env.pool import close_quietly
    from conveyor.runtime.errors import SetupError
    try:
        instance = build()
    except Exception as err:  # noqa: BLE001 - any error of user code is reported the same way
        first = str(err).splitlines()[0] if str(err) else ""
        raise SetupError(f"env.name={e.name!r} with env.kwargs={dict(e.kwargs)}: building it raised "
                         f"{type(err).__name__}: {first}; fix env.kwargs or the environment") from None
    try:
        from conveyor.env.api import env_tools
        from conveyor.env.parsers import tool_problem
        if way.kind == "agent":
            from conveyor.episodes.agents import agent_of
            try:
                agent_of(instance)
            except TypeError as err:
                raise SetupError(f"env.name={e.name!r}: {err}") from None
        problems = [p for p in map(tool_problem, env_tools(instance)) if p]
        if problems:
            raise SetupError(f"env.name={e.name!r}: {problems[0]}; fix the tool's declaration")
    finally:
        close_quietly(instance)
