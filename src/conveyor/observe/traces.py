"""Trajectory traces: what the model actually wrote, step by step, in the run directory.

- ``TraceWriter.write(step, groups, places)`` appends up to ``per_step`` of the step's
  trajectories to ``run_dir/traces.jsonl`` (the best, the worst, a seeded random choice of the
  rest), one JSON line each; past ``max_mb`` nothing more is written, and what is left out is
  counted. ``write_trajectories`` appends given ones (the evaluator's samples).
- ``read_traces(run_dir, step=None)`` reads them back.

It knows nothing of the loop, engines or rewards beyond the wire types.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from conveyor.types import Group, Trajectory

TRACES_FILE = "traces.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"  # the same writer, for held-out evaluations


class TraceWriter:
    """Contract: ``TraceWriter(run_dir, tokenizer, per_step, max_mb, seed)``;
    ``write(step, groups, places)`` appends up to ``per_step`` of the step's
    trajectories to ``run_dir/traces.jsonl`` as one JSON line each: the best and
    the worst by reward, then a seeded random choice of the rest. A line holds
    the step, the task id, its group's place in the rollout schedule when given
    (``place``: the step it was admitted for is ``place // loop.batch_size``), the prompt and the completion as text, token counts (prompt,
    completion, the policy's own), the policy versions of its tokens (min, max,
    distinct), the reward and its components, the finish reason, the turns of
    a multi-turn episode (span, reward, tool calls, environment seconds,
    failure class) and the timings. Past ``max_mb`` nothing more is written and
    ``skipped`` counts what was left out; ``per_step = 0`` writes nothing.
    ``read_traces(run_dir, step=None)`` reads them back (one step, or all).
    ``write_trajectories(step, trajs, **extra)`` appends given trajectories as
    they are; with ``name=EVAL_SAMPLES_FILE`` the evaluator writes the first
    held-out tasks' completions of every evaluation (``read_traces(run_dir,
    name=EVAL_SAMPLES_FILE)``).
    """
    def __init__(self, run_dir: str | Path, tokenizer: Any, per_step: int = 8, max_mb: float = 64.0,
                 seed: int = 0, name: str = TRACES_FILE):
        self.path = Path(run_dir) / name
        self.tokenizer, self.per_step, self.seed = tokenizer, per_step, seed
        self.max_bytes = int(max_mb * 2**20)
        self.written = self.path.stat().st_size if self.path.exists() else 0  # a resumed run appends
        self.skipped = 0

    def write(self, step: int, groups: list[Group], places: tuple[int, ...] = ()) -> None:
        if self.per_step <= 0:
            return
        trajs = [t for g in groups for t in g.trajectories]
        place_of = {id(t): p for g, p in zip(groups, places) for t in g.trajectories}
        self._append([{**self.record(step, t), **({"place": place_of[id(t)]} if places else {})}
                      for t in self.choose(step, trajs)])

    def write_trajectories(self, step: int, trajs: list[Trajectory], **extra: Any) -> None:
        """Append ``trajs`` as they are (no choice), each record with the fields ``extra``."""
        self._append([{**self.record(step, t), **extra} for t in trajs])

    def _append(self, records: list[dict[str, Any]]) -> None:
        lines = [json.dumps(r, default=str) + "\n" for r in records]
        keep = []
        for line in lines:
            size = len(line.encode("utf-8"))
            if self.written + size > self.max_bytes:
                self.skipped += len(lines) - len(keep)
                break
            keep.append(line)
            self.written += size
        if keep:
            with self.path.open("a", encoding="utf-8") as f:
                f.writelines(keep)

    def choose(self, step: int, trajs: list[Trajectory]) -> list[Trajectory]:
        """The best and the worst by reward, then a random choice of the rest (seeded by step)."""
        if len(trajs) <= self.per_step:
            return trajs
        order = sorted(range(len(trajs)), key=lambda i: trajs[i].reward)
        picked = [order[-1], order[0]][: self.per_step]
        rest = [i for i in order[1:-1]]
        random.Random(f"traces-{self.seed}-{step}").shuffle(rest)
        picked += rest[: self.per_step - len(picked)]
        return [trajs[i] for i in picked]

    def record(self, step: int, t: Trajectory) -> dict[str, Any]:
        own = t.policy_versions
        return {
            "step": step, "task_id": t.task.id,
            "prompt": self.tokenizer.decode(list(t.prompt_ids), skip_special_tokens=False),
            "completion": self.tokenizer.decode(list(t.completion_ids), skip_special_tokens=False),
            "prompt_tokens": len(t.prompt_ids), "completion_tokens": len(t.completion_ids),
            "policy_tokens": len(own),
            "versions": {"min": min(own), "max": max(own), "distinct": len(set(own))} if own else {},
            "reward": t.reward, "reward_info": dict(t.reward_info), "finish_reason": t.finish_reason,
            "turns": [{"start": r.start, "end": r.end, "reward": r.reward, "tool_calls": list(r.tool_calls),
                       "env_s": r.env_s, "error": r.error} for r in t.turn_records],
            "timings": dict(t.timings),
        }


def read_traces(run_dir: str | Path, step: int | None = None, name: str = TRACES_FILE) -> list[dict[str, Any]]:
    """The traces of ``run_dir`` (those of ``step`` only, when given), in the order written."""
    path = Path(run_dir) / name
    if not path.exists():
        knob = "observe.eval_samples" if name == EVAL_SAMPLES_FILE else "observe.traces_per_step"
        raise FileNotFoundError(f"{path} does not exist: the run wrote none ({knob}=0, or not a run directory)")
    out = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if step is None or rec["step"] == step:
                out.append(rec)
    return out
