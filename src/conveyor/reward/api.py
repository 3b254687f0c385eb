"""The reward contract and the one place a reward is looked up by name.

Contract
- A reward is ``RewardFn = Callable[[Trajectory], float | dict]``. A float is
  the scalar reward. A dict must carry ``"reward"`` (a finite real number);
  its other keys are kept in ``Trajectory.reward_info`` and the numeric ones
  are logged as metrics by whoever reads them.
- ``BatchReward`` is the batched form (reward models, judges, remote servers):
  ``score_batch(trajs)`` returns one float or dict per trajectory.
- ``load_reward(spec, kwargs)`` turns a builtin name (``BUILTIN_REWARDS``) or a
  dotted path ``pkg.module:fn`` into a ``RewardFn``. Non-empty ``kwargs`` are
  bound with ``functools.partial``, so the reward is called as
  ``fn(traj, **kwargs)``; keywords the function does not accept are rejected
  here, at load time, rather than on every call.

This module does not call rewards and knows nothing of threads, timeouts or
failures: ``service.py`` owns all of that. It does not know which reward a
data source wants either (``"auto"`` / ``"task"`` are resolved by the caller).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping, Protocol, Sequence, Union, runtime_checkable

from conveyor.plugins import PluginError, resolve
from conveyor.types import Trajectory

RewardFn = Callable[[Trajectory], Union[float, dict]]


@runtime_checkable
class BatchReward(Protocol):
    """A reward that scores many trajectories in one call: a reward model, a generative judge,
    a remote reward server. ``score_batch`` returns one float or dict (as a ``RewardFn`` does) per
    trajectory, in order; it may raise, and then the whole batch gets the fallback, counted.
    ``max_batch`` bounds one call; ``close`` frees what the reward holds (a model, a process)."""

    name: str
    max_batch: int

    def score_batch(self, trajs: Sequence[Trajectory]) -> list[Union[float, dict]]: ...

    def close(self) -> None: ...

BUILTIN_REWARDS: dict[str, str] = {
    "math": "conveyor.reward.verifiers:math_reward",
    "exact": "conveyor.reward.verifiers:exact_match",
    "format": "conveyor.reward.verifiers:format_reward",
    "env": "conveyor.reward.verifiers:env_return",
}


def load_reward(spec: str, kwargs: Mapping[str, Any] | None = None) -> RewardFn:
    """Resolve ``spec`` and bind ``kwargs``; raises ``PluginError`` on a bad spec or keyword."""
    fn = resolve(spec, "reward", BUILTIN_REWARDS)
    kwargs = dict(kwargs or {})
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


def _check_kwargs(spec: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins / C callables: nothing to check against
        return
    try:
        sig.bind(None, **kwargs)
    except TypeError as e:
        accepted = [p.name for p in list(sig.parameters.values())[1:]
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise PluginError(f"reward {spec!r} does not accept reward.kwargs {sorted(kwargs)} ({e}); "
                          f"accepted keywords: {', '.join(accepted) or 'none'}") from None
