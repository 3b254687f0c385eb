"""The sampler's behaviour logprob is the trainer's formula on the same logits.

``sampling.sample`` and ``trainer.logprobs.token_logprobs`` both compute the token's
temperature-scaled logit minus the row's logsumexp in float32, so on identical logits they
agree to one rounding of the logsumexp (their row blocking may differ): float32 epsilon
times |logsumexp|. torch's CPU ``log_softmax`` kernel, which the sampler used before, is
off by several times that at a 49k vocabulary and logits of a real model's size.
"""
import pytest
import torch

from conveyor.rollout.native.sampling import draw_seeds, sample
from conveyor.trainer.logprobs import token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_sampler_logprob_equals_the_trainers_on_the_same_logits(temperature):
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 64, 49152  # SmolLM2's vocabulary; logits spread and offset like its (|logit| up to ~40)
    logits = torch.randn(rows, vocab, generator=gen) * 5 + 10
    seeds = torch.from_numpy(draw_seeds(list(range(rows)), [0] * rows))
    tokens, got = sample(logits, temperature=temperature, seeds=seeds)
    # The trainer scores token t from the logits at t - 1: one two-token sequence per row.
    ids = torch.stack([torch.zeros_like(tokens), tokens], 1)
    scores = torch.stack([logits, torch.zeros_like(logits)], 1)
    scale = temperature or 1.0  # greedy reports log_softmax(logits), the trainer's at T = 1
    want = token_logprobs(scores, ids, torch.ones_like(ids), temperature=scale)[0][:, 1]
    lse = torch.logsumexp(logits / scale, -1)
    tol = torch.finfo(torch.float32).eps * lse.abs()
    assert ((got - want).abs() <= tol).all(), float((got - want).abs().max())
