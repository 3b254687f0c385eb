"""Per-token estimators of KL(π_θ || π_ref) from samples of the policy π_θ.

Contract: ``kl_estimate(logprobs, ref_logprobs, kind)`` returns a [B, T]
tensor whose expectation over tokens sampled from π_θ estimates the KL
divergence from the reference (k1, k2 or k3: Schulman, "Approximating KL divergence", 2020).
Gradients flow into ``logprobs`` (the policy being trained); the reference is
frozen, so ``ref_logprobs`` is detached. With ``mask`` given, off-mask
positions are exactly 0 whatever garbage they hold.

What it deliberately does not know: whether the estimate becomes a loss term
(kl_coef * KL added to the loss) or a reward penalty (REINFORCE++'s
-kl_coef * KL_t), nor how it is aggregated over tokens.
"""
from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3",
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate [B, T]; with

        log_ratio = logprobs - ref_logprobs = log π_θ(a_t|s_t) - log π_ref(a_t|s_t)
    and ρ = π_ref / π_θ = exp(-log_ratio) (Schulman, "Approximating KL
    divergence", 2020):
        k1 = log_ratio                            unbiased, high variance, can be < 0
        k2 = 0.5 * log_ratio^2                    biased, low variance, >= 0
        k3 = ρ - 1 - log ρ = exp(-log_ratio) - 1 + log_ratio
                                                  unbiased, low variance, >= 0
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")
    lp, ref = logprobs, ref_logprobs.detach()
    if mask is not None:
        # Replace garbage before any arithmetic so neither values nor gradients see it.
        m = mask.bool()
        lp = torch.where(m, lp, torch.zeros_like(lp))
        ref = torch.where(m, ref, torch.zeros_like(ref))
    log_ratio = lp - ref                                   # [B, T]
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    return torch.exp(-log_ratio) - 1.0 + log_ratio
