"""W1 (systems throughput): conveyor vs TRL GRPOTrainer on a random-init Qwen2.5 shape, heavy-tail lengths.

    python benchmarks/w1_throughput.py --model qwen2.5-0.5b --out runs/bench-w1      # GPU
    python benchmarks/w1_throughput.py --model qwen2.5-1.5b --out runs/bench-w1-1.5b # GPU
    python benchmarks/w1_throughput.py --model tiny --prompt-len 16 --max-new-tokens 64 \
        --target-mean 16 --prompts 4 --group 4 --steps 4 --out runs/bench-w1-cpu    # CPU smoke

Contract: builds the model (seeded random init, bf16; float32 for
``tiny``), writes the random-id prompts, calibrates the EOS bias ONCE
(``lengths.py``, in a subprocess) and hands the same model, prompts and bias
to every configuration: TRL, and conveyor at each ``--staleness`` value
(0 = synchronous; >0 needs conveyor's asynchronous mode) with
``--partial-rollouts``. Every configuration runs in its own subprocess with
a deadline; each writes ``<out>/<name>.json`` and a row of
``<out>/table.md``, and the end-to-end ratios against TRL and against
conveyor's synchronous mode are appended after the rows.

It knows the workload's shape and the table layout; metrics live in
``metrics.py``, systems in ``peers/``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from benchmarks.bounds import SHAPES  # noqa: E402


def _hist(r: dict) -> str:
    h = r["metrics"].get("staleness", {}).get("histogram") or {}
    return " ".join(f"{k}:{v}" for k, v in h.items()) or "n/a"


COLUMNS = [
    ("system", lambda r: r["system"]), ("setting", lambda r: r["setting"].get("label", "")),
    ("seed", lambda r: str(r["seeds"]["loop"])), ("status", H.status_cell),
    ("steps", lambda r: H.fmt(r["metrics"]["steps"])),
    ("samples/s", lambda r: H.fmt(r["metrics"]["trained_samples_per_s"])),
    ("median step s", lambda r: H.fmt(r["metrics"]["median_step_s"])),
    ("rollout tok/s", lambda r: H.fmt(r["metrics"]["rollout_tokens_per_s"])),
    ("MBU", lambda r: H.fmt(r["metrics"]["mbu"], pct=True)),
    ("train tok/s", lambda r: H.fmt(r["metrics"]["training_tokens_per_s"])),
    ("MFU", lambda r: H.fmt(r["metrics"]["mfu"], pct=True)),
    ("engine idle", lambda r: H.fmt(r["metrics"]["engine_idle_frac"], pct=True)),
    ("trainer idle", lambda r: H.fmt(r["metrics"]["trainer_idle_frac"], pct=True)),
    ("sync ms", lambda r: H.fmt(r["metrics"]["weight_sync_ms"])),
    ("announce ms", lambda r: H.fmt(r["metrics"].get("weight_announce_ms"))),
    ("transfer ms", lambda r: H.fmt(r["metrics"].get("weight_transfer_ms"))),
    ("publish ms", lambda r: H.fmt(r["metrics"].get("weight_publish_ms"))),
    ("pause ms", lambda r: H.fmt(r["metrics"].get("weight_pause_ms"))),
    ("engine batch", lambda r: H.fmt(r["metrics"].get("engine_batch_mean"))),
    ("decode step ms", lambda r: H.fmt(r["metrics"].get("engine_step_ms"))),
    ("prefill", lambda r: H.fmt(r["metrics"].get("engine_prefill_frac"), pct=True)),
    ("staleness", _hist),
    ("len p50/p99/max", lambda r: "/".join(H.fmt(r["lengths"][k]) for k in ("p50", "p99", "max"))),
    ("tau", lambda r: H.fmt(r["lengths"]["tau"])),
    ("decode bound tok/s", lambda r: H.fmt(r["bounds"]["decode_bound_tokens_per_s"])),
    ("train bound tok/s", lambda r: H.fmt(r["bounds"]["train_bound_tokens_per_s"])),
    ("device", lambda r: r["device"]),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--out", default=f"runs/bench-w1-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    p.add_argument("--systems", default="conveyor,trl")
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
    p.add_argument("--trl-micro-batch", type=int, default=16, help="TRL sequences per forward/backward")
    H.add_run_args(p)
    return p.parse_args(argv)


def prepare(args, out: Path) -> tuple[Path, Path, dict]:
    from benchmarks.models import FIRST_WORD_ID, build_w1_model, check_prompt_roundtrip, write_prompts
    model = build_w1_model(out / f"model-{args.model}-seed{args.model_seed}", args.model, seed=args.model_seed,
                           dtype="float32" if args.model == "tiny" else "bfloat16")
    prompts = write_prompts(out / "prompts.jsonl", (args.steps + 8) * args.prompts, args.prompt_len,
                            SHAPES[args.model].vocab, seed=args.model_seed)
    check_prompt_roundtrip(model, prompts, args.prompt_len)
    calib_path = out / "calibration.json"
    if not calib_path.is_file():
        argv = [sys.executable, "-m", "benchmarks.lengths", str(model), "--target-mean", str(args.target_mean),
                "--max-new-tokens", str(args.max_new_tokens), "--prompt-len", str(args.prompt_len),
                "--vocab-low", str(FIRST_WORD_ID), "--out", str(calib_path)]
        outcome = H.run_subprocess(argv, out / "calibration", deadline_s=1800, threads=args.cpu_threads)
        if outcome["status"] != "ok":
            raise SystemExit(f"EOS-bias calibration failed: {outcome['error']}; see {out}/calibration/stderr.log")
    return model, prompts, json.loads(calib_path.read_text())


def configurations(args) -> list[tuple[str, dict, list[str]]]:
    """(system, setting, extra overrides) for every configuration of one seed."""
    out = []
    partial = {"on": [True], "off": [False], "both": [True, False]}[args.partial_rollouts]
    for system in args.systems.split(","):
        if system != "conveyor":
            out.append((system, {"label": "sync"}, []))
            continue
        for k in [int(s) for s in args.staleness.split(",")]:
            for pr in partial if k > 0 else [True]:
                label = "sync" if k == 0 else f"async s={k}{'' if pr else ' no-partial'}"
                launch = args.async_override if k > 0 else args.sync_override
                if launch:
                    label += " [" + " ".join(o.split(".", 1)[-1] for o in launch) + "]"
                out.append((system, {"label": label, "max_staleness": k, "partial_rollouts": pr, "launch": launch},
                            [f"loop.max_staleness={k}", f"loop.partial_rollouts={str(pr).lower()}", *launch]))
    return out


def ratio_lines(records: list[dict]) -> list[str]:
    ok = [r for r in records if r["status"] == "ok" and r["metrics"]["trained_samples_per_s"]]
    lines = ["", "Trained samples/s ratios (same seed, same machine):", ""]
    for r in ok:
        for base_sys, base_label in (("trl", "sync"), ("conveyor", "sync")):
            base = [b for b in ok if b["system"] == base_sys and b["setting"].get("label") == base_label
                    and b["seeds"]["loop"] == r["seeds"]["loop"] and b is not r]
            if base and not (r["system"] == "trl"):
                x = r["metrics"]["trained_samples_per_s"] / base[0]["metrics"]["trained_samples_per_s"]
                lines.append(f"- {r['system']} {r['setting'].get('label')} / {base_sys} {base_label}, seed "
                             f"{r['seeds']['loop']}: {x:.2f}x (tau {H.fmt(r['lengths']['tau'])})")
    return lines if len(lines) > 3 else []


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    table = Path(args.table).resolve() if args.table else out / "table.md"
    if args.recollect:
        table.unlink(missing_ok=True)
        records = H.recollect(out)
        for rec in records:
            H.write_record(out, rec)
            print(H.append_row(table, COLUMNS, rec))
        _append_ratios(table, records)
        return 0
    model, prompts, calib = prepare(args, out)
    print(f"EOS bias {calib['eos_bias']:.3f} (stop p {calib['unbiased_stop_p_mean']:.2e} -> "
          f"{calib['target_stop_p']:.4f}; expected mean length {calib['expected_mean_length']:.0f})", flush=True)
    base_overrides = [f"loop.batch_size={args.prompts}", f"rollout.n={args.group}",
                      f"rollout.max_new_tokens={args.max_new_tokens}", *args.override]
    records = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for system, setting, extra in configurations(args):
            # Run names become directory names: letters, digits, "._-" only.
            tag = re.sub(r"[^A-Za-z0-9._-]+", "-", setting["label"].replace("=", "")).strip("-")
            name = f"w1-{args.model}-{system}-{tag}-seed{seed}"
            spec = {"workload": "w1", "system": system, "name": name, "run_dir": str(out / name),
                    "model_path": str(model), "prompts_path": str(prompts), "seed": seed, "lr": args.lr,
                    "budget_s": args.budget_s, "max_steps": args.steps, "eos_bias": calib["eos_bias"],
                    "reward_seed": seed, "trl_micro_batch": args.trl_micro_batch, "model_seed": args.model_seed,
                    "overrides": base_overrides + extra, "setting": setting,
                    "cpu_threads": args.cpu_threads}
            outcome = H.run_peer(spec, deadline_s=args.deadline_s)
            rec = H.collect_safely(spec, outcome)
            rec["calibration"] = calib
            rec["model"] = args.model
            H.write_record(out, rec)
            H.record_run(rec)
            records.append(rec)
            print(H.append_row(table, COLUMNS, rec), flush=True)
    _append_ratios(table, records)
    return 0


def _append_ratios(table: Path, records: list[dict]) -> None:
    lines = ratio_lines(records)
    if lines:
        with table.open("a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
