"""Held-out evaluation: the policy's reward on tasks it does not train on.

Contract: ``Evaluator(cfg, tasks, prompting, rollouts, rewards, logger)``; ``evaluate(step)``
generates one sample per held-out task (greedy by default, and with ``loop.eval_sampled`` also
at the rollout temperature), scores them and logs the means as ``eval_*`` metrics; the weights
of a step do not change, so a second call for the same step returns the first's result.
Requests go through the producer outside the training schedule, with a fixed seed, and wait
with the launch deadline. It knows nothing of training or of how the engines run.
"""
from __future__ import annotations

import numbers
import time

from conveyor.config import RunConfig
from conveyor.controller.producer import Producer, Prompting
from conveyor.observe import timeline
from conveyor.observe.progress import report_length_skips
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.single_turn import prepare_prompts, to_groups
from conveyor.runtime import watchdog
from conveyor.types import Task

PROBE = 8  # generations timed before the first evaluation, to predict its time


class Evaluator:
    """Contract: ``Evaluator(cfg, tasks, prompting, rollouts, rewards, logger)``;
    ``evaluate(step)`` generates one sample per held-out task at
    ``loop.eval_temperature`` (greedy by default) and, with
    ``loop.eval_sampled``, also at the rollout temperature (the policy's
    expected reward), scores them, logs the means as ``eval_*`` /
    ``eval_sampled_*`` metrics at ``step`` and returns them (a span on the run's
    timeline); a second call for the same step after step 0 (the final
    evaluation right after a mid-run one) returns the first call's result
    without generating again: the weights of a step do not change. The completions of
    the first ``observe.eval_samples`` tasks go to ``eval_samples.jsonl``. ``on(tasks,
    temperature, prefix)`` does one such pass over any tasks (the warm start's
    early-stop check). Requests go through the producer outside the training
    schedule, with a fixed seed, and wait with the launch deadline; before the
    first, PROBE of its generations are timed and a whole predicted to run past
    that deadline is said at once.
    """
    def __init__(self, cfg: RunConfig, tasks: list[Task], prompting: Prompting, rollouts: Producer, rewards,
                 logger, episodes=None):
        self.cfg, self.tasks, self.prompting = cfg, tasks, prompting
        self.episodes = episodes  # multi-turn runs evaluate whole episodes (episodes.runner)
        self.rollouts, self.rewards, self.logger = rollouts, rewards, logger
        self.length_notes: dict[str, int] = {}  # prompts skipped for length, as last reported
        self._last: tuple[int, dict[str, float]] | None = None  # (step, result) of the last evaluation
        self._predicted = False  # the first evaluation's time has been predicted (_predict)

    def evaluate(self, step: int) -> dict[str, float]:
        if step > 0 and self._last is not None and self._last[0] == step:  # step 0 recurs after a warm-start
            return dict(self._last[1])
        cfg = self.cfg
        with timeline.measure("controller", "eval", args={"step": step}), \
                self.logger.phase("eval", 2 if cfg.loop.eval_sampled else 1) as bar:
            m = self.on(self.tasks, cfg.loop.eval_temperature, "eval_", step)
            bar.update()
            if cfg.loop.eval_sampled:
                m.update(self.on(self.tasks, cfg.rollout.temperature, "eval_sampled_", step))
        m.update({k: v for k, v in self.length_notes.items() if k.startswith("eval_")})  # prompts skipped
        self.logger.log(step, m, kind="eval")
        self._last = (step, dict(m))
        return m

    def on(self, tasks: list[Task], temperature: float, prefix: str, step: int | None = None) -> dict[str, float]:
        cfg, p = self.cfg, self.prompting
        params = SamplingParams.from_config(cfg.rollout, n=1, temperature=temperature, seed=cfg.loop.seed + 7919)
        n = len(tasks)
        if n == 0:  # no held-out set configured (data.eval_size=0): nothing to report
            return {prefix + "reward": float("nan")}
        if self.episodes is not None:
            return self._episodes(tasks, params, prefix, step)
        tasks, prompts = prepare_prompts(p.tokenizer, tasks, p.max_prompt_tokens, p.add_special_tokens)
        report_length_skips(self.logger, p.max_prompt_tokens, n - len(tasks), n, prefix, self.length_notes)
        if not self._predicted:
            self._predicted = True
            self._predict(prompts, params)
        t0 = time.perf_counter()
        outs = watchdog.result(self.rollouts.request([list(x) for x in prompts], params), cfg.launch.timeout_s,
                               f"the evaluation's {len(prompts)} generations ({prefix.rstrip('_')})")
        groups = to_groups(p.tokenizer, tasks, prompts, outs, time.perf_counter() - t0)
        return self._means([t for g in groups for t in g.trajectories], prefix, step=step)

    def _predict(self, prompts: list, params: SamplingParams) -> None:
        """Before the first evaluation: time PROBE of its generations and say so when the whole is
        predicted (linearly in the number of prompts: an upper bound where a batch is cheaper
        than its rows) to run past the wait's deadline, ``launch.timeout_s``."""
        n, timeout = len(prompts), self.cfg.launch.timeout_s
        if n <= PROBE:
            return
        t0 = time.perf_counter()
        watchdog.result(self.rollouts.request([list(x) for x in prompts[:PROBE]], params), timeout,
                        f"the first {PROBE} of the evaluation's generations (its time probe)")
        took = time.perf_counter() - t0
        predicted = took * n / PROBE
        if predicted > timeout:
            self.logger.message(
                f"the evaluation is predicted to take about {predicted:.0f}s ({PROBE} of its {n} generations took "
                f"{took:.1f}s), past launch.timeout_s={timeout:g}: raise launch.timeout_s, or lower data.eval_size "
                f"or rollout.max_new_tokens")

    def _episodes(self, tasks: list[Task], params: SamplingParams, prefix: str, step: int | None) -> dict[str, float]:
        """One episode per task; a failed episode scores the reward's fallback and is counted."""
        out = self.episodes.run_tasks(tasks, params, timeout_s=self.cfg.launch.timeout_s)
        done = [t for t in out if t is not None]
        m = self._means(done, prefix, total=len(tasks), step=step) if done else {prefix + "reward": self.cfg.reward.fallback}
        m[prefix + "episodes_failed"] = float(len(tasks) - len(done))
        return m

    def _means(self, trajs, prefix: str, total: int | None = None, step: int | None = None) -> dict[str, float]:
        trajs = self.rewards.score(trajs)
        if step is not None:  # what the model wrote on the first held-out tasks (observe.eval_samples)
            self.logger.eval_samples(step, trajs, prefix.rstrip("_"))
        total = total or len(trajs)
        # Failed episodes (total - len(trajs)) count at the reward's fallback.
        fallback = self.cfg.reward.fallback * (total - len(trajs))
        m = {prefix + "reward": (sum(t.reward for t in trajs) + fallback) / total,
             prefix + "len": sum(len(t.completion_ids) for t in trajs) / max(len(trajs), 1)}
        # Numbers only: a reward's text (the code reward's per-test letters, an error) stays in the samples.
        numeric = [(k, float(v)) for t in trajs for k, v in t.reward_info.items()
                   if k != "reward_error" and isinstance(v, numbers.Real)]
        for key in sorted({k for k, _ in numeric}):
            vals = [v for k, v in numeric if k == key]
            m[prefix + key] = sum(vals) / len(vals)
        return m
