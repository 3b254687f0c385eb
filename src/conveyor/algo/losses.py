"""Policy losses, importance weights and the loss aggregation that the trainer sums.

Contract
- Per-token tensors are [B, T]; ``mask`` is 1 on target tokens. Every loss returns
  ``(per_token_loss [B, T], metrics)`` with the loss exactly 0 off the mask, even when padded
  positions hold -inf, NaN or huge logprobs (inputs are replaced with ``torch.where`` first).
- Only ``logprobs`` (the policy being trained, π_θ) carries gradient; everything else is
  detached here, whatever the caller passes.
- ``metrics`` are detached scalar tensors over target tokens; no ``.item()`` happens here.
- ``aggregate``'s normalisers are totals over the WHOLE batch, so gradient accumulation is exact.

What it deliberately does not know: how logprobs were computed, which
micro-batch it is looking at, how advantages were estimated, or anything of
the rest of conveyor.
"""
from __future__ import annotations

import math

import torch

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IS_MODES = ("truncated", "masked", "none")
IS_LEVELS = ("token", "sequence")
BEHAVIOUR_MODES = ("truncate", "mask")

# torch.quantile refuses inputs above 2**24 elements; beyond that we take the nearest rank.
_QUANTILE_MAX = 2 ** 24


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is set; 0 where there are none."""
    m = mask.bool()
    xm = torch.where(m, x, torch.zeros_like(x))
    if dim is None:
        return xm.sum() / m.sum().clamp(min=1)
    return xm.sum(dim) / m.sum(dim).clamp(min=1)


def _masked_max(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    if not bool(m.any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(m, x, torch.full_like(x, -math.inf)).max()


def _masked_quantile(x: torch.Tensor, m: torch.Tensor, q: float) -> torch.Tensor:
    vals = x[m].float()                                   # [N]
    if vals.numel() == 0:
        return torch.zeros((), device=x.device)
    if vals.numel() > _QUANTILE_MAX:
        k = max(1, math.ceil(q * vals.numel()))
        return vals.kthvalue(k).values
    return torch.quantile(vals, q)


def _zeros_off_mask(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros_like(x))


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
                       dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PPO's pessimistic clipped surrogate, as a loss (negated objective).

    L_t = max(-r_t A_t, -clip(r_t, 1 - ε_low, 1 + ε_high) A_t)
    Dual clip (Ye et al. 2020): for A_t < 0 the loss is also capped at
    -c A_t, so a huge ratio on a bad action cannot blow up the update.
    Returns (loss [B, T], clipped [B, T] bool, dual_clipped [B, T] bool or None);
    ``clipped`` marks tokens where the clipped branch won, i.e. gradient 0.
    """
    unclipped = -ratio * adv                                                    # [B, T]
    clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv               # [B, T]
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is None:
        return loss, was_clipped, None
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss at -c*A for A < 0), got {dual_clip}")
    bound = -dual_clip * adv                                                    # [B, T]
    negative = adv < 0
    dual_clipped = negative & (loss > bound)
    return torch.where(negative, torch.minimum(loss, bound), loss), was_clipped, dual_clipped


