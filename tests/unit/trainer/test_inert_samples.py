"""Samples whose every loss term is zero (a GRPO group whose rewards are all equal) are left out of
forward and backward (``PolicyLoss.inert``, ``LocalTrainer._update``): the same step, less work."""
import pytest
import torch

from conveyor.config import AlgoConfig, TrainerConfig
from conveyor.controller.objective import PolicyLoss
from conveyor.trainer.single import LocalTrainer
from conveyor.trainer.step_metrics import MetricMean
from conveyor.types import Batch

LENGTHS = [9, 4, 12, 6, 7, 3, 10, 5]  # sample 2 is the longest: never dead below, so the padding is the same


class Plain:
    """The same loss without ``inert``: every sample computed."""

    def __init__(self, loss):
        self.loss, self.needs_entropy = loss, loss.needs_entropy

    def __call__(self, *args):
        return self.loss(*args)


def _batch(make_batch, dead: set[int]) -> Batch:
    b = make_batch(LENGTHS, seed=1)
    adv = [a * (0.0 if i in dead else 1.0) for i, a in enumerate(b.fields["adv"])]
    behaviour = [-2.0 * m for m in b.loss_mask]
    return Batch(b.input_ids, b.loss_mask, {"advantages": adv, "behaviour_logprobs": behaviour})


def _trainer(make_model) -> LocalTrainer:
    return LocalTrainer(make_model(), TrainerConfig(device="cpu", lr=1e-3, micro_batch_tokens=4096), total_steps=4)


def _grads(trainer: LocalTrainer) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in trainer.model.parameters()])


def test_inert_samples_are_marked_only_when_no_term_survives(make_batch):
    batch = _batch(make_batch, {1, 4})
    assert PolicyLoss(AlgoConfig()).inert(batch) == [i in {1, 4} for i in range(len(LENGTHS))]
    for other in ({"entropy_coef": 0.01}, {"kl_coef": 0.1}, {"advantage": "gae"}):
        assert not any(PolicyLoss(AlgoConfig(**other)).inert(batch)), other
    assert PolicyLoss(AlgoConfig(kl_coef=0.1, kl_in_reward=True)).inert(batch)[1]  # KL moved into the reward


def test_leaving_inert_samples_out_gives_the_same_gradient(make_model, make_batch):
    loss = PolicyLoss(AlgoConfig(), one_update=True)
    batch = _batch(make_batch, {1, 4, 5})
    grads, seen = [], []
    for fn in (loss, Plain(loss)):
        trainer = _trainer(make_model)
        totals = {"loss": 0.0, "grad_norm": 0.0, "critic_grad_norm": 0.0, "microbatches": 0, "inert": 0}
        original = trainer._backward
        trainer._backward = lambda mini, *a, **k: seen.append(len(mini)) or original(mini, *a, **k)
        trainer._update(batch, fn, MetricMean(), totals, "test")
        grads.append(_grads(trainer))
    assert seen == [5, 8]  # three samples never reached forward and backward
    # Float32 sums over other rows in another order: about eps per summed token, relative to the norm.
    tol = torch.finfo(torch.float32).eps * sum(LENGTHS)
    assert float((grads[0] - grads[1]).norm()) <= tol * float(grads[1].norm()) and float(grads[1].norm()) > 0


def test_a_step_without_signal_still_steps_and_reports_it(make_model, make_batch):
    """All samples inert: AdamW still moves the weights by its moments (and decay), as the full
    computation of zero gradients would; the step says how much it left out."""
    loss = PolicyLoss(AlgoConfig(), one_update=True)
    models, metrics = [], []
    for fn in (loss, Plain(loss)):
        trainer = _trainer(make_model)
        trainer.train(_batch(make_batch, set()), fn)  # a step with signal: the moments are nonzero
        metrics.append(trainer.train(_batch(make_batch, set(range(len(LENGTHS)))), fn))
        models.append(trainer.model)
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        assert torch.equal(a, b), name
    assert metrics[0]["inert_frac"] == 1.0 and metrics[1]["inert_frac"] == 0.0
    assert metrics[0]["grad_norm"] == metrics[1]["grad_norm"] == 0.0
