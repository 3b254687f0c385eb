"""Advantage estimators: scores in, per-sequence or per-token advantages out.

Contract
- Group estimators (GRPO, Dr.GRPO, RLOO) take ``rewards`` [G, n] (row g: the n samples of task
  g) and return [G, n] sequence-level advantages; ``expand_to_tokens`` spreads them over a mask.
- Token estimators (REINFORCE++, GAE) take [B, T] tensors and a ``mask`` of policy target
  tokens; they read only masked positions (others may hold NaN or inf) and return exactly 0 there.
- Everything is a pure function of its tensors; every output is detached.
- ``estimate_*``: the estimators as ``conveyor.config.estimators.ESTIMATORS`` names them, one
  call shape ``(AdvantageInputs) -> (advantages [B, T], returns [B, T] or None)``.

What it deliberately does not know: where rewards came from, how groups were
formed (callers build the [G, n] matrix from explicit groups), which loss
consumes the result, or anything of the rest of conveyor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo")


def _check_group_rewards(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"group rewards must be [G, n] (groups x samples), got shape {tuple(rewards.shape)}")


@torch.no_grad()
def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6, std_normalize: bool = True) -> torch.Tensor:
    """GRPO group-relative advantage (Shao et al. 2024).

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)          # [G, n]

    ``std`` is the population standard deviation (``unbiased=False``,
    dividing by n): it is the scale of the n numbers actually observed, and it
    keeps a group of two samples {1, 0} at advantages {+1, -1} rather than
    {+0.71, -0.71}. A group whose rewards are all equal gets advantage 0
    everywhere (numerator 0; eps keeps the division finite).

    ``std_normalize=False`` is Dr.GRPO (Liu et al. 2025): A_i = r_i - mean,
    which removes the bias towards groups with low reward variance.
    """
    _check_group_rewards(rewards)
    r = rewards.float()                                  # [G, n]
    centred = r - r.mean(dim=1, keepdim=True)            # [G, n]
    if not std_normalize:
        return centred
    std = r.std(dim=1, keepdim=True, unbiased=False)     # [G, 1]
    return centred / (std + eps)


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = r_i - 1/(n-1) * sum_{j != i} r_j                      # [G, n]

    The baseline of sample i excludes i itself, so it is independent of the
    action and the estimator stays unbiased. Needs n >= 2 samples per group.
    """
    _check_group_rewards(rewards)
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(f"RLOO needs at least 2 samples per group to leave one out, got n={n}; "
                         "raise rollout.n or use advantage=grpo")
    r = rewards.float()                                  # [G, n]
    others_mean = (r.sum(dim=1, keepdim=True) - r) / (n - 1)  # [G, n]
    return r - others_mean


