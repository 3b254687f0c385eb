"""A run's checkpoints: what they carry beyond the trainer's state, which are kept, how a resume reads them.

- ``Totals``: what a run has done so far, saved in every checkpoint so that a resumed run
  reports the whole run.
- ``latest(run_dir)``: the newest complete checkpoint; ``prune`` keeps the newest ``keep_last``
  and, with ``keep_best``, the best by held-out reward.
- ``rewind(run_dir, step)``: before a resume, the run's logs lose their records of later steps,
  so they read as one run.

It knows nothing of trainers or of the loop's schedule.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

_REWOUND = ("metrics.jsonl", "traces.jsonl", "eval_samples.jsonl")


@dataclass
class Totals:
    """``Totals``: what a run has done so far, saved in every checkpoint so that a
    resumed run reports the whole run: wall and RL seconds, the steps trained,
    and the running counters of the metrics (reward failures and timeouts,
    environment failures, skipped prompts, engine restarts: what the loop
    names as counters). ``since(...)`` adds what this part of the run did;
    ``offset(counters)`` adds the counters of the earlier parts.
    """
    wall_seconds: float = 0.0
    rl_seconds: float = 0.0
    steps: int = 0
    counters: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, extra: Mapping[str, Any]) -> "Totals":
        t = extra.get("totals") or {}
        return cls(float(t.get("wall_seconds", 0.0)), float(t.get("rl_seconds", 0.0)), int(t.get("steps", 0)),
                   dict(t.get("counters", {})))

    def offset(self, counters: Mapping[str, float]) -> dict[str, float]:
        """This part's running counters with the earlier parts' added."""
        return {**self.counters, **{k: v + self.counters.get(k, 0) for k, v in counters.items()}}

    def since(self, wall_seconds: float, rl_seconds: float, steps: int, counters: Mapping[str, float]) -> "Totals":
        """The totals after this part ran ``wall_seconds`` (``rl_seconds`` of it training) up to
        ``steps``; ``counters`` are already offset."""
        return Totals(self.wall_seconds + wall_seconds, self.rl_seconds + rl_seconds, steps, dict(counters))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def latest(run_dir: Path) -> Path | None:
    """``latest(run_dir)`` is the newest complete checkpoint (a checkpoint being
    written lives under a hidden name until it is complete).
    """
    ckpts = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / "extra.json").is_file())
    return ckpts[-1] if ckpts else None


def read_extra(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "extra.json").read_text())


def prune(run_dir: Path, keep_last: int | None, keep_best: bool) -> list[Path]:
    """Delete the checkpoints not kept; returns those deleted.

    ``prune(run_dir, keep_last, keep_best)`` keeps the newest ``keep_last`` and,
    with ``keep_best``, the one of the highest held-out reward
    (``extra.json``'s ``eval_reward``, present where an evaluation ran at that
    step); the rest are deleted.
    """
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    if keep_last is None or len(ckpts) <= keep_last:
        return []
    keep = set(ckpts[-keep_last:]) if keep_last > 0 else set()
    if keep_best:
        scored = [(r, c) for c in ckpts if (r := _eval_reward(c)) is not None]
        if scored:
            keep.add(max(scored, key=lambda rc: (rc[0], rc[1].name))[1])
    gone = [c for c in ckpts if c not in keep]
    for c in gone:
        shutil.rmtree(c, ignore_errors=True)
    return gone


def _eval_reward(ckpt: Path) -> float | None:
    try:
        value = read_extra(ckpt).get("eval_reward")
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


@dataclass(frozen=True)
class Rewound:
    """What ``rewind`` dropped: records per file, and the time of the newest dropped metrics row."""
    dropped: dict[str, int]
    last_time: float | None

    def lost_seconds(self, saved_at: float | None) -> float:
        """Wall time the run spent past its checkpoint (redone after the resume)."""
        if self.last_time is None or saved_at is None:
            return 0.0
        return max(0.0, self.last_time - float(saved_at))


def rewind(run_dir: Path, step: int) -> Rewound:
    """Drop the records of steps after ``step`` from the run's line logs.

    ``rewind(run_dir, step)``: before a resume from ``step``, the run's logs
    (``metrics.jsonl``, ``traces.jsonl``, ``eval_samples.jsonl``) lose their
    records of later steps, which the resumed run writes again, so they read as
    one run; TensorBoard's are purged by the writer (``purge_step``).
    """
    dropped: dict[str, int] = {}
    last_time = None
    for name in _REWOUND:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        kept, n = [], 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line) if line.endswith("\n") else None  # a line torn by the kill: dropped
                except ValueError:
                    rec = None
                if rec is None or (rec.get("kind") != "sft" and isinstance(rec.get("step"), int)
                                   and rec["step"] > step):
                    n += 1
                    if rec is not None and name == "metrics.jsonl" and isinstance(rec.get("time"), (int, float)):
                        last_time = max(last_time or 0.0, float(rec["time"]))
                    continue
                kept.append(line)
        if n:
            tmp = path.with_name(f".{name}.rewind-{os.getpid()}")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, path)
        dropped[name] = n
    return Rewound(dropped, last_time)
