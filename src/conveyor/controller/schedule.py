"""Which places of the rollout schedule a run has trained: what a checkpoint saves so that a
resumed run trains every group once.

Contract: the producer numbers each group by its place in the schedule (``Scored.index``):
place i belongs to step ``i // batch_size``'s admission and draws the i-th servable task after
the data position of that step's boundary. A streaming run trains groups in the order they are
scored, so when step S ends some places below ``S * batch_size`` may still be in flight and
some above it already trained. ``Ledger(batch_size)`` records the places each step trained
(``trained(indices)``); ``resume_point()`` is a ``ResumePoint``: ``boundary``, the step
boundary at or below the first place not trained yet, and ``done``, the places from that
boundary on that are trained. A resumed producer draws from the data position of ``boundary``
again and skips the places in ``done``; ``Ledger.resumed(point)`` goes on from there.
``ResumePoint.to_json()`` / ``from_json(data, step, batch_size)`` is its form in a checkpoint
(``schedule``); a checkpoint without one resumes at its own step's boundary. Synchronous runs
train each step's own places, so their point is always their step's boundary with nothing done.

It knows nothing of tasks, engines or training.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed producer starts: the step ``boundary`` (its first place is
    ``boundary * batch_size``) and the places from there on that were trained (``done``)."""
    boundary: int
    batch_size: int
    done: tuple[int, ...] = ()

    @property
    def start(self) -> int:
        return self.boundary * self.batch_size

    def to_json(self) -> dict[str, Any]:
        return {"boundary": self.boundary, "batch_size": self.batch_size, "done": list(self.done)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None, step: int, batch_size: int) -> ResumePoint:
        """A checkpoint's ``schedule`` (None: one saved before it was recorded: ``step``'s
        boundary). A run resumed with another ``loop.batch_size`` cannot skip by place and
        starts at its step's boundary."""
        if not data or int(data.get("batch_size", -1)) != batch_size:
            return cls(step, batch_size)
        return cls(int(data["boundary"]), batch_size, tuple(sorted(int(i) for i in data["done"])))


@dataclass
class Ledger:
    """The places trained so far: all below ``low``, and those in ``above``."""
    batch_size: int
    low: int = 0
    above: set[int] = field(default_factory=set)

    @classmethod
    def resumed(cls, point: ResumePoint) -> Ledger:
        ledger = cls(point.batch_size, point.start)
        ledger.trained(point.done)
        return ledger

    def trained(self, indices) -> None:
        self.above.update(i for i in indices if i >= self.low)
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1

    def resume_point(self) -> ResumePoint:
        boundary = self.low // self.batch_size
        done = (*range(boundary * self.batch_size, self.low), *sorted(self.above))
        return ResumePoint(boundary, self.batch_size, done)
