"""Every advantage estimator and both KL placements, through the whole loop on the tiny task.

Each run is the default recipe's task (string reversal) with a small model and a short
warm start (so that groups carry signal), a few steps long, through ``conveyor.api.train`` (engine, reward service, producer,
trainer). What is checked is what each choice must do, read from the run's metrics and
weights: a finite loss and gradient at every step, weights that moved, and the quantity that
names the estimator: RLOO's advantages are n/(n-1) times Dr.GRPO's on the same samples
(the first step samples the same tokens for every run of one seed), REINFORCE++ whitens
its advantages over the batch's tokens, the critic's error falls under GAE, and the KL to
the reference is 0 before the first update and positive after it, in the loss or in the
reward.
"""
import math

import pytest
import torch
from safetensors.torch import load_file

from conveyor.api import load_config, train
from conveyor.observe.report import read_metrics

pytestmark = pytest.mark.slow  # whole training runs (seconds each): `pytest -m "not slow"` leaves them out

N = 4  # samples per group
TINY = ["sft.steps=100", "sft.lr=3e-3", "loop.batch_size=4", f"rollout.n={N}", "data.eval_size=8", "loop.eval_every=0",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
        "observe.tensorboard=false", "observe.progress=false", "trainer.lr=1e-3", "loop.seed=0"]


def _run(tmp_path, name: str, extra: list[str], steps: int = 3) -> list[dict]:
    run_dir = tmp_path / name
    train(load_config(None, TINY + [f"loop.steps={steps}"] + extra), run_dir=run_dir)
    metrics = read_metrics(run_dir, kind="train")
    assert len(metrics) == steps
    for m in metrics:  # what every estimator owes at every step
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0, m
        assert m["adv_abs_mean"] > 0, m
        assert not any(k.startswith("dynamic_sampling/") for k in m)  # off unless asked for
    base, final = (load_file(str(run_dir / d / "model.safetensors")) for d in ("warmstart", "final"))
    assert any(not torch.equal(base[k], final[k]) for k in base), "the weights did not move"
    return metrics


def test_rloo_is_drgrpo_scaled_by_n_over_n_minus_one_on_the_same_samples(tmp_path):
    dr = _run(tmp_path, "drgrpo", ["algo.advantage=drgrpo"])
    rloo = _run(tmp_path, "rloo", ["algo.advantage=rloo"])
    assert rloo[0]["reward"] == dr[0]["reward"]  # the same first samples
    # A_rloo = r - mean_others = n/(n-1) (r - mean) = n/(n-1) A_drgrpo; float32 sums of ~100 tokens
    assert rloo[0]["adv_abs_mean"] == pytest.approx(N / (N - 1) * dr[0]["adv_abs_mean"], rel=1e-5)
    for m in dr:  # no std normalisation: |r - mean| <= 1 for rewards in [0, 1]
        assert m["adv_abs_mean"] <= 1.0 and m["adv_std"] <= 1.0


def test_grpo_normalises_where_drgrpo_does_not(tmp_path):
    grpo = _run(tmp_path, "grpo", ["algo.advantage=grpo"], steps=1)
    dr = _run(tmp_path, "drgrpo", ["algo.advantage=drgrpo"], steps=1)
    assert grpo[0]["reward"] == dr[0]["reward"]
    # each group with signal is scaled to unit std: far above the raw reward differences
    assert grpo[0]["adv_abs_mean"] > 3 * dr[0]["adv_abs_mean"]


def test_reinforce_pp_whitens_token_returns_over_the_batch(tmp_path):
    for m in _run(tmp_path, "rpp", ["algo.advantage=reinforce++"]):
        # (G - mean) / (std + 1e-6) over the loss tokens: mean 0, std 1 up to eps / std(G) (~1e-4)
        assert abs(m["adv_mean"]) < 1e-5, m
        assert m["adv_std"] == pytest.approx(1.0, abs=1e-3), m


def test_gae_trains_a_critic_whose_error_falls(tmp_path):
    metrics = _run(tmp_path, "gae", ["algo.advantage=gae", "trainer.critic=true", "trainer.critic_lr=3e-3"], steps=8)
    assert all(m["critic_grad_norm"] > 0 and math.isfinite(m["value_mean"]) for m in metrics)
    errors = [m["value_error"] for m in metrics]
    # the value head starts random (|V - R| about 1 for rewards near 0) and regresses onto the returns
    assert errors[-1] < 0.5 * errors[0], errors


def test_kl_in_the_loss_is_zero_at_the_reference_and_grows_after_updates(tmp_path):
    metrics = _run(tmp_path, "kl_loss", ["algo.kl_coef=0.1", "trainer.reference=true", "trainer.mini_batches=1"])
    kl = [m["kl"] for m in metrics]
    # one optimizer step per batch: the first step's forward IS the reference
    assert kl[0] < 1e-6 and all(k > 1e-6 for k in kl[1:]), kl
    assert "kl_reward" not in metrics[0]


@pytest.mark.parametrize("advantage", ["grpo", "reinforce++"])
def test_kl_in_the_reward_is_zero_at_the_reference_and_grows_after_updates(tmp_path, advantage):
    metrics = _run(tmp_path, f"kl_reward_{advantage}", [f"algo.advantage={advantage}", "algo.kl_in_reward=true",
                                                        "algo.kl_coef=0.1", "trainer.reference=true"])
    kl = [m["kl_reward"] for m in metrics]
    # the engine's logprobs against the reference's: the same weights before the first update
    assert kl[0] < 1e-6 and all(k > 1e-6 for k in kl[1:]), kl
    assert "kl" not in metrics[0]  # not added to the loss as well


def test_gae_with_kl_in_the_reward(tmp_path):
    metrics = _run(tmp_path, "gae_kl", ["algo.advantage=gae", "trainer.critic=true", "algo.kl_in_reward=true",
                                        "algo.kl_coef=0.1", "trainer.reference=true"])
    assert metrics[-1]["kl_reward"] > 0 and all(math.isfinite(m["value_error"]) for m in metrics)
