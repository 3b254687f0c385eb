"""Policy versions across the turns of an episode: synchronous multi-turn RL (max_staleness 0)
samples every policy token of an episode from the weights of the step it trains in; streaming
lets a weight swap land between turns, so episodes span versions, each token keeping its own."""
from pathlib import Path

import pytest

import time

from conveyor.api import load_config, train
from conveyor.env.games import GuessNumber
from conveyor.observe.report import read_metrics

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "guess_number.yaml"


@pytest.fixture(autouse=True)
def _turns_wait_out_training(monkeypatch):
    """Marks the loop's training: from a train call until the producer hears of the new version.
    A SlowGuess turn that ends meanwhile waits until then, so its episode's next turn is sampled
    from the new weights however long the step takes."""
    import threading

    from conveyor import loop
    from conveyor.controller.producer import Producer
    idle = threading.Event()
    idle.set()
    train, published = loop.train_and_prepare_next, Producer.published

    def training(*args, **kwargs):
        idle.clear()
        try:
            return train(*args, **kwargs)
        except BaseException:
            idle.set()
            raise

    def announced(self, *args, **kwargs):
        try:
            return published(self, *args, **kwargs)
        finally:
            idle.set()
    training.idle = idle  # found through the loop: the env may live in another copy of this module
    monkeypatch.setattr(loop, "train_and_prepare_next", training)
    monkeypatch.setattr(Producer, "published", announced)


class SlowGuess(GuessNumber):
    """The game with a slow answer: an episode outlasts a training step, so a swap lands
    between its turns (one that ends while the trainer trains waits for the new version)."""

    def step(self, action):
        time.sleep(0.2)
        from conveyor import loop
        idle = getattr(loop.train_and_prepare_next, "idle", None)
        if idle is not None:
            assert idle.wait(25.0), "the training step did not end"  # within env.step_timeout_s (30 s)
        return super().step(action)


def _run(tmp_path: Path, staleness: int, steps: int) -> list[dict]:
    cfg = load_config(RECIPE, [f"loop.max_staleness={staleness}", "sft.steps=10", "sft.batch_size=16", f"loop.steps={steps}",
                               "loop.batch_size=4", "rollout.n=4", "data.eval_size=8", "loop.eval_every=0",
                               "loop.eval_sampled=false", "observe.progress=false", "observe.tensorboard=false",
                               "env.name=tests.e2e.test_env_versions:SlowGuess",
                               f"output_dir={tmp_path / str(staleness)}"])
    train(cfg, tmp_path / str(staleness))
    return read_metrics(tmp_path / str(staleness), kind="train")


def test_sync_episodes_are_on_policy_and_streaming_ones_span_versions(tmp_path):
    sync = _run(tmp_path, 0, steps=3)
    assert all(m["staleness_max"] == 0 and m["multi_version_frac"] == 0 for m in sync)
    streaming = _run(tmp_path, 1, steps=6)
    assert max(m["multi_version_frac"] for m in streaming) > 0  # a swap landed between turns
    assert all(m["reward_failures"] == 0 for m in streaming)
