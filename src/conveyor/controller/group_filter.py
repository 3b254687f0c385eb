"""DAPO's group shaping: the soft overlong penalty, overlong filtering and dynamic sampling.

Contract
- ``GroupFilter.from_config(cfg)`` returns None when none of it is on (the
  producer then takes its usual path), else a filter the producer calls once
  per scored group, on its own thread: ``review(index, group)`` gives the
  group back with the soft overlong penalty added to each reward (the
  penalty also in ``reward_info["overlong_penalty"]``), or None when dynamic
  sampling drops it. A group is dropped when its rewards are all alike (every
  advantage of a group estimator would be 0) or, with overlong filtering,
  when every sample of it is masked out: it carries no learning signal. The
  producer then gives the group's slot a new task, so the slot keeps its
  place in the schedule and admission and staleness go on as if it had been
  kept; nothing waits for a whole batch to be redrawn.
- The draws of a training step are bounded: slot ``index`` belongs to step
  ``index // batch_size``, and a step that would draw more than
  ``algo.max_draws_per_step * loop.batch_size`` groups stops the run with
  ``NoLearningSignal`` (``runtime.errors``; named, with the counts and the fix) instead of
  sampling forever. ``take_stats()`` gives the groups kept and dropped since
  its last call and the dropped fraction (the loop logs them each step);
  ``dropped_total`` counts the whole run. Reading the stats is thread-safe.
- ``mask_overlong(batch, trajectories)`` is overlong filtering at batch
  building: a sample that hit ``rollout.max_new_tokens`` without ending
  (``finish_reason == "length"``) keeps its reward in its group's baseline
  but gets loss mask 0, so its tokens teach nothing.

The formulas (DAPO, Yu et al. 2025): with budget L = ``rollout.max_new_tokens``
and buffer C = ``algo.overlong_buffer``, a completion of length l loses
``overlong_penalty * min(1, (l - (L - C)) / C)`` reward when l > L - C, and
nothing otherwise. It knows nothing of engines, the buffer or the trainer.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from conveyor.config import RunConfig
from conveyor.runtime.errors import NoLearningSignal
from conveyor.types import Batch, Group, Trajectory


@dataclass(frozen=True)
class FilterStats:
    """Groups reviewed since the last ``take_stats``: kept, dropped, and the dropped fraction."""
    kept: int
    dropped: int

    def metrics(self) -> dict[str, float]:
        seen = self.kept + self.dropped
        return {"dynamic_sampling/kept": float(self.kept), "dynamic_sampling/dropped": float(self.dropped),
                "dynamic_sampling/drop_frac": self.dropped / seen if seen else 0.0}


def overlong_penalty(length: int, budget: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens (<= 0)."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -factor * min(1.0, (length - (budget - buffer)) / buffer)


def has_signal(group: Group, masked: bool) -> bool:
    """Whether a group can move the policy: its rewards differ, and (with overlong filtering,
    ``masked``) some sample of it keeps its tokens."""
    if len(set(group.rewards)) < 2:
        return False
    return not masked or any(t.finish_reason != "length" for t in group.trajectories)


def mask_overlong(batch: Batch, trajs: list[Trajectory]) -> Batch:
    """The batch with loss mask 0 on every sample that ran into the token budget."""
    masks = [torch.zeros_like(m) if t.finish_reason == "length" else m for m, t in zip(batch.loss_mask, trajs)]
    return replace(batch, loss_mask=masks)


class GroupFilter:
    def __init__(self, *, batch_size: int, budget: int, dynamic_sampling: bool, max_draws_per_step: int,
                 overlong_filter: bool, overlong_buffer: int, overlong_factor: float):
        self.batch_size, self.budget = batch_size, budget
        self.dynamic_sampling, self.max_draws = dynamic_sampling, max_draws_per_step * batch_size
        self.overlong_filter, self.overlong_buffer, self.overlong_factor = (overlong_filter, overlong_buffer,
                                                                            overlong_factor)
        self._draws: dict[int, int] = {}  # step -> groups drawn for its slots (first draws included)
        self._in_a_row = 0
        self._lock = threading.Lock()
        self._kept = self._dropped = 0
        self.dropped_total = 0

    @classmethod
    def from_config(cls, cfg: RunConfig) -> GroupFilter | None:
        a = cfg.algo
        if not (a.dynamic_sampling or a.overlong_buffer > 0):
            return None  # overlong filtering alone acts at batch building (objective.make_batch)
        return cls(batch_size=cfg.loop.batch_size, budget=cfg.rollout.max_new_tokens,
                   dynamic_sampling=a.dynamic_sampling, max_draws_per_step=a.max_draws_per_step,
                   overlong_filter=a.overlong_filter, overlong_buffer=a.overlong_buffer,
                   overlong_factor=a.overlong_penalty)

    def review(self, index: int, group: Group) -> Group | None:
        """The group to buffer (rewards shaped), or None: dropped, its slot to be drawn again."""
        group = self._shaped(group)
        if not self.dynamic_sampling or has_signal(group, self.overlong_filter):
            with self._lock:
                self._kept += 1
            self._in_a_row = 0
            return group
        step = index // self.batch_size
        drawn = self._draws.get(step, self.batch_size)
        self._in_a_row += 1
        if drawn >= self.max_draws:
            raise NoLearningSignal(
                f"dynamic sampling: step {step + 1} drew {drawn} groups (algo.max_draws_per_step="
                f"{self.max_draws // self.batch_size} x loop.batch_size={self.batch_size}) and the last "
                f"{self._in_a_row} in a row all scored alike, so its batch cannot be filled: the task is solved "
                "or too hard for the model; raise algo.max_draws_per_step, change the data, or set "
                "algo.dynamic_sampling=false")
        self._draws[step] = drawn + 1
        for old in [s for s in self._draws if s < step - 64]:  # steps long trained
            del self._draws[old]
        with self._lock:
            self._dropped += 1
            self.dropped_total += 1
        return None

    def take_stats(self) -> FilterStats:
        with self._lock:
            out = FilterStats(self._kept, self._dropped)
            self._kept = self._dropped = 0
        return out

    def _shaped(self, group: Group) -> Group:
        if self.overlong_buffer <= 0:
            return group
        shaped = []
        for t in group.trajectories:
            pen = overlong_penalty(len(t.completion_ids), self.budget, self.overlong_buffer, self.overlong_factor)
            shaped.append(t.with_reward(t.reward + pen, {**t.reward_info, "overlong_penalty": pen}))
        return Group(group.task, tuple(shaped))
