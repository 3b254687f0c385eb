"""Policy losses, importance weights, entropy and aggregation against hand-computed values."""
import math

import pytest
import torch

from conveyor.algo import (
    aggregate,
    decoupled_ppo_loss,
    entropy_from_logits,
    gspo_loss,
    importance_weights,
    masked_mean,
    ppo_clip_loss,
    value_loss,
)

NAN, INF = float("nan"), float("inf")


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def logs(*xs):
    return [math.log(x) for x in xs]


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    close(masked_mean(x, mask), 7 / 3)
    close(masked_mean(x, mask, dim=1), [1.5, 4.0, 0.0])  # empty row -> 0


# ---- PPO ---------------------------------------------------------------------------------------

def _ppo_case():
    # ratios [1.5, 0.5, 1.1, 0.7] (old = 0), advantages [1, 1, -1, -1]; column 4 is padding garbage
    lp = torch.tensor([logs(1.5, 0.5, 1.1, 0.7) + [-INF]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, NAN]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return lp, old, adv, mask


def test_ppo_values_gradients_and_metrics():
    lp, old, adv, mask = _ppo_case()
    loss, m = ppo_clip_loss(lp, old, adv, mask)
    # t0: max(-1.5, -1.2) clipped; t1: max(-0.5, -0.8); t2: 1.1 both; t3: max(0.7, 0.8) clipped
    close(loss, [[-1.2, -0.5, 1.1, 0.8, 0.0]])
    loss.sum().backward()
    # d(-r A)/d lp = -r A where unclipped, 0 where clipped (and on padding, no NaN)
    close(lp.grad, [[0.0, -0.5, 1.1, 0.0, 0.0]])
    close(m["clip_frac"], 0.5)
    close(m["ratio_mean"], 0.95)
    close(m["ratio_max"], 1.5)
    assert not m["clip_frac"].requires_grad


def test_ppo_asymmetric_clip_higher():
    lp, old, adv, mask = torch.tensor([logs(1.25)]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    close(ppo_clip_loss(lp, old, adv, mask)[0], [[-1.2]])
    close(ppo_clip_loss(lp, old, adv, mask, clip_high=0.28)[0], [[-1.25]])


def test_ppo_dual_clip_bounds_negative_advantages():
    lp = torch.tensor([logs(4.0, 2.0, 4.0)], requires_grad=True)
    old, adv, mask = torch.zeros(1, 3), torch.tensor([[-1.0, -1.0, 1.0]]), torch.ones(1, 3)
    loss, m = ppo_clip_loss(lp, old, adv, mask, dual_clip=3.0)
    # t0: max(4, 1.2) = 4 capped at -3*A = 3; t1: 2 < 3 unchanged; t2 (A > 0): max(-4, -1.2)
    close(loss, [[3.0, 2.0, -1.2]])
    loss.sum().backward()
    close(lp.grad, [[0.0, 2.0, 0.0]])
    close(m["dual_clip_frac"], 1 / 3)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip_loss(lp, old, adv, mask, dual_clip=1.0)


def test_ppo_accepts_sequence_advantages():
    lp, old, mask = torch.tensor([logs(1.1, 0.9)]), torch.zeros(1, 2), torch.ones(1, 2)
    close(ppo_clip_loss(lp, old, torch.tensor([2.0]), mask)[0], [[-2.2, -1.8]])


# ---- GSPO --------------------------------------------------------------------------------------

def test_gspo_clips_whole_sequences():
    # seq 0: mean log-ratio 0.2 -> s = e^0.2 = 1.2214, above 1 + 4e-4: clipped to 1.0004
    # seq 1: mean log-ratio 1e-4 -> s = 1.0001, inside the range
    lp = torch.tensor([[0.1, 0.3, -INF], [-1e-4, 3e-4, 1e-4]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, NAN], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, m = gspo_loss(lp, old, torch.tensor([1.0, 2.0], dtype=torch.float64), mask)
    s1 = math.exp(1e-4)
    close(loss, [[-1.0004, -1.0004, 0.0], [-2 * s1, -2 * s1, -2 * s1]], atol=1e-9)
    loss.sum().backward()
    close(lp.grad, [[0.0, 0.0, 0.0], [-2 * s1, -2 * s1, -2 * s1]], atol=1e-9)
    close(m["clip_frac"], 0.5)
    close(m["seq_ratio_max"], math.exp(0.2), atol=1e-9)


def test_gspo_gradient_is_sequence_ratio_gradient_spread_over_tokens():
    # s = exp(mean(0.2, 0.4, -0.3)) = e^0.1; A = -2; wide clip so nothing is clipped
    lp = torch.tensor([[0.2, 0.4, -0.3]], dtype=torch.float64, requires_grad=True)
    old, mask, adv = torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3), torch.tensor([-2.0])
    loss, _ = gspo_loss(lp, old, adv.double(), mask, clip_low=0.5, clip_high=0.5)
    total = aggregate(loss, mask, "seq-mean-token-mean", num_tokens=3, num_seqs=1)
    s = math.exp(0.1)
    close(total, 2 * s, atol=1e-9)
    total.backward()
    # every token: -A * s / len = 2 * e^0.1 / 3 = 0.73678
    close(lp.grad, [[2 * s / 3] * 3], atol=1e-9)
    # identical to differentiating the sequence-level objective -A * exp(mean(lp - old)) directly
    lp2 = lp.detach().clone().requires_grad_(True)
    (2.0 * torch.exp(lp2.mean())).backward()
    torch.testing.assert_close(lp.grad, lp2.grad)


# ---- decoupled PPO -----------------------------------------------------------------------------

def _decoupled_case():
    # lp == prox (ratio 1); behaviour weights w = prox/behav = [0.5, 1.5, 3.0]; padding at t3
    lp = torch.tensor([[0.0, 0.0, 0.0, -INF]], requires_grad=True)
    prox = torch.tensor([[0.0, 0.0, 0.0, NAN]], requires_grad=True)
    behav = torch.tensor([[-math.log(w) for w in (0.5, 1.5, 3.0)] + [-INF]], requires_grad=True)
    return lp, prox, behav, torch.tensor([[1.0, 1.0, 1.0, NAN]]), torch.tensor([[1, 1, 1, 0]])


def test_decoupled_ppo_truncated_behaviour_weight():
    lp, prox, behav, adv, mask = _decoupled_case()
    loss, m = decoupled_ppo_loss(lp, prox, behav, adv, mask, behaviour_cap=2.0)
    close(loss, [[-0.5, -1.5, -2.0, 0.0]], atol=1e-6)
    loss.sum().backward()
    close(lp.grad, [[-0.5, -1.5, -2.0, 0.0]], atol=1e-6)
    assert prox.grad is None and behav.grad is None  # the weight is detached
    close(m["behaviour_weight_mean"], 5 / 3, atol=1e-6)
    close(m["behaviour_capped_frac"], 1 / 3)
    close(m["clip_frac"], 0.0)


def test_decoupled_ppo_masks_heavy_tokens():
    lp, prox, behav, adv, mask = _decoupled_case()
    loss, _ = decoupled_ppo_loss(lp, prox, behav, adv, mask, behaviour_cap=2.0, behaviour_mode="mask")
    close(loss, [[-0.5, -1.5, 0.0, 0.0]], atol=1e-6)
    loss, _ = decoupled_ppo_loss(lp, prox, behav, adv, mask)  # no cap: the raw weights
    close(loss, [[-0.5, -1.5, -3.0, 0.0]], atol=1e-6)


def test_decoupled_ppo_clips_against_the_proximal_policy():
    # ratio to prox 1.5 > 1.2 with A = 1: clipped to -1.2, then weighted by w = 0.5
    lp = torch.tensor([logs(1.5)], requires_grad=True)
    loss, m = decoupled_ppo_loss(lp, torch.zeros(1, 1), torch.tensor([[math.log(2.0)]]),
                                 torch.ones(1, 1), torch.ones(1, 1))
    close(loss, [[-0.6]])
    loss.sum().backward()
    close(lp.grad, [[0.0]])
    close(m["clip_frac"], 1.0)


def test_decoupled_ppo_equals_ppo_when_behaviour_is_proximal():
    lp, old, adv, mask = _ppo_case()
    ppo, _ = ppo_clip_loss(lp, old, adv, mask)
    dec, _ = decoupled_ppo_loss(lp, old, old, adv, mask)
    torch.testing.assert_close(dec, ppo)


# ---- importance weights ------------------------------------------------------------------------

def _is_token_case():
    engine = torch.tensor([[-math.log(w) for w in (0.5, 1.0, 2.5, 4.0)] + [-INF]])
    trainer = torch.tensor([[0.0, 0.0, 0.0, 0.0, NAN]], requires_grad=True)
    return trainer, engine, torch.tensor([[1, 1, 1, 1, 0]])


def test_token_level_truncated():
    trainer, engine, mask = _is_token_case()
    w, m = importance_weights(trainer, engine, mask, mode="truncated", level="token", cap=2.0)
    close(w, [[0.5, 1.0, 2.0, 2.0, 0.0]], atol=1e-6)
    assert not w.requires_grad
    close(m["is_ratio_mean"], 2.0, atol=1e-6)
    close(m["is_ratio_p99"], 3.955, atol=1e-5)  # linear interpolation: 2.5 + 0.97 * 1.5
    close(m["is_truncated_frac"], 0.5)


def test_token_level_masked():
    trainer, engine, mask = _is_token_case()
    w, m = importance_weights(trainer, engine, mask, mode="masked", level="token", cap=2.0)
    close(w, [[0.5, 1.0, 0.0, 0.0, 0.0]], atol=1e-6)
    close(m["is_masked_frac"], 0.5)


def test_sequence_level_uses_the_product_of_token_ratios():
    # row 0: log-ratios 0.1 + 0.2 -> e^0.3 = 1.34986; row 1: 0.5 + 0.4 -> e^0.9 = 2.45960 > cap
    trainer = torch.tensor([[0.1, 0.2, NAN], [0.5, 0.4, 3.0]])
    engine = torch.tensor([[0.0, 0.0, -INF], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    a = math.exp(0.3)
    w, m = importance_weights(trainer, engine, mask, mode="truncated", level="sequence", cap=2.0)
    close(w, [[a, a, 0.0], [2.0, 2.0, 0.0]], atol=1e-5)
    close(m["is_ratio_mean"], (a + math.exp(0.9)) / 2, atol=1e-5)
    close(m["is_truncated_frac"], 0.5)
    w, m = importance_weights(trainer, engine, mask, mode="masked", level="sequence", cap=2.0)
    close(w, [[a, a, 0.0], [0.0, 0.0, 0.0]], atol=1e-5)
    close(m["is_masked_frac"], 0.5)


def test_importance_weights_reject_unknown_names():
    t = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="mode 'clip'"):
        importance_weights(t, t, t, mode="clip")
    with pytest.raises(ValueError, match="level 'group'"):
        importance_weights(t, t, t, level="group")


# ---- entropy and value loss --------------------------------------------------------------------

def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -INF, -INF]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    # uniform over 4: ln 4; p = [0.25, 0.75]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.56234
    close(ent, [[math.log(4.0), 0.5623351]], atol=1e-6)
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()
    close(logits.grad[0, 1, 2:], [0.0, 0.0])


def test_value_loss_plain_and_clipped():
    values = torch.tensor([[0.5, 1.1, NAN]], requires_grad=True)
    old, ret, mask = torch.tensor([[1.0, 0.5, 0.0]]), torch.tensor([[1.0, 1.0, INF]]), torch.tensor([[1, 1, 0]])
    loss, _ = value_loss(values, old, ret, mask)
    close(loss, [[0.125, 0.005, 0.0]])
    # clip 0.2: t0 clipped value 0.8 -> max(0.25, 0.04); t1 clipped value 0.7 -> max(0.01, 0.09)
    loss, m = value_loss(values, old, ret, mask, clip=0.2)
    close(loss, [[0.125, 0.045, 0.0]])
    loss.sum().backward()
    close(values.grad, [[-0.5, 0.0, 0.0]])
    close(m["value_clip_frac"], 0.5)


# ---- aggregation -------------------------------------------------------------------------------

AGG_L = torch.tensor([[1.0, 2.0, 99.0], [4.0, NAN, -INF]])
AGG_M = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 7 / 3),                    # (1 + 2 + 4) / 3 tokens
    ("seq-mean-token-sum", 3.5),              # (3 + 4) / 2 sequences
    ("seq-mean-token-mean", 2.75),            # (3/2 + 4/1) / 2
    ("seq-mean-token-sum-norm", 0.875),       # 7 / (2 * 4)
])
def test_aggregate_values(mode, expected):
    close(aggregate(AGG_L, AGG_M, mode, num_tokens=3, num_seqs=2, norm_len=4), expected)


