"""W4 (a judge in the loop): W1 with the reward written by a generative judge on a device of its own.

    python benchmarks/judge.py --model qwen2.5-0.5b --judge-device cuda:1 --out runs/bench-w4       # 2 GPUs
    python benchmarks/judge.py --model qwen2.5-0.5b --judge-device cuda:1 --staleness 0,2 \
        --async-override launch.placement=disaggregated --out runs/bench-w4-async                   # 3 GPUs
    python benchmarks/judge.py --model tiny --judge-device cpu --prompt-len 16 --max-new-tokens 32 \
        --target-mean 8 --prompts 4 --group 4 --steps 4 --judge-max-new-tokens 16 --cpu-threads 1 \
        --out runs/bench-w4-cpu                                                                      # CPU smoke

Contract: BENCHMARKS.md's W4. Builds W1's policy, prompts and EOS-bias calibration ONCE
(``w1_throughput.prepare``) and a second model of ``--judge-model``'s shape (W1's model by
default) with another seed: the judge, frozen and randomly initialised. Each configuration (the
``--staleness`` values, as in W1) runs conveyor in its own subprocess with a deadline (``python
-m benchmarks.judge --peer SPEC.json``: ``peers/conveyor_peer.py`` on W4's RunConfig) with
``reward.fn: judge`` on ``--judge-device``: the judge reads each prompt and completion (the
built-in pointwise template, as plain text: W1's tokenizer has no chat template) and writes up
to ``--judge-max-new-tokens`` tokens; a random judge writes no score, so the reward is the
seeded hash of the completion (``reward.judge.fallback: hash``, W1's hash reward: same formula,
same seed), every one counted unparseable. It writes ``<out>/<name>.json``, a row of
``<out>/table.md`` and one line of ``benchmarks/results/w4[_cpu].jsonl``.

Reported: W1's metrics (trained samples/s, step time, rollout and training tokens/s, the
engine's and the trainer's idle fractions), and the judge's: tokens/s while it generates (the
median over the steady steps of the per-call rate the judge reports in ``reward_info``), tokens
per judgement, the share of unparseable judgements, the mean batch per judge call, and its idle
fraction: 1 - (the union of the reward service's ``score`` spans in ``timeline.json``) / (the
steady window's wall time). The policy's trajectories (lengths, versions, rewards) come from
the run's ``traces.jsonl`` (every trajectory of every step is traced), turned into the
``trajectories.jsonl`` rows ``metrics.py`` reads.

It knows W4's shape and its table; metrics live in ``metrics.py``, the system in
``peers/conveyor_peer.py``, the judge in ``conveyor.reward.judge``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H
from benchmarks import workloads as W
from benchmarks.bounds import SHAPES


# ----- W4's RunConfig ----------------------------------------------------------------------------
def w4_config(spec: dict):
    """W1's RunConfig (model, prompts, EOS bias, optimizer, loss) with the judge as the reward and
    every trajectory traced."""
    judge = {"model": spec["judge"]["model_path"], "device": spec["judge"]["device"],
             "max_new_tokens": int(spec["judge"]["max_new_tokens"]), "samples": int(spec["judge"]["samples"]),
             "temperature": 1.0, "chat_template": False, "fallback": "hash"}
    return W.w1_based(spec, [
        W._kv("reward.fn", "judge"), *[W._kv(f"reward.judge.{k}", v) for k, v in judge.items()],
        W._kv("reward.workers", 1), W._kv("reward.timeout_s", float(spec["judge"]["timeout_s"])),
        W._kv("reward.max_batch", int(spec["judge"]["max_batch"])),
        W._kv("observe.traces_per_step", int(spec["samples_per_step"])), W._kv("observe.traces_max_mb", 4096),
    ], name="w4")


def run_config(spec: dict):
    """``workloads.run_config`` that also knows W4."""
    return w4_config(spec) if spec["workload"] == "w4" else W.run_config(spec)


# harness.collect (this process) and the conveyor peer (its subprocess) read the RunConfig through
# their module-level ``run_config``; W4 is not in workloads.run_config, so both get this one.
H.run_config = run_config


def peer_main(spec_path: str) -> int:
    """The subprocess of one configuration: ``peers/conveyor_peer.py`` on W4's RunConfig."""
    return H.conveyor_peer_main(run_config, spec_path)


def run_peer(spec: dict, deadline_s: float) -> dict:
    return H.run_peer_module("benchmarks.judge", spec, deadline_s)


