"""Rewards of the two workloads, for both systems, recording every scored trajectory.

Contract
- The scores: ``hash_score(text, seed)`` (W1: a seeded hash of the completion
  text in [0, 1), so advantages are non-zero and the whole gradient path
  runs) and ``addition_score(text, answer, task)`` (W2: conveyor's own
  partial credit, ``conveyor.data.synthetic.score_text``).
- conveyor side: ``conveyor_hash`` and ``conveyor_partial_credit`` follow
  conveyor's reward contract (``fn(traj, **reward.kwargs)``).
- TRL side: ``TrlReward`` follows TRL's (``fn(prompts, completions,
  completion_ids, **columns)`` -> list of floats) and also times itself, so
  the TRL peer can report a reward phase like conveyor's.
- Both sides append one JSON line per trajectory to ``log_path``: split
  ("train" or "eval"), prompt_len, completion_len, version (oldest policy
  version of its tokens; TRL: the rollout batch it was generated at),
  versions (number of distinct versions), finish ("stop" or "length"),
  reward. ``metrics.py`` cuts the train lines into steps by count, which is
  exact for synchronous systems whose steps never interleave.

It knows nothing of either system's training; it only scores and records.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

from conveyor.data.synthetic import score_text

_LOCK = threading.Lock()
_FILES: dict[str, object] = {}


def record(log_path: str | None, rows: list[dict]) -> None:
    """Append rows as JSON lines; safe from the reward service's worker threads."""
    if not log_path or not rows:
        return
    with _LOCK:
        f = _FILES.get(log_path)
        if f is None:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            f = _FILES[log_path] = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        f.write("".join(json.dumps(r) + "\n" for r in rows))  # type: ignore[attr-defined]


def hash_score(text: str, seed: int = 0) -> float:
    h = hashlib.blake2b(f"{seed}:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0 ** 64


def addition_score(text: str, answer: str, task: str = "addition") -> float:
    return score_text(text, answer or "", right_align=task == "addition")


def _split_of(task_id: str) -> str:
    # conveyor's task ids: "<name>-eval-<i>" (synthetic) and "eval-<row>" (files).
    return "eval" if task_id.startswith("eval-") or "-eval-" in task_id else "train"


def _conveyor_row(traj, reward: float) -> dict:
    return {"split": _split_of(traj.task.id), "prompt_len": len(traj.prompt_ids),
            "completion_len": len(traj.completion_ids), "version": traj.min_version,
            "versions": len(set(traj.policy_versions)),
            "finish": traj.finish_reason, "reward": reward}


def conveyor_hash(traj, log_path: str | None = None, seed: int = 0) -> float:
    r = hash_score(traj.text, seed)
    record(log_path, [_conveyor_row(traj, r)])
    return r


def conveyor_partial_credit(traj, log_path: str | None = None) -> dict:
    info = traj.task.info or {}
    r = addition_score(traj.text, traj.task.answer or "", info.get("task", "addition"))
    record(log_path, [_conveyor_row(traj, r)])
    return {"reward": r, "exact": float(traj.text.strip() == (traj.task.answer or ""))}


class TrlReward:
    """A TRL reward function (one float per completion) that records and times itself."""

    def __init__(self, kind: str, log_path: str | None, eos_ids: set[int], count_prompt, seed: int = 0,
                 steps_per_version: int = 1):
        if kind not in ("hash", "partial_credit"):
            raise ValueError(f"unknown reward kind {kind!r}; use hash or partial_credit")
        self.kind, self.log_path, self.eos_ids, self.seed = kind, log_path, set(eos_ids), seed
        self.count_prompt = count_prompt  # prompt text -> token count, as the trainer tokenized it
        self.__name__ = kind  # TRL names reward columns after __name__
        self.seconds = 0.0
        # TRL counts optimizer steps; a policy version (as conveyor counts them) spans this many.
        self.steps_per_version = max(1, int(steps_per_version))

    def __call__(self, prompts, completions, completion_ids, trainer_state=None, answer=None, task=None,
                 **_unused) -> list[float]:
        t0 = time.perf_counter()
        if self.kind == "hash":
            rewards = [hash_score(c, self.seed) for c in completions]
        else:
            rewards = [addition_score(c, a, t) for c, a, t in zip(completions, answer, task, strict=True)]
        step = int(getattr(trainer_state, "global_step", 0)) // self.steps_per_version
        cache: dict[str, int] = {}
        rows = []
        for p, ids, r in zip(prompts, completion_ids, rewards, strict=True):
            if p not in cache:
                cache[p] = self.count_prompt(p)
            stop = bool(ids) and int(ids[-1]) in self.eos_ids
            rows.append({"split": "train", "prompt_len": cache[p], "completion_len": len(ids), "version": step,
                         "versions": 1, "finish": "stop" if stop else "length", "reward": r})
        record(self.log_path, rows)
        self.seconds += time.perf_counter() - t0
        return rewards
