"""A step accumulated part by part (``LocalTrainer.accumulate`` / ``train_accumulated``) is the
step ``train`` takes on the whole batch: same loss, gradient norm and update, up to the rounding
of a different summation order."""
import pytest
import torch

from conveyor.config import TrainerConfig
from conveyor.trainer.single import LocalTrainer, NonFiniteLossError

LENGTHS = [9, 4, 12, 6, 7, 3, 10, 5]


def cfg(**kw):
    return TrainerConfig(**{**dict(device="cpu", lr=1e-4, micro_batch_tokens=4096), **kw})


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


class SeqMeanLoss:
    """Each sequence's mean of -adv * logprob, averaged over sequences (divides by num_seqs)."""
    normaliser = "seqs"

    def __call__(self, out, mb, num_tokens, num_seqs):
        m = mb["loss_mask"]
        per_seq = -(mb["adv"] * out["logprobs"] * m).sum(1) / m.sum(1).clamp(min=1)
        return per_seq.sum() / num_seqs, {}


def _parts(batch):
    return [batch.select([0, 1, 2]), batch.select([3]), batch.select([4, 5, 6, 7])]


def _accumulated(trainer, batch, loss, budgets=(4096, 1, 16)):
    for part, budget in zip(_parts(batch), budgets):
        trainer.accumulate(part, loss, budget)
    return trainer.train_accumulated()


@pytest.mark.parametrize("loss_name", ["tokens", "seqs", "tokens+critic"])
def test_parts_give_the_whole_batchs_step(make_model, make_batch, pg_loss, pg_value_loss, loss_name):
    loss = {"tokens": pg_loss, "seqs": SeqMeanLoss(), "tokens+critic": pg_value_loss}[loss_name]
    if loss_name != "seqs":
        loss.normaliser = "tokens"
    critic = loss_name == "tokens+critic"
    batch = make_batch(LENGTHS)
    whole = LocalTrainer(make_model(), cfg(critic=critic), total_steps=10)
    parts = LocalTrainer(make_model(), cfg(critic=critic), total_steps=10)
    m1, m2 = whole.train(batch, loss), _accumulated(parts, batch, loss)
    assert m2["num_tokens"] == m1["num_tokens"] == batch.num_tokens and m2["num_seqs"] == m1["num_seqs"] == len(batch)
    assert m2["microbatches"] > m1["microbatches"]  # the parts ran in micro-batches of their own budgets
    # The loss is a float32 sum of O(1) terms over ~30 tokens: equal to a few ulps of its scale.
    eps = torch.finfo(torch.float32).eps
    assert m2["loss"] == pytest.approx(m1["loss"], abs=64 * eps * max(1.0, abs(m1["loss"])))
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    # Adam's first step is lr * g / (|g| + eps_adam): rounding on near-zero gradients becomes a few
    # percent of lr, so weights are compared at 5% of the step (lr = 1e-4), as the micro-batch test does.
    assert max_diff(whole.model, parts.model) <= 5e-6
    assert max_diff(whole.model, make_model()) > 5e-5  # the step did move the weights
    assert parts.step == whole.step == 1


def test_a_loss_without_normaliser_is_refused_by_name(make_model, make_batch, pg_loss):
    trainer = LocalTrainer(make_model(), cfg(), total_steps=10)
    with pytest.raises(ValueError, match="PGLoss declares no normaliser"):
        trainer.accumulate(make_batch(LENGTHS), pg_loss)
    with pytest.raises(ValueError, match="no part was accumulated"):
        trainer.train_accumulated()


def test_a_failed_part_ends_the_accumulation_and_the_next_starts_clean(make_model, make_batch, pg_loss):
    pg_loss.normaliser = "tokens"
    batch = make_batch(LENGTHS)
    bad = make_batch(LENGTHS[:2])
    bad.fields["adv"] = [a * float("nan") for a in bad.fields["adv"]]
    trainer = LocalTrainer(make_model(), cfg(), total_steps=10)
    trainer.accumulate(batch.select([0]), pg_loss)
    with pytest.raises(NonFiniteLossError, match="part 1"):
        trainer.accumulate(bad, pg_loss)
    assert trainer.step == 0
    reference = LocalTrainer(make_model(), cfg(), total_steps=10)
    assert _accumulated(trainer, batch, pg_loss)["num_seqs"] == len(batch)  # the failed parts left nothing
    reference.train(batch, pg_loss)
    assert max_diff(trainer.model, reference.model) <= 5e-6


def test_confining_a_part_to_sms_is_refused_on_a_cpu_trainer(make_model, make_batch, pg_loss):
    pg_loss.normaliser = "tokens"
    trainer = LocalTrainer(make_model(), cfg(), total_steps=10)
    with pytest.raises(ValueError, match=r"loop.accumulate_sms=8 .* trains on cpu"):
        trainer.accumulate(make_batch(LENGTHS), pg_loss, None, sms=8)
    trainer.accumulate(make_batch(LENGTHS), pg_loss, None, sms=None)  # the next step starts clean
    assert trainer.train_accumulated()["num_seqs"] == len(LENGTHS)
