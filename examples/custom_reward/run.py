"""Train on data.jsonl with the reward in reward.py through the Python API, then try the model.

    python examples/custom_reward/run.py [key=value ...]     (e.g. loop.steps=10)

The same run from the command line, from the repository root:

    PYTHONPATH=examples/custom_reward conveyor train examples/custom_reward/recipe.yaml
"""
from __future__ import annotations

import sys
from pathlib import Path

import conveyor

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> conveyor.TrainSummary:
    sys.path.insert(0, str(HERE))  # so that reward.fn=reward:shout imports reward.py
    run_dir = Path("runs") / "shout"
    overrides = [f"data.path={HERE / 'data.jsonl'}"]
    for arg in argv:
        if arg.startswith("--output-dir="):
            run_dir = Path(arg.split("=", 1)[1])
        else:
            overrides.append(arg)
    cfg = conveyor.load_config(HERE / "recipe.yaml", overrides)
    summary = conveyor.train(cfg, run_dir=run_dir)
    for phase in ("initial", "warmstart", "final"):
        r = getattr(summary, phase)
        print(f"{phase:>10}: greedy reward {r.greedy_reward:.3f}, exact {r.exact:.3f}")
    print("up cat= ->", conveyor.generate(summary.run_dir, ["up cat="])[0])
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