def test_aggregate_errors():
    with pytest.raises(ValueError, match="needs norm_len"):
        aggregate(AGG_L, AGG_M, "seq-mean-token-sum-norm", num_tokens=3, num_seqs=2)
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        aggregate(AGG_L, AGG_M, "sum", num_tokens=3, num_seqs=2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("sizes", [[1] * 8, [3, 5], [8]])
def test_aggregate_is_additive_over_micro_batches(mode, sizes):
    gen = torch.Generator().manual_seed(0)
    lengths = [6, 1, 0, 4, 6, 2, 5, 3]  # one sequence without targets
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])
    base = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    base[mask == 0] = NAN  # garbage must not leak through the split either
    num_tokens = int(mask.sum())

    whole_l = base.clone().requires_grad_(True)
    whole = aggregate(whole_l * 2.0, mask, mode, num_tokens, 8, norm_len=6)
    whole.backward()

    split_l = base.clone().requires_grad_(True)
    total, start = torch.zeros((), dtype=torch.float64), 0
    for n in sizes:
        piece = aggregate(split_l[start:start + n] * 2.0, mask[start:start + n], mode, num_tokens, 8, norm_len=6)
        piece.backward()  # gradients accumulate as in a trainer's micro-batch loop
        total, start = total + piece.detach(), start + n
    torch.testing.assert_close(total, whole.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(split_l.grad, whole_l.grad, atol=1e-12, rtol=0)
    assert torch.isfinite(whole_l.grad).all()
