"""Token sampling and behaviour logprobs from one step's logits.

Contract: ``sample(logits, ...)`` takes next-token logits ``[B, V]`` (any float
dtype) and returns ``(tokens [B] long, logprobs [B] float32)``. Everything is
computed in float32. The logprob is ``log_softmax(logits / T)`` of the
temperature-scaled distribution BEFORE top-k / top-p truncation, gathered at the
sampled token (``log_softmax(logits)`` for greedy), because the trainer
recomputes exactly that; truncation only decides which tokens may be drawn.
``eos_bias`` is added to the EOS logits first, so the logprob is of the biased
distribution. Randomness comes only from the ``generator`` passed in.

It does not know about requests, stop conditions or the model: one call, one
batch of logits.
"""
from __future__ import annotations

import torch


def _top_k_mask(scaled: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties with the k-th survive)."""
    if k <= 0 or k >= scaled.shape[-1]:
        return scaled
    kth = torch.topk(scaled, k, dim=-1).values[:, -1:]
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _top_p_mask(scaled: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return scaled
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Probability mass strictly before each token: a token is dropped once the mass
    # before it already reaches p, so the most likely token is always kept.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           eos_ids: tuple[int, ...] = (), eos_bias: float = 0.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return the tokens and their float32 logprobs."""
    logits = logits.float()
    if eos_bias and eos_ids:
        logits = logits.clone()
        logits[:, list(eos_ids)] += eos_bias
    if temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        allowed = _top_p_mask(_top_k_mask(scaled, top_k), top_p)
        probs = torch.softmax(allowed, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
