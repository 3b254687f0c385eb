"""W2 (learning): conveyor vs TRL GRPOTrainer from one warm-started checkpoint, same wall budget.

    python benchmarks/w2_learning.py --out runs/bench-w2 [--systems conveyor,trl] [--lrs 3e-4,1e-3,3e-3]
        [--seeds 0,1] [--budget-s 120] [--sft-steps 150] [--warmstart DIR] [--override key=value ...]

Contract: warm-starts conveyor's tiny model once with ``conveyor sft`` (or
takes ``--warmstart``, an HF checkpoint directory such as the
``warmstart/`` folder a conveyor run writes), then runs every
(seed, lr, system) configuration in its own subprocess from that same
checkpoint with the same RL wall budget, and evaluates every starting and
final checkpoint with ``benchmarks.evaluate`` (greedy, eval split). Runs
are interleaved (for each seed, for each lr, every system) so that drift in
a shared machine's speed hits all systems alike. Each configuration writes
``<out>/<name>.json`` and one row of ``<out>/table.md``; at the end a
per-(system, lr) summary over seeds is appended. ``--override`` applies
conveyor dotted overrides to the warm-start and to every RL run (TRL reads
the same resolved config).

It knows the sweep and the table layout; what a metric means lives in
``metrics.py``, how each system runs in ``peers/``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402

COLUMNS = [
    ("system", lambda r: r["system"]), ("lr", lambda r: H.fmt(r["config"]["lr"])),
    ("seed", lambda r: str(r["seeds"]["loop"])), ("status", H.status_cell),
    ("steps", lambda r: H.fmt(r["metrics"]["steps"])), ("RL s", lambda r: H.fmt(r["rl_seconds"], 4)),
    ("samples/s", lambda r: H.fmt(r["metrics"]["trained_samples_per_s"])),
    ("median step s", lambda r: H.fmt(r["metrics"]["median_step_s"])),
    ("eval before", lambda r: H.fmt((r.get("eval") or {}).get("before"))),
    ("eval after", lambda r: H.fmt((r.get("eval") or {}).get("after"))),
    ("delta", lambda r: H.fmt((r.get("eval") or {}).get("delta"), 2)),
    ("t to thr s", lambda r: H.fmt(r["metrics"]["time_to_threshold_s"])),
    ("rollout tok/s", lambda r: H.fmt(r["metrics"]["rollout_tokens_per_s"])),
    ("train tok/s", lambda r: H.fmt(r["metrics"]["training_tokens_per_s"])),
    ("engine idle", lambda r: H.fmt(r["metrics"]["engine_idle_frac"], pct=True)),
    ("trainer idle", lambda r: H.fmt(r["metrics"]["trainer_idle_frac"], pct=True)),
    ("sync ms", lambda r: H.fmt(r["metrics"]["weight_sync_ms"])),
    ("len p50/p99/max", lambda r: "/".join(H.fmt(r["lengths"][k]) for k in ("p50", "p99", "max"))),
    ("tau", lambda r: H.fmt(r["lengths"]["tau"])),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=f"runs/bench-w2-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    p.add_argument("--systems", default="conveyor,trl")
    p.add_argument("--lrs", default=None, help="comma-separated learning rates (a sweep); default: the recipe's")
    p.add_argument("--seeds", default="0", help="comma-separated loop seeds")
    p.add_argument("--budget-s", type=float, default=120.0, help="wall seconds of RL per configuration")
    p.add_argument("--max-steps", type=int, default=10_000, help="step cap (the budget usually ends a run first)")
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--warmstart", default=None, help="reuse this HF checkpoint instead of running conveyor sft")
    p.add_argument("--override", action="append", default=[], help="conveyor key=value, for SFT and RL")
    p.add_argument("--threshold", type=float, default=None,
                   help="train-reward level for time-to-threshold (mean over 5 steps)")
    p.add_argument("--slack-s", type=float, default=300.0, help="deadline = budget + slack (start-up, eval)")
    p.add_argument("--table", default=None, help="markdown table to append to (default OUT/table.md)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="intra-op threads of every child (OMP/MKL); on a shared CPU, 1 keeps timings sane")
    p.add_argument("--skip-done", action="store_true",
                   help="keep configurations whose OUT/<name>.json says ok (resume an interrupted sweep)")
    p.add_argument("--recollect", action="store_true",
                   help="run nothing: rebuild OUT's JSON records and table.md from its run directories")
    return p.parse_args(argv)


def _lrs(args) -> list[float]:
    if args.lrs:
        return [float(x) for x in args.lrs.split(",")]
    from benchmarks.workloads import RECIPE
    from conveyor.config import load_config
    return [load_config(RECIPE, list(args.override)).trainer.lr]


def warm_start(args, out: Path) -> Path:
    if args.warmstart:
        return Path(args.warmstart).resolve()
    run_dir = out / "warmstart_run"
    from benchmarks.workloads import RECIPE
    argv = [sys.executable, "-m", "conveyor.cli", "sft", str(RECIPE), f"--output-dir={run_dir}",
            f"sft.steps={args.sft_steps}",
            "observe.progress=false", "observe.tensorboard=false", *args.override]
    outcome = H.run_subprocess(argv, run_dir, deadline_s=max(600.0, 4.0 * args.sft_steps),
                               threads=args.cpu_threads)
    model = run_dir / "warmstart"
    if not (model / "config.json").is_file():
        raise SystemExit(f"warm-start failed ({outcome['status']}): {outcome['error']}; see {run_dir}/stderr.log")
    if outcome["status"] != "ok":  # the checkpoint was written; only the process exit failed
        print(f"note: conveyor sft exited with code {outcome['rc']} after writing {model}: {outcome['error']}")
    return model.resolve()


def summary_rows(records: list[dict]) -> list[str]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["system"], r["config"]["lr"]), []).append(r)
    lines = ["", "Mean over seeds (ok runs only; +- is half the range):", "",
             "| system | lr | runs ok | eval delta | eval after | samples/s | steps |", "|---|---|---|---|---|---|---|"]

    def mean_pm(vals):
        vals = [v for v in vals if v is not None]
        if not vals:
            return "n/a"
        return f"{statistics.mean(vals):.3f} +- {(max(vals) - min(vals)) / 2:.3f}"

    for (system, lr), rs in sorted(groups.items()):
        ok = [r for r in rs if r["status"] == "ok"]
        lines.append(f"| {system} | {lr:g} | {len(ok)}/{len(rs)} | {mean_pm([r['eval']['delta'] for r in ok])} | "
                     f"{mean_pm([r['eval']['after'] for r in ok])} | "
                     f"{mean_pm([r['metrics']['trained_samples_per_s'] for r in ok])} | "
                     f"{mean_pm([r['metrics']['steps'] for r in ok])} |")
    return lines


def rewrite(out: Path, table: Path, records: list[dict]) -> int:
    table.unlink(missing_ok=True)
    for rec in records:
        H.write_record(out, rec)
        print(H.append_row(table, COLUMNS, rec))
    with table.open("a", encoding="utf-8") as f:
        f.write("\n".join(summary_rows(records)) + "\n")
    print("\n".join(summary_rows(records)))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    table = Path(args.table).resolve() if args.table else out / "table.md"
    if args.recollect:
        return rewrite(out, table, H.recollect(out, args.threshold))
    model = warm_start(args, out)
    records, before = [], None
    for seed in [int(s) for s in args.seeds.split(",")]:
        for lr in _lrs(args):
            for system in args.systems.split(","):
                name = f"w2-{system}-lr{lr:g}-seed{seed}"
                spec = {"workload": "w2", "system": system, "name": name, "run_dir": str(out / name),
                        "model_path": str(model), "seed": seed, "lr": lr, "budget_s": args.budget_s,
                        "max_steps": args.max_steps, "overrides": list(args.override),
                        "setting": {"lr": lr}, "model_seed": 0,
                        "cpu_threads": args.cpu_threads}
                done = H.load_done(out, name) if args.skip_done else None
                if done is not None:
                    records.append(done)
                    print(H.append_row(table, COLUMNS, done), flush=True)
                    continue
                if before is None:
                    before = H.evaluate_start(spec, out, deadline_s=args.slack_s)
                    print(f"starting checkpoint {model}: held-out reward {before['eval_reward']:.3f}", flush=True)
                outcome = H.run_peer(spec, deadline_s=(args.budget_s or 3600.0) + args.slack_s)
                rec = H.collect_safely(spec, outcome, threshold=args.threshold, eval_before=before)
                H.write_record(out, rec)
                H.record_run(rec)
                records.append(rec)
                print(H.append_row(table, COLUMNS, rec), flush=True)
    lines = summary_rows(records)
    with table.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    (out / "index.json").write_text(json.dumps([r["name"] for r in records], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
