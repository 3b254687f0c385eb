"""Which reward a run scores with, and which executor runs it (``reward.executor``).

- ``RewardSpec(fn, kwargs, parts)``: what to load, as plain strings and numbers (a worker
  process loads it; the loaded reward never crosses). ``reward_spec`` / ``model_spec`` make one.
- ``reward_service(cfg, spec, reward=None, launch=None)`` starts the ``thread`` or ``process``
  executor's service, an ``api.RewardHandle``; ``ray`` is the Ray launcher's
  (``launch.ray_rewards.ray_reward_service``) and here a ``ValueError`` that says so.

It knows nothing of how a reward computes, nor of the run that uses it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor.reward.api import RewardFn, RewardHandle, load_reward
from conveyor.reward.compose import Composite, Part, composite_name, part_name, parts_of

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.config import LaunchConfig, RewardConfig


MODEL_REWARD = "conveyor.reward.model:RewardModel"  # a class: load_reward constructs it with the kwargs


@dataclass(frozen=True)
class RewardSpec:
    """``RewardSpec(fn, kwargs, parts)`` is what to load: a reward's spec and
    kwargs (``api.load_reward``), or, when ``parts`` is non-empty, the
    components of a ``compose.Composite``. ``load()`` builds the ``RewardFn``;
    a reward worker process calls it, so only these strings and numbers cross
    to it, never the loaded reward.
    """
    fn: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    parts: tuple[Part, ...] = ()

    @property
    def name(self) -> str:
        """A name for logs, before anything is loaded."""
        return composite_name(self.parts) if self.parts else part_name(self.fn)

    def load(self) -> RewardFn:
        return Composite(self.parts) if self.parts else load_reward(self.fn, self.kwargs)


def reward_spec(cfg: RewardConfig, default_fn: str) -> RewardSpec:
    """``reward_spec(cfg, default_fn)``: the spec of a ``RewardConfig``:
    ``reward.components`` when given, else ``reward.fn`` (``auto``:
    ``default_fn``, what the task source or environment asks for).
    """
    if cfg.components:
        return RewardSpec("compose", parts=parts_of(cfg.components))
    return RewardSpec(default_fn if cfg.fn == "auto" else cfg.fn, dict(cfg.kwargs))


def model_spec(cfg: RewardConfig, device: str) -> RewardSpec:
    """``model_spec(cfg, device)``: the spec of ``reward.fn: rm`` that a worker
    process builds its own ``model.RewardModel`` from (the checkpoint path,
    ``device``, ``max_batch`` and ``normalize``, as plain values).
    """
    return RewardSpec(MODEL_REWARD, {"path": str(cfg.model), "device": device, "max_batch": cfg.max_batch,
                                     "normalize": cfg.normalize})


def reward_service(cfg: RewardConfig, spec: RewardSpec, reward: Any = None,
                   launch: LaunchConfig | None = None) -> RewardHandle:
    """``reward_service(cfg, spec, reward=None, launch=None)`` starts the service:
    executor ``thread`` -> ``service.RewardService`` over ``reward`` (an already
    built reward, such as a reward model) or ``spec.load()``; ``process`` ->
    ``processes.ProcessRewardService(spec)``, whose workers load the reward
    themselves (a ``BatchReward``, such as a reward model, scores batches
    there) and report a reward that cannot load as ``PluginError`` before the
    run starts. Both are an ``api.RewardHandle``. ``ray`` (those workers as Ray
    actors) is a piece of the Ray launcher, above the roles:
    ``launch.ray_rewards.ray_reward_service``, which the run calls instead; here
    it is a ``ValueError`` that says so.
    """
    if cfg.executor == "ray":  # worker processes as Ray actors: the Ray launcher places them
        raise ValueError("reward.executor=ray: the reward workers are Ray actors, which the Ray launcher starts "
                         "(conveyor.launch.ray_rewards.ray_reward_service, with launch.backend=ray)")
    if cfg.executor == "process":
        from conveyor.reward.processes import ProcessRewardService
        return ProcessRewardService(spec, timeout_s=cfg.timeout_s, fallback=cfg.fallback, workers=cfg.workers,
                                    max_restarts=cfg.max_restarts, batch_wait_s=cfg.batch_wait_ms / 1e3)
    from conveyor.reward.service import RewardService
    return RewardService(spec.load() if reward is None else reward, timeout_s=cfg.timeout_s,
                         fallback=cfg.fallback, workers=cfg.workers, batch_wait_s=cfg.batch_wait_ms / 1e3)
