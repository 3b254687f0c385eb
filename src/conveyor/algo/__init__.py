"""RL algorithms as pure tensor functions: advantages, KL estimators, policy losses, aggregation.

Contract: every public function here takes and returns torch tensors (plus
plain numbers and strings naming a variant), has no state and no side
effects, and follows two layouts: per-token [B, T] with a target ``mask``
(off-mask positions never influence a result), and per-sequence [B] or
per-group [G, n]. This package imports torch and nothing else of conveyor;
it does not know about trajectories, models, trainers or configs. The
caller maps config names to the functions below.
"""
from conveyor.algo.advantages import (
    AdvantageInputs,
    compute_group_advantages,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    turn_advantages,
)
from conveyor.algo.kl import kl_estimate
from conveyor.algo.losses import (
    aggregate,
    decoupled_ppo_loss,
    entropy_from_logits,
    gspo_loss,
    importance_weights,
    masked_mean,
    ppo_clip_loss,
    value_loss,
)

__all__ = [
    "AdvantageInputs",
    "aggregate",
    "compute_group_advantages",
    "decoupled_ppo_loss",
    "entropy_from_logits",
    "expand_to_tokens",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "importance_weights",
    "kl_estimate",
    "masked_mean",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "turn_advantages",
    "value_loss",
]
