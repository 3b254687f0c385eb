"""The reward contract and the one place a reward is looked up by name.

- A reward is ``RewardFn = Callable[[Trajectory], float | dict]``: a float, or a dict carrying a
  finite real ``"reward"`` whose other keys are kept in ``Trajectory.reward_info``.
- ``BatchReward`` is the batched form; ``RewardHandle`` the reward service the controller holds.
- ``load_reward(spec, kwargs)``: a builtin name, a dotted path or an ``http://`` server as a
  reward, its keywords checked at load time. ``RewardError``: a reward that cannot be used as
  configured (raised before a run starts); the message names the fix.

This module does not call rewards and knows nothing of threads, timeouts or
failures: ``service.py`` owns all of that. It does not know which reward a
data source wants either (``"auto"`` / ``"task"`` are resolved by the caller).
"""
from __future__ import annotations

import functools
import inspect
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Protocol, Sequence, Union, runtime_checkable

from conveyor.plugins import PluginError, resolve
from conveyor.types import Trajectory

RewardFn = Callable[[Trajectory], Union[float, dict]]


@runtime_checkable
class BatchReward(Protocol):
    """A reward that scores many trajectories in one call: a reward model, a generative judge,
    a remote reward server. ``score_batch`` returns one float or dict (as a ``RewardFn`` does) per
    trajectory, in order; it may raise, and then the whole batch gets the fallback, counted.
    ``max_batch`` bounds one call; ``close`` frees what the reward holds (a model, a process).

    - A reward is ``RewardFn = Callable[[Trajectory], float | dict]``. A float is
      the scalar reward. A dict must carry ``"reward"`` (a finite real number);
      its other keys are kept in ``Trajectory.reward_info`` and the numeric ones
      are logged as metrics by whoever reads them.
    - ``BatchReward`` is the batched form (reward models, judges, remote servers):
      ``score_batch(trajs)`` returns one float or dict per trajectory.
    """

    name: str
    max_batch: int

    def score_batch(self, trajs: Sequence[Trajectory]) -> list[Union[float, dict]]: ...

    def close(self) -> None: ...


class RewardError(RuntimeError):
    """A reward that cannot be used as configured (no sandbox, a remote server that does not
    answer); raised before a run starts, the message names the fix."""


class RewardHandle(Protocol):
    """What the controller holds of the reward role, whichever executor runs it
    (``service.RewardService``: threads; ``processes.ProcessRewardService``: processes).
    ``submit`` returns at once a Future that always resolves, ``score`` is the blocking form in
    order, ``stats`` the counters the loop logs, ``close`` stops taking work."""

    name: str

    def submit(self, traj: Trajectory) -> "Future[Trajectory]": ...

    def score(self, trajs: list[Trajectory], timeout_s: float | None = None) -> list[Trajectory]: ...

    def stats(self) -> dict[str, int]: ...

    def close(self, timeout_s: float | None = None) -> None: ...

    def __enter__(self) -> "RewardHandle": ...

    def __exit__(self, *exc: object) -> None: ...


BUILTIN_REWARDS: dict[str, str] = {
    "math": "conveyor.reward.verifiers:math_reward",
    "exact": "conveyor.reward.verifiers:exact_match",
    "format": "conveyor.reward.verifiers:format_reward",
    "digits": "conveyor.reward.verifiers:number_digits",
    "env": "conveyor.reward.verifiers:env_return",
    "code": "conveyor.reward.code:CodeReward",
}
REMOTE_SCHEMES = ("http://", "https://")


def load_reward(spec: str, kwargs: Mapping[str, Any] | None = None) -> RewardFn:
    """Resolve ``spec`` and bind ``kwargs``; raises ``PluginError`` on a bad spec or keyword.

    ``load_reward(spec, kwargs)`` turns a builtin name (``BUILTIN_REWARDS``) or a
    dotted path ``pkg.module:fn`` into a ``RewardFn``. Non-empty ``kwargs`` are
    bound with ``functools.partial``, so the reward is called as
    ``fn(traj, **kwargs)``; keywords the function does not accept are rejected
    here, at load time, rather than on every call. A spec naming a CLASS (the
    ``code`` reward) is constructed with ``kwargs`` and its instance is the
    reward, so it can check what it needs before a run starts. A spec
    ``http://host:port`` (or https) is a reward served by ``conveyor
    serve-reward``: a ``remote.RemoteReward`` (a ``BatchReward``) built with
    ``kwargs``, after a health check.
    """
    kwargs = dict(kwargs or {})
    if spec.startswith(REMOTE_SCHEMES):
        from conveyor.reward.remote import RemoteReward
        _check_kwargs(spec, RemoteReward, kwargs, filled=1)
        return RemoteReward(spec, **kwargs)  # type: ignore[return-value]
    fn = resolve(spec, "reward", BUILTIN_REWARDS)
    if inspect.isclass(fn):
        _check_kwargs(spec, fn, kwargs, filled=0)
        return fn(**kwargs)
    if not kwargs:
        return fn
    _check_kwargs(spec, fn, kwargs)
    bound = functools.partial(fn, **kwargs)
    # partial objects have no __name__; keep the spec so logs name the reward.
    bound.__name__ = reward_name(fn)  # type: ignore[attr-defined]
    return bound


def reward_name(fn: Callable[..., Any]) -> str:
    """A short human name for logs: the function's qualified name, or its class name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not name:
        return type(fn).__name__
    # A function defined inside another reads better without its enclosing scopes.
    return str(name).rsplit("<locals>.", 1)[-1]


def _check_kwargs(spec: str, fn: Callable[..., Any], kwargs: dict[str, Any], filled: int = 1) -> None:
    """``filled``: leading positional parameters the caller fills (a reward function's trajectory;
    nothing of the ``code`` reward's constructor; a remote reward's URL)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins / C callables: nothing to check against
        return
    try:
        sig.bind(*[None] * filled, **kwargs)
    except TypeError as e:
        accepted = [p.name for p in list(sig.parameters.values())[filled:]
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise PluginError(f"reward {spec!r} does not accept reward.kwargs {sorted(kwargs)} ({e}); "
                          f"accepted keywords: {', '.join(accepted) or 'none'}") from None
