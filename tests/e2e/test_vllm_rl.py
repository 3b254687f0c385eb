"""A short RL run with vLLM as the rollout engine learns on the default task.

The default recipe (tiny model, string reversal) with ``rollout.engine=vllm``:
the warm-start runs in the trainer as usual, its weights reach vLLM through
``reload_weights``, and GRPO then trains on vLLM's samples. Runs in the vLLM
venv only (docs/vllm.md); skipped elsewhere.
"""
import json

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM venv (docs/vllm.md)")

from conveyor.cli import DEFAULT_RECIPE  # noqa: E402
from conveyor.config import load_config  # noqa: E402
from conveyor.observe.report import read_metrics  # noqa: E402
from conveyor.run.local import run_local  # noqa: E402

pytestmark = pytest.mark.slow  # a whole training run or several: `pytest -m "not slow"` leaves it out


def test_grpo_with_vllm_engine_learns(tmp_path):
    cfg = load_config(DEFAULT_RECIPE, ["rollout.engine=vllm", "rollout.dtype=float32", "loop.steps=30",
                                       "loop.eval_every=0", "observe.progress=false",
                                       "observe.tensorboard=false"])
    summary = run_local(cfg, tmp_path / "run")
    assert summary["steps"] == 30
    assert summary["eval_reward_warmstart"] > 0.45
    assert summary["eval_reward_final"] - summary["eval_reward_warmstart"] >= 0.03, summary
    train = read_metrics(tmp_path / "run", kind="train")
    assert max(m["staleness_max"] for m in train) == 0  # every step sampled from the newest weights
    assert all(m["reward_failures"] == 0 for m in train)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 30