def compute_group_advantages(name: str, rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dispatch a group estimator by its config name: "grpo" | "drgrpo" | "rloo"."""
    if name == "grpo":
        return grpo_advantages(rewards, eps=eps, std_normalize=True)
    if name == "drgrpo":
        return grpo_advantages(rewards, eps=eps, std_normalize=False)
    if name == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"unknown group advantage estimator {name!r}; expected one of {GROUP_ESTIMATORS}")


@torch.no_grad()
def turn_advantages(turn_rewards: torch.Tensor, turn_mask: torch.Tensor, gamma: float = 1.0,
                    std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Turn-level credit for the n multi-turn episodes of one group.

    r_{i,k}: the reward of turn k of episode i (a process reward; the episode's final reward
    sits on its last turn). The return of a turn is the discounted sum of the rewards from it
    on, over the episode's own turns:
        G_{i,k} = r_{i,k} + gamma * G_{i,k+1}          (G after the last turn = 0)
    and the advantage compares it with every turn of every episode of the group:
        A_{i,k} = (G_{i,k} - mean(G)) / (std(G) + eps)   (population std; over valid turns)
    so, as in GRPO, only the group's own samples form the baseline. ``std_normalize=False``
    keeps A = G - mean(G) (Dr.GRPO's form). With gamma = 1 and the reward only at the end,
    every turn of an episode has the same return, and the result is GRPO on the episodes with
    each episode weighted by its number of turns.

    Shapes: turn_rewards, turn_mask [n, K] (K: the most turns; mask 1 on real turns) -> [n, K],
    0 off the mask.
    """
    m = turn_mask.bool()                                              # [n, K]
    r = torch.where(m, turn_rewards.float(), torch.zeros_like(turn_rewards, dtype=torch.float32))
    G = torch.zeros_like(r)                                           # [n, K]
    running = torch.zeros(r.shape[0], dtype=torch.float32)            # [n]
    for k in range(r.shape[1] - 1, -1, -1):
        running = torch.where(m[:, k], r[:, k] + gamma * running, running)
        G[:, k] = running
    count = m.sum().clamp(min=1)
    mean = torch.where(m, G, torch.zeros_like(G)).sum() / count
    centred = torch.where(m, G - mean, torch.zeros_like(G))
    if not std_normalize:
        return centred
    std = (centred ** 2).sum().div(count).sqrt()
    return centred / (std + eps)


@torch.no_grad()
def expand_to_tokens(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every target token its sequence's advantage: [B] -> [B, T], 0 off the mask."""
    if seq_adv.dim() != 1 or seq_adv.shape[0] != mask.shape[0]:
        raise ValueError(f"seq_adv must be [B] with B={mask.shape[0]}, got shape {tuple(seq_adv.shape)}")
    m = mask.bool()                                      # [B, T]
    per_token = seq_adv.float().unsqueeze(1).expand(m.shape)  # [B, T]
    return torch.where(m, per_token, torch.zeros_like(per_token))


def _whiten(x: torch.Tensor, m: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole batch, 0 elsewhere.

    Population std, as in ``grpo_advantages``. With no masked entry at all the
    result is all zeros.
    """
    count = m.sum().clamp(min=1)
    xm = torch.where(m, x, torch.zeros_like(x))
    mean = xm.sum() / count
    var = torch.where(m, (x - mean) ** 2, torch.zeros_like(x)).sum() / count
    out = (x - mean) / (var.sqrt() + eps)
    return torch.where(m, out, torch.zeros_like(out))


def _last_masked_index(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last True per row ([B]) and whether the row has any ([B])."""
    T = m.shape[1]
    # argmax returns the first maximum, so search the time-reversed mask.
    last = (T - 1) - torch.flip(m.int(), dims=[1]).argmax(dim=1)  # [B]
    return last, m.any(dim=1)


@torch.no_grad()
def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                            kl_coef: float = 0.0, gamma: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted token returns, whitened over the batch.

    Token reward r_t = -kl_coef * KL_t on every target token, plus the
    sequence reward R on the sequence's last target token. The return is
    G_t = sum_{k >= t} gamma^(k - t) r_k, where k and t count target tokens
    only (environment tokens between turns are skipped, not discounted).
    The advantage is G_t whitened over ALL target tokens of the batch:
    A_t = (G_t - mean(G)) / (std(G) + eps), population std.

    Shapes: rewards [B], mask [B, T], kl [B, T] or None -> advantages [B, T].
    A sequence with no target token contributes nothing (its reward is dropped).
    """
    m = mask.bool()                                                  # [B, T]
    B, T = m.shape
    if rewards.shape != (B,):
        raise ValueError(f"rewards must be [B] with B={B}, got shape {tuple(rewards.shape)}")
    token_r = torch.zeros(B, T, dtype=torch.float32, device=m.device)  # [B, T]
    if kl is not None and kl_coef != 0.0:
        token_r = torch.where(m, -kl_coef * kl.float(), token_r)
    last, has_any = _last_masked_index(m)                            # [B], [B]
    rows = torch.arange(B, device=m.device)
    token_r[rows, last] += torch.where(has_any, rewards.float(), torch.zeros_like(rewards, dtype=torch.float32))
    returns = torch.zeros_like(token_r)                              # [B, T]
    running = torch.zeros(B, dtype=torch.float32, device=m.device)   # [B]
    for t in range(T - 1, -1, -1):
        # Off-mask positions neither add reward nor discount: carry the running return through.
        running = torch.where(m[:, t], token_r[:, t] + gamma * running, running)
        returns[:, t] = running
    return _whiten(returns, m, eps)


@torch.no_grad()
def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 1.0, whiten: bool = False,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over target tokens.

    Walking the target tokens of each sequence backwards (t' is the next
    target token after t; after the last one the value is 0, the episode ends):
        delta_t = r_t + gamma * V(s_t') - V(s_t)
        A_t     = delta_t + gamma * lam * A_t'
        returns_t = A_t + V(s_t)            (the critic's regression target)
    Non-target positions are skipped entirely: their rewards and values are
    never read, so a multi-turn trajectory's environment tokens neither earn
    reward nor break the chain. Put any reward on a target token.

    ``whiten=True`` normalises the advantages over all target tokens of the
    batch (population std); ``returns`` are computed before whitening.
    Shapes: token_rewards, values, mask [B, T] -> (advantages, returns) [B, T].
    """
    m = mask.bool()                                                  # [B, T]
    B, T = m.shape
    r = torch.where(m, token_rewards.float(), torch.zeros(B, T, device=m.device))  # [B, T]
    v = torch.where(m, values.float(), torch.zeros(B, T, device=m.device))         # [B, T]
    adv = torch.zeros(B, T, dtype=torch.float32, device=m.device)                  # [B, T]
    next_value = torch.zeros(B, dtype=torch.float32, device=m.device)              # [B]
    next_adv = torch.zeros(B, dtype=torch.float32, device=m.device)                # [B]
    for t in range(T - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        on = m[:, t]
        adv[:, t] = torch.where(on, a_t, torch.zeros_like(a_t))
        next_value = torch.where(on, v[:, t], next_value)
        next_adv = torch.where(on, a_t, next_adv)
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    if whiten:
        adv = _whiten(adv, m, eps)
    return adv, returns


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator gets of a step's batch: B sequences, the n_g samples of group g in rows
    ``sum(group_sizes[:g]) ..`` (consecutive), time T padded.

    rewards [B] (each sequence's reward), mask [B, T] (1 on target tokens), kl [B, T] or None
    (the per-token KL to the reference, ``algo.kl_in_reward``: a penalty of ``kl_coef`` per unit),
    values [B, T] or None (the critic's, for an estimator that reads them), gamma and lam (the
    discount and GAE's lambda).

    ``estimate_*`` are the estimators as ``conveyor.config.estimators.ESTIMATORS``
    names them: one call shape, ``(AdvantageInputs) -> (advantages [B, T], returns
    [B, T] or None)``, the advantages 0 off the mask, returns for a critic to regress on.
    """

    rewards: torch.Tensor
    mask: torch.Tensor
    group_sizes: tuple[int, ...]
    kl: torch.Tensor | None = None
    kl_coef: float = 0.0
    values: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0


def _per_group(x: AdvantageInputs, advantages) -> torch.Tensor:
    """A group estimator ``advantages([G, n] rewards) -> [G, n]`` on equal groups, KL taken off the
    reward, its sequence advantages given to every target token."""
    r = x.rewards if x.kl is None else x.rewards - x.kl_coef * x.kl.sum(-1)
    seq_adv = advantages(r.view(-1, x.group_sizes[0])).reshape(-1)
    return expand_to_tokens(seq_adv, x.mask)


def estimate_grpo(x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    return _per_group(x, grpo_advantages), None


def estimate_drgrpo(x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    return _per_group(x, lambda r: grpo_advantages(r, std_normalize=False)), None


def estimate_rloo(x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    return _per_group(x, rloo_advantages), None


def estimate_reinforce_pp(x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    kl_coef = x.kl_coef if x.kl is not None else 0.0
    return reinforce_pp_advantages(x.rewards, x.mask, kl=x.kl, kl_coef=kl_coef, gamma=x.gamma), None


def estimate_gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with the sequence reward on its last target token and the KL penalty on every token."""
    if x.values is None:
        raise ValueError("GAE needs the critic's values (AdvantageInputs.values); set trainer.critic=true")
    token_r = torch.zeros_like(x.mask)
    last = (x.mask * torch.arange(x.mask.shape[1])).argmax(-1)      # [B] index of the last target token
    token_r[torch.arange(x.mask.shape[0]), last] = x.rewards
    if x.kl is not None:
        token_r = token_r - x.kl_coef * x.kl
    return gae_advantages(token_r, x.values, x.mask, x.gamma, x.lam)
