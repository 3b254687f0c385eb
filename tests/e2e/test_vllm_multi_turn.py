"""Multi-turn episodes with vLLM as the engine: the guessing game's turns go to vLLM token in /
token out, the warm start's weights reach it, and RL steps run on its samples.

Runs in the vLLM venv only (docs/vllm.md); skipped elsewhere.
"""
import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM venv (docs/vllm.md)")

from conveyor.config import load_config  # noqa: E402
from conveyor.observe.report import read_metrics  # noqa: E402
from conveyor.run.local import run_local  # noqa: E402

pytestmark = pytest.mark.slow


def test_guess_number_episodes_on_vllm(tmp_path):
    recipe = __file__.rsplit("/tests/", 1)[0] + "/recipes/guess_number.yaml"
    cfg = load_config(recipe, ["rollout.engine=vllm", "rollout.dtype=float32", "sft.steps=150", "loop.steps=3",
                               "data.eval_size=32", "loop.eval_every=0", "observe.progress=false",
                               "observe.tensorboard=false"])
    summary = run_local(cfg, tmp_path / "run")
    assert summary["steps"] == 3
    # The warm start taught the game (episodes of several turns that win some games), and the
    # RL steps trained on multi-turn groups sampled by vLLM from the newest weights.
    assert summary["eval_reward_warmstart"] > 0.1
    assert 1.0 < summary["eval_turns_warmstart"] <= 4.0
    train = read_metrics(tmp_path / "run", kind="train")
    assert all(m["staleness_max"] == 0 for m in train)
    assert all(m.get("env_episodes", 0) > 0 for m in train)
    assert all(m["response_len"] > 3 for m in train)  # more than one turn's tokens
