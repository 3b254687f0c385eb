"""Streaming (asynchronous) against synchronous RL on this machine's CPU cores.

    python benchmarks/async_cpu.py --out runs/async-cpu [--seeds 0 1] [--steps 14]
    python benchmarks/async_cpu.py --learning --out runs/async-learning

Throughput mode: the tiny model at random init on a heavy-tailed length
workload (EOS bias calibrated once by ``benchmarks.lengths`` so that lengths
are geometric with mean ``--mean`` and capped at ``--max-new``), identical for
every configuration:
- sync: ``max_staleness 0``, colocated (all roles in one process, all cores);
- sync-disagg: ``max_staleness 0``, trainer and engine in processes of their
  own (one core each), the same split as the asynchronous runs;
- async-sK: ``max_staleness K``, disaggregated, partial rollouts on (and off
  for K = 2).
Each configuration runs as a `conveyor train` subprocess with a deadline; a
failure becomes a row. Trained samples/s is taken at steady state (steps
after the first 2: the sum of samples over the sum of step wall times).

Learning mode: W2's recipe, benchmarks/w2.yaml (warm-start then GRPO) with sync and with
``max_staleness 2``, same seeds; the held-out rewards are compared.

Writes one JSON per run and a markdown table (``table.md``) in ``--out``, and
appends each run's summary to ``benchmarks/results/async[_cpu].jsonl``
(throughput) or ``w2_async[_cpu].jsonl`` (learning).
It knows nothing of conveyor's internals beyond the CLI and metrics.jsonl.
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
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "sync": ["loop.max_staleness=0", "launch.placement=colocated"],
    "sync-disagg": ["loop.max_staleness=0", "launch.placement=disaggregated"],
    "async-s1": ["loop.max_staleness=1", "launch.placement=disaggregated"],
    "async-s2": ["loop.max_staleness=2", "launch.placement=disaggregated"],
    "async-s2-nopartial": ["loop.max_staleness=2", "launch.placement=disaggregated",
                           "loop.partial_rollouts=false"],
    "async-s4": ["loop.max_staleness=4", "launch.placement=disaggregated"],
    # The streaming engine (fast runner: continuous batching, each decode step queued before
    # the one before is read) instead of the CPU default, the Hugging Face runner.
    "sync-fast": ["loop.max_staleness=0", "launch.placement=colocated", "rollout.runner=fast"],
    "async-s2-fast": ["loop.max_staleness=2", "launch.placement=disaggregated", "rollout.runner=fast"],
    # The multi-GPU code paths on CPU: two FSDP2 ranks (gloo), weights by gloo broadcast.
    "sync-fsdp2": ["loop.max_staleness=0", "launch.placement=disaggregated", "launch.trainer_ranks=2",
                   "launch.weight_sync=broadcast"],
    "async-s2-broadcast": ["loop.max_staleness=2", "launch.placement=disaggregated",
                           "launch.weight_sync=broadcast"],
    # The same comparison on a two-GPU machine: data parallel on both cards against one
    # trainer card plus one engine card (NCCL broadcast).
    "sync-2gpu": ["loop.max_staleness=0", "launch.trainer_ranks=2", "launch.engines=2"],
    "async-s2-2gpu": ["loop.max_staleness=2", "launch.placement=disaggregated"],
    # Sync with decoupled PPO's anchor (the trainer's own logprobs before the update, the
    # engine's behaviour weights truncated) instead of PPO's ratio against the engine's logprobs.
    # The synchronous loop without the one-GPU overlap of training and memory: the engine's KV
    # pool kept while training (launch.time_share) and padded micro-batches (trainer.pack_sequences).
    "sync-unpacked": ["loop.max_staleness=0", "launch.placement=colocated", "launch.time_share=off",
                      "trainer.pack_sequences=off"],
    "sync-decoupled": ["loop.max_staleness=0", "launch.placement=colocated", "algo.loss=decoupled_ppo"],
    # Staleness without the off-policy correction (algo.loss=auto would pick decoupled PPO).
    "async-s2-ppo": ["loop.max_staleness=2", "launch.placement=disaggregated", "algo.loss=ppo"],
    "async-s2-2gpu-ppo": ["loop.max_staleness=2", "launch.placement=disaggregated", "algo.loss=ppo"],
    # The GPU trainer's numerics, one GPU each (sync): float32 weights under autocast without
    # our kernels (the earlier trainer), then the bf16 compute copy and the kernels one at a time.
    "sync-fp32-nokernels": ["loop.max_staleness=0", "launch.placement=colocated", "trainer.param_dtype=float32",
                            "trainer.kernels=false"],
    "sync-fp32-kernels": ["loop.max_staleness=0", "launch.placement=colocated", "trainer.param_dtype=float32"],
    "sync-bf16-nokernels": ["loop.max_staleness=0", "launch.placement=colocated", "trainer.param_dtype=bfloat16",
                            "trainer.kernels=false"],
}
COMMON = ["observe.progress=false", "observe.tensorboard=false", "loop.eval_every=0",
          "launch.engine_threads=1", "launch.trainer_threads=1", "loop.time_limit_s=null"]


def run(args_list: list[str], out: Path, deadline: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.workloads import RECIPE  # W2's task (two-digit addition), not the built-in default
    cmd = [sys.executable, "-m", "conveyor.cli", "train", str(RECIPE), f"--output-dir={out / 'run'}", *args_list]
    t0 = time.perf_counter()
    with open(out / "stdout.log", "w") as so, open(out / "stderr.log", "w") as se:
        try:
            rc = subprocess.run(cmd, stdout=so, stderr=se, timeout=deadline, cwd=ROOT).returncode
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc, status = None, "timeout"
    return {"status": status, "rc": rc, "wall_s": time.perf_counter() - t0,
            "error": (out / "stderr.log").read_text()[-400:] if status != "ok" else None}


def steady(run_dir: Path, warmup: int = 2) -> dict:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    tail = train[warmup:] or train
    secs = sum(r["time/step"] for r in tail)
    samples = sum(r["num_seqs"] for r in tail)
    lens_mean = statistics.mean(r["response_len"] for r in train)
    lens_max = max(r["response_len_max"] for r in train)

    def med(key):
        vals = [r[key] for r in tail if r.get(key) is not None]
        return statistics.median(vals) if vals else None
    hist: dict[str, float] = {}
    for r in tail:
        for k, v in r.items():
            if k.startswith("staleness_hist/"):
                hist[k.split("/")[1]] = hist.get(k.split("/")[1], 0.0) + v / len(tail)
    return {"steps": len(train), "samples_per_s": samples / secs if secs else None,
            "step_s_median": med("time/step"), "trainer_idle": med("trainer_idle_frac"),
            "engine_idle": med("engine0_idle_frac"), "weight_sync_ms": med("weight_sync_ms"),
            "weight_pause_ms": med("weight_pause_ms"), "staleness_hist": hist,
            "multi_version_frac": med("multi_version_frac"),
            "len_mean": lens_mean, "len_p50": med("response_len_p50"), "len_p99": med("response_len_p99"),
            "len_max": lens_max, "tau": lens_max / lens_mean if lens_mean else None}


def throughput(args) -> list[dict]:
    from benchmarks.lengths import calibrate
    from conveyor.data.tiny import build_tiny
    model = build_tiny(args.out / "model", seed=0)
    bias = calibrate(model, target_mean=args.mean, max_new_tokens=args.max_new, prompt_len=8)["eos_bias"]
    workload = [f"model.path={model}", "sft.steps=0", f"rollout.eos_bias={bias}",
                f"rollout.max_new_tokens={args.max_new}", f"loop.steps={args.steps}",
                f"loop.batch_size={args.groups}", f"rollout.n={args.n}", "data.eval_size=16",
                "trainer.lr=1e-4"]
    rows = []
    for seed in args.seeds:
        for name in args.configs:
            out = args.out / f"{name}-seed{seed}"
            res = run([*workload, *COMMON, *CONFIGS[name], f"loop.seed={seed}"], out, args.deadline)
            if res["status"] == "ok":
                res.update(steady(out / "run"))
            res.update({"config": name, "seed": seed, "eos_bias": bias})
            (out / "result.json").write_text(json.dumps(res, indent=1))
            _record("async", res)
            rows.append(res)
            print(json.dumps({k: res.get(k) for k in ("config", "seed", "status", "samples_per_s", "tau")}),
                  flush=True)
    return rows


def learning(args) -> list[dict]:
    rows = []
    for seed in args.seeds:
        for name in args.configs if args.configs != list(CONFIGS) else ("sync", "async-s2"):
            out = args.out / f"learn-{name}{args.tag}-seed{seed}"
            extra = ["loop.eval_sampled=true", f"loop.seed={seed}", f"data.seed={seed}", *args.override]
            res = run([*COMMON, *CONFIGS[name], *extra], out, args.deadline)
            if res["status"] == "ok":
                s = json.loads((out / "run" / "summary.json").read_text())
                res.update({k: s.get(k) for k in ("eval_reward_warmstart", "eval_reward_final",
                                                  "eval_sampled_reward_warmstart", "eval_sampled_reward_final",
                                                  "trained_samples_per_second", "rl_seconds")})
            res.update({"config": name + args.tag, "seed": seed, "overrides": args.override})
            (out / "result.json").write_text(json.dumps(res, indent=1))
            _record("w2_async", res)
            rows.append(res)
            print(json.dumps({k: res.get(k) for k in ("config", "seed", "status", "eval_reward_final")}), flush=True)
    return rows


def _record(workload: str, res: dict) -> None:
    from benchmarks.harness import append_record
    config = {k: res.get(k) for k in ("config", "seed", "status", "error")}
    append_record(workload, {k: v for k, v in res.items() if k not in config and k != "rc"}, config=config)


def table(rows: list[dict], keys: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        if isinstance(v, dict):
            return " ".join(f"{k}:{x:.2f}" for k, x in sorted(v.items()))
        return "" if v is None else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--learning", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--mean", type=float, default=16.0)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--deadline", type=float, default=900.0)
    p.add_argument("--override", action="append", default=[], help="KEY=VALUE for every --learning run")
    p.add_argument("--tag", default="", help="suffix of the --learning runs' folders")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    if args.learning:
        rows = learning(args)
        keys = ["config", "seed", "status", "eval_reward_warmstart", "eval_reward_final",
                "eval_sampled_reward_warmstart", "eval_sampled_reward_final", "trained_samples_per_second"]
    else:
        rows = throughput(args)
        keys = ["config", "seed", "status", "samples_per_s", "step_s_median", "trainer_idle", "engine_idle",
                "weight_sync_ms", "weight_pause_ms", "staleness_hist", "multi_version_frac",
                "len_p50", "len_p99", "len_max", "tau"]
    (args.out / "table.md").write_text(table(rows, keys))
    print(table(rows, keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
