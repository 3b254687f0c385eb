"""From scored groups to a trainer Batch, and from AlgoConfig to a loss function.

Contract
- ``needs(cfg, one_update)`` says which extra forward passes a step needs
  (proximal logprobs recomputed by the trainer, reference logprobs, critic
  values). With ``one_update`` (one optimizer step per batch: one epoch, one
  mini-batch) the proximal policy IS the policy of the training forward, so
  the loss takes its detached logprobs and nothing is recomputed.
- ``make_batch(groups, cfg, extra)`` builds the Batch: ids = prompt +
  completion, loss mask over the policy's own tokens (0 on a sample cut at
  the token budget under ``algo.overlong_filter``), the named per-token fields
  ``advantages`` (the estimator's row of ``config.estimators.ESTIMATORS``),
  ``behaviour_logprobs`` (engine), and where computed ``proximal_logprobs`` /
  ``ref_logprobs`` / ``old_values`` / ``returns``; ``routes`` are the engine's
  recorded experts when trajectories carry them (routing replay; a sample without
  any is routed by the trainer's own routers).
- ``PolicyLoss(cfg)`` is the ``LossFn`` for ``Trainer.train``: the policy loss
  chosen in AlgoConfig, with optional importance-sampling correction, KL
  term, entropy bonus and value loss, aggregated with global normalisers; its
  ``needs`` declare the batch fields and outputs it reads. ``sft_loss`` is the
  warm start's.

The formulas live in ``conveyor.algo``; this module only chooses and wires
them. It knows nothing of engines, processes or the loop's schedule.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, replace

import torch

from conveyor import algo
from conveyor.config import AlgoConfig
from conveyor.config.estimators import Estimator, estimator
from conveyor.controller.group_filter import mask_overlong
from conveyor.trainer.api import LossInputs, LossNeeds, LossOutputs
from conveyor.types import Batch, Group, Trajectory


@dataclass(frozen=True)
class Needs:
    proximal: bool  # trainer recomputes logprobs of the data before the update
    reference: bool
    values: bool


def needs(cfg: AlgoConfig, one_update: bool = False) -> Needs:
    return Needs(
        proximal=uses_proximal(cfg) and not one_update,
        reference=cfg.kl_coef > 0,
        values=estimator(cfg.advantage).critic,
    )


def uses_proximal(cfg: AlgoConfig) -> bool:
    return cfg.loss == "decoupled_ppo" or cfg.importance_sampling != "none"


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:  # list of [L_i] -> [B, max L]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _unpad(x: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x[i, : len(r)].clone() for i, r in enumerate(like)]


def _tensor(code: str, values: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(array(code, values), dtype=dtype) if values else torch.zeros(0, dtype=dtype)


def base_batch(trajs: list[Trajectory]) -> Batch:
    # Through typed arrays: torch.tensor on Python sequences costs about twice as much, and
    # this runs on the trainer's critical path (a step's 100k tokens: tens of ms).
    ids, masks, behaviour = [], [], []
    for t in trajs:
        head = torch.zeros(len(t.prompt_ids))
        ids.append(_tensor("q", t.prompt_ids + t.completion_ids, torch.long))
        masks.append(torch.cat([head, _tensor("f", t.loss_mask, torch.float32)]))
        behaviour.append(torch.cat([head, _tensor("f", t.logprobs, torch.float32)]))
    return Batch(ids, masks, routes=_routes(trajs), behaviour_logprobs=behaviour)


def _routes(trajs: list[Trajectory]) -> list[torch.Tensor] | None:
    """The engine's recorded experts (routing replay); a sample without them (none recorded)
    gets none, so the trainer's own router serves it."""
    shapes = [t.routed_experts.shape[1:] for t in trajs if t.routed_experts is not None]
    if not shapes:
        return None
    return [torch.zeros((0, *shapes[0]), dtype=torch.long) if t.routed_experts is None
            else torch.from_numpy(t.routed_experts).long() for t in trajs]


