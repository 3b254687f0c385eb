"""Supervised warm-start: teach the policy the task's answer format before RL.

Contract: ``warm_start(trainer, batch_of, source, steps, ...)`` runs up to
``steps`` optimizer steps of next-token NLL on demonstrations (single-turn:
prompt + reference answer + EOS, loss only on the answer and EOS;
multi-turn: episodes a teacher played, loss only on the teacher's turns)
through the ordinary ``Trainer``, with
batches drawn by a seeded RNG, stopping early when the caller's ``check``
says the policy is good enough ("warm-start if needed": how long a short
supervised phase must run to teach the format varies a lot between seeds). It knows
nothing of rewards, engines or evaluation; the caller evaluates before and
after.
"""
from __future__ import annotations

import random

import torch

from conveyor.controller.objective import sft_loss
from conveyor.types import Batch, Task


def sft_batch(tokenizer, tasks: list[Task], add_special_tokens: bool = False,
              answers: list[str | None] | None = None) -> Batch:
    """Prompt + answer + EOS with the loss on answer and EOS; ``answers`` default to the tasks' own."""
    ids, masks = [], []
    for t, answer in zip(tasks, answers or [t.answer for t in tasks]):
        if answer is None:
            raise ValueError(f"task {t.id!r} has no answer; the warm-start needs reference answers "
                             "(set sft.steps=0 to skip it)")
        p = tokenizer(t.prompt, add_special_tokens=add_special_tokens)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids.append(torch.tensor(p + a, dtype=torch.long))
        masks.append(torch.tensor([0.0] * len(p) + [1.0] * len(a)))
    return Batch(ids, masks, {})


def demonstration_batches(tokenizer, source, add_special_tokens: bool = False):
    """The single-turn batch builder: each task's demonstration (``source.demonstration``)."""
    def batch_of(tasks: list[Task], rng: random.Random) -> Batch:
        answers = [source.demonstration(t, rng) for t in tasks]  # a source may show imperfect ones
        return sft_batch(tokenizer, tasks, add_special_tokens, answers)
    return batch_of


def warm_start(trainer, batch_of, source, steps: int, batch_size: int, seed: int, log=None, check=None,
               check_every: int = 50, exclude: set[int] | None = None) -> int:
    """Train up to ``steps`` steps on ``batch_of(tasks, rng) -> Batch`` (the demonstrations of
    tasks drawn from ``source``: ``demonstration_batches``, or multi-turn episodes played by a
    teacher); every ``check_every`` steps ``check()`` may say "enough" (returns True). Tasks
    whose index is in ``exclude`` are never trained on (the caller checks on them). Returns the
    number of steps taken."""
    rng = random.Random(f"sft-{seed}")
    pool = [i for i in range(len(source)) if not exclude or i not in exclude]
    for step in range(steps):
        tasks = [source[pool[rng.randrange(len(pool))]] for _ in range(batch_size)]
        m = trainer.train(batch_of(tasks, rng), sft_loss)
        if log is not None:
            log(step, {"sft_loss": m["loss"], "lr": m.get("lr", 0.0)})
        if check is not None and (step + 1) % check_every == 0 and check():
            return step + 1
    return steps