# ----- W4's metrics on top of W1's ---------------------------------------------------------------
def traces_to_trajectories(run_dir: Path) -> int:
    """``trajectories.jsonl`` rows (``rewards.py``'s format) from the run's traces, in step order."""
    rows = [{"split": "train", "prompt_len": t["prompt_tokens"], "completion_len": t["completion_tokens"],
             "version": (t.get("versions") or {}).get("min", -1),
             "versions": (t.get("versions") or {}).get("distinct", 1),
             "finish": t["finish_reason"], "reward": t["reward"]}
            for t in H._read_jsonl(run_dir / "traces.jsonl")]
    (run_dir / W.TRAJECTORIES).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def busy_seconds(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] covered by at least one span (spans may overlap)."""
    covered, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= max(a, reach):  # outside the window, or already covered
            continue
        covered += b - max(a, reach)
        reach = b
    return covered


def judge_spans(run_dir: Path) -> list[tuple[float, float]]:
    """The reward service's calls (the judge's batches) as (start, end) wall seconds."""
    from conveyor.observe.timeline import ROLE_PIDS, read_timeline
    return [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in read_timeline(run_dir)
            if e.get("ph") == "X" and e.get("pid") == ROLE_PIDS["reward"] and e.get("name") == "score"]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def w4_extras(rec: dict, spec: dict) -> dict:
    """Add the judge's columns to a harness record (in place); missing inputs give None."""
    run_dir = Path(spec["run_dir"])
    m = rec.setdefault("metrics", {})
    steps = [r for r in H._read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    win = m.get("window")
    steady = steps[win[0] - 1:win[1]] if win else []
    rates = [s["reward_judge_tokens_per_s"] for s in steady if s.get("reward_judge_tokens_per_s")]
    m["judge_tokens_per_s"] = statistics.median(rates) if rates else None
    m["judge_tokens_per_judgement"] = _mean([s.get("reward_judge_tokens") for s in steady])
    m["judge_unparseable_frac"] = _mean([s.get("reward_judge_fallback") for s in steady])
    last = steps[-1] if steps else {}
    m["reward_batch_mean"] = last["reward_scored"] / last["reward_batches"] if last.get("reward_batches") else None
    m["judge_idle_frac"] = m["judge_busy_s"] = None
    if steady and (run_dir / "timeline.json").is_file():
        start = float(steady[0]["time"]) - float(steady[0]["time/step"])
        end = float(steady[-1]["time"])
        busy = busy_seconds(judge_spans(run_dir), start, end)
        m["judge_busy_s"] = busy
        m["judge_idle_frac"] = 1.0 - busy / (end - start) if end > start else None
    # record_run carries the judge's settings to the results line (its path is this machine's only).
    rec.setdefault("config", {})["judge"] = {k: v for k, v in (spec.get("judge") or {}).items() if k != "model_path"}
    return rec


def collect(spec: dict, outcome: dict) -> dict:
    run_dir = Path(spec["run_dir"])
    if (run_dir / "traces.jsonl").is_file():
        traces_to_trajectories(run_dir)
    return w4_extras(H.collect_safely(spec, outcome), spec)


# ----- the table ---------------------------------------------------------------------------------
def _m(key: str, pct: bool = False):
    return lambda r: H.fmt(r["metrics"].get(key), pct=pct)


COLUMNS = [
    ("system", lambda r: r["system"]), ("setting", lambda r: r["setting"].get("label", "")),
    ("seed", lambda r: str(r["seeds"]["loop"])), ("status", H.status_cell),
    ("steps", _m("steps")), ("samples/s", _m("trained_samples_per_s")), ("median step s", _m("median_step_s")),
    ("judge tok/s", _m("judge_tokens_per_s")), ("judge tok/judgement", _m("judge_tokens_per_judgement")),
    ("unparseable", _m("judge_unparseable_frac", pct=True)), ("judge batch", _m("reward_batch_mean")),
    ("judge idle", _m("judge_idle_frac", pct=True)), ("engine idle", _m("engine_idle_frac", pct=True)),
    ("trainer idle", _m("trainer_idle_frac", pct=True)),
    ("rollout tok/s", _m("rollout_tokens_per_s")), ("train tok/s", _m("training_tokens_per_s")),
    ("len p50/p99/max", lambda r: "/".join(H.fmt((r.get("lengths") or {}).get(k)) for k in ("p50", "p99", "max"))),
    ("device", lambda r: r["device"]),
]


# ----- the sweep ---------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--judge-model", default=None, choices=sorted(SHAPES), help="the judge's shape (default: --model)")
    p.add_argument("--judge-device", default="auto", help="reward.judge.device: cpu, cuda, cuda:N")
    p.add_argument("--judge-max-new-tokens", type=int, default=64, help="most tokens of one judgement")
    p.add_argument("--judge-samples", type=int, default=1, help="judgements per completion")
    p.add_argument("--judge-batch", type=int, default=64, help="reward.max_batch: trajectories per judge call")
    p.add_argument("--judge-timeout-s", type=float, default=600.0, help="reward.timeout_s: deadline of a judge call")
    p.add_argument("--out", default=f"runs/bench-w4-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    p.add_argument("--staleness", default="0", help="conveyor max_staleness values, comma-separated")
    p.add_argument("--partial-rollouts", default="on", choices=["on", "off", "both"])
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=10,
                   help="rollout batches (loop steps) per configuration; the first 2 are excluded")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--target-mean", type=float, default=256.0, help="mean completion length (stop p = 1/mean)")
    p.add_argument("--lr", type=float, default=1e-6)
    H.add_run_args(p)
    args = p.parse_args(argv)
    args.systems = "conveyor"  # W4 has no TRL peer (w1_throughput.configurations reads this)
    args.judge_model = args.judge_model or args.model
    return args


def build_judge_model(args, out: Path) -> Path:
    from benchmarks.models import build_w1_model
    seed = args.model_seed + 1  # another random model than the policy
    return build_w1_model(out / f"judge-{args.judge_model}-seed{seed}", args.judge_model, seed=seed,
                          dtype="float32" if args.judge_model == "tiny" else "bfloat16")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--peer"]:
        return peer_main(argv[1])
    args = parse_args(argv)
    from benchmarks.w1_throughput import configurations, prepare
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    table = Path(args.table).resolve() if args.table else out / "table.md"
    if args.recollect:
        table.unlink(missing_ok=True)
        for rec in H.recollect(out):  # trajectories.jsonl was written when the run was collected
            w4_extras(rec, json.loads((out / rec["name"] / "spec.json").read_text()))
            H.write_record(out, rec)
            print(H.append_row(table, COLUMNS, rec))
        return 0
    model, prompts, calib = prepare(args, out)
    judge_model = build_judge_model(args, out)
    print(f"EOS bias {calib['eos_bias']:.3f} (expected mean length {calib['expected_mean_length']:.0f} of "
          f"{args.max_new_tokens}); judge {args.judge_model} at {judge_model} on {args.judge_device}, "
          f"{args.judge_samples} x {args.judge_max_new_tokens} tokens per completion", flush=True)
    base_overrides = [f"loop.batch_size={args.prompts}", f"rollout.n={args.group}",
                      f"rollout.max_new_tokens={args.max_new_tokens}", *args.override]
    judge = {"model_path": str(judge_model), "shape": args.judge_model, "device": args.judge_device,
             "max_new_tokens": args.judge_max_new_tokens, "samples": args.judge_samples,
             "max_batch": args.judge_batch, "timeout_s": args.judge_timeout_s}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for system, setting, extra in configurations(args):
            tag = re.sub(r"[^A-Za-z0-9._-]+", "-", setting["label"].replace("=", "")).strip("-")
            name = f"w4-{args.model}-{system}-{tag}-seed{seed}"
            spec = {"workload": "w4", "system": system, "name": name, "run_dir": str(out / name),
                    "model_path": str(model), "prompts_path": str(prompts), "seed": seed, "lr": args.lr,
                    "budget_s": args.budget_s, "max_steps": args.steps, "eos_bias": calib["eos_bias"],
                    "reward_seed": seed, "model_seed": args.model_seed, "judge": judge,
                    "samples_per_step": args.prompts * args.group, "overrides": base_overrides + extra,
                    "setting": setting, "cpu_threads": args.cpu_threads}
            rec = collect(spec, run_peer(spec, deadline_s=args.deadline_s))
            rec["calibration"] = calib
            rec["model"] = args.model
            H.write_record(out, rec)
            H.record_run(rec)
            print(H.append_row(table, COLUMNS, rec), flush=True)
    print(f"\n{table}:\n{table.read_text()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