def make_batch(groups: list[Group], cfg: AlgoConfig, extra: dict[str, list[torch.Tensor]] | None = None,
               base: Batch | None = None) -> tuple[Batch, dict[str, float]]:
    """``extra`` carries per-token tensors computed by the trainer on ``base``
    (proximal_logprobs, ref_logprobs, values); KL-in-reward and GAE need them."""
    trajs = [t for g in groups for t in g.trajectories]
    base = base or base_batch(trajs)
    if cfg.overlong_filter:  # DAPO: samples cut at the token budget teach nothing
        base = mask_overlong(base, trajs)
    extra = extra or {}
    mask = _pad(base.loss_mask)                                     # [B, T]
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)  # [B]
    kl_tok = None
    if cfg.kl_in_reward and "ref_logprobs" in extra:
        own = _pad(extra.get("proximal_logprobs") or base.behaviour_logprobs)
        kl_tok = algo.kl_estimate(own, _pad(extra["ref_logprobs"]), cfg.kl_estimator, mask=mask)
    est, returns = estimator(cfg.advantage), None
    if cfg.turn_credit == "discounted" and any(t.turn_records for t in trajs):
        adv = _turn_credit(groups, cfg, est, mask)
    else:
        adv, returns = est.function()(_advantage_inputs(groups, cfg, est, rewards, mask, kl_tok, extra))
    passes = {"proximal_logprobs": extra.get("proximal_logprobs"), "ref_logprobs": extra.get("ref_logprobs"),
              "old_values": extra.get("values"),
              "returns": None if returns is None else _unpad(returns, base.input_ids)}
    batch = replace(base, advantages=_unpad(adv * mask, base.input_ids),
                    **{name: rows for name, rows in passes.items() if rows is not None})
    stats = {
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "adv_abs_mean": float((adv.abs() * mask).sum() / mask.sum().clamp(min=1)),
        **_token_moments(adv, mask),
        "groups_without_signal": float(sum(len(set(g.rewards)) == 1 for g in groups) / max(len(groups), 1)),
    }
    if kl_tok is not None:
        stats["kl_reward"] = float(kl_tok.sum() / mask.sum().clamp(min=1))
    return batch, stats


def _advantage_inputs(groups: list[Group], cfg: AlgoConfig, est: Estimator, rewards: torch.Tensor,
                      mask: torch.Tensor, kl_tok: torch.Tensor | None,
                      extra: dict[str, list[torch.Tensor]]) -> algo.AdvantageInputs:
    """What the estimator's function gets of the batch (``algo.AdvantageInputs``)."""
    sizes = tuple(len(g.trajectories) for g in groups)
    if est.group and len(set(sizes)) > 1:
        raise ValueError(f"group advantages need equal group sizes, got sizes {sorted(set(sizes))}")
    return algo.AdvantageInputs(rewards, mask, sizes, kl=kl_tok, kl_coef=cfg.kl_coef,
                                values=_pad(extra["values"]) if est.critic else None, gamma=cfg.gamma, lam=cfg.lam)


