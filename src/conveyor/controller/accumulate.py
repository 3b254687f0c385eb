"""A step trained part by part as its groups are scored (``loop.accumulate_groups``).

Contract: ``accumulated_step(trainer, buffer, cfg, loss_fn, need, version, timeout_s, timer,
memory)`` takes the step's ``loop.batch_size`` groups from the buffer ``accumulate_groups`` at
a time, in the order they are scored, and hands each part to ``trainer.accumulate`` at once:
with one optimizer step per batch the weights cannot change before the step ends, so a
group's gradient is the same whenever it is computed, and the trainer computes it while the
engines still decode the step's long samples (on ``loop.accumulate_sms`` of the GPU's SMs when
set, leaving the rest to the decode steps). Once the last group is in, the engines have nothing
left to generate for this step: ``memory.release()`` (launch.time_share) frees the engine's KV
pool, so the last part trains with ``trainer.micro_batch_tokens`` instead of
``micro_batch_tokens_shared``, on every SM; then ``trainer.finish_and_publish(version)`` takes
the optimizer step over the whole batch and publishes. It returns the whole step's
``step_batch.StepBatch`` and what ``finish_and_publish`` returned, so the loop reports it as
any step; the step's stats are computed over all its groups.

The gradient is the whole batch's step's up to summation order (parts follow arrival, so a
run with accumulate_groups > 0 is not bit-reproducible from its seed; 0 is). In a streaming run
(``loop.max_staleness`` > 0) the parts are the groups the buffer holds, of whichever admitted step,
as a whole batch would take them; the step, and the publish that lets the producer admit more,
ends a part's training after the last group instead of a whole batch's. It knows nothing
of engines: ``memory`` is the loop's handle on their KV pools (``runtime.handles.EngineMemory``), or None.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.controller import objective
from conveyor.controller.step_batch import StepBatch, prepare
from conveyor.observe import timeline
from conveyor.runtime.handles import EngineMemory

if TYPE_CHECKING:  # pragma: no cover
    from conveyor.config import RunConfig
    from conveyor.observe.timers import PhaseTimer
    from conveyor.trainer.api import LossFn, TrainerSteps
    from conveyor.transport.buffer import TrajectoryBuffer


def accumulated_step(trainer: TrainerSteps, buffer: TrajectoryBuffer, cfg: RunConfig, loss_fn: LossFn,
                     need: objective.Needs, version: int, timeout_s: float, timer: PhaseTimer,
                     memory: EngineMemory | None):
    """One step over ``loop.batch_size`` groups taken as they are scored; see the module docstring."""
    k, total = cfg.loop.accumulate_groups, cfg.loop.batch_size
    shared = cfg.trainer.micro_batch_tokens_shared if memory is not None else None
    taken: list[tuple[int, object, dict]] = []  # per group: admission index, group, its samples' extras
    while len(taken) < total:
        with timer.phase("wait"):
            part_items = buffer.get(min(k, total - len(taken)), timeout=timeout_s)
        budget, sms = shared, cfg.loop.accumulate_sms or None
        if len(taken) + len(part_items) == total:  # this step's generation is over: the whole GPU trains
            sms = None
            if memory is not None:
                with timer.phase("release"):
                    memory.release()
                budget = None
        with timer.phase("prepare"):
            part = prepare(trainer, cfg.algo, part_items, need)
        with timer.phase("train"):
            trainer.accumulate(part.batch, loss_fn, budget, sms)
        row = 0
        for index, group in zip(part.indices, part.groups):
            n = len(group.trajectories)
            taken.append((index, group, {key: rows[row:row + n] for key, rows in part.extra.items()}))
            row += n
    with timer.phase("train"):
        trained = trainer.finish_and_publish(version)
    timeline.record_spans("trainer", trained.spans)
    taken.sort(key=lambda t: t[0])  # the step's groups in admission order, as one batch would hold them
    groups = [g for _, g, _ in taken]
    extra = {key: [r for _, _, e in taken for r in e[key]] for key in taken[0][2]}
    with timer.phase("prepare"):
        batch, stats = objective.make_batch(groups, cfg.algo, extra)
    return StepBatch(groups, tuple(i for i, _, _ in taken), batch, stats, extra), trained
