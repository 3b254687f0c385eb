"""The RL loop: take scored groups, compute advantages, train, publish, repeat.

Contract: ``rl_loop(cfg, trainer, rollouts, buffer, rewards, logger, timer,
evaluate, checkpoint, start_step, ledger)`` runs training steps ``start_step ..
loop.steps-1`` and returns the last step's metrics; ``ledger`` (``controller.schedule``)
learns which places of the schedule each step trained, for the checkpoints. It holds named handles:
the trainer (its per-step surface, ``trainer.api.TrainerSteps``), the producer that owns
admission and the published version (``controller.producer.Producer``), the
buffer of scored groups, the reward service (for its counts), the metrics
sinks, and two callbacks, ``evaluate(step)`` and ``checkpoint(step)``.
Rollouts are produced concurrently by the producer, which admits a group
only while ``staleness.admissible`` allows for the version published here;
with ``max_staleness = 0`` nothing of step v+1 starts before version v+1 is
published: synchronous on-policy RL is this same loop. Each step waits (with
a deadline) for ``batch_size`` scored groups, trains on them in admission
order (with ``loop.replay``, plus groups replayed from ``controller.replay``'s
store; the new weights leave as the step ends, ``train_and_publish``), tells
the producer the new version, and logs metrics; evaluation and checkpoints
run when due. The loop knows no formulas (``controller.objective``), no model
internals and not where the roles run.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from conveyor.config import RunConfig
from conveyor.controller import objective
from conveyor.controller.accumulate import EngineMemory, accumulated_step
from conveyor.controller.producer import Producer
from conveyor.controller.replay import ReplayStore
from conveyor.controller.schedule import Ledger
from conveyor.controller.step_batch import prepare, train_and_prepare_next
from conveyor.controller.step_stats import engine_stats, rollout_stats, sync_stats
from conveyor.runtime import interrupt, watchdog
from conveyor.runtime.errors import RoleError
from conveyor.runtime.watchdog import Deadlines
from conveyor.trainer.api import TrainerSteps
from conveyor.transport.buffer import BufferTimeout

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.observe.metrics import MetricsLogger
    from conveyor.observe.timers import PhaseTimer
    from conveyor.reward.api import RewardHandle
    from conveyor.transport.buffer import TrajectoryBuffer


@interrupt.deferred  # Ctrl-C: the step in progress ends whole (and is checkpointed) before the run stops
def rl_loop(cfg: RunConfig, *, trainer: TrainerSteps, rollouts: Producer, buffer: TrajectoryBuffer,
            rewards: RewardHandle, logger: MetricsLogger, timer: PhaseTimer,
            evaluate: Callable[[int], dict], checkpoint: Callable[[int, dict, dict | None], object],
            start_step: int, ledger: Ledger, counted_before: Callable[[dict], dict] = dict,
            memory: EngineMemory | None = None) -> dict[str, float]:
    """The RL loop from ``start_step`` to ``loop.steps``. ``checkpoint(step, counters, evaluation)``
    saves a step (``counters``: the running counts of the metrics; ``evaluation``: the held-out
    result of that step, if one ran); ``counted_before`` adds the counts of a run's earlier
    parts to this part's (a resumed run reports the whole run's); ``memory`` (launch.time_share):
    the colocated engines' KV pools, released while a step trains and taken back before the next;
    ``ledger`` records the places in the schedule each step trained (what a checkpoint saves)."""
    lc = cfg.loop
    deadlines = Deadlines(cfg.launch.timeout_s)  # the wait for a step's groups may grow with the steps seen
    one_update = cfg.trainer.ppo_epochs == 1 and cfg.trainer.mini_batches == 1
    loss_fn = objective.PolicyLoss(cfg.algo, norm_len=cfg.rollout.max_new_tokens, one_update=one_update)
    need = objective.needs(cfg.algo, one_update)
    metrics: dict[str, float] = {}
    published_at: dict[int, float] = {}  # versions published by this loop -> when
    swaps: list = []  # engines' swap reports of versions not reported yet
    clocks = rollouts.snapshot().clocks  # each engine's clock at the last step's report
    t_start = time.perf_counter()
    rollouts.start_admitting()  # admission is driven by the version published below
    ahead = None  # the next step's batch, prepared while this step trained
    replay = ReplayStore(lc.replay, lc.batch_size, lc.seed) if lc.replay.fraction > 0 else None
    for step in range(start_step, lc.steps):
        if lc.time_limit_s and time.perf_counter() - t_start > lc.time_limit_s:
            logger.message(f"time limit {lc.time_limit_s:g}s reached after {step - start_step} steps")
            break
        timeout, t_wait = deadlines.of("groups"), time.monotonic()
        if lc.accumulate_groups:  # parts trained as they are scored, the step once all are in
            with stalled(f"step {step + 1}'s groups, trained as they are scored"):
                sb, trained = accumulated_step(trainer, buffer, cfg, loss_fn, need, step + 1, timeout, timer,
                                               memory)
        elif ahead is None:
            with timer.phase("wait"), stalled(f"the wait for step {step + 1}'s {lc.batch_size} scored groups"):
                items = buffer.get(lc.batch_size, timeout=timeout)  # the trainer's idle time
            with timer.phase("prepare"):
                sb = prepare(trainer, cfg.algo, items, need, replay, step)
        else:  # built while the last step trained; what is not ready yet, the trainer waits for
            with timer.phase("wait"), stalled(f"the wait for step {step + 1}'s batch"):
                sb = ahead.take(timeout)
        if not lc.accumulate_groups:  # the trainer publishes version step + 1 as its step ends
            trained, ahead = train_and_prepare_next(trainer, buffer, lc, cfg.algo, sb.batch, loss_fn, need,
                                                    version=step + 1, timeout_s=timeout, timer=timer,
                                                    last=step + 1 == lc.steps, replay=replay, memory=memory)
        if memory is not None:  # before the producer may admit the next step's chunks
            with timer.phase("reacquire"):
                memory.reacquire()
        deadlines.observe("groups", time.monotonic() - t_wait)  # a step's wait and train: what a wait may take
        published_at[step + 1] = trained.step_ended
        ledger.trained(sb.indices)  # what a checkpoint of this step must not train again
        rollouts.published(step + 1)
        now = rollouts.snapshot()
        counters = counted_before(running_counts(rewards, now))
        metrics = {**sb.stats, **trained.metrics, **rollout_stats(sb.groups, step),
                   "weight_publish_ms": trained.publish_s * 1e3,
                   "buffer_depth": len(buffer), **rollouts.filter_stats(),  # dynamic sampling's drops
                   **sync_stats(rollouts.take_swaps(), published_at, swaps, upto=step),
                   **engine_stats(now.clocks, clocks, lc.batch_size * cfg.rollout.n), **counters, **timer.lap()}
        if "proximal_logprobs" in sb.extra:
            metrics["logprob_diff_max"] = max(
                float(((p - b).abs() * m).max()) for p, b, m in
                zip(sb.extra["proximal_logprobs"], sb.batch.behaviour_logprobs, sb.batch.loss_mask))
        for phase in ("time/wait", "time/prepare"):  # absent when prepared during the last step
            metrics.setdefault(phase, 0.0)
        metrics["trainer_idle_frac"] = metrics["time/wait"] / max(metrics["time/step"], 1e-9)
        metrics["samples_per_s"] = len(sb.batch) / max(metrics["time/step"], 1e-9)
        logger.log(step + 1, metrics)
        logger.trace(step + 1, sb.groups, sb.indices)  # what the model wrote (observe.traces_per_step of them)
        evaluation = None
        if lc.eval_every and (step + 1) % lc.eval_every == 0 and step + 1 < lc.steps and not interrupt.requested():
            with timer.outside():  # not a training step's time: samples/s and idle fractions stay true
                evaluation = evaluate(step + 1)
            engine_stats(rollouts.snapshot().clocks, clocks)  # the engines' eval work is not the next step's
        end_step(lc.checkpoint_every, step + 1, lambda: checkpoint(step + 1, counters, evaluation))
    rollouts.stop_admitting()
    return metrics


def end_step(every: int, step: int, save: Callable[[], object]) -> None:
    """``save()`` the step ended when a checkpoint is due (every ``every`` steps, 0: never) or
    Ctrl-C asked the run to stop (``interrupt.deferred``); then stop it, naming what was saved."""
    if every and (step % every == 0 or interrupt.requested()):
        saved = save()
    if interrupt.requested():  # Ctrl-C during the step: it ended whole
        raise interrupt.Interrupted(f"stopped after step {step}" + (f", saved in {saved}" if every else
                                    " (no checkpoint: loop.checkpoint_every is 0)"))


def running_counts(rewards, now) -> dict[str, float]:
    """The metrics that count since the run began: the reward service's and the environment
    pool's counters, prompts skipped, engine restarts (``now``: the producer's snapshot)."""
    return {**{f"reward_{k}": v for k, v in rewards.stats().items()}, **now.prompts_skipped,
            **{f"env_{k}": v for k, v in now.env.items()}, "engine_restarts": now.restarts}


@contextlib.contextmanager
def stalled(what: str) -> Iterator[None]:
    """A wait of the loop that runs out: every role's stacks are dumped, the error says where each was."""
    try:
        yield
    except (BufferTimeout, TimeoutError) as e:
        raise RoleError(f"{what} ran out: {e}\nwhere each role was:\n{watchdog.dump_stacks(what)}") from None
