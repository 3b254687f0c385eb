"""DAPO vs the default recipe on the default task: held-out gain and wall time, paired seeds.

    python benchmarks/dapo_gain.py --out runs/bench-dapo [--seeds 0,1] [--steps 20] [--override key=value ...]

Contract: for each seed, runs the built-in default recipe and recipes/dapo.yaml
one after the other (same seed, same ``loop.steps``, so the same warm-start and
the same number of optimizer steps), each through ``conveyor.api.train`` in
this process, and reads each run's ``summary.json`` and last step's metrics.
Writes ``<out>/table.md`` (one row per run: held-out greedy and sampled reward
after the warm-start and after RL, RL's gain, RL seconds, wall seconds, the
last step's share of groups without signal and dynamic sampling's drop
fraction; a run that stopped, the steps it trained and its error) and
``<out>/results.json``. ``--override`` applies dotted overrides
to both recipes (e.g. ``sft.steps=100`` for a smoke run). On a shared CPU,
run it under the machine's lock so the wall times compare.

It knows the two recipes and the table; what the recipes do lives in them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `conveyor` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from conveyor.api import load_config, train
from conveyor.observe.report import read_metrics

DAPO = Path(__file__).resolve().parent.parent / "recipes" / "dapo.yaml"
RECIPES = {"default": None, "dapo": DAPO}
COLUMNS = ("recipe", "seed", "greedy warm", "greedy final", "greedy gain", "sampled warm", "sampled final",
           "sampled gain", "RL s", "wall s", "no-signal last", "drop frac last")


def run_one(name: str, seed: int, steps: int, overrides: list[str], out: Path) -> dict:
    over = [f"loop.seed={seed}", f"loop.steps={steps}", f"loop.eval_every={max(steps // 2, 1)}",
            "observe.progress=false", "observe.tensorboard=false", *overrides]
    run_dir = out / f"{name}-seed{seed}"
    try:
        train(load_config(RECIPES[name], over), run_dir=run_dir)
    except Exception as e:  # noqa: BLE001 - a run that stops (e.g. no learning signal left) is a result
        trained = read_metrics(run_dir, kind="train")
        return {"recipe": name, "seed": seed, "steps": len(trained), "error": str(e).splitlines()[0]}
    s = json.loads((run_dir / "summary.json").read_text())
    last = read_metrics(run_dir, kind="train")[-1]
    return {"recipe": name, "seed": seed, "steps": s["steps"],
            "greedy_warm": s["eval_reward_warmstart"], "greedy_final": s["eval_reward_final"],
            "sampled_warm": s["eval_sampled_reward_warmstart"], "sampled_final": s["eval_sampled_reward_final"],
            "rl_s": s["rl_seconds"], "wall_s": s["wall_seconds"],
            "no_signal_last": last.get("groups_without_signal"),
            "drop_frac_last": last.get("dynamic_sampling/drop_frac")}


def row(r: dict) -> str:
    if "error" in r:
        return f"| {r['recipe']} | {r['seed']} | stopped after {r['steps']} steps: {r['error']} |"

    def f(x, d=3):
        return "-" if x is None else f"{x:.{d}f}"
    cells = [r["recipe"], str(r["seed"]), f(r["greedy_warm"]), f(r["greedy_final"]),
             f"{r['greedy_final'] - r['greedy_warm']:+.3f}", f(r["sampled_warm"]), f(r["sampled_final"]),
             f"{r['sampled_final'] - r['sampled_warm']:+.3f}", f(r["rl_s"], 0), f(r["wall_s"], 0),
             f(r["no_signal_last"], 2), f(r["drop_frac_last"], 2)]
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench-dapo")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--override", action="append", default=[], help="dotted override for both recipes")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in (int(s) for s in a.seeds.split(",")):
        for name in RECIPES:
            results.append(run_one(name, seed, a.steps, a.override, out))
            (out / "results.json").write_text(json.dumps(results, indent=1))
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)] + [row(r) for r in results]
    (out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
