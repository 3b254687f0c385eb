"""Advantage estimators against hand-computed values."""
import math

import pytest
import torch

from conveyor.algo import (
    compute_group_advantages,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_grpo_uses_population_std():
    # group 0: mean 0.5, population std 0.5; group 1: mean 2, std sqrt(0.5)
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    s = 1 / math.sqrt(0.5)
    close(grpo_advantages(r), [[1.0, -1.0, -1.0, 1.0], [s, -s, 0.0, 0.0]])


def test_grpo_equal_rewards_give_zero_not_nan():
    close(grpo_advantages(torch.tensor([[5.0, 5.0, 5.0]])), [[0.0, 0.0, 0.0]])


def test_drgrpo_only_centres():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    close(grpo_advantages(r, std_normalize=False), [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])


def test_rloo_leaves_one_out():
    # sample 0: 1 - mean(0, 0, 1) = 2/3; sample 1: 0 - mean(1, 0, 1) = -2/3
    close(rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]])), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    close(rloo_advantages(torch.tensor([[4.0, 1.0]])), [[3.0, -3.0]])


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages(torch.tensor([[1.0], [0.0]]))


def test_group_estimators_reject_flat_rewards():
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        grpo_advantages(torch.tensor([1.0, 0.0]))


def test_dispatch_by_name():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    close(compute_group_advantages("grpo", r), [[1.0, -1.0, -1.0, 1.0]])
    close(compute_group_advantages("drgrpo", r), [[0.5, -0.5, -0.5, 0.5]])
    close(compute_group_advantages("rloo", r), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])
    with pytest.raises(ValueError, match="unknown group advantage estimator 'gae'"):
        compute_group_advantages("gae", r)


def test_expand_to_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    close(expand_to_tokens(torch.tensor([2.0, -1.0]), mask), [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]])


def test_reinforce_pp_whitens_over_all_batch_tokens():
    # returns (gamma 1): [[1, 1, 1, -], [0, 0, -, -]]; masked mean 0.6, population var 0.24
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask)
    hi, lo = 0.4 / math.sqrt(0.24), -0.6 / math.sqrt(0.24)
    close(adv, [[hi, hi, hi, 0.0], [lo, lo, 0.0, 0.0]])


def test_reinforce_pp_kl_penalty_and_discount():
    # token rewards -0.5*kl = [-0.05, -0.1, -0.15], +1 on the last: [-0.05, -0.1, 0.85]
    # returns with gamma 0.5: [0.1125, 0.325, 0.85]; then whitened (mean 0.42917, std 0.30996)
    kl = torch.tensor([[0.1, 0.2, 0.3]])
    adv = reinforce_pp_advantages(torch.tensor([1.0]), torch.ones(1, 3), kl=kl, kl_coef=0.5, gamma=0.5)
    close(adv, [[-1.0216309, -0.3360628, 1.3576938]])


def test_reinforce_pp_skips_environment_tokens_and_ignores_garbage():
    # target tokens at t=0 and t=2; returns [0.5, -, 1] -> whitened [-1, 0, 1]
    mask = torch.tensor([[1, 0, 1, 0]])
    kl = torch.tensor([[0.0, float("nan"), 0.0, float("inf")]])
    adv = reinforce_pp_advantages(torch.tensor([1.0]), mask, kl=kl, kl_coef=1.0, gamma=0.5)
    close(adv, [[-1.0, 0.0, 1.0, 0.0]])


def test_reinforce_pp_row_without_targets_is_zero():
    mask = torch.tensor([[1, 1], [0, 0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 7.0]), mask)
    close(adv, [[0.0, 0.0], [0.0, 0.0]])


def test_gae_lambda_one_is_monte_carlo():
    # deltas [0.1, 0.1, 0.3] -> advantages [0.5, 0.4, 0.3]; returns = A + V = 1 everywhere
    r, v = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_discounted():
    # t2: delta 0.3, A 0.3; t1: delta 0.9*0.7-0.6 = 0.03, A = 0.03 + 0.45*0.3 = 0.165
    # t0: delta 0.9*0.6-0.5 = 0.04, A = 0.04 + 0.45*0.165 = 0.11425
    r, v = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=0.9, lam=0.5)
    close(adv, [[0.11425, 0.165, 0.3]])
    close(ret, [[0.61425, 0.765, 1.0]])


def test_gae_skips_untargeted_positions_and_garbage():
    # only t0 and t2 are targets: A2 = 1 - 0.7 = 0.3, A0 = (0.7 - 0.5) + 0.3 = 0.5
    r = torch.tensor([[0.0, 99.0, 1.0, 99.0]])
    v = torch.tensor([[0.5, float("nan"), 0.7, float("inf")]])
    adv, ret = gae_advantages(r, v, torch.tensor([[1, 0, 1, 0]]), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.0, 0.3, 0.0]])
    close(ret, [[1.0, 0.0, 1.0, 0.0]])


def test_gae_whiten_keeps_raw_returns():
    r, v = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0, whiten=True)
    s = 0.1 / math.sqrt(0.02 / 3)  # eps=1e-6 moves this by ~1.5e-5
    close(adv, [[s, 0.0, -s]], atol=1e-4)
    close(ret, [[1.0, 1.0, 1.0]])
