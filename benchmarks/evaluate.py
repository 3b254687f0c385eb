"""The one held-out evaluator used for every system's W2 checkpoints.

Contract: ``evaluate_checkpoint(cfg, model_path, work_dir)`` runs conveyor's
public entry point ``run_local`` on the HF checkpoint at ``model_path``
with zero RL steps and no warm-start, and returns its first held-out
evaluation as logged in ``metrics.jsonl`` (``{"eval_reward", "eval_len",
"eval_exact", ...}``):
conveyor's ``loop.evaluate``, greedy by default (``loop.eval_temperature``),
on the eval split of ``cfg.data``, scored with the data source's default
reward (partial credit for the synthetic tasks). Whoever trained the
checkpoint (conveyor, TRL), the numbers come from this same code on the same
problems, so before/after deltas are comparable.

``python -m benchmarks.evaluate SPEC.json MODEL_DIR OUT.json`` does the
same in a subprocess (the harness evaluates the shared starting checkpoint
once this way).

It does not know which system wrote the checkpoint and never trains.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def evaluate_checkpoint(cfg, model_path: str | Path, work_dir: str | Path) -> dict:
    from conveyor.run.local import run_local

    # The benchmark's recording reward is swapped for the task's plain one (evaluation must not
    # add lines to a training trajectory log), and RL is switched off.
    cfg = cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"path": str(model_path)}),
        "reward": cfg.reward.model_copy(update={"fn": "auto", "kwargs": {}}),
        "observe": cfg.observe.model_copy(update={"progress": False, "tensorboard": False, "sinks": [],
                                                  "timeline": False}),
        "sft": cfg.sft.model_copy(update={"steps": 0}),
        "loop": cfg.loop.model_copy(update={"steps": 0, "time_limit_s": None, "eval_every": 0,
                                            "checkpoint_every": 0}),
    })
    work_dir = Path(work_dir)
    shutil.rmtree(work_dir, ignore_errors=True)  # metrics.jsonl is appended to: start from an empty one
    run_local(cfg, work_dir)
    # The first "eval" line of metrics.jsonl (report.py's file contract) is the checkpoint's evaluation.
    from conveyor.observe.report import read_metrics
    first = read_metrics(work_dir, kind="eval")[0]
    return {k: v for k, v in first.items() if k not in ("step", "kind", "time")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        raise SystemExit("usage: python -m benchmarks.evaluate SPEC.json MODEL_DIR OUT.json")
    from benchmarks.workloads import run_config
    spec = json.loads(Path(argv[0]).read_text())
    out = Path(argv[2])
    res = evaluate_checkpoint(run_config(spec), argv[1], out.parent / (out.stem + "_run"))
    out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