def _token_moments(adv: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and population std of the advantages over the loss tokens (REINFORCE++ whitens
    them to 0 and 1; group estimators centre each group's sequences, not its tokens)."""
    m = mask.bool()
    vals = adv[m].double()
    if vals.numel() == 0:
        return {"adv_mean": 0.0, "adv_std": 0.0}
    return {"adv_mean": float(vals.mean()), "adv_std": float(vals.std(unbiased=False))}


def _turn_credit(groups: list[Group], cfg: AlgoConfig, est: Estimator, mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages from turn-level returns (``algo.turn_advantages``), group by group:
    a turn's policy tokens get its turn's advantage. What the reward service gave beyond the
    environment's turn rewards (its own verifier) counts on the episode's last turn."""
    if est.turn_credit is None:
        raise ValueError(f"algo.turn_credit=discounted works with advantage grpo or drgrpo, not {cfg.advantage!r}")
    adv = torch.zeros_like(mask)
    row = 0
    for g in groups:
        K = max(max(len(t.turn_records), 1) for t in g.trajectories)
        r = torch.zeros(len(g.trajectories), K)
        on = torch.zeros(len(g.trajectories), K)
        for i, t in enumerate(g.trajectories):
            turns = t.turn_records or ()
            for k, rec in enumerate(turns):
                r[i, k], on[i, k] = rec.reward, 1.0
            last = max(len(turns), 1) - 1
            r[i, last] += t.reward - t.env_return
            on[i, last] = 1.0
        a = algo.turn_advantages(r, on, cfg.turn_gamma, std_normalize=est.turn_credit == "std")
        for i, t in enumerate(g.trajectories):
            head = len(t.prompt_ids)
            spans = [(rec.start, rec.end) for rec in t.turn_records] or [(0, len(t.completion_ids))]
            for k, (start, end) in enumerate(spans):
                adv[row, head + start: head + end] = a[i, k]
            row += 1
    return adv * mask


class PolicyLoss:
    """The configured RL objective as a trainer LossFn (see trainer/api.py)."""

    def __init__(self, cfg: AlgoConfig, norm_len: int | None = None, one_update: bool = False):
        self.cfg = cfg
        self.passes = needs(cfg, one_update)
        # One optimizer step per batch: the weights of this forward are those before the
        # step, i.e. the proximal policy, whose logprobs a recompute would only repeat.
        self.proximal_from_forward = uses_proximal(cfg) and one_update
        self.norm_len = norm_len
        self.kl_in_loss = cfg.kl_coef > 0 and not cfg.kl_in_reward
        self.needs = LossNeeds(
            entropy=cfg.entropy_coef != 0, values=self.passes.values,
            fields=("advantages", "behaviour_logprobs") + ("proximal_logprobs",) * self.passes.proximal
            + ("ref_logprobs",) * self.kl_in_loss + ("old_values", "returns") * self.passes.values,
            # Which batch total the loss divides by (a step accumulated part by part divides at the end).
            normaliser="tokens" if cfg.loss_agg == "token-mean" else "seqs")

    @property
    def needs_entropy(self) -> bool:
        return self.needs.entropy

    @property
    def normaliser(self) -> str | None:
        return self.needs.normaliser

    def inert(self, batch: Batch) -> list[bool]:
        """Samples whose every loss term is zero whatever the policy (``LossFn.inert``): the policy
        terms scale with the advantage, so a sample with a zero advantage at every loss token (a
        GRPO group whose rewards are all equal) adds nothing, unless a term that does not scale
        with it is on (a KL loss, an entropy bonus, a value loss)."""
        if self.needs.entropy or self.needs.values or self.kl_in_loss:
            return [False] * len(batch)
        return [not bool(torch.count_nonzero(adv[mask > 0]))
                for adv, mask in zip(batch.advantages, batch.loss_mask)]

    def __call__(self, out: LossOutputs, mb: LossInputs, num_tokens: float, num_seqs: int):
        out, mb = LossOutputs.of(out), LossInputs.of(mb)
        c = self.cfg
        lp, mask, adv = out.logprobs, mb.loss_mask, mb.advantages
        behaviour = mb.behaviour_logprobs
        old = mb.proximal_logprobs if self.passes.proximal else behaviour
        if self.proximal_from_forward:
            old = lp.detach()
        if c.loss == "decoupled_ppo":
            tok, m = algo.decoupled_ppo_loss(lp, old, behaviour, adv, mask, c.clip_low, c.clip_high,
                                             behaviour_cap=c.is_cap, behaviour_mode=c.behaviour_mode,
                                             dual_clip=c.dual_clip)
        elif c.loss == "gspo":
            tok, m = algo.gspo_loss(lp, old, adv, mask, c.clip_low, c.clip_high)
        else:
            tok, m = algo.ppo_clip_loss(lp, old, adv, mask, c.clip_low, c.clip_high, c.dual_clip)
        if c.importance_sampling != "none" and c.loss != "decoupled_ppo":
            w, wm = algo.importance_weights(old, behaviour, mask, c.importance_sampling, c.is_level, c.is_cap)
            tok = tok * w
            m.update(wm)
        if self.kl_in_loss:
            kl = algo.kl_estimate(lp, mb.ref_logprobs, c.kl_estimator, mask=mask)
            tok = tok + c.kl_coef * kl
            m["kl"] = algo.masked_mean(kl.detach(), mask)  # a metric: no graph kept
        if self.needs.entropy:
            tok = tok - c.entropy_coef * out.entropy
            m["entropy"] = algo.masked_mean(out.entropy.detach(), mask)  # a metric: no graph kept
        if self.needs.values:
            v_tok, vm = algo.value_loss(out.values, mb.old_values, mb.returns, mask, c.value_clip)
            tok = tok + c.value_coef * v_tok
            m.update(vm)
        loss = algo.aggregate(tok, mask, c.loss_agg, num_tokens, num_seqs, norm_len=self.norm_len)
        # Metrics stay on the device: the trainer reads them once per mini-batch (a read here
        # would make the host wait for each micro-batch's forward before launching its backward).
        return loss, {k: v.detach() if isinstance(v, torch.Tensor) else float(v) for k, v in m.items()}


class SFTLoss:
    """Negative log-likelihood of the target tokens, token-mean over the whole batch."""

    needs = LossNeeds(normaliser="tokens")

    def inert(self, batch: Batch) -> list[bool]:
        return [False] * len(batch)

    def __call__(self, out: LossOutputs, mb: LossInputs, num_tokens: float, num_seqs: int):
        out, mb = LossOutputs.of(out), LossInputs.of(mb)
        nll = -(out.logprobs * mb.loss_mask).sum() / max(num_tokens, 1)
        return nll, {"nll": float(nll.detach()) * max(num_tokens, 1) / max(float(mb.loss_mask.sum()), 1)}


sft_loss = SFTLoss()
