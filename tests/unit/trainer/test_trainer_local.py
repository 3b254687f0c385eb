import copy
import math

import pytest
import torch

from conveyor.config import TrainerConfig
from conveyor.trainer.api import Trainer
from conveyor.trainer.single import LocalTrainer, NonFiniteLossError, lr_multiplier, token_logprobs
from conveyor.trainer.microbatch import collate

LENGTHS = [9, 4, 12, 6, 7, 3, 10, 5]


def cfg(**kw):
    base = dict(device="cpu", lr=1e-3, micro_batch_tokens=4096)
    return TrainerConfig(**{**base, **kw})


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_microbatch_split_does_not_change_the_update(make_model, make_batch, pg_loss):
    batch = make_batch(LENGTHS)
    # Gradients agree to fp32 rounding (~1e-7 relative); Adam's first step is
    # lr * g / (|g| + eps), which turns rounding on near-zero gradients into a
    # few percent of lr (1.8e-6 on some CPUs' kernels), so weights are compared
    # at 5% of the step while every element moves by up to lr = 1e-4.
    one = LocalTrainer(make_model(), cfg(lr=1e-4, micro_batch_tokens=10**6), total_steps=10)
    many = LocalTrainer(make_model(), cfg(lr=1e-4, micro_batch_tokens=1), total_steps=10)
    m1, m8 = one.train(batch, pg_loss), many.train(batch, pg_loss)
    assert (m1["microbatches"], m8["microbatches"]) == (1.0, 8.0)
    assert m1["num_tokens"] == m8["num_tokens"] == batch.num_tokens
    assert m1["loss"] == pytest.approx(m8["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m8["grad_norm"], rel=1e-5)
    assert m1["mean_logprob"] == pytest.approx(m8["mean_logprob"], abs=1e-5)
    assert max_diff(one.model, many.model) <= 5e-6
    assert max_diff(one.model, make_model()) > 5e-5  # the step did move the weights


def hand_logprobs(model, ids, temperature):
    logits = model(input_ids=ids[None]).logits[0]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    expected = torch.zeros(ids.numel())
    expected[1:] = logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    return expected


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_plain_forward(make_model, make_batch, temperature):
    batch = make_batch([7, 3])
    trainer = LocalTrainer(make_model(), cfg(), total_steps=1, temperature=temperature)
    got = trainer.logprobs(batch)
    plain = make_model().eval()
    with torch.no_grad():
        for ids, lp in zip(batch.input_ids, got):
            assert lp.shape == ids.shape and lp[0] == 0.0
            torch.testing.assert_close(lp, hand_logprobs(plain, ids, temperature), atol=1e-5, rtol=0)


def test_token_logprobs_entropy_and_padding():
    logits = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 2, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    lp, ent = token_logprobs(logits, ids, mask, temperature=0.5, with_entropy=True)
    logp = torch.log_softmax(logits[0] / 0.5, dim=-1)
    assert lp[0].tolist() == pytest.approx([0.0, float(logp[0, 2]), float(logp[1, 3]), 0.0], abs=1e-6)
    h = -(logp.exp() * logp).sum(-1)
    assert ent[0].tolist() == pytest.approx([0.0, float(h[0]), float(h[1]), 0.0], abs=1e-5)


def test_lr_multiplier_formula():
    assert [lr_multiplier(k, 0, 4, "constant") for k in range(3)] == [1.0, 1.0, 1.0]
    assert [lr_multiplier(k, 2, 6, "linear") for k in range(7)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    assert lr_multiplier(9, 2, 6, "linear") == 0.0


def test_reported_lr_follows_warmup_then_cosine(make_model, make_batch, pg_loss):
    trainer = LocalTrainer(make_model(), cfg(warmup_steps=2, lr_schedule="cosine"), total_steps=6)
    batch = make_batch([5, 4])
    lrs = [trainer.train(batch, pg_loss)["lr"] for _ in range(6)]
    expected = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert lrs == pytest.approx([1e-3 * e for e in expected], rel=1e-12)
    assert trainer.step == 6


def reference_update(model, batch, loss_fn, max_norm, lr, steps):
    """Plain PyTorch: padded forward, log_softmax, clip_grad_norm_, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    mb = collate(batch, list(range(len(batch))), pad_id=0)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        am = mb["attention_mask"]
        logits = model(input_ids=mb["input_ids"], attention_mask=am,
                       position_ids=torch.arange(am.shape[1]).expand_as(am)).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        lp = torch.zeros_like(mb["loss_mask"])
        lp[:, 1:] = logp.gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1) * am[:, 1:]
        loss, _ = loss_fn({"logprobs": lp}, mb, float(batch.num_tokens), len(batch))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
    return norms


def test_grad_norm_is_reported_before_clipping_and_clipping_applies(make_model, make_batch, pg_loss):
    batch = make_batch([8, 6, 5])
    lr = 1e-3
    trainer = LocalTrainer(make_model(), cfg(lr=lr, max_grad_norm=0.05), total_steps=2)
    reported = [trainer.train(batch, pg_loss)["grad_norm"] for _ in range(2)]
    clipped, unclipped = make_model(), make_model()
    norms = reference_update(clipped, batch, pg_loss, 0.05, lr, steps=2)
    reference_update(unclipped, batch, pg_loss, float("inf"), lr, steps=2)
    assert norms[0] > 0.05  # so clipping really is exercised
    assert reported == pytest.approx(norms, rel=1e-5)
    # Each Adam step moves an element by up to ~lr; rounding on near-zero gradients can turn
    # into a few percent of that (see the micro-batch test), so the weights are compared at 5%
    # of one step. Clipping itself changes the second step by a large part of a step.
    assert max_diff(trainer.model, clipped) <= 0.05 * lr
    assert max_diff(trainer.model, unclipped) > 0.2 * lr


def test_reference_is_frozen_and_critic_trains(make_model, make_batch, pg_value_loss):
    batch = make_batch([6, 9, 4])
    trainer = LocalTrainer(make_model(), cfg(reference=True, critic=True, critic_lr=1e-3), total_steps=3)
    assert isinstance(trainer, Trainer)
    ref0, lp0 = trainer.ref_logprobs(batch), trainer.logprobs(batch)
    for a, b in zip(ref0, lp0):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    values = trainer.values(batch)
    assert [v.shape for v in values] == [x.shape for x in batch.input_ids]
    assert all(v[0] == 0.0 for v in values)
    critic0 = copy.deepcopy(trainer.critic)
    metrics = trainer.train(batch, pg_value_loss)
    assert metrics["critic_grad_norm"] > 0 and metrics["value_loss"] > 0
    assert all(torch.equal(a, b) for a, b in zip(ref0, trainer.ref_logprobs(batch)))
    assert max(float((a - b).abs().max()) for a, b in zip(lp0, trainer.logprobs(batch))) > 1e-4
    assert float((critic0.head.weight - trainer.critic.head.weight).detach().abs().max()) > 1e-4
    assert max_diff(critic0.backbone, trainer.critic.backbone) > 1e-4
    assert not any(p.requires_grad for p in trainer.reference.parameters())


def test_ref_and_values_need_their_models(make_model, make_batch):
    trainer = LocalTrainer(make_model(), cfg(), total_steps=1)
    with pytest.raises(RuntimeError, match="trainer.reference=true"):
        trainer.ref_logprobs(make_batch([3]))
    with pytest.raises(RuntimeError, match="trainer.critic=true"):
        trainer.values(make_batch([3]))


def test_entropy_is_provided_only_when_asked(make_model, make_batch):
    seen = []

    def loss_fn(out, mb, num_tokens, num_seqs):
        seen.append(sorted(out))
        return -(out["logprobs"] * mb["loss_mask"]).sum() / num_tokens, {}

    trainer = LocalTrainer(make_model(), cfg(), total_steps=2)
    trainer.train(make_batch([5]), loss_fn)
    loss_fn.needs_entropy = True
    trainer.train(make_batch([5]), loss_fn)
    assert seen == [["logprobs"], ["entropy", "logprobs"]]


def test_epochs_and_minibatches_step_per_chunk(make_model, make_batch, pg_loss):
    trainer = LocalTrainer(make_model(), cfg(ppo_epochs=2, mini_batches=2, micro_batch_tokens=1),
                           total_steps=1)
    metrics = trainer.train(make_batch([5, 4, 3]), pg_loss)
    # 2 epochs x 3 samples, one micro-batch each; 4 optimizer steps but one schedule step
    assert metrics["microbatches"] == 6.0
    assert int(trainer.optimizer.state[trainer.optimizer.param_groups[0]["params"][0]]["step"]) == 4
    assert trainer.step == 1
    with pytest.raises(ValueError, match="trainer.mini_batches=2 exceeds the batch's 1 samples"):
        trainer.train(make_batch([5]), pg_loss)


def test_nonfinite_loss_names_step_and_microbatch_and_takes_no_step(make_model, make_batch, pg_loss):
    calls = []

    def loss_fn(out, mb, num_tokens, num_seqs):
        calls.append(1)
        loss, m = pg_loss(out, mb, num_tokens, num_seqs)
        return (loss * float("nan") if len(calls) == 3 else loss), m

    trainer = LocalTrainer(make_model(), cfg(micro_batch_tokens=1), total_steps=2)
    before = copy.deepcopy(trainer.model)
    with pytest.raises(NonFiniteLossError, match=r"trainer step 0, epoch 0, mini-batch 0, micro-batch 2: loss is nan"):
        trainer.train(make_batch([5, 4, 3, 6]), loss_fn)
    assert max_diff(before, trainer.model) == 0.0
    assert trainer.step == 0
    assert all(p.grad is None for p in trainer.model.parameters())


def test_gradient_checkpointing_gives_the_same_update(make_model, make_batch, pg_value_loss):
    batch = make_batch([6, 4])
    plain = LocalTrainer(make_model(), cfg(critic=True), total_steps=1)
    ckpt = LocalTrainer(make_model(), cfg(critic=True, gradient_checkpointing=True), total_steps=1)
    assert ckpt.train(batch, pg_value_loss)["loss"] == plain.train(batch, pg_value_loss)["loss"]
    assert max_diff(plain.model, ckpt.model) <= 1e-6
    assert max_diff(plain.critic, ckpt.critic) <= 1e-6
    assert ckpt.model.model.gradient_checkpointing and not plain.model.model.gradient_checkpointing


@pytest.mark.slow  # over 10 s on a 2-core CPU
def test_compiled_layers_give_the_same_logprobs_and_update(make_model, make_batch, pg_loss):
    batch = make_batch(LENGTHS)
    plain = LocalTrainer(make_model(), cfg(lr=1e-4), total_steps=1)
    comp = LocalTrainer(make_model(), cfg(lr=1e-4, compile=True), total_steps=1)
    assert all(hasattr(layer, "_compiled_call_impl") and layer._compiled_call_impl is not None
               for layer in comp.model.model.layers)
    for a, b in zip(plain.logprobs(batch), comp.logprobs(batch)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    m1, m2 = plain.train(batch, pg_loss), comp.train(batch, pg_loss)
    assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-5)
    assert max_diff(plain.model, comp.model) <= 1e-5
    assert list(comp.model.state_dict()) == list(plain.model.state_dict())  # names unchanged for export


def test_pad_multiple_changes_shapes_not_results(make_model, make_batch, pg_loss):
    batch = make_batch(LENGTHS)
    plain = LocalTrainer(make_model(), cfg(lr=1e-4, micro_batch_tokens=24), total_steps=1)
    padded = LocalTrainer(make_model(), cfg(lr=1e-4, micro_batch_tokens=24, pad_multiple=16), total_steps=1)
    for a, b in zip(plain.logprobs(batch), padded.logprobs(batch)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6)
    m1, m2 = plain.train(batch, pg_loss), padded.train(batch, pg_loss)
    assert m2["microbatches"] > m1["microbatches"]  # padded rows cost more of the budget
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    # Rounding of other micro-batch shapes, amplified by Adam's first step (see above), against
    # a step that moves weights by ~lr.
    assert max_diff(plain.model, padded.model) <= 5e-6
    assert max_diff(plain.model, make_model()) > 5e-5


def test_dropping_the_padding_mask_changes_no_real_token(make_model, make_batch, pg_value_loss, monkeypatch):
    # Micro-batches are right-padded, so causal attention alone keeps real tokens off the
    # padding. If padding ever moved to the left (or a row's positions restarted), the
    # unmasked logprobs and the update would differ from the masked ones here.
    batch = make_batch(LENGTHS)
    masked = LocalTrainer(make_model(), cfg(lr=1e-4, attention_mask=True, critic=True), total_steps=1)
    causal = LocalTrainer(make_model(), cfg(lr=1e-4, critic=True), total_steps=1)
    seen = []
    forward = type(causal.model).forward
    monkeypatch.setattr(type(causal.model), "forward",
                        lambda self, **kw: seen.append((self, kw["attention_mask"])) or forward(self, **kw))
    for a, b in zip(masked.logprobs(batch), causal.logprobs(batch)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert {m is None for model, m in seen if model is causal.model} == {True}  # the mask was left out
    assert {m is None for model, m in seen if model is masked.model} == {False}
    for a, b in zip(masked.values(batch), causal.values(batch)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    m1, m2 = masked.train(batch, pg_value_loss), causal.train(batch, pg_value_loss)
    assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-5)
    assert max_diff(masked.model, causal.model) <= 5e-6
    assert max_diff(masked.critic, causal.critic) <= 5e-6


def test_the_head_skips_the_shared_prompt_and_changes_nothing(make_model, make_batch, pg_loss, monkeypatch):
    import conveyor.trainer.single as local
    batch = make_batch(LENGTHS)
    for i, m in enumerate(batch.loss_mask):  # every row's loss starts at position 3 or later
        m[: 3 + i % 2] = 0
    assert local.head_start(collate(batch, list(range(len(batch))), 0)) == 2
    full = LocalTrainer(make_model(), cfg(lr=1e-4), total_steps=1)
    trimmed = LocalTrainer(make_model(), cfg(lr=1e-4), total_steps=1)
    kept = []
    forward = type(trimmed.model).forward
    monkeypatch.setattr(type(trimmed.model), "forward",
                        lambda self, **kw: kept.append((self, kw.get("logits_to_keep"))) or forward(self, **kw))
    with monkeypatch.context() as m:
        m.setattr(local, "head_start", lambda mb: 0)
        m1 = full.train(batch, pg_loss)
    m2 = trimmed.train(batch, pg_loss)
    widths = [k for model, k in kept if model is trimmed.model]
    assert widths and all(k is not None and k == w - 2 for k, w in zip(widths, [max(LENGTHS)]))
    assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
    assert m2["mean_logprob"] == pytest.approx(m1["mean_logprob"], abs=1e-6)
    assert max_diff(full.model, trimmed.model) <= 1e-6
