"""Variants of a recipe over several seeds, as concurrent ``conveyor train`` runs: the held-out curve of each.

    python benchmarks/recipe_sweep.py recipes/smollm2-addition.yaml --variants VARIANTS.txt \
        --seeds 0,1,2,3,4 --concurrency 10 --override rollout.kv_blocks=3000 --out runs/sweep

VARIANTS.txt has one variant a line, ``name|key=value key=value ...`` (conveyor overrides, split
as a shell splits words, so a value with spaces is quoted; an empty right side is the recipe
itself; ``#`` starts a comment). Every variant runs once per seed
(``loop.seed``), at most ``--concurrency`` at a time; on one GPU give each run a fixed KV pool
(``rollout.kv_blocks``), since ``rollout.kv_fraction`` is a share of the memory free when a run
starts. A small model on a large GPU runs ten at a time (SmolLM2-135M on one H200: 100 steps of
16 x 8 in about 130 s each, ten together). Runs still going at ``--deadline-s`` are stopped and
recorded as such.

Each run appends one record to ``benchmarks/results/recipe_sweep[_cpu].jsonl``: the variant, its
overrides and seed, the held-out reward at every evaluation, steps, trained samples, mean
completion length, median step seconds, and the exit status. A table of the held-out reward at the
last evaluation, per variant and seed with the mean, is printed and written to OUT/table.md.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import append_record  # noqa: E402
from conveyor.observe.report import METRICS_FILE, read_metrics  # noqa: E402


@dataclass
class Run:
    variant: str
    overrides: list[str]
    seed: int
    run_dir: Path
    proc: subprocess.Popen | None = None
    status: str = "not started"
    metrics: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.variant}-s{self.seed}"


def read_variants(path: Path) -> list[tuple[str, list[str]]]:
    variants = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if "|" not in line:
            raise SystemExit(f"{path}:{n}: write a variant as name|key=value ...; got {line!r}")
        name, overrides = line.split("|", 1)
        try:
            variants.append((name.strip(), shlex.split(overrides)))
        except ValueError as e:  # an unclosed quote
            raise SystemExit(f"{path}:{n}: {e} in {overrides.strip()!r}; close the quote") from None
    if not variants:
        raise SystemExit(f"{path}: no variants in it; write one a line as name|key=value ...")
    return variants


def summarize(run_dir: Path) -> dict:
    """The held-out curve and step statistics of a run directory's metrics.jsonl (empty if none)."""
    if not (run_dir / METRICS_FILE).is_file():
        return {}
    rows = read_metrics(run_dir)  # a run stopped at the deadline may end in a torn line: dropped
    train = [r for r in rows if r.get("kind") == "train"]
    out: dict = {"held_out": {str(r["step"]): r["eval_reward"] for r in rows if r.get("kind") == "eval"},
                 "steps": len(train)}
    if train:
        out.update(trained_samples=int(sum(r.get("num_seqs", 0) for r in train)),
                   response_len_mean=statistics.fmean(r["response_len"] for r in train),
                   step_s_median=statistics.median(r["time/step"] for r in train))
    return out


def table(runs: list[Run]) -> str:
    seeds = sorted({r.seed for r in runs})
    lines = ["| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---" * (len(seeds) + 2) + "|"]
    for variant in dict.fromkeys(r.variant for r in runs):
        cells, finals = [], []
        for s in seeds:
            run = next((r for r in runs if r.variant == variant and r.seed == s), None)
            curve = (run.metrics.get("held_out") or {}) if run else {}
            if curve and run.status == "ok":
                step = max(curve, key=int)
                finals.append(curve[step])
                cells.append(f"{curve[step]:.2f} (step {step})")
            else:
                cells.append(run.status if run else "")
        mean = f"{statistics.fmean(finals):.3f}" if finals else ""
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", help="the recipe every variant starts from (a path, or - for none)")
    p.add_argument("--variants", type=Path, required=True, help="name|overrides, one a line")
    p.add_argument("--seeds", default="0", help="loop.seed values, comma-separated")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--deadline-s", type=float, default=None, help="stop runs still going after this")
    p.add_argument("--override", action="append", default=[], help="key=value for every run")
    p.add_argument("--out", type=Path, default=Path("runs/recipe-sweep"))
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    base = [sys.executable, "-m", "conveyor.cli", "train"] + ([] if args.recipe == "-" else [args.recipe])
    queue = [Run(v, ov, s, args.out / f"{v}-s{s}") for v, ov in read_variants(args.variants) for s in seeds]
    runs, live = list(queue), []
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    while queue or live:
        if args.deadline_s is not None and time.monotonic() - t0 > args.deadline_s:
            for run in live:
                run.proc.kill()
                run.proc.wait()
                run.status = "stopped at the deadline"
            break
        while queue and len(live) < args.concurrency:
            run = queue.pop(0)
            cmd = base + args.override + run.overrides + [f"loop.seed={run.seed}", f"--output-dir={run.run_dir}"]
            log = open(args.out / f"{run.name}.log", "w")
            run.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            live.append(run)
        time.sleep(0.5)
        for run in [r for r in live if r.proc.poll() is not None]:
            live.remove(run)
            run.status = "ok" if run.proc.returncode == 0 else f"exit {run.proc.returncode}"
    for run in runs:
        if run.proc is None:
            continue
        run.metrics = summarize(run.run_dir)
        append_record("recipe_sweep", {"status": run.status, **run.metrics}, name=run.name,
                      config={"recipe": args.recipe, "variant": run.variant, "seed": run.seed,
                              "overrides": args.override + run.overrides})
    text = table(runs)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.status == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
