"""W3 (agentic, multi-turn): conveyor streaming vs synchronous with a slow environment, W1's model and prompts.

    python benchmarks/w3_agentic.py --model qwen2.5-0.5b --out runs/bench-w3            # 1 GPU
    python benchmarks/w3_agentic.py --model qwen2.5-0.5b --staleness 0,1,2 \
        --sync-override launch.trainer_ranks=2 --sync-override launch.engines=2 \
        --async-override launch.placement=disaggregated --out runs/bench-w3-2gpu        # 2 GPUs
    python benchmarks/w3_agentic.py --model tiny --steps 3 --prompts 4 --group 4 --prompt-len 16 \
        --max-new-tokens 16 --target-mean 4 --latency-median-s 0.05 --cpu-threads 1 \
        --out /tmp/w3-cpu                                                              # CPU smoke

Contract: BENCHMARKS.md's W3. Builds W1's model and random-id prompts and
calibrates the EOS bias for ``--max-new-tokens`` per turn (256, target mean
64: W1's tail at a quarter of the scale), ONCE (``w1_throughput.prepare``);
then runs conveyor at each ``--staleness`` (0 = synchronous, the others
streaming with ``--partial-rollouts``) on episodes of ``--turns`` model
turns with ``benchmarks.w3_env:LatencyEnv`` (seeded log-normal step
latency, median ``--latency-median-s``, p99 ``--latency-p99-s``;
observations of ``--obs-tokens`` random ids, loss-masked; the hash of the
episode's actions as the reward at its last step). Every configuration runs
in its own subprocess with a deadline (``python -m benchmarks.w3_agentic
--peer SPEC.json``: ``peers/conveyor_peer.py`` with W3's RunConfig) and
writes ``<out>/<name>.json``, a row of ``<out>/table.md`` and one line of
``benchmarks/results/w3[_cpu].jsonl``; the streaming / synchronous ratios
follow the rows.

Reported: W1's metrics (trained samples/s, step time, each role's idle
fraction, weight sync, staleness, MFU) with rollout tokens/s and MBU counted
on the policy's tokens only (observation tokens are prefilled, not decoded);
``lengths`` are per-turn policy lengths (the calibrated tail) and
``episode_lengths`` whole completions (observations included); environment
step latency p50 / p99 / max as measured by the episodes (``TurnRecord.env_s``:
the pool's overhead included) and as drawn (the env's log); the engines'
mean decode rows and that over the rows each engine is given per step, the
decode step's milliseconds and the share of engine time in prefill (every
turn re-submits the episode's whole context), and the fraction of decode time
in steps of at most half the rows each engine is given per step (the engines
count decode time by rows in powers of two, so half is rounded down to one).

It knows W3's shape and its table; metrics live in ``metrics.py``, the
environment in ``w3_env.py``, the system in ``peers/conveyor_peer.py``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from benchmarks import metrics as M  # noqa: E402
from benchmarks import w3_env as E  # noqa: E402
from benchmarks import workloads as W  # noqa: E402
from benchmarks.bounds import SHAPES  # noqa: E402
from benchmarks.lengths import length_stats  # noqa: E402

ENV = "benchmarks.w3_env:LatencyEnv"
DRAWS = "env_draws.jsonl"  # the env's log of its latency draws, in each run directory


# ----- W3's RunConfig ----------------------------------------------------------------------------
def w3_config(spec: dict):
    """W1's RunConfig (model, prompts, EOS bias, optimizer, loss) with W3's environment as the episodes
    and its return (the hash of the actions at the last turn) as the recorded reward."""
    run_dir = Path(spec["run_dir"])
    env_kwargs = {**spec["env"], "tokenizer": spec["model_path"], "reward_seed": int(spec.get("reward_seed", 0)),
                  "log_path": str(run_dir / DRAWS)}
    return W.w1_based(spec, [
        W._kv("env.name", ENV), W._kv("env.kwargs", env_kwargs),
        W._kv("reward.fn", "benchmarks.w3_env:conveyor_env_return"),
        W._kv("reward.kwargs", {"log_path": str(run_dir / W.TRAJECTORIES)}),
    ], name="w3")


def run_config(spec: dict):
    """``workloads.run_config`` that also knows W3."""
    return w3_config(spec) if spec["workload"] == "w3" else W.run_config(spec)


# harness.collect (this process) and the conveyor peer (its subprocess) read the RunConfig through
# their module-level ``run_config``; W3 is not in workloads.run_config, so both get this one.
H.run_config = run_config


def peer_main(spec_path: str) -> int:
    """The subprocess of one configuration: ``peers/conveyor_peer.py`` on W3's RunConfig."""
    return H.conveyor_peer_main(run_config, spec_path)


