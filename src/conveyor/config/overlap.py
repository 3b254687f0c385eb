"""What may overlap in a step, checked before the run: streamed gradient accumulation
(``loop.accumulate_groups``, synchronous or streaming) and the colocated engine's memory time
sharing (``launch.time_share``, synchronous).

Contract: ``check(cfg)`` raises ``ValueError`` with a one-line fix for a combination that
cannot give the step the loop would take on the whole batch; it changes nothing. ``time_share_on(cfg, device_type)``
resolves ``launch.time_share`` for the device the roles share (auto: on for one native engine
and one trainer in the controller's process on a GPU, at staleness 0; the run then keeps it only
where the trainer's micro-batch does not fit beside the pool, ``trainer/fit.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.config.estimators import estimator, group_estimators

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.config.sections import RunConfig



def check(cfg: RunConfig) -> None:
    k, lc, la = cfg.loop.accumulate_groups, cfg.loop, cfg.launch
    if la.time_share == "on":
        if cfg.rollout.engine != "native" or la.placement != "colocated" or lc.max_staleness > 0:
            raise ValueError("launch.time_share=on releases a colocated native engine's KV pool while a synchronous "
                             f"step trains: it needs rollout.engine=native (got {cfg.rollout.engine}), "
                             f"launch.placement=colocated (got {la.placement}) and loop.max_staleness=0 "
                             f"(got {lc.max_staleness}); or set launch.time_share=off")
    if k == 0:
        if lc.accumulate_sms:
            raise ValueError(f"loop.accumulate_sms={lc.accumulate_sms} confines parts trained beside the engine, "
                             "and loop.accumulate_groups=0 trains none; set loop.accumulate_groups or "
                             "loop.accumulate_sms=0")
        return
    why = None
    if cfg.trainer.ppo_epochs != 1 or cfg.trainer.mini_batches != 1:
        why = (f"trainer.ppo_epochs={cfg.trainer.ppo_epochs} and trainer.mini_batches={cfg.trainer.mini_batches} "
               "change the weights within a step; set both to 1")
    elif not estimator(cfg.algo.advantage).group:
        why = (f"algo.advantage={cfg.algo.advantage} needs the whole batch before any advantage is known; "
               f"use one of {', '.join(group_estimators())}")
    elif cfg.algo.dynamic_sampling or lc.replay.enabled:
        why = "algo.dynamic_sampling and loop.replay decide a step's groups only once all are in; turn them off"
    elif la.trainer_ranks != 1:
        why = f"launch.trainer_ranks={la.trainer_ranks}: parts are trained by one trainer rank; use 1"
    elif k > lc.batch_size:
        why = f"it exceeds loop.batch_size ({lc.batch_size}); lower it"
    if why:
        raise ValueError(f"loop.accumulate_groups={k}: {why}, or set loop.accumulate_groups=0")


def time_share_on(cfg: RunConfig, device_type: str) -> bool:
    """``launch.time_share`` for a run whose colocated roles share a ``device_type`` device."""
    la = cfg.launch
    if la.time_share != "auto":
        return la.time_share == "on"
    return device_type == "cuda" and cfg.rollout.engine == "native" and la.in_process and cfg.loop.max_staleness == 0
