"""One configuration of a workload, as a conveyor RunConfig that every peer reads.

Contract: ``run_config(spec)`` turns a run spec (the JSON the harness hands
each subprocess) into a validated ``conveyor.config.RunConfig``. The SAME
RunConfig drives conveyor directly and is translated field by field into
TRL's arguments by ``peers/trl_peer.py``, so model, data, prompts, group
size, lengths, reward, optimizer, lr and loss aggregation cannot drift apart
between systems.

Spec keys: workload ("w1" | "w2"), system, name, run_dir, model_path, seed,
lr, budget_s (wall seconds of RL, None = no limit), max_steps, overrides
(conveyor dotted overrides, applied after the workload's defaults and
before the harness's fixed keys), eos_bias, reward_seed, trl_micro_batch,
threshold.

- W2 starts from benchmarks/w2.yaml (two-digit addition, partial
  credit, group 8, 32 tasks per step, token-mean PPO-clip 0.2) with the
  warm-started checkpoint as the model and no supervised phase.
- W1 is BENCHMARKS.md's shape: 32 prompts x 8, random-id prompts, EOS bias,
  hash reward, lr 1e-6, clip 0.2, no KL, no evaluation.

It does not run anything and knows nothing of TRL.
"""
from __future__ import annotations

import json
from pathlib import Path

from conveyor.config import RunConfig, load_config

RECIPE = Path(__file__).resolve().parent / "w2.yaml"  # W2's task, fixed apart from the built-in default
TRAJECTORIES = "trajectories.jsonl"


def _kv(key: str, value) -> str:
    # JSON is valid YAML flow syntax, so any value (dicts included) survives the override parser.
    return f"{key}={json.dumps(value)}"


def _fixed(spec: dict) -> list[str]:
    return [
        _kv("model.path", spec["model_path"]), _kv("sft.steps", 0), _kv("loop.steps", int(spec["max_steps"])),
        _kv("loop.time_limit_s", spec.get("budget_s")), _kv("loop.seed", int(spec["seed"])),
        _kv("trainer.lr", float(spec["lr"])), _kv("loop.eval_every", 0), _kv("loop.checkpoint_every", 0),
        _kv("observe.progress", False), _kv("observe.tensorboard", False),
    ]


def w2_config(spec: dict) -> RunConfig:
    log = str(Path(spec["run_dir"]) / TRAJECTORIES)
    fixed = _fixed(spec) + [_kv("reward.fn", "benchmarks.rewards:conveyor_partial_credit"),
                            _kv("reward.kwargs", {"log_path": log})]
    return load_config(RECIPE, list(spec.get("overrides", [])) + fixed)


W1_BASE = {
    "name": "w1",
    "data": {"source": "jsonl", "answer_field": "", "eval_size": 0},
    "rollout": {"n": 8, "temperature": 1.0, "max_new_tokens": 1024, "dtype": "auto"},
    "trainer": {"max_grad_norm": 1.0},
    "algo": {"advantage": "grpo", "loss": "ppo", "clip_low": 0.2, "clip_high": 0.2, "loss_agg": "token-mean",
             "kl_coef": 0.0},
    "loop": {"batch_size": 32},
}


def w1_based(spec: dict, extra: list[str], name: str | None = None) -> RunConfig:
    """W1's RunConfig (model, prompts, EOS bias, optimizer, loss) with ``extra`` overrides on top:
    what W1 scores with, or what another workload built on W1 (W3, W4) changes; ``name`` renames it."""
    base = json.loads(json.dumps(W1_BASE))
    if name:
        base["name"] = name
    fixed = _fixed(spec) + [
        _kv("data.path", spec["prompts_path"]), _kv("rollout.eos_bias", float(spec.get("eos_bias", 0.0))), *extra]
    return load_config(None, list(spec.get("overrides", [])) + fixed, base=base)


def w1_config(spec: dict) -> RunConfig:
    log = str(Path(spec["run_dir"]) / TRAJECTORIES)
    return w1_based(spec, [_kv("reward.fn", "benchmarks.rewards:conveyor_hash"),
                           _kv("reward.kwargs", {"log_path": log, "seed": int(spec.get("reward_seed", 0))})])


def run_config(spec: dict) -> RunConfig:
    if spec["workload"] == "w2":
        return w2_config(spec)
    if spec["workload"] == "w1":
        return w1_config(spec)
    raise ValueError(f"unknown workload {spec['workload']!r}; use w1 or w2")


def samples_per_step(cfg: RunConfig) -> int:
    return cfg.loop.batch_size * cfg.rollout.n
