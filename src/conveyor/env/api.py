"""The environment pool's contract: environments, tools, tool calls and what a step returns.

Contract
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
- ``Tool``: a function the model may call, declared by a JSON schema of its
  keyword arguments (OpenAI's ``function`` shape, what
  ``tokenizer.apply_chat_template(tools=...)`` renders). ``fn(**arguments)``
  returns the observation text (or awaits it). ``ToolCall`` is one parsed
  call; ``ToolError`` is raised by a tool for a failure the model should
  read (bad arguments, a sandbox violation), with a failure class for the
  pool's counters.
- ``load_env(spec)`` resolves an environment factory from a builtin name or
  a dotted path (``pkg.module:MyEnv``); the factory is called with the
  recipe's ``env.kwargs`` once per instance.

This module knows no engine, no tokenizer and no pool: only the shapes an
environment and its tools speak.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence, runtime_checkable

from conveyor.plugins import resolve
from conveyor.types import Task

# Failure classes counted by the pool (``env/<class>`` metrics); one name per way things fail.
FAILURE_CLASSES = ("timeout", "crash", "malformed_call", "unknown_tool", "bad_arguments",
                   "sandbox_violation", "truncated_observation", "bad_return", "quarantined")


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
    deadline of one call (None: the pool's ``tool_timeout_s``)."""
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
    """A multi-turn text environment (methods may be ``async def``)."""

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


# Builtin environments by name (module:attr); anything else is a dotted path.
BUILTIN_ENVS = {
    "tools": "conveyor.env.tool_env:ToolEnv",
    "guess_number": "conveyor.env.games:GuessNumber",
    "textarena": "conveyor.env.ecosystem:TextArenaEnv",
    "agent": "conveyor.env.agent:AgentEnv",
}


def load_env(spec: str) -> Callable[..., Env]:
    """The environment factory named by ``spec`` (a builtin name or ``pkg.module:Factory``)."""
    return resolve(spec, "env.name", BUILTIN_ENVS)
