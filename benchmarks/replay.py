"""W2 with and without trajectory reuse (``loop.replay``), paired seeds: reward per generated sample.

    python benchmarks/replay.py --out runs/replay-w2 [--seeds 0 1 2] [--steps 60] [--fraction 0.25]
        [--max-age 2] [--max-uses 1] [--warmstart DIR] [--sft-steps 1500] [--override key=value ...]

Contract: warm-starts W2's tiny model once (``conveyor sft`` on
benchmarks/w2.yaml, or takes ``--warmstart``), then for every seed runs the
same RL twice from that checkpoint as ``conveyor train`` subprocesses:
``base`` (no replay) and ``replay`` (``loop.replay`` on). Both use
``algo.loss=decoupled_ppo`` (what replay requires), so the loss is not what
differs; same seed = same task order and the same random stream per sample,
so the two arms start from identical samples. Generation per step is the
same in both arms (``loop.batch_size`` x ``rollout.n`` fresh samples); the
replay arm trains on up to ``fraction x batch_size`` stored groups more.

Per run, from ``metrics.jsonl`` and ``summary.json``: the mean training
reward of the FRESH samples over all steps (``reward_per_sample``: the area
under reward against generated samples, divided by the samples) and over the
last quarter of the steps, the held-out greedy and sampled reward after RL,
RL seconds, samples trained (replayed included) and the replay counts. Each
run is appended to ``benchmarks/results/w2_replay[_cpu].jsonl``, then one
summary record: per-seed differences (replay - base) and their mean. With
``--override`` any shape can be set (the tests run a tiny one on CPU).
It knows conveyor only through its CLI and metrics files.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import append_record
from benchmarks.workloads import RECIPE

COMMON = ["observe.progress=false", "observe.tensorboard=false", "observe.traces_per_step=0", "loop.eval_every=0",
          "loop.eval_sampled=true", "loop.time_limit_s=null", "sft.steps=0", "algo.loss=decoupled_ppo"]
KEYS = ("reward_per_sample", "reward_last_quarter", "eval_after", "eval_sampled_after")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60, help="RL steps of every run")
    p.add_argument("--fraction", type=float, default=0.25, help="loop.replay.fraction")
    p.add_argument("--max-age", type=int, default=2, help="loop.replay.max_age")
    p.add_argument("--max-uses", type=int, default=1, help="loop.replay.max_uses")
    p.add_argument("--warmstart", type=Path, default=None, help="an HF checkpoint to start from (skips the SFT)")
    p.add_argument("--sft-steps", type=int, default=1500, help="most warm-start steps (w2.yaml stops at 0.65)")
    p.add_argument("--override", action="append", default=[], help="conveyor key=value for every run")
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds each subprocess may take")
    return p.parse_args(argv)


def conveyor(cmd: str, out: Path, overrides: list[str], deadline: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "conveyor.cli", cmd, str(RECIPE), f"--output-dir={out / 'run'}", *overrides]
    t0 = time.perf_counter()
    with open(out / "stdout.log", "w") as so, open(out / "stderr.log", "w") as se:
        try:
            rc = subprocess.run(argv, check=False, stdout=so, stderr=se, timeout=deadline, cwd=ROOT).returncode
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
    return {"status": status, "wall_s": time.perf_counter() - t0,
            "error": (out / "stderr.log").read_text()[-400:] if status != "ok" else None}


def warm_start(args) -> Path:
    if args.warmstart:
        return args.warmstart.resolve()
    res = conveyor("sft", args.out / "warmstart", [f"sft.steps={args.sft_steps}", "observe.progress=false",
                                                   "observe.tensorboard=false", *args.override], args.deadline)
    model = args.out / "warmstart" / "run" / "warmstart"
    if not (model / "config.json").is_file():
        raise SystemExit(f"warm-start failed ({res['status']}): {res['error']}")
    return model.resolve()


def measure(run_dir: Path) -> dict:
    """What one run learned per generated sample (fresh samples only) and what it replayed."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = [r["reward"] for r in train]
    fresh = sum(r["num_seqs"] - r.get("replay/samples", 0.0) for r in train)
    replayed = sum(r.get("replay/samples", 0.0) for r in train)
    ages = [(r["replay/age_mean"], r["replay/samples"]) for r in train if r.get("replay/samples")]
    return {"steps": len(train), "generated_samples": fresh, "replayed_samples": replayed,
            "reward_per_sample": statistics.fmean(rewards),
            "reward_last_quarter": statistics.fmean(rewards[-max(1, len(rewards) // 4):]),
            "eval_before": summary.get("eval_reward_initial"), "eval_after": summary.get("eval_reward_final"),
            "eval_sampled_after": summary.get("eval_sampled_reward_final"), "rl_seconds": summary.get("rl_seconds"),
            "replay_age_mean": sum(a * n for a, n in ages) / replayed if replayed else None,
            "curve": [[(i + 1) * (fresh / max(len(train), 1)), round(r, 4)] for i, r in enumerate(rewards)]}


def paired(results: dict[tuple[str, int], dict], seeds: list[int]) -> dict:
    """Per-seed (replay - base) differences of KEYS and their mean, over seeds where both ran."""
    out: dict = {"seeds": [], "per_seed": {k: [] for k in KEYS}}
    for seed in seeds:
        a, b = results.get(("base", seed)), results.get(("replay", seed))
        if not (a and b and a["status"] == b["status"] == "ok"):
            continue
        out["seeds"].append(seed)
        for k in KEYS:
            out["per_seed"][k].append(None if a[k] is None or b[k] is None else b[k] - a[k])
    for k in KEYS:
        vals = [v for v in out["per_seed"][k] if v is not None]
        out[f"{k}_diff_mean"] = statistics.fmean(vals) if vals else None
        out[f"{k}_base_mean"] = _mean(results, "base", out["seeds"], k)
        out[f"{k}_replay_mean"] = _mean(results, "replay", out["seeds"], k)
    return out


def _mean(results, arm, seeds, key):
    vals = [results[(arm, s)][key] for s in seeds if results[(arm, s)][key] is not None]
    return statistics.fmean(vals) if vals else None


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    model = warm_start(args)
    replay = [f"loop.replay.fraction={args.fraction}", f"loop.replay.max_age={args.max_age}",
              f"loop.replay.max_uses={args.max_uses}"]
    results: dict[tuple[str, int], dict] = {}
    for seed in args.seeds:  # the arms of a seed run back to back: drift in a shared machine hits both
        for arm, extra in (("base", []), ("replay", replay)):
            out = args.out / f"{arm}-seed{seed}"
            res = conveyor("train", out, [f"model.path={model}", *COMMON, f"loop.steps={args.steps}",
                                          f"loop.seed={seed}", *args.override, *extra], args.deadline)
            if res["status"] == "ok":
                res.update(measure(out / "run"))
            results[(arm, seed)] = res
            (out / "result.json").write_text(json.dumps(res, indent=1))
            config = {"config": arm, "seed": seed, "status": res["status"], "steps": args.steps,
                      "replay": replay if extra else None}
            append_record("w2_replay", {k: v for k, v in res.items() if k not in ("status", "curve")}, config=config)
            print(json.dumps({"arm": arm, "seed": seed, **{k: res.get(k) for k in ("status", *KEYS)}}), flush=True)
    summary = paired(results, args.seeds)
    append_record("w2_replay", summary, config={"config": "summary", "steps": args.steps, "replay": replay,
                                                "overrides": args.override, "warmstart": str(model)})
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if len(summary["seeds"]) == len(args.seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
