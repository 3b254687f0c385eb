"""The RL loop: take scored groups, compute advantages, train, publish, repeat.

Contract: ``rl_loop(c, start_step, summary)`` runs training steps
``start_step .. loop.steps-1`` over the roles bundled in ``c``
(``launch.local.Components``) and returns the last step's metrics. Rollouts
are produced concurrently by ``c.producer``, which admits a new group only
while ``staleness.may_admit(issued, batch_size, version, max_staleness)``
holds for the version published here. With ``max_staleness = 0`` nothing of
step v+1 starts before version v+1 is published: synchronous on-policy RL is
this same loop. Each step waits (with a deadline) for ``batch_size`` scored
groups from ``c.buffer``, trains on them in admission order (the trainer
publishes the new weights as its step ends, ``train_and_publish``), lets the
producer admit against the new version and logs metrics; evaluation and
checkpoints run when due.
The loop knows no formulas (``objective``/``algo``), no model internals and
not where the roles run.
"""
from __future__ import annotations

import time

from conveyor import objective
from conveyor.rollout.api import SamplingParams
from conveyor.observe.progress import report_length_skips
from conveyor.rollout.single_turn import prepare_prompts, to_groups
from conveyor.step_batch import prepare, train_and_prepare_next
from conveyor.step_stats import engine_stats, rollout_stats, sync_stats


def sampling(cfg, **overrides) -> SamplingParams:
    return SamplingParams.from_config(cfg.rollout, **overrides)


def evaluate(c, step: int) -> dict[str, float]:
    """Held-out reward at ``loop.eval_temperature`` (greedy by default); with
    ``loop.eval_sampled`` also at the rollout temperature (the policy's expected reward)."""
    cfg = c.cfg
    with c.logger.phase("eval", 2 if cfg.loop.eval_sampled else 1) as bar:
        m = eval_tasks(c, c.eval_tasks, cfg.loop.eval_temperature, "eval_")
        bar.update()
        if cfg.loop.eval_sampled:
            m.update(eval_tasks(c, c.eval_tasks, cfg.rollout.temperature, "eval_sampled_"))
    c.logger.log(step, m, kind="eval")
    return m


def eval_tasks(c, tasks, temperature: float, prefix: str) -> dict[str, float]:
    params = sampling(c.cfg, n=1, temperature=temperature, seed=c.cfg.loop.seed + 7919)
    n = len(tasks)
    tasks, prompts = prepare_prompts(c.tokenizer, tasks, c.max_prompt_tokens, c.add_special_tokens)
    report_length_skips(c, n - len(tasks), n, prefix)
    t0 = time.perf_counter()
    outs = c.producer.request([list(p) for p in prompts], params).result(timeout=c.cfg.launch.timeout_s)
    groups = to_groups(c.tokenizer, tasks, prompts, outs, time.perf_counter() - t0)
    trajs = c.rewards.score([t for g in groups for t in g.trajectories])
    m = {prefix + "reward": sum(t.reward for t in trajs) / len(trajs),
         prefix + "len": sum(len(t.completion_ids) for t in trajs) / len(trajs)}
    for key in sorted({k for t in trajs for k in t.reward_info if k != "reward_error"}):
        vals = [float(t.reward_info[key]) for t in trajs if key in t.reward_info]
        m[prefix + key] = sum(vals) / len(vals)
    return m


def rl_loop(c, start_step: int, summary: dict) -> dict[str, float]:
    cfg, lc = c.cfg, c.cfg.loop
    one_update = cfg.trainer.ppo_epochs == 1 and cfg.trainer.mini_batches == 1
    loss_fn = objective.PolicyLoss(cfg.algo, norm_len=cfg.rollout.max_new_tokens, one_update=one_update)
    need = objective.needs(cfg.algo, one_update)
    metrics: dict[str, float] = {}
    published_at: dict[int, float] = {}  # versions published by this loop -> when
    swaps: list = []  # engines' swap events of versions not reported yet
    engine_busy = {e.engine_id: (e.busy_s, e.idle_s, dict(e.counters)) for e in c.producer.engines}
    t_start = time.perf_counter()
    c.producer.admitting = True  # admission is driven by the version published below
    ahead = None  # the next step's batch, prepared while this step trained
    for step in range(start_step, lc.steps):
        if lc.time_limit_s and time.perf_counter() - t_start > lc.time_limit_s:
            c.logger.message(f"time limit {lc.time_limit_s:.0f}s reached after {step - start_step} steps")
            break
        timer = c.timer
        if ahead is None:
            with timer.phase("wait"):  # the trainer's idle time: waiting for scored groups
                items = c.buffer.get(lc.batch_size, timeout=cfg.launch.timeout_s)
            with timer.phase("prepare"):
                groups, batch, stats, extra = prepare(c, items, need)
        else:  # built while the last step trained; what is not ready yet, the trainer waits for
            with timer.phase("wait"):
                groups, batch, stats, extra = ahead.take(cfg.launch.timeout_s)
        with timer.phase("train"):  # the trainer publishes version step + 1 as its step ends
            (train_m, published_at[step + 1], publish_s), ahead = train_and_prepare_next(
                c, batch, loss_fn, need, version=step + 1, last=step + 1 == lc.steps)
        c.producer.version = step + 1
        metrics = {**stats, **train_m, **rollout_stats(groups, step), "weight_publish_ms": publish_s * 1e3,
                   "buffer_depth": len(c.buffer), **sync_stats(c.producer, published_at, swaps, upto=step),
                   **engine_stats(c.producer.engines, engine_busy),
                   **{f"reward_{k}": v for k, v in c.rewards.stats().items()}, **c.stats, **timer.lap()}
        if "proximal_logprobs" in extra:
            metrics["logprob_diff_max"] = max(
                float(((p - b).abs() * m).max()) for p, b, m in
                zip(extra["proximal_logprobs"], batch.fields["behaviour_logprobs"], batch.loss_mask))
        for phase in ("time/wait", "time/prepare"):  # absent when prepared during the last step
            metrics.setdefault(phase, 0.0)
        metrics["trainer_idle_frac"] = metrics["time/wait"] / max(metrics["time/step"], 1e-9)
        metrics["samples_per_s"] = len(batch) / max(metrics["time/step"], 1e-9)
        c.logger.log(step + 1, metrics)
        if lc.eval_every and (step + 1) % lc.eval_every == 0 and step + 1 < lc.steps:
            evaluate(c, step + 1)
        if lc.checkpoint_every and (step + 1) % lc.checkpoint_every == 0:
            c.checkpoint(step + 1, summary)
    c.producer.admitting = False
    return metrics
