"""conveyor as a benchmark peer: ``python -m benchmarks.peers.conveyor_peer SPEC.json``.

Contract: runs conveyor's public entry point ``run_local`` (the same code
``conveyor train`` runs; ``run_ray`` when the overrides set
``launch.backend=ray``) under ``workloads.run_config(spec)`` until
``loop.steps`` or ``loop.time_limit_s``, then, for W2, evaluates the final
checkpoint with ``benchmarks.evaluate`` (the evaluator TRL's checkpoints
get too). conveyor's own ``summary.json`` (with its in-process evaluations)
stays in the run directory as a cross-check.

The RL start time is not reported by ``run_local``; it is taken as the last
step's log time minus ``rl_seconds`` (off by the final step's logging, a
few milliseconds), which only places the learning curve on the clock.
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.bounds import describe_machine
from benchmarks.evaluate import evaluate_checkpoint
from benchmarks.peers.common import gpu_memory, load_spec, spec_path_from_argv, write_result
from benchmarks.workloads import run_config


def _last_train_time(run_dir: Path) -> float | None:
    from conveyor.observe.report import read_metrics
    steps = read_metrics(run_dir, kind="train")
    return float(steps[-1]["time"]) if steps else None


def main() -> int:
    from conveyor.run.local import run_local

    spec = load_spec(spec_path_from_argv())
    run_dir = Path(spec["run_dir"])
    cfg = run_config(spec)
    result: dict = {"system": "conveyor", "machine": describe_machine()}
    if cfg.launch.backend == "ray":
        from conveyor.run.ray import run_ray
        summary = run_ray(cfg, run_dir)
    else:
        summary = run_local(cfg, run_dir)
    last = _last_train_time(run_dir)
    result.update({"steps": summary["steps"], "rl_seconds": summary["rl_seconds"],
                   "rl_start_unix": last - summary["rl_seconds"] if last else None,
                   "conveyor_summary": {k: summary.get(k) for k in
                                        ("eval_reward_initial", "eval_reward_final", "trained_samples_per_second",
                                         "wall_seconds")}})
    if spec["workload"] == "w2":
        result["eval_after"] = evaluate_checkpoint(cfg, run_dir / "final", run_dir / "eval_after")
    result.update(gpu_memory())
    write_result(run_dir, result)
    print(json.dumps({"steps": result["steps"], "rl_seconds": result["rl_seconds"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
