"""Agent episodes: the user's agent plays a task through the OpenAI-compatible endpoint, its calls become a trajectory.

- ``AgentEpisodes(endpoint, timeout_s)`` is the episode runner's path for an environment played
  by an agent (``env.api.PlayedBy("agent")``): ``play`` runs the agent under the pool's deadline
  and returns the episode's recorded ``Trajectory``, or raises ``EnvFailure``, counted.
- ``agent_episodes(cfg, ...)`` builds it for a run.

It knows nothing of admission, rewards functions or training.
"""
from __future__ import annotations

import time

from conveyor.env.api import AgentPlayed, EnvFailure, agent_result
from conveyor.env.pool import EnvSession
from conveyor.episodes.multi_turn import EpisodeLimits, TurnEngine
from conveyor.episodes.openai_server import Endpoint, EndpointSettings
from conveyor.types import SamplingParams, Task, Trajectory


class AgentEpisodes:
    """Contract: ``AgentEpisodes(endpoint, timeout_s)`` is the episode runner's
    (``episodes.runner.EpisodeRunner``) path for an environment that declares
    it is played by an agent (``env.api.PlayedBy("agent")``, as ``env.name: agent`` does).
    ``start(engine)`` serves the endpoint on the runner's event loop with the
    runner as the default engine (turns reach the engine workers exactly as
    ``run_episode``'s do). ``play(session, task, params, engine=None)`` opens
    an episode, runs the session's ``env.api.AgentPlayed`` with the endpoint's
    ``base_url`` and the episode's key under the pool's deadline
    (``timeout_s``: ``env.endpoint.episode_timeout_s``; an agent that raises,
    hangs or never closes its episode is a counted failure of the session, see
    ``EnvSession.play``), closes the episode (later calls with its key are
    refused) and returns its ``Trajectory``: the recorded tokens, the agent's
    reward on its last turn (its other numbers in ``reward_info``), and
    ``finish_reason`` ``length`` when a call hit a budget. An episode that
    rewrote its history, made no call, returned something that is not a
    reward, or whose engine call failed raises ``EnvFailure``, counted by
    class on the pool. ``engine`` replaces the runner for one episode (the warm
    start's scripted teacher). ``stop()`` refuses every later call (the run
    ended) and stops the server.
    """
    def __init__(self, endpoint: Endpoint, timeout_s: float):
        self.endpoint, self.timeout_s = endpoint, timeout_s

    async def start(self, engine: TurnEngine) -> str:
        from conveyor.runtime.errors import SetupError
        try:
            return await self.endpoint.start(engine)
        except RuntimeError as e:  # a taken address, a server that did not come up: the run cannot start
            raise SetupError(str(e)) from None

    async def stop(self) -> None:
        await self.endpoint.stop()

    async def play(self, session: EnvSession, task: Task, params: SamplingParams,
                   engine: TurnEngine | None = None) -> Trajectory:
        agent = agent_of(session.env)
        pool, where = session.pool, f"agent {agent.name} on task {task.id!r}"
        t0 = time.perf_counter()
        ep = self.endpoint.open(task, params, engine)
        try:
            out = await session.play(agent.entry, self.endpoint.base_url, ep.key, task,
                                     timeout=self.timeout_s, what=where)
        finally:
            self.endpoint.close(ep.key)
        try:
            if ep.failure is not None:
                raise ep.failure
            result = agent_result(out, where)
            traj = ep.transcript.trajectory(
                task, finish_reason="length" if ep.budget_hit else "stop", reward=result.reward, info=result.info,
                timings={"episode_s": time.perf_counter() - t0, "generate_s": ep.generate_s, "env_s": ep.client_s})
        except EnvFailure as e:
            pool.count(e.kind)
            raise
        return traj


def agent_of(env: object) -> AgentPlayed:
    """``env`` as the agent that plays its episodes; a ``TypeError`` saying what it lacks otherwise."""
    if not isinstance(env, AgentPlayed):
        raise TypeError(f"{type(env).__name__} is played by an agent (its played_by) but has no name or "
                        "entry(base_url, api_key, task); give it both (conveyor.env.api.AgentPlayed)")
    return env


def agent_episodes(cfg, tokenizer, limits: EpisodeLimits, add_special_tokens: bool, count) -> AgentEpisodes:
    """The endpoint and agent episodes of a ``RunConfig`` whose environment an agent plays."""
    from conveyor.runtime.errors import SetupError
    for module in ("starlette", "uvicorn", "jsonschema"):
        try:
            __import__(module)
        except ImportError:
            raise SetupError(f"env.name={cfg.env.name} is played by an agent through an OpenAI-compatible "
                             f"endpoint, which needs {module}: pip install 'conveyor[agents]'") from None
    ep = cfg.env.endpoint
    settings = EndpointSettings(host=ep.host, port=ep.port, model=ep.model, tools_in_prompt=ep.tools_in_prompt,
                                tool_format=cfg.env.tool_format, add_special_tokens=add_special_tokens)
    return AgentEpisodes(Endpoint(tokenizer, settings, limits, count), ep.episode_timeout_s)
