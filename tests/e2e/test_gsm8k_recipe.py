"""The GSM8K recipe runs end to end on the shipped rows, scored by math-verify."""
import json
from pathlib import Path

import pytest

from conveyor.config import load_config
from conveyor.observe.report import read_metrics
from conveyor.run.local import run_local

pytestmark = pytest.mark.slow  # a whole training run or several: `pytest -m "not slow"` leaves it out

ROOT = Path(__file__).resolve().parents[2]


def test_gsm8k_recipe_two_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipe names tests/data/gsm8k_sample.jsonl relative to the repo
    cfg = load_config(ROOT / "recipes" / "gsm8k.yaml", [
        "rollout.dtype=float32", "rollout.max_new_tokens=8", "rollout.n=2", "loop.batch_size=2",
        "loop.steps=2", "loop.eval_every=0", "loop.checkpoint_every=0", "trainer.micro_batch_tokens=4096",
        "trainer.gradient_checkpointing=false", "observe.tensorboard=false", "observe.progress=false",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "model.tiny.max_position_embeddings=512"])
    summary = run_local(cfg, tmp_path / "run")
    assert summary["steps"] == 2
    train = read_metrics(tmp_path / "run", kind="train")
    assert len(train) == 2
    for m in train:
        assert 0.0 <= m["reward"] <= 1.0
        assert m["reward_failures"] == 0  # every gold answer parsed, no verifier crashed
        assert m["reward_scored"] >= 4
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= s["eval_reward_final"] <= 1.0