def _token_advantages(advantages: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Accept [B] (sequence-level) or [B, T] advantages; return detached [B, T], 0 off the mask."""
    a = advantages.detach()
    if a.dim() == 1:
        a = a.unsqueeze(1).expand(m.shape)
    if a.shape != m.shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(m.shape)}, got {tuple(advantages.shape)}")
    return _zeros_off_mask(a, m)


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                  dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip (Schulman et al. 2017) with asymmetric clip (DAPO's clip-higher) and dual clip.

    ratio = r_t(θ) = π_θ(a_t|s_t) / π_old(a_t|s_t) = exp(logprobs - old_logprobs)
    loss_t = max(-r_t A_t, -clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
    with ``dual_clip`` = c: loss_t = min(loss_t, -c A_t) where A_t < 0.
    Metrics: clip_frac (tokens whose clipped branch won), ratio_mean,
    ratio_max, and dual_clip_frac when dual clip is on.
    """
    m = mask.bool()                                                   # [B, T]
    lp = _zeros_off_mask(logprobs, m)                                 # [B, T]
    old = _zeros_off_mask(old_logprobs.detach(), m)                   # [B, T]
    adv = _token_advantages(advantages, m)                            # [B, T]
    ratio = torch.exp(lp - old)                                       # [B, T], 1 off the mask
    pg, clipped, dual = _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    loss = _zeros_off_mask(pg, m)
    r = ratio.detach()
    metrics = {
        "clip_frac": masked_mean(clipped.float(), m),
        "ratio_mean": masked_mean(r, m),
        "ratio_max": _masked_max(r, m),
    }
    if dual is not None:
        metrics["dual_clip_frac"] = masked_mean(dual.float(), m)
    return loss, metrics


def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_low: float = 3e-4,
              clip_high: float = 4e-4) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025), in its GSPO-token form.

    Sequence ratio (length-normalised, geometric mean of token ratios):
        s_i(θ) = exp( 1/|y_i| * sum_t [log π_θ(y_i,t) - log π_old(y_i,t)] )   # [B]
    GSPO-token ratio, equal in value to s_i:
        s_i,t(θ) = sg[s_i(θ)] * π_θ(y_i,t) / sg[π_θ(y_i,t)]                     # [B, T]
    loss_i,t = max(-s_i,t A_i,t, -clip(s_i,t, 1 - clip_low, 1 + clip_high) A_i,t)
    Clipping is decided by s_i, so a whole sequence is clipped or not (for
    sequence-level advantages). d loss_i,t / d logprob_i,t = -A_i,t s_i
    where unclipped; aggregating with "seq-mean-token-mean" gives the
    paper's gradient s_i A_i / |y_i| * sum_t ∇ log π_θ(y_i,t).
    The default clip range is the paper's (3e-4, 4e-4), far narrower than
    PPO's because s_i is a per-token geometric mean.
    Metrics: clip_frac (fraction of target sequences clipped; with per-token
    advantages, the mean per-sequence fraction), seq_ratio_mean, seq_ratio_max.
    """
    m = mask.bool()                                                   # [B, T]
    lp = _zeros_off_mask(logprobs, m)                                 # [B, T]
    old = _zeros_off_mask(old_logprobs.detach(), m)                   # [B, T]
    adv = _token_advantages(advantages, m)                            # [B, T]
    length = m.sum(dim=1).clamp(min=1)                                # [B]
    seq_log_ratio = (lp.detach() - old).sum(dim=1) / length           # [B]
    seq_ratio = torch.exp(seq_log_ratio)                              # [B], sg[s_i]
    token_ratio = seq_ratio.unsqueeze(1) * torch.exp(lp - lp.detach())  # [B, T], value s_i
    pg, clipped, _ = _clipped_surrogate(token_ratio, adv, clip_low, clip_high, None)
    loss = _zeros_off_mask(pg, m)
    has_tokens = m.any(dim=1)                                         # [B]
    seq_clip = masked_mean(clipped.float(), m, dim=1)                 # [B]
    metrics = {
        "clip_frac": masked_mean(seq_clip, has_tokens),
        "seq_ratio_mean": masked_mean(seq_ratio, has_tokens),
        "seq_ratio_max": _masked_max(seq_ratio, has_tokens),
    }
    return loss, metrics


def decoupled_ppo_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
                       behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       clip_low: float = 0.2, clip_high: float = 0.2, behaviour_cap: float | None = None,
                       behaviour_mode: str = "truncate",
                       dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (Hilton et al. 2022), as used for asynchronous RL (AReaL).

    Three policies: π_θ (trained), π_prox (the proximal policy: the trainer's
    recomputed logprobs before this update) and π_behav (the engine's policy,
    possibly several versions old, that sampled the tokens).
    ratio   = r_t(θ) = π_θ / π_prox = exp(logprobs - proximal_logprobs)     # clipped as in PPO
    weight  = w_t = π_prox / π_behav = exp(proximal - behaviour), detached  # off-policy correction
    loss_t  = w_t * max(-r_t A_t, -clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
    ``behaviour_cap`` bounds w_t: "truncate" uses min(w_t, cap); "mask"
    drops tokens with w_t > cap (weight 0), as AReaL does.
    Metrics: clip_frac, ratio_mean, behaviour_weight_mean (uncapped),
    behaviour_capped_frac (when a cap is set), dual_clip_frac (when on).
    """
    if behaviour_mode not in BEHAVIOUR_MODES:
        raise ValueError(f"unknown behaviour_mode {behaviour_mode!r}; expected one of {BEHAVIOUR_MODES}")
    m = mask.bool()                                                   # [B, T]
    lp = _zeros_off_mask(logprobs, m)                                 # [B, T]
    prox = _zeros_off_mask(proximal_logprobs.detach(), m)             # [B, T]
    behav = _zeros_off_mask(behaviour_logprobs.detach(), m)           # [B, T]
    adv = _token_advantages(advantages, m)                            # [B, T]
    ratio = torch.exp(lp - prox)                                      # [B, T]
    pg, clipped, dual = _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    weight = torch.exp(prox - behav)                                  # [B, T], 1 off the mask
    applied = weight
    if behaviour_cap is not None:
        over = weight > behaviour_cap                                 # [B, T]
        if behaviour_mode == "truncate":
            applied = weight.clamp(max=behaviour_cap)
        else:
            applied = torch.where(over, torch.zeros_like(weight), weight)
    loss = _zeros_off_mask(applied * pg, m)
    metrics = {
        "clip_frac": masked_mean(clipped.float(), m),
        "ratio_mean": masked_mean(ratio.detach(), m),
        "behaviour_weight_mean": masked_mean(weight, m),
    }
    if behaviour_cap is not None:
        metrics["behaviour_capped_frac"] = masked_mean(over.float(), m)
    if dual is not None:
        metrics["dual_clip_frac"] = masked_mean(dual.float(), m)
    return loss, metrics


