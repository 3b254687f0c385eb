"""External agents as environments (``env.name: agent``): the user's agent plays an episode through an endpoint.

- ``AgentEnv(agent="pkg.mod:fn")`` or ``AgentEnv(command=[...])``: a function called with the
  endpoint's ``base_url`` and ``api_key``, or a program started with them in ``OPENAI_*``
  environment variables (killed with its process group on a deadline).
- It declares ``played_by = PlayedBy("agent", ...)``: the episode runner serves the endpoint and
  reads what ``entry`` returns (a reward, a dict, or None: ``reward.fn`` scores the transcript).

It knows no tokens, engines or HTTP server: it starts agents and hands
back what they return.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
from typing import Any, Callable, Mapping, Sequence

from conveyor.env.api import EnvFailure, PlayedBy
from conveyor.plugins import resolve
from conveyor.types import Task

_OUTPUT_KEPT = 64 * 1024  # bytes of an agent program's stdout / stderr kept (its last ones)


class AgentEnv:
    """- ``AgentEnv(agent="pkg.mod:fn")`` (or the function itself, from Python) or
      ``AgentEnv(command=["prog", "arg"])`` (exactly one; ``env.kwargs``):
      - a function ``async def fn(base_url: str, api_key: str, task: Task) ->
        float | dict | None`` (a plain ``def`` runs in the pool's threads) runs its
        agent with any OpenAI client pointed at ``base_url`` with ``api_key``;
      - a program is started with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and
        ``OPENAI_MODEL`` in its environment (plus ``env`` and ``cwd`` when
        given) and the task as one JSON object on stdin (``id``, ``prompt``,
        ``answer``, ``info``); its reward is the last line of its stdout that is
        JSON (a number, an object with ``"reward"``, or ``null``); an exit code
        other than 0 is a crash (its stderr's last lines in the message). On a
        deadline or cancellation its whole process group is killed.
    - ``entry`` is what the pool calls under the episode deadline
      (``EnvPool.call``): the function, or the program's runner (async).
    - It declares ``played_by = PlayedBy("agent", model_kwarg="model")``
      (``env.api``): the episode runner serves the endpoint, passes its model
      name as ``model`` and reads what ``entry`` returns with
      ``env.api.agent_result``: a float (the reward), a dict with ``"reward"``
      (its other numbers are kept as reward components), or None (the
      configured ``reward.fn`` scores the transcript).
    """
    played_by = PlayedBy("agent", model_kwarg="model")

    def __init__(self, agent: str | Callable | None = None, command: str | Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | None = None, model: str = "policy"):
        if (agent is None) == (command is None):
            raise ValueError("env.name=agent needs exactly one of env.kwargs.agent (a function, pkg.module:fn) "
                             "or env.kwargs.command (a program and its arguments)")
        self.model = model
        if agent is not None:
            fn = resolve(agent, "env.kwargs.agent") if isinstance(agent, str) else agent
            name = agent if isinstance(agent, str) else getattr(agent, "__qualname__", type(agent).__name__)
            _check_signature(fn, name)
            self.name, self.entry = name, fn
        else:
            argv = [command] if isinstance(command, str) else list(command or [])
            if not argv or not all(isinstance(a, str) and a for a in argv):
                raise ValueError(f"env.kwargs.command={command!r}: give the program and its arguments as a list "
                                 "of strings")
            self.argv, self.extra_env, self.cwd = argv, dict(env or {}), cwd
            self.name, self.entry = argv[0], self._program

    async def _program(self, base_url: str, api_key: str, task: Task) -> Any:
        environ = {**os.environ, **self.extra_env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
                   "OPENAI_MODEL": self.model}
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=environ, cwd=self.cwd, start_new_session=True)
        except OSError as e:
            raise EnvFailure("crash", f"agent program {self.argv[0]!r} cannot start: {e}") from None
        task_json = json.dumps({"id": task.id, "prompt": task.prompt, "answer": task.answer,
                                "info": dict(task.info)}, default=str)
        try:
            out, err = await proc.communicate(task_json.encode() + b"\n")
        except BaseException:
            _kill_group(proc)  # a deadline (cancellation) or any error: no agent outlives its episode
            await _reap(proc)
            raise
        if proc.returncode != 0:
            tail = " | ".join(err[-_OUTPUT_KEPT:].decode(errors="replace").strip().splitlines()[-3:])
            raise EnvFailure("crash", f"agent program {self.argv[0]!r} exited with code {proc.returncode}"
                                      + (f": {tail}" if tail else ""))
        return _last_json(out[-_OUTPUT_KEPT:].decode(errors="replace"))

    def close(self) -> None:
        """Nothing held between episodes: each one starts its agent afresh."""


def _check_signature(fn: Callable, spec: str) -> None:
    try:
        inspect.signature(fn).bind("base_url", "api_key", "task")
    except TypeError:
        raise ValueError(f"env.kwargs.agent={spec!r} cannot be called as fn(base_url, api_key, task); give "
                         "async def fn(base_url: str, api_key: str, task: Task) -> float | dict | None") from None
    except ValueError:  # builtins without a signature: nothing to check
        return


def _last_json(text: str) -> Any:
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None  # no reward printed: the reward function scores the transcript


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


async def _reap(proc: asyncio.subprocess.Process) -> None:
    try:
        await asyncio.shield(asyncio.wait_for(proc.wait(), 5.0))
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass
