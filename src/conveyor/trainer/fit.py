"""Whether the trainer's micro-batches fit the GPU memory they will get, checked before the first step.

Contract: ``check_micro_batches(trainer, cfg, length, memory)`` runs one forward and backward
of a micro-batch of ``trainer.micro_batch_tokens`` tokens (rows of ``length`` tokens, the
longest a sample can be) through ``trainer.fits`` with the colocated engine's KV pool
released (``memory``, launch.time_share), as the steps will, and, with
``loop.accumulate_groups``, one of ``trainer.micro_batch_tokens_shared`` beside the held pool.
A budget that runs out of memory is refused with ``ConfigError``: one line naming the field,
the memory situation, and the largest halving of the budget that did fit (or that none did).
Nothing changes in the model: the probe's gradients are dropped. On CPU nothing is checked
(``fits`` is always true there). ``largest_fitting(budget, fits)`` is the search.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from conveyor.config.base import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.config import RunConfig
    from conveyor.controller.accumulate import EngineMemory
    from conveyor.trainer.api import TrainerHandle


def largest_fitting(budget: int, fits: Callable[[int], bool], floor: int = 256) -> int | None:
    """The budget itself if it fits, else the largest of budget / 2, / 4, ... (not below ``floor``)
    that does; None when none does."""
    tokens = budget
    while tokens >= min(floor, budget):
        if fits(tokens):
            return tokens
        tokens //= 2
    return None


def check_micro_batches(trainer: TrainerHandle, cfg: RunConfig, length: int,
                        memory: EngineMemory | None) -> None:
    tc = cfg.trainer
    probes = []
    if cfg.loop.accumulate_groups and memory is not None:
        probes.append(("trainer.micro_batch_tokens_shared", tc.micro_batch_tokens_shared or tc.micro_batch_tokens,
                       "beside the engine's KV pool"))
    probes.append(("trainer.micro_batch_tokens", tc.micro_batch_tokens,
                   "with the engine's KV pool released" if memory is not None else "beside the engine's KV pool"))
    for field, budget, where in probes:
        released = memory is not None and field == "trainer.micro_batch_tokens"
        if released:
            memory.release()
        try:
            fits = largest_fitting(budget, lambda tokens: trainer.fits(tokens, length))
        finally:
            if released:
                memory.reacquire()
        if fits == budget:
            continue
        hint = f"set {field}={fits}" if fits else "no smaller budget fit either: lower rollout.kv_fraction"
        raise ConfigError(f"{field}={budget} does not fit the trainer's GPU memory {where} (a micro-batch of "
                          f"{budget} tokens in rows of {length} ran out of memory); {hint}"
                          + ("" if memory is not None or not fits else ", or set launch.time_share=on"))
