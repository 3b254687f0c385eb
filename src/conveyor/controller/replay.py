"""Trajectory reuse: a store of recent high-signal groups that later steps train on again.

Contract
- ``ReplayStore(cfg, batch_size, seed)`` (``cfg``: ``loop.replay``). Once per
  training step, ``mix(fresh, step)`` returns a ``Mix``: the step's fresh
  groups (unchanged, in admission order) and up to
  ``cfg.per_step(batch_size)`` replayed groups drawn from the store, then
  offers the fresh groups to the store. ``step`` is the 0-based loop step,
  i.e. the version of the policy being trained; calls come in step order.
- A group is stored only when its rewards are not all equal (a group of equal
  rewards has zero group-relative advantage: nothing to learn from it) and
  only while it can still be replayed. Its age at ``step`` is ``step - v``
  with ``v`` the oldest policy version among its tokens (the staleness rule's
  measure); it may be replayed while that age is at most ``cfg.max_age``, so
  ``max_age`` 0 never replays, and at most ``cfg.max_uses`` times; it is
  never replayed in the step that trains it fresh.
- Draw order: the largest reward spread (population standard deviation of
  the group's rewards, the spread of its Dr.GRPO advantages) first, then the
  youngest, then a tie-break drawn from ``seed`` when the group was stored:
  the same fresh groups give the same draws. Past ``cfg.capacity`` the
  lowest spread (then the oldest) is evicted.
- ``Mix.metrics()``: ``replay/groups``, ``replay/samples``,
  ``replay/store_size`` every step; ``replay/age_mean``, ``replay/age_max``
  and ``replay/reward`` when something was replayed; and ``reward``,
  ``reward_std``, ``groups_without_signal`` of the FRESH groups (what was
  generated this step; the batch's own numbers would count replays).

A replayed group carries its trajectories untouched: behaviour logprobs and
versions of the policy that sampled it, so the loss's behaviour weight
(decoupled PPO or truncated importance sampling, required by ``RunConfig``)
corrects it like a stale streaming sample; its advantages are recomputed with
the step's batch. It knows nothing of the trainer, the loss or the buffer.
"""
from __future__ import annotations

import random
import statistics
import threading
from dataclasses import dataclass, field

import torch

from conveyor.config.replay import ReplayConfig
from conveyor.types import Group


def oldest_version(group: Group) -> int:
    """The oldest policy version among the group's own tokens (-1 if it has none)."""
    versions = [t.min_version for t in group.trajectories if t.min_version >= 0]
    return min(versions) if versions else -1


def spread(group: Group) -> float:
    """Population standard deviation of the group's rewards: 0 for a group without signal."""
    rewards = group.rewards
    return statistics.pstdev(rewards) if len(rewards) > 1 else 0.0


@dataclass
class _Entry:
    group: Group
    version: int
    spread: float
    tiebreak: float
    seq: int
    uses: int = 0

    def key(self) -> tuple[float, int, float]:  # smaller draws first
        return (-self.spread, -self.version, self.tiebreak)


@dataclass(frozen=True)
class Replayed:
    """One group trained again: ``age`` in versions at the step that replays it, ``use`` counts from 1."""
    group: Group
    age: int
    use: int


@dataclass(frozen=True)
class Mix:
    """What one step trains: its fresh groups, then the replayed ones; ``store_size`` after the step."""
    fresh: list[Group]
    replayed: list[Replayed] = field(default_factory=list)
    store_size: int = 0

    @property
    def groups(self) -> list[Group]:
        return self.fresh + [r.group for r in self.replayed]

    def metrics(self) -> dict[str, float]:
        # as objective.make_batch computes them over a batch (float32), so that a step without
        # replays reports exactly what it would without a store
        fresh = torch.tensor([t.reward for g in self.fresh for t in g.trajectories], dtype=torch.float32)
        out = {"replay/groups": float(len(self.replayed)), "replay/store_size": float(self.store_size),
               "replay/samples": float(sum(len(r.group.trajectories) for r in self.replayed)),
               "reward": float(fresh.mean()) if len(fresh) else 0.0,
               "reward_std": float(fresh.std()) if len(fresh) > 1 else 0.0,
               "groups_without_signal": sum(spread(g) == 0 for g in self.fresh) / max(len(self.fresh), 1)}
        if self.replayed:
            ages = [r.age for r in self.replayed for _ in r.group.trajectories]  # per sample
            out["replay/age_mean"] = statistics.fmean(ages)
            out["replay/age_max"] = float(max(ages))
            out["replay/reward"] = statistics.fmean(t.reward for r in self.replayed for t in r.group.trajectories)
        return out


class ReplayStore:
    """The groups that may still be replayed (see the module docstring); thread-safe, one call per step."""

    def __init__(self, cfg: ReplayConfig, batch_size: int, seed: int = 0):
        self.cfg = cfg
        self.per_step = cfg.per_step(batch_size)
        self._rng = random.Random(seed)
        self._entries: list[_Entry] = []
        self._seq = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def mix(self, fresh: list[Group], step: int) -> Mix:
        with self._lock:
            replayed = self._draw(step)
            self._add(fresh, step)
            return Mix(list(fresh), replayed, len(self._entries))

    def _draw(self, step: int) -> list[Replayed]:
        self._entries = [e for e in self._entries if step - e.version <= self.cfg.max_age]  # expired
        chosen = sorted(self._entries, key=_Entry.key)[: self.per_step]
        out = []
        for e in chosen:
            e.uses += 1
            out.append(Replayed(e.group, step - e.version, e.uses))
        self._entries = [e for e in self._entries if e.uses < self.cfg.max_uses]
        return out

    def _add(self, groups: list[Group], step: int) -> None:
        for g in groups:
            version, s = oldest_version(g), spread(g)
            # stored only if it has signal and could still be replayed at the next step
            if s > 0 and version >= 0 and step + 1 - version <= self.cfg.max_age:
                self._entries.append(_Entry(g, version, s, self._rng.random(), self._seq))
                self._seq += 1
        if len(self._entries) > self.cfg.capacity:  # keep the highest spread, then the youngest
            self._entries.sort(key=lambda e: (-e.spread, -e.version, -e.seq))
            del self._entries[self.cfg.capacity:]
