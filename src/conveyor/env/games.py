"""Small built-in games with feedback, for multi-turn RL that runs on a CPU.

Contract: ``GuessNumber(low=1, high=15, turn_penalty=0.0)``: ``reset(task)``
takes the secret from ``task.info["target"]`` (a ``guess`` task of
``data.agentic``) and shows the task's prompt; each ``step(action)`` reads
the first integer of the turn and answers ``"higher"`` or ``"lower"``, or
ends the episode with reward ``1 - turn_penalty * (guesses - 1)`` when it
is right. A turn without a number answers ``"a number"`` (it costs the
turn). The episode's turn budget (``env.max_turns``) bounds the guesses:
an episode that runs out scores 0.

It knows nothing of tokens, engines or the pool.
"""
from __future__ import annotations

import re

from conveyor.env.api import StepResult
from conveyor.types import Task

_INT = re.compile(r"-?\d+")


class GuessNumber:
    def __init__(self, low: int = 1, high: int = 15, turn_penalty: float = 0.0):
        if low >= high:
            raise ValueError(f"GuessNumber: low ({low}) must be below high ({high})")
        self.low, self.high, self.turn_penalty = low, high, turn_penalty
        self.target, self.guesses = low, 0

    def reset(self, task: Task) -> str:
        target = task.info.get("target")
        if not isinstance(target, int) or not self.low <= target <= self.high:
            raise ValueError(f"task {task.id!r}: info['target'] must be an int in [{self.low}, {self.high}]")
        self.target, self.guesses = target, 0
        return task.prompt

    def step(self, action: str) -> StepResult:
        self.guesses += 1
        m = _INT.search(action)
        if m is None:
            return StepResult("a number", 0.0, False, {"valid": False})
        guess = int(m.group())
        if guess == self.target:
            return StepResult("", max(0.0, 1.0 - self.turn_penalty * (self.guesses - 1)), True,
                              {"guesses": self.guesses})
        return StepResult("higher" if guess < self.target else "lower", 0.0, False, {"guesses": self.guesses})
