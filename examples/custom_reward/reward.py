"""A custom reward: credit per correct letter of the upper-cased word, plus an exact-answer flag.

A reward is any callable ``fn(traj) -> float | dict``. ``traj`` is a
``conveyor.types.Trajectory``; the fields a reward usually reads:

- ``traj.text``: the completion, decoded (special tokens dropped)
- ``traj.task.prompt``: the prompt as sent to the model (after templates)
- ``traj.task.answer``: the reference answer (the data's ``answer_field``)
- ``traj.task.info``: the row's other fields, plus ``raw_prompt`` and ``row``
- ``traj.completion_ids`` / ``traj.prompt_ids``: token ids; ``traj.finish_reason``: "stop" or "length"

A dict return must carry ``"reward"``; its other numbers (here ``exact``) are
averaged into the metrics, and ``exact`` becomes the summary's exact-answer rate.
"""
from __future__ import annotations


def shout(traj) -> dict:
    want, got = traj.task.answer, traj.text.strip()
    hits = sum(a == b for a, b in zip(want, got))
    return {"reward": hits / max(len(want), len(got), 1), "exact": float(got == want)}