def importance_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str = "truncated", level: str = "token",
                       cap: float = 2.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Correction weights for the engine/trainer mismatch (TIS / MIS).

    The engine samples from π_engine, which differs numerically from the
    trainer's π_θ (other kernels, precision). Multiply the per-token loss by
    the returned weights (detached, 0 off the mask).
    token level:    w_t = π_θ(a_t|s_t) / π_engine(a_t|s_t) = exp(trainer - engine)
    sequence level: w_i = prod_t w_t = exp(sum_t (trainer - engine)) over the
                    target tokens of sequence i, broadcast to its tokens
    mode "truncated" (TIS): min(w, cap); "masked" (MIS): w if w <= cap else 0;
    "none": weight 1 everywhere, metrics only (to watch the mismatch).
    Metrics over target tokens (a sequence ratio counts once per token):
    is_ratio_mean, is_ratio_p99, and is_truncated_frac / is_masked_frac /
    is_over_cap_frac (the fraction with w > cap).
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {IS_MODES}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; expected one of {IS_LEVELS}")
    m = mask.bool()                                                   # [B, T]
    log_w = _zeros_off_mask(trainer_logprobs.detach() - engine_logprobs.detach(), m)  # [B, T]
    if level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand(m.shape)        # [B, T]
    raw = torch.exp(log_w.float())                                    # [B, T]
    over = raw > cap                                                  # [B, T]
    if mode == "truncated":
        w = raw.clamp(max=cap)
    elif mode == "masked":
        w = torch.where(over, torch.zeros_like(raw), raw)
    else:
        w = torch.ones_like(raw)
    frac_name = {"truncated": "is_truncated_frac", "masked": "is_masked_frac", "none": "is_over_cap_frac"}[mode]
    metrics = {
        "is_ratio_mean": masked_mean(raw, m),
        "is_ratio_p99": _masked_quantile(raw, m, 0.99),
        frac_name: masked_mean(over.float(), m),
    }
    return _zeros_off_mask(w, m), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy H = -sum_v p_v log p_v of the next-token distribution: [B, T, V] -> [B, T].

    Uses log_softmax for stability; vocabulary entries with logit -inf
    (p = 0) contribute 0 rather than 0 * -inf = NaN, in value and gradient.
    Computed in the logits' dtype; upcast first if that matters.
    """
    logp = torch.log_softmax(logits, dim=-1)                          # [B, T, V]
    p = logp.exp()                                                    # [B, T, V]
    safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return -(p * safe_logp).sum(dim=-1)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic regression loss for GAE, optionally clipped around the old values (PPO2 style).

    loss_t = 0.5 * (V_θ(s_t) - R_t)^2, or with ``clip`` = ε:
    loss_t = 0.5 * max((V_θ - R_t)^2, (V_old + clip(V_θ - V_old, -ε, ε) - R_t)^2)
    Metrics: value_clip_frac (when clipped), value_mean, value_error (mean |V - R|).
    """
    m = mask.bool()                                                   # [B, T]
    v = _zeros_off_mask(values, m)                                    # [B, T]
    ret = _zeros_off_mask(returns.detach(), m)                        # [B, T]
    sq = (v - ret).pow(2)                                             # [B, T]
    metrics = {"value_mean": masked_mean(v.detach(), m), "value_error": masked_mean((v - ret).detach().abs(), m)}
    if clip is not None:
        old = _zeros_off_mask(old_values.detach(), m)                 # [B, T]
        v_clipped = old + (v - old).clamp(-clip, clip)                # [B, T]
        sq_clipped = (v_clipped - ret).pow(2)
        metrics["value_clip_frac"] = masked_mean((sq_clipped > sq).float(), m)
        sq = torch.maximum(sq, sq_clipped)
    return _zeros_off_mask(0.5 * sq, m), metrics


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: int | float,
              num_seqs: int, norm_len: int | float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to the scalar to backpropagate.

    ``num_tokens`` (target tokens) and ``num_seqs`` (sequences) are totals
    over the WHOLE batch, never this micro-batch's, which makes the result
    additive over micro-batches. With l the loss, m the mask, len_i = sum_t m_i,t:
      "token-mean"              sum_i,t l m / num_tokens
      "seq-mean-token-sum"      sum_i (sum_t l m) / num_seqs
      "seq-mean-token-mean"     sum_i (sum_t l m / max(len_i, 1)) / num_seqs
      "seq-mean-token-sum-norm" sum_i,t l m / (num_seqs * norm_len)   (Dr.GRPO; norm_len
                                is a constant such as the maximum generation length)
    A zero normaliser (a batch without targets) gives 0.

    ``aggregate`` turns a per-token loss into the scalar to backpropagate,
    with normalisers that are totals over the WHOLE batch (passed in). Hence
    summing ``aggregate`` over any split of a batch into micro-batches equals
    one call on the whole batch, value and gradient: gradient accumulation is
    exact, whatever the micro-batch sizes.
    """
    m = mask.bool()
    l = _zeros_off_mask(per_token, m)                                 # [B, T]
    if mode == "token-mean":
        return l.sum() / max(num_tokens, 1)
    if mode == "seq-mean-token-sum":
        return l.sum() / max(num_seqs, 1)
    if mode == "seq-mean-token-mean":
        per_seq = l.sum(dim=1) / m.sum(dim=1).clamp(min=1)            # [B]
        return per_seq.sum() / max(num_seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        if norm_len is None or norm_len <= 0:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_len > 0 "
                             "(a fixed length such as rollout.max_new_tokens)")
        return l.sum() / (max(num_seqs, 1) * norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATION_MODES}")
