"""Built-in multi-turn task families with scripted teachers, for agentic RL on a CPU.

Contract: ``agentic_source(name, split, options, eval_size, seed)`` returns a
task source like ``data.synthetic``'s (disjoint seeded splits, the gold
answer in ``Task.answer``) for an environment to play, plus ``teacher(task,
transcript, rng)``: the next action of a scripted teacher given the
episode's text so far (the prompt, every turn and observation), what the
warm start imitates (``run.sft``). Families: ``multiply`` (env ``tools``) and ``guess`` (env
``guess_number``); ``agentic_source`` describes them and their teachers.

It knows nothing of tokenizers, engines or the pool: text in, text out.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from conveyor.types import Task

AGENTIC_TASKS = ("multiply", "guess")
_FEEDBACK = re.compile(r"(-?\d+)\D*?(higher|lower)")


@dataclass
class AgenticSource:
    name: str
    tasks: list[Task]
    options: dict
    default_reward: str = "env"
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def demonstration(self, task: Task, rng: random.Random) -> None:
        return None  # multi-turn: the warm start plays episodes with ``teacher``

    def teacher(self, task: Task, transcript: str, rng: random.Random) -> str:
        if self.name == "multiply":
            return _multiply_teacher(task, transcript, rng, float(self.options.get("teacher_error", 0.0)))
        return _guess_teacher(task, transcript, rng, str(self.options.get("teacher", "random")))


def _multiply_teacher(task: Task, transcript: str, rng: random.Random, error: float) -> str:
    after = transcript[len(task.prompt):]
    if "calculator" not in after:
        if error and rng.random() < error:  # answers without the tool: a guess of the right length
            n = len(task.answer or "1")
            return str(rng.randint(10 ** (n - 1), 10 ** n - 1))
        return f"calculator({task.prompt.rstrip('=')})"
    numbers = re.findall(r"-?\d+", after.rsplit("calculator", 1)[1])
    return numbers[-1] if numbers else ""


def _guess_teacher(task: Task, transcript: str, rng: random.Random, mode: str) -> str:
    low, high = task.info["low"], task.info["high"]
    for guess, hint in _FEEDBACK.findall(transcript[len(task.prompt):]):
        if hint == "higher":
            low = max(low, int(guess) + 1)
        else:
            high = min(high, int(guess) - 1)
    if high < low:
        low, high = high, low
    return str((low + high) // 2 if mode == "bisect" else rng.randint(low, high))


def _make(name: str, rng: random.Random, options: dict) -> tuple[str, str, dict]:
    if name == "multiply":
        d = int(options.get("digits", 3))
        a, b = rng.randint(10 ** (d - 1), 10 ** d - 1), rng.randint(10 ** (d - 1), 10 ** d - 1)
        return f"{a}*{b}=", str(a * b), {}
    low, high = int(options.get("low", 1)), int(options.get("high", 15))
    target = rng.randint(low, high)
    return f"guess {low}-{high}:", str(target), {"target": target, "low": low, "high": high}


def agentic_source(name: str, split: str, options: dict | None = None, eval_size: int = 256,
                   seed: int = 0) -> AgenticSource:
    """Seeded tasks; the first ``eval_size`` are the eval split. ``multiply`` keeps prompts
    distinct across splits; ``guess`` has few secrets, so its splits share them (the seeds of
    sampling differ) and it is the policy, not a memorised answer, that is evaluated.

    Families
    - ``multiply`` (env ``tools`` with the calculator): ``"123*456="`` ->
      ``"56088"``; ``digits`` per factor (default 3). A model this small cannot
      multiply; the teacher calls ``calculator(123*456)`` and then copies the
      result, except with probability ``teacher_error`` it answers at once with
      a guess of the right length (almost always wrong): imitation learns both
      habits, RL learns from the reward which one pays.
    - ``guess`` (env ``guess_number``): ``"guess 1-15:"`` with the secret in
      ``info["target"]``; the teacher guesses uniformly among the numbers its
      feedback still allows (``teacher="random"``, default) or bisects
      (``teacher="bisect"``). Random consistent guessing needs more turns than
      the budget allows on many secrets; bisection never does.
    """
    if name not in AGENTIC_TASKS:
        raise ValueError(f"unknown agentic task {name!r}; choose one of {', '.join(AGENTIC_TASKS)}")
    options = dict(options or {})
    if not 0.0 <= float(options.get("teacher_error", 0.0)) <= 1.0:
        raise ValueError(f"data.options.teacher_error must be in [0, 1], got {options['teacher_error']}")
    train_size = int(options.get("train_size", 20000))
    rng = random.Random(f"{name}-{seed}")
    items: list[tuple[str, str, dict]] = []
    seen: set[str] = set()
    for _ in range((eval_size + train_size) * 3):
        if len(items) >= eval_size + train_size:
            break
        prompt, answer, info = _make(name, rng, options)
        if name == "multiply" and prompt in seen:
            continue
        seen.add(prompt)
        items.append((prompt, answer, info))
    part = items[:eval_size] if split == "eval" else items[eval_size:]
    tasks = [Task(id=f"{name}-{split}-{i}", prompt=p, answer=a, info={"task": name, **info})
             for i, (p, a, info) in enumerate(part)]
    return AgenticSource(name, tasks, options)
