"""The default recipe learns, and RL itself (not the warm-start) adds reward on held-out problems.

This is the README's first command, run as a test: the tiny model is built,
warm-started until it knows the answer format, then trained with GRPO. The
assertions compare the held-out reward (200 problems never trained on)
before and after the RL phase, so a rising curve that the supervised phase
alone explains cannot pass. Runs in about three minutes on two CPU cores.
"""
import json

import pytest

from conveyor.cli import main

pytestmark = pytest.mark.slow  # a whole training run or several: `pytest -m "not slow"` leaves it out


def test_default_recipe_rl_adds_reward(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"--output-dir={run}", "observe.progress=false", "observe.tensorboard=false"]) == 0
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 300
    assert s["eval_reward_initial"] < 0.1                      # a random model gets almost nothing
    assert s["eval_reward_warmstart"] > 0.45                   # the warm-start taught the format
    greedy_gain = s["eval_reward_final"] - s["eval_reward_warmstart"]
    sampled_gain = s["eval_sampled_reward_final"] - s["eval_sampled_reward_warmstart"]
    exact_gain = s["eval_exact_final"] - s["eval_exact_warmstart"]
    assert greedy_gain >= 0.05, s
    assert sampled_gain >= 0.05, s
    assert exact_gain >= 0.08, s
    assert s["trained_samples_per_second"] > 0