def run_peer(spec: dict, deadline_s: float) -> dict:
    return H.run_peer_module("benchmarks.w3_agentic", spec, deadline_s)


# ----- W3's metrics on top of W1's ---------------------------------------------------------------
def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {"count": 0, "p50": None, "p99": None, "max": None, "mean": None}
    s = sorted(xs)
    st = length_stats(s)  # nearest-rank percentiles, as every length column
    return {"count": len(s), "p50": st["p50"], "p99": st["p99"], "max": st["max"], "mean": st["mean"]}


def w3_extras(rec: dict, spec: dict) -> dict:
    """Add W3's columns to a harness record (in place): environment latency, per-turn lengths,
    policy-token rollout rate, engine rows. Missing inputs give None, never an exception."""
    run_dir = Path(spec["run_dir"])
    rows = [t for t in H._read_jsonl(run_dir / W.TRAJECTORIES) if t.get("split", "train") == "train"]
    draws = H._read_jsonl(run_dir / DRAWS)
    m = rec.setdefault("metrics", {})
    cap = spec.get("max_new_tokens_per_turn")
    env_s = _pcts([s for t in rows for s in t.get("env_s", [])])
    drawn = _pcts([d["latency_s"] for d in draws])
    m.update({f"env_step_{k}_s": env_s[k] for k in ("p50", "p99", "max", "mean")})
    m["env_steps"] = env_s["count"]
    m.update({f"env_draw_{k}_s": drawn[k] for k in ("p50", "p99", "max", "mean")})
    m["env_draws"] = drawn["count"]
    m["turns_mean"] = sum(t.get("turns", 0) for t in rows) / len(rows) if rows else None
    m["episodes_finished_frac"] = sum(t.get("finish") == "stop" for t in rows) / len(rows) if rows else None
    m["reward_mean"] = sum(t["reward"] for t in rows) / len(rows) if rows else None
    # Lengths: the calibrated tail is per turn; whole completions carry the observations too.
    rec["episode_lengths"] = m["episode_lengths"] = length_stats([t["completion_len"] for t in rows])
    rec["lengths"] = length_stats([n for t in rows for n in t.get("turn_lens", [])], cap)
    # Rollout tokens/s and MBU on the policy's tokens (decoded), over the steady window.
    sps = (rec.get("config") or {}).get("samples_per_step") or spec.get("samples_per_step")
    busy = (m.get("seconds") or {}).get("engine_busy")
    win = m.get("window")
    m["sequence_tokens_per_s"] = m.get("rollout_tokens_per_s")  # the harness's count: observations included
    if sps and busy and win and m.get("steps"):
        chunks = M.per_step_trajs(rows, sps, m["steps"])[win[0] - 1:win[1]]
        tokens = sum(t.get("policy_len", t["completion_len"]) for c in chunks for t in c)
        m["rollout_tokens_per_s"] = tokens / busy if chunks else None
        bound = (rec.get("bounds") or {}).get("decode_bound_tokens_per_s")
        m["mbu"] = m["rollout_tokens_per_s"] / bound if bound and m["rollout_tokens_per_s"] else None
    # Engine rows: the mean rows of a decode step over the rows each engine is given per step.
    engines = m.get("engines") or 0
    mean_rows = m.get("engine_batch_mean")
    m["engine_batch_frac"] = mean_rows / (sps / engines) if mean_rows and sps and engines else None
    # Decode time in steps of at most half an engine's rows (the loop's engine_low_rows_frac, median step).
    m["engine_lt_half_rows_frac"] = m.get("engine_low_rows_frac")
    # The environment pool's counters, where the loop logs them (env_<counter> in metrics.jsonl).
    steps = [r for r in H._read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    last = steps[-1] if steps else {}
    m["env_counters"] = {k[4:]: v for k, v in last.items() if k.startswith("env_")} or None
    m["groups_dropped"] = last.get("groups_dropped", 0) if steps else None
    rec.setdefault("config", {})["env"] = spec.get("env")  # record_run carries it to the results line
    return rec


# ----- the table ---------------------------------------------------------------------------------
def _hist(r: dict) -> str:
    h = r["metrics"].get("staleness", {}).get("histogram") or {}
    return " ".join(f"{k}:{v}" for k, v in h.items()) or "n/a"


def _m(key: str, pct: bool = False):
    return lambda r: H.fmt(r["metrics"].get(key), pct=pct)


def _pair(a: str, b: str):
    return lambda r: "/".join(H.fmt(r["metrics"].get(k)) for k in (a, b))


COLUMNS = [
    ("system", lambda r: r["system"]), ("setting", lambda r: r["setting"].get("label", "")),
    ("seed", lambda r: str(r["seeds"]["loop"])), ("status", H.status_cell),
    ("steps", _m("steps")), ("samples/s", _m("trained_samples_per_s")), ("median step s", _m("median_step_s")),
    ("engine idle", _m("engine_idle_frac", pct=True)), ("trainer idle", _m("trainer_idle_frac", pct=True)),
    ("env step p50/p99 s", _pair("env_step_p50_s", "env_step_p99_s")),
    ("drawn p50/p99/max s", lambda r: "/".join(H.fmt(r["metrics"].get(f"env_draw_{k}_s"))
                                               for k in ("p50", "p99", "max"))),
    ("turns", _m("turns_mean")),
    ("turn len p50/p99/max", lambda r: "/".join(H.fmt(r["lengths"].get(k)) for k in ("p50", "p99", "max"))),
    ("turn tau", lambda r: H.fmt(r["lengths"].get("tau"))),
    ("episode tok mean", lambda r: H.fmt((r.get("episode_lengths") or {}).get("mean"))),
    ("rollout tok/s", _m("rollout_tokens_per_s")), ("MBU", _m("mbu", pct=True)),
    ("train tok/s", _m("training_tokens_per_s")), ("MFU", _m("mfu", pct=True)),
    ("engine batch", _m("engine_batch_mean")), ("batch frac", _m("engine_batch_frac", pct=True)),
    ("decode step ms", _m("engine_step_ms")), ("prefill", _m("engine_prefill_frac", pct=True)),
    ("<half rows", lambda r: H.fmt(r["metrics"].get("engine_lt_half_rows_frac"), pct=True)),
    ("sync ms", _m("weight_sync_ms")), ("staleness", _hist),
    ("device", lambda r: r["device"]),
]


def ratio_lines(records: list[dict]) -> list[str]:
    ok = [r for r in records if r["status"] == "ok" and r["metrics"].get("trained_samples_per_s")]
    lines = []
    for r in ok:
        if r["setting"].get("max_staleness", 0) == 0:
            continue
        base = [b for b in ok if b["setting"].get("max_staleness", 0) == 0 and b["seeds"]["loop"] == r["seeds"]["loop"]]
        if base:
            x = r["metrics"]["trained_samples_per_s"] / base[0]["metrics"]["trained_samples_per_s"]
            lines.append(f"- {r['setting'].get('label')} / {base[0]['setting'].get('label')}, seed "
                         f"{r['seeds']['loop']}: {x:.2f}x (turn tau {H.fmt(r['lengths'].get('tau'))}, env step p99 "
                         f"{H.fmt(r['metrics'].get('env_step_p99_s'))} s)")
    return ["", "Trained samples/s, streaming / synchronous (same seed, same machine):", "", *lines] if lines else []


def _append_ratios(table: Path, records: list[dict]) -> None:
    lines = ratio_lines(records)
    if lines:
        with table.open("a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))


# ----- the sweep ---------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--out", default=f"runs/bench-w3-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    p.add_argument("--staleness", default="0,1,2", help="conveyor max_staleness values (0 = synchronous)")
    p.add_argument("--partial-rollouts", default="on", choices=["on", "off", "both"])
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=10,
                   help="rollout batches (loop steps) per configuration; the first 2 are excluded")
    p.add_argument("--prompts", type=int, default=32, help="episodes' tasks per step")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens of one turn")
    p.add_argument("--target-mean", type=float, default=64.0, help="mean turn length (stop p = 1/mean)")
    p.add_argument("--turns", type=int, default=4, help="model turns per episode (the env ends it at the last)")
    p.add_argument("--obs-tokens", type=int, default=32, help="random token ids per observation")
    p.add_argument("--latency-median-s", type=float, default=E.MEDIAN_S)
    p.add_argument("--latency-p99-s", type=float, default=None,
                   help=f"p99 of an environment step (default: {E.P99_S / E.MEDIAN_S:.3g} x the median, 2 s at 0.3 s)")
    p.add_argument("--env-seed", type=int, default=0, help="seed of the latency and observation draws")
    p.add_argument("--shared-latency", action="store_true",
                   help="key latencies by (task, turn) only: every episode of a group waits the same")
    p.add_argument("--env-concurrency", type=int, default=0,
                   help="env.concurrency; 0 = every episode in flight (prompts x group x (staleness + 1), >= 256)")
    p.add_argument("--step-timeout-s", type=float, default=120.0, help="env.step_timeout_s (far above the draws)")
    p.add_argument("--lr", type=float, default=1e-6)
    H.add_run_args(p)
    args = p.parse_args(argv)
    args.systems = "conveyor"  # W3 has no TRL peer (w1_throughput.configurations reads this)
    return args


def env_kwargs(args) -> dict:
    p99 = args.latency_p99_s or args.latency_median_s * E.P99_S / E.MEDIAN_S
    sigma = E.sigma_for(args.latency_median_s, p99) if args.latency_median_s > 0 else 0.0
    return {"turns": args.turns, "median_s": args.latency_median_s, "sigma": sigma, "obs_tokens": args.obs_tokens,
            "seed": args.env_seed, "per_episode": not args.shared_latency}


def seeded_max_latency(args, tasks: int) -> float:
    """The longest step any episode of the prompts file can draw (task ids ``train-<row>``)."""
    kw = env_kwargs(args)
    if kw["median_s"] <= 0:
        return 0.0
    episodes = [None] if args.shared_latency else list(range(args.group))
    return max(E.latency(kw["seed"], f"train-{i}", k, t, kw["median_s"], kw["sigma"])
               for i in range(tasks) for k in episodes for t in range(args.turns))


def prepare(args, out: Path):
    from benchmarks import w1_throughput
    calib = out / "calibration.json"
    if calib.is_file():  # a calibration for other lengths is not this run's
        c = json.loads(calib.read_text())
        if c.get("target_mean") != args.target_mean or c.get("max_new_tokens") != args.max_new_tokens:
            calib.unlink()
    model, prompts, calib = w1_throughput.prepare(args, out)
    E.check_observation_roundtrip(str(model), args.obs_tokens)
    return model, prompts, calib


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--peer"]:
        return peer_main(argv[1])
    args = parse_args(argv)
    from benchmarks.w1_throughput import configurations
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    table = Path(args.table).resolve() if args.table else out / "table.md"
    if args.recollect:
        table.unlink(missing_ok=True)
        records = []
        for rec in H.recollect(out):
            spec = json.loads((out / rec["name"] / "spec.json").read_text())
            records.append(w3_extras(rec, spec))
            H.write_record(out, rec)
            print(H.append_row(table, COLUMNS, rec))
        _append_ratios(table, records)
        return 0
    model, prompts, calib = prepare(args, out)
    print(f"EOS bias {calib['eos_bias']:.3f} (stop p {calib['unbiased_stop_p_mean']:.2e} -> "
          f"{calib['target_stop_p']:.4f}; expected mean turn length {calib['expected_mean_length']:.0f} of "
          f"{args.max_new_tokens})", flush=True)
    tasks = (args.steps + 8) * args.prompts
    worst = seeded_max_latency(args, tasks)
    kw = env_kwargs(args)
    print(f"environment: {args.turns} turns, step latency log-normal median {kw['median_s']:.3g} s sigma "
          f"{kw['sigma']:.3f} (p99 {kw['median_s'] * math.exp(E.Z99 * kw['sigma']):.3g} s); longest seeded "
          f"step over the prompts file {worst:.2f} s; env.step_timeout_s {args.step_timeout_s:g}", flush=True)
    if worst >= args.step_timeout_s:
        raise SystemExit(f"--step-timeout-s {args.step_timeout_s:g} is not above the longest seeded step "
                         f"({worst:.2f} s); raise it")
    base_overrides = [f"loop.batch_size={args.prompts}", f"rollout.n={args.group}",
                      f"rollout.max_new_tokens={args.max_new_tokens}", f"env.max_turns={args.turns}",
                      f"env.step_timeout_s={args.step_timeout_s}", "env.reset_timeout_s=120",
                      f"env.max_observation_tokens={max(256, args.obs_tokens)}", *args.override]
    records = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for system, setting, extra in configurations(args):
            k = setting.get("max_staleness", 0)
            conc = args.env_concurrency or max(256, args.prompts * args.group * (k + 1))
            tag = re.sub(r"[^A-Za-z0-9._-]+", "-", setting["label"].replace("=", "")).strip("-")
            name = f"w3-{args.model}-{system}-{tag}-seed{seed}"
            spec = {"workload": "w3", "system": system, "name": name, "run_dir": str(out / name),
                    "model_path": str(model), "prompts_path": str(prompts), "seed": seed, "lr": args.lr,
                    "budget_s": args.budget_s, "max_steps": args.steps, "eos_bias": calib["eos_bias"],
                    "reward_seed": seed, "model_seed": args.model_seed,
                    "max_new_tokens_per_turn": args.max_new_tokens, "samples_per_step": args.prompts * args.group,
                    "env": env_kwargs(args), "overrides": base_overrides + [f"env.concurrency={conc}"] + extra,
                    "setting": setting, "cpu_threads": args.cpu_threads}
            outcome = run_peer(spec, deadline_s=args.deadline_s)
            rec = w3_extras(H.collect_safely(spec, outcome), spec)
            rec["calibration"] = calib
            rec["model"] = args.model
            H.write_record(out, rec)
            H.record_run(rec)
            records.append(rec)
            print(H.append_row(table, COLUMNS, rec), flush=True)
    _append_ratios(table, records)
    print(f"\n{table}:\n{table.read_text()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
