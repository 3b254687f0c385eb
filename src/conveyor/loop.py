"""The RL loop: generate, score, compute advantages, train, publish, repeat.

Contract: ``rl_loop(c, start_step, summary)`` runs training steps
``start_step .. cfg.loop.steps-1`` over the roles bundled in ``c``
(``launch.local.Components``), logging metrics, evaluating and
checkpointing when due, and returns the last step's metrics. Admission of
new rollouts goes through ``staleness.may_admit``; with ``max_staleness = 0``
(the only mode here) a step's rollouts start only after the previous step's
weights are published, which is synchronous on-policy RL. The loop knows no
formulas (``objective``/``algo``) and no model internals (trainer, engine).
"""
from __future__ import annotations

import time

from conveyor import objective, staleness
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.single_turn import rollout_groups
from conveyor.types import Group


def sampling(cfg, **overrides) -> SamplingParams:
    return SamplingParams.from_config(cfg.rollout, **overrides)


def score(c, groups: list[Group]) -> list[Group]:
    flat = c.rewards.score([t for g in groups for t in g.trajectories])
    out, i = [], 0
    for g in groups:
        out.append(Group(g.task, tuple(flat[i:i + len(g.trajectories)])))
        i += len(g.trajectories)
    return out


def evaluate(c, step: int) -> dict[str, float]:
    cfg = c.cfg
    params = sampling(cfg, n=1, temperature=cfg.loop.eval_temperature, seed=cfg.loop.seed + 7919)
    groups = score(c, rollout_groups(c.engine, c.tokenizer, c.eval_tasks, params, c.max_prompt_tokens,
                                     c.add_special_tokens, c.stats))
    trajs = [t for g in groups for t in g.trajectories]
    m = {"eval_reward": sum(t.reward for t in trajs) / max(len(trajs), 1),
         "eval_len": sum(len(t.completion_ids) for t in trajs) / max(len(trajs), 1)}
    for key in sorted({k for t in trajs for k in t.reward_info}):
        vals = [float(t.reward_info[key]) for t in trajs if key in t.reward_info]
        m[f"eval_{key}"] = sum(vals) / len(vals)
    c.logger.log(step, m, kind="eval")
    return m


def rl_loop(c, start_step: int, summary: dict) -> dict[str, float]:
    cfg, lc = c.cfg, c.cfg.loop
    loss_fn = objective.PolicyLoss(cfg.algo, norm_len=cfg.rollout.max_new_tokens)
    need = objective.needs(cfg.algo)
    metrics: dict[str, float] = {}
    t_start = time.perf_counter()
    for step in range(start_step, lc.steps):
        if lc.time_limit_s and time.perf_counter() - t_start > lc.time_limit_s:
            c.logger.message(f"time limit {lc.time_limit_s:.0f}s reached after {step - start_step} steps")
            break
        timer = c.timer
        version = c.engine.version
        issued = step * lc.batch_size  # groups admitted before this step's
        if not staleness.may_admit(issued, lc.batch_size, version, lc.max_staleness):
            raise RuntimeError(f"step {step}: engine serves version {version}, too stale to admit "
                               f"(max_staleness={lc.max_staleness}); weight publishing fell behind")
        with timer.phase("generate"):
            tasks = c.cursor.next_batch(lc.batch_size)
            groups = rollout_groups(c.engine, c.tokenizer, tasks, sampling(cfg, seed=lc.seed * 100_003 + step),
                                    c.max_prompt_tokens, c.add_special_tokens, c.stats)
        with timer.phase("reward"):
            groups = score(c, groups)
        if not groups:
            raise RuntimeError(f"step {step}: no task produced a rollout (see prompt_too_long in metrics)")
        with timer.phase("prepare"):
            base = objective.base_batch([t for g in groups for t in g.trajectories])
            extra = {}
            if need.proximal:
                extra["proximal_logprobs"] = c.trainer.logprobs(base)
            if need.reference:
                extra["ref_logprobs"] = c.trainer.ref_logprobs(base)
            if need.values:
                extra["values"] = c.trainer.values(base)
            batch, stats = objective.make_batch(groups, cfg.algo, extra, base)
        with timer.phase("train"):
            train_m = c.trainer.train(batch, loss_fn)
        with timer.phase("sync"):
            t0 = time.perf_counter()
            c.engine.update_weights(c.trainer.named_weights(), version=version + 1)
            sync_ms = (time.perf_counter() - t0) * 1e3
        metrics = {**stats, **train_m, **rollout_stats(groups, version + 1), "weight_sync_ms": sync_ms,
                   **{f"reward_{k}": v for k, v in c.rewards.stats().items()}, **c.stats, **timer.lap()}
        if "proximal_logprobs" in extra:
            metrics["logprob_diff_max"] = max(
                float(((p - b).abs() * m).max()) for p, b, m in
                zip(extra["proximal_logprobs"], base.fields["behaviour_logprobs"], base.loss_mask))
        metrics["samples_per_s"] = len(batch) / max(metrics["time/step"], 1e-9)
        c.logger.log(step + 1, metrics)
        if lc.eval_every and (step + 1) % lc.eval_every == 0 and step + 1 < lc.steps:
            evaluate(c, step + 1)
        if lc.checkpoint_every and (step + 1) % lc.checkpoint_every == 0:
            c.checkpoint(step + 1, summary)
    return metrics


def rollout_stats(groups: list[Group], trainer_version: int) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    lens = sorted(len(t.completion_ids) for t in trajs)
    stale = [trainer_version - 1 - t.min_version for t in trajs]
    return {"response_len": sum(lens) / len(lens), "response_len_max": float(lens[-1]),
            "truncated_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
            "staleness_max": float(max(stale)),
            "multi_version_frac": sum(len(set(t.versions)) > 1 for t in trajs) / len(trajs)}
