"""The environment pool's contract: environments, tools, tool calls and what a step returns.

- ``Env``: what a Python developer knows from gymnasium, for text: ``reset(task)``,
  ``step(action) -> StepResult``, either may be ``async def``; one instance serves one episode
  at a time. ``StepResult.reward`` is the turn's reward; the return is their sum.
- ``Tool``: a function the model may call, declared by a JSON schema; ``ToolCall`` is one
  parsed call; ``ToolError`` a failure the model reads.
- ``load_env(spec)``: an environment factory from a builtin name or a dotted path.
- ``played_by``: whether the engine writes each turn (``"turns"``) or an external agent plays
  the whole episode (``"agent"``). ``EnvFailure``: an episode cannot go on.

This module knows no engine, no tokenizer and no pool: only the shapes an
environment and its tools speak.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence, runtime_checkable

from conveyor.plugins import resolve
from conveyor.runtime.errors import SetupError
from conveyor.types import Task

# Failure classes counted by the pool (``env/<class>`` metrics); one name per way things fail.
FAILURE_CLASSES = ("timeout", "crash", "malformed_call", "unknown_tool", "bad_arguments",
                   "sandbox_violation", "truncated_observation", "bad_return", "quarantined")


class EnvFailure(Exception):
    """An episode cannot go on: ``kind`` is the failure class, the message names the call."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model turn."""
    observation: str
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from the model's text: the tool's name, its arguments, the text it came from."""
    name: str
    arguments: Mapping[str, Any]
    raw: str = ""


class ToolError(Exception):
    """A tool failure the model reads as an error observation. ``kind`` is its failure class
    (one of ``FAILURE_CLASSES``: ``bad_arguments``, ``sandbox_violation``, ``timeout``, ...)."""

    def __init__(self, message: str, kind: str = "crash"):
        super().__init__(message)
        if kind not in FAILURE_CLASSES:
            raise ValueError(f"ToolError kind {kind!r} is not one of {FAILURE_CLASSES}")
        self.kind = kind


@dataclass(frozen=True)
class Tool:
    """A function the model may call.

    name / description: what the model is shown. parameters: the JSON schema (an ``object``
    schema) of ``fn``'s keyword arguments. fn: ``fn(**arguments) -> str`` (or a coroutine
    function); it raises ``ToolError`` for a failure the model should read. timeout_s: the
    deadline of one call (None: the pool's ``tool_timeout_s``).

    ``Tool``: a function the model may call, declared by a JSON schema of its
    keyword arguments (OpenAI's ``function`` shape, what
    ``tokenizer.apply_chat_template(tools=...)`` renders). ``fn(**arguments)``
    returns the observation text (or awaits it). ``ToolCall`` is one parsed
    call; ``ToolError`` is raised by a tool for a failure the model should
    read (bad arguments, a sandbox violation), with a failure class for the
    pool's counters.
    """
    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., "str | Awaitable[str]"]
    timeout_s: float | None = None

    def schema(self) -> dict[str, Any]:
        """The OpenAI / chat-template form: ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": dict(self.parameters)}}


@runtime_checkable
class Env(Protocol):
    """A multi-turn text environment (methods may be ``async def``).

    - ``Env``: what a Python developer knows from gymnasium, for text.
      ``reset(task) -> observation`` starts an episode (the first observation is
      the text the model reads first; ``""`` or ``None`` means ``task.prompt``);
      ``step(action) -> StepResult`` (or gymnasium's 4-tuple ``(observation,
      reward, done, info)``) answers one model turn. Either method may be
      ``async def``; the pool runs plain ones in a worker thread under a
      deadline. ``close()`` (optional) releases what the instance holds. One
      instance serves one episode at a time and is reused for the next after
      ``reset``. ``tools`` (optional) lists the tools the model is shown.
    - ``StepResult.reward`` is the reward of this turn (a process reward; 0 for
      none); the episode's return is the sum of its turns' rewards.
    """

    def reset(self, task: Task) -> "str | None | Awaitable[str | None]":
        """Start an episode of ``task``; the first observation (None or "": ``task.prompt``)."""
        ...

    def step(self, action: str) -> "StepResult | tuple | Awaitable[StepResult | tuple]":
        """Answer the model's turn ``action``: a ``StepResult`` or ``(observation, reward, done, info)``."""
        ...


def env_tools(env: object) -> Sequence[Tool]:
    """The tools an environment declares (none if it has no ``tools`` attribute)."""
    tools = getattr(env, "tools", None) or ()
    for t in tools:
        if not isinstance(t, Tool):
            raise TypeError(f"{type(env).__name__}.tools holds a {type(t).__name__}, not a conveyor.env.api.Tool")
    return tuple(tools)


def as_step_result(value: Any, where: str) -> StepResult:
    """Normalise what ``step`` returned; raise ``TypeError`` (a ``bad_return``) naming ``where``."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 4:
        obs, reward, done, info = value
        if isinstance(obs, str) and isinstance(reward, (int, float)) and not isinstance(reward, bool) \
                and isinstance(done, (bool, int)) and isinstance(info, Mapping):
            return StepResult(obs, float(reward), bool(done), dict(info))
    raise TypeError(f"{where} returned {type(value).__name__} {str(value)[:80]!r}; return a "
                    "conveyor.env.api.StepResult or a tuple (observation: str, reward: float, done: bool, info: dict)")


PLAY_KINDS = ("turns", "agent")


@dataclass(frozen=True)
class PlayedBy:
    """How an episode of an environment is played: what its factory declares as ``played_by``.

    kind: ``"turns"`` (the engine writes each turn, ``step`` answers it) or ``"agent"`` (an
    ``AgentPlayed``'s ``entry`` plays the whole episode through the OpenAI-compatible endpoint).
    model_kwarg: the keyword argument its factory is given the endpoint's model name by (None: none).

    How an episode is played is the factory's declaration ``played_by``
    (``PlayedBy``; ``played_by(factory, spec)`` reads it, ``TURNS`` when there
    is none): ``"turns"``, the engine writes each turn and ``step`` answers it
    (an ``Env``); ``"agent"``, one call of user code plays the whole episode
    against the OpenAI-compatible endpoint the episode runner serves (an
    ``AgentPlayed``: ``entry(base_url, api_key, task)``, whose return
    ``agent_result`` reads).
    """
    kind: str = "turns"
    model_kwarg: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in PLAY_KINDS:
            raise ValueError(f"PlayedBy(kind={self.kind!r}): choose one of {PLAY_KINDS}")
        if self.model_kwarg is not None and self.kind != "agent":
            raise ValueError(f"PlayedBy(kind={self.kind!r}, model_kwarg=...): only an agent is told the model name")


TURNS = PlayedBy("turns")


def played_by(factory: Any, spec: str) -> PlayedBy:
    """How the episodes of the environments ``factory`` builds are played (``spec``: its ``env.name``)."""
    way = getattr(factory, "played_by", TURNS)  # optional, like ``tools``: an Env need not declare it
    if not isinstance(way, PlayedBy):
        raise SetupError(f"env.name={spec!r} declares played_by={way!r}; declare a conveyor.env.api.PlayedBy "
                         "(or nothing: its turns are played token by token)")
    return way


@runtime_checkable
class AgentPlayed(Protocol):
    """An environment played by an external agent (``played_by.kind == "agent"``): ``name`` says
    which, ``entry(base_url, api_key, task)`` (plain or async) runs the agent against the endpoint
    at ``base_url`` with ``api_key`` and returns what ``agent_result`` reads."""
    name: str
    entry: Callable[..., Any]


@dataclass(frozen=True)
class AgentResult:
    """What an agent returned: ``reward`` (None: the reward function decides) and other numbers."""
    reward: float | None
    info: Mapping[str, float]


def agent_result(value: Any, where: str) -> AgentResult:
    """Read an agent's return: a float (the reward), a dict with ``"reward"`` (its other numbers
    kept as reward components) or None (the configured ``reward.fn`` scores the transcript);
    anything else is an ``EnvFailure("bad_return")`` naming ``where``."""
    if value is None:
        return AgentResult(None, {})
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise EnvFailure("bad_return", f"{where} returned a dict without 'reward' ({sorted(value)[:5]}); "
                                           "return a float, {'reward': float, ...} or None")
        info = {str(k): float(v) for k, v in value.items() if k != "reward" and _real(v)}
        reward = value["reward"]
    else:
        info, reward = {}, value
    if reward is None:
        return AgentResult(None, info)
    if not _real(reward) or not math.isfinite(float(reward)):
        raise EnvFailure("bad_return", f"{where} returned reward {reward!r}; return a finite float, "
                                       "{'reward': float, ...} or None (the reward function decides)")
    return AgentResult(float(reward), info)


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Builtin environments by name (module:attr); anything else is a dotted path.
BUILTIN_ENVS = {
    "tools": "conveyor.env.tool_env:ToolEnv",
    "guess_number": "conveyor.env.games:GuessNumber",
    "textarena": "conveyor.env.ecosystem:TextArenaEnv",
    "agent": "conveyor.env.agent:AgentEnv",
}


def load_env(spec: str) -> Callable[..., Env]:
    """The environment factory named by ``spec`` (a builtin name or ``pkg.module:Factory``).

    ``load_env(spec)`` resolves an environment factory from a builtin name or
    a dotted path (``pkg.module:MyEnv``); the factory is called with the
    recipe's ``env.kwargs`` once per instance.
    """
    return resolve(spec, "env.name", BUILTIN_ENVS)
